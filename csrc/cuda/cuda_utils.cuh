// Small CUDA helpers shared by the kernels: conversions, vector accesses, grid sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "quant8.h"

#define RUDA_CUDA_CHECK(expr)                               \
  do {                                                      \
    cudaError_t err_ = (expr);                              \
    TORCH_CHECK(err_ == cudaSuccess, "ruda_torch: ", #expr, \
                " failed: ", cudaGetErrorString(err_));     \
  } while (0)

#define RUDA_CUDA_CHECK_LAUNCH()                                                      \
  do {                                                                                \
    cudaError_t err_ = cudaGetLastError();                                            \
    TORCH_CHECK(err_ == cudaSuccess,                                                  \
                "ruda_torch: CUDA kernel launch failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace ruda {

// Exact conversions to FP32 (every FP16 and BF16 value is representable).
__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int N, typename T>
__device__ inline bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (N * sizeof(T)) == 0;
}

// Four 16-bit values with one 8-byte global load / store (caller checked alignment). A
// plain struct of four uint16_t compiles to a generic-space load and to four 2-byte
// stores; the cache intrinsics on uint2 keep each one instruction (tests/test_cuda_ptx.py).
__device__ inline void load_bits16(const uint16_t* p, uint16_t* out) {
  const uint2 v = __ldca(reinterpret_cast<const uint2*>(p));
  out[0] = static_cast<uint16_t>(v.x & 0xFFFFu);
  out[1] = static_cast<uint16_t>(v.x >> 16);
  out[2] = static_cast<uint16_t>(v.y & 0xFFFFu);
  out[3] = static_cast<uint16_t>(v.y >> 16);
}

__device__ inline void store_bits16(uint16_t* p, const uint16_t* in) {
  const uint2 v = make_uint2(static_cast<uint32_t>(in[0]) | (static_cast<uint32_t>(in[1]) << 16),
                             static_cast<uint32_t>(in[2]) | (static_cast<uint32_t>(in[3]) << 16));
  __stwb(reinterpret_cast<uint2*>(p), v);
}

template <typename T>
__device__ inline T bits_as(uint16_t b);
template <>
__device__ inline __half bits_as<__half>(uint16_t b) {
  return __ushort_as_half(b);
}
template <>
__device__ inline __nv_bfloat16 bits_as<__nv_bfloat16>(uint16_t b) {
  return __ushort_as_bfloat16(b);
}

// N consecutive elements converted to FP32, with one wide load (caller checked alignment).
// Four FP32 values go through the load intrinsic: like a plain float4 store, a plain
// aligned struct load is not always kept whole (ld.global.v4.f32) by the compiler.
template <int N, typename T>
__device__ inline void load_vec(const T* p, float* out) {
  if constexpr (N == 4 && std::is_same_v<T, float>) {
    const float4 v = __ldca(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else if constexpr (N == 4 && sizeof(T) == 2) {  // FP16/BF16: one 8-byte global load
    uint16_t bits[4];
    load_bits16(reinterpret_cast<const uint16_t*>(p), bits);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = to_float(bits_as<T>(bits[j]));
  } else {
    struct alignas(N * sizeof(T)) Pack {
      T v[N];
    };
    const Pack pack = *reinterpret_cast<const Pack*>(p);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(pack.v[j]);
  }
}

// N consecutive FP32 values with one wide store (caller checked alignment). For N = 4 a
// plain float4 assignment is split into four 32-bit stores in the update kernel; the store
// intrinsic gives one st.global.wb.v4.f32 (write-back, the default cache policy: the
// parameters and moments are read again at the next step). tests/test_cuda_ptx.py checks
// the PTX.
template <int N>
__device__ inline void store_vec(float* p, const float* in) {
  if constexpr (N == 4) {
    __stwb(reinterpret_cast<float4*>(p), make_float4(in[0], in[1], in[2], in[3]));
  } else {
    struct alignas(N * sizeof(float)) Pack {
      float v[N];
    };
    Pack pack;
#pragma unroll
    for (int j = 0; j < N; ++j) pack.v[j] = in[j];
    *reinterpret_cast<Pack*>(p) = pack;
  }
}

// Launches `kernel` as `grid` blocks of `threads` threads on `stream`: `<<<...>>>` under
// nvcc; on the emulated device when the kernels are built as host C++ for the tests (Note
// [CUDA emulation] in csrc/cuda_sim/cuda_sim.h). Every launch of csrc/cuda goes through it.
// Note [8-bit moments] in csrc/quant8.h, on the GPU: one warp codes one block of kBlock8
// elements, lane l holding elements l, l + 32, ... (kPerLane8 of them, coalesced), so that
// the block's scale is a butterfly of shuffles (every lane gets it) and no barrier or
// shared memory is needed. The maximum is of the magnitudes' bits: any order gives the
// CPU kernels' scale.
constexpr int kPerLane8 = static_cast<int>(kBlock8) / 32;

__device__ inline uint32_t warp_largest(uint32_t bits) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, bits, s);
    bits = other > bits ? other : bits;
  }
  return bits;
}

// The warp's block at `kb` (elements before `end` only) coded from x[j] = element
// kb + lane + 32 j: its bytes into codes[k], its scale into *scale (by lane 0).
template <Code8 kCode>
__device__ inline void store_block8(const float* x, int64_t kb, int64_t end, uint8_t* codes,
                                    float* scale) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  uint32_t largest = 0;
#pragma unroll
  for (int j = 0; j < kPerLane8; ++j) {
    const uint32_t m = kb + lane + 32 * j < end ? magnitude_bits(x[j]) : 0u;
    largest = m > largest ? m : largest;
  }
  const float s = block_scale(warp_largest(largest));
  if (lane == 0) *scale = s;
  const float inverse = block_inverse(s);
#pragma unroll
  for (int j = 0; j < kPerLane8; ++j) {
    const int64_t k = kb + lane + 32 * j;
    if (k < end) codes[k] = s > 0.0f ? encode8<kCode>(x[j] * inverse) : 0;
  }
}

template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), unsigned grid, unsigned threads,
                          cudaStream_t stream, const Args&... args) {
#ifdef RUDA_CUDA_SIM
  (void)stream;
  ::ruda_sim::launch(grid, threads, [&] { kernel(args...); });
#else
  kernel<<<grid, threads, 0, stream>>>(args...);
#endif
}

// Enough blocks of `kernel` to fill the current device in one wave: SM count x the blocks
// that fit on one SM at `threads_per_block`, as the kernel's registers and shared memory
// allow (cudaOccupancyMaxActiveBlocksPerMultiprocessor; 2048 / threads would assume no
// register limit, and the update kernels' 47-48 registers fit 5 blocks of 256, not 8).
// The kernels loop over their work units, so a larger grid would only add a ragged
// tail. Cached per (kernel, device): the query is not free and the answer never changes.
template <typename Kernel>
inline int64_t max_resident_blocks(Kernel kernel, int threads_per_block) {
  int device = 0;
  RUDA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> cache;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto hit = cache.find(key);
  if (hit != cache.end()) return hit->second;
  int sms = 0, per_sm = 0;
  RUDA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  RUDA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads_per_block, 0));
  const int64_t blocks = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  cache.emplace(key, blocks);
  return blocks;
}

}  // namespace ruda
