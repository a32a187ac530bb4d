// Quoted includes: one relative to this file, one found through -I.
#include "../common/vec_helpers.cuh"
#include "scaling.cuh"

__global__ void normalize(const float* in, float* out, float lo, float hi, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = scale_to_unit(in[i], lo, hi);
}

__global__ void clamp_inplace(float* data, float lo, float hi, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) data[i] = clampf(data[i], lo, hi);
}
