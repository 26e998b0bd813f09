// CPU kernels of quantize_4bit and dequantize_4bit (Note [4-bit moments] in csrc/quant4.h):
// blocks of kBlock4 in parallel with at::parallel_for, each by the step's own codec
// (quant4_vec.h: vectors with AVX-512 or AVX2, quant4.h's scalar code otherwise), so that
// these operators and the fused step give the same bits on every ISA build, and
// tests/test_cpu_isa.py holds the vector codec to the scalar one on every class of value.
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu/kernels/quant4_vec.h"
#include "kernels.h"
#include "quant4.h"

namespace ruda {
namespace {

constexpr int64_t kBlocksPerTask = 128;  // 16384 elements, a CPU tile (kCpuTile)

// f(b, begin, n) for every block b of n elements from `begin` (even), blocks in parallel.
template <typename F>
void for_each_block4(int64_t numel, const F& f) {
  const int64_t blocks = (numel + kBlock4 - 1) / kBlock4;
  at::parallel_for(0, blocks, kBlocksPerTask, [&](int64_t b_begin, int64_t b_end) {
    for (int64_t b = b_begin; b < b_end; ++b) {
      const int64_t begin = b * kBlock4;
      f(b, begin, std::min(kBlock4, numel - begin));
    }
  });
}

template <Code4 kCode>
void quantize_blocks4(const Quant8Launch& L) {
  for_each_block4(L.n, [&](int64_t b, int64_t begin, int64_t n) {
    const float* x = L.x + begin;
    cpu::code_block4<kCode>(x, n, cpu::largest_magnitude(x, n), L.codes + begin / 2, L.scales + b);
  });
}

template <Code4 kCode>
void dequantize_blocks4(const Quant8Launch& L) {
  for_each_block4(L.n, [&](int64_t b, int64_t begin, int64_t n) {
    cpu::decode_block4_vec<kCode>(L.codes + begin / 2, L.scales[b], n, L.out + begin);
  });
}

}  // namespace

void quantize_4bit_cpu(const Quant8Launch& launch) {
  if (static_cast<Code4>(launch.code) == Code4::kSigned) {
    quantize_blocks4<Code4::kSigned>(launch);
  } else {
    quantize_blocks4<Code4::kUnsigned>(launch);
  }
}

void dequantize_4bit_cpu(const Quant8Launch& launch) {
  if (static_cast<Code4>(launch.code) == Code4::kSigned) {
    dequantize_blocks4<Code4::kSigned>(launch);
  } else {
    dequantize_blocks4<Code4::kUnsigned>(launch);
  }
}

}  // namespace ruda
