// The 8-bit codes of the moments (Note [8-bit moments] in csrc/quant8.h) on vectors of
// lanes: the scalar encode8 / decode8 of quant8.h with at::vec integer and FP32 operations,
// lane for lane the same bits (the same operations in the same order; no FMA in these
// builds), for the CPU kernel's fused 8-bit step (Note [One pass per 8-bit block] in
// adamw_cpu.cpp).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#include "quant8.h"

namespace ruda {
namespace cpu {

using VecF = at::vec::Vectorized<float>;
using VecI = at::vec::Vectorized<int32_t>;

// x >> n with zeros shifted in, and x << n, by a constant: one immediate shift where the
// ISA has it (at::vec's shifts take a vector of counts, a register each, and shift
// arithmetically; on Zen 1 the register pressure of the counts spilled the 8-bit loop).
template <int n>
inline VecI shr_lanes(const VecI& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_srli_epi32(x, n);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_srli_epi32(x, n);
#else
  return (x >> VecI(n)) & VecI(static_cast<int32_t>(0xFFFFFFFFu >> n));
#endif
}

template <int n>
inline VecI shl_lanes(const VecI& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_slli_epi32(x, n);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_slli_epi32(x, n);
#else
  return x << VecI(n);
#endif
}

inline VecI bits_of(const VecF& x) { return at::vec::cast<int32_t>(x); }
inline VecF float_of(const VecI& x) { return at::vec::cast<float>(x); }

// VecI::size() codes at src, one per lane.
inline VecI load_codes(const uint8_t* src) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src)));
#else
  alignas(64) int32_t lanes[VecI::size()];
  for (int64_t j = 0; j < VecI::size(); ++j) lanes[j] = src[j];
  return VecI::loadu(lanes);
#endif
}

// The low byte of each lane (each lane holds 0..255) to dst, consecutive.
inline void store_codes(const VecI& codes, uint8_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(codes));
#elif defined(CPU_CAPABILITY_AVX2)
  // The packs work within 128-bit halves: bytes 0-3 of each half are lanes 0-3 and 4-7.
  const __m256i words = _mm256_packus_epi32(codes, codes);
  const __m256i bytes = _mm256_packus_epi16(words, words);
  const __m256i ordered =
      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(ordered));
#else
  alignas(64) int32_t lanes[VecI::size()];
  codes.store(lanes);
  for (int64_t j = 0; j < VecI::size(); ++j) dst[j] = static_cast<uint8_t>(lanes[j]);
#endif
}

// encode_magnitude<kExp, kMan> of quant8.h, a >= 0 in every lane.
template <int kExp, int kMan>
inline VecI encode_magnitude_vec(const VecF& a) {
  constexpr int32_t kTop = (1 << kExp) - 1;
  constexpr int kDrop = 23 - kMan;
  const VecI bits = bits_of(a);
  const VecI r = bits + VecI((1 << (kDrop - 1)) - 1) + (shr_lanes<kDrop>(bits) & VecI(1));
  const VecI normal = shr_lanes<kDrop>(r) - VecI((127 - kTop) << kMan);
  const VecF units = a * VecF(float_from_bits(static_cast<uint32_t>(127 + kTop + kMan - 1) << 23));
  const VecI sub = bits_of(units + VecF(8388608.0f)) - VecI(0x4B000000);
  // bits >= the smallest normal code's: lanes hold non-negative values, so the signed
  // comparison is the scalar unsigned one.
  const VecI is_normal = bits > VecI(((127 + 1 - kTop) << 23) - 1);
  return (normal & is_normal) | (sub & ~is_normal);
}

// encode8<kCode>(q) in every lane.
template <Code8 kCode>
inline VecI encode8_vec(const VecF& q) {
  const VecI bits = bits_of(q);
  const VecI abs_bits = bits & VecI(0x7FFFFFFF);
  if constexpr (kCode == Code8::kSigned) {
    const VecI magnitude = encode_magnitude_vec<3, 4>(float_of(abs_bits));
    const VecI sign = shl_lanes<7>(shr_lanes<31>(bits));
    return (sign & (magnitude != VecI(0))) | magnitude;
  } else {
    const VecI magnitude = encode_magnitude_vec<4, 4>(float_of(abs_bits));
    return magnitude | (VecI(1) & (magnitude == VecI(0)) & (abs_bits != VecI(0)));
  }
}

