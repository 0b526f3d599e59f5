// The int8 Llama layer's glue in compiled loops (worker/weights/native.py builds this file, worker/weights/quant.py calls it).
//
// Around fbgemm's four int8 products, a layer of the TorchScript path (worker/weights/scripted.py) makes a few dozen
// small ATen calls, each with its dispatch, allocation and checks, and one flash-attention call per row of
// the batch. Here the layer makes three calls, with the products inside:
//
// - int8_linear: the row scale (with RMSNorm's factor when the norm is folded into the product), the
//   division by it, fbgemm's product and the rescale: without a norm, worker/weights/scripted.py's bits (tested).
// - write_and_attend / decode_attention: each row's queries over that row's own keys (a ragged cache's), each
//   row computed alone, so that its result does not depend on its batch; a long row's keys split among the
//   threads in runs of a fixed size.
// - mlp_residual: o_proj and its residual, the MLP with down_proj's input rotated by a fast Walsh-Hadamard
//   transform (the block-diagonal Sylvester matrix of worker/weights/rotation.py, without the matrix product).
//
// Compiled with -ffp-contract=off: a fused multiply-add would round differently from ATen's separate ones (the
// block attention, which matches no ATen result, opts back in where the CPU has FMA).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <tuple>
#include <vector>

#include "native_math.h"

namespace {

using llmserve::exp_lanes;
using llmserve::exp_poly;
using llmserve::exp_reduced;
using llmserve::Ints16;
using llmserve::Ints8;
using llmserve::Lanes16;
using llmserve::Lanes8;

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

constexpr double kActScale = 1.0 / 127;  // worker/weights/scripted.py's ACT_MAX and ACT_ZERO_POINT
constexpr int64_t kActZeroPoint = 128;
constexpr float kFloor = 1e-12f;  // worker/weights/scripted.py's EPS

// Each row of x [rows, k] divided by its largest magnitude (floored), into `scaled`; the row maxima into
// `rowmax`, and with `norm_eps` >= 0 each times RMSNorm's factor 1 / sqrt(mean(x^2) + eps) (the norm only
// scales the row, which its own quantisation scale undoes: worker/weights/scripted.py).
__attribute__((target_clones("avx2", "default")))
void scale_rows(const float* x, float* scaled, float* rowmax, int64_t rows, int64_t k, float norm_eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * k;
    float m = 0.0f, squares = 0.0f;
#pragma omp simd reduction(max : m) reduction(+ : squares)
    for (int64_t i = 0; i < k; ++i) {
      m = std::max(m, std::fabs(in[i]));
      squares += in[i] * in[i];
    }
    m = std::max(m, kFloor);
    float* out = scaled + r * k;
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) out[i] = in[i] / m;
    rowmax[r] = norm_eps < 0 ? m : m * (1.0f / std::sqrt(squares / static_cast<float>(k) + norm_eps));
  }
}

// Python names a linear's packed weights by their number in this list, not by passing the ScriptObject: this
// torch converts a ScriptObject argument with an attribute lookup that throws and catches, about 12 us a call,
// and a decode step makes 121 such calls (bench/native.py --calls). A deque keeps each entry in place while
// others are added.
std::mutex weights_mutex;
std::deque<Packed> weights;

int64_t keep_weight(const Packed& packed) {
  std::lock_guard<std::mutex> lock(weights_mutex);
  weights.push_back(packed);
  return static_cast<int64_t>(weights.size()) - 1;
}

void drop_weight(int64_t id) {
  std::lock_guard<std::mutex> lock(weights_mutex);
  if (id >= 0 && id < static_cast<int64_t>(weights.size())) weights[id].reset();
}

Packed weight_at(int64_t id) {
  std::lock_guard<std::mutex> lock(weights_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(weights.size()) && weights[id],
              "llmserve: no int8 weight number ", id, " (keep_weight gives them)");
  return weights[id];
}

// Without `norm_eps`, the very float operations of worker/weights/scripted.py's int8_linear: its bits (tested). With
// it, the mean of squares is this loop's sum, whose order differs from ATen's in the last bits.
at::Tensor int8_linear(const at::Tensor& input, int64_t weight, const std::optional<at::Tensor>& bias,
                       std::optional<double> norm_eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat, "llmserve::int8_linear takes float32");
  at::Tensor x = input.contiguous();
  const int64_t k = x.size(-1), rows = x.numel() / k;
  at::Tensor scaled = at::empty_like(x);
  std::vector<float> factor(rows);
  scale_rows(x.data_ptr<float>(), scaled.data_ptr<float>(), factor.data(), rows, k,
             norm_eps ? static_cast<float>(*norm_eps) : -1.0f);
  at::Tensor out = weight_at(weight)->apply_with_input_q_dq_qweight_dq_output_fp32(scaled, kActScale, kActZeroPoint);
  const int64_t n = out.size(-1);
  float* o = out.data_ptr<float>();
  const at::Tensor bias_values = bias ? bias->contiguous() : at::Tensor();
  const float* b = bias ? bias_values.data_ptr<float>() : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = o + r * n;
    const float f = factor[r];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = row[i] * f;
    if (b) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) row[i] = row[i] + b[i];
    }
  }
  return out;
}

