"""SwiGLU of a stacked gate|up product in one compiled call (``csrc/swiglu.cpp``): every element torch's
``F.silu(gate) * up`` bit for bit, and the bound decode step (``runtime.token_step``) takes it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import int_llamas

from shardwise.plan import ParallelPlan
from shardwise.runtime import cpp_ops
from shardwise.runtime.generate import generate
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM

op = cpp_ops.optional_op("swiglu.cpp", "shardwise_act", "silu_mul")
pytestmark = pytest.mark.skipif(op is None, reason="the SwiGLU op builds for AVX-512 only")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width"), [(1, 64), (5, 384), (2, 5632)])
def test_silu_mul_is_torchs_bits(dtype, rows, width):
    gen = torch.Generator().manual_seed(width + rows)
    for scale in (0.01, 1.0, 8.0, 120.0):
        gate_up = (torch.randn(rows, 2 * width, generator=gen) * scale).to(dtype)
        gate, up = gate_up.split(width, dim=-1)
        assert torch.equal(op(gate_up), F.silu(gate) * up), (scale, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_edge_values(dtype):
    specials = [0.0, -0.0, 1e-40, -1e-40, 88.7, -88.7, 89.0, -104.0, 1e30, -1e30, math.inf, -math.inf]
    gate = torch.tensor(specials * 6)[:64]
    gate_up = torch.cat([gate, torch.linspace(-3, 3, 64)]).view(1, 128).to(dtype)
    out = op(gate_up)
    assert _same(out, F.silu(gate_up[:, :64]) * gate_up[:, 64:])
    nan = gate_up.clone()
    nan[0, 3] = math.nan
    assert bool(op(nan)[0, 3].isnan()) and _same(op(nan)[0, 4:], out[0, 4:])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits but for NaN's payload: NaN where the other is, equal elsewhere."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a[~a.isnan()], b[~b.isnan()])


def test_silu_mul_refuses_widths_torch_would_finish_in_scalar_code():
    with pytest.raises(RuntimeError, match="n a multiple of 64"):
        op(torch.zeros(1, 96))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(torch.zeros(1, 128, dtype=torch.float16))


def test_the_bound_decode_step_takes_it(llama_dir, monkeypatch):
    """The tiny llama's MLPs (width 384) run it in every decode step, and greedy decoding gives the tokens the layer
    modules give (tests/test_token_step.py holds every step's bits)."""
    calls = []
    real = cpp_ops.optional_op

    def counting(source, namespace, name):
        found = real(source, namespace, name)
        if name != "silu_mul" or found is None:
            return found
        return lambda gate_up: calls.append(tuple(gate_up.shape)) or found(gate_up)

    monkeypatch.setattr(cpp_ops, "optional_op", counting)
    tokens = generate(_model(llama_dir), [3, 17, 101, 42], 5).tokens
    assert len(calls) >= 4 * 2 and set(calls) == {(1, 768)}
    modules = _model(llama_dir)
    modules.model.layers[0].register_forward_hook(lambda *_: None)  # a hooked layer: the modules run
    assert tokens == generate(modules, [3, 17, 101, 42], 5).tokens


def _model(folder) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, torch.bfloat16, max_seq_len=32)
    load_shard(model, folder)
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return int_llamas(tmp_path_factory.mktemp("swiglu"), seed=9)["float"]
