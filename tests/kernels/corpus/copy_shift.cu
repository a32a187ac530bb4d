// dst = src + 1. Idempotent unless src and dst overlap at launch (then in place).
extern "C" __global__ void copy_shift(const float* src, float* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i] + 1.0f;
}
