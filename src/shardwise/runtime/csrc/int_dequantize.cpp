// Rows of a packed int8 / int4 weight as float32 or bfloat16: w[r, k] = q[r, k] * scale[r, k / group] for rows
// row0 .. row0 + rows (layouts as in int_matmul.cpp: int8 [N, K]; uint8 [N, K/2], element 2j in the low nibble
// of byte j, stored with offset 8; scale [N, K/group] float32 or bfloat16). Each value is the product of q and
// its scale in float32 (exact for bfloat16 scales), rounded once for a bfloat16 output (to nearest even). For
// passes of many rows (a prefill), where runtime.int_matmul multiplies blocks of dequantized rows by GEMMs
// instead of turning every weight into float once per row of x.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

namespace {

template <class S, class T>
void dequantize_rows(const at::Tensor& q, const S* s, int64_t bits, int64_t group, int64_t row0, T* out,
                     int64_t rows, int64_t K) {
  const int64_t G = K / group;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const S* sr = s + (row0 + r) * G;
      T* o = out + r * K;
      if (bits == 8) {
        const int8_t* qr = q.data_ptr<int8_t>() + (row0 + r) * K;
        for (int64_t g = 0; g < G; ++g) {
          const float sc = float(sr[g]);
          for (int64_t k = g * group; k < (g + 1) * group; ++k) o[k] = T(float(qr[k]) * sc);
        }
      } else {
        const uint8_t* qr = q.data_ptr<uint8_t>() + (row0 + r) * (K / 2);
        for (int64_t g = 0; g < G; ++g) {
          const float sc = float(sr[g]);
          for (int64_t j = g * group / 2; j < (g + 1) * group / 2; ++j) {
            o[2 * j] = T(float(int(qr[j] & 15) - 8) * sc);
            o[2 * j + 1] = T(float(int(qr[j] >> 4) - 8) * sc);
          }
        }
      }
    }
  });
}

template <class T>
void dequantize_as(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group, int64_t row0, at::Tensor& out) {
  if (scale.scalar_type() == at::kBFloat16) {
    dequantize_rows(q, scale.data_ptr<at::BFloat16>(), bits, group, row0, out.data_ptr<T>(), out.size(0), out.size(1));
  } else {
    TORCH_CHECK(scale.scalar_type() == at::kFloat, "scale must be float32 or bfloat16");
    dequantize_rows(q, scale.data_ptr<float>(), bits, group, row0, out.data_ptr<T>(), out.size(0), out.size(1));
  }
}

at::Tensor int_dequantize(const at::Tensor& q, const at::Tensor& scale, int64_t bits, int64_t group, int64_t row0,
                          int64_t rows, at::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && scale.dim() == 2 && scale.is_contiguous(), "q and scale must be contiguous 2-D");
  TORCH_CHECK((bits == 8 && q.scalar_type() == at::kChar) || (bits == 4 && q.scalar_type() == at::kByte),
              "q must be int8 (8 bits) or uint8 (4 bits)");
  const int64_t K = bits == 8 ? q.size(1) : 2 * q.size(1);
  TORCH_CHECK(group > 0 && K % group == 0 && (bits == 8 || group % 2 == 0) && scale.size(0) == q.size(0) && scale.size(1) == K / group,
              "scale must be [N, K / group] with group dividing K");
  TORCH_CHECK(row0 >= 0 && rows >= 0 && row0 + rows <= q.size(0), "rows out of range");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  at::Tensor out = at::empty({rows, K}, q.options().dtype(dtype));
  dtype == at::kFloat ? dequantize_as<float>(q, scale, bits, group, row0, out)
                      : dequantize_as<at::BFloat16>(q, scale, bits, group, row0, out);
  return out;
}

}  // namespace

TORCH_LIBRARY(shardwise_intdq, m) {
  m.def("int_dequantize(Tensor q, Tensor scale, int bits, int group, int row0, int rows, ScalarType dtype) -> Tensor", &int_dequantize);
}
