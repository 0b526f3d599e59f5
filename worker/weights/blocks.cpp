// Linear layers over a GGUF file's own blocks (worker/weights/blocks.py packs them, worker/weights/native.py builds this file).
//
// A Q4_1 block is 32 weights of one output channel along its inputs: 4-bit codes c with a scale d and a
// minimum m (w = d c + m); a Q5_1 block the same with 5-bit codes; a Q8_0 block has signed 8-bit codes and a scale. Each token's activations are cut
// into the same blocks of 32 and quantised to 8 bits per block (scale a, codes q), so a block's product is
// d a sum(c q) + m a sum(q), its sum of codes an exact integer product (VNNI's vpdpbusd, or AVX2's
// vpmaddubsw: 31 * 127 * 2 fits its 16-bit pair sums). A decode step then reads 5 (Q4_1) or 6 (Q5_1) bits per
// layer weight instead of int8's 8.
//
// Weights are packed in tiles of 16 output channels, one per 32-bit lane; a tile's block is its codes
// (lane c holding 4 consecutive inputs of channel c) then its 16 scales (and minima) as float16. Every row's
// float arithmetic is the same lane-wise sequence in the AVX-512, AVX2 and plain loops, and rows never mix:
// a row's bits are the same alone or in any batch, on any of the three (tested).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "native_math.h"

namespace {

using llmserve::Ints16;
using llmserve::Ints8;
using llmserve::Lanes16;
using llmserve::Lanes8;

constexpr int64_t kBlock = 32;  // inputs per block
constexpr int64_t kTile = 16;   // output channels per tile
constexpr int64_t kQ4 = 2, kQ5 = 7, kQ8 = 8;  // GGUF's type numbers: Q4_1, Q5_1 and Q8_0
// From this many rows two tiles share each activation read (AVX-512); below, one stream of weights per thread
// reads faster (bench/blocks.py).
constexpr int64_t kPairRows = 4;
// Below kPairRows rows a kernel streams its tiles one after another (a thread's tiles are contiguous) and asks for
// the block this far ahead in that stream, across the 4 KiB pages where the hardware's prefetcher stops.
constexpr int64_t kAhead = 8;

// Bytes of one tile's block: codes (for Q5_1 the low four bits as Q4_1's, then a byte of fifth bits per four
// inputs), then scales (and, but for Q8_0, minima) as float16.
constexpr int64_t kPlane = kTile * kBlock / 2;  // where Q5_1's fifth bits start
constexpr int64_t code_bytes(int64_t type) {
  return type == kQ4 ? kPlane : type == kQ5 ? kPlane + kTile * kBlock / 8 : kTile * kBlock;
}
constexpr int64_t tile_block_bytes(int64_t type) { return code_bytes(type) + (type == kQ8 ? 2 : 4) * kTile; }

// One row's activations, quantised per block: codes, each block's scale, and its scale times its codes' sum.
struct Quantised {
  const int8_t* codes;
  const int8_t* biased;  // (Q8_0 only) codes + 128, read as unsigned
  const float* scale;
  const float* scaled_sum;
};

// Round to nearest, ties to even, for |x| < 2^22, in plain arithmetic (vectorises without SSE4.1's roundps).
inline float round_even(float x) {
  constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23: the sum's last bit is the integer's
  return std::copysign((std::fabs(x) + kMagic) - kMagic, x);
}

// Each row of x [rows, k] quantised per block of 32: codes in [-127, 127] with scale max|x| / 127. Every step is
// exact or rounds one number alone, so vector width and threads change no bit.
void quantise_plain(const float* x, int64_t rows, int64_t k, int8_t* codes, float* scale, float* scaled_sum) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + r * k + b * kBlock;
      float top = 0.0f;
      for (int64_t i = 0; i < kBlock; ++i) top = std::max(top, std::fabs(in[i]));
      const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
      int32_t total = 0;
      int8_t* out = codes + r * k + b * kBlock;
      for (int64_t i = 0; i < kBlock; ++i) {
        const int32_t q = static_cast<int32_t>(std::min(127.0f, std::max(-127.0f, round_even(in[i] * inverse))));
        out[i] = static_cast<int8_t>(q);
        total += q;
      }
      const float a = top / 127.0f;
      scale[r * blocks + b] = a;
      scaled_sum[r * blocks + b] = a * static_cast<float>(total);
    }
  }
}