// Attention is computed in units of one row's key-value head over a run of at most kSplit of its keys; a unit
// leaves, for each of its queries, the largest score m, the sum l of exp(score - m) and the sum acc of
// exp(score - m) * value, and `attend` then combines a row's units in key order. A unit's work depends only on its
// own row, so neither the batch nor the threads change a bit, and a long row's keys are shared among the
// threads (a single stream's decode step, a prompt deep in a long context).
constexpr int64_t kSplit = 256;
// One new token per row (a decode step): the query heads sharing one key-value head (`group` of them) over
// keys begin..end. Each key and value is read once for the whole group. DIM > 0: the head size known at
// compile time (the dot products unroll into whole vectors); 0: read from `runtime_dim`. `scores`: room for
// group * (end - begin) floats; acc: [group, dim].
template <int64_t DIM>
__attribute__((target_clones("avx2", "default")))
void attend_one(const float* q, int64_t q_head_stride, int64_t group, const float* keys, const float* values,
                int64_t begin, int64_t end, int64_t runtime_dim, float scale, float* scores, float* m, float* l,
                float* acc) {
  const int64_t dim = DIM > 0 ? DIM : runtime_dim, n = end - begin;
  for (int64_t j = 0; j < n; ++j) {
    const float* key = keys + (begin + j) * dim;
    for (int64_t g = 0; g < group; ++g) {
      const float* query = q + g * q_head_stride;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += query[d] * key[d];
      scores[g * n + j] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * n;
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int64_t j = 0; j < n; ++j) top = std::max(top, row[j]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      row[j] = exp_poly(row[j] - top);
      total += row[j];
    }
    m[g] = top;
    l[g] = total;
    std::fill(acc + g * dim, acc + (g + 1) * dim, 0.0f);
  }
  for (int64_t j = 0; j < n; ++j) {
    const float* value = values + (begin + j) * dim;
    for (int64_t g = 0; g < group; ++g) {
      float* result = acc + g * dim;
      const float p = scores[g * n + j];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) result[d] += p * value[d];
    }
  }
}

// Several queries per row (a prefill block), side by side in lanes: qt [dim, lanes] holds query L in column L
// (lanes a multiple of kLaneRound; the padding columns are computed and ignored). Query L sees keys up to
// limits[L]. Scores [keys, lanes] and acc [dim, lanes]: each key's products with every query are whole-vector
// multiplies by one number of the key, with no sum across a vector, so each lane's arithmetic is its own and
// the vector width (AVX2's 8 floats, AVX-512's 16) changes no bit, only how many lanes one instruction takes.
constexpr int64_t kLaneRound = 16;  // lanes of a block: whole vectors of either width

// One unit's work for the block kernel: its queries, keys begin..end, and where its results go.
struct BlockWork {
  const float* qt;
  int64_t lanes;
  const float* keys;
  const float* values;
  int64_t begin, end, dim;
  const int32_t* limits;
  float scale;
  float* scores;
  float *m, *l, *acc;
};

// The templates below are inlined into each kernel, so that they compile for its instruction set.

// One pass of NV vectors of queries (lanes v.. of qt) over keys 0..n: their scores, kTile keys at a time.
template <typename V, int NV>
[[gnu::always_inline]] inline void score_pass(const float* qt, int64_t lanes, int64_t v, const float* keys,
                                              int64_t n, int64_t dim, float* scores) {
  constexpr int64_t kTile = 4, W = sizeof(V) / sizeof(float);
  int64_t j0 = 0;
  for (; j0 + kTile <= n; j0 += kTile) {
    V sum[kTile][NV] = {};
    const float* key = keys + j0 * dim;
    for (int64_t d = 0; d < dim; ++d) {
      V q[NV];
      for (int c = 0; c < NV; ++c) q[c] = *reinterpret_cast<const V*>(qt + d * lanes + v + c * W);
#pragma GCC unroll 4
      for (int64_t k = 0; k < kTile; ++k) {
        const float x = key[k * dim + d];
        for (int c = 0; c < NV; ++c) sum[k][c] += q[c] * x;
      }
    }
    for (int64_t k = 0; k < kTile; ++k) {
      for (int c = 0; c < NV; ++c) *reinterpret_cast<V*>(scores + (j0 + k) * lanes + v + c * W) = sum[k][c];
    }
  }
  for (; j0 < n; ++j0) {
    V sum[NV] = {};
    const float* key = keys + j0 * dim;
    for (int64_t d = 0; d < dim; ++d) {
      for (int c = 0; c < NV; ++c) sum[c] += *reinterpret_cast<const V*>(qt + d * lanes + v + c * W) * key[d];
    }
    for (int c = 0; c < NV; ++c) *reinterpret_cast<V*>(scores + j0 * lanes + v + c * W) = sum[c];
  }
}

