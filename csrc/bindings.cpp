// Argument validation and launch-struct filling for every operator. Everything is
// checked before the first write, so a rejected call changes nothing.
#include "bindings.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "grad_stats.h"

namespace ruda {
namespace {

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }

// A [begin, end) byte range of a tensor's elements; empty for zero-size tensors. The
// name is built only for an error message: `name` plus "[index]" when index >= 0.
struct Span {
  uintptr_t begin, end;
  const char* name;
  int64_t index;
  std::string label() const {
    return index >= 0 ? std::string(name) + "[" + std::to_string(index) + "]" : name;
  }
};

Span span_of(const at::Tensor& t, const char* name, int64_t index = -1) {
  auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {b, b + static_cast<uintptr_t>(t.numel()) * t.element_size(), name, index};
}

// Fails if two of the written ranges overlap, or a read-only range overlaps a written one.
void check_no_aliasing(const char* op, std::vector<Span> written,
                       const std::vector<Span>& read_only) {
  written.erase(std::remove_if(written.begin(), written.end(),
                               [](const Span& s) { return s.begin == s.end; }),
                written.end());
  std::sort(written.begin(), written.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 1; i < written.size(); ++i) {
    TORCH_CHECK(written[i].begin >= written[i - 1].end, "ruda_torch.", op, ": ", written[i].label(),
                " overlaps ", written[i - 1].label(),
                " in memory; every written tensor must own its storage");
  }
  for (const Span& r : read_only) {
    if (r.begin == r.end) continue;
    auto it = std::upper_bound(written.begin(), written.end(), r.begin,
                               [](uintptr_t v, const Span& s) { return v < s.begin; });
    // The written span that starts at or before r.begin, and the one after it.
    if (it != written.begin()) {
      const Span& w = *(it - 1);
      TORCH_CHECK(r.begin >= w.end, "ruda_torch.", op, ": ", r.label(), " overlaps ", w.label(),
                  " in memory; a gradient must not alias what the step writes");
    }
    if (it != written.end()) {
      TORCH_CHECK(r.end <= it->begin, "ruda_torch.", op, ": ", r.label(), " overlaps ", it->label(),
                  " in memory; a gradient must not alias what the step writes");
    }
  }
}

void check_same_device(const char* op, const at::Tensor& t, const char* name,
                       const at::Device& device, int64_t index = -1) {
  TORCH_CHECK(t.device() == device, "ruda_torch.", op, ": ", name,
              index >= 0 ? "[" + std::to_string(index) + "]" : std::string(), " must be on ",
              device, " like the first tensor (got ", t.device(), ")");
}

void check_flat_fp32(const char* op, const at::Tensor& t, const char* name,
                     const at::Device& device) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "ruda_torch.", op, ": ", name,
              " must be float32 (got ", t.scalar_type(), ")");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "ruda_torch.", op, ": ", name,
              " must be a contiguous 1-D tensor (got shape ", shape_str(t), ")");
  check_same_device(op, t, name, device);
}

void check_scalar_fp32(const char* op, const std::optional<at::Tensor>& t, const char* name,
                       int64_t numel, const at::Device& device) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kFloat, "ruda_torch.", op, ": ", name,
              " must be float32 (got ", t->scalar_type(), ")");
  TORCH_CHECK(t->numel() == numel && t->is_contiguous(), "ruda_torch.", op, ": ", name,
              " must be a contiguous tensor of ", numel, " element(s) (got shape ", shape_str(*t),
              ")");
  check_same_device(op, *t, name, device);
}

void check_hyper(double value, bool ok, const char* what) {
  TORCH_CHECK(std::isfinite(value) && ok, "ruda_torch.adamw_scaled_: invalid ", what, ": ", value);
}

const float* ptr_or_null(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<float>() : nullptr;
}

