"""One rank of a ``shardwise run``: build the shard, load it, generate, report.

``run_rank(rank, world_size, request)`` is what ``launch_local`` starts in each local
process (and what a torchrun-started process calls after ``init_from_env``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.plan import ParallelPlan, local_experts, rank_param_counts


@dataclass(frozen=True)
class RunRequest:
    """Everything a rank needs; picklable so it crosses to spawned processes."""

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
    threads: int = 1


def run_rank(rank: int, world_size: int, request: RunRequest) -> dict[str, Any]:
    """Load this rank's shard of ``request.checkpoint`` and generate; returns this rank's report."""
    from shardwise.runtime.generate import SamplingParams, generate
    from shardwise.runtime.layers import set_allreduce
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    torch.set_num_threads(request.threads)
    if request.backend == "nccl":  # every tensor of the run on this rank's GPU
        from shardwise.runtime.launch import RankContext

        torch.set_default_device(RankContext.current().device)
    set_allreduce(request.allreduce)
    spec = load_spec(request.checkpoint)
    plan = ParallelPlan(tp=request.tp, ep=request.ep)
    sampling = SamplingParams(request.temperature, request.top_p, request.seed)
    t0 = time.perf_counter()
    model = ShardedCausalLM(
        spec, plan, rank, request.dtype, max_seq_len=len(request.prompt_ids) + request.max_new_tokens
    )
    load_shard(model, Path(request.checkpoint))
    load_s = time.perf_counter() - t0
    result = generate(model, request.prompt_ids, request.max_new_tokens, sampling)
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
    }