// The same pass's weighted sum of values, kTile head channels at a time, into acc [dim, lanes].
template <typename V, int NV>
[[gnu::always_inline]] inline void value_pass(const float* scores, int64_t lanes, int64_t v, const float* values,
                                              int64_t n, int64_t dim, float* acc) {
  constexpr int64_t kTile = 4, W = sizeof(V) / sizeof(float);
  for (int64_t d0 = 0; d0 < dim; d0 += kTile) {
    V sum[kTile][NV] = {};
    for (int64_t j = 0; j < n; ++j) {
      V p[NV];
      for (int c = 0; c < NV; ++c) p[c] = *reinterpret_cast<const V*>(scores + j * lanes + v + c * W);
      const float* value = values + j * dim + d0;
#pragma GCC unroll 4
      for (int64_t k = 0; k < kTile; ++k) {
        for (int c = 0; c < NV; ++c) sum[k][c] += p[c] * value[k];
      }
    }
    for (int64_t k = 0; k < kTile; ++k) {
      for (int c = 0; c < NV; ++c) *reinterpret_cast<V*>(acc + (d0 + k) * lanes + v + c * W) = sum[k][c];
    }
  }
}

template <typename V, typename I>
[[gnu::always_inline]] inline void attend_lanes(const BlockWork& work) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  const int64_t lanes = work.lanes, begin = work.begin, n = work.end - begin, dim = work.dim;
  const float *keys = work.keys + begin * dim, *values = work.values + begin * dim;
  float* __restrict scores = work.scores;
  int64_t v = 0;
  for (; v + 2 * W <= lanes; v += 2 * W) score_pass<V, 2>(work.qt, lanes, v, keys, n, dim, scores);
  if (v < lanes) score_pass<V, 1>(work.qt, lanes, v, keys, n, dim, scores);
  const V none = V{} - INFINITY;
  for (v = 0; v < lanes; v += W) {  // scale, mask, then exp(score - the largest), by lanes
    const I limit = *reinterpret_cast<const I*>(work.limits + v);
    V top = none;
    for (int64_t j = 0; j < n; ++j) {
      V& row = *reinterpret_cast<V*>(scores + j * lanes + v);
      const I key = I{} + static_cast<int32_t>(begin + j);
      row = key <= limit ? row * work.scale : none;
      top = top < row ? row : top;
    }
    V total = {};
    for (int64_t j = 0; j < n; ++j) {
      V& row = *reinterpret_cast<V*>(scores + j * lanes + v);
      row = row == none ? V{} : exp_lanes<V, I>(row - top);
      total += row;
    }
    *reinterpret_cast<V*>(work.m + v) = top;
    *reinterpret_cast<V*>(work.l + v) = total;
  }
  for (v = 0; v + 2 * W <= lanes; v += 2 * W) value_pass<V, 2>(scores, lanes, v, values, n, dim, work.acc);
  if (v < lanes) value_pass<V, 1>(scores, lanes, v, values, n, dim, work.acc);
}

using BlockKernel = void (*)(const BlockWork&);

// The decode kernel in vectors of the head's channels, for a head size known at compile time: four keys' scores
// at a time (independent sums, each reduced across its lanes by halves), then each query's weighted sum of values
// held in registers over all the unit's keys. Its own rounding (fused multiply-adds), like the block kernel's; a
// unit's arithmetic depends only on its row and the vector width.
template <typename V>
[[gnu::always_inline]] inline float lane_sum(V v) {
  constexpr int W = sizeof(V) / sizeof(float);
  float lanes[W];
  std::memcpy(lanes, &v, sizeof v);
  for (int width = W / 2; width > 0; width /= 2) {
    for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
  }
  return lanes[0];
}

template <typename V, int64_t DIM>
[[gnu::always_inline]] inline void attend_one_lanes(const float* q, int64_t q_head_stride, int64_t group,
                                                    const float* keys, const float* values, int64_t begin,
                                                    int64_t end, float scale, float* scores, float* m, float* l,
                                                    float* acc) {
  constexpr int64_t W = sizeof(V) / sizeof(float), C = DIM / W, kKeys = 4;
  static_assert(DIM % W == 0, "a head of whole vectors");
  const int64_t n = end - begin;
  keys += begin * DIM;
  values += begin * DIM;
  for (int64_t g = 0; g < group; ++g) {
    V query[C];
    for (int64_t c = 0; c < C; ++c) query[c] = *reinterpret_cast<const V*>(q + g * q_head_stride + c * W);
    float* row = scores + g * n;
    int64_t j = 0;
    for (; j + kKeys <= n; j += kKeys) {
      V sum[kKeys] = {};
      for (int64_t c = 0; c < C; ++c) {
        for (int64_t k = 0; k < kKeys; ++k) {
          sum[k] += query[c] * *reinterpret_cast<const V*>(keys + (j + k) * DIM + c * W);
        }
      }
      for (int64_t k = 0; k < kKeys; ++k) row[j + k] = lane_sum(sum[k]) * scale;
    }
    for (; j < n; ++j) {
      V sum = {};
      for (int64_t c = 0; c < C; ++c) sum += query[c] * *reinterpret_cast<const V*>(keys + j * DIM + c * W);
      row[j] = lane_sum(sum) * scale;
    }
    float top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (j = 0; j < n; ++j) top = std::max(top, row[j]);
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (j = 0; j < n; ++j) {
      row[j] = exp_poly(row[j] - top);
      total += row[j];
    }
    m[g] = top;
    l[g] = total;
    V sums[C] = {};
    for (j = 0; j < n; ++j) {
      const V p = V{} + row[j];
      for (int64_t c = 0; c < C; ++c) sums[c] += p * *reinterpret_cast<const V*>(values + j * DIM + c * W);
    }
    for (int64_t c = 0; c < C; ++c) *reinterpret_cast<V*>(acc + g * DIM + c * W) = sums[c];
  }
}

