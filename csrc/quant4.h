// Blockwise 4-bit codes of the moments, shared by the CPU kernels, the operators and the
// CUDA emulation (state_precision="4bit").
//
// Note [4-bit moments]
// A tensor is cut into blocks of kBlock4 = 128 consecutive elements of each row (Note [4-bit
// row blocks] below), each stored as one FP32 scale, the largest magnitude in the block
// (the same rule as Note [8-bit moments] in csrc/quant8.h: a maximum rounds nothing, so every
// reduction order gives the same bits), and one 4-bit code per element, two per byte (the
// element of even index in the low nibble). The code books were chosen by measurement on the
// moments of a byte-level language model (benchmarks/quant8_error.py --bits 4,
// docs/performance.md "4-bit code books, measured"): against torchao's AdamW4bit maps (17.8%
// update error) and the 4-bit paper's best (16.9%), these give 12.4%:
//   kSigned   (exp_avg):    sign bit + E2M1 (magnitudes 0, 1/8, 1/4, 3/8, 1/2, 3/4, 1, 3/2)
//             in units of scale / 1.5: 0, 1/12, 1/6, 1/4, 1/3, 1/2, 2/3, 1 of the largest;
//   kUnsigned (exp_avg_sq): E2M2 (0, 1/16 .. 7/4 in units of scale / 1.75), where only an
//             exact zero has the code 0: a positive value rounds up to 1/16 at least
//             (1/28 of the block's largest), so a positive second moment never decodes to
//             zero (v = 0 under a nonzero m would make the update m / eps) and the decoded
//             v is then too large, never too small.
// Encoding: y = |x| * (top / scale) (one correctly rounded quotient per block, one product
// per element), coded by encode_magnitude<2, 1> or <2, 2> of quant8.h (round to nearest on
// the bits of y, ties to the even code: integer operations, the same on every backend).
// Decoding: the code's ratio to the top, ratio4 = value / top correctly rounded (an FP32
// constant per code; the top code's is 1), times the scale: one product per element. So a
// block's largest element decodes to its scale exactly, and values decoded and coded again
// give back the same scale and codes (each decoded value is within an ulp or two of its
// code's point, far from the midpoints between codes): FSDP1's FP32 state dicts and
// dequantize_state_dict round-trip bit for bit, as the 8-bit codes (whose top is 1) do. A
// block whose largest magnitude is below FP32's smallest normal is stored as zeros (scale
// 0), as for 8 bits.
//
// Non-finite moments stay in their element, as in the FP32 step (Note [8-bit moments] has
// why: an overflowing square makes one element's v infinite and moves its parameter by 0).
// A block holding one stores its scale negated, and its finite values are coded with a top
// code left free: exp_avg's magnitude 7 is then +-inf and the code 8 (a negative zero) NaN,
// finite magnitudes up to 6 (top 1: the largest finite value has code 6); exp_avg_sq's code
// 15 is inf, 14 NaN, finite codes up to 13 (top 1.25). Decoding tests the scale's sign
// once per block.
#pragma once

#include <cstdint>

#include "adamw_math.h"
#include "quant8.h"
#include "ruda_params.h"

