// 1-bit kernels. Work goes tile by tile (kTile elements, a multiple of 8 so tiles start on
// a byte of bits): the tile's c or signs sit in an L1 array while branch-free loops, which
// GCC/Clang vectorize at -O3, turn them into bits, errors or sums.
//
// compress needs every scale of a block before it can write that block's error, so it
// makes two passes (sum of squares, then bits and error) over chunks of whole blocks small
// enough (kChunk) that the second pass reads x and error from L2, not memory; with one
// scale for the whole vector the chunk is the vector.
//
// The four kernels are also built for AVX2 (COLLECTIVES_CLONES): the tile loops work in L1,
// where the wider vectors pay (decompress about 2x, serve 1.5x; benchmarks/kernels.py).
#include "onebit.h"

#include "clones.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace collectives {
namespace {

constexpr int64_t kTile = 2048;
constexpr int64_t kChunk = 16384;

// sum of (x + e)^2 in double, in 8 fixed lanes: vectorizable, and the same order every run.
double sum_squares(const float* __restrict__ x, const float* __restrict__ e, int64_t n) {
  double lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) {
      const double c = x[i + j] + e[i + j];
      lane[j] += c * c;
    }
  }
  for (; i < n; ++i) {
    const double c = x[i] + e[i];
    lane[0] += c * c;
  }
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

// bits of c[0:n] (c starts on a byte); a partial last byte is padded with 0.
void pack_signs(const float* __restrict__ c, uint8_t* __restrict__ bits, int64_t n) {
  const int64_t full = n / 8;
  for (int64_t k = 0; k < full; ++k) {
    uint32_t b = 0;
    for (int j = 0; j < 8; ++j) b |= static_cast<uint32_t>(c[8 * k + j] >= 0.0f) << (7 - j);
    bits[k] = static_cast<uint8_t>(b);
  }
  if (n % 8 != 0) {
    uint32_t b = 0;
    for (int j = 0; j < n % 8; ++j) b |= static_cast<uint32_t>(c[8 * full + j] >= 0.0f) << (7 - j);
    bits[full] = static_cast<uint8_t>(b);
  }
}

// sgn[0:n] = +1 / -1 from bits (starting on a byte).
void expand_signs(const uint8_t* __restrict__ bits, float* __restrict__ sgn, int64_t n) {
  const int64_t full = n / 8;
  for (int64_t k = 0; k < full; ++k) {
    const uint32_t b = bits[k];
    for (int j = 0; j < 8; ++j) sgn[8 * k + j] = (b & (0x80u >> j)) ? 1.0f : -1.0f;
  }
  for (int64_t i = 8 * full; i < n; ++i) sgn[i] = (bits[full] & (0x80u >> (i % 8))) ? 1.0f : -1.0f;
}

// f(lo, hi, b) for each run [lo, hi) of [begin, end) that lies in one block b.
template <typename F>
void for_each_block(int64_t begin, int64_t end, int64_t block, F f) {
  for (int64_t lo = begin; lo < end;) {
    const int64_t b = lo / block;
    const int64_t hi = std::min(end, (b + 1) * block);
    f(lo, hi, b);
    lo = hi;
  }
}

// Chunk length for the two compress passes: whole blocks, a multiple of 8 elements.
int64_t chunk_length(int64_t block) {
  const int64_t blocks = (std::max<int64_t>(1, kChunk / block) + 7) / 8 * 8;
  return blocks * block;
}

void add(const float* __restrict__ x, const float* __restrict__ e, float* __restrict__ c,
         int64_t n) {
  for (int64_t i = 0; i < n; ++i) c[i] = x[i] + e[i];
}

void update_error(const float* __restrict__ c, float* __restrict__ e, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) e[i] = c[i] - (c[i] >= 0.0f ? s : -s);
}

void scale_signs(const float* __restrict__ sgn, float* __restrict__ out, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) out[i] = sgn[i] * s;
}

void add_scaled_signs(const float* __restrict__ sgn, float* __restrict__ acc, int64_t n,
                      float s) {
  for (int64_t i = 0; i < n; ++i) acc[i] += sgn[i] * s;  // sgn * s is exact: = acc +- s
}

}  // namespace

