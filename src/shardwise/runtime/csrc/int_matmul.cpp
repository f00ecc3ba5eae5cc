// Weight-only int8 / int4 matrix products for CPU decode: y[m, r] = sum_k x[m, k] * w[r, k], where
// w[r, k] = q[r, k] * scale[r, k / group] and q is read packed (int8, or two 4-bit values per byte)
// and turned into float in registers; nothing dequantized is written to memory.
//
// Layouts (those of compressed-tensors' pack-quantized int32 words, read as bytes, little-endian):
//   bits 8: q int8 [N, K] (the stored unsigned byte minus 128, converted once at load);
//   bits 4: q uint8 [N, K/2], element 2j in the low nibble of byte j, 2j+1 in the high one,
//           each stored unsigned with offset 8 (value = nibble - 8).
// scale [N, K/group] float32 or bfloat16; x float32 [M, K]; group a multiple of 32 dividing K, or
// (8 bits, per channel) the whole row of any width, whose last K % 32 products are summed one by one.
//
// Every row is summed in one fixed order (32 lanes per group, a group's sum times its scale added
// to 32 row lanes, then a fixed-order reduction of the lanes), whatever M and whichever rows share
// a call: results are bit-identical between a one-row decode step and a k+1-row verify pass.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SHARDWISE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDWISE_AVX2 1
#endif

namespace {

// How far ahead of its reads a thread asks for weight bytes (_mm_prefetch, one cache line per 128
// weights): a decode step streams every weight from memory once, and the hardware prefetcher alone
// keeps too few lines in flight. Measured here (185 MB of int8 rows, two threads): 11-13 GB/s without,
// 16.0 / 17.3 / 19.3 / 18.0 GB/s at 1, 2, 4 and 8 KB ahead; int4 8 -> 11 GB/s (its unpacking bounds it).
constexpr int64_t kPrefetchBytes = 4096;

inline float scale_at(const void* s, bool bf16, int64_t i) {
  if (!bf16) return static_cast<const float*>(s)[i];
  uint32_t bits = uint32_t(static_cast<const uint16_t*>(s)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(SHARDWISE_AVX512)
// 16-lane vectors. Within a group, independent partial sums over its 32-element chunks; a group's sum
// times its scale goes into one of two sets of row accumulators, alternating by group.
inline __m512 f8(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))); }

float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  float rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    int64_t k = g0;
    for (; k + 64 <= g0 + group; k += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(q + k) + kPrefetchBytes, _MM_HINT_T0);
      t0 = _mm512_fmadd_ps(f8(q + k), _mm512_loadu_ps(x + k), t0);
      t1 = _mm512_fmadd_ps(f8(q + k + 16), _mm512_loadu_ps(x + k + 16), t1);
      t2 = _mm512_fmadd_ps(f8(q + k + 32), _mm512_loadu_ps(x + k + 32), t2);
      t3 = _mm512_fmadd_ps(f8(q + k + 48), _mm512_loadu_ps(x + k + 48), t3);
    }
    if (k + 32 <= g0 + group) {  // a last 32-element chunk
      t0 = _mm512_fmadd_ps(f8(q + k), _mm512_loadu_ps(x + k), t0);
      t1 = _mm512_fmadd_ps(f8(q + k + 16), _mm512_loadu_ps(x + k + 16), t1);
      k += 32;
    }
    float tail = 0;  // per-channel rows whose width is not a multiple of 32 (a tensor-parallel slice)
    for (; k < g0 + group; ++k) tail += float(q[k]) * x[k];
    const float scale = scale_at(s, bf16, gi);
    rest += scale * tail;
    __m512 sc = _mm512_set1_ps(scale);
    if ((gi - s0) & 1) {
      a2 = _mm512_fmadd_ps(sc, _mm512_add_ps(t0, t2), a2);
      a3 = _mm512_fmadd_ps(sc, _mm512_add_ps(t1, t3), a3);
    } else {
      a0 = _mm512_fmadd_ps(sc, _mm512_add_ps(t0, t2), a0);
      a1 = _mm512_fmadd_ps(sc, _mm512_add_ps(t1, t3), a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3))) + rest;
}

// 16 packed bytes (32 nibbles) widened to one byte per 32-bit lane.
inline __m512i bytes16(const uint8_t* q) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))); }

// acc += scale · the low (even elements) or high (odd elements) nibbles of w, as floats, times x.
inline __m512 fma_low(__m512i w, __m512 lut, const float* x, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(w, lut), _mm512_loadu_ps(x), acc);
}
inline __m512 fma_high(__m512i w, __m512 lut, const float* x, __m512 acc) {
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), lut), _mm512_loadu_ps(x), acc);
}

