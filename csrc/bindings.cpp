// Argument validation and launch-struct filling for every operator. Everything is
// checked before the first write, so a rejected call changes nothing.
#include "bindings.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>

#include "grad_stats.h"
#include "kernels.h"
#include "quant4.h"
#include "quant8.h"

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

// torch's name of a dtype, as users write it ("float32", not c10's "Float").
const char* dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kByte:
      return "uint8";
    case at::kChar:
      return "int8 (4-bit codes)";
    case at::kShort:
      return "int16";
    default:
      return c10::toString(t);
  }
}

void check_flat(const char* op, const at::Tensor& t, const char* name, const at::Device& device,
                at::ScalarType dtype = at::kFloat) {
  TORCH_CHECK(t.scalar_type() == dtype, "ruda_torch.", op, ": ", name, " must be ",
              dtype_name(dtype), " (got ", dtype_name(t.scalar_type()), ")");
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "ruda_torch.", op, ": ", name,
              " must be a contiguous 1-D tensor (got shape ", shape_str(t), ")");
  check_same_device(op, t, name, device);
}

// Elements a flat moment buffer holds: its length, or for packed 8-bit moments (uint8
// without separate `scales`, Note [8-bit moments] in csrc/quant8.h) the codes before the
// scales.
// 4-bit moments (int8 buffers of two codes per byte, Note [4-bit moments] in csrc/quant4.h)
// hold two elements per byte.
int64_t state_capacity(const at::Tensor& moments, const std::optional<at::Tensor>& scales) {
  if (moments.scalar_type() == at::kChar) return 2 * moments.numel();
  if (moments.scalar_type() != at::kByte || scales.has_value()) return moments.numel();
  return moments.numel() / kPacked8 * kBlock8;
}

// The indices of a tensor's walk (its elements, or its rows laid out on whole blocks of the
// moments' format: Note [8-bit row blocks], Note [4-bit row blocks]), which its units cover.
int64_t walk_extent(const TensorEntry& e, const at::Tensor& moments) {
  return moments.scalar_type() == at::kChar ? state_extent4(e) : state_extent(e);
}

// The length of each moment's run of scales: the scales' share of each moment (separate
// scales, whose runs may hold more than one per block of the state: Note [8-bit row
// blocks] in csrc/quant8.h), or the blocks of the state (packed).
int64_t scale_run_of(const at::Tensor& moments, const std::optional<at::Tensor>& max_moments,
                     const std::optional<at::Tensor>& scales) {
  if (scales.has_value()) return scales->numel() / (max_moments.has_value() ? 3 : 2);
  return state_capacity(moments, scales) / kBlock8;
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

bool is_16bit(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

// Note [Dense layouts]
// The kernels walk a tensor's memory front to back. A tensor whose elements fill
// [data_ptr, data_ptr + numel) without overlap (contiguous, transposed, channels_last:
// `is_non_overlapping_and_dense`) is such a range, element k of memory being element k
// of the parameter's slice of the flat state; its gradient must lay its elements out the
// same way (equal strides on every dimension of size > 1), which autograd's gradients of
// dense parameters do.
bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// A gradient the statistics or the update can read: defined, dense (Note [Dense layouts]),
// of grads[0]'s dtype (`dtype`), on `device`. The allowed dtypes are the caller's.
void check_grad(const char* op, at::TensorList grads, size_t i, at::ScalarType dtype,
                const at::Device& device) {
  const at::Tensor& g = grads[i];
  TORCH_CHECK(g.defined(), "ruda_torch.", op, ": grads[", i, "] is undefined");
  TORCH_CHECK(g.layout() == at::kStrided, "ruda_torch.", op, ": grads[", i,
              "] is sparse; sparse gradients are not supported");
  TORCH_CHECK(g.scalar_type() == dtype, "ruda_torch.", op, ": grads[", i, "] is ", g.scalar_type(),
              " but grads[0] is ", dtype, "; one call takes one gradient dtype (bucket by dtype)");
  TORCH_CHECK(g.is_non_overlapping_and_dense(), "ruda_torch.", op, ": grads[", i,
              "] must be dense (contiguous, or a permutation of a contiguous tensor; got shape ",
              shape_str(g), " with strides ", g.strides(), ")");
  check_same_device(op, g, "grads", device, static_cast<int64_t>(i));
}

void check_stats_grad_dtype(const char* op, const at::Tensor& g, size_t i) {
  TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf ||
                  g.scalar_type() == at::kBFloat16,
              "ruda_torch.", op, ": grads[", i, "] must be float32, float16 or bfloat16 (got ",
              g.scalar_type(), ")");
}

// The gradient dtypes an update of `pdtype` parameters takes (Note [Parameter dtypes]).
void check_update_grad_dtype(const char* op, const at::Tensor& g, at::ScalarType pdtype) {
  const at::ScalarType gd = g.scalar_type();
  bool ok;
  const char* allowed;
  if (pdtype == at::kDouble) {
    ok = gd == at::kDouble;
    allowed = "float64";
  } else if (pdtype == at::kFloat) {
    ok = gd == at::kFloat || gd == at::kHalf || gd == at::kBFloat16;
    allowed = "float32, float16 or bfloat16";
  } else {
    ok = gd == pdtype || gd == at::kFloat;
    allowed = pdtype == at::kHalf ? "float16 or float32" : "bfloat16 or float32";
  }
  TORCH_CHECK(ok, "ruda_torch.", op, ": grads[0] is ", dtype_name(gd), "; ", dtype_name(pdtype),
              " parameters take ", allowed, " gradients");
}

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return DType::kHalf;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kDouble;
    case at::kByte:
      return DType::kUInt8;
    case at::kChar:
      return DType::kNibble;
    default:
      return DType::kFloat;
  }
}

