// Early return for out-of-range threads, then a clamp. Idempotent.
extern "C" __global__ void clamp_copy(const float* x, float* y, int n, float lo, float hi) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    if (v < lo) { y[i] = lo; return; }
    y[i] = v > hi ? hi : v;
}
