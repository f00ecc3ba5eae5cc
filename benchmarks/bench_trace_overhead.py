"""Does tracing *off* cost anything? Decode tok/s of the same tp=2 run, side by side.

    PYTHONPATH=src python benchmarks/bench_trace_overhead.py [--tokens 64] [--rounds 5]

Two gloo ranks on this machine load one tiny llama checkpoint, then alternate, round by
round, three variants of the same greedy decode:

- ``hooks absent``: every decoder layer's class is swapped for a subclass whose forward
  calls the module-level ``layers.allreduce`` directly (the code before the trace hooks);
- ``tracing off``: the shipped code path, ``reduce_attn`` / ``reduce_mlp`` attributes set
  to the plain ``layers.allreduce`` and ``generate(..., tracer=None)``;
- ``tracing on``: a ``trace.Tracer`` attached (arrival exchange + clock reads), for scale.

It prints the median decode tok/s of each over the rounds and the ratio to "hooks absent"
(1.00 = no measurable cost). A tiny model keeps the per-token time short, so any per-call
overhead of the hooks would show.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch


def _rank(rank: int, world_size: int, folder: str, tokens: int, rounds: int) -> dict[str, list[float]]:
    from shardwise.plan import ParallelPlan
    from shardwise.runtime import layers
    from shardwise.runtime.generate import generate
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import DecoderLayer, ShardedCausalLM
    from shardwise.runtime.trace import Tracer

    class HooklessLayer(DecoderLayer):
        def forward(self, x, positions, rope):
            h = x + layers.allreduce(self.self_attn(self.input_layernorm(x), positions, rope).contiguous())
            return h + layers.allreduce(self.mlp(self.post_attention_layernorm(h)).contiguous())

    torch.set_num_threads(1)
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(tp=world_size), rank, "float32", max_seq_len=tokens + 8)
    load_shard(model, Path(folder))
    prompt = [1, 2, 3]
    generate(model, prompt, 8)  # warm-up
    rates: dict[str, list[float]] = {"hooks absent": [], "tracing off": [], "tracing on": []}
    for _ in range(rounds):
        for layer in model.model.layers:
            layer.__class__ = HooklessLayer
        rates["hooks absent"].append(generate(model, prompt, tokens).decode_tok_per_s)
        for layer in model.model.layers:
            layer.__class__ = DecoderLayer
        rates["tracing off"].append(generate(model, prompt, tokens).decode_tok_per_s)
        tracer = Tracer(model).attach()
        rates["tracing on"].append(generate(model, prompt, tokens, tracer=tracer).decode_tok_per_s)
        tracer.detach()
    return rates


def main() -> None:
    from shardwise.runtime.checkpoint import make_checkpoint
    from shardwise.runtime.launch import launch_local

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per generate")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the three variants")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_checkpoint("llama-3.1-8b", "tiny", tmp, seed=0)
        results = launch_local(_rank, 2, args=(str(folder), args.tokens, args.rounds), run_timeout_s=1800)
    rates = results[0]
    base = statistics.median(rates["hooks absent"])
    print(f"tiny llama, tp=2 gloo, {args.tokens} new tokens, {args.rounds} alternating rounds (median decode tok/s)")
    print(f"{'variant':<14} {'tok/s':>8} {'vs hooks absent':>16}   per round")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"{name:<14} {med:8.1f} {med / base:15.3f}x   {' '.join(f'{v:.0f}' for v in values)}")


if __name__ == "__main__":
    main()
