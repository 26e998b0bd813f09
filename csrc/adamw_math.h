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
constexpr uint64_t kCanonicalNaNBits64 = 0x7FFFFFFFFFFFFFFFull;
// FP16 and BF16 parameters store a NaN as 0x7FFF (CUDA's conversions make it too).
constexpr uint16_t kCanonicalNaNBits16 = 0x7FFFu;

// Bit patterns of floating values, the same operation on both backends.
RUDA_HOST_DEVICE inline uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
#endif
}

RUDA_HOST_DEVICE inline float float_from_bits(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

RUDA_HOST_DEVICE inline double double_from_bits(uint64_t b) {
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(b));
#else
  double x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
#endif
}

// Scalar operations for V = float, and V = double for FP64 parameters (Note [Parameter
// dtypes]); the CPU file supplies the Vectorized twins.
struct ScalarOps {
  RUDA_HOST_DEVICE static inline float sqrt(float x) { return ::sqrtf(x); }
  RUDA_HOST_DEVICE static inline double sqrt(double x) { return ::sqrt(x); }
  // IEEE maximum: NaN if either operand is NaN (at::vec::maximum does the same).
  template <typename T>
  RUDA_HOST_DEVICE static inline T max(T a, T b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
  }
  template <typename T>
  RUDA_HOST_DEVICE static inline T canonical_nan() {
    if constexpr (sizeof(T) == sizeof(double)) {
      return double_from_bits(kCanonicalNaNBits64);
    } else {
      return float_from_bits(kCanonicalNaNBits);
    }
  }
  template <typename T>
  RUDA_HOST_DEVICE static inline T canonical(T x) {
    return x == x ? x : canonical_nan<T>();
  }
  // x / c for a bias correction c of FP32 math, from inverse = 1 / c in FP64: the FP64
  // product rounded once (Note [Division by a step constant]); FP64 math divides.
  RUDA_HOST_DEVICE static inline float div_step(float x, float, double inverse) {
    return static_cast<float>(static_cast<double>(x) * inverse);
  }
  RUDA_HOST_DEVICE static inline double div_step(double x, double c, double) { return x / c; }
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
// docs/design.md section 1 asks. The kernels evaluate it from the step counter that lives in
// device memory, so the host never needs to know t (no host sync).
template <typename M = float>
RUDA_HOST_DEVICE inline M bias_correction(double beta, int64_t t) {
  return static_cast<M>(1.0 - pow_int(beta, t));
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
  // The factor of FP64 math: factor, widened, or with an FP64 clip coefficient
  // (clip_coef_f64) that coefficient over the scale in FP64.
  double factor64;
};

// The factor of math type M: FP32 math reads factor, FP64 math factor64.
template <typename M>
RUDA_HOST_DEVICE inline double factor_of(const StepDecision& d) {
  if constexpr (sizeof(M) == sizeof(double)) {
    return d.factor64;
  } else {
    return static_cast<double>(d.factor);
  }
}

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
  const float factor = signed_clip / scale;
  double factor64 = static_cast<double>(factor);
  if (c.clip_coef_f64 != nullptr) {
    const double clip64 = c.clip_coef_f64[0];
    factor64 = (c.maximize ? -clip64 : clip64) / static_cast<double>(scale);
  }
  return {skip, factor, factor64};
}

// The coefficients of one update at step t, in the math type M (FP32, or FP64 for FP64
// parameters); every lane of a vector holds the same.
template <typename V>
struct StepCoefs {
  V factor, beta1, one_minus_beta1, beta2, one_minus_beta2, eps, lr, decay, bc1, bc2;
  V l2;                // Adam's L2 coefficient (Note [Weight decay modes])
  bool l2_on = false;  // uniform over a launch: a predictable branch, no template copy
  // 1 / bc1 and 1 / bc2 in FP64, for FP32 math (Note [Division by a step constant]).
  double inv_bc1 = 1.0, inv_bc2 = 1.0;
};

