// Attention of one query row per head (a decode step, or one row of a verify pass) over a cache:
// out[b, 0, h * dv + e] = sum_j p[b, h, j] v[b, h / g, j, e], p = softmax_j(scale * q[b, h] . k[b, h / g, j]),
// q [B, H, 1, dk], k [B, KV, L, dk], v [B, KV, L, dv] (H = g * KV; any strides but a contiguous last dim: the
// caches are read where they lie), float32 or bfloat16 -> out [B, 1, H * dv] in that dtype.
//
// Every sum is float32 in one fixed order that depends on L, dk and dv alone (not on B, H, which rows share
// the call or which thread runs it): a score is one 16-lane chain over dk ascending (float32: fused
// multiply-adds; bfloat16 on AVX512-BF16: vdpbf16ps, exact products added in pairs; bfloat16 elsewhere:
// widened to float32 exactly), its lanes summed in one fixed tree (lane_sums16, 16 keys at a time), then times
// scale; the softmax is at::softmax over the float32 scores of a row (vectorised along L inside one thread); an
// output element is one chain over j ascending of p * v, rounded once to the dtype (nearest even). So a verify
// pass, attending row by row, gives each row a one-row step's bits (runtime.attention.attend).
//
// Why not torch's scaled_dot_product_attention for one query row: on an AMD EPYC (Zen 4, no AMX) VM, two
// threads, 16 heads / 4 KV heads of 128, its flash kernel took 36 / 139 / 5183 us in float32 and 172 /
// 1772 / 15367 us in bfloat16 at 64 / 512 / 4096 keys (an eager matmul-softmax-matmul: 60 / 127 / 1862 and
// 97 / 165 / 1060): at long context a decode step spent more time in attention than reading the weights.
// Threads split (batch row, KV head, 256-key block) for the scores and (batch row, KV head, value lanes: whole
// rows, or halves where that leaves fewer tasks than threads) for the outputs; each KV head's keys and values
// are read from memory once for all g of its query heads (a block of 256 rows stays in cache while the heads
// pass over it, 2 at a time for the values). Against
// the previous form of this file (one key at a time, each score's lanes reduced alone, one 16-lane value
// slice per task), side by side, two threads, same VM: 16 / 4 heads of 128, bfloat16, 21 / 200 / 1000 /
// 4096 keys: 21 / 48 / 191 / 726 -> 14 / 32 / 117 / 448 us; float32 17 / 45 / 187 / 775 -> 16 / 38 / 148 /
// 614 us; MLA's absorbed shape (16 heads over one latent head, dk 576, dv 512) bfloat16 at 200 / 4096 keys:
// 227 / 2170 -> 117 / 1678 us.
// Problems under kInlineWork multiply-adds run on the calling thread (waking the pool costs more than them).
//
// step: one decode step of grouped-query full attention in one call, for a token per row: qkv [B, 1, (H + 2 KV)
// d] (the stacked q|k|v product) read in place; q and k through the optional q / k RMSNorms
// (shardwise_norm::rms_norm, looked up in the dispatcher: runtime.attention loads its library first) and rotate-half
// rotary (rotary.cpp's own rows, rotary_row.h; cos / sin [1, d/2]), k rotated straight into cache position
// `position` and v copied there (rows 0..B-1 of k_cache / v_cache [max_batch, KV, S, d]); then decode over keys
// 0..position. The ops and order of runtime.attention's GQAttention path, so the same bits, without its ~12
// Python-level torch calls; rotating in place saves the two rotary calls' and two cache copies' dispatch and
// allocations (~20-30 us a layer of a decode step, whose caches are cold after each weight stream).
// Built only where the compiler targets AVX-512F and BW; elsewhere no op is registered (SDPA runs).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dispatched_ops.h"
#include "rotary_row.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

namespace {

constexpr int64_t kKeyBlock = 256;  // keys per scoring task
constexpr int64_t kValueHeads = 2;  // query heads sharing one pass over a KV head's value rows (accumulators)
constexpr int64_t kLanes = 8;       // 16-lane slices of the value rows one task sums (kValueHeads x kLanes registers)
constexpr int64_t kInlineWork = 1 << 17;  // multiply-adds (B H L dk) below which one thread runs a call

// 16 elements from p as float32 (the first `n` of them; the rest zero).
inline __m512 load16(const float* p, int64_t n) {
  return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline __m512 load16(const c10::BFloat16* p, int64_t n) {
  const __m256i raw = n >= 16 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
                              : _mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));  // bfloat16 -> float32, exact
}

