"""One-row products on CPU (batch-1 decode): ``y = W x`` for a float weight ``W`` [out, in].

Two candidates per dtype, and the faster one on this machine is used, chosen by measuring
(``chosen_kernel``): ``torch.mv`` (F.linear's own bits) and the runtime's compiled kernel — float32:
``shardwise_rows.linear_f32`` (``csrc/row_linear.cpp``, the fixed-order AVX-512 product that
``runtime.exact`` also uses), bfloat16: ``shardwise_rows.linear_bf16_dp`` (the same file's vdpbf16ps
product, where the CPU has AVX512-BF16: one row at a time it is what ``runtime.exact`` uses without
AMX, so plain and exact decode get the same bits there). Which wins depends on the CPU and its BLAS. Measured
with two threads, weights cycled so they stream from memory: on an Emerald Rapids Xeon VM MKL's
float32 GEMV streamed 25-30 GB/s (the kernel 24-27: torch.mv kept), on an AMD EPYC (Zen 4) VM
15-17 GB/s against the kernel's 23-27 and ``torch.sum``'s 30 (the kernel chosen: float32 decode
~1.5x faster there); torch's bfloat16 GEMV streamed 8-13 GB/s on both against the kernel's 19-25.
Both sum in float32 and round once, in different orders: the kernels' outputs are within float32
rounding of F.linear's (bfloat16: one bfloat16 step away for an element now and then;
``tests/test_runtime_linear.py``). A non-contiguous weight, a float16 one, or no compiler keep
``torch.mv``. ``csrc/decode_gemv.cpp`` runs a MoE block's routed experts for one row in one call
(``experts_kernel``) through the same products (float32: the chosen one).

The choice is measured once per machine, dtype and thread count, the first time a process needs it
(~0.5 s: the candidates taking turns weight by weight over 512 MB of weights — more than any L3 — best
of four rounds) and kept in a JSON file beside the kernel's build (``cpp_ops.build_dir``), under a lock so
ranks starting together measure once. ``SHARDWISE_GEMV=torch`` or ``=kernel`` overrides it.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable

import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime import cpp_ops, hugepages

__all__ = ["applies", "chosen_kernel", "experts_kernel", "mv", "rows_kernel"]

SOURCE = "decode_gemv.cpp"
ROWS_SOURCE = "row_linear.cpp"
_ROWS_OPS = {torch.float32: "linear_f32", torch.bfloat16: "linear_bf16_dp"}
MEASURE_BYTES = 512 * 1024 * 1024
"""Weight bytes each candidate streams per measuring round (more than any CPU's last-level cache)."""
MEASURE_SHAPES = ((5632, 2048), (2048, 5632), (2048, 2048))
"""Weight shapes cycled while measuring: a decoder's tall, wide and square projections."""
KERNEL_MARGIN = 1.05
"""The compiled kernel is chosen only if it streams at least this many times torch.mv's GB/s."""
CONTENDED_SHARE = 0.85
"""A measurement whose threads held less than this share of their cores (the process's CPU time over wall time x
threads) was taken beside other work; a torch.mv win from it is not stored (``_stored_choice``)."""
_chosen: dict[tuple[torch.dtype, int], Callable | None] = {}


def applies(x: torch.Tensor) -> bool:
    """Whether a one-row product of ``x`` may take this module's paths: on the CPU, and outside
    ``exact.row_blocked()`` (a torch-function mode under which every product is ``F.linear`` made
    row-invariant: a fixed-order kernel or whole row blocks)."""
    return x.device.type == "cpu" and not torch._C._is_torch_function_mode_enabled()


def rows_kernel(dtype: torch.dtype):
    """The compiled ``shardwise_rows`` product ``op(x [M, K], w [N, K])`` for ``dtype`` (``linear_f32``,
    ``linear_bf16_dp``), or None where this CPU or machine cannot run it (no compiler; no AVX-512 /
    AVX512-BF16: the library registers no such op)."""
    name = _ROWS_OPS.get(dtype)
    return None if name is None else cpp_ops.optional_op(ROWS_SOURCE, "shardwise_rows", name)


def _candidate(dtype: torch.dtype) -> Callable | None:
    """``fn(weight, x)``: the compiled one-row product for ``dtype``, or None."""
    op = rows_kernel(dtype)
    return None if op is None else (lambda weight, x: op(x.view(1, -1), weight).view(-1))


def measure(dtype: torch.dtype, kernel: Callable, nbytes: int = MEASURE_BYTES, rounds: int = 4) -> dict[str, float]:
    """GB/s of weight bytes that ``torch.mv`` and ``kernel(weight, x)`` stream for one row of ``dtype``, best of
    ``rounds`` over ``nbytes`` of weights shaped as ``MEASURE_SHAPES``, held in huge pages where the host gives
    them (as the loader holds a model's); and ``cpu_share``, the share of its threads' cores the process held
    while measuring (below ``CONTENDED_SHARE``: other work ran beside it). Within a round the candidates take
    turns weight by weight (each on
    its own weights, none read from cache; the next round swaps them), so a noisy neighbour's burst slows
    both alike: with whole rounds alternating, one taken while the CPU was busy once stored torch.mv as the
    choice at half the kernel's speed."""
    size = torch.empty(0, dtype=dtype).element_size()
    shapes = MEASURE_SHAPES * -(-nbytes // (size * sum(r * c for r, c in MEASURE_SHAPES)))
    total = size * sum(r * c for r, c in shapes)
    memory = hugepages.arena(total)  # where the loader puts a model's weights (hugepages.place)
    if memory is None:
        memory = torch.empty(total, dtype=torch.uint8)
    weights, start = [], 0
    for rows, cols in shapes:
        weights.append(memory[start : start + rows * cols * size].view(dtype).view(rows, cols).fill_(0.5))  # mapped
        start += rows * cols * size
    xs = {k: torch.full((k,), 0.01, dtype=dtype) for k in {s[1] for s in MEASURE_SHAPES}}
    candidates = (("torch_mv", torch.mv), ("kernel", kernel))
    best = {"torch_mv": 0.0, "kernel": 0.0}
    wall, cpu = time.perf_counter(), time.process_time()
    for r in range(rounds):
        spent, moved = {"torch_mv": 0.0, "kernel": 0.0}, {"torch_mv": 0, "kernel": 0}
        for i, w in enumerate(weights):
            name, fn = candidates[(i + r) % 2]
            start = time.perf_counter()
            fn(w, xs[w.shape[1]])
            spent[name] += time.perf_counter() - start
            moved[name] += w.numel() * size
        for name in best:
            best[name] = max(best[name], moved[name] / spent[name] / 1e9)
    share = (time.process_time() - cpu) / ((time.perf_counter() - wall) * torch.get_num_threads())
    return {**best, "cpu_share": share}


def chosen_kernel(dtype: torch.dtype) -> Callable | None:
    """The compiled one-row product ``fn(weight, x)`` for ``dtype`` if it is the faster candidate on this
    machine at torch's current thread count, else None (``torch.mv``). Decided once per process, from
    the machine's stored measurement or by measuring (module docstring)."""
    key = (dtype, torch.get_num_threads())
    if key not in _chosen:
        candidate = _candidate(dtype)
        forced = os.environ.get("SHARDWISE_GEMV", "").strip().lower()
        if forced not in ("", "torch", "kernel"):
            raise ShardwiseError(f"SHARDWISE_GEMV={forced!r}: set it to 'torch' or 'kernel', or unset it to measure")
        if candidate is None or forced == "torch":
            _chosen[key] = None
        elif forced == "kernel":
            _chosen[key] = candidate
        else:
            _chosen[key] = candidate if _stored_choice(candidate, dtype, key[1])["choice"] == "kernel" else None
    return _chosen[key]


def _stored_choice(candidate: Callable, dtype: torch.dtype, threads: int) -> dict:
    """This machine's measurement for ``dtype`` at ``threads`` threads: read, or measured and stored — except a
    torch.mv win measured while other work held the cores (``cpu_share`` below ``CONTENDED_SHARE``): that one
    serves its own process and the next one measures again. Contention slows the kernel's threads more than
    torch.mv's (AMD EPYC VM, 2 threads, float32: alone, kernel 27.8-29.5 GB/s and torch.mv 13.6-13.8, cpu_share
    1.0; beside one spinning process 13.0-16.7 and 13.9-16.7, 0.6-0.7; beside two 6.3-6.8 and 18.8-19.9, 0.5),
    and every later process follows a stored choice: one stored during a test run here (kernel 9.1, torch.mv
    14.3 GB/s) halved float32 decode (17.2 -> 7.9 tok/s in benchmarks/bench_decode.py)."""
    path = cpp_ops.build_dir(ROWS_SOURCE) / f"gemv-choice-{str(dtype).removeprefix('torch.')}-{threads}t.json"
    with open(path.with_suffix(".flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            record = json.loads(path.read_text())
            if "cpu_share" in record:  # older records (without it) may hold such a win: measured again
                return record
        except (OSError, ValueError):
            pass
        rates = measure(dtype, candidate)
        record = {**rates, "choice": "kernel" if rates["kernel"] >= KERNEL_MARGIN * rates["torch_mv"] else "torch_mv"}
        if record["choice"] == "kernel" or rates["cpu_share"] >= CONTENDED_SHARE:
            path.write_text(json.dumps(record))
        return record


def experts_kernel(dtype: torch.dtype):
    """The compiled ``shardwise_gemv.experts_row(x, gate_up[], down[], weights, slots, out)`` op for
    experts of ``dtype`` (``moe.SparseMoE``'s one-row step), or None: no compiler, a dtype other than
    float32, or bfloat16 without its ``rows_kernel``."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and rows_kernel(dtype) is not None):
        op = cpp_ops.optional_op(SOURCE, "shardwise_gemv", "experts_row")
        if op is not None:
            fixed_order = dtype == torch.float32 and chosen_kernel(dtype) is not None
            return lambda x, gate_up, down, weights, slots, out: op(x, gate_up, down, weights, slots, out, fixed_order)
    return None


def mv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] times the CPU vector ``x`` [in] of the same dtype → [out] in that dtype."""
    if weight.is_contiguous() and weight.dtype in (torch.float32, torch.bfloat16):
        op = chosen_kernel(weight.dtype)
        if op is not None:
            return op(weight, x.contiguous())
    return torch.mv(weight, x)
