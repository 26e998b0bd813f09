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
// integer operations on both backends, no table, no search; the CPU's AVX2 and AVX-512
// builds and the CUDA kernels' encoder convert through FP16 instead, the same bits: Note
// [8-bit codes through FP16] in cpu/kernels/quant8_vec.h); decoding is exact to FP32 and then
// multiplied by the scale (one correctly rounded product). Why these codes and not the peers'
// dynamic-exponent map (bitsandbytes, torchao; 256 table entries found by a binary search):
// measured on the moments of a byte-level language model trained on the standard library's sources
// (benchmarks/quant8_error.py, docs/performance.md), the update m / (sqrt(v) + eps) computed from
// the decoded moments is 1.46% (relative L2) away from the exact one, against 1.43% with the
// dynamic map, so the map buys nothing that justifies a table lookup per element. The second moment
// must not decode to zero where it was not: v = 0 under a nonzero m makes the update m / eps, so
// E4M4 (range 2^-18) instead of E3M5, and a positive v is never flushed to zero: the decoded v is
// then too large, never too small, and the step never larger than the exact one.
// The scale is a maximum, which rounds nothing, so every reduction order gives the same
// bits (it is taken on the magnitudes' bit patterns, which order as the values do). A
// block whose largest magnitude is below 2^-126 (FP32's smallest normal, where 1 / scale
// would overflow) is stored as zeros (scale 0).
//
// Non-finite moments stay in their element, as in the FP32 path. A gradient whose square
// overflows (1e30, FLT_MAX: finite, so a finite check does not skip the step) makes that
// element's second moment infinite; the FP32 step then moves the parameter by 0 (m / inf)
// and keeps every other element as it was. So here: the scale is the largest magnitude of
// the block's *finite* values, an infinite value is coded kInf8 (its sign in the signed
// code's sign bit) and a NaN kNaN8, codes no finite value has (a finite q is at most
// 1 + 2^-23, whose code is 0x70 or 0xF0), and a block holding one stores its scale negated
// (sign bit set; -0.0 where its finite part is stored as zeros). Decoding tests the scale's
// sign once per block: clear, each element is its code's value times the scale; set, the
// special codes decode to +-inf and NaN and the others times |scale|. The common block
// costs nothing more: its maximum over all magnitude bits is computed anyway, and only a
// maximum at or above the infinity's bits takes the path that finds the finite one. A
// checkpoint of the earlier format (a block with a NaN or an infinity stored as scale NaN,
// sign bit clear, codes 0) decodes as it did: every element of such a block NaN. One large
// finite value still sets its block's scale, so that small values beside it code to 0 (m)
// or to the smallest code (v): the quantization of any absmax block format, never a NaN.
#pragma once

#include <cstdint>

#include "adamw_math.h"
#include "ruda_params.h"

