// An emulated CUDA device: the kernels of csrc/cuda/*.cu compiled as host C++ and run on
// the CPU with CUDA's semantics where the kernels depend on them.
//
// Note [CUDA emulation]
// No GPU has run this project's CUDA kernels, and a CI machine never has one. The shared
// math headers make the per-element arithmetic the same on both backends, but what only
// the CUDA files do (the unit/tile decomposition, wide and scalar accesses, the tail
// loops, 16-bit bit packing, the step-advance launch, warp shuffles and shared-memory
// trees, the grid sizing) is tested here by running it:
// * The .cu sources compile unchanged as C++ with this folder first on the include path:
//   its cuda_runtime.h, cuda_fp16.h and cuda_bf16.h define the CUDA keywords away,
//   `__shared__` as `static` (one instance, used by one block at a time), the built-in
//   index variables as the running emulated thread's, the vector types, the load/store
//   and conversion intrinsics with the hardware's exact results, and the runtime calls
//   the launch code makes (an emulated device of kSimSms multiprocessors). Launches go
//   through ruda::launch_kernel (csrc/cuda/cuda_utils.cuh), `<<<...>>>` under nvcc.
// * Every CUDA thread of a block is an OS thread; blocks run one at a time (CUDA
//   promises no order between blocks: the tests run them first to last and last to
//   first, and require the same bits). Within a block, the scheduler decides who runs:
//   - kForward / kReverse: exactly one thread runs at a time, until it reaches a barrier
//     or ends; then the lowest (highest) runnable thread runs. A phase between two
//     barriers is so executed thread by thread in a fixed order, so a missing
//     __syncthreads() makes some thread read a value another has not written yet (or
//     already overwritten) in one of the two orders, and the results differ;
//   - kConcurrent: all threads run at once with std::barrier, for ThreadSanitizer, which
//     reports a shared-memory access that no barrier orders (tools/cuda_sim_check.sh).
//   `__syncthreads()` is a barrier of the block's threads, `__syncwarp()` one of the warp's
//   lanes; `__shfl_down_sync`, `__shfl_xor_sync` and `__reduce_max_sync` a warp exchange (each
//   lane publishes its value, the 32 lanes meet, each reads lane + delta, or all of them, they
//   meet again): what the kernels rely on (full-warp masks, warp-uniform calls).
// * Arithmetic is the host's IEEE FP32/FP64 without contraction (-ffp-contract=off):
//   what nvcc's --fmad=false -prec-div=true -prec-sqrt=true gives (Note [No FMA
//   contraction] in setup.py). FP16/BF16 conversions are integer operations on the bits.
// What the emulation cannot show: timing, occupancy, memory coalescing, the real
// allocator, streams and events, CUDA-graph capture, and what the hardware does that the
// model above does not (docs/building.md, "The CUDA emulation").
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#define RUDA_CUDA_SIM 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

// ---------------------------------------------------------------- types and intrinsics

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(8) uint2 {
  uint32_t x, y;
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// Cache-hinted loads and stores: plain accesses of the whole object.
template <typename T>
inline T __ldca(const T* p) {
  return *p;
}
template <typename T>
inline void __stwb(T* p, T v) {
  *p = v;
}

inline uint32_t __float_as_uint(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}
inline float __uint_as_float(uint32_t b) {
  float x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// __byte_perm(x, y, s): byte n of the result is byte s[4n+2 : 4n] of the 8 bytes {y, x}
// (x the low 4): CUDA's intrinsic reads 3 bits of each selector nibble (nvcc folds
// __byte_perm(x, 0, 0x9180) into __byte_perm(x, 0, 0x1100)).
inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    r |= static_cast<uint32_t>((v >> (8 * ((s >> (4 * n)) & 7u))) & 0xFFu) << (8 * n);
  }
  return r;
}

namespace ruda_sim {
// prmt.b32 in its default mode, all 4 bits of each selector nibble: where s[4n+3] is set,
// byte n of the result is the selected byte's sign bit in all 8 bits (what __byte_perm drops).
inline uint32_t prmt_msb(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t nibble = (s >> (4 * n)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>((v >> (8 * (nibble & 7u))) & 0xFFu);
    if ((nibble & 8u) != 0) byte = (byte & 0x80u) != 0 ? 0xFFu : 0u;
    r |= byte << (8 * n);
  }
  return r;
}
}  // namespace ruda_sim

// __vminu2, __vmaxu2: the minimum and maximum of the two unsigned 16-bit halves, half by half.
inline uint32_t __vminu2(uint32_t a, uint32_t b) {
  return std::min(a & 0xFFFFu, b & 0xFFFFu) | (std::min(a >> 16, b >> 16) << 16);
}
inline uint32_t __vmaxu2(uint32_t a, uint32_t b) {
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | (std::max(a >> 16, b >> 16) << 16);
}
inline double __longlong_as_double(long long b) {
  double x;
  std::memcpy(&x, &b, sizeof(x));
  return x;
}

// CUDA's min/max overloads of device code (integers and floats).
template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

// ---------------------------------------------------------------- the runtime

