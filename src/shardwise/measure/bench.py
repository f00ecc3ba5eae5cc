"""Predicted vs measured decode: the planner's Estimate next to a traced run of the runtime.

``shardwise bench`` runs a checkpoint with the runtime twice (once plain for the decode
speed, once with ``runtime.trace`` for per-layer compute / communication / wait times),
plans the same model and layout on the probed cluster with the ``shardwise`` profile
calibrated from the probe, and lines the two up term by term.

Calibration (``calibrated_profile``), every figure from the probe, none from the run:

- memory bandwidth and matmul TFLOPS are what the probe achieved (triad, matmul in the
  run's dtype), so the memory and compute efficiencies are 1;
- the per-collective software overhead is the probe's residual of the chosen algorithm
  over its α-β time at small sizes; α and β are the probe's ring fit;
- host overhead: an eager runtime pays a fixed host cost per dispatched aten op, which at
  batch 1 on small models is most of the step. ``count_step_ops`` counts the ops each
  layer and the rest of a decode step dispatch (one rank-0 shard, in a process of its
  own, nothing timed), and the probe's ``op_overhead_s`` (``op_overhead_moe_s`` for MoE
  layers) prices them: per layer in the
  per-layer prediction, summed into the profile's ``step_overhead_s`` for the total.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from shardwise.errors import ShardwiseError
from shardwise.perf.collectives import PLANNER_ALGORITHM

DTYPE_FORMAT = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16", "fp16": "fp16"}


@dataclass(frozen=True)
class OpCounts:
    """Aten ops one decode step dispatches on rank 0: per decoder layer, and the rest
    (embedding, final norm, LM head, sampling); means over the counted steps."""

    layers: tuple[float, ...]
    other: float

    @property
    def total(self) -> float:
        """Ops per decode step."""
        return sum(self.layers) + self.other


def count_rank_ops(rank: int, world: int, checkpoint: str, tp: int, ep: int, dtype: str,
                   prompt_ids: tuple[int, ...], steps: int = 4) -> dict[str, Any]:
    """Inside a one-process group: load rank 0's shard of a ``tp``-way plan and count the
    aten ops of ``steps`` greedy decode steps, per layer and in total (the plain decode path
    ``generate`` runs; collectives are no-ops on one rank)."""
    import torch

    from shardwise.plan import ParallelPlan
    from shardwise.runtime.host_costs import op_counter
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    torch.set_num_threads(1)
    spec = load_spec(checkpoint)
    model = ShardedCausalLM(spec, ParallelPlan(tp=tp, ep=ep), 0, dtype, max_seq_len=len(prompt_ids) + steps + 1)
    load_shard(model, checkpoint)
    counter = op_counter()
    starts: dict[int, int] = {}
    per_layer = [0] * len(model.model.layers)

    def start(index: int) -> None:
        starts[index] = counter.ops

    def end(index: int) -> None:
        per_layer[index] += counter.ops - starts[index]

    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=index: start(i))
        layer.register_forward_hook(lambda m, a, o, i=index: end(i))
    with torch.no_grad():
        token = int(model.lm_head.greedy(model(torch.tensor([list(prompt_ids)]), 0)[:, -1])[0])
        with counter:
            for pos in range(len(prompt_ids), len(prompt_ids) + steps):
                token = int(model.lm_head.greedy(model(torch.tensor([[token]]), pos)[:, -1])[0])
    layers = tuple(n / steps for n in per_layer)
    return {"layers": layers, "other": counter.ops / steps - sum(layers)}


def with_host_probe(probe: dict[str, Any], reports: list[dict[str, Any]], allreduce: str) -> dict[str, Any]:
    """``probe`` with its host-time figures replaced by those the run's own ranks measured on
    the probe's reference blocks interleaved with the measured runs (``RunRequest.host_probe``):
    the slowest rank's seconds per op and, with peers, the per-call all-reduce overhead inside a
    decode step over the probe's ring α-β at the reference message size."""
    from shardwise.measure.probe_fit import in_decode_overhead_s

    figures = [r["host_probe"] for r in reports]
    out = {**probe, "op_overhead_s": max(f["op_overhead_s"] for f in figures),
           "op_overhead_moe_s": max(f["op_overhead_moe_s"] for f in figures),
           "host_probe": "per-op and in-decode all-reduce costs timed in the run's ranks between the measured runs"}
    if all("collective_in_decode_s" in f for f in figures) and probe.get("ring_fit"):
        fit, p = probe["ring_fit"], len(figures)  # local ranks: one host
        overhead = in_decode_overhead_s(allreduce, max(f["collective_in_decode_s"] for f in figures), p, p,
                                        fit["alpha_s"], fit["beta_gbps"] * 1e9)
        out["collective_overhead_s"] = {**probe.get("collective_overhead_s", {}), allreduce: overhead}
    return out


