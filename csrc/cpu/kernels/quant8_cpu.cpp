// CPU kernels of quantize_8bit and dequantize_8bit (Note [8-bit moments] in csrc/quant8.h):
// blocks in parallel with at::parallel_for; within a block, loops the compiler vectorizes
// for the module's ISA (integer maximum, the code's integer operations), or with AVX-512
// and AVX2 the vector codec of the 8-bit step.
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu/kernels/quant8_vec.h"
#include "kernels.h"
#include "quant8.h"

namespace ruda {
namespace {

constexpr int64_t kBlocksPerTask = 64;  // 16384 elements, a CPU tile (kCpuTile)

// f(b, begin, n) for every block b of n elements from `begin`, blocks in parallel.
template <typename F>
void for_each_block(int64_t numel, const F& f) {
  const int64_t blocks = (numel + kBlock8 - 1) / kBlock8;
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kBlock8;
      f(b, begin, std::min(kBlock8, numel - begin));
    }
  });
}

// With AVX-512 or AVX2, whole blocks of finite values take the codec of the 8-bit step
// (Note [8-bit codes through FP16] in quant8_vec.h): the same bits, faster, and these
// operators then test it value by value (tests/test_cpu_isa.py).
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCodecVec = true;
#else
constexpr bool kCodecVec = false;
#endif

template <Code8 kCode>
void quantize_blocks(const Quant8Launch& L) {
  for_each_block(L.n, [&](int64_t b, int64_t begin, int64_t n) {
    const float* x = L.x + begin;
    if (kCodecVec && n == kBlock8) {
      uint32_t largest = 0;
      for (int64_t j = 0; j < n; ++j) largest = std::max(largest, magnitude_bits(x[j]));
      if (largest < kInfBits) {
        const float s = block_scale(largest, false);
        L.scales[b] = s;
        cpu::encode_block_vec<kCode>(x, block_inverse(s), L.codes + begin);
        return;
      }
    }
    encode_block<kCode>(x, n, L.codes + begin, L.scales + b);
  });
}

template <Code8 kCode>
void dequantize_blocks(const Quant8Launch& L) {
  for_each_block(L.n, [&](int64_t b, int64_t begin, int64_t n) {
    const float scale = L.scales[b];
    if (kCodecVec && n == kBlock8 && cpu::vector_block(scale)) {
      for (int64_t j = 0; j < n; j += cpu::VecF::size()) {
        cpu::decode8_scaled_vec<kCode>(L.codes + begin + j, scale).store(L.out + begin + j);
      }
      return;
    }
    decode_block_cpu<kCode>(L.codes + begin, scale, n, L.out + begin);
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
