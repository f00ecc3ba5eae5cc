// A MoE block's routed SwiGLU experts for one row of a decode step on CPU, in one call.
//
// experts_row: out += sum over the picked experts i (in the order given) of w[slot_i] * down_i(silu(gate_i x)
// * up_i x), with the roundings of the torch ops it replaces (each product and sum rounded to the run dtype
// where those produce it). The products are the one-row products runtime.gemv uses: bfloat16 always
// shardwise_rows::linear_bf16_dp (row_linear.cpp: vdpbf16ps, each output one fixed-order chain rounded once);
// float32 torch.mv (MKL, F.linear's bits) or, with `fixed_order` (the kernel runtime.gemv measured faster on
// this machine), shardwise_rows::linear_f32. Both row_linear.cpp ops are looked up in the dispatcher:
// runtime.gemv loads that library first. So only the elementwise steps differ from the torch path, by float32
// rounding. Replaces ~8 small ops and a module call per expert, whose dispatch cost a decode step more than
// their bytes.
//
// experts_row_packed: the same for packed experts (int8 / int4 IntWeight, MXFP4 blocks with E8M0 scales): gate, up and
// down each through shardwise_int::int_matmul (int_matmul.cpp) with the arguments runtime.int_matmul.kernel_rows gives
// the modules (so each product's bits are the module path's), the SwiGLU and weighted sum as above. A Qwen3-MoE-shaped
// MXFP4 model (hidden 1024, 64 experts top-8, 6 layers; Xeon VM, 2 threads, bfloat16): decode 77 -> 117 tok/s, against
// 84 for its BF16-expert twin through experts_row; int4 experts (stacked gate|up already) 115 -> 125. It also takes
// Kimi K3's SiTU-GLU experts and its latent MoE's float32 sum (out float32, router weights float32), and gpt-oss's
// fused experts (interleaved gate|up, biases, clamped SwiGLU): bench_mxfp4's gpt-oss shape, one thread, MXFP4 208 -> 251
// tok/s (its BF16 twin 173-181, expert by expert).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "dispatched_ops.h"

namespace {

using RowsOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// shardwise_rows' product for `dtype` (linear_f32 or linear_bf16_dp), looked up once.
const RowsOp& rows_op(at::ScalarType dtype) {
  const auto find = shardwise::find_op<at::Tensor(const at::Tensor&, const at::Tensor&)>;
  if (dtype == at::kFloat) {
    static const RowsOp op = find("shardwise_rows::linear_f32");
    return op;
  }
  static const RowsOp op = find("shardwise_rows::linear_bf16_dp");
  return op;
}

// w [N, K] times x [K] in their dtype: linear_bf16_dp for bfloat16; for float32 torch.mv, or linear_f32 if
// `fixed_order`.
at::Tensor row_product(const at::Tensor& w, const at::Tensor& x, bool fixed_order) {
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "experts_row runs float32 or bfloat16");
  if (w.scalar_type() == at::kFloat && !fixed_order) return at::mv(w, x);
  return rows_op(w.scalar_type()).call(x.view({1, x.numel()}), w).view({w.size(0)});
}

template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// How an expert's gate and up meet: kind 0, moe.silu_and_mul (F.silu(gate) rounded to T, times up, rounded); kind 1,
// moe.situ_and_mul (p0 = beta, p1 = linear beta: beta tanh(gate / beta) sigmoid(gate) times up — first squashed to
// lb tanh(up / lb) where lb != 0 — in float32, rounded to T once); kind 2, gpt-oss's clamped SwiGLU (p0 = alpha,
// p1 = limit: (clamp(up, +-limit) + 1) (g sigmoid(alpha g)), g = min(gate, limit), each op rounded to T as
// moe.FusedExperts' torch ops round it).
struct Act {
  int64_t kind;
  float p0, p1;
};

template <typename T>
inline T activate(float g, float u, const Act& act) {
  if (act.kind == 0) return static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * u);
  if (act.kind == 2) {
    const float gate = std::min(g, act.p1), up = std::min(std::max(u, -act.p1), act.p1);  // NaN stays NaN
    const float sig = rounded<T>(1.f / (1.f + std::exp(-rounded<T>(gate * act.p0))));
    return static_cast<T>(rounded<T>(up + 1.f) * rounded<T>(gate * sig));
  }
  const float s = act.p0 * std::tanh(g / act.p0) * (1.f / (1.f + std::exp(-g)));
  if (act.p1 != 0.f) u = act.p1 * std::tanh(u / act.p1);
  return static_cast<T>(s * u);
}

// y plus bias[i] where biases are given (rounded to T: the modules add a bias in the run dtype), in place.
template <typename T>
const at::Tensor& with_bias(const at::Tensor& y, at::TensorList bias, int64_t i) {
  if (bias.empty()) return y;
  TORCH_CHECK(bias[i].numel() == y.numel() && bias[i].scalar_type() == y.scalar_type() && bias[i].is_contiguous(),
              "a bias must be a contiguous vector of its product's width, in the run dtype");
  T* yp = y.data_ptr<T>();
  const T* bp = bias[i].data_ptr<T>();
  for (int64_t j = 0; j < y.numel(); ++j) yp[j] = static_cast<T>(static_cast<float>(yp[j]) + static_cast<float>(bp[j]));
  return y;
}

