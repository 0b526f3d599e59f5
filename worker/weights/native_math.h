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

// Vectors of 8 and 16 floats (or int32s), read and written at any float's alignment; the kernels' loops over them
// compile for the instruction set of the function they are inlined into.
using Lanes8 = float __attribute__((vector_size(8 * sizeof(float)), aligned(sizeof(float))));
using Ints8 = int32_t __attribute__((vector_size(8 * sizeof(int32_t)), aligned(sizeof(int32_t))));
using Lanes16 = float __attribute__((vector_size(16 * sizeof(float)), aligned(sizeof(float))));
using Ints16 = int32_t __attribute__((vector_size(16 * sizeof(int32_t)), aligned(sizeof(int32_t))));

// exp_poly lane by lane, by the same operations (floor as truncation, less one where that rounded up).
template <typename V, typename I>
[[gnu::always_inline]] inline V exp_lanes(V x) {
  const V high = V{} + 88.0f, low = V{} - 87.0f;
  x = x < high ? x : high;
  x = x > low ? x : low;
  const V y = x * 1.44269504088896341f + 0.5f;
  const V whole = __builtin_convertvector(__builtin_convertvector(y, I), V);
  const I above = whole > y;  // -1 where truncation went up (negative y)
  const V n = whole + __builtin_convertvector(above, V);
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  return exp_reduced(x, n) * reinterpret_cast<const V&>(bits);
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