// The same in vectors of W lanes: a block's magnitudes masked out of its bits, rounded by the same sum, clamped,
// and the sign given back to the integer.
template <typename V, typename I>
[[gnu::always_inline]] inline void quantise_lanes(const float* x, int64_t rows, int64_t k, int8_t* codes,
                                                  float* scale, float* scaled_sum) {
  constexpr int64_t W = sizeof(V) / sizeof(float), C = kBlock / W;
  typedef int8_t Bytes __attribute__((vector_size(W)));
  const int64_t blocks = k / kBlock;
  const I magnitude = I{} + 0x7fffffff;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const float* in = x + r * k + b * kBlock;
      V v[C], peak = {};
      for (int64_t c = 0; c < C; ++c) {
        v[c] = *reinterpret_cast<const V*>(in + c * W);
        const I bits = reinterpret_cast<const I&>(v[c]) & magnitude;
        const V size = reinterpret_cast<const V&>(bits);
        peak = peak > size ? peak : size;
      }
      float top = 0.0f;
      for (int64_t i = 0; i < W; ++i) top = std::max(top, peak[i]);
      const float inverse = top > 0.0f ? 127.0f / top : 0.0f;
      I total = {};
      for (int64_t c = 0; c < C; ++c) {
        const V y = v[c] * inverse;
        const I bits = reinterpret_cast<const I&>(y) & magnitude;
        V rounded = (reinterpret_cast<const V&>(bits) + 12582912.0f) - 12582912.0f;  // round_even's sum
        rounded = rounded < 127.0f ? rounded : 127.0f;
        I q = __builtin_convertvector(rounded, I);
        q = y < 0.0f ? -q : q;
        total += q;
        const Bytes narrow = __builtin_convertvector(q, Bytes);
        std::memcpy(codes + r * k + b * kBlock + c * W, &narrow, sizeof narrow);
      }
      int32_t sum = 0;
      for (int64_t i = 0; i < W; ++i) sum += total[i];
      const float a = top / 127.0f;
      scale[r * blocks + b] = a;
      scaled_sum[r * blocks + b] = a * static_cast<float>(sum);
    }
  }
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    int32_t e = 113;
    uint32_t m = mantissa;
    while ((m & 0x400u) == 0) {
      m <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The code of channel c, input i of a tile's block (the packing of worker/weights/blocks.py).
// Q5_1's fifth bits: lane c's byte t holds, for step j (inputs 4 j + t and 16 + 4 j + t), the first's in bit
// 4 + j and the second's in bit j, so that a step's bits reach bit 4 by one shift of the whole plane.
inline int32_t code_at(const uint8_t* block, int64_t type, int64_t c, int64_t i) {
  if (type == kQ8) return static_cast<int8_t>(block[((i / 4) * kTile + c) * 4 + i % 4]);
  const int64_t step = (i % 16) / 4;
  const uint8_t byte = block[(step * kTile + c) * 4 + i % 4];
  const int32_t low = i < 16 ? (byte & 0x0f) : (byte >> 4);
  if (type == kQ4) return low;
  const uint8_t fifth = block[kPlane + c * 4 + i % 4];
  return low | (((fifth >> (i < 16 ? 4 + step : step)) & 1) << 4);
}

// Plain loops: rows [0, count) of one tile into out (kTile floats a row, `stride` apart).
void tile_plain(const uint8_t* tile, int64_t type, int64_t blocks, const Quantised* rows, int64_t count,
                float* out, int64_t stride) {
  const int64_t bytes = tile_block_bytes(type), codes = code_bytes(type);
  for (int64_t r = 0; r < count; ++r) {
    float acc[kTile] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* block = tile + b * bytes;
      const int8_t* q = rows[r].codes + b * kBlock;
      const uint16_t* halves = reinterpret_cast<const uint16_t*>(block + codes);
      for (int64_t c = 0; c < kTile; ++c) {
        int32_t sum = 0;
        for (int64_t i = 0; i < kBlock; ++i) sum += code_at(block, type, c, i) * q[i];
        const float p = half_to_float(halves[c]) * rows[r].scale[b];
        acc[c] = std::fma(static_cast<float>(sum), p, acc[c]);
        if (type != kQ8) acc[c] = std::fma(half_to_float(halves[kTile + c]), rows[r].scaled_sum[b], acc[c]);
      }
    }
    std::memcpy(out + r * stride, acc, sizeof acc);
  }
}

#if defined(__x86_64__)

// The same block of the tile after, asked for ahead of its use by a kernel of kPairRows rows or more (the first
// row group, which reads a tile from memory): at batch the short run of tiles each thread streams is not left to
// the hardware's prefetcher alone (one row gains nothing from it). It may lie past the weights: a
// prefetch never faults.
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  const char* start = reinterpret_cast<const char*>(block);
  for (int64_t line = 0; line < bytes; line += 64) _mm_prefetch(start + line, _MM_HINT_T0);
}

// What a kernel of R rows asks for ahead (prefetch_block): the same block of the tile after from kPairRows rows
// on, else the block kAhead on in its own stream.
template <int R>
inline void prefetch_next(const uint8_t* block, int64_t blocks, int64_t bytes) {
  prefetch_block(block + (R >= kPairRows ? blocks : kAhead) * bytes, bytes);
}

