// CUDA kernels of quantize_4bit and dequantize_4bit (Note [4-bit moments] in
// csrc/quant4.h): a warp codes or decodes a block of kBlock4 (Note [4-bit CUDA lanes] in
// csrc/cuda/quant4_lanes.cuh), with the update kernels' lane codec.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_utils.cuh"
#include "kernels.h"
#include "quant4.h"
#include "quant4_lanes.cuh"

namespace ruda {
namespace {

constexpr int kQuant4Threads = 256;
constexpr int kQuant4Warps = kQuant4Threads / 32;

// A warp per block, lane l its elements 4 l .. 4 l + 3: a whole block of a 16-byte aligned
// x with 2-byte aligned codes in one access each; the last, shorter block (and every block
// of an unaligned view) element by element, zeros past its end (which code to 0: an odd
// block's last high nibble is 0, as the CPU writes it).
template <Code4 kCode>
__global__ void __launch_bounds__(kQuant4Threads)
    quantize4_kernel(const float* x, uint8_t* codes, float* scales, int64_t n) {
  const int64_t warps = int64_t(gridDim.x) * kQuant4Warps;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int k = kPerLane4 * lane;
  const int64_t blocks = (n + kBlock4 - 1) / kBlock4;
  const bool direct = is_aligned<kPerLane4>(x) && is_aligned<1>(reinterpret_cast<uint16_t*>(codes));
  for (int64_t b = blockIdx.x * int64_t(kQuant4Warps) + warp; b < blocks; b += warps) {
    const int64_t kb = b * kBlock4;
    const int count = static_cast<int>(min(kBlock4, n - kb));
    const bool whole = direct && count == kBlock4;
    float v[kPerLane4];
    if (whole) {
      load_vec<kPerLane4>(x + kb + k, v);
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane4; ++j) {
        v[j] = k + j < count ? x[kb + k + j] : 0.0f;  // static-check: 32-bit (a short block)
      }
    }
    const float scale = lane_block_scale(v, kPerLane4, largest_of(v, kPerLane4, 0u));
    const uint32_t c = encode_lane4<kCode>(v, scale);
    if (lane == 0) scales[b] = scale;
    uint8_t* out = codes + kb / 2;
    if (whole) {
      __stwb(reinterpret_cast<unsigned short*>(out) + lane, static_cast<unsigned short>(c));
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane4; j += 2) {
        if (k + j < count) out[(k + j) / 2] = static_cast<uint8_t>(c >> (4 * j));
      }
    }
  }
}

// A warp per block as quantize4_kernel, decoded by decode_lane4, the update kernels'
// decoder: tests/test_cuda_sim.py decodes every code under every kind of scale through it.
template <Code4 kCode>
__global__ void __launch_bounds__(kQuant4Threads)
    dequantize4_kernel(const uint8_t* codes, const float* scales, float* out, int64_t n) {
  __shared__ Book4 book;
  book.fill(static_cast<int>(threadIdx.x));
  __syncthreads();
  const int64_t warps = int64_t(gridDim.x) * kQuant4Warps;
  const int warp = static_cast<int>(threadIdx.x / 32), lane = static_cast<int>(threadIdx.x % 32);
  const int k = kPerLane4 * lane;
  const int64_t blocks = (n + kBlock4 - 1) / kBlock4;
  const bool direct = is_aligned<1>(reinterpret_cast<const uint16_t*>(codes)) && is_aligned<4>(out);
  for (int64_t b = blockIdx.x * int64_t(kQuant4Warps) + warp; b < blocks; b += warps) {
    const int64_t kb = b * kBlock4;
    const int count = static_cast<int>(min(kBlock4, n - kb));
    const bool whole = direct && count == kBlock4;
    const uint8_t* in = codes + kb / 2;
    uint32_t c = 0u;
    if (whole) {
      c = __ldca(reinterpret_cast<const unsigned short*>(in) + lane);
    } else {  // the block's codes only; nibbles past its end as 0 (decoded, never written)
#pragma unroll
      for (int j = 0; j < kPerLane4; j += 2) {
        if (k + j < count) {
          const uint32_t byte = in[(k + j) / 2];
          c |= (k + j + 1 < count ? byte : byte & 15u) << (4 * j);
        }
      }
    }
    float x[kPerLane4];
    decode_lane4<kCode>(c, scales[b], book, x);  // static-check: 32-bit (a block's scale)
    if (whole) {
      store_vec<kPerLane4>(out + kb + k, x);
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane4; ++j) {
        if (k + j < count) out[kb + k + j] = x[j];
      }
    }
  }
}

template <typename Kernel, typename... Args>
void launch_quant4(Kernel kernel, int64_t n, void* stream, const Args&... args) {
  const int64_t per_block = kBlock4 * kQuant4Warps;
  const int64_t blocks = (n + per_block - 1) / per_block;
  const int64_t grid = std::min<int64_t>(blocks, max_resident_blocks(kernel, kQuant4Threads));
  launch_kernel(kernel, static_cast<unsigned>(grid), kQuant4Threads,
                static_cast<cudaStream_t>(stream), args..., n);
  RUDA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void quantize_4bit_cuda(const Quant8Launch& L, void* stream) {
  if (static_cast<Code4>(L.code) == Code4::kSigned) {
    launch_quant4(quantize4_kernel<Code4::kSigned>, L.n, stream, L.x, L.codes, L.scales);
  } else {
    launch_quant4(quantize4_kernel<Code4::kUnsigned>, L.n, stream, L.x, L.codes, L.scales);
  }
}

void dequantize_4bit_cuda(const Quant8Launch& L, void* stream) {
  const uint8_t* codes = L.codes;
  const float* scales = L.scales;
  if (static_cast<Code4>(L.code) == Code4::kSigned) {
    launch_quant4(dequantize4_kernel<Code4::kSigned>, L.n, stream, codes, scales, L.out);
  } else {
    launch_quant4(dequantize4_kernel<Code4::kUnsigned>, L.n, stream, codes, scales, L.out);
  }
}

}  // namespace ruda
