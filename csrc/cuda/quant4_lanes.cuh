// The 4-bit codec of a warp's block (Note [4-bit moments] in csrc/quant4.h), shared by the
// 4-bit update kernels (csrc/cuda/adamw_cuda.cu) and quantize_4bit / dequantize_4bit
// (csrc/cuda/quant4_cuda.cu).
#pragma once

#include <cstdint>

#include "cuda_utils.cuh"
#include "quant4.h"

namespace ruda {

// Note [4-bit CUDA lanes]
// One warp codes one block of kBlock4 = 128 elements, lane l holding its elements 4 l .. 4 l
// + 3 (kPerLane4): FP32 values with one 128-bit access, 16-bit ones with one 64-bit access,
// the lane's 4 codes (16 bits: code j in bits 4 j .. 4 j + 3, the nibble order of the
// buffers) with one 16-bit access; the block's scale is one warp reduction
// (lane_block_scale, as for 8 bits: the maximum of the magnitudes' bits, the CPU's scale in
// any order). Decoding reads each code's ratio4 (csrc/quant4.h) from a book in shared memory
// (Book4: the ratios of a byte's two codes in one load), times the scale's magnitude:
// ratio4(code) |scale|, the CPU kernels' bits.
// Encoding goes through FP16 two codes at a time (Note [4-bit CUDA encode] below), as the
// CPU's vector coders do: quantize4's codes (csrc/quant4.h). A block with non-finite values
// (a negative scale) decodes and codes through the special codes element by element
// (dequantize4_special, quantize4), the warp's branch.
constexpr int kPerLane4 = static_cast<int>(kBlock4) / 32;
static_assert(kPerLane4 == 4, "a lane holds 4 elements: 16 bits of codes");

// The code books of a block of finite values, by pairs of codes: pair[0][b] the ratios of
// exp_avg's (signed) codes in byte b (its low nibble's in .x, its high nibble's in .y),
// pair[1][b] the second moments' (unsigned); filled once per thread block, before a
// barrier. 4 KiB: two elements' ratios in one 64-bit load, where a book of 16 values took a
// load, a shift and a mask per element (analyze.sh: 2.5 SASS per element and moment fewer).
struct Book4 {
  float2 pair[2][256];