// AVX2, Q4_1: a tile as two vectors of 8 lanes, R rows at a time, each activation read serving both. A block's
// four steps of code products are summed in 16 bits before one widening: a step's pair of maddubs is at most
// 2 * 2 * 15 * 127 a lane, so four of them stay within int16.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_q4_avx2(const uint8_t* tile, int64_t blocks,
                                                           const Quantised* rows, float* out, int64_t stride) {
  constexpr int64_t bytes = tile_block_bytes(kQ4), codes = code_bytes(kQ4);
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * bytes;
    prefetch_next<R>(block, blocks, bytes);
    __m256i sums[R][2];
    for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_si256();
    // Unrolled, GCC schedules every product of the block first and spills them to the stack.
#pragma GCC unroll 1
    for (int64_t j = 0; j < 4; ++j) {
      __m256i lo[2], hi[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * 64 + h * 32));
        lo[h] = _mm256_and_si256(packed, low);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
      }
      for (int r = 0; r < R; ++r) {
        const int8_t* q = rows[r].codes + b * kBlock + 4 * j;
        const __m256i first = _mm256_set1_epi32(four_bytes(q)), second = _mm256_set1_epi32(four_bytes(q + 16));
        for (int h = 0; h < 2; ++h) {
          const __m256i a = _mm256_maddubs_epi16(lo[h], first), c = _mm256_maddubs_epi16(hi[h], second);
          sums[r][h] = _mm256_add_epi16(sums[r][h], _mm256_add_epi16(a, c));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + codes + h * 16)));
      const __m256 mw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + codes + 32 + h * 16)));
      for (int r = 0; r < R; ++r) {
        const __m256 p = _mm256_mul_ps(dw, _mm256_set1_ps(rows[r].scale[b]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums[r][h], ones)), p, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(mw, _mm256_set1_ps(rows[r].scaled_sum[b]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * stride + h * 8, acc[r][h]);
}

// AVX2, Q5_1: a tile as two halves of 8 lanes, up to 4 rows at a time. A step's fifth bits are shifted to bit 4
// of its codes' bytes; a pair of maddubs is at most 2 * 2 * 31 * 127 a lane, so two steps are summed in 16 bits
// before each widening.
template <int R>
__attribute__((target("avx2,fma,f16c"))) void half_tile_q5_avx2(const uint8_t* tile, int64_t blocks,
                                                                const Quantised* rows, float* out, int64_t stride,
                                                                int64_t half) {
  constexpr int64_t bytes = tile_block_bytes(kQ5), codes = code_bytes(kQ5);
  const __m256i low = _mm256_set1_epi8(0x0f), bit = _mm256_set1_epi8(0x10), ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * bytes;
    if (half == 0) prefetch_next<R>(block, blocks, bytes);
    __m256i first_bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + kPlane + half * 32));
    __m256i second_bits = _mm256_slli_epi16(first_bits, 4);
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int64_t pair = 0; pair < 2; ++pair) {
      __m256i part[R];
      for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
      for (int64_t j = 2 * pair; j < 2 * pair + 2; ++j) {
        const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * 64 + half * 32));
        const __m256i lo = _mm256_or_si256(_mm256_and_si256(packed, low), _mm256_and_si256(first_bits, bit));
        const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(packed, 4), low),
                                           _mm256_and_si256(second_bits, bit));
        first_bits = _mm256_srli_epi16(first_bits, 1);
        second_bits = _mm256_srli_epi16(second_bits, 1);
        for (int r = 0; r < R; ++r) {
          const int8_t* q = rows[r].codes + b * kBlock + 4 * j;
          const __m256i a = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(four_bytes(q)));
          const __m256i c = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(four_bytes(q + 16)));
          part[r] = _mm256_add_epi16(part[r], _mm256_add_epi16(a, c));
        }
      }
      for (int r = 0; r < R; ++r) sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(part[r], ones));
    }
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + codes + half * 16)));
    const __m256 mw =
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + codes + 32 + half * 16)));
    for (int r = 0; r < R; ++r) {
      const __m256 p = _mm256_mul_ps(dw, _mm256_set1_ps(rows[r].scale[b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), p, acc[r]);
      acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(rows[r].scaled_sum[b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride + half * 8, acc[r]);
}

// AVX2, Q8_0: a tile as two halves of 8 lanes, up to 4 rows at a time; |w| times q carrying w's sign (codes and
// activations within [-127, 127]).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void half_tile_q8_avx2(const uint8_t* tile, int64_t blocks,
                                                                const Quantised* rows, float* out, int64_t stride,
                                                                int64_t half) {
  constexpr int64_t bytes = tile_block_bytes(kQ8), codes = code_bytes(kQ8);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = tile + b * bytes;
    if (half == 0) prefetch_next<R>(block, blocks, bytes);
    const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + codes + half * 16)));
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int64_t j = 0; j < 8; ++j) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + j * 64 + half * 32));
      const __m256i magnitude = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i q = _mm256_set1_epi32(four_bytes(rows[r].codes + b * kBlock + 4 * j));
        const __m256i a = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(q, w));
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(a, ones));
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 p = _mm256_mul_ps(dw, _mm256_set1_ps(rows[r].scale[b]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), p, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * stride + half * 8, acc[r]);
}

