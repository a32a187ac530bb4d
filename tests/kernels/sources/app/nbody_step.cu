// A whole program, as projects ship them: host code, main(), error checks, system
// and toolkit headers, kernels launched with <<<...>>>.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <vector>
#include <cuda_runtime.h>

#define CUDA_CHECK(call)                                                        \
  do {                                                                          \
    cudaError_t err_ = (call);                                                  \
    if (err_ != cudaSuccess) {                                                  \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__,                   \
                   cudaGetErrorString(err_));                                   \
      std::exit(1);                                                             \
    }                                                                           \
  } while (0)

struct Body {
  float x, y, z, mass;
};

// Reads every body, writes one acceleration per body: safe to re-run.
__global__ void compute_forces(const Body* bodies, float3* accel, int n, float softening) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  Body me = bodies[i];
  float3 a = make_float3(0.f, 0.f, 0.f);
  for (int j = 0; j < n; ++j) {
    Body other = bodies[j];
    float dx = other.x - me.x, dy = other.y - me.y, dz = other.z - me.z;
    float inv = rsqrtf(dx * dx + dy * dy + dz * dz + softening);
    float s = other.mass * inv * inv * inv;
    a.x += dx * s;
    a.y += dy * s;
    a.z += dz * s;
  }
  accel[i] = a;
}

// Moves the bodies in place: a re-run would move them twice.
__global__ void integrate(Body* bodies, float3* velocity, const float3* accel, float dt, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  velocity[i].x += accel[i].x * dt;
  velocity[i].y += accel[i].y * dt;
  velocity[i].z += accel[i].z * dt;
  bodies[i].x += velocity[i].x * dt;
  bodies[i].y += velocity[i].y * dt;
  bodies[i].z += velocity[i].z * dt;
}

int main(int argc, char** argv) {
  int n = argc > 1 ? std::atoi(argv[1]) : 4096;
  std::vector<Body> host(n);
  for (int i = 0; i < n; ++i) host[i] = Body{float(i), float(i % 7), float(i % 13), 1.0f};
  Body* bodies;
  float3 *velocity, *accel;
  CUDA_CHECK(cudaMalloc(&bodies, n * sizeof(Body)));
  CUDA_CHECK(cudaMalloc(&velocity, n * sizeof(float3)));
  CUDA_CHECK(cudaMalloc(&accel, n * sizeof(float3)));
  CUDA_CHECK(cudaMemcpy(bodies, host.data(), n * sizeof(Body), cudaMemcpyHostToDevice));
  CUDA_CHECK(cudaMemset(velocity, 0, n * sizeof(float3)));
  int threads = 256, blocks = (n + threads - 1) / threads;
  for (int step = 0; step < 10; ++step) {
    compute_forces<<<blocks, threads>>>(bodies, accel, n, 1e-3f);
    integrate<<<blocks, threads>>>(bodies, velocity, accel, 0.01f, n);
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  std::cout << "done" << std::endl;
  return 0;
}