// decode_magnitude<kExp, kMan> of quant8.h in every lane.
template <int kExp, int kMan>
inline VecF decode_magnitude_vec(const VecI& code) {
  constexpr int32_t kTop = (1 << kExp) - 1;
  const VecI e = shr_lanes<kMan>(code);
  const VecI f = code & VecI((1 << kMan) - 1);
  const VecF sub = at::vec::convert_to_fp_of_same_size<float>(f) *
                   VecF(float_from_bits(static_cast<uint32_t>(127 + 1 - kTop - kMan) << 23));
  const VecI normal = shl_lanes<23>(e + VecI(127 - kTop)) | shl_lanes<23 - kMan>(f);
  const VecI is_sub = e == VecI(0);
  return float_of((bits_of(sub) & is_sub) | (normal & ~is_sub));
}

// decode8<kCode>(code) in every lane.
template <Code8 kCode>
inline VecF decode8_vec(const VecI& code) {
  if constexpr (kCode == Code8::kSigned) {
    const VecI magnitude = bits_of(decode_magnitude_vec<3, 4>(code & VecI(0x7F)));
    return float_of(magnitude | shl_lanes<24>(code & VecI(0x80)));
  } else {
    return decode_magnitude_vec<4, 4>(code);
  }
}

// Whether the vector decoders take a block of this scale: finite with its sign bit clear.
// The others (blocks with non-finite values, Note [8-bit moments]; an earlier format's
// NaN scale, or a scale no kernel writes) decode by dequantize8_special or decode8 times
// the scale, whose NaN the vector decoders' sign step would change.
inline bool vector_block(float scale) { return float_bits(scale) < kInfBits; }

// Note [8-bit codes through FP16]
// Both codes are FP16's own layout cut short: E4M4 (exp_avg_sq) is the top 8 bits of an
// FP16 of the same value below 2 (FP16's exponent bias 15 is E4M4's top binade, its
// subnormals 2^-24 apart, 2^6 to an E4M4 subnormal step), and E3M4 (exp_avg's magnitude)
// is the top bits of the FP16 of q 2^-8. AVX-512 (16 lanes) and AVX2 with F16C (8 lanes,
// masks as vectors) convert with one instruction each way (vcvtph2ps, vcvtps2ph), where
// the arithmetic of quant8.h takes about 20 vector operations per moment (measured on
// Zen 4, AVX-512: the codec was a third of the 8-bit step's time). The CUDA kernels encode
// the same way, a pair per conversion (encode_pair8 in cuda/cuda_utils.cuh,
// cvt.rz.f16x2.f32). Same bits, by construction:
// - decoding: the code shifted to its place in an FP16 converts exactly (subnormal codes
//   to FP16 subnormals), then one correctly rounded product with the scale, as decode8's
//   value times the scale (E3M4: times 2^8 first, exact; the sign applied after the
//   product, which rounds symmetrically).
// - encoding: q to FP16 rounded toward zero, its last bit set where that dropped anything
//   (rounding to odd: the conversion back lacks q's bits), then rounded to nearest even on
//   the integer bits, 6 of them dropped. Rounding to odd with 2 or more bits beyond the
//   target precision and then to nearest gives the nearest (Boldo and Melquiond,
//   "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
//   odd", 2008): FP16 keeps 6 more bits than the codes, on the same binades and on a
//   subnormal grid that refines the codes' one. Whether a lane is zero (an E4M4 code is
//   never 0 for a value that is not) and whether the conversion was exact are read as
//   integers, which no MXCSR setting (torch.set_flush_denormal) changes.
// Checked against the default build's scalar encode8 on every FP32 q in [0, 1 + 2^-23]
// (and -q for the signed code: 3.2e9 values, no difference, both ISAs); the suite
// (tests/test_cpu_isa.py) compares every ISA build's codes with the default build's over
// every class of q (both grids, every midpoint between codes, their neighbours), with and
// without denormal flushing.
#if defined(CPU_CAPABILITY_AVX512)
// The codes at src times `scale`, VecF::size() lanes (decode8's value times the scale).
template <Code8 kCode>
inline VecF decode8_scaled_vec(const uint8_t* src, float scale) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  __m256i words = _mm256_cvtepu8_epi16(codes);
  if constexpr (kCode == Code8::kSigned) {
    words = _mm256_and_si256(_mm256_slli_epi16(words, 6), _mm256_set1_epi16(0x1FC0));
    const __m512 magnitude = _mm512_mul_ps(
        _mm512_mul_ps(_mm512_cvtph_ps(words), _mm512_set1_ps(256.0f)), _mm512_set1_ps(scale));
    // The code's sign bit (bit 7 of each byte) onto the product.
    return _mm512_mask_xor_ps(magnitude, _mm_movepi8_mask(codes), magnitude, _mm512_set1_ps(-0.0f));
  } else {
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_slli_epi16(words, 6)), _mm512_set1_ps(scale));
  }
}

