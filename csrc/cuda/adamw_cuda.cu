// CUDA kernels of adamw_scaled_: launch code only; the math is adamw_element() from
// csrc/adamw_math.h (Note [One math, two backends]). Built with --fmad=false.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <type_traits>

#include "adamw_math.h"
#include "cuda_utils.cuh"
#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per vector access
static_assert(kCudaTile % (kThreads * kVec) == 0, "a tile is whole block-wide vector steps");

// Advances the step counter of every tensor in the call, unless the step is skipped.
// A separate launch, so that every block of the update kernel reads the new value.
__global__ void advance_steps_kernel(const TensorEntry* table, int64_t n, float* steps,
                                     StepControl control) {
  if (decide_step(control).skip) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float& s = steps[table[i].step_index];
    s = s + 1.0f;
  }
}

// The math and state type of a parameter dtype (Note [Parameter dtypes]).
template <typename P>
using MathOf = std::conditional_t<std::is_same_v<P, double>, double, float>;
template <typename P>
constexpr bool kIs16Bit = std::is_same_v<P, __half> || std::is_same_v<P, __nv_bfloat16>;

__device__ inline double to_math(double x) { return x; }
template <typename T>
__device__ inline float to_math(T x) {
  return to_float(x);
}

template <typename P>
constexpr bool kIsHalf = std::is_same_v<P, __half>;

// A 16-bit parameter widened exactly to FP32.
template <typename P>
__device__ inline float widen(uint16_t bits) {
  if constexpr (std::is_same_v<P, __half>) {
    return __half2float(__ushort_as_half(bits));
  } else {
    return __uint_as_float(static_cast<uint32_t>(bits) << 16);
  }
}

// The pointers of one tensor's slice. S: the moments' storage type, the math type or BF16
// (Note [Low-precision states] in adamw_math.h).
template <typename P, typename G, typename S>
struct Slice {
  P* p;
  const G* g;
  S *m, *v, *vm;
  float* master;            // 16-bit parameters with master weights, else null
  uint32_t key_mv, key_vm;  // moment_key()s of the BF16 moments' stochastic rounding
  Rounding state_rounding;
};

template <typename S>
constexpr bool kBf16State = std::is_same_v<S, __nv_bfloat16>;

template <typename S>
__device__ inline auto load_moment(const S* base, int64_t k) {
  if constexpr (kBf16State<S>) {
    return widen_bf16(reinterpret_cast<const uint16_t*>(base)[k]);
  } else {
    return base[k];
  }
}

// The random bits of element `index`'s BF16 moments (Note [Low-precision states]):
// exp_avg takes the low half of the first draw, exp_avg_sq its high half, max_exp_avg_sq
// the low half of the second.
struct MomentBits {
  uint32_t mv, vm;
};

template <typename S, bool AMSGRAD, typename Sl>
__device__ inline MomentBits moment_bits(const Sl& s, int64_t index) {
  MomentBits b{0, 0};
  if constexpr (kBf16State<S>) {
    if (s.state_rounding == Rounding::kStochastic) {
      b.mv = rounding_bits(s.key_mv, index);
      if (AMSGRAD) b.vm = rounding_bits(s.key_vm, index);
    }
  }
  return b;
}

template <typename S, typename M>
__device__ inline void store_moment(S* base, int64_t k, M x, Rounding r, uint32_t random) {
  if constexpr (kBf16State<S>) {
    reinterpret_cast<uint16_t*>(base)[k] = round_moment(x, r, random);
  } else {
    base[k] = x;
  }
}

// kVec moments with one wide store: FP32, or BF16 rounded lane by lane (random[j]: lane
// j's random bits in the low half).
template <typename S>
__device__ inline void store_moments(S* p, const float* in, Rounding r, const uint32_t* random) {
  if constexpr (kBf16State<S>) {
    uint16_t out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = round_moment(in[j], r, random[j]);
    store_bits16(reinterpret_cast<uint16_t*>(p), out);
  } else {
    store_vec<kVec>(p, in);
  }
}

