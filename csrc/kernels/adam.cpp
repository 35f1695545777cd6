// See adam.h. A branch-free loop GCC/Clang vectorize at -O3 (sqrtps, divps: correctly
// rounded, as the scalar forms); memory bound: 3 reads and a write per element.
#include "adam.h"

#include <cmath>

namespace collectives {

void adam_update(float* __restrict__ p, const float* __restrict__ m,
                 const float* __restrict__ v, int64_t count, float lr, float c1, float sqrt_c2,
                 float eps, float decay, float bound) {
  for (int64_t i = 0; i < count; ++i) {
    const float d = std::sqrt(v[i]) / sqrt_c2 + eps;
    float u = (m[i] / c1) / d;
    u = u < -bound ? -bound : u;
    u = u > bound ? bound : u;
    const float step = lr * u;
    p[i] = p[i] * decay - step;
  }
}

}  // namespace collectives