// Magnitudes a (finite, below 2) rounded to nearest even with kDrop of their FP16's
// bits dropped, 16-bit lanes: FP16 rounded toward zero, its last bit set where that
// dropped anything (to odd), then rounded on the integer bits (Note [8-bit codes through
// FP16]; the 4-bit codes too, quant4_vec.h).
template <int kDrop>
inline __m256i round_through_fp16(const __m512 a) {
  __m256i h = _mm512_cvtps_ph(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256i one = _mm256_set1_epi16(1);
  // Inexact where the conversion back lacks a's bits (an integer comparison, as every
  // MXCSR setting reads it).
  const __mmask16 inexact =
      _mm512_cmpneq_epi32_mask(_mm512_castps_si512(_mm512_cvtph_ps(h)), _mm512_castps_si512(a));
  h = _mm256_mask_mov_epi16(h, inexact, _mm256_or_si256(h, one));  // rounded to odd
  const __m256i r = _mm256_add_epi16(_mm256_add_epi16(h, _mm256_set1_epi16((1 << (kDrop - 1)) - 1)),
                                     _mm256_and_si256(_mm256_srli_epi16(h, kDrop), one));
  return _mm256_srli_epi16(r, kDrop);
}

// The codes of q (|q| <= 1 + 2^-23, finite) to dst, VecF::size() bytes.
template <Code8 kCode>
inline void encode8_store(const VecF& q, uint8_t* dst) {
  const __m512i bits = _mm512_castps_si512(q);
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  __m512 a = _mm512_castsi512_ps(abs_bits);
  if constexpr (kCode == Code8::kSigned) a = _mm512_mul_ps(a, _mm512_set1_ps(0.00390625f));
  const __m256i one = _mm256_set1_epi16(1);
  __m256i code = round_through_fp16<6>(a);
  if constexpr (kCode == Code8::kSigned) {  // the sign where the magnitude is not 0
    const __mmask16 negative = _mm512_movepi32_mask(bits) & _mm256_test_epi16_mask(code, code);
    code = _mm256_mask_add_epi16(code, negative, code, _mm256_set1_epi16(0x80));  // code < 0x80
  } else {  // a value that is not zero never has the code 0
    code = _mm256_mask_max_epu16(code, _mm512_test_epi32_mask(abs_bits, abs_bits), code, one);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_cvtepi16_epi8(code));
}
#elif defined(CPU_CAPABILITY_AVX2)  // F16C's conversions, 8 lanes, masks as vectors
template <Code8 kCode>
inline VecF decode8_scaled_vec(const uint8_t* src, float scale) {
  const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  const __m128i words = _mm_slli_epi16(_mm_cvtepu8_epi16(codes), 6);
  if constexpr (kCode == Code8::kSigned) {
    const __m256 magnitude =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtph_ps(_mm_and_si128(words, _mm_set1_epi16(0x1FC0))),
                                    _mm256_set1_ps(256.0f)),
                      _mm256_set1_ps(scale));
    // The code's sign bit (bit 7) to each lane's bit 31.
    const __m256i sign = _mm256_and_si256(_mm256_slli_epi32(_mm256_cvtepu8_epi32(codes), 24),
                                          _mm256_set1_epi32(static_cast<int32_t>(0x80000000u)));
    return _mm256_xor_ps(magnitude, _mm256_castsi256_ps(sign));
  } else {
    return _mm256_mul_ps(_mm256_cvtph_ps(words), _mm256_set1_ps(scale));
  }
}

// 32-bit lanes' masks (0 or -1) as 16-bit lanes, in order.
inline __m128i mask16_of(const __m256i mask) {
  return _mm_packs_epi32(_mm256_castsi256_si128(mask), _mm256_extracti128_si256(mask, 1));
}

