// Found only through -I include (not next to the file that includes it).
#pragma once

__device__ __forceinline__ float scale_to_unit(float v, float lo, float hi) {
  return (v - lo) / (hi - lo);
}
