// Blockwise 8-bit codes of the moments, shared by the CPU and the CUDA kernels.
//
// Note [8-bit moments]
// The format of state_precision="8bit" (the optimizer's option, ruda_torch/optimizer.py; the
// operators quantize_8bit / dequantize_8bit, and adamw_scaled_ with uint8 moment buffers,
// whose step decodes a block, updates it in FP32 and codes it again in one pass): a tensor
// is cut into blocks of
// kBlock8 = 256 consecutive elements (the last one shorter), each stored as one FP32
// scale, the largest magnitude in the block, and one byte per element, the code of
// q = x * (1 / scale) in a small floating-point format whose top binade is [1, 2):
//   kSigned   (exp_avg):    sign bit + 3 exponent bits + 4 mantissa bits ("s+E3M4"):
//             q in 2^-6 .. 1.94 at 2^-5 relative spacing, subnormals down to 2^-10;
//   kUnsigned (exp_avg_sq): 4 exponent bits + 4 mantissa bits ("E4M4"): q in 2^-14 ..
//             1.94 at 2^-5 relative spacing, subnormals down to 2^-18; a positive value
//             never gets the code of zero (it rounds up to 2^-18 instead).
// Encoding is round to nearest, ties to the even code, done on the bits of q (the same
// integer operations on both backends, no table, no search); decoding is exact to FP32
// and then multiplied by the scale (one correctly rounded product). Why these codes and
// not the peers' dynamic-exponent map (bitsandbytes, torchao; 256 table entries found by
// a binary search): measured on the moments of a byte-level language model trained on the
// standard library's sources (benchmarks/quant8_error.py, docs/performance.md), the
// update m / (sqrt(v) + eps) computed from the decoded moments is 1.46% (relative L2)
// away from the exact one, against 1.43% with the dynamic map, so the map buys nothing
// that justifies a table lookup per element. The second moment must not decode to zero
// where it was not: v = 0 under a nonzero m makes the update m / eps, so E4M4 (range
// 2^-18) instead of E3M5, and a positive v is never flushed to zero: the decoded v is
// then too large, never too small, and the step never larger than the exact one.
// The scale is a maximum, which rounds nothing, so every reduction order gives the same
// bits (it is taken on the magnitudes' bit patterns, which order as the values do). A
// block with a NaN or an infinity stores the scale NaN and codes 0: every element of it
// decodes to NaN. A block whose largest magnitude is below 2^-126 (FP32's smallest normal,
// where 1 / scale would overflow) is stored as zeros (scale 0).
#pragma once

#include <cstdint>

#include "adamw_math.h"

