// Weight-only int8 / int4 matrix products for CPU decode: y[m, r] = sum_k x[m, k] * w[r, k], where
// w[r, k] = q[r, k] * scale[r, k / group] and q is read packed (int8, or two 4-bit values per byte)
// and turned into float in registers; nothing dequantized is written to memory.
//
// Layouts (those of compressed-tensors' pack-quantized int32 words, read as bytes, little-endian):
//   bits 8: q int8 [N, K] (the stored unsigned byte minus 128, converted once at load);
//   bits 4: q uint8 [N, K/2], element 2j in the low nibble of byte j, 2j+1 in the high one,
//           each stored unsigned with offset 8 (value = nibble - 8); MXFP4's blocks [N, K/32, 16] are the same
//           bytes, each nibble an E2M1 value, with uint8 E8M0 scales (ScaleKind).
// scale [N, K/group] float32 or bfloat16 (or E8M0); x float32 or bfloat16 [M, K] (bfloat16 rows take vdpbf16ps where the
// CPU has it, otherwise rows are widened to float32); group a multiple of 32 dividing K, or (8 bits, per
// channel) the whole row of any width, whose last K % 32 products are summed one by one. y float32, or
// (out_dtype) bfloat16: the float32 sum rounded once, to nearest even.
//
// Every row is summed in one fixed order (32 lanes per group, a group's sum times its scale added to 32 row
// lanes, then a fixed-order reduction of the lanes), whatever M and whichever rows share a call: results are
// bit-identical between a one-row decode step and a k+1-row verify pass.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dynamic_for.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define SHARDWISE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHARDWISE_AVX2 1
#endif

namespace {

// How far ahead of its reads a thread asks for weight bytes, and into which cache (one _mm_prefetch per 64 bytes of
// weights). A decode product's loop is dense in vector instructions, so the out-of-order window covers only a few
// hundred bytes of its own loads: the prefetches are what keeps enough lines in flight. Into L1 (T0) 4 KB ahead
// was measured first (185 MB of int8 rows, two threads, a Xeon VM: 11-13 GB/s without, 16.0 / 17.3 / 19.3 / 18.0 GB/s
// at 1, 2, 4 and 8 KB ahead). Into L2 (T1) 6 KB ahead is faster on an AMD EPYC (Zen 4) VM, whose L1 has fewer
// miss buffers than its L2: 256 MB in huge pages, two threads, bfloat16 row, variants in shuffled order each round
// (20 rounds): int4 groups of 32 21.9 -> 26.6 GB/s median while a torch sum read 33 GB/s, 23.7 -> 26.6 while it
// read 57; int8 per channel 31.0 -> 32.7 (sum 35). T0 and T1 at other distances (1-16 KB, and both at once) were
// within 1 GB/s of this or slower.
constexpr int64_t kPrefetchBytes = 6144;
#if defined(SHARDWISE_AVX512) || defined(SHARDWISE_AVX2)
inline void prefetch_ahead(const void* p) { _mm_prefetch(static_cast<const char*>(p) + kPrefetchBytes, _MM_HINT_T1); }
#endif

// Scales: float32, bfloat16, or (MXFP4) E8M0 bytes e meaning 2^(e - 127) (e = 0: the float32 subnormal 2^-127;
// 255: NaN), which also make the 4-bit values E2M1 (OCP MX: 0, 0.5, 1, 1.5, 2, 3, 4, 6, sign in bit 3).
enum ScaleKind { kF32, kBF16, kE8M0 };
constexpr float kE2M1[16] = {0, .5f, 1, 1.5f, 2, 3, 4, 6, -0.f, -.5f, -1, -1.5f, -2, -3, -4, -6};

inline uint32_t e8m0_bits(uint32_t e) { return e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : e << 23; }

inline float scale_at(const void* s, ScaleKind sk, int64_t i) {
  if (sk == kF32) return static_cast<const float*>(s)[i];
  uint32_t bits = sk == kE8M0 ? e8m0_bits(static_cast<const uint8_t*>(s)[i]) : uint32_t(static_cast<const uint16_t*>(s)[i]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(SHARDWISE_AVX512)
#include "int_matmul_dot8.h"

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

// Any row width (a multiple of 32; dot4_lines takes those of whole 64-byte lines). xp: each 32-chunk of x as its
// 16 even then its 16 odd elements (the nibble order). A nibble becomes its float value (nibble - 8) through a
// 16-entry table (vpermps reads the low 4 bits of each index).
float dot4(const uint8_t* q, const float* xp, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  const __m512 lut = sk == kE8M0 ? _mm512_loadu_ps(kE2M1) : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m512 t0 = _mm512_setzero_ps(), t1 = t0, t2 = t0, t3 = t0;  // four independent chains
    int64_t k = g0;
    for (; k + 64 <= g0 + group; k += 64) {
      if ((k & 127) == 0) prefetch_ahead(q + k / 2);
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
    add_group(_mm512_set1_ps(scale_at(s, sk, gi)), t, (gi - s0) & 1, a0, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

#if defined(__AVX512VL__)
#define SHARDWISE_LINES 1
// A chunk's scales (groups of 32 or 64: `count` = 4 or 2 of them from gi) spread to the lanes their weights
// sum in (lane i: scale idx[i]). A bfloat16 scale is a float32's top 16 bits: one word permute puts it
// there and zeroes the bottom ones.
inline __m512 chunk_scales(const void* s, ScaleKind sk, int64_t gi, int count, __m512i idx) {
  const __mmask8 take = __mmask8((1 << count) - 1);
  if (sk == kE8M0) {  // e << 23, with the two special bytes (e8m0_bits) mended lane by lane
    const __m512i e = _mm512_permutexvar_epi32(idx, _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(take, static_cast<const uint8_t*>(s) + gi)));
    __m512i v = _mm512_slli_epi32(e, 23);
    v = _mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(v, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000)));
  }
  if (sk == kF32) return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_maskz_loadu_ps(take, static_cast<const float*>(s) + gi)));
  const __m512i raw = _mm512_castsi128_si512(_mm_maskz_loadu_epi16(take, static_cast<const uint16_t*>(s) + gi));
  return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, _mm512_slli_epi32(idx, 16), raw));
}