def layer_host_seconds(probe: dict[str, Any], ops: OpCounts, moe_layers: tuple[bool, ...] = ()) -> list[float]:
    """Host seconds of each decoder layer's ops: MoE layers (``moe_layers[i]``) at the probe's
    MoE per-op cost (``op_overhead_moe_s``, the dense cost for probes that lack it), the rest
    at the dense one."""
    dense = probe["op_overhead_s"]
    moe = probe.get("op_overhead_moe_s", dense)
    kinds = moe_layers or (False,) * len(ops.layers)
    return [n * (moe if is_moe else dense) for n, is_moe in zip(ops.layers, kinds)]


def calibrated_profile(probe: dict[str, Any], allreduce: str, ops: OpCounts, moe_layers: tuple[bool, ...] = ()):
    """The ``shardwise`` runtime profile with every factor taken from a probe document
    (``moe_layers``: which decoder layers are MoE, priced at the MoE per-op cost)."""
    from shardwise.perf.profiles import get_profile

    base = get_profile("shardwise")
    host_s = sum(layer_host_seconds(probe, ops, moe_layers)) + ops.other * probe["op_overhead_s"]
    return replace(
        base,
        mem_efficiency=1.0,
        compute_efficiency=1.0,
        step_overhead_s=host_s,
        collective_overhead_s=float(probe.get("collective_overhead_s", {}).get(allreduce, 0.0)),
        allreduce=(PLANNER_ALGORITHM[allreduce],),
        source=f"calibrated from shardwise probe: {ops.total:.0f} ops/step, {host_s * 1e3:.2f} ms host time",
    )


def probe_cluster(probe: dict[str, Any], dtype: str):
    """(box, link) from a probe document, the box's peak TFLOPS set to the run dtype's."""
    import msgspec

    from shardwise.spec.hardware import Measured, apply_measured, get_box, get_link

    table = probe["cluster"]["cluster"]
    measured = msgspec.convert(table["measured"], Measured) if "measured" in table else None
    box, link = apply_measured(get_box(table["box"]), get_link(table["link"]), measured)
    fmt = DTYPE_FORMAT[dtype]
    if fmt in probe.get("tflops", {}):
        sources = {**box.sources, "tflops_bf16": f"measured: shardwise probe {fmt} matmul (the run's dtype)"}
        box = msgspec.structs.replace(box, tflops_bf16=probe["tflops"][fmt], sources=sources)
    return box, link


def predict(spec, tp: int, ep: int, dtype: str, context_tokens: int, probe: dict[str, Any], allreduce: str,
            ops: OpCounts) -> dict[str, Any]:
    """Planner prediction for the run: tok/s, step terms and per-layer compute / comm (s)."""
    from shardwise.perf.estimate import Scenario, decode_speed
    from shardwise.plan import ParallelPlan

    if len(ops.layers) != spec.num_layers:
        raise ShardwiseError(f"op counts cover {len(ops.layers)} layers but the model has {spec.num_layers}")
    box, link = probe_cluster(probe, dtype)
    fmt = DTYPE_FORMAT[dtype]
    moe_layers = tuple(layer.mlp == "moe" for layer in spec.layers)
    profile = calibrated_profile(probe, allreduce, ops, moe_layers)
    host = layer_host_seconds(probe, ops, moe_layers)
    elem = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0}[fmt]
    sc = Scenario(
        model=spec, box=box, boxes=tp, link=link, plan=ParallelPlan(tp=tp, ep=ep),
        formats=spec.run_formats(fmt), profile=profile, context_tokens=context_tokens,
        kv_bytes=elem,
    )
    tok_per_s, plain, _, _ = decode_speed(sc)
    per_call = profile.collective_overhead_s if link.kind in ("tcp", "rdma") else 0.0
    comm = 2 * (plain.allreduce_s + per_call) if tp > 1 else 0.0
    layers = [
        {"layer": i, "predicted_compute_s": plain.per_layer_s[i] + host[i],
         "predicted_comm_s": comm}
        for i in range(spec.num_layers)
    ]
    return {
        "tok_per_s": tok_per_s, "step_s": plain.total_s, "layers_s": plain.layers_s,
        "collective_s": plain.collective_s, "overhead_s": plain.overhead_s,
        "allreduce_algorithm": allreduce, "allreduce_model": plain.allreduce_algorithm,
        "allreduce_s": plain.allreduce_s, "collective_overhead_s": per_call,
        "ops_per_step": ops.total, "op_overhead_s": probe["op_overhead_s"],
        "op_overhead_moe_s": probe.get("op_overhead_moe_s", probe["op_overhead_s"]),
        "memory_bandwidth_gbps": box.memory_bandwidth_gbps, "tflops": box.tflops_bf16,
        "link_alpha_s": link.latency_s, "link_beta_gbps": link.bandwidth_gbps,
        "profile": {"mem_efficiency": profile.mem_efficiency, "compute_efficiency": profile.compute_efficiency,
                    "step_overhead_s": profile.step_overhead_s, "collective_overhead_s": profile.collective_overhead_s,
                    "source": profile.source},
        "layers": layers,
    }


