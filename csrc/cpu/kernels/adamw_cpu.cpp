// CPU kernel of adamw_scaled_: vectorized with at::vec, parallel with at::parallel_for.
// This is the optimizer-offload path, not a test stub. The math is adamw_element() from
// csrc/adamw_math.h (Note [One math, two backends]); only loads and stores live here.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>

#include <cstring>
#include <type_traits>
#include <utility>

#include "adamw_math.h"
#include "cpu/kernels/quant4_vec.h"
#include "cpu/kernels/quant8_vec.h"
#include "cpu/kernels/vec_load.h"
#include "kernels.h"
#include "quant4.h"
#include "quant8.h"

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
#if defined(CPU_CAPABILITY_AVX512)
    // A compare into a mask register and a masked blend: at::vec's `x != x` makes a
    // vector of the mask and blendv a mask of it again (4 instructions, measured on Zen 4).
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x,
                                _mm512_set1_ps(ScalarOps::canonical_nan<float>()));
#else
    return Vec::blendv(x, Vec(ScalarOps::canonical_nan<float>()), x != x);
#endif
  }
  static inline VecD canonical(const VecD& x) {
    return VecD::blendv(x, VecD(ScalarOps::canonical_nan<double>()), x != x);
  }
  // The division itself: the bits of ScalarOps::div_step's product (Note [Division by a
  // step constant]), in one vector instruction.
  template <typename V>
  static inline V div_step(const V& x, const V& c, double) {
    return x / c;
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

// rounding_bits (adamw_math.h) of the elements index, index + 1, ... on a vector of lanes.
// Integer lanes wrap on overflow (the build has -fwrapv for the portable vectors), which is
// the uint32 arithmetic of the scalar function.
inline VI rounding_bits_vec(uint32_t key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  if (static_cast<uint32_t>(i) > 0xFFFFFFFFu - (VI::size() - 1)) {
    // The lanes' low 32 bits wrap (a slot offset near a multiple of 2^32): lane by lane.
    alignas(64) int32_t lanes[VI::size()];
    for (int64_t j = 0; j < VI::size(); ++j) {
      lanes[j] = static_cast<int32_t>(rounding_bits(key, index + j));
    }
    return VI::loadu(lanes);
  }
  const VI lo = VI(static_cast<int32_t>(static_cast<uint32_t>(i))) + VI::arange(0, 1);
  const auto hi = static_cast<int32_t>(static_cast<uint32_t>(i >> 32) * 0x85EBCA77u);
  VI h = (lo * VI(static_cast<int32_t>(0x9E3779B1u))) ^ VI(hi);
  h = h ^ VI(static_cast<int32_t>(key));
  h = h ^ shr(h, 16);
  h = h * VI(static_cast<int32_t>(0x85EBCA6Bu));
  h = h ^ shr(h, 13);
  h = h * VI(static_cast<int32_t>(0xC2B2AE35u));
  return h ^ shr(h, 16);
}

// Note [Rounding canonical moments]
// The moments that adamw_element() returns are canonical (Note [Canonical NaN]): a NaN is
// exactly 0x7FFFFFFF. Clamping the bits, as signed lanes, to at most 0x7FFF0000 changes
// that NaN alone (every other positive value is at most 0x7F800000, negative ones are
// negative lanes), and turns both roundings below into their scalar functions'
// (round_to_bf16, round_bf16_stochastic) without a NaN test: 0x7FFF0000 rounds to 0x7FFF
// either way. Infinities need no test either: their low 16 bits are zero, so no rounding
// increment carries. Each lane's low 16 bits are the result; the rest is garbage.
inline VI clamp_canonical_nan(const Vec& v) {
  return at::vec::minimum(at::vec::cast<int32_t>(v), VI(0x7FFF0000));
}

inline VI round_bf16_nearest_vec(const Vec& v) {
  const VI x = clamp_canonical_nan(v);
  return (x + VI(0x7FFF) + ((x >> VI(16)) & VI(1))) >> VI(16);
}

// `random`: each lane's 16 random bits in its low half.
inline VI round_bf16_stochastic_vec(const Vec& v, const VI& random) {
  return (clamp_canonical_nan(v) + (random & VI(0xFFFF))) >> VI(16);
}

// The low 16 bits of each lane, stored as consecutive uint16 (a loop the compiler turns
// into one narrowing store).
inline void store_low16(const VI& r, uint16_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
#elif defined(CPU_CAPABILITY_AVX2)
  // packus saturates signed lanes to [0, 65535]: the high halves are cleared first; it
  // packs within 128-bit halves, so the two 64-bit groups in the middle swap back.
  const __m256i low = _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF));
  const __m256i packed = _mm256_packus_epi32(low, low);
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);  // qwords 0, 2
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(ordered));
#else
  alignas(64) int32_t lanes[VI::size()];
  r.store(lanes);
  for (int64_t j = 0; j < VI::size(); ++j) dst[j] = static_cast<uint16_t>(lanes[j]);
#endif
}

// master_or_param for BF16 on a vector of lanes.
inline Vec master_or_param_bf16(const Vec& master, const Vec& widened) {
  const VI param = shr(at::vec::cast<int32_t>(widened), 16);
  return Vec::blendv(widened, master, at::vec::cast<float>(low16(round_bf16_vec(master)) == param));
}

