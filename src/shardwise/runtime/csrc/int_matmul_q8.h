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

// corr[i] = -offset times the sum of q's elements span * i .. span * i + span - 1 (i < 16): the integer lanes' start,
// taking off the offset the unsigned weights carry.
inline void lane_offsets(const int32_t* q, int span, int offset, int32_t* corr) {
  for (int i = 0; i < 16; ++i) {
    int32_t sum = 0;
    for (int e = span * i; e < span * i + span; ++e) sum += q[e];
    corr[i] = -offset * sum;
  }
}

// Rows x [M, K] (K a multiple of 128) as M * K / 128 chunks: round(block, q) puts one 32-block on integers (into
// q[0..31]) and returns its step; fill(chunk, q, steps) lays out a chunk's 128 integers and its four blocks' steps.
template <class Chunk, class T, class Round, class Fill>
std::vector<Chunk> int_rows(const T* x, int64_t M, int64_t K, const Round& round, const Fill& fill) {
  std::vector<Chunk> out(M * K / 128);
  alignas(64) int32_t q[128];
  float steps[4];
  for (int64_t c = 0; c < M * K / 128; ++c) {
    for (int b = 0; b < 4; ++b) steps[b] = round(x + 128 * c + 32 * b, q + 32 * b);
    fill(out[c], q, steps);
  }
  return out;
}

// lanes[i] = steps[i / per] * unit, i < 4 * per: a chunk's four block steps spread to the integer lanes summing them.
inline void spread_steps(const float* steps, int per, float unit, float* lanes) {
  for (int i = 0; i < 4 * per; ++i) lanes[i] = steps[i / per] * unit;
}

// Rows x [M, K] (float32, or bfloat16 as uint16), K a multiple of 128, as M * K / 128 chunks, for weights whose
// stored nibbles stand for (nibble - offset) * unit: int4 8 and 1, MXFP4 (E2M1 values doubled) 12 and 0.5.
template <class T>
std::vector<Q8Chunk> q8_rows(const T* x, int64_t M, int64_t K, int offset, float unit) {
  return int_rows<Q8Chunk>(x, M, K, round_block<T>, [&](Q8Chunk& ch, const int32_t* q, const float* d) {
    spread_steps(d, 4, unit, ch.xs);
    for (int j = 0; j < 64; ++j) {
      ch.xe[j] = int8_t(q[2 * j]);
      ch.xo[j] = int8_t(q[2 * j + 1]);
    }
    lane_offsets(q, 8, offset, ch.corr);
  });
}

// MXFP4's nibbles as unsigned bytes 2 * E2M1 + 12 (0..24; the x chunks' offset 12, unit 0.5), one vpshufb each.
const __m512i kE2M1Bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));

