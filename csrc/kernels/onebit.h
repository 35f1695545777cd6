// 1-bit compression with error feedback (the compressor of DeepSpeed's 1-bit Adam): each
// element travels as its sign, and a block of elements shares one magnitude.
//
// Format: bits holds (count + 7) / 8 bytes; element i is bit 7 - i % 8 of byte i / 8 (MSB
// first, as numpy.packbits); 1 means +scale, 0 means -scale; pad bits of the last byte are
// 0. Element i uses scales[i / block]; block >= count means one scale for the whole vector.
#pragma once

#include <cstdint>

namespace collectives {

// c = x + error; bit i = (c[i] >= 0); scales[b] = ||c over block b||_2 / sqrt(len(block b));
// error = c - decompress(bits, scales): what was lost is added back next time.
// An all-zero block gets scale 0 and error 0. A NaN in c has bit 0 and makes its block's
// scale NaN, so the block decompresses to NaN and its error becomes NaN: a non-finite
// gradient is reported, not hidden (check gradients first, as loss scalers do). +-inf
// likewise gives scale inf and a non-finite error.
void onebit_compress(const float* x, float* error, uint8_t* bits, float* scales,
                     int64_t count, int64_t block);

// out[i] = bit i ? scales[i / block] : -scales[i / block]
void onebit_decompress(const uint8_t* bits, const float* scales, float* out, int64_t count,
                       int64_t block);

// acc[i] += decompress(bits[k], scales[k])[i] for k = 0, 1, ..., n - 1 in that order,
// without materializing any decompressed chunk (the server side of compressed allreduce).
void onebit_accumulate(float* acc, const uint8_t* const* bits, const float* const* scales,
                       int n, int64_t count, int64_t block);

// The server step of compressed allreduce in one pass: acc = accumulate(bits, scales) from
// zeros, then onebit_compress(acc, error, out_bits, out_scales, count, block), with the same
// bits and scales as those two calls. acc lives tile by tile in L1 where every block fits
// one tile (block divides the tile, or count fits one); otherwise it is materialized.
void onebit_serve(const uint8_t* const* bits, const float* const* scales, int n, float* error,
                  uint8_t* out_bits, float* out_scales, int64_t count, int64_t block);

}  // namespace collectives
