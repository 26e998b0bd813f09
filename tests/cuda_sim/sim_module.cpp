// The emulated CUDA kernels as a Python module (Note [CUDA emulation] in
// csrc/cuda_sim/cuda_sim.h), for tests/test_cuda_sim.py: each function prepares its launch
// with the binding code the real CUDA operators use (csrc/bindings.cpp: the same table,
// tiles and validation; host memory is the emulated device's) and runs the kernels of
// csrc/cuda/*.cu, included below as C++.
#include <torch/extension.h>

#include <cstring>
#include <memory>
#include <string>

#include "adamw_math.h"
#include "bindings.h"
#include "cuda_fp16.h"
#include "cuda_sim.h"
#include "grad_stats.h"
#include "kernels.h"

namespace {

void set_schedule(const std::string& name) {
  using ruda_sim::Schedule;
  if (name == "forward") {
    ruda_sim::schedule() = Schedule::kForward;
  } else if (name == "reverse") {
    ruda_sim::schedule() = Schedule::kReverse;
  } else if (name == "concurrent") {
    ruda_sim::schedule() = Schedule::kConcurrent;
  } else {
    TORCH_CHECK(false, "schedule must be forward, reverse or concurrent, got ", name);
  }
}

// Whether adamw() launches the low-bit edge kernels: off, tests/test_cuda_sim.py sees which
// blocks the direct kernels step on their own.
bool& edge_kernels() {
  static bool on = true;
  return on;
}
void set_edge_kernels(bool on) { edge_kernels() = on; }

void adamw(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, const at::Tensor& exp_avg,
           const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
           const at::Tensor& steps, const at::Tensor& slots,
           const std::optional<at::Tensor>& grad_scale, const std::optional<at::Tensor>& found_inf,
           const std::optional<at::Tensor>& stats, const std::optional<at::Tensor>& clip_coef,
           double lr, double beta1, double beta2, double eps, double weight_decay,
           double max_grad_norm, bool maximize, const std::optional<at::Tensor>& master,
           const std::optional<at::Tensor>& lr_tensor, int64_t rounding, int64_t seed,
           bool decoupled, const std::optional<at::Tensor>& scales) {
  ruda::PreparedAdamW prep = ruda::prepare_adamw(
      params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, grad_scale, found_inf,
      stats, clip_coef, lr, beta1, beta2, eps, weight_decay, max_grad_norm, maximize, master,
      lr_tensor, rounding, seed, decoupled, scales, ruda::kCudaTile);
  if (prep.table.empty()) return;  // as the CUDA operator
  if (!edge_kernels()) prep.launch.edges = false;
  prep.launch.table = prep.table.data();
  ruda::adamw_cuda(prep.launch, nullptr);
}

// adamw() with every slice's state offset moved past 2^31 elements and the state bases
// moved back by as much: the same memory, reached through 64-bit offsets that no test
// buffer could have (nothing that large is allocated; the bases are never dereferenced).
void adamw_far(std::vector<at::Tensor> params, std::vector<at::Tensor> grads,
               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
               const at::Tensor& slots, int64_t shift) {
  ruda::PreparedAdamW prep = ruda::prepare_adamw(
      params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, std::nullopt, std::nullopt,
      std::nullopt, std::nullopt, 1e-2, 0.9, 0.99, 1e-8, 0.1, 0.0, false, std::nullopt,
      std::nullopt, 0, 0, true, std::nullopt, ruda::kCudaTile);
  if (prep.table.empty()) return;
  for (ruda::TensorEntry& e : prep.table) e.state_offset += shift;
  const auto back = [shift](void* base, size_t size) {
    return base == nullptr ? nullptr
                           : reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(base) -
                                                     static_cast<uintptr_t>(shift) * size);
  };
  const size_t size = exp_avg.element_size();
  prep.launch.exp_avg = back(prep.launch.exp_avg, size);
  prep.launch.exp_avg_sq = back(prep.launch.exp_avg_sq, size);
  prep.launch.max_exp_avg_sq = back(prep.launch.max_exp_avg_sq, size);
  prep.launch.table = prep.table.data();
  ruda::adamw_cuda(prep.launch, nullptr);
}

