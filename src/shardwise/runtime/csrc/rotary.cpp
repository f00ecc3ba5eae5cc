// Rotary position embedding of q or k in one call: x [B, H, T, d] (any strides, the last dimension
// contiguous), cos / sin [T, d/2] (every row of a position alike) or [B or 1, H or 1, T, d/2] (per-slot
// tables: broadcast over size-1 dimensions), the last dimension contiguous -> a new contiguous
// [B, H, T, d] in x's dtype (float32 or bfloat16).
//
// Two layouts, as transformers has them:
//   rotate-half (Llama):    x1 = x[:d/2], x2 = x[d/2:]               -> [x1 c - x2 s, x2 c + x1 s]
//   interleaved (DeepSeek): x1 = x[0::2], x2 = x[1::2] (pairs 2i, 2i+1) -> the same, de-interleaved
//                           (evens then odds: what transformers' apply_rotary_pos_emb_interleave returns).
// Roundings are torch's for the expression `cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)` in x's dtype:
// every product is rounded to the dtype, then the sum / difference of the two rounded products is (a
// bfloat16 product is formed in float32, exactly, and rounded once, as torch's bfloat16 multiply does). No
// fused multiply-add anywhere (this file is built with floating-point contraction off), so the bits equal
// torch's expression: tests/test_rotary.py holds them equal.
//
// Why: the expression is 7 torch ops (chunk, four multiplies, a subtract, an add, a cat) twice per attention
// layer per decoded token; on an AMD EPYC (Zen 4) VM, torch 2.13, 2 threads, 20000 calls side by side in one
// process, q [1, 16, 1, 128] bfloat16 (a transposed view) took 17-23 us per call through torch, 6-9 us through
// layers.apply_rotary with this op (3-4 us of it the op itself).
#pragma GCC optimize("fp-contract=off")
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "rotary_row.h"

namespace {

// Rounds a float32 to E and back (bfloat16: to nearest even, as c10::BFloat16 does; float32: itself), in
// plain integer operations the compiler vectorises (a NaN's quiet bit is kept, as c10's conversion does).
// A table's strides over x's [B, H, T] (0 where it broadcasts).
void table_strides(const at::Tensor& t, int64_t* strides) {
  if (t.dim() == 2) {
    strides[0] = strides[1] = 0;
    strides[2] = t.stride(0);
    return;
  }
  for (int i = 0; i < 3; ++i) strides[i] = t.size(i) == 1 ? 0 : t.stride(i);
}

template <class E, bool kInterleaved>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t H = x.size(1), T = x.size(2), half = x.size(3) / 2, rows = x.size(0) * H * T;
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  int64_t cs[3], ss[3];
  table_strides(cos, cs);
  table_strides(sin, ss);
  const E* xp = x.data_ptr<E>();
  const E* cp = cos.data_ptr<E>();
  const E* sp = sin.data_ptr<E>();
  E* op = out.data_ptr<E>();
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / (H * T), h = r / T % H, t = r % T;
      shardwise::rotate_row<E, kInterleaved>(xp + b * xs[0] + h * xs[1] + t * xs[2], cp + b * cs[0] + h * cs[1] + t * cs[2],
                                  sp + b * ss[0] + h * ss[1] + t * ss[2], op + r * 2 * half, half);
    }
  });
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, bool interleaved) {
  TORCH_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1,
              "x must be [B, H, T, d] with an even d and its last dimension contiguous");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be float32 or bfloat16");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "cos and sin must have x's dtype");
    const bool rows = t->dim() == 2 && t->size(0) == x.size(2);
    const bool slots = t->dim() == 4 && (t->size(0) == x.size(0) || t->size(0) == 1) &&
                       (t->size(1) == x.size(1) || t->size(1) == 1) && t->size(2) == x.size(2);
    TORCH_CHECK((rows || slots) && t->size(-1) == x.size(3) / 2 && (t->stride(-1) == 1 || t->size(-1) == 1),
                "cos and sin must be [T, d/2] or [B or 1, H or 1, T, d/2] with the last dimension contiguous");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) {
    interleaved ? rotate<float, true>(x, cos, sin, out) : rotate<float, false>(x, cos, sin, out);
  } else {
    interleaved ? rotate<c10::BFloat16, true>(x, cos, sin, out) : rotate<c10::BFloat16, false>(x, cos, sin, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(shardwise_rope, m) { m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor", &rope); }
