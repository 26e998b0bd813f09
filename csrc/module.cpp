// The Python module `ruda_torch._C`: importing it runs the operator registrations (the
// static initializers of ops.cpp and the backend files); the module itself carries the
// build facts (ruda_torch/_build.py) and the per-step host helpers of the fused path:
// `unchanged`, the test of Note [Fused state coherence] in ruda_torch/_fused.py, and
// `grads_of`, which gathers a bucket's gradients.
//
// `unchanged` compares object identities, shapes and views (Note [Exact views]), never values: it
// is loops over pointers, on all of torch's threads (Note [Checks on all threads]), where the
// same loops in Python would cost tens of milliseconds for 20,000 parameters.
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "grad_stats.h"
#include "kernels.h"

namespace {

// A contiguous CPU int64 tensor's data (null when empty) and size; false with a Python
// error set for anything else (`name` says which argument of which function).
bool int64_data(PyObject* obj, const char* name, int64_t** data, int64_t* numel) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.scalar_type() == at::kLong && t.is_cpu() && t.is_contiguous()) {
      *numel = t.numel();
      *data = *numel > 0 ? t.data_ptr<int64_t>() : nullptr;
      return true;
    }
  }
  PyErr_Format(PyExc_TypeError, "%s must be a contiguous CPU int64 tensor", name);
  return false;
}

// What unchanged() compares of a parameter: dtype, device, shape and strides (any change
// re-derives the plan: the bucket holds state of that dtype, on that device, in that
// memory order). Appends [dtype, device type, device index, dim, sizes..., strides...];
// false for anything that is not a tensor with concrete sizes.
void append_layout_of(const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(t.scalar_type()));
  out.push_back(static_cast<int64_t>(t.device().type()));
  out.push_back(static_cast<int64_t>(t.device().index()));
  out.push_back(t.dim());
  out.insert(out.end(), t.sizes().begin(), t.sizes().end());
  out.insert(out.end(), t.strides().begin(), t.strides().end());
}

bool append_layout(PyObject* obj, std::vector<int64_t>& out) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  append_layout_of(t, out);
  return true;
}

// Whether `t` (or `obj`) still has the layout append_layout() recorded at *want; advances
// *want past it. Compared in place: unchanged() runs it for every fused parameter at every
// step.
bool same_layout_of(const c10::TensorImpl& t, const int64_t** want, const int64_t* end) {
  if (t.has_symbolic_sizes_strides()) return false;
  const int64_t dim = t.dim();
  const int64_t* w = *want;
  if (end - w < 4 + 2 * dim || w[0] != static_cast<int64_t>(t.dtype().toScalarType()) ||
      w[1] != static_cast<int64_t>(t.device().type()) ||
      w[2] != static_cast<int64_t>(t.device().index()) || w[3] != dim) {
    return false;
  }
  w += 4;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t d = 0; d < dim; ++d) {
    if (w[d] != sizes[d] || w[dim + d] != strides[d]) return false;
  }
  *want = w + 2 * dim;
  return true;
}

// Note [Exact views]
// A view of a bucket buffer (a state view in optimizer.state, a flat gradient view that
// is `p.grad`) is what the step reads and writes. Whether it still is that view is a fact
// about the tensor object, and is checked as such: the storage it addresses (the
// StorageImpl, which the bucket keeps alive, so an equal pointer is the same memory), its
// storage offset, dtype, device, sizes and strides. `view.data = t`, `set_`, `t_()`,
// `resize_`, `unsqueeze_` all change one of these in the same TensorImpl, whatever other
// tensors share the buffer (a sharing count, the proxy used before, missed a replaced
// view while some other tensor kept a reference). All of it lives in the TensorImpl: one
// object per view, prefetched like the others, no second pointer chase.