// R rows of 4-bit weights (q[i], scales from s0[i]; K a multiple of 128; group 32, 64 or a multiple of 128) in
// 64-byte lines of 128 weights, each summed exactly as a row alone (R = 1) is: chunk(line, x + k, t0, t1) adds a
// line's products into two chains, float32 lane i holding 8 of its weights (lanes 0-3 the first 32, and so on), so a
// chunk's sum times its scales (chunk_scales) goes into a[i][0] or a[i][1]. R = 2 with rows far apart (the `pairs`
// argument): more independent work and two memory streams per thread — on a Xeon VM (AMX, 2 vCPUs) int4 rows with
// bfloat16 x streamed 17.8 -> 19.8 GB/s and an int4 decode step of the 2048x10 llama ran 51.1 -> 56.1 tok/s.
template <int R, class X, class Chunk>
void dot4_lines(const uint8_t* const* q, const X* xp, int64_t K, int64_t group, const void* s, ScaleKind sk,
                const int64_t* s0, const Chunk& chunk, float* out) {
  __m512 a[R][2];
  for (int i = 0; i < R; ++i) a[i][0] = a[i][1] = _mm512_setzero_ps();
  if (group < 128) {  // 32 or 64: each chunk spans 128 / group groups
    const int count = int(128 / group);
    const __m512i idx = group == 32 ? _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)
                                    : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    for (int64_t k = 0, g = 0; k < K; k += 128, g += count) {
      for (int i = 0; i < R; ++i) prefetch_ahead(q[i] + k / 2);
      for (int i = 0; i < R; ++i) {
        __m512 t0 = _mm512_setzero_ps(), t1 = t0;
        chunk(q[i] + k / 2, xp + k, t0, t1);
        add_group(chunk_scales(s, sk, s0[i] + g, count, idx), _mm512_add_ps(t0, t1), (k >> 7) & 1, a[i][0], a[i][1]);
      }
    }
  } else {
    for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g)
      for (int i = 0; i < R; ++i) {
        __m512 t0 = _mm512_setzero_ps(), t1 = t0;
        for (int64_t k = g0; k < g0 + group; k += 128) {
          prefetch_ahead(q[i] + k / 2);
          chunk(q[i] + k / 2, xp + k, t0, t1);
        }
        add_group(_mm512_set1_ps(scale_at(s, sk, s0[i] + g)), _mm512_add_ps(t0, t1), g & 1, a[i][0], a[i][1]);
      }
  }
  for (int i = 0; i < R; ++i) out[i] = _mm512_reduce_add_ps(_mm512_add_ps(a[i][0], a[i][1]));
}

