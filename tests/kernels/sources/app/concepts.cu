// Needs -std=c++20 (a concept constrains the template).
#include <concepts>

template <typename T>
concept Number = std::floating_point<T> || std::integral<T>;

template <Number T>
__global__ void square(const T* in, T* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = in[i] * in[i];
}

template __global__ void square<float>(const float*, float*, int);
