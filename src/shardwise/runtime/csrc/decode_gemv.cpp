// One-row products of a decode step on CPU.
//
// bf16_mv: y[r] = sum_k w[r, k] x[k], w bfloat16 [N, K] (row-major, contiguous), x bfloat16 [K], y bfloat16
// [N] (the float32 sum rounded once, to nearest even). vdpbf16ps multiplies 32 bfloat16 pairs exactly and
// adds them into 16 float32 lanes per instruction; eight rows share each load of x and each row's bytes are
// prefetched 4 KB ahead (a decode step streams every weight from memory once). Torch's own bfloat16 GEMV
// streamed the small matrices of a decode step (a MoE expert's 256 x 1024, a 1024 x 256 down projection) at
// 8-13 GB/s here, this one at 19-22 GB/s; large ones 16-24 against 22-29 GB/s (two threads, side by side).
// Each row is summed in one fixed order (32-element chunks in ascending k, a masked last chunk, then a
// fixed-order reduction of the 16 lanes) whatever thread computes it. Built only where the compiler targets
// AVX512-BF16 (with AVX512-BW for the masked tail).
//
// experts_row: a MoE block's routed SwiGLU experts for one row in one call, out += sum over the picked
// experts i (in the order given) of w[slot_i] * down_i(silu(gate_i x) * up_i x), with the roundings of the
// torch ops it replaces (each product and sum rounded to the run dtype where those produce it): the
// products run as bf16_mv (bfloat16) or, in float32, as the one-row product runtime.gemv chose for this
// machine: torch.mv (MKL, F.linear's bits) or, with `fixed_order`, shardwise_rows::linear_f32 (row_linear.cpp,
// looked up in the dispatcher: runtime.gemv loads that library first), so only the elementwise steps differ
// from the torch path, by float32 rounding. Replaces ~8 small ops and a module call per
// expert, whose dispatch cost a decode step more than their bytes.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SHARDWISE_BF16_MV 1
#include <immintrin.h>
#endif

namespace {

#ifdef SHARDWISE_BF16_MV

constexpr int64_t kAhead = 2048;  // elements (4 KB) of a row prefetched ahead of its reads
constexpr int64_t kRows = 8;      // rows sharing one load of x: eight streams in flight per thread. On an AMD
                                  // EPYC (Zen 4) VM, 400 MB of a decoder's shapes cycled, two threads: 20.9-24.9 GB/s
                                  // against 18.4-22.1 with four rows (2 rows: 16-19, 12 or 16: no better than 8)

at::Tensor bf16_mv(const at::Tensor& w, const at::Tensor& x) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "w must be contiguous bfloat16 [N, K]");
  TORCH_CHECK(x.dim() == 1 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(0) == w.size(1),
              "x must be contiguous bfloat16 [K]");
  const int64_t N = w.size(0), K = w.size(1), full = K / 32 * 32;
  const __mmask32 tail = static_cast<__mmask32>((1ull << (K - full)) - 1);
  at::Tensor y = at::empty({N}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  c10::BFloat16* yp = y.data_ptr<c10::BFloat16>();
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r += kRows) {
      const int64_t rows = r + kRows <= r1 ? kRows : r1 - r;
      __m512 acc[kRows];
      const uint16_t* row[kRows];
      for (int64_t i = 0; i < kRows; ++i) {
        acc[i] = _mm512_setzero_ps();
        row[i] = wp + (r + (i < rows ? i : 0)) * K;  // a short last group repeats its first row (result unused)
      }
      for (int64_t k = 0; k < full; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(xp + k);
        for (int64_t i = 0; i < kRows; ++i) {
          _mm_prefetch(reinterpret_cast<const char*>(row[i] + k + kAhead), _MM_HINT_T0);
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(row[i] + k), xv);
        }
      }
      if (tail) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, xp + full);
        for (int64_t i = 0; i < kRows; ++i)
          acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_maskz_loadu_epi16(tail, row[i] + full), xv);
      }
      for (int64_t i = 0; i < rows; ++i) yp[r + i] = c10::BFloat16(_mm512_reduce_add_ps(acc[i]));
    }
  });
  return y;
}
#endif

