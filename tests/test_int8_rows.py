"""int8 / int4 / MXFP4 weights against rows rounded to int8 (``SHARDWISE_INT_ACTIVATIONS=int8``: llama.cpp's Q8_0 / Q4_0 /
MXFP4 x Q8_0 arithmetic, ``csrc/int_matmul_q8.h``): the kernel equals an independent reference of that arithmetic, a row's
result does not depend on the rows beside it or on the two-row schedule, a model's output stays within the rounding's
own bound of the float-row one, speculative decoding still equals plain decoding, and bad settings are named."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import int_llamas, run_cli
from shardwise.errors import ShardwiseError
from shardwise.plan import ParallelPlan
from shardwise.quant.mxfp4_codec import E2M1_VALUES
from shardwise.runtime import cpp_ops, int_matmul
from shardwise.runtime.checkpoint import make_checkpoint
from shardwise.runtime.drafters import PromptLookup
from shardwise.runtime.generate import SamplingParams, generate
from shardwise.runtime.int_matmul import IntWeight
from shardwise.runtime.loader import load_shard, load_spec
from shardwise.runtime.model import ShardedCausalLM
from shardwise.runtime.speculative import speculative_generate

pytestmark = pytest.mark.skipif(not int_matmul.int8_rows_here(),
                                reason="int8 rows need AVX-512 VNNI")


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the int8 rows stand for it, in float64: each 32-block's step d = max|x| / 127 (float32), its
    values round-half-even(x * (1 / d)) times d."""
    blocks = x.float().view(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(blocks * inv).double() * d.double()).view(x.shape)