// Note [Remainder master] (adamw_math.h) on a vector of lanes: the masters of BF16
// parameters from their remainders. A BF16 value's bits widened to FP32 are its bits
// shifted up 16, so load_fp32 of the int16 remainders read as BF16 gives each lane's
// remainder in its high half, which at::vec's arithmetic shift brings down sign-extended.
// (The split back is a scalar loop, as the master path's rounding: on a 2-core Zen 1 the
// vector split and two narrowing stores took the step 15% over master_weights=True's, the
// scalar loop 15% under it; a scalar load measured 28% over.)
inline Vec master_of_remainder_vec(const c10::BFloat16* p, const uint16_t* remainder) {
  const VI high = at::vec::cast<int32_t>(cpu::load_fp32<c10::BFloat16>(p));
  const VI low = at::vec::cast<int32_t>(cpu::load_fp32<c10::BFloat16>(
                     reinterpret_cast<const c10::BFloat16*>(remainder))) >>
                 VI(16);
  const VI bits = high + low;
  const VI wrapped = (bits ^ high) < VI(0);  // a +-0 over a negative remainder: the parameter
  return at::vec::cast<float>(VI::blendv(bits, high, wrapped));
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

// Where the moments are stored: as the math type M, or as BF16 (Note [Low-precision
// states] in adamw_math.h). Loads widen exactly; stores round.
template <typename M, typename S>
struct MomentStore {
  S* base;  // element k of the range is base[k - origin]
  Rounding rounding;
  int64_t origin = 0;

  using V = at::vec::Vectorized<M>;
  static constexpr bool kBf16 = std::is_same_v<S, c10::BFloat16>;
  static constexpr bool kCanonical = true;  // Note [Canonical NaN]

  inline V load(int64_t k) const {
    if constexpr (kBf16) {
      return cpu::load_fp32<c10::BFloat16>(base + (k - origin));
    } else {
      return V::loadu(base + (k - origin));
    }
  }
  // `random`: each lane's random bits in its low 16 (stochastic rounding only).
  inline void store(const V& x, int64_t k, const VI& random) const {
    if constexpr (kBf16) {
      uint16_t* bits = reinterpret_cast<uint16_t*>(base + (k - origin));
      store_low16(rounding == Rounding::kStochastic ? round_bf16_stochastic_vec(x, random)
                                                    : round_bf16_nearest_vec(x),
                  bits);
    } else {
      x.store(base + (k - origin));
    }
  }
  inline M get(int64_t k) const {
    if constexpr (kBf16) {
      return widen_bf16(reinterpret_cast<const uint16_t*>(base)[k - origin]);
    } else {
      return base[k - origin];
    }
  }
  inline void set(M x, int64_t k, uint32_t random) const {
    if constexpr (kBf16) {
      reinterpret_cast<uint16_t*>(base)[k - origin] = round_moment(x, rounding, random);
    } else {
      base[k - origin] = x;
    }
  }
};

// The random bits of the moments of W elements from `index` (Note [Low-precision states]):
// {exp_avg's and exp_avg_sq's draw, max_exp_avg_sq's draw}; zeros where none is needed.
template <bool STOCHASTIC_BF16, bool AMSGRAD>
inline std::pair<VI, VI> moment_bits_vec(uint32_t key_mv, uint32_t key_vm, int64_t index) {
  if constexpr (!STOCHASTIC_BF16) {
    return {VI(0), VI(0)};
  } else {
    return {rounding_bits_vec(key_mv, index), AMSGRAD ? rounding_bits_vec(key_vm, index) : VI(0)};
  }
}

// Elements [begin, end) of one tensor at step t, its moments in m, v, vm (MomentStores, or
// Code8Moments).
// `after(k)` runs after each vector of elements from k is stepped (Note [One pass per
// 8-bit block]: the previous block's codes).
struct NoHook {
  inline void operator()(int64_t) const {}
};

template <typename P, typename G, bool AMSGRAD, typename StoreM, typename StoreV,
          typename Hook = NoHook>
void update_span(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<MathOf<P>>& c,
                 int64_t t, int64_t begin, int64_t end, const StoreM m, const StoreV v,
                 const StoreV vm, const Hook& after = Hook{}) {
  // The stores by value: locals the compiler knows no parameter store can change, so
  // their pointers stay in registers (as when this loop built them itself).
  using M = MathOf<P>;
  using V = at::vec::Vectorized<M>;
  constexpr int64_t W = V::size();
  constexpr int64_t kLineElems = 64 / sizeof(M);  // one prefetch per cache line of math type
  static_assert(kLineElems % W == 0, "a cache line must hold whole vectors");
  P* p = static_cast<P*>(e.param);
  const G* g = static_cast<const G*>(e.grad);
  const int64_t off = e.state_offset;
  const Rounding sr = L.state_rounding;
  const uint32_t key_mv = moment_key(L.seed, t, Moment::kAverages);
  const uint32_t key_vm = moment_key(L.seed, t, Moment::kMaxExpAvgSq);
  float* master = kIs16Bit<P> && L.master != nullptr ? L.master + off : nullptr;
  constexpr bool kBf16Param = std::is_same_v<P, c10::BFloat16>;
  uint16_t* remainder = kBf16Param && L.remainder != nullptr ? L.remainder + off : nullptr;
  uint16_t* p16 = reinterpret_cast<uint16_t*>(p);
  const uint32_t key = rounding_key(L.seed, t);
  const StepCoefs<V> cv = broadcast(c);
  auto update_vec = [&](int64_t k) {
    V pv;
    if constexpr (kIs16Bit<P>) {
      if (kBf16Param && remainder != nullptr) {
        pv = master_of_remainder_vec(reinterpret_cast<const c10::BFloat16*>(p + k), remainder + k);
      } else if (master != nullptr && kBf16Param) {
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
    V mv = m.load(k), vv = v.load(k);
    V vmv = AMSGRAD ? vm.load(k) : V(M(0));
    adamw_element<AMSGRAD, VecOps, StoreM::kCanonical>(pv, load_grad<M>(g + k), mv, vv, vmv, cv);
    if constexpr (kIs16Bit<P>) {
      alignas(64) float out[W];
      pv.store(out);
      if (kBf16Param && remainder != nullptr) {
        for (int64_t j = 0; j < W; ++j) {
          const uint32_t split = split_master(out[j]);
          p16[k + j] = static_cast<uint16_t>(split >> 16);
          remainder[k + j] = static_cast<uint16_t>(split);
        }
      } else {
        if (master != nullptr) pv.store(master + k);
        for (int64_t j = 0; j < W; ++j) {
          p16[k + j] = round_param<kIsHalf<P>>(out[j], L.rounding, key, off + k + j);
        }
      }
    } else {
      pv.store(p + k);
    }
    if constexpr (StoreM::kBf16) {
      const auto [r_mv, r_vm] =
          sr == Rounding::kStochastic
              ? moment_bits_vec<StoreM::kBf16, AMSGRAD>(key_mv, key_vm, off + k)
              : std::pair<VI, VI>{VI(0), VI(0)};
      m.store(mv, k, r_mv);
      v.store(vv, k, shr(r_mv, 16));
      if (AMSGRAD) vm.store(vmv, k, r_vm);
    } else {
      m.store(mv, k, VI(0));
      v.store(vv, k, VI(0));
      if (AMSGRAD) vm.store(vmv, k, VI(0));
    }
  };
  int64_t k = begin;
  if constexpr (kVectorUpdate) {
    for (; k + kLineElems <= end; k += kLineElems) {
      __builtin_prefetch(p + k + kPrefetchElems, 1);  // written back: fetch for writing
      __builtin_prefetch(g + k + kPrefetchElems, 0);
      __builtin_prefetch(m.base + (k - m.origin) + kPrefetchElems, 1);
      __builtin_prefetch(v.base + (k - v.origin) + kPrefetchElems, 1);
      if (AMSGRAD) __builtin_prefetch(vm.base + (k - vm.origin) + kPrefetchElems, 1);
      if (master != nullptr) __builtin_prefetch(master + k + kPrefetchElems, 1);
      if (remainder != nullptr) __builtin_prefetch(remainder + k + kPrefetchElems, 1);
      for (int64_t j = k; j < k + kLineElems; j += W) {
        update_vec(j);
        after(j);
      }
    }
    for (; k + W <= end; k += W) {
      update_vec(k);
      after(k);
    }
  }
  for (; k < end; ++k) {  // the leftover elements, same math on scalars
    M mk = m.get(k), vk = v.get(k), vmk = AMSGRAD ? vm.get(k) : M(0);
    M pk;
    if constexpr (kIs16Bit<P>) {
      pk = remainder != nullptr ? master_of_remainder(p16[k], remainder[k])
           : master != nullptr  ? master_or_param<kIsHalf<P>>(master[k], p16[k], widen<P>(p16[k]))
                                : static_cast<float>(p[k]);
    } else {
      pk = p[k];
    }
    adamw_element<AMSGRAD, ScalarOps>(pk, static_cast<M>(g[k]), mk, vk, vmk, c);
    if constexpr (kIs16Bit<P>) {
      if (remainder != nullptr) {
        const uint32_t split = split_master(pk);
        p16[k] = static_cast<uint16_t>(split >> 16);
        remainder[k] = static_cast<uint16_t>(split);
      } else {
        if (master != nullptr) master[k] = pk;
        p16[k] = round_param<kIsHalf<P>>(pk, L.rounding, key, off + k);
      }
    } else {
      p[k] = pk;
    }
    uint32_t r_mv = 0, r_vm = 0;
    if (StoreM::kBf16 && sr == Rounding::kStochastic) {
      r_mv = rounding_bits(key_mv, off + k);
      if (AMSGRAD) r_vm = rounding_bits(key_vm, off + k);
    }
    m.set(mk, k, r_mv);
    v.set(vk, k, r_mv >> 16);
    if (AMSGRAD) vm.set(vmk, k, r_vm);
  }
}

// Note [8-bit moments] in csrc/quant8.h: each block is decoded to FP32, stepped by
// update_span exactly as FP32 moments are (the parameter takes the moments as computed in
// FP32), and coded again with its new scale. The blocks are the state buffer's: a slice
// starts a block (the binding checks it) and a range starts a tile.
//
// Note [One pass per 8-bit block]
// The FP32 update is bound by its divisions and square root on the CPU, and the codec is
// integer work: done in passes of its own over a block (decode each moment, update, the
// largest magnitude of each, encode each), it added its time to the update's, and the
// decoding by scalar loops more. So a whole block's moments are decoded as the update
// loads them (Code8Moment::load, on vector lanes: quant8_vec.h) and their largest
// magnitude is kept in a register as it stores them to an L1 buffer; one vector pass per
// moment then codes the block. Measured on Zen 1 (AVX2, one thread, 10M elements in 50
// tensors, FP32 moments 2.1 ns per element): the per-pass kernel 17.5 ns per element,
// this one 5.7. Coding a block inside the next block's update loop (software pipelining)
// measured slower there (6.9 ns): its constants and the update's do not fit in 16 vector
// registers. With AVX-512 (32 registers) it pays: measured on Zen 4 (2 threads, 20M
// elements in 100 tensors, alternating builds) the step took 0.84-0.96x the time of
// coding each block after its update in 5 of 6 pairs (one 1.17x, a noisy machine): the
// update is bound by its divisions and square roots, beside which the codes' integer
// work fits (kPipelineCodes: AVX-512 only; the AVX2 build on the same machine was 1.1x
// slower with it, and 1.15-1.2x slower with the two-vector coder of Note [Codes of two
// AVX2 vectors], its functions forced inline). The codec itself converts through FP16
// where the ISA has it (Note [8-bit codes through FP16] in quant8_vec.h).
// Every value is the one the per-pass code computes (the same scalar operations, lane by
// lane), so codes and scales are bit for bit update_block_per_pass's and the CUDA kernel's. A block
// with non-finite moments (a negative scale before the step, or an infinity or NaN after
// it) is coded by encode_block. A row's last block, shorter than kBlock8 (Note [8-bit row
// blocks] in csrc/quant8.h), goes the same way, its elements after the last whole vector
// stepped and coded by scalars: rows of 128 or 1000 elements are not left to the per-pass
// way (measured at 0.63x and 0.88x torch's fused FP32 step on an AVX-512 Xeon, against
// 1.08x for rows of whole blocks).

// One moment of one block as update_span sees it (Note [One pass per 8-bit block]): loads
// decode the block's codes, stores write FP32 to `buf` and keep the largest magnitude
// bits in *largest. `base`: the codes, element k of the range at base[k - origin].
template <Code8 kCode>
struct Code8Moment {
  const uint8_t* base;
  float scale;
  float* buf;
  int64_t origin;
  VI* largest;
  static constexpr bool kBf16 = false;
  // Every NaN has one code (Note [8-bit moments]): no canonical NaN to make.
  static constexpr bool kCanonical = false;

  inline Vec load(int64_t k) const {
    return cpu::decode8_scaled_vec<kCode>(base + (k - origin), scale);
  }
  inline void store(const Vec& x, int64_t k, const VI&) const {
    x.store(buf + (k - origin));
    *largest = at::vec::maximum(*largest, at::vec::cast<int32_t>(x) & VI(0x7FFFFFFF));
  }
  inline float get(int64_t k) const { return decode8<kCode>(base[k - origin]) * scale; }
  inline void set(float x, int64_t k, uint32_t) const {
    buf[k - origin] = x;
    *largest = at::vec::maximum(*largest, VI(static_cast<int32_t>(magnitude_bits(x))));
  }
};

// The largest lane of x.
inline uint32_t largest_lane(const VI& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return static_cast<uint32_t>(std::max(0, _mm512_reduce_max_epi32(x)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256i m = _mm256_max_epi32(x, _mm256_permute2x128_si256(x, x, 1));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0x4E));
  m = _mm256_max_epi32(m, _mm256_shuffle_epi32(m, 0xB1));
  return static_cast<uint32_t>(std::max(0, _mm256_cvtsi256_si32(m)));
#endif
  alignas(64) int32_t lanes[VI::size()];
  x.store(lanes);
  int32_t out = 0;
  for (int64_t j = 0; j < VI::size(); ++j) out = lanes[j] > out ? lanes[j] : out;
  return static_cast<uint32_t>(out);
}

// Whether a block is coded inside the next block's update loop (Note [One pass per 8-bit
// block]): with AVX-512's 32 vector registers; with 16 (AVX2) that measured slower.
#if defined(CPU_CAPABILITY_AVX512)
constexpr bool kPipelineCodes = true;
#else
constexpr bool kPipelineCodes = false;
#endif

// The 8-bit and 4-bit codecs as PendingCodes and scale_block use them: a moment's codes
// (kSigned: exp_avg's) of a whole vector from element j, of the elements from j to n by
// scalars, of a block with non-finite values, and a block's inverse scale.
struct Codes8 {
  static constexpr int64_t kBlock = kBlock8;
  template <bool kSigned>
  static constexpr Code8 kCode = kSigned ? Code8::kSigned : Code8::kUnsigned;
  template <bool kSigned>
  static inline void decode(const uint8_t* codes, float scale, int64_t n, float* out) {
    decode_block_cpu<kCode<kSigned>>(codes, scale, n, out);
  }
  template <bool kSigned>
  static inline void vector(const Vec& q, uint8_t* codes, int64_t j) {
    cpu::encode8_store<kCode<kSigned>>(q, codes + j);
  }
  template <bool kSigned>
  static inline int64_t vectors(const float* x, float inverse, uint8_t* codes, int64_t j,
                                int64_t n) {
    return cpu::encode8_vectors<kCode<kSigned>>(x, inverse, codes, j, n);
  }
  template <bool kSigned>
  static inline void tail(const float* x, float inverse, uint8_t* codes, int64_t j, int64_t n) {
    for (; j < n; ++j) codes[j] = encode8<kCode<kSigned>>(x[j] * inverse);
  }
  // Codes and scale of a block (encode_block's own path: non-finite values too).
  template <bool kSigned>
  static inline void block(const float* x, int64_t n, uint8_t* codes, float* scale) {
    encode_block<kCode<kSigned>>(x, n, codes, scale);
  }
  template <bool kSigned>
  static inline float inverse(float scale) {
    return block_inverse(scale);
  }
};

struct Codes4 {  // two codes a byte: element j's at nibble j (j even at a byte boundary)
  static constexpr int64_t kBlock = kBlock4;
  template <bool kSigned>
  static constexpr Code4 kCode = kSigned ? Code4::kSigned : Code4::kUnsigned;
  template <bool kSigned>
  static inline void decode(const uint8_t* codes, float scale, int64_t n, float* out) {
    decode_block4<kCode<kSigned>>(codes, scale, n, out);
  }
  template <bool kSigned>
  static inline void vector(const Vec& y, uint8_t* codes, int64_t j) {
    cpu::encode4_store<kCode<kSigned>>(y, codes + j / 2);
  }
  template <bool kSigned>
  static inline int64_t vectors(const float* x, float inverse, uint8_t* codes, int64_t j,
                                int64_t n) {
    return cpu::encode4_vectors<kCode<kSigned>>(x, inverse, codes, j, n);
  }
  template <bool kSigned>
  static inline void tail(const float* x, float inverse, uint8_t* codes, int64_t j, int64_t n) {
    cpu::encode4_tail<kCode<kSigned>>(x, inverse, codes, j, n);
  }
  template <bool kSigned>
  static inline void block(const float* x, int64_t n, uint8_t* codes, float* scale) {
    encode_block4<kCode<kSigned>>(x, n, codes, scale);
  }
  template <bool kSigned>
  static inline float inverse(float scale) {
    return block_inverse4<kCode<kSigned>>(scale);
  }
};

// One block the per-pass way (decode each moment, update, encode each): its elements
// [k0, k0 + n) (n <= Codes::kBlock; Note [8-bit row blocks] in csrc/quant8.h, Note [4-bit
// row blocks] in csrc/quant4.h), its codes from byte `byte` of each moment's buffer, its
// scales at index b of each moment's run.
template <typename Codes, typename P, typename G, bool AMSGRAD>
void update_block_per_pass(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<float>& c,
                           int64_t t, int64_t k0, int64_t n, int64_t byte, int64_t b) {
  uint8_t* const mc = static_cast<uint8_t*>(L.exp_avg) + byte;
  uint8_t* const vc = static_cast<uint8_t*>(L.exp_avg_sq) + byte;
  uint8_t* const vmc = AMSGRAD ? static_cast<uint8_t*>(L.max_exp_avg_sq) + byte : nullptr;
  alignas(64) float mf[Codes::kBlock], vf[Codes::kBlock], vmf[Codes::kBlock];
  Codes::template decode<true>(mc, L.exp_avg_scales[b], n, mf);
  Codes::template decode<false>(vc, L.exp_avg_sq_scales[b], n, vf);
  if (AMSGRAD) Codes::template decode<false>(vmc, L.max_exp_avg_sq_scales[b], n, vmf);
  const MomentStore<float, float> m{mf, Rounding::kNearestEven, k0};
  const MomentStore<float, float> v{vf, Rounding::kNearestEven, k0};
  const MomentStore<float, float> vm{AMSGRAD ? vmf : nullptr, Rounding::kNearestEven, k0};
  update_span<P, G, AMSGRAD>(L, e, c, t, k0, k0 + n, m, v, vm);
  Codes::template block<true>(mf, n, mc, L.exp_avg_scales + b);
  Codes::template block<false>(vf, n, vc, L.exp_avg_sq_scales + b);
  if (AMSGRAD) Codes::template block<false>(vmf, n, vmc, L.max_exp_avg_sq_scales + b);
}

// A block's moments waiting for their codes (Note [One pass per 8-bit block]): up to three
// moments' FP32 values, each with its block's inverse scale and where its codes go, and the
// block's element count (a row's last block may be shorter than the block: Note [8-bit row
// blocks] in csrc/quant8.h; its codes end where the next row's begin).
template <typename Codes>
struct PendingCodes {
  const float* x[3] = {nullptr, nullptr, nullptr};
  float inverse[3] = {0.0f, 0.0f, 0.0f};
  uint8_t* codes[3] = {nullptr, nullptr, nullptr};
  int64_t n = 0;

  // The codes of the W elements from j of each pending moment, where they are all the
  // block's (code_from codes the rest).
  inline void code_vector(int64_t j) const {
    if (j + Vec::size() > n) return;
    if (x[0] != nullptr) {
      Codes::template vector<true>(Vec::loadu(x[0] + j) * Vec(inverse[0]), codes[0], j);
    }
    for (int q = 1; q < 3; ++q) {
      if (x[q] != nullptr) {
        Codes::template vector<false>(Vec::loadu(x[q] + j) * Vec(inverse[q]), codes[q], j);
      }
    }
  }
  // The codes from element j (a multiple of W) to the block's end, a moment at a time:
  // whole vectors (two at a time with AVX2: Note [Codes of two AVX2 vectors] in
  // quant8_vec.h), then the elements after the last one by scalars (the same codes: Note
  // [8-bit codes through FP16] there); nothing pending after it.
  inline void code_from(int64_t j) {
    j = std::min(j, n / Vec::size() * Vec::size());  // a shorter block's last elements
    if (x[0] != nullptr) {
      const int64_t k = Codes::template vectors<true>(x[0], inverse[0], codes[0], j, n);
      Codes::template tail<true>(x[0], inverse[0], codes[0], k, n);
    }
    for (int q = 1; q < 3; ++q) {
      if (x[q] != nullptr) {
        const int64_t k = Codes::template vectors<false>(x[q], inverse[q], codes[q], j, n);
        Codes::template tail<false>(x[q], inverse[q], codes[q], k, n);
      }
    }
    x[0] = x[1] = x[2] = nullptr;
    n = 0;
  }
  inline void code_all() { code_from(0); }
};

// The block's new scale from the largest magnitude of its n values (Note [8-bit moments]);
// its codes now for a block with non-finite values (encode_block's own path), else left to
// `pending` (moment q: 0 exp_avg, 1 exp_avg_sq, 2 max_exp_avg_sq).
template <typename Codes>
void scale_block(const float* x, int64_t n, uint32_t largest, uint8_t* codes, float* scale,
                 PendingCodes<Codes>& pending, int q) {
  if (largest >= kInfBits) {
    if (q == 0) {
      Codes::template block<true>(x, n, codes, scale);
    } else {
      Codes::template block<false>(x, n, codes, scale);
    }
    return;
  }
  const float s = block_scale(largest, false);
  *scale = s;
  pending.x[q] = x;
  pending.inverse[q] =
      q == 0 ? Codes::template inverse<true>(s) : Codes::template inverse<false>(s);
  pending.codes[q] = codes;
  pending.n = n;
}

// Indices [begin, end) of one tensor's walk (a tile of whole blocks; Note [8-bit row
// blocks] in csrc/quant8.h maps them to elements and scales).
template <typename P, typename G, bool AMSGRAD>
void update_range8(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<float>& c, int64_t t,
                   int64_t begin, int64_t end) {
  const int64_t off = e.state_offset;
  uint8_t* const mc = static_cast<uint8_t*>(L.exp_avg) + off;
  uint8_t* const vc = static_cast<uint8_t*>(L.exp_avg_sq) + off;
  uint8_t* const vmc = AMSGRAD ? static_cast<uint8_t*>(L.max_exp_avg_sq) + off : nullptr;
  // Two blocks' FP32 moments: the one stepped and the previous one being coded.
  alignas(64) float mf[2][kBlock8], vf[2][kBlock8], vmf[2][kBlock8];
  PendingCodes<Codes8> pending;
  const auto code_pending = [&pending](int64_t k) { pending.code_vector(k); };
  int cur = 0;
  for (int64_t kc = begin; kc < end; kc += kBlock8) {
    const Block8 blk = block8_at(e, kc, end);
    const int64_t kb = blk.first, b = scale_index8(e, kc);
    // Blocks the one-pass way where the update is vectorized (Note [One pass per 8-bit
    // block]), a row's shorter last block too (its last elements by scalars); the portable
    // x86-64 build steps scalars, the per-pass way, as does a block that met inf or NaN
    // (rare).
    const int64_t n = blk.n;
    if (!kVectorUpdate || !cpu::vector_block(L.exp_avg_scales[b]) ||
        !cpu::vector_block(L.exp_avg_sq_scales[b]) ||
        (AMSGRAD && !cpu::vector_block(L.max_exp_avg_sq_scales[b]))) {
      pending.code_all();
      update_block_per_pass<Codes8, P, G, AMSGRAD>(L, e, c, t, kb, n, off + kb, b);
      continue;
    }
    cur ^= 1;
    VI largest[3] = {VI(0), VI(0), VI(0)};
    const Code8Moment<Code8::kSigned> m{mc + kb, L.exp_avg_scales[b], mf[cur], kb, &largest[0]};
    const Code8Moment<Code8::kUnsigned> v{vc + kb, L.exp_avg_sq_scales[b], vf[cur], kb,
                                          &largest[1]};
    const Code8Moment<Code8::kUnsigned> vm{AMSGRAD ? vmc + kb : nullptr,
                                           AMSGRAD ? L.max_exp_avg_sq_scales[b] : 0.0f, vmf[cur],
                                           kb, &largest[2]};
    if constexpr (kPipelineCodes) {
      // The previous block coded a vector at a time between this one's updates: its
      // integer work beside their divisions and square roots; what this block's vectors
      // did not reach (a shorter block on either side) after them.
      update_span<P, G, AMSGRAD>(L, e, c, t, kb, kb + n, m, v, vm,
                                 [&](int64_t k) { code_pending(k - kb); });
      pending.code_from(n / Vec::size() * Vec::size());
    } else {
      update_span<P, G, AMSGRAD>(L, e, c, t, kb, kb + n, m, v, vm);
    }
    scale_block(mf[cur], n, largest_lane(largest[0]), mc + kb, L.exp_avg_scales + b, pending, 0);
    scale_block(vf[cur], n, largest_lane(largest[1]), vc + kb, L.exp_avg_sq_scales + b, pending, 1);
    if (AMSGRAD) {
      scale_block(vmf[cur], n, largest_lane(largest[2]), vmc + kb, L.max_exp_avg_sq_scales + b,
                  pending, 2);
    }
    if constexpr (!kPipelineCodes) pending.code_all();
  }
  pending.code_all();
}

// Note [4-bit moments] in csrc/quant4.h: each block is decoded to FP32, stepped by
// update_span exactly as FP32 moments are, and coded again with its new scale: the step is
// "decode, the FP32 step, encode" by construction. Indices [begin, end) of one tensor's walk
// (a tile of whole blocks; Note [4-bit row blocks] maps them to elements, codes and scales).
//
// Note [One pass per 4-bit block]
// As Note [One pass per 8-bit block]: with AVX-512 or AVX2 the update's loads decode the
// codes (Code4Moment::load: a table in registers, Note [4-bit codes through FP16] in
// quant4_vec.h), its stores keep the FP32 values in an L1 buffer and their largest
// magnitude in a register, and the block is coded a vector at a time inside the next
// block's update loop with AVX-512 (kPipelineCodes), after its own with AVX2; a block with
// non-finite moments (a negative scale, or an infinity or NaN after the step) goes the
// per-pass way (update_block_per_pass), as does every block of the portable build. The same
// operations lane by lane as the scalar codec: the same codes and scales.
template <Code4 kCode>
struct Code4Moment {
  const uint8_t* base;  // the block's codes (from a byte boundary); element k at k - origin
  cpu::Table4 table;    // ratio4(code) * the block's scale
  const float* book;    // ratio4(code)
  float scale;
  float* buf;
  int64_t origin;
  VI* largest;
  static constexpr bool kBf16 = false;
  static constexpr bool kCanonical = false;  // every NaN goes the per-pass way

  inline Vec load(int64_t k) const { return table.decode(base + ((k - origin) >> 1)); }
  inline void store(const Vec& x, int64_t k, const VI&) const {
    x.store(buf + (k - origin));
    *largest = at::vec::maximum(*largest, at::vec::cast<int32_t>(x) & VI(0x7FFFFFFF));
  }
  inline float get(int64_t k) const { return book[nibble_at(base, k - origin)] * scale; }
  inline void set(float x, int64_t k, uint32_t) const {
    buf[k - origin] = x;
    *largest = at::vec::maximum(*largest, VI(static_cast<int32_t>(magnitude_bits(x))));
  }
};

template <Code4 kCode>
inline Code4Moment<kCode> code4_moment(const uint8_t* base, float scale, float* buf, int64_t origin,
                                       VI* largest) {
  // Blocks of finite values only (vector_block: scale >= 0 is its own magnitude).
  return {base,   cpu::Table4::of<kCode>(scale), cpu::code_book4<kCode>(), scale, buf, origin,
          largest};
}

template <typename P, typename G, bool AMSGRAD>
void update_range4(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<float>& c, int64_t t,
                   int64_t begin, int64_t end) {
  uint8_t* const mc = static_cast<uint8_t*>(L.exp_avg);
  uint8_t* const vc = static_cast<uint8_t*>(L.exp_avg_sq);
  uint8_t* const vmc = AMSGRAD ? static_cast<uint8_t*>(L.max_exp_avg_sq) : nullptr;
  // Two blocks' FP32 moments: the one stepped and the previous one being coded.
  alignas(64) float mf[2][kBlock4], vf[2][kBlock4], vmf[2][kBlock4];
  PendingCodes<Codes4> pending;
  const auto code_pending = [&pending](int64_t k) { pending.code_vector(k); };
  int cur = 0;
  for (int64_t kc = begin; kc < end; kc += kBlock4) {
    const Block4 blk = block4_at(e, kc, end);
    const int64_t k0 = blk.first, n = blk.n, byte = blk.nibble >> 1;
    const int64_t b = scale_index4(e, kc);
    if (!kVectorUpdate || !cpu::kCodec4Vec || !cpu::vector_block(L.exp_avg_scales[b]) ||
        !cpu::vector_block(L.exp_avg_sq_scales[b]) ||
        (AMSGRAD && !cpu::vector_block(L.max_exp_avg_sq_scales[b]))) {
      pending.code_all();
      update_block_per_pass<Codes4, P, G, AMSGRAD>(L, e, c, t, k0, n, byte, b);
      continue;
    }
    cur ^= 1;
    VI largest[3] = {VI(0), VI(0), VI(0)};
    const auto m =
        code4_moment<Code4::kSigned>(mc + byte, L.exp_avg_scales[b], mf[cur], k0, &largest[0]);
    const auto v =
        code4_moment<Code4::kUnsigned>(vc + byte, L.exp_avg_sq_scales[b], vf[cur], k0, &largest[1]);
    const auto vm = code4_moment<Code4::kUnsigned>(AMSGRAD ? vmc + byte : nullptr,
                                                   AMSGRAD ? L.max_exp_avg_sq_scales[b] : 0.0f,
                                                   vmf[cur], k0, &largest[2]);
    if constexpr (kPipelineCodes) {  // as update_range8
      update_span<P, G, AMSGRAD>(L, e, c, t, k0, k0 + n, m, v, vm,
                                 [&](int64_t k) { code_pending(k - k0); });
      pending.code_from(n / Vec::size() * Vec::size());
    } else {
      update_span<P, G, AMSGRAD>(L, e, c, t, k0, k0 + n, m, v, vm);
    }
    scale_block(mf[cur], n, largest_lane(largest[0]), mc + byte, L.exp_avg_scales + b, pending, 0);
    scale_block(vf[cur], n, largest_lane(largest[1]), vc + byte, L.exp_avg_sq_scales + b, pending,
                1);
    if (AMSGRAD) {
      scale_block(vmf[cur], n, largest_lane(largest[2]), vmc + byte, L.max_exp_avg_sq_scales + b,
                  pending, 2);
    }
    if constexpr (!kPipelineCodes) pending.code_all();
  }
  pending.code_all();
}

// The storage type of 4-bit moments (a tag: two codes per byte).
struct Nibbles {};

// Elements [begin, end) of one tensor at step t, its moments where the launch keeps them.
template <typename P, typename G, typename S, bool AMSGRAD>
void update_range(const AdamWLaunch& L, const TensorEntry& e, const StepCoefs<MathOf<P>>& c,
                  int64_t t, int64_t begin, int64_t end) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    update_range8<P, G, AMSGRAD>(L, e, c, t, begin, end);
  } else if constexpr (std::is_same_v<S, Nibbles>) {
    update_range4<P, G, AMSGRAD>(L, e, c, t, begin, end);
  } else {
    using M = MathOf<P>;
    const int64_t off = e.state_offset;
    const Rounding sr = L.state_rounding;
    const MomentStore<M, S> m{static_cast<S*>(L.exp_avg) + off, sr};
    const MomentStore<M, S> v{static_cast<S*>(L.exp_avg_sq) + off, sr};
    const MomentStore<M, S> vm{AMSGRAD ? static_cast<S*>(L.max_exp_avg_sq) + off : nullptr, sr};
    update_span<P, G, AMSGRAD>(L, e, c, t, begin, end, m, v, vm);
  }
}

template <typename P, typename G, typename S, bool AMSGRAD>
void run(const AdamWLaunch& L, double factor) {
  // A grain of a few tiles: a bucket of one or two tiles runs on the calling thread
  // instead of waking the pool (far more costly than the work on a loaded machine).
  constexpr int64_t kGrain = 4;
  at::parallel_for(0, L.n_units, kGrain, [&](int64_t u_begin, int64_t u_end) {
    int64_t i = find_tensor(L.table, L.n_tensors, u_begin);
    // The coefficients depend on t alone, which most tensors of a bucket share: made once
    // per run of equal counters, not per tile (a model of many small tensors has a tile
    // per tensor, and each make_coefs computes two FP64 powers).
    int64_t last_t = -1;
    StepCoefs<MathOf<P>> c{};
    for (int64_t u = u_begin; u < u_end; ++u) {
      while (i + 1 < L.n_tensors && L.table[i + 1].unit_start <= u) ++i;
      const TensorEntry& e = L.table[i];
      // The counter was advanced before the parallel region (see adamw_cpu).
      const int64_t t = step_count(L.steps[e.step_index]);  // Note [Step counter range]
      if (t != last_t) {
        c = make_coefs<MathOf<P>>(L.hyper, factor, t);
        last_t = t;
      }
      const int64_t begin = (u - e.unit_start) * kCpuTile;
      const int64_t extent = std::is_same_v<S, Nibbles> ? state_extent4(e) : state_extent(e);
      update_range<P, G, S, AMSGRAD>(L, e, c, t, begin, std::min(begin + kCpuTile, extent));
    }
  });
}

template <typename P, typename G, typename S>
void run_amsgrad(const AdamWLaunch& L, double factor) {
  if (L.amsgrad) {
    run<P, G, S, true>(L, factor);
  } else {
    run<P, G, S, false>(L, factor);
  }
}

// The moments' storage type: the math type, or BF16, or 8-bit codes (not for FP64
// parameters: the binding refuses them).
template <typename P, typename G>
void run_state(const AdamWLaunch& L, double factor) {
  if constexpr (!std::is_same_v<P, double>) {
    if (L.state_dtype == DType::kBFloat16) return run_amsgrad<P, G, c10::BFloat16>(L, factor);
    if (L.state_dtype == DType::kUInt8) return run_amsgrad<P, G, uint8_t>(L, factor);
    if (L.state_dtype == DType::kNibble) return run_amsgrad<P, G, Nibbles>(L, factor);
  }
  run_amsgrad<P, G, MathOf<P>>(L, factor);
}

// The gradient dtypes each parameter dtype takes (checked by the binding).
template <typename P>
void run_param(const AdamWLaunch& L, double factor) {
  if constexpr (std::is_same_v<P, double>) {
    run_state<double, double>(L, factor);
  } else if constexpr (std::is_same_v<P, float>) {
    switch (L.grad_dtype) {
      case DType::kHalf:
        return run_state<float, c10::Half>(L, factor);
      case DType::kBFloat16:
        return run_state<float, c10::BFloat16>(L, factor);
      default:
        return run_state<float, float>(L, factor);
    }
  } else {  // a 16-bit parameter: its own dtype or FP32 gradients
    if (L.grad_dtype == DType::kFloat) return run_state<P, float>(L, factor);
    return run_state<P, P>(L, factor);
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
      return run_param<double>(L, d.factor64);
    case DType::kUInt8:  // state dtypes, never a parameter's (the binding)
    case DType::kNibble:
      return;
  }
}

}  // namespace ruda
