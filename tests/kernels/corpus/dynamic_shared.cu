// Reverse each block's slice through dynamic shared memory. Idempotent.
extern "C" __global__ void reverse_blocks(const int* in, int* out, int n) {
    extern __shared__ int s[];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    s[threadIdx.x] = (i < n) ? in[i] : 0;
    __syncthreads();
    int j = blockIdx.x * blockDim.x + (blockDim.x - 1 - threadIdx.x);
    if (j < n) out[j] = s[threadIdx.x];
}