// Everything of an update launch but its tensor table: the hyperparameters, the flat
// state buffers and the device-resident controls, for `n` parameters of `pdtype` with
// `gdtype` gradients on `device`. Shared by prepare_adamw and the flat-gradient path
// (prepare_flat_step), which keeps its table between steps.
AdamWLaunch prepare_launch(const char* op, size_t n, const at::Device& device,
                           at::ScalarType pdtype, at::ScalarType gdtype, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq,
                           const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
                           const std::optional<at::Tensor>& grad_scale,
                           const std::optional<at::Tensor>& found_inf,
                           const std::optional<at::Tensor>& stats,
                           const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                           double beta2, double eps, double weight_decay, double max_grad_norm,
                           bool maximize, const std::optional<at::Tensor>& master,
                           const std::optional<at::Tensor>& lr_tensor, int64_t rounding,
                           int64_t seed, bool decoupled, const std::optional<at::Tensor>& scales) {
  check_hyper(lr, lr >= 0.0, "learning rate (lr >= 0)");
  check_hyper(beta1, beta1 >= 0.0 && beta1 < 1.0, "beta1 (0 <= beta1 < 1)");
  check_hyper(beta2, beta2 >= 0.0 && beta2 < 1.0, "beta2 (0 <= beta2 < 1)");
  check_hyper(eps, eps >= 0.0, "eps (eps >= 0)");
  check_hyper(weight_decay, weight_decay >= 0.0, "weight_decay (weight_decay >= 0)");
  check_hyper(max_grad_norm, max_grad_norm >= 0.0, "max_grad_norm (0 = off, > 0 = clip)");
  TORCH_CHECK(exp_avg.defined() && steps.defined(), "ruda_torch.", op,
              ": exp_avg and steps are required");
  TORCH_CHECK(pdtype == at::kFloat || pdtype == at::kDouble || is_16bit(pdtype), "ruda_torch.", op,
              ": params[0] must be float32, float64, float16 or bfloat16 (got ", pdtype, ")");
  // Note [Parameter dtypes]: FP64 state for FP64 parameters, FP32 for all others, or BF16
  // moments for those (Note [Low-precision states]): exp_avg's dtype says which, and every
  // moment buffer must have it.
  const at::ScalarType sdtype = pdtype == at::kDouble                    ? at::kDouble
                                : exp_avg.scalar_type() == at::kBFloat16 ? at::kBFloat16
                                : exp_avg.scalar_type() == at::kByte     ? at::kByte
                                : exp_avg.scalar_type() == at::kChar     ? at::kChar
                                                                         : at::kFloat;
  const int64_t capacity = state_capacity(exp_avg, scales);
  const int64_t n_moments = max_exp_avg_sq.has_value() ? 3 : 2;
  if (sdtype == at::kChar) {
    TORCH_CHECK(scales.has_value() && exp_avg.numel() % (kBlock4 / 2) == 0, "ruda_torch.", op,
                ": 4-bit moment buffers (int8) hold the codes of whole blocks of ", kBlock4,
                " elements, two per byte (", kBlock4 / 2,
                " bytes a block), with their scales "
                "passed separately (got ",
                exp_avg.numel(), " bytes", scales.has_value() ? "" : ", no scales", ")");
    check_flat(op, *scales, "scales", device);
    TORCH_CHECK(
        scales->numel() >= n_moments * (capacity / kBlock4) && scales->numel() % n_moments == 0,
        "ruda_torch.", op, ": scales must hold one run of float32 scales per moment (", n_moments,
        " runs of equal length), each at least one per block of the state (",
        n_moments * (capacity / kBlock4), " in all), got ", scales->numel());
  } else if (sdtype == at::kByte && scales.has_value()) {
    TORCH_CHECK(exp_avg.numel() % kBlock8 == 0, "ruda_torch.", op,
                ": with scales, 8-bit moment buffers (uint8) hold the codes of whole blocks of ",
                kBlock8, " elements (got ", exp_avg.numel(), ")");
    check_flat(op, *scales, "scales", device);
    TORCH_CHECK(
        scales->numel() >= n_moments * (capacity / kBlock8) && scales->numel() % n_moments == 0,
        "ruda_torch.", op, ": scales must hold one run of float32 scales per moment (", n_moments,
        " runs of equal length), each at least one per block of the state (",
        n_moments * (capacity / kBlock8), " in all), got ", scales->numel());
  } else if (sdtype == at::kByte) {
    TORCH_CHECK(exp_avg.numel() % kPacked8 == 0, "ruda_torch.", op,
                ": 8-bit moment buffers (uint8) hold ", kPacked8, " bytes per block of ", kBlock8,
                " elements: the codes, then one float32 scale per block (got ", exp_avg.numel(),
                " bytes; see ruda_torch.ops.packed_8bit_bytes), or pass the scales separately");
  } else {
    TORCH_CHECK(!scales.has_value(), "ruda_torch.", op,
                ": scales are for 8-bit (uint8) and 4-bit (int8) moments; exp_avg is ",
                dtype_name(sdtype), " (pass scales=None)");
  }
  check_flat(op, exp_avg, "exp_avg", device, sdtype);
  check_flat(op, exp_avg_sq, "exp_avg_sq", device, sdtype);
  TORCH_CHECK(exp_avg_sq.numel() == exp_avg.numel(), "ruda_torch.", op,
              ": exp_avg_sq must have as many elements as exp_avg (got ", exp_avg_sq.numel(),
              " vs ", exp_avg.numel(), ")");
  if (max_exp_avg_sq.has_value()) {
    check_flat(op, *max_exp_avg_sq, "max_exp_avg_sq", device, sdtype);
    TORCH_CHECK(max_exp_avg_sq->numel() == exp_avg.numel(), "ruda_torch.", op,
                ": max_exp_avg_sq must have as many elements as exp_avg (got ",
                max_exp_avg_sq->numel(), " vs ", exp_avg.numel(), ")");
  }
  check_flat(op, steps, "steps", device);
  // `master`: FP32 masters, or int16 remainders of BF16 parameters' FP32 masters (Note
  // [Remainder master] in csrc/adamw_math.h).
  const bool remainder = master.has_value() && master->scalar_type() == at::kShort;
  if (master.has_value()) {
    TORCH_CHECK(is_16bit(pdtype), "ruda_torch.", op,
                ": master weights are for float16 and "
                "bfloat16 parameters; params are ",
                dtype_name(pdtype), " (pass master=None)");
    TORCH_CHECK(!remainder || pdtype == at::kBFloat16, "ruda_torch.", op,
                ": an int16 master (the remainder of an FP32 master) is for bfloat16 "
                "parameters, whose bits are its high half; params are ",
                dtype_name(pdtype), " (pass a float32 master)");
    check_flat(op, *master, "master", device, remainder ? at::kShort : at::kFloat);
    TORCH_CHECK(master->numel() == capacity, "ruda_torch.", op,
                ": master must have as many elements as exp_avg holds (got ", master->numel(),
                " vs ", capacity, ")");
  }
  // `rounding`: bit 0 stochastic rounding of the parameters, bit 1 of BF16 moments.
  TORCH_CHECK(rounding >= 0 && rounding <= 3, "ruda_torch.", op,
              ": rounding must be 0 to 3 (bit 0: stochastic rounding of bfloat16 parameters, "
              "bit 1: of bfloat16 moments), got ",
              rounding);
  TORCH_CHECK((rounding & 1) == 0 || (pdtype == at::kBFloat16 && !master.has_value()),
              "ruda_torch.", op,
              ": stochastic rounding of the parameters (rounding bit 0) is for bfloat16 "
              "parameters without master weights; params are ",
              dtype_name(pdtype), master.has_value() ? " with master weights" : "");
  TORCH_CHECK((rounding & 2) == 0 || sdtype == at::kBFloat16, "ruda_torch.", op,
              ": stochastic rounding of the moments (rounding bit 1) is for bfloat16 moments; "
              "exp_avg is ",
              dtype_name(sdtype));
  const float* lr_f32 = nullptr;
  const double* lr_f64 = nullptr;
  if (lr_tensor.has_value()) {
    const at::Tensor& t = *lr_tensor;
    TORCH_CHECK(t.numel() == 1 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble),
                "ruda_torch.", op,
                ": lr_tensor must be a float32 or float64 tensor of one "
                "element (got ",
                t.scalar_type(), " ", shape_str(t), ")");
    if (t.device().is_cpu()) {  // host memory: read now, without any device sync
      lr = t.scalar_type() == at::kFloat ? static_cast<double>(*t.data_ptr<float>())
                                         : *t.data_ptr<double>();
      check_hyper(lr, lr >= 0.0, "learning rate (lr_tensor >= 0)");
    } else {  // read by the kernel (a negative or NaN value there is the caller's to avoid)
      check_same_device(op, t, "lr_tensor", device);
      if (t.scalar_type() == at::kFloat) {
        lr_f32 = t.data_ptr<float>();
      } else {
        lr_f64 = t.data_ptr<double>();
      }
    }
  }
  check_scalar_fp32(op, grad_scale, "grad_scale", 1, device);
  check_scalar_fp32(op, found_inf, "found_inf", 1, device);
  check_scalar_fp32(op, stats, "stats", kStatsWidth, device);
  // clip_coef: FP32, or FP64 for FP64 parameters (clip_grad_norm_'s coefficient there,
  // which FP32 would round); any other dtype gets check_scalar_fp32's error.
  const bool clip64 =
      clip_coef.has_value() && clip_coef->scalar_type() == at::kDouble && pdtype == at::kDouble;
  if (clip64) {
    TORCH_CHECK(clip_coef->numel() == 1 && clip_coef->is_contiguous(), "ruda_torch.", op,
                ": clip_coef must be a contiguous tensor of 1 element(s) (got shape ",
                shape_str(*clip_coef), ")");
    check_same_device(op, *clip_coef, "clip_coef", device);
  } else {
    check_scalar_fp32(op, clip_coef, "clip_coef", 1, device);
  }

  AdamWLaunch L;
  L.table = nullptr;  // placed by the backend
  L.edges = false;    // set with the table (edges_of)
  L.rows = false;     // set with the table (rows_of)
  L.n_tensors = static_cast<int64_t>(n);
  L.n_units = 0;  // set with the table
  L.param_dtype = dtype_of(pdtype);
  L.grad_dtype = dtype_of(gdtype);
  L.amsgrad = max_exp_avg_sq.has_value();
  L.exp_avg = exp_avg.data_ptr();
  L.exp_avg_sq = exp_avg_sq.data_ptr();
  L.max_exp_avg_sq = max_exp_avg_sq.has_value() ? max_exp_avg_sq->data_ptr() : nullptr;
  L.master = master.has_value() && !remainder ? master->data_ptr<float>() : nullptr;
  L.remainder = remainder ? reinterpret_cast<uint16_t*>(master->data_ptr<int16_t>()) : nullptr;
  L.steps = steps.data_ptr<float>();
  L.state_dtype = dtype_of(sdtype);
  L.exp_avg_scales = L.exp_avg_sq_scales = L.max_exp_avg_sq_scales = nullptr;
  if ((sdtype == at::kByte || sdtype == at::kChar) && scales.has_value()) {  // a run per moment
    float* run = scales->data_ptr<float>();
    const int64_t blocks = scale_run_of(exp_avg, max_exp_avg_sq, scales);
    L.exp_avg_scales = run;
    L.exp_avg_sq_scales = run + blocks;
    L.max_exp_avg_sq_scales = L.amsgrad ? run + 2 * blocks : nullptr;
  } else if (sdtype == at::kByte) {  // the scales follow the codes (Note [8-bit moments])
    auto scales_of = [capacity](void* buffer) {
      return reinterpret_cast<float*>(static_cast<uint8_t*>(buffer) + capacity);
    };
    L.exp_avg_scales = scales_of(L.exp_avg);
    L.exp_avg_sq_scales = scales_of(L.exp_avg_sq);
    L.max_exp_avg_sq_scales = L.amsgrad ? scales_of(L.max_exp_avg_sq) : nullptr;
  }
  L.rounding = (rounding & 1) != 0 ? Rounding::kStochastic : Rounding::kNearestEven;
  L.state_rounding = (rounding & 2) != 0 ? Rounding::kStochastic : Rounding::kNearestEven;
  L.seed = static_cast<uint64_t>(seed);
  L.hyper = {lr, beta1, beta2, eps, weight_decay, lr_f32, lr_f64, !decoupled};
  set_float_consts(L.hyper);
  L.control = {ptr_or_null(grad_scale),
               ptr_or_null(found_inf),
               ptr_or_null(stats),
               clip64 ? nullptr : ptr_or_null(clip_coef),
               clip64 ? clip_coef->data_ptr<double>() : nullptr,
               max_grad_norm,
               maximize};
  return L;
}

