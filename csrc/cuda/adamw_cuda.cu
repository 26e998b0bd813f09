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
#include "quant4.h"
#include "quant4_lanes.cuh"
#include "quant8.h"

namespace ruda {
namespace {

// The update kernels' blocks: 128 threads, 8 blocks per SM (32 warps, 50% occupancy), which
// 64 registers per thread allow (65,536 per SM); the compiler is held to that. Each thread
// steps 32 elements of a 4096-element tile, which amortizes the tile's bookkeeping (Note
// [CUDA tile walk]) over twice the elements that 256-thread blocks would.
constexpr int kThreads = 128;
constexpr int kBlocksPerSm = 8;
constexpr int kVec = 4;  // elements per vector access
static_assert(kCudaTile % (kThreads * kVec) == 0, "a tile is whole block-wide vector steps");

// Advances the step counter of every tensor in the call, unless the step is skipped.
// A separate launch, so that every block of the update kernel reads the new value.
__global__ void __launch_bounds__(kThreads)
    advance_steps_kernel(const TensorEntry* table, int64_t n, float* steps, StepControl control) {
  if (decide_step(control).skip) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float& s = steps[table[i].step_index];
    s = s + 1.0f;  // static-check: 32-bit (a step counter per tensor)
  }
}

// A unit (tile) of a launch: its tensor's pointers, its first element of the tensor and
// that element's state index, its number of elements. A tensor of 8-bit or 4-bit moments
// whose rows are not whole blocks (Note [8-bit row blocks] in csrc/quant8.h, Note [4-bit
// row blocks] in csrc/quant4.h): `first` and `count` count indices of its walk, `row` is
// the rows' length (0 otherwise; below 2^31, the binding checks) and `scale0` the tensor's
// first scale in each moment's run (its table entry's, read once per tile).
struct UnitTile {
  void* param;
  const void* grad;
  int64_t first, state0;
  int32_t count;
  int32_t row;
  int64_t scale0;
};

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
  uint16_t* remainder;      // BF16 parameters with remainder masters, else null
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
// REM: remainder masters (Note [Remainder master]; BF16 parameters), a kernel of their own so
// that the other variants' code is not shaped around theirs.
template <typename P, typename G, typename S, bool AMSGRAD, bool REM>
__device__ inline void step_element(const Slice<P, G, S>& s, int64_t k,
                                    const StepCoefs<MathOf<P>>& c, const AdamWLaunch& L,
                                    uint32_t key, int64_t index, MathOf<P>& mk, MathOf<P>& vk,
                                    MathOf<P>& vmk) {
  using M = MathOf<P>;
  M pk;
  if constexpr (kIs16Bit<P>) {
    const uint16_t bits = reinterpret_cast<const uint16_t*>(s.p)[k];
    if constexpr (REM) {
      pk = master_of_remainder(bits, s.remainder[k]);
    } else {
      pk = s.master != nullptr ? master_or_param<kIsHalf<P>>(s.master[k], bits, widen<P>(bits))
                               : to_float(s.p[k]);
    }
  } else {
    pk = s.p[k];
  }
  adamw_element<AMSGRAD, DeviceOps>(pk, to_math(s.g[k]), mk, vk, vmk, c);
  if constexpr (REM) {
    const uint32_t split = split_master(pk);
    reinterpret_cast<uint16_t*>(s.p)[k] = static_cast<uint16_t>(split >> 16);
    s.remainder[k] = static_cast<uint16_t>(split);
  } else if constexpr (kIs16Bit<P>) {
    if (s.master != nullptr) s.master[k] = pk;
    reinterpret_cast<uint16_t*>(s.p)[k] = round_param<kIsHalf<P>>(pk, L.rounding, key, index);
  } else {
    s.p[k] = pk;
  }
}

template <typename P, typename G, typename S, bool AMSGRAD, bool REM>
__device__ inline void update_one(const Slice<P, G, S>& s, int64_t k, const StepCoefs<MathOf<P>>& c,
                                  const AdamWLaunch& L, uint32_t key, int64_t index) {
  using M = MathOf<P>;
  M mk = load_moment(s.m, k), vk = load_moment(s.v, k), vmk = AMSGRAD ? load_moment(s.vm, k) : M(0);
  step_element<P, G, S, AMSGRAD, REM>(s, k, c, L, key, index, mk, vk, vmk);
  const MomentBits r = moment_bits<S, AMSGRAD>(s, index);
  store_moment(s.m, k, mk, s.state_rounding, r.mv);
  store_moment(s.v, k, vk, s.state_rounding, r.mv >> 16);
  if (AMSGRAD) store_moment(s.vm, k, vmk, s.state_rounding, r.vm);
}

// kVec elements at k with wide accesses (FP32 and 16-bit parameters; the caller checked
// alignment).
template <typename P, typename G, typename S, bool AMSGRAD, bool REM>
__device__ inline void update_vec(const Slice<P, G, S>& s, int64_t k, const StepCoefs<float>& c,
                                  const AdamWLaunch& L, uint32_t key, int64_t index,
                                  const volatile UnitTile& out) {
  float pv[kVec], gv[kVec], mv[kVec], vv[kVec], vmv[kVec];
  if constexpr (REM) {
    uint16_t bits[kVec], low[kVec];
    load_bits16(reinterpret_cast<const uint16_t*>(s.p + k), bits);
    load_bits16(s.remainder + k, low);
#pragma unroll
    for (int j = 0; j < kVec; ++j) pv[j] = master_of_remainder(bits[j], low[j]);
  } else if constexpr (kIs16Bit<P>) {
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
    adamw_element<AMSGRAD, DeviceOps>(pv[j], gv[j], mv[j], vv[j], vmv[j], c);
  }
  if constexpr (REM) {
    uint16_t out[kVec], low[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t split = split_master(pv[j]);
      out[j] = static_cast<uint16_t>(split >> 16);
      low[j] = static_cast<uint16_t>(split);
    }
    store_bits16(s.remainder + k, low);
    store_bits16(reinterpret_cast<uint16_t*>(s.p + k), out);
  } else if constexpr (kIs16Bit<P>) {
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
  // The moments' addresses made again from the tile's state index, read anew (`out`:
  // volatile), not held in registers through the arithmetic (Note [CUDA tile walk]).
  const int64_t at = out.state0 + k;
  store_moments(static_cast<S*>(L.exp_avg) + at, mv, s.state_rounding, r_m);
  store_moments(static_cast<S*>(L.exp_avg_sq) + at, vv, s.state_rounding, r_v);
  if (AMSGRAD) store_moments(static_cast<S*>(L.max_exp_avg_sq) + at, vmv, s.state_rounding, r_vm);
}

// Note [CUDA tile walk]
// The units of a launch (tiles of kCudaTile elements, Note [Tensor table]) are dealt to
// the blocks in contiguous runs: block b steps units [b per, (b + 1) per), per =
// ceil(n_units / gridDim.x). A block finds the tensor of its first unit by binary search,
// once, then walks the table forward, and makes the step's coefficients (two FP64 powers
// by repeated squaring, the rounding key) once per run of equal step counters, as the CPU
// kernel does (run() in csrc/cpu/kernels/adamw_cpu.cpp): a bucket of many small tensors at
// one step costs a table entry and a counter per tile, not a search and two powers. (With
// a grid-stride loop, block b stepping units b, b + grid, ..., every tile of a block was
// another tensor, and that work about 43 instructions per element; docs/performance.md.)
template <typename M>
struct TileWalk {
  // 32-bit: the binding keeps units below 2^31 (kMaxUnits in csrc/kernels.h).
  int32_t u, u_end;  // the block's units still to step: [u, u_end)
  int32_t i, next;   // the tensor of unit u, and the first unit of tensor i + 1
  float counter;     // the step counter the values below are for (NaN: none yet)
  // Its bias corrections (Note [Bias correction]): FP32 math takes their FP64 reciprocals
  // (Note [Division by a step constant]), FP64 math divides by them.
  double bc1, bc2;
  // The random streams of its step (Note [Stochastic rounding bits]): the parameters', and
  // the BF16 moments' (Note [Low-precision states]).
  uint32_t key, key_mv, key_vm;

  // Not a constructor: the 8-bit kernel keeps its walks in shared memory.
  __device__ void init(const AdamWLaunch& L) {
    const int32_t n_units = static_cast<int32_t>(L.n_units);
    const int32_t grid = static_cast<int32_t>(gridDim.x);
    const int32_t per = (n_units + grid - 1) / grid;
    u = static_cast<int32_t>(blockIdx.x) * per;
    u_end = min(u + per, n_units);
    i = u < u_end ? static_cast<int32_t>(find_tensor(L.table, L.n_tensors, u)) : 0;
    next = next_start(L);
    counter = float_from_bits(kCanonicalNaNBits);
  }

  __device__ int32_t next_start(const AdamWLaunch& L) const {
    return static_cast<int32_t>(i + 1 < L.n_tensors
                                    ? L.table[i + 1].unit_start
                                    : L.n_units);  // static-check: 32-bit (a table entry)
  }

  // The coefficients of unit u (Note [Division by a step constant]: FP32 math needs the
  // bias corrections' reciprocals only).
  __device__ StepCoefs<M> coefs(const AdamWLaunch& L, double factor, double lr) const {
    if constexpr (std::is_same_v<M, float>) {
      return coefs_at<M>(L.hyper, factor, lr, 0.0f, 0.0f, bc1, bc2);
    } else {
      return coefs_at<M>(L.hyper, factor, lr, bc1, bc2, 0.0, 0.0);
    }
  }

  // Moves to unit u (false past the block's run): its step values, and its tile into `tile`.
  // kRowBits 8 or 4: the 8-bit or 4-bit kernels' walk, whose tensors may have rows that are
  // not whole blocks (Note [8-bit row blocks] in csrc/quant8.h, Note [4-bit row blocks] in
  // csrc/quant4.h); the other kernels' tensors never do, and their per-tile bookkeeping
  // stays without the rows' extent (5 SASS per tile).
  template <int kRowBits = 0>
  __device__ bool at_unit(const AdamWLaunch& L, UnitTile& tile) {
    if (u >= u_end) return false;
    while (u >= next) {  // the tensors before unit u (empty ones own no unit)
      ++i;
      next = next_start(L);
    }
    const TensorEntry& e = L.table[i];
    const float now = L.steps[e.step_index];  // static-check: 32-bit (a tile's step counter)
    if (!(now == counter)) {  // a NaN counter is made every time (it counts as t = 1)
      counter = now;
      const int64_t t = step_count(now);  // Note [Step counter range]
      bc1 = static_cast<double>(bias_correction<M>(L.hyper.beta1, t));
      bc2 = static_cast<double>(bias_correction<M>(L.hyper.beta2, t));
      if constexpr (std::is_same_v<M, float>) {
        bc1 = 1.0 / bc1;
        bc2 = 1.0 / bc2;
      }
      key = rounding_key(L.seed, t);
      key_mv = moment_key(L.seed, t, Moment::kAverages);
      key_vm = moment_key(L.seed, t, Moment::kMaxExpAvgSq);
    }
    const int64_t first = static_cast<int64_t>(u - e.unit_start) * kCudaTile;
    if constexpr (kRowBits != 0) {
      const int64_t extent = kRowBits == 4 ? state_extent4(e) : state_extent(e);
      tile.count = static_cast<int32_t>(min(kCudaTile, extent - first));
      tile.row = static_cast<int32_t>(e.row);
      tile.scale0 = e.scale_offset;
    } else {  // tile.row is not read
      tile.count = static_cast<int32_t>(min(kCudaTile, e.numel - first));
    }
    tile.param = e.param;
    tile.grad = e.grad;
    tile.first = first;
    tile.state0 = e.state_offset + first;
    return true;
  }
};

template <typename P, typename G, typename S, bool AMSGRAD, bool REM>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) adamw_kernel(AdamWLaunch L) {
  using M = MathOf<P>;
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  const double lr = learning_rate(L.hyper);  // a Tensor lr: one load
  __shared__ TileWalk<M> walks[kThreads];    // Note [CUDA tile walk]
  TileWalk<M>& w = walks[threadIdx.x];
  // The tiles too (read as needed): a tile's fields held in registers made some variants
  // spill (the AMSGrad ones with BF16 moments, FP64 math).
  __shared__ UnitTile tiles[kThreads];
  UnitTile& tile = tiles[threadIdx.x];
  w.init(L);
  for (; w.at_unit(L, tile); ++w.u) {
    const StepCoefs<M> c = w.coefs(L, factor_of<M>(d), lr);
    const int32_t end = tile.count;
    const int64_t state0 = tile.state0;
    Slice<P, G, S> s;
    s.p = static_cast<P*>(tile.param) + tile.first;
    s.g = static_cast<const G*>(tile.grad) + tile.first;
    s.m = static_cast<S*>(L.exp_avg) + state0;
    s.v = static_cast<S*>(L.exp_avg_sq) + state0;
    s.vm = AMSGRAD ? static_cast<S*>(L.max_exp_avg_sq) + state0 : nullptr;
    s.state_rounding = L.state_rounding;
    s.key_mv = w.key_mv;
    s.key_vm = w.key_vm;
    s.master = kIs16Bit<P> && L.master != nullptr ? L.master + state0 : nullptr;
    s.remainder = REM ? L.remainder + state0 : nullptr;
    bool aligned = false;
    if constexpr (!std::is_same_v<P, double>) {  // FP64: scalar accesses (a rare dtype)
      // Every access kVec elements wide: the addresses' low bits together (state and
      // master elements are 4 bytes, or 2 for BF16 moments; parameters and gradients 2 or 4).
      const auto bits = [](const void* q) { return reinterpret_cast<uintptr_t>(q); };
      aligned = ((bits(s.p) % (kVec * sizeof(P))) | (bits(s.g) % (kVec * sizeof(G))) |
                 (bits(s.m) | bits(s.v) | (AMSGRAD ? bits(s.vm) : 0)) % (kVec * sizeof(S)) |
                 (s.master != nullptr ? bits(s.master) % (kVec * sizeof(float)) : 0) |
                 (REM ? bits(s.remainder) % (kVec * sizeof(uint16_t)) : 0)) == 0;
    }
    if (aligned) {
      if constexpr (!std::is_same_v<P, double>) {
        for (int32_t k = static_cast<int32_t>(threadIdx.x) * kVec; k < end; k += kThreads * kVec) {
          if (k + kVec <= end) {
            update_vec<P, G, S, AMSGRAD, REM>(s, k, c, L, w.key, state0 + k, tile);
          } else {
            for (int32_t kk = k; kk < end; ++kk) {
              update_one<P, G, S, AMSGRAD, REM>(
                  s, kk, c, L, w.key, state0 + kk);  // static-check: 32-bit (the last elements)
            }
          }
        }
      }
    } else {  // a view that is not aligned for wide accesses: scalar accesses, same math
      // (the tile's count read for each element: FP64 math holds twice the registers)
      const volatile UnitTile& vt = tile;
      for (int32_t k = static_cast<int32_t>(threadIdx.x); k < vt.count; k += kThreads) {
        update_one<P, G, S, AMSGRAD, REM>(s, k, c, L, w.key,
                                          state0 + k);  // static-check: 32-bit (not aligned)
      }
    }
  }
}

// Note [8-bit moments] in csrc/quant8.h: each warp steps one block of kBlock8 elements at
// a time, lane l its elements 8 l .. 8 l + 7 (Note [8-bit CUDA lanes] in cuda_utils.cuh),
// decoded to FP32, stepped as FP32 moments, coded again with the block's new scale.
//
// Note [8-bit CUDA registers]
// A kernel of at most 64 registers runs 32 warps per SM (50% occupancy); the 8-bit step
// holds more than the FP32 one (codes, scales, the largest magnitudes), and the compiler
// left to itself used 90 to 105 registers, or spilled at 64. So: a lane steps its 8
// elements in two halves of 4, each half's parameters (and masters) loaded, stepped and
// stored before the next, its new moments parked in shared memory (Park8) with only their
// largest magnitudes kept, and read back to be coded once the block's scales are known; the
// walk's state between tiles (Note [CUDA tile walk]) and the tile are kept in shared
// memory, one per warp (what the compiler would have spilled to local memory, used once per
// tile and block); and the blocks of a tile that the lanes cannot access directly (the
// last, shorter block of a tensor, every block of a view that is not 16-byte aligned) are
// stepped by a kernel of its own (adamw8_edge_kernel), reading and writing them element by
// element, so that neither kernel holds the registers of the other's accesses. 12 KiB of
// shared memory per block of 128 threads (the park) lets 8 blocks run on an SM of sm_80
// (164 KiB) as of sm_90 (228 KiB).
static_assert(kCudaTile % kBlock8 == 0, "tiles are whole 8-bit blocks");
constexpr int kThreads8 = kThreads;
constexpr int kWarps8 = kThreads8 / 32;
constexpr int kBlocksPerSm8 = kBlocksPerSm;

// Each thread's new moments, a half (4 values) at a time: moment q's half h of thread t at
// [q][h][t] (consecutive threads' 16 bytes consecutive: no bank conflict).
struct Park8 {
  float2 v[3][4][kThreads8];
};

// A moment's codes at state index k of the launch's buffer q (0 exp_avg, 1 exp_avg_sq, 2
// max_exp_avg_sq).
__device__ inline uint8_t* codes8(const AdamWLaunch& L, int q, int64_t k) {
  void* base = q == 0 ? L.exp_avg : q == 1 ? L.exp_avg_sq : L.max_exp_avg_sq;
  return static_cast<uint8_t*>(base) + k;
}

// The block at index kb of a tile: its pointers, read from the tile in shared memory for
// each block (volatile: not held in registers through the block loop, Note [8-bit CUDA
// registers]). kRows: the tile may be of a tensor whose rows are not whole blocks (Note
// [8-bit row blocks] in csrc/quant8.h), whose blocks the edge kernel steps (the tensor's
// scale offset from the tile, UnitTile::scale0); the direct kernel's tiles never are.
template <typename P, typename G>
struct Tile8 {
  P* p;
  const G* g;
  float* master;  // null without master weights
  int64_t state;  // the state index of its first element (codes, masters, random bits)
  int64_t scale;  // its scale in each moment's run
  int32_t n;      // its elements (kRows only; the caller's count otherwise)
};

template <typename P, typename G, bool kRows = false>
__device__ inline Tile8<P, G> tile8(const AdamWLaunch& L, const UnitTile& tile, bool has_master,
                                    int32_t kb) {
  const volatile UnitTile& vt = tile;
  int64_t first = vt.first + kb;
  int64_t state = vt.state0 + kb;
  int64_t scale = static_cast<int64_t>(static_cast<uint64_t>(state) / kBlock8);  // never negative
  int32_t n = static_cast<int32_t>(kBlock8);
  if constexpr (kRows) {
    TensorEntry e{};
    e.numel = vt.count - kb;  // what block8_at reads of a flat tensor: the tile's end
    e.row = vt.row;
    const Block8 blk = block8_at(e, e.row == 0 ? 0 : first, e.numel);
    n = static_cast<int32_t>(blk.n);
    if (e.row != 0) {
      e.scale_offset = vt.scale0;
      scale = scale_index8(e, first);
      state = vt.state0 - vt.first + blk.first;
      first = blk.first;
    }
  }
  return {static_cast<P*>(const_cast<void*>(vt.param)) + first,
          static_cast<const G*>(const_cast<const void*>(vt.grad)) + first,
          has_master ? L.master + state : nullptr,
          state,
          scale,
          n};
}

// Whether the lanes access the block `b` of a tile directly (Note [8-bit CUDA lanes] in
// cuda_utils.cuh): its elements 16-byte aligned (8 per lane, a quarter at a time), its
// masters and remainders likewise, its codes 8-byte aligned. Every block of a flat tile
// shares the alignment of its first (each starts kBlock8 elements and codes after the
// last); a block of rows that are not whole blocks (Note [8-bit row blocks] in
// csrc/quant8.h) is asked on its own, and must also be whole and keep its state indices'
// high 32 bits (the parameters' random bits, step_block8).
template <typename P, typename G, bool AMSGRAD, bool REM>
__device__ inline bool block8_aligned(const AdamWLaunch& L, const Tile8<P, G>& b, bool has_master) {
  bool direct = is_aligned<16 / sizeof(P)>(b.p) && is_aligned<16 / sizeof(G)>(b.g) &&
                (!has_master || is_aligned<4>(b.master)) &&
                (!REM || is_aligned<8>(L.remainder + b.state));
  for (int q = 0; q < (AMSGRAD ? 3 : 2); ++q) {
    direct = direct && is_aligned<8>(codes8(L, q, b.state));
  }
  return direct;
}

template <typename P, typename G, bool AMSGRAD, bool REM>
__device__ inline bool row_block8_direct(const AdamWLaunch& L, const Tile8<P, G>& b,
                                         bool has_master) {
  return b.n == static_cast<int32_t>(kBlock8) &&
         static_cast<uint32_t>(b.state) <= ~static_cast<uint32_t>(kBlock8 - 1) &&
         block8_aligned<P, G, AMSGRAD, REM>(L, b, has_master);
}

// One block stepped by a warp: `p`, `g` and `master` (null without) at the block's first
// element, `sk` its first element's state index (codes, remainders, random bits), `sb` its
// scale, `n` its elements (kBlock8 unless kEdge). kEdge: the block's n elements read and
// written one by one (a tensor's shorter last block, a view that is not 16-byte aligned:
// Note [8-bit CUDA registers]).
template <typename P, typename G, bool AMSGRAD, bool kEdge, bool REM, bool kRows = kEdge,
          typename Ch>
__device__ inline void step_block8(const AdamWLaunch& L, const StepCoefs<float>& coefs, P* p,
                                   const G* g, float* master, int64_t sk, int64_t sb, int n,
                                   Park8& park, const TileWalk<float>& w, const UnitTile& tile,
                                   int32_t kb, const Ch& ch) {
  constexpr int kMoments = AMSGRAD ? 3 : 2;
  const int lane = static_cast<int>(threadIdx.x % 32), tid = static_cast<int>(threadIdx.x);
  const bool with_master = !REM && kIs16Bit<P> && ch.master;
  StepCoefs<float> c = coefs;
  c.l2_on = ch.l2;  // the direct kernels' constant: their element loop tests none of these
  // Remainder masters (REM, Note [Remainder master]): BF16 parameters, 16-bit like them.
  P* rem = REM ? reinterpret_cast<P*>(L.remainder + sk) : nullptr;
  const int64_t b = sb;
  // Read before lane 0 writes the new scales: each value feeds the warp's reduction below.
  float sc[3];
  sc[0] = L.exp_avg_scales[b];                          // static-check: 32-bit (a block's scale)
  sc[1] = L.exp_avg_sq_scales[b];                       // static-check: 32-bit (a block's scale)
  sc[2] = AMSGRAD ? L.max_exp_avg_sq_scales[b] : 0.0f;  // static-check: 32-bit (a block's scale)
  const int k = 8 * lane;                               // the lane's first element of the block
  // The parameters' random bits (stochastic rounding) from the high 32 bits of the block's
  // first index: a direct block's indices share them (from a multiple of kBlock8, or asked:
  // row_block8_direct); an edge block of rows may start anywhere, and its indices past a
  // multiple of 2^32 take the next ones (rounding_high_at).
  const uint32_t high =
      ch.stochastic ? rounding_high(static_cast<const volatile TileWalk<float>&>(w).key, sk) : 0u;
  const uint32_t low = static_cast<uint32_t>(sk);
  uint2 cw[3];
  if constexpr (kEdge) {  // the block's codes byte by byte, zeros past its end
    for (int q = 0; q < kMoments; ++q) {
      const uint8_t* codes = codes8(L, q, sk);
      uint32_t word[2] = {0u, 0u};
#pragma unroll
      for (int j = 0; j < kPerLane8; ++j) {
        if (k + j < n) word[j / 4] |= static_cast<uint32_t>(codes[k + j]) << (8 * (j % 4));
      }
      cw[q] = make_uint2(word[0], word[1]);
    }
  } else {
    for (int q = 0; q < kMoments; ++q) {
      cw[q] = __ldca(reinterpret_cast<const uint2*>(codes8(L, q, sk + k)));
    }
  }
  // The old moments decoded into the park, which the new ones then replace quarter by
  // quarter: the codes and scales are not held through the arithmetic.
#pragma unroll
  for (int q = 0; q < kMoments; ++q) {
    float x[kPerLane8];
    if (q == 0) {
      decode_lane8<Code8::kSigned>(cw[q], sc[q], x);
    } else {
      decode_lane8<Code8::kUnsigned>(cw[q], sc[q], x);
    }
#pragma unroll
    for (int h = 0; h < 4; ++h) park.v[q][h][tid] = make_float2(x[2 * h], x[2 * h + 1]);
  }
  uint32_t largest[3] = {0u, 0u, 0u};
  Quarters8<P> pq;
  Quarters8<G> gq;
  Quarters8<float> mq;
  Quarters8<P> rq;
#pragma unroll
  for (int h = 0; h < 4; ++h) {  // the lane's elements a quarter (2) at a time
    if constexpr (kEdge) {
      pq.load_each(p + k, h, n - k);
      gq.load_each(g + k, h, n - k);
      if (with_master) mq.load_each(master + k, h, n - k);
      if constexpr (REM) rq.load_each(rem + k, h, n - k);
    } else {
      pq.template load<true>(p + k, h);
      gq.template load<true>(g + k, h);
      if (with_master) mq.template load<true>(master + k, h);
      if constexpr (REM) rq.template load<true>(rem + k, h);
    }
    const float2 m2 = park.v[0][h][tid], v2 = park.v[1][h][tid];
    const float2 vm2 = AMSGRAD ? park.v[2][h][tid] : make_float2(0.0f, 0.0f);
    float m[2] = {m2.x, m2.y}, v[2] = {v2.x, v2.y}, vm[2] = {vm2.x, vm2.y};
    float pk[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if constexpr (kIs16Bit<P>) {
        const uint16_t bits = pq.bits16(h, j);
        if constexpr (REM) {
          pk[j] = master_of_remainder(bits, rq.bits16(h, j));
        } else if (with_master) {
          pk[j] = master_or_param<kIsHalf<P>>(mq.value(h, j), bits, widen<P>(bits));
        } else {
          pk[j] = pq.value(h, j);
        }
      } else {
        pk[j] = pq.value(h, j);
      }
      adamw_element<AMSGRAD, DeviceOps, false>(pk[j], gq.value(h, j), m[j], v[j], vm[j], c);
    }
    // The pair's results stored (16-bit parameters: the pair rounded into one word).
    if constexpr (kIs16Bit<P>) {
      if constexpr (REM) {
        const uint32_t s0 = split_master(pk[0]), s1 = split_master(pk[1]);
        pq.set_pair(h, __byte_perm(s0, s1, 0x7632));  // the parameters' high halves
        rq.set_pair(h, __byte_perm(s0, s1, 0x5410));  // the remainders' low halves
      } else {
        if (with_master) {
          mq.set(h, 0, __float_as_uint(pk[0]));
          mq.set(h, 1, __float_as_uint(pk[1]));
        }
        if (!kIsHalf<P> && ch.stochastic) {
          const uint32_t at = low + static_cast<uint32_t>(k + 2 * h);
          uint32_t high0 = high, high1 = high;
          if constexpr (kEdge) {
            const auto key = [&] { return static_cast<const volatile TileWalk<float>&>(w).key; };
            high0 = rounding_high_at(high, low, at, key);
            high1 = rounding_high_at(high, low, at + 1u, key);
          }
          pq.set_pair(h, round_pair_stochastic_bf16(pk[0], pk[1], rounding_mix(high0, at),
                                                    rounding_mix(high1, at + 1u)));
        } else {
          pq.set_pair(h, round_pair_nearest16<kIsHalf<P>>(pk[0], pk[1]));
        }
      }
    } else {
      pq.set(h, 0, __float_as_uint(pk[0]));
      pq.set(h, 1, __float_as_uint(pk[1]));
    }
    largest[0] = largest_of(m, 2, largest[0]);
    largest[1] = largest_of(v, 2, largest[1]);
    if (AMSGRAD) largest[2] = largest_of(vm, 2, largest[2]);
    park.v[0][h][tid] = make_float2(m[0], m[1]);
    park.v[1][h][tid] = make_float2(v[0], v[1]);
    if (AMSGRAD) park.v[2][h][tid] = make_float2(vm[0], vm[1]);
    if constexpr (kEdge) {  // the block's elements only
      if (Quarters8<P>::stored_after(h)) {
        const int f = Quarters8<P>::first(h);
#pragma unroll
        for (int j = 0; j < (kIs16Bit<P> ? 4 : 2); ++j) {
          if (k + f + j < n) {
            if constexpr (kIs16Bit<P>) {
              reinterpret_cast<uint16_t*>(p)[k + f + j] = pq.bits16(h - 1 + j / 2, j % 2);
              if constexpr (REM) {
                reinterpret_cast<uint16_t*>(rem)[k + f + j] = rq.bits16(h - 1 + j / 2, j % 2);
              }
            } else {
              p[k + f + j] = pq.value(h, j);
            }
          }
        }
      }
      if (with_master) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (k + 2 * h + j < n) master[k + 2 * h + j] = mq.value(h, j);
        }
      }
    } else {
      if (Quarters8<P>::stored_after(h)) {
        pq.template store<true>(p + k, h);
        if constexpr (REM) rq.template store<true>(rem + k, h);
      }
      if (with_master) mq.template store<true>(master + k, h);
    }
  }
  uint2 oc[3];
