"""The Estimate: memory fit, decode and prefill speed, waterfall, bottleneck, power and cost.

``estimate(scenario)`` returns one JSON-ready dict (the document ``shardwise plan --json``
prints). Units are in the key names: ``*_bytes``, ``*_s``, ``tok_per_s``, ``watts``, ``usd``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardwise.errors import ShardwiseError
from shardwise.perf import core, grid
from shardwise.perf.decode import Hardware, StepCost, apply_profile, layout_table, step_cost, step_terms
from shardwise.perf.batching import batch_curve, batch_figures, crossover_batch
from shardwise.perf.imbalance import load_percentiles
from shardwise.perf.memory import memory_fit, total_weight_bytes
from shardwise.perf.profiles import RuntimeProfile, message_latency_s
from shardwise.perf.speculative import tokens_per_step
from shardwise.plan import ParallelPlan
from shardwise.quant import gguf_mix
from shardwise.quant.formats import get_format
from shardwise.spec.model import EMBEDDING, ModelSpec
from shardwise.spec.tensors import MATMUL_GROUPS, unpacked_key

GB = 1e9
ACTIVE_CONVENTION = (
    "active = weights one decoded token touches: all non-expert weights and top_k of the routed "
    "experts, LM head included, input embedding excluded (gpt-oss model-card convention)"
)


@dataclass(frozen=True)
class Scenario:
    """Everything a plan needs: model, hardware, layout and workload.

    box / link: catalog entries (see ``shardwise.spec.hardware``); price_usd is per box.
    formats: quantization format name per tensor group.
    batch: sequences decoded together; tok/s figures are per sequence unless named aggregate.
    draft: the speculative draft model, if one (None: a model-free drafter such as prompt
    lookup, which costs nothing per step); it runs whole on every box at its config's formats,
    ``spec_tokens`` decode steps per verify step, as the runtime runs it.
    """

    model: ModelSpec
    box: object
    boxes: int
    link: object
    plan: ParallelPlan
    formats: dict[str, str]
    profile: RuntimeProfile
    context_tokens: int = 4096
    prompt_tokens: int = 2048
    spec_tokens: int = 0
    acceptance: float = 0.0
    price_usd: float = 0.0
    price_note: str = ""
    kv_bytes: float = 2.0
    reserve_fraction: float = 0.10
    topology: object | None = None  # shardwise.topology.Topology of the cluster file, if any
    draft: ModelSpec | None = None
    batch: int = 1  # sequences decoded together (each with its own cache at context_tokens)
    notes: tuple[str, ...] = field(default=())


def hardware_of(box, link, profile: RuntimeProfile, ring_order_s=None) -> Hardware:
    """SI-unit view of a catalog box and link as ``profile``'s runtime sees it (per-message α
    from :func:`message_latency_s`; ``ring_order_s``: ring cost on a cable graph)."""
    return Hardware(
        mem_bandwidth_bytes_per_s=box.memory_bandwidth_gbps * GB,
        peak_flops=box.tflops_bf16 * 1e12,
        link_alpha_s=message_latency_s(link, profile),
        link_beta_bytes_per_s=link.bandwidth_gbps * GB,
        network=link.kind in ("tcp", "rdma"),
        ring_allreduce_s=ring_order_s,
    )


def ring_orders(sc: Scenario) -> dict | None:
    """Best, listed and worst ring orders on the cluster's cable graph for the decode message."""
    if sc.topology is None or sc.plan.tp < 2:
        return None
    from shardwise.perf.ring_order import best_ring_order, worst_ring_order

    topo = sc.topology
    msg = sc.model.hidden_size * 2
    best = best_ring_order(topo, msg)
    worst = worst_ring_order(topo, msg)
    return {
        "message_bytes": msg, "best_order": list(best.order), "best_s": best.allreduce_s, "best_exact": best.exact,
        "listed_order": list(topo.hosts), "listed_s": topo.ring_allreduce_time(topo.hosts, msg),
        "worst_order": list(worst.order), "worst_s": worst.allreduce_s,
        "rank_order": [topo.hosts.index(h) for h in best.order],
    }