// w [N, K] times x [K] in their dtype: bf16_mv for bfloat16; for float32 torch.mv, or linear_f32 if
// `fixed_order`.
at::Tensor row_product(const at::Tensor& w, const at::Tensor& x, bool fixed_order) {
#ifdef SHARDWISE_BF16_MV
  if (w.scalar_type() == at::kBFloat16) return bf16_mv(w, x);
#endif
  TORCH_CHECK(w.scalar_type() == at::kFloat, "experts_row runs float32, or bfloat16 on AVX512-BF16 CPUs");
  if (!fixed_order) return at::mv(w, x);
  static const auto linear_f32 = c10::Dispatcher::singleton()
                                     .findSchemaOrThrow("shardwise_rows::linear_f32", "")
                                     .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  return linear_f32.call(x.view({1, x.numel()}), w).view({w.size(0)});
}

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void add_experts_row(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, const float* w,
                     at::IntArrayRef slots, at::Tensor& out, bool fixed_order) {
  T* o = out.data_ptr<T>();
  const int64_t H = out.numel();
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const at::Tensor h = row_product(gate_up[i], x, fixed_order);  // gate | up, in the run dtype
    const int64_t I = h.numel() / 2;
    const T* hp = h.data_ptr<T>();
    at::Tensor a = at::empty({I}, x.options());
    T* ap = a.data_ptr<T>();
    for (int64_t j = 0; j < I; ++j) {
      const float g = static_cast<float>(hp[j]);
      ap[j] = static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * static_cast<float>(hp[I + j]));
    }
    const at::Tensor y = row_product(down[i], a, fixed_order);
    const T* yp = y.data_ptr<T>();
    const float weight = w[slots[i]];
    for (int64_t c = 0; c < H; ++c)
      o[c] = static_cast<T>(static_cast<float>(o[c]) + rounded<T>(static_cast<float>(yp[c]) * weight));
  }
}

void experts_row(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, const at::Tensor& weights,
                 at::IntArrayRef slots, at::Tensor& out, bool fixed_order) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && out.dim() == 1 && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(), "x and out must be contiguous vectors of one dtype");
  TORCH_CHECK(gate_up.size() == down.size() && down.size() == slots.size(), "one gate_up, down and slot per expert");
  for (size_t i = 0; i < down.size(); ++i)
    TORCH_CHECK(gate_up[i].dim() == 2 && gate_up[i].size(1) == x.numel() && gate_up[i].size(0) % 2 == 0 &&
                    down[i].dim() == 2 && down[i].size(0) == out.numel() && down[i].size(1) * 2 == gate_up[i].size(0) &&
                    gate_up[i].is_contiguous() && down[i].is_contiguous() &&
                    gate_up[i].scalar_type() == x.scalar_type() && down[i].scalar_type() == x.scalar_type(),
                "expert weights must be contiguous gate|up [2I, H] and down [H, I] in x's dtype");
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  for (const int64_t slot : slots) TORCH_CHECK(slot >= 0 && slot < w.numel(), "slot out of range");
  if (x.scalar_type() == at::kBFloat16)
    add_experts_row<c10::BFloat16>(x, gate_up, down, w.data_ptr<float>(), slots, out, fixed_order);
  else
    add_experts_row<float>(x, gate_up, down, w.data_ptr<float>(), slots, out, fixed_order);
}

}  // namespace

TORCH_LIBRARY(shardwise_gemv, m) {
#ifdef SHARDWISE_BF16_MV
  m.def("bf16_mv(Tensor w, Tensor x) -> Tensor", &bf16_mv);
#endif
  m.def("experts_row(Tensor x, Tensor[] gate_up, Tensor[] down, Tensor weights, int[] slots, Tensor(a!) out, bool fixed_order) -> ()",
        &experts_row);
}
