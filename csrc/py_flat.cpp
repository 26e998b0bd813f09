// The Python handles of flat gradient buckets (Note [Flat gradient buckets] in
// csrc/bindings.h): a capsule around a FlatBucket, and the per-step calls on it
// (ruda_torch/_fused.py's FlatGrads). Validation and launches are bindings.cpp's.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "kernels.h"
#include "py_records.h"

namespace ruda::py {

namespace {

// ---- Note [Flat gradient buckets] (csrc/bindings.h): the handle of one bucket, a capsule
// around its FlatBucket, and the per-step calls on it.
constexpr const char* kFlatCapsule = "ruda_torch.FlatBucket";

// The GIL is released while a kernel runs, as torch's operators do (the CPU kernels are
// parallel, and other Python threads may go on).
struct ReleasedGil {
  PyThreadState* state = PyEval_SaveThread();
  ReleasedGil() = default;
  ReleasedGil(const ReleasedGil&) = delete;
  ReleasedGil& operator=(const ReleasedGil&) = delete;
  ~ReleasedGil() { PyEval_RestoreThread(state); }
};

void free_flat(PyObject* capsule) {
  delete static_cast<ruda::FlatBucket*>(PyCapsule_GetPointer(capsule, kFlatCapsule));
}

ruda::FlatBucket* flat_of(PyObject* obj) {
  return static_cast<ruda::FlatBucket*>(PyCapsule_GetPointer(obj, kFlatCapsule));
}

// A list of tensors; false with a Python error set for anything else.
bool tensor_list(PyObject* obj, const char* name, std::vector<at::Tensor>& out) {
  if (!PyList_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "flat_bucket: %s must be a list of tensors", name);
    return false;
  }
  const Py_ssize_t n = PyList_GET_SIZE(obj);
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(obj, i);
    if (!THPVariable_Check(t)) {
      PyErr_Format(PyExc_TypeError, "flat_bucket: %s[%zd] is not a tensor", name, i);
      return false;
    }
    out.push_back(THPVariable_Unpack(t));
  }
  return true;
}

std::optional<at::Tensor> optional_tensor(PyObject* obj) {
  if (obj == Py_None) return std::nullopt;
  return THPVariable_Unpack(obj);
}

bool tensor_or_none(PyObject* obj, const char* name) {
  if (obj == Py_None || THPVariable_Check(obj)) return true;
  PyErr_Format(PyExc_TypeError, "%s must be a tensor or None", name);
  return false;
}

// `clean`: a CPU int64 tensor of one entry per parameter of `fb` (its data in *data, null
// when empty); false with a Python error set for anything else.
bool versions_of(PyObject* obj, const ruda::FlatBucket& fb, int64_t** data) {
  int64_t numel = 0;
  if (!int64_data(obj, "clean", data, &numel)) return false;
  if (numel != static_cast<int64_t>(fb.views.size())) {
    PyErr_SetString(PyExc_ValueError, "clean must have one entry per view");
    return false;
  }
  return true;
}

// Makes `active_obj` (a list of ascending parameter indices, or None for all) the
// handle's selected subset; false with a Python error set for another object.
bool select_active(ruda::FlatBucket& fb, PyObject* active_obj) {
  if (active_obj == Py_None) {
    ruda::flat_bucket_select(fb, nullptr);
    return true;
  }
  if (!PyList_Check(active_obj)) {
    PyErr_SetString(PyExc_TypeError, "active must be a list of int or None");
    return false;
  }
  std::vector<int64_t> active;
  const Py_ssize_t k = PyList_GET_SIZE(active_obj);
  active.reserve(k);
  for (Py_ssize_t j = 0; j < k; ++j) {
    const long long v = PyLong_AsLongLong(PyList_GET_ITEM(active_obj, j));
    if (v == -1 && PyErr_Occurred()) return false;
    active.push_back(v);
  }
  ruda::flat_bucket_select(fb, &active);
  return true;
}

}  // namespace