// The sums of 16 vectors' lanes as one vector (lane i: vector i's sum), in one fixed tree: neighbouring lanes,
// then lanes two apart, then 128-bit quarters (halves, then pairs).
inline __m512 lane_sums16(__m512 a[16]) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0x44), _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], 0xEE));
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, 0x88), _mm512_shuffle_f32x4(z0, z1, 0xDD));
}

// How a score's products are formed: float32 q and keys (fused multiply-add, 16 per step); bfloat16 q and keys
// on AVX512-BF16 (vdpbf16ps: exact products, added in pairs, 32 per step); bfloat16 elsewhere (widened).
struct WideDot {
  static constexpr int64_t kStep = 16;
  using V = __m512;
  template <class T>
  static V load(const T* p, int64_t n) { return load16(p, n); }
  static __m512 madd(__m512 acc, V q, V k) { return _mm512_fmadd_ps(q, k, acc); }
};
#if defined(__AVX512BF16__)
struct PairDot {
  static constexpr int64_t kStep = 32;
  using V = __m512i;
  static V load(const c10::BFloat16* p, int64_t n) {
    return n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
  }
  static __m512 madd(__m512 acc, V q, V k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
};
#endif

// scores[h, j] = scale * q[h] . k[j] for the g query heads of one KV head and keys j0..j1: each key's products in
// a 16-lane chain over dk ascending (Dot's steps), its lanes summed by lane_sums16 (the same tree for every one of
// its 16 vectors). Two heads by 8 keys at a time, so each key vector loaded serves both heads (one head at a time
// by 16 keys loaded every key twice as often; one thread, 4 heads over 4096 bfloat16 keys in cache: 12-18 -> 6
// cycles per score, the same bits); an odd last head is computed twice and stored once. The whole op, 16 / 4 heads
// of 128, 2 threads, 10 layers' caches cycled, side by side with the form before this and value_tile: bfloat16
// 41 / 512 / 4096 keys 22-23 / 164-173 / 985-1014 -> 9.5-13.7 / 89-93 / 635-650 us, float32 24 / 250 / 1933-1951
// -> 14-15 / 166-167 / 1240-1269 us.
template <class Dot, class Q, class T>
void score_keys(const Q* q, const T* k, int64_t ks2, int64_t dk, int64_t g, int64_t j0, int64_t j1, float scale,
                float* s, int64_t L) {
  for (int64_t h = 0; h < g; h += 2) {
    const int64_t h1 = std::min<int64_t>(h + 1, g - 1);
    for (int64_t jb = j0; jb < j1; jb += 8) {
      const int64_t n = std::min<int64_t>(8, j1 - jb);
      __m512 acc[16];  // 0-7: head h's keys, 8-15: head h1's
      const T* kr[8];
      for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
      for (int i = 0; i < 8; ++i) kr[i] = k + (jb + std::min<int64_t>(i, n - 1)) * ks2;  // past the last key: its copy
      for (int64_t d = 0; d < dk; d += Dot::kStep) {
        const typename Dot::V q0 = Dot::load(q + h * dk + d, dk - d), q1 = Dot::load(q + h1 * dk + d, dk - d);
        for (int i = 0; i < 8; ++i) {
          const typename Dot::V kv = Dot::load(kr[i] + d, dk - d);
          acc[i] = Dot::madd(acc[i], q0, kv);
          acc[8 + i] = Dot::madd(acc[8 + i], q1, kv);
        }
      }
      const __m512 out = _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale));
      const auto keys = static_cast<__mmask16>((1u << n) - 1);
      _mm512_mask_storeu_ps(s + h * L + jb, keys, out);
      if (h1 != h) _mm512_mask_storeu_ps(s + h1 * L + jb, keys, _mm512_shuffle_f32x4(out, out, 0x4E));  // lanes 8-15
    }
  }
}