// Three builds of the block kernel. With AVX2 or AVX-512 each product and its sum are one fused multiply-add
// (the kernel's own rounding: no ATen result to match here), so the two widths give the same bits; the plain
// build has no FMA instruction to use.
void attend_block_plain(const BlockWork& work) { attend_lanes<Lanes8, Ints8>(work); }

__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void attend_block_avx2(const BlockWork& work) { attend_lanes<Lanes8, Ints8>(work); }

__attribute__((target("avx512f,fma"), optimize("fp-contract=fast")))
void attend_block_avx512(const BlockWork& work) { attend_lanes<Lanes16, Ints16>(work); }

using OneKernel = void (*)(const float*, int64_t, int64_t, const float*, const float*, int64_t, int64_t, int64_t,
                           float, float*, float*, float*, float*);

template <int64_t DIM>
__attribute__((target("avx2,fma"), optimize("fp-contract=fast")))
void attend_one_avx2(const float* q, int64_t stride, int64_t group, const float* keys, const float* values,
                     int64_t begin, int64_t end, int64_t, float scale, float* scores, float* m, float* l, float* acc) {
  attend_one_lanes<Lanes8, DIM>(q, stride, group, keys, values, begin, end, scale, scores, m, l, acc);
}

template <int64_t DIM>
__attribute__((target("avx512f,fma"), optimize("fp-contract=fast")))
void attend_one_avx512(const float* q, int64_t stride, int64_t group, const float* keys, const float* values,
                       int64_t begin, int64_t end, int64_t, float scale, float* scores, float* m, float* l,
                       float* acc) {
  attend_one_lanes<Lanes16, DIM>(q, stride, group, keys, values, begin, end, scale, scores, m, l, acc);
}

// 0 plain, 1 AVX2 with FMA, 2 AVX-512: the most this CPU has; attention_isa lowers it (tests compare them).
int64_t detected_attention_isa() {
  if (__builtin_cpu_supports("avx512f")) return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}

int64_t block_attention_isa = detected_attention_isa();

int64_t attention_isa(int64_t most) {
  block_attention_isa = std::min(std::max<int64_t>(most, 0), detected_attention_isa());
  return block_attention_isa;
}

// The decode kernel for a head of `dim` channels at the attention's level: vectors where the head size is known and
// the CPU has AVX2 with FMA, else the plain loops.
OneKernel one_kernel(int64_t dim) {
  if (block_attention_isa == 2 && dim == 64) return attend_one_avx512<64>;
  if (block_attention_isa == 2 && dim == 128) return attend_one_avx512<128>;
  if (block_attention_isa >= 1 && dim == 64) return attend_one_avx2<64>;
  if (block_attention_isa >= 1 && dim == 128) return attend_one_avx2<128>;
  return dim == 64 ? attend_one<64> : dim == 128 ? attend_one<128> : attend_one<0>;
}

BlockKernel block_kernel() {
  return block_attention_isa == 2 ? attend_block_avx512 : block_attention_isa == 1 ? attend_block_avx2
                                                                                   : attend_block_plain;
}

// Where one row's keys and values lie: kv head h's n tokens from keys + h * key_stride (values + h *
// value_stride), token after token.
struct RowCache {
  const float* keys;
  const float* values;
  int64_t key_stride;
  int64_t value_stride;
  int64_t n;
};

// One row's key-value head over keys begin..end.
struct Unit {
  int64_t row, head, begin, end;
};

