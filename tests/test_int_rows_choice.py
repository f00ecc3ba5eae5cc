"""How bfloat16 rows reach the int8 / int4 kernel (``int_matmul.widens_bfloat16``): as they are (vdpbf16ps) or
widened to float32, whichever this machine measured faster — measured once, stored, followed, overridable — and
both paths giving the same product to float32 rounding."""

from __future__ import annotations

import json

import pytest
import torch

from shardwise.quant import int_codec
from shardwise.runtime.int_matmul import IntWeight


@pytest.fixture
def fresh_rows_choice(tmp_path, monkeypatch):
    """The int kernels' bfloat16-row choice stored under ``tmp_path``, none made yet in this process."""
    from shardwise.runtime import int_matmul

    monkeypatch.setattr(int_matmul, "build_dir", lambda: tmp_path)
    monkeypatch.setattr(int_matmul, "_widened", {})
    monkeypatch.delenv("SHARDWISE_INT_ROWS", raising=False)
    return tmp_path


@pytest.mark.parametrize("bits", [8, 4])
def test_bfloat16_rows_path_is_measured_once_and_followed(fresh_rows_choice, bits):
    """Whether bfloat16 rows reach the int kernel as they are (vdpbf16ps) or widened to float32: measured once
    per machine (each path streaming real packed weights from memory), stored (unless measured beside other
    work), read back by later processes; the module follows it, and both paths give the same product to float32
    rounding (a bfloat16 row widens exactly)."""
    from shardwise.runtime import int_matmul

    if not {"avx512_bf16", "avx512vl"} <= int_matmul.cpp_ops.cpu_flags():
        assert int_matmul.widens_bfloat16(bits)  # no vdpbf16ps path: the row is widened, nothing measured
        assert not list(fresh_rows_choice.iterdir())
        return
    widened = int_matmul.widens_bfloat16(bits)
    path = fresh_rows_choice / f"int-rows-choice-{bits}bit-{torch.get_num_threads()}t.json"
    if path.exists():
        stored = json.loads(path.read_text())
        assert stored["bfloat16"] > 0.5 and stored["float32"] > 0.5, stored  # GB/s over 512 MB
        assert stored["cpu_share"] >= int_matmul.kernel_choice.CONTENDED_SHARE
        assert stored["choice"] == ("float32" if stored["float32"] >= int_matmul.WIDEN_MARGIN * stored["bfloat16"] else "bfloat16")
        assert widened == (stored["choice"] == "float32")
    gen = torch.Generator().manual_seed(bits)
    group = 256 if bits == 8 else 32
    w = torch.randn(40, 256, generator=gen) * 0.05
    q, s = int_codec.encode(w.numpy(), bits, group)
    weight = IntWeight.from_stored(torch.from_numpy(int_codec.pack(q, bits)), torch.from_numpy(s).bfloat16(), bits)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    outputs = {}
    for choice in ("bfloat16", "float32"):  # a stored choice is what a new process follows
        path.write_text(json.dumps({"bfloat16": 1.0, "float32": 1.0, "cpu_share": 1.0, "choice": choice}))
        int_matmul._widened.clear()
        assert int_matmul.widens_bfloat16(bits) == (choice == "float32")
        rows = int_matmul.kernel_rows(x, bits)
        assert rows.dtype == (torch.float32 if choice == "float32" else torch.bfloat16)
        outputs[choice] = weight(x)
        assert torch.equal(outputs[choice], int_matmul.kernel()(rows, weight.q, weight.scale, bits, group, torch.bfloat16))
    exact = x.double() @ weight.dequantized().double().T
    for y in outputs.values():
        torch.testing.assert_close(y.double(), exact, rtol=2**-7, atol=1e-5)


def test_bfloat16_rows_override_and_its_error(fresh_rows_choice, monkeypatch):
    from shardwise.errors import ShardwiseError
    from shardwise.runtime import int_matmul

    for forced, widened in (("float32", True), ("bfloat16", False)):
        monkeypatch.setenv("SHARDWISE_INT_ROWS", forced)
        int_matmul._widened.clear()
        assert int_matmul.widens_bfloat16(4) == widened
    assert not list(fresh_rows_choice.iterdir())  # nothing measured
    monkeypatch.setenv("SHARDWISE_INT_ROWS", "int8")
    int_matmul._widened.clear()
    with pytest.raises(ShardwiseError, match="SHARDWISE_INT_ROWS='int8'.*'bfloat16' or 'float32'"):
        int_matmul.widens_bfloat16(4)
