// Batch-invariant products for CPU. linear_f32: y[m, n] = sum_k x[m, k] w[n, k], x [M, K], w [N, K] (row-major,
// contiguous), y [M, N], where every output is summed in one fixed order whatever M is, which rows share the
// call and which thread computes it: 16 lanes, lane l accumulating the products k = l, l + 16, ... in
// ascending k by fused multiply-add (a masked last vector when K % 16 != 0), then one fixed-order reduction
// of the lanes (_mm512_reduce_add_ps). So a row's result is the same bits in a one-row decode step, a k+1-row
// speculative verify pass and a serving batch of any size (runtime.exact), without padding every product to
// a 16-row GEMM: a one-row call streams the weight once at GEMV speed.
//
// Tiles of up to 4 x rows by 4 weight rows (16 accumulators; a weight block of 4 rows stays in L1 while the
// x rows of a 64-row chunk pass over it), or, for one x row (decode), one weight row at a time (the _pairs ops:
// two, half a thread's run apart, which a Xeon streams faster; runtime.gemv measures which a machine runs): each thread
// streams one run of consecutive rows (the tile shape changes no output's bits: each output is its own
// 16-lane chain). Threads split the weight rows (at::parallel_for over the blocks; one x row: runs of 64
// rows from a shared counter, dynamic_for.h). One row at a time against 1 x 8 tiles (eight streams in
// flight), bfloat16, 600 MB of a decoder's shapes cycled in huge pages, two threads, an AMD EPYC (Zen 4) VM,
// side by side: median 30.1 vs 27.1 GB/s (sum() of the same memory: 31.6); in a decode step of the 2048x10
// llama within noise (paired rounds in one process 0.93-1.15x, median 1.04x; processes alternated: 26.0-27.6
// vs 25.0-27.5 tok/s); float32 within noise of 1 x 8. Software prefetch: with 1 x 8 tiles, the same setup,
// prefetching each row 8 KB ahead read 17.0 / 33.2 GB/s (float32, one / two threads) and 19.4 / 21.2 (bfloat16)
// against 20.3 / 37.3 and 20.9 / 24.2 without, one row at a time 4 KB ahead within noise of none; on a Xeon VM
// one or two rows at a time 3 KB ahead stream 5-12% faster, so the one-row path prefetches (kOneRowPrefetchBytes).
// Built only where the compiler targets AVX-512F; elsewhere the library registers no op and runtime.exact pads
// products to whole row blocks instead.
//
// linear_bf16: the same contract for bfloat16 x [M, K], w [N, K] -> y [M, N] bfloat16, on Intel AMX. Weights
// are the A operand straight from memory (16 rows x 32 k per tile, row stride K), x the B operand, packed
// once per call into VNNI pairs ([K / 2][16 rows][2] per 16 rows, zeros past M and K); C[n][m] (16 x 16
// float32) accumulates tdpbf16ps over k in ascending 32-wide steps and is rounded once to bfloat16 (nearest
// even). An element of C depends only on its weight row, its x row and the steps: every tile is configured
// full (16 x 64 bytes) whatever M, N, K (zero-padded copies for the K % 32 tail and a short last weight tile),
// and splitting K into blocks only stores C to memory and loads it back, bit for bit. Two weight tiles x
// two x tiles (4 C tiles) share each load; threads split the weight tile pairs; K blocks are sized so the
// packed x of one block (1 MB) stays in L2 while a group of 8 weight tile pairs passes over it. No software
// prefetch: the L2 streamer keeps up; prefetching each row 4 KB ahead measured no faster at K = 2048 and
// 15-25% slower at K = 5632. Measured on this machine (an Emerald Rapids Xeon VM, 2 cores, torch 2.13, 2 threads;
// 12 weights of 5632x2048 and of 2048x5632 cycled so they stream from memory, best of 5 rounds alternating
// with the padded F.linear runtime.exact uses otherwise, in one process): 1-16 rows stream the weight at
// 20-30 GB/s (the one-row vdpbf16ps GEMV then used for decode: 21-22; padded oneDNN: 13-19), 64 and 256 rows reach
// 620-1090 and 710-730 GFLOP/s (padded oneDNN: 400-630 and 540-650). Built only where the compiler targets
// AMX-TILE, AMX-BF16, AVX512-BF16 and AVX512-BW, and registered only if Linux grants this process the tile
// data (arch_prctl).
//
// linear_bf16_dp: the same contract without AMX, on AVX512-BF16 (AMD Zen 4): the float32 kernel's tiles with
// vdpbf16ps (each output one 16-lane chain over k in ascending 32-wide steps, a masked last step, one
// fixed-order lane reduction, rounded once to bfloat16, to nearest even). It is also runtime.gemv's one-row
// bfloat16 product for plain decode and decode_gemv.cpp's for MoE experts. Elsewhere runtime.exact keeps the padded product for bfloat16.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>
#include <sys/syscall.h>

