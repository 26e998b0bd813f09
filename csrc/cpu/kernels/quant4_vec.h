// The 4-bit codes of the moments (Note [4-bit moments] in csrc/quant4.h) on vectors of
// lanes, for the CPU kernel's 4-bit step and the quantize_4bit / dequantize_4bit operators
// with AVX-512 or AVX2: lane for lane the bits of quant4.h's scalar decode4 / encode4
// (Note [One pass per 4-bit block] in adamw_cpu.cpp).
// Decoding reads each code's exact value from a 16-entry table held in registers (a
// permutation: AVX-512 takes all 16 entries in one, AVX2 two of 8) and multiplies it by
// the block's unit, decode4(code) * u as the scalar code; encoding is quant8_vec.h's
// encode_magnitude_vec<2, 1> / <2, 2>, the integer steps of quant4.h's encode_magnitude.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <cstring>

#include "cpu/kernels/quant8_vec.h"
#include "quant4.h"

namespace ruda {
namespace cpu {

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCodec4Vec = true;

// The VecI::size() codes from the byte at src, one per lane (the even element in the low
// nibble of its byte): VecI::size() / 2 bytes.
inline VecI load_nibbles(const uint8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
#else
  int32_t word;
  std::memcpy(&word, src, 4);
  const __m128i bytes = _mm_cvtsi32_si128(word);
#endif
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i low = _mm_and_si128(bytes, mask);
  const __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128i nibbles = _mm_unpacklo_epi8(low, high);  // lo0 hi0 lo1 hi1 ...
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu8_epi32(nibbles);
#else
  return _mm256_cvtepu8_epi32(nibbles);
#endif
}

// The codes of VecI::size() lanes (0..15 each) packed two per byte to dst.
inline void store_nibbles(const VecI& codes, uint8_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm512_cvtepi32_epi8(codes);  // c0 .. c15
#else
  const __m256i words = _mm256_packus_epi32(codes, codes);
  const __m256i packed = _mm256_packus_epi16(words, words);
  const __m128i bytes = _mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)));
#endif
  // Each 16-bit word holds c(2i) | c(2i+1) << 8: its byte is c(2i) | c(2i+1) << 4.
  const __m128i folded =
      _mm_or_si128(_mm_and_si128(bytes, _mm_set1_epi16(0x000F)),
                   _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi16(0x00F0)));
  const __m128i out = _mm_packus_epi16(folded, folded);
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), out);
#else
  const int32_t word = _mm_cvtsi128_si32(out);
  std::memcpy(dst, &word, 4);
#endif
}

// decode4<kCode>(code) of every lane: the exact code values.
template <Code4 kCode>
inline VecF decode4_vec(const VecI& code) {
  alignas(64) static const float table[16] = {
      decode4<kCode>(0),  decode4<kCode>(1),  decode4<kCode>(2),  decode4<kCode>(3),
      decode4<kCode>(4),  decode4<kCode>(5),  decode4<kCode>(6),  decode4<kCode>(7),
      decode4<kCode>(8),  decode4<kCode>(9),  decode4<kCode>(10), decode4<kCode>(11),
      decode4<kCode>(12), decode4<kCode>(13), decode4<kCode>(14), decode4<kCode>(15)};
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_permutexvar_ps(code, _mm512_load_ps(table));
#else
  const __m256 low = _mm256_permutevar8x32_ps(_mm256_load_ps(table), code);
  const __m256 high = _mm256_permutevar8x32_ps(_mm256_load_ps(table + 8), code);
  const __m256i upper = _mm256_slli_epi32(code, 28);  // bit 3 of the code to the sign bit
  return _mm256_blendv_ps(low, high, _mm256_castsi256_ps(upper));
#endif
}

// encode4<kCode>(y) of every lane (y = x * inverse, finite, |y| < 2).
template <Code4 kCode>
inline VecI encode4_vec(const VecF& y) {
  const VecI bits = bits_of(y);
  const VecI abs_bits = bits & VecI(0x7FFFFFFF);
  if constexpr (kCode == Code4::kSigned) {
    const VecI magnitude = encode_magnitude_vec<2, 1>(float_of(abs_bits));
    const VecI sign = shl_lanes<3>(shr_lanes<31>(bits));
    return (sign & (magnitude != VecI(0))) | magnitude;
  } else {
    const VecI code = encode_magnitude_vec<2, 2>(float_of(abs_bits));
    return code | (VecI(1) & (code == VecI(0)) & (abs_bits != VecI(0)));
  }
}
#else
// The portable build steps 4-bit blocks the per-pass way (Note [One pass per 4-bit block]);
// these lane-by-lane forms only keep the shared code compiling.
constexpr bool kCodec4Vec = false;

inline VecI load_nibbles(const uint8_t* src) {
  alignas(64) int32_t lanes[VecI::size()];
  for (int64_t j = 0; j < VecI::size(); ++j) lanes[j] = static_cast<int32_t>(nibble_at(src, j));
  return VecI::loadu(lanes);
}

inline void store_nibbles(const VecI& codes, uint8_t* dst) {
  alignas(64) int32_t lanes[VecI::size()];
  codes.store(lanes);
  for (int64_t j = 0; j < VecI::size(); j += 2) {
    dst[j / 2] = static_cast<uint8_t>(lanes[j] | (lanes[j + 1] << 4));
  }
}

template <Code4 kCode>
inline VecF decode4_vec(const VecI& code) {
  alignas(64) int32_t lanes[VecI::size()];
  alignas(64) float out[VecF::size()];
  code.store(lanes);
  for (int64_t j = 0; j < VecI::size(); ++j)
    out[j] = decode4<kCode>(static_cast<uint32_t>(lanes[j]));
  return VecF::loadu(out);
}

template <Code4 kCode>
inline VecI encode4_vec(const VecF& y) {
  alignas(64) float in[VecF::size()];
  alignas(64) int32_t out[VecI::size()];
  y.store(in);
  for (int64_t j = 0; j < VecF::size(); ++j) out[j] = static_cast<int32_t>(encode4<kCode>(in[j]));
  return VecI::loadu(out);
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
  int64_t j = 0;
  for (; j + VecF::size() <= n; j += VecF::size()) {
    store_nibbles(encode4_vec<kCode>(VecF::loadu(x + j) * VecF(inverse)), codes + j / 2);
  }
  for (; j + 1 < n; j += 2) {
    codes[j >> 1] = static_cast<uint8_t>(quantize4<kCode>(x[j], inverse, false) |
                                         (quantize4<kCode>(x[j + 1], inverse, false) << 4));
  }
  if (j < n) codes[j >> 1] = static_cast<uint8_t>(quantize4<kCode>(x[j], inverse, false));
}

// decode_block4 of a block's n codes into out: by vectors where the scale is finite and not
// negative (vector_block), by decode_block4 otherwise. The same values.
template <Code4 kCode>
inline void decode_block4_vec(const uint8_t* codes, float scale, int64_t n, float* out) {
  if (!kCodec4Vec || !vector_block(scale)) {
    decode_block4<kCode>(codes, scale, n, out);
    return;
  }
  const float u = block_unit4<kCode>(scale);
  int64_t j = 0;
  for (; j + VecF::size() <= n; j += VecF::size()) {
    (decode4_vec<kCode>(load_nibbles(codes + j / 2)) * VecF(u)).store(out + j);
  }
  for (; j < n; ++j) out[j] = decode4<kCode>(nibble_at(codes, j)) * u;
}

}  // namespace cpu
}  // namespace ruda
