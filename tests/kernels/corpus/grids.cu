// 2-D grid: b = a + row index. Idempotent.
extern "C" __global__ void add_rows_2d(const float* a, float* b, int w, int h) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    if (x < w && y < h) b[y * w + x] = a[y * w + x] + (float)y;
}
// 3-D grid: out[z][y][x] encodes its block coordinates. Idempotent.
extern "C" __global__ void fill_3d(int* out, int nx, int ny, int nz) {
    int x = blockIdx.x * blockDim.x + threadIdx.x;
    int y = blockIdx.y * blockDim.y + threadIdx.y;
    int z = blockIdx.z * blockDim.z + threadIdx.z;
    if (x < nx && y < ny && z < nz)
        out[(z * ny + y) * nx + x] = x + 1000 * y + 1000000 * z + gridDim.x + 7 * gridDim.y + 13 * gridDim.z;
}
