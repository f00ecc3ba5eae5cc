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
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

namespace {

using RowsOp = c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&)>;

// shardwise_rows' product for `dtype` (linear_f32 or linear_bf16_dp), looked up once.
const RowsOp& rows_op(at::ScalarType dtype) {
  const auto find = [](const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
  };
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

template <typename T>
void add_experts_row(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, const float* w,
                     at::IntArrayRef slots, at::Tensor& out, bool fixed_order) {
  T* o = out.data_ptr<T>();
  const int64_t H = out.numel();
  for (size_t i = 0; i < gate_up.size(); ++i) {
    const at::Tensor h = row_product(gate_up[i], x, fixed_order);  // gate | up, in the run dtype
    const int64_t I = h.numel() / 2;
    const T* hp = h.data_ptr<T>();
    at::Tensor a = at::empty({I}, x.options());
    T* ap = a.data_ptr<T>();
    for (int64_t j = 0; j < I; ++j) {
      const float g = static_cast<float>(hp[j]);
      ap[j] = static_cast<T>(rounded<T>(g / (1.f + std::exp(-g))) * static_cast<float>(hp[I + j]));
    }
    const at::Tensor y = row_product(down[i], a, fixed_order);
    const T* yp = y.data_ptr<T>();
    const float weight = w[slots[i]];
    for (int64_t c = 0; c < H; ++c)
      o[c] = static_cast<T>(static_cast<float>(o[c]) + rounded<T>(static_cast<float>(yp[c]) * weight));
  }
}

void experts_row(const at::Tensor& x, at::TensorList gate_up, at::TensorList down, const at::Tensor& weights,
                 at::IntArrayRef slots, at::Tensor& out, bool fixed_order) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous() && out.dim() == 1 && out.is_contiguous() &&
                  out.scalar_type() == x.scalar_type(), "x and out must be contiguous vectors of one dtype");
  TORCH_CHECK(gate_up.size() == down.size() && down.size() == slots.size(), "one gate_up, down and slot per expert");
  for (size_t i = 0; i < down.size(); ++i)
    TORCH_CHECK(gate_up[i].dim() == 2 && gate_up[i].size(1) == x.numel() && gate_up[i].size(0) % 2 == 0 &&
                    down[i].dim() == 2 && down[i].size(0) == out.numel() && down[i].size(1) * 2 == gate_up[i].size(0) &&
                    gate_up[i].is_contiguous() && down[i].is_contiguous() &&
                    gate_up[i].scalar_type() == x.scalar_type() && down[i].scalar_type() == x.scalar_type(),
                "expert weights must be contiguous gate|up [2I, H] and down [H, I] in x's dtype");
  const at::Tensor w = weights.to(at::kFloat).contiguous();
  for (const int64_t slot : slots) TORCH_CHECK(slot >= 0 && slot < w.numel(), "slot out of range");
  if (x.scalar_type() == at::kBFloat16)
    add_experts_row<c10::BFloat16>(x, gate_up, down, w.data_ptr<float>(), slots, out, fixed_order);
  else
    add_experts_row<float>(x, gate_up, down, w.data_ptr<float>(), slots, out, fixed_order);
}

}  // namespace

TORCH_LIBRARY(shardwise_gemv, m) {
  m.def("experts_row(Tensor x, Tensor[] gate_up, Tensor[] down, Tensor weights, int[] slots, Tensor(a!) out, bool fixed_order) -> ()",
        &experts_row);
}