def _hardware(sc: Scenario, rings: dict | None) -> Hardware:
    if rings is None:
        return hardware_of(sc.box, sc.link, sc.profile)
    order = tuple(rings["best_order"])
    # the runtime's own per-message cost rides on each of the ring's 2(p-1) steps
    extra = 2 * (len(order) - 1) * (message_latency_s(sc.link, sc.profile) - sc.link.latency_s)
    return hardware_of(sc.box, sc.link, sc.profile, lambda n: sc.topology.ring_allreduce_time(order, n) + extra)


def formats_bits(formats: dict[str, str], model: ModelSpec) -> dict[str, float]:
    """Bits per weight per tensor group of ``model`` at ``formats`` from the codec-backed format
    registry; for a group in a weights-only format (block formats, int8/int4) also the bits its
    biases and 1-D parameters keep (``unpacked_key``): the model's unquantized dtype, the embedding's
    format (no scheme quantizes the embedding). A GGUF file type (``gguf-*``) names every tensor's
    type at once, embedding and LM head included: llama.cpp's per-tensor choice (``quant.gguf_mix``)."""
    ftypes = {get_format(formats[g]).gguf_ftype for g in MATMUL_GROUPS}
    if ftypes != {None}:
        if len(ftypes) > 1:
            shown = ", ".join(f"{g} {formats[g]}" for g in MATMUL_GROUPS)
            raise ShardwiseError(f"a GGUF file type sets every tensor at once, got {shown}: give one gguf-* "
                                 "format for all weights (--quant), not per group")
        return gguf_mix.cached_group_bits(model, ftypes.pop())
    bits = {g: get_format(f).bits_per_weight for g, f in formats.items()}
    for g, f in formats.items():
        if get_format(f).weights_only:
            bits[unpacked_key(g)] = bits[EMBEDDING]
    return bits


def _tok(step: StepCost, tokens: float = 1.0) -> float:
    return tokens / step.total_s if step.total_s > 0 else float("inf")


def profile_kwargs(profile: RuntimeProfile) -> dict:
    """step_cost keyword arguments that apply a runtime profile's efficiency factors."""
    return dict(
        mem_efficiency=profile.mem_efficiency, compute_efficiency=profile.compute_efficiency,
        collective_overhead_s=profile.collective_overhead_s, step_overhead_s=profile.step_overhead_s,
        layer_overhead_s=profile.layer_overhead_s,
        allreduce=profile.allreduce,
    )


SINGLE_BOX = ParallelPlan(tp=1, ep=1, pp=1)


def draft_bytes(draft: ModelSpec | None, context_tokens: int, kv_bytes: float, batch: int = 1) -> float:
    """Bytes a draft model holds on every box: its weights at its config's formats and the
    caches of ``batch`` sequences at ``context_tokens`` (0 without a draft model)."""
    if draft is None:
        return 0.0
    bits = formats_bits(draft.group_formats(), draft)
    return total_weight_bytes(draft, bits) + batch * draft.cache_bytes(context_tokens, kv_bytes)


def draft_step_cost(draft: ModelSpec, mem_bandwidth_bytes_per_s: float, peak_flops: float, context_tokens: int,
                    kv_bytes: float, **kwargs) -> StepCost:
    """One decode step of ``draft`` whole on one box (tp = 1: no collectives); ``kwargs`` are
    step_cost's profile factors."""
    hw = Hardware(mem_bandwidth_bytes_per_s, peak_flops, link_alpha_s=0.0, link_beta_bytes_per_s=1.0, network=False)
    table = layout_table(draft, SINGLE_BOX, formats_bits(draft.group_formats(), draft), kv_bytes)
    return step_cost(draft, table, hw, context_tokens, 1, **kwargs)


def draft_step(sc: Scenario, hw: Hardware, **kwargs) -> StepCost | None:
    """The scenario's draft model's decode step on one of its boxes, or None without one."""
    if sc.draft is None:
        return None
    return draft_step_cost(sc.draft, hw.mem_bandwidth_bytes_per_s, hw.peak_flops, sc.context_tokens, sc.kv_bytes,
                           **kwargs)