#pragma unroll
  for (int q = 0; q < kMoments; ++q) {
    const float2 x0 = park.v[q][0][tid], x1 = park.v[q][1][tid], x2 = park.v[q][2][tid],
                 x3 = park.v[q][3][tid];
    const float x[kPerLane8] = {x0.x, x0.y, x1.x, x1.y, x2.x, x2.y, x3.x, x3.y};
    sc[q] = lane_block_scale(x, kPerLane8, largest[q]);
    oc[q] =
        q == 0 ? encode_lane8<Code8::kSigned>(x, sc[q]) : encode_lane8<Code8::kUnsigned>(x, sc[q]);
  }
  // The edge and rows kernels read the block's state index and scale again (Note [8-bit
  // CUDA registers]); the direct one keeps them (its registers allow, and rereading them
  // cost 20 SASS per block).
  int64_t sk_out = sk, b_out = b;
  if constexpr (kRows) {
    const Tile8<P, G> out = tile8<P, G, true>(L, tile, false, kb);
    sk_out = out.state;
    b_out = out.scale;
  }
  if (lane == 0) {
    L.exp_avg_scales[b_out] = sc[0];
    L.exp_avg_sq_scales[b_out] = sc[1];
    if (AMSGRAD) L.max_exp_avg_sq_scales[b_out] = sc[2];
  }
  for (int q = 0; q < kMoments; ++q) {
    if constexpr (kEdge) {
#pragma unroll
      for (int j = 0; j < kPerLane8; ++j) {
        if (k + j < n) codes8(L, q, sk_out)[k + j] = code_of(oc[q], j);
      }
    } else {
      __stwb(reinterpret_cast<uint2*>(codes8(L, q, sk_out + k)), oc[q]);
    }
  }
}

