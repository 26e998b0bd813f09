// The binding layer: the only code besides the TORCH_LIBRARY_IMPL files that touches
// at::Tensor. It validates every argument (naming it in the message) before anything
// is written, and fills the plain launch structs of ruda_params.h. The backend files
// (csrc/cpu/ops_cpu.cpp, csrc/cuda/ops_cuda.cpp) call these, then their kernels.
#pragma once

#include <ATen/ATen.h>

#include <memory>
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
    int64_t rounding, int64_t seed, bool decoupled, const std::optional<at::Tensor>& scales,
    int64_t unit);

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
                        const std::optional<at::Tensor>& lr_tensor, int64_t rounding, int64_t seed,
                        bool decoupled, const std::optional<at::Tensor>& scales);

PreparedStats prepare_analyze(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                              const at::Tensor& rows);

// Returns the number of input rows.
int64_t check_merge(const at::Tensor& rows, const at::Tensor& out);

// Returns the number of reports.
int64_t check_merge_chunks(const at::Tensor& reports, const at::Tensor& out);

// Validates quantize_8bit's / dequantize_8bit's arguments (Note [8-bit moments] in
// csrc/quant8.h), or with bits = 4 quantize_4bit's / dequantize_4bit's (Note [4-bit
// moments] in csrc/quant4.h), and fills the launch (data pointers of the given tensors).
Quant8Launch prepare_quantize_8bit(const at::Tensor& x, const at::Tensor& codes,
                                   const at::Tensor& scales, int64_t code, int bits = 8);
Quant8Launch prepare_dequantize_8bit(const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& out, int64_t code, int bits = 8);

// Note [Flat gradient buckets] (ruda_torch/_fused.py has the Python side)
// A bucket whose gradients are views of one flat buffer laid out like its state: the
// views never move, so the table prepare_adamw validated once stays valid as long as no
// parameter's memory moves (`p.data = ...` keeps the tensor and moves the memory; the
// shapes, strides, dtypes and devices are the plan's to check). A step then checks one
// address per parameter, validates its scalars and controls, and launches: no tensor
// lists cross from Python, and on CUDA the table stays in device memory, uploaded only
// when the set of parameters with a gradient changes.
struct FlatBucket {
  std::vector<at::Tensor> params;  // what the kernel steps (staging copies for non-dense)
  std::vector<at::Tensor> owners;  // the parameters whose `grad` are the views
  std::vector<at::Tensor> views;   // the gradient views, in the flat buffer
  at::Tensor grad;                 // the flat gradient buffer
  at::Tensor exp_avg, exp_avg_sq, steps;
  std::optional<at::Tensor> max_exp_avg_sq, master, scales;
  at::Device device = at::kCPU;
  at::ScalarType pdtype = at::kFloat;
  int64_t unit = 1;
  std::vector<TensorEntry> table;   // every parameter
  std::vector<TensorEntry> active;  // the table of the last step's subset (`active_ids`)
  std::vector<int64_t> active_ids;  // empty: every parameter
  bool all_active = true;
  at::Tensor device_table;  // CUDA: the launch's table in device memory
  bool device_table_current = false;
  // What each view is (Note [Exact views] in csrc/py_records.h), recorded when the handle
  // is made and compared by flat_check at every step.
  std::vector<int64_t> view_facts;
  std::vector<int64_t> view_fact_starts;  // where view i's record starts in view_facts
  // Statistics of the selected subset, one piece [lo, hi) of it at a time (CUDA): the
  // pieces partition the subset, so their tables fit one buffer of an entry per
  // parameter, piece [lo, hi) at entry lo, allocated once and rewritten in place (as
  // device_table) for the pieces listed in stats_pieces since the subset last changed.
  at::Tensor stats_device_table;
  std::vector<std::pair<int64_t, int64_t>> stats_pieces;
};

// Validates everything prepare_adamw does for the bucket (with `views` as the gradients)
// and keeps its table; `unit` is the backend's tile.
std::unique_ptr<FlatBucket> make_flat_bucket(
    std::vector<at::Tensor> owners, std::vector<at::Tensor> params, std::vector<at::Tensor> views,
    const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
    const at::Tensor& slots, const std::optional<at::Tensor>& master,
    const std::optional<at::Tensor>& scales);

// Whether parameter i's memory is where the table says.
bool flat_param_current(const FlatBucket& fb, size_t i);

// Note [Flat device tables]: a flat bucket's tables live in device memory at fixed
// addresses (a CUDA graph that captured a step reads them at every replay): the update
// table, the selected subset's entries from word 0, and the statistics table, piece
// [lo, hi) of the subset at entry lo, each one entry (6 words) per parameter. These say
// what must be written before a launch, with no device involved, so that the CUDA
// emulation (tests/test_cuda_sim.py) runs the same rules as csrc/cuda/ops_cuda.cpp:
// the update table after every change of the subset, a statistics piece once per subset.
// `*_written` records a write that succeeded (a refused one leaves the table stale).
int64_t flat_table_words(const FlatBucket& fb);
bool flat_update_table_stale(const FlatBucket& fb);
void flat_update_table_written(FlatBucket& fb);
bool flat_stats_piece_stale(const FlatBucket& fb, int64_t lo, int64_t hi);
void flat_stats_piece_written(FlatBucket& fb, int64_t lo, int64_t hi);

// Makes `active` (parameter indices, ascending; null = all) the launch's table subset.
void flat_bucket_select(FlatBucket& fb, const std::vector<int64_t>* active);

// The launch of one step over the selected subset, every scalar and control validated
// as adamw_scaled_ validates them; launch.table is left for the backend to place.
// `amsgrad` false steps without the bucket's AMSGrad buffer (the group turned it off).
AdamWLaunch prepare_flat_step(const FlatBucket& fb, bool amsgrad,
                              const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf,
                              const std::optional<at::Tensor>& stats,
                              const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                              double beta2, double eps, double weight_decay, double max_grad_norm,
                              bool maximize, const std::optional<at::Tensor>& lr_tensor,
                              int64_t rounding, int64_t seed, bool decoupled);

// The statistics launch of the selected parameters lo .. hi-1 into `rows` (one row per
// kStatsChunk elements of each, as analyze_gradient), validated as analyze_gradient
// validates; the table is returned in `prep` for the backend to place.
PreparedStats prepare_flat_analyze(const FlatBucket& fb, int64_t lo, int64_t hi,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const at::Tensor& rows);

#ifdef RUDA_TORCH_WITH_CUDA
// Places a statistics piece's table in device memory once per subset and enqueues it.
void launch_flat_analyze_cuda(FlatBucket& fb, int64_t lo, int64_t hi, PreparedStats& prep);

// Places the selected table in device memory when it changed (csrc/cuda/ops_cuda.cpp)
// and enqueues the update on the current stream.
void launch_flat_cuda(FlatBucket& fb, AdamWLaunch launch);
#endif

}  // namespace ruda
