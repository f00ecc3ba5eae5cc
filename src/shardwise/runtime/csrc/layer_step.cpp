// A decoder layer's two halves for one token of one sequence in one call each, where their products are packed int
// weights (runtime.token_step binds them; runtime.int_matmul's kernel does the products):
//   int_attention: h + o(step(qkv(rms_norm(h))))  — step: shardwise_attn::step (rotary, cache write, attention)
//   int_mlp:       h + down(silu_mul(gate_up(rms_norm(h))))
// h [1, H] float32 or bfloat16 (the residual stream); each product `p` is (q, scale, [bits, group, widen, pairs, q8,
// grids]) as IntWeight.kernel_args decided it (widen: the row goes in as float32), out in h's dtype; the residual
// add rounds h + y once to h's dtype (torch's `h + y`). The same ops in the same order as the bound Python calls
// (each op looked up in the dispatcher: their libraries are loaded first), so the same bits; one call where a layer
// made ~12 Python-level calls, each paying the interpreter and dispatcher with caches cold after a weight stream.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#include "dispatched_ops.h"

namespace {

using shardwise::find_op;

at::Tensor norm(const at::Tensor& h, const at::Tensor& weight, double eps, bool after, bool offset) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, double, bool, bool)>("shardwise_norm::rms_norm");
  return op.call(h, weight, eps, after, offset);
}

// x [1, in] times one packed weight, args = [bits, group, widen, pairs, q8, grids], out in `dtype`.
at::Tensor product(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, at::IntArrayRef args, at::ScalarType dtype) {
  TORCH_CHECK(args.size() == 6, "a product's args are [bits, group, widen, pairs, q8, grids]");
  return shardwise::int_row_product(x, q, scale, args[0], args[1], args.slice(2), dtype);
}

// h + y, each sum rounded once to h's dtype.
at::Tensor add(const at::Tensor& h, const at::Tensor& y) {
  TORCH_CHECK(h.sizes() == y.sizes() && h.scalar_type() == y.scalar_type() && h.is_contiguous() && y.is_contiguous(),
              "h and the branch output must be contiguous, of one shape and dtype");
  at::Tensor out = at::empty(h.sizes(), h.options());
  const int64_t n = h.numel();
  if (h.scalar_type() == at::kFloat) {
    const float *a = h.data_ptr<float>(), *b = y.data_ptr<float>();
    float* o = out.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
  } else {
    const c10::BFloat16 *a = h.data_ptr<c10::BFloat16>(), *b = y.data_ptr<c10::BFloat16>();
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    for (int64_t i = 0; i < n; ++i) o[i] = c10::BFloat16(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  }
  return out;
}

void check_row(const at::Tensor& h) {
  TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.is_contiguous() && h.device().is_cpu() &&
              (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16),
              "h must be one contiguous float32 or bfloat16 row [1, H] on the CPU");
}

at::Tensor int_attention(const at::Tensor& h, const at::Tensor& norm_w, double eps, bool after, bool offset,
                         const at::Tensor& qkv_q, const at::Tensor& qkv_s, at::IntArrayRef qkv, const at::Tensor& o_q,
                         const at::Tensor& o_s, at::IntArrayRef o, const at::Tensor& cos, const at::Tensor& sin,
                         at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& position, int64_t heads, double scale,
                         const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double qk_eps) {
  check_row(h);
  static const auto step = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                              const at::Tensor&, int64_t, double, const std::optional<at::Tensor>&,
                                              const std::optional<at::Tensor>&, double)>("shardwise_attn::step");
  const at::Tensor mixed = product(norm(h, norm_w, eps, after, offset), qkv_q, qkv_s, qkv, h.scalar_type());
  const at::Tensor y = step.call(mixed.view({1, 1, -1}), cos, sin, k_cache, v_cache, position, heads, scale, q_norm, k_norm, qk_eps);
  return add(h, product(y.view({1, -1}), o_q, o_s, o, h.scalar_type()));
}

at::Tensor int_mlp(const at::Tensor& h, const at::Tensor& norm_w, double eps, bool after, bool offset, const at::Tensor& gu_q,
                   const at::Tensor& gu_s, at::IntArrayRef gu, const at::Tensor& d_q, const at::Tensor& d_s, at::IntArrayRef d) {
  check_row(h);
  static const auto swiglu = find_op<at::Tensor(const at::Tensor&)>("shardwise_act::silu_mul");
  const at::Tensor gate_up = product(norm(h, norm_w, eps, after, offset), gu_q, gu_s, gu, h.scalar_type());
  return add(h, product(swiglu.call(gate_up), d_q, d_s, d, h.scalar_type()));
}

}  // namespace

TORCH_LIBRARY(shardwise_layer, m) {
  m.def("int_attention(Tensor h, Tensor norm_w, float eps, bool after, bool offset, Tensor qkv_q, Tensor qkv_s, int[] qkv, "
        "Tensor o_q, Tensor o_s, int[] o, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor position, "
        "int heads, float scale, Tensor? q_norm, Tensor? k_norm, float qk_eps) -> Tensor", &int_attention);
  m.def("int_mlp(Tensor h, Tensor norm_w, float eps, bool after, bool offset, Tensor gu_q, Tensor gu_s, int[] gu, "
        "Tensor d_q, Tensor d_s, int[] d) -> Tensor", &int_mlp);
}