// Note [Warp tile walk]
// The low-bit kernels' walk of a launch's tiles (Note [CUDA tile walk]), one walk per warp
// in shared memory (Note [8-bit CUDA registers]): every lane walks a copy in registers, lane
// 0 writes it back, between warp barriers; a tile per thread, which each writes.
// start_warp_walk before the first tile (a barrier of the block: it also orders what the
// caller wrote to shared memory before it), then next_warp_tile for each tile: false past
// the warp's run, else the tile in `tile` and its coefficients in `c`. kRowBits: the rows'
// blocks of the tiles' extent (8 or 4, TileWalk::at_unit).
// The moments' FP32 constants are read from `consts` in shared memory (Note [8-bit CUDA
// constants]).
__device__ inline void start_warp_walk(const AdamWLaunch& L, TileWalk<float>& w, float* consts) {
  if (threadIdx.x == 0) {
    consts[0] = L.hyper.beta1_f;
    consts[1] = L.hyper.one_minus_beta1_f;
    consts[2] = L.hyper.beta2_f;
    consts[3] = L.hyper.one_minus_beta2_f;
    consts[4] = L.hyper.eps_f;
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) w.init(L);
  __syncwarp();
}

template <int kRowBits>
__device__ inline bool next_warp_tile(const AdamWLaunch& L, const StepDecision& d, double lr,
                                      TileWalk<float>& w, UnitTile& tile, const float* consts,
                                      StepCoefs<float>& c) {
  TileWalk<float> now = w;
  const bool more = now.template at_unit<kRowBits>(L, tile);
  __syncwarp();  // every lane has read the warp's walk
  if (threadIdx.x % 32 == 0) {
    TileWalk<float> after = now;
    ++after.u;
    w = after;
  }
  __syncwarp();  // ... and sees the new one
  if (!more) return false;
  c = now.coefs(L, factor_of<float>(d), lr);
  const volatile float* vc = consts;  // Note [8-bit CUDA constants]
  c.beta1 = vc[0];
  c.one_minus_beta1 = vc[1];
  c.beta2 = vc[2];
  c.one_minus_beta2 = vc[3];
  c.eps = vc[4];
  return true;
}