// AVX-512 with VNNI: T tiles side by side (`tile_bytes` apart), a tile in one vector, R rows at a time; each
// activation read serves the T tiles.
template <int64_t TYPE, int R, int T>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tiles_avx512(const uint8_t* tile, int64_t tile_bytes,
                                                                         int64_t blocks, const Quantised* rows,
                                                                         float* out, int64_t stride) {
  constexpr int64_t bytes = tile_block_bytes(TYPE), codes = code_bytes(TYPE);
  const __m512i low = _mm512_set1_epi8(0x0f), bit = _mm512_set1_epi8(0x10),
                offset = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block[T];
    __m512 dw[T];
    __m512i sums[T][R];
    if constexpr (R >= kPairRows) {
      for (int t = 0; t < T; ++t) prefetch_block(tile + (T + t) * tile_bytes + b * bytes, bytes);
    } else {
      for (int t = 0; t < T; ++t) prefetch_block(tile + t * tile_bytes + (b + kAhead) * bytes, bytes);
    }
    for (int t = 0; t < T; ++t) {
      block[t] = tile + t * tile_bytes + b * bytes;
      dw[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[t] + codes)));
      for (int r = 0; r < R; ++r) sums[t][r] = _mm512_setzero_si512();
    }
    if constexpr (TYPE != kQ8) {
      __m512i first_bits[T], second_bits[T];  // Q5_1's fifth bits (code_at)
      if constexpr (TYPE == kQ5) {
        for (int t = 0; t < T; ++t) {
          first_bits[t] = _mm512_loadu_si512(block[t] + kPlane);
          second_bits[t] = _mm512_slli_epi16(first_bits[t], 4);
        }
      }
      for (int64_t j = 0; j < 4; ++j) {
        __m512i lo[T], hi[T];
        for (int t = 0; t < T; ++t) {
          const __m512i packed = _mm512_loadu_si512(block[t] + j * 64);
          lo[t] = _mm512_and_si512(packed, low);
          hi[t] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
          if constexpr (TYPE == kQ5) {
            lo[t] = _mm512_or_si512(lo[t], _mm512_and_si512(first_bits[t], bit));
            hi[t] = _mm512_or_si512(hi[t], _mm512_and_si512(second_bits[t], bit));
            first_bits[t] = _mm512_srli_epi16(first_bits[t], 1);
            second_bits[t] = _mm512_srli_epi16(second_bits[t], 1);
          }
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* q = rows[r].codes + b * kBlock + 4 * j;
          const __m512i first = _mm512_set1_epi32(four_bytes(q)), second = _mm512_set1_epi32(four_bytes(q + 16));
          for (int t = 0; t < T; ++t) {
            sums[t][r] = _mm512_dpbusd_epi32(sums[t][r], lo[t], first);
            sums[t][r] = _mm512_dpbusd_epi32(sums[t][r], hi[t], second);
          }
        }
      }
    } else {  // (q + 128) unsigned times the signed codes, less 128 times the codes' sum: the same integer
      __m512i correction[T];
      for (int t = 0; t < T; ++t) correction[t] = _mm512_setzero_si512();
      for (int64_t j = 0; j < 8; ++j) {
        __m512i w[T];
        for (int t = 0; t < T; ++t) {
          w[t] = _mm512_loadu_si512(block[t] + j * 64);
          correction[t] = _mm512_dpbusd_epi32(correction[t], offset, w[t]);
        }
        for (int r = 0; r < R; ++r) {
          const __m512i q = _mm512_set1_epi32(four_bytes(rows[r].biased + b * kBlock + 4 * j));
          for (int t = 0; t < T; ++t) sums[t][r] = _mm512_dpbusd_epi32(sums[t][r], q, w[t]);
        }
      }
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) sums[t][r] = _mm512_sub_epi32(sums[t][r], correction[t]);
    }
    __m512 mw[T];
    if constexpr (TYPE != kQ8) {
      for (int t = 0; t < T; ++t)
        mw[t] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block[t] + codes + 32)));
    }
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(rows[r].scale[b]);
      for (int t = 0; t < T; ++t) {
        acc[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[t][r]), _mm512_mul_ps(dw[t], a), acc[t][r]);
        if constexpr (TYPE != kQ8) acc[t][r] = _mm512_fmadd_ps(mw[t], _mm512_set1_ps(rows[r].scaled_sum[b]), acc[t][r]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + r * stride + t * kTile, acc[t][r]);
}