// Element k's update with its moments in mk, vk, vmk (updated in place); the parameter
// (and master) read and written.
template <typename P, typename G, typename S, bool AMSGRAD>
__device__ inline void step_element(const Slice<P, G, S>& s, int64_t k,
                                    const StepCoefs<MathOf<P>>& c, const AdamWLaunch& L,
                                    uint32_t key, int64_t index, MathOf<P>& mk, MathOf<P>& vk,
                                    MathOf<P>& vmk) {
  using M = MathOf<P>;
  M pk;
  if constexpr (kIs16Bit<P>) {
    const uint16_t bits = reinterpret_cast<const uint16_t*>(s.p)[k];
    pk = s.master != nullptr ? master_or_param<kIsHalf<P>>(s.master[k], bits, widen<P>(bits))
                             : to_float(s.p[k]);
  } else {
    pk = s.p[k];
  }
  adamw_element<AMSGRAD, ScalarOps>(pk, to_math(s.g[k]), mk, vk, vmk, c);
  if constexpr (kIs16Bit<P>) {
    if (s.master != nullptr) s.master[k] = pk;
    reinterpret_cast<uint16_t*>(s.p)[k] = round_param<kIsHalf<P>>(pk, L.rounding, key, index);
  } else {
    s.p[k] = pk;
  }
}

template <typename P, typename G, typename S, bool AMSGRAD>
__device__ inline void update_one(const Slice<P, G, S>& s, int64_t k, const StepCoefs<MathOf<P>>& c,
                                  const AdamWLaunch& L, uint32_t key, int64_t index) {
  using M = MathOf<P>;
  M mk = load_moment(s.m, k), vk = load_moment(s.v, k), vmk = AMSGRAD ? load_moment(s.vm, k) : M(0);
  step_element<P, G, S, AMSGRAD>(s, k, c, L, key, index, mk, vk, vmk);
  const MomentBits r = moment_bits<S, AMSGRAD>(s, index);
  store_moment(s.m, k, mk, s.state_rounding, r.mv);
  store_moment(s.v, k, vk, s.state_rounding, r.mv >> 16);
  if (AMSGRAD) store_moment(s.vm, k, vmk, s.state_rounding, r.vm);
}

// kVec elements at k with wide accesses (FP32 and 16-bit parameters; the caller checked
// alignment).
template <typename P, typename G, typename S, bool AMSGRAD>
__device__ inline void update_vec(const Slice<P, G, S>& s, int64_t k, const StepCoefs<float>& c,
                                  const AdamWLaunch& L, uint32_t key, int64_t index) {
  float pv[kVec], gv[kVec], mv[kVec], vv[kVec], vmv[kVec];
  if constexpr (kIs16Bit<P>) {
    if (s.master != nullptr) {
      float mv16[kVec];
      uint16_t bits[kVec];
      load_vec<kVec>(s.master + k, mv16);
      load_bits16(reinterpret_cast<const uint16_t*>(s.p + k), bits);
#pragma unroll
      for (int j = 0; j < kVec; ++j)
        pv[j] = master_or_param<kIsHalf<P>>(mv16[j], bits[j], widen<P>(bits[j]));
    } else {
      load_vec<kVec>(s.p + k, pv);
    }
  } else {
    load_vec<kVec>(s.p + k, pv);
  }
  load_vec<kVec>(s.g + k, gv);
  load_vec<kVec>(s.m + k, mv);
  load_vec<kVec>(s.v + k, vv);
  if (AMSGRAD) load_vec<kVec>(s.vm + k, vmv);
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    adamw_element<AMSGRAD, ScalarOps>(pv[j], gv[j], mv[j], vv[j], vmv[j], c);
  }
  if constexpr (kIs16Bit<P>) {
    if (s.master != nullptr) store_vec<kVec>(s.master + k, pv);
    uint16_t out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j)
      out[j] = round_param<kIsHalf<P>>(pv[j], L.rounding, key, index + j);
    store_bits16(reinterpret_cast<uint16_t*>(s.p + k), out);
  } else {
    store_vec<kVec>(s.p + k, pv);
  }
  uint32_t r_m[kVec], r_v[kVec], r_vm[kVec];
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const MomentBits r = moment_bits<S, AMSGRAD>(s, index + j);
    r_m[j] = r.mv;
    r_v[j] = r.mv >> 16;
    r_vm[j] = r.vm;
  }
  store_moments(s.m + k, mv, s.state_rounding, r_m);
  store_moments(s.v + k, vv, s.state_rounding, r_v);
  if (AMSGRAD) store_moments(s.vm + k, vmv, s.state_rounding, r_vm);
}

// What a tile (unit u) of an update launch steps: its tensor, the coefficients and
// rounding key of the tensor's counter, and its element range [begin, end).
template <typename M>
struct Tile {
  TensorEntry e;
  int64_t t;
  StepCoefs<M> c;
  uint32_t key;
  int64_t begin, end;
};

