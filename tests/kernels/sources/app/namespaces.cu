// Namespaced kernels (one name in two namespaces), comments and line breaks inside
// signatures, __restrict__ and attributes.
namespace physics {
namespace fluid {

__global__ void step(const float* __restrict__ density /* kg/m^3 */,
                     float* __restrict__ pressure,  // Pa, written
                     float k, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) pressure[i] = k * density[i];
}

}  // namespace fluid

namespace solid {

__global__ void step(float* /* in and out */ stress, const float* strain, float modulus,
                     int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) stress[i] = stress[i] + modulus * strain[i];
}

}  // namespace solid
}  // namespace physics

namespace {
__global__ void __launch_bounds__(128, 2)
    tally(unsigned int* __restrict__ bins,  /* one per bucket */
          const int* __restrict__ values,
          int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) atomicAdd(&bins[values[i] & 63], 1u);
}
}  // namespace

void launch_tally(unsigned int* bins, const int* values, int n) {
  tally<<<(n + 127) / 128, 128>>>(bins, values, n);
}
