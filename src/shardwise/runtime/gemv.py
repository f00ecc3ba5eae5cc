"""One-row products on CPU (batch-1 decode): ``y = W x`` for a float weight ``W`` [out, in].

Three candidates per dtype, and the fastest on this machine is used, chosen by measuring
(``chosen_kernel``): ``torch.mv`` (F.linear's own bits) and the runtime's compiled kernel in two schedules —
float32: ``shardwise_rows.linear_f32`` (``csrc/row_linear.cpp``, the fixed-order AVX-512 product that
``runtime.exact`` also uses), bfloat16: ``shardwise_rows.linear_bf16_dp`` (the same file's vdpbf16ps
product, where the CPU has AVX512-BF16: one row at a time it is what ``runtime.exact`` uses without
AMX, so plain and exact decode get the same bits there); each thread streams one weight row at a time
(``kernel``) or two (``kernel_pairs``: their ``_pairs`` twins, the same bits). Which wins depends on the CPU
and its BLAS. Measured with two threads, weights cycled so they stream from memory: on an Emerald Rapids Xeon
VM MKL's float32 GEMV streamed 25-30 GB/s (the kernel 24-27: torch.mv kept), on an AMD EPYC (Zen 4) VM
15-17 GB/s against the kernel's 23-27 and ``torch.sum``'s 30 (the kernel chosen: float32 decode
~1.5x faster there); torch's bfloat16 GEMV streamed 8-13 GB/s on both against the kernel's 19-25. On a
Xeon with AMX (2 vCPUs, 540 MB of a decoder's shapes in huge pages, 12 rounds in shuffled order, medians):
bfloat16 one row at a time 23.3-25.3 GB/s, two 24.7-27.4, torch.mv 22.1-24.7; float32 27.1-27.5, 29.3-29.6
and 28.3-28.8 — two streams per thread keep more of that core's misses in flight.
Both sum in float32 and round once, in different orders: the kernels' outputs are within float32
rounding of F.linear's (bfloat16: one bfloat16 step away for an element now and then;
``tests/test_runtime_linear.py``). A non-contiguous weight, a float16 one, or no compiler keep
``torch.mv``. ``csrc/decode_gemv.cpp`` runs a MoE block's routed experts for one row in one call
(``experts_kernel``) through the one-row-at-a-time products (float32: if a kernel is the choice).

The choice is measured once per machine, dtype and thread count, the first time a process needs it
(~0.5 s: the candidates taking turns weight by weight over 512 MB of weights — more than most L3s — best
of four rounds; ``kernel_choice``) and kept in a JSON file beside the kernel's build (``cpp_ops.build_dir``),
under a lock so ranks starting together measure once. ``SHARDWISE_GEMV=torch``, ``=kernel`` or
``=kernel_pairs`` overrides it.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from shardwise.errors import ShardwiseError
from shardwise.runtime import cpp_ops, hugepages, kernel_choice
from shardwise.runtime.kernel_choice import CONTENDED_SHARE

__all__ = ["applies", "chosen_kernel", "chosen_name", "experts_kernel", "mv", "pairs_faster", "row_product", "rows_kernel"]

SOURCE = "decode_gemv.cpp"
ROWS_SOURCE = "row_linear.cpp"
_ROWS_OPS = {torch.float32: "linear_f32", torch.bfloat16: "linear_bf16_dp"}
MEASURE_BYTES = 512 * 1024 * 1024
"""Weight bytes each candidate streams per measuring round (more than any CPU's last-level cache)."""
MEASURE_SHAPES = ((5632, 2048), (2048, 5632), (2048, 2048))
"""Weight shapes cycled while measuring: a decoder's tall, wide and square projections."""
KERNEL_MARGIN = 1.0
"""The compiled kernel is chosen only if it streams at least this many times torch.mv's GB/s (ties: torch.mv). It was
1.05; on a Xeon VM with the kernel's one-row prefetch (row_linear.cpp) the measurement read float32 kernel 34.9 vs
torch.mv 33.8 GB/s (torch.mv kept) while in the 2048x10 llama's decode the kernel ran 16.4-16.9 tok/s against
torch.mv's 15.2-15.5 (processes alternated, best of 3 each): the weight-by-weight measurement understates the
kernel's lead, so any lead counts."""
KERNELS = ("kernel", "kernel_pairs")
"""The compiled candidates: one weight row at a time per thread (``linear_f32`` / ``linear_bf16_dp``), or two
(their ``_pairs`` twins)."""
_chosen: dict[tuple[torch.dtype, int], tuple[str, Callable | None, bool]] = {}


def applies(x: torch.Tensor) -> bool:
    """Whether a one-row product of ``x`` may take this module's paths: on the CPU, and outside
    ``exact.row_blocked()`` (a torch-function mode under which every product is ``F.linear`` made
    row-invariant: a fixed-order kernel or whole row blocks)."""
    return x.device.type == "cpu" and not torch._C._is_torch_function_mode_enabled()


def rows_kernel(dtype: torch.dtype, pairs: bool = False):
    """The compiled ``shardwise_rows`` product ``op(x [M, K], w [N, K])`` for ``dtype`` (``linear_f32``,
    ``linear_bf16_dp``; with ``pairs``, their ``_pairs`` twins: one row of x runs against two weight rows at a
    time, the same bits), or None where this CPU or machine cannot run it (no compiler; no AVX-512 /
    AVX512-BF16: the library registers no such op)."""
    name = _ROWS_OPS.get(dtype)
    return None if name is None else cpp_ops.optional_op(ROWS_SOURCE, "shardwise_rows", name + ("_pairs" if pairs else ""))


def _candidates(dtype: torch.dtype) -> dict[str, Callable]:
    """The compiled one-row products ``fn(weight, x)`` for ``dtype`` by ``KERNELS`` name (none where the
    kernel does not build)."""
    found = {}
    for name in KERNELS:
        op = rows_kernel(dtype, pairs=name == "kernel_pairs")
        if op is not None:
            found[name] = lambda weight, x, op=op: op(x.view(1, -1), weight).view(-1)
    return found


def measure(dtype: torch.dtype, kernels: dict[str, Callable], nbytes: int = MEASURE_BYTES, rounds: int = 4) -> dict[str, float]:
    """GB/s of weight bytes that ``torch.mv`` and each of ``kernels`` (``fn(weight, x)``) stream for one row of
    ``dtype``, best of ``rounds`` over ``nbytes`` of weights shaped as ``MEASURE_SHAPES``, held in huge pages
    where the host gives them (as the loader holds a model's), the candidates taking turns weight by weight
    (``kernel_choice.side_by_side``); and ``cpu_share``, the share of its threads' cores the process held while
    measuring (below ``CONTENDED_SHARE``: other work ran beside it)."""
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
    candidates = {"torch_mv": torch.mv, **kernels}

    def run(name: str, i: int) -> int:
        w = weights[i]
        candidates[name](w, xs[w.shape[1]])
        return w.numel() * size

    return kernel_choice.side_by_side(tuple(candidates), run, len(weights), rounds)


def decide(rates: dict[str, float]) -> str:
    """The choice among measured ``rates`` (GB/s by candidate): the faster compiled kernel if it streams at least
    ``KERNEL_MARGIN`` times torch.mv's GB/s, else ``torch_mv``."""
    best = max((name for name in KERNELS if name in rates), key=lambda name: rates[name], default=None)
    return best if best is not None and rates[best] >= KERNEL_MARGIN * rates["torch_mv"] else "torch_mv"


def chosen_kernel(dtype: torch.dtype) -> Callable | None:
    """The compiled one-row product ``fn(weight, x)`` for ``dtype`` that is the fastest candidate on this
    machine at torch's current thread count, or None (``torch.mv`` is): ``chosen_name``'s."""
    return _choice(dtype)[1]


def chosen_name(dtype: torch.dtype) -> str:
    """Which one-row product this process runs for ``dtype``: ``torch_mv`` or one of ``KERNELS``."""
    return _choice(dtype)[0]


def pairs_faster(dtype: torch.dtype) -> bool:
    """Whether the compiled one-row product streams faster two weight rows at a time (``kernel_pairs``) than one
    (``kernel``) for ``dtype`` here, whichever of the candidates decode runs: ``runtime.exact`` takes its one-row
    fixed-order products in that schedule (the same bits either way). ``SHARDWISE_GEMV=kernel_pairs`` says yes,
    ``=torch`` or ``=kernel`` no."""
    return _choice(dtype)[2]


def _choice(dtype: torch.dtype) -> tuple[str, Callable | None, bool]:
    """(name, compiled product or None, ``pairs_faster``) for ``dtype`` at torch's current thread count: decided
    once per process, from the machine's stored measurement or by measuring (module docstring);
    ``SHARDWISE_GEMV`` overrides it."""
    key = (dtype, torch.get_num_threads())
    if key not in _chosen:
        candidates = _candidates(dtype)
        forced = os.environ.get("SHARDWISE_GEMV", "").strip().lower()
        if forced not in ("", "torch", *KERNELS):
            raise ShardwiseError(f"SHARDWISE_GEMV={forced!r}: set it to 'torch', 'kernel' or 'kernel_pairs', or unset it to measure")
        pairs = forced == "kernel_pairs"
        if not candidates or forced == "torch":
            name = "torch_mv"
        elif forced:
            name = forced if forced in candidates else "torch_mv"
        else:
            record = _stored_choice(dtype, key[1])
            name, pairs = record["choice"], record.get("kernel_pairs", 0.0) > record.get("kernel", 0.0)
        _chosen[key] = (name, candidates.get(name), pairs and "kernel_pairs" in candidates)
    return _chosen[key]


def _stored_choice(dtype: torch.dtype, threads: int) -> dict:
    """This machine's measurement for ``dtype`` at ``threads`` threads: read, or measured and stored — except a
    torch.mv win measured while other work held the cores (``cpu_share`` below ``CONTENDED_SHARE``): that one
    serves its own process and the next one measures again. Contention slows the kernel's threads more than
    torch.mv's (AMD EPYC VM, 2 threads, float32: alone, kernel 27.8-29.5 GB/s and torch.mv 13.6-13.8, cpu_share
    1.0; beside one spinning process 13.0-16.7 and 13.9-16.7, 0.6-0.7; beside two 6.3-6.8 and 18.8-19.9, 0.5),
    and every later process follows a stored choice: one stored during a test run here (kernel 9.1, torch.mv
    14.3 GB/s) halved float32 decode (17.2 -> 7.9 tok/s in benchmarks/bench_decode.py)."""
    path = cpp_ops.build_dir(ROWS_SOURCE) / f"gemv-choice-{str(dtype).removeprefix('torch.')}-{threads}t.json"
    kernels = _candidates(dtype)
    return kernel_choice.stored(path, lambda: measure(dtype, kernels), decide,
                                lambda record: record["choice"] != "torch_mv" or record["cpu_share"] >= CONTENDED_SHARE,
                                ("torch_mv", *kernels))


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
    return row_product(weight)(x.contiguous().view(1, -1)).view(-1)


def row_product(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``mv(weight, ·)`` for one contiguous row ``x`` [1, in] → [1, out], with the product decided now (this
    process's choice for the weight's dtype): the same op and bits without the per-call checks and reshapes, for a
    caller running it every step (``runtime.token_step``)."""
    name = chosen_name(weight.dtype) if weight.is_contiguous() and weight.dtype in _ROWS_OPS else "torch_mv"
    if name in KERNELS:
        op = rows_kernel(weight.dtype, pairs=name == "kernel_pairs")
        return lambda x: op(x, weight)
    return lambda x: torch.mv(weight, x.view(-1)).view(1, -1)