// With 8-bit or 4-bit moments: whether a tensor of `entries` has a block the CUDA kernels do
// not access directly (Note [8-bit CUDA registers] and Note [4-bit CUDA step] in
// csrc/cuda/adamw_cuda.cu): a last block shorter than the block, a tensor whose rows are not
// whole blocks (Note [8-bit row blocks], Note [4-bit row blocks]), or parameters, gradients,
// masters or codes not aligned for their wide accesses (8-bit: 16 bytes for elements, 8 for
// codes; 4-bit: 4 elements, 2 bytes for codes).
uintptr_t element_bytes(DType t) {
  return t == DType::kHalf || t == DType::kBFloat16 ? 2 : t == DType::kDouble ? 8 : 4;
}

bool edges_of(const AdamWLaunch& L, const std::vector<TensorEntry>& entries) {
  const bool four = L.state_dtype == DType::kNibble;
  if (L.state_dtype != DType::kUInt8 && !four) return false;
  const auto misaligned = [](const void* p, uintptr_t bytes) {
    return reinterpret_cast<uintptr_t>(p) % bytes != 0;
  };
  const int64_t block = four ? kBlock4 : kBlock8;
  const uintptr_t param_bytes = four ? 4 * element_bytes(L.param_dtype) : 16;
  const uintptr_t grad_bytes = four ? 4 * element_bytes(L.grad_dtype) : 16;
  const uintptr_t code_bytes = four ? 2 : 8;
  for (const TensorEntry& e : entries) {
    if (e.numel == 0) continue;
    const int64_t off = e.state_offset, code = four ? off / 2 : off;
    if (e.row != 0 || e.numel % block != 0 || misaligned(e.param, param_bytes) ||
        misaligned(e.grad, grad_bytes) || (L.master != nullptr && misaligned(L.master + off, 16)) ||
        (L.remainder != nullptr && misaligned(L.remainder + off, four ? 8 : 16)) ||
        misaligned(static_cast<uint8_t*>(L.exp_avg) + code, code_bytes) ||
        misaligned(static_cast<uint8_t*>(L.exp_avg_sq) + code, code_bytes) ||
        (L.max_exp_avg_sq != nullptr &&
         misaligned(static_cast<uint8_t*>(L.max_exp_avg_sq) + code, code_bytes))) {
      return true;
    }
  }
  return false;
}