// flat_bucket(owners, params, views, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots,
// master, scales) -> handle; validates as adamw_scaled_ does.
PyObject* flat_bucket(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *owners, *params, *views, *grad, *exp_avg, *exp_avg_sq, *max_sq, *steps, *slots, *master,
      *scales;
  if (!PyArg_ParseTuple(args, "OOOOOOOOOOO", &owners, &params, &views, &grad, &exp_avg, &exp_avg_sq,
                        &max_sq, &steps, &slots, &master, &scales)) {
    return nullptr;
  }
  std::vector<at::Tensor> o, p, v;
  if (!tensor_list(owners, "owners", o) || !tensor_list(params, "params", p) ||
      !tensor_list(views, "views", v)) {
    return nullptr;
  }
  for (PyObject* t : {grad, exp_avg, exp_avg_sq, steps, slots}) {
    if (!THPVariable_Check(t)) {
      PyErr_SetString(PyExc_TypeError,
                      "flat_bucket: grad, exp_avg, exp_avg_sq, steps and slots "
                      "must be tensors");  // fmt: skip
      return nullptr;
    }
  }
  if (!tensor_or_none(max_sq, "max_exp_avg_sq") || !tensor_or_none(master, "master") ||
      !tensor_or_none(scales, "scales")) {
    return nullptr;
  }
  auto fb = ruda::make_flat_bucket(std::move(o), std::move(p), std::move(v),
                                   THPVariable_Unpack(grad), THPVariable_Unpack(exp_avg),
                                   THPVariable_Unpack(exp_avg_sq), optional_tensor(max_sq),
                                   THPVariable_Unpack(steps), THPVariable_Unpack(slots),
                                   optional_tensor(master), optional_tensor(scales));
  for (const at::Tensor& view : fb->views) {  // Note [Exact views]
    fb->view_fact_starts.push_back(static_cast<int64_t>(fb->view_facts.size()));
    append_view(view, fb->view_facts);
    append_layout_of(view, fb->view_facts);
  }
  PyObject* capsule = PyCapsule_New(fb.get(), kFlatCapsule, free_flat);
  if (capsule != nullptr) fb.release();
  return capsule;
  END_HANDLE_TH_ERRORS
}