// The passes of an 8-bit step, each a kernel of its own so that each has its own 64
// registers (Note [8-bit CUDA registers]), over disjoint blocks: the whole blocks of flat
// tiles whose accesses are aligned for the lanes (kDirect: adamw8_kernel); the whole,
// aligned blocks inside rows that are not whole blocks (kRows: adamw8_rows_kernel, launched
// where a tensor has such rows: AdamWLaunch::rows), which in the direct kernel cost each
// flat block a branch and the bf16 variants 4% more instructions; the others, element by
// element (kEdges: adamw8_edge_kernel).
enum class Pass8 { kDirect, kRows, kEdges };

// The 8-bit step over a launch's tiles, one pass (Pass8).
// Its walk is written out here rather than through start_warp_walk / next_warp_tile (Note
// [Warp tile walk]): through them, adamw8_edge_kernel<half, float, AMSGrad> spilled 4 bytes
// at 64 registers (gpu_static's analyze.sh; why, ptxas does not say).
template <typename P, typename G, bool AMSGRAD, Pass8 kPass, bool REM, typename Ch>
__device__ inline void step_tiles8(const AdamWLaunch& L, const Ch& ch) {
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  __shared__ Park8 park;
  // One walk per warp (Note [8-bit CUDA registers]): every lane walks a copy in registers,
  // lane 0 writes it back, between warp barriers; a tile per thread, which each writes.
  __shared__ TileWalk<float> walks[kWarps8];
  __shared__ UnitTile tiles[kThreads8];
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  TileWalk<float>& w = walks[warp];
  UnitTile& tile = tiles[threadIdx.x];
  const bool has_master = !REM && kIs16Bit<P> && ch.master;
  const double lr = learning_rate(L.hyper);  // a Tensor lr: one load
  // Note [8-bit CUDA constants]
  // The moments' FP32 constants (beta1, 1 - beta1, beta2, 1 - beta2, eps) are launch
  // constants, and ptxas read each from the constant bank into a uniform register again for
  // every element (ULDC, 4 to 5 SASS per element of the 8-bit step). Read from shared memory
  // (volatile: once per tile), they are values the compiler must keep in registers.
  __shared__ float consts[5];
  if (threadIdx.x == 0) {
    consts[0] = L.hyper.beta1_f;
    consts[1] = L.hyper.one_minus_beta1_f;
    consts[2] = L.hyper.beta2_f;
    consts[3] = L.hyper.one_minus_beta2_f;
    consts[4] = L.hyper.eps_f;
  }
  __syncthreads();
  if (lane == 0) w.init(L);
  __syncwarp();
  for (;;) {
    TileWalk<float> now = w;
    const bool more = now.at_unit<8>(L, tile);
    __syncwarp();  // every lane has read the warp's walk
    if (lane == 0) {
      TileWalk<float> after = now;
      ++after.u;
      w = after;
    }
    __syncwarp();  // ... and sees the new one
    if (!more) break;
    StepCoefs<float> c = now.coefs(L, factor_of<float>(d), lr);
    const volatile float* vc = consts;  // Note [8-bit CUDA constants]
    c.beta1 = vc[0];
    c.one_minus_beta1 = vc[1];
    c.beta2 = vc[2];
    c.one_minus_beta2 = vc[3];
    c.eps = vc[4];
    const int32_t count = tile.count;
    // 128-bit accesses of elements (16 bytes) and 64-bit accesses of codes: the blocks start
    // at multiples of kBlock8 from these.
    // A flat tile's whole blocks are aligned as its first (block8_aligned).
    const bool direct = tile.row == 0 && block8_aligned<P, G, AMSGRAD, REM>(
                                             L, tile8<P, G>(L, tile, has_master, 0), has_master);
    constexpr int32_t kBlock = static_cast<int32_t>(kBlock8);
    const int32_t whole = direct ? count / kBlock * kBlock : 0;  // the blocks stepped directly
    // The tile's count and row read for each block (Note [8-bit CUDA registers]).
    const volatile UnitTile& vt = tile;
    if constexpr (kPass == Pass8::kEdges) {
      for (int32_t kb = whole + warp * kBlock; kb < vt.count; kb += kWarps8 * kBlock) {
        const Tile8<P, G> b = tile8<P, G, true>(L, tile, has_master, kb);
        if (vt.row != 0 && row_block8_direct<P, G, AMSGRAD, REM>(L, b, has_master)) continue;
        step_block8<P, G, AMSGRAD, true, REM>(L, c, b.p, b.g, b.master, b.state, b.scale, b.n, park,
                                              w, tile, kb, ch);
      }
    } else if constexpr (kPass == Pass8::kRows) {
      if (vt.row == 0) continue;  // a flat tile: the other kernels'
      for (int32_t kb = warp * kBlock; kb < vt.count; kb += kWarps8 * kBlock) {
        const Tile8<P, G> b = tile8<P, G, true>(L, tile, has_master, kb);
        if (!row_block8_direct<P, G, AMSGRAD, REM>(L, b, has_master)) continue;
        step_block8<P, G, AMSGRAD, false, REM, true>(L, c, b.p, b.g, b.master, b.state, b.scale,
                                                     kBlock, park, w, tile, kb, ch);
      }
    } else {
      for (int32_t kb = warp * kBlock; kb < whole; kb += kWarps8 * kBlock) {
        const Tile8<P, G> b = tile8<P, G>(L, tile, has_master, kb);
        step_block8<P, G, AMSGRAD, false, REM>(L, c, b.p, b.g, b.master, b.state, b.scale, kBlock,
                                               park, w, tile, kb, ch);
      }
    }
  }
}

