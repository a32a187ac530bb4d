// gpushare: stand-ins for the texture references CUDA 12 removed, force-included only
// to analyse the kernels of a file that still declares them (never to run anything).
// A fetch reads through a pointer loaded from memory, which the analysis cannot tie
// to a parameter: a kernel that fetches from a texture is classified "unknown", since
// the texture may be bound to a buffer the kernel also writes.
#pragma once
#include <cuda_runtime.h>

__device__ const void* __gpushare_texture_memory;

template <class T, int dim = 1, enum cudaTextureReadMode mode = cudaReadModeElementType>
struct texture {
  typedef T texel_type;
  int normalized;
  enum cudaTextureFilterMode filterMode;
  enum cudaTextureAddressMode addressMode[3];
  struct cudaChannelFormatDesc channelDesc;
};

template <class T>
__device__ __forceinline__ T __gpushare_texture_fetch(long long i) {
  return static_cast<const T*>(__gpushare_texture_memory)[i];
}

// decltype only: the texture itself is a host variable, which device code cannot read.
#define tex1Dfetch(t, x) __gpushare_texture_fetch<decltype(t)::texel_type>((long long)(x))
#define tex1D(t, x) __gpushare_texture_fetch<decltype(t)::texel_type>((long long)(x))
#define tex2D(t, x, y) \
  __gpushare_texture_fetch<decltype(t)::texel_type>((long long)(x) + ((long long)(y) << 20))
#define tex3D(t, x, y, z)                                                              \
  __gpushare_texture_fetch<decltype(t)::texel_type>((long long)(x) + ((long long)(y) << 20) + \
                                                    ((long long)(z) << 40))
