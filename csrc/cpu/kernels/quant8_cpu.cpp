// CPU kernels of quantize_8bit and dequantize_8bit (Note [8-bit moments] in csrc/quant8.h):
// blocks in parallel with at::parallel_for; within a block, loops the compiler vectorizes
// for the module's ISA (integer maximum, the code's integer operations).
#include <ATen/Parallel.h>

#include <algorithm>

#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int64_t kBlocksPerTask = 64;  // 16384 elements, a CPU tile (kCpuTile)

template <Code8 kCode>
void quantize_blocks(const Quant8Launch& L) {
  const int64_t blocks = (L.n + kBlock8 - 1) / kBlock8;
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kBlock8;
      const int64_t n = std::min(kBlock8, L.n - begin);
      const float* x = L.x + begin;
      uint8_t* codes = L.codes + begin;
      uint32_t largest = 0;
      for (int64_t k = 0; k < n; ++k) largest = std::max(largest, magnitude_bits(x[k]));
      const float scale = block_scale(largest);
      L.scales[b] = scale;
      if (!(scale > 0.0f)) {  // stored as zeros, or a block with a NaN or an infinity
        std::fill(codes, codes + n, uint8_t{0});
        continue;
      }
      const float inverse = block_inverse(scale);
      for (int64_t k = 0; k < n; ++k) codes[k] = encode8<kCode>(x[k] * inverse);
    }
  });
}

template <Code8 kCode>
void dequantize_blocks(const Quant8Launch& L) {
  const int64_t blocks = (L.n + kBlock8 - 1) / kBlock8;
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kBlock8;
      const int64_t n = std::min(kBlock8, L.n - begin);
      const float scale = L.scales[b];
      for (int64_t k = 0; k < n; ++k) {
        L.out[begin + k] = dequantize8<kCode>(L.codes[begin + k], scale);
      }
    }
  });
}

}  // namespace

void quantize_8bit_cpu(const Quant8Launch& launch) {
  if (static_cast<Code8>(launch.code) == Code8::kSigned) {
    quantize_blocks<Code8::kSigned>(launch);
  } else {
    quantize_blocks<Code8::kUnsigned>(launch);
  }
}

void dequantize_8bit_cpu(const Quant8Launch& launch) {
  if (static_cast<Code8>(launch.code) == Code8::kSigned) {
    dequantize_blocks<Code8::kSigned>(launch);
  } else {
    dequantize_blocks<Code8::kUnsigned>(launch);
  }
}

}  // namespace ruda