template <typename M>
__device__ inline Tile<M> tile_of(const AdamWLaunch& L, int64_t u, float factor) {
  Tile<M> tile;
  tile.e = L.table[find_tensor(L.table, L.n_tensors, u)];
  tile.t = step_count(L.steps[tile.e.step_index]);  // Note [Step counter range]
  tile.c = make_coefs<M>(L.hyper, factor, tile.t);
  tile.key = rounding_key(L.seed, tile.t);  // Note [Stochastic rounding bits]
  tile.begin = (u - tile.e.unit_start) * kCudaTile;
  tile.end = min(tile.begin + kCudaTile, tile.e.numel);
  return tile;
}

template <typename P, typename G, typename S, bool AMSGRAD>
__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWLaunch L) {
  using M = MathOf<P>;
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  for (int64_t u = blockIdx.x; u < L.n_units; u += gridDim.x) {
    const Tile<M> tile = tile_of<M>(L, u, d.factor);
    const TensorEntry& e = tile.e;
    const int64_t t = tile.t, begin = tile.begin, end = tile.end;
    const StepCoefs<M>& c = tile.c;
    const uint32_t key = tile.key;
    Slice<P, G, S> s;
    s.p = static_cast<P*>(e.param);
    s.g = static_cast<const G*>(e.grad);
    s.m = static_cast<S*>(L.exp_avg) + e.state_offset;
    s.v = static_cast<S*>(L.exp_avg_sq) + e.state_offset;
    s.vm = AMSGRAD ? static_cast<S*>(L.max_exp_avg_sq) + e.state_offset : nullptr;
    s.state_rounding = L.state_rounding;
    s.key_mv = kBf16State<S> ? moment_key(L.seed, t, Moment::kAverages) : 0;
    s.key_vm = kBf16State<S> ? moment_key(L.seed, t, Moment::kMaxExpAvgSq) : 0;
    s.master = kIs16Bit<P> && L.master != nullptr ? L.master + e.state_offset : nullptr;
    bool aligned = false;
    if constexpr (!std::is_same_v<P, double>) {  // FP64: scalar accesses (a rare dtype)
      aligned = is_aligned<kVec>(s.p) && is_aligned<kVec>(s.g) && is_aligned<kVec>(s.m) &&
                is_aligned<kVec>(s.v) && (!AMSGRAD || is_aligned<kVec>(s.vm)) &&
                (s.master == nullptr || is_aligned<kVec>(s.master));
    }
    if (aligned) {
      if constexpr (!std::is_same_v<P, double>) {
        for (int64_t k = begin + int64_t(threadIdx.x) * kVec; k < end; k += kThreads * kVec) {
          if (k + kVec <= end) {
            update_vec<P, G, S, AMSGRAD>(s, k, c, L, key, e.state_offset + k);
          } else {
            for (int64_t kk = k; kk < end; ++kk) {
              update_one<P, G, S, AMSGRAD>(s, kk, c, L, key, e.state_offset + kk);
            }
          }
        }
      }
    } else {  // a view that is not aligned for wide accesses: scalar accesses, same math
      for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) {
        update_one<P, G, S, AMSGRAD>(s, k, c, L, key, e.state_offset + k);
      }
    }
  }
}

// Note [8-bit moments] in csrc/quant8.h: each warp steps one block of kBlock8 elements at
// a time (store_block8 in cuda_utils.cuh: lane l the elements l, l + 32, ...), decoded to
// FP32, stepped by adamw_element as FP32 moments, coded again with the block's new scale.
static_assert(kCudaTile % kBlock8 == 0, "tiles are whole 8-bit blocks");
constexpr int kWarps8 = kThreads / 32;