// Note [Tensors of their own]
// The views that the state and the flat gradients hold are tensors of their own over the
// bucket's memory (`torch.empty(0).set_(storage, offset, sizes, strides)`), not views in
// autograd's sense, and a bucket makes those of many slots one after another before it
// puts any into an entry (Bucket.own_views, then install). Both are for the checks below,
// which read every one of them at every step: an autograd view allocates its view
// metadata between the TensorImpls, and a slot made while the entry it replaces is freed
// lands in that entry's scattered memory, so the 60,000 state views of 20,000 parameters
// spread over 9,000 pages and cost 86 ns each to check; made as here, 2,950 pages and
// 20 ns. Like torch's own AdamW state, they have no `_base`, and each its own version
// counter (a flat gradient view needs that: Note [Flat gradient buckets]).
void append_view(const at::Tensor& t, std::vector<int64_t>& out) {
  out.push_back(static_cast<int64_t>(
      reinterpret_cast<uintptr_t>(t.has_storage() ? t.storage().unsafeGetStorageImpl() : nullptr)));
  out.push_back(t.has_storage() ? t.storage_offset() : 0);
}

// The record after the one at `w` (append_view + append_layout), or `end`.
const int64_t* skip_view(const int64_t* w, const int64_t* end) {
  if (end - w < 6) return end;
  const int64_t next = 6 + 2 * w[5];
  return end - w < next ? end : w + next;
}

// Whether TensorImpl `t` is still the view that append_view() + append_layout_of() recorded
// at *want; advances *want past the record. Reads the TensorImpl alone (same_views runs it
// on worker threads).
bool same_view_impl(const c10::TensorImpl& t, const int64_t** want, const int64_t* end) {
  const int64_t* w = *want;
  if (end - w < 2) return false;
  const auto storage = static_cast<int64_t>(reinterpret_cast<uintptr_t>(
      t.has_storage() ? t.unsafe_storage().unsafeGetStorageImpl() : nullptr));
  if (w[0] != storage || w[1] != (t.has_storage() ? t.storage_offset() : 0)) return false;
  w += 2;
  if (!same_layout_of(t, &w, end)) return false;
  *want = w;
  return true;
}

// layout_record(tensors) -> list[int]: append_layout() of each, concatenated.
PyObject* layout_record(PyObject*, PyObject* tensors) {
  if (!PyList_Check(tensors)) {
    PyErr_SetString(PyExc_TypeError, "layout_record: tensors must be a list");
    return nullptr;
  }
  std::vector<int64_t> out;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tensors); ++j) {
    if (!append_layout(PyList_GET_ITEM(tensors, j), out)) {
      PyErr_SetString(PyExc_TypeError, "layout_record: every item must be a tensor of known sizes");
      return nullptr;
    }
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(out.size()));
  if (list == nullptr) return nullptr;
  for (size_t k = 0; k < out.size(); ++k) {
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), PyLong_FromLongLong(out[k]));
  }
  return list;
}

// view_record(tensors) -> list[int]: per tensor, append_view() then append_layout()
// (Note [Exact views]).
PyObject* view_record(PyObject*, PyObject* tensors) {
  if (!PyList_Check(tensors)) {
    PyErr_SetString(PyExc_TypeError, "view_record: tensors must be a list");
    return nullptr;
  }
  std::vector<int64_t> out;
  for (Py_ssize_t j = 0; j < PyList_GET_SIZE(tensors); ++j) {
    PyObject* t = PyList_GET_ITEM(tensors, j);
    if (!THPVariable_Check(t)) {
      PyErr_SetString(PyExc_TypeError, "view_record: every item must be a tensor");
      return nullptr;
    }
    append_view(THPVariable_Unpack(t), out);
    if (!append_layout(t, out)) {
      PyErr_SetString(PyExc_TypeError, "view_record: every item must have known sizes");
      return nullptr;
    }
  }
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(out.size()));
  if (list == nullptr) return nullptr;
  for (size_t k = 0; k < out.size(); ++k) {
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), PyLong_FromLongLong(out[k]));
  }
  return list;
}

