// 1-D 7-point stencil with a shared-memory halo. Idempotent.
#define R 3
#define BS 256
extern "C" __global__ void stencil_1d(const float* in, float* out, int n) {
    __shared__ float tile[BS + 2 * R];
    int g = blockIdx.x * blockDim.x + threadIdx.x;
    int l = threadIdx.x + R;
    tile[l] = (g < n) ? in[g] : 0.0f;
    if (threadIdx.x < R) {
        tile[l - R] = (g >= R && g - R < n) ? in[g - R] : 0.0f;
        tile[l + BS] = (g + BS < n) ? in[g + BS] : 0.0f;
    }
    __syncthreads();
    if (g < n) {
        float s = 0.0f;
        for (int k = -R; k <= R; ++k) s += tile[l + k];
        out[g] = s;
    }
}
