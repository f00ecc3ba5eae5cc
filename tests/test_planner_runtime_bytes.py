"""The planner's bytes per rank are the runtime's bytes per rank: weights and cache.

For the tiny checkpoint of every family the runtime runs (llama, qwen3_moe, deepseek_v3,
gpt_oss, qwen3_5_moe, kimi_linear), at tp 1, 2 and 4 with ep = tp, ep = 1 and an ep < tp case, in float32 and
bfloat16, every tensor rank's shard is built in process (``ShardedCausalLM`` needs no
process group to allocate a rank's parameters) and its allocated bytes are compared with
``perf.memory``:

- weights: ``param.numel() * param.element_size()`` over ``model.parameters()`` (tied
  weights once; the model holds no weight buffers) against ``rank_weight_bytes`` with
  ``formats_bits`` giving each group the bits the runtime stores it at: the run dtype,
  except the groups the runtime keeps in float32 (``RUNTIME_FP32_GROUPS``: DeepSeek-V3's
  and Kimi Linear's router and correction bias, gpt-oss's RMSNorm weights, as transformers
  does), and MXFP4 for packed routed experts; single tensors the runtime keeps in float32
  whatever their group (``TensorSpec.keep_float32``: Kimi Linear's KDA ``dt_bias``) the planner
  prices at 4 bytes itself. Compared per tensor group, so a failure names the group.
- cache: ``model.cache_bytes()`` (KV / latent buffers of one sequence of ``max_seq_len``
  tokens; sliding layers hold their ring) against ``rank_cache_bytes``.

Cases where the planner were known to count differently would be ``xfail(strict=True)`` with the
reason; they turn into failures (XPASS) once the planner counts like the runtime.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.perf.estimate import formats_bits
from shardwise.perf.memory import rank_cache_bytes, rank_group_bytes, rank_weight_bytes
from shardwise.plan import ParallelPlan, rank_param_counts
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.loader import load_spec
from shardwise.runtime.model import ShardedCausalLM, param_dtype
from shardwise.spec.model import NORM, ROUTED_EXPERTS, ROUTER, TENSOR_GROUPS
from shardwise.spec.tensors import unpacked_key

FAMILIES = {"llama": "llama-3.1-8b", "qwen3_moe": "qwen3-30b-a3b", "deepseek_v3": "deepseek-v3", "gpt_oss": "gpt-oss-20b",
            "qwen3_5_moe": "qwen3.5-397b-a17b", "kimi_linear": "kimi-linear-48b-a3b"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BITS = {torch.float32: 32, torch.bfloat16: 16}
RUNTIME_FP32_GROUPS = {"deepseek_v3": {ROUTER}, "gpt_oss": {NORM}, "kimi_linear": {ROUTER}}
RUNTIME_FP32_TENSORS = {"kimi_linear": {"dt_bias"}}  # name endings held in float32 outside those groups
MXFP4_BITS = 4.25  # 4-bit elements + one 8-bit scale per 32

# (tp, ep) per family: dense models only ep 1; MoE models ep = tp, ep = 1 and ep < tp
PLANS = {
    "llama": [(1, 1), (2, 1), (4, 1)],
    "moe": [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2)],
}
CONTEXTS = (5, 40)  # below and above the tiny gpt-oss window of 8



@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    out = {family: load_spec(make_checkpoint(key, "tiny", root / family, seed=0)) for family, key in FAMILIES.items()}
    out["llama_v509"] = load_spec(make_checkpoint("llama-3.1-8b", "tiny", root / "v509", overrides={"vocab_size": 509}))
    out["gpt_oss_mxfp4"] = load_spec(make_checkpoint("gpt-oss-20b", "tiny", root / "gm", quant="mxfp4",
                                                     overrides={"intermediate_size": 64}))
    out["qwen3_moe_mxfp4"] = load_spec(make_checkpoint("qwen3-30b-a3b", "tiny", root / "qm", quant="mxfp4",
                                                       overrides={"moe_intermediate_size": 64}))
    return out


def runtime_formats_bits(spec, dtype: torch.dtype) -> dict[str, float]:
    """Bits per weight per group as the runtime stores them, written out here from the rule."""
    bits = {g: float(BITS[dtype]) for g in TENSOR_GROUPS}
    for g in RUNTIME_FP32_GROUPS.get(spec.family, ()):
        bits[g] = 32.0
    if spec.quant_formats.get(ROUTED_EXPERTS) == "mxfp4":
        bits[ROUTED_EXPERTS] = MXFP4_BITS
        bits[unpacked_key(ROUTED_EXPERTS)] = float(BITS[dtype])  # expert biases stay at the run dtype
    return bits


def test_planner_run_formats_are_the_runtime_rule(specs):
    """``ModelSpec.run_formats`` (what the planner uses for a shardwise run) gives the bits above."""
    for family, spec in specs.items():
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            assert formats_bits(spec.run_formats(name), spec) == runtime_formats_bits(spec, dtype), (family, name)


def _runtime_group_bytes(model) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in model.parameters():  # tied weights once
        out[p.spec.group] = out.get(p.spec.group, 0) + p.numel() * p.element_size()
    return out


def _weight_buffers(model) -> list[str]:
    return [n for n, _ in model.named_buffers() if "cache" not in n and not n.startswith("rotary.")]


def _cases(specs_keys):
    for family in specs_keys:
        base = family.split("_mxfp4")[0].split("_v")[0]
        for tp, ep in PLANS["llama" if base == "llama" else "moe"]:
            for dname in DTYPES:
                yield pytest.param(family, tp, ep, dname, id=f"{family}-tp{tp}-ep{ep}-{dname}")


WEIGHT_CASES = list(_cases(["llama", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama_v509", "gpt_oss_mxfp4",
                            "qwen3_moe_mxfp4", "qwen3_5_moe", "kimi_linear"]))


def test_fp32_groups_are_the_runtime_rule(specs):
    """RUNTIME_FP32_GROUPS is exactly the set of groups ``model.param_dtype`` keeps in float32 (single
    ``keep_float32`` tensors apart: the next test)."""
    for family in FAMILIES:
        spec = specs[family]
        kept = {t.group for t in spec.tensors()
                if not t.keep_float32 and param_dtype(spec, t, torch.bfloat16) == torch.float32}
        assert kept == RUNTIME_FP32_GROUPS.get(family, set()), family


def test_fp32_tensors_are_the_runtime_rule(specs):
    """In a bfloat16 run the runtime holds in float32 exactly the tensors of ``float32_groups``
    plus those the spec marks ``keep_float32`` (Kimi Linear's KDA ``dt_bias``; Qwen3.5's Gated
    DeltaNet ``dt_bias`` / ``A_log`` stay in the run dtype, as in transformers), and the marks are
    the ones written out here."""
    for family in FAMILIES:
        spec = specs[family]
        model = ShardedCausalLM(spec, ParallelPlan(), 0, torch.bfloat16, max_seq_len=8)
        held = {p.spec.name for p in model.parameters() if p.dtype == torch.float32}
        marked = {t.name for t in spec.tensors() if t.keep_float32 or t.group in spec.float32_groups}
        assert held == marked, (family, held ^ marked)
        endings = RUNTIME_FP32_TENSORS.get(family, set())
        assert {t.name for t in spec.tensors() if t.keep_float32} == {
            t.name for t in spec.tensors() if any(t.name.endswith("." + e) for e in endings)}, family


@pytest.mark.parametrize("family, tp, ep, dname", WEIGHT_CASES)
def test_weight_bytes_per_rank(specs, family, tp, ep, dname):
    spec, dtype = specs[family], DTYPES[dname]
    plan = ParallelPlan(tp=tp, ep=ep)
    bits = runtime_formats_bits(spec, dtype)
    for rank in range(tp):
        model = ShardedCausalLM(spec, plan, rank, dtype, max_seq_len=8)
        assert not _weight_buffers(model), f"weight-holding buffers: {_weight_buffers(model)}"
        runtime = _runtime_group_bytes(model)
        planner = rank_group_bytes(spec, plan, bits, rank)
        assert set(planner) == {g for g, n in rank_param_counts(spec, plan, rank).items() if n}
        diff = {g: (planner.get(g, 0), runtime.get(g, 0)) for g in set(planner) | set(runtime)
                if not math.isclose(planner.get(g, 0), runtime.get(g, 0))}
        assert not diff, f"rank {rank}: group (planner bytes, runtime bytes) {diff}"
        assert rank_weight_bytes(spec, plan, bits, rank) == pytest.approx(model.param_bytes(), rel=0, abs=1e-6)


def _cache_cases():
    for family in FAMILIES:
        for tp, ep in PLANS["llama" if family == "llama" else "moe"]:
            for dname in DTYPES:
                for ctx in CONTEXTS:
                    yield pytest.param(family, tp, ep, dname, ctx, 1, id=f"{family}-tp{tp}-ep{ep}-{dname}-ctx{ctx}")
    for ctx in CONTEXTS:  # speculative decoding with 4 drafts: verify passes of 5 positions
        yield pytest.param("gpt_oss", 2, 2, "bfloat16", ctx, 5, id=f"gpt_oss-spec5-ctx{ctx}")
    for dname in DTYPES:  # a linear layer keeps k+2 states and kernel-1+k+1 conv positions for rollback
        yield pytest.param("qwen3_5_moe", 2, 2, dname, 40, 5, id=f"qwen3_5_moe-spec5-{dname}-ctx40")


@pytest.mark.parametrize("family, tp, ep, dname, context, step", list(_cache_cases()))
def test_cache_bytes_per_rank(specs, family, tp, ep, dname, context, step):
    spec, dtype = specs[family], DTYPES[dname]
    plan = ParallelPlan(tp=tp, ep=ep)
    kv_bytes = torch.tensor([], dtype=dtype).element_size()
    for rank in range(tp):
        model = ShardedCausalLM(spec, plan, rank, dtype, max_seq_len=context, max_step_tokens=step)
        planner = rank_cache_bytes(spec, plan, context, kv_bytes, rank, step_tokens=step)
        assert planner == model.cache_bytes(), f"rank {rank}: planner {planner} B, runtime {model.cache_bytes()} B"


def test_sliding_ring_formula(specs):
    """gpt-oss's sliding layers hold min(max_seq_len, window + max_step_tokens - 1) positions."""
    spec = specs["gpt_oss"]
    for max_seq_len, step in ((5, 1), (40, 1), (40, 5), (10, 5)):
        model = ShardedCausalLM(spec, ParallelPlan(), 0, torch.float32, max_seq_len=max_seq_len, max_step_tokens=step)
        for layer, attn in zip(spec.layers, (l.self_attn for l in model.model.layers)):
            expect = max_seq_len if layer.window is None else min(max_seq_len, layer.window + step - 1)
            assert attn.k_cache.shape[2] == attn.v_cache.shape[2] == expect
