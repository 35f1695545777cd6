// Adam's parameter update from known moments on the GPU, one thread per element; the same
// operations and roundings as csrc/kernels/adam.h (each one a PTX instruction rounding to
// nearest even: ieee.cuh), so host and device give the same bits.
#include "ieee.cuh"

extern "C" __global__ void adam_update(float* p, const float* m, const float* v, long long n,
                                       float lr, float c1, float sqrt_c2, float eps,
                                       float decay, float bound) {
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
       i += (long long)gridDim.x * blockDim.x) {
    const float d = add_f32(div_f32(sqrt_f32(v[i]), sqrt_c2), eps);
    float u = div_f32(div_f32(m[i], c1), d);
    u = lt_f32(u, neg_f32(bound)) ? neg_f32(bound) : u;
    u = gt_f32(u, bound) ? bound : u;
    p[i] = sub_f32(mul_f32(p[i], decay), mul_f32(lr, u));
  }
}