// Note [Checks on all threads]
// The checks below read, for every fused parameter, a few objects allocated one by one
// (a dict, a Python tensor object, a TensorImpl): after the kernel swept the caches each
// is a miss, and a loop that waits for them one at a time is bound by memory latency.
// So the records are walked first, serially (they are contiguous), to find where each
// object's record starts, and the objects are then compared on all of torch's threads,
// each prefetching a few objects ahead, so that many misses are in flight at once. The
// workers read Python objects without taking the GIL: plain loads of fields of objects
// that the calling thread keeps alive and holds the GIL for, so that no Python code can
// change them meanwhile (no reference counts are touched, nothing is allocated). Python
// builds without a GIL run the same loops on the calling thread alone.
#ifdef Py_GIL_DISABLED
constexpr int64_t kCheckGrain = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kCheckGrain = 2048;
#endif

// What a worker thread finds of item j: the same, different, or an object it must not
// look into (a tensor subclass: telling what it is may run Python code), which the
// calling thread then checks.
enum class Verdict : uint8_t { kSame, kDifferent, kOnCaller };

// Runs check(j) for j in [0, n) on all threads, then on_caller(j) on the calling thread
// where check(j) said so (Note [Checks on all threads]); false as soon as one finds a
// difference. prefetch(j) is called a few items ahead of check(j).
template <typename Prefetch, typename Check, typename OnCaller>
bool check_all(int64_t n, Prefetch prefetch, Check check, OnCaller on_caller) {
  std::atomic<bool> same{true}, deferred{false};
  std::vector<uint8_t> later(static_cast<size_t>(n), 0);
  constexpr int64_t kAhead = 12;
  at::parallel_for(0, n, std::min<int64_t>(kCheckGrain, std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t stop) {
                     for (int64_t j = begin; j < std::min(stop, begin + kAhead); ++j) prefetch(j);
                     for (int64_t j = begin; j < stop; ++j) {
                       if (!same.load(std::memory_order_relaxed)) return;
                       if (j + kAhead < stop) prefetch(j + kAhead);
                       const Verdict v = check(j);
                       if (v == Verdict::kDifferent) {
                         same.store(false, std::memory_order_relaxed);
                       } else if (v == Verdict::kOnCaller) {
                         later[static_cast<size_t>(j)] = 1;
                         deferred.store(true, std::memory_order_relaxed);
                       }
                     }
                   });
  if (!same.load()) return false;
  if (deferred.load()) {
    for (int64_t j = 0; j < n; ++j) {
      if (later[static_cast<size_t>(j)] && !on_caller(j)) return false;
    }
  }
  return true;
}

// The TensorImpl of a torch.Tensor or nn.Parameter object (their exact types: a field
// read, safe on any thread), else null.
const c10::TensorImpl* exact_impl_of(PyObject* obj) {
  return THPVariable_CheckExact(obj) ? THPVariable_Unpack(obj).unsafeGetTensorImpl() : nullptr;
}

// The TensorImpl of any tensor object, tensor subclasses included (calling thread only:
// the type test may run Python code), else null.
const c10::TensorImpl* impl_of(PyObject* obj) {
  return THPVariable_Check(obj) ? THPVariable_Unpack(obj).unsafeGetTensorImpl() : nullptr;
}

void prefetch_impl_of(PyObject* obj) {
  if (const c10::TensorImpl* impl = exact_impl_of(obj)) {
    const char* p = reinterpret_cast<const char*>(impl);
    __builtin_prefetch(p);  // what the comparisons read: three cache lines
    __builtin_prefetch(p + 64);
    __builtin_prefetch(p + 128);
  }
}

// Whether compare(impl, record) holds for the TensorImpl of every tensor object of `list`,
// `record` pointing at starts[j] for item j: on all threads, tensor subclasses on the
// calling thread (check_all).
template <typename Compare>
bool check_tensors(PyObject* list, const std::vector<const int64_t*>& starts, Compare compare) {
  const int64_t m = PyList_GET_SIZE(list);
  PyObject** items = reinterpret_cast<PyListObject*>(list)->ob_item;
  auto holds = [&](const c10::TensorImpl& impl, int64_t j) {
    const int64_t* at = starts[static_cast<size_t>(j)];
    return compare(impl, &at);
  };
  return check_all(
      m,
      [&](int64_t j) {
        __builtin_prefetch(items[j]);
        if (j + 8 < m) __builtin_prefetch(items[j + 8]);  // the object before its TensorImpl
        prefetch_impl_of(items[j]);
      },
      [&](int64_t j) {
        const c10::TensorImpl* impl = exact_impl_of(items[j]);
        if (impl == nullptr) return Verdict::kOnCaller;
        return holds(*impl, j) ? Verdict::kSame : Verdict::kDifferent;
      },
      [&](int64_t j) {
        const c10::TensorImpl* impl = impl_of(items[j]);
        return impl != nullptr && holds(*impl, j);
      });
}