template <int64_t TYPE, int R>
void rows_avx2(const uint8_t* tile, int64_t blocks, const Quantised* rows, float* out, int64_t stride) {
  if constexpr (TYPE == kQ4) {
    tile_q4_avx2<R>(tile, blocks, rows, out, stride);
  } else if constexpr (TYPE == kQ5) {
    half_tile_q5_avx2<R>(tile, blocks, rows, out, stride, 0);
    half_tile_q5_avx2<R>(tile, blocks, rows, out, stride, 1);
  } else {
    half_tile_q8_avx2<R>(tile, blocks, rows, out, stride, 0);
    half_tile_q8_avx2<R>(tile, blocks, rows, out, stride, 1);
  }
}

// Rows [0, count) of T tiles, R at a time (R a power of 2 up to MAX), by Kernel<TYPE, R, T>.
template <int64_t TYPE, int MAX, int T, template <int64_t, int, int> class Kernel>
void tile_rows(const uint8_t* tile, int64_t tile_bytes, int64_t blocks, const Quantised* rows, int64_t count,
               float* out, int64_t stride) {
  int64_t r = 0;
  for (; r + MAX <= count; r += MAX) Kernel<TYPE, MAX, T>::run(tile, tile_bytes, blocks, rows + r, out + r * stride,
                                                               stride);
  if constexpr (MAX > 1) {
    if (r < count) {
      tile_rows<TYPE, MAX / 2, T, Kernel>(tile, tile_bytes, blocks, rows + r, count - r, out + r * stride, stride);
    }
  }
}

template <int64_t TYPE, int R, int T>
struct Avx512 {
  static void run(const uint8_t* t, int64_t tb, int64_t b, const Quantised* q, float* o, int64_t s) {
    tiles_avx512<TYPE, R, T>(t, tb, b, q, o, s);
  }
};

template <int64_t TYPE, int R, int T>
struct Avx2 {
  static void run(const uint8_t* t, int64_t tb, int64_t b, const Quantised* q, float* o, int64_t s) {
    static_assert(T == 1, "AVX2 takes one tile at a time");
    rows_avx2<TYPE, R>(t, b, q, o, s);
  }
};

#endif

enum Isa : int64_t { kPlain = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detected() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) return kAvx2;
#endif
  return kPlain;
}

const Isa kDetected = detected();
Isa isa = kDetected;  // block_isa lowers it (tests compare the three)

// The widest kernel set this CPU has, at most `most` (0 plain, 1 AVX2, 2 AVX-512 VNNI); returns it.
int64_t block_isa(int64_t most) {
  isa = static_cast<Isa>(std::min<int64_t>(std::max<int64_t>(most, kPlain), kDetected));
  return isa;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) void quantise_avx2(const float* x, int64_t rows, int64_t k, int8_t* codes,
                                                    float* scale, float* scaled_sum) {
  quantise_lanes<Lanes8, Ints8>(x, rows, k, codes, scale, scaled_sum);
}

__attribute__((target("avx512f"))) void quantise_avx512(const float* x, int64_t rows, int64_t k, int8_t* codes,
                                                         float* scale, float* scaled_sum) {
  quantise_lanes<Lanes16, Ints16>(x, rows, k, codes, scale, scaled_sum);
}
#endif

void quantise_rows(const float* x, int64_t rows, int64_t k, int8_t* codes, float* scale, float* scaled_sum) {
#if defined(__x86_64__)
  if (isa == kAvx512) return quantise_avx512(x, rows, k, codes, scale, scaled_sum);
  if (isa == kAvx2) return quantise_avx2(x, rows, k, codes, scale, scaled_sum);
#endif
  quantise_plain(x, rows, k, codes, scale, scaled_sum);
}

