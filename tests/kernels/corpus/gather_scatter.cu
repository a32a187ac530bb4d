// dst[i] = src[idx[i]]: reads src and idx, writes dst. Idempotent.
extern "C" __global__ void gather(const float* src, const int* idx, float* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[idx[i]];
}
// dst[idx[i]] = src[i] (idx a permutation): writes through an index array. Idempotent.
extern "C" __global__ void scatter(const float* src, const int* idx, float* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[idx[i]] = src[i];
}
// dst[idx[i]] += src[i] with atomics. Not idempotent.
extern "C" __global__ void scatter_add(const int* src, const int* idx, int* dst, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) atomicAdd(&dst[idx[i]], src[i]);
}
