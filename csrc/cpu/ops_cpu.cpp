// CPU registrations: validate (csrc/bindings.cpp), then run the CPU kernels.
#include <torch/library.h>

#include "bindings.h"
#include "kernels.h"

namespace ruda {
namespace {

void adamw_scaled_cpu(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                      const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
                      const at::Tensor& steps, const at::Tensor& slots,
                      const std::optional<at::Tensor>& grad_scale,
                      const std::optional<at::Tensor>& found_inf,
                      const std::optional<at::Tensor>& stats,
                      const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                      double beta2, double eps, double weight_decay, double max_grad_norm,
                      bool maximize, const std::optional<at::Tensor>& master,
                      const std::optional<at::Tensor>& lr_tensor, int64_t rounding, int64_t seed,
                      bool decoupled, const std::optional<at::Tensor>& scales) {
  PreparedAdamW prep =
      prepare_adamw(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, grad_scale,
                    found_inf, stats, clip_coef, lr, beta1, beta2, eps, weight_decay, max_grad_norm,
                    maximize, master, lr_tensor, rounding, seed, decoupled, scales, kCpuTile);
  prep.launch.table = prep.table.data();
  adamw_cpu(prep.launch);
}

void analyze_gradient_cpu_op(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                             const at::Tensor& rows) {
  PreparedStats prep = prepare_analyze(grads, grad_scale, rows);
  prep.launch.table = prep.table.data();
  analyze_gradient_cpu(prep.launch);
}

void merge_gradient_stats_cpu_op(const at::Tensor& rows, const at::Tensor& out) {
  const int64_t n = check_merge(rows, out);
  merge_gradient_stats_cpu(rows.data_ptr<float>(), n, out.data_ptr<float>());
}

void merge_gradient_stats_chunks_cpu_op(const at::Tensor& reports, const at::Tensor& out) {
  const int64_t n = check_merge_chunks(reports, out);
  merge_gradient_stats_chunks_cpu(reports.data_ptr<float>(), n, out.data_ptr<float>());
}

void quantize_8bit_cpu_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t code) {
  quantize_8bit_cpu(prepare_quantize_8bit(x, codes, scales, code));
}

void dequantize_8bit_cpu_op(const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& out, int64_t code) {
  dequantize_8bit_cpu(prepare_dequantize_8bit(codes, scales, out, code));
}

void quantize_4bit_cpu_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          int64_t code) {
  quantize_4bit_cpu(prepare_quantize_8bit(x, codes, scales, code, 4));
}

void dequantize_4bit_cpu_op(const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& out, int64_t code) {
  dequantize_4bit_cpu(prepare_dequantize_8bit(codes, scales, out, code, 4));
}

}  // namespace
}  // namespace ruda

TORCH_LIBRARY_IMPL(ruda_torch, CPU, m) {
  m.impl("adamw_scaled_", &ruda::adamw_scaled_cpu);
  m.impl("analyze_gradient", &ruda::analyze_gradient_cpu_op);
  m.impl("merge_gradient_stats", &ruda::merge_gradient_stats_cpu_op);
  m.impl("merge_gradient_stats_chunks", &ruda::merge_gradient_stats_chunks_cpu_op);
  m.impl("quantize_8bit", &ruda::quantize_8bit_cpu_op);
  m.impl("dequantize_8bit", &ruda::dequantize_8bit_cpu_op);
  m.impl("quantize_4bit", &ruda::quantize_4bit_cpu_op);
  m.impl("dequantize_4bit", &ruda::dequantize_4bit_cpu_op);
}