template <typename P, typename G, bool AMSGRAD>
__global__ void __launch_bounds__(kThreads) adamw8_kernel(AdamWLaunch L) {
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t u = blockIdx.x; u < L.n_units; u += gridDim.x) {
    const Tile<float> tile = tile_of<float>(L, u, d.factor);
    const int64_t begin = tile.begin, end = tile.end, off = tile.e.state_offset;
    const StepCoefs<float>& c = tile.c;
    const uint32_t key = tile.key;
    Slice<P, G, float> s;
    s.p = static_cast<P*>(tile.e.param);
    s.g = static_cast<const G*>(tile.e.grad);
    s.m = s.v = s.vm = nullptr;  // in registers
    s.master = kIs16Bit<P> && L.master != nullptr ? L.master + off : nullptr;
    s.state_rounding = Rounding::kNearestEven;
    s.key_mv = s.key_vm = 0;
    uint8_t* mc = static_cast<uint8_t*>(L.exp_avg) + off;
    uint8_t* vc = static_cast<uint8_t*>(L.exp_avg_sq) + off;
    uint8_t* vmc = AMSGRAD ? static_cast<uint8_t*>(L.max_exp_avg_sq) + off : nullptr;
    for (int64_t kb = begin + warp * kBlock8; kb < end; kb += kWarps8 * kBlock8) {
      const int64_t b = (off + kb) / kBlock8;
      // Read before lane 0 writes the new scales: each value feeds the shuffles below.
      const float sm = L.exp_avg_scales[b], sv = L.exp_avg_sq_scales[b];
      const float svm = AMSGRAD ? L.max_exp_avg_sq_scales[b] : 0.0f;
      float m[kPerLane8], v[kPerLane8], vm[kPerLane8];
#pragma unroll
      for (int j = 0; j < kPerLane8; ++j) {
        const int64_t k = kb + lane + 32 * j;
        m[j] = v[j] = vm[j] = 0.0f;
        if (k < end) {
          m[j] = dequantize8<Code8::kSigned>(mc[k], sm);
          v[j] = dequantize8<Code8::kUnsigned>(vc[k], sv);
          if (AMSGRAD) vm[j] = dequantize8<Code8::kUnsigned>(vmc[k], svm);
          step_element<P, G, float, AMSGRAD>(s, k, c, L, key, off + k, m[j], v[j], vm[j]);
        }
      }
      store_block8<Code8::kSigned>(m, kb, end, mc, L.exp_avg_scales + b);
      store_block8<Code8::kUnsigned>(v, kb, end, vc, L.exp_avg_sq_scales + b);
      if (AMSGRAD) store_block8<Code8::kUnsigned>(vm, kb, end, vmc, L.max_exp_avg_sq_scales + b);
    }
  }
}

template <typename P, typename G>
void launch_8bit(const AdamWLaunch& L, cudaStream_t stream) {
  const auto kernel = L.amsgrad ? adamw8_kernel<P, G, true> : adamw8_kernel<P, G, false>;
  const int64_t grid = std::min<int64_t>(L.n_units, max_resident_blocks(kernel, kThreads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kThreads, stream, L);
  RUDA_CUDA_CHECK_LAUNCH();
}

template <typename P, typename G, typename S>
void launch_state(const AdamWLaunch& L, cudaStream_t stream) {
  const auto kernel = L.amsgrad ? adamw_kernel<P, G, S, true> : adamw_kernel<P, G, S, false>;
  const int64_t grid = std::min<int64_t>(L.n_units, max_resident_blocks(kernel, kThreads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kThreads, stream, L);
  RUDA_CUDA_CHECK_LAUNCH();
}

// The moments' storage type: the math type, or BF16 (not for FP64 parameters: the binding
// refuses it).
template <typename P, typename G>
void launch(const AdamWLaunch& L, cudaStream_t stream) {
  if (L.n_units == 0) return;
  if constexpr (!std::is_same_v<P, double>) {
    if (L.state_dtype == DType::kBFloat16) return launch_state<P, G, __nv_bfloat16>(L, stream);
    if (L.state_dtype == DType::kUInt8) return launch_8bit<P, G>(L, stream);
  }
  launch_state<P, G, MathOf<P>>(L, stream);
}

// The gradient dtypes each parameter dtype takes (checked by the binding).
template <typename P>
void launch_param(const AdamWLaunch& L, cudaStream_t stream) {
  if constexpr (std::is_same_v<P, double>) {
    launch<double, double>(L, stream);
  } else if constexpr (std::is_same_v<P, float>) {
    switch (L.grad_dtype) {
      case DType::kHalf:
        return launch<float, __half>(L, stream);
      case DType::kBFloat16:
        return launch<float, __nv_bfloat16>(L, stream);
      default:
        return launch<float, float>(L, stream);
    }
  } else {  // a 16-bit parameter: its own dtype or FP32 gradients
    if (L.grad_dtype == DType::kFloat) return launch<P, float>(L, stream);
    return launch<P, P>(L, stream);
  }
}

}  // namespace

void adamw_cuda(const AdamWLaunch& L, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t step_blocks = std::min<int64_t>((L.n_tensors + kThreads - 1) / kThreads, 1024);
  launch_kernel(advance_steps_kernel, static_cast<unsigned>(step_blocks), kThreads, stream, L.table,
                L.n_tensors, L.steps, L.control);
  RUDA_CUDA_CHECK_LAUNCH();
  switch (L.param_dtype) {
    case DType::kFloat:
      return launch_param<float>(L, stream);
    case DType::kHalf:
      return launch_param<__half>(L, stream);
    case DType::kBFloat16:
      return launch_param<__nv_bfloat16>(L, stream);
    case DType::kDouble:
      return launch_param<double>(L, stream);
    case DType::kUInt8:  // a state dtype, never a parameter's (the binding)
      return;
  }
}

}  // namespace ruda