// A group's sum t, times its scale, into a0 (even groups of the row) or a1 (odd ones).
inline void add_group(__m512 sc, __m512 t, bool odd, __m512& a0, __m512& a1) {
  if (odd) {
    a1 = _mm512_fmadd_ps(sc, t, a1);
  } else {
    a0 = _mm512_fmadd_ps(sc, t, a0);
  }
}

// xp: each 32-chunk of x as its 16 even then its 16 odd elements (the nibble order). A nibble becomes
// its float value (nibble - 8) through a 16-entry table (vpermps reads the low 4 bits of each index).
float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  const __m512 lut = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  if (group == 32) {  // one 32-element chunk per scale: no per-group sums of partial chains
    for (int64_t k = 0, gi = s0; k < K; k += 32, ++gi) {
      if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + k / 2) + kPrefetchBytes, _MM_HINT_T0);
      __m512i w = bytes16(q + k / 2);
      __m512 t = fma_high(w, lut, xp + k + 16, _mm512_mul_ps(_mm512_permutexvar_ps(w, lut), _mm512_loadu_ps(xp + k)));
      add_group(_mm512_set1_ps(scale_at(s, bf16, gi)), t, (gi - s0) & 1, a0, a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  }
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;  // four independent chains
    int64_t k = g0;
    for (; k + 64 <= g0 + group; k += 64) {
      if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + k / 2) + kPrefetchBytes, _MM_HINT_T0);
      __m512i w = bytes16(q + k / 2), v = bytes16(q + k / 2 + 16);
      t0 = fma_low(w, lut, xp + k, t0);
      t1 = fma_high(w, lut, xp + k + 16, t1);
      t2 = fma_low(v, lut, xp + k + 32, t2);
      t3 = fma_high(v, lut, xp + k + 48, t3);
    }
    if (k < g0 + group) {  // a last 32-element chunk
      __m512i w = bytes16(q + k / 2);
      t0 = fma_low(w, lut, xp + k, t0);
      t1 = fma_high(w, lut, xp + k + 16, t1);
    }
    __m512 t = _mm512_add_ps(_mm512_add_ps(t0, t2), _mm512_add_ps(t1, t3));
    add_group(_mm512_set1_ps(scale_at(s, bf16, gi)), t, (gi - s0) & 1, a0, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}
#elif defined(SHARDWISE_AVX2)
inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

inline float lanes_sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  alignas(32) float v[8];
  _mm256_store_ps(v, s);
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// One row of int8 weights against one row of x.
float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  float rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    int64_t k = g0;
    for (; k + 32 <= g0 + group; k += 32) {
      if ((k & 63) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + k) + kPrefetchBytes, _MM_HINT_T0);
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
      t0 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x + k), t0);
      t1 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + k + 8), t1);
      t2 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + k + 16), t2);
      t3 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + k + 24), t3);
    }
    float tail = 0;  // per-channel rows whose width is not a multiple of 32 (a tensor-parallel slice)
    for (; k < g0 + group; ++k) tail += float(q[k]) * x[k];
    const float scale = scale_at(s, bf16, gi);
    rest += scale * tail;
    __m256 sc = _mm256_set1_ps(scale);
    a0 = _mm256_fmadd_ps(sc, t0, a0);
    a1 = _mm256_fmadd_ps(sc, t1, a1);
    a2 = _mm256_fmadd_ps(sc, t2, a2);
    a3 = _mm256_fmadd_ps(sc, t3, a3);
  }
  return lanes_sum(a0, a1, a2, a3) + rest;
}

