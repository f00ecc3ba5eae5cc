"""How rows reach the int8 / int4 kernel (``int_matmul.row_path`` / ``int_matmul.float_path``): bfloat16 rows as they
are (vdpbf16ps), on int16 grids or widened to float32, float32 rows through the value table or on int24 grids, one or
two weight rows at a time (two: the kernel's ``pairs``) —
whichever this machine measured faster: measured once, stored, followed, overridable; every path giving the same
product to float32 rounding, and the two-row path the one-row path's bits."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.quant import int_codec
from shardwise.runtime import int_matmul
from shardwise.runtime.int_matmul import IntWeight


@pytest.fixture
def fresh_rows_choice(tmp_path, monkeypatch):
    """The int kernels' row-path choice stored under ``tmp_path``, none made yet in this process."""
    monkeypatch.setattr(int_matmul, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(int_matmul, "_paths", {})
    monkeypatch.delenv("SHARDWISE_INT_ROWS", raising=False)
    monkeypatch.delenv("SHARDWISE_INT_FLOAT_ROWS", raising=False)
    return tmp_path


def _weight(bits: int, rows: int = 40, width: int = 256, seed: int = 0) -> IntWeight:
    w = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 0.05
    q, s = int_codec.encode(w.numpy(), bits, width if bits == 8 else 32)
    return IntWeight.from_stored(torch.from_numpy(int_codec.pack(q, bits)), torch.from_numpy(s).bfloat16(), bits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_row_path_is_measured_once_and_followed(fresh_rows_choice, bits, dtype):
    """bfloat16 rows' path (``row_path``) and float32 rows' (``float_path``): measured once and stored (when there is
    a choice), and what a stored choice says is what ``kernel_rows`` and the weight follow."""
    bf16 = dtype == torch.bfloat16
    names = int_matmul.candidates(bits, dtype)
    stem = "int-rows-choice" if bf16 else "int-float-rows-choice"
    path = fresh_rows_choice / f"{stem}-{bits}bit-{torch.get_num_threads()}t.json"
    chosen_path = int_matmul.row_path if bf16 else int_matmul.float_path
    chosen = chosen_path(bits)
    assert chosen in names and set(names) <= set(int_matmul.ROW_PATHS if bf16 else int_matmul.FLOAT_PATHS)
    if len(names) == 1:  # nothing to choose between on this CPU: nothing measured
        assert not path.exists()
    elif path.exists():  # measured without other work beside it: stored
        stored = json.loads(path.read_text())
        assert all(stored[name] > 0.5 for name in names), stored  # GB/s over 512 MB of packed weights
        assert stored["cpu_share"] >= int_matmul.kernel_choice.CONTENDED_SHARE
        rates = {name: stored[name] for name in names}
        assert stored["choice"] == chosen == (int_matmul.decide_rows(rates) if bf16 else max(rates, key=rates.get))
    weight, x = _weight(bits), torch.randn(1, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    exact = x.double() @ weight.dequantized().double().T
    for choice in names:  # a stored choice is what a new process follows
        path.write_text(json.dumps(dict.fromkeys(names, 1.0) | {"cpu_share": 1.0, "choice": choice}))
        int_matmul._paths.clear()
        assert chosen_path(bits) == choice
        rows, flags = int_matmul.kernel_rows(x, bits, lines=weight.takes_int8_rows)
        assert rows.dtype == (torch.bfloat16 if choice.startswith(("bfloat16", "int16")) else torch.float32)
        assert flags == (choice.endswith("_pairs"), False, choice.startswith(("int16", "int24")))
        y = weight(x)
        assert torch.equal(y, int_matmul.kernel()(rows, weight.q, weight.scale, bits, weight.group, dtype, *flags))
        torch.testing.assert_close(y.double(), exact, rtol=2**-7 if bf16 else 1e-5, atol=1e-5)


def test_decide_rows_widens_only_past_the_margin():
    margin = int_matmul.WIDEN_MARGIN
    assert int_matmul.decide_rows({"bfloat16": 10.0, "float32": 10.0 * margin * 0.99}) == "bfloat16"
    assert int_matmul.decide_rows({"bfloat16": 10.0, "float32": 10.0 * margin}) == "float32"
    assert int_matmul.decide_rows({"bfloat16": 10.0, "float32": 10.0, "float32_pairs": 12.0}) == "float32_pairs"
    assert int_matmul.decide_rows({"float32": 10.0, "float32_pairs": 9.0}) == "float32"
    rates = {"bfloat16": 10.0, "bfloat16_pairs": 11.0, "float32": 11.0, "float32_pairs": 11.5}
    assert int_matmul.decide_rows(rates) == "bfloat16_pairs"  # 11.5 < 1.05 x 11
    assert int_matmul.decide_rows(rates | {"float32_pairs": 11.6}) == "float32_pairs"
    grids = rates | {"int16": 10.5, "int16_pairs": 13.0}  # int16 grids keep the rows' 16 bits: no margin against bfloat16
    assert int_matmul.decide_rows(grids) == "int16_pairs"
    assert int_matmul.decide_rows(grids | {"float32_pairs": 13.0 * margin}) == "float32_pairs"


def _assert_pairs_match(x, q, scale, bits, group, one, grids=False):
    """The ``pairs`` path equals ``one`` (the one-row path's output for ``x``) bit for bit, on 1 and 2 threads, for all
    of ``x``'s rows and for its last row alone (bfloat16 out), and for a slice of the weight's rows (``grids``: the
    integer grids' path)."""
    op = int_matmul.kernel()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(op(x, q, scale, bits, group, None, True, False, grids), one), n
            assert torch.equal(op(x[-1:], q, scale, bits, group, torch.bfloat16, True, False, grids), one[-1:].bfloat16()), n
    finally:
        torch.set_num_threads(threads)
    lo = q.shape[0] // 3
    assert torch.equal(op(x, q[lo:], scale[lo:], bits, group, None, True, False, grids), one[:, lo:])


@pytest.mark.parametrize(("rows", "width", "group"), [(37, 256, 256), (129, 2048, 2048), (64, 100, 100), (9, 384, 32),
                                                      (1, 64, 64), (300, 96, 32)])
def test_two_int8_rows_at_a_time_give_one_rows_bits(rows, width, group):
    """The kernel's ``pairs`` path (int8 weights, float32 rows: two weight rows, half a thread's run apart, per
    pass) gives every output the bits of the one-row path — odd row counts, per-channel rows whose width is no
    multiple of 32, several x rows, any thread count, any slice of the weight."""
    gen = torch.Generator().manual_seed(rows * 7 + width)
    q = torch.randint(-128, 128, (rows, width), dtype=torch.int8, generator=gen)
    scale = (torch.rand(rows, width // group, generator=gen) * 0.02 + 0.001).bfloat16()
    x = torch.randn(3, width, generator=gen)
    one = int_matmul.kernel()(x, q, scale, 8, group)
    _assert_pairs_match(x, q, scale, 8, group, one)
    exact = x.double() @ (q.double() * scale.double().repeat_interleave(group, dim=1)).T
    torch.testing.assert_close(one.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "width", "group", "mxfp4"), [(37, 256, 32, False), (130, 2048, 32, False),
                                                               (9, 384, 64, False), (65, 512, 256, False),
                                                               (1, 128, 128, False), (20, 96, 32, False),
                                                               (37, 256, 32, True), (20, 96, 32, True)])
def test_two_4_bit_rows_at_a_time_give_one_rows_bits(rows, width, group, mxfp4, row_dtype):
    """4-bit weights (the 64-byte-line paths: bfloat16 rows through vdpbf16ps, float32 ones through the value
    table; widths of no whole line take the 32-weight path, which has no pairs) the same, int4 and MXFP4 (E8M0
    scales, E2M1 values): every output the one-row bits, whatever else shares the call."""
    gen = torch.Generator().manual_seed(rows * 11 + width + group)
    q = torch.randint(0, 256, (rows, width // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.randint(118, 130, (rows, width // group), dtype=torch.uint8, generator=gen) if mxfp4
             else (torch.rand(rows, width // group, generator=gen) * 0.1 + 0.01).bfloat16())
    x = torch.randn(3, width, generator=gen).to(row_dtype)
    _assert_pairs_match(x, q, scale, 4, group, int_matmul.kernel()(x, q, scale, 4, group))
    if width % 128 == 0 and int_matmul.int8_rows_here():  # the integer grids' path too
        _assert_pairs_match(x, q, scale, 4, group, int_matmul.kernel()(x, q, scale, 4, group, grids=True), grids=True)


def test_row_path_override_and_its_error(fresh_rows_choice, monkeypatch):
    from shardwise.errors import ShardwiseError

    for env, names, chosen_path in (("SHARDWISE_INT_ROWS", int_matmul.ROW_PATHS, int_matmul.row_path),
                                    ("SHARDWISE_INT_FLOAT_ROWS", int_matmul.FLOAT_PATHS, int_matmul.float_path)):
        for forced in names:
            monkeypatch.setenv(env, forced)
            int_matmul._paths.clear()
            assert chosen_path(8) == forced
    assert not list(fresh_rows_choice.iterdir())  # nothing measured
    monkeypatch.setenv("SHARDWISE_INT_ROWS", "int8")
    int_matmul._paths.clear()
    with pytest.raises(ShardwiseError, match="SHARDWISE_INT_ROWS='int8'.*bfloat16, bfloat16_pairs, float32, float32_pairs"):
        int_matmul.row_path(4)
    monkeypatch.setenv("SHARDWISE_INT_FLOAT_ROWS", "int16")
    with pytest.raises(ShardwiseError, match="SHARDWISE_INT_FLOAT_ROWS='int16'.*float32, float32_pairs, int24, int24_pairs"):
        int_matmul.float_path(4)
