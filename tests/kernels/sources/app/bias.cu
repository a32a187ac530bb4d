// Macros set with -D change the signature and the body.
#ifndef BLOCK
#define BLOCK 256
#endif

__global__ void __launch_bounds__(BLOCK) dense(const float* x,
                                               const float* w,
#ifdef WITH_BIAS
                                               const float* bias,
#endif
                                               float* y, int rows, int cols) {
  int r = blockIdx.x * BLOCK + threadIdx.x;
  if (r >= rows) return;
  float acc = 0.f;
  for (int c = 0; c < cols; ++c) acc += w[r * cols + c] * x[c];
#ifdef WITH_BIAS
  acc += bias[r];
#endif
#if ACCUMULATE
  y[r] += acc;
#else
  y[r] = acc;
#endif
}
