// Reading back what the same thread wrote is not a re-run hazard; reading first is.
__global__ void two_pass(float* out, const float* a, float* scratch, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[i] = a[i];
  scratch[i] = 2.0f * a[i];   // may alias out: the compiler reads out[i] back below
  out[i] = out[i] + scratch[i];
}

__global__ void maybe_then_read(float* out, const float* a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (a[i] > 0.f) out[i] = a[i];  // not on every path: the read below may see old data
  out[i] = out[i] * 2.0f;
}