void check_grad(const char* op, at::TensorList grads, size_t i, at::ScalarType dtype,
                const at::Device& device) {
  const at::Tensor& g = grads[i];
  TORCH_CHECK(g.defined(), "ruda_torch.", op, ": grads[", i, "] is undefined");
  TORCH_CHECK(g.layout() == at::kStrided, "ruda_torch.", op, ": grads[", i,
              "] is sparse; sparse gradients are not supported");
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf ||
                  g.scalar_type() == at::kBFloat16,
              "ruda_torch.", op, ": grads[", i, "] must be float32, float16 or bfloat16 (got ",
              g.scalar_type(), ")");
  TORCH_CHECK(g.scalar_type() == dtype, "ruda_torch.", op, ": grads[", i, "] is ", g.scalar_type(),
              " but grads[0] is ", dtype, "; one call takes one gradient dtype (bucket by dtype)");
  TORCH_CHECK(g.is_contiguous(), "ruda_torch.", op, ": grads[", i,
              "] must be contiguous (got strides ", g.strides(), ")");
  check_same_device(op, g, "grads", device, static_cast<int64_t>(i));
}

}  // namespace

GradDType grad_dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return GradDType::kHalf;
    case at::kBFloat16:
      return GradDType::kBFloat16;
    default:
      return GradDType::kFloat;
  }
}

