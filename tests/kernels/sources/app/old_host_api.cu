// Written for an older CUDA: the host code calls what CUDA 13 removed, the kernels are
// fine.
#include <cstdio>
#include <cuda_runtime.h>

__global__ void relu_inplace(float* x, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && x[i] < 0.f) x[i] = 0.f;
}

__device__ float square(float v) { return v * v; }

__global__ void squares(const float* in, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = square(in[i]);
}

extern "C"
void run(float* x, float* y, int n)
{
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  if (prop.deviceOverlap) std::printf("overlap\n");
  relu_inplace<<<(n + 255) / 256, 256>>>(x, n);
  squares<<<(n + 255) / 256, 256>>>(x, y, n);
  cudaThreadSynchronize();
}