// acc[i][l] (head i's 16-lane slice l, kLanes slices per head, in memory) += sum over keys j0..j1 ascending of
// p[i][j] * v[j][16 l ..] (ph: head i's probabilities at i * L; vr: the task's first value lane in key 0's row;
// `width` value lanes from there), one fused multiply-add chain per slice. value_tile: N heads by NL slices with
// compile-time bounds, so the accumulators stay in registers (with runtime bounds they lived in a stack array);
// the same operations in the same order, so the same bits. 2 threads, 16 / 4 heads of 128, this AMD EPYC VM: the
// value pass at 4096 bfloat16 keys in cache ~430 -> ~270 us (4 heads x 4 slices, half rows per task). With whole
// rows per task (2 heads x 8 slices) the whole op with 10 layers' caches cycled (from memory), side by side
// against the runtime-bounded half-row form: bfloat16 41 / 512 / 4096 keys 24-26 / 154-156 / 964-986 -> 20-21 /
// 131-139 / 752-794 us, float32 31 / 235-247 / 1478-1619 -> 23-26 / 191-210 / 1092-1176 us; the same bits.
template <int N, int NL, class T>
inline void value_tile(const float* ph, int64_t L, const T* vr, int64_t vs2, int64_t j0, int64_t j1, int64_t width,
                       float* acc_out) {
  __m512 acc[N][NL];
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < NL; ++l) acc[i][l] = _mm512_loadu_ps(acc_out + (i * kLanes + l) * 16);
  for (int64_t j = j0; j < j1; ++j) {
    const T* row = vr + j * vs2;
    __m512 p[N];
    for (int i = 0; i < N; ++i) p[i] = _mm512_set1_ps(ph[i * L + j]);
    for (int l = 0; l < NL; ++l) {
      const __m512 vv = load16(row + l * 16, width - l * 16);
      for (int i = 0; i < N; ++i) acc[i][l] = _mm512_fmadd_ps(p[i], vv, acc[i][l]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int l = 0; l < NL; ++l) _mm512_storeu_ps(acc_out + (i * kLanes + l) * 16, acc[i][l]);
}
// value_tile for n (1..kValueHeads) heads by nl (1..kLanes) slices, each shape its own instantiation.
template <int N, class T>
void value_lanes(int64_t nl, const float* ph, int64_t L, const T* vr, int64_t vs2, int64_t j0, int64_t j1, int64_t width,
                 float* acc) {
  switch (nl) {
    case 1: return value_tile<N, 1>(ph, L, vr, vs2, j0, j1, width, acc);
    case 2: return value_tile<N, 2>(ph, L, vr, vs2, j0, j1, width, acc);
    case 3: return value_tile<N, 3>(ph, L, vr, vs2, j0, j1, width, acc);
    case 4: return value_tile<N, 4>(ph, L, vr, vs2, j0, j1, width, acc);
    case 5: return value_tile<N, 5>(ph, L, vr, vs2, j0, j1, width, acc);
    case 6: return value_tile<N, 6>(ph, L, vr, vs2, j0, j1, width, acc);
    case 7: return value_tile<N, 7>(ph, L, vr, vs2, j0, j1, width, acc);
    default: return value_tile<N, kLanes>(ph, L, vr, vs2, j0, j1, width, acc);
  }
}
template <class T>
void value_pass(int64_t n, int64_t nl, const float* ph, int64_t L, const T* vr, int64_t vs2, int64_t j0, int64_t j1,
                int64_t width, float* acc) {
  if (n == 1) return value_lanes<1>(nl, ph, L, vr, vs2, j0, j1, width, acc);
  return value_lanes<kValueHeads>(nl, ph, L, vr, vs2, j0, j1, width, acc);
}

template <class T>
at::Tensor attend_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t B = q.size(0), H = q.size(1), dk = q.size(3), KV = k.size(1), L = k.size(2), dv = v.size(3);
  const int64_t g = H / KV;
#if defined(__AVX512BF16__)
  constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
  constexpr bool kPairs = false;
#endif
  const at::Tensor qf = kPairs ? q : q.to(at::kFloat).contiguous();  // widened once (exact) unless pairs
  const T* kp = reinterpret_cast<const T*>(k.data_ptr());
  const T* vp = reinterpret_cast<const T*>(v.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  at::Tensor scores = at::empty({B, H, L}, q.options().dtype(at::kFloat));
  float* sp = scores.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t blocks = (L + kKeyBlock - 1) / kKeyBlock;
  const bool inline_call = B * H * L * std::max(dk, dv) < kInlineWork;  // which thread sums a value changes no bit
  at::parallel_for(0, B * KV * blocks, inline_call ? B * KV * blocks : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (KV * blocks), kvh = t / blocks % KV, j0 = t % blocks * kKeyBlock, j1 = std::min(L, j0 + kKeyBlock);
      const T* keys = kp + b * ks0 + kvh * ks1;
      float* s = sp + (b * H + kvh * g) * L;
      if constexpr (kPairs) {
#if defined(__AVX512BF16__)
        score_keys<PairDot>(q.data_ptr<T>() + (b * H + kvh * g) * dk, keys, ks2, dk, g, j0, j1, sc, s, L);
#endif
      } else {
        score_keys<WideDot>(qf.data_ptr<float>() + (b * H + kvh * g) * dk, keys, ks2, dk, g, j0, j1, sc, s, L);
      }
    }
  });
  const at::Tensor probs = scores.softmax(-1);
  const float* pp = probs.data_ptr<float>();
  at::Tensor out = at::empty({B, 1, H * dv}, q.options());
  T* op = reinterpret_cast<T*>(out.data_ptr());
  // A task's 16-lane slices of the value rows: whole rows up to kLanes slices (each row read once, in full: on this
  // VM two tasks each streaming half of every row ran 2-3x slower than one streaming whole rows), halves where
  // that would leave fewer tasks than threads.
  const int64_t lanes = (dv + 15) / 16, per_task = B * KV >= at::get_num_threads() ? kLanes : kLanes / 2;
  const int64_t slices = (lanes + per_task - 1) / per_task;
  at::parallel_for(0, B * KV * slices, inline_call ? B * KV * slices : 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (KV * slices), kvh = t / slices % KV, e0 = t % slices * per_task * 16;
      const int64_t nl = std::min<int64_t>(per_task, (dv - e0 + 15) / 16);  // 16-lane slices of this task
      std::vector<float> sums(g * kLanes * 16, 0.f);  // each head's slices, carried across key blocks
      for (int64_t j0 = 0; j0 < L; j0 += kKeyBlock) {  // a block of value rows stays in cache for all g heads
        const int64_t j1 = std::min(L, j0 + kKeyBlock);
        for (int64_t h0 = 0; h0 < g; h0 += kValueHeads) {
          const int64_t n = std::min(kValueHeads, g - h0);
          const float* ph = pp + (b * H + kvh * g + h0) * L;
          const T* vr = vp + b * vs0 + kvh * vs1 + e0;
          value_pass(n, nl, ph, L, vr, vs2, j0, j1, dv - e0, &sums[h0 * kLanes * 16]);
        }
      }
      for (int64_t h = 0; h < g; ++h) {
        T* dst = op + b * H * dv + (kvh * g + h) * dv + e0;
        for (int64_t e = 0; e < std::min<int64_t>(per_task * 16, dv - e0); ++e) dst[e] = static_cast<T>(sums[h * kLanes * 16 + e]);
      }
    }
  });
  return out;
}