#include "dynamic_for.h"
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace {

constexpr int64_t kWeightRows = 4;   // weight rows per tile
constexpr int64_t kChunkRows = 64;   // x rows passing over one weight block before the next block
// Weight rows a thread takes at a time when M = 1 (dynamic_for.h): at least 64, and at least kChunkBytes of them
// (bfloat16 [1024, 256] weights, 300 MB cycled, 2 threads, side by side: 17-19 GB/s in runs of 64 rows, 20.5-23
// in runs of 128 KB; [2048, 2048] unchanged).
constexpr int64_t kOneRowChunk = 64;
// How far ahead of its loads a one-row product asks for each weight row's bytes (into L2, one _mm_prefetch per 64
// bytes). A Xeon VM (AMX, 2 vCPUs), 2 threads, a 2048x10 llama's 41 decode weights cycled (or one 256 MB weight),
// in huge pages, 6 rounds shuffled, medians, torch.mv beside as the yardstick: bfloat16 two rows at a time
// 29.5 -> 33.1-33.8 GB/s at 3 KB ahead (torch.mv 26.3-27.5), float32 31.8 -> 33.3-33.5 (31.4-31.7); 1 KB ahead no
// gain, 2 and 4 KB between; into L1 (T0) at 3 KB the same. (On an AMD EPYC VM earlier, 1 x 8 tiles prefetching 8 KB
// ahead were slower and one row 4 KB ahead within noise: re-measure there.)
constexpr int64_t kOneRowPrefetchBytes = 3072;

// The element types a tile works in: float32 (16 lanes per step, fused multiply-add), and bfloat16 on
// AVX512-BF16 (32 elements per step, vdpbf16ps: pairs of exact products added into 16 float32 lanes; the
// float32 sum rounded once to bfloat16, to nearest even).
struct F32 {
  using T = float;
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int64_t kStep = 16;
  static V load(const T* p) { return _mm512_loadu_ps(p); }
  static V load(Mask m, const T* p) { return _mm512_maskz_loadu_ps(m, p); }
  static __m512 madd(__m512 acc, V w, V x) { return _mm512_fmadd_ps(x, w, acc); }
  static T out(float v) { return v; }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SHARDWISE_DP_BF16 1
struct BF16 {
  using T = c10::BFloat16;
  using V = __m512i;
  using Mask = __mmask32;
  static constexpr int64_t kStep = 32;
  static V load(const T* p) { return _mm512_loadu_si512(p); }
  static V load(Mask m, const T* p) { return _mm512_maskz_loadu_epi16(m, p); }
  static __m512 madd(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)x); }
  static T out(float v) { return T(v); }
};
#endif

