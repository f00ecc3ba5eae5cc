"""One rank of a ``shardwise run``: build the shard, load it, generate, report.

``run_rank(rank, world_size, request)`` is what ``launch_local`` starts in each local
process (and what a torchrun-started process calls after ``init_from_env``).

Testing hook: ``SHARDWISE_TEST_SLOW_RANK=RANK:SECONDS`` in the environment makes rank
RANK sleep SECONDS inside every layer's attention compute (before its all-reduce), so
tests can show the other ranks' wait time growing in a trace and a straggling rank
being named. It is read once per run; unset, nothing is added to the model.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan, local_experts, rank_param_counts
from shardwise.runtime import int_matmul

if TYPE_CHECKING:
    from shardwise.runtime.speculative import SpecParams

SLOW_RANK_ENV = "SHARDWISE_TEST_SLOW_RANK"


@dataclass(frozen=True)
class RunRequest:
    """Everything a rank needs; picklable so it crosses to the rank processes."""

    checkpoint: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    tp: int = 1
    ep: int = 1
    dtype: str = "float32"
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    allreduce: str = "builtin"
    backend: str = "gloo"
    threads: int | None = None  # torch threads per rank; None: the launcher's (OMP_NUM_THREADS, else cores / local ranks)
    trace: bool = False  # time every layer of every step (runtime.trace); the report gets "trace"
    spec: SpecParams | None = None  # speculative decoding (drafter, k); the report gets "speculative"
    log: bool = False  # rank 0 prints one status line to stderr when generation starts
    host_probe: int = 0  # bench: generate this many times, timing the probe's reference blocks before, between and after
    int_activations: str | None = None  # rows 4-bit weights multiply (int_matmul.activations); None: the environment's


def slow_rank_hook(rank: int) -> float:
    """Seconds of sleep ``SHARDWISE_TEST_SLOW_RANK`` asks of this rank per layer (0 when unset)."""
    value = os.environ.get(SLOW_RANK_ENV)
    if not value:
        return 0.0
    try:
        who, seconds = value.split(":")
        target, delay = int(who), float(seconds)
    except ValueError:
        raise ShardwiseError(f"{SLOW_RANK_ENV}='{value}' must look like RANK:SECONDS, e.g. 1:0.005") from None
    return delay if target == rank and delay > 0 else 0.0


def run_rank(rank: int, world_size: int, request: RunRequest) -> dict[str, Any]:
    """Load this rank's shard of ``request.checkpoint`` and generate; returns this rank's report."""
    from shardwise.runtime.generate import SamplingParams, generate
    from shardwise.runtime.layers import set_allreduce
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    if request.threads is not None:
        torch.set_num_threads(request.threads)
    if request.int_activations is not None:
        int_matmul.set_activations(request.int_activations)
    if request.backend == "nccl":  # every tensor of the run on this rank's GPU
        from shardwise.runtime.rendezvous import RankContext

        torch.set_default_device(RankContext.current().device)
    set_allreduce(request.allreduce)
    spec = load_spec(request.checkpoint)
    plan = ParallelPlan(tp=request.tp, ep=request.ep)
    sampling = SamplingParams(request.temperature, request.top_p, request.seed)
    t0 = time.perf_counter()
    model = ShardedCausalLM(
        spec, plan, rank, request.dtype, max_seq_len=len(request.prompt_ids) + request.max_new_tokens,
        max_step_tokens=request.spec.tokens + 1 if request.spec is not None else 1,
    )
    load_shard(model, Path(request.checkpoint))
    load_s = time.perf_counter() - t0
    delay = slow_rank_hook(rank)
    if delay:
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(lambda module, args, out: time.sleep(delay))
    tracer = None
    if request.trace:
        from shardwise.runtime.trace import Tracer

        tracer = Tracer(model, device=next(model.parameters()).device).attach()
    if request.log and rank == 0:
        print(f"[shardwise rank 0] loaded in {load_s:.2f} s; generating up to {request.max_new_tokens} tokens",
              file=sys.stderr, flush=True)
    speculative = host = None
    if request.spec is not None:
        from shardwise.runtime.speculative import run_speculative

        result, speculative = run_speculative(model, request, sampling, tracer)
    else:
        result = generate(model, request.prompt_ids, request.max_new_tokens, sampling, tracer=tracer)
        if request.host_probe:
            result, host = _interleaved_runs(model, request, sampling, world_size)
    if tracer is not None:
        tracer.detach()
    return {
        "rank": rank,
        "world_size": world_size,
        "tokens": result.tokens,
        "stopped_by": result.stopped_by,
        "prompt_tokens": result.prompt_tokens,
        "load_s": load_s,
        "prefill_s": result.prefill_s,
        "decode_s": result.decode_s,
        "decode_step_s": result.step_s,
        "tok_per_s": result.decode_tok_per_s,
        "param_bytes": model.param_bytes(),
        "planned_params": sum(rank_param_counts(spec, plan, rank).values()),
        "cache_bytes": model.cache_bytes(),
        "experts": list(local_experts(spec.moe.num_experts, plan, rank)) if spec.moe is not None else [],
        "trace": tracer.export() if tracer is not None else None,
        "speculative": speculative,
        "int_activations": int_matmul.activations(),
        "threads": torch.get_num_threads(),
        **({"host_probe": host} if host is not None else {}),
    }


def _interleaved_runs(model, request: RunRequest, sampling, world_size: int):
    """``request.host_probe`` more generations (after the warm one), the host probe timed
    before, between and after them: (a result holding every measured step, the median of each
    probe figure). A busy or shared host drifts by tens of percent within seconds, so figures
    from a probe run earlier would not describe this run; interleaving averages the same
    stretch of time on both sides."""
    from shardwise.runtime.generate import generate

    probes = [_host_probe(world_size, request.allreduce)]
    steps: list[float] = []
    result = None
    for _ in range(request.host_probe):
        result = generate(model, request.prompt_ids, request.max_new_tokens, sampling)
        steps += result.step_s
        probes.append(_host_probe(world_size, request.allreduce))
    host = {k: statistics.median(p[k] for p in probes) for k in probes[0]}
    return replace(result, step_s=steps), host


def _host_probe(world_size: int, allreduce: str) -> dict[str, float]:
    """The probe's host figures for this run's all-reduce, timed in this rank's process with
    fewer batches than `shardwise probe`: per-op costs and, with peers, the in-decode cost."""
    from shardwise.runtime.host_costs import measure_host_costs

    costs = measure_host_costs(world_size, [allreduce], batches=7)
    out = {"op_overhead_s": costs["op_overhead_s"], "op_overhead_moe_s": costs["op_overhead_moe_s"]}
    if world_size > 1:
        out["collective_in_decode_s"] = costs["collective_in_decode_s"][allreduce]
    return out
