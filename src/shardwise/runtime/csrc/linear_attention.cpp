// One position of a gated delta-rule layer (Qwen3.5's Gated DeltaNet, Kimi Delta Attention) for B rows:
// everything between the layer's input projections and its output norm in one call, which in torch
// ops is ~50 small kernels per layer and token (their dispatch, not their bytes, was the decode step's
// cost). Per row b:
//
//   conv:  y[c] = sum_j window[c, j] w[c, j] + x[c] w[c, K-1]   (float32, j ascending), then
//          s[c] = silu(y[c] rounded to the run dtype), rounded to the run dtype   (as transformers)
//          the new window: window[c, 1:] then x[c]
//   q, k:  s's first two blocks of key_heads x d_k channels, each head L2-normalised
//          (x / sqrt(sum x^2 + 1e-6)); q also times `scale`; v: the last value_heads x d_v channels
//   per value head h (key head h / (value_heads / key_heads)), state S [d_k, d_v] float32 in place:
//          S <- diag(exp g) S      g [d_k] per channel (KDA) or one value per head (Gated DeltaNet)
//          S <- S + k (beta (v - S^T k))^T;   o = S^T q
//
// With `a_log` the call also forms the gates from the projections, as the layers' torch code does (float32):
//   g = -exp(a_log[h]) * softplus(g_raw + dt_bias)  softplus(t) = t past 20, else log1p(exp(t)) (`log1p`:
//       Gated DeltaNet's F.softplus) or log(1 + exp(t)) (KDA's expression); with `lower_bound` (K3's safe gate)
//       g = lower_bound * sigmoid(exp(a_log[h]) * (g_raw + dt_bias));
//   beta = sigmoid(beta_raw) in the run dtype (rounded to it, as torch's sigmoid of a run-dtype tensor).
// That replaces ~10 more small torch ops per layer and token.
//
// Every head is computed in one fixed order whatever B and whichever rows share a call, so a k+1-position
// verify pass equals k+1 single steps bit for bit (each position is its own call).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr float kL2Eps = 1e-6f;  // FLA's and transformers' l2norm epsilon

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// conv + SiLU of one row's C channels into s (float32), the shifted window into next.
template <typename T>
void conv_silu(const T* x, const T* window, const T* w, int64_t C, int64_t taps, float* s, T* next) {
  for (int64_t c = 0; c < C; ++c) {
    const T* win = window + c * taps;
    const T* wc = w + c * (taps + 1);
    float y = 0.f;
    for (int64_t j = 0; j < taps; ++j) y += static_cast<float>(win[j]) * static_cast<float>(wc[j]);
    y += static_cast<float>(x[c]) * static_cast<float>(wc[taps]);
    const float u = rounded<T>(y);
    s[c] = rounded<T>(u / (1.f + std::exp(-u)));
    T* out = next + c * taps;
    for (int64_t j = 0; j + 1 < taps; ++j) out[j] = win[j + 1];
    out[taps - 1] = x[c];
  }
}

void l2_normalize(float* v, int64_t n, float scale) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += v[i] * v[i];
  const float f = scale / std::sqrt(ss + kL2Eps);
  for (int64_t i = 0; i < n; ++i) v[i] *= f;
}

// One head: S [dk, dv] in place, o [dv].
void delta_head(float* __restrict S, const float* __restrict q, const float* __restrict k, const float* __restrict v,
                const float* g, bool per_channel, float beta, int64_t dk, int64_t dv, float* __restrict kv,
                float* __restrict o) {
  for (int64_t j = 0; j < dv; ++j) kv[j] = 0.f;
  const float head_decay = per_channel ? 0.f : std::exp(g[0]);
  for (int64_t i = 0; i < dk; ++i) {
    const float d = per_channel ? std::exp(g[i]) : head_decay;
    const float ki = k[i];
    float* __restrict row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      row[j] *= d;
      kv[j] += ki * row[j];
    }
  }
  for (int64_t j = 0; j < dv; ++j) {
    kv[j] = (v[j] - kv[j]) * beta;  // the write: delta
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float ki = k[i], qi = q[i];
    float* __restrict row = S + i * dv;
    for (int64_t j = 0; j < dv; ++j) {
      row[j] += ki * kv[j];
      o[j] += qi * row[j];
    }
  }
}