namespace ruda {

constexpr int64_t kBlock8 = 256;
// Bytes of a flat 8-bit moment buffer per block: the codes, and the block's FP32 scale
// (the buffer holds all blocks' codes first, then all scales).
constexpr int64_t kPacked8 = kBlock8 + 4;

enum class Code8 : int64_t { kSigned = 0, kUnsigned = 1 };

// All ones where `condition` holds, else zero: the selects below are bit masks, so that
// the CPU compiler vectorizes the loops over a block at every ISA (a conditional
// expression it may leave as a branch, which costs a misprediction per element).
RUDA_HOST_DEVICE inline uint32_t mask_if(bool condition) {
  return 0u - static_cast<uint32_t>(condition);
}

// The code of a >= 0 (finite, below 2) with kExp exponent and kMan mantissa bits, top
// binade [1, 2): round to nearest, ties to even. Both ways are computed and one selected
// by a mask (the results are those of the plain branches).
template <int kExp, int kMan>
RUDA_HOST_DEVICE inline uint32_t encode_magnitude(float a) {
  constexpr int32_t kTop = (1 << kExp) - 1;
  constexpr uint32_t kDrop = 23 - kMan;
  const uint32_t bits = float_bits(a);
  // A normal code (a >= 2^(1 - kTop)): drop the low mantissa bits of the FP32 bits,
  // rounding to nearest even; the carry may reach the exponent.
  const uint32_t r = bits + ((1u << (kDrop - 1)) - 1u) + ((bits >> kDrop) & 1u);
  const uint32_t normal = (r >> kDrop) - (static_cast<uint32_t>(127 - kTop) << kMan);
  // A subnormal code: a in units of the smallest subnormal code, 2^(1 - kTop - kMan) (an
  // exact scaling, below 2^(kMan + 1) here), rounded to an integer by the FP32 addition
  // of 2^23, whose rounding is to nearest even: the integer is the sum's low mantissa
  // bits. A value that rounds up to the smallest normal gets its code (the codes are in
  // value order); one below half the smallest subnormal gets 0.
  const float units = a * float_from_bits(static_cast<uint32_t>(127 + kTop + kMan - 1) << 23);
  const uint32_t sub = float_bits(units + 8388608.0f) - 0x4B000000u;
  const uint32_t is_normal = mask_if(bits >= (static_cast<uint32_t>(127 + 1 - kTop) << 23));
  return (normal & is_normal) | (sub & ~is_normal);
}

// The value of a code of encode_magnitude(), exact in FP32.
template <int kExp, int kMan>
RUDA_HOST_DEVICE inline float decode_magnitude(uint32_t code) {
  constexpr int32_t kTop = (1 << kExp) - 1;
  const uint32_t e = code >> kMan;
  const uint32_t f = code & ((1u << kMan) - 1u);
  // e == 0: f * 2^(1 - kTop - kMan), a power of two times a small integer (both ways are
  // computed, one selected by a mask, for vectorized loops).
  const float sub = static_cast<float>(static_cast<int32_t>(f)) *
                    float_from_bits(static_cast<uint32_t>(127 + 1 - kTop - kMan) << 23);
  const uint32_t normal = ((e + static_cast<uint32_t>(127 - kTop)) << 23) | (f << (23 - kMan));
  const uint32_t is_sub = mask_if(e == 0);
  return float_from_bits((float_bits(sub) & is_sub) | (normal & ~is_sub));
}

// The byte of q = x / scale (|q| <= 1 + 2^-23).
template <Code8 kCode>
RUDA_HOST_DEVICE inline uint8_t encode8(float q) {
  const uint32_t bits = float_bits(q);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if constexpr (kCode == Code8::kSigned) {
    const uint32_t magnitude = encode_magnitude<3, 4>(float_from_bits(abs_bits));
    // The sign where the magnitude is not 0 (no code of -0).
    return static_cast<uint8_t>((((bits >> 31) << 7) & mask_if(magnitude != 0)) | magnitude);
  } else {
    const uint32_t magnitude = encode_magnitude<4, 4>(float_from_bits(abs_bits));
    // A positive value is never coded 0 (Note [8-bit moments]).
    return static_cast<uint8_t>(magnitude | (1u & mask_if(magnitude == 0 && abs_bits != 0)));
  }
}

// The value of a byte, before the scale (exact).
template <Code8 kCode>
RUDA_HOST_DEVICE inline float decode8(uint8_t code) {
  if constexpr (kCode == Code8::kSigned) {  // the code's sign bit on the magnitude's
    const uint32_t magnitude = float_bits(decode_magnitude<3, 4>(code & 0x7Fu));
    return float_from_bits(magnitude | (static_cast<uint32_t>(code & 0x80u) << 24));
  } else {
    return decode_magnitude<4, 4>(code);
  }
}

// The bits of |x|, which order as the magnitudes do (NaN above infinity above all finite):
// their maximum is the block's scale, in any order of reduction.
RUDA_HOST_DEVICE inline uint32_t magnitude_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

// A block's scale from the maximum of magnitude_bits() over it: NaN (canonical) when a
// value was not finite, 0 below FP32's smallest normal, else the largest magnitude.
RUDA_HOST_DEVICE inline float block_scale(uint32_t max_magnitude_bits) {
  if (max_magnitude_bits >= 0x7F800000u) return float_from_bits(kCanonicalNaNBits);
  if (max_magnitude_bits < 0x00800000u) return 0.0f;
  return float_from_bits(max_magnitude_bits);
}

// What q = x * inverse uses: 1 / scale, or 0 for a block stored as zeros (scale 0 or NaN).
RUDA_HOST_DEVICE inline float block_inverse(float scale) {
  return scale > 0.0f ? 1.0f / scale : 0.0f;
}

// An element's stored value: the byte's value times the block's scale.
template <Code8 kCode>
RUDA_HOST_DEVICE inline float dequantize8(uint8_t code, float scale) {
  return decode8<kCode>(code) * scale;
}

// decode8 through the FP32 format itself (the CUDA kernels): a code's exponent and mantissa
// bits, placed where an FP32's are, make an FP32 of 2^(kTop - 127) times the code's value,
// subnormal for a subnormal code (the formats have the same layout, FP32's exponent bias
// 127 for the code's kTop), and one exact multiplication by 2^(127 - kTop) gives decode8's
// value: a shift and a product instead of both of decode_magnitude's ways and a select.
// Needs FP32 subnormals kept (the CUDA build has -ftz=false; the CPU's loops run where
// denormal inputs may cost a microcode assist and keep decode_magnitude).
// tests/test_cuda_sim.py decodes all 256 codes of both kinds.
template <Code8 kCode>
RUDA_HOST_DEVICE inline float decode8_scaled(uint32_t code) {
  if constexpr (kCode == Code8::kSigned) {  // E3M4 under the sign bit: top binade 2^(7 - 127)
    const uint32_t bits = ((code & 0x7Fu) << 19) | ((code & 0x80u) << 24);
    return float_from_bits(bits) * 1.329227995784916e36f;        // 2^120
  } else {                                                       // E4M4: top binade 2^(15 - 127)
    return float_from_bits(code << 19) * 5.192296858534828e33f;  // 2^112
  }
}

template <Code8 kCode>
RUDA_HOST_DEVICE inline float dequantize8_scaled(uint32_t code, float scale) {
  return decode8_scaled<kCode>(code) * scale;
}

#if !defined(__CUDA_ARCH__)
// The CPU kernels' decoding of n values (n <= kBlock8) of one block into out, with
// dequantize8's bits: with AVX2 or AVX-512 by decode8's arithmetic, which the compiler
// vectorizes (1.4x the speed of a table read through vector gathers); below them from a
// table of decode8's 256 values (scalar loads beat the arithmetic on 4-wide vectors).
template <Code8 kCode>
inline const float* decode_table() {
  static const auto table = [] {
    struct Table {
      float v[256];
    } t{};
    for (uint32_t c = 0; c < 256; ++c) t.v[c] = decode8<kCode>(static_cast<uint8_t>(c));
    return t;
  }();
  return table.v;
}

template <Code8 kCode>
inline void decode_block_cpu(const uint8_t* codes, float scale, int64_t n, float* out) {
#if defined(__AVX2__)
  for (int64_t j = 0; j < n; ++j) out[j] = decode8<kCode>(codes[j]) * scale;
#else
  const float* table = decode_table<kCode>();
  for (int64_t j = 0; j < n; ++j) out[j] = table[codes[j]] * scale;
#endif
}
#endif

// n values (n <= kBlock8) of one block coded: its scale into *scale, the bytes into codes
// (one thread's loops; the CUDA kernels share the work of a block between threads).
template <Code8 kCode>
RUDA_HOST_DEVICE inline void encode_block(const float* x, int64_t n, uint8_t* codes, float* scale) {
  uint32_t largest = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t m = magnitude_bits(x[j]);
    largest = m > largest ? m : largest;
  }
  const float s = block_scale(largest);
  *scale = s;
  const float inverse = block_inverse(s);
  const uint32_t keep = mask_if(s > 0.0f);  // a block of zeros, or not finite: codes 0
  for (int64_t j = 0; j < n; ++j) {
    codes[j] = static_cast<uint8_t>(encode8<kCode>(x[j] * inverse) & keep);
  }
}

}  // namespace ruda
