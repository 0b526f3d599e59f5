// Arithmetic shared by worker/weights/native.cpp and worker/weights/blocks.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

namespace llmserve {

// exp(x) for x in float range: 2^n times a polynomial on [-ln2/2, ln2/2] (Cephes' coefficients), a
// couple of ulps from the exact value; plain arithmetic, so that loops over it vectorise. The polynomial of
// x - n ln2 (ln2 in two parts), for a float or a vector of them (T{} + c: c in every lane).
template <typename T>
inline T exp_reduced(T x, T n) {
  T r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  T p = T{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

inline float exp_poly(float x) {
  x = std::min(88.0f, std::max(-87.0f, x));
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_reduced(x, n) * scale;
}

// x [rows, 2 * width]: silu(first half) * second half, into out [rows, width], then with `block` > 0 each run of
// `block` channels Hadamard-rotated; rows shared among the threads (worker/weights/native.cpp).
void silu_mul_rows(const float* x, float* out, int64_t rows, int64_t width, int64_t block);

// native.cpp's rotary heads and its cache write with attention, for blocks.cpp's whole layer in one call.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rotary_heads(const at::Tensor& qkv, int64_t rows, int64_t length,
                                                            int64_t dim, int64_t q_heads, int64_t kv_heads,
                                                            const at::Tensor& cos, const at::Tensor& signed_sin);
at::Tensor write_and_attend_rows(const at::Tensor& query, at::TensorList key_buffers, at::TensorList value_buffers,
                                 at::IntArrayRef lengths, const at::Tensor& keys, const at::Tensor& values,
                                 double scaling);

}  // namespace llmserve