// (g, beta) float32 [B, H(, d_k)] / [B, H] from the raw projections (see the header).
std::tuple<at::Tensor, at::Tensor> gates(const at::Tensor& g_raw, const at::Tensor& beta_raw, const at::Tensor& a_log,
                                         const at::Tensor& dt_bias, std::optional<double> lower_bound, bool log1p,
                                         int64_t B, int64_t H) {
  const at::Tensor raw = g_raw.to(at::kFloat).contiguous().view({B, H, -1});
  const int64_t per = raw.size(2);
  const at::Tensor bias = dt_bias.to(at::kFloat).contiguous().view({-1});
  const at::Tensor alog = a_log.to(at::kFloat).contiguous().view({-1});
  TORCH_CHECK(bias.numel() == H * per && alog.numel() == H, "dt_bias must hold H (x d_k) values and a_log H");
  at::Tensor g = at::empty({B, H, per}, raw.options());
  const float* rp = raw.data_ptr<float>();
  const float* bp = bias.data_ptr<float>();
  const float* ap = alog.data_ptr<float>();
  float* gp = g.data_ptr<float>();
  for (int64_t i = 0; i < B * H * per; ++i) {
    const float a = std::exp(ap[i / per % H]), t = rp[i] + bp[i % (H * per)];
    if (lower_bound.has_value()) {
      gp[i] = static_cast<float>(*lower_bound) * (1.f / (1.f + std::exp(-(a * t))));
    } else {
      gp[i] = -a * (t > 20.f ? t : (log1p ? std::log1p(std::exp(t)) : std::log(1.f + std::exp(t))));
    }
  }
  at::Tensor beta = at::empty({B, H}, raw.options());
  TORCH_CHECK(beta_raw.numel() == B * H, "beta must hold B x H values");
  const at::Tensor braw = beta_raw.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, braw.scalar_type(), "gates", [&] {
    const scalar_t* src = braw.data_ptr<scalar_t>();
    for (int64_t i = 0; i < B * H; ++i) beta.data_ptr<float>()[i] = rounded<scalar_t>(1.f / (1.f + std::exp(-float(src[i]))));
  });
  return {per == 1 ? g.view({B, H}) : g, beta};
}

std::tuple<at::Tensor, at::Tensor> gated_delta_step(const at::Tensor& x, const at::Tensor& window,
                                                    const at::Tensor& weight, const at::Tensor& g_in,
                                                    const at::Tensor& beta_in, at::Tensor& state, int64_t key_heads,
                                                    double scale, const std::optional<at::Tensor>& a_log,
                                                    const std::optional<at::Tensor>& dt_bias,
                                                    std::optional<double> lower_bound, bool log1p) {
  TORCH_CHECK(state.dim() == 4 && state.scalar_type() == at::kFloat && state.is_contiguous(),
              "state must be contiguous float32 [B, H, d_k, d_v]");
  const int64_t B = state.size(0), H = state.size(1), dk = state.size(2), dv = state.size(3);
  TORCH_CHECK(!a_log.has_value() || dt_bias.has_value(), "a_log needs dt_bias");
  const auto [g, beta] = a_log.has_value() ? gates(g_in, beta_in, *a_log, *dt_bias, lower_bound, log1p, B, H)
                                           : std::make_tuple(g_in, beta_in);
  TORCH_CHECK(key_heads > 0 && H % key_heads == 0, "value heads must be a multiple of key heads");
  const int64_t C = 2 * key_heads * dk + H * dv;
  TORCH_CHECK(x.dim() == 2 && x.size(0) == B && x.size(1) == C && x.is_contiguous(), "x must be contiguous [B, C]");
  TORCH_CHECK(window.dim() == 3 && window.size(0) == B && window.size(1) == C && window.is_contiguous() &&
                  window.size(2) >= 1, "window must be contiguous [B, C, K-1]");
  const int64_t taps = window.size(2);
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == C && weight.size(1) == taps + 1 && weight.is_contiguous(),
              "weight must be contiguous [C, K]");
  TORCH_CHECK(x.scalar_type() == window.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, window and weight must share the run dtype");
  const bool per_channel = g.dim() == 3;
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.is_contiguous() && g.size(0) == B && g.size(1) == H &&
                  (g.dim() == 2 || (per_channel && g.size(2) == dk)), "g must be contiguous float32 [B, H] or [B, H, d_k]");
  TORCH_CHECK(beta.scalar_type() == at::kFloat && beta.is_contiguous() && beta.numel() == B * H,
              "beta must be contiguous float32 [B, H]");

  at::Tensor out = at::empty({B, H, dv}, state.options());
  at::Tensor next = at::empty_like(window);
  std::vector<float> s(B * C);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "gated_delta_step", [&] {
    for (int64_t b = 0; b < B; ++b)
      conv_silu<scalar_t>(x.data_ptr<scalar_t>() + b * C, window.data_ptr<scalar_t>() + b * C * taps,
                          weight.data_ptr<scalar_t>(), C, taps, s.data() + b * C, next.data_ptr<scalar_t>() + b * C * taps);
  });
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < 2 * key_heads; ++h)
      l2_normalize(s.data() + b * C + h * dk, dk, h < key_heads ? static_cast<float>(scale) : 1.f);

  const int64_t group = H / key_heads;
  float* S = state.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> kv(dv);
    for (int64_t bh = h0; bh < h1; ++bh) {
      const int64_t b = bh / H, h = bh % H, kh = h / group;
      const float* row = s.data() + b * C;
      delta_head(S + bh * dk * dv, row + kh * dk, row + (key_heads + kh) * dk, row + 2 * key_heads * dk + h * dv,
                 gp + bh * (per_channel ? dk : 1), per_channel, bp[bh], dk, dv, kv.data(), op + bh * dv);
    }
  });
  return {out, next};
}

}  // namespace

TORCH_LIBRARY(shardwise_la, m) {
  m.def("gated_delta_step(Tensor x, Tensor window, Tensor weight, Tensor g, Tensor beta, Tensor(a!) state, "
        "int key_heads, float scale, Tensor? a_log=None, Tensor? dt_bias=None, float? lower_bound=None, "
        "bool log1p=False) -> (Tensor, Tensor)",
        &gated_delta_step);
}