// A float32 row: the line's 16 32-bit words, nibble r of each (a shift by 4r; vpermps reads an index's low 4 bits)
// through the value table, times xp's block r (the chunk's x as eight blocks of 16: block r, lane j = element 8j + r).
// Against dot4 on an AMD EPYC (Zen 4) VM, groups of 32: 9.3 -> 11.3-12.0 GB/s on one core from L1, 15-17 -> 17-19 on two
// from memory (it drops dot4's widening of 16 bytes per 32 weights: 8 table permutes a line instead of 12 shuffles).
inline void chunk128_f32(const uint8_t* q, const float* x, __m512 lut, __m512& t0, __m512& t1) {
  const __m512i w = _mm512_loadu_si512(q);
  t0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(w, lut), _mm512_loadu_ps(x), t0);
  for (int r = 1; r < 8; r += 2) {
    t1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4 * r), lut), _mm512_loadu_ps(x + 16 * r), t1);
    if (r < 7) t0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(w, 4 * r + 4), lut), _mm512_loadu_ps(x + 16 * r + 16), t0);
  }
}

template <int R>
void dot4_f32(const uint8_t* const* q, const float* xp, int64_t K, int64_t group, const void* s, ScaleKind sk, const int64_t* s0, float* out) {
  const __m512 lut = sk == kE8M0 ? _mm512_loadu_ps(kE2M1) : _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  dot4_lines<R>(q, xp, K, group, s, sk, s0, [&](const uint8_t* line, const float* x, __m512& t0, __m512& t1) {
    chunk128_f32(line, x, lut, t0, t1);
  }, out);
}

#if defined(__AVX512VNNI__)
#define SHARDWISE_Q8 1
#include "int_matmul_q8.h"
#endif
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#define SHARDWISE_BF16_DOT 1
// A vpermw table: word i holds value(i & 15) as bfloat16 (exact for these small integers); vpermw reads
// the low 5 bits of each index, so the 16 values repeat.
template <class Value>
__m512i bf16_table(Value value) {
  alignas(64) uint16_t t[32];
  for (int i = 0; i < 32; ++i) {
    const float f = value(i & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    t[i] = uint16_t(bits >> 16);
  }
  return _mm512_load_si512(t);
}

// bfloat16 rows (a bfloat16 model's activations, as they are): a nibble's value (-8..7) is exact in
// bfloat16, so vdpbf16ps multiplies it by x exactly and adds the products into float32 lanes two at a time,
// 32 weights per instruction with no float conversion of the weights (where the float32 path above spends
// its time). A 128-weight chunk is 64 bytes read as 32 16-bit words, word j holding elements 4j..4j+3, a
// nibble each; nibble r of every word becomes bfloat16 through one table lookup (vpermw reads the low 5
// bits of a word: the table repeats its 16 values) after a shift by 4r. Float32 lane i of a chunk's sum
// holds elements 8i..8i+7: lanes 0-3 are the chunk's first 32 weights, 4-7 the next 32, and so on.
const __m512i kNibbleBf16 = bf16_table([](int n) { return float(n - 8); });
const __m512i kE2M1Bf16 = bf16_table([](int n) { return kE2M1[n]; });  // MXFP4's values, exact in bfloat16

inline __m512bh nibbles_bf16(__m512i words, int shift, __m512i table) {
  return (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, shift), table);
}