at::Tensor decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(2) == 1 && q.is_contiguous(),
              "q must be contiguous [B, H, 1, dk]; k [B, KV, L, dk], v [B, KV, L, dv]");
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1) && k.size(2) == v.size(2) &&
              k.size(3) == q.size(3) && q.size(1) % k.size(1) == 0 && k.size(2) > 0,
              "k and v must hold the same positive number of keys for KV heads dividing q's heads, k with q's dk");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "k and v must be contiguous along their last dim");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k and v must share a dtype");
  if (q.scalar_type() == at::kFloat) return attend_rows<float>(q, k, v, scale);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16, "q, k and v must be float32 or bfloat16");
  return attend_rows<c10::BFloat16>(q, k, v, scale);
}

// x [B, 1, n, d] (a view of qkv) through shardwise_norm::rms_norm (Llama form): contiguous [B, 1, n, d].
at::Tensor normed_heads(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static const auto norm = shardwise::find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool, bool)>("shardwise_norm::rms_norm");
  return norm.call(x, weight, eps, false, false);
}

// Rotate-half rotary of B x n rows of d (row (b, i) at src + b * sb + i * d) into dst + b * db + i * di: rotary.cpp's
// rows (rotary_row.h), so its bits.
template <class E>
void rotate_rows(const E* src, int64_t sb, const E* cos, const E* sin, E* dst, int64_t db, int64_t di, int64_t B,
                 int64_t n, int64_t d) {
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i = 0; i < n; ++i) shardwise::rotate_row<E, false>(src + b * sb + i * d, cos, sin, dst + b * db + i * di, d / 2);
}

