// CPU kernel of adamw_scaled_: vectorized with at::vec, parallel with at::parallel_for.
// This is the optimizer-offload path, not a test stub. The math is adamw_element() from
// csrc/adamw_math.h (Note [One math, two backends]); only loads and stores live here.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstring>
#include <type_traits>

#include "adamw_math.h"
#include "cpu/kernels/vec_load.h"
#include "kernels.h"

namespace ruda {
namespace {

using cpu::Vec;
using VecD = at::vec::Vectorized<double>;

struct VecOps {
  template <typename V>
  static inline V sqrt(const V& x) {
    return x.sqrt();
  }
  template <typename V>
  static inline V max(const V& a, const V& b) {
    return at::vec::maximum(a, b);
  }
  // Note [Canonical NaN]: lanes where x != x get the canonical NaN.
  static inline Vec canonical(const Vec& x) {
    return Vec::blendv(x, Vec(ScalarOps::canonical_nan<float>()), x != x);
  }
  static inline VecD canonical(const VecD& x) {
    return VecD::blendv(x, VecD(ScalarOps::canonical_nan<double>()), x != x);
  }
};

// The math and state type of a parameter dtype (Note [Parameter dtypes]).
template <typename P>
using MathOf = std::conditional_t<std::is_same_v<P, double>, double, float>;
template <typename P>
constexpr bool kIs16Bit = std::is_same_v<P, c10::Half> || std::is_same_v<P, c10::BFloat16>;

template <typename M>
StepCoefs<at::vec::Vectorized<M>> broadcast(const StepCoefs<M>& c) {
  using V = at::vec::Vectorized<M>;
  return {V(c.factor), V(c.beta1), V(c.one_minus_beta1), V(c.beta2), V(c.one_minus_beta2),
          V(c.eps),    V(c.lr),    V(c.decay),           V(c.bc1),   V(c.bc2),
          V(c.l2),     c.l2_on};
}

// W consecutive gradient elements at g as the math type (exact conversions).
template <typename M, typename G>
inline at::vec::Vectorized<M> load_grad(const G* g) {
  if constexpr (std::is_same_v<M, double>) {
    return VecD::loadu(g);
  } else {
    return cpu::load_fp32<G>(g);
  }
}

template <typename P>
constexpr bool kIsHalf = std::is_same_v<P, c10::Half>;

// A 16-bit parameter widened exactly to FP32.
template <typename P>
inline float widen(uint16_t bits) {
  if constexpr (kIsHalf<P>) {
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  } else {
    return float_from_bits(static_cast<uint32_t>(bits) << 16);
  }
}

// BF16 round to nearest even on a vector of lanes, with integer vector operations: each
// lane gets the bits of round_to_bf16 (adamw_math.h) in its low 16 bits (the rest is
// garbage: at::vec shifts int32 lanes arithmetically). Used where the step compares, not
// stores: a scalar loop over the lanes to choose between master and parameter cost the
// master-weights step 40% of its speed; for the stores a scalar loop measured faster than
// vector rounding followed by a narrowing through memory.
using VI = at::vec::Vectorized<int32_t>;

inline VI low16(const VI& x) { return x & VI(0xFFFF); }

// x >> n with zeros shifted in (at::vec's >> on int32 lanes is arithmetic).
inline VI shr(const VI& x, int n) {
  return (x >> VI(n)) & VI(static_cast<int32_t>(0xFFFFFFFFu >> n));
}

inline VI nan_lanes(const VI& x) { return (x & VI(0x7FFFFFFF)) > VI(0x7F800000); }

inline VI with_canonical_nan(const VI& r, const VI& nan) {
  return (r & ~nan) | (VI(kCanonicalNaNBits16) & nan);
}

inline VI round_bf16_vec(const Vec& v) {
  const VI x = at::vec::cast<int32_t>(v);
  const VI r = shr(x + VI(0x7FFF) + (shr(x, 16) & VI(1)), 16);
  return with_canonical_nan(r, nan_lanes(x));
}

// master_or_param for BF16 on a vector of lanes.
inline Vec master_or_param_bf16(const Vec& master, const Vec& widened) {
  const VI param = shr(at::vec::cast<int32_t>(widened), 16);
  return Vec::blendv(widened, master, at::vec::cast<float>(low16(round_bf16_vec(master)) == param));
}

// Software prefetch distance of the update loop, in elements (16 KiB of FP32 state).
// The loop streams four or five arrays at once; on a 2-core AVX2 machine the hardware
// prefetchers alone left the step 4-7% slower than with this (measured against
// torch's fused step in the same process; 8,192 elements helped less). A prefetch
// past the end of an array touches nothing: it never faults.
constexpr int64_t kPrefetchElems = 4096;

// The portable x86-64 build steps every element with the scalar loop: at::vec's DEFAULT
// vectors are arrays handled element by element, which the compiler does not turn into
// SSE2; measured on a 2-core AVX2 machine (benchmarks/bench_cpu_isa.py, 20M FP32
// elements), the scalar loop took 16 ms where the DEFAULT vectors took 99 ms (AVX2: 12).
// Elsewhere (aarch64) torch's DEFAULT vectors are NEON, and are kept.
#if defined(CPU_CAPABILITY_DEFAULT) && (defined(__x86_64__) || defined(_M_X64))
constexpr bool kVectorUpdate = false;
#else
constexpr bool kVectorUpdate = true;
#endif

// Elements [begin, end) of one tensor at step t.
template <typename P, typename G, bool AMSGRAD>
void update_range(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<MathOf<P>>& c,
                  int64_t t, int64_t begin, int64_t end) {
  using M = MathOf<P>;
  using V = at::vec::Vectorized<M>;
  constexpr int64_t W = V::size();
  constexpr int64_t kLineElems = 64 / sizeof(M);  // one prefetch per cache line of state
  static_assert(kLineElems % W == 0, "a cache line must hold whole vectors");
  P* p = static_cast<P*>(e.param);
  const G* g = static_cast<const G*>(e.grad);
  M* m = static_cast<M*>(L.exp_avg) + e.state_offset;
  M* v = static_cast<M*>(L.exp_avg_sq) + e.state_offset;
  M* vm = AMSGRAD ? static_cast<M*>(L.max_exp_avg_sq) + e.state_offset : nullptr;
  float* master = kIs16Bit<P> && L.master != nullptr ? L.master + e.state_offset : nullptr;
  uint16_t* p16 = reinterpret_cast<uint16_t*>(p);
  const uint32_t key = rounding_key(L.seed, t);
  const StepCoefs<V> cv = broadcast(c);
  auto update_vec = [&](int64_t k) {
    V pv;
    if constexpr (kIs16Bit<P>) {
      if (master != nullptr && std::is_same_v<P, c10::BFloat16>) {
        pv = master_or_param_bf16(Vec::loadu(master + k), cpu::load_fp32<P>(p + k));
      } else if (master != nullptr) {
        alignas(64) float in[W];
        for (int64_t j = 0; j < W; ++j)
          in[j] = master_or_param<kIsHalf<P>>(master[k + j], p16[k + j], widen<P>(p16[k + j]));
        pv = Vec::loadu(in);
      } else {
        pv = cpu::load_fp32<P>(p + k);
      }
    } else {
      pv = V::loadu(p + k);
    }
    V mv = V::loadu(m + k), vv = V::loadu(v + k);
    V vmv = AMSGRAD ? V::loadu(vm + k) : V(M(0));
    adamw_element<AMSGRAD, VecOps>(pv, load_grad<M>(g + k), mv, vv, vmv, cv);
    if constexpr (kIs16Bit<P>) {
      alignas(64) float out[W];
      pv.store(out);
      if (master != nullptr) pv.store(master + k);
      for (int64_t j = 0; j < W; ++j) {
        p16[k + j] = round_param<kIsHalf<P>>(out[j], L.rounding, key, e.state_offset + k + j);
      }
    } else {
      pv.store(p + k);
    }
    mv.store(m + k);
    vv.store(v + k);
    if (AMSGRAD) vmv.store(vm + k);
  };
  int64_t k = begin;
  if constexpr (kVectorUpdate) {
    for (; k + kLineElems <= end; k += kLineElems) {
      __builtin_prefetch(p + k + kPrefetchElems, 1);  // written back: fetch for writing
      __builtin_prefetch(g + k + kPrefetchElems, 0);
      __builtin_prefetch(m + k + kPrefetchElems, 1);
      __builtin_prefetch(v + k + kPrefetchElems, 1);
      if (AMSGRAD) __builtin_prefetch(vm + k + kPrefetchElems, 1);
      if (master != nullptr) __builtin_prefetch(master + k + kPrefetchElems, 1);
      for (int64_t j = k; j < k + kLineElems; j += W) update_vec(j);
    }
    for (; k + W <= end; k += W) update_vec(k);
  }
  for (; k < end; ++k) {  // the leftover elements, same math on scalars
    M vmk = AMSGRAD ? vm[k] : M(0);
    M pk;
    if constexpr (kIs16Bit<P>) {
      pk = master != nullptr ? master_or_param<kIsHalf<P>>(master[k], p16[k], widen<P>(p16[k]))
                             : static_cast<float>(p[k]);
    } else {
      pk = p[k];
    }
    adamw_element<AMSGRAD, ScalarOps>(pk, static_cast<M>(g[k]), m[k], v[k], vmk, c);
    if constexpr (kIs16Bit<P>) {
      if (master != nullptr) master[k] = pk;
      p16[k] = round_param<kIsHalf<P>>(pk, L.rounding, key, e.state_offset + k);
    } else {
      p[k] = pk;
    }
    if (AMSGRAD) vm[k] = vmk;
  }
}

template <typename P, typename G, bool AMSGRAD>
void run(const AdamWLaunch& L, float factor) {
  // A grain of a few tiles: a bucket of one or two tiles runs on the calling thread
  // instead of waking the pool (far more costly than the work on a loaded machine).
  constexpr int64_t kGrain = 4;
  at::parallel_for(0, L.n_units, kGrain, [&](int64_t u_begin, int64_t u_end) {
    int64_t i = find_tensor(L.table, L.n_tensors, u_begin);
    for (int64_t u = u_begin; u < u_end; ++u) {
      while (i + 1 < L.n_tensors && L.table[i + 1].unit_start <= u) ++i;
      const TensorEntry& e = L.table[i];
      // The counter was advanced before the parallel region (see adamw_cpu).
      const int64_t t = step_count(L.steps[e.step_index]);  // Note [Step counter range]
      const StepCoefs<MathOf<P>> c = make_coefs<MathOf<P>>(L.hyper, factor, t);
      const int64_t begin = (u - e.unit_start) * kCpuTile;
      update_range<P, G, AMSGRAD>(L, e, c, t, begin, std::min(begin + kCpuTile, e.numel));
    }
  });
}

template <typename P, typename G>
void run_amsgrad(const AdamWLaunch& L, float factor) {
  if (L.amsgrad) {
    run<P, G, true>(L, factor);
  } else {
    run<P, G, false>(L, factor);
  }
}

// The gradient dtypes each parameter dtype takes (checked by the binding).
template <typename P>
void run_param(const AdamWLaunch& L, float factor) {
  if constexpr (std::is_same_v<P, double>) {
    run_amsgrad<double, double>(L, factor);
  } else if constexpr (std::is_same_v<P, float>) {
    switch (L.grad_dtype) {
      case DType::kHalf:
        return run_amsgrad<float, c10::Half>(L, factor);
      case DType::kBFloat16:
        return run_amsgrad<float, c10::BFloat16>(L, factor);
      default:
        return run_amsgrad<float, float>(L, factor);
    }
  } else {  // a 16-bit parameter: its own dtype or FP32 gradients
    if (L.grad_dtype == DType::kFloat) return run_amsgrad<P, float>(L, factor);
    return run_amsgrad<P, P>(L, factor);
  }
}

}  // namespace

void adamw_cpu(const AdamWLaunch& L) {
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  for (int64_t i = 0; i < L.n_tensors; ++i) {
    float& s = L.steps[L.table[i].step_index];
    s = s + 1.0f;
  }
  switch (L.param_dtype) {
    case DType::kFloat:
      return run_param<float>(L, d.factor);
    case DType::kHalf:
      return run_param<c10::Half>(L, d.factor);
    case DType::kBFloat16:
      return run_param<c10::BFloat16>(L, d.factor);
    case DType::kDouble:
      return run_param<double>(L, d.factor);
  }
}

}  // namespace ruda
