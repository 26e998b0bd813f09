// The 4-bit codes of the moments (Note [4-bit moments] in csrc/quant4.h) on vectors of
// lanes, for the CPU kernel's 4-bit step and the quantize_4bit / dequantize_4bit operators
// with AVX-512 or AVX2: lane for lane the bits of quant4.h's scalar decode4 / encode4
// (Note [One pass per 4-bit block] in adamw_cpu.cpp).
//
// Note [4-bit codes through FP16]
// Decoding reads each code's value from a 16-entry table made once per block (Table4:
// ratio4(code) times the block's scale for every code, one vector product) and held
// in registers, one permutation per vector (AVX-512 all 16 entries in one, AVX2 two of 8
// and a blend). Encoding goes through FP16 as the 8-bit codes do (Note [8-bit codes
// through FP16] in quant8_vec.h): both 4-bit codes are FP16's layout cut short once the
// magnitude is scaled by 2^-12 (exact). E2M2 and E2M1 have quant8.h's encode_magnitude
// binades [2^-2, 2^-1), [2^-1, 1), [1, 2) with bias 3, which times 2^-12 are FP16's
// exponent fields 1, 2, 3; their subnormal steps 2^-4 and 2^-3 become 2^8 and 2^9 of
// FP16's 2^-24. So the code is the FP16 of |y| 2^-12 rounded to nearest even with 8 (E2M2)
// or 9 (E2M1) bits dropped, which round_through_fp16 does by rounding to odd first (FP16
// keeps 8 or 9 more bits than the code, at least the 2 that makes the double rounding
// exact). About half the vector operations of encode_magnitude's arithmetic, most on
// 16-bit lanes. Checked against the default build's scalar encode4 over every class of
// value by tests/test_cpu_isa.py, with and without denormal flushing.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>

#include "cpu/kernels/quant8_vec.h"
#include "quant4.h"

namespace ruda {
namespace cpu {

// The 16 ratios of a code book in a block of finite values, ratio4<kCode>(code, false) in
// entry `code` (made once).
template <Code4 kCode>
inline const float* code_book4() {
  struct Book {
    alignas(64) float v[16];
    Book() {
      for (uint32_t code = 0; code < 16; ++code) v[code] = ratio4<kCode>(code, false);
    }
  };
  static const Book book;
  return book.v;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCodec4Vec = true;

// The VecI::size() codes from the byte at src, one per lane (the even element in the low
// nibble of its byte; VecI::size() / 2 bytes), in each lane's low 4 bits: the bits above
// are left as they come, since the table's permutations read only the index bits (4 of
// them with AVX-512; AVX2's two permutations read 3, its blend bit 3 moved to the top).
inline VecI load_nibbles(const uint8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
#else
  int32_t word;
  std::memcpy(&word, src, 4);
  const __m128i bytes = _mm_cvtsi32_si128(word);
#endif
  // byte i, then byte i shifted down by 4 (its high nibble low): b0 b0>>4 b1 b1>>4 ...
  const __m128i nibbles = _mm_unpacklo_epi8(bytes, _mm_srli_epi16(bytes, 4));
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu8_epi32(nibbles);
#else
  return _mm256_cvtepu8_epi32(nibbles);
#endif
}

// A block's decoding table in registers (Note [4-bit codes through FP16]).
struct Table4 {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 all;
#else
  __m256 low, high;
#endif

  // ratio4(code) * a (a: the scale's magnitude) in entry `code`: the scalar products.
  template <Code4 kCode>
  static inline Table4 of(float a) {
    const float* book = code_book4<kCode>();
#if defined(CPU_CAPABILITY_AVX512)
    return {_mm512_mul_ps(_mm512_load_ps(book), _mm512_set1_ps(a))};
#else
    const __m256 unit = _mm256_set1_ps(a);
    return {_mm256_mul_ps(_mm256_load_ps(book), unit),
            _mm256_mul_ps(_mm256_load_ps(book + 8), unit)};
#endif
  }

  // The values of the VecF::size() codes from the byte at src.
  inline VecF decode(const uint8_t* src) const {
    const VecI code = load_nibbles(src);
#if defined(CPU_CAPABILITY_AVX512)
    return _mm512_permutexvar_ps(code, all);
#else
    const __m256 lo = _mm256_permutevar8x32_ps(low, code);
    const __m256 hi = _mm256_permutevar8x32_ps(high, code);
    // bit 3 of the code to the sign bit: blendv's selector
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(code, 28)));
#endif
  }
};

// encode4<kCode>(y) of VecF::size() lanes (finite, |y| < 2) packed two a byte to dst
// (VecF::size() / 2 bytes).
template <Code4 kCode>
inline void encode4_store(const VecF& y, uint8_t* dst) {
  constexpr int kDrop = kCode == Code4::kSigned ? 9 : 8;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(abs_bits), _mm512_set1_ps(0x1p-12f));
  __m256i code = round_through_fp16<kDrop>(a);
  if constexpr (kCode == Code4::kSigned) {  // the sign where the magnitude is not 0
    const __mmask16 negative = _mm512_movepi32_mask(bits) & _mm256_test_epi16_mask(code, code);
    code = _mm256_mask_add_epi16(code, negative, code, _mm256_set1_epi16(8));
  } else {  // a value that is not zero never has the code 0
    code = _mm256_mask_max_epu16(code, _mm512_test_epi32_mask(abs_bits, abs_bits), code,
                                 _mm256_set1_epi16(1));
  }
  // Each 32-bit lane holds c(2i) | c(2i+1) << 16: its low byte c(2i) | c(2i+1) << 4.
  const __m256i pairs = _mm256_or_si256(code, _mm256_srli_epi32(code, 12));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_cvtepi32_epi8(pairs));
