// int4 / MXFP4 weights against bfloat16 rows held on int16 grids (the kernel's i16), on AVX-512 VNNI: int_matmul.cpp
// includes it where AVX-512 VNNI builds the q8 path, after dot4_lines and line_order.
//
// Each 32-block of a bfloat16 row is put once per call on its own power-of-two grid, step 2^(E - 141) for E the
// block's largest biased exponent: a bfloat16 value is its 8-bit significand times 2^(e - 134), so every element
// within 2^7 of the block's largest (e >= E - 7) is a whole number of steps below 2^15 and is held exactly; smaller
// ones round to the nearest step (half-even), off by at most 2^-15 of the block's largest element — 2^-7 of that
// element's own bfloat16 spacing. A block holding inf or NaN gets a NaN step (every output it reaches is NaN).
// Then every product is an exact integer (vpdpwssd: 32 int16 weights times 32 int16 elements, summed two at a time
// into 16 int32 lanes), a lane's eight products sum exactly (|sum| < 2^22), and the lane times its block's step is
// exact in float32: a 128-weight line's sums carry no rounding at all before its weight scales (the vdpbf16ps path
// rounds at every addition). MXFP4's E2M1 values go in doubled (exact integers), their unit 0.5 folded into the step.
// Each row's sum depends on that row of x alone and is summed in one fixed order: a k+1-row verify pass equals k+1
// one-row steps bit for bit.
//
// Why: on a Xeon VM (AMX, 2 vCPUs) vdpbf16ps is the costliest instruction of the bfloat16 path (one line of 128
// weights from L1: 4.6 ns, of which its four vdpbf16ps alone 2.9), vpdpwssd does the same 32 products in about 60% of
// its time: the line 2.9 ns (standalone loops, one core).
#pragma once

#include <algorithm>

// A 32-entry int16 table for vpermw (it reads an index's low 5 bits: the 16 values repeat).
template <class Value>
__m512i i16_table(Value value) {
  alignas(64) int16_t t[32];
  for (int i = 0; i < 32; ++i) t[i] = int16_t(value(i & 15));
  return _mm512_load_si512(t);
}
const __m512i kNibbleI16 = i16_table([](int n) { return n - 8; });
const __m512i kE2M1I16 = i16_table([](int n) { return int(2 * kE2M1[n]); });  // doubled: 0, 1, 2, 3, 4, 6, 8, 12

// Rows of x on their grids: x [M, K] int16 in line order (line_order, 4 blocks of 32 words per 128), steps
// [M, K / 128, 16] float32 (lane i of a line's sums holds elements 8i..8i+7: its 32-block is lane / 4) times unit.
struct I16Rows {
  std::vector<int16_t> x;
  std::vector<float> steps;
  std::vector<int32_t> corr;  // [M, K / 128, 16]: -8 times the sum of lane i's eight elements
};

I16Rows i16_rows(const uint16_t* xs, int64_t M, int64_t K, float unit) {
  std::vector<int16_t> plain(M * K);
  std::vector<float> block_steps(M * K / 32);
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const uint16_t* v = xs + 32 * b;
    int E = 0;
    for (int i = 0; i < 32; ++i) E = std::max(E, (v[i] >> 7) & 0xFF);
    const uint32_t step_bits = E == 255 ? 0x7FC00000u : E >= 141 - 126 ? uint32_t(E - 141 + 127) << 23 : 0x00400000u >> (14 - E);
    std::memcpy(&block_steps[b], &step_bits, sizeof(float));
    block_steps[b] *= unit;
    const __m512 down = _mm512_set1_ps(float(141 - E));  // x * 2^(141 - E): exact (scalef), then rounded half-even
    for (int h = 0; h < 2; ++h) {
      const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + 16 * h)));
      const __m512 f = _mm512_scalef_ps(_mm512_castsi512_ps(_mm512_slli_epi32(words, 16)), down);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(plain.data() + 32 * b + 16 * h), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(f)));
    }
  }
  I16Rows rows{line_order(plain.data(), M * K, 4), std::vector<float>(M * K / 8), std::vector<int32_t>(M * K / 8)};
  for (int64_t line = 0; line < M * K / 128; ++line)
    for (int i = 0; i < 16; ++i) {
      rows.steps[16 * line + i] = block_steps[4 * line + i / 4];
      int32_t sum = 0;
      for (int e = 0; e < 8; ++e) sum += plain[128 * line + 8 * i + e];
      rows.corr[16 * line + i] = -8 * sum;
    }
  return rows;
}

// One 128-weight line's exact integer sums with its x (four blocks of 32 words, as chunk128 reads bfloat16 ones).
inline __m512i chunk128_i16(const uint8_t* q, const int16_t* x, __m512i table) {
  const __m512i w = _mm512_loadu_si512(q);
  __m512i a = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_permutexvar_epi16(w, table), _mm512_loadu_si512(x));
  __m512i b = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), table), _mm512_loadu_si512(x + 32));
  a = _mm512_dpwssd_epi32(a, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 8), table), _mm512_loadu_si512(x + 64));
  b = _mm512_dpwssd_epi32(b, _mm512_permutexvar_epi16(_mm512_srli_epi16(w, 12), table), _mm512_loadu_si512(x + 96));
  return _mm512_add_epi32(a, b);
}

// R rows of 4-bit weights against one row of i16_rows (xp: its x, steps: its steps; K a multiple of 128; group 32,
// 64 or a multiple of 128).
inline __m512i chunk128_u4(const uint8_t* q, const int16_t* x, __m512i corr) {
  const __m512i w = _mm512_loadu_si512(q), m = _mm512_set1_epi16(0x000F);
  __m512i a = _mm512_dpwssd_epi32(corr, _mm512_and_si512(w, m), _mm512_loadu_si512(x));
  __m512i b = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(w, 4), m), _mm512_loadu_si512(x + 32));
  a = _mm512_dpwssd_epi32(a, _mm512_and_si512(_mm512_srli_epi16(w, 8), m), _mm512_loadu_si512(x + 64));
  b = _mm512_dpwssd_epi32(b, _mm512_srli_epi16(w, 12), _mm512_loadu_si512(x + 96));
  return _mm512_add_epi32(a, b);
}

template <int R>
void dot4_i16(const uint8_t* const* q, const int16_t* xp, const float* steps, const int32_t* corr, int64_t K, int64_t group, const void* s,
              ScaleKind sk, const int64_t* s0, float* out) {
  if (sk == kE8M0) {
    dot4_lines<R>(q, xp, K, group, s, sk, s0, [&](const uint8_t* line, const int16_t* x, __m512& t0, __m512&) {
      t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk128_i16(line, x, kE2M1I16)), _mm512_loadu_ps(steps + (x - xp) / 8), t0);
    }, out);
    return;
  }
  dot4_lines<R>(q, xp, K, group, s, sk, s0, [&](const uint8_t* line, const int16_t* x, __m512& t0, __m512&) {
    const int64_t at = (x - xp) / 8;
    t0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(chunk128_u4(line, x, _mm512_loadu_si512(corr + at))), _mm512_loadu_ps(steps + at), t0);
  }, out);
}