// The launch-uniform choices of an 8-bit step: master weights, stochastic rounding of the
// parameters, Adam's L2 term (Note [Weight decay modes]). The direct kernel takes them as
// template arguments (Choice8), so that its element loop tests none of them (each test was a
// branch, or a select, per element: docs/performance.md); the edge kernel, which steps few
// blocks, reads them from the launch (Choice8Of).
template <bool kMaster, bool kStochastic, bool kL2>
struct Choice8 {
  static constexpr bool master = kMaster, stochastic = kStochastic, l2 = kL2;
};

struct Choice8Of {
  bool master, stochastic, l2;
};

// The rows kernels' choices (Pass8::kRows): master weights and stochastic rounding as
// template arguments (with both read from the launch, the 16-bit AMSGrad kernels spilled at
// 64 registers), Adam's L2 term from the launch (its test is a select per element, in a
// kernel that steps few blocks).
template <bool kMaster, bool kStochastic>
struct ChoiceRows {
  static constexpr bool master = kMaster, stochastic = kStochastic;
  bool l2;
};

__host__ __device__ inline Choice8Of choice8_of(const AdamWLaunch& L) {
  return {L.master != nullptr, L.rounding == Rounding::kStochastic,
          L.hyper.l2 && L.hyper.weight_decay != 0.0};
}

