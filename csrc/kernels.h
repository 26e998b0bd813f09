// Kernel entry points of each backend. They take the plain launch structs that
// csrc/bindings.cpp filled after validation; the table pointer is readable by the
// backend (host memory for CPU, device memory for CUDA).
#pragma once

#include "ruda_params.h"

namespace ruda {

// Elements per update work unit (TensorEntry::unit_start counts these).
constexpr int64_t kCpuTile = 16384;
constexpr int64_t kCudaTile = 4096;
// The units and tensors of one update call: below 2^31, which the CUDA kernels count in 32
// bits (checked by the binding).
constexpr int64_t kMaxUnits = int64_t(1) << 31;

// The CPU kernels. They are defined once per vector ISA, each build in its own module
// (csrc/cpu/kernels/, `ruda_torch._cpu_<isa>`); in `ruda_torch._C` these names forward to
// the build chosen at import (Note [CPU ISA at run time] in csrc/cpu/dispatch.cpp).
void adamw_cpu(const AdamWLaunch& launch);
void analyze_gradient_cpu(const StatsLaunch& launch);
void merge_gradient_stats_cpu(const float* rows, int64_t n_rows, float* out);
void merge_gradient_stats_chunks_cpu(const float* reports, int64_t n_reports, float* out);
void quantize_8bit_cpu(const Quant8Launch& launch);
void dequantize_8bit_cpu(const Quant8Launch& launch);
void quantize_4bit_cpu(const Quant8Launch& launch);
void dequantize_4bit_cpu(const Quant8Launch& launch);

// What an ISA module hands to `_C` (a capsule named kCpuKernelsCapsule). `abi` guards
// against a module from another build of the package.
constexpr int kCpuKernelsAbi = 3;
constexpr const char* kCpuKernelsCapsule = "ruda_torch.CpuKernels";
struct CpuKernels {
  int abi;
  const char* isa;  // "default", "avx2" or "avx512"
  void (*adamw)(const AdamWLaunch&);
  void (*analyze_gradient)(const StatsLaunch&);
  void (*merge_gradient_stats)(const float*, int64_t, float*);
  void (*merge_gradient_stats_chunks)(const float*, int64_t, float*);
  void (*quantize_8bit)(const Quant8Launch&);
  void (*dequantize_8bit)(const Quant8Launch&);
  void (*quantize_4bit)(const Quant8Launch&);
  void (*dequantize_4bit)(const Quant8Launch&);
};

#ifdef RUDA_TORCH_WITH_CUDA
// All CUDA launchers enqueue on `stream` and return without synchronizing.
void adamw_cuda(const AdamWLaunch& launch, void* stream);
void analyze_gradient_cuda(const StatsLaunch& launch, void* stream);
void merge_gradient_stats_cuda(const float* rows, int64_t n_rows, float* out, void* stream);
void merge_gradient_stats_chunks_cuda(const float* reports, int64_t n_reports, float* out,
                                      void* stream);
void quantize_8bit_cuda(const Quant8Launch& launch, void* stream);
void dequantize_8bit_cuda(const Quant8Launch& launch, void* stream);
void quantize_4bit_cuda(const Quant8Launch& launch, void* stream);
void dequantize_4bit_cuda(const Quant8Launch& launch, void* stream);
#endif

}  // namespace ruda
