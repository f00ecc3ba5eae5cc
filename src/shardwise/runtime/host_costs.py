"""Host cost of the runtime's eager decode path, timed on a small reference decoder.

At batch 1 on small models the host cost of dispatching torch ops, not bandwidth, sets the
speed of an eager runtime. This module builds a reference decode step out of the runtime's
own layers and times it:

- ``measure_op_overhead``: the host cost of one eager torch op (``op_overhead_s``): the
  reference block timed and divided by the aten ops it dispatches (counted by
  ``count_ops``), for the dense llama and the MoE reference;
- ``measure_collective_in_decode``: the cost of one all-reduce *inside a decode step*
  (``collective_in_decode_s``): the same block with each layer's two all-reduces running
  the algorithm, on every rank at once, minus the block alone, per all-reduce. Between
  back-to-back calls the ranks arrive together and stay awake; in a decode step they
  arrive from compute with skew and a blocked rank must be woken, which on a shared or
  busy host costs several times the tight-loop latency.

``measure_host_costs`` gathers both for one rank; ``shardwise probe``
(``shardwise.measure.probe``) calls it in every probe rank and ``runtime.runner`` between
the measured generations of a bench run (``RunRequest.host_probe``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any


def op_counter():
    """A torch dispatch mode whose ``ops`` attribute counts the aten ops dispatched while it
    is active (views and in-place ops included); use as ``with op_counter() as c:``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _OpCounter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    return _OpCounter()


def count_ops(fn: Callable[[], Any]) -> int:
    """Number of aten ops ``fn()`` dispatches."""
    with op_counter() as counter:
        fn()
    return counter.ops


REFERENCE_CONFIG = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "vocab_size": 256,
                    "num_attention_heads": 4, "head_dim": 32}
"""The reference decoder's sizes: a llama the runtime runs, with sizes no bundled tiny
checkpoint (``make-checkpoint --scale tiny``) uses, so calibrating on it is not fitting the
model later benched."""

REFERENCE_MOE_CONFIG = {**REFERENCE_CONFIG, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 64}
"""The MoE reference (a qwen3_moe with the reference sizes; tiny checkpoints use 8 experts,
top-2): routing and the per-expert loop dispatch ops from more Python per op than a dense
MLP does, so MoE layers get their own per-op cost (``op_overhead_moe_s``)."""


def _reference_block(context: int = 16, reduce: Callable[[Any], Any] | None = None, moe: bool = False) -> Callable[[], Any]:
    """One decode step of the runtime's own decoder layers (norms, projections, rotary,
    attention over a static cache, gated MLP) on a small random llama at tp=1: the op mix,
    and the per-op host cost, of the runtime's eager decode path. Each layer's two
    all-reduce hooks run ``reduce`` (default: identity, so the step runs alone inside a
    rank of a larger group; every rank must call a block built with the same ``reduce``).
    ``moe``: the MoE reference (``REFERENCE_MOE_CONFIG``) instead of the dense llama."""
    import torch

    from shardwise.plan import ParallelPlan
    from shardwise.runtime.checkpoint import shrink_config
    from shardwise.runtime.model import ShardedCausalLM
    from shardwise.spec.parse import load_model, parse_config

    cfg = shrink_config(dict(load_model("qwen3-30b-a3b" if moe else "llama-3.1-8b").config))
    cfg.update(REFERENCE_MOE_CONFIG if moe else REFERENCE_CONFIG)
    model = ShardedCausalLM(parse_config(cfg, name="probe-reference"), ParallelPlan(), 0, "float32",
                            max_seq_len=context + 1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    for layer in model.model.layers:
        layer.reduce_attn = layer.reduce_mlp = reduce or _identity
    positions = torch.tensor([context])
    rope = model.rotary(positions, model.dtype)
    x0 = torch.randn(1, 1, cfg["hidden_size"], generator=g)

    def block():
        h = x0
        for layer in model.model.layers:
            h = layer(h, positions, rope)
        return model.model.norm(h)

    return block


def _identity(t):
    return t


def _block_seconds(block: Callable[[], Any], reps: int, batches: int) -> float:
    """Median over ``batches`` of the mean seconds per call of ``block`` (after 10 warm-ups)."""
    import torch

    with torch.no_grad():
        for _ in range(10):
            block()
        times = []
        for _ in range(batches):
            t0 = time.perf_counter()
            for _ in range(reps):
                block()
            times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def measure_op_overhead(reps: int = 20, batches: int = 15, moe: bool = False) -> tuple[float, int]:
    """(seconds per dispatched aten op, ops per block) of the reference block (``moe``: the
    MoE one), eager, as the runtime's plain decode path dispatches it (no ``runtime.exact``
    scope); the median of ``batches`` batches, like the decode steps ``bench`` compares it with."""
    import torch

    block = _reference_block(moe=moe)
    with torch.no_grad():
        ops = count_ops(block)
    return _block_seconds(block, reps, batches) / ops, ops


def measure_collective_in_decode(reduce: Callable[[Any], Any], reps: int = 10, batches: int = 15) -> float:
    """Seconds one all-reduce (``reduce``) adds to a decode step: the reference block with
    its 2 per layer all-reduces minus the block without them, per all-reduce, both timed
    right here on every rank at once (call it on every rank of the group together)."""
    import torch.distributed as dist

    alone = _reference_block()
    with_reduce = _reference_block(reduce=reduce)
    dist.barrier()
    alone_s = _block_seconds(alone, reps, batches)
    dist.barrier()
    with_s = _block_seconds(with_reduce, reps, batches)
    return max(0.0, with_s - alone_s) / (2 * REFERENCE_CONFIG["num_hidden_layers"])


REFERENCE_MESSAGE_BYTES = REFERENCE_CONFIG["hidden_size"] * 4
"""Bytes of the reference block's all-reduce message (one fp32 hidden vector)."""


def measure_host_costs(world: int, algorithms: Sequence[str], batches: int = 15) -> dict[str, Any]:
    """This rank's host costs on the reference blocks: seconds per op of the dense
    (``op_overhead_s``, with ``reference_block_ops``) and MoE (``op_overhead_moe_s``) blocks and,
    with peers, each algorithm's in-decode all-reduce seconds (``collective_in_decode_s``;
    every rank of the group must call this together)."""
    from shardwise.runtime.comm import get_allreduce

    op_s, block_ops = measure_op_overhead(batches=batches)
    out: dict[str, Any] = {
        "op_overhead_s": op_s, "reference_block_ops": block_ops,
        "op_overhead_moe_s": measure_op_overhead(reps=10, batches=batches, moe=True)[0],
        "collective_in_decode_s": {},
    }
    if world > 1:
        for name in algorithms:
            out["collective_in_decode_s"][name] = measure_collective_in_decode(get_allreduce(name), batches=batches)
    return out
