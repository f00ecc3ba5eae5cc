// Work split for the decode products: threads take chunks of work from one shared counter instead of a
// fixed share each (at::parallel_for's static split). On a shared host the two vCPUs of this VM do not run
// at the same speed moment to moment, and a static half leaves the faster thread waiting at the end of every
// product. Which thread computes an output changes none of its bits (each output is summed by one thread in
// its own fixed order), so this is purely a schedule. Measured on an AMD EPYC (Zen 4) VM, 2 threads, one
// bfloat16 row against a 2048 x 10 llama's 41 decode weights (1.03 GB in huge pages, small torch ops between
// products, 6 rounds alternating, three runs): median 29.4 / 25.4 / 26.2 GB/s static against 30.8-31.3 /
// 27.2-27.8 / 27.4-27.6 in chunks of 4-64 blocks of 8 rows.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace shardwise {

// Weight bytes a thread should stream per chunk it takes: each new chunk restarts the hardware prefetcher's
// stream. int4 rows of 2048 (1 KB + scales), 2 threads, 260 MB cycled, an AMD EPYC VM, side by side in two runs:
// chunks of 32 rows read 22-23 GB/s, of 128 to 1408 rows 26.5-27.5 (fixed halves 27-28).
constexpr int64_t kChunkBytes = 128 * 1024;
// The int8 / int4 kernels' (int_matmul.cpp) chunks: a Xeon VM (AMX, 2 vCPUs), the 2048x10 llama's decode in bfloat16,
// 5-6 rounds shuffled in one process, 128 / 512 / 1024 KB: int8 39.3 / 42.5 / 42.6 tok/s, int4 53.4 / 56.0 / 56.5, int4
// with int8 rows 65.6 / 67.7 / 69.2 (the dense bfloat16 product 22.6 / 22.2 / 22.2: it keeps kChunkBytes).
constexpr int64_t kIntChunkBytes = 512 * 1024;

// Rows per chunk for rows of `row_bytes`: about `chunk_bytes`, a multiple of `multiple` (at least one).
inline int64_t run_rows(int64_t row_bytes, int64_t multiple, int64_t chunk_bytes = kChunkBytes) {
  const int64_t rows = chunk_bytes / std::max<int64_t>(row_bytes, 1);
  return std::max<int64_t>(multiple, (rows + multiple - 1) / multiple * multiple);
}

// Rows per chunk for n rows of `row_bytes`: about `chunk_bytes` each, but as many chunks as a multiple of torch's
// thread count, so that threads streaming at one speed take equal shares (a multiple of `multiple` rows each, at
// least one). A MoE expert's 768x1024 MXFP4 projection (418 KB) was one chunk at 512 KB: one thread did all of it —
// a Qwen3-MoE-shaped model (hidden 1024, 64 experts top-8, width 768, 6 layers) with MXFP4 experts, 2 threads,
// bfloat16, side by side in one process, 6 rounds: 96.8 -> 129.4 tok/s (its BF16-expert twin 74.9 / 76.8); the
// 2048x10 llama's int4 decode (weights of 2.3-36 MB) unchanged.
inline int64_t even_runs(int64_t n, int64_t row_bytes, int64_t multiple, int64_t chunk_bytes) {
  const int64_t threads = std::max(1, at::get_num_threads());
  int64_t chunks = std::max<int64_t>(1, (n * row_bytes + chunk_bytes / 2) / chunk_bytes);
  chunks = (chunks + threads - 1) / threads * threads;
  const int64_t rows = (n + chunks - 1) / chunks;
  return std::max<int64_t>(multiple, (rows + multiple - 1) / multiple * multiple);
}

// f(begin, end) over [0, n) in chunks of `chunk`, each chunk taken by whichever of torch's threads is free.
template <class F>
void dynamic_for(int64_t n, int64_t chunk, const F& f) {
  if (n <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), (n + chunk - 1) / chunk);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(chunk, std::memory_order_relaxed)) < n;) f(begin, std::min(n, begin + chunk));
  });
}

// A thread's run [r0, r1) of weight rows taken two at a time, half a run apart (f2(a, a + half): two memory streams
// per thread, which a Xeon VM streams faster than one), then f1(r) for a lone last row.
template <class F2, class F1>
void run_in_pairs(int64_t r0, int64_t r1, const F2& f2, const F1& f1) {
  const int64_t half = (r1 - r0) / 2;
  for (int64_t i = 0; i < half; ++i) f2(r0 + i, r0 + half + i);
  if ((r1 - r0) & 1) f1(r1 - 1);
}

}  // namespace shardwise
