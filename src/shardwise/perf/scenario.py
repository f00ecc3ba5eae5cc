"""Inputs of the planner from command-line values: a validated ``Scenario`` for one plan,
a ``SweepRequest`` for a sweep, with one-line errors that name the flag.

Pure Python: the planning path (``shardwise plan``, ``sweep``, ``report``) never imports
torch, and neither does this module (``perf.estimate`` and ``perf.sweep`` are imported
when called).
"""

from __future__ import annotations

import math

from shardwise.errors import ShardwiseError

SEED = {"model": "kimi-k3", "box": "dgx-spark", "boxes": 16, "link": "100g-roce"}
"""The seed's case, ``shardwise plan``'s defaults: Kimi K3 on 16 DGX Spark boxes over 100 Gb RoCE."""

DEFAULT_MAX_BOXES = 64
"""Most boxes a sweep tries when neither --boxes nor --max-boxes is given."""
MAX_SWEEP_BOXES = 4096  # a box count, a range's end or --max-boxes beyond this is refused (1-1e8 ate GBs)
MAX_BATCH = 1_000_000  # sequences in one step: far beyond any box's memory, small enough to stay numeric
MAX_SPEC_TOKENS = 64  # draft tokens per verify step: past any runtime's use; 1e9 ran on as if it were fine
MAX_PRICE_USD = 1e9  # per box: above any machine sold, low enough that a cluster's cost stays finite


def check_number(flag: str, value: float | None, *, zero: bool = False, most: float | None = None) -> None:
    """One-line error unless ``value`` (None: the flag was not given) is a finite number > 0
    (>= 0 with ``zero``), at most ``most``: NaN, inf and negative money, watts or tok/s are refused."""
    if value is None:
        return
    if math.isfinite(value) and (value >= 0 if zero else value > 0) and (most is None or value <= most):
        return
    bound = ">= 0" if zero else "> 0"
    if most is not None:
        bound += f" and at most {most:,.0f}"
    raise ShardwiseError(f"--{flag} must be {bound} (a finite number), got {value:g}")


# --------------------------------------------------------------------------- one plan