namespace ruda {

constexpr int64_t kBlock4 = 128;

// Note [4-bit row blocks]
// As Note [8-bit row blocks] in csrc/quant8.h, with blocks of kBlock4: a parameter of shape
// (d0, ..., dk) is d0 rows of R = d1 ... dk elements (a 0-D or 1-D one is one row), each cut
// into blocks of kBlock4 consecutive elements, the last one shorter. The codes of a row take
// ceil(R / 2) bytes: a tensor's codes are shaped (d0, ceil(R / 2)) (a 1-D one's
// (ceil(n / 2),)), so that a shard of rows holds whole bytes and every block starts a byte:
// no two blocks (and no two threads) ever write one byte. In the flat state the codes are
// indexed by nibble: element (r, c) of a tensor at state offset `off` has nibble
// off + r * R2 + c, R2 = R rounded up to even (R itself where R is even: the element's own
// index). Where R is a multiple of kBlock4 (or there is one row) the tensor's blocks are
// those of its flat elements (TensorEntry::row = 0) and block b has its scale at
// (off / kBlock4 + b) of each moment's run; otherwise TensorEntry::row = R, and the
// rows * ceil(R / kBlock4) scales lie apart from TensorEntry::scale_offset, walked as if
// each row were laid out on whole blocks (row_stride4), as the 8-bit kernels do.
RUDA_HOST_DEVICE inline int64_t row_stride4(int64_t row) {
  return (row + kBlock4 - 1) / kBlock4 * kBlock4;
}
// Nibbles a row's codes take: R rounded up to even.
RUDA_HOST_DEVICE inline int64_t row_nibbles4(int64_t row) { return row + (row & 1); }
// The indices of a tensor's walk (its elements, or its rows on whole blocks).
RUDA_HOST_DEVICE inline int64_t state_extent4(const TensorEntry& e) {
  return e.row == 0 ? e.numel : e.numel / e.row * row_stride4(e.row);
}
// The nibbles a tensor's codes take in the state from its offset.
RUDA_HOST_DEVICE inline int64_t code_extent4(int64_t numel, int64_t row) {
  return row == 0 ? numel : numel / row * row_nibbles4(row);
}
RUDA_HOST_DEVICE inline int64_t scale_index4(const TensorEntry& e, int64_t kc) {
  return e.row == 0 ? (e.state_offset + kc) / kBlock4 : e.scale_offset + kc / kBlock4;
}
// The block at index kc of a tensor's walk, in a range of it ending at `end`: its first
// element, its element count, and its first code's nibble in the state (even).
struct Block4 {
  int64_t first;
  int64_t n;
  int64_t nibble;
};
RUDA_HOST_DEVICE inline Block4 block4_at(const TensorEntry& e, int64_t kc, int64_t end) {
  if (e.row == 0) return {kc, end - kc < kBlock4 ? end - kc : kBlock4, e.state_offset + kc};
  const int64_t stride = row_stride4(e.row);
  const int64_t r = kc / stride, col = kc - r * stride;
  const int64_t left = e.row - col;
  return {r * e.row + col, left < kBlock4 ? left : kBlock4,
          e.state_offset + r * row_nibbles4(e.row) + col};
}

enum class Code4 : int64_t { kSigned = 0, kUnsigned = 1 };

// The largest code value (in units of u) of a block: kTop4 in a block of finite values,
// kTopSpecial4 in one with non-finite values (a top code left free for them).
template <Code4 kCode>
constexpr float kTop4 = kCode == Code4::kSigned ? 1.5f : 1.75f;
template <Code4 kCode>
constexpr float kTopSpecial4 = kCode == Code4::kSigned ? 1.0f : 1.25f;
// The code of y = |x| * inverse (y <= top (1 + 2^-22), finite, with the sign of x for the
// signed code; y < 2 holds for both tops).
template <Code4 kCode>
RUDA_HOST_DEVICE inline uint32_t encode4(float y) {
  const uint32_t bits = float_bits(y);
  const uint32_t abs_bits = bits & 0x7FFFFFFFu;
  if constexpr (kCode == Code4::kSigned) {
    const uint32_t magnitude = encode_magnitude<2, 1>(float_from_bits(abs_bits));
    return (((bits >> 31) << 3) & mask_if(magnitude != 0)) | magnitude;  // no code of -0
  } else {
    const uint32_t code = encode_magnitude<2, 2>(float_from_bits(abs_bits));
    return code | (1u & mask_if(code == 0 && abs_bits != 0));  // positive: never 0
  }
}

// The exact value of a code, in units of u.
template <Code4 kCode>
RUDA_HOST_DEVICE inline float decode4(uint32_t code) {
  if constexpr (kCode == Code4::kSigned) {
    const uint32_t magnitude = float_bits(decode_magnitude<2, 1>(code & 7u));
    return float_from_bits(magnitude | ((code & 8u) << 28));
  } else {
    return decode_magnitude<2, 2>(code & 15u);
  }
}

// A code's value in units of its block's scale: decode4(code) / top, correctly rounded (1 for
// the top code of either kind of block). Decoding multiplies it by the scale's magnitude.
template <Code4 kCode>
RUDA_HOST_DEVICE inline float ratio4(uint32_t code, bool special) {
  return decode4<kCode>(code) / (special ? kTopSpecial4<kCode> : kTop4<kCode>);
}

// The scale's magnitude (a block with non-finite values stores it negated).
RUDA_HOST_DEVICE inline float scale_magnitude4(float scale) {
  return float_from_bits(magnitude_bits(scale));
}

// What y = |x| * inverse uses: top / |scale|, or 0 for a block stored as zeros.
template <Code4 kCode>
RUDA_HOST_DEVICE inline float block_inverse4(float scale) {
  const float a = float_from_bits(magnitude_bits(scale));
  const float top = special_block(scale) ? kTopSpecial4<kCode> : kTop4<kCode>;
  return a > 0.0f ? top / a : 0.0f;
}

// The special codes of a block with non-finite values (Note [4-bit moments]).
template <Code4 kCode>
constexpr uint32_t kInf4 = kCode == Code4::kSigned ? 7u : 15u;
template <Code4 kCode>
constexpr uint32_t kNaN4 = kCode == Code4::kSigned ? 8u : 14u;

// The value of a code in a block of a negated scale (a block with non-finite values) of
// magnitude a: the special codes' infinities and NaN, the others' ratio4 times a.
template <Code4 kCode>
RUDA_HOST_DEVICE inline float dequantize4_special(uint32_t code, float a) {
  if (code == kNaN4<kCode>) return float_from_bits(kCanonicalNaNBits);
  if ((code & (kCode == Code4::kSigned ? 7u : 15u)) == kInf4<kCode>) {
    return float_from_bits(kInfBits | ((code & 8u & mask_if(kCode == Code4::kSigned)) << 28));
  }
  return ratio4<kCode>(code, true) * a;
}

// The code of x in a block (inverse as block_inverse4 of its stored scale).
template <Code4 kCode>
RUDA_HOST_DEVICE inline uint32_t quantize4(float x, float inverse, bool special) {
  if (special) {
    const uint32_t m = magnitude_bits(x);
    if (m > kInfBits) return kNaN4<kCode>;
    if (m == kInfBits) {
      return kInf4<kCode> | (kCode == Code4::kSigned ? (float_bits(x) >> 31) << 3 : 0u);
    }
  }
  return encode4<kCode>(x * inverse);
}

// The nibble k of a code buffer (k counted from a byte boundary).
RUDA_HOST_DEVICE inline uint32_t nibble_at(const uint8_t* codes, int64_t k) {
  return (static_cast<uint32_t>(codes[k >> 1]) >> ((k & 1) * 4)) & 15u;
}

// n values (n <= kBlock4) of one block decoded into out; codes from a byte boundary.
template <Code4 kCode>
RUDA_HOST_DEVICE inline void decode_block4(const uint8_t* codes, float scale, int64_t n,
                                           float* out) {
  const float a = scale_magnitude4(scale);
  if (special_block(scale)) {
    for (int64_t j = 0; j < n; ++j) out[j] = dequantize4_special<kCode>(nibble_at(codes, j), a);
    return;
  }
  float ratios[16];
  for (uint32_t code = 0; code < 16; ++code) ratios[code] = ratio4<kCode>(code, false);
  for (int64_t j = 0; j < n; ++j) out[j] = ratios[nibble_at(codes, j)] * a;
}

// n values (n <= kBlock4) of one block coded: its scale into *scale, the codes from a byte
// boundary (ceil(n / 2) bytes; an odd block's last high nibble 0).
template <Code4 kCode>
RUDA_HOST_DEVICE inline void encode_block4(const float* x, int64_t n, uint8_t* codes,
                                           float* scale) {
  uint32_t largest = 0, finite = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t m = magnitude_bits(x[j]);
    largest = m > largest ? m : largest;
    const uint32_t f = finite_magnitude_bits(x[j]);
    finite = f > finite ? f : finite;
  }
  const bool special = largest >= kInfBits;
  const float s = block_scale(special ? finite : largest, special);
  *scale = s;
  const float inverse = block_inverse4<kCode>(s);
  for (int64_t j = 0; j + 1 < n; j += 2) {
    const uint32_t lo = quantize4<kCode>(x[j], inverse, special);
    const uint32_t hi = quantize4<kCode>(x[j + 1], inverse, special);
    codes[j >> 1] = static_cast<uint8_t>(lo | (hi << 4));
  }
  if (n & 1) codes[n >> 1] = static_cast<uint8_t>(quantize4<kCode>(x[n - 1], inverse, special));
}

}  // namespace ruda