// query [rows, q_heads, t, dim] (dim contiguous): each row's t new tokens, the last t of its cache's n keys,
// query i seeing keys 0..n - t + i. Out: [rows, t, q_heads, dim]. A unit's queries: the group of query heads
// sharing its key-value head, times the t tokens (lane g * t + i).
void attend(const at::Tensor& query, const std::vector<RowCache>& rows, int64_t kv_heads, double scaling,
            at::Tensor& out) {
  const int64_t q_heads = query.size(1), t = query.size(2), dim = query.size(3), group = q_heads / kv_heads;
  TORCH_CHECK(t == 1 || dim % 4 == 0, "llmserve: attention over several tokens needs a head size in 4s");
  const int64_t queries = group * t, lanes = t == 1 ? group : (queries + kLaneRound - 1) / kLaneRound * kLaneRound;
  const int64_t width = lanes * (dim + 2);  // a unit's m, l and acc
  std::vector<Unit> units;
  std::vector<int64_t> firsts;  // each (row, head)'s first unit, then the end of the last
  for (int64_t r = 0; r < static_cast<int64_t>(rows.size()); ++r) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      firsts.push_back(static_cast<int64_t>(units.size()));
      for (int64_t begin = 0; begin < rows[r].n; begin += kSplit) {
        units.push_back({r, h, begin, std::min(begin + kSplit, rows[r].n)});
      }
    }
  }
  firsts.push_back(static_cast<int64_t>(units.size()));
  std::vector<float> results(units.size() * width);
  const float* q = query.data_ptr<float>();
  const float scale = static_cast<float>(scaling);
  const OneKernel one = one_kernel(dim);
  const BlockKernel block = block_kernel();
  at::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t from, int64_t to) {
    std::vector<float> scores(kSplit * lanes), qt(t == 1 ? 0 : dim * lanes);
    std::vector<int32_t> limits(lanes);
    for (int64_t u = from; u < to; ++u) {
      const Unit& unit = units[u];
      const RowCache& row = rows[unit.row];
      const float* head_q = q + unit.row * query.stride(0) + unit.head * group * query.stride(1);
      float* m = results.data() + u * width;
      float *l = m + lanes, *acc = l + lanes;
      const float *keys = row.keys + unit.head * row.key_stride, *values = row.values + unit.head * row.value_stride;
      if (t == 1) {
        one(head_q, query.stride(1), group, keys, values, unit.begin, unit.end, dim, scale, scores.data(), m, l, acc);
        continue;
      }
      for (int64_t L = 0; L < lanes; ++L) {
        const int64_t g = std::min(L, queries - 1) / t, i = std::min(L, queries - 1) % t;
        limits[L] = static_cast<int32_t>(row.n - t + i);
        for (int64_t d = 0; d < dim; ++d) {
          qt[d * lanes + L] = L < queries ? head_q[g * query.stride(1) + i * query.stride(2) + d] : 0.0f;
        }
      }
      block({qt.data(), lanes, keys, values, unit.begin, unit.end, dim, limits.data(), scale, scores.data(), m, l,
             acc});
    }
  });
  // Each (row, head)'s units in key order: exp(m - top) rescales each to the largest score of all.
  float* o = out.data_ptr<float>();
  const int64_t channel = t == 1 ? 1 : lanes, lane_step = t == 1 ? dim : 1;  // acc's layout by kernel
  at::parallel_for(0, static_cast<int64_t>(firsts.size()) - 1, 1, [&](int64_t from, int64_t to) {
    std::vector<float> sum(dim);
    for (int64_t pair = from; pair < to; ++pair) {
      const int64_t u = firsts[pair], last = firsts[pair + 1] - 1;
      const Unit& unit = units[u];
      for (int64_t L = 0; L < queries; ++L) {
        const int64_t g = L / t, i = L % t;
        float* target = o + ((unit.row * t + i) * q_heads + unit.head * group + g) * dim;
        float top = -INFINITY;
        for (int64_t s = u; s <= last; ++s) top = std::max(top, results[s * width + L]);
        float total = 0.0f;
        std::fill(sum.begin(), sum.end(), 0.0f);
        for (int64_t s = u; s <= last; ++s) {
          const float* m = results.data() + s * width;
          const float* acc = m + 2 * lanes + L * lane_step;
          const float w = m[L] == -INFINITY ? 0.0f : exp_poly(m[L] - top);
          total += w * m[lanes + L];
          for (int64_t d = 0; d < dim; ++d) sum[d] += w * acc[d * channel];
        }
        const float inverse = 1.0f / total;
        for (int64_t d = 0; d < dim; ++d) target[d] = sum[d] * inverse;
      }
    }
  });
}

at::Tensor query_of(const at::Tensor& query) {
  TORCH_CHECK(query.dim() == 4 && query.size(2) == 1 && query.scalar_type() == at::kFloat && query.size(0) > 0,
              "llmserve::decode_attention takes one float32 query per row");
  return query.stride(3) == 1 ? query : query.contiguous();
}

// query [rows, q_heads, 1, dim] (any strides, dim contiguous); keys[r], values[r] [1, kv_heads, n_r, dim]
// with dim contiguous (a ragged cache's views). Returns [rows, 1, q_heads, dim], as worker/weights/scripted.py's
// attend_rows does.
at::Tensor decode_attention(const at::Tensor& query, at::TensorList keys, at::TensorList values, double scaling) {
  const at::Tensor q = query_of(query);
  const int64_t rows = q.size(0), q_heads = q.size(1), dim = q.size(3);
  TORCH_CHECK(static_cast<int64_t>(keys.size()) == rows && static_cast<int64_t>(values.size()) == rows,
              "llmserve::decode_attention needs each row's keys and values");
  const int64_t kv_heads = keys[0].size(1);
  TORCH_CHECK(kv_heads > 0 && q_heads % kv_heads == 0, "llmserve::decode_attention: query heads in whole groups");
  std::vector<RowCache> caches;
  for (int64_t r = 0; r < rows; ++r) {
    for (const auto& tensor : {keys[r], values[r]}) {
      TORCH_CHECK(tensor.dim() == 4 && tensor.size(0) == 1 && tensor.size(1) == kv_heads && tensor.size(3) == dim &&
                      tensor.size(2) == keys[r].size(2) && tensor.size(2) > 0,
                  "llmserve::decode_attention: row ", r, "'s keys and values do not match the query");
      TORCH_CHECK(tensor.stride(3) == 1 && tensor.stride(2) == dim && tensor.scalar_type() == at::kFloat,
                  "llmserve::decode_attention needs keys and values laid out token after token");
    }
    caches.push_back({keys[r].data_ptr<float>(), values[r].data_ptr<float>(), keys[r].stride(1), values[r].stride(1),
                      keys[r].size(2)});
  }
  at::Tensor out = at::empty({rows, 1, q_heads, dim}, q.options());
  attend(q, caches, kv_heads, scaling, out);
  return out;
}

