// CUDA kernels of quantize_8bit and dequantize_8bit (Note [8-bit moments] in
// csrc/quant8.h): a warp codes a block (store_block8, csrc/cuda/cuda_utils.cuh); decoding
// is an element per thread.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int kQuant8Threads = 256;
constexpr int kQuant8Warps = kQuant8Threads / 32;

// A warp per block (store_block8 in cuda_utils.cuh).
template <Code8 kCode>
__global__ void quantize8_kernel(const float* x, uint8_t* codes, float* scales, int64_t n) {
  const int64_t warps = int64_t(gridDim.x) * kQuant8Warps;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  for (int64_t b = blockIdx.x * int64_t(kQuant8Warps) + threadIdx.x / 32; b < blocks; b += warps) {
    const int64_t kb = b * kBlock8;
    float values[kPerLane8];
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) {
      const int64_t k = kb + lane + 32 * j;
      values[j] = k < n ? x[k] : 0.0f;
    }
    store_block8<kCode>(values, kb, n, codes, scales + b);
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

// `per_block`: blocks of the code that one block of threads takes at a time.
template <typename Kernel, typename... Args>
void launch_quant8(Kernel kernel, int64_t per_block, int64_t n, void* stream, const Args&... args) {
  const int64_t blocks = (n + kBlock8 * per_block - 1) / (kBlock8 * per_block);
  const int64_t grid = std::min<int64_t>(blocks, max_resident_blocks(kernel, kQuant8Threads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kQuant8Threads,
                static_cast<cudaStream_t>(stream), args..., n);
  RUDA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_8bit_cuda(const Quant8Launch& L, void* stream) {
  if (static_cast<Code8>(L.code) == Code8::kSigned) {
    launch_quant8(quantize8_kernel<Code8::kSigned>, kQuant8Warps, L.n, stream, L.x, L.codes,
                  L.scales);
  } else {
    launch_quant8(quantize8_kernel<Code8::kUnsigned>, kQuant8Warps, L.n, stream, L.x, L.codes,
                  L.scales);
  }
}

void dequantize_8bit_cuda(const Quant8Launch& L, void* stream) {
  const uint8_t* codes = L.codes;
  const float* scales = L.scales;
  if (static_cast<Code8>(L.code) == Code8::kSigned) {
    launch_quant8(dequantize8_kernel<Code8::kSigned>, 1, L.n, stream, codes, scales, L.out);
  } else {
    launch_quant8(dequantize8_kernel<Code8::kUnsigned>, 1, L.n, stream, codes, scales, L.out);
  }
}

}  // namespace ruda