def relative_error(predicted: float, measured: float) -> float | None:
    """(predicted − measured) / measured, None when nothing was measured."""
    return (predicted - measured) / measured if measured > 0 else None


def bench_document(model: str, tp: int, ep: int, allreduce: str, measured_tok_per_s: float,
                   summary: dict[str, Any], prediction: dict[str, Any]) -> dict[str, Any]:
    """The bench JSON: the trace summary's per-layer rows with the predicted terms and the
    error of each, plus predicted vs measured decode tok/s. The predicted all-reduce cost is
    the probe's cost *inside a decode step*, the wait for the last rank included, so the
    ``comm`` term is held against the measured communication plus waiting (``comm_wait_s``)."""
    by_layer = {row["layer"]: row for row in prediction["layers"]}
    layers = []
    for row in summary["layers"]:
        pred = by_layer[row["layer"]]
        comm_wait = row["comm_s"] + row["wait_s"]
        layers.append({
            **row, "comm_wait_s": comm_wait,
            "predicted_compute_s": pred["predicted_compute_s"], "predicted_comm_s": pred["predicted_comm_s"],
            "compute_error": relative_error(pred["predicted_compute_s"], row["compute_s"]),
            "comm_error": relative_error(pred["predicted_comm_s"], comm_wait) if tp > 1 else None,
        })
    totals = {}
    for term, measured_key in (("compute", "compute_s"), ("comm", "comm_wait_s")):
        for rank in sorted({row["rank"] for row in layers}):
            rows = [row for row in layers if row["rank"] == rank]
            measured = sum(row[measured_key] for row in rows)
            predicted = sum(row[f"predicted_{term}_s"] for row in rows)
            totals.setdefault(term, []).append({"rank": rank, "measured_s": measured, "predicted_s": predicted,
                                                "error": relative_error(predicted, measured)})
    return {
        "kind": "bench",
        "model": model,
        "tp": tp,
        "ep": ep,
        "allreduce": allreduce,
        "predicted_tok_per_s": prediction["tok_per_s"],
        "measured_tok_per_s": measured_tok_per_s,
        "error": relative_error(prediction["tok_per_s"], measured_tok_per_s),
        "traced_tok_per_s": summary["measured_tok_per_s"],
        "decode_steps": summary["decode_steps"],
        "layers": layers,
        "totals": totals,
        "ranks": summary["ranks"],
        "prediction": {k: v for k, v in prediction.items() if k != "layers"},
    }


def predicted_trace_events(prediction: dict[str, Any], start_us: float, pid: int) -> list[dict[str, Any]]:
    """Chrome-trace events of one predicted decode step (compute and comm per layer, then the
    rest of the step), laid from ``start_us`` on a process of its own."""
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "predicted (planner)"}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 1, "args": {"name": "compute"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 3, "args": {"name": "collective"}},
    ]
    t = start_us
    for row in prediction["layers"]:
        for name, tid, seconds in (("compute", 1, row["predicted_compute_s"]), ("comm", 3, row["predicted_comm_s"])):
            if seconds > 0:
                events.append({"name": f"L{row['layer']} {name}", "cat": f"predicted {name}", "ph": "X", "pid": pid,
                               "tid": tid, "ts": round(t, 3), "dur": round(seconds * 1e6, 3), "args": {"layer": row["layer"]}})
                t += seconds * 1e6
    rest = prediction["step_s"] * 1e6 - (t - start_us)
    if rest > 0:
        events.append({"name": "embed + head + overhead", "cat": "predicted compute", "ph": "X", "pid": pid, "tid": 1,
                       "ts": round(t, 3), "dur": round(rest, 3), "args": {}})
    return events