// Whether every tensor of `tensors` is still the view view_record() recorded in *want.
bool same_views(PyObject* tensors, const int64_t* want, const int64_t* end) {
  const Py_ssize_t m = PyList_GET_SIZE(tensors);
  std::vector<const int64_t*> starts(static_cast<size_t>(m));
  const int64_t* w = want;
  for (Py_ssize_t j = 0; j < m; ++j) {
    if (end - w < 6) return false;
    starts[static_cast<size_t>(j)] = w;
    w = skip_view(w, end);
  }
  if (w != end) return false;
  return check_tensors(tensors, starts, [&](const c10::TensorImpl& impl, const int64_t** at) {
    return same_view_impl(impl, at, end);
  });
}

// Whether container `actual` (a dict or a list) still holds exactly `count` objects,
// expected[0 .. count) (a dict as key, value, key, value, ...), by identity, in order.
bool same_items_at(PyObject* actual, PyObject* const* expected, Py_ssize_t count) {
  if (PyDict_Check(actual)) {
    if (2 * PyDict_GET_SIZE(actual) != count) return false;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(actual, &pos, &key, &value)) {
      if (key != expected[i] || value != expected[i + 1]) return false;
      i += 2;
    }
    return true;
  }
  if (PyList_Check(actual)) {
    if (PyList_GET_SIZE(actual) != count) return false;
    PyObject** items = reinterpret_cast<PyListObject*>(actual)->ob_item;
    for (Py_ssize_t k = 0; k < count; ++k) {
      if (items[k] != expected[k]) return false;
    }
    return true;
  }
  return false;
}