// out (O) += sum over experts i of w[slots[i]] * down(i, act(gate, up)), (gate, up) = gate_up(i), each in T (the run
// dtype), rounded as the torch ops it replaces round them: the weighted output in T, or in float32 where the router
// weights are float32 (`weights_float`), then in O, added in O (a latent MoE sums in float32). With `by_expert` (products
// whose bits do not depend on the threads running them) torch's threads take whole experts, each product then run on
// one thread, before the sums are added in the given order (the same bits): a Qwen3-MoE-shaped MXFP4 model (64 experts
// top-8, expert width 768, 6 layers; Xeon VM, 2 threads, bfloat16), processes alternated, 3 rounds x 4: 126-141 ->
// 137-152 tok/s. Only for experts_row_packed: experts_row's float32 torch.mv may sum differently on one thread.
template <typename T, typename O, class GateUp, class Down>
void add_experts_row(int64_t experts, const GateUp& gate_up, const Down& down, const float* w, bool weights_float,
                     at::IntArrayRef slots, const Act& act, at::Tensor& out, bool by_expert = false) {
  const auto output = [&](int64_t i) {  // expert i's output, in T
    const auto [gate, up] = gate_up(i);  // in the run dtype
    const int64_t I = gate.numel();
    const T* gp = gate.template data_ptr<T>();
    const T* up_p = up.template data_ptr<T>();
    at::Tensor a = at::empty({I}, gate.options());
    T* ap = a.data_ptr<T>();
    for (int64_t j = 0; j < I; ++j) ap[j] = activate<T>(static_cast<float>(gp[j]), static_cast<float>(up_p[j]), act);
    return down(i, a);
  };
  std::vector<at::Tensor> ys(experts);
  if (by_expert && experts > 1 && at::get_num_threads() > 1)
    at::parallel_for(0, experts, 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) ys[i] = output(i);
    });
  O* o = out.data_ptr<O>();
  const int64_t H = out.numel();
  for (int64_t i = 0; i < experts; ++i) {
    const at::Tensor y = ys[i].defined() ? ys[i] : output(i);
    const T* yp = y.data_ptr<T>();
    const float weight = w[slots[i]];
    for (int64_t c = 0; c < H; ++c) {
      const float product = static_cast<float>(yp[c]) * weight;
      o[c] = static_cast<O>(static_cast<float>(o[c]) + rounded<O>(weights_float ? product : rounded<T>(product)));
    }
  }
}

// The router weights as float32 and the slots checked; runs body(T{}, O{}, w) for x's dtype T and out's O (O = T,
// or float32 for bfloat16 x).
template <class Body>
void in_run_dtype(const at::Tensor& x, const at::Tensor& weights, at::IntArrayRef slots, const at::Tensor& out, const Body& body) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && out.dim() == 1 && out.is_contiguous() &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              "x and out must be contiguous vectors, out of x's dtype or float32");
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  for (const int64_t slot : slots) TORCH_CHECK(slot >= 0 && slot < w.numel(), "slot out of range");
  if (x.scalar_type() != at::kBFloat16)
    body(float{}, float{}, w.data_ptr<float>());
  else if (out.scalar_type() == at::kFloat)
    body(c10::BFloat16{}, float{}, w.data_ptr<float>());
  else
    body(c10::BFloat16{}, c10::BFloat16{}, w.data_ptr<float>());
}

void experts_row(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, const at::Tensor& weights,
                 at::IntArrayRef slots, at::Tensor& out, bool fixed_order) {
  TORCH_CHECK(gate_up.size() == down.size() && down.size() == slots.size(), "one gate_up, down and slot per expert");
  for (size_t i = 0; i < down.size(); ++i)
    TORCH_CHECK(gate_up[i].dim() == 2 && gate_up[i].size(1) == x.numel() && gate_up[i].size(0) % 2 == 0 &&
                    down[i].dim() == 2 && down[i].size(0) == out.numel() && down[i].size(1) * 2 == gate_up[i].size(0) &&
                    gate_up[i].is_contiguous() && down[i].is_contiguous() &&
                    gate_up[i].scalar_type() == x.scalar_type() && down[i].scalar_type() == x.scalar_type(),
                "expert weights must be contiguous gate|up [2I, H] and down [H, I] in x's dtype");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out must be in x's dtype");
  in_run_dtype(x, weights, slots, out, [&](auto t, auto o, const float* w) {
    add_experts_row<decltype(t), decltype(o)>(int64_t(down.size()), [&](int64_t i) {
      const at::Tensor h = row_product(gate_up[i], x, fixed_order);  // gate | up
      const int64_t I = h.numel() / 2;
      return std::make_pair(h.narrow(0, 0, I), h.narrow(0, I, I));
    }, [&](int64_t i, const at::Tensor& a) { return row_product(down[i], a, fixed_order); }, w, false, slots, Act{0, 0.f, 0.f},
        out);
  });
}

