// int4 / MXFP4 / int8 weights against float rows held on integer grids (the kernel's `grids`), on AVX-512 VNNI:
// int_matmul.cpp includes it where AVX-512 VNNI builds the q8 path (after int_matmul_q8.h: widen16, int_rows,
// lane_offsets, spread_steps, dot4_int, dot8_int_rows; and after int_matmul_outputs.h: sum_rows).
//
// Each 32-block of a row is put once per call on its own power-of-two grid, its step a fixed power of two below the
// block's largest biased exponent E, and each grid value xq goes in as P int8 parts, xq = sum_p part_p * 128^(P-1-p)
// (part 0 signed, the others 0..127), each part meeting the stored nibbles (unsigned; the offset taken off through
// corr, as int_matmul_q8.h does) in vpdpbusd — 64 products an instruction. The parts' lane sums, shifted and added,
// are the integer sums; times the block's power-of-two step and one fused multiply-add with the weight scales.
//   bfloat16 rows, P = 2, step 2^(E - 140): a bfloat16 value is its 8-bit significand times 2^(e - 134), so every
//     element within 2^6 of the block's largest (e >= E - 6) is a whole number of steps below 2^14 and is held
//     exactly; smaller ones round to the nearest step (half-even), off by at most 2^-14 of the block's largest
//     element — 2^-6 of that element's own bfloat16 spacing. The sums (|sum| < 2^22) are exact in float32: a 128-weight
//     line carries no rounding before its weight scales (the vdpbf16ps path rounds at every addition).
//   float32 rows, P = 3, step 2^(E - 146): every element rounds to the nearest step (|xq| <= 2^20), off by at most
//     2^-20 of its block's largest element (float32's own spacing is 2^-23 of it); a lane's sum is exact in int32
//     and rounded once to float32 (float32 rounding of each product and addition is what the table path pays).
// A block holding inf or NaN gets a NaN step (every output it reaches is NaN). Each row's sum depends on that row of x
// alone and is summed in one fixed order: a k+1-row verify pass equals k+1 one-row steps bit for bit.
//
// Why: on a Xeon VM (AMX, 2 vCPUs) vdpbf16ps is the costliest instruction of the bfloat16 path (one line of 128
// weights from L1: 4.6 ns, of which its four vdpbf16ps alone 2.9), and the float32 path spends eight table permutes,
// seven shifts and eight fused multiply-adds a line; these integer products take a fraction of that.
#pragma once

#include <algorithm>
#include <type_traits>

// How rows of T meet bits-bit weights on grids: P int8 parts of D bits each (D = 7: part 0 signed, the others 0..127;
// D = 8: every part signed, -128..127), each 32-block's step 2^(E - kBelow). The float32 steps keep every lane's true
// integer sum within int32 (|sum| <= 8 * 12 * 2^22 for 4-bit weights, 4 * 128 * 2^21 for int8 ones); the parts'
// partial sums may wrap in between, as int32 arithmetic on these registers does, and the wrapped sum is the true one.
template <class T, int Bits>
struct Grid {
  static constexpr bool kFloat = std::is_same_v<T, float>;
  static constexpr int P = kFloat ? 3 : 2;
  static constexpr int D = kFloat ? 8 : 7;
  static constexpr int kBelow = !kFloat ? 140 : Bits == 4 ? 148 : 147;
};

// v's P parts of D bits (Grid), most significant first: v = sum_p parts[p] * 2^(D (P-1-p)).
template <int P, int D>
inline void grid_parts(int32_t v, int8_t* parts) {
  for (int p = P - 1; p > 0; --p) {
    parts[p] = D == 7 ? int8_t(v & 127) : int8_t(v);  // D = 8: v's low byte, signed
    v = (v - parts[p]) >> D;
  }
  parts[0] = int8_t(v);
}

// One 128-element chunk of one row on its grids as P parts: e / o the elements 2j / 2j + 1 (the low / high nibbles'
// ones); lane i of the integer sums holds elements 8i..8i+7, so corr[i] = -offset times their xq sum and steps[i] =
// the step of their 32-block, times unit.
template <int P>
struct alignas(64) GridChunk {
  int8_t e[P][64];
  int8_t o[P][64];
  int32_t corr[16];
  float steps[16];
};

// One 32-block of a row (bfloat16 as uint16, or float32) on its grid (as int32 into q[0..31]); returns its step
// 2^(E - Below).
template <class T, int Below>
float grid_block(const T* v, int32_t* q) {
  const __m512i exponent = _mm512_set1_epi32(0xFF);
  int E = 0;
  for (int h = 0; h < 2; ++h)
    E = std::max(E, _mm512_reduce_max_epi32(_mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(widen16(v + 16 * h)), 23), exponent)));
  // the step as a float32's bits (subnormal below E = Below - 126); NaN for a block holding inf or NaN
  const uint32_t bits = E == 255 ? 0x7FC00000u : E - Below >= -126 ? uint32_t(E - Below + 127) << 23 : 1u << (E - Below + 149);
  float step;
  std::memcpy(&step, &bits, sizeof step);
  const __m512 down = _mm512_set1_ps(float(Below - E));  // x * 2^(Below - E): exact (scalef), then rounded half-even
  for (int h = 0; h < 2; ++h) _mm512_storeu_si512(q + 16 * h, _mm512_cvtps_epi32(_mm512_scalef_ps(widen16(v + 16 * h), down)));
  return step;
}

