"""A MoE block's one-row step through the compiled ``experts_row`` (``runtime/gemv.py``): the same
experts, order and roundings as the torch ops it replaces, for the routings and expert layouts that
take it (Qwen3-MoE softmax top-k, DeepSeek-V3 sigmoid with shared experts, Qwen3.5's sigmoid-gated
shared expert — the shared experts run in the same call, as its last expert), float32 and bfloat16; packed
experts (MXFP4, int4, int8; Kimi K3's SiTU experts in its latent MoE; gpt-oss's fused ones) through ``experts_row_packed`` (``runtime/packed_experts.py``) the same way; kept out of
``exact.row_blocked()``."""

from __future__ import annotations

import pytest
import torch

from shardwise.plan import ParallelPlan
from shardwise.runtime import gemv, packed_experts
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.moe import FusedExperts, SparseMoE
from shardwise.runtime.quantize_checkpoint import quantize_checkpoint

PROMPT = [5, 17, 3, 99, 42, 7, 11, 64, 2, 8, 31, 77, 120, 9]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_row")
    return {
        "qwen3_moe": make_checkpoint("qwen3-30b-a3b", "tiny", root / "qwen3_moe", seed=4),
        "deepseek": make_checkpoint("deepseek-v3", "tiny", root / "deepseek", seed=5),
        "qwen3_5": make_checkpoint("qwen3.5-35b-a3b", "tiny", root / "qwen3_5", seed=7),
        "mxfp4": make_checkpoint("qwen3-30b-a3b", "tiny", root / "mxfp4", seed=6, quant="mxfp4"),
        "kimi_k3_mxfp4": make_checkpoint("kimi-k3", "tiny", root / "kimi_k3", seed=9, quant="mxfp4"),
        "gpt_oss_mxfp4": make_checkpoint("gpt-oss-20b", "tiny", root / "gpt_oss", seed=10, quant="mxfp4"),
        **{fmt: quantize_checkpoint(make_checkpoint("qwen3-30b-a3b", "tiny", root / f"float-{fmt}", seed=8),
                                    root / fmt, fmt, compare=False) and root / fmt for fmt in ("int4", "int8")},
    }


def _decode(folder, dtype: torch.dtype) -> tuple[torch.Tensor, ShardedCausalLM]:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=len(PROMPT))
    load_shard(model, folder)
    with torch.no_grad():
        model.logits(torch.tensor([PROMPT[:4]]))
        steps = [model.logits(torch.tensor([[t]]), 4 + i)[0] for i, t in enumerate(PROMPT[4:])]
    return torch.cat(steps).float(), model


def _blocks(model) -> list[SparseMoE]:
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek", "qwen3_5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_experts_in_one_call_equal_the_torch_ops(ckpts, name, dtype, monkeypatch):
    if gemv.experts_kernel(dtype) is None:
        pytest.skip(f"no compiled experts_row for {dtype} on this machine")
    fused, model = _decode(ckpts[name], dtype)
    assert _blocks(model) and all(b._row for b in _blocks(model))  # every block took the kernel
    shared = [b._row_shared is not None for b in _blocks(model) if b.shared_module() is not None]
    assert shared == ([] if name == "qwen3_moe" else [True] * len(_blocks(model)))  # ... its shared experts too
    monkeypatch.setattr(gemv, "experts_kernel", lambda dtype: None)
    plain, _ = _decode(ckpts[name], dtype)
    bound = 1e-5 if dtype == torch.float32 else 0.05  # float32 rounding; a bfloat16 step of the logits
    assert float((fused - plain).abs().max()) <= bound


@pytest.mark.parametrize("name", ["mxfp4", "int4", "int8", "kimi_k3_mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_packed_experts_in_one_call_equal_the_modules(ckpts, name, dtype, monkeypatch):
    """Each picked expert's three products are the int kernel's, with the modules' flags (so their bits); only the
    activation (SiLU; Kimi K3's SiTU, whose latent MoE sums its experts in float32 with float32 router weights) and
    the weighted sum are the kernel's own float32 roundings."""
    fused, model = _decode(ckpts[name], dtype)
    blocks = _blocks(model)
    if blocks[0]._row_packed is None:
        pytest.skip(f"no compiled experts_row_packed (or int kernel for {name}) on this machine")
    assert all(b._row and b._row_packed is not None for b in blocks)
    monkeypatch.setattr(packed_experts, "kernel", lambda dtype, act: None)
    plain, model = _decode(ckpts[name], dtype)
    assert all(b._row is None for b in _blocks(model))  # expert by expert
    bound = 1e-5 if dtype == torch.float32 else 0.05
    assert float((fused - plain).abs().max()) <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_gpt_oss_experts_in_one_call_equal_the_modules(ckpts, dtype, monkeypatch):
    """gpt-oss's fused MXFP4 experts (interleaved gate|up, biases, the clamped SwiGLU) the same way."""
    fused, model = _decode(ckpts["gpt_oss_mxfp4"], dtype)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    if experts[0]._row_run is None:
        pytest.skip("no compiled experts_row_packed (or MXFP4 int kernel) on this machine")
    assert all(e._row_run is not None for e in experts)
    monkeypatch.setattr(packed_experts, "kernel", lambda dtype, act: None)
    plain, model = _decode(ckpts["gpt_oss_mxfp4"], dtype)
    assert all(e._row_run is None for e in model.modules() if isinstance(e, FusedExperts))
    bound = 1e-5 if dtype == torch.float32 else 0.05
    assert float((fused - plain).abs().max()) <= bound


def test_kernel_stays_out_of_row_blocked(ckpts):
    for name in ("qwen3_moe", "int4"):
        model = ShardedCausalLM(load_spec(ckpts[name]), ParallelPlan(), 0, torch.float32, max_seq_len=8)
        load_shard(model, ckpts[name])
        block = _blocks(model)[0]
        x = torch.randn(1, block.gate.weight.shape[1])
        with torch.no_grad(), row_blocked():
            assert block._row_weights(x, torch.zeros_like(x)) is None
        assert block._row_weights(x, torch.zeros_like(x))  # outside the mode it runs
