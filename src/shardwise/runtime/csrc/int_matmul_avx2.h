// int_matmul.cpp's AVX2 + FMA row kernels (the same 32-lane order as its AVX-512 ones), included by it inside
// its anonymous namespace, after scale_at: kept apart only to keep that file short.
#pragma once

inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

inline float lanes_sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  alignas(32) float v[8];
  _mm256_store_ps(v, s);
  return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

// One row of int8 weights against one row of x.
float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  float rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    int64_t k = g0;
    for (; k + 32 <= g0 + group; k += 32) {
      if ((k & 63) == 0) prefetch_ahead(q + k);
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      __m128i lo = _mm256_castsi256_si128(b), hi = _mm256_extracti128_si256(b, 1);
      t0 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(lo)), _mm256_loadu_ps(x + k), t0);
      t1 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), _mm256_loadu_ps(x + k + 8), t1);
      t2 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(hi)), _mm256_loadu_ps(x + k + 16), t2);
      t3 = _mm256_fmadd_ps(to_float(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), _mm256_loadu_ps(x + k + 24), t3);
    }
    float tail = 0;  // per-channel rows whose width is not a multiple of 32 (a tensor-parallel slice)
    for (; k < g0 + group; ++k) tail += float(q[k]) * x[k];
    const float scale = scale_at(s, sk, gi);
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
float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  const __m256i low = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m256 t0 = _mm256_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;
    for (int64_t k = g0; k < g0 + group; k += 32) {
      if ((k & 127) == 0) prefetch_ahead(q + k / 2);
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
    __m256 sc = _mm256_set1_ps(scale_at(s, sk, gi));
    a0 = _mm256_fmadd_ps(sc, t0, a0);
    a1 = _mm256_fmadd_ps(sc, t1, a1);
    a2 = _mm256_fmadd_ps(sc, t2, a2);
    a3 = _mm256_fmadd_ps(sc, t3, a3);
  }
  return lanes_sum(a0, a1, a2, a3);
}
