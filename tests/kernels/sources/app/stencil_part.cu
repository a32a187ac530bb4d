// Included by stencil_main.cu, which defines `real` first: it does not compile alone.
__global__ void smooth(const real* in, real* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > 0 && i < n - 1) out[i] = (in[i - 1] + in[i] + in[i + 1]) / 3;
}