def _unpacked(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The weight [N, K] in float64: element 2j in byte j's low nibble, 2j+1 in its high one, each minus 8 times
    its group's scale — or, for uint8 (E8M0) scales, MXFP4: each nibble's E2M1 value times 2^(scale - 127)."""
    nibbles = torch.stack([q & 15, q >> 4], dim=-1).view(q.shape[0], -1).long()
    if scale.dtype == torch.uint8:
        values = torch.from_numpy(E2M1_VALUES).double()[nibbles]
        return values * torch.ldexp(torch.ones(scale.shape, dtype=torch.float64), scale.long() - 127).repeat_interleave(group, dim=1)
    return (nibbles - 8).double() * scale.double().repeat_interleave(group, dim=1)


@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width", "group", "m", "mxfp4"), [(37, 256, 32, 1, False), (130, 2048, 32, 3, False),
                                                                     (9, 384, 64, 2, False), (65, 512, 256, 1, False),
                                                                     (1, 128, 128, 4, False), (37, 256, 32, 2, True),
                                                                     (130, 2048, 32, 1, True)])
def test_kernel_is_the_q8_arithmetic_and_row_invariant(rows, width, group, m, mxfp4, row_dtype):
    gen = torch.Generator().manual_seed(rows + width + group)
    q = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.randint(118, 130, (rows, width // group), dtype=torch.uint8, generator=gen) if mxfp4
             else (torch.rand(rows, width // group, generator=gen) * 0.1 + 0.01).bfloat16())
    x = (torch.randn(m, width, generator=gen) * torch.logspace(-3, 1, width)).to(row_dtype)  # blocks of unlike size
    x[0, :32] = 0  # an all-zero block: step 0
    op = int_matmul.kernel()
    y = op(x, q, scale, 4, group, None, False, True)
    expected = _rounded(x) @ _unpacked(q, scale, group).T
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    assert torch.equal(op(x, q, scale, 4, group, None, True, True), y)  # two weight rows at a time: the same bits
    for i in range(m):  # each row alone: the same bits as beside the others
        assert torch.equal(op(x[i : i + 1].contiguous(), q, scale, 4, group, None, False, True), y[i : i + 1])
    x[1 % m, 5] = float("nan")
    assert op(x, q, scale, 4, group, None, False, True)[1 % m].isnan().all()  # a NaN is not rounded away
    with pytest.raises(RuntimeError, match="q8 takes rows a multiple of 128"):
        op(x, q.view(torch.int8).repeat(1, 2), torch.ones(rows, width // 32), 8, 32, None, False, True)


@pytest.mark.parametrize("row_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "width", "group", "m"), [(37, 256, 256, 1), (130, 2048, 2048, 3), (9, 384, 64, 2),
                                                            (65, 512, 128, 1)])
def test_int8_weights_take_the_q8_arithmetic_too(rows, width, group, m, row_dtype):
    """int8 weights (per channel or in groups of k*64) against int8 rows: llama.cpp's Q8_0 x Q8_0 arithmetic."""
    gen = torch.Generator().manual_seed(rows * 7 + width + group)
    q = torch.randint(-127, 128, (rows, width), dtype=torch.int8, generator=gen)
    scale = (torch.rand(rows, width // group, generator=gen) * 0.01 + 0.001).to(row_dtype)
    x = (torch.randn(m, width, generator=gen) * torch.logspace(-2, 1, width)).to(row_dtype)
    op = int_matmul.kernel()
    y = op(x, q, scale, 8, group, None, False, True)
    expected = _rounded(x) @ (q.double() * scale.double().repeat_interleave(group, dim=1)).T
    torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-6 * expected.abs().max().item())
    assert torch.equal(op(x, q, scale, 8, group, None, True, True), y)
    for i in range(m):
        assert torch.equal(op(x[i : i + 1].contiguous(), q, scale, 8, group, None, False, True), y[i : i + 1])
    assert not torch.equal(y, op(x, q, scale, 8, group, None, False, False))  # rounded: not the float rows' sums


def _weight(width: int = 512, rows: int = 48) -> IntWeight:
    from shardwise.quant import int_codec

    w = torch.randn(rows, width, generator=torch.Generator().manual_seed(3)) * 0.05
    q, s = int_codec.encode(w.numpy(), 4, 32)
    return IntWeight.from_stored(torch.from_numpy(int_codec.pack(q, 4)), torch.from_numpy(s).bfloat16(), 4)


def test_weight_follows_the_setting_within_the_roundings_bound(monkeypatch):
    weight = _weight()
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(4))
    monkeypatch.delenv("SHARDWISE_INT_ACTIVATIONS", raising=False)
    assert int_matmul.activations() == "float"
    floats = weight(x)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    assert int_matmul.activations() == "int8" and weight.takes_int8_rows
    rounded = weight(x)
    w = weight.dequantized().double()
    # |x - rounded x| <= d / 2 per element: the products move by at most sum |w| d / 2, plus float32 sums' rounding
    d = x.view(1, -1, 32).abs().amax(-1) / 127
    bound = (w.abs().view(w.shape[0], -1, 32).sum(-1) * d.double() / 2).sum(-1) + 1e-5
    gap = (rounded.double() - floats.double()).abs()[0]
    assert (gap <= bound).all() and gap.max() > 0  # rounded, and no further than the rounding allows
    torch.testing.assert_close(rounded.double(), _rounded(x) @ w.T, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int4")
    with pytest.raises(ShardwiseError, match="SHARDWISE_INT_ACTIVATIONS 'int4': use one of float, int8"):
        weight(x)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    monkeypatch.setattr(cpp_ops, "cpu_flags", lambda: frozenset({"avx2"}))
    with pytest.raises(ShardwiseError, match="SHARDWISE_INT_ACTIVATIONS int8 needs a CPU with AVX-512 VNNI"):
        weight(x)


def test_run_and_serve_take_the_setting(four_bit, monkeypatch):
    """``--int-activations`` reaches the ranks (the run's JSON says what they used; the tokens differ from float rows
    only as the rounding allows: here, on this tiny random model, they are checked equal to a direct int8-row run);
    a bad value is one line, before any rank starts."""
    ids = "3,17,101,42,7,250,11,64"
    docs = {}
    for value in ("float", "int8"):
        proc = run_cli("run", str(four_bit["int4"]), "--tp", "1", "--prompt-ids", ids, "--max-new-tokens", "6",
                       "--int-activations", value, "--json")
        assert proc.returncode == 0, proc.stderr
        docs[value] = json.loads(proc.stdout)
        assert docs[value]["int_activations"] == value
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    direct = generate(_model(four_bit["int4"]), [3, 17, 101, 42, 7, 250, 11, 64], 6, SamplingParams()).tokens
    assert docs["int8"]["tokens"] == direct
    for verb in ("run", "serve"):
        proc = run_cli(verb, str(four_bit["int4"]), "--tp", "1", "--int-activations", "int4")
        assert proc.returncode == 2 and proc.stderr.strip() == "error: --int-activations 'int4': use one of float, int8"


@pytest.mark.parametrize("bits", [8, 4])
def test_pairs_choice_is_measured_once_and_followed(tmp_path, monkeypatch, bits):
    monkeypatch.setattr(int_matmul, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(int_matmul, "_q8_pairs", {})
    path = tmp_path / f"int8-rows-choice-{bits}bit-{torch.get_num_threads()}t.json"
    chosen = int_matmul.q8_pairs(bits)
    if path.exists():  # measured without other work beside it: stored
        stored = json.loads(path.read_text())
        assert all(stored[name] > 0.5 for name in int_matmul.Q8_PATHS), stored  # GB/s of packed weights
        assert chosen == (stored["choice"] == "int8_pairs") == (stored["int8_pairs"] > stored["int8"])
    for choice in int_matmul.Q8_PATHS:
        path.write_text(json.dumps({"int8": 1.0, "int8_pairs": 1.0, "cpu_share": 1.0, "choice": choice}))
        int_matmul._q8_pairs.clear()
        assert int_matmul.q8_pairs(bits) == (choice == "int8_pairs")


@pytest.fixture(scope="module")
def four_bit(tmp_path_factory) -> dict[str, object]:
    """A llama quantized to int4 and to int8 (LM heads too) and a gpt-oss with MXFP4 experts, rows 256 wide."""
    root = tmp_path_factory.mktemp("q8")
    llamas = int_llamas(root, seed=21)
    mxfp4 = make_checkpoint("gpt-oss-20b", "tiny", root / "mxfp4", seed=22, quant="mxfp4",
                            overrides={"hidden_size": 256, "intermediate_size": 256, "head_dim": 64})
    return {"int4": llamas["int4"], "int8": llamas["int8"], "mxfp4": mxfp4}


def _model(folder, dtype=torch.float32, max_step_tokens: int = 1) -> ShardedCausalLM:
    model = ShardedCausalLM(load_spec(folder), ParallelPlan(), 0, dtype, max_seq_len=64, max_step_tokens=max_step_tokens)
    load_shard(model, folder)
    return model


@pytest.mark.parametrize(("kind", "dtype"), [("int4", torch.float32), ("int4", torch.bfloat16), ("int8", torch.bfloat16),
                                           ("mxfp4", torch.bfloat16)])
def test_model_runs_on_int8_rows_and_speculation_still_equals_plain(four_bit, kind, dtype, monkeypatch):
    prompt = [3, 17, 101, 42, 7, 250, 11, 64, 3, 17, 101]
    folder = four_bit[kind]
    model = _model(folder, dtype)
    weights = [m for m in model.modules() if isinstance(m, IntWeight)]
    assert kind == "mxfp4" or (weights and all(w.takes_int8_rows for w in weights))  # all int products take them
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "float")
    floats = generate(model, prompt, 12, SamplingParams(), eos=set(), exact=True)
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    plain = generate(model, prompt, 12, SamplingParams(), eos=set(), exact=True)
    with torch.no_grad():
        logits8 = model.logits(torch.tensor([prompt[:1]]))
        monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "float")
        logits = model.logits(torch.tensor([prompt[:1]]))
    assert not torch.equal(logits8, logits)  # the setting reached the products
    torch.testing.assert_close(logits8.float(), logits.float(), rtol=0.05, atol=0.05 * logits.abs().max().item())
    assert len(plain.tokens) == len(floats.tokens) == 12
    monkeypatch.setenv("SHARDWISE_INT_ACTIVATIONS", "int8")
    for k in (1, 3):
        spec = speculative_generate(_model(folder, dtype, max_step_tokens=k + 1), prompt, 12, PromptLookup(1, 3), k,
                                    eos=set())
        assert spec.tokens == plain.tokens, k
