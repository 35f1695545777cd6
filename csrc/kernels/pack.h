// Fusion-buffer packing: many tensors copied into one contiguous buffer (and back) in a
// single call, multiplied by a scale on the way (gradient pre/post-division for free).
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace collectives {

// dst = concat(srcs[0][:counts[0]], ..., srcs[n-1][:counts[n-1]]) * scale.
// scale != 1 is for floating dtypes only (the caller checks); half types multiply in
// float32 and round to nearest even once. No buffer may overlap another.
void pack(void* dst, const void* const* srcs, const int64_t* counts, int n, DType dtype,
          double scale);

// dsts[k][:counts[k]] = src[offset_k : offset_k + counts[k]] * scale, where offset_k is
// counts[0] + ... + counts[k-1]: the inverse of pack.
void unpack(const void* src, void* const* dsts, const int64_t* counts, int n, DType dtype,
            double scale);

}  // namespace collectives
