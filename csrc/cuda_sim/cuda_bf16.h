// BF16 of the emulated device (Note [CUDA emulation] in cuda_sim.h): the storage type and
// the conversions the kernels use, bit-exact (a BF16 value is the top half of an FP32).
#pragma once
#include <cstdint>

#include "cuda_sim.h"

struct __nv_bfloat16 {
  uint16_t bits;
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short b) {
  return __nv_bfloat16{static_cast<uint16_t>(b)};
}

inline float __bfloat162float(__nv_bfloat16 h) {
  return __uint_as_float(static_cast<uint32_t>(h.bits) << 16);
}