// 8-bit or 4-bit moments: whether a tensor has rows that are not whole blocks but hold one
// (AdamWLaunch::rows).
bool rows_of(const AdamWLaunch& L, const std::vector<TensorEntry>& entries) {
  const bool four = L.state_dtype == DType::kNibble;
  if (L.state_dtype != DType::kUInt8 && !four) return false;
  const int64_t block = four ? kBlock4 : kBlock8;
  for (const TensorEntry& e : entries) {
    if (e.numel != 0 && e.row > block) return true;
  }
  return false;
}

// The CUDA kernels count units and tensors in 32 bits (Note [CUDA tile walk] in
// csrc/cuda/adamw_cuda.cu): 2^31 units of kCudaTile elements are 8.8e12 elements.
void check_units(const char* op, int64_t units, size_t tensors) {
  TORCH_CHECK(units < kMaxUnits && static_cast<int64_t>(tensors) < kMaxUnits, "ruda_torch.", op,
              ": one call steps fewer than 2^31 tiles and tensors (got ", units, " tiles of ",
              tensors, " tensors); split the parameters over several calls (param groups)");
}

}  // namespace

std::unique_ptr<FlatBucket> make_flat_bucket(
    std::vector<at::Tensor> owners, std::vector<at::Tensor> params, std::vector<at::Tensor> views,
    const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
    const std::optional<at::Tensor>& max_exp_avg_sq, const at::Tensor& steps,
    const at::Tensor& slots, const std::optional<at::Tensor>& master,
    const std::optional<at::Tensor>& scales) {
  const char* op = "flat_bucket";
  TORCH_CHECK(owners.size() == params.size() && views.size() == params.size(), "ruda_torch.", op,
              ": owners, params and views must have one entry per parameter");
  const at::Device device = params.empty() ? exp_avg.device() : params[0].device();
  TORCH_CHECK(grad.defined() && grad.dim() == 1 && grad.is_contiguous(), "ruda_torch.", op,
              ": grad must be a contiguous 1-D tensor");
  check_same_device(op, grad, "grad", device);
  const int64_t unit = device.is_cpu() ? kCpuTile : kCudaTile;
  PreparedAdamW prep =
      prepare_adamw(params, views, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, std::nullopt,
                    std::nullopt, std::nullopt, std::nullopt, 0.0, 0.9, 0.999, 0.0, 0.0, 0.0, false,
                    master, std::nullopt, 0, 0, /*decoupled=*/true, scales, unit);
  const auto g0 = reinterpret_cast<uintptr_t>(grad.data_ptr());
  const auto g1 = g0 + static_cast<uintptr_t>(grad.numel()) * grad.element_size();
  for (size_t i = 0; i < views.size(); ++i) {
    const auto b = reinterpret_cast<uintptr_t>(views[i].data_ptr());
    TORCH_CHECK(
        views[i].numel() == 0 || (b >= g0 && b + views[i].numel() * views[i].element_size() <= g1),
        "ruda_torch.", op, ": views[", i, "] is not inside grad");
  }
  auto fb = std::make_unique<FlatBucket>();
  fb->owners = std::move(owners);
  fb->params = std::move(params);
  fb->views = std::move(views);
  fb->grad = grad;
  fb->exp_avg = exp_avg;
  fb->exp_avg_sq = exp_avg_sq;
  fb->steps = steps;
  fb->max_exp_avg_sq = max_exp_avg_sq;
  fb->master = master;
  fb->scales = scales;
  fb->device = device;
  fb->pdtype = fb->params.empty() ? at::kFloat : fb->params[0].scalar_type();
  fb->unit = unit;
  fb->table = std::move(prep.table);
  fb->active = fb->table;
  return fb;
}