def decode_speed(sc: Scenario, table=None, hw: Hardware | None = None, draft: StepCost | None = None,
                 **overrides) -> tuple[float, StepCost, StepCost, float]:
    """(tok/s per sequence, plain step, final step, tokens per final step and sequence) under the
    scenario's profile, with ``sc.batch`` sequences in every step.

    With speculation the final step is the verify pass; a draft model adds ``spec_tokens``
    of its own decode steps to every verify step.
    ``overrides`` replace profile factors (used by calibration); the one-layout ``table``
    (``decode.layout_table``), ``hw`` and the draft model's step (``draft_step``) can be precomputed.
    """
    hw = hw or _hardware(sc, ring_orders(sc))
    if table is None:
        table = layout_table(sc.model, sc.plan, formats_bits(sc.formats, sc.model), sc.kv_bytes)
    kwargs = {**profile_kwargs(sc.profile), **overrides, "batch": sc.batch}
    plain = step_cost(sc.model, table, hw, sc.context_tokens, 1, **kwargs)
    if not sc.spec_tokens:
        return _tok(plain), plain, plain, 1.0
    tokens = tokens_per_step(sc.spec_tokens, sc.acceptance)
    verify = step_cost(sc.model, table, hw, sc.context_tokens, sc.spec_tokens + 1, **kwargs)
    draft = draft or draft_step(sc, hw, **kwargs)
    drafting_s = sc.spec_tokens * draft.total_s if draft is not None else 0.0
    return tokens / (verify.total_s + drafting_s), plain, verify, tokens