void analyze(std::vector<at::Tensor> grads, const std::optional<at::Tensor>& grad_scale,
             const at::Tensor& rows) {
  ruda::PreparedStats prep = ruda::prepare_analyze(grads, grad_scale, rows);
  if (prep.launch.n_rows == 0) return;
  prep.launch.table = prep.table.data();
  ruda::analyze_gradient_cuda(prep.launch, nullptr);
}

void merge(const at::Tensor& rows, const at::Tensor& out) {
  const int64_t n = ruda::check_merge(rows, out);
  if (n == 0) return;
  ruda::merge_gradient_stats_cuda(rows.data_ptr<float>(), n, out.data_ptr<float>(), nullptr);
}

void merge_chunks(const at::Tensor& reports, const at::Tensor& out) {
  const int64_t n = ruda::check_merge_chunks(reports, out);
  ruda::merge_gradient_stats_chunks_cuda(reports.data_ptr<float>(), n, out.data_ptr<float>(),
                                         nullptr);
}

void quantize_8bit(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t code) {
  const ruda::Quant8Launch launch = ruda::prepare_quantize_8bit(x, codes, scales, code);
  if (launch.n > 0) ruda::quantize_8bit_cuda(launch, nullptr);
}

void dequantize_8bit(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                     int64_t code) {
  const ruda::Quant8Launch launch = ruda::prepare_dequantize_8bit(codes, scales, out, code);
  if (launch.n > 0) ruda::dequantize_8bit_cuda(launch, nullptr);
}

void quantize_4bit(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                   int64_t code) {
  const ruda::Quant8Launch launch = ruda::prepare_quantize_8bit(x, codes, scales, code, 4);
  if (launch.n > 0) ruda::quantize_4bit_cuda(launch, nullptr);
}

void dequantize_4bit(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& out,
                     int64_t code) {
  const ruda::Quant8Launch launch = ruda::prepare_dequantize_8bit(codes, scales, out, code, 4);
  if (launch.n > 0) ruda::dequantize_4bit_cuda(launch, nullptr);
}

// A flat bucket (Note [Flat gradient buckets]) on the emulated device: the binding's
// FlatBucket, with its device tables as host memory written by the rules of Note [Flat
// device tables] (as csrc/cuda/ops_cuda.cpp writes them), counting the writes.
struct SimFlat {
  std::unique_ptr<ruda::FlatBucket> fb;
  std::vector<int64_t> table, stats_table;
  int64_t table_writes = 0, stats_writes = 0;
};

std::shared_ptr<SimFlat> flat_new(std::vector<at::Tensor> owners, std::vector<at::Tensor> params,
                                  std::vector<at::Tensor> views, const at::Tensor& grad,
                                  const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                  const std::optional<at::Tensor>& max_exp_avg_sq,
                                  const at::Tensor& steps, const at::Tensor& slots,
                                  const std::optional<at::Tensor>& master) {
  auto sim = std::make_shared<SimFlat>();
  sim->fb = ruda::make_flat_bucket(std::move(owners), std::move(params), std::move(views), grad,
                                   exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, master,
                                   std::nullopt);
  // The handle sizes its work units by the tensors' device: these are CPU tensors standing
  // in for device memory, so the units are made the CUDA tile, as for a CUDA bucket.
  ruda::FlatBucket& fb = *sim->fb;
  fb.unit = ruda::kCudaTile;
  int64_t units = 0;
  for (ruda::TensorEntry& e : fb.table) {
    e.unit_start = units;
    units += (e.numel + fb.unit - 1) / fb.unit;
  }
  fb.active = fb.table;
  const int64_t words = ruda::flat_table_words(fb);
  sim->table.assign(words, -1);  // as uninitialized device memory: every entry written first
  sim->stats_table.assign(words, -1);
  return sim;
}

void select(SimFlat& sim, const std::optional<std::vector<int64_t>>& active) {
  ruda::flat_bucket_select(*sim.fb, active ? &*active : nullptr);
}

void write_entries(std::vector<int64_t>& table, int64_t entry,
                   const std::vector<ruda::TensorEntry>& entries) {
  std::memcpy(table.data() + entry * ruda::kTableWords, entries.data(), entries.size() * sizeof(entries[0]));
}