// Outputs y[m0 .. m0 + MT) x weight rows n0, n0 + step, ... (WR of them; rows past `valid` are computed from row n0
// and dropped).
template <class E, int MT, int64_t WR = kWeightRows>
void tile(const typename E::T* x, const typename E::T* w, typename E::T* y, int64_t K, int64_t N, int64_t m0,
          int64_t n0, int64_t valid, int64_t step = 1) {
  using T = typename E::T;
  const int64_t full = K / E::kStep * E::kStep;
  const auto tail = static_cast<typename E::Mask>((1ull << (K - full)) - 1);
  const T* wr[WR];
  const T* xr[MT];
  for (int64_t j = 0; j < WR; ++j) wr[j] = w + (n0 + (j < valid ? j : 0) * step) * K;
  for (int i = 0; i < MT; ++i) xr[i] = x + (m0 + i) * K;
  __m512 acc[MT][WR];
  for (int i = 0; i < MT; ++i)
    for (int64_t j = 0; j < WR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < full; k += E::kStep) {
    typename E::V wv[WR];
    for (int64_t j = 0; j < WR; ++j) {
      if (MT == 1 && WR <= 2) _mm_prefetch(reinterpret_cast<const char*>(wr[j] + k) + kOneRowPrefetchBytes, _MM_HINT_T1);
      wv[j] = E::load(wr[j] + k);
    }
    for (int i = 0; i < MT; ++i) {
      const typename E::V xv = E::load(xr[i] + k);
      for (int64_t j = 0; j < WR; ++j) acc[i][j] = E::madd(acc[i][j], wv[j], xv);
    }
  }
  if (tail) {
    typename E::V wv[WR];
    for (int64_t j = 0; j < WR; ++j) wv[j] = E::load(tail, wr[j] + full);
    for (int i = 0; i < MT; ++i) {
      const typename E::V xv = E::load(tail, xr[i] + full);
      for (int64_t j = 0; j < WR; ++j) acc[i][j] = E::madd(acc[i][j], wv[j], xv);
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int64_t j = 0; j < valid; ++j) y[(m0 + i) * N + n0 + j * step] = E::out(_mm512_reduce_add_ps(acc[i][j]));
}

// y [M, N] = x [M, K] w [N, K]^T in E's type: tiles over 4-row weight blocks split across threads, 64-row x
// chunks passing over each block; one x row: one weight row at a time, or (OneRow = 2, the _pairs ops) two rows half
// a thread's run apart, two memory streams per thread (runtime.gemv measures which a machine runs for decode; on a
// Xeon VM bfloat16 decode of the 2048x10 llama ran 23.64 -> 24.39 tok/s with the rows half a run apart against
// adjacent ones, float32 13.51 -> 13.54).
template <class E, int64_t OneRow = 1>
at::Tensor rows_times(const at::Tensor& x, const at::Tensor& w) {
  using T = typename E::T;
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const T* xp = reinterpret_cast<const T*>(x.data_ptr());
  const T* wp = reinterpret_cast<const T*>(w.data_ptr());
  T* yp = reinterpret_cast<T*>(y.data_ptr());
  if (M == 1) {
    const int64_t chunk = OneRow * std::max(kOneRowChunk, shardwise::run_rows(K * int64_t(sizeof(T)) * OneRow, 1));
    shardwise::dynamic_for(N, chunk, [&](int64_t r0, int64_t r1) {
      const auto one = [&](int64_t r) { tile<E, 1, 1>(xp, wp, yp, K, N, 0, r, 1); };
      if (OneRow == 1) {
        for (int64_t r = r0; r < r1; ++r) one(r);
      } else {
        shardwise::run_in_pairs(r0, r1, [&](int64_t a, int64_t b) { tile<E, 1, 2>(xp, wp, yp, K, N, 0, a, 2, b - a); }, one);
      }
    });
    return y;
  }
  const int64_t blocks = (N + kWeightRows - 1) / kWeightRows;
  at::parallel_for(0, blocks, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t c0 = 0; c0 < M; c0 += kChunkRows) {
      const int64_t c1 = std::min(M, c0 + kChunkRows);
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n0 = b * kWeightRows, valid = std::min(kWeightRows, N - n0);
        int64_t m = c0;
        for (; m + 4 <= c1; m += 4) tile<E, 4>(xp, wp, yp, K, N, m, n0, valid);
        switch (c1 - m) {
          case 3: tile<E, 3>(xp, wp, yp, K, N, m, n0, valid); break;
          case 2: tile<E, 2>(xp, wp, yp, K, N, m, n0, valid); break;
          case 1: tile<E, 1>(xp, wp, yp, K, N, m, n0, valid); break;
          default: break;
        }
      }
    }
  });
  return y;
}

void check_rows(const at::Tensor& x, const at::Tensor& w, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous(), "x must be contiguous ", name, " [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == dtype && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous ", name, " [N, K] with x's K");
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kFloat, "float32");
  return rows_times<F32>(x, w);
}

at::Tensor linear_f32_pairs(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kFloat, "float32");
  return rows_times<F32, 2>(x, w);
}

#ifdef SHARDWISE_DP_BF16
at::Tensor linear_bf16_dp(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kBFloat16, "bfloat16");
  return rows_times<BF16>(x, w);
}