// The query, key and value heads of a part's fused projections qkv [rows * length, (q + 2 kv) * dim]: query
// and key heads rotated as worker/weights/scripted.py's heads does (x * cos + roll(x, dim / 2) * signed_sin, the same
// products and sum: the same bits), into [rows, heads, length, dim] tensors; values a view of qkv.
std::tuple<at::Tensor, at::Tensor, at::Tensor> heads(const at::Tensor& qkv, int64_t rows, int64_t length,
                                                     int64_t dim, int64_t q_heads, int64_t kv_heads,
                                                     const at::Tensor& cos, const at::Tensor& signed_sin) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && qkv.is_contiguous() && dim % 2 == 0 &&
                  qkv.numel() == rows * length * (q_heads + 2 * kv_heads) * dim,
              "llmserve::heads takes the contiguous float32 projections of rows * length tokens");
  const at::Tensor c = cos.expand({rows, 1, length, dim}).contiguous();
  const at::Tensor s = signed_sin.expand({rows, 1, length, dim}).contiguous();
  const int64_t rotated = q_heads + kv_heads, width = (rotated + kv_heads) * dim, half = dim / 2;
  at::Tensor query = at::empty({rows, q_heads, length, dim}, qkv.options());
  at::Tensor key = at::empty({rows, kv_heads, length, dim}, qkv.options());
  const float *x = qkv.data_ptr<float>(), *cp = c.data_ptr<float>(), *sp = s.data_ptr<float>();
  float *qp = query.data_ptr<float>(), *kp = key.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = 0; t < length; ++t) {
      const float* token = x + (r * length + t) * width;
      const float* ct = cp + (r * length + t) * dim;
      const float* st = sp + (r * length + t) * dim;
      for (int64_t h = 0; h < rotated; ++h) {
        const float* in = token + h * dim;
        float* out = h < q_heads ? qp + ((r * q_heads + h) * length + t) * dim
                                 : kp + ((r * kv_heads + h - q_heads) * length + t) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float turned = in[i < half ? i + half : i - half];
          out[i] = in[i] * ct[i] + turned * st[i];
        }
      }
    }
  }
  at::Tensor value = qkv.view({rows, length, -1, dim}).transpose(1, 2).narrow(1, rotated, kv_heads);
  return {query, key, value};
}

// Row r's new keys and values ([rows, kv_heads, added, dim], any strides with dim contiguous) copied after its
// lengths[r] tokens into its buffers ([1, kv_heads, room, dim], contiguous, with room: the caller grows them).
void copy_rows(at::TensorList key_buffers, at::TensorList value_buffers, at::IntArrayRef lengths,
               const at::Tensor& keys, const at::Tensor& values) {
  const int64_t rows = static_cast<int64_t>(lengths.size()), heads = keys.size(1), added = keys.size(2),
                dim = keys.size(3);
  TORCH_CHECK(static_cast<int64_t>(key_buffers.size()) == rows && static_cast<int64_t>(value_buffers.size()) == rows &&
                  keys.size(0) == rows && values.sizes() == keys.sizes(),
              "llmserve::write_rows needs a buffer and new keys and values per row");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1 && keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "llmserve::write_rows takes float32 keys and values with each head's numbers side by side");
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t start = lengths[r];
    for (const auto& [buffers, source] : {std::tie(key_buffers, keys), std::tie(value_buffers, values)}) {
      const at::Tensor& buffer = buffers[r];
      TORCH_CHECK(buffer.is_contiguous() && buffer.size(1) == heads && buffer.size(3) == dim &&
                      start + added <= buffer.size(2) && buffer.scalar_type() == at::kFloat,
                  "llmserve::write_rows: row ", r, "'s buffer has no room for its new tokens");
      const int64_t room = buffer.size(2);
      float* base = buffer.data_ptr<float>();
      const float* from = source.data_ptr<float>();
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t t = 0; t < added; ++t) {
          std::memcpy(base + (h * room + start + t) * dim,
                      from + r * source.stride(0) + h * source.stride(1) + t * source.stride(2), dim * sizeof(float));
        }
      }
    }
  }
}