// unchanged(containers, counts, expected, tensors, shapes, views, facts) -> bool
//   containers: dicts and lists; counts: a CPU int64 tensor, how many items of `expected`
//   each holds (twice its length for a dict); expected: their items, concatenated (a dict
//   as key, value, ...); tensors: tensors whose layouts must not change; shapes: a CPU
//   int64 tensor holding layout_record(tensors); views: the bucket views in the state,
//   each of which must still be exactly the view recorded in facts (a CPU int64 tensor
//   from view_record; Note [Exact views]). Note [Checks on all threads].
PyObject* unchanged(PyObject*, PyObject* args) {
  PyObject *containers, *counts_obj, *expected, *tensors, *shapes_obj, *views, *facts_obj;
  if (!PyArg_ParseTuple(args, "O!OO!O!OO!O", &PyList_Type, &containers, &counts_obj, &PyList_Type,
                        &expected, &PyList_Type, &tensors, &shapes_obj, &PyList_Type, &views,
                        &facts_obj)) {
    return nullptr;
  }
  int64_t n_counts = 0, n_shapes = 0, n_facts = 0;
  int64_t *counts = nullptr, *want = nullptr, *facts = nullptr;
  if (!int64_data(counts_obj, "unchanged: counts", &counts, &n_counts) ||
      !int64_data(shapes_obj, "unchanged: shapes", &want, &n_shapes) ||
      !int64_data(facts_obj, "unchanged: facts", &facts, &n_facts)) {
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(containers);
  if (n_counts != n) {
    PyErr_SetString(PyExc_ValueError, "unchanged: counts must have one entry per container");
    return nullptr;
  }
  // Where each container's items start in `expected`.
  std::vector<Py_ssize_t> first(static_cast<size_t>(n) + 1, 0);
  for (Py_ssize_t c = 0; c < n; ++c) first[c + 1] = first[c] + counts[c];
  if (first[n] != PyList_GET_SIZE(expected)) Py_RETURN_FALSE;
  PyObject** boxes = reinterpret_cast<PyListObject*>(containers)->ob_item;
  PyObject* const* items = reinterpret_cast<PyListObject*>(expected)->ob_item;
  const bool same_containers = check_all(
      n,
      [&](int64_t c) {
        PyObject* ahead = boxes[c];
        __builtin_prefetch(ahead);
        if (PyDict_CheckExact(ahead)) {  // the keys' header, indices and first entries
          const char* keys = reinterpret_cast<const char*>(((PyDictObject*)ahead)->ma_keys);
          __builtin_prefetch(keys);
          __builtin_prefetch(keys + 64);
          __builtin_prefetch(keys + 128);
        }
      },
      [&](int64_t c) {
        // Exact dicts and lists only: a subclass's methods may be Python code.
        PyObject* box = boxes[c];
        if (!PyDict_CheckExact(box) && !PyList_CheckExact(box)) return Verdict::kOnCaller;
        return same_items_at(box, items + first[c], counts[c]) ? Verdict::kSame
                                                               : Verdict::kDifferent;
      },
      [&](int64_t c) { return same_items_at(boxes[c], items + first[c], counts[c]); });
  if (!same_containers) Py_RETURN_FALSE;
  // The layouts of the parameters: where each record starts, then the comparisons.
  const Py_ssize_t m = PyList_GET_SIZE(tensors);
  const int64_t* const want_end = want + n_shapes;
  std::vector<const int64_t*> starts(static_cast<size_t>(m));
  const int64_t* w = want;
  for (Py_ssize_t j = 0; j < m; ++j) {
    if (want_end - w < 4) Py_RETURN_FALSE;
    starts[static_cast<size_t>(j)] = w;
    w += 4 + 2 * w[3];
  }
  if (w != want_end) Py_RETURN_FALSE;
  const bool same_layouts =
      check_tensors(tensors, starts, [&](const c10::TensorImpl& impl, const int64_t** at) {
        return same_layout_of(impl, at, want_end);
      });
  if (!same_layouts) Py_RETURN_FALSE;
  if (!same_views(views, facts, facts + n_facts)) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// Whether gradient g lays out its elements in memory as its parameter p does, with both
// dense (Note [Dense layouts] in csrc/bindings.cpp), or p is not dense and g contiguous:
// what adamw_scaled_ takes without a copy (a non-dense parameter is stepped through a
// contiguous staging copy, see Bucket in ruda_torch/_fused.py).
bool kernel_layout(const at::Tensor& p, const at::Tensor& g) {
  if (p.is_contiguous() && g.is_contiguous()) return true;  // (a shape mismatch is the binding's)
  if (!p.is_non_overlapping_and_dense()) return g.is_contiguous();
  if (p.sizes() != g.sizes() || !g.is_non_overlapping_and_dense()) return false;
  for (int64_t d = 0; d < p.dim(); ++d) {
    if (p.size(d) > 1 && p.stride(d) != g.stride(d)) return false;
  }
  return true;
}

// grads_of(params) -> (grads, missing, mixed, relayout): `p.grad` of every parameter in
// the list (None where there is none), how many are None, whether the others have more
// than one dtype, and whether any may need a copy in the kernel's layout (kernel_layout
// false, or a tensor subclass whose local gradient the caller must look at). The step's
// per-parameter gathering in one C loop: a Python loop over 20,000 parameters (the list, the None
// test, the dtype set) cost more than the check above. Exact torch.Tensor / nn.Parameter objects
// are read directly, as their `grad` property does; anything else (a tensor subclass) through its
// own attribute.
PyObject* grads_of(PyObject*, PyObject* params) {
  if (!PyList_Check(params)) {
    PyErr_SetString(PyExc_TypeError, "grads_of: params must be a list");
    return nullptr;
  }
  static PyObject* grad_name = PyUnicode_InternFromString("grad");
  const Py_ssize_t n = PyList_GET_SIZE(params);
  PyObject* grads = PyList_New(n);
  if (grads == nullptr) return nullptr;
  Py_ssize_t missing = 0;
  bool mixed = false, seen = false, relayout = false;
  at::ScalarType dtype = at::kFloat;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params, i);
    PyObject* g = nullptr;
    if (THPVariable_CheckExact(p)) {
      const at::Tensor& param = THPVariable_Unpack(p);
      const at::Tensor& grad = param.grad();
      g = grad.defined() ? THPVariable_Wrap(grad) : Py_NewRef(Py_None);
      if (grad.defined() && !relayout) relayout = !kernel_layout(param, grad);
    } else {
      g = PyObject_GetAttr(p, grad_name);
      relayout = relayout || (g != nullptr && g != Py_None);
    }
    if (g == nullptr) {
      Py_DECREF(grads);
      return nullptr;
    }
    PyList_SET_ITEM(grads, i, g);
    if (g == Py_None) {
      ++missing;
    } else if (THPVariable_Check(g)) {
      const at::ScalarType t = THPVariable_Unpack(g).scalar_type();
      mixed = mixed || (seen && t != dtype);
      dtype = t;
      seen = true;
    }
  }
  return Py_BuildValue("(NnOO)", grads, missing, mixed ? Py_True : Py_False,
                       relayout ? Py_True : Py_False);
}

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