COLLECTIVES_CLONES
void onebit_compress(const float* x, float* error, uint8_t* bits, float* scales,
                     int64_t count, int64_t block) {
  block = std::min(block, std::max<int64_t>(count, 1));
  const int64_t chunk = block == count ? count : chunk_length(block);
  for (int64_t lo = 0; lo < count; lo += chunk) {
    const int64_t hi = std::min(count, lo + chunk);
    for_each_block(lo, hi, block, [&](int64_t a, int64_t z, int64_t b) {
      const double len = static_cast<double>(z - a);
      scales[b] = static_cast<float>(std::sqrt(sum_squares(x + a, error + a, z - a) / len));
    });
    for (int64_t t = lo; t < hi; t += kTile) {
      const int64_t n = std::min(kTile, hi - t);
      float c[kTile];
      add(x + t, error + t, c, n);
      pack_signs(c, bits + t / 8, n);
      for_each_block(t, t + n, block, [&](int64_t a, int64_t z, int64_t b) {
        update_error(c + (a - t), error + a, z - a, scales[b]);
      });
    }
  }
}

COLLECTIVES_CLONES
void onebit_decompress(const uint8_t* bits, const float* scales, float* out, int64_t count,
                       int64_t block) {
  block = std::min(block, std::max<int64_t>(count, 1));
  for (int64_t t = 0; t < count; t += kTile) {
    const int64_t n = std::min(kTile, count - t);
    float sgn[kTile];
    expand_signs(bits + t / 8, sgn, n);
    for_each_block(t, t + n, block, [&](int64_t a, int64_t z, int64_t b) {
      scale_signs(sgn + (a - t), out + a, z - a, scales[b]);
    });
  }
}

COLLECTIVES_CLONES
void onebit_accumulate(float* acc, const uint8_t* const* bits, const float* const* scales,
                       int n, int64_t count, int64_t block) {
  block = std::min(block, std::max<int64_t>(count, 1));
  for (int64_t t = 0; t < count; t += kTile) {
    const int64_t len = std::min(kTile, count - t);
    float sgn[kTile];
    for (int k = 0; k < n; ++k) {
      expand_signs(bits[k] + t / 8, sgn, len);
      for_each_block(t, t + len, block, [&](int64_t a, int64_t z, int64_t b) {
        add_scaled_signs(sgn + (a - t), acc + a, z - a, scales[k][b]);
      });
    }
  }
}

COLLECTIVES_CLONES
void onebit_serve(const uint8_t* const* bits, const float* const* scales, int n, float* error,
                  uint8_t* out_bits, float* out_scales, int64_t count, int64_t block) {
  block = std::min(block, std::max<int64_t>(count, 1));
  if (kTile % block != 0 && count > kTile) {  // a block would span tiles
    std::vector<float> acc(static_cast<size_t>(count), 0.0f);
    onebit_accumulate(acc.data(), bits, scales, n, count, block);
    return onebit_compress(acc.data(), error, out_bits, out_scales, count, block);
  }
  for (int64_t t = 0; t < count; t += kTile) {
    const int64_t len = std::min(kTile, count - t);
    float acc[kTile], sgn[kTile], c[kTile];
    std::fill(acc, acc + len, 0.0f);
    for (int k = 0; k < n; ++k) {
      expand_signs(bits[k] + t / 8, sgn, len);
      for_each_block(t, t + len, block, [&](int64_t a, int64_t z, int64_t b) {
        add_scaled_signs(sgn + (a - t), acc + (a - t), z - a, scales[k][b]);
      });
    }
    for_each_block(t, t + len, block, [&](int64_t a, int64_t z, int64_t b) {
      const double m = static_cast<double>(z - a);
      out_scales[b] =
          static_cast<float>(std::sqrt(sum_squares(acc + (a - t), error + a, z - a) / m));
    });
    add(acc, error + t, c, len);
    pack_signs(c, out_bits + t / 8, len);
    for_each_block(t, t + len, block, [&](int64_t a, int64_t z, int64_t b) {
      update_error(c + (a - t), error + a, z - a, out_scales[b]);
    });
  }
}

}  // namespace collectives
