// SwiGLU of one stacked gate|up product: y[m, i] = silu(g[m, i]) * u[m, i], g = gu[m, :n], u = gu[m, n:] (gu [M, 2n]
// contiguous, float32 or bfloat16, n a multiple of 64) in one call, with the bits of torch's `F.silu(g) * u`:
// silu(x) = x / (1 + exp(-x)) in float32 vectors of 16, exp through the same SLEEF routine torch's CPU vectors use
// (Sleef_expf16_u10, exported by libtorch_cpu), then (bfloat16) rounded to bfloat16 as torch's vector conversion
// rounds (nearest even; NaN 0xFFFF), the product formed in float32 and rounded once. Rows whose width leaves torch a
// scalar tail (n not a multiple of 64: its vector loop takes two vectors a pass) are refused: there its bits are
// std::exp's. tests/test_swiglu.py holds every element equal to torch's.
//
// Why: a decode step's `gate, up = gu.split(...); F.silu(gate) * up` is three Python-level torch calls a layer, each
// paying the interpreter and dispatcher with cold caches right after a weight product's stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

extern "C" __m512 Sleef_expf16_u10(__m512);

namespace {

// torch's vector silu of 16 floats: x / (1 + exp(-x)).
inline __m512 silu16(__m512 x) {
  const __m512 neg = _mm512_xor_ps(x, _mm512_set1_ps(-0.f));
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(neg)));
}

// 16 floats to bfloat16 as torch's AVX-512 conversion: nearest even, NaN as 0xFFFF.
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)), bits), 16);
  rounded = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), rounded);
  return _mm512_cvtusepi32_epi16(rounded);
}

inline __m512 from_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.is_contiguous() && gu.size(1) % 128 == 0 && gu.device().is_cpu(),
              "silu_mul: gate|up must be contiguous [M, 2n] on the CPU with n a multiple of 64");
  const int64_t M = gu.size(0), n = gu.size(1) / 2;
  at::Tensor y = at::empty({M, n}, gu.options());
  if (gu.scalar_type() == at::kFloat) {
    for (int64_t m = 0; m < M; ++m) {
      const float* g = gu.data_ptr<float>() + m * 2 * n;
      float* out = y.data_ptr<float>() + m * n;
      for (int64_t i = 0; i < n; i += 16)
        _mm512_storeu_ps(out + i, _mm512_mul_ps(silu16(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(g + n + i)));
    }
    return y;
  }
  TORCH_CHECK(gu.scalar_type() == at::kBFloat16, "silu_mul: gate|up must be float32 or bfloat16");
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = reinterpret_cast<const uint16_t*>(gu.data_ptr<at::BFloat16>()) + m * 2 * n;
    uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()) + m * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __m256i s = to_bf16(silu16(from_bf16(g + i)));  // F.silu's bfloat16 output
      const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), to_bf16(_mm512_mul_ps(sf, from_bf16(g + n + i))));
    }
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(shardwise_act, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor", &silu_mul);
}
#else
TORCH_LIBRARY(shardwise_act, m) {}
#endif
