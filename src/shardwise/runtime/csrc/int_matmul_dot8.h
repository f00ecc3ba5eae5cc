// int8 weights against float32 rows on AVX-512 (int_matmul.cpp includes it inside its AVX-512 part, after
// prefetch_ahead, ScaleKind and scale_at).
#pragma once

// 16-lane vectors. Within a group, independent partial sums over its 32-element chunks; a group's sum
// times its scale goes into one of two sets of row accumulators, alternating by group.
inline __m512 f8(const int8_t* q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))); }

// R rows (q[i], scales from s0[i]) against one x, each summed exactly as a row alone is (R = 1: dot8), the x loads
// shared. Two rows from far apart in the matrix keep two memory streams going per thread: on a Xeon VM (AMX,
// 2 vCPUs) int8 rows streamed 23.5 -> 26.0 GB/s (300 MB cycled, 10 rounds shuffled) and an int8 decode step of the
// 2048x10 llama ran 38.2 -> 41.4 tok/s; two adjacent rows did not help (23.3), nor one row at a time in that
// alternating order (23.7). runtime.int_matmul measures whether a machine runs them (the `pairs` argument).
template <int R>
void dot8_rows(const int8_t* const* q, const float* x, int64_t K, int64_t group, const void* s, ScaleKind sk,
               const int64_t* s0, float* out) {
  __m512 a[R][4];
  float rest[R];
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < 4; ++j) a[i][j] = _mm512_setzero_ps();
    rest[i] = 0;
  }
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    __m512 t[R][4];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < 4; ++j) t[i][j] = _mm512_setzero_ps();
    int64_t k = g0;
    for (; k + 64 <= g0 + group; k += 64) {
      for (int i = 0; i < R; ++i) prefetch_ahead(q[i] + k);
      for (int j = 0; j < 4; ++j) {
        const __m512 xv = _mm512_loadu_ps(x + k + 16 * j);
        for (int i = 0; i < R; ++i) t[i][j] = _mm512_fmadd_ps(f8(q[i] + k + 16 * j), xv, t[i][j]);
      }
    }
    const bool last32 = k + 32 <= g0 + group;  // a last 32-element chunk
    for (int i = 0; i < R; ++i) {
      int64_t kk = k;
      if (last32) {
        t[i][0] = _mm512_fmadd_ps(f8(q[i] + kk), _mm512_loadu_ps(x + kk), t[i][0]);
        t[i][1] = _mm512_fmadd_ps(f8(q[i] + kk + 16), _mm512_loadu_ps(x + kk + 16), t[i][1]);
        kk += 32;
      }
      float tail = 0;  // per-channel rows whose width is not a multiple of 32 (a tensor-parallel slice)
      for (; kk < g0 + group; ++kk) tail += float(q[i][kk]) * x[kk];
      const float scale = scale_at(s, sk, s0[i] + g);
      rest[i] += scale * tail;
      const __m512 sc = _mm512_set1_ps(scale);
      if (g & 1) {  // a group's sum times its scale into a[0], a[1] (even groups) or a[2], a[3]
        a[i][2] = _mm512_fmadd_ps(sc, _mm512_add_ps(t[i][0], t[i][2]), a[i][2]);
        a[i][3] = _mm512_fmadd_ps(sc, _mm512_add_ps(t[i][1], t[i][3]), a[i][3]);
      } else {
        a[i][0] = _mm512_fmadd_ps(sc, _mm512_add_ps(t[i][0], t[i][2]), a[i][0]);
        a[i][1] = _mm512_fmadd_ps(sc, _mm512_add_ps(t[i][1], t[i][3]), a[i][1]);
      }
    }
  }
  for (int i = 0; i < R; ++i)
    out[i] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[i][0], a[i][2]), _mm512_add_ps(a[i][1], a[i][3]))) + rest[i];
}

float dot8(const int8_t* q, const float* x, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  float out;
  dot8_rows<1>(&q, x, K, group, s, sk, &s0, &out);
  return out;
}