void flat_step(SimFlat& sim, const std::optional<std::vector<int64_t>>& active, bool amsgrad,
               double lr, double weight_decay, const std::optional<at::Tensor>& grad_scale,
               const std::optional<at::Tensor>& stats, double max_grad_norm) {
  ruda::FlatBucket& fb = *sim.fb;
  select(sim, active);
  ruda::AdamWLaunch launch = ruda::prepare_flat_step(
      fb, amsgrad, grad_scale, std::nullopt, stats, std::nullopt, lr, 0.9, 0.99, 1e-8, weight_decay,
      max_grad_norm, false, std::nullopt, 0, 0, true);
  if (fb.active.empty()) return;
  if (ruda::flat_update_table_stale(fb)) {
    write_entries(sim.table, 0, fb.active);
    ruda::flat_update_table_written(fb);
    ++sim.table_writes;
  }
  launch.table = reinterpret_cast<const ruda::TensorEntry*>(sim.table.data());
  ruda::adamw_cuda(launch, nullptr);
}

void flat_analyze(SimFlat& sim, const std::optional<std::vector<int64_t>>& active, int64_t lo,
                  int64_t hi, const std::optional<at::Tensor>& grad_scale, const at::Tensor& rows) {
  ruda::FlatBucket& fb = *sim.fb;
  select(sim, active);
  ruda::PreparedStats prep = ruda::prepare_flat_analyze(fb, lo, hi, grad_scale, rows);
  if (prep.launch.n_rows == 0) return;
  if (ruda::flat_stats_piece_stale(fb, lo, hi)) {
    write_entries(sim.stats_table, lo, prep.table);
    ruda::flat_stats_piece_written(fb, lo, hi);
    ++sim.stats_writes;
  }
  prep.launch.table = reinterpret_cast<const ruda::TensorEntry*>(sim.stats_table.data() + lo * ruda::kTableWords);
  ruda::analyze_gradient_cuda(prep.launch, nullptr);
}

std::pair<int64_t, int64_t> flat_writes(const SimFlat& sim) {
  return {sim.table_writes, sim.stats_writes};
}

// The emulated cvt.rz.f16.f32 (csrc/cuda_sim/cuda_fp16.h) of each FP32 value: its FP16 bits.
at::Tensor emulated_f16_toward_zero(const at::Tensor& x) {
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kInt));
  const float* src = in.data_ptr<float>();
  int32_t* dst = out.data_ptr<int32_t>();
  for (int64_t i = 0; i < in.numel(); ++i) {
    dst[i] = static_cast<int32_t>(::f16_bits_toward_zero(src[i]));
  }
  return out;
}

// The random bits of indices first .. first + n - 1 as the 8-bit edge kernels draw them
// (rounding_high once, then rounding_high_at past a multiple of 2^32), for n < 2^32.
at::Tensor rounding_bits_from(int64_t key, int64_t first, int64_t n) {
  at::Tensor out = at::empty({n}, at::kLong);
  const auto k = static_cast<uint32_t>(key);
  const uint32_t high = ruda::rounding_high(k, first), low = static_cast<uint32_t>(first);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t at = low + static_cast<uint32_t>(j);
    const uint32_t h = ruda::rounding_high_at(high, low, at, [k] { return k; });
    out.data_ptr<int64_t>()[j] = ruda::rounding_mix(h, at);
  }
  return out;
}

// The grid the launch code sizes from the emulated device (kSimSms x kSimBlocksPerSm).
int64_t resident_blocks() { return int64_t(ruda_sim::kSimSms) * ruda_sim::kSimBlocksPerSm; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_schedule", &set_schedule);
  m.def("set_edge_kernels", &set_edge_kernels);
  m.def("adamw", &adamw);
  m.def("adamw_far", &adamw_far);
  m.def("analyze", &analyze);
  m.def("merge", &merge);
  m.def("merge_chunks", &merge_chunks);
  m.def("quantize_8bit", &quantize_8bit);
  m.def("dequantize_8bit", &dequantize_8bit);
  m.def("quantize_4bit", &quantize_4bit);
  m.def("dequantize_4bit", &dequantize_4bit);
  m.def("resident_blocks", &resident_blocks);
  m.def("f16_bits_toward_zero", &emulated_f16_toward_zero);
  m.def("rounding_bits_from", &rounding_bits_from);
  py::class_<SimFlat, std::shared_ptr<SimFlat>>(m, "SimFlat");
  m.def("flat_new", &flat_new);
  m.def("flat_step", &flat_step);
  m.def("flat_analyze", &flat_analyze);
  m.def("flat_writes", &flat_writes);
}
