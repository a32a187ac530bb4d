// Buffers reached through pointers: a table of row pointers in device memory (the
// analysis cannot name those buffers) and a by-value struct of pointers (it can: each
// field is named by its byte offset in the struct).
__global__ void gather_rows(float* const* rows, const int* picks, float* out, int cols,
                            int n) {
  int r = blockIdx.x;
  if (r >= n) return;
  const float* src = rows[picks[r]];
  float* dst = rows[r];
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    out[r * cols + c] = src[c];
    dst[c] = 0.0f;
  }
}

struct Batch {
  const float* inputs[4];
  float* outputs[4];
};

__global__ void batched_scale(Batch batch, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
#pragma unroll
  for (int k = 0; k < 4; ++k) batch.outputs[k][i] = a * batch.inputs[k][i];
}