// flat_check(handle, clean) -> (current, broken, inactive). current: no parameter's
// memory moved (else the handle must be made again). broken: the parameters whose `grad`
// is not their view any more, or whose view is no longer exactly the view the handle
// made (Note [Exact views]). inactive: those whose view was not written since
// flat_mark() recorded its version in `clean` (-1: counts as written). Reads only.
PyObject* flat_check(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handle, *clean_obj;
  if (!PyArg_ParseTuple(args, "OO", &handle, &clean_obj)) return nullptr;
  ruda::FlatBucket* fb = flat_of(handle);
  if (fb == nullptr) return nullptr;
  const int64_t n = static_cast<int64_t>(fb->views.size());
  int64_t* clean = nullptr;
  if (!versions_of(clean_obj, *fb, &clean)) return nullptr;
  PyObject* broken = PyList_New(0);
  PyObject* inactive = PyList_New(0);
  if (broken == nullptr || inactive == nullptr) {
    Py_XDECREF(broken);
    Py_XDECREF(inactive);
    return nullptr;
  }
  // Bound by memory latency: each parameter is a chain of separately allocated objects
  // (its TensorImpl, its autograd meta holding `grad`, its storage; the view's TensorImpl
  // and version counter). The chains are followed on all of torch's threads, reading C++
  // objects only, with the heads prefetched a few parameters ahead and their second links
  // a little less ahead, so that many misses are in flight at once; the Python lists are
  // made afterwards from the per-parameter results.
  enum : uint8_t { kFine = 0, kBroken = 1, kInactive = 2 };
  std::vector<uint8_t> status(static_cast<size_t>(n), kFine);
  std::atomic<bool> current{true};
  const int64_t* const facts = fb->view_facts.data();
  const int64_t* const facts_end = facts + fb->view_facts.size();
  constexpr int64_t kAhead = 16;
  auto prefetch_heads = [&](int64_t j) {
    __builtin_prefetch(fb->owners[j].unsafeGetTensorImpl());
    __builtin_prefetch(fb->views[j].unsafeGetTensorImpl());
  };
  auto prefetch_links = [&](int64_t j) {
    c10::TensorImpl* p = fb->owners[j].unsafeGetTensorImpl();
    __builtin_prefetch(p->autograd_meta());
    if (p->has_storage()) __builtin_prefetch(p->storage().unsafeGetStorageImpl());
  };
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < std::min(end, begin + 2 * kAhead); ++j) prefetch_heads(j);
    for (int64_t j = begin; j < std::min(end, begin + kAhead); ++j) prefetch_links(j);
    bool moved = false;
    for (int64_t i = begin; i < end; ++i) {
      if (i + 2 * kAhead < end) prefetch_heads(i + 2 * kAhead);
      if (i + kAhead < end) prefetch_links(i + kAhead);
      const at::Tensor& view = fb->views[i];
      // TensorImpl::grad, not Tensor::grad: the latter asks autograd whether the tensor
      // is a leaf (for a warning), a second pointer chase per parameter.
      const at::Tensor& grad = fb->owners[i].unsafeGetTensorImpl()->grad();
      moved = moved || !ruda::flat_param_current(*fb, static_cast<size_t>(i));
      // Note [Exact views]: the view still addresses its slice with its layout.
      const int64_t* at = facts + fb->view_fact_starts[static_cast<size_t>(i)];
      if (!same_view_impl(*view.unsafeGetTensorImpl(), &at, facts_end) || !grad.defined() ||
          grad.unsafeGetTensorImpl() != view.unsafeGetTensorImpl()) {
        status[static_cast<size_t>(i)] = kBroken;
      } else if (static_cast<int64_t>(view._version()) == clean[i]) {
        status[static_cast<size_t>(i)] = kInactive;
      }
    }
    if (moved) current.store(false, std::memory_order_relaxed);
  });
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t s = status[static_cast<size_t>(i)];
    if (s == kFine) continue;
    PyObject* index = PyLong_FromLongLong(i);
    if (index == nullptr || PyList_Append(s == kBroken ? broken : inactive, index) < 0) {
      Py_XDECREF(index);
      Py_DECREF(broken);
      Py_DECREF(inactive);
      return nullptr;
    }
    Py_DECREF(index);
  }
  return Py_BuildValue("(ONN)", current.load() ? Py_True : Py_False, broken, inactive);
  END_HANDLE_TH_ERRORS
}

