// Kernel entry points of each backend. They take the plain launch structs that
// csrc/bindings.cpp filled after validation; the table pointer is readable by the
// backend (host memory for CPU, device memory for CUDA).
#pragma once

#include "ruda_params.h"

namespace ruda {

// Elements per update work unit (TensorEntry::unit_start counts these).
constexpr int64_t kCpuTile = 16384;
constexpr int64_t kCudaTile = 4096;

void adamw_cpu(const AdamWLaunch& launch);
void analyze_gradient_cpu(const StatsLaunch& launch);
void merge_gradient_stats_cpu(const float* rows, int64_t n_rows, float* out);
void merge_gradient_stats_chunks_cpu(const float* reports, int64_t n_reports, float* out);

#ifdef RUDA_TORCH_WITH_CUDA
// All CUDA launchers enqueue on `stream` and return without synchronizing.
void adamw_cuda(const AdamWLaunch& launch, void* stream);
void analyze_gradient_cuda(const StatsLaunch& launch, void* stream);
void merge_gradient_stats_cuda(const float* rows, int64_t n_rows, float* out, void* stream);
void merge_gradient_stats_chunks_cuda(const float* reports, int64_t n_reports, float* out,
                                      void* stream);
#endif

}  // namespace ruda
