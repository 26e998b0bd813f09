// FP16 of the emulated device (Note [CUDA emulation] in cuda_sim.h): the storage type and
// the conversions the kernels use, bit-exact (every FP16 value is an FP32 value).
#pragma once
#include <cstdint>

#include "cuda_sim.h"

struct __half {
  uint16_t bits;
};

inline __half __ushort_as_half(unsigned short b) { return __half{static_cast<uint16_t>(b)}; }

inline float __half2float(__half h) {
  const uint32_t sign = static_cast<uint32_t>(h.bits & 0x8000u) << 16;
  const uint32_t exp = (h.bits >> 10) & 0x1Fu;
  uint32_t mant = h.bits & 0x3FFu;
  uint32_t out;
  if (exp == 0x1Fu) {  // inf, or NaN made quiet with its payload, as cvt.f32.f16
    out = sign | 0x7F800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u);
  } else if (exp != 0) {
    out = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    out = sign;
  } else {  // subnormal: normalize
    uint32_t e = 113u;
    while ((mant & 0x400u) == 0) {
      mant <<= 1;
      --e;
    }
    out = sign | (e << 23) | ((mant & 0x3FFu) << 13);
  }
  return __uint_as_float(out);
}

// cvt.rz.f16.f32's bits (rounded toward zero; subnormal results kept, as without .ftz):
// f16x2_toward_zero in csrc/cuda/cuda_utils.cuh, lane by lane. tests/test_cuda_sim.py
// checks it on every FP16 boundary against the host's conversion.
inline uint32_t f16_bits_toward_zero(float x) {
  const uint32_t b = __float_as_uint(x);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const uint32_t a = b & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;                     // NaN (the kernels convert none)
  if (a == 0x7F800000u) return sign | 0x7C00u;                    // infinity
  if (a >= 0x47800000u) return sign | 0x7BFFu;                    // >= 2^16: the largest finite
  if (a >= 0x38800000u) return sign | ((a - 0x38000000u) >> 13);  // normal: truncated
  const uint32_t e = a >> 23;                                     // below 2^-14: units of 2^-24
  if (e < 103u) return sign;                                      // below 2^-24
  return sign | (((a & 0x7FFFFFu) | 0x800000u) >> (126u - e));
}