// x [K] in the run dtype times a packed weight (q, its scales s; `bits`) -> [N] in x's dtype, as IntWeight and
// mxfp4_matmul run one row; flags = [widen x to float32 first, the kernel's pairs, q8, grids].
at::Tensor packed_product(const at::Tensor& q, const at::Tensor& s, int64_t bits, const at::Tensor& x, at::IntArrayRef flags) {
  const int64_t K = x.numel();
  TORCH_CHECK(q.dim() == 2 && s.dim() == 2 && q.size(1) * 8 == K * bits && s.size(0) == q.size(0) && K % s.size(1) == 0,
              "packed expert weights must be q [N, K * bits / 8] and scales [N, K / group] for x of K");
  return shardwise::int_row_product(x.view({1, K}), q, s, bits, K / s.size(1), flags, x.scalar_type()).view({q.size(0)});
}

// experts_row for packed int8 / int4 / MXFP4 experts: gate, up and down as (q, scales) each — or, with no up, gate
// holding the gate|up rows: interleaved for act kind 2 (gpt-oss), else as two halves (an expert whose gate and up
// IntWeights load stacked: one product for both; a Qwen3-MoE-shaped int4 model, 64 experts top-8, 6 layers, 2 threads,
// processes alternated 6 x 4: 144-197 (median ~177) -> 166-205 (~189) tok/s) —, every product through
// shardwise_int::int_matmul with the flags runtime.int_matmul.kernel_rows gives (in_flags: gate and up; down_flags),
// then its bias where given.
void experts_row_packed(const at::Tensor& x, at::TensorList gate_q, at::TensorList gate_s, at::TensorList up_q,
                        at::TensorList up_s, at::TensorList down_q, at::TensorList down_s, int64_t bits,
                        const at::Tensor& weights, at::IntArrayRef slots, at::Tensor& out, at::IntArrayRef in_flags,
                        at::IntArrayRef down_flags, int64_t act, double p0, double p1, at::TensorList gate_bias,
                        at::TensorList down_bias) {
  const size_t n = slots.size();
  const bool joined = up_q.empty();  // gate holds gate|up
  TORCH_CHECK(gate_q.size() == n && gate_s.size() == n && up_q.size() == up_s.size() && (joined || up_q.size() == n) &&
              (joined || act != 2) && down_q.size() == n && down_s.size() == n &&
              (gate_bias.empty() || gate_bias.size() == n) && (down_bias.empty() || down_bias.size() == n),
              "one gate, up (none where gate holds gate|up; always none for act 2) and down (q and scales, biases if any) "
              "and slot per expert");
  TORCH_CHECK(in_flags.size() == 4 && down_flags.size() == 4, "flags are [widen, pairs, q8, grids]");
  TORCH_CHECK(act == 0 || (act == 1 && p0 != 0.) || act == 2, "act is 0 (SiLU), 1 (SiTU, beta != 0) or 2 (gpt-oss)");
  in_run_dtype(x, weights, slots, out, [&](auto t, auto o, const float* w) {
    using T = decltype(t);
    add_experts_row<T, decltype(o)>(int64_t(n), [&](int64_t i) {
      const at::Tensor g = with_bias<T>(packed_product(gate_q[i], gate_s[i], bits, x, in_flags), gate_bias, i);
      if (!joined) return std::make_pair(g, packed_product(up_q[i], up_s[i], bits, x, in_flags));
      const int64_t I2 = g.numel();
      if (act != 2) return std::make_pair(g.slice(0, 0, I2 / 2), g.slice(0, I2 / 2, I2));  // gate rows, then up rows
      return std::make_pair(g.slice(0, 0, I2, 2).contiguous(), g.slice(0, 1, I2, 2).contiguous());  // gate_j, up_j interleaved
    }, [&](int64_t i, const at::Tensor& a) {
      return with_bias<T>(packed_product(down_q[i], down_s[i], bits, a, down_flags), down_bias, i);
    }, w, weights.scalar_type() == at::kFloat, slots, Act{act, float(p0), float(p1)}, out, true);
  });
}

}  // namespace

TORCH_LIBRARY(shardwise_gemv, m) {
  m.def("experts_row(Tensor x, Tensor[] gate_up, Tensor[] down, Tensor weights, int[] slots, Tensor(a!) out, bool fixed_order) -> ()",
        &experts_row);
  m.def("experts_row_packed(Tensor x, Tensor[] gate_q, Tensor[] gate_s, Tensor[] up_q, Tensor[] up_s, Tensor[] down_q, "
        "Tensor[] down_s, int bits, Tensor weights, int[] slots, Tensor(a!) out, int[] in_flags, int[] down_flags, int act, "
        "float p0, float p1, Tensor[] gate_bias, Tensor[] down_bias) -> ()",
        &experts_row_packed);
}