  __device__ inline void fill(int tid) {
    for (int i = tid; i < 512; i += static_cast<int>(blockDim.x)) {
      const uint32_t b = static_cast<uint32_t>(i & 255);
      pair[i >> 8][b] = i < 256 ? make_float2(ratio4<Code4::kSigned>(b & 15u, false),
                                              ratio4<Code4::kSigned>(b >> 4, false))
                                : make_float2(ratio4<Code4::kUnsigned>(b & 15u, false),
                                              ratio4<Code4::kUnsigned>(b >> 4, false));
    }
  }
};

template <Code4 kCode>
constexpr int kBook4 = kCode == Code4::kSigned ? 0 : 1;

// A lane's 4 values of a block of scale s from its 16 bits of codes c. kPairs false: a
// code at a time (the .x of its byte with a high nibble 0), fewer registers live (the edge
// kernels).
template <Code4 kCode, bool kPairs = true>
__device__ inline void decode_lane4(uint32_t c, float s, const Book4& book, float* x) {
  const float a = scale_magnitude4(s);
  if (special_block(s)) {  // the warp's branch: a block with non-finite values
    for (int j = 0; j < kPerLane4; ++j) {
      x[j] = dequantize4_special<kCode>((c >> (4 * j)) & 15u, a);
    }
    return;
  }
  const float2* pair = book.pair[kBook4<kCode>];
  if constexpr (!kPairs) {
#pragma unroll
    for (int j = 0; j < kPerLane4; ++j) x[j] = pair[(c >> (4 * j)) & 15u].x * a;
  } else {
#pragma unroll
    for (int h = 0; h < kPerLane4 / 2; ++h) {
      const float2 r = pair[(c >> (8 * h)) & 255u];
      x[2 * h] = r.x * a;
      x[2 * h + 1] = r.y * a;
    }
  }
}

// Note [4-bit CUDA encode]
// Two codes at a time through FP16, as the CPU's vector encoder (Note [4-bit codes through
// FP16] in csrc/cpu/kernels/quant4_vec.h) and the 8-bit CUDA one (encode_pair8): y = x
// inverse (the scalar codec's product, its sign kept), a = y 2^-12 (exact where y is at
// least 2^-114; below, a is far under FP16's smallest subnormal either way), the pair in
// FP16 toward zero (one conversion), the last bit of each half set where the conversion
// back lacks its value's bits (to odd), then rounded to nearest even with kDrop bits dropped
// (8 for E2M2, 9 for E2M1) on both halves at once: the magnitudes' codes, each half's in
// its low bits. The signed code takes the FP16's sign (bit 15) as its bit 3 where its
// magnitude is not 0; the unsigned one is at least 1 where y is not 0 (an integer test of
// y's bits: a may underflow to 0 where y does not). encode4's codes (tests/test_cuda_sim.py
// over every class of value).
template <Code4 kCode>
__device__ inline uint32_t encode_pair4(float a0, float a1, uint32_t nonzero) {
  constexpr int kDrop = kCode == Code4::kSigned ? 9 : 8;
  uint32_t h = f16x2_toward_zero(a0, a1);
  const float2 back = f16x2_to_f32(h);
  h |= (__float_as_uint(back.x) != __float_as_uint(a0) ? 1u : 0u) |
       (__float_as_uint(back.y) != __float_as_uint(a1) ? 0x10000u : 0u);
  // Each half's sign (bit 15) stays out of the rounding (the magnitude and the addend are
  // below 2^13: no carry reaches it) and out of the code (shifted to bit 6 or 7, masked).
  uint32_t r =
      ((h + ((1u << (kDrop - 1)) - 1u) * 0x10001u + ((h >> kDrop) & 0x00010001u)) >> kDrop) &
      0x000F000Fu;
  if constexpr (kCode == Code4::kSigned) {
    // bit 3: the sign (bit 15 of each half) where the magnitude (below 8) is not 0
    r |= (h >> 12) & (r + 0x00070007u) & 0x00080008u;
  } else {
    r = __vmaxu2(r, nonzero);
  }
  return r;
}

// The 16 bits of codes of a lane's 4 values x in a block of scale s (from lane_block_scale).
// A signed code's input is x (inverse 2^-12) where that factor is a normal FP32 value
// (inverse at least 2^-114: exactly y 2^-12 wherever that is normal, and below, the code is
// 0 either way), one product per element.
template <Code4 kCode>
__device__ inline uint32_t encode_lane4(const float* x, float s) {
  constexpr float k2m12 = 2.44140625e-4f;  // 2^-12
  const float inverse = block_inverse4<kCode>(s);
  if (special_block(s)) {  // the warp's branch: a block with non-finite values
    uint32_t c = 0u;
    for (int j = 0; j < kPerLane4; ++j) c |= quantize4<kCode>(x[j], inverse, true) << (4 * j);
    return c;
  }
  float a[kPerLane4];
  uint32_t nonzero[2] = {0u, 0u};
  if constexpr (kCode == Code4::kSigned) {
    if (inverse >= 4.81482486096809e-35f) {  // 2^-114 (the warp's branch)
      const float inverse12 = inverse * k2m12;
#pragma unroll
      for (int j = 0; j < kPerLane4; ++j) a[j] = x[j] * inverse12;
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane4; ++j) a[j] = (x[j] * inverse) * k2m12;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane4; j += 2) {
      const float y0 = x[j] * inverse, y1 = x[j + 1] * inverse;
      a[j] = y0 * k2m12;
      a[j + 1] = y1 * k2m12;
      nonzero[j / 2] = min(__float_as_uint(y0) & 0x7FFFFFFFu, 1u) |
                       (min(__float_as_uint(y1) & 0x7FFFFFFFu, 1u) << 16);
    }
  }
  const uint32_t lo = encode_pair4<kCode>(a[0], a[1], nonzero[0]);
  const uint32_t hi = encode_pair4<kCode>(a[2], a[3], nonzero[1]);
  // Codes 0 and 1 of each pair in bits 0-3 and 16-19: to bits 0-7, then the pairs' bytes.
  return __byte_perm(lo | (lo >> 12), hi | (hi >> 12), 0x0040);
}

}  // namespace ruda
