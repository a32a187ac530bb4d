// y = x*x with a grid-stride loop (uses gridDim). Idempotent.
extern "C" __global__ void grid_stride_square(const float* x, float* y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += blockDim.x * gridDim.x)
        y[i] = x[i] * x[i];
}