// Rows [0, count) of `pair` (1 or 2) tiles side by side, `tile_bytes` apart, into out (16 floats a tile).
void tile_any(int64_t type, const uint8_t* tile, int64_t tile_bytes, int64_t pair, int64_t blocks,
              const Quantised* rows, int64_t count, float* out, int64_t stride) {
#if defined(__x86_64__)
  if (isa == kAvx512 && pair == 2) {
    if (type == kQ4) return tile_rows<kQ4, 4, 2, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
    if (type == kQ5) return tile_rows<kQ5, 4, 2, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
    return tile_rows<kQ8, 4, 2, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
  }
  if (isa == kAvx512) {
    if (type == kQ4) return tile_rows<kQ4, 8, 1, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
    if (type == kQ5) return tile_rows<kQ5, 8, 1, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
    return tile_rows<kQ8, 8, 1, Avx512>(tile, tile_bytes, blocks, rows, count, out, stride);
  }
  if (isa == kAvx2) {
    for (int64_t t = 0; t < pair; ++t) {
      const uint8_t* at = tile + t * tile_bytes;
      float* to = out + t * kTile;
      if (type == kQ4) {
        tile_rows<kQ4, 4, 1, Avx2>(at, tile_bytes, blocks, rows, count, to, stride);
      } else if (type == kQ5) {
        tile_rows<kQ5, 4, 1, Avx2>(at, tile_bytes, blocks, rows, count, to, stride);
      } else {
        tile_rows<kQ8, 4, 1, Avx2>(at, tile_bytes, blocks, rows, count, to, stride);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < pair; ++t) {
    tile_plain(tile + t * tile_bytes, type, blocks, rows, count, out + t * kTile, stride);
  }
}

// x [rows, k] float32 times the packed weights ([tiles, blocks, tile block bytes], uint8) of `n` output channels.
// The packed blocks' type, told by their size.
void product(const float* x, int64_t rows, int64_t k, const at::Tensor& weights, int64_t n, float* out) {
  TORCH_CHECK(weights.dim() == 3, "llmserve: packed blocks are [tiles, blocks, bytes]");
  const int64_t blocks = k / kBlock, tiles = weights.size(0);
  const int64_t bytes = weights.size(2);
  const int64_t type = bytes == tile_block_bytes(kQ4) ? kQ4 : bytes == tile_block_bytes(kQ5) ? kQ5 : kQ8;
  TORCH_CHECK(weights.scalar_type() == at::kByte && weights.is_contiguous() &&
                  weights.size(1) == blocks && weights.size(2) == tile_block_bytes(type) && tiles * kTile >= n &&
                  (tiles - 1) * kTile < n && k % kBlock == 0,
              "llmserve: packed blocks do not fit an input of ", k, " and ", n, " outputs");
  std::vector<int8_t> codes(rows * k);
  std::vector<float> scale(rows * blocks), scaled_sum(rows * blocks);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    quantise_rows(x + begin * k, end - begin, k, codes.data() + begin * k, scale.data() + begin * blocks,
                  scaled_sum.data() + begin * blocks);
  });
  std::vector<int8_t> biased(type == kQ8 && isa == kAvx512 ? rows * k : 0);  // VNNI's unsigned Q8_0 operand
  for (size_t i = 0; i < biased.size(); ++i) biased[i] = static_cast<int8_t>(codes[i] ^ 0x80);
  std::vector<Quantised> quantised(rows);
  for (int64_t r = 0; r < rows; ++r) {
    quantised[r] = {codes.data() + r * k, biased.empty() ? nullptr : biased.data() + r * k,
                    scale.data() + r * blocks, scaled_sum.data() + r * blocks};
  }
  const uint8_t* w = weights.data_ptr<uint8_t>();
  const int64_t tile_bytes = blocks * tile_block_bytes(type);
  at::parallel_for(0, tiles, 2, [&](int64_t begin, int64_t end) {
    std::vector<float> tile_out(rows * 2 * kTile);
    for (int64_t t = begin; t < end;) {
      const int64_t pair = std::min<int64_t>(rows >= kPairRows ? 2 : 1, end - t);
      tile_any(type, w + t * tile_bytes, tile_bytes, pair, blocks, quantised.data(), rows, tile_out.data(), 2 * kTile);
      const int64_t width = std::min(pair * kTile, n - t * kTile);
      for (int64_t r = 0; r < rows; ++r) {
        std::memcpy(out + r * n + t * kTile, tile_out.data() + r * 2 * kTile, width * sizeof(float));
      }
      t += pair;
    }
  });
}

// RMSNorm with its gain: x / sqrt(mean(x^2) + eps) * gain, row by row. The squares are summed in 16 fixed
// lanes, then the lanes in order: the same bits at any vector width.
__attribute__((target_clones("avx512f", "avx2", "default")))
void rms_norm(const float* x, const float* gain, int64_t rows, int64_t k, float eps, float* out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * k;
    float lanes[kTile] = {};
    for (int64_t i = 0; i < k; i += kTile) {
#pragma omp simd
      for (int64_t l = 0; l < kTile; ++l) lanes[l] += in[i + l] * in[i + l];
    }
    float squares = 0.0f;
    for (int64_t l = 0; l < kTile; ++l) squares += lanes[l];
    const float factor = 1.0f / std::sqrt(squares / static_cast<float>(k) + eps);
#pragma omp simd
    for (int64_t i = 0; i < k; ++i) out[r * k + i] = gain[i] * (in[i] * factor);
  }
}

at::Tensor linear_of(const float* x, int64_t rows, int64_t k, const at::Tensor& weights, int64_t n,
                     at::IntArrayRef leading, const at::TensorOptions& options) {
  std::vector<int64_t> shape(leading.begin(), leading.end());
  shape.push_back(n);
  at::Tensor out = at::empty(shape, options);
  product(x, rows, k, weights, n, out.data_ptr<float>());
  return out;
}