bool flat_param_current(const FlatBucket& fb, size_t i) {
  const TensorEntry& e = fb.table[i];
  return e.numel == 0 || fb.params[i].unsafeGetTensorImpl()->data() == e.param;
}

PreparedStats prepare_flat_analyze(const FlatBucket& fb, int64_t lo, int64_t hi,
                                   const std::optional<at::Tensor>& grad_scale,
                                   const at::Tensor& rows) {
  const char* op = "analyze_gradient";
  const int64_t n = static_cast<int64_t>(fb.active.size());
  TORCH_CHECK(0 <= lo && lo <= hi && hi <= n, "ruda_torch.", op, ": piece [", lo, ", ", hi,
              ") is outside the ", n, " selected parameters");
  const at::ScalarType gdtype = fb.grad.scalar_type();
  TORCH_CHECK(gdtype == at::kFloat || is_16bit(gdtype), "ruda_torch.", op,
              ": gradients must be float32, float16 or bfloat16 (got ", dtype_name(gdtype), ")");
  PreparedStats prep;
  prep.table.resize(hi - lo);
  int64_t n_rows = 0;
  for (int64_t i = lo; i < hi; ++i) {
    TensorEntry& e = prep.table[i - lo];
    e = {nullptr, fb.active[i].grad, fb.active[i].numel, 0, 0, n_rows, 0, 0};
    n_rows += stats_rows_for(e.numel);
  }
  check_scalar_fp32(op, grad_scale, "grad_scale", 1, fb.device);
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(0) == n_rows && rows.size(1) == kStatsWidth,
              "ruda_torch.", op, ": rows must be a contiguous float32 tensor of shape [", n_rows,
              ", ", kStatsWidth, "] (got ", rows.scalar_type(), " ", shape_str(rows), ")");
  check_same_device(op, rows, "rows", fb.device);
  check_no_aliasing(op, {span_of(rows, "rows")}, {span_of(fb.grad, "grad")});
  prep.launch = {
      nullptr, hi - lo, n_rows, dtype_of(gdtype), ptr_or_null(grad_scale), rows.data_ptr<float>()};
  return prep;
}

int64_t flat_table_words(const FlatBucket& fb) {
  return static_cast<int64_t>(fb.table.size()) * kTableWords;
}

bool flat_update_table_stale(const FlatBucket& fb) { return !fb.device_table_current; }

void flat_update_table_written(FlatBucket& fb) { fb.device_table_current = true; }

bool flat_stats_piece_stale(const FlatBucket& fb, int64_t lo, int64_t hi) {
  const std::pair<int64_t, int64_t> key{lo, hi};
  return std::find(fb.stats_pieces.begin(), fb.stats_pieces.end(), key) == fb.stats_pieces.end();
}