// One 128-weight chunk's products with xp (the chunk's x as four blocks of 32: block r, lane l = element
// 4l + r) added into two independent chains.
inline void chunk128(const uint8_t* q, const uint16_t* xp, __m512i table, __m512& t0, __m512& t1) {
  const __m512i w = _mm512_loadu_si512(q);
  t0 = _mm512_dpbf16_ps(t0, (__m512bh)_mm512_permutexvar_epi16(w, table), (__m512bh)_mm512_loadu_si512(xp));
  t1 = _mm512_dpbf16_ps(t1, nibbles_bf16(w, 4, table), (__m512bh)_mm512_loadu_si512(xp + 32));
  t0 = _mm512_dpbf16_ps(t0, nibbles_bf16(w, 8, table), (__m512bh)_mm512_loadu_si512(xp + 64));
  t1 = _mm512_dpbf16_ps(t1, nibbles_bf16(w, 12, table), (__m512bh)_mm512_loadu_si512(xp + 96));
}

// R rows of 4-bit weights against a bfloat16 row (K a multiple of 128; group 32, 64 or a multiple of 128).
template <int R>
void dot4_bf16(const uint8_t* const* q, const uint16_t* xp, int64_t K, int64_t group, const void* s, ScaleKind sk, const int64_t* s0, float* out) {
  const __m512i table = sk == kE8M0 ? kE2M1Bf16 : kNibbleBf16;
  dot4_lines<R>(q, xp, K, group, s, sk, s0, [&](const uint8_t* line, const uint16_t* x, __m512& t0, __m512& t1) {
    chunk128(line, x, table, t0, t1);
  }, out);
}

// int8 weights against a bfloat16 row: each weight splits exactly into its signed high nibble h (-8..7) and
// unsigned low nibble l (0..15), q = 16 h + l, each one table lookup to bfloat16 (bf16_table), so vdpbf16ps
// multiplies 32 of each by x per instruction, products exact. A group's sum is 16 * (sum of h x) + (sum of
// l x), times its scale; per-channel rows whose width is not a multiple of 32 sum their last K % 32 one by one.
const __m512i kLowBf16 = bf16_table([](int n) { return float(n); });            // unsigned low nibble
const __m512i kHighBf16 = bf16_table([](int n) { return float((n ^ 8) - 8); });  // signed high nibble

inline void chunk32_8(const int8_t* q, const uint16_t* x, __m512& lo, __m512& hi) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  const __m512bh xv = (__m512bh)_mm512_loadu_si512(x);
  lo = _mm512_dpbf16_ps(lo, (__m512bh)_mm512_permutexvar_epi16(w, kLowBf16), xv);
  hi = _mm512_dpbf16_ps(hi, (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(w, 4), kHighBf16), xv);
}

float dot8_bf16(const int8_t* q, const uint16_t* x, int64_t K, int64_t group, const void* s, ScaleKind sk, int64_t s0) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  float rest = 0;
  for (int64_t g0 = 0, gi = s0; g0 < K; g0 += group, ++gi) {
    __m512 lo0 = _mm512_setzero_ps(), lo1 = lo0, hi0 = lo0, hi1 = lo0;
    int64_t k = g0;
    for (; k + 64 <= g0 + group; k += 64) {
      prefetch_ahead(q + k);
      chunk32_8(q + k, x + k, lo0, hi0);
      chunk32_8(q + k + 32, x + k + 32, lo1, hi1);
    }
    if (k + 32 <= g0 + group) {
      chunk32_8(q + k, x + k, lo0, hi0);
      k += 32;
    }
    float tail = 0;
    for (; k < g0 + group; ++k) {
      const uint32_t bits = uint32_t(x[k]) << 16;
      float f;
      std::memcpy(&f, &bits, sizeof f);
      tail += float(q[k]) * f;
    }
    const float scale = scale_at(s, sk, gi);
    rest += scale * tail;
    const __m512 t = _mm512_fmadd_ps(_mm512_set1_ps(16.f), _mm512_add_ps(hi0, hi1), _mm512_add_ps(lo0, lo1));
    add_group(_mm512_set1_ps(scale), t, (gi - s0) & 1, a0, a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + rest;
}
#endif
#elif defined(SHARDWISE_AVX2)
#include "int_matmul_avx2.h"
#else
#include "int_matmul_portable.h"
#endif

// x in the order dot4_lines' chunks read it: each 128-chunk as `blocks` blocks of 128 / blocks, block r lane l =
// element blocks * l + r (bfloat16 rows: 4 blocks of 32 words; float32 rows: 8 of 16 floats).
template <class T>
std::vector<T> line_order(const T* xs, int64_t n, int blocks) {
  std::vector<T> perm(n);
  const int lanes = 128 / blocks;
  for (int64_t i = 0; i < n; i += 128)
    for (int r = 0; r < blocks; ++r)
      for (int l = 0; l < lanes; ++l) perm[i + lanes * r + l] = xs[i + blocks * l + r];
  return perm;
}

#include "int_matmul_outputs.h"

#if defined(SHARDWISE_Q8)
#define SHARDWISE_GRIDS 1
#include "int_matmul_grids.h"
#endif

at::Tensor int_matmul(const at::Tensor& x_in, const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group,
                      std::optional<at::ScalarType> out_dtype, bool pairs, bool q8, bool grids) {
  TORCH_CHECK(x_in.dim() == 2 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16) && x_in.is_contiguous(),
              "x must be contiguous float32 or bfloat16 [M, K]");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && scale.dim() == 2 && scale.is_contiguous(), "q and scale must be contiguous 2-D");
  const ScaleKind sk = scale.scalar_type() == at::kByte ? kE8M0 : scale.scalar_type() == at::kBFloat16 ? kBF16 : kF32;
  TORCH_CHECK(sk != kF32 || scale.scalar_type() == at::kFloat, "scale must be float32, bfloat16 or (MXFP4) uint8 E8M0");