// R rows of 4-bit weights (q[i], scales from s0[i]: float32, bfloat16 or E8M0 — then E2M1 values, group 32; else
// group 32, 64 or a multiple of 128) against one row's chunks xc (Q8Chunk here, GridChunk for int_matmul_grids.h), each
// row summed exactly as alone (R = 1); chunks alternate between two accumulators. The stored nibbles go in unsigned
// (MXFP4's through kE2M1Bytes); add(lo, hi, x, ws, acc) adds one chunk's products times its weight scales ws to acc.
template <int R, class Chunk, class Add>
void dot4_int(const uint8_t* const* q, const Chunk* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
              const int64_t* s0, const Add& add, float* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const int count = group < 128 ? int(128 / group) : 1;
  const __m512i idx = group == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                  : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  for (int64_t k = 0, c = 0; k < K; k += 128, ++c) {
    const Chunk& x = xc[c];
    for (int i = 0; i < R; ++i) prefetch_ahead(q[i] + k / 2);
    for (int i = 0; i < R; ++i) {
      const __m512i w = _mm512_loadu_si512(q[i] + k / 2);
      __m512i lo = _mm512_and_si512(w, low4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4);
      if (sk == kE8M0) {
        lo = _mm512_shuffle_epi8(kE2M1Bytes, lo);
        hi = _mm512_shuffle_epi8(kE2M1Bytes, hi);
      }
      const __m512 ws = group < 128 ? chunk_scales(s, sk, s0[i] + k / group, count, idx) : _mm512_set1_ps(scale_at(s, sk, s0[i] + k / group));
      add(lo, hi, x, ws, a[i][c & 1]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

template <int R>
void dot4_q8(const uint8_t* const* q, const Q8Chunk* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
             const int64_t* s0, float* out) {
  dot4_int<R>(q, xc, K, group, s, sk, s0, [](__m512i lo, __m512i hi, const Q8Chunk& x, __m512 ws, __m512& acc) {
    const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(x.corr), lo, _mm512_load_si512(x.xe)), hi, _mm512_load_si512(x.xo));
    acc = _mm512_fmadd_ps(_mm512_mul_ps(ws, _mm512_load_ps(x.xs)), _mm512_cvtepi32_ps(sum), acc);
  }, out);
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
  return int_rows<Q8Line8>(x, M, K, round_block<T>, [](Q8Line8& ch, const int32_t* q, const float* d) {
    spread_steps(d, 8, 1.f, ch.xs[0]);
    for (int e = 0; e < 128; ++e) ch.x[e] = int8_t(q[e]);
    for (int h = 0; h < 2; ++h) lane_offsets(q + 64 * h, 4, 128, ch.corr[h]);
  });
}

// dot8_int_rows' loop, PerRow: one scale per row.
template <int R, bool PerRow, class Line, class Add>
void dot8_int(const int8_t* const* q, const Line* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
              const int64_t* s0, const Add& add, float* out) {
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  const int64_t per_group = PerRow ? 1 : group / 64;  // 64-weight halves per scale
  for (int64_t k = 0, c = 0, g = 0; k < K; k += 128, ++c) {
    const Line& x = xc[c];
    for (int i = 0; i < R; ++i) {
      prefetch_ahead(q[i] + k);
      prefetch_ahead(q[i] + k + 64);
    }
    for (int h = 0; h < 2; ++h, ++g)
      for (int i = 0; i < R; ++i) {
        const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(q[i] + k + 64 * h), flip);
        add(w, x, h, PerRow ? 1.f : scale_at(s, sk, s0[i] + g / per_group), a[i][h]);
      }
  }
  for (int i = 0; i < R; ++i) {
    const float sum = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
    out[i] = PerRow ? sum * scale_at(s, sk, s0[i]) : sum;
  }
}

// R rows of int8 weights (q[i], scales from s0[i]; one scale per row — group = K — or groups of a multiple of 64)
// against one row's chunks (Q8Line8 here, GridLine8 for int_matmul_grids.h), each row summed exactly as alone; the two
// halves of a chunk into two accumulators. The weights go in as q + 128 (unsigned); add(w, x, h, scale, acc) adds
// half h's products (times its group's scale, 1 for a per-channel row: its scale multiplies the row's sum) to acc.
template <int R, class Line, class Add>
void dot8_int_rows(const int8_t* const* q, const Line* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
                   const int64_t* s0, const Add& add, float* out) {
  if (group == K) return dot8_int<R, true>(q, xc, K, group, s, sk, s0, add, out);
  dot8_int<R, false>(q, xc, K, group, s, sk, s0, add, out);
}

// Per 64 weights: one xor (q + 128), one vpdpbusd, a conversion and a fused multiply-add.
template <int R>
void dot8_q8(const int8_t* const* q, const Q8Line8* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
             const int64_t* s0, float* out) {
  const bool per_row = group == K;
  dot8_int_rows<R>(q, xc, K, group, s, sk, s0, [per_row](__m512i w, const Q8Line8& x, int h, float scale, __m512& acc) {
    const __m512 xs = _mm512_load_ps(x.xs[h]);
    const __m512 t = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_load_si512(x.corr[h]), w, _mm512_load_si512(x.x + 64 * h)));
    acc = _mm512_fmadd_ps(per_row ? xs : _mm512_mul_ps(_mm512_set1_ps(scale), xs), t, acc);
  }, out);
}