// The learning rate: a Tensor lr's value when the launch has one (read from memory by
// the kernel), else the float argument.
RUDA_HOST_DEVICE inline double learning_rate(const AdamWHyper& h) {
  if (h.lr_f32 != nullptr) return static_cast<double>(h.lr_f32[0]);
  if (h.lr_f64 != nullptr) return h.lr_f64[0];
  return h.lr;
}

// Host-precision scalars are computed in FP64 and cast once to M (Note [Bias correction]).
// coefs_at: the coefficients from the learning rate `lr` and the bias corrections bc1, bc2
// of the step (what make_coefs computes from t); the CUDA kernels make these once per step
// counter and the rest per tile from the launch, whose fields the compiler keeps in uniform
// registers (Note [CUDA tile walk] in csrc/cuda/adamw_cuda.cu).
// The FP32 constants of h, cast once (the binding calls it as it fills a launch).
RUDA_HOST_DEVICE inline void set_float_consts(AdamWHyper& h) {
  h.beta1_f = static_cast<float>(h.beta1);
  h.one_minus_beta1_f = static_cast<float>(1.0 - h.beta1);
  h.beta2_f = static_cast<float>(h.beta2);
  h.one_minus_beta2_f = static_cast<float>(1.0 - h.beta2);
  h.eps_f = static_cast<float>(h.eps);
  h.weight_decay_f = static_cast<float>(h.weight_decay);
}

template <typename M = float>
RUDA_HOST_DEVICE inline StepCoefs<M> coefs_at(const AdamWHyper& h, double factor, double lr, M bc1,
                                              M bc2, double inv_bc1, double inv_bc2) {
  StepCoefs<M> c;
  c.factor = static_cast<M>(factor);
  if constexpr (sizeof(M) == sizeof(float)) {  // set_float_consts' casts
    c.beta1 = h.beta1_f;
    c.one_minus_beta1 = h.one_minus_beta1_f;
    c.beta2 = h.beta2_f;
    c.one_minus_beta2 = h.one_minus_beta2_f;
    c.eps = h.eps_f;
  } else {
    c.beta1 = static_cast<M>(h.beta1);
    c.one_minus_beta1 = static_cast<M>(1.0 - h.beta1);
    c.beta2 = static_cast<M>(h.beta2);
    c.one_minus_beta2 = static_cast<M>(1.0 - h.beta2);
    c.eps = static_cast<M>(h.eps);
  }
  c.lr = static_cast<M>(lr);
  // Note [Weight decay modes]
  // AdamW (torch.optim.AdamW, Adam(decoupled_weight_decay=True)): the parameter is scaled
  // by 1 - lr * wd; the gradient and moments never see the decay. Adam (torch.optim.Adam):
  // wd * p is added to the unscaled, clipped (and for maximize negated) gradient before
  // the moments, as torch adds it to the gradient it is given, and the parameter is not
  // scaled (decay 1: p * 1 is p exactly). With wd == 0 both are the same update, bit for
  // bit (l2_on false: no `+ 0 * p`, which would turn an infinite p's gradient into NaN).
  if (h.l2) {
    c.decay = static_cast<M>(1.0);
    if constexpr (sizeof(M) == sizeof(float)) {
      c.l2 = h.weight_decay_f;
    } else {
      c.l2 = static_cast<M>(h.weight_decay);
    }
    c.l2_on = h.weight_decay != 0.0;
  } else {
    c.decay = static_cast<M>(1.0 - lr * h.weight_decay);
    c.l2 = static_cast<M>(0.0);
  }
  c.bc1 = bc1;
  c.bc2 = bc2;
  c.inv_bc1 = inv_bc1;
  c.inv_bc2 = inv_bc2;
  return c;
}

template <typename M = float>
RUDA_HOST_DEVICE inline StepCoefs<M> make_coefs(const AdamWHyper& h, double factor, int64_t t) {
  const M bc1 = bias_correction<M>(h.beta1, t), bc2 = bias_correction<M>(h.beta2, t);
  return coefs_at<M>(h, factor, learning_rate(h), bc1, bc2, 1.0 / static_cast<double>(bc1),
                     1.0 / static_cast<double>(bc2));
}