// input [..., k] float32 through the packed blocks (after RMSNorm with `gain`, when given): [..., n].
at::Tensor block_linear(const at::Tensor& input, const at::Tensor& weights, int64_t n,
                        const std::optional<at::Tensor>& gain, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && input.dim() >= 1, "llmserve::block_linear takes float32");
  const at::Tensor x = input.contiguous();
  const int64_t k = x.size(-1), rows = x.numel() / std::max<int64_t>(k, 1);
  if (!gain) return linear_of(x.data_ptr<float>(), rows, k, weights, n, x.sizes().slice(0, x.dim() - 1),
                              x.options());
  const at::Tensor g = gain->contiguous();
  TORCH_CHECK(g.scalar_type() == at::kFloat && g.numel() == k && k % kTile == 0,
              "llmserve::block_linear: a gain per input");
  std::vector<float> normed(rows * k);
  const float *in = x.data_ptr<float>(), *gains = g.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    rms_norm(in + begin * k, gains, end - begin, k, static_cast<float>(eps), normed.data() + begin * k);
  });
  return linear_of(normed.data(), rows, k, weights, n, x.sizes().slice(0, x.dim() - 1), x.options());
}

// The rest of a layer after attention: h = x + o_proj(attended), then h + down(silu(gate) * up) of the normed h.
at::Tensor block_mlp_residual(const at::Tensor& x, const at::Tensor& attended, const at::Tensor& o_proj,
                              const at::Tensor& gate_up, const at::Tensor& down_proj, int64_t inner,
                              const at::Tensor& gain, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              "llmserve::block_mlp_residual takes [tokens, width] float32");
  const int64_t rows = x.size(0), width = x.size(1);
  at::Tensor h = x + block_linear(attended, o_proj, width, std::nullopt, 0.0);
  at::Tensor gu = block_linear(h, gate_up, 2 * inner, gain, eps);
  at::Tensor mixed = at::empty({rows, inner}, x.options());
  llmserve::silu_mul_rows(gu.data_ptr<float>(), mixed.data_ptr<float>(), rows, inner, 0);
  return h.add_(block_linear(mixed, down_proj, width, std::nullopt, 0.0));
}

// A whole decoder layer over one ragged cache (worker/own/cache.py), in one call instead of a dozen from Python: x
// [rows, length, width] through RMSNorm and the fused q, k, v product, the rotary heads, the cache write and each
// row's attention, then o_proj, the MLP and both residuals. The same calls in the same order as the layer's
// Python forward (worker/weights/quant.py), so the same bits.
// Qwen 3's RMSNorm of each query and key head before the rotation, in place on the fused projection [tokens, n]:
// `gains` empty (no such norms) or the query heads' gain and the key heads'. transformers' arithmetic (x times the
// reciprocal root of its mean square plus eps, times the gain), to rounding: one loop a head, as a dozen ATen
// calls a layer cost a twelfth of a decode step.
void norm_heads(const at::Tensor& projected, at::TensorList gains, int64_t head_dim, int64_t q_heads, int64_t kv_heads,
                double eps) {
  if (gains.empty()) return;
  TORCH_CHECK(gains.size() == 2 && gains[0].is_contiguous() && gains[1].is_contiguous() &&
                  gains[0].numel() == head_dim && gains[1].numel() == head_dim && projected.is_contiguous(),
              "llmserve::block_layer: a query heads' gain and a key heads' gain of head_dim each, or none");
  const int64_t tokens = projected.size(0), width = projected.size(1);
  const float* gain_of[2] = {gains[0].data_ptr<float>(), gains[1].data_ptr<float>()};
  float* base = projected.data_ptr<float>();
  const float epsilon = static_cast<float>(eps);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < q_heads + kv_heads; ++h) {
        float* x = base + t * width + h * head_dim;
        const float* gain = gain_of[h < q_heads ? 0 : 1];
        float squares = 0.0f;
        for (int64_t i = 0; i < head_dim; ++i) squares += x[i] * x[i];
        const float scale = 1.0f / std::sqrt(squares / static_cast<float>(head_dim) + epsilon);
        for (int64_t i = 0; i < head_dim; ++i) x[i] = x[i] * scale * gain[i];
      }
    }
  });
}

