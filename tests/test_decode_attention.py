"""The compiled one-row attention (``csrc/decode_attention.cpp``) that decode steps and verify rows run on
the CPU: within float32 rounding of a float64 reference (bfloat16: as close as torch's own kernel) for
grouped, MLA-shaped (dk != dv) and odd head sizes over cache slices read in place; each row's bits do not
depend on the batch it shares a call with or on the thread count; and ``attend`` takes it for one row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_has
from shardwise.runtime import cpp_ops
from shardwise.runtime.attention import attend

SHAPES = [(16, 4, 128, 128, 64), (8, 8, 192, 128, 300), (14, 2, 80, 80, 77), (32, 4, 64, 64, 1000), (4, 1, 16, 8, 1)]


@pytest.fixture(scope="module")
def op():
    if not (cpu_has("avx512f") and cpu_has("avx512bw")):
        pytest.skip("no AVX-512 F/BW on this CPU: one-row attention stays torch's SDPA")
    kernel = cpp_ops.optional_op("decode_attention.cpp", "shardwise_attn", "decode")
    assert kernel is not None
    return kernel


def _case(shape, dtype, batch=1, seed=0):
    heads, kv, dk, dv, keys = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, 1, dk, generator=gen).to(dtype)
    k = torch.randn(batch, kv, keys + 9, dk, generator=gen).to(dtype)[:, :, :keys]  # a cache's first keys, in place
    v = torch.randn(batch, kv, keys + 9, dv, generator=gen).to(dtype)[:, :, :keys]
    return q, k, v, dk**-0.5


def _reference(q, k, v, scale):
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape[0], 1, -1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(op, shape, dtype):
    q, k, v, scale = _case(shape, dtype, batch=2)
    got = op(q, k, v, scale)
    assert got.shape == (2, 1, shape[0] * shape[3]) and got.dtype == dtype
    error = (got.double() - _reference(q, k, v, scale)).abs().max().item()
    if dtype == torch.float32:
        assert error <= 1e-6
    else:  # the output rounded once to bfloat16: torch's kernel is no closer
        theirs = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True).transpose(1, 2).reshape(2, 1, -1)
        assert error <= max(2 ** -8, (theirs.double() - _reference(q, k, v, scale)).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_has_the_same_bits_in_any_batch_and_thread_count(op, dtype):
    q, k, v, scale = _case((16, 4, 128, 128, 700), dtype, batch=3, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = [op(q[i : i + 1], k[i : i + 1], v[i : i + 1], scale) for i in range(3)]
        torch.set_num_threads(max(2, threads))
        together = op(q, k, v, scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(torch.cat(alone), together)


def test_attend_takes_it_for_one_row(op):
    q, k, v, scale = _case((16, 4, 128, 128, 40), torch.float32)
    assert torch.equal(attend(q, k, v, torch.tensor([39]), None, scale), op(q, k, v, scale))


def test_bad_inputs_are_refused(op):
    q, k, v, scale = _case((16, 4, 128, 128, 40), torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        op(q, k.double(), v, scale)
    with pytest.raises(RuntimeError, match="KV heads dividing"):
        op(q, k[:, :3], v[:, :3], scale)


IDS = [3, 17, 101, 42, 7, 250, 11, 64, 9, 33, 180, 2]


def _tiny_deepseek(folder):
    """A tiny random DeepSeek-V3 written by transformers' own class into ``folder``; returns the model."""
    transformers = pytest.importorskip("transformers")
    from runtime_checks import randomise

    config = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
        moe_intermediate_size=32, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(11)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    randomise(hf)
    hf.save_pretrained(folder)
    return hf


def test_mla_decode_in_the_absorbed_form_matches_transformers(op, tmp_path, monkeypatch):
    """DeepSeek-V3 attention past the prompt runs absorbed (queries taken into latent space, the cached
    latents read once, no per-token kv_b expansion): one-token steps and a multi-token pass at a later
    start give transformers' logits for the whole sequence within 1e-4."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.attention import MLAttention
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    hf = _tiny_deepseek(tmp_path)
    ids = IDS
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    absorbed = []
    original = MLAttention._absorbed
    monkeypatch.setattr(MLAttention, "_absorbed", lambda self, *a: absorbed.append(original(self, *a)) or absorbed[-1])
    model = ShardedCausalLM(load_spec(tmp_path), ParallelPlan(), 0, torch.float32, max_seq_len=32)
    load_shard(model, tmp_path)
    with torch.no_grad():
        got = [model.logits(torch.tensor([ids[:6]]))[0]]  # prefill from 0: the expanded form
        got += [model.logits(torch.tensor([[t]]), start=6 + i)[0] for i, t in enumerate(ids[6:9])]
        got.append(model.logits(torch.tensor([ids[9:]]), start=9)[0])  # a verify-like pass
    assert absorbed and all(out is not None for out in absorbed)
    assert (torch.cat(got) - want).abs().max().item() <= 1e-4


def test_mla_absorbed_form_in_bfloat16(op, tmp_path, monkeypatch):
    """bfloat16 (the value product a bmm against kv_b's blocks as stored): one-token steps within bfloat16
    rounding of the expanded form (2^-5 of the largest logit: a bfloat16 step is 2^-8 of a value), and a
    multi-token pass's rows the same bits as the steps under exact.row_blocked()."""
    from shardwise.plan import ParallelPlan
    from shardwise.runtime.attention import MLAttention
    from shardwise.runtime.exact import row_blocked
    from shardwise.runtime.loader import load_shard, load_spec
    from shardwise.runtime.model import ShardedCausalLM

    _tiny_deepseek(tmp_path)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        model = ShardedCausalLM(load_spec(tmp_path), ParallelPlan(), 0, torch.bfloat16, max_seq_len=32)
        load_shard(model, tmp_path)
        with torch.no_grad(), row_blocked():
            model.logits(torch.tensor([IDS[:6]]))
            steps = torch.cat([model.logits(torch.tensor([[t]]), start=6 + i)[0] for i, t in enumerate(IDS[6:])])
            model.logits(torch.tensor([IDS[:6]]))
            return steps.float(), model.logits(torch.tensor([IDS[6:]]), start=6)[0].float()

    steps, whole = run()
    assert torch.equal(steps, whole)
    monkeypatch.setattr(MLAttention, "_absorbed", lambda self, *a: None)  # every pass expanded
    expanded, _ = run()
    assert (steps - expanded).abs().max().item() <= 2**-5 * expanded.abs().max().item()