// flat_bucket(owners, params, views, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, slots,
// master) -> handle; validates as adamw_scaled_ does.
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

}  // namespace

namespace ruda {  // csrc/cpu/dispatch.cpp
PyObject* set_cpu_kernels(PyObject*, PyObject* capsule);
PyObject* cpu_supports(PyObject*, PyObject*);
}  // namespace ruda

namespace {

PyMethodDef kMethods[] = {
    {"grads_of", grads_of, METH_O, "grads_of(params) -> (grads, missing, mixed, relayout)"},
    {"unchanged", unchanged, METH_VARARGS,
     "unchanged(containers, counts, expected, tensors, shapes, views, facts) -> bool "
     "(Note [Fused state coherence])"},
    {"view_record", view_record, METH_O, "view_record(tensors) -> list[int] (Note [Exact views])"},
    {"set_cpu_kernels", ruda::set_cpu_kernels, METH_O,
     "set_cpu_kernels(capsule) -> str (Note [CPU ISA at run time])"},
    {"cpu_supports", ruda::cpu_supports, METH_NOARGS,
     "cpu_supports() -> tuple of the CPU kernel ISAs this machine runs"},
    {"layout_record", layout_record, METH_O, "layout_record(tensors) -> list[int]"},
    {"flat_bucket", flat_bucket, METH_VARARGS,
     "flat_bucket(owners, params, views, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, "
     "slots, master) -> handle (Note [Flat gradient buckets])"},
    {"flat_check", flat_check, METH_VARARGS,
     "flat_check(handle, clean) -> (current, broken, inactive)"},
    {"flat_mark", flat_mark, METH_VARARGS, "flat_mark(handle, clean, unwritten) -> None"},
    {"flat_analyze", flat_analyze, METH_VARARGS,
     "flat_analyze(handle, active, lo, hi, grad_scale, rows) -> None"},
    {"flat_step", flat_step, METH_VARARGS,
     "flat_step(handle, active, validate_only, amsgrad, lr, lr_tensor, beta1, beta2, eps, "
     "weight_decay, maximize, grad_scale, found_inf, stats, max_grad_norm, clip_coef, "
     "rounding, seed, decoupled) -> None"},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, kMethods};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
#ifdef RUDA_TORCH_WITH_CUDA
  PyModule_AddIntConstant(m, "cuda_compiled", 1);
#else
  PyModule_AddIntConstant(m, "cuda_compiled", 0);
#endif
#ifdef RUDA_TORCH_BUILT_WITH
  PyModule_AddStringConstant(m, "torch_version", RUDA_TORCH_BUILT_WITH);
#endif
  PyModule_AddIntConstant(m, "stats_chunk", ruda::kStatsChunk);
  PyModule_AddIntConstant(m, "merge_fan_in", ruda::kMergeFanIn);
  return m;
}
