"""The runtime's ``layers.linear``: a one-row product runs as ``gemv.mv`` — the candidate this machine
measured faster (``gemv.chosen_kernel``): ``torch.mv``, exactly F.linear's bits, or the compiled kernel,
within float32 rounding of them (float32) or F.linear's bits but for an element now and then one
bfloat16 step away (bfloat16; both sum in float32 and round once, in different orders) — for the
shapes a decoder has (odd sizes included); several rows, a bias, or ``row_blocked()`` keep F.linear
itself. The choice: measured once per machine, dtype and thread count, stored, read back, overridable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from conftest import cpu_has
from shardwise.runtime import gemv
from shardwise.runtime.exact import row_blocked
from shardwise.runtime.layers import linear

SHAPES = [(5632, 2048), (2048, 5632), (640, 2048), (32000, 512), (193, 77), (1, 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_one_row_equals_f_linear_bit_for_bit(dtype, out_features, in_features):
    gen = torch.Generator().manual_seed(out_features * 7 + in_features)
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    for shape in [(1, in_features), (1, 1, in_features), (in_features,)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        got, want = linear(x, weight), F.linear(x, weight)
        assert got.shape == want.shape and got.dtype == want.dtype
        kernel = gemv.chosen_kernel(dtype)
        if kernel is None:
            assert torch.equal(got, want), f"{dtype} {tuple(weight.shape)} x{shape}: {(got - want).abs().max()}"
            continue
        assert torch.equal(got.reshape(-1), kernel(weight, x.reshape(-1)))  # the product really is the kernel's
        step = 2.0**-20 * (x.float().abs() @ weight.float().abs().T)  # what float32 sums may differ by
        if dtype == torch.bfloat16:
            step += 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(1e-30))) - 7)  # one bfloat16 step
        off = (got.float() - want.float()).abs()
        assert bool((off <= step).all()), f"{tuple(weight.shape)} x{shape}: {int((off > step).sum())} elements off"


def test_bfloat16_kernel_on_this_machine():
    """Where the CPU has AVX512-BF16 the compiled bfloat16 product is built; one row's float32 sums rounded
    once agree with the float64 product of the same bfloat16 values to within one bfloat16 step."""
    if not cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16: bfloat16 one-row products stay torch.mv")
    op = gemv.rows_kernel(torch.bfloat16)
    assert op is not None
    gen = torch.Generator().manual_seed(5)
    weight, x = torch.randn(300, 1000, generator=gen).bfloat16(), torch.randn(1000, generator=gen).bfloat16()
    exact = (weight.double() @ x.double())
    step = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 7) + 2.0**-20 * (weight.double().abs() @ x.double().abs())
    assert bool(((op(x.view(1, -1), weight).view(-1).double() - exact).abs() <= step).all())


def test_other_cases_are_f_linear():
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 48, generator=gen), torch.randn(96, generator=gen)
    rows = torch.randn(3, 48, generator=gen)
    assert torch.equal(linear(rows, weight), F.linear(rows, weight))
    one = rows[:1]
    assert torch.equal(linear(one, weight, bias), F.linear(one, weight, bias))
    calls = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with row_blocked(), Spy():  # inside the exact mode one row goes through F.linear (made row-invariant there)
        linear(one, weight)
    assert F.linear in calls and torch.mv not in calls


@pytest.fixture
def fresh_choice(tmp_path, monkeypatch):
    """The choice stored under ``tmp_path`` instead of beside the machine's build, none made yet in
    this process."""
    monkeypatch.setattr(gemv.cpp_ops, "build_dir", lambda source: tmp_path)
    monkeypatch.setattr(gemv, "_chosen", {})
    monkeypatch.delenv("SHARDWISE_GEMV", raising=False)
    return tmp_path


def test_choice_is_measured_once_stored_and_read_back(fresh_choice):
    if gemv.rows_kernel(torch.float32) is None:
        pytest.skip("no compiled float32 kernel here (no AVX-512 or no compiler): torch.mv is the only candidate")
    threads = torch.get_num_threads()
    path = fresh_choice / f"gemv-choice-float32-{threads}t.json"
    chosen = gemv.chosen_kernel(torch.float32)
    if path.exists():
        stored = json.loads(path.read_text())
        for name in ("torch_mv", *gemv.KERNELS):
            assert stored[name] > 0.5, stored  # GB/s over 512 MB: real measurements
        best = max(gemv.KERNELS, key=lambda name: stored[name])
        assert stored["choice"] == (best if stored[best] >= gemv.KERNEL_MARGIN * stored["torch_mv"] else "torch_mv")
        assert stored["choice"] != "torch_mv" or stored["cpu_share"] >= gemv.CONTENDED_SHARE
        assert (chosen is not None) == (stored["choice"] != "torch_mv")
    else:  # measured beside other work (the suite's other worker) and torch.mv won: not stored
        assert chosen is None
        stored = {"torch_mv": 1.0, "kernel": 1.0, "kernel_pairs": 1.0, "cpu_share": 1.0}
    weight, x = torch.randn(70, 50), torch.randn(50)
    ops = {"kernel": gemv.rows_kernel(torch.float32), "kernel_pairs": gemv.rows_kernel(torch.float32, pairs=True)}
    for choice in ("torch_mv", *gemv.KERNELS):  # a stored choice is what a new process follows, not measured again
        path.write_text(json.dumps({**stored, "choice": choice}))
        gemv._chosen.clear()
        assert (gemv.chosen_kernel(torch.float32) is not None) == (choice != "torch_mv")
        want = torch.mv(weight, x) if choice == "torch_mv" else ops[choice](x.view(1, -1), weight).view(-1)
        assert torch.equal(gemv.mv(weight, x), want), choice
        assert float((gemv.mv(weight, x) - torch.mv(weight, x)).abs().max()) < 1e-5


def test_a_torch_win_measured_beside_other_work_is_not_stored(fresh_choice):
    """Two processes spinning on this machine's cores while the choice is measured: the measurement sees
    that its threads held under ``CONTENDED_SHARE`` of their cores, and stores its choice only if the
    kernel still won; a torch.mv win serves this process alone (contention slows the kernel's threads
    more: stored, it would slow every later process)."""
    if gemv.rows_kernel(torch.float32) is None:
        pytest.skip("no compiled float32 kernel here: torch.mv is the only candidate")
    threads = torch.get_num_threads()
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(2, os.cpu_count() or 1))]
    try:
        time.sleep(0.3)
        record = gemv._stored_choice(torch.float32, threads)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert record["cpu_share"] < gemv.CONTENDED_SHARE, record
    path = fresh_choice / f"gemv-choice-float32-{threads}t.json"
    assert path.exists() == (record["choice"] != "torch_mv"), record


@pytest.mark.parametrize("forced", ["torch", "kernel", "kernel_pairs"])
def test_environment_overrides_the_choice(fresh_choice, monkeypatch, forced):
    if gemv.rows_kernel(torch.float32) is None:
        pytest.skip("no compiled float32 kernel here: torch.mv is the only candidate")
    monkeypatch.setenv("SHARDWISE_GEMV", forced)
    chosen = gemv.chosen_kernel(torch.float32)
    assert (chosen is not None) == (forced != "torch")
    if chosen is not None:  # the one named: the pairs op is the one under its own name
        weight, x = torch.randn(9, 40), torch.randn(40)
        op = gemv.rows_kernel(torch.float32, pairs=forced == "kernel_pairs")
        assert torch.equal(chosen(weight, x), op(x.view(1, -1), weight).view(-1))
    assert not list(fresh_choice.iterdir())  # nothing measured


def test_unknown_override_is_a_one_line_error(fresh_choice, monkeypatch):
    from shardwise.errors import ShardwiseError

    monkeypatch.setenv("SHARDWISE_GEMV", "fastest")
    with pytest.raises(ShardwiseError, match="SHARDWISE_GEMV='fastest'.*'torch', 'kernel' or 'kernel_pairs'"):
        gemv.chosen_kernel(torch.float32)