def estimate(sc: Scenario, curve: bool = False) -> dict:
    """Memory, decode, prefill, waterfall, bottleneck, power and cost for one scenario (``curve``:
    also the concurrency curve, tok/s per sequence and in all for B = 1 … max_batch)."""
    m, plan, prof = sc.model, sc.plan, sc.profile
    bits = formats_bits(sc.formats, sc.model)
    rings = ring_orders(sc)
    hw = _hardware(sc, rings)
    table = layout_table(m, plan, bits, sc.kv_bytes)
    ctx = sc.context_tokens

    # ---- the seed's arithmetic and the byte-exact bandwidth ceilings ----------------------
    total_bytes = total_weight_bytes(m, bits)
    avg_bits = 8 * total_bytes / m.total_params
    naive_bytes = m.active_params * avg_bits / 8
    agg_bw = sc.boxes * hw.mem_bandwidth_bytes_per_s
    naive_tok = agg_bw / naive_bytes
    active_bytes = m.weight_bytes(bits, active=True)
    precision_tok = agg_bw / active_bytes
    stage_bw = plan.tp * hw.mem_bandwidth_bytes_per_s

    # The waterfall's steps: the same step's terms with one more effect switched on each time.
    busiest = step_terms(m, table, hw, ctx, 1, allreduce=prof.allreduce)
    spread = step_terms(m, table, hw, ctx, 1, allreduce=prof.allreduce, busiest_experts=False)
    eff = (prof.mem_efficiency, prof.compute_efficiency)
    even = apply_profile(spread, 1.0, 1.0, 0.0, 0.0, hw, include_compute=False, include_network=False)
    roof = apply_profile(busiest, 1.0, 1.0, 0.0, 0.0, hw, include_compute=False, include_network=False)
    effic = apply_profile(busiest, *eff, 0.0, 0.0, hw, include_network=False)
    net = apply_profile(busiest, *eff, 0.0, prof.collective_overhead_s, hw)
    draft = draft_step(sc, hw, **profile_kwargs(prof)) if sc.spec_tokens else None
    one = replace(sc, batch=1)  # the waterfall runs at batch 1; a "batch" step ends it at sc.batch
    tok_per_s, plain, final, tokens = decode_speed(one, table, hw, draft)

    steps = [
        {"step": "seed arithmetic", "tok_per_s": naive_tok,
         "cause": f"{m.active_params / 1e9:.1f} B active params x {avg_bits:.2f} bits avg = "
                  f"{naive_bytes / GB:.1f} GB per token over {sc.boxes} x {sc.box.memory_bandwidth_gbps:g} GB/s"},
        {"step": "per-group precision", "tok_per_s": precision_tok,
         "cause": f"each tensor group at its own format ({_formats_text(sc.formats, m)}): "
                  f"{active_bytes / GB:.1f} GB read per token"},
    ]
    if plan.pp > 1:
        steps.append({"step": "pipeline stages take turns", "tok_per_s": stage_bw / active_bytes,
                      "cause": f"at batch 1 only one of {plan.pp} stages ({plan.tp} boxes) reads at a time"})
    steps += [
        {"step": "per-rank reads", "tok_per_s": _tok(even),
         "cause": f"replicated weights (routers, norms, latent/MLA down-projections), LM head and the "
                  f"KV cache at {ctx} tokens on every rank: {even.bytes_busiest / GB:.2f} GB per rank per token"},
    ]
    if m.moe is not None and plan.ep > 1:
        steps.append({"step": "expert imbalance", "tok_per_s": _tok(roof),
                      "cause": f"busiest rank holds {roof.experts_busiest:.2f} of {m.moe.top_k} picked experts "
                               f"per layer (average {roof.experts_average:.2f})"})
    ceiling = _tok(roof)
    compute_bound = effic.compute_s > effic.memory_s
    steps.append({"step": f"{prof.name} kernel efficiency", "tok_per_s": _tok(effic),
                  "cause": f"{prof.mem_efficiency:.0%} of peak memory bandwidth"
                           + (f"; compute-bound layers at {prof.compute_efficiency:.0%} of peak FLOPS" if compute_bound else "")})
    if plan.world_size > 1:
        steps.append({"step": "collective latency", "tok_per_s": _tok(net),
                      "cause": f"{net.collectives_per_step} collectives per token over {sc.link.name}; one "
                               f"all-reduce ({net.allreduce_algorithm}) = {net.allreduce_s * 1e6:.0f} us on the wire"
                               + (f" (incl. {prof.tcp_message_overhead_s * 1e6:.0f} us per message for {prof.name}'s "
                                  f"socket path on TCP)" if sc.link.kind == "tcp" and prof.tcp_message_overhead_s else "")
                               + (f" + {prof.collective_overhead_s * 1e6:.0f} us software per call" if hw.network else "")})
    steps.append({"step": "host overhead", "tok_per_s": _tok(plain),
                  "cause": f"{plain.overhead_s * 1e3:.2f} ms per step: {prof.step_overhead_s * 1e3:.2f} ms (sampling, "
                           f"scheduling) + {prof.layer_overhead_s * 1e6:.0f} us per layer (kernel launches) "
                           f"x {m.launch_layers:g} layers" + (f" ({m.num_layers} single-mixer or MLP blocks, each half a "
                                                               f"layer's kernels)" if m.launch_layers != m.num_layers else "")})
    spec = None
    drafting_s = 0.0
    if sc.spec_tokens:
        drafting_s = sc.spec_tokens * draft.total_s if draft is not None else 0.0
        spec = {
            "spec_tokens": sc.spec_tokens, "acceptance": sc.acceptance, "tokens_per_step": tokens,
            "verify_step_s": final.total_s, "plain_step_s": plain.total_s,
            "verify_experts_busiest": final.experts_busiest, "speedup": tok_per_s / _tok(plain),
            "draft_model": sc.draft.name if sc.draft is not None else None,
            "draft_step_s": draft.total_s if draft is not None else 0.0, "drafting_s": drafting_s,
        }
        steps.append({"step": "speculative decoding", "tok_per_s": _tok(final, tokens),
                      "cause": f"{sc.spec_tokens} drafts at acceptance {sc.acceptance:g}: {tokens:.2f} tokens per "
                               f"verify step of {final.total_s * 1e3:.1f} ms (vs {plain.total_s * 1e3:.1f} ms)"
                               + (f"; verify reads {final.experts_busiest:.1f} experts on the busiest rank" if m.moe else "")})
        if draft is not None:
            steps.append({"step": "draft model", "tok_per_s": tok_per_s,
                          "cause": f"{sc.draft.name} drafts on every box: {sc.spec_tokens} x {draft.total_s * 1e3:.2f} ms "
                                   f"= {drafting_s * 1e3:.1f} ms per verify step"})
    batching = None
    if sc.batch > 1:
        single = tok_per_s
        draft = draft_step(sc, hw, **profile_kwargs(prof), batch=sc.batch) if sc.spec_tokens and sc.draft else None
        tok_per_s, _, final, _ = decode_speed(sc, table, hw, draft)
        drafting_s = sc.spec_tokens * draft.total_s if draft is not None else 0.0
        batching = batch_figures(sc, final, single, tok_per_s)
        steps.append({"step": "batch", "tok_per_s": tok_per_s, "cause": batching["cause"]})
    parts = {
        "memory bandwidth": final.memory_s if final.memory_s >= final.compute_s else 0.0,
        "compute": final.compute_s if final.compute_s > final.memory_s else 0.0,
        "network latency": final.collective_s,
        "host overhead": final.overhead_s,
        "drafting": drafting_s,
    }
    bottleneck = max(parts, key=parts.get)
    imbalance = None
    if m.moe is not None:
        imbalance = {
            "experts_per_token": m.moe.top_k, "ep": plan.ep,
            "expected_busiest": roof.experts_busiest, "average": roof.experts_average,
            **{f"monte_carlo_{k}": v for k, v in load_percentiles(m.moe.num_experts, m.moe.top_k, plan.ep, samples=2000).items()},
        }

    fit = memory_fit(m, plan, bits, ctx, sc.kv_bytes, sc.box.memory_gb * GB, sc.reserve_fraction,
                     draft_bytes(sc.draft, ctx, sc.kv_bytes, sc.batch), step_tokens=sc.spec_tokens + 1, batch=sc.batch)
    prefill = prefill_speed(sc, table, hw)
    aggregate = sc.batch * tok_per_s

    def speed_at(b: int) -> tuple[float, StepCost]:
        tok, _, step, _ = decode_speed(replace(sc, batch=b), table, hw)
        return tok, step

    crossover = crossover_batch(lambda b: speed_at(b)[1], fit.max_batch)
    power = _power(sc, aggregate)
    cost = _cost(sc, aggregate)
    return {
        "model": {
            "name": m.name, "model_type": m.model_type, "total_params": m.total_params,
            "active_params": m.active_params, "active_convention": ACTIVE_CONVENTION,
            "layers": m.num_layers, "experts": m.moe.num_experts if m.moe else 0,
            "experts_per_token": m.moe.top_k if m.moe else 0,
            "formats": dict(sc.formats), "avg_bits_per_weight": avg_bits,
            "cache_bytes_per_token": m.cache_bytes_per_token(sc.kv_bytes),
        },
        "cluster": {
            "box": sc.box.name, "box_key": sc.box.key, "boxes": sc.boxes, "link": sc.link.name, "link_key": sc.link.key,
            "tflops_bf16": sc.box.tflops_bf16, "switches": switches_needed(sc.link, sc.boxes),
            "memory_bandwidth_gbps": sc.box.memory_bandwidth_gbps, "link_bandwidth_gbps": sc.link.bandwidth_gbps,
            "link_latency_s": sc.link.latency_s,
        },
        "plan": {"tp": plan.tp, "ep": plan.ep, "pp": plan.pp, "layout": plan.describe(), "runtime": prof.name,
                 "ring": rings},
        "memory": {
            "box_bytes": fit.box_bytes, "weights_bytes": fit.weights_bytes, "kv_bytes": fit.kv_bytes,
            "workspace_bytes": fit.workspace_bytes, "reserve_bytes": fit.reserve_bytes,
            "draft_bytes": fit.replicated_bytes, "free_bytes": fit.free_bytes,
            "total_weight_bytes": fit.total_weight_bytes, "min_boxes_weights": fit.min_boxes_weights,
            "min_boxes": fit.min_boxes, "min_boxes_layout": fit.min_boxes_layout, "fits": fit.fits,
            "context_tokens": ctx, "batch": sc.batch, "max_batch": fit.max_batch,
            "layout_search_max_boxes": fit.layout_search_max,
        },
        "decode": {
            "naive_bytes_per_token": naive_bytes, "bytes_per_token": active_bytes,
            "busiest_rank_bytes_per_token": roof.bytes_busiest,
            "naive_ceiling_tok_per_s": naive_tok, "ceiling_tok_per_s": ceiling, "tok_per_s": tok_per_s,
            "batch": sc.batch, "aggregate_tok_per_s": aggregate, "batching": batching,
            "compute_bound_from_batch": crossover,
            "batch_curve": batch_curve(speed_at, fit.max_batch) if curve else None,
            "step_s": final.total_s, "memory_s": final.memory_s, "compute_s": final.compute_s,
            "collective_s": final.collective_s, "overhead_s": final.overhead_s,
            "allreduce_algorithm": final.allreduce_algorithm, "allreduce_s": final.allreduce_s,
            "collectives_per_step": final.collectives_per_step, "bottleneck": bottleneck,
            "waterfall": steps, "speculative": spec, "expert_imbalance": imbalance,
            "per_layer_s": list(final.per_layer_s),
        },
        "prefill": prefill,
        "power": power,
        "cost": cost,
        "notes": list(sc.notes),
    }


