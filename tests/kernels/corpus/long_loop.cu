// A per-thread loop of `iters` dependent FMAs (long logical blocks, for abort mode).
extern "C" __global__ void long_loop(const float* x, float* y, int n, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
    y[i] = v;
}
// The same, updating x in place: needs a snapshot.
extern "C" __global__ void long_loop_inplace(float* x, int n, int iters) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    for (int k = 0; k < iters; ++k) v = v * 0.999f + 0.001f;
    x[i] = v;
}