// round_through_fp16 with 8 lanes (F16C; masks as vectors).
template <int kDrop>
inline __m128i round_through_fp16(const __m256 a) {
  __m128i h = _mm256_cvtps_ph(a, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m128i one = _mm_set1_epi16(1);
  // Exact where the conversion back has a's bits (an integer comparison, as every MXCSR
  // setting reads it).
  const __m128i exact = mask16_of(
      _mm256_cmpeq_epi32(_mm256_castps_si256(_mm256_cvtph_ps(h)), _mm256_castps_si256(a)));
  h = _mm_or_si128(h, _mm_andnot_si128(exact, one));  // rounded to odd
  const __m128i r = _mm_add_epi16(_mm_add_epi16(h, _mm_set1_epi16((1 << (kDrop - 1)) - 1)),
                                  _mm_and_si128(_mm_srli_epi16(h, kDrop), one));
  return _mm_srli_epi16(r, kDrop);
}

template <Code8 kCode>
inline void encode8_store(const VecF& q, uint8_t* dst) {
  const __m256i bits = _mm256_castps_si256(q);
  const __m256i abs_bits = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  __m256 a = _mm256_castsi256_ps(abs_bits);
  if constexpr (kCode == Code8::kSigned) a = _mm256_mul_ps(a, _mm256_set1_ps(0.00390625f));
  const __m128i one = _mm_set1_epi16(1);
  __m128i code = round_through_fp16<6>(a);
  if constexpr (kCode == Code8::kSigned) {  // the sign where the magnitude is not 0
    const __m128i sign =
        _mm_and_si128(mask16_of(_mm256_srai_epi32(bits, 31)), _mm_set1_epi16(0x80));
    code = _mm_or_si128(code, _mm_andnot_si128(_mm_cmpeq_epi16(code, _mm_setzero_si128()), sign));
  } else {  // a value that is not zero never has the code 0
    const __m128i zero16 = mask16_of(_mm256_cmpeq_epi32(abs_bits, _mm256_setzero_si256()));
    code = _mm_max_epu16(code, _mm_andnot_si128(zero16, one));
  }
  _mm_storel_epi64(reinterpret_cast<__m128i*>(dst), _mm_packus_epi16(code, code));
}

// Note [Codes of two AVX2 vectors]
// With 8 lanes of FP32, the 16-bit half of the FP16 codec (rounding, signs, packing) fills
// half a vector: the two-vector forms below run it on the 16 lanes of two vectors at
// once, in one 256-bit vector of 16-bit lanes (their masks packed in order: packs
// interleaves the 128-bit halves, one 64-bit permutation puts them back): half the 16-bit
// operations per element of the one-vector forms, lane for lane the same codes (measured:
// the AVX2 step 1.21x faster with 4 bits, 1.18x with 8, docs/performance.md). Used
// wherever two whole vectors of a block are coded together (encode8_vectors,
// encode4_vectors): the AVX2 step's blocks and the quantize operators, which
// tests/test_cpu_isa.py compares with the default build's scalar codec.

// 32-bit lanes' masks (0 or -1) of two vectors as 16-bit lanes, m0's then m1's.
inline __m256i mask16_of2(const __m256i m0, const __m256i m1) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(m0, m1), 0xD8);
}