#else
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256 a = _mm256_mul_ps(_mm256_castsi256_ps(abs_bits), _mm256_set1_ps(0x1p-12f));
  __m128i code = round_through_fp16<kDrop>(a);
  if constexpr (kCode == Code4::kSigned) {
    const __m128i sign = _mm_and_si128(mask16_of(_mm256_srai_epi32(bits, 31)), _mm_set1_epi16(8));
    code = _mm_or_si128(code, _mm_andnot_si128(_mm_cmpeq_epi16(code, _mm_setzero_si128()), sign));
  } else {
    const __m128i zero16 = mask16_of(_mm256_cmpeq_epi32(abs_bits, _mm256_setzero_si256()));
    code = _mm_max_epu16(code, _mm_andnot_si128(zero16, _mm_set1_epi16(1)));
  }
  const __m128i pairs = _mm_or_si128(code, _mm_srli_epi32(code, 12));
  const __m128i bytes = _mm_shuffle_epi8(
      pairs, _mm_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  const int32_t word = _mm_cvtsi128_si32(bytes);
  std::memcpy(dst, &word, 4);
#endif
}

#if defined(CPU_CAPABILITY_AVX2)
// encode4_store of two vectors (y0's codes, then y1's: VecF::size() bytes), the 16-bit
// half on 16 lanes (Note [Codes of two AVX2 vectors] in quant8_vec.h). The sign rides in
// each FP16's bit 15 (round_through_fp16_x2 keeps it out of the rounding) instead of a
// mask of its own, as the CUDA coder does (Note [4-bit CUDA encode]): after the rounding
// it is bit 15 - kDrop, masked off the magnitude's code; the signed code takes it as bit
// 3 where the magnitude (at most 7) is not 0. The unsigned code is at least 1 where y's
// magnitude bits are not 0 (y is read as an integer: a = y 2^-12 may underflow to 0 where
// y does not).
template <Code4 kCode>
inline void encode4_store2(const VecF& y0, const VecF& y1, uint8_t* dst) {
  constexpr int kDrop = kCode == Code4::kSigned ? 9 : 8;
  const __m256 k2m12 = _mm256_set1_ps(0x1p-12f);
  __m256i code = round_through_fp16_x2<kDrop>(_mm256_mul_ps(y0, k2m12), _mm256_mul_ps(y1, k2m12));
  const __m256i h_sign = code;  // the sign at bit 15 - kDrop (the magnitude below it)
  code = _mm256_and_si256(code, _mm256_set1_epi16(15));
  if constexpr (kCode == Code4::kSigned) {
    const __m256i sign = _mm256_srli_epi16(h_sign, 3);  // bit 6 to bit 3
    code = _mm256_or_si256(
        code, _mm256_and_si256(_mm256_and_si256(sign, _mm256_add_epi16(code, _mm256_set1_epi16(7))),
                               _mm256_set1_epi16(8)));
  } else {
    const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF), one32 = _mm256_set1_epi32(1);
    const __m256i nonzero0 =
        _mm256_min_epu32(_mm256_and_si256(_mm256_castps_si256(y0), magnitude), one32);
    const __m256i nonzero1 =
        _mm256_min_epu32(_mm256_and_si256(_mm256_castps_si256(y1), magnitude), one32);
    code = _mm256_max_epu16(
        code, _mm256_permute4x64_epi64(_mm256_packus_epi32(nonzero0, nonzero1), 0xD8));
  }
  // Each 32-bit lane holds c(2i) | c(2i+1) << 16: its low byte c(2i) | c(2i+1) << 4; the
  // low bytes of each 128-bit half, then the halves' 4 bytes side by side.
  const __m256i pairs = _mm256_or_si256(code, _mm256_srli_epi32(code, 12));
  const __m256i bytes = _mm256_shuffle_epi8(
      pairs, _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8,
                              12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
  _mm_storel_epi64(
      reinterpret_cast<__m128i*>(dst),
      _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1)));
}
#endif
#else
// The portable build steps 4-bit blocks the per-pass way (Note [One pass per 4-bit block]);
// these lane-by-lane forms only keep the shared code compiling.
constexpr bool kCodec4Vec = false;