at::Tensor block_layer(const at::Tensor& x, const at::Tensor& qkv, int64_t qkv_n,
                       const std::optional<at::Tensor>& qkv_bias, at::TensorList head_norms,
                       const at::Tensor& input_gain,
                       const at::Tensor& o_proj, const at::Tensor& gate_up, const at::Tensor& down_proj, int64_t inner,
                       const at::Tensor& post_gain, double eps, int64_t head_dim, int64_t q_heads, int64_t kv_heads,
                       const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList key_buffers,
                       at::TensorList value_buffers, at::IntArrayRef lengths, double scaling) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat, "llmserve::block_layer takes [rows, length, width]");
  const int64_t rows = x.size(0), length = x.size(1), width = x.size(2);
  const at::Tensor flat = x.contiguous().view({rows * length, width});
  at::Tensor projected = block_linear(flat, qkv, qkv_n, input_gain, eps);
  if (qkv_bias) projected.add_(*qkv_bias);  // Qwen 2's biases on q, k and v
  norm_heads(projected, head_norms, head_dim, q_heads, kv_heads, eps);
  auto [query, key, value] =
      llmserve::rotary_heads(projected, rows, length, head_dim, q_heads, kv_heads, cos, signed_sin);
  const at::Tensor attended =
      llmserve::write_and_attend_rows(query, key_buffers, value_buffers, lengths, key, value, scaling);
  return block_mlp_residual(flat, attended.reshape({rows * length, -1}), o_proj, gate_up, down_proj, inner, post_gain,
                            eps)
      .view({rows, length, width});
}

// Every decoder layer of the stack in turn, in one call from Python instead of one a layer: block_layer over layer
// l's weights and its rows' buffers (key_buffers and value_buffers hold every layer's rows, layer after layer). The
// same calls in the same order, so the same bits as the layers called one by one.
at::Tensor block_layers(const at::Tensor& x, at::TensorList qkv, int64_t qkv_n, at::TensorList qkv_biases,
                        at::TensorList head_norms, at::TensorList input_gains,
                        at::TensorList o_proj, at::TensorList gate_up, at::TensorList down_proj, int64_t inner,
                        at::TensorList post_gains, double eps, int64_t head_dim, int64_t q_heads, int64_t kv_heads,
                        const at::Tensor& cos, const at::Tensor& signed_sin, at::TensorList key_buffers,
                        at::TensorList value_buffers, at::IntArrayRef lengths, double scaling) {
  const size_t layers = qkv.size(), rows = lengths.size();
  for (const at::TensorList& weights : {input_gains, o_proj, gate_up, down_proj, post_gains}) {
    TORCH_CHECK(weights.size() == layers, "llmserve::block_layers: one of each weight a layer");
  }
  TORCH_CHECK(qkv_biases.empty() || qkv_biases.size() == layers, "llmserve::block_layers: a bias a layer, or none");
  TORCH_CHECK(head_norms.empty() || head_norms.size() == 2 * layers,
              "llmserve::block_layers: two head norms a layer, or none");
  TORCH_CHECK(key_buffers.size() == layers * rows && value_buffers.size() == layers * rows,
              "llmserve::block_layers: each layer's buffers for every row");
  at::Tensor hidden = x;
  for (size_t l = 0; l < layers; ++l) {
    const std::optional<at::Tensor> bias =
        qkv_biases.empty() ? std::nullopt : std::optional<at::Tensor>(qkv_biases[l]);
    const at::TensorList norms = head_norms.empty() ? head_norms : head_norms.slice(2 * l, 2);
    hidden = block_layer(hidden, qkv[l], qkv_n, bias, norms, input_gains[l], o_proj[l], gate_up[l], down_proj[l], inner,
                         post_gains[l], eps, head_dim, q_heads, kv_heads, cos, signed_sin,
                         key_buffers.slice(l * rows, rows), value_buffers.slice(l * rows, rows), lengths, scaling);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmserve, m) {
  m.def("block_linear(Tensor x, Tensor weights, int n, Tensor? gain, float eps) -> Tensor", &block_linear);
  m.def("block_mlp_residual(Tensor x, Tensor attended, Tensor o_proj, Tensor gate_up, Tensor down_proj, int inner, "
        "Tensor gain, float eps) -> Tensor",
        &block_mlp_residual);
  m.def("block_isa(int most) -> int", &block_isa);
  m.def("block_layer(Tensor x, Tensor qkv, int qkv_n, Tensor? qkv_bias, Tensor[] head_norms, Tensor input_gain, "
        "Tensor o_proj, Tensor gate_up, Tensor down_proj, int inner, Tensor post_gain, float eps, int head_dim, "
        "int q_heads, int kv_heads, Tensor cos, Tensor signed_sin, Tensor[] key_buffers, Tensor[] value_buffers, "
        "int[] lengths, float scaling) -> Tensor",
        &block_layer);
  m.def("block_layers(Tensor x, Tensor[] qkv, int qkv_n, Tensor[] qkv_biases, Tensor[] head_norms, "
        "Tensor[] input_gains, Tensor[] o_proj, Tensor[] gate_up, Tensor[] down_proj, int inner, "
        "Tensor[] post_gains, float eps, int head_dim, int q_heads, int kv_heads, Tensor cos, Tensor signed_sin, "
        "Tensor[] key_buffers, Tensor[] value_buffers, int[] lengths, float scaling) -> Tensor",
        &block_layers);
}