def decode_inputs(kv_dtype: str, spec_tokens: int, acceptance: float | None, workload: str | None) -> tuple[float, float]:
    """(KV-cache bytes per element, draft acceptance) from the CLI flags, checked (one-line errors)."""
    from shardwise.perf.speculative import check_spec, resolve_acceptance

    kv_bytes = {"bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "fp32": 4.0}.get(kv_dtype)
    if kv_bytes is None:
        raise ShardwiseError(f"--kv-dtype '{kv_dtype}' is unknown: use bf16, fp16, fp8 or fp32")
    if spec_tokens < 0:
        raise ShardwiseError(f"--spec-tokens must be >= 0, got {spec_tokens}")
    if spec_tokens > MAX_SPEC_TOKENS:
        raise ShardwiseError(
            f"--spec-tokens must be at most {MAX_SPEC_TOKENS} draft tokens per step, got {spec_tokens}: "
            f"pass --spec-tokens {MAX_SPEC_TOKENS} or fewer")
    given = [flag for flag, value in (("--acceptance", acceptance), ("--workload", workload)) if value is not None]
    if len(given) == 2:
        raise ShardwiseError("--acceptance and --workload both given: pick one (a workload names an acceptance)")
    if given and not spec_tokens:
        raise ShardwiseError(f"{given[0]} has no effect without --spec-tokens k: add --spec-tokens or drop {given[0]}")
    acc = 0.0
    if spec_tokens:
        acc = resolve_acceptance(acceptance, workload)
        check_spec(spec_tokens, acc)
    return kv_bytes, acc


def build_scenario(
    model: str, box, boxes: int | None, link: str, tp: int | None, ep: int | None, pp: int | None,
    context: int, prompt_tokens: int, spec_tokens: int, acceptance: float | None, workload: str | None,
    runtime: str, quant: str | None, experts: str | None, dense: str | None, price: float | None,
    kv_dtype: str, cluster: str | None = None, draft_model: str | None = None, batch: int = 1,
):
    """Resolve CLI inputs into a validated Scenario (one-line errors on bad input). ``box`` is a
    catalog key or a ``Box`` (from ``--box-spec``)."""
    if not 1 <= batch <= MAX_BATCH:
        raise ShardwiseError(f"--batch must be a whole number of sequences in 1..{MAX_BATCH}, got {batch}")
    if prompt_tokens < 1:
        raise ShardwiseError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    check_number("price", price, zero=True, most=MAX_PRICE_USD)
    if quant and experts and dense:
        raise ShardwiseError(f"--quant {quant} has no effect with both --experts and --dense: drop --quant")
    from shardwise.perf.estimate import Scenario
    from shardwise.perf.profiles import get_profile
    from shardwise.plan import ParallelPlan, default_plan, validate_plan
    from shardwise.quant.formats import get_format
    from shardwise.spec.hardware import get_box, get_link, load_cluster_file
    from shardwise.spec.model import MATMUL_GROUPS, ROUTED_EXPERTS
    from shardwise.spec.parse import load_model

    spec = load_model(model)
    topology = None
    if cluster:
        cl = load_cluster_file(cluster)
        box_obj, link_obj, n, topology = cl.box, cl.link, cl.boxes, cl.topology
        if boxes is not None and boxes != n:
            raise ShardwiseError(f"--boxes {boxes} disagrees with cluster file '{cluster}' ({n} boxes): drop --boxes")
    else:
        box_obj, link_obj = (get_box(box) if isinstance(box, str) else box), get_link(link)  # a Box: --box-spec
        n = boxes if boxes is not None else SEED["boxes"]
    if not 1 <= n <= MAX_SWEEP_BOXES:
        raise ShardwiseError(f"--boxes must be a count in 1..{MAX_SWEEP_BOXES}, got {n}")
    if tp is None and ep is None and pp is None:
        plan = default_plan(spec, n)
    else:
        base = default_plan(spec, n)
        t = tp if tp is not None else (n // (pp or 1))
        p = pp if pp is not None else max(n // max(t, 1), 1)
        e = ep if ep is not None else (base.ep if t == base.tp else 1)
        plan = ParallelPlan(tp=t, ep=e, pp=p)
    validate_plan(spec, plan)
    if plan.world_size != n:
        raise ShardwiseError(
            f"--tp {plan.tp} x --pp {plan.pp} = {plan.world_size} ranks but --boxes is {n}: "
            f"use --boxes {plan.world_size} or --pp {max(n // plan.tp, 1)}"
        )
    formats = spec.group_formats()
    if quant:
        formats.update({g: quant for g in get_format(quant).groups})
    if experts:
        get_format(experts)
        formats[ROUTED_EXPERTS] = experts
    if dense:
        get_format(dense)
        formats.update({g: dense for g in MATMUL_GROUPS if g != ROUTED_EXPERTS})
    kv_bytes, acc = decode_inputs(kv_dtype, spec_tokens, acceptance, workload)
    draft = resolve_draft(draft_model, [spec], spec_tokens)
    if context < 1:
        raise ShardwiseError(f"--context must be >= 1 token, got {context}")
    if spec.max_position_embeddings and context > spec.max_position_embeddings:
        raise ShardwiseError(
            f"--context {context:,} exceeds {spec.name}'s {spec.max_position_embeddings:,} positions "
            f"(max_position_embeddings): use --context {spec.max_position_embeddings} or less"
        )
    if price is not None:
        unit_price, price_note = price, "--price"
    elif getattr(box_obj, "builder_price_usd", None):
        unit_price = box_obj.builder_price_usd
        price_note = f"what the seed's builder paid; list price ${box_obj.list_price_usd:,.0f} (--price to change)"
    else:
        unit_price = box_obj.list_price_usd
        price_note = ("list price, an estimate (see the catalog's source; --price to change)"
                      if box_obj.is_estimate("list_price_usd") else "list price (--price to change)")
    return Scenario(
        model=spec, box=box_obj, boxes=n, link=link_obj, plan=plan, formats=formats,
        profile=get_profile(runtime), context_tokens=context, prompt_tokens=prompt_tokens,
        spec_tokens=spec_tokens, acceptance=acc, price_usd=unit_price, price_note=price_note,
        kv_bytes=kv_bytes, topology=topology, draft=draft, batch=batch,
    )


def resolve_draft(name: str | None, targets: list, spec_tokens: int):
    """The ``--draft-model`` ModelSpec (or None), checked against every target (one-line errors)."""
    from shardwise.spec.parse import load_model

    if name is None:
        return None
    if not spec_tokens:
        raise ShardwiseError("--draft-model needs --spec-tokens k (tokens it drafts per verify step)")
    draft = load_model(name)
    for target in targets:
        if draft.vocab_size != target.vocab_size:
            raise ShardwiseError(
                f"--draft-model {draft.name} has a {draft.vocab_size:,}-token vocabulary but {target.name} has "
                f"{target.vocab_size:,}: a draft model must share the target's vocabulary"
            )
    return draft


# --------------------------------------------------------------------------- a sweep


def _names(value: str | None, what: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    if not names:
        raise ShardwiseError(f"--{what} is empty: pass one name or a comma-separated list")
    return names


def parse_counts(value: str | None, max_boxes: int | None) -> tuple[int, ...]:
    """Box counts from --boxes ('16', '4,8,16', '8-16') and --max-boxes, each in 1..MAX_SWEEP_BOXES
    (checked before a range is expanded)."""
    if max_boxes is not None and not 1 <= max_boxes <= MAX_SWEEP_BOXES:
        raise ShardwiseError(f"--max-boxes must be in 1..{MAX_SWEEP_BOXES}, got {max_boxes}")
    if value is None:
        return tuple(range(1, (max_boxes or DEFAULT_MAX_BOXES) + 1))
    counts: set[int] = set()
    for part in value.split(","):
        part = part.strip()
        try:
            lo, hi = (int(x) for x in part.split("-", 1)) if "-" in part else (int(part), int(part))
        except ValueError:
            raise ShardwiseError(f"--boxes '{value}' must be counts like 16, 4,8,16 or 8-16") from None
        if not 1 <= lo <= hi <= MAX_SWEEP_BOXES:
            within = "" if part == value.strip() else f" (in '{value}')"
            raise ShardwiseError(f"--boxes {part}{within} must be a count or a rising range within 1..{MAX_SWEEP_BOXES}")
        counts.update(range(lo, hi + 1))
    if max_boxes is not None:
        kept = {c for c in counts if c <= max_boxes}
        if not kept:
            raise ShardwiseError(f"--boxes {value} are all above --max-boxes {max_boxes}: raise --max-boxes or lower --boxes")
        counts = kept
    return tuple(sorted(counts))


def build_request(
    model: str | None = None, box: str | None = None, boxes: str | None = None, link: str | None = None,
    quant: str | None = None, experts: str | None = None, budget: float | None = None,
    max_watts: float | None = None, min_tok_per_s: float | None = None, context: int = 4096,
    max_boxes: int | None = None, runtime: str = "vllm", spec_tokens: int = 0, acceptance: float | None = None,
    workload: str | None = None, prefill: bool = False, prompt_tokens: int = 2048, list_prices: bool = False,
    kv_dtype: str = "bf16", draft_model: str | None = None, users: int = 1,
):
    """Resolve CLI inputs into a SweepRequest (one-line errors on bad input)."""
    if not 1 <= users <= MAX_BATCH:
        raise ShardwiseError(f"--users must be a whole number of sequences in 1..{MAX_BATCH}, got {users}")
    from shardwise.perf.sweep import SweepRequest
    from shardwise.perf.profiles import get_profile
    from shardwise.quant.formats import get_format
    from shardwise.spec.hardware import get_box, get_link, load_catalog
    from shardwise.spec.parse import catalog_models, load_model

    catalog = load_catalog()
    models = _names(model, "model") or tuple(catalog_models())
    specs = [load_model(m) for m in models]
    box_objs = tuple(get_box(b) for b in (_names(box, "box") or tuple(catalog.boxes)))
    link_objs = tuple(get_link(lk) for lk in (_names(link, "link") or tuple(catalog.links)))
    quants = _names(quant, "quant")
    for q in quants or ():
        if q != "native":
            get_format(q)
    expert_formats = _names(experts, "experts")
    for e in expert_formats or ():
        get_format(e)
    get_profile(runtime)
    for name, value in (("budget", budget), ("max-watts", max_watts), ("min-tok-per-s", min_tok_per_s)):
        check_number(name, value)
    if context < 1:
        raise ShardwiseError(f"--context must be >= 1 token, got {context}")
    if prompt_tokens < 1:
        raise ShardwiseError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    kv_bytes, acc = decode_inputs(kv_dtype, spec_tokens, acceptance, workload)
    draft = resolve_draft(draft_model, specs, spec_tokens)
    return SweepRequest(
        models=models, boxes=box_objs, counts=parse_counts(boxes, max_boxes), links=link_objs, quants=quants,
        experts=expert_formats, context_tokens=context, runtime=runtime, spec_tokens=spec_tokens, acceptance=acc,
        draft=draft,
        prefill=prefill, prompt_tokens=prompt_tokens, list_prices=list_prices, kv_bytes=kv_bytes,
        budget_usd=budget, max_watts=max_watts, min_tok_per_s=min_tok_per_s, users=users,
    )