def _formats_text(formats: dict[str, str], m: ModelSpec) -> str:
    present = [g for g, n in m.params_by_group.items() if n]
    by_fmt: dict[str, list[str]] = {}
    for g in present:
        by_fmt.setdefault(formats[g], []).append(g)
    return "; ".join(f"{f}: {', '.join(gs)}" for f, gs in by_fmt.items())


def prefill_speed(sc: Scenario, table: core.LayoutTable, hw: Hardware) -> dict:
    """Prefill of ``prompt_tokens`` under the scenario's profile (``grid.evaluate_prefill``, row 0)."""
    prof = sc.profile
    out = grid.evaluate_prefill(sc.model, table, 0, hw, sc.prompt_tokens, profile=prof)
    return {
        "prompt_tokens": sc.prompt_tokens, "tok_per_s": float(out["tok_per_s"]), "compute_s": float(out["compute_s"]),
        "collective_s": float(out["collective_s"]),
        "bottleneck": grid.PREFILL_BOTTLENECKS[int(out["bottleneck"])],
    }


def switches_needed(link, boxes: int) -> int:
    """Switches a cluster of ``boxes`` needs on ``link``: none for 1-2 boxes (a direct cable),
    else enough of the link's switch for one port per box."""
    if boxes <= 2 or not getattr(link, "switch_ports", None):
        return 0
    return -(-boxes // link.switch_ports)


def _power(sc: Scenario, tok_per_s: float) -> dict:
    box, link = sc.box, sc.link
    switch_w = (link.switch_watts or 0.0) * switches_needed(link, sc.boxes)
    load = sc.boxes * box.load_watts + switch_w
    return {
        "rated_watts": sc.boxes * box.rated_watts, "load_watts": load,
        "idle_watts": sc.boxes * box.idle_watts + switch_w, "switch_watts": switch_w,
        "joules_per_token": load / tok_per_s,
    }


def _cost(sc: Scenario, tok_per_s: float) -> dict:
    switch = (sc.link.switch_price_usd or 0.0) * switches_needed(sc.link, sc.boxes)
    boxes_usd = sc.boxes * sc.price_usd
    return {
        "usd": boxes_usd, "price_per_box_usd": sc.price_usd, "price_note": sc.price_note,
        "switch_usd": switch, "total_usd": boxes_usd + switch, "usd_per_tok_per_s": (boxes_usd + switch) / tok_per_s,
    }
