// Vector loads of a gradient converted exactly to FP32, shared by the CPU kernels.
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace ruda {
namespace cpu {

using Vec = at::vec::Vectorized<float>;

// Vec::size() consecutive elements at p, as FP32 (every FP16/BF16 value is exact in FP32).
template <typename T>
inline Vec load_fp32(const T* p);
template <>
inline Vec load_fp32<float>(const float* p) {
  return Vec::loadu(p);
}
template <>
inline Vec load_fp32<c10::Half>(const c10::Half* p) {
  Vec out;
  at::vec::load_fp32_from_fp16(p, out);
  return out;
}
template <>
inline Vec load_fp32<c10::BFloat16>(const c10::BFloat16* p) {
  Vec out;
  at::vec::load_fp32_from_bf16(p, out);
  return out;
}

}  // namespace cpu
}  // namespace ruda