// Rows x [M, K] (K a multiple of 128) as M * K / 128 chunks of P parts, for weights whose stored nibbles stand for
// (nibble - offset) * unit: int4 8 and 1, MXFP4 (E2M1 values doubled) 12 and 0.5.
template <class T, class G = Grid<T, 4>>
std::vector<GridChunk<G::P>> grid_rows(const T* x, int64_t M, int64_t K, int offset, float unit) {
  return int_rows<GridChunk<G::P>>(x, M, K, grid_block<T, G::kBelow>, [&](GridChunk<G::P>& ch, const int32_t* q, const float* steps) {
    spread_steps(steps, 4, unit, ch.steps);
    int8_t parts[G::P];
    for (int j = 0; j < 128; ++j) {
      grid_parts<G::P, G::D>(q[j], parts);
      for (int p = 0; p < G::P; ++p) (j % 2 ? ch.o : ch.e)[p][j / 2] = parts[p];
    }
    lane_offsets(q, 8, offset, ch.corr);
  });
}

// The integer lane sums of P parts of D bits: part(p, start) is part p's products added to start; the last part
// starts at corr.
template <int P, int D, class Part>
inline __m512i part_sums(const Part& part, const int32_t* corr) {
  __m512i sum = part(0, _mm512_setzero_si512());
  for (int p = 1; p < P; ++p)
    sum = _mm512_add_epi32(_mm512_slli_epi32(sum, D), part(p, p == P - 1 ? _mm512_load_si512(corr) : _mm512_setzero_si512()));
  return sum;
}

// R rows of 4-bit weights against one row's chunks (dot4_int): per chunk the nibbles times each part (vpdpbusd, four
// products a lane each), the parts' sums shifted and added, times the blocks' power-of-two steps, then one fused
// multiply-add with the weight scales.
template <int R, int P, int D>
void dot4_grid(const uint8_t* const* q, const GridChunk<P>* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
               const int64_t* s0, float* out) {
  dot4_int<R>(q, xc, K, group, s, sk, s0, [](__m512i lo, __m512i hi, const GridChunk<P>& x, __m512 ws, __m512& acc) {
    const __m512i sum = part_sums<P, D>([&](int p, __m512i start) {
      return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(start, lo, _mm512_load_si512(x.e[p])), hi, _mm512_load_si512(x.o[p]));
    }, x.corr);
    acc = _mm512_fmadd_ps(ws, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_load_ps(x.steps)), acc);
  }, out);
}

// int8 weights (the kernel multiplies q + 128, unsigned): one 128-element chunk of one row on its grids, as two
// 64-element halves of P parts each; lane i of half h holds elements 64h + 4i..+3, so corr[h][i] = -128 times their
// grid values' sum and steps[h][i] the step of their 32-block.
template <int P>
struct alignas(64) GridLine8 {
  int8_t x[P][128];
  int32_t corr[2][16];
  float steps[2][16];
};

template <class T, class G = Grid<T, 8>>
std::vector<GridLine8<G::P>> grid_rows8(const T* x, int64_t M, int64_t K) {
  return int_rows<GridLine8<G::P>>(x, M, K, grid_block<T, G::kBelow>, [](GridLine8<G::P>& ch, const int32_t* q, const float* steps) {
    spread_steps(steps, 8, 1.f, ch.steps[0]);
    int8_t parts[G::P];
    for (int e = 0; e < 128; ++e) {
      grid_parts<G::P, G::D>(q[e], parts);
      for (int p = 0; p < G::P; ++p) ch.x[p][e] = parts[p];
    }
    for (int h = 0; h < 2; ++h) lane_offsets(q + 64 * h, 4, 128, ch.corr[h]);
  });
}

// R rows of int8 weights against one row's chunks (dot8_int_rows). Per 64 weights: one xor, P vpdpbusd, the parts'
// shifts and adds, then the float32 sums times their steps into one fused multiply-add with the weight scale.
template <int R, int P, int D>
void dot8_grid(const int8_t* const* q, const GridLine8<P>* xc, int64_t K, int64_t group, const void* s, ScaleKind sk,
               const int64_t* s0, float* out) {
  dot8_int_rows<R>(q, xc, K, group, s, sk, s0, [](__m512i w, const GridLine8<P>& x, int h, float scale, __m512& acc) {
    const __m512i sum = part_sums<P, D>([&](int p, __m512i start) {
      return _mm512_dpbusd_epi32(start, w, _mm512_load_si512(x.x[p] + 64 * h));
    }, x.corr[h]);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(scale), _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_load_ps(x.steps[h])), acc);
  }, out);
}

// y = rows x [M, K] (bfloat16 as uint16, or float32) on their grids times the weights q (bits 4 or 8).
template <class T>
void grid_products(const at::Tensor& y, const T* x, int64_t M, int64_t K, int64_t N, const at::Tensor& q, int64_t bits,
                   int64_t group, const void* s, ScaleKind sk, int64_t row_bytes, bool pairs) {
  const int64_t G = K / group;
  if (bits == 8) {
    using G8 = Grid<T, 8>;
    const auto xc = grid_rows8(x, M, K);
    sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<int8_t>(), K, [&](auto R, const int8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
      dot8_grid<decltype(R)::value, G8::P, G8::D>(rows, xc.data() + m * (K / 128), K, group, s, sk, s0, out);
    });
    return;
  }
  using G4 = Grid<T, 4>;
  const auto xc = grid_rows(x, M, K, sk == kE8M0 ? 12 : 8, sk == kE8M0 ? .5f : 1.f);
  sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<uint8_t>(), K / 2, [&](auto R, const uint8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
    dot4_grid<decltype(R)::value, G4::P, G4::D>(rows, xc.data() + m * (K / 128), K, group, s, sk, s0, out);
  });
}