#if defined(SHARDWISE_AVX2)
  TORCH_CHECK(sk != kE8M0, "MXFP4 (uint8 E8M0 scales) runs on the AVX-512 and portable builds, not AVX2");
#endif
  const int64_t M = x_in.size(0), K = x_in.size(1), N = q.size(0);
  TORCH_CHECK(K % group == 0 && (group % 32 == 0 || (bits == 8 && group == K)),
              "group must divide K and be a multiple of 32 (or, for 8 bits, the whole row)");
  TORCH_CHECK(scale.size(0) == N && scale.size(1) == K / group, "scale must be [N, K / group]");
  if (bits == 8) {
    TORCH_CHECK(q.scalar_type() == at::kChar && q.size(1) == K, "8-bit q must be int8 [N, K]");
  } else {
    TORCH_CHECK(bits == 4 && q.scalar_type() == at::kByte && q.size(1) == K / 2, "4-bit q must be uint8 [N, K / 2]");
  }
  TORCH_CHECK(sk != kE8M0 || (bits == 4 && group == 32), "MXFP4 (uint8 E8M0 scales) is 4 bits in groups of 32");
  auto y = at::empty({M, N}, x_in.options().dtype(out_dtype.value_or(at::kFloat)));
  TORCH_CHECK(y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16, "out_dtype must be float32 or bfloat16");
  const void* sp = scale.data_ptr();
  const int64_t G = K / group, row_bytes = K * bits / 8 + G * scale.element_size();
  [[maybe_unused]] const bool lines = bits == 4 && K % 128 == 0 && (group == 32 || group == 64 || group % 128 == 0);
  // the weights whose rows q8 and grids take: int4 / MXFP4 lines, or int8 per channel or in groups of k*64, K a multiple of 128
  const bool int_rows = lines || (bits == 8 && K % 128 == 0 && (group == K || group % 64 == 0));
  TORCH_CHECK(!grids || (!q8 && int_rows),
              "grids take rows a multiple of 128 wide against int4 / MXFP4 weights in groups of 32, 64 or k*128, "
              "or int8 ones per channel or in groups of k*64 (and not q8)");
  if (q8) {  // x rounded to int8 per 32-block (int_matmul_q8.h)
    TORCH_CHECK(int_rows, "q8 takes rows a multiple of 128 "
                "wide against int4 / MXFP4 weights in groups of 32, 64 or k*128, or int8 ones per channel or in groups of k*64");
#if defined(SHARDWISE_Q8)
    if (bits == 8) {
      const std::vector<Q8Line8> xc = x_in.scalar_type() == at::kFloat ? q8_rows8(x_in.data_ptr<float>(), M, K)
          : q8_rows8(reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>()), M, K);
      sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<int8_t>(), K, [&](auto R, const int8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
        dot8_q8<decltype(R)::value>(rows, xc.data() + m * (K / 128), K, group, sp, sk, s0, out);
      });
      return y;
    }
    const int offset = sk == kE8M0 ? 12 : 8;
    const float unit = sk == kE8M0 ? .5f : 1.f;
    const std::vector<Q8Chunk> xc = x_in.scalar_type() == at::kFloat ? q8_rows(x_in.data_ptr<float>(), M, K, offset, unit)
        : q8_rows(reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>()), M, K, offset, unit);
    sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<uint8_t>(), K / 2, [&](auto R, const uint8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
      dot4_q8<decltype(R)::value>(rows, xc.data() + m * (K / 128), K, group, sp, sk, s0, out);
    });
    return y;
