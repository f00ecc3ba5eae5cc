"""MXFP4 experts in the runtime: resident bytes against the planner, decode tok/s against BF16
experts, and the per-weight decode paths.

    PYTHONPATH=src python benchmarks/bench_mxfp4.py [--family gpt-oss|qwen3-moe] [--hidden 1024] [--experts 16] [--tokens 32]

Builds a gpt-oss-shaped checkpoint (random weights, experts MXFP4 in the gpt-oss layout; or ``--family qwen3-moe``:
Qwen3-MoE's SwiGLU experts, top-8, expert width 3/4 of hidden, MXFP4 in compressed-tensors' layout — the experts a
one-row step runs in one call, ``runtime/packed_experts.py``),
its dequantized BF16 twin (expert weights = decode(blocks, scales) exactly), then on one
thread in this process:

1. resident expert bytes of each rank at tp = 1 and tp = 2 / ep = 2 against the planner's
   prediction ``rank_param_counts(...)[routed_experts] × bits_per_weight('mxfp4') / 8``
   (target: within 5%; the packed blocks + scales alone match exactly, the rest is the
   BF16 expert biases the planner also prices at 4.25 bits);
2. greedy decode tok/s of the MXFP4 and BF16 checkpoints at tp = 1 in bfloat16, same run;
3. one expert projection (and a 2880×2880 gpt-oss-120b-sized weight): dense BF16 matmul,
   decode-then-matmul with the runtime's decoder (int-packed pair LUT + index_select),
   and with the earlier ``F.embedding`` float-pair LUT, all bit-identical weights.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from shardwise.plan import ParallelPlan, rank_param_counts
from shardwise.quant.formats import get_format
from shardwise.quant.mxfp4_codec import E2M1_VALUES
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.generate import SamplingParams, generate
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.mxfp4_matmul import decode
from shardwise.runtime.quantize_checkpoint import dequantize_checkpoint
from shardwise.spec.model import ROUTED_EXPERTS


def _embedding_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The previous decoder: F.embedding over a [256, 2] float pair table, then the scale table."""
    values = torch.from_numpy(E2M1_VALUES).double()
    codes = torch.arange(256)
    pairs = torch.stack([values[codes & 15], values[codes >> 4]], -1).to(dtype)
    scale_lut = torch.ldexp(torch.ones(256, dtype=torch.float64), codes - 127).to(dtype)[:, None]
    out = F.embedding(blocks.int(), pairs).reshape(*blocks.shape[:-1], 32) * F.embedding(scales.int(), scale_lut)
    return out.reshape(*blocks.shape[:-2], -1)


def _ms(fn, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1e3


def _resident(folder: Path, plan: ParallelPlan, rank: int) -> dict:
    spec = load_spec(folder)
    model = ShardedCausalLM(spec, plan, rank, torch.bfloat16, max_seq_len=8)
    load_shard(model, folder)
    packed = sum(p.numel() for p in model.parameters() if getattr(p, "packed", None))
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    predicted = rank_param_counts(spec, plan, rank)[ROUTED_EXPERTS] * get_format("mxfp4").bits_per_weight / 8
    return {"tp": plan.tp, "ep": plan.ep, "rank": rank, "resident_expert_bytes": experts, "packed_bytes": packed,
            "predicted_bytes": predicted, "ratio": experts / predicted}


def _tok_per_s(folder: Path, tokens: int) -> float:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, torch.bfloat16, max_seq_len=8 + tokens)
    load_shard(model, folder)
    result = generate(model, [3, 17, 101, 42, 7, 250, 11, 64], tokens, SamplingParams())
    return result.decode_tok_per_s


def _paths(out: int, inp: int) -> dict:
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (out, inp // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 130, (out, inp // 32), dtype=torch.uint8, generator=g)
    x = torch.randn(1, inp, generator=g).bfloat16()
    dense = decode(blocks, scales, torch.bfloat16)
    assert torch.equal(_embedding_decode(blocks, scales, torch.bfloat16), dense)
    return {
        "shape": [out, inp],
        "dense_bf16_matmul_ms": _ms(lambda: F.linear(x, dense)),
        "decode_then_matmul_ms": _ms(lambda: F.linear(x, decode(blocks, scales, torch.bfloat16))),
        "embedding_decode_then_matmul_ms": _ms(lambda: F.linear(x, _embedding_decode(blocks, scales, torch.bfloat16))),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--family", choices=("gpt-oss", "qwen3-moe"), default="gpt-oss")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        h = args.hidden
        t0 = time.perf_counter()
        if args.family == "gpt-oss":
            overrides = dict(hidden_size=h, intermediate_size=h, num_attention_heads=h // 64, head_dim=64,
                             num_local_experts=args.experts)
            q = make_checkpoint("gpt-oss-20b", "tiny", root / "mxfp4", seed=0, quant="mxfp4", overrides=overrides)
            shape = f"gpt-oss shape, hidden {h}, expert intermediate {h}, {args.experts} experts, top-2, 2 layers"
        else:
            overrides = dict(hidden_size=h, moe_intermediate_size=3 * h // 4, num_attention_heads=h // 64, head_dim=64,
                             num_experts=args.experts, num_experts_per_tok=min(8, args.experts))
            q = make_checkpoint("qwen3-30b-a3b", "tiny", root / "mxfp4", seed=0, quant="mxfp4", overrides=overrides)
            shape = (f"Qwen3-MoE shape, hidden {h}, expert intermediate {3 * h // 4}, {args.experts} experts, "
                     f"top-{min(8, args.experts)}, {load_spec(q).num_layers} layers")
        bf16 = dequantize_checkpoint(q, root / "bf16", dtype=torch.bfloat16)
        build_s = time.perf_counter() - t0
        report = {
            "model": shape,
            "build_s": build_s,
            "resident": [_resident(q, ParallelPlan(), 0)] + [_resident(q, ParallelPlan(tp=2, ep=2), r) for r in range(2)],
            "bf16_resident_expert_bytes_tp1": _resident(bf16, ParallelPlan(), 0)["resident_expert_bytes"],
        }
        report["tok_per_s"] = {"mxfp4": _tok_per_s(q, args.tokens), "bf16": _tok_per_s(bf16, args.tokens)}
        report["decode_paths"] = [_paths(2 * h, h), _paths(h, h), _paths(2880, 2880)]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