using cudaStream_t = void*;
enum cudaError_t { cudaSuccess = 0 };
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };
inline const char* cudaGetErrorString(cudaError_t) { return "no error (emulated device)"; }
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}

namespace ruda_sim {

// The emulated device: few multiprocessors, so that the kernels' grid-stride loops run
// more than one unit per block in the tests.
constexpr int kSimSms = 2;
constexpr int kSimBlocksPerSm = 2;
constexpr int kWarp = 32;

enum class Schedule { kForward, kReverse, kConcurrent };

struct Block;
struct ThreadCtx {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
  Block* block = nullptr;
  int tid = 0;
};
inline thread_local ThreadCtx* current = nullptr;

inline ThreadCtx& ctx() {
  if (current == nullptr) throw std::logic_error("CUDA built-in used outside an emulated kernel");
  return *current;
}

// One block's threads and the scheduler of Note [CUDA emulation].
struct Block {
  Schedule schedule;
  int n;
  std::vector<float> slots;  // one per thread: the warp exchange of __shfl_down_sync
  // Serial schedules: the thread holding the token runs; the others wait.
  std::mutex mutex;
  std::vector<std::unique_ptr<std::condition_variable>> wake;
  int token = -1;
  enum State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };
  std::vector<State> state;
  int at_block = 0, done = 0;
  std::vector<int> at_warp;
  // Concurrent schedule.
  std::unique_ptr<std::barrier<>> block_barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;

  Block(Schedule s, int threads)
      : schedule(s), n(threads), slots(threads), state(threads, kRunnable) {
    const int warps = (threads + kWarp - 1) / kWarp;
    at_warp.assign(warps, 0);
    if (s == Schedule::kConcurrent) {
      block_barrier = std::make_unique<std::barrier<>>(threads);
      for (int w = 0; w < warps; ++w) {
        warp_barriers.push_back(std::make_unique<std::barrier<>>(warp_size(w)));
      }
    } else {
      for (int i = 0; i < threads; ++i) wake.push_back(std::make_unique<std::condition_variable>());
    }
  }

  int warp_size(int w) const { return std::min(kWarp, n - w * kWarp); }

  // The next thread to run (lowest or highest runnable), or -1; mutex held.
  int next_runnable() const {
    if (schedule == Schedule::kForward) {
      for (int i = 0; i < n; ++i)
        if (state[i] == kRunnable) return i;
    } else {
      for (int i = n - 1; i >= 0; --i)
        if (state[i] == kRunnable) return i;
    }
    return -1;
  }

  // Hands the token on and waits until this thread holds it again; mutex held by `lock`.
  void pass_and_wait(int me, std::unique_lock<std::mutex>& lock) {
    token = next_runnable();
    if (token < 0) throw std::logic_error("emulated block deadlocked: no runnable thread");
    if (token != me) {
      wake[token]->notify_one();
      wake[me]->wait(lock, [&] { return token == me; });
    }
  }

  // When every thread that has not ended waits at the block barrier, all go on; mutex held.
  void release_block_if_complete() {
    if (at_block == 0 || at_block + done != n) return;
    at_block = 0;
    for (int i = 0; i < n; ++i)
      if (state[i] == kAtBlockBarrier) state[i] = kRunnable;
  }

  void wait_for_start(int me) {
    std::unique_lock<std::mutex> lock(mutex);
    wake[me]->wait(lock, [&] { return token == me; });
  }

  void sync_block(int me) {
    if (schedule == Schedule::kConcurrent) {
      block_barrier->arrive_and_wait();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex);
    state[me] = kAtBlockBarrier;
    ++at_block;
    release_block_if_complete();
    pass_and_wait(me, lock);
  }

  void sync_warp(int me) {
    const int w = me / kWarp;
    if (schedule == Schedule::kConcurrent) {
      warp_barriers[w]->arrive_and_wait();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex);
    state[me] = kAtWarpBarrier;
    if (++at_warp[w] == warp_size(w)) {
      at_warp[w] = 0;
      for (int i = w * kWarp; i < w * kWarp + warp_size(w); ++i) state[i] = kRunnable;
    }
    pass_and_wait(me, lock);
  }

  void finish(int me) {
    if (schedule == Schedule::kConcurrent) {
      block_barrier->arrive_and_drop();
      return;
    }
    std::unique_lock<std::mutex> lock(mutex);
    state[me] = kDone;
    ++done;
    release_block_if_complete();  // the others may wait at a block barrier
    token = next_runnable();
    if (token >= 0) wake[token]->notify_one();
  }
};

inline Schedule& schedule() {
  static Schedule s = Schedule::kForward;
  return s;
}