void flat_stats_piece_written(FlatBucket& fb, int64_t lo, int64_t hi) {
  fb.stats_pieces.emplace_back(lo, hi);
}

void flat_bucket_select(FlatBucket& fb, const std::vector<int64_t>* active) {
  if (active == nullptr) {
    if (fb.all_active) return;
    fb.stats_pieces.clear();
    fb.active = fb.table;
    fb.active_ids.clear();
    fb.all_active = true;
    fb.device_table_current = false;
    return;
  }
  if (!fb.all_active && *active == fb.active_ids) return;
  fb.stats_pieces.clear();
  const int64_t n = static_cast<int64_t>(fb.table.size());
  fb.active.clear();
  fb.active.reserve(active->size());
  int64_t units = 0, last = -1;
  for (int64_t i : *active) {
    TORCH_CHECK(i > last && i < n,
                "ruda_torch.flat_bucket: active indices must be ascending "
                "and below ",
                n);  // fmt: skip
    last = i;
    TensorEntry e = fb.table[i];
    e.unit_start = units;
    units += (walk_extent(e, fb.exp_avg) + fb.unit - 1) / fb.unit;
    fb.active.push_back(e);
  }
  fb.active_ids = *active;
  fb.all_active = false;
  fb.device_table_current = false;
}

AdamWLaunch prepare_flat_step(const FlatBucket& fb, bool amsgrad,
                              const std::optional<at::Tensor>& grad_scale,
                              const std::optional<at::Tensor>& found_inf,
                              const std::optional<at::Tensor>& stats,
                              const std::optional<at::Tensor>& clip_coef, double lr, double beta1,
                              double beta2, double eps, double weight_decay, double max_grad_norm,
                              bool maximize, const std::optional<at::Tensor>& lr_tensor,
                              int64_t rounding, int64_t seed, bool decoupled) {
  // A step without AMSGrad over a bucket that has its maximum: the scales of the first two
  // moments' runs (each run as long as when the handle was made).
  std::optional<at::Tensor> scales = fb.scales;
  if (scales.has_value() && !amsgrad && fb.max_exp_avg_sq.has_value()) {
    scales = scales->narrow(0, 0, 2 * (scales->numel() / 3));
  }
  AdamWLaunch L = prepare_launch(
      "adamw_scaled_", fb.active.size(), fb.device, fb.pdtype, fb.grad.scalar_type(), fb.exp_avg,
      fb.exp_avg_sq, amsgrad ? fb.max_exp_avg_sq : std::nullopt, fb.steps, grad_scale, found_inf,
      stats, clip_coef, lr, beta1, beta2, eps, weight_decay, max_grad_norm, maximize, fb.master,
      lr_tensor, rounding, seed, decoupled, scales);
  int64_t units = 0;
  if (!fb.active.empty()) {
    const TensorEntry& e = fb.active.back();
    units = e.unit_start + (walk_extent(e, fb.exp_avg) + fb.unit - 1) / fb.unit;
  }
  check_units("adamw_scaled_", units, fb.active.size());
  L.n_units = units;
  L.edges = edges_of(L, fb.active);
  L.rows = rows_of(L, fb.active);
  return L;
}