template <typename P, typename G, bool AMSGRAD, bool REM, bool kMaster, bool kStochastic, bool kL2>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw8_kernel(AdamWLaunch L) {
  step_tiles8<P, G, AMSGRAD, Pass8::kDirect, REM>(L, Choice8<kMaster, kStochastic, kL2>{});
}

template <typename P, typename G, bool AMSGRAD, bool REM, bool kMaster, bool kStochastic>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw8_rows_kernel(AdamWLaunch L) {
  step_tiles8<P, G, AMSGRAD, Pass8::kRows, REM>(L,
                                                ChoiceRows<kMaster, kStochastic>{choice8_of(L).l2});
}

template <typename P, typename G, bool AMSGRAD, bool REM>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw8_edge_kernel(AdamWLaunch L) {
  step_tiles8<P, G, AMSGRAD, Pass8::kEdges, REM>(L, choice8_of(L));
}

template <typename Kernel>
void launch_tiles8(Kernel kernel, const AdamWLaunch& L, cudaStream_t stream) {
  const int64_t grid = std::min<int64_t>(L.n_units, max_resident_blocks(kernel, kThreads8));
  launch_kernel(kernel, static_cast<unsigned>(grid), kThreads8, stream, L);
  RUDA_CUDA_CHECK_LAUNCH();
}

// The kernels of a low-bit format: its direct kernel of given choices and its edge kernel.
struct Kernels8 {
  template <typename P, typename G, bool AMSGRAD, bool REM, bool kM, bool kS, bool kL2>
  static auto direct() {
    return adamw8_kernel<P, G, AMSGRAD, REM, kM, kS, kL2>;
  }
  template <typename P, typename G, bool AMSGRAD, bool REM, bool kM, bool kS>
  static auto rows() {
    return adamw8_rows_kernel<P, G, AMSGRAD, REM, kM, kS>;
  }
  template <typename P, typename G, bool AMSGRAD, bool REM>
  static auto edge() {
    return adamw8_edge_kernel<P, G, AMSGRAD, REM>;
  }
};

// The direct kernel of the launch's choices (Choice8): only those its parameters can make.
// Master weights: 16-bit parameters without remainders; stochastic rounding: BF16 ones
// without master weights (csrc/bindings.cpp refuses stochastic rounding with them).
template <typename K, typename P, typename G, bool AMSGRAD, bool REM>
void launch_direct(const AdamWLaunch& L, cudaStream_t stream) {
  constexpr bool kCanMaster = kIs16Bit<P> && !REM;
  constexpr bool kCanRound = std::is_same_v<P, __nv_bfloat16> && !REM;
  const Choice8Of ch = choice8_of(L);
  const auto pick = [&](auto master, auto stochastic) {
    constexpr bool kM = decltype(master)::value, kS = decltype(stochastic)::value;
    if (L.rows) launch_tiles8(K::template rows<P, G, AMSGRAD, REM, kM, kS>(), L, stream);
    if (ch.l2) {
      return launch_tiles8(K::template direct<P, G, AMSGRAD, REM, kM, kS, true>(), L, stream);
    }
    launch_tiles8(K::template direct<P, G, AMSGRAD, REM, kM, kS, false>(), L, stream);
  };
  if (kCanMaster && ch.master) return pick(std::bool_constant<kCanMaster>{}, std::false_type{});
  if (kCanRound && ch.stochastic) return pick(std::false_type{}, std::bool_constant<kCanRound>{});
  pick(std::false_type{}, std::false_type{});
}

// A low-bit step (K: Kernels8 or Kernels4). Both kernels of a format read the counters and
// the old scales of their own blocks only: they step disjoint blocks, in either order.
template <typename K, typename P, typename G, bool REM>
void launch_low_bit(const AdamWLaunch& L, cudaStream_t stream) {
  if (L.amsgrad) {
    launch_direct<K, P, G, true, REM>(L, stream);
    if (L.edges) launch_tiles8(K::template edge<P, G, true, REM>(), L, stream);
  } else {
    launch_direct<K, P, G, false, REM>(L, stream);
    if (L.edges) launch_tiles8(K::template edge<P, G, false, REM>(), L, stream);
  }
}

// Note [4-bit CUDA step]
// Note [4-bit moments] in csrc/quant4.h on the GPU: each warp steps one block of kBlock4
// elements at a time, lane l its elements 4 l .. 4 l + 3 (Note [4-bit CUDA lanes] in
// quant4_lanes.cuh), decoded to FP32, stepped by adamw_element as FP32 moments and coded
// again with the block's new scale: "decode, the FP32 step, encode", as on the CPU. A lane
// holds half the elements of an 8-bit lane, whose values and codes fit its registers: no
// park in shared memory. As for 8 bits (Note [8-bit CUDA registers]), the walk is kept per
// warp in shared memory (Note [Warp tile walk]), and the blocks the lanes cannot access
// directly go to a kernel of their own (adamw4_edge_kernel, element by element): a block
// shorter than kBlock4 (a tensor's last, or a row's last where rows are not whole blocks),
// or one whose elements, masters, remainders or codes are not aligned for the lanes' wide
// accesses. The whole, aligned blocks of rows that are not whole blocks (Note [4-bit row
// blocks]) take the lanes' wide accesses in a third kernel (adamw4_rows_kernel, Pass8): the
// rows and edge kernels ask block4_direct() of every block of such a tile, and all three
// of a flat tile's first block once. In the direct kernel, the rows' mapping cost every
// block 6 to 9 SASS per element (analyze.sh).

// The block at index kb of a tile: its first element in the tensor, that element's state
// index (masters, remainders, random bits), its first code's nibble, its scale in each
// moment's run, its elements. A tile of rows that are not whole blocks maps kb by its row
// (block4_at); kRows false: the caller knows the tile is flat.
struct Block4At {
  int64_t first, state, nibble, scale;
  int32_t n;
};

template <bool kRows = true>
__device__ inline Block4At block4_in(const UnitTile& tile, int32_t kb) {
  const volatile UnitTile& vt = tile;
  const int64_t off = vt.state0 - vt.first;  // the tensor's state offset
  const int64_t kc = vt.first + kb;          // the block's index in the tensor's walk
  if (!kRows || vt.row == 0) {
    const int64_t state = off + kc;  // never negative: an unsigned shift
    return {kc, state, state, static_cast<int64_t>(static_cast<uint64_t>(state) / kBlock4),
            min(static_cast<int32_t>(kBlock4), vt.count - kb)};
  }
  TensorEntry e{};
  e.row = vt.row;
  e.state_offset = off;
  e.scale_offset = vt.scale0;
  const Block4 blk = block4_at(e, kc, 0);
  return {blk.first, off + blk.first, blk.nibble, scale_index4(e, kc), static_cast<int32_t>(blk.n)};
}

// The codes of moment q (0 exp_avg, 1 exp_avg_sq, 2 max_exp_avg_sq) from nibble k (even).
__device__ inline uint8_t* codes4(const AdamWLaunch& L, int q, int64_t k) {
  void* base = q == 0 ? L.exp_avg : q == 1 ? L.exp_avg_sq : L.max_exp_avg_sq;
  return static_cast<uint8_t*>(base) + (static_cast<uint64_t>(k) >> 1);
}

// Whether the lanes access a block directly (Note [4-bit CUDA lanes]): whole, its elements
// (4 per lane), masters and remainders aligned for one access of 4, its codes for one
// 16-bit access per lane (from a nibble that is a multiple of 4).
template <typename P, typename G, bool AMSGRAD, bool REM>
__device__ inline bool block4_direct(const AdamWLaunch& L, const UnitTile& tile, const Block4At& b,
                                     bool has_master) {
  const volatile UnitTile& vt = tile;
  bool direct =
      b.n == static_cast<int32_t>(kBlock4) &&
      is_aligned<kPerLane4>(static_cast<const P*>(const_cast<void*>(vt.param)) + b.first) &&
      is_aligned<kPerLane4>(static_cast<const G*>(const_cast<const void*>(vt.grad)) + b.first) &&
      (!has_master || is_aligned<kPerLane4>(L.master + b.state)) &&
      (!REM || is_aligned<kPerLane4>(L.remainder + b.state)) && (b.nibble & 3) == 0;
  for (int q = 0; q < (AMSGRAD ? 3 : 2); ++q)
    direct = direct && is_aligned<1>(reinterpret_cast<const uint16_t*>(codes4(L, q, b.nibble)));
  return direct;
}

