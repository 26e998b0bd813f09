// Small CUDA helpers shared by the kernels: conversions, vector accesses, grid sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <cstdint>

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

// N consecutive elements converted to FP32, with one wide load (caller checked alignment).
template <int N, typename T>
__device__ inline void load_vec(const T* p, float* out) {
  struct alignas(N * sizeof(T)) Pack {
    T v[N];
  };
  const Pack pack = *reinterpret_cast<const Pack*>(p);
#pragma unroll
  for (int j = 0; j < N; ++j) out[j] = to_float(pack.v[j]);
}

template <int N>
__device__ inline void store_vec(float* p, const float* in) {
  struct alignas(N * sizeof(float)) Pack {
    float v[N];
  };
  Pack pack;
#pragma unroll
  for (int j = 0; j < N; ++j) pack.v[j] = in[j];
  *reinterpret_cast<Pack*>(p) = pack;
}

// Enough blocks to fill the current device (SM count x resident blocks per SM); the
// kernels loop over their work units, so a larger grid would only add scheduling.
inline int64_t max_resident_blocks(int threads_per_block) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  return static_cast<int64_t>(sms > 0 ? sms : 1) * (2048 / threads_per_block);
}

}  // namespace ruda
