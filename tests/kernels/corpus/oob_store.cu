// Writes a[i] = 1 and, from thread 0 of block 0, plants a store `bad` elements past the end.
extern "C" __global__ void oob_store(float* a, int n, int bad) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) a[i] = 1.0f;
    if (i == 0) a[n + bad] = 42.0f;
}
