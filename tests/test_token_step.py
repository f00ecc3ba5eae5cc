"""The one-token decode step as bound calls (``runtime.token_step``): bit for bit the module path's hidden states,
step after step, for dense, MoE and int4 / int8 models in float32 and bfloat16; rebuilt when a bound choice changes;
never used where the module path must run (exact mode, a tracer's hooks, cache slots)."""

from __future__ import annotations

import pytest
import torch

from shardwise.plan import ParallelPlan
from shardwise.runtime import int_matmul
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.quantize_checkpoint import quantize_checkpoint
from shardwise.runtime.token_step import TokenStep, token_step

PROMPT = [3, 17, 101, 42, 7, 250, 11]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("token_step")
    wide = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
    llama = make_checkpoint("llama-3.1-8b", "tiny", root / "llama", seed=5, overrides=wide)
    quantize_checkpoint(llama, root / "int4", "int4", compare=False, lm_head=True)
    quantize_checkpoint(llama, root / "int8", "int8", compare=False, lm_head=True)
    moe = make_checkpoint("qwen3-30b-a3b", "tiny", root / "moe", seed=6)
    return {"llama": llama, "int4": root / "int4", "int8": root / "int8", "moe": moe}


def _model(folder, dtype) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=32)
    load_shard(model, folder)
    return model


def _through_modules(model: ShardedCausalLM, token: int, pos: int) -> torch.Tensor:
    """One token through every layer module and the final norm (the path token_step stands in for)."""
    h = model.model.embed_tokens(torch.tensor([[token]]))
    positions = torch.arange(pos, pos + 1)
    rope = model.rotary(positions, model.dtype)
    for layer in model.model.layers:
        h = layer(h, positions, rope)
    return model.model.norm(h)


def _same_steps(folder, dtype, steps: int = 6) -> TokenStep:
    """Two copies of a model decode the same tokens, one through forward (its TokenStep), one through the layer
    modules: every step's hidden state is the same bits. Returns the TokenStep used."""
    fast, slow = _model(folder, dtype), _model(folder, dtype)
    with torch.no_grad():
        for model in (fast, slow):
            model(torch.tensor([PROMPT]), 0)
        token = PROMPT[-1]
        for i in range(steps):
            pos = len(PROMPT) + i
            a = fast(torch.tensor([[token]]), pos)
            b = _through_modules(slow, token, pos)
            assert torch.equal(a, b), f"step {i}: {(a.float() - b.float()).abs().max().item()}"
            token = int(fast.lm_head.greedy(a[:, -1])[0])
    step = fast.__dict__.get("_token_step")
    assert isinstance(step, TokenStep)
    return step


@pytest.mark.parametrize("kind", ["llama", "int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_layers_run_bound_and_give_the_module_bits(folders, kind, dtype):
    step = _same_steps(folders[kind], dtype)
    assert all(attention is not None and mlp is not None for _, attention, mlp in step.parts)


def test_moe_layers_bind_their_attention_and_run_the_moe_module(folders):
    step = _same_steps(folders["moe"], torch.bfloat16)
    assert all(attention is not None and mlp is None for _, attention, mlp in step.parts)


@pytest.mark.skipif(not int_matmul.int8_rows_here(), reason="int8 rows need AVX-512 VNNI")
def test_a_changed_int_activation_setting_rebuilds_the_step(folders, monkeypatch):
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "float")
    before = _same_steps(folders["int4"], torch.bfloat16, steps=2)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    model = _model(folders["int4"], torch.bfloat16)
    h = torch.zeros(1, 1, model.spec.hidden_size, dtype=torch.bfloat16)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "float")
    first = token_step(model, h)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    second = token_step(model, h)
    assert first is not second and first.key != second.key == before.key[:1] + ("int8",)
    _same_steps(folders["int4"], torch.bfloat16, steps=3)  # and int8 rows give the module path's bits too


def test_the_module_path_runs_where_it_must(folders):
    model = _model(folders["llama"], torch.float32)
    h = torch.zeros(1, 1, model.spec.hidden_size)
    assert token_step(model, h) is not None
    with row_blocked():  # exact: every product row-invariant, which the bound products are not
        assert token_step(model, h) is None
    handle = model.model.layers[0].register_forward_pre_hook(lambda *args: None)  # as runtime.trace hooks layer 0
    assert token_step(model, h) is None
    handle.remove()
    assert token_step(model, h.double()) is None
    model.stack_projections()  # weights re-stacked (a reload): the bound step is dropped
    assert "_token_step" not in model.__dict__
