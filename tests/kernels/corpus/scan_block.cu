// Inclusive Hillis-Steele scan of each 256-element block (barriers in a loop). Idempotent.
extern "C" __global__ void block_scan(const int* in, int* out, int n) {
    __shared__ int buf[2][256];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int t = threadIdx.x;
    int cur = 0;
    buf[0][t] = (i < n) ? in[i] : 0;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        int v = buf[cur][t];
        if (t >= off) v += buf[cur][t - off];
        buf[1 - cur][t] = v;
        cur = 1 - cur;
        __syncthreads();
    }
    if (i < n) out[i] = buf[cur][t];
}