// One block stepped by a warp (Note [4-bit CUDA step]). kEdge: its n elements read and
// written one by one, zeros past its end (which step to zeros and change no maximum), and
// its codes byte by byte.
template <typename P, typename G, bool AMSGRAD, bool kEdge, bool REM, typename Ch>
__device__ inline void step_block4(const AdamWLaunch& L, const StepCoefs<float>& coefs,
                                   const Book4& book, const UnitTile& tile, const Block4At& b,
                                   const TileWalk<float>& walk, const Ch& ch) {
  constexpr int kMoments = AMSGRAD ? 3 : 2;
  // The key of the parameters' random bits (stochastic rounding): read once per block by the
  // direct and rows kernels, and at each use by the edge kernel (no register held for it).
  const volatile uint32_t& walk_key = static_cast<const volatile TileWalk<float>&>(walk).key;
  const uint32_t block_key = !kEdge && ch.stochastic ? walk_key : 0u;
  const auto key = [&] { return kEdge ? walk_key : block_key; };
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int k = kPerLane4 * lane;  // the lane's first element of the block
  const int n = b.n;
  const bool with_master = !REM && kIs16Bit<P> && ch.master;
  StepCoefs<float> c = coefs;
  c.l2_on = ch.l2;  // the direct kernels' constant: their element loop tests none of these
  const volatile UnitTile& vt = tile;
  P* p = static_cast<P*>(const_cast<void*>(vt.param)) + b.first + k;
  const G* g = static_cast<const G*>(const_cast<const void*>(vt.grad)) + b.first + k;
  float* master = with_master ? L.master + b.state + k : nullptr;
  uint16_t* rem = REM ? L.remainder + b.state + k : nullptr;
  // Read before lane 0 writes the new scales: each value feeds the warp's reduction below.
  float sc[3];
  sc[0] = L.exp_avg_scales[b.scale];                          // static-check: 32-bit (a scale)
  sc[1] = L.exp_avg_sq_scales[b.scale];                       // static-check: 32-bit (a scale)
  sc[2] = AMSGRAD ? L.max_exp_avg_sq_scales[b.scale] : 0.0f;  // static-check: 32-bit (a scale)
  uint32_t cw[3] = {0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < kMoments; ++q) {
    const uint8_t* codes = codes4(L, q, b.nibble);
    if constexpr (kEdge) {  // the block's codes byte by byte; nibbles past its end as 0
#pragma unroll
      for (int j = 0; j < kPerLane4; j += 2) {
        if (k + j < n) {
          const uint32_t byte = codes[(k + j) / 2];
          cw[q] |= (k + j + 1 < n ? byte : byte & 15u) << (4 * j);
        }
      }
    } else {
      cw[q] = __ldca(reinterpret_cast<const unsigned short*>(codes) + lane);
    }
  }
  float m[kPerLane4], v[kPerLane4], vm[kPerLane4];
  decode_lane4<Code4::kSigned, !kEdge>(cw[0], sc[0], book, m);
  decode_lane4<Code4::kUnsigned, !kEdge>(cw[1], sc[1], book, v);
  if (AMSGRAD) decode_lane4<Code4::kUnsigned, !kEdge>(cw[2], sc[2], book, vm);
  // The lane's parameters (16-bit: their bits), gradients, masters or remainders: loaded
  // with one access each (direct), or element by element inside the loop below (kEdge: a
  // value at a time, few registers), zeros past the block's end.
  float pv[kPerLane4], gv[kPerLane4], mv[kPerLane4];
  uint16_t bits[kPerLane4], low[kPerLane4];
  if constexpr (!kEdge) {
    if constexpr (kIs16Bit<P>) {
      load_bits16(reinterpret_cast<const uint16_t*>(p), bits);
      if (REM) load_bits16(rem, low);
      if (with_master) load_vec<kPerLane4>(master, mv);
    } else {
      load_vec<kPerLane4>(p, pv);
    }
    load_vec<kPerLane4>(g, gv);
  }
#pragma unroll
  for (int j = 0; j < kPerLane4; ++j) {
    const bool in = !kEdge || k + j < n;
    if constexpr (kEdge) {
      if constexpr (kIs16Bit<P>) {
        bits[j] = in ? reinterpret_cast<const uint16_t*>(p)[j] : 0;
        if (REM) low[j] = in ? rem[j] : 0;
        if (with_master) mv[j] = in ? master[j] : 0.0f;  // static-check: 32-bit (edges)
      } else {
        pv[j] = in ? p[j] : 0.0f;  // static-check: 32-bit (edges)
      }
      gv[j] = in ? to_float(g[j]) : 0.0f;  // static-check: 32-bit (edges)
    }
    float pk;
    if constexpr (REM) {
      pk = master_of_remainder(bits[j], low[j]);
    } else if constexpr (kIs16Bit<P>) {
      pk = with_master ? master_or_param<kIsHalf<P>>(mv[j], bits[j], widen<P>(bits[j]))
                       : widen<P>(bits[j]);
    } else {
      pk = pv[j];
    }
    adamw_element<AMSGRAD, DeviceOps, false>(pk, gv[j], m[j], v[j], vm[j], c);
    if constexpr (REM) {
      const uint32_t split = split_master(pk);
      bits[j] = static_cast<uint16_t>(split >> 16);
      low[j] = static_cast<uint16_t>(split);
    } else if constexpr (kIs16Bit<P>) {
      if (with_master) mv[j] = pk;
      pv[j] = pk;  // rounded below, a pair at a time
    } else {
      pv[j] = pk;
    }
    if constexpr (kEdge) {
      if (in) {
        if constexpr (REM) {
          reinterpret_cast<uint16_t*>(p)[j] = bits[j];
          rem[j] = low[j];
        } else if constexpr (kIs16Bit<P>) {
          if (with_master) master[j] = mv[j];
          reinterpret_cast<uint16_t*>(p)[j] =
              round_param<kIsHalf<P>>(pk, L.rounding, key(), b.state + k + j);
        } else {
          p[j] = pk;
        }
      }
    }
  }
  if constexpr (!kEdge) {
    if constexpr (REM) {
      store_bits16(reinterpret_cast<uint16_t*>(p), bits);
      store_bits16(rem, low);
    } else if constexpr (kIs16Bit<P>) {
      if (with_master) store_vec<kPerLane4>(master, mv);
      // The 16-bit parameters rounded a pair at a time (one conversion for the pair to
      // nearest; stochastically, each element's own random bits).
      uint32_t w[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (!kIsHalf<P> && ch.stochastic) {
          const int64_t at = b.state + k + 2 * h;
          w[h] = round_pair_stochastic_bf16(pv[2 * h], pv[2 * h + 1], rounding_bits(key(), at),
                                            rounding_bits(key(), at + 1));
        } else {
          w[h] = round_pair_nearest16<kIsHalf<P>>(pv[2 * h], pv[2 * h + 1]);
        }
      }
      __stwb(reinterpret_cast<uint2*>(p), make_uint2(w[0], w[1]));
    } else {
      store_vec<kPerLane4>(p, pv);
    }
  }
  uint32_t largest[3] = {0u, 0u, 0u};
  largest[0] = largest_of(m, kPerLane4, 0u);
  largest[1] = largest_of(v, kPerLane4, 0u);
  if (AMSGRAD) largest[2] = largest_of(vm, kPerLane4, 0u);
  uint32_t oc[3];
  sc[0] = lane_block_scale(m, kPerLane4, largest[0]);
  oc[0] = encode_lane4<Code4::kSigned>(m, sc[0]);
  sc[1] = lane_block_scale(v, kPerLane4, largest[1]);
  oc[1] = encode_lane4<Code4::kUnsigned>(v, sc[1]);
  if (AMSGRAD) {
    sc[2] = lane_block_scale(vm, kPerLane4, largest[2]);
    oc[2] = encode_lane4<Code4::kUnsigned>(vm, sc[2]);
  }
  if (lane == 0) {
    L.exp_avg_scales[b.scale] = sc[0];
    L.exp_avg_sq_scales[b.scale] = sc[1];
    if (AMSGRAD) L.max_exp_avg_sq_scales[b.scale] = sc[2];
  }
#pragma unroll
  for (int q = 0; q < kMoments; ++q) {
    uint8_t* codes = codes4(L, q, b.nibble);
    if constexpr (kEdge) {  // the block's bytes only (an odd block's last high nibble 0)
#pragma unroll
      for (int j = 0; j < kPerLane4; j += 2) {
        if (k + j < n) codes[(k + j) / 2] = static_cast<uint8_t>(oc[q] >> (4 * j));
      }
    } else {
      __stwb(reinterpret_cast<unsigned short*>(codes) + lane, static_cast<unsigned short>(oc[q]));
    }
  }
}