// Runs `body` as a grid of `grid` blocks of `threads` threads (x dimension only, what
// the kernels use). Blocks run one at a time, first to last (kForward, kConcurrent) or
// last to first (kReverse).
inline void launch(unsigned grid, unsigned threads, const std::function<void()>& body) {
  if (grid == 0 || threads == 0) return;
  const Schedule s = schedule();
  for (unsigned k = 0; k < grid; ++k) {
    const unsigned b = s == Schedule::kReverse ? grid - 1 - k : k;
    Block block(s, static_cast<int>(threads));
    std::vector<std::thread> pool;
    std::vector<ThreadCtx> contexts(threads);
    std::exception_ptr failure;
    std::mutex failure_mutex;
    pool.reserve(threads);
    for (unsigned t = 0; t < threads; ++t) {
      ThreadCtx& c = contexts[t];
      c.thread_idx = dim3(t);
      c.block_idx = dim3(b);
      c.block_dim = dim3(threads);
      c.grid_dim = dim3(grid);
      c.block = &block;
      c.tid = static_cast<int>(t);
      pool.emplace_back([&block, &c, &body, &failure, &failure_mutex, s] {
        current = &c;
        if (s != Schedule::kConcurrent) block.wait_for_start(c.tid);
        try {
          body();
        } catch (...) {
          const std::lock_guard<std::mutex> lock(failure_mutex);
          if (!failure) failure = std::current_exception();
        }
        block.finish(c.tid);
        current = nullptr;
      });
    }
    if (s != Schedule::kConcurrent) {
      std::unique_lock<std::mutex> lock(block.mutex);
      block.token = block.next_runnable();
      block.wake[block.token]->notify_one();
    }
    for (auto& th : pool) th.join();
    if (failure) std::rethrow_exception(failure);
  }
}

// A warp exchange: each lane publishes v, the lanes meet, `read` makes each lane's result
// from the warp's published values (its first slot, the warp's size, the lane, the lane's
// own v), and they meet again.
template <typename T, typename Read>
inline T exchange(T v, Read read) {
  static_assert(sizeof(T) == sizeof(float), "the kernels exchange 32-bit values");
  ThreadCtx& c = ctx();
  Block& b = *c.block;
  float bits;
  std::memcpy(&bits, &v, sizeof(bits));
  b.slots[c.tid] = bits;
  b.sync_warp(c.tid);
  const int lane = c.tid % kWarp;
  const T out = read(&b.slots[c.tid - lane], b.warp_size(c.tid / kWarp), lane, v);
  b.sync_warp(c.tid);
  return out;
}

// A shuffle: the value of lane source(lane), or the lane's own where that is past the warp
// (as the hardware returns it).
template <typename T, typename Source>
inline T shfl(T v, Source source) {
  return exchange(v, [&source](const float* warp, int n, int lane, T own) {
    const int from = source(lane);
    T out = own;
    if (from >= 0 && from < n) std::memcpy(&out, &warp[from], sizeof(out));
    return out;
  });
}

// __shfl_down_sync: lane + delta's value.
template <typename T>
inline T shfl_down(T v, unsigned delta) {
  return shfl(v, [delta](int lane) { return lane + static_cast<int>(delta); });
}

// __shfl_xor_sync: lane ^ mask's value (the butterfly of an all-lanes reduction).
template <typename T>
inline T shfl_xor(T v, unsigned lane_mask) {
  return shfl(v, [lane_mask](int lane) { return lane ^ static_cast<int>(lane_mask); });
}

// __reduce_max_sync (redux.sync.max.u32): the largest value of the warp's lanes, in every
// lane.
inline uint32_t reduce_max(uint32_t v) {
  return exchange(v, [](const float* warp, int n, int, uint32_t) {
    uint32_t out = 0u;
    for (int i = 0; i < n; ++i) {
      uint32_t x;
      std::memcpy(&x, &warp[i], sizeof(x));
      out = std::max(out, x);
    }
    return out;
  });
}

}  // namespace ruda_sim

#define threadIdx (::ruda_sim::ctx().thread_idx)
#define blockIdx (::ruda_sim::ctx().block_idx)
#define blockDim (::ruda_sim::ctx().block_dim)
#define gridDim (::ruda_sim::ctx().grid_dim)

inline void __syncthreads() {
  ::ruda_sim::ThreadCtx& c = ::ruda_sim::ctx();
  c.block->sync_block(c.tid);
}

// __syncwarp: the 32 lanes of the running thread's warp meet (full warps: what the kernels
// use, around the shared-memory stages of Note [8-bit CUDA lanes]).
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) throw std::logic_error("the emulation syncs full warps only");
  ::ruda_sim::ThreadCtx& c = ::ruda_sim::ctx();
  c.block->sync_warp(c.tid);
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
  if (mask != 0xffffffffu) throw std::logic_error("the emulation shuffles full warps only");
  return ::ruda_sim::shfl_down(v, delta);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, unsigned lane_mask) {
  if (mask != 0xffffffffu) throw std::logic_error("the emulation shuffles full warps only");
  return ::ruda_sim::shfl_xor(v, lane_mask);
}

inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  if (mask != 0xffffffffu) throw std::logic_error("the emulation reduces full warps only");
  return ::ruda_sim::reduce_max(v);
}

inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  *value = attr == cudaDevAttrMultiProcessorCount ? ::ruda_sim::kSimSms : 0;
  return cudaSuccess;
}

template <typename Kernel>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = ::ruda_sim::kSimBlocksPerSm;
  return cudaSuccess;
}