namespace ruda {

constexpr int64_t kBlock8 = 256;

// Note [8-bit row blocks]
// The blocks of a parameter are defined on its shape, not on any shard of it, so that the
// codes and scales are the same on every mesh (ruda_torch/_state8bit.py, Note [8-bit
// blocks on every mesh]): a parameter of shape (d0, d1, ..., dk) is d0 rows of R = d1 ...
// dk elements (a 0-D or 1-D one is one row), and each row is cut into blocks of kBlock8
// consecutive elements, its last block shorter when kBlock8 does not divide R. Where it
// does (or there is one row), the blocks are those of the flat tensor: block b of a slice
// at state offset `off` (a multiple of kBlock8) has its scale at (off / kBlock8 + b) of
// each moment's run of scales, as before. Where it does not (TensorEntry::row = R), the
// codes stay one per element at the element's own state index (no gaps: a row of 33
// elements costs 33 bytes, not a block's 256), and the tensor's rows * ceil(R / kBlock8)
// scales lie apart, from TensorEntry::scale_offset of each run. The kernels walk such a
// tensor as if each row were laid out on whole blocks (row_stride8: R rounded up to
// kBlock8; row_extent8 indices, so a tile is still whole blocks), and map each block of
// that walk to its first element and its count (block8_at) and its scale (scale_index8).
// The parameter, gradient, codes, master and the stochastic rounding's index are the
// element's own.
RUDA_HOST_DEVICE inline int64_t row_stride8(int64_t row) {
  return (row + kBlock8 - 1) / kBlock8 * kBlock8;
}
RUDA_HOST_DEVICE inline int64_t row_extent8(int64_t numel, int64_t row) {
  return numel / row * row_stride8(row);
}
// The indices of a tensor's walk (its elements, or its rows on whole blocks).
RUDA_HOST_DEVICE inline int64_t state_extent(const TensorEntry& e) {
  return e.row == 0 ? e.numel : row_extent8(e.numel, e.row);
}
// The scale (in each moment's run) of the block at index kc of a tensor's walk.
RUDA_HOST_DEVICE inline int64_t scale_index8(const TensorEntry& e, int64_t kc) {
  return e.row == 0 ? (e.state_offset + kc) / kBlock8 : e.scale_offset + kc / kBlock8;
}
// The block at index kc of a tensor's walk, in a range of it ending at `end`: its first
// element and its element count.
struct Block8 {
  int64_t first;
  int64_t n;
};
RUDA_HOST_DEVICE inline Block8 block8_at(const TensorEntry& e, int64_t kc, int64_t end) {
  if (e.row == 0) return {kc, end - kc < kBlock8 ? end - kc : kBlock8};
  const int64_t stride = row_stride8(e.row);
  const int64_t r = kc / stride, col = kc - r * stride;
  const int64_t left = e.row - col;
  return {r * e.row + col, left < kBlock8 ? left : kBlock8};
}
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

// The magnitude bits of the infinity: a maximum at or above it says the block holds a value
// that is not finite (Note [8-bit moments]).
constexpr uint32_t kInfBits = 0x7F800000u;

// The bits of |x| where x is finite, else 0: their maximum is the largest finite magnitude.
RUDA_HOST_DEVICE inline uint32_t finite_magnitude_bits(float x) {
  const uint32_t m = magnitude_bits(x);
  return m & mask_if(m < kInfBits);
}

// A block's scale from the maximum of finite_magnitude_bits() over it and whether it holds a
// non-finite value: 0 below FP32's smallest normal, else the largest finite magnitude;
// negated (its sign bit set) when a value was not finite.
RUDA_HOST_DEVICE inline float block_scale(uint32_t largest_finite_bits, bool special) {
  const uint32_t s = largest_finite_bits < 0x00800000u ? 0u : largest_finite_bits;
  return float_from_bits(s | (special ? 0x80000000u : 0u));
}

// Whether a stored scale marks a block with non-finite values (its sign bit).
RUDA_HOST_DEVICE inline bool special_block(float scale) { return (float_bits(scale) >> 31) != 0; }

// What q = x * inverse uses: 1 / |scale|, or 0 for a block stored as zeros (scale +-0).
RUDA_HOST_DEVICE inline float block_inverse(float scale) {
  const float a = float_from_bits(magnitude_bits(scale));
  return a > 0.0f ? 1.0f / a : 0.0f;
}

// The codes of non-finite values (Note [8-bit moments]): no finite value has them.
template <Code8 kCode>
constexpr uint32_t kInf8 = kCode == Code8::kSigned ? 0x7Eu : 0xFEu;
template <Code8 kCode>
constexpr uint32_t kNaN8 = kCode == Code8::kSigned ? 0x7Fu : 0xFFu;

// The code of a value in a block with non-finite values (scale `inverse` as block_inverse):
// its special code if it is not finite, else encode8's.
template <Code8 kCode>
RUDA_HOST_DEVICE inline uint8_t encode8_special(float x, float inverse) {
  const uint32_t m = magnitude_bits(x);
  if (m > kInfBits) return static_cast<uint8_t>(kNaN8<kCode>);
  if (m == kInfBits) {
    const uint32_t sign = kCode == Code8::kSigned ? (float_bits(x) >> 31) << 7 : 0u;
    return static_cast<uint8_t>(kInf8<kCode> | sign);
  }
  return encode8<kCode>(x * inverse);
}

// The value of a code in a block with non-finite values (`scale` negated): +-inf and NaN for
// the special codes, else decode8's value times |scale|.
template <Code8 kCode>
RUDA_HOST_DEVICE inline float dequantize8_special(uint32_t code, float scale) {
  const uint32_t magnitude = kCode == Code8::kSigned ? code & 0x7Fu : code;
  if (magnitude == kNaN8<kCode>) return float_from_bits(kCanonicalNaNBits);
  if (magnitude == kInf8<kCode>) {
    return float_from_bits(kInfBits | ((code & 0x80u & mask_if(kCode == Code8::kSigned)) << 24));
  }
  return decode8<kCode>(static_cast<uint8_t>(code)) * float_from_bits(magnitude_bits(scale));
}

#if !defined(__CUDA_ARCH__)
// The CPU kernels' decoding of n values (n <= kBlock8) of one block into out, each
// decode8's value times the scale (dequantize8_special's in a block with non-finite
// values): with AVX2 or AVX-512 by decode8's arithmetic, which the compiler vectorizes
// (1.4x the speed of a table read through vector gathers); below them from a table of
// decode8's 256 values (scalar loads beat the arithmetic on 4-wide vectors).
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
  if (special_block(scale)) {  // a block with non-finite values (Note [8-bit moments])
    for (int64_t j = 0; j < n; ++j) out[j] = dequantize8_special<kCode>(codes[j], scale);
    return;
  }
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
  if (largest >= kInfBits) {  // non-finite values (Note [8-bit moments]): the other path
    uint32_t finite = 0;
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t m = finite_magnitude_bits(x[j]);
      finite = m > finite ? m : finite;
    }
    const float s = block_scale(finite, true);
    *scale = s;
    const float inverse = block_inverse(s);
    for (int64_t j = 0; j < n; ++j) codes[j] = encode8_special<kCode>(x[j], inverse);
    return;
  }
  const float s = block_scale(largest, false);
  *scale = s;
  const float inverse = block_inverse(s);  // 0 for a block stored as zeros: codes 0
  for (int64_t j = 0; j < n; ++j) codes[j] = encode8<kCode>(x[j] * inverse);
}

}  // namespace ruda