PreparedAdamW prepare_adamw(
    at::TensorList params, at::TensorList grads, const at::Tensor& exp_avg,
    const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& max_exp_avg_sq,
    const at::Tensor& steps, const at::Tensor& slots, const std::optional<at::Tensor>& grad_scale,
    const std::optional<at::Tensor>& found_inf, const std::optional<at::Tensor>& stats,
    const std::optional<at::Tensor>& clip_coef, double lr, double beta1, double beta2, double eps,
    double weight_decay, double max_grad_norm, bool maximize,
    const std::optional<at::Tensor>& master, const std::optional<at::Tensor>& lr_tensor,
    int64_t rounding, int64_t seed, bool decoupled, const std::optional<at::Tensor>& scales,
    int64_t unit) {
  const char* op = "adamw_scaled_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n, "ruda_torch.", op, ": grads has ", grads.size(),
              " tensors but params has ", n);
  TORCH_CHECK(exp_avg.defined() && steps.defined(), "ruda_torch.", op,
              ": exp_avg and steps are required");
  const at::Device device = n > 0 ? params[0].device() : exp_avg.device();
  const at::ScalarType pdtype = n > 0 && params[0].defined() ? params[0].scalar_type() : at::kFloat;
  const at::ScalarType gdtype = n > 0 && grads[0].defined() ? grads[0].scalar_type() : at::kFloat;
  PreparedAdamW prep;
  prep.launch =
      prepare_launch(op, n, device, pdtype, gdtype, exp_avg, exp_avg_sq, max_exp_avg_sq, steps,
                     grad_scale, found_inf, stats, clip_coef, lr, beta1, beta2, eps, weight_decay,
                     max_grad_norm, maximize, master, lr_tensor, rounding, seed, decoupled, scales);
  TORCH_CHECK(slots.device().is_cpu() && slots.scalar_type() == at::kLong && slots.dim() == 2 &&
                  slots.size(0) == static_cast<int64_t>(n) &&
                  (slots.size(1) == 2 || slots.size(1) == 4) && slots.is_contiguous(),
              "ruda_torch.", op, ": slots must be a contiguous CPU int64 tensor of shape [", n,
              ", 2] or [", n, ", 4] (got ", slots.scalar_type(), " ", shape_str(slots), " on ",
              slots.device(), ")");
  const int64_t slot_width = slots.size(1);
  if (n > 0 && grads[0].defined()) check_update_grad_dtype(op, grads[0], pdtype);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t state_numel = state_capacity(exp_avg, scales);
  // Blockwise moments: 8-bit (uint8) or 4-bit (int8, Note [4-bit moments]), each slice
  // starting a block of `block` elements, with its scales.
  const bool blocks4 = exp_avg.scalar_type() == at::kChar;
  const bool blocks8 = exp_avg.scalar_type() == at::kByte || blocks4;
  const int64_t block = blocks4 ? kBlock4 : kBlock8;
  const int64_t n_steps = steps.numel();

  prep.table.resize(n);
  std::vector<Span> written, read_only;
  written.reserve(n + 4);
  read_only.reserve(n);
  std::vector<std::pair<int64_t, int64_t>> slices;  // (offset, end) of each state slice
  slices.reserve(n);
  std::vector<std::pair<int64_t, int64_t>> scale_spans;  // of each 8-bit slice's scales
  const int64_t scale_run = scale_run_of(exp_avg, max_exp_avg_sq, scales);
  std::vector<int64_t> step_ids(n);
  int64_t units = 0;
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.defined(), "ruda_torch.", op, ": params[", i, "] is undefined");
    TORCH_CHECK(p.scalar_type() == pdtype, "ruda_torch.", op, ": params[", i, "] is ",
                dtype_name(p.scalar_type()), " but params[0] is ", dtype_name(pdtype),
                "; one call takes one parameter dtype");
    TORCH_CHECK(p.layout() == at::kStrided && p.is_non_overlapping_and_dense(), "ruda_torch.", op,
                ": params[", i,
                "] must be dense (contiguous, or a permutation of a contiguous tensor; got shape ",
                shape_str(p), " with strides ", p.strides(), ")");
    check_same_device(op, p, "params", device, static_cast<int64_t>(i));
    check_grad(op, grads, i, gdtype, device);
    TORCH_CHECK(grads[i].sizes() == p.sizes(), "ruda_torch.", op, ": grads[", i,
                "] must have the same shape as params[", i, "] (got ", shape_str(grads[i]), " vs ",
                shape_str(p), ")");
    TORCH_CHECK(same_layout(p, grads[i]), "ruda_torch.", op, ": grads[", i,
                "] must lay its elements out in memory as params[", i, "] does (strides ",
                grads[i].strides(), " vs ", p.strides(),
                "); make it with torch.empty_like(param).copy_(grad)");
    const int64_t* si = slot + slot_width * i;
    const int64_t off = si[0], sid = si[1], numel = p.numel();
    // Note [8-bit row blocks] in csrc/quant8.h: rows of `row` elements that are not whole
    // blocks, their scales from `scale_off` of each moment's run.
    const int64_t row = slot_width == 4 ? si[2] : 0, scale_off = slot_width == 4 ? si[3] : 0;
    TORCH_CHECK(row == 0 || (blocks8 && scales.has_value() && row > 0 && row < kMaxUnits &&
                             numel % row == 0 && p.is_contiguous()),
                "ruda_torch.", op, ": slots[", i, "] gives params[", i, "] rows of ", row,
                " elements; a row length (column 2 of slots) is for 8-bit moments (uint8 "
                "exp_avg) with separate scales, or 4-bit ones (int8 exp_avg), of a contiguous "
                "parameter whose element count (",
                numel, ") it divides, below 2^31, or 0 for none");
    const int64_t blocks = row == 0  ? (numel + block - 1) / block
                           : blocks4 ? numel / row * row_stride4(row) / kBlock4
                                     : row_extent8(numel, row) / kBlock8;
    // The state elements the slice takes: 4-bit codes of rows of odd length take one more
    // nibble a row (Note [4-bit row blocks] in csrc/quant4.h).
    const int64_t extent = blocks4 ? code_extent4(numel, row) : numel;
    TORCH_CHECK(off >= 0 && off <= state_numel - extent, "ruda_torch.", op, ": slots[", i,
                "] puts params[", i, "] (", extent, " elements) at offset ", off,
                ", outside the state buffers of ", state_numel, " elements");
    if (blocks8 && numel > 0) {
      const int64_t first = row == 0 ? off / block : scale_off;
      TORCH_CHECK(first >= 0 && first <= scale_run - blocks, "ruda_torch.", op, ": slots[", i,
                  "] puts the ", blocks, " scale(s) of params[", i, "] at ", first,
                  ", outside each moment's run of ", scale_run, " scales");
      scale_spans.emplace_back(first, first + blocks);
    }
    TORCH_CHECK(!blocks8 || off % block == 0, "ruda_torch.", op, ": slots[", i, "] puts params[", i,
                "] at offset ", off, "; with ", blocks4 ? 4 : 8,
                "-bit moments every slice starts a block of ", block, " elements");
    TORCH_CHECK(sid >= 0 && sid < n_steps, "ruda_torch.", op, ": slots[", i, "] step index ", sid,
                " is outside steps (", n_steps, " counters)");
    if (numel > 0) slices.emplace_back(off, off + extent);
    step_ids[i] = sid;
    written.push_back(span_of(p, "params", i));
    read_only.push_back(span_of(grads[i], "grads", i));
    TensorEntry& e = prep.table[i];
    e.param = p.data_ptr();
    e.grad = grads[i].data_ptr();
    e.numel = numel;
    e.state_offset = off;
    e.step_index = sid;
    e.unit_start = units;
    e.row = row;
    e.scale_offset = scale_off;
    units += (walk_extent(e, exp_avg) + unit - 1) / unit;
  }
  std::sort(scale_spans.begin(), scale_spans.end());
  for (size_t i = 1; i < scale_spans.size(); ++i) {
    TORCH_CHECK(scale_spans[i].first >= scale_spans[i - 1].second, "ruda_torch.", op,
                ": two parameters share ", blocks4 ? "4-bit" : "8-bit", " scales (from ",
                scale_spans[i - 1].first, " and ", scale_spans[i].first, "); check slots");
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
  if (master.has_value()) written.push_back(span_of(*master, "master"));
  if (scales.has_value()) written.push_back(span_of(*scales, "scales"));
  written.push_back(span_of(steps, "steps"));
  check_no_aliasing(op, std::move(written), read_only);
  check_units(op, units, n);
  prep.launch.n_units = units;
  prep.launch.edges = edges_of(prep.launch, prep.table);
  prep.launch.rows = rows_of(prep.launch, prep.table);
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
                        bool maximize, const std::optional<at::Tensor>& master,
                        const std::optional<at::Tensor>& lr_tensor, int64_t rounding, int64_t seed,
                        bool decoupled, const std::optional<at::Tensor>& scales) {
  // The unit only sizes the work split, which validation does not use.
  prepare_adamw(params, grads, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots, grad_scale,
                found_inf, stats, clip_coef, lr, beta1, beta2, eps, weight_decay, max_grad_norm,
                maximize, master, lr_tensor, rounding, seed, decoupled, scales, /*unit=*/1);
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
    check_stats_grad_dtype(op, grads[i], i);
    TensorEntry& e = prep.table[i];
    e.param = nullptr;
    e.grad = grads[i].data_ptr();
    e.numel = grads[i].numel();
    e.state_offset = 0;
    e.step_index = 0;
    e.unit_start = n_rows;
    e.row = 0;
    e.scale_offset = 0;
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
                 n > 0 ? dtype_of(grads[0].scalar_type()) : DType::kFloat,
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

namespace {

void check_code8(const char* op, int64_t code) {
  TORCH_CHECK(code == 0 || code == 1, "ruda_torch.", op,
              ": code must be 0 (signed: exp_avg) or 1 (unsigned: exp_avg_sq), got ", code);
}

// codes: contiguous uint8 of n elements (8 bits) or ceil(n / 2) (4 bits, two per byte);
// scales: contiguous float32 of one per block.
void check_codes8(const char* op, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                  const at::Device& device, int bits = 8) {
  const int64_t bytes = bits == 4 ? (n + 1) / 2 : n;
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == bytes,
              "ruda_torch.", op, ": codes must be a contiguous uint8 tensor of ", bytes,
              bits == 4 ? " bytes (two 4-bit codes per byte)" : " elements", " (got ",
              codes.scalar_type(), " ", shape_str(codes),
              codes.is_contiguous() ? "" : ", not contiguous", ")");
  const int64_t block = bits == 4 ? kBlock4 : kBlock8;
  const int64_t blocks = (n + block - 1) / block;
  TORCH_CHECK(
      scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == blocks,
      "ruda_torch.", op, ": scales must be a contiguous float32 tensor of ", blocks,
      " elements, one per block of ", block, " (got ", scales.scalar_type(), " ", shape_str(scales),
      scales.is_contiguous() ? "" : ", not contiguous", ")");
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "ruda_torch.", op, ": ", n,
              " elements are more blocks than one launch takes");
  check_same_device(op, codes, "codes", device);
  check_same_device(op, scales, "scales", device);
}

}  // namespace