template <class E>
at::Tensor step_rows(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                     at::Tensor& v_cache, int64_t p, int64_t heads, double scale, const std::optional<at::Tensor>& q_norm,
                     const std::optional<at::Tensor>& k_norm, double eps) {
  const int64_t B = qkv.size(0), KV = k_cache.size(1), d = k_cache.size(3), row = qkv.stride(0);
  const E* base = qkv.data_ptr<E>();
  // q and k as they enter the rotary: qkv's own rows, or (q / k norms) the norms' contiguous outputs
  const at::Tensor qn = q_norm ? normed_heads(qkv.narrow(2, 0, heads * d).view({B, 1, heads, d}), *q_norm, eps) : at::Tensor();
  const at::Tensor kn = k_norm ? normed_heads(qkv.narrow(2, heads * d, KV * d).view({B, 1, KV, d}), *k_norm, eps) : at::Tensor();
  at::Tensor q = at::empty({B, heads, 1, d}, qkv.options());
  rotate_rows<E>(q_norm ? qn.data_ptr<E>() : base, q_norm ? heads * d : row, cos.data_ptr<E>(), sin.data_ptr<E>(),
                 q.data_ptr<E>(), heads * d, d, B, heads, d);
  // k rotated straight into cache position p, v copied there: no TensorIterator copies (~20 us a layer, cold)
  E* kc = k_cache.data_ptr<E>() + p * k_cache.stride(2);
  E* vc = v_cache.data_ptr<E>() + p * v_cache.stride(2);
  rotate_rows<E>(k_norm ? kn.data_ptr<E>() : base + heads * d, k_norm ? KV * d : row, cos.data_ptr<E>(), sin.data_ptr<E>(),
                 kc, k_cache.stride(0), k_cache.stride(1), B, KV, d);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < KV; ++h)
      std::memcpy(vc + b * v_cache.stride(0) + h * v_cache.stride(1), base + b * row + (heads + KV + h) * d, d * sizeof(E));
  return decode(q, k_cache.narrow(0, 0, B).narrow(2, 0, p + 1), v_cache.narrow(0, 0, B).narrow(2, 0, p + 1), scale);
}

at::Tensor step(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                at::Tensor& v_cache, const at::Tensor& position, int64_t heads, double scale,
                const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double eps) {
  const int64_t B = qkv.size(0), KV = k_cache.size(1), S = k_cache.size(2), d = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 3 && qkv.size(1) == 1 && qkv.size(2) == (heads + 2 * KV) * d && qkv.is_contiguous(),
              "qkv must be contiguous [B, 1, (heads + 2 kv) d]");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && B <= k_cache.size(0), "caches must be [max_batch >= B, kv, S, d] alike");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.scalar_type() == qkv.scalar_type() &&
              v_cache.scalar_type() == qkv.scalar_type(), "caches must be contiguous along d, in qkv's dtype");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == 1 && t->size(1) == d / 2 && t->stride(1) == 1 && d % 2 == 0 &&
                t->scalar_type() == qkv.scalar_type(), "cos and sin must be [1, d/2] in qkv's dtype");
  TORCH_CHECK(position.scalar_type() == at::kLong && position.numel() == 1 && position.device().is_cpu(),
              "position must be one int64 on the CPU");
  const int64_t p = position.data_ptr<int64_t>()[0];
  TORCH_CHECK(p >= 0 && p < S, "position ", p, " is outside the cache of ", S);
  if (qkv.scalar_type() == at::kFloat) return step_rows<float>(qkv, cos, sin, k_cache, v_cache, p, heads, scale, q_norm, k_norm, eps);
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "qkv must be float32 or bfloat16");
  return step_rows<c10::BFloat16>(qkv, cos, sin, k_cache, v_cache, p, heads, scale, q_norm, k_norm, eps);
}

}  // namespace

TORCH_LIBRARY(shardwise_attn, m) {
  m.def("decode(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &decode);
  m.def("step(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor position, int heads, "
        "float scale, Tensor? q_norm, Tensor? k_norm, float eps) -> Tensor", &step);
}
#else
TORCH_LIBRARY(shardwise_attn, m) {}
#endif
