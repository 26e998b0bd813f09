// CUDA kernels of quantize_8bit and dequantize_8bit (Note [8-bit moments] in
// csrc/quant8.h): one block of kBlock8 threads per block of the code, an element per
// thread; the scale is the maximum of the magnitudes' bits (warp shuffles, then the
// warps' results in shared memory), which any order reduces to the CPU kernels' bits.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int kQuant8Threads = static_cast<int>(kBlock8);
constexpr int kQuant8Warps = kQuant8Threads / 32;

template <Code8 kCode>
__global__ void quantize8_kernel(const float* x, uint8_t* codes, float* scales, int64_t n) {
  __shared__ uint32_t s_largest[kQuant8Warps];
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t k = b * kBlock8 + threadIdx.x;
    const float value = k < n ? x[k] : 0.0f;
    uint32_t largest = magnitude_bits(value);
#pragma unroll
    for (int s = 16; s > 0; s >>= 1) {
      const uint32_t other = __shfl_down_sync(0xffffffffu, largest, s);
      largest = other > largest ? other : largest;
    }
    if (threadIdx.x % 32 == 0) s_largest[threadIdx.x / 32] = largest;
    __syncthreads();
    uint32_t all = 0;
    for (int w = 0; w < kQuant8Warps; ++w) all = s_largest[w] > all ? s_largest[w] : all;
    const float scale = block_scale(all);
    if (threadIdx.x == 0) scales[b] = scale;
    if (k < n) codes[k] = scale > 0.0f ? encode8<kCode>(value * block_inverse(scale)) : 0;
    __syncthreads();  // s_largest is the next block's
  }
}

template <Code8 kCode>
__global__ void dequantize8_kernel(const uint8_t* codes, const float* scales, float* out,
                                   int64_t n) {
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  for (int64_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const int64_t k = b * kBlock8 + threadIdx.x;
    if (k < n) out[k] = dequantize8<kCode>(codes[k], scales[b]);
  }
}

template <typename Kernel, typename... Args>
void launch_quant8(Kernel kernel, int64_t n, void* stream, const Args&... args) {
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  const int64_t grid = std::min<int64_t>(blocks, max_resident_blocks(kernel, kQuant8Threads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kQuant8Threads,
                static_cast<cudaStream_t>(stream), args..., n);
  RUDA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_8bit_cuda(const Quant8Launch& L, void* stream) {
  if (static_cast<Code8>(L.code) == Code8::kSigned) {
    launch_quant8(quantize8_kernel<Code8::kSigned>, L.n, stream, L.x, L.codes, L.scales);
  } else {
    launch_quant8(quantize8_kernel<Code8::kUnsigned>, L.n, stream, L.x, L.codes, L.scales);
  }
}

void dequantize_8bit_cuda(const Quant8Launch& L, void* stream) {
  const uint8_t* codes = L.codes;
  const float* scales = L.scales;
  if (static_cast<Code8>(L.code) == Code8::kSigned) {
    launch_quant8(dequantize8_kernel<Code8::kSigned>, L.n, stream, codes, scales, L.out);
  } else {
    launch_quant8(dequantize8_kernel<Code8::kUnsigned>, L.n, stream, codes, scales, L.out);
  }
}

}  // namespace ruda
