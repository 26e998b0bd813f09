// CUDA kernels of quantize_8bit and dequantize_8bit (Note [8-bit moments] in
// csrc/quant8.h): a warp codes or decodes a block (Note [8-bit CUDA lanes] in
// csrc/cuda/cuda_utils.cuh).
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int kQuant8Threads = 256;
constexpr int kQuant8Warps = kQuant8Threads / 32;

// A warp per block, lane l its elements 8 l .. 8 l + 7 (Note [8-bit CUDA lanes] in
// cuda_utils.cuh): the last, shorter block and the blocks of a view that is not 16-byte
// aligned go through shared memory.
// A warp's block staged in shared memory: its values, then its codes.
struct Quant8Stage {
  alignas(16) float values[kBlock8];
  alignas(16) uint8_t codes[kBlock8];
};

template <Code8 kCode>
__global__ void __launch_bounds__(kQuant8Threads)
    quantize8_kernel(const float* x, uint8_t* codes, float* scales, int64_t n) {
  __shared__ Quant8Stage stages[kQuant8Warps];
  const int64_t warps = int64_t(gridDim.x) * kQuant8Warps;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  const bool direct = is_aligned<4>(x) && is_aligned<8>(codes);
  for (int64_t b = blockIdx.x * int64_t(kQuant8Warps) + warp; b < blocks; b += warps) {
    const int64_t kb = b * kBlock8;
    const int count = static_cast<int>(min(kBlock8, n - kb));
    const bool whole = direct && count == kBlock8;
    uint32_t words[kPerLane8];
    if (whole) {
      load_words8<float, true>(x + kb + 8 * lane, words);
    } else {
      stage_copy(stages[warp].values, x + kb, count, lane, true);
      __syncwarp();
      load_words8<float, false>(stages[warp].values + 8 * lane, words);
    }
    float values[kPerLane8];
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) values[j] = __uint_as_float(words[j]);
    const float scale = lane_block_scale(values, kPerLane8, largest_of(values, kPerLane8, 0u));
    const uint2 c = encode_lane8<kCode>(values, scale);
    if (lane == 0) scales[b] = scale;
    if (whole) {
      __stwb(reinterpret_cast<uint2*>(codes + kb + 8 * lane), c);
    } else {  // the block's count codes only
      *reinterpret_cast<uint2*>(stages[warp].codes + 8 * lane) = c;
      __syncwarp();
      stage_copy(codes + kb, stages[warp].codes, count, lane, false);
      __syncwarp();  // the stages are read before the warp's next block writes them
    }
  }
}

// A warp per block as quantize8_kernel (lane l its elements 8 l .. 8 l + 7), decoded by
// decode_lane8, the update kernel's decoder (Note [8-bit CUDA decode] in cuda_utils.cuh):
// tests/test_cuda_sim.py decodes every code under every kind of scale through it.
template <Code8 kCode>
__global__ void __launch_bounds__(kQuant8Threads)
    dequantize8_kernel(const uint8_t* codes, const float* scales, float* out, int64_t n) {
  __shared__ Quant8Stage stages[kQuant8Warps];
  const int64_t warps = int64_t(gridDim.x) * kQuant8Warps;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int64_t blocks = (n + kBlock8 - 1) / kBlock8;
  const bool direct = is_aligned<8>(codes) && is_aligned<4>(out);
  for (int64_t b = blockIdx.x * int64_t(kQuant8Warps) + warp; b < blocks; b += warps) {
    const int64_t kb = b * kBlock8;
    const int count = static_cast<int>(min(kBlock8, n - kb));
    const bool whole = direct && count == kBlock8;
    uint2 c;
    if (whole) {
      c = __ldca(reinterpret_cast<const uint2*>(codes + kb + 8 * lane));
    } else {  // zeros past the block's end (decoded, never written)
      stage_copy(stages[warp].codes, codes + kb, count, lane, true);
      __syncwarp();
      c = *reinterpret_cast<const uint2*>(stages[warp].codes + 8 * lane);
    }
    float x[kPerLane8];
    decode_lane8<kCode>(c, scales[b], x);  // static-check: 32-bit (a block's scale)
    uint32_t words[kPerLane8];
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) words[j] = __float_as_uint(x[j]);
    if (whole) {
      store_words8<float, true>(out + kb + 8 * lane, words);
    } else {
      store_words8<float, false>(stages[warp].values + 8 * lane, words);
      __syncwarp();
      stage_copy(out + kb, stages[warp].values, count, lane, false);
      __syncwarp();  // the stages are read before the warp's next block writes them
    }
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
    launch_quant8(dequantize8_kernel<Code8::kSigned>, kQuant8Warps, L.n, stream, codes, scales,
                  L.out);
  } else {
    launch_quant8(dequantize8_kernel<Code8::kUnsigned>, kQuant8Warps, L.n, stream, codes, scales,
                  L.out);
  }
}

}  // namespace ruda
