"""The compiled one-token attention step (``shardwise_attn.step`` in ``csrc/decode_attention.cpp``) that a
decode step of grouped-query full attention takes on the CPU: the same bits as the torch-level path it
replaces (split, q/k norms, rotary, cache writes, one-row attention), for a Llama (no q/k norms) and a
Qwen3-MoE (q/k norms) built by transformers, in float32 and bfloat16, one row and a batch of two; it is taken
where it applies and not where it does not (a sliding window)."""

from __future__ import annotations

import pytest
import torch

from conftest import cpu_has

transformers = pytest.importorskip("transformers")

from runtime_checks import randomise  # noqa: E402
from shardwise.plan import ParallelPlan  # noqa: E402
from shardwise.runtime import attention  # noqa: E402
from shardwise.runtime.loader import load_shard, load_spec  # noqa: E402
from shardwise.runtime.model import ShardedCausalLM  # noqa: E402

PROMPT = [3, 17, 101, 42, 7, 250, 11, 64]
STEPS = 24


def _configs():
    common = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=96, num_hidden_layers=2, max_position_embeddings=128, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    return {"llama": transformers.LlamaConfig(**common),
            "qwen3_moe": transformers.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=32, mlp_only_layers=[1])}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    if not (cpu_has("avx512f") and cpu_has("avx512bw")):
        pytest.skip("no AVX-512 F/BW on this CPU: no compiled attention step")
    out = {}
    for i, (key, config) in enumerate(_configs().items()):
        torch.manual_seed(200 + i)
        hf = transformers.AutoModelForCausalLM.from_config(config).eval()
        randomise(hf)
        folder = tmp_path_factory.mktemp(key)
        hf.save_pretrained(folder)
        out[key] = folder
    return out


def _decode(folder, dtype, batch: int) -> tuple[torch.Tensor, list[bool]]:
    """Logits of a prefill then STEPS one-token steps for ``batch`` rows, and whether each layer's step
    op applied at the first step."""
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=64, max_batch=batch)
    load_shard(model, folder)
    ids = torch.tensor([PROMPT[: 8 - r] + PROMPT[:r] for r in range(batch)])
    x = torch.zeros(batch, 1, model.spec.hidden_size, dtype=dtype)
    rope = model.rotary(torch.tensor([len(PROMPT)]), dtype)
    taken = [layer.self_attn.one_token_step(x, rope, None) is not None for layer in model.model.layers]
    with torch.no_grad():
        logits = [model.logits(ids)[:, -1]]
        for i in range(STEPS):
            step_ids = torch.tensor([[(PROMPT[i % 8] * (r + 3) + i) % 256] for r in range(batch)])
            logits.append(model.logits(step_ids, len(PROMPT) + i)[:, -1])
    return torch.stack(logits), taken


@pytest.mark.parametrize("key", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 2])
def test_step_equals_torch_ops(folders, key, dtype, batch, monkeypatch):
    fused, taken = _decode(folders[key], dtype, batch)
    assert all(taken), "the compiled step did not apply"
    monkeypatch.setattr(attention.GQAttention, "one_token_step", lambda self, x, rope, slots: None)
    plain, _ = _decode(folders[key], dtype, batch)
    assert torch.equal(fused, plain)


def test_step_not_taken_for_a_sliding_window(folders):
    model = ShardedCausalLM(load_spec(folders["llama"]), ParallelPlan(), 0, torch.float32, max_seq_len=64)
    load_shard(model, folders["llama"])
    attn = model.model.layers[0].self_attn
    rope = model.rotary(torch.tensor([3]), torch.float32)
    x = torch.zeros(1, 1, model.spec.hidden_size)
    assert attn.one_token_step(x, rope, None) is not None
    attn.window = 4
    assert attn.one_token_step(x, rope, None) is None
    attn.window = None
    assert attn.one_token_step(torch.zeros(1, 2, model.spec.hidden_size), rope, None) is None  # two tokens
    assert attn.one_token_step(x, rope, [0]) is None  # cache slots: the per-slot path
