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

}  // namespace cpu
}  // namespace ruda