// A prefix-cache hit's blocks (each [layers, 2 (keys, values), heads, tokens, dim], contiguous) one after another
// into row `row` of every layer's keys and values ([rows, heads, room, dim], contiguous), the layers shared among
// the threads: worker/own/cache.py's stacked_cache without a tensor per block and layer.
void join_blocks(at::TensorList blocks, at::TensorList keys, at::TensorList values, int64_t row) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(!blocks.empty() && static_cast<int64_t>(values.size()) == layers,
              "llmserve::join_blocks needs blocks and every layer's keys and values");
  const int64_t heads = keys[0].size(1), room = keys[0].size(2), dim = keys[0].size(3);
  int64_t length = 0;
  for (const auto& block : blocks) {
    TORCH_CHECK(block.is_contiguous() && block.dim() == 5 && block.size(0) == layers && block.size(1) == 2 &&
                    block.size(2) == heads && block.size(4) == dim && block.scalar_type() == at::kFloat,
                "llmserve::join_blocks: a block does not fit the cache");
    length += block.size(3);
  }
  for (const auto& tensor : {keys, values}) {
    for (const auto& layer : tensor) {
      TORCH_CHECK(layer.is_contiguous() && layer.scalar_type() == at::kFloat && layer.size(1) == heads &&
                      layer.size(2) == room && layer.size(3) == dim && row >= 0 && row < layer.size(0),
                  "llmserve::join_blocks: every layer's keys and values [rows, heads, room, dim], contiguous");
    }
  }
  TORCH_CHECK(length <= room, "llmserve::join_blocks: the row has no room for its blocks");
  at::parallel_for(0, layers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t layer = begin; layer < end; ++layer) {
      for (int64_t half = 0; half < 2; ++half) {
        float* target = (half ? values : keys)[layer].data_ptr<float>() + row * heads * room * dim;
        int64_t start = 0;
        for (const auto& block : blocks) {
          const int64_t tokens = block.size(3);
          const float* source = block.data_ptr<float>() + (layer * 2 + half) * heads * tokens * dim;
          for (int64_t h = 0; h < heads; ++h) {
            std::memcpy(target + (h * room + start) * dim, source + h * tokens * dim, tokens * dim * sizeof(float));
          }
          start += tokens;
        }
      }
    }
  });
}

// copy_rows, then each row's keys and values so far, views of its buffers (worker/weights/scripted.py's write_rows).
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>> write_rows(at::TensorList key_buffers,
                                                                        at::TensorList value_buffers,
                                                                        at::IntArrayRef lengths,
                                                                        const at::Tensor& keys,
                                                                        const at::Tensor& values) {
  copy_rows(key_buffers, value_buffers, lengths, keys, values);
  std::vector<at::Tensor> row_keys, row_values;
  for (int64_t r = 0; r < static_cast<int64_t>(lengths.size()); ++r) {
    row_keys.push_back(key_buffers[r].narrow(2, 0, lengths[r] + keys.size(2)));
    row_values.push_back(value_buffers[r].narrow(2, 0, lengths[r] + keys.size(2)));
  }
  return {row_keys, row_values};
}

// A forward's cache write and attention in one call: each row's t new keys and values (keys, values
// [rows, kv_heads, t, dim]) written after its lengths[r] tokens, then its t queries attended over its buffers,
// query i over the first lengths[r] + i + 1 tokens, read in place: no view per row and layer (a decode step at
// 16 rows made 960 of them). With t = 1, the same numbers as write_rows then decode_attention.
at::Tensor write_and_attend(const at::Tensor& query, at::TensorList key_buffers, at::TensorList value_buffers,
                            at::IntArrayRef lengths, const at::Tensor& keys, const at::Tensor& values,
                            double scaling) {
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat && query.size(0) > 0 && keys.dim() == 4 &&
                  keys.size(0) == query.size(0) && keys.size(2) == query.size(2) && keys.size(3) == query.size(3) &&
                  query.size(1) % keys.size(1) == 0,
              "llmserve::write_and_attend takes float32 queries, keys and values of the same rows, tokens and "
              "head size");
  const at::Tensor q = query.stride(3) == 1 ? query : query.contiguous();
  copy_rows(key_buffers, value_buffers, lengths, keys, values);
  const int64_t rows = q.size(0), kv_heads = keys.size(1), added = keys.size(2), dim = q.size(3);
  std::vector<RowCache> caches;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t room = key_buffers[r].size(2);
    TORCH_CHECK(value_buffers[r].size(2) == room, "llmserve::write_and_attend: row ", r, "'s buffers differ");
    caches.push_back({key_buffers[r].data_ptr<float>(), value_buffers[r].data_ptr<float>(), room * dim, room * dim,
                      lengths[r] + added});
  }
  at::Tensor out = at::empty({rows, added, q.size(1), dim}, q.options());
  attend(q, caches, kv_heads, scaling, out);
  return out;
}

void silu_mul_plain(const float* gate, const float* up, float* out, int64_t width) {
  for (int64_t i = 0; i < width; ++i) out[i] = gate[i] / (1.0f + exp_poly(-gate[i])) * up[i];
}

// silu(gate) * up, element by element: in vectors, exp_lanes being exp_poly's own operations, the same bits as the
// plain loop's (tested).
template <typename V, typename I>
[[gnu::always_inline]] inline void silu_mul_lanes(const float* gate, const float* up, float* out, int64_t width) {
  constexpr int64_t W = sizeof(V) / sizeof(float);
  int64_t i = 0;
  for (; i + W <= width; i += W) {
    const V g = *reinterpret_cast<const V*>(gate + i);
    *reinterpret_cast<V*>(out + i) = g / (1.0f + exp_lanes<V, I>(-g)) * *reinterpret_cast<const V*>(up + i);
  }
  silu_mul_plain(gate + i, up + i, out + i, width - i);  // the last few
}

__attribute__((target("avx2"))) void silu_mul_avx2(const float* gate, const float* up, float* out, int64_t width) {
  silu_mul_lanes<Lanes8, Ints8>(gate, up, out, width);
}

__attribute__((target("avx512f"))) void silu_mul_avx512(const float* gate, const float* up, float* out,
                                                         int64_t width) {
  silu_mul_lanes<Lanes16, Ints16>(gate, up, out, width);
}

