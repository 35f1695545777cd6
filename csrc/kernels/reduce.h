// Elementwise reductions: the arithmetic behind every collective's reduce step.
#pragma once

#include <cstdint>

#include "dtypes.h"

namespace collectives {

// Codes are part of the Python interface (collectives/ops.py keeps the same table).
// Average is not here: it is a Sum followed by one divide().
enum class ReduceOp : int { sum = 0, min = 1, max = 2, prod = 3 };

// dst[i] = srcs[0][i] op srcs[1][i] op ... op srcs[nsrc-1][i], folded left to right.
// dst may be srcs[0]; no other overlap is allowed. Integers wrap (two's complement),
// half types round to nearest even after every op, Min/Max propagate NaN.
void reduce_many(void* dst, const void* const* srcs, int nsrc, int64_t count, DType dtype,
                 ReduceOp op);

// buf[i] /= divisor: correctly rounded for floats, floor division for integers.
void divide(void* buf, int64_t count, DType dtype, int64_t divisor);

}  // namespace collectives