at::Tensor linear_bf16_dp_pairs(const at::Tensor& x, const at::Tensor& w) {
  check_rows(x, w, at::kBFloat16, "bfloat16");
  return rows_times<BF16, 2>(x, w);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define SHARDWISE_AMX_BF16 1

constexpr int64_t kTile = 16;            // weight rows of an A tile, x rows (B columns) of a B tile
constexpr int64_t kStep = 32;            // bfloat16 of K per tile step (64 bytes)
constexpr int64_t kChunkBytes = 1 << 20; // packed x (B) of one K block, kept in L2 while weights pass over it
constexpr int64_t kGroup = 8;            // weight tile pairs per K sweep (their C tiles buffered across K blocks)

// Tiles: C[i][j] = tmm(2i + j) (16 weight rows x 16 x rows, float32), A0 / A1 = tmm4 / tmm5 (weights), B0 / B1
// = tmm6 / tmm7 (x, VNNI pairs). Every tile is 16 x 64 bytes, whatever M, N and K.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Linux lets a process use the AMX tile data only after asking (arch_prctl ARCH_REQ_XCOMP_PERM = 0x1023 for
// XFEATURE_XTILEDATA = 18); asked once, when the library loads; without it the op is not registered.
bool amx_permitted() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// C tiles (float32, from zero at k0 = 0, else reloaded from c) plus the products over k in [k0, k1) of two
// weight tiles (a0, a1: row stride lda elements; k past `full` from the zero-padded slabs t0, t1, row stride 32)
// and one or two packed x tiles (b0, b1: [K / 2 pairs][16 rows][2]); stored back to c ([4][16][16]).
template <bool TwoM>
void tile_block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* t0, const uint16_t* t1,
                const uint32_t* b0, const uint32_t* b1, int64_t k0, int64_t k1, int64_t full, float* c) {
  if (k0 == 0) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, 64);
    _tile_loadd(1, c + 256, 64);
    _tile_loadd(2, c + 512, 64);
    _tile_loadd(3, c + 768, 64);
  }
  for (int64_t k = k0; k < std::min(k1, full); k += kStep) {
    _tile_loadd(4, a0 + k, lda * 2);
    _tile_loadd(6, b0 + k / 2 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1 + k, lda * 2);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (TwoM) {
      _tile_loadd(7, b1 + k / 2 * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (k1 > full) {
    _tile_loadd(4, t0, 64);
    _tile_loadd(6, b0 + full / 2 * kTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, t1, 64);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (TwoM) {
      _tile_loadd(7, b1 + full / 2 * kTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  _tile_stored(2, c + 512, 64);
  _tile_stored(3, c + 768, 64);
}

// r[i] = row i of a 16 x 16 matrix of 32-bit elements; on return r[j] = its column j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + c]: lane L holds rows 4g .. 4g + 3 of column 4L + c
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // transpose the 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
    t[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    t[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be contiguous bfloat16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.size(1) == x.size(1),
              "w must be contiguous bfloat16 [N, K] with x's K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t full = K / kStep * kStep, pad_k = (K + kStep - 1) / kStep * kStep;
  const int64_t m_tiles = (M + kTile - 1) / kTile, n_tiles = (N + kTile - 1) / kTile, pairs = (n_tiles + 1) / 2;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  // x as B tiles: tile t holds rows 16t .. 16t + 15 as [pad_k / 2][16][2] (k pairs x rows), zeros past M, K.
  const int64_t b_tile = pad_k / 2 * kTile;  // uint32 pairs per packed x tile
  at::Tensor packed = at::empty({m_tiles * b_tile * 2}, x.options());
  uint32_t* bp = reinterpret_cast<uint32_t*>(packed.data_ptr());
  at::parallel_for(0, m_tiles, 1, [&](int64_t t0, int64_t t1) {
    __m512i r[16];
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < pad_k; k += kStep) {
        const __mmask32 valid = K - k >= kStep ? ~0u : static_cast<__mmask32>((1u << (K - k)) - 1);
        for (int64_t m = 0; m < kTile; ++m) {
          const int64_t row = t * kTile + m;
          r[m] = row < M ? _mm512_maskz_loadu_epi16(valid, xp + row * K + k) : _mm512_setzero_si512();
        }
        transpose16(r);
        for (int64_t j = 0; j < kTile; ++j) _mm512_storeu_si512(bp + t * b_tile + (k / 2 + j) * kTile, r[j]);
      }
  });
  // Zero-padded weight copies: the last 16-row tile when N % 16 != 0, the K % 32 tail of every row.
  const int64_t last_rows = N - (n_tiles - 1) * kTile;
  at::Tensor last = at::zeros({last_rows < kTile ? kTile : 0, K}, w.options());
  at::Tensor slab = at::zeros({full < K ? n_tiles * kTile : 0, kStep}, w.options());
  if (last_rows < kTile) last.narrow(0, 0, last_rows).copy_(w.narrow(0, N - last_rows, last_rows));
  if (full < K) slab.narrow(0, 0, N).narrow(1, 0, K - full).copy_(w.narrow(1, full, K - full));
  const uint16_t* lp = reinterpret_cast<const uint16_t*>(last.data_ptr());
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(slab.data_ptr());
  const int64_t m_pairs = (m_tiles + 1) / 2;
  const int64_t kc = std::max(8 * kStep, kChunkBytes / (m_tiles * kTile * 2) / kStep * kStep);
  // Weight tile i: its rows in w (row stride K), or the zero-padded copy of a short last tile.
  const auto weights = [&](int64_t i) { return i * kTile + kTile <= N ? wp + i * kTile * K : lp; };
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    const TileConfig config;
    _tile_loadconfig(&config);
    std::vector<float> acc(kGroup * m_pairs * 4 * kTile * kTile);  // C of a group of weight tile pairs
    for (int64_t g0 = p0; g0 < p1; g0 += kGroup) {
      const int64_t g1 = std::min(p1, g0 + kGroup);
      for (int64_t k0 = 0; k0 < pad_k; k0 += kc)
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t i0 = 2 * p, i1 = std::min(2 * p + 1, n_tiles - 1);  // a lone last tile runs twice
          const uint16_t *a0 = weights(i0), *a1 = weights(i1);
          const uint16_t *s0 = sp + i0 * kTile * kStep, *s1 = sp + i1 * kTile * kStep;
          for (int64_t t = 0; t < m_tiles; t += 2) {
            float* c = acc.data() + ((p - g0) * m_pairs + t / 2) * 4 * kTile * kTile;
            const int64_t k1 = std::min(pad_k, k0 + kc);
            const uint32_t* b = bp + t * b_tile;
            if (t + 1 < m_tiles)
              tile_block<true>(a0, a1, K, s0, s1, b, b + b_tile, k0, k1, full, c);
            else
              tile_block<false>(a0, a1, K, s0, s1, b, nullptr, k0, k1, full, c);
          }
        }
      // Each C tile [n][m] transposed, rounded once to bfloat16 (to nearest even) into y[m][n].
      for (int64_t p = g0; p < g1; ++p)
        for (int64_t i = 0; i < 2 && (2 * p + i) * kTile < N; ++i)
          for (int64_t t = 0; t < m_tiles; ++t) {
            const float* c = acc.data() + (((p - g0) * m_pairs + t / 2) * 4 + 2 * i + t % 2) * kTile * kTile;
            const int64_t n0 = (2 * p + i) * kTile;
            const __mmask16 cols = static_cast<__mmask16>((1u << std::min(kTile, N - n0)) - 1);
            __m512i r[16];
            for (int64_t n = 0; n < kTile; ++n) r[n] = _mm512_loadu_si512(c + n * kTile);
            transpose16(r);
            for (int64_t m = 0; m < std::min(kTile, M - t * kTile); ++m)
              _mm256_mask_storeu_epi16(yp + (t * kTile + m) * N + n0, cols,
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[m])));
          }
    }
    _tile_release();
  });
  return y;
}
#endif

}  // namespace

TORCH_LIBRARY(shardwise_rows, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor", &linear_f32);
  m.def("linear_f32_pairs(Tensor x, Tensor w) -> Tensor", &linear_f32_pairs);
#if defined(SHARDWISE_AMX_BF16)
  if (amx_permitted()) m.def("linear_bf16(Tensor x, Tensor w) -> Tensor", &linear_bf16);
#endif
#if defined(SHARDWISE_DP_BF16)
  m.def("linear_bf16_dp(Tensor x, Tensor w) -> Tensor", &linear_bf16_dp);
  m.def("linear_bf16_dp_pairs(Tensor x, Tensor w) -> Tensor", &linear_bf16_dp_pairs);
#endif
}
#else
TORCH_LIBRARY(shardwise_rows, m) {}
#endif
