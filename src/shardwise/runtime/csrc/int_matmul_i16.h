// int4 / MXFP4 / int8 weights against bfloat16 rows held on integer grids (the kernel's i16), on AVX-512 VNNI: int_matmul.cpp
// includes it where AVX-512 VNNI builds the q8 path (after int_matmul_q8.h: kE2M1Bytes, add_group, chunk_scales).
//
// Each 32-block of a bfloat16 row is put once per call on its own power-of-two grid, step 2^(E - 140) for E the
// block's largest biased exponent: a bfloat16 value is its 8-bit significand times 2^(e - 134), so every element
// within 2^6 of the block's largest (e >= E - 6) is a whole number of steps below 2^14 and is held exactly; smaller
// ones round to the nearest step (half-even), off by at most 2^-14 of the block's largest element — 2^-6 of that
// element's own bfloat16 spacing. A block holding inf or NaN gets a NaN step (every output it reaches is NaN).
// A grid value xq (|xq| < 2^14) goes in as two int8 parts, xq = 128 hi + lo with lo in 0..127, and each part meets
// the stored nibbles (unsigned; the offset taken off through corr, as int_matmul_q8.h does) in vpdpbusd — 64
// products an instruction; hi's lane sums times 128 plus lo's are the exact integer sums (|sum| < 2^22), exact in
// float32 and times the block's power-of-two step: a 128-weight line's sums carry no rounding before its weight
// scales (the vdpbf16ps path rounds at every addition). Each row's sum depends on that row of x alone and is summed
// in one fixed order: a k+1-row verify pass equals k+1 one-row steps bit for bit.
//
// Why: on a Xeon VM (AMX, 2 vCPUs) vdpbf16ps is the costliest instruction of the bfloat16 path (one line of 128
// weights from L1: 4.6 ns, of which its four vdpbf16ps alone 2.9); these integer products take a fraction of that.
#pragma once

#include <algorithm>

// One 128-element chunk of one row on its grids, as two int8 parts xq = 128 * hi + lo (hi signed, lo 0..127): e / o
// the elements 2j / 2j + 1 (the low / high nibbles' ones); lane i of the integer sums holds elements 8i..8i+7, so
// corr[i] = -offset times their xq sum and steps[i] = the step of their 32-block, times unit.
struct alignas(64) I16Chunk {
  int8_t e_hi[64];
  int8_t o_hi[64];
  int8_t e_lo[64];
  int8_t o_lo[64];
  int32_t corr[16];
  float steps[16];
};

// One 32-block of a bfloat16 row on its grid (as int32 into q[0..31]); returns its step.
float grid_block(const uint16_t* v, int32_t* q) {
  int E = 0;
  for (int i = 0; i < 32; ++i) E = std::max(E, (v[i] >> 7) & 0xFF);
  // step 2^(E - 140): a float32's bits (subnormal below E = 14); NaN for a block holding inf or NaN
  const uint32_t bits = E == 255 ? 0x7FC00000u : E >= 14 ? uint32_t(E - 13) << 23 : 0x00400000u >> (13 - E);
  float step;
  std::memcpy(&step, &bits, sizeof step);
  const __m512 down = _mm512_set1_ps(float(140 - E));  // x * 2^(140 - E): exact (scalef), then rounded half-even
  for (int h = 0; h < 2; ++h) {
    const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * h)));
    const __m512 f = _mm512_scalef_ps(_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)), down);
    _mm512_storeu_si512(q + 16 * h, _mm512_cvtps_epi32(f));
  }
  return step;
}

// Rows x [M, K] (bfloat16 as uint16, K a multiple of 128) as M * K / 128 chunks, for weights whose stored nibbles
// stand for (nibble - offset) * unit: int4 8 and 1, MXFP4 (E2M1 values doubled) 12 and 0.5.
std::vector<I16Chunk> i16_rows(const uint16_t* x, int64_t M, int64_t K, int offset, float unit) {
  return int_rows<I16Chunk>(x, M, K, grid_block, [&](I16Chunk& ch, const int32_t* q, const float* steps) {
    spread_steps(steps, 4, unit, ch.steps);
    for (int j = 0; j < 64; ++j) {
      ch.e_hi[j] = int8_t(q[2 * j] >> 7);
      ch.e_lo[j] = int8_t(q[2 * j] & 127);
      ch.o_hi[j] = int8_t(q[2 * j + 1] >> 7);
      ch.o_lo[j] = int8_t(q[2 * j + 1] & 127);
    }
    lane_offsets(q, 8, offset, ch.corr);
  });
}

// R rows of 4-bit weights against one row's chunks (dot4_int): per chunk the nibbles times hi and lo (vpdpbusd, four
// products a lane each), hi's sums times 128 plus lo's — exact in int32 (|sum| < 2^22) and in float32, and exact times
// the blocks' power-of-two steps — then one fused multiply-add with the weight scales.
template <int R>
void dot4_i16(const uint8_t* const* q, const I16Chunk* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
              const int64_t* s0, float* out) {
  dot4_int<R>(q, xc, K, group, s, sk, s0, [](__m512i lo, __m512i hi, const I16Chunk& x, __m512 ws, __m512& acc) {
    const __m512i high = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_load_si512(x.e_hi)), hi, _mm512_load_si512(x.o_hi));
    const __m512i low = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(x.corr), lo, _mm512_load_si512(x.e_lo)), hi, _mm512_load_si512(x.o_lo));
    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high, 7), low)), _mm512_load_ps(x.steps));
    acc = _mm512_fmadd_ps(ws, t, acc);
  }, out);
}

// int8 weights (the kernel multiplies q + 128, unsigned): one 128-element chunk of one row on its grids, as two
// 64-element halves, each grid value's int8 parts hi / lo; lane i of half h holds elements 64h + 4i..+3, so
// corr[h][i] = -128 times their grid values' sum and steps[h][i] the step of their 32-block.
struct alignas(64) I16Line8 {
  int8_t hi[128];
  int8_t lo[128];
  int32_t corr[2][16];
  float steps[2][16];
};

std::vector<I16Line8> i16_rows8(const uint16_t* x, int64_t M, int64_t K) {
  return int_rows<I16Line8>(x, M, K, grid_block, [](I16Line8& ch, const int32_t* q, const float* steps) {
    spread_steps(steps, 8, 1.f, ch.steps[0]);
    for (int e = 0; e < 128; ++e) {
      ch.hi[e] = int8_t(q[e] >> 7);
      ch.lo[e] = int8_t(q[e] & 127);
    }
    for (int h = 0; h < 2; ++h) lane_offsets(q + 64 * h, 4, 128, ch.corr[h]);
  });
}

// R rows of int8 weights against one row's chunks (dot8_int_rows). Per 64 weights: one xor, two vpdpbusd, a shift and
// an add, then the exact float32 sums times their steps into one fused multiply-add with the weight scale.
template <int R>
void dot8_i16(const int8_t* const* q, const I16Line8* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
              const int64_t* s0, float* out) {
  dot8_int_rows<R>(q, xc, K, group, s, sk, s0, [](__m512i w, const I16Line8& x, int h, float scale, __m512& acc) {
    const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, _mm512_load_si512(x.hi + 64 * h));
    const __m512i low = _mm512_dpbusd_epi32(_mm512_load_si512(x.corr[h]), w, _mm512_load_si512(x.lo + 64 * h));
    const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high, 7), low)), _mm512_load_ps(x.steps[h]));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(scale), t, acc);
  }, out);
}
