// CUDA registrations: validate (csrc/bindings.cpp), place the tensor table in device
// memory, and enqueue the kernels on the current stream. Nothing here waits for the
// GPU: the table travels through a pinned staging buffer from torch's caching host
// allocator (its reuse is ordered by an event on the stream), and every decision that
// depends on device values is made by the kernels themselves.
//
// Only c10/cuda headers are used: ATen/cuda/CUDAContext.h pulls in cuBLAS/cuSPARSE
// headers that a bare toolkit may lack (docs/building.md).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#include "bindings.h"
#include "kernels.h"

namespace ruda {
namespace {

// Copies the host table to the device; the returned tensor must outlive the launch,
// which the caching allocator guarantees for work already enqueued on this stream.
at::Tensor upload_table(const std::vector<TensorEntry>& table, const at::Device& device) {
  const int64_t words = static_cast<int64_t>(table.size()) * kTableWords;
  at::Tensor host = at::empty({words}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  if (words > 0) std::memcpy(host.data_ptr(), table.data(), words * sizeof(int64_t));
  at::Tensor dev = at::empty({words}, at::TensorOptions().dtype(at::kLong).device(device));
  dev.copy_(host, /*non_blocking=*/true);
  return dev;
}

void* current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

void adamw_scaled_cuda(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                       const at::Tensor& exp_avg_sq,
                       const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
                       const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
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
                    maximize, master, lr_tensor, rounding, seed, decoupled, scales, kCudaTile);
  if (prep.table.empty()) return;
  const c10::cuda::CUDAGuard guard(exp_avg.device());
  at::Tensor table = upload_table(prep.table, exp_avg.device());
  prep.launch.table = reinterpret_cast<const TensorEntry*>(table.data_ptr<int64_t>());
  adamw_cuda(prep.launch, current_stream());
}

void analyze_gradient_cuda_op(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                              const at::Tensor& rows) {
  PreparedStats prep = prepare_analyze(grads, grad_scale, rows);
  if (prep.launch.n_rows == 0) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  at::Tensor table = upload_table(prep.table, rows.device());
  prep.launch.table = reinterpret_cast<const TensorEntry*>(table.data_ptr<int64_t>());
  analyze_gradient_cuda(prep.launch, current_stream());
}

void merge_gradient_stats_cuda_op(const at::Tensor& rows, const at::Tensor& out) {
  const int64_t n = check_merge(rows, out);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(rows.device());
  merge_gradient_stats_cuda(rows.data_ptr<float>(), n, out.data_ptr<float>(), current_stream());
}

void merge_gradient_stats_chunks_cuda_op(const at::Tensor& reports, const at::Tensor& out) {
  const int64_t n = check_merge_chunks(reports, out);
  const c10::cuda::CUDAGuard guard(reports.device());
  merge_gradient_stats_chunks_cuda(reports.data_ptr<float>(), n, out.data_ptr<float>(),
                                   current_stream());
}

}  // namespace

// The device copy of a flat bucket's table is allocated once, for every parameter, and
// rewritten in place when the subset changes, so that its address never changes: a CUDA
// graph that captured a step reads the current table at every replay. A change of the
// subset while a stream captures is refused: the copy would be recorded from a host
// buffer that is reused.
namespace {

// A flat bucket's table buffer on the device: an entry per parameter, allocated once.
void ensure_table(at::Tensor& table, const FlatBucket& fb) {
  if (!table.defined()) {
    table =
        at::empty({flat_table_words(fb)}, at::TensorOptions().dtype(at::kLong).device(fb.device));
  }
}

// Writes `entries` into `slot` of a table buffer, refused while `stream` captures.
void rewrite_table(const at::Tensor& slot, const std::vector<TensorEntry>& entries,
                   const FlatBucket& fb, cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  TORCH_CHECK(capturing == cudaStreamCaptureStatusNone,
              "ruda_torch.AdamW: the set of parameters with a gradient differs from the eager "
              "steps' while a CUDA graph captures the step; capture a step in which the same "
              "parameters have gradients as in the eager steps before it");
  slot.copy_(upload_table(entries, fb.device), /*non_blocking=*/true);
}

void quantize_8bit_cuda_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t code) {
  const Quant8Launch launch = prepare_quantize_8bit(x, codes, scales, code);
  if (launch.n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  quantize_8bit_cuda(launch, current_stream());
}

void dequantize_8bit_cuda_op(const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& out, int64_t code) {
  const Quant8Launch launch = prepare_dequantize_8bit(codes, scales, out, code);
  if (launch.n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  dequantize_8bit_cuda(launch, current_stream());
}

void quantize_4bit_cuda_op(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                           int64_t code) {
  const Quant8Launch launch = prepare_quantize_8bit(x, codes, scales, code, 4);
  if (launch.n == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  quantize_4bit_cuda(launch, current_stream());
}

void dequantize_4bit_cuda_op(const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& out, int64_t code) {
  const Quant8Launch launch = prepare_dequantize_8bit(codes, scales, out, code, 4);
  if (launch.n == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  dequantize_4bit_cuda(launch, current_stream());
}

}  // namespace

void launch_flat_cuda(FlatBucket& fb, AdamWLaunch launch) {
  if (fb.active.empty()) return;
  const c10::cuda::CUDAGuard guard(fb.device);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  ensure_table(fb.device_table, fb);  // Note [Flat device tables] in csrc/bindings.h
  if (flat_update_table_stale(fb)) {
    const int64_t words = static_cast<int64_t>(fb.active.size()) * kTableWords;
    rewrite_table(fb.device_table.narrow(0, 0, words), fb.active, fb, stream.stream());
    flat_update_table_written(fb);
  }
  launch.table = reinterpret_cast<const TensorEntry*>(fb.device_table.data_ptr<int64_t>());
  adamw_cuda(launch, stream.stream());
}

void launch_flat_analyze_cuda(FlatBucket& fb, int64_t lo, int64_t hi, PreparedStats& prep) {
  if (prep.launch.n_rows == 0) return;
  const c10::cuda::CUDAGuard guard(fb.device);
  const auto stream = c10::cuda::getCurrentCUDAStream();
  ensure_table(fb.stats_device_table, fb);
  at::Tensor slot = fb.stats_device_table.narrow(0, lo * kTableWords, (hi - lo) * kTableWords);
  if (flat_stats_piece_stale(fb, lo, hi)) {  // once per subset and piece
    rewrite_table(slot, prep.table, fb, stream.stream());
    flat_stats_piece_written(fb, lo, hi);
  }
  prep.launch.table = reinterpret_cast<const TensorEntry*>(slot.data_ptr<int64_t>());
  analyze_gradient_cuda(prep.launch, stream.stream());
}

}  // namespace ruda

TORCH_LIBRARY_IMPL(ruda_torch, CUDA, m) {
  m.impl("adamw_scaled_", &ruda::adamw_scaled_cuda);
  m.impl("analyze_gradient", &ruda::analyze_gradient_cuda_op);
  m.impl("merge_gradient_stats", &ruda::merge_gradient_stats_cuda_op);
  m.impl("merge_gradient_stats_chunks", &ruda::merge_gradient_stats_chunks_cuda_op);
  m.impl("quantize_8bit", &ruda::quantize_8bit_cuda_op);
  m.impl("dequantize_8bit", &ruda::dequantize_8bit_cuda_op);
  m.impl("quantize_4bit", &ruda::quantize_4bit_cuda_op);
  m.impl("dequantize_4bit", &ruda::dequantize_4bit_cuda_op);
}