// flat_mark(handle, clean, unwritten): clean[i] := the version of view i when `unwritten`
// (the views were just zeroed as if set to None: a view not written before the next step
// is a parameter without a gradient), else -1 (the view holds a zero gradient) except
// for a view still unwritten, which stays so (torch keeps a None gradient None).
PyObject* flat_mark(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handle, *clean_obj;
  int unwritten = 0;
  if (!PyArg_ParseTuple(args, "OOp", &handle, &clean_obj, &unwritten)) return nullptr;
  ruda::FlatBucket* fb = flat_of(handle);
  if (fb == nullptr) return nullptr;
  const int64_t n = static_cast<int64_t>(fb->views.size());
  int64_t* clean = nullptr;
  if (!versions_of(clean_obj, *fb, &clean)) return nullptr;
  for (int64_t i = 0; i < n; ++i) {
    const auto version = static_cast<int64_t>(fb->views[i]._version());
    clean[i] = unwritten || clean[i] == version ? version : -1;
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// flat_analyze(handle, active, lo, hi, grad_scale, rows): analyze_gradient over the
// gradients of the selected parameters lo .. hi-1 (one statistics piece), the table
// kept on the device (csrc/bindings.h). Same precondition as flat_step.
PyObject* flat_analyze(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handle, *active_obj, *grad_scale, *rows;
  long long lo, hi;
  if (!PyArg_ParseTuple(args, "OOLLOO", &handle, &active_obj, &lo, &hi, &grad_scale, &rows)) {
    return nullptr;
  }
  ruda::FlatBucket* fb = flat_of(handle);
  if (fb == nullptr || !tensor_or_none(grad_scale, "flat_analyze: grad_scale")) return nullptr;
  if (!THPVariable_Check(rows)) {
    PyErr_SetString(PyExc_TypeError, "flat_analyze: rows must be a tensor");
    return nullptr;
  }
  if (!select_active(*fb, active_obj)) return nullptr;
  ruda::PreparedStats prep = ruda::prepare_flat_analyze(*fb, lo, hi, optional_tensor(grad_scale),
                                                        THPVariable_Unpack(rows));
  if (prep.launch.n_rows == 0) Py_RETURN_NONE;
  {
    const ReleasedGil no_gil;
    if (fb->device.is_cpu()) {
      prep.launch.table = prep.table.data();
      ruda::analyze_gradient_cpu(prep.launch);
    } else {
#ifdef RUDA_TORCH_WITH_CUDA
      ruda::launch_flat_analyze_cuda(*fb, lo, hi, prep);
#else
      TORCH_CHECK(false, "ruda_torch.flat_analyze: CUDA tensors in a build without CUDA kernels");
#endif
    }
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// Precondition: flat_check() found the handle current in the same step.
// flat_step(handle, active, validate_only, amsgrad, lr, lr_tensor, beta1, beta2, eps, weight_decay,
// maximize, grad_scale, found_inf, stats, max_grad_norm, clip_coef, rounding, seed, decoupled):
// one update of the bucket's parameters listed in `active` (ascending indices; None: all),
// or with validate_only its validation alone (writes nothing).
PyObject* flat_step(PyObject*, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *handle, *active_obj, *lr_tensor, *grad_scale, *found_inf, *stats, *clip_coef;
  int validate_only = 0, amsgrad = 0, maximize = 0, decoupled = 1;
  double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  long long rounding, seed;
  if (!PyArg_ParseTuple(args, "OOppdOddddpOOOdOLLp", &handle, &active_obj, &validate_only, &amsgrad,
                        &lr, &lr_tensor, &beta1, &beta2, &eps, &weight_decay, &maximize,
                        &grad_scale, &found_inf, &stats, &max_grad_norm, &clip_coef, &rounding,
                        &seed, &decoupled)) {
    return nullptr;
  }
  ruda::FlatBucket* fb = flat_of(handle);
  if (fb == nullptr) return nullptr;
  for (PyObject* t : {lr_tensor, grad_scale, found_inf, stats, clip_coef}) {
    if (!tensor_or_none(t, "flat_step: lr_tensor, grad_scale, found_inf, stats and clip_coef")) {
      return nullptr;
    }
  }
  // The caller checked the addresses with flat_check() in this step, before anything of
  // the step ran (Note [Flat gradient buckets]): a second pass here would cost as much.
  // Validation needs the subset's size only; selecting it first is not a write.
  if (!select_active(*fb, active_obj)) return nullptr;
  ruda::AdamWLaunch launch = ruda::prepare_flat_step(
      *fb, amsgrad != 0, optional_tensor(grad_scale), optional_tensor(found_inf),
      optional_tensor(stats), optional_tensor(clip_coef), lr, beta1, beta2, eps, weight_decay,
      max_grad_norm, maximize != 0, optional_tensor(lr_tensor), rounding, seed, decoupled != 0);
  if (validate_only || fb->active.empty()) Py_RETURN_NONE;
  {
    const ReleasedGil no_gil;
    if (fb->device.is_cpu()) {
      launch.table = fb->active.data();
      ruda::adamw_cpu(launch);
    } else {
#ifdef RUDA_TORCH_WITH_CUDA
      ruda::launch_flat_cuda(*fb, launch);
#else
      TORCH_CHECK(false, "ruda_torch.flat_step: CUDA tensors in a build without CUDA kernels");
#endif
    }
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace ruda::py
