// int4 / MXFP4 / int8 weights against rows quantized to int8 (llama.cpp's Q4_0 / MXFP4 / Q8_0 x Q8_0 arithmetic), on
// AVX-512 VNNI: int_matmul.cpp
// includes it inside its AVX-512 part, after prefetch_ahead, ScaleKind, scale_at and chunk_scales.
//
// x is rounded once per call, each block of 32 elements to int8 with its own float32 step d = max|x| / 127
// (xq = round-half-even(x * (1 / d)), so |x - d xq| <= d / 2); then every product is an exact integer (vpdpbusd:
// 64 unsigned nibbles times 64 signed bytes, summed four at a time into 16 int32 lanes), and a lane's integer sum
// times its weight scale times its block's d is added in float32. The nibbles are the stored values (q + 8); the
// 8 * sum(xq) they add is taken off by starting each lane at -8 times its eight xq's sum. MXFP4's E2M1 values go in
// doubled and offset by 12 (one byte shuffle per 64), their unit 0.5 folded into d; int8 weights as q + 128 (one
// xor per 64), less 128 * sum(xq) the same way (dot8_q8). Each row's sum depends on
// that row of x alone and is summed in one fixed order: a k+1-row verify pass equals k+1 one-row steps bit for bit.
//
// Why: on a Xeon VM (AMX, 2 vCPUs), 4-bit rows of 2048 (groups of 32), the bfloat16-row loop streamed 10.0-10.7 GB/s
// on one core from L1 and 20.4-21.2 GB/s on two from memory, this one 17.5-18.8 and 27.7-28.6 (standalone, side by
// side): it spends two integer dot products and three bit operations per 128 weights where that one spends four
// vdpbf16ps, four table lookups and three shifts. The price is x's rounding (at most half a step of 1/127 of its
// block's largest element), which float rows do not pay; runtime.int_matmul takes this path only when asked.
#pragma once

#include <limits>

// One 128-element chunk of one x row as the kernel reads it: xe[j] = xq[2j] (the low nibbles' elements), xo[j] =
// xq[2j + 1]; lane i of the integer sums holds elements 8i..8i+7, so corr[i] = -8 * their xq sum and xs[i] = the d of
// their 32-block.
struct alignas(64) Q8Chunk {
  int8_t xe[64];
  int8_t xo[64];
  int32_t corr[16];
  float xs[16];
};

inline __m512 widen16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 widen16(const uint16_t* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

// One 32-block of x rounded to int8 (as int32 into q[0..31]); returns its step d (NaN where the block holds a NaN, so
// that NaN stays one in y).
template <class T>
float round_block(const T* xb, int32_t* q) {
  const __m512 lo = widen16(xb), hi = widen16(xb + 16);
  const bool nan = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
  const float d = nan ? amax + std::numeric_limits<float>::quiet_NaN() : amax / 127.f;
  const float inv = d != 0.f && d == d ? 1.f / d : 0.f;
  const __m512 iv = _mm512_set1_ps(inv);
  _mm512_storeu_si512(q, _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv)));  // rounds half to even (MXCSR)
  _mm512_storeu_si512(q + 16, _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv)));
  return d;
}

// Rows x [M, K] (float32, or bfloat16 as uint16), K a multiple of 128, as M * K / 128 chunks, for weights whose
// stored nibbles stand for (nibble - offset) * unit: int4 8 and 1, MXFP4 (E2M1 values doubled) 12 and 0.5.
template <class T>
std::vector<Q8Chunk> q8_rows(const T* x, int64_t M, int64_t K, int offset, float unit) {
  std::vector<Q8Chunk> out(M * K / 128);
  alignas(64) int32_t q[128];
  for (int64_t c = 0; c < M * K / 128; ++c) {
    Q8Chunk& ch = out[c];
    for (int b = 0; b < 4; ++b) {  // 32-blocks
      const float d = round_block(x + c * 128 + 32 * b, q + 32 * b);
      for (int i = 4 * b; i < 4 * b + 4; ++i) ch.xs[i] = d * unit;
    }
    for (int j = 0; j < 64; ++j) {
      ch.xe[j] = int8_t(q[2 * j]);
      ch.xo[j] = int8_t(q[2 * j + 1]);
    }
    for (int i = 0; i < 16; ++i) {
      int32_t s = 0;
      for (int e = 8 * i; e < 8 * i + 8; ++e) s += q[e];
      ch.corr[i] = -offset * s;
    }
  }
  return out;
}

// MXFP4's nibbles as unsigned bytes 2 * E2M1 + 12 (0..24; the x chunks' offset 12, unit 0.5), one vpshufb each.
const __m512i kE2M1Bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));