// Note [Parameter dtypes]
// * FP32 parameters: FP32 math and state (docs/design.md section 1).
// * FP64 parameters: FP64 math, FP64 state and FP64 gradients, as torch's AdamW computes
//   for them; the same expressions with M = double. (FP32 math would cost an FP64 user
//   half the precision they chose, for no bandwidth gain worth having.)
// * FP16/BF16 parameters: FP32 math and FP32 moments. The value updated is the FP32
//   master copy when the bucket keeps one (master_weights), else the parameter widened
//   exactly to FP32; the result is written to the parameter rounded to nearest even
//   (round_to_half/round_to_bf16 below), or for BF16 stochastically (round_bf16_stochastic).
//   The conversions are integer operations on the bits, the same code on both backends,
//   so CPU and CUDA write the same 16-bit values.

// FP32 -> BF16, round to nearest even; NaN -> kCanonicalNaNBits16.
// Branch-free (selects, not jumps), so that the CPU loops over a vector's lanes vectorize.
RUDA_HOST_DEVICE inline uint16_t round_to_bf16(uint32_t x) {
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return kCanonicalNaNBits16;
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// FP32 -> FP16, round to nearest even (subnormals included); NaN -> kCanonicalNaNBits16.
RUDA_HOST_DEVICE inline uint16_t round_to_half(uint32_t x) {
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return kCanonicalNaNBits16;
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: inf
  if (ax < 0x38800000u) {  // below 2^-14: an FP16 subnormal or zero
    if (ax <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: ties to 0
    const uint32_t e = ax >> 23;                                // 102 ... 112
    const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
    const uint32_t shift = 126u - e;  // value / 2^-24 = mant / 2^shift
    uint32_t q = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;  // may carry into the smallest normal
    return static_cast<uint16_t>(sign | q);
  }
  const uint32_t r = ax - 0x38000000u;  // exponent rebiased from 127 to 15
  return static_cast<uint16_t>(sign | ((r + 0xFFFu + ((r >> 13) & 1u)) >> 13));
}

// FP32 -> BF16 rounded up in magnitude with probability (dropped bits) / 2^16, as
// torchao's bf16_stochastic_round; NaN -> kCanonicalNaNBits16. A value within one BF16
// ulp of the largest finite one may round to infinity, as with any stochastic rounding.
RUDA_HOST_DEVICE inline uint16_t round_bf16_stochastic(uint32_t x, uint32_t random) {
  const uint32_t ax = x & 0x7FFFFFFFu;
  const uint32_t r = (x + (ax == 0x7F800000u ? 0u : (random & 0xFFFFu))) >> 16;  // +-inf stays
  return static_cast<uint16_t>(ax > 0x7F800000u ? kCanonicalNaNBits16 : r);
}

// Note [Stochastic rounding bits]
// The random bits of element `index` (its position in the bucket's flat state) at step t
// of seed `seed`: a counter-based hash, so that each element draws independently at
// every step, any backend and any thread schedule draws the same bits, and a resumed run
// (same seed, same counters) repeats them. The (seed, t) part is mixed once per tile
// (SplitMix64's finalizer, rounding_key); each element then costs one 32-bit mix
// (MurmurHash3's fmix32) of its index and that key, which the CPU loops vectorize.
RUDA_HOST_DEVICE inline uint32_t rounding_key(uint64_t seed, int64_t t) {
  uint64_t z = seed + static_cast<uint64_t>(t) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return static_cast<uint32_t>((z ^ (z >> 31)) >> 32);
}

constexpr uint32_t kRoundingHigh = 0x85EBCA77u;

// rounding_bits in two parts, for a range of elements that shares its indices' high 32
// bits (one that does not cross a multiple of 2^32): the part of those bits and the key,
// once, and the rest per element, the same bits.
RUDA_HOST_DEVICE inline uint32_t rounding_high(uint32_t key, int64_t index) {
  return static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32) * kRoundingHigh ^ key;
}
// rounding_high of an index of a range of fewer than 2^32 that may cross a multiple of 2^32,
// from its first index's (`high`, and `low` its low 32 bits): `at` its low 32 bits, past
// the crossing where it is below `low`, there the next high word. `key()` gives the key,
// asked only then (the CUDA edge kernels read it from shared memory: Note [8-bit CUDA
// registers] in csrc/cuda/adamw_cuda.cu).
template <typename Key>
RUDA_HOST_DEVICE inline uint32_t rounding_high_at(uint32_t high, uint32_t low, uint32_t at,
                                                  const Key& key) {
  if (at >= low) return high;
  const uint32_t k = key();
  return ((high ^ k) + kRoundingHigh) ^ k;  // (h + 1) * kRoundingHigh ^ key from h * ...
}

RUDA_HOST_DEVICE inline uint32_t rounding_mix(uint32_t high, uint32_t low) {
  uint32_t h = low * 0x9E3779B1u ^ high;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h;
}

RUDA_HOST_DEVICE inline uint32_t rounding_bits(uint32_t key, int64_t index) {
  return rounding_mix(rounding_high(key, index), static_cast<uint32_t>(index));
}

// The 16-bit parameter's bits written for the FP32 result x of element `index`, FP16
// (IS_HALF) or BF16 (Note [Parameter dtypes]); `key` is rounding_key(seed, t).
template <bool IS_HALF>
RUDA_HOST_DEVICE inline uint16_t round_nearest16(uint32_t x) {
  if constexpr (IS_HALF) {
    return round_to_half(x);
  } else {
    return round_to_bf16(x);
  }
}

template <bool IS_HALF>
RUDA_HOST_DEVICE inline uint16_t round_param(float x, Rounding rounding, uint32_t key,
                                             int64_t index) {
  const uint32_t bits = float_bits(x);
  if constexpr (!IS_HALF) {
    if (rounding == Rounding::kStochastic) {
      return round_bf16_stochastic(bits, rounding_bits(key, index));
    }
  }
  return round_nearest16<IS_HALF>(bits);
}

// Note [Low-precision states]
// state_precision="bf16" (ruda_torch/optimizer.py) keeps exp_avg, exp_avg_sq and
// max_exp_avg_sq in BF16: 2 bytes per moment instead of 4. A step widens each stored
// moment exactly to FP32, runs adamw_element() unchanged (the parameter is updated from the
// moments as computed in FP32, before they are rounded for storage), and stores each
// moment rounded to BF16: stochastically by default, or to nearest even. Nearest rounding
// stalls a BF16 second moment: with beta2 = 0.999 the step changes v by 0.1% relative,
// below half a BF16 ulp (2^-9 = 0.2%), so v stays where it is while the gradients shrink
// (tests/test_state_precision.py; docs/performance.md has the quality run). Stochastic
// rounding is unbiased: v moves by 0.1% on average. Its bits are counter-based as the
// parameters' (Note [Stochastic rounding bits]), from streams of their own (the seed mixed
// with a constant): one 32-bit draw per element gives exp_avg its low 16 bits and
// exp_avg_sq its high 16 bits (each rounding uses 16), max_exp_avg_sq draws from a second
// stream, so the moments and the parameter of one element round independently, and CPU
// and CUDA store the same bits.
enum class Moment : uint64_t {
  kAverages = 0x6578705F61766731ull,     // exp_avg (low half), exp_avg_sq (high half)
  kMaxExpAvgSq = 0x6D61785F61767371ull,  // max_exp_avg_sq (low half)
};

RUDA_HOST_DEVICE inline uint32_t moment_key(uint64_t seed, int64_t t, Moment moment) {
  return rounding_key(seed ^ static_cast<uint64_t>(moment), t);
}

// The stored BF16 bits of a moment's FP32 value x; `random` holds its 16 random bits in
// the low half (stochastic rounding only).
RUDA_HOST_DEVICE inline uint16_t round_moment(float x, Rounding rounding, uint32_t random) {
  const uint32_t bits = float_bits(x);
  if (rounding == Rounding::kStochastic) return round_bf16_stochastic(bits, random);
  return round_to_bf16(bits);
}

// A BF16 value's bits widened exactly to FP32.
RUDA_HOST_DEVICE inline float widen_bf16(uint16_t bits) {
  return float_from_bits(static_cast<uint32_t>(bits) << 16);
}

// The FP32 value updated for a 16-bit parameter with master weights (Note [Master
// weights] in ruda_torch/_fused.py): the master while the parameter (bits `param`,
// `widened` exactly to FP32) still holds it rounded to nearest even, else the parameter's
// own value (it was written since).
template <bool IS_HALF>
RUDA_HOST_DEVICE inline float master_or_param(float master, uint16_t param, float widened) {
  return round_nearest16<IS_HALF>(float_bits(master)) == param ? master : widened;
}

// Note [Remainder master]
// master_weights="remainder" (BF16 parameters): the FP32 master is kept as its low 16 bits
// only, an int16 remainder beside the BF16 parameter, which holds the high 16 bits rounded:
//   param     = (bits + 0x8000) >> 16   (round to nearest, ties away from zero, on the bits)
//   remainder = bits & 0xFFFF           (as int16: bits - (param << 16), in [-32768, 32767])
//   master    = (param << 16) + remainder (sign-extended)   -- exactly the FP32 master.
// Why ties away and not to even, as master_weights=True rounds: with ties to even two
// masters, (p - 1) << 16 | 0x8000 and p << 16 | 0x8000, both round to the even p with the
// same low half, so 65,537 masters round to each even parameter and 16 bits cannot tell
// them apart; ties away makes the map from (parameter, remainder) to masters one to one
// (TransformerEngine's store_param_remainders rounds the same way). So the masters of
// "remainder" and True are the same bits, step after step; the BF16 parameter differs only
// where a master's low half is exactly 0x8000 with an even high half (1 in 131,072 values),
// by one BF16 unit in the last place, rounded up where True rounds down.
// A NaN master stores the canonical BF16 NaN with remainder 0, a master of bits 0x7FFF0000
// (a NaN; True's master is the canonical FP32 NaN, whose low half no int16 reaches). The master
// made from a parameter that something wrote between steps is that parameter plus the old low half,
// within half a BF16 unit of the written value: what was written is never lost (True's
// master_or_param finds such elements exactly; 2 bytes cannot). The one exception is a +-0 written
// over a negative remainder, which would carry through the sign bit: the master is then the
// parameter itself. Whole-tensor writes seen by the parameter's version counter reset its
// remainders to 0 in the optimizer (Note [Master weights] in ruda_torch/_fused.py).
RUDA_HOST_DEVICE inline float master_of_remainder(uint16_t param, uint16_t remainder) {
  const uint32_t high = static_cast<uint32_t>(param) << 16;
  const uint32_t bits =
      high + static_cast<uint32_t>(static_cast<int32_t>(static_cast<int16_t>(remainder)));
  return float_from_bits(((bits ^ high) >> 31) != 0 ? high : bits);
}

// The parameter's bits (high half) and the remainder (low half) of a master x.
RUDA_HOST_DEVICE inline uint32_t split_master(float x) {
  const uint32_t bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint32_t>(kCanonicalNaNBits16) << 16;
  return ((bits + 0x8000u) & 0xFFFF0000u) | (bits & 0xFFFFu);
}

// Note [Division by a step constant]
// m / bc1 and v_used / bc2 divide by constants of the step: bc = 1 - beta^t rounded to
// FP32, a normal number in [2^-53, 1] (beta < 1 in FP64). For every FP32 x, RN32(x / bc) =
// RN32(RN64(x * RN64(1 / bc))): the FP64 product with the reciprocal, rounded once to FP32.
// On the GPU that is three instructions where an IEEE division is about ten (the
// reciprocal is made once per step counter). Proof. The product is within |x / bc| 2^-51
// of x / bc (two FP64 roundings), and exact for x zero, infinite or NaN. RN32 changes value
// only at the midpoints M = (2K + 1) 2^s between adjacent FP32 values (FLT_MAX's upper one
// included; 2K + 1 < 2^25, with 2^24 <= 2K + 1 for those between normal values). Write x =
// X 2^a and bc = C 2^b with X, C odd integers below 2^24 (b <= 0, as bc <= 1): then x / bc
// - M = N / C with N = X 2^(a - b) - C (2K + 1) 2^s, an odd multiple of 2^d, d = min(a - b,
// s): for a - b != s one of the terms is an odd multiple of 2^d and the other an even one;
// for a - b = s, X = C (2K + 1) would need 2K + 1 <= X < 2^24, a midpoint between
// subnormals (s = -150), and then a = b - 150 <= -150, which an odd X 2^a >= 2^-149 (an FP32
// value) cannot have. So |x / bc - M| >= 2^d / C: for d = s more than 2^(s - 24) > |M| 2^-49,
// for d = a - b < s more than |x / bc| 2^-24. No midpoint lies between x / bc and the
// product, which is none itself: both round to the same FP32 value. The CPU's vector loops
// divide (one instruction there), its scalar loops and the CUDA kernels multiply
// (ScalarOps::div_step); tests/test_step_division.py checks the identity on every binade,
// subnormals included, against the bias corrections of real steps.

// The update in three stages (docs/design.md section 1):
// adamw_moments: the gradient into the moments; returns v_used.
//   g      = stored * factor   (+ l2 * p: Adam, Note [Weight decay modes])
//   m      = beta1 * m + (1 - beta1) * g
//   v      = beta2 * v + (1 - beta2) * g * g
//   v_used = max(v_max, v)   (AMSGrad; the uncorrected maximum is stored)
// then m_hat = m / bc1 and v_hat = v_used / bc2, and adamw_param: the new parameter
//   p      = p * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps)
template <bool AMSGRAD, typename Ops, typename V>
RUDA_HOST_DEVICE inline V adamw_moments(const V& p, V stored_grad, V& m, V& v, V& v_max,
                                        const StepCoefs<V>& c) {
  V g = stored_grad * c.factor;
  if (c.l2_on) g = g + c.l2 * p;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * (g * g);
  if (AMSGRAD) {
    v_max = Ops::max(v_max, v);
    return v_max;
  }
  return v;
}

template <typename Ops, typename V>
RUDA_HOST_DEVICE inline V adamw_param(const V& p, V m_hat, V v_hat, const StepCoefs<V>& c) {
  V denom = Ops::sqrt(v_hat) + c.eps;
  return p * c.decay - (c.lr * m_hat) / denom;
}

// One element (or one vector of elements), every stored value canonical (Note [Canonical
// NaN]); kCanonicalMoments false leaves a NaN moment as computed, for 8-bit moments, which
// code every NaN alike.
template <bool AMSGRAD, typename Ops, bool kCanonicalMoments = true, typename V>
RUDA_HOST_DEVICE inline void adamw_element(V& p, V stored_grad, V& m, V& v, V& v_max,
                                           const StepCoefs<V>& c) {
  const V v_used = adamw_moments<AMSGRAD, Ops>(p, stored_grad, m, v, v_max, c);
  const V m_hat = Ops::div_step(m, c.bc1, c.inv_bc1);
  const V v_hat = Ops::div_step(v_used, c.bc2, c.inv_bc2);
  p = Ops::canonical(adamw_param<Ops>(p, m_hat, v_hat, c));
  if (kCanonicalMoments) {
    m = Ops::canonical(m);
    v = Ops::canonical(v);
    if (AMSGRAD) v_max = Ops::canonical(v_max);
  }
}

}  // namespace ruda
