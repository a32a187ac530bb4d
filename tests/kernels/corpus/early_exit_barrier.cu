// Returns before a barrier for some threads: the persistent transform must refuse it.
extern "C" __global__ void early_exit_barrier(const float* x, float* y, int n) {
    __shared__ float s[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    s[threadIdx.x] = x[i];
    __syncthreads();
    y[i] = s[255 - threadIdx.x];
}