// R rows of 4-bit weights (q[i], scales from s0[i]: float32, bfloat16 or E8M0 — then E2M1 values, group 32; else
// group 32, 64 or a multiple of 128) against one row's chunks xc, each row summed exactly as alone (R = 1); chunks
// alternate between two accumulators.
template <int R>
void dot4_q8(const uint8_t* const* q, const Q8Chunk* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
             const int64_t* s0, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int count = group < 128 ? int(128 / group) : 1;
  const __m512i idx = group == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0, c = 0; k < K; k += 128, ++c) {
    const Q8Chunk& x = xc[c];
    for (int i = 0; i < R; ++i) prefetch_ahead(q[i] + k / 2);
    for (int i = 0; i < R; ++i) {
      const __m512i w = _mm512_loadu_si512(q[i] + k / 2);
      __m512i acc = _mm512_load_si512(x.corr);
      __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      if (sk == kE8M0) {
        lo = _mm512_shuffle_epi8(kE2M1Bytes, lo);
        hi = _mm512_shuffle_epi8(kE2M1Bytes, hi);
      }
      acc = _mm512_dpbusd_epi32(acc, lo, _mm512_load_si512(x.xe));
      acc = _mm512_dpbusd_epi32(acc, hi, _mm512_load_si512(x.xo));
      const __m512 ws = group < 128 ? chunk_scales(s, sk, s0[i] + k / group, count, idx) : _mm512_set1_ps(scale_at(s, sk, s0[i] + k / group));
      add_group(_mm512_mul_ps(ws, _mm512_load_ps(x.xs)), _mm512_cvtepi32_ps(acc), c & 1, a[i][0], a[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

// int8 weights (stored as q; the kernel multiplies q + 128, unsigned, by the signed int8 row): one 128-element chunk of
// one x row in its own order, as two 64-element halves; lane i of half h holds elements 64h + 4i..+3, so corr[h][i] =
// -128 times their xq sum and xs[h][i] the d of their 32-block.
struct alignas(64) Q8Line8 {
  int8_t x[128];
  int32_t corr[2][16];
  float xs[2][16];
};

template <class T>
std::vector<Q8Line8> q8_rows8(const T* x, int64_t M, int64_t K) {
  std::vector<Q8Line8> out(M * K / 128);
  alignas(64) int32_t q[128];
  for (int64_t c = 0; c < M * K / 128; ++c) {
    Q8Line8& ch = out[c];
    for (int b = 0; b < 4; ++b) {
      const float d = round_block(x + c * 128 + 32 * b, q + 32 * b);
      for (int i = 8 * (b % 2); i < 8 * (b % 2) + 8; ++i) ch.xs[b / 2][i] = d;
    }
    for (int e = 0; e < 128; ++e) ch.x[e] = int8_t(q[e]);
    for (int h = 0; h < 2; ++h)
      for (int i = 0; i < 16; ++i) ch.corr[h][i] = -128 * (q[64 * h + 4 * i] + q[64 * h + 4 * i + 1] + q[64 * h + 4 * i + 2] + q[64 * h + 4 * i + 3]);
  }
  return out;
}

// R rows of int8 weights (q[i], scales from s0[i]; one scale per row — group = K — or groups of a multiple of 64)
// against one row's chunks, each row summed exactly as alone; the two halves of a chunk into two accumulators.
// Per 64 weights: one xor (q + 128), one vpdpbusd, a conversion and a fused multiply-add.
template <int R, bool PerRow>
void dot8_q8_lines(const int8_t* const* q, const Q8Line8* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
                   const int64_t* s0, float* out) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  const int64_t per_group = PerRow ? 1 : group / 64;  // 64-weight halves per scale
  for (int64_t k = 0, c = 0, g = 0; k < K; k += 128, ++c) {
    const Q8Line8& x = xc[c];
    for (int i = 0; i < R; ++i) {
      prefetch_ahead(q[i] + k);
      prefetch_ahead(q[i] + k + 64);
    }
    for (int h = 0; h < 2; ++h, ++g) {
      const __m512 xs = _mm512_load_ps(x.xs[h]);
      for (int i = 0; i < R; ++i) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(q[i] + k + 64 * h), flip);
        const __m512 t = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_load_si512(x.corr[h]), w, _mm512_load_si512(x.x + 64 * h)));
        a[i][h] = _mm512_fmadd_ps(PerRow ? xs : _mm512_mul_ps(_mm512_set1_ps(scale_at(s, sk, s0[i] + g / per_group)), xs), t, a[i][h]);
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
    out[i] = PerRow ? sum * scale_at(s, sk, s0[i]) : sum;
  }
}
template <int R>
void dot8_q8(const int8_t* const* q, const Q8Line8* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
             const int64_t* s0, float* out) {
  if (group == K) return dot8_q8_lines<R, true>(q, xc, K, group, s, sk, s0, out);
  dot8_q8_lines<R, false>(q, xc, K, group, s, sk, s0, out);
}
