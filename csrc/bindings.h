// The binding layer: the only code besides the TORCH_LIBRARY_IMPL files that touches
// at::Tensor. It validates every argument (naming it in the message) before anything
// is written, and fills the plain launch structs of ruda_params.h. The backend files
// (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cpp) call these, then their kernels.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "ruda_params.h"

namespace ruda {

// A launch struct plus the host copy of its tensor table (launch.table points into it
// once the backend has placed the table where its kernels can read it).
struct PreparedAdamW {
  AdamWLaunch launch;
  std::vector<TensorEntry> table;
};

struct PreparedStats {
  StatsLaunch launch;
  std::vector<TensorEntry> table;
};

// `unit` is the backend's update tile (elements per work unit).
PreparedAdamW prepare_adamw(
    at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
    const at::Tensor& steps, const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& stats,
    const std::optional<at::Tensor>& clip_coef, double lr, double beta1, double beta2, double eps,
    double weight_decay, double max_grad_norm, bool maximize,
    const std::optional<at::Tensor>& master, const std::optional<at::Tensor>& lr_tensor,
    int64_t rounding, int64_t seed, int64_t unit);

// check_adamw_scaled: prepare_adamw for its errors alone (any backend; writes nothing).
void check_adamw_scaled(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq,
                        const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
                        const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& stats,
                        const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double max_grad_norm,
                        bool maximize, const std::optional<at::Tensor>& master,
                        const std::optional<at::Tensor>& lr_tensor, int64_t rounding, int64_t seed);

PreparedStats prepare_analyze(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                              const at::Tensor& rows);

// Returns the number of input rows.
int64_t check_merge(const at::Tensor& rows, const at::Tensor& out);

// Returns the number of reports.
int64_t check_merge_chunks(const at::Tensor& reports, const at::Tensor& out);

DType grad_dtype_of(const at::Tensor& t);

}  // namespace ruda