Quant8Launch prepare_quantize_8bit(const at::Tensor& x, const at::Tensor& codes,
                                   const at::Tensor& scales, int64_t code, int bits) {
  const char* op = bits == 4 ? "quantize_4bit" : "quantize_8bit";
  check_code8(op, code);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "ruda_torch.", op,
              ": x must be a contiguous float32 tensor (got ", x.scalar_type(), " ", shape_str(x),
              x.is_contiguous() ? "" : ", not contiguous", "; pass x.contiguous())");
  check_codes8(op, codes, scales, x.numel(), x.device(), bits);
  check_no_aliasing(op, {span_of(codes, "codes"), span_of(scales, "scales")}, {span_of(x, "x")});
  return Quant8Launch{x.data_ptr<float>(),
                      codes.data_ptr<uint8_t>(),
                      scales.data_ptr<float>(),
                      nullptr,
                      x.numel(),
                      code};
}

Quant8Launch prepare_dequantize_8bit(const at::Tensor& codes, const at::Tensor& scales,
                                     const at::Tensor& out, int64_t code, int bits) {
  const char* op = bits == 4 ? "dequantize_4bit" : "dequantize_8bit";
  check_code8(op, code);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(), "ruda_torch.", op,
              ": out must be a contiguous float32 tensor (got ", out.scalar_type(), " ",
              shape_str(out), out.is_contiguous() ? "" : ", not contiguous", ")");
  check_codes8(op, codes, scales, out.numel(), out.device(), bits);
  check_no_aliasing(op, {span_of(out, "out")},
                    {span_of(codes, "codes"), span_of(scales, "scales")});
  return Quant8Launch{nullptr,
                      const_cast<uint8_t*>(codes.data_ptr<uint8_t>()),
                      const_cast<float*>(scales.data_ptr<float>()),
                      out.data_ptr<float>(),
                      out.numel(),
                      code};
}

}  // namespace ruda