// The 4-bit step over a launch's tiles, one pass (Pass8, as for 8 bits): the whole blocks of
// flat tiles whose accesses are aligned for the lanes (adamw4_kernel), the whole, aligned
// blocks inside rows that are not whole blocks (adamw4_rows_kernel, where AdamWLaunch::rows),
// the others element by element (adamw4_edge_kernel); each a kernel of its own (Note [4-bit
// CUDA step]).
template <typename P, typename G, bool AMSGRAD, Pass8 kPass, bool REM, typename Ch>
__device__ inline void step_tiles4(const AdamWLaunch& L, const Ch& ch) {
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  __shared__ Book4 book;
  __shared__ TileWalk<float> walks[kWarps8];  // Note [Warp tile walk]
  __shared__ UnitTile tiles[kThreads8];
  __shared__ float consts[5];
  book.fill(static_cast<int>(threadIdx.x));  // before the walk's barrier
  const int warp = static_cast<int>(threadIdx.x / 32);
  TileWalk<float>& w = walks[warp];
  UnitTile& tile = tiles[threadIdx.x];
  const bool has_master = !REM && kIs16Bit<P> && ch.master;
  constexpr int32_t kBlock = static_cast<int32_t>(kBlock4);
  const double lr = learning_rate(L.hyper);  // a Tensor lr: one load
  start_warp_walk(L, w, consts);
  StepCoefs<float> c;
  while (next_warp_tile<4>(L, d, lr, w, tile, consts, c)) {
    const volatile UnitTile& vt = tile;
    if (kPass == Pass8::kRows && vt.row == 0) continue;  // a flat tile: the other kernels'
    // A flat tile's blocks share their alignment (each starts kBlock4 elements and 64 bytes
    // of codes after the last): the first block's, decided once, holds for its whole ones.
    bool flat = false;
    if (kPass != Pass8::kRows && vt.row == 0) {
      Block4At first = block4_in<false>(tile, 0);
      first.n = kBlock;
      flat = block4_direct<P, G, AMSGRAD, REM>(L, tile, first, has_master);
    }
    const int32_t whole = flat ? vt.count / kBlock * kBlock : 0;  // the blocks stepped directly
    if constexpr (kPass == Pass8::kDirect) {
      for (int32_t kb = warp * kBlock; kb < whole; kb += kWarps8 * kBlock) {
        step_block4<P, G, AMSGRAD, false, REM>(L, c, book, tile, block4_in<false>(tile, kb), w, ch);
      }
    } else {  // rows: their direct blocks; edges: the others
      for (int32_t kb = whole + warp * kBlock; kb < vt.count; kb += kWarps8 * kBlock) {
        const Block4At b = block4_in(tile, kb);
        const bool direct =
            vt.row != 0 && block4_direct<P, G, AMSGRAD, REM>(L, tile, b, has_master);
        if (direct != (kPass == Pass8::kRows)) continue;  // the other kernel's block
        step_block4<P, G, AMSGRAD, kPass == Pass8::kEdges, REM>(L, c, book, tile, b, w, ch);
      }
    }
  }
}

template <typename P, typename G, bool AMSGRAD, bool REM, bool kMaster, bool kStochastic, bool kL2>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw4_kernel(AdamWLaunch L) {
  step_tiles4<P, G, AMSGRAD, Pass8::kDirect, REM>(L, Choice8<kMaster, kStochastic, kL2>{});
}

template <typename P, typename G, bool AMSGRAD, bool REM, bool kMaster, bool kStochastic>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw4_rows_kernel(AdamWLaunch L) {
  step_tiles4<P, G, AMSGRAD, Pass8::kRows, REM>(L,
                                                ChoiceRows<kMaster, kStochastic>{choice8_of(L).l2});
}

template <typename P, typename G, bool AMSGRAD, bool REM>
__global__ void __launch_bounds__(kThreads8, kBlocksPerSm8) adamw4_edge_kernel(AdamWLaunch L) {
  step_tiles4<P, G, AMSGRAD, Pass8::kEdges, REM>(L, choice8_of(L));
}

struct Kernels4 {
  template <typename P, typename G, bool AMSGRAD, bool REM, bool kM, bool kS, bool kL2>
  static auto direct() {
    return adamw4_kernel<P, G, AMSGRAD, REM, kM, kS, kL2>;
  }
  template <typename P, typename G, bool AMSGRAD, bool REM, bool kM, bool kS>
  static auto rows() {
    return adamw4_rows_kernel<P, G, AMSGRAD, REM, kM, kS>;
  }
  template <typename P, typename G, bool AMSGRAD, bool REM>
  static auto edge() {
    return adamw4_edge_kernel<P, G, AMSGRAD, REM>;
  }
};

template <typename P, typename G, typename S, bool REM>
void launch_state(const AdamWLaunch& L, cudaStream_t stream) {
  const auto kernel =
      L.amsgrad ? adamw_kernel<P, G, S, true, REM> : adamw_kernel<P, G, S, false, REM>;
  const int64_t grid = std::min<int64_t>(L.n_units, max_resident_blocks(kernel, kThreads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kThreads, stream, L);
  RUDA_CUDA_CHECK_LAUNCH();
}

// The moments' storage type and the kind of master: remainder masters (BF16 parameters
// only, the binding checks) get kernels of their own.
template <typename P, typename G, typename S>
void launch_state_of(const AdamWLaunch& L, cudaStream_t stream) {
  if constexpr (std::is_same_v<P, __nv_bfloat16>) {
    if (L.remainder != nullptr) return launch_state<P, G, S, true>(L, stream);
  }
  launch_state<P, G, S, false>(L, stream);
}

// The moments' storage type: the math type, or BF16 (not for FP64 parameters: the binding
// refuses it).
template <typename P, typename G>
void launch(const AdamWLaunch& L, cudaStream_t stream) {
  if (L.n_units == 0) return;
  if constexpr (!std::is_same_v<P, double>) {
    if (L.state_dtype == DType::kBFloat16) return launch_state_of<P, G, __nv_bfloat16>(L, stream);
    if (L.state_dtype == DType::kUInt8) {
      if constexpr (std::is_same_v<P, __nv_bfloat16>) {
        if (L.remainder != nullptr) return launch_low_bit<Kernels8, P, G, true>(L, stream);
      }
      return launch_low_bit<Kernels8, P, G, false>(L, stream);
    }
    if (L.state_dtype == DType::kNibble) {
      if constexpr (std::is_same_v<P, __nv_bfloat16>) {
        if (L.remainder != nullptr) return launch_low_bit<Kernels4, P, G, true>(L, stream);
      }
      return launch_low_bit<Kernels4, P, G, false>(L, stream);
    }
  }
  launch_state_of<P, G, MathOf<P>>(L, stream);
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
    case DType::kUInt8:  // state dtypes, never a parameter's (the binding)
    case DType::kNibble:
      return;
  }
}

}  // namespace ruda