// One row of 4-bit weights; xp is x with each 32-chunk reordered as its 16 even then 16 odd elements.
float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    for (int64_t k = g0; k < g0 + group; k += 32) {
      if ((k & 127) == 0) _mm_prefetch(reinterpret_cast<const char*>(q + k / 2) + kPrefetchBytes, _MM_HINT_T0);
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k / 2));
      __m256i w0 = _mm256_cvtepu8_epi32(b), w1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
      __m256i e0 = _mm256_sub_epi32(_mm256_and_si256(w0, low), eight);
      __m256i e1 = _mm256_sub_epi32(_mm256_and_si256(w1, low), eight);
      __m256i o0 = _mm256_sub_epi32(_mm256_srli_epi32(w0, 4), eight);
      __m256i o1 = _mm256_sub_epi32(_mm256_srli_epi32(w1, 4), eight);
      t0 = _mm256_fmadd_ps(to_float(e0), _mm256_loadu_ps(xp + k), t0);
      t1 = _mm256_fmadd_ps(to_float(e1), _mm256_loadu_ps(xp + k + 8), t1);
      t2 = _mm256_fmadd_ps(to_float(o0), _mm256_loadu_ps(xp + k + 16), t2);
      t3 = _mm256_fmadd_ps(to_float(o1), _mm256_loadu_ps(xp + k + 24), t3);
    }
    __m256 sc = _mm256_set1_ps(scale_at(s, bf16, gi));
    a0 = _mm256_fmadd_ps(sc, t0, a0);
    a1 = _mm256_fmadd_ps(sc, t1, a1);
    a2 = _mm256_fmadd_ps(sc, t2, a2);
    a3 = _mm256_fmadd_ps(sc, t3, a3);
  }
  return lanes_sum(a0, a1, a2, a3);
}
#else
// Portable versions with the same 32-lane order (no AVX2/FMA on this machine).
inline float lanes_sum(const float* a) {
  float v[8];
  for (int j = 0; j < 8; ++j) v[j] = (a[j] + a[8 + j]) + (a[16 + j] + a[24 + j]);
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  float a[32] = {0}, rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    float t[32] = {0}, tail = 0;
    int64_t k = g0;
    for (; k + 32 <= g0 + group; k += 32)
      for (int j = 0; j < 32; ++j) t[j] += float(q[k + j]) * x[k + j];
    for (; k < g0 + group; ++k) tail += float(q[k]) * x[k];
    float sc = scale_at(s, bf16, gi);
    rest += sc * tail;
    for (int j = 0; j < 32; ++j) a[j] += sc * t[j];
  }
  return lanes_sum(a) + rest;
}

float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, bool bf16, int64_t s0) {
  float a[32] = {0};
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    float t[32] = {0};
    for (int64_t k = g0; k < g0 + group; k += 32)
      for (int j = 0; j < 16; ++j) {
        uint8_t b = q[k / 2 + j];
        int lane = j < 8 ? j : 8 + (j - 8);  // even elements fill lanes 0..15, odd ones 16..31
        t[lane] += float(int(b & 15) - 8) * xp[k + j];
        t[16 + lane] += float(int(b >> 4) - 8) * xp[k + 16 + j];
      }
    float sc = scale_at(s, bf16, gi);
    for (int j = 0; j < 32; ++j) a[j] += sc * t[j];
  }
  return lanes_sum(a);
}
#endif

at::Tensor int_matmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32 [M, K]");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && scale.dim() == 2 && scale.is_contiguous(), "q and scale must be contiguous 2-D");
  TORCH_CHECK(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16, "scale must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  TORCH_CHECK(K % group == 0 && (group % 32 == 0 || (bits == 8 && group == K)),
              "group must divide K and be a multiple of 32 (or, for 8 bits, the whole row)");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == K / group, "scale must be [N, K / group]");
  if (bits == 8) {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == K, "8-bit q must be int8 [N, K]");
  } else {
    TORCH_CHECK(bits == 4 && q.scalar_type() == at::kByte && q.size(1) == K / 2, "4-bit q must be uint8 [N, K / 2]");
  }
  auto y = at::empty({M, N}, x.options());
  const float* xs = x.data_ptr<float>();
  std::vector<float> perm;
  if (bits == 4) {  // each 32-chunk of x as its even then its odd elements (the nibble order)
    perm.resize(M * K);
    for (int64_t i = 0; i < M * K; i += 32)
      for (int j = 0; j < 16; ++j) {
        perm[i + j] = xs[i + 2 * j];
        perm[i + 16 + j] = xs[i + 2 * j + 1];
      }
    xs = perm.data();
  }
  const bool bf16 = scale.scalar_type() == at::kBFloat16;
  const void* sp = scale.data_ptr();
  float* yp = y.data_ptr<float>();
  const int64_t G = K / group;
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t m = 0; m < M; ++m)
        yp[m * N + r] = bits == 8
            ? dot8(q.data_ptr<int8_t>() + r * K, xs + m * K, K, group, sp, bf16, r * G)
            : dot4(q.data_ptr<uint8_t>() + r * (K / 2), xs + m * K, K, group, sp, bf16, r * G);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(shardwise_int, m) {
  m.def("int_matmul(Tensor x, Tensor q, Tensor scale, int bits, int group) -> Tensor", &int_matmul);
}