struct Table4 {
  alignas(64) float t[16];

  template <Code4 kCode>
  static inline Table4 of(float a) {
    Table4 out;
    for (uint32_t code = 0; code < 16; ++code) out.t[code] = code_book4<kCode>()[code] * a;
    return out;
  }
  inline VecF decode(const uint8_t* src) const {
    alignas(64) float out[VecF::size()];
    for (int64_t j = 0; j < VecF::size(); ++j) out[j] = t[nibble_at(src, j)];
    return VecF::loadu(out);
  }
};

template <Code4 kCode>
inline void encode4_store(const VecF& y, uint8_t* dst) {
  alignas(64) float in[VecF::size()];
  y.store(in);
  for (int64_t j = 0; j < VecF::size(); j += 2) {
    dst[j / 2] = static_cast<uint8_t>(encode4<kCode>(in[j]) | (encode4<kCode>(in[j + 1]) << 4));
  }
}
#endif

// The largest magnitude_bits of x[0, n).
inline uint32_t largest_magnitude(const float* x, int64_t n) {
  VecI largest(0);
  int64_t j = 0;
  for (; j + VecF::size() <= n; j += VecF::size()) {
    largest = at::vec::maximum(largest, bits_of(VecF::loadu(x + j)) & VecI(0x7FFFFFFF));
  }
  alignas(64) int32_t lanes[VecI::size()];
  largest.store(lanes);
  uint32_t out = 0;
  for (int64_t l = 0; l < VecI::size(); ++l) {
    out = static_cast<uint32_t>(lanes[l]) > out ? static_cast<uint32_t>(lanes[l]) : out;
  }
  for (; j < n; ++j) out = magnitude_bits(x[j]) > out ? magnitude_bits(x[j]) : out;
  return out;
}

// The codes of x[j, n) (j even) coded with `inverse` by scalars: pairs, then the last one.
template <Code4 kCode>
inline void encode4_tail(const float* x, float inverse, uint8_t* codes, int64_t j, int64_t n) {
  for (; j + 1 < n; j += 2) {
    codes[j >> 1] = static_cast<uint8_t>(quantize4<kCode>(x[j], inverse, false) |
                                         (quantize4<kCode>(x[j + 1], inverse, false) << 4));
  }
  if (j < n) codes[j >> 1] = static_cast<uint8_t>(quantize4<kCode>(x[j], inverse, false));
}

// The 4-bit codes of x[j, n) (j even; finite values) by code_vectors (quant8_vec.h: two
// vectors at a time with AVX2, Note [Codes of two AVX2 vectors]); the rest is
// encode4_tail's.
template <Code4 kCode>
inline int64_t encode4_vectors(const float* x, float inverse, uint8_t* codes, int64_t j,
                               int64_t n) {
  return code_vectors(
      x, inverse, j, n,
      [codes](const VecF& y, int64_t k) { encode4_store<kCode>(y, codes + k / 2); },
      [codes](const auto& y0, const auto& y1, int64_t k) {
        encode4_store2<kCode>(y0, y1, codes + k / 2);
      });
}

// encode_block4 of a block's n values x (codes from a byte boundary), the largest of their
// magnitude_bits being `largest`: a block of finite values by vectors (and its last pair by
// scalars), one with non-finite values by encode_block4 itself. The same codes and scale.
template <Code4 kCode>
inline void code_block4(const float* x, int64_t n, uint32_t largest, uint8_t* codes, float* scale) {
  if (!kCodec4Vec || largest >= kInfBits) {
    encode_block4<kCode>(x, n, codes, scale);
    return;
  }
  const float s = block_scale(largest, false);
  *scale = s;
  const float inverse = block_inverse4<kCode>(s);
  encode4_tail<kCode>(x, inverse, codes, encode4_vectors<kCode>(x, inverse, codes, 0, n), n);
}

// decode_block4 of a block's n codes into out: by vectors where the scale is finite and not
// negative (vector_block), by decode_block4 otherwise. The same values.
template <Code4 kCode>
inline void decode_block4_vec(const uint8_t* codes, float scale, int64_t n, float* out) {
  if (!kCodec4Vec || !vector_block(scale)) {
    decode_block4<kCode>(codes, scale, n, out);
    return;
  }
  const float* book = code_book4<kCode>();
  const Table4 table = Table4::of<kCode>(scale);
  int64_t j = 0;
  for (; j + VecF::size() <= n; j += VecF::size()) table.decode(codes + j / 2).store(out + j);
  for (; j < n; ++j) out[j] = book[nibble_at(codes, j)] * scale;
}

}  // namespace cpu
}  // namespace ruda
