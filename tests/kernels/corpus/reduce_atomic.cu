// Block tree reduction in shared memory, then one atomicAdd per block into *total.
// Not idempotent: a re-run would add twice.
extern "C" __global__ void reduce_sum(const int* x, int* total, int n) {
    __shared__ int s[256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = (i < n) ? x[i] : 0;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) atomicAdd(total, s[0]);
}
