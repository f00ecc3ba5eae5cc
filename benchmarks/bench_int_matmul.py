"""One decode-sized weight-only product, side by side: shardwise's int8 / int4 kernel
(``runtime.int_matmul``) against torch's float GEMV and torch's own packed CPU kernels.

    PYTHONPATH=src python benchmarks/bench_int_matmul.py [--out 5632] [--in 2048] [--threads N] [--rows 1]

Every kernel multiplies the same random weight (quantized the same way for the integer ones) by
``--rows`` activation rows; the figure is weight bytes read per second (GB/s) and time per call,
best of 5 passes of 50 calls, so the ratios are what to read. Where the CPU has AVX-512 VNNI, shardwise's int8 / int4
also run on rows rounded to int8 per 32-block (``--int-activations int8``: llama.cpp's Q8_0 / Q4_0 x Q8_0 arithmetic),
and bfloat16 rows along each row path (as they are, widened, on integer grids: ``int_matmul.row_path``).
Torch's kernels:
``_weight_int8pack_mm`` (int8 per channel, activations and scales in the activation dtype) and
``_weight_int4pack_mm_for_cpu`` (int4 groups of 32 with a bfloat16 scale and zero point per group).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from shardwise.quant import int_codec
from shardwise.runtime import int_matmul
from shardwise.runtime.int_matmul import IntWeight


def best_seconds(fn, calls: int = 50, passes: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def on_int8_rows(weight: IntWeight, x: torch.Tensor) -> torch.Tensor:
    """``weight(x)`` with x rounded to int8 per 32-block in the kernel (its q8 argument: ``--int-activations int8``)."""
    rows, flags = int_matmul.kernel_rows(x, weight.bits, True)
    return int_matmul.kernel()(rows, weight.q, weight.scale, weight.bits, weight.group, x.dtype, *flags)


def on_row_path(weight: IntWeight, x: torch.Tensor, path: str) -> torch.Tensor:
    """``weight(x)`` along one of ``int_matmul.ROW_PATHS`` (bfloat16 ``x``) or ``FLOAT_PATHS`` (float32), one weight row
    at a time."""
    rows = x.float() if path == "float32" else x
    return int_matmul.kernel()(rows, weight.q, weight.scale, weight.bits, weight.group, x.dtype, False, False,
                               path in ("int16", "int24"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=5632)
    parser.add_argument("--in", dest="inp", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    w = torch.randn(args.out, args.inp) * 0.02
    q8, s8 = int_codec.encode(w.numpy(), 8, args.inp)
    q4, s4 = int_codec.encode(w.numpy(), 4, 32)
    int8 = IntWeight.from_stored(torch.from_numpy(int_codec.pack(q8, 8)), torch.from_numpy(s8).bfloat16(), 8)
    int4 = IntWeight.from_stored(torch.from_numpy(int_codec.pack(q4, 4)), torch.from_numpy(s4).bfloat16(), 4)
    q8t, s8t = torch.from_numpy(q8), torch.from_numpy(s8)[:, 0]
    u4 = torch.from_numpy(q4).to(torch.int32) + 8
    packed4 = torch._convert_weight_to_int4pack_for_cpu(u4, 1)
    zeros = torch.zeros_like(torch.from_numpy(s4).T)
    cases = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(args.rows, args.inp).to(dtype)
        wd = w.to(dtype)
        name = "fp32" if dtype == torch.float32 else "bf16"
        one_row = args.rows == 1
        cases += [
            (f"torch {'mv' if one_row else 'linear'} {name} weights", wd.numel() * wd.element_size(),
             (lambda wd=wd, x=x: torch.mv(wd, x[0])) if one_row else (lambda wd=wd, x=x: torch.nn.functional.linear(x, wd))),
            (f"shardwise int8, {name} x", int8.q.numel() + int8.scale.numel() * 2, lambda x=x: int8(x)),
            (f"shardwise int4 g32, {name} x", int4.q.numel() + int4.scale.numel() * 2, lambda x=x: int4(x)),
        ]
        if int_matmul.int8_rows_here() and args.inp % 128 == 0:
            for weight, label in ((int8, "int8"), (int4, "int4 g32")):
                cases.append((f"shardwise {label}, {name} x as int8", weight.q.numel() + weight.scale.numel() * 2,
                              lambda x=x, weight=weight: on_int8_rows(weight, x)))
        # each way the rows can reach the kernel (the lines above: the measured choice)
        grids = ("int16" if dtype == torch.bfloat16 else "int24",) if int_matmul.int8_rows_here() and args.inp % 128 == 0 else ()
        for weight, label in ((int8, "int8"), (int4, "int4 g32")):
            for path in ("bfloat16", "float32") + grids if dtype == torch.bfloat16 else ("float32",) + grids:
                cases.append((f"shardwise {label}, {name} x, row path {path}", weight.q.numel() + weight.scale.numel() * 2,
                              lambda x=x, weight=weight, path=path: on_row_path(weight, x, path)))
        cases += [
            (f"torch _weight_int8pack_mm, {name} x", q8t.numel() + s8t.numel() * x.element_size(),
             lambda x=x, dtype=dtype: torch._weight_int8pack_mm(x, q8t, s8t.to(dtype))),
        ]
        if dtype == torch.bfloat16:
            sz = torch.stack([torch.from_numpy(s4).T, zeros], -1).contiguous().to(dtype)
            cases.append(("torch _weight_int4pack_mm_for_cpu g32, bf16 x", packed4.numel() + sz.numel() * 2,
                          lambda x=x, sz=sz: torch._weight_int4pack_mm_for_cpu(x, packed4, 32, sz)))
    print(f"{args.out}x{args.inp} weight, {args.rows} row(s), {args.threads} thread(s)")
    for name, nbytes, fn in cases:
        sec = best_seconds(fn)
        print(f"  {name:44s} {sec * 1e3:7.3f} ms  {nbytes / sec / 1e9:6.1f} GB/s of its weight bytes")


if __name__ == "__main__":
    main()