#else
    TORCH_CHECK(false, "q8 needs a CPU with AVX-512 VNNI");
#endif
  }
  if (grids) {  // rows on integer grids (int_matmul_grids.h): bfloat16 in two int8 parts, float32 in three
#if defined(SHARDWISE_GRIDS)
    if (x_in.scalar_type() == at::kFloat) {
      grid_products(y, x_in.data_ptr<float>(), M, K, N, q, bits, group, sp, sk, row_bytes, pairs);
    } else {
      grid_products(y, reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>()), M, K, N, q, bits, group, sp, sk, row_bytes, pairs);
    }
    return y;
#else
    TORCH_CHECK(false, "grids need a CPU with AVX-512 VNNI");
#endif
  }
#if defined(SHARDWISE_BF16_DOT)
  if (lines && x_in.scalar_type() == at::kBFloat16) {
    const std::vector<uint16_t> perm = line_order(reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>()), M * K, 4);
    sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<uint8_t>(), K / 2, [&](auto R, const uint8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
      dot4_bf16<decltype(R)::value>(rows, perm.data() + m * K, K, group, sp, sk, s0, out);
    });
    return y;
  }
  if (bits == 8 && x_in.scalar_type() == at::kBFloat16) {  // any group (dot8_bf16 sums a group's tail alone)
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x_in.data_ptr<at::BFloat16>());
    const int8_t* qp = q.data_ptr<int8_t>();
    each_output(y, M, N, row_bytes, [&](int64_t r, int64_t m) { return dot8_bf16(qp + r * K, xs + m * K, K, group, sp, sk, r * G); });
    return y;
  }
#endif
  const at::Tensor x = x_in.to(at::kFloat);
  const float* xs = x.data_ptr<float>();
#if defined(SHARDWISE_LINES)
  if (lines) {
    const std::vector<float> perm = line_order(xs, M * K, 8);
    sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<uint8_t>(), K / 2, [&](auto R, const uint8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
      dot4_f32<decltype(R)::value>(rows, perm.data() + m * K, K, group, sp, sk, s0, out);
    });
    return y;
  }
#endif
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
#if defined(SHARDWISE_AVX512)
  if (bits == 8) {  // float32 rows times int8 weights, one or (pairs) two weight rows per pass (dot8_rows)
    sum_rows(y, M, N, row_bytes, G, pairs, q.data_ptr<int8_t>(), K, [&](auto R, const int8_t* const* rows, const int64_t* s0, int64_t m, float* out) {
      dot8_rows<decltype(R)::value>(rows, xs + m * K, K, group, sp, sk, s0, out);
    });
    return y;
  }
#endif
  each_output(y, M, N, row_bytes, [&](int64_t r, int64_t m) {
    return bits == 8 ? dot8(q.data_ptr<int8_t>() + r * K, xs + m * K, K, group, sp, sk, r * G)
                     : dot4(q.data_ptr<uint8_t>() + r * (K / 2), xs + m * K, K, group, sp, sk, r * G);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(shardwise_int, m) {
  m.def("int_matmul(Tensor x, Tensor q, Tensor scale, int bits, int group, ScalarType? out_dtype=None, bool pairs=False, bool q8=False, bool grids=False) -> Tensor",
        &int_matmul);
}
