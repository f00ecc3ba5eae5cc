"""Weight-only int8 / int4 Linears on CPU: the weights stay packed in memory and are turned
into float in registers by a small compiled kernel (``csrc/int_matmul.cpp``).

Why a kernel of our own (``benchmarks/bench_int_matmul.py``, 5632×2048, one row, two threads, this
VM's Xeon, one run): torch's ``_weight_int8pack_mm`` takes 9.5 ms for a float32 row — 7× the
1.4 ms of float32 ``torch.mv`` on the float weight it replaces (0.71 ms with a bfloat16 row, about
ours); ``_weight_int4pack_mm_for_cpu`` needs a zero point beside every group scale (more bytes than
the checkpoint holds) and bfloat16 rows. Ours: int8 0.65 ms, int4 (groups of 32) 0.71 ms, float32
or bfloat16 rows. The int4 path is bound by unpacking, not by memory: a float32 row costs a widening
and two table lookups per 32 weights. A bfloat16 row (a bfloat16 model) on a CPU with AVX512-BF16
takes a shorter path — the nibbles become bfloat16 by one table lookup per 32 weights and vdpbf16ps
multiplies 32 of them by x per instruction, each product exact — measured side by side in one process
(24 weights of 5632×2048, two threads): 13.2-13.5 GB/s of packed bytes against 9.5-9.9 for the
float32 path (``sum()`` of a tensor that size: 15-17 GB/s); a decode step of the 2048×10 llama's
int4 checkpoint in bfloat16: 1.31× the float32 path (best of four rounds each, alternated). int8 weights against a
bfloat16 row take the same instruction: each weight splits exactly into its signed high and unsigned
low nibble (q = 16·h + l), each one table lookup to bfloat16, two vdpbf16ps per 32 weights — on an AMD
EPYC (Zen 4) VM 23 GB/s of int8 weights (300 MB cycled, two threads) against 12-15 for widening the
row to float32. On a Xeon with AMX the other way round: from cache, one core, int8 12.7 GB/s with the
bfloat16 row against 20.0 widened (int4 9.2 against 11.4); a decode step of the 2048x10 llama's int8 checkpoint
in bfloat16, 8 rounds in shuffled order in one process: 33.1 -> 37.3 tok/s widened (int4: 51.9 both). So which
path bfloat16 rows take is measured once per machine (``row_path``), and with it whether float32 rows run int8
weight rows two at a time (``pairs``: two memory streams per thread; 38.2 -> 41.4 tok/s there; int4 with
bfloat16 rows 51.1 -> 56.1).

The kernel reads int8 [out, in] (or uint8 [out, in/2] holding two 4-bit values) and the
checkpoint's own scales [out, in/group] (bfloat16 or float32) as stored, so the rank holds
exactly the checkpoint's bytes (``bits/8 + scale bytes / group`` per weight), and sums every
row in one fixed order: a row's result does not depend on how many rows share the call, so a
k+1-row speculative verify equals k+1 one-row steps bit for bit (``runtime.exact``).

Bfloat16 rows may also go in on integer grids (``csrc/int_matmul_grids.h``, the ``int16`` row
paths): each 32-block on its own power-of-two step, so every element within 2^6 of the block's largest is held exactly
and smaller ones move by at most 2^-14 of it, and the products are integers (vpdpbusd on its two int8 halves, where
vdpbf16ps is this Xeon's slowest instruction): on the Xeon VM, 41 decode weights of the 2048x10 llama's int4
checkpoint back to back 12.6-13.0 -> 10.4 ms, its decode 66.5 -> 79.5 tok/s (processes alternated, 2 rounds each; the
same grids at 16 bits through vpdpwssd: 73.3). One 5632x2048 weight from L2 on one core, 5 rounds shuffled: 12.2-13.1
-> 15.4-17.7 GB/s (int8 rows, q8: 17.1-18.6); from memory on two, 24-26 -> 30-30.5 (q8 32-35).
int8 weights the same way (one xor and two vpdpbusd per 64): the int8 checkpoint's decode 47.6 -> 51.2 tok/s (widened
to float32 before: the faster of the others here), its 41 weights 18.8 -> 17.1 ms = 30 GB/s.
Float32 rows likewise (the ``int24`` paths, ``float_path``): each 32-block on a grid of 23-bit integers in three int8
parts (every element off by at most 2^-22 of its block's largest; float32's own spacing is 2^-23 of it), three vpdpbusd
pairs per 128 weights where the table path spends eight permutes, seven shifts and eight fused multiply-adds: the int4
checkpoint in float32 on the Xeon VM 64.0-68.1 -> 70.2-73.3 tok/s (processes alternated, 3 rounds x 3), its 41 weights
back to back 20.0 -> 22.0 GB/s (8 rounds shuffled in one process).

Opt-in, rows may instead be rounded to int8 per 32-block inside the kernel and multiplied as integers (``activations``:
``run`` / ``serve --int-activations int8``; llama.cpp's Q8_0 / Q4_0 / MXFP4 x Q8_0 arithmetic, ``csrc/int_matmul_q8.h``):
not weight-only any more — x is off by up to half a step of 1/127 of its block's largest element — but one vpdpbusd
multiplies 64 weights, so the int4 kernel stops being bound by its instructions (Xeon VM, the 2048x10 llama's int4
checkpoint in bfloat16: 55.9 -> 67.7 tok/s; int8 40.0 -> 44.0).

It is compiled on first use (``runtime.cpp_ops``) for the CPU it runs on (AVX-512, AVX2+FMA, or
portable C++); ``at::parallel_for`` splits the rows over torch's own threads.

A pass of ``GEMM_ROWS`` or more rows (a prefill; a large serving batch) is compute-bound in that kernel: it turns
every weight into float once per row of x. There the weight is dequantized a block of rows at a time
(``csrc/int_dequantize.cpp``: q times its scale in float32, exact; rounded once to bfloat16 for bfloat16 rows,
as a bfloat16 model's own weights are) and multiplied by GEMMs in x's dtype (torch's: oneDNN / MKL). Not
row-invariant (as a float model's ``F.linear`` on many rows is not): under ``exact.row_blocked()`` every pass
keeps the kernel. Measured (AMD EPYC Zen 4 VM, two threads, the kernel and the GEMMs side by side in one
process), a 512-token prefill of the 2048x10 llama, int4 / int8: bfloat16 rows 119 / 92 -> 282 / 274 tok/s
(the bfloat16 checkpoint: ~350), float32 rows 66 / 69 -> 146 / 149 tok/s.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shardwise.errors import ShardwiseError
from shardwise.quant import int_codec
from shardwise.runtime import cpp_ops, gemv, hugepages, kernel_choice

SOURCE = "int_matmul.cpp"
GEMM_ROWS = 16
"""Rows of x from which a product runs as GEMMs over dequantized blocks of the weight (bfloat16 for bfloat16 rows,
else float32; verify passes of up to 15 rows keep the row-invariant kernel)."""
BLOCK_ELEMENTS = 1 << 20
"""Weights dequantized per block (4 MB of float32: in cache while the GEMM reads it)."""
WIDEN_MARGIN = 1.05
"""bfloat16 rows are widened to float32 only if that streams at least this many times as fast (``row_path``)."""
ROW_PATHS = ("bfloat16", "bfloat16_pairs", "float32", "float32_pairs", "int16", "int16_pairs")
"""How bfloat16 rows may reach the kernel (``row_path``)."""
FLOAT_PATHS = ("float32", "float32_pairs", "int24", "int24_pairs")
"""How float32 rows may reach the kernel (``float_path``)."""
ACTIVATIONS = ("float", "int8")
"""What rows int8 / int4 / MXFP4 weights multiply (``activations``)."""
Q8_PATHS = ("int8", "int8_pairs")
"""How int8 rows run: one weight row per pass or two (``q8_pairs``)."""
_kernel = None
_paths: dict[tuple[torch.dtype, int, int], str] = {}
_q8_pairs: dict[tuple[int, int], bool] = {}
_chosen_activations: str | None = None


def runs_as_gemm(rows: torch.Tensor) -> bool:
    """Whether a pass of ``rows`` [M, in] is multiplied by dense GEMMs rather than the kernel: ``GEMM_ROWS`` or
    more rows, outside ``exact.row_blocked()`` (where every pass keeps the row-invariant kernel)."""
    return rows.shape[0] >= GEMM_ROWS and gemv.applies(rows)


def kernel_rows(rows: torch.Tensor, bits: int, int8_rows: bool = False, lines: bool = False) -> tuple[torch.Tensor, tuple[bool, bool, bool]]:
    """(``rows`` as the kernel reads them for ``bits``-bit weights, contiguous: bfloat16 as they are unless this
    machine multiplies them faster widened to float32 (``row_path``), any other dtype as float32 (``float_path``); the
    kernel's trailing arguments for them: ``pairs`` (two weight rows at a time where this machine measured that
    faster), ``q8`` and ``grids``). With ``int8_rows`` (the kernel's q8: it rounds float32 / bfloat16 rows itself) as
    they are, and ``q8_pairs``. Rows take the integer grids (the ``int16`` / ``int24`` paths) only against ``lines``
    weights, those int8 rows fit (``IntWeight.takes_int8_rows``); against others the ``bfloat16`` / ``float32`` path
    alike."""
    if int8_rows and rows.dtype in (torch.float32, torch.bfloat16):
        return rows.contiguous(), (q8_pairs(bits), True, False)
    path = row_path(bits) if rows.dtype == torch.bfloat16 else float_path(bits)
    if not path.startswith(("bfloat16", "int16")):
        rows = rows.float()
    return rows.contiguous(), (path.endswith("_pairs"), False, lines and path.startswith(("int16", "int24")))


def row_flags(dtype: torch.dtype, bits: int, lines: bool) -> list[int]:
    """[widen, pairs, q8, grids] for one row of ``dtype`` against ``bits``-bit weights whose rows int8 rows and the grids
    fit (``lines``: ``IntWeight.takes_int8_rows``), decided now (``kernel_rows``, ``activations``); widen: the row goes
    into the kernel as float32. What the compiled callers (``csrc/dispatched_ops.h``) pass the kernel."""
    rows, flags = kernel_rows(torch.zeros(1, 1, dtype=dtype), bits, lines and activations() == "int8", lines)
    return [int(rows.dtype != dtype), *map(int, flags)]


def activations() -> str:
    """How rows meet int8 / int4 / MXFP4 weights in the one-row kernel: ``float`` (as they are, every product exact)
    or ``int8`` — each 32-block of a row rounded to int8 with its own float32 step (max|x| / 127), llama.cpp's Q4_0 /
    Q8_0 / MXFP4 x Q8_0 arithmetic (``csrc/int_matmul_q8.h``). Set for this process by
    ``set_activations`` (``run`` / ``serve --int-activations``), else ``SHARDWISE_INT_ACTIVATIONS``, float unless set.
    int8 needs AVX-512 VNNI; weights it does not fit (rows not a multiple of 128 wide: ``IntWeight.takes_int8_rows``)
    and passes of ``GEMM_ROWS`` or more keep float rows."""
    if _chosen_activations is not None:
        return _chosen_activations
    return check_activations(os.environ.get("SHARDWISE_INT_ACTIVATIONS", "").strip().lower() or "float",
                             "SHARDWISE_INT_ACTIVATIONS")


def check_activations(value: str, name: str) -> str:
    """``value`` if it is one of ``ACTIVATIONS`` that this CPU runs; else a one-line error naming ``name``."""
    if value not in ACTIVATIONS:
        raise ShardwiseError(f"{name} {value!r}: use one of {', '.join(ACTIVATIONS)}")
    if value == "int8" and not int8_rows_here():
        raise ShardwiseError(f"{name} int8 needs a CPU with AVX-512 VNNI (this one lacks it): use float")
    return value


def int8_rows_here() -> bool:
    """Whether this CPU runs the kernel's int8 rows (``activations`` = int8): AVX-512 VNNI, VL and BW."""
    return {"avx512_vnni", "avx512vl", "avx512bw"} <= cpp_ops.cpu_flags()


def set_activations(value: str) -> None:
    """``activations()`` for the rest of this process (a rank's ``--int-activations``), checked first."""
    global _chosen_activations
    _chosen_activations = check_activations(value, "--int-activations")


def q8_pairs(bits: int) -> bool:
    """Whether int8 rows (``activations``) run two ``bits``-bit weight rows per pass (the kernel's ``pairs``; the same
    bits as one at a time), as measured faster here at torch's current thread count (``measure_rows`` over
    ``Q8_PATHS``, stored beside the build). Xeon VM (AMX, 2 vCPUs), the 2048x10 llama's int4 checkpoint in bfloat16,
    6 rounds shuffled in one process: float rows 55.9 tok/s, int8 rows 63.8, two at a time 67.7."""
    key = (bits, torch.get_num_threads())
    if key not in _q8_pairs:
        path = build_dir() / f"int8-rows-choice-{bits}bit-{key[1]}t.json"
        record = kernel_choice.stored(path, lambda: measure_rows(bits, Q8_PATHS), lambda rates: max(Q8_PATHS, key=rates.get),
                                      lambda record: record["cpu_share"] >= kernel_choice.CONTENDED_SHARE, Q8_PATHS)
        _q8_pairs[key] = record["choice"] == "int8_pairs"
    return _q8_pairs[key]


def row_path(bits: int) -> str:
    """How bfloat16 rows times ``bits``-bit weights reach the kernel on this machine: ``bfloat16`` (as they are:
    the vdpbf16ps path), ``float32`` (widened, exactly: the products and sums are then the float32 path's) or
    ``int16`` (each 32-block on its power-of-two integer grid: ``csrc/int_matmul_grids.h`` —
    elements within 2^6 of their block's largest exact, smaller ones off by at most 2^-14 of it), each
    one weight row at a time or two (``_pairs``: the kernel's ``pairs``, the same bits) — the fastest of them at
    torch's current thread count (``decide_rows``), measured once (``measure_rows``) and stored beside the kernel's
    build; widened wherever the CPU has no AVX512-BF16 (the kernel would widen them itself). ``SHARDWISE_INT_ROWS``
    (one of ``ROW_PATHS``) overrides it. Decided once per process."""
    return _chosen(torch.bfloat16, bits)


def float_path(bits: int) -> str:
    """How float32 rows (a float32 model's) times ``bits``-bit weights reach the kernel on this machine: ``float32``
    (each weight through a table to float32, a fused multiply-add per product) or ``int24`` (each 32-block of the row on
    its power-of-two integer grid, in three int8 parts: ``csrc/int_matmul_grids.h`` — every element off by at most
    2^-22 of its block's largest, 2^-21 against int8 weights; the integer sums rounded once to float32), one weight
    row at a time or two
    (``_pairs``) — the fastest of them at torch's current thread count, measured once with float32 rows
    (``measure_rows``) and stored beside the kernel's build. ``SHARDWISE_INT_FLOAT_ROWS`` (one of ``FLOAT_PATHS``)
    overrides it. Decided once per process."""
    return _chosen(torch.float32, bits)


def _chosen(dtype: torch.dtype, bits: int) -> str:
    """``row_path`` (``dtype`` bfloat16) or ``float_path`` (float32) for ``bits`` at torch's current thread count."""
    key = (dtype, bits, torch.get_num_threads())
    if key not in _paths:
        bf16 = dtype == torch.bfloat16
        env, allowed = ("SHARDWISE_INT_ROWS", ROW_PATHS) if bf16 else ("SHARDWISE_INT_FLOAT_ROWS", FLOAT_PATHS)
        forced = os.environ.get(env, "").strip().lower()
        if forced not in ("", *allowed):
            raise ShardwiseError(f"{env}={forced!r}: set it to one of {', '.join(allowed)}, or unset it to measure")
        names = candidates(bits, dtype)
        if forced or len(names) == 1:
            _paths[key] = forced or names[0]
        else:
            stem = "int-rows-choice" if bf16 else "int-float-rows-choice"
            record = kernel_choice.stored(build_dir() / f"{stem}-{bits}bit-{key[2]}t.json",
                                          lambda: measure_rows(bits, names, dtype),
                                          decide_rows if bf16 else (lambda rates: max(names, key=rates.get)),
                                          lambda record: record["cpu_share"] >= kernel_choice.CONTENDED_SHARE, names)
            _paths[key] = record["choice"]
    return _paths[key]


def candidates(bits: int, dtype: torch.dtype = torch.bfloat16) -> tuple[str, ...]:
    """The paths this CPU's build of the kernel has for ``dtype`` rows (``ROW_PATHS`` for bfloat16, ``FLOAT_PATHS``
    for float32) times ``bits``-bit weights (two rows at a time: int8 rows on AVX-512, 4-bit ones where AVX-512VL
    gives the 64-byte-line paths; int8 with bfloat16 rows has none; integer grids: AVX-512 VNNI)."""
    flags = cpp_ops.cpu_flags()
    lines = {"avx512f", "avx512bw", "avx512vl"} <= flags
    two = {"avx512f", "avx512bw"} <= flags if bits == 8 else lines
    floats = ("float32",) + (("float32_pairs",) if two else ())
    if dtype != torch.bfloat16:
        return floats + (("int24", "int24_pairs") if int8_rows_here() else ())
    names = ("bfloat16",) + (("bfloat16_pairs",) if bits == 4 else ()) if {"avx512_bf16", "avx512vl"} <= flags else ()
    return names + floats + (("int16", "int16_pairs") if int8_rows_here() else ())


def decide_rows(rates: dict[str, float]) -> str:
    """The bfloat16-row path among measured ``rates`` (GB/s by ``ROW_PATHS`` name): the fastest float32 one if it
    streams at least ``WIDEN_MARGIN`` times the fastest of those that keep the rows' 16 bits (bfloat16, int16
    grids; or there is none), else that one."""
    def fastest(*prefixes: str) -> str | None:
        return max((n for n in ROW_PATHS if n.startswith(prefixes) and n in rates), key=lambda n: rates[n], default=None)

    widened, kept = fastest("float32"), fastest("bfloat16", "int16")
    return widened if kept is None or rates[widened] >= WIDEN_MARGIN * rates[kept] else kept


def measure_rows(bits: int, names: tuple[str, ...], dtype: torch.dtype = torch.bfloat16, nbytes: int = gemv.MEASURE_BYTES,
                 rounds: int = 4) -> dict[str, float]:
    """GB/s of packed weight bytes (and scales) the kernel streams for one ``dtype`` row along each of ``names``
    (``ROW_PATHS`` / ``FLOAT_PATHS``, widening timed with the product; or ``Q8_PATHS``, rounding to int8 timed with it), best of
    ``rounds`` over ``nbytes`` of ``bits``-bit weights (per channel for 8 bits, groups of 32 for 4, bfloat16 scales) shaped as a decoder's (``gemv.MEASURE_SHAPES``),
    in huge pages where the host gives them, the paths taking turns weight by weight
    (``kernel_choice.side_by_side``); and ``cpu_share``."""
    shape_bytes = [(n, k, n * k * bits // 8, n * (1 if bits == 8 else k // 32) * 2) for n, k in gemv.MEASURE_SHAPES]
    copies = -(-nbytes // sum(q + s for _, _, q, s in shape_bytes))
    total = copies * sum(q + s for _, _, q, s in shape_bytes)
    memory = hugepages.arena(total)
    if memory is None:
        memory = torch.empty(total, dtype=torch.uint8)
    weights, start = [], 0
    for n, k, qb, sb in shape_bytes * copies:
        q = memory[start : start + qb].fill_(0x5A).view(torch.int8 if bits == 8 else torch.uint8).view(n, -1)
        scale = memory[start + qb : start + qb + sb].view(torch.bfloat16).view(n, -1).fill_(0.01)
        weights.append((q, scale, k if bits == 8 else 32, qb + sb))
        start += qb + sb
    xs = {k: torch.full((1, k), 0.5, dtype=dtype) for _, k in gemv.MEASURE_SHAPES}
    op = kernel()

    def run(name: str, i: int) -> int:
        q, scale, group, moved = weights[i]
        x = xs[q.shape[1] * 8 // bits]
        rows = x.float() if name.startswith("float32") else x
        op(rows, q, scale, bits, group, torch.bfloat16, name.endswith("_pairs"), name.startswith("int8"), name.startswith(("int16", "int24")))
        return moved

    return kernel_choice.side_by_side(names, run, len(weights), rounds)


def kernel():
    """The compiled ``int_matmul(x, q, scale, bits, group)`` op, built once per machine and loaded
    once per process (``cpp_ops.load``)."""
    global _kernel
    if _kernel is None:
        try:
            cpp_ops.load(SOURCE)
        except (RuntimeError, OSError, ImportError) as exc:
            raise ShardwiseError(
                f"building the int8/int4 CPU kernel failed ({cpp_ops.first_line(exc)}): install a C++ compiler and "
                "ninja (`pip install ninja`), or run a float checkpoint"
            ) from None
        _kernel = torch.ops.shardwise_int.int_matmul
    return _kernel


def build_dir() -> Path:
    """Where this machine's build of the kernel lives (``cpp_ops.build_dir``)."""
    return cpp_ops.build_dir(SOURCE)


class IntWeight(nn.Module):
    """One Linear's packed int weight on this rank: ``q`` int8 [out, in] (8 bits) or uint8
    [out, in/2] (4 bits, element 2j in the low nibble), ``scale`` [out, in/group] as stored.

    Called in place of a float weight by ``layers.linear``: ``y = x Wᵀ`` in x's dtype,
    accumulated in float32.
    """

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bits: int, group: int):
        super().__init__()
        self.q = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale, requires_grad=False)
        self.bits, self.group = bits, group
        self.in_features = q.shape[1] * 8 // bits
        self.takes_int8_rows = self.in_features % 128 == 0 and (
            group in (32, 64) or group % 128 == 0 if bits == 4 else group == self.in_features or group % 64 == 0)
        """Whether ``activations()`` = int8 applies to this weight (the kernel's q8 path: rows of whole 128-weight
        lines; int4 in groups of 32, 64 or k*128, int8 per channel or in groups of k*64) — and the integer grids
        (``kernel_rows``' ``lines``)."""

    @classmethod
    def from_stored(cls, packed: torch.Tensor, scale: torch.Tensor, bits: int) -> IntWeight:
        """From this rank's slices of ``weight_packed`` (int32 words) and ``weight_scale``."""
        if sys.byteorder != "little":
            raise ShardwiseError("int-quantized weights need a little-endian CPU: run a float checkpoint")
        raw = packed.contiguous().view(torch.uint8)
        q = raw.bitwise_xor(0x80).view(torch.int8) if bits == 8 else raw
        if scale.dtype not in (torch.float32, torch.bfloat16):
            scale = scale.float()
        in_features = raw.shape[1] * 8 // bits
        group = in_features // scale.shape[1]
        if not (bits == 8 and group == in_features):  # per-channel rows may be any width (a tp slice)
            int_codec.check_scheme(bits, group, in_features)
        return cls(q.contiguous(), scale.contiguous(), bits, group)

    @classmethod
    def stack(cls, parts: list[IntWeight]) -> IntWeight | None:
        """One IntWeight whose rows are ``parts``' rows in order (their q and scales concatenated);
        each part's ``q`` and ``scale`` become views of its rows, so nothing is held twice. None when
        the parts' bits, groups, input widths or scale dtypes differ."""
        if len({(p.bits, p.group, p.in_features, p.scale.dtype) for p in parts}) != 1:
            return None
        q = torch.cat([p.q.detach() for p in parts])
        scale = torch.cat([p.scale.detach() for p in parts])
        start = 0
        for p in parts:
            n = p.q.shape[0]
            p.q.data, p.scale.data = q[start : start + n], scale[start : start + n]
            start += n
        return cls(q, scale, parts[0].bits, parts[0].group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if runs_as_gemm(rows):
            y = self._dequantized_blocks(rows)
            if y is not None:
                return y.to(x.dtype).view(*x.shape[:-1], self.q.shape[0])
        q8 = self.takes_int8_rows and x.dtype in (torch.float32, torch.bfloat16) and activations() == "int8"
        rows, flags = kernel_rows(rows, self.bits, q8, self.takes_int8_rows)
        if x.dtype in (torch.float32, torch.bfloat16):  # the kernel rounds its float32 sums to x's dtype
            return kernel()(rows, self.q, self.scale, self.bits, self.group, x.dtype, *flags).view(*x.shape[:-1], self.q.shape[0])
        y = kernel()(rows, self.q, self.scale, self.bits, self.group, None, *flags)
        return y.to(x.dtype).view(*x.shape[:-1], self.q.shape[0])

    def row_product(self, dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
        """``forward`` for one contiguous row ``x`` [1, in] of ``dtype`` (float32 or bfloat16) → [1, out] in ``dtype``,
        with the kernel's row path, pairs and int8 rows decided now (``kernel_rows``, ``activations``): the same call
        and bits without the per-call checks, for a caller running it every step (``runtime.token_step``)."""
        bits, group, widen, *flags = self.kernel_args(dtype)
        op, q, scale = kernel(), self.q, self.scale
        if widen:  # widened to float32, as kernel_rows does
            return lambda x: op(x.float(), q, scale, bits, group, dtype, *flags)
        return lambda x: op(x, q, scale, bits, group, dtype, *flags)

    def kernel_args(self, dtype: torch.dtype) -> list[int]:
        """[bits, group, widen, pairs, q8, grids] for one row of ``dtype`` (``row_flags``): what ``row_product`` binds,
        as ``csrc/layer_step.cpp`` takes it."""
        return [self.bits, self.group, *row_flags(dtype, self.bits, self.takes_int8_rows)]

    def _dequantized_blocks(self, rows: torch.Tensor) -> torch.Tensor | None:
        """``rows`` [M, in] times the weight, one GEMM per block of dequantized weight rows (``BLOCK_ELEMENTS``),
        in bfloat16 for bfloat16 rows, else float32; None where the dequantizing op does not build here."""
        op = cpp_ops.optional_op("int_dequantize.cpp", "shardwise_intdq", "int_dequantize")
        if op is None:
            return None
        dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        x, n = rows.to(dtype), self.q.shape[0]
        y = torch.empty(rows.shape[0], n, dtype=dtype)
        step = max(16, BLOCK_ELEMENTS // self.in_features)
        for r0 in range(0, n, step):
            r = min(step, n - r0)
            y[:, r0 : r0 + r] = x @ op(self.q, self.scale, self.bits, self.group, r0, r, dtype).T
        return y

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] this module multiplies by (for checks)."""
        q = self.q.numpy() if self.bits == 8 else int_codec.unpack(self.q.numpy().view("<i4"), 4)
        return torch.from_numpy(int_codec.decode(q, self.scale.float().numpy()))


def int_decode(packed: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """A float32 weight [out, in] from stored ``weight_packed`` int32 words and ``weight_scale``."""
    q = int_codec.unpack(np.ascontiguousarray(packed.numpy()), bits)
    return torch.from_numpy(int_codec.decode(q, scale.float().numpy()))
