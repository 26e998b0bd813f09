// The AdamW / AMSGrad per-element update, shared by the CPU and the CUDA kernels.
//
// Note [One math, two backends]
// Every kernel that updates a parameter calls adamw_element() below, the CPU kernels
// with V = at::vec::Vectorized<float> (and V = float for the leftover elements), the
// CUDA kernels with V = float. Each multiply, add, divide and square root is its own
// correctly rounded IEEE FP32 operation: the build forbids FMA contraction
// (-ffp-contract=off, nvcc --fmad=false, see setup.py) and uses no fast-math, so the
// CPU and the GPU produce the same bits for the same inputs, and tests on a machine
// without a GPU speak for the GPU. Do not rewrite an expression here without keeping
// the CPU and CUDA paths on the same function.
#pragma once

#include <cstdint>
#include <cstring>

#include "ruda_params.h"

namespace ruda {

// Note [Canonical NaN]
// A NaN has many bit patterns, and the backends make different ones: CUDA arithmetic
// returns 0x7FFFFFFF, x86 returns 0xFFC00000 for an invalid operation and keeps the
// payload of a NaN operand, and a maximum that selects an operand keeps its bits. So that
// CPU and CUDA write the same bits in every case, every value the update stores goes
// through canonical(): NaN becomes 0x7FFFFFFF (CUDA's own), anything else is unchanged.
constexpr uint32_t kCanonicalNaNBits = 0x7FFFFFFFu;

// Scalar operations for V = float; the CPU file supplies the Vectorized<float> twin.
struct ScalarOps {
  RUDA_HOST_DEVICE static inline float sqrt(float x) { return ::sqrtf(x); }
  // IEEE maximum: NaN if either operand is NaN (at::vec::maximum does the same).
  RUDA_HOST_DEVICE static inline float max(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
  }
  RUDA_HOST_DEVICE static inline float canonical_nan() {
#if defined(__CUDA_ARCH__)
    return __int_as_float(static_cast<int>(kCanonicalNaNBits));
#else
    float nan;
    const uint32_t bits = kCanonicalNaNBits;
    std::memcpy(&nan, &bits, sizeof(nan));
    return nan;
#endif
  }
  RUDA_HOST_DEVICE static inline float canonical(float x) { return x == x ? x : canonical_nan(); }
};

// beta^e by repeated squaring in FP64 (Note [Bias correction]).
RUDA_HOST_DEVICE inline double pow_int(double base, int64_t e) {
  double result = 1.0;
  while (e > 0) {
    if (e & 1) result = result * base;
    base = base * base;
    e >>= 1;
  }
  return result;
}

// Note [Bias correction]
// 1 - beta^t is computed in FP64 by integer exponentiation and cast once to FP32, as
// SPEC section 1 asks. The kernels evaluate it from the step counter that lives in
// device memory, so the host never needs to know t (no host sync).
RUDA_HOST_DEVICE inline float bias_correction(double beta, int64_t t) {
  return static_cast<float>(1.0 - pow_int(beta, t));
}

// Note [Step counter range]
// The FP32 counter, already advanced for this step, as the integer t of the bias
// correction. load_state_dict and the functional API reject counters that are negative,
// non-integral or non-finite, but a counter lives in device memory and can still be
// written there (an in-place fill of state["step"]); the kernels read it without a host
// sync, so such values are made harmless here instead of overflowing the int64 cast (a
// NaN parameter): anything below 1, NaN included, counts as t = 1, and anything above
// 2^62 as 2^62. Every FP64 beta < 1 is at most 1 - 2^-53, so beta^t < 2^-25 once
// t >= 2^58 and 1 - beta^t is then exactly 1 in FP32: the upper clamp changes no result.
RUDA_HOST_DEVICE inline int64_t step_count(float counter) {
  constexpr float kMaxStep = 4611686018427387904.0f;  // 2^62, exact in FP32
  if (!(counter >= 1.0f)) return 1;
  if (counter >= kMaxStep) return static_cast<int64_t>(kMaxStep);
  return static_cast<int64_t>(counter);
}

// clip_grad_norm_'s coefficient from a sum of squares: min(1, max_norm / (norm + 1e-6)).
RUDA_HOST_DEVICE inline float clip_coefficient(float sum_of_squares, float max_norm) {
  float norm = ::sqrtf(sum_of_squares);
  float coef = max_norm / (norm + 1e-6f);
  return coef < 1.0f ? coef : 1.0f;
}

// What the kernels read from device memory before touching any element: whether to
// skip the step and the factor that unscales, clips and (for maximize) negates the
// stored gradient: g = stored * factor, factor = (+-clip_coef) / gradient_scale.
struct StepDecision {
  bool skip;
  float factor;
};

RUDA_HOST_DEVICE inline StepDecision decide_step(const StepControl& c) {
  bool skip = c.found_inf != nullptr && c.found_inf[0] != 0.0f;
  float clip = 1.0f;
  if (c.stats != nullptr) {
    skip = skip || c.stats[2] != 0.0f;  // nonfinite_count (Note [Statistics row])
    if (c.max_grad_norm > 0.0) {
      clip = clip_coefficient(c.stats[0], static_cast<float>(c.max_grad_norm));
    }
  }
  if (c.clip_coef != nullptr) clip = c.clip_coef[0];
  float scale = c.grad_scale != nullptr ? c.grad_scale[0] : 1.0f;
  // A scale the gradient cannot be divided by (0, negative, infinite or NaN; only a
  // device-side value can be one, the host paths reject them) skips the step instead of
  // writing infinities or NaN into the parameters and moments.
  skip = skip || !(scale > 0.0f && scale <= 3.402823466e38f);
  // Negating the clip coefficient negates g exactly (IEEE rounding is sign-symmetric).
  float signed_clip = c.maximize ? -clip : clip;
  return {skip, signed_clip / scale};
}

// The FP32 coefficients of one update at step t; every lane of a vector holds the same.
template <typename V>
struct StepCoefs {
  V factor, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, lr, decay, bc1, bc2;
};

// Host-precision scalars are computed in FP64 and cast once (Note [Bias correction]).
RUDA_HOST_DEVICE inline StepCoefs<float> make_coefs(const AdamWHyper& h, float factor, int64_t t) {
  StepCoefs<float> c;
  c.factor = factor;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.lr = static_cast<float>(h.lr);
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  c.bc1 = bias_correction(h.beta1, t);
  c.bc2 = bias_correction(h.beta2, t);
  return c;
}

// SPEC section 1, one element (or one vector of elements):
//   g      = stored * factor
//   m      = beta1 * m + (1 - beta1) * g
//   v      = beta2 * v + (1 - beta2) * g * g
//   v_used = max(v_max, v)   (AMSGrad; the uncorrected maximum is stored)
//   p      = p * (1 - lr * wd) - lr * (m / bc1) / (sqrt(v_used / bc2) + eps)
template <bool AMSGRAD, typename Ops, typename V>
RUDA_HOST_DEVICE inline void adamw_element(V& p, V stored_grad, V& m, V& v, V& v_max,
                                           const StepCoefs<V>& c) {
  V g = stored_grad * c.factor;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  V v_used = v;
  if (AMSGRAD) {
    v_max = Ops::max(v_max, v);
    v_used = v_max;
  }
  V denom = Ops::sqrt(v_used / c.bc2) + c.eps;
  p = Ops::canonical(p * c.decay - (c.lr * (m / c.bc1)) / denom);  // Note [Canonical NaN]
  m = Ops::canonical(m);
  v = Ops::canonical(v);
  if (AMSGRAD) v_max = Ops::canonical(v_max);
}

}  // namespace ruda
