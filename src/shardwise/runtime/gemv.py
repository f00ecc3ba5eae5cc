"""One-row products on CPU (batch-1 decode): ``y = W x`` for a float weight ``W`` [out, in].

float32 (and float16) weights run ``torch.mv`` (MKL's GEMV streams them at the machine's read
bandwidth, and gives F.linear's own bits). bfloat16 weights run the runtime's compiled kernel
(``csrc/decode_gemv.cpp``, built on first use by ``runtime.cpp_ops``) where the CPU has AVX512-BF16:
torch's bfloat16 GEMV streamed a decode step's small matrices at 8-13 GB/s here (a MoE expert's
256 × 1024, its 1024 × 256 down projection) against 19-22 GB/s for the kernel, large ones at 16-24
against 22-29 GB/s (two threads, side by side in one process). Both sum in float32 and round once,
in a different order: the kernel's outputs equal F.linear's bits for nearly every element and are
one bfloat16 step away for the rest (``tests/test_runtime_linear.py``). Elsewhere (no AVX512-BF16,
no compiler, a non-contiguous weight) bfloat16 keeps ``torch.mv``. The same library runs a MoE
block's routed experts for one row in one call (``experts_kernel``).
"""

from __future__ import annotations

import torch

from shardwise.runtime import cpp_ops

__all__ = ["applies", "bf16_kernel", "experts_kernel", "mv"]

SOURCE = "decode_gemv.cpp"


def applies(x: torch.Tensor) -> bool:
    """Whether a one-row product of ``x`` may take this module's paths: on the CPU, and outside
    ``exact.row_blocked()`` (a torch-function mode under which every product is ``F.linear`` made
    row-invariant: a fixed-order kernel or whole row blocks)."""
    return x.device.type == "cpu" and not torch._C._is_torch_function_mode_enabled()


def bf16_kernel():
    """The compiled ``shardwise_gemv.bf16_mv(w, x)`` op, or None where this CPU or machine cannot run it
    (no compiler; no AVX512-BF16: the library registers no such op)."""
    return cpp_ops.optional_op(SOURCE, "shardwise_gemv", "bf16_mv")


def experts_kernel(dtype: torch.dtype):
    """The compiled ``shardwise_gemv.experts_row(x, gate_up[], down[], weights, slots, out)`` op for
    experts of ``dtype`` (``moe.SparseMoE``'s one-row step), or None: no compiler, a dtype other than
    float32, or bfloat16 without ``bf16_kernel``."""
    if dtype == torch.float32 or (dtype == torch.bfloat16 and bf16_kernel() is not None):
        return cpp_ops.optional_op(SOURCE, "shardwise_gemv", "experts_row")
    return None


def mv(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] times the CPU vector ``x`` [in] of the same dtype → [out] in that dtype."""
    if weight.dtype == torch.bfloat16 and weight.is_contiguous():
        op = bf16_kernel()
        if op is not None:
            return op(weight, x.contiguous())
    return torch.mv(weight, x)
