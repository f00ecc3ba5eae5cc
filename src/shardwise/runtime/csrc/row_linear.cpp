// Batch-invariant float32 products for CPU: y[m, n] = sum_k x[m, k] w[n, k], x [M, K], w [N, K] (row-major,
// contiguous), y [M, N], where every output is summed in one fixed order whatever M is, which rows share the
// call and which thread computes it: 16 lanes, lane l accumulating the products k = l, l + 16, ... in
// ascending k by fused multiply-add (a masked last vector when K % 16 != 0), then one fixed-order reduction
// of the lanes (_mm512_reduce_add_ps). So a row's result is the same bits in a one-row decode step, a k+1-row
// speculative verify pass and a serving batch of any size (runtime.exact), without padding every product to
// a 16-row GEMM: a one-row call streams the weight once at GEMV speed.
//
// Tiles of up to 4 x rows by 4 weight rows (16 accumulators; a weight block of 4 rows stays in L1 while the
// x rows of a 64-row chunk pass over it); weight rows are prefetched 4 KB ahead. Threads split the weight
// rows (at::parallel_for over 4-row blocks). Built only where the compiler targets AVX-512F; elsewhere the
// library registers no op and runtime.exact pads products to whole row blocks instead.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kWeightRows = 4;   // weight rows per tile
constexpr int64_t kChunkRows = 64;   // x rows passing over one weight block before the next block
constexpr int64_t kAhead = 1024;     // floats (4 KB) of a weight row prefetched ahead of its reads

// Outputs y[m0 .. m0 + MT) x [n0 .. n0 + 4) (rows past `valid` weight rows are computed from row n0 and
// dropped).
template <int MT>
void tile(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t n0, int64_t valid) {
  const int64_t full = K / 16 * 16;
  const __mmask16 tail = static_cast<__mmask16>((1u << (K - full)) - 1);
  const float* wr[kWeightRows];
  const float* xr[MT];
  for (int64_t j = 0; j < kWeightRows; ++j) wr[j] = w + (n0 + (j < valid ? j : 0)) * K;
  for (int i = 0; i < MT; ++i) xr[i] = x + (m0 + i) * K;
  __m512 acc[MT][kWeightRows];
  for (int i = 0; i < MT; ++i)
    for (int64_t j = 0; j < kWeightRows; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += 16) {
    __m512 wv[kWeightRows];
    for (int64_t j = 0; j < kWeightRows; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k + kAhead), _MM_HINT_T0);
      wv[j] = _mm512_loadu_ps(wr[j] + k);
    }
    for (int i = 0; i < MT; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + k);
      for (int64_t j = 0; j < kWeightRows; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (tail) {
    __m512 wv[kWeightRows];
    for (int64_t j = 0; j < kWeightRows; ++j) wv[j] = _mm512_maskz_loadu_ps(tail, wr[j] + full);
    for (int i = 0; i < MT; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(tail, xr[i] + full);
      for (int64_t j = 0; j < kWeightRows; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int64_t j = 0; j < valid; ++j) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous float32 [N, K] with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (N + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, blocks, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
      const int64_t c1 = std::min(M, c0 + kChunkRows);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kWeightRows, valid = std::min(kWeightRows, N - n0);
        int64_t m = c0;
        for (; m + 4 <= c1; m += 4) tile<4>(xp, wp, yp, K, N, m, n0, valid);
        switch (c1 - m) {
          case 3: tile<3>(xp, wp, yp, K, N, m, n0, valid); break;
          case 2: tile<2>(xp, wp, yp, K, N, m, n0, valid); break;
          case 1: tile<1>(xp, wp, yp, K, N, m, n0, valid); break;
          default: break;
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(shardwise_rows, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor", &linear_f32);
}
#else
TORCH_LIBRARY(shardwise_rows, m) {}
#endif