// round_through_fp16 of two vectors' 16 lanes (a0's, then a1's), in 16-bit lanes. Signs
// stay in bit 15 for the caller (below 2, the magnitudes and the rounding's addend stay
// under 2^13: no carry reaches it).
template <int kDrop>
inline __m256i round_through_fp16_x2(const __m256 a0, const __m256 a1) {
  const __m128i h0 = _mm256_cvtps_ph(a0, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m128i h1 = _mm256_cvtps_ph(a1, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
  const __m256i one = _mm256_set1_epi16(1);
  const __m256i exact = mask16_of2(
      _mm256_cmpeq_epi32(_mm256_castps_si256(_mm256_cvtph_ps(h0)), _mm256_castps_si256(a0)),
      _mm256_cmpeq_epi32(_mm256_castps_si256(_mm256_cvtph_ps(h1)), _mm256_castps_si256(a1)));
  __m256i h = _mm256_inserti128_si256(_mm256_castsi128_si256(h0), h1, 1);
  h = _mm256_or_si256(h, _mm256_andnot_si256(exact, one));  // rounded to odd
  const __m256i r = _mm256_add_epi16(_mm256_add_epi16(h, _mm256_set1_epi16((1 << (kDrop - 1)) - 1)),
                                     _mm256_and_si256(_mm256_srli_epi16(h, kDrop), one));
  return _mm256_srli_epi16(r, kDrop);
}

// encode8_store of two vectors (q0's codes, then q1's: 2 VecF::size() bytes).
template <Code8 kCode>
inline void encode8_store2(const VecF& q0, const VecF& q1, uint8_t* dst) {
  const __m256i bits0 = _mm256_castps_si256(q0), bits1 = _mm256_castps_si256(q1);
  const __m256i magnitude = _mm256_set1_epi32(0x7FFFFFFF);
  const __m256i abs0 = _mm256_and_si256(bits0, magnitude);
  const __m256i abs1 = _mm256_and_si256(bits1, magnitude);
  __m256 a0 = _mm256_castsi256_ps(abs0), a1 = _mm256_castsi256_ps(abs1);
  if constexpr (kCode == Code8::kSigned) {
    a0 = _mm256_mul_ps(a0, _mm256_set1_ps(0.00390625f));
    a1 = _mm256_mul_ps(a1, _mm256_set1_ps(0.00390625f));
  }
  __m256i code = round_through_fp16_x2<6>(a0, a1);
  if constexpr (kCode == Code8::kSigned) {  // the sign where the magnitude is not 0
    const __m256i sign =
        _mm256_and_si256(mask16_of2(_mm256_srai_epi32(bits0, 31), _mm256_srai_epi32(bits1, 31)),
                         _mm256_set1_epi16(0x80));
    code = _mm256_or_si256(
        code, _mm256_andnot_si256(_mm256_cmpeq_epi16(code, _mm256_setzero_si256()), sign));
  } else {  // a value that is not zero never has the code 0
    const __m256i zero16 = mask16_of2(_mm256_cmpeq_epi32(abs0, _mm256_setzero_si256()),
                                      _mm256_cmpeq_epi32(abs1, _mm256_setzero_si256()));
    code = _mm256_max_epu16(code, _mm256_andnot_si256(zero16, _mm256_set1_epi16(1)));
  }
  _mm_storeu_si128(
      reinterpret_cast<__m128i*>(dst),
      _mm_packus_epi16(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1)));
}
#else
template <Code8 kCode>
inline VecF decode8_scaled_vec(const uint8_t* src, float scale) {
  return decode8_vec<kCode>(load_codes(src)) * VecF(scale);
}

template <Code8 kCode>
inline void encode8_store(const VecF& q, uint8_t* dst) {
  store_codes(encode8_vec<kCode>(q), dst);
}
#endif

// Whether the coders take two vectors at a time (Note [Codes of two AVX2 vectors]).
#if defined(CPU_CAPABILITY_AVX2)
constexpr bool kCodesInPairs = true;
#else
constexpr bool kCodesInPairs = false;
#endif

// The whole vectors of x[j, n) times `inverse` (a block's values, block_inverse or
// block_inverse4 of its scale), from j: two at a time where kCodesInPairs (pair(y0, y1, k),
// generic so that other builds never instantiate it), then one (one(y, k)). Returns where
// the vectors ended (the elements after them are the caller's, by scalars).
template <typename One, typename Pair>
inline int64_t code_vectors(const float* x, float inverse, int64_t j, int64_t n, const One& one,
                            const Pair& pair) {
  constexpr int64_t W = VecF::size();
  const VecF inv(inverse);
  if constexpr (kCodesInPairs) {
    for (; j + 2 * W <= n; j += 2 * W) {
      pair(VecF::loadu(x + j) * inv, VecF::loadu(x + j + W) * inv, j);
    }
  }
  for (; j + W <= n; j += W) one(VecF::loadu(x + j) * inv, j);
  return j;
}

// The 8-bit codes of x[j, n) (finite values) by code_vectors.
template <Code8 kCode>
inline int64_t encode8_vectors(const float* x, float inverse, uint8_t* codes, int64_t j,
                               int64_t n) {
  return code_vectors(
      x, inverse, j, n, [codes](const VecF& y, int64_t k) { encode8_store<kCode>(y, codes + k); },
      [codes](const auto& y0, const auto& y1, int64_t k) {
        encode8_store2<kCode>(y0, y1, codes + k);
      });
}

// A whole block x (kBlock8 finite values) coded with `inverse` (block_inverse of its
// scale), by vectors.
template <Code8 kCode>
inline void encode_block_vec(const float* x, float inverse, uint8_t* codes) {
  encode8_vectors<kCode>(x, inverse, codes, 0, kBlock8);
}

}  // namespace cpu
}  // namespace ruda
