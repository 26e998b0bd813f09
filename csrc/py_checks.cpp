// The per-step host checks of the fused path, for the Python side (ruda_torch/_plan.py,
// ruda_torch/_step.py): `unchanged`, the test of Note [Fused state coherence] in
// ruda_torch/_plan.py, the records it compares (`layout_record`, `view_record`), and
// `grads_of`, which gathers a bucket's gradients.
//
// `unchanged` compares object identities, shapes and views (Note [Exact views] in
// csrc/py_records.h), never values: it is loops over pointers, on all of torch's threads
// (Note [Checks on all threads]), where the same loops in Python would cost tens of
// milliseconds for 20,000 parameters.
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "py_records.h"

namespace ruda::py {

namespace {

bool append_layout(PyObject* obj, std::vector<int64_t>& out) {
  if (!THPVariable_Check(obj)) return false;
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  append_layout_of(t, out);
  return true;
}

// The record after the one at `w` (append_view + append_layout), or `end`.
const int64_t* skip_view(const int64_t* w, const int64_t* end) {
  if (end - w < 6) return end;
  const int64_t next = 6 + 2 * w[5];
  return end - w < next ? end : w + next;
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

// A record as a Python list of int; null with a Python error set when out of memory.
PyObject* int_list(const std::vector<int64_t>& out) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(out.size()));
  if (list == nullptr) return nullptr;
  for (size_t k = 0; k < out.size(); ++k) {
    PyObject* item = PyLong_FromLongLong(out[k]);
    if (item == nullptr) {
      Py_DECREF(list);
      return nullptr;
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(k), item);
  }
  return list;
}

}  // namespace

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
  return int_list(out);
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
  return int_list(out);
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

}  // namespace ruda::py
