"""The one-token decode step as bound calls (``runtime.token_step``): bit for bit the module path's hidden states,
step after step, for dense, MoE and int4 / int8 models in float32 and bfloat16, plain and exact (under
``row_blocked``), in cache row 0 and in a cache slot (serving's decode of one sequence); rebuilt when a bound choice
changes; never used where the module path must run (other modes, a tracer's hooks, a slot beside an unbound part)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import int_llamas
from shardwise.plan import ParallelPlan
from shardwise.runtime import gemv, int_matmul
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.token_step import TokenStep, token_step

PROMPT = [3, 17, 101, 42, 7, 250, 11]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("token_step")
    llamas = int_llamas(root, seed=5)
    moe = make_checkpoint("qwen3-30b-a3b", "tiny", root / "moe", seed=6)
    sinks = make_checkpoint("gpt-oss-20b", "tiny", root / "sinks", seed=7)
    return {"llama": llamas["float"], "int4": llamas["int4"], "int8": llamas["int8"], "moe": moe, "sinks": sinks}


def _model(folder, dtype) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=32, max_batch=3)
    load_shard(model, folder)
    return model


def _through_modules(model: ShardedCausalLM, token: int, pos: int, slot: int | None) -> torch.Tensor:
    """One token through every layer module and the final norm (the path token_step stands in for), in cache row 0
    or (``slot``) as forward runs a batch of cache slots."""
    ids = torch.tensor([[token]])
    if slot is None:
        positions = torch.arange(pos, pos + 1)
        return model._run(ids, positions, model.rotary(positions, model.dtype), None)
    positions = torch.tensor([[pos]])
    cos, sin = model.rotary(positions, model.dtype)
    return model._run(ids, positions, (cos.unsqueeze(1), sin.unsqueeze(1)), [slot])


def _same_steps(folder, dtype, steps: int = 6, exact: bool = False, slot: int | None = None) -> TokenStep:
    """Two copies of a model decode the same tokens (under ``row_blocked`` with ``exact``), one through forward (its
    TokenStep), one through the layer modules: every step's hidden state is the same bits. Returns the TokenStep."""
    fast, slow = _model(folder, dtype), _model(folder, dtype)
    mode = row_blocked() if exact else contextlib.nullcontext()
    with torch.no_grad(), mode:
        for model in (fast, slow):
            if slot is None:
                model(torch.tensor([PROMPT]), 0)
            else:
                model(torch.tensor([PROMPT]), [0], slots=[slot])
        token = PROMPT[-1]
        for i in range(steps):
            pos = len(PROMPT) + i
            a = fast(torch.tensor([[token]]), pos) if slot is None else fast(torch.tensor([[token]]), [pos], slots=[slot])
            b = _through_modules(slow, token, pos, slot)
            assert torch.equal(a, b), f"step {i}: {(a.float() - b.float()).abs().max().item()}"
            token = int(fast.lm_head.greedy(a[:, -1])[0])
    step = fast.__dict__.get("_token_step")
    assert isinstance(step, TokenStep) and step.key[-1] == exact
    return step


@pytest.mark.parametrize("kind", ["llama", "int4", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("exact", [False, True])
def test_dense_layers_run_bound_and_give_the_module_bits(folders, kind, dtype, exact):
    step = _same_steps(folders[kind], dtype, exact=exact)
    assert all(attention is not None and mlp is not None for _, attention, mlp in step.parts)


@pytest.mark.parametrize("exact", [False, True])
def test_one_sequence_in_a_cache_slot_runs_bound_too(folders, exact):
    """Serving decodes one sequence in its own cache slot (under row_blocked): the step writes and reads that slot."""
    step = _same_steps(folders["int4"], torch.bfloat16, exact=exact, slot=2)
    assert step.every_attention_bound


@pytest.mark.parametrize("slot", [None, 1])
def test_moe_layers_bind_their_attention_and_run_the_moe_module(folders, slot):
    step = _same_steps(folders["moe"], torch.bfloat16, exact=True, slot=slot)
    assert all(attention is not None and mlp is None for _, attention, mlp in step.parts)


def test_a_slot_beside_an_unbound_attention_takes_the_modules(folders):
    model = _model(folders["sinks"], torch.bfloat16)  # gpt-oss: attention sinks, sliding windows, MoE
    assert token_step(model) is not None and token_step(model, 1) is None


@pytest.mark.skipif(not int_matmul.int8_rows_here(), reason="int8 rows need AVX-512 VNNI")
def test_a_changed_int_activation_setting_rebuilds_the_step(folders, monkeypatch):
    model = _model(folders["int4"], torch.bfloat16)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "float")
    first = token_step(model)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    second = token_step(model)
    assert first is not second and first.key[1:] == ("float", False) and second.key[1:] == ("int8", False)
    _same_steps(folders["int4"], torch.bfloat16, steps=3)  # int8 rows give the module path's bits too


def test_the_module_path_runs_where_it_must(folders):
    model = _model(folders["llama"], torch.float32)
    assert token_step(model) is not None
    with row_blocked(vector_kernels=False):  # serving's prefill mode: products not the one-row kind's
        assert token_step(model) is None
    with row_blocked(), row_blocked():
        assert token_step(model) is None
    handle = model.model.layers[0].register_forward_pre_hook(lambda *args: None)  # as runtime.trace hooks layer 0
    assert token_step(model) is None
    handle.remove()
    model.stack_projections()  # weights re-stacked (a reload): the bound step is dropped
    assert "_token_step" not in model.__dict__
    assert token_step(_model(folders["llama"], torch.float16)) is None


def test_an_exact_step_binds_the_row_invariant_products_not_the_plain_ones(folders, monkeypatch):
    monkeypatch.setattr(gemv, "_chosen", {})
    monkeypatch.setenv("SHARDWISE_GEMV", "torch")  # plain one-row products would be torch.mv

    def no_mv(*args):
        raise AssertionError("torch.mv ran in an exact step")

    monkeypatch.setattr(torch, "mv", no_mv)
    _same_steps(folders["llama"], torch.float32, steps=2, exact=True)
    with pytest.raises(AssertionError, match="torch.mv ran"):
        _same_steps(folders["llama"], torch.float32, steps=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int_layer_halves_run_as_one_call_each(folders, monkeypatch, dtype):
    """Packed int weights on one rank: each layer half is one compiled call (csrc/layer_step.cpp), with the modules'
    bits (``_same_steps``); dense weights keep the separate bound calls."""
    from shardwise.runtime import cpp_ops

    calls, real = [], cpp_ops.optional_op

    def counting(source, namespace, name):
        found = real(source, namespace, name)
        if namespace != "shardwise_layer" or found is None:
            return found
        return lambda *args: calls.append(name) or found(*args)

    monkeypatch.setattr(cpp_ops, "optional_op", counting)
    _same_steps(folders["int4"], dtype, steps=3)
    layers = _model(folders["int4"], dtype).model.layers
    assert calls.count("int_attention") == calls.count("int_mlp") >= 3 * len(layers)
    calls.clear()
    _same_steps(folders["llama"], dtype, steps=2)
    assert not calls
