// One row of rotary position embedding (rotary.cpp; decode_attention.cpp's step rotates into the cache with it): the
// roundings of torch's `cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)` in E — every product rounded to E, then their
// sum / difference — with floating-point contraction off for these functions whatever the including file's flags.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace shardwise {

template <class E>
inline float rounded(float v) {
  if constexpr (std::is_same_v<E, float>) {
    return v;
  } else {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    bits = v != v ? (bits | 0x00400000u) & 0xFFFF0000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    float out;
    std::memcpy(&out, &bits, sizeof out);
    return out;
  }
}

// One row: the pairs' halves gathered as float32, then the four rounded products and their rounded sums.
template <class E, bool kInterleaved>
inline void rotate_row(const E* __restrict xr, const E* __restrict cr, const E* __restrict sr, E* __restrict o,
                       int64_t half) {
  constexpr int64_t kBlock = 64;  // pairs per pass (float32 scratch in registers / L1)
  for (int64_t i0 = 0; i0 < half; i0 += kBlock) {
    const int64_t n = std::min(kBlock, half - i0);
    float x1[kBlock], x2[kBlock], lo[kBlock], hi[kBlock];
    for (int64_t i = 0; i < n; ++i) {
      x1[i] = float(kInterleaved ? xr[2 * (i0 + i)] : xr[i0 + i]);
      x2[i] = float(kInterleaved ? xr[2 * (i0 + i) + 1] : xr[half + i0 + i]);
    }
    for (int64_t i = 0; i < n; ++i) {
      const float c = float(cr[i0 + i]), s = float(sr[i0 + i]);
      lo[i] = rounded<E>(x1[i] * c) - rounded<E>(x2[i] * s);  // each product rounded to E, as torch's multiply
      hi[i] = rounded<E>(x2[i] * c) + rounded<E>(x1[i] * s);
    }
    for (int64_t i = 0; i < n; ++i) {
      o[i0 + i] = E(lo[i]);
      o[half + i0 + i] = E(hi[i]);
    }
  }
}


}  // namespace shardwise
#pragma GCC pop_options