PreparedAdamW prepare_adamw(
    at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
    const at::Tensor& steps, const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& stats,
    const std::optional<at::Tensor>& clip_coef, double lr, double beta1, double beta2, double eps,
    double weight_decay, double max_grad_norm, bool maximize, int64_t unit) {
  const char* op = "adamw_scaled_";
  check_hyper(lr, lr >= 0.0, "learning rate (lr >= 0)");
  check_hyper(beta1, beta1 >= 0.0 && beta1 < 1.0, "beta1 (0 <= beta1 < 1)");
  check_hyper(beta2, beta2 >= 0.0 && beta2 < 1.0, "beta2 (0 <= beta2 < 1)");
  check_hyper(eps, eps >= 0.0, "eps (eps >= 0)");
  check_hyper(weight_decay, weight_decay >= 0.0, "weight_decay (weight_decay >= 0)");
  check_hyper(max_grad_norm, max_grad_norm >= 0.0, "max_grad_norm (0 = off, > 0 = clip)");

  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "ruda_torch.", op, ": grads has ", grads.size(),
              " tensors but params has ", n);
  TORCH_CHECK(exp_avg.defined() && steps.defined(), "ruda_torch.", op,
              ": exp_avg and steps are required");
  const at::Device device = n > 0 ? params[0].device() : exp_avg.device();
  check_flat_fp32(op, exp_avg, "exp_avg", device);
  check_flat_fp32(op, exp_avg_sq, "exp_avg_sq", device);
  TORCH_CHECK(exp_avg_sq.numel() == exp_avg.numel(), "ruda_torch.", op,
              ": exp_avg_sq must have as many elements as exp_avg (got ", exp_avg_sq.numel(),
              " vs ", exp_avg.numel(), ")");
  if (max_exp_avg_sq.has_value()) {
    check_flat_fp32(op, *max_exp_avg_sq, "max_exp_avg_sq", device);
    TORCH_CHECK(max_exp_avg_sq->numel() == exp_avg.numel(), "ruda_torch.", op,
                ": max_exp_avg_sq must have as many elements as exp_avg (got ",
                max_exp_avg_sq->numel(), " vs ", exp_avg.numel(), ")");
  }
  check_flat_fp32(op, steps, "steps", device);
  TORCH_CHECK(
      slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 2 &&
          slots.size(0) == static_cast<int64_t>(n) && slots.size(1) == 2 && slots.is_contiguous(),
      "ruda_torch.", op, ": slots must be a contiguous CPU int64 tensor of shape [", n,
      ", 2] (got ", slots.scalar_type(), " ", shape_str(slots), " on ", slots.device(), ")");
  check_scalar_fp32(op, grad_scale, "grad_scale", 1, device);
  check_scalar_fp32(op, found_inf, "found_inf", 1, device);
  check_scalar_fp32(op, stats, "stats", kStatsWidth, device);
  check_scalar_fp32(op, clip_coef, "clip_coef", 1, device);

  const at::ScalarType gdtype = n > 0 ? grads[0].scalar_type() : at::kFloat;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t state_numel = exp_avg.numel();
  const int64_t n_steps = steps.numel();

  PreparedAdamW prep;
  prep.table.resize(n);
  std::vector<Span> written, read_only;
  written.reserve(n + 4);
  read_only.reserve(n);
  std::vector<std::pair<int64_t, int64_t>> slices;  // (offset, end) of each state slice
  slices.reserve(n);
  std::vector<int64_t> step_ids(n);
  int64_t units = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "ruda_torch.", op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.scalar_type() == at::kFloat, "ruda_torch.", op, ": params[", i,
                "] must be float32 (FP32 master weights; got ", p.scalar_type(), ")");
    TORCH_CHECK(p.layout() == at::kStrided && p.is_contiguous(), "ruda_torch.", op, ": params[", i,
                "] must be a dense contiguous tensor (got strides ", p.strides(), ")");
    check_same_device(op, p, "params", device, static_cast<int64_t>(i));
    check_grad(op, grads, i, gdtype, device);
    TORCH_CHECK(grads[i].sizes() == p.sizes(), "ruda_torch.", op, ": grads[", i,
                "] must have the same shape as params[", i, "] (got ", shape_str(grads[i]), " vs ",
                shape_str(p), ")");
    const int64_t off = slot[2 * i], sid = slot[2 * i + 1], numel = p.numel();
    TORCH_CHECK(off >= 0 && off <= state_numel - numel, "ruda_torch.", op, ": slots[", i,
                "] puts params[", i, "] (", numel, " elements) at offset ", off,
                ", outside the state buffers of ", state_numel, " elements");
    TORCH_CHECK(sid >= 0 && sid < n_steps, "ruda_torch.", op, ": slots[", i, "] step index ", sid,
                " is outside steps (", n_steps, " counters)");
    if (numel > 0) slices.emplace_back(off, off + numel);
    step_ids[i] = sid;
    written.push_back(span_of(p, "params", i));
    read_only.push_back(span_of(grads[i], "grads", i));
    TensorEntry& e = prep.table[i];
    e.param = p.data_ptr<float>();
    e.grad = grads[i].data_ptr();
    e.numel = numel;
    e.state_offset = off;
    e.step_index = sid;
    e.unit_start = units;
    units += (numel + unit - 1) / unit;
  }
  std::sort(slices.begin(), slices.end());
  for (size_t i = 1; i < slices.size(); ++i) {
    TORCH_CHECK(slices[i].first >= slices[i - 1].second, "ruda_torch.", op,
                ": two parameters share state elements (slices at offsets ", slices[i - 1].first,
                " and ", slices[i].first, " overlap); check slots");
  }
  std::sort(step_ids.begin(), step_ids.end());
  TORCH_CHECK(std::adjacent_find(step_ids.begin(), step_ids.end()) == step_ids.end(), "ruda_torch.",
              op, ": two parameters share one step counter; check slots");
  written.push_back(span_of(exp_avg, "exp_avg"));
  written.push_back(span_of(exp_avg_sq, "exp_avg_sq"));
  if (max_exp_avg_sq.has_value()) written.push_back(span_of(*max_exp_avg_sq, "max_exp_avg_sq"));
  written.push_back(span_of(steps, "steps"));
  check_no_aliasing(op, std::move(written), read_only);

  AdamWLaunch& L = prep.launch;
  L.table = nullptr;  // placed by the backend
  L.n_tensors = static_cast<int64_t>(n);
  L.n_units = units;
  L.grad_dtype = n > 0 ? grad_dtype_of(grads[0]) : GradDType::kFloat;
  L.amsgrad = max_exp_avg_sq.has_value();
  L.exp_avg = exp_avg.data_ptr<float>();
  L.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  L.max_exp_avg_sq = max_exp_avg_sq.has_value() ? max_exp_avg_sq->data_ptr<float>() : nullptr;
  L.steps = steps.data_ptr<float>();
  L.hyper = {lr, beta1, beta2, eps, weight_decay};
  L.control = {ptr_or_null(grad_scale), ptr_or_null(found_inf), ptr_or_null(stats),
               ptr_or_null(clip_coef),  max_grad_norm,          maximize};
  return prep;
}

