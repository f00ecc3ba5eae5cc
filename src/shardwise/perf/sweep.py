"""The sweep: enumerate models × boxes × counts × links × layouts × quantizations, keep what fits
and meets the constraints, and return the Pareto front of decode tok/s vs cost vs power.

Each (model, quantization) is one numpy evaluation over a grid of layouts × boxes × links
(``perf.sweep``); nothing loops per configuration.

Rules the sweep applies (each one a modelling choice, stated here so rows can be read):

- **Links a box can use** (``link_capacity``): NVLink only between GPUs of the same NVLink
  generation, at most 8 (one HGX board); PCIe only between GPU cards of that PCIe generation or
  newer, at most 8 in one host; Thunderbolt 5 only between boxes with Thunderbolt 5 ports,
  cabled as a full mesh (at most ports + 1 boxes); Ethernet only when the link's effective
  speed fits the box's fastest Ethernet port (the "NGbE" ports its ``nic`` names, its
  ConnectX/RoCE NIC at ``nic_gbit_s``, else ``nic_gbit_s``), RDMA over Ethernet only on a
  ConnectX/RoCE NIC. One box
  uses no link (``link = "none"``).
- **Switches**: two boxes are cabled directly; more need ``ceil(boxes / switch_ports)``
  switches of the link's kind (uplinks between switches not counted).
- **Price**: per box, what the seed's builder paid where the catalog has it (as ``shardwise
  plan`` does), else the list price; ``list_prices=True`` uses list prices throughout.
  ``usd`` = boxes + switches. **Power**: ``watts`` = boxes × loaded watts + switches' watts.
- **Quantization**: by default each model runs at its checkpoint's formats (``native``) and at
  ``fp8`` and ``mxfp4``, applied to the matmul weights, never *raising* a group above its
  checkpoint precision. Precision is then a fourth objective (``bits_per_weight``, higher is
  closer to the checkpoint) so a lower-bit variant does not hide the native one.
- **Pareto front**: per model (a small model on the same boxes always beats a large one; the
  front compares ways to run *one* model). Objectives: tok/s up, usd down, watts down,
  bits_per_weight up (when variants differ), prefill tok/s up (when asked).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np

from shardwise.errors import ShardwiseError
from shardwise.perf import core, grid
from shardwise.perf.configurations import (
    NO_LINK,
    QuantVariant,
    box_price,
    enumerate_layouts,
    link_capacity,
    quant_variants,
    switches_needed,
)
from shardwise.perf.estimate import draft_bytes, draft_step_cost, formats_bits, profile_kwargs
from shardwise.perf.pareto import front_indices
from shardwise.perf.profiles import get_profile, message_latency_s
from shardwise.plan import ParallelPlan, is_valid_plan
from shardwise.spec.hardware import Box, Link
from shardwise.spec.model import ModelSpec

GB = 1e9


# ---- request and result ------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepRequest:
    """What to enumerate and which constraints to apply (None: unconstrained)."""

    models: tuple[str, ...]
    boxes: tuple[Box, ...]
    counts: tuple[int, ...]
    links: tuple[Link, ...]
    quants: tuple[str, ...] | None = None
    experts: tuple[str, ...] | None = None
    context_tokens: int = 4096
    runtime: str = "vllm"
    spec_tokens: int = 0
    acceptance: float = 0.0
    draft: ModelSpec | None = None  # speculative draft model run on every box (None: a free drafter)
    prefill: bool = False
    prompt_tokens: int = 2048
    list_prices: bool = False
    kv_bytes: float = 2.0
    reserve_fraction: float = 0.10
    budget_usd: float | None = None
    max_watts: float | None = None
    min_tok_per_s: float | None = None  # per sequence
    users: int = 1  # sequences decoded together on every configuration (their caches must fit)


@dataclass
class _Nearest:
    """Running best configuration under a violation score."""

    score: float = math.inf
    row: dict | None = None


@dataclass
class SweepResult:
    """The front (rows, best first) and the counts behind it."""

    rows: list[dict]
    configurations: int  # enumerated: model × quant × layout × box × link combinations that can be cabled
    fitting: int  # of those, fit in memory at the context
    feasible: int  # of those, meet every constraint
    elapsed_s: float
    notes: list[str] = field(default_factory=list)  # models with nothing on their front
    ranking: list[dict] = field(default_factory=list)  # best row per model, by tok/s


# Constraint names, in the order violations are reported.
_CONSTRAINTS = ("memory", "budget", "watts", "tok_per_s")


def _constraint_text(req: SweepRequest, name: str) -> str:
    return {
        "memory": f"memory (fit {req.users} x --context {req.context_tokens} on at most {max(req.counts)} boxes)",
        "budget": f"--budget {req.budget_usd:,.0f}" if req.budget_usd is not None else "",
        "watts": f"--max-watts {req.max_watts:,.0f}" if req.max_watts is not None else "",
        "tok_per_s": f"--min-tok-per-s {req.min_tok_per_s:g}" if req.min_tok_per_s is not None else "",
    }[name]


class _Model:
    """Everything swept for one model, accumulated over its quantization variants."""

    def __init__(self, name: str):
        self.name = name
        self.cols: dict[str, list[np.ndarray]] = {}

    def add(self, **cols: np.ndarray) -> None:
        for k, v in cols.items():
            self.cols.setdefault(k, []).append(v)

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.concatenate(v) for k, v in self.cols.items()} if self.cols else {}


def draft_terms(req: SweepRequest, boxes: tuple[Box, ...]) -> tuple[np.ndarray, float]:
    """Seconds of drafting per verify step on each box (``spec_tokens`` decode steps of the draft
    model, whole on the box) and the bytes the draft holds on every box; zeros without a draft."""
    if req.draft is None:
        return np.zeros(len(boxes)), 0.0
    kwargs = profile_kwargs(get_profile(req.runtime))
    per_box = [
        req.spec_tokens * draft_step_cost(req.draft, b.memory_bandwidth_gbps * GB, b.tflops_bf16 * 1e12,
                                          req.context_tokens, req.kv_bytes, **kwargs, batch=req.users).total_s
        for b in boxes
    ]
    return np.array(per_box), draft_bytes(req.draft, req.context_tokens, req.kv_bytes, req.users)


def run_sweep(req: SweepRequest, progress=None) -> SweepResult:
    """Evaluate every configuration of ``req``; ``progress(advance, total)`` is called per step."""
    from shardwise.spec.parse import load_model

    t0 = time.perf_counter()
    if not req.models or not req.boxes or not req.counts or (not req.links and max(req.counts) > 1):
        raise ShardwiseError("nothing to sweep: give at least one model, box, box count and link")
    prof = get_profile(req.runtime)
    boxes, links = req.boxes, (None, *req.links)
    prices = np.array([box_price(b, req.list_prices)[0] for b in boxes])
    mem = np.array([b.memory_gb * GB for b in boxes])[None, :, None]
    drafting, replicated = draft_terms(req, boxes)
    drafting = drafting[None, :, None]
    grid_hw = core.Hardware(  # boxes on the second axis, links (none first) on the third
        mem_bandwidth_bytes_per_s=np.array([b.memory_bandwidth_gbps * GB for b in boxes])[None, :, None],
        peak_flops=np.array([b.tflops_bf16 * 1e12 for b in boxes])[None, :, None],
        link_alpha_s=np.array([0.0] + [message_latency_s(lk, prof) for lk in req.links])[None, None, :],
        link_beta_bytes_per_s=np.array([1.0] + [lk.bandwidth_gbps * GB for lk in req.links])[None, None, :],
        network=np.array([False] + [lk.kind in ("tcp", "rdma") for lk in req.links])[None, None, :],
    )
    capacity = np.array([[1] + [link_capacity(b, lk) for lk in req.links] for b in boxes])  # (B, K)
    sw_price = np.array([0.0] + [lk.switch_price_usd or 0.0 for lk in req.links])
    sw_watts = np.array([0.0] + [lk.switch_watts or 0.0 for lk in req.links])
    load_w = np.array([b.load_watts for b in boxes])
    rated_w = np.array([b.rated_watts for b in boxes])

    specs = [(name, load_model(name)) for name in req.models]
    work = [(name, spec, quant_variants(spec, req.quants, req.experts)) for name, spec in specs]
    total_steps = sum(len(v) for _, _, v in work)
    if progress:
        progress(0, total_steps)
    totals = dict(configurations=0, fitting=0, feasible=0)
    nearest = {c: _Nearest() for c in _CONSTRAINTS}
    overall = _Nearest()
    models: list[_Model] = []
    layouts: dict[str, list[ParallelPlan]] = {}
    variants: dict[str, list[QuantVariant]] = {}
    for name, spec, quants in work:
        plans = enumerate_layouts(spec, req.counts, formats={})  # structure only; formats per variant below
        layouts[name], variants[name] = plans, quants
        acc = _Model(name)
        models.append(acc)
        if not plans:
            if progress:
                progress(len(quants), total_steps)
            continue
        counts = core.count_layouts(spec, plans, req.kv_bytes)
        n = (counts.tp * counts.pp)[:, None, None]
        cap = capacity[None, :, :]
        link_ok = np.where(n == 1, np.arange(len(links))[None, None, :] == 0, np.arange(len(links))[None, None, :] > 0)
        buildable = link_ok & (n <= cap)  # (P, B, K)
        switches = np.stack([switches_needed(n[:, 0, 0], lk) for lk in links], axis=-1)[:, None, :]
        usd = n * prices[None, :, None] + switches * sw_price[None, None, :]
        watts = n * load_w[None, :, None] + switches * sw_watts[None, None, :]
        layout_idx = np.arange(len(plans))[:, None, None]
        for qi, variant in enumerate(quants):
            table = core.build_layout_table(spec, counts, formats_bits(variant.format_map, spec), req.kv_bytes)
            # the one validity check at this variant's formats (packed expert blocks must not be cut)
            valid = np.array([is_valid_plan(spec, p, variant.format_map) for p in plans])[:, None, None]
            out = grid.evaluate(
                spec, table, layout_idx, grid_hw, mem, req.context_tokens, profile=prof,
                reserve_fraction=req.reserve_fraction, spec_tokens=req.spec_tokens, batch=req.users,
                acceptance=req.acceptance, drafting_s=drafting, replicated_bytes=replicated,
            )
            shape = buildable.shape
            tok = np.broadcast_to(out["tok_per_s"], shape)
            fits = np.broadcast_to(out["fits"], shape)
            viol = {
                "memory": np.broadcast_to(np.maximum(0.0, out["used_bytes"] / mem - 1.0), shape),
                "budget": np.maximum(0.0, usd / req.budget_usd - 1.0) if req.budget_usd is not None else np.zeros(shape),
                "watts": np.maximum(0.0, watts / req.max_watts - 1.0) if req.max_watts is not None else np.zeros(shape),
                "tok_per_s": np.maximum(0.0, req.min_tok_per_s / tok - 1.0) if req.min_tok_per_s is not None else np.zeros(shape),
            }
            viol = {k: np.broadcast_to(v, shape) for k, v in viol.items()}
            ok = buildable & valid & fits
            for c in ("budget", "watts", "tok_per_s"):
                ok = ok & (viol[c] == 0.0)
            totals["configurations"] += int((buildable & valid).sum())
            totals["fitting"] += int((buildable & valid & fits).sum())
            totals["feasible"] += int(ok.sum())
            figures = dict(usd=usd, watts=watts, tok=tok, out=out, shape=shape)
            if not totals["feasible"]:  # only needed to explain an empty result
                _track_nearest(req, name, variant, plans, boxes, links, buildable & valid, viol, nearest, overall, figures)
            p_i, b_i, k_i = np.nonzero(ok)
            if not len(p_i):
                if progress:
                    progress(1, total_steps)
                continue
            cols = dict(
                quant=np.full(len(p_i), qi), layout=p_i, box=b_i, link=k_i, n=n[p_i, 0, 0],
                tok=tok[p_i, b_i, k_i], usd=np.broadcast_to(usd, shape)[p_i, b_i, k_i],
                watts=np.broadcast_to(watts, shape)[p_i, b_i, k_i], bits=np.full(len(p_i), table.bits_per_weight),
                bottleneck=np.broadcast_to(out["bottleneck"], shape)[p_i, b_i, k_i],
                step_s=np.broadcast_to(out["step_s"], shape)[p_i, b_i, k_i],
                collective_s=np.broadcast_to(out["collective_s"], shape)[p_i, b_i, k_i],
                free_bytes=np.broadcast_to(out["free_bytes"], shape)[p_i, b_i, k_i],
            )
            if req.prefill:
                pf = grid.evaluate_prefill(spec, table, layout_idx, grid_hw, req.prompt_tokens, profile=prof)
                cols["prefill"] = np.broadcast_to(pf["tok_per_s"], shape)[p_i, b_i, k_i]
                cols["prefill_bottleneck"] = np.broadcast_to(pf["bottleneck"], shape)[p_i, b_i, k_i]
            acc.add(**cols)
            if progress:
                progress(1, total_steps)

    ctx = _RowContext(req, boxes, links, prices, load_w, rated_w, layouts, variants)
    rows: list[dict] = []
    ranking: list[dict] = []
    notes = []
    for acc in models:
        cols = acc.arrays()
        if not cols:
            notes.append(f"{acc.name}: no configuration fits and meets the constraints")
            continue
        keep = front_indices(cols, prefill=req.prefill)
        model_rows = [ctx.row(acc.name, {k: v[i] for k, v in cols.items()}) for i in keep]
        rows.extend(model_rows)
        ranking.append(model_rows[0])
    rows.sort(key=_row_order)
    ranking.sort(key=_row_order)
    elapsed = time.perf_counter() - t0
    result = SweepResult(rows=rows, ranking=ranking, elapsed_s=elapsed, notes=notes, **totals)
    if not rows:
        raise ShardwiseError(_nothing_message(req, nearest, overall, totals))
    return result


def _row_order(row: dict) -> tuple:
    return (-row["tok_per_s"], row["usd"], row["watts"], -row["bits_per_weight"], row["model"], row["box"],
            row["boxes"], row["link"], row["tp"], row["ep"], row["pp"], row["quant"])


@dataclass
class _RowContext:
    req: SweepRequest
    boxes: tuple[Box, ...]
    links: tuple[Link | None, ...]
    prices: np.ndarray
    load_w: np.ndarray
    rated_w: np.ndarray
    layouts: dict[str, list[ParallelPlan]]
    variants: dict[str, list[QuantVariant]]

    def row(self, model: str, v: dict) -> dict:
        plan = self.layouts[model][int(v["layout"])]
        box = self.boxes[int(v["box"])]
        link = self.links[int(v["link"])]
        variant = self.variants[model][int(v["quant"])]
        n = plan.world_size
        switches = int(switches_needed(n, link))
        tok = float(v["tok"])
        usd, watts = float(v["usd"]), float(v["watts"])
        row = {
            "model": model, "box": box.key, "box_name": box.name, "boxes": n,
            "link": link.key if link else NO_LINK, "link_name": link.name if link else "one box, no link",
            "tp": plan.tp, "ep": plan.ep, "pp": plan.pp, "layout": plan.describe(),
            "quant": variant.label, "bits_per_weight": float(v["bits"]),
            "tok_per_s": tok, "users": self.req.users, "aggregate_tok_per_s": self.req.users * tok,
        }
        if "prefill" in v:
            row["prefill_tok_per_s"] = float(v["prefill"])
            row["prefill_bottleneck"] = grid.PREFILL_BOTTLENECKS[int(v["prefill_bottleneck"])]
        row.update({
            "usd": usd, "watts": watts, "rated_watts": n * float(self.rated_w[int(v["box"])]),
            "switches": switches, "price_per_box_usd": float(self.prices[int(v["box"])]),
            "price_basis": box_price(box, self.req.list_prices)[1],
            "joules_per_token": watts / (self.req.users * tok), "usd_per_tok_per_s": usd / (self.req.users * tok),
            "bottleneck": grid.BOTTLENECKS[int(v["bottleneck"])], "step_s": float(v["step_s"]),
            "collective_s": float(v["collective_s"]), "free_bytes": float(v["free_bytes"]),
            "context_tokens": self.req.context_tokens, "runtime": self.req.runtime,
            "spec_tokens": self.req.spec_tokens, "formats": variant.format_map,
        })
        if self.req.draft is not None:
            row["draft_model"] = self.req.draft.name
        return row


def _track_nearest(req, name, variant, plans, boxes, links, buildable, viol, nearest, overall, figures) -> None:
    """Keep, per constraint, the configuration that meets every other one and misses this one
    least; and overall the one with the smallest summed violation."""
    total = sum(viol.values())
    for c in _CONSTRAINTS:
        others = buildable.copy()
        for o in _CONSTRAINTS:
            if o != c:
                others &= viol[o] == 0.0
        if not others.any():
            continue
        score = np.where(others, viol[c], np.inf)
        i = np.unravel_index(int(np.argmin(score)), score.shape)
        if score[i] > 0 and score[i] < nearest[c].score:
            nearest[c].score = float(score[i])
            nearest[c].row = _brief(req, name, variant, plans, boxes, links, i, figures, viol)
    score = np.where(buildable, total, np.inf)
    i = np.unravel_index(int(np.argmin(score)), score.shape)
    if np.isfinite(score[i]) and score[i] < overall.score:
        overall.score = float(score[i])
        overall.row = _brief(req, name, variant, plans, boxes, links, i, figures, viol)


def _brief(req, name, variant, plans, boxes, links, i, figures, viol) -> dict:
    p, b, k = (int(x) for x in i)
    plan, link = plans[p], links[k]
    shape = figures["shape"]
    return {
        "text": f"{name} ({variant.label}) on {plan.world_size} x {boxes[b].key}"
                f"{' over ' + link.key if link else ''}, {plan.describe()}",
        "tok_per_s": float(figures["tok"][p, b, k]), "usd": float(np.broadcast_to(figures["usd"], shape)[p, b, k]),
        "watts": float(np.broadcast_to(figures["watts"], shape)[p, b, k]),
        "free_bytes": float(np.broadcast_to(figures["out"]["free_bytes"], shape)[p, b, k]),
        "violated": [c for c in _CONSTRAINTS if viol[c][p, b, k] > 0],
    }


def _describe(req: SweepRequest, row: dict) -> str:
    misses = []
    for c in row["violated"]:
        if c == "memory":
            misses.append(f"{-row['free_bytes'] / GB:,.1f} GB short of memory")
        elif c == "budget":
            misses.append(f"${row['usd'] - req.budget_usd:,.0f} over --budget")
        elif c == "watts":
            misses.append(f"{row['watts'] - req.max_watts:,.0f} W over --max-watts")
        else:
            misses.append(f"{req.min_tok_per_s - row['tok_per_s']:,.2f} tok/s under --min-tok-per-s")
    return (f"{row['text']}: {row['tok_per_s']:,.2f} tok/s, ${row['usd']:,.0f}, {row['watts']:,.0f} W"
            + (f" ({'; '.join(misses)})" if misses else ""))


def _nothing_message(req: SweepRequest, nearest: dict, overall: _Nearest, totals: dict) -> str:
    if totals["configurations"] == 0:
        return ("no configuration can be built: no box in the sweep can use any link in it for more than one box, "
                "or no layout divides the box counts; widen --box / --link / --boxes")
    alone = [(v.score, c, v.row) for c, v in nearest.items() if v.row is not None]
    if alone:
        score, c, row = min(alone, key=lambda t: t[0])
        return f"no configuration meets every constraint: {_constraint_text(req, c)} binds; nearest: {_describe(req, row)}"
    names = ", ".join(_constraint_text(req, c) for c in overall.row["violated"]) if overall.row else "the constraints"
    return f"no configuration meets {names} together; nearest: {_describe(req, overall.row)}"