// At the attention's instruction set level (WORKER_ISA caps both).
void silu_mul(const float* gate, const float* up, float* out, int64_t width) {
  const auto kernel = block_attention_isa == 2 ? silu_mul_avx512 : block_attention_isa == 1 ? silu_mul_avx2
                                                                                             : silu_mul_plain;
  kernel(gate, up, out, width);
}

// x [rows, 2 * width]: silu(first half) * second half, then, with `block`, each run of `block` channels
// times the normalised Sylvester-Hadamard matrix of that order (a power of 2): butterflies, then 1/sqrt.
__attribute__((target_clones("avx2", "default")))
void silu_mul_rotate(const float* x, float* out, int64_t rows, int64_t width, int64_t block) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = x + r * 2 * width;
    const float* up = gate + width;
    float* mixed = out + r * width;
    silu_mul(gate, up, mixed, width);
    if (block == 0) continue;
    const float norm = 1.0f / std::sqrt(static_cast<float>(block));
    for (int64_t start = 0; start < width; start += block) {
      float* v = mixed + start;
      for (int64_t half = 1; half < block; half *= 2) {
        for (int64_t i = 0; i < block; i += 2 * half) {
#pragma omp simd
          for (int64_t j = i; j < i + half; ++j) {
            const float a = v[j], b = v[j + half];
            v[j] = a + b;
            v[j + half] = a - b;
          }
        }
      }
#pragma omp simd
      for (int64_t i = 0; i < block; ++i) v[i] *= norm;
    }
  }
}

// The rest of a layer after attention, for a model whose norms have a gain of 1 (worker/weights/rotation.py):
// x + o_proj(attended), then + down_proj(rotated silu(gate) * up) of the normed sum.
at::Tensor mlp_residual(const at::Tensor& x, const at::Tensor& attended, int64_t o_proj, int64_t gate_up,
                        int64_t down_proj, double eps, int64_t block) {
  at::Tensor h = x + int8_linear(attended, o_proj, std::nullopt, std::nullopt);
  at::Tensor gu = int8_linear(h, gate_up, std::nullopt, eps);
  const int64_t width = gu.size(-1) / 2, rows = gu.numel() / gu.size(-1);
  TORCH_CHECK(block == 0 || ((block & (block - 1)) == 0 && width % block == 0),
              "llmserve::mlp_residual rotates blocks of a power of 2 that divides the width");
  at::Tensor mixed = at::empty({rows, width}, gu.options());
  llmserve::silu_mul_rows(gu.data_ptr<float>(), mixed.data_ptr<float>(), rows, width, block);
  return h.add_(int8_linear(mixed, down_proj, std::nullopt, std::nullopt));
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> llmserve::rotary_heads(
    const at::Tensor& qkv, int64_t rows, int64_t length, int64_t dim, int64_t q_heads, int64_t kv_heads,
    const at::Tensor& cos, const at::Tensor& signed_sin) {
  return heads(qkv, rows, length, dim, q_heads, kv_heads, cos, signed_sin);
}

at::Tensor llmserve::write_and_attend_rows(const at::Tensor& query, at::TensorList key_buffers,
                                           at::TensorList value_buffers, at::IntArrayRef lengths,
                                           const at::Tensor& keys, const at::Tensor& values, double scaling) {
  return write_and_attend(query, key_buffers, value_buffers, lengths, keys, values, scaling);
}

// silu_mul_rotate with the rows shared among the threads (rows apart: each row's bits its own).
void llmserve::silu_mul_rows(const float* x, float* out, int64_t rows, int64_t width, int64_t block) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    silu_mul_rotate(x + begin * 2 * width, out + begin * width, end - begin, width, block);
  });
}

// Catch-all kernels: inference only, CPU tensors (the int8 path's).
TORCH_LIBRARY(llmserve, m) {
  m.def("keep_weight(__torch__.torch.classes.quantized.LinearPackedParamsBase packed) -> int", &keep_weight);
  m.def("drop_weight(int weight) -> ()", &drop_weight);
  m.def("int8_linear(Tensor x, int weight, Tensor? bias, float? norm_eps) -> Tensor",
        &int8_linear);
  m.def("heads(Tensor qkv, int rows, int length, int dim, int q_heads, int kv_heads, Tensor cos, Tensor signed_sin) "
        "-> (Tensor, Tensor, Tensor)",
        &heads);
  m.def("write_rows(Tensor[] key_buffers, Tensor[] value_buffers, int[] lengths, Tensor keys, Tensor values) "
        "-> (Tensor[], Tensor[])",
        &write_rows);
  m.def("join_blocks(Tensor[] blocks, Tensor[] keys, Tensor[] values, int row) -> ()", &join_blocks);
  m.def("decode_attention(Tensor query, Tensor[] keys, Tensor[] values, float scaling) -> Tensor", &decode_attention);
  m.def("write_and_attend(Tensor query, Tensor[] key_buffers, Tensor[] value_buffers, int[] lengths, Tensor keys, "
        "Tensor values, float scaling) -> Tensor",
        &write_and_attend);
  m.def("attention_isa(int most) -> int", &attention_isa);
  m.def("mlp_residual(Tensor x, Tensor attended, int o_proj, int gate_up, int down_proj, float eps, int block) "
        "-> Tensor",
        &mlp_residual);
}
