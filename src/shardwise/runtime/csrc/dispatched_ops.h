// The runtime's compiled ops calling each other from C++ through the dispatcher (decode_attention.cpp,
// decode_gemv.cpp, layer_step.cpp): each callee's library is loaded first by the Python that loads the caller.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>

namespace shardwise {

// The op `name` ("namespace::op") with `Signature`; callers keep it in a function-local static (looked up once).
template <class Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// One row [1, K] times a packed weight (q, scale; bits, group) through shardwise_int::int_matmul (int_matmul.cpp) as
// runtime.int_matmul's IntWeight runs it: flags = [widen the row to float32 first, pairs, q8, grids]; out in `dtype`.
inline at::Tensor int_row_product(const at::Tensor& row, const at::Tensor& q, const at::Tensor& scale, int64_t bits,
                                  int64_t group, at::IntArrayRef flags, at::ScalarType dtype) {
  static const auto op = find_op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                                            std::optional<at::ScalarType>, bool, bool, bool)>("shardwise_int::int_matmul");
  TORCH_CHECK(flags.size() == 4, "int product flags are [widen, pairs, q8, grids]");
  return op.call(flags[0] ? row.to(at::kFloat) : row, q, scale, bits, group, dtype, flags[1] != 0, flags[2] != 0, flags[3] != 0);
}

}  // namespace shardwise
