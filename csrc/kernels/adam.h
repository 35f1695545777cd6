// Adam's parameter update from known moments, in one pass (OnebitAdam's step after the
// freeze, optim/onebit_adam.py): the moments are read, the parameters written, nothing else.
#pragma once

#include <cstdint>

namespace collectives {

// For each i, every operation rounded to float32 (no FMA):
//   d = sqrt(v[i]) / sqrt_c2 + eps
//   u = (m[i] / c1) / d, clamped to [-bound, bound] (a NaN stays NaN; bound may be inf)
//   p[i] = p[i] * decay - lr * u
// sqrt_c2 and c1 are Adam's bias corrections (1: none), decay 1 - lr * weight_decay.
void adam_update(float* p, const float* m, const float* v, int64_t count, float lr, float c1,
                 float sqrt_c2, float eps, float decay, float bound);

}  // namespace collectives