void check_adamw_scaled(at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
                        const at::Tensor& exp_avg_sq,
                        const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
                        const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
                        const std::optional<at::Tensor>& found_inf,
                        const std::optional<at::Tensor>& stats,
                        const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double max_grad_norm,
                        bool maximize) {
  // The unit only sizes the work split, which validation does not use.
  prepare_adamw(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, grad_scale,
                found_inf, stats, clip_coef, lr, beta1, beta2, eps, weight_decay, max_grad_norm,
                maximize, /*unit=*/1);
}

PreparedStats prepare_analyze(at::TensorList grads, const std::optional<at::Tensor>& grad_scale,
                              const at::Tensor& rows) {
  const char* op = "analyze_gradient";
  const size_t n = grads.size();
  const at::Device device = n > 0 ? grads[0].device() : rows.device();
  const at::ScalarType gdtype = n > 0 ? grads[0].scalar_type() : at::kFloat;
  PreparedStats prep;
  prep.table.resize(n);
  int64_t n_rows = 0;
  std::vector<Span> read_only;
  read_only.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    check_grad(op, grads, i, gdtype, device);
    TensorEntry& e = prep.table[i];
    e.param = nullptr;
    e.grad = grads[i].data_ptr();
    e.numel = grads[i].numel();
    e.state_offset = 0;
    e.step_index = 0;
    e.unit_start = n_rows;
    n_rows += stats_rows_for(e.numel);
    read_only.push_back(span_of(grads[i], "grads", i));
  }
  check_scalar_fp32(op, grad_scale, "grad_scale", 1, device);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(0) == n_rows && rows.size(1) == kStatsWidth,
              "ruda_torch.", op, ": rows must be a contiguous float32 tensor of shape [", n_rows,
              ", ", kStatsWidth, "] (one row per ", kStatsChunk,
              " gradient elements of each tensor; got ", rows.scalar_type(), " ", shape_str(rows),
              ")");
  check_same_device(op, rows, "rows", device);
  check_no_aliasing(op, {span_of(rows, "rows")}, read_only);
  prep.launch = {nullptr,
                 static_cast<int64_t>(n),
                 n_rows,
                 n > 0 ? grad_dtype_of(grads[0]) : GradDType::kFloat,
                 ptr_or_null(grad_scale),
                 rows.data_ptr<float>()};
  return prep;
}

int64_t check_merge(const at::Tensor& rows, const at::Tensor& out) {
  const char* op = "merge_gradient_stats";
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(1) == kStatsWidth,
              "ruda_torch.", op, ": rows must be a contiguous float32 tensor of shape [n, ",
              kStatsWidth, "] (got ", rows.scalar_type(), " ", shape_str(rows), ")");
  const int64_t n = rows.size(0);
  const int64_t n_out = (n + kMergeFanIn - 1) / kMergeFanIn;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == n_out && out.size(1) == kStatsWidth,
              "ruda_torch.", op, ": out must be a contiguous float32 tensor of shape [", n_out,
              ", ", kStatsWidth, "] for ", n, " input rows (fan-in ", kMergeFanIn, "; got ",
              out.scalar_type(), " ", shape_str(out), ")");
  check_same_device(op, out, "out", rows.device());
  check_no_aliasing(op, {span_of(out, "out")}, {span_of(rows, "rows")});
  return n;
}

int64_t check_merge_chunks(const at::Tensor& reports, const at::Tensor& out) {
  const char* op = "merge_gradient_stats_chunks";
  TORCH_CHECK(reports.scalar_type() == at::kFloat && reports.is_contiguous() &&
                  reports.dim() == 2 && reports.size(1) == kStatsWidth,
              "ruda_torch.", op, ": reports must be a contiguous float32 tensor of shape [k, ",
              kStatsWidth, "] (got ", reports.scalar_type(), " ", shape_str(reports), ")");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == kStatsWidth,
              "ruda_torch.", op, ": out must be a contiguous float32 tensor of ", kStatsWidth,
              " elements (got ", out.scalar_type(), " ", shape_str(out), ")");
  check_same_device(op, out, "out", reports.device());
  check_no_aliasing(op, {span_of(out, "out")}, {span_of(reports, "reports")});
  return reports.size(0);
}

}  // namespace ruda
