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
      encode_block<kCode>(L.x + begin, n, L.codes + begin, L.scales + b);
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
      decode_block_cpu<kCode>(L.codes + begin, L.scales[b], n, L.out + begin);
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
