// How int_matmul.cpp's kernels fill y: every output of a call, spread over torch's threads (int_matmul.cpp includes
// it inside its anonymous namespace, after dynamic_for.h).
#pragma once

// y[m, r] = dot(r, m), float32 or rounded once to bfloat16 (nearest even, as Tensor.to); threads take runs of weight
// rows (dynamic_for.h, about 512 KB of packed rows + scales each), one sums each; with `dot2(a, b, m, out)` summing
// rows a and b together, a run's rows go two at a time (run_in_pairs).
template <class Dot, class Dot2>
void each_output(const at::Tensor& y, int64_t M, int64_t N, int64_t row_bytes, const Dot& dot, const Dot2* dot2) {
  const auto fill = [&](auto* yp) {
    using T = std::remove_pointer_t<decltype(yp)>;
    const auto one = [&](int64_t r) {
      for (int64_t m = 0; m < M; ++m) yp[m * N + r] = T(dot(r, m));
    };
    shardwise::dynamic_for(N, shardwise::even_runs(N, row_bytes, 32, shardwise::kIntChunkBytes), [&](int64_t r0, int64_t r1) {
      if (dot2 == nullptr) {
        for (int64_t r = r0; r < r1; ++r) one(r);
        return;
      }
      shardwise::run_in_pairs(r0, r1, [&](int64_t ra, int64_t rb) {
        for (int64_t m = 0; m < M; ++m) {
          float out[2];
          (*dot2)(ra, rb, m, out);
          yp[m * N + ra] = T(out[0]);
          yp[m * N + rb] = T(out[1]);
        }
      }, one);
    });
  };
  if (y.scalar_type() == at::kBFloat16) return fill(y.data_ptr<at::BFloat16>());
  fill(y.data_ptr<float>());
}
template <class Dot>
void each_output(const at::Tensor& y, int64_t M, int64_t N, int64_t row_bytes, const Dot& dot) {
  const auto no_pairs = [](int64_t, int64_t, int64_t, float*) {};
  each_output(y, M, N, row_bytes, dot, static_cast<const decltype(no_pairs)*>(nullptr));
}

// Every output through sum(R, rows, s0, m, out), which sums R weight rows (rows[i] = q + r_i * stride, their scales
// from s0[i]) against x row m — one at a time, or with `pairs` two far apart (each_output); R is passed as a
// std::integral_constant. Each row's bits are its own either way.
template <class P, class Sum>
void sum_rows(const at::Tensor& y, int64_t M, int64_t N, int64_t row_bytes, int64_t G, bool pairs, const P* q,
              int64_t stride, const Sum& sum) {
  const auto one = [&](int64_t r, int64_t m) {
    const P* rows[1] = {q + r * stride};
    const int64_t s0[1] = {r * G};
    float out;
    sum(std::integral_constant<int, 1>{}, rows, s0, m, &out);
    return out;
  };
  const auto two = [&](int64_t a, int64_t b, int64_t m, float* out) {
    const P* rows[2] = {q + a * stride, q + b * stride};
    const int64_t s0[2] = {a * G, b * G};
    sum(std::integral_constant<int, 2>{}, rows, s0, m, out);
  };
  each_output(y, M, N, row_bytes, one, pairs ? &two : nullptr);
}
