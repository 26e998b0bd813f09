// The Python module `ruda_torch._C`: importing it runs the operator registrations (the
// static initializers of ops.cpp and the backend files); the module itself carries the
// build facts (ruda_torch/_build.py) and the per-step host helpers of the fused path:
// `unchanged`, the test of Note [Fused state coherence] in ruda_torch/_fused.py, and
// `grads_of`, which gathers a bucket's gradients.
//
// `unchanged` compares object identities, shapes and sharing counts, never values: it is a
// loop over pointers, so that checking 20,000 parameters and their state entries costs a
// fraction of a millisecond where the same loop in Python would cost several.
#include <torch/csrc/autograd/python_variable.h>

#include "grad_stats.h"

namespace {

// Whether container `actual` still holds exactly the objects expected[*at ...] (identity),
// in order: a dict its items as key, value, key, value, ...; a list its items. Advances
// *at past them. Any other container counts as changed (the caller then re-derives).
bool same_items(PyObject* actual, PyObject* expected, Py_ssize_t* at) {
  const Py_ssize_t end = PyList_GET_SIZE(expected);
  Py_ssize_t i = *at;
  if (PyDict_Check(actual)) {
    if (i + 2 * PyDict_Size(actual) > end) return false;
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(actual, &pos, &key, &value)) {
      if (key != PyList_GET_ITEM(expected, i) || value != PyList_GET_ITEM(expected, i + 1)) {
        return false;
      }
      i += 2;
    }
  } else if (PyList_Check(actual)) {
    const Py_ssize_t n = PyList_GET_SIZE(actual);
    if (i + n > end) return false;
    for (Py_ssize_t k = 0; k < n; ++k, ++i) {
      if (PyList_GET_ITEM(actual, k) != PyList_GET_ITEM(expected, i)) return false;
    }
  } else {
    return false;
  }
  *at = i;
  return true;
}

// A contiguous CPU int64 tensor's data (null when empty) and size; false with a Python
// error set for anything else.
bool int64_data(PyObject* obj, const char* name, const int64_t** data, int64_t* numel) {
  if (THPVariable_Check(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.scalar_type() == at::kLong && t.is_cpu() && t.is_contiguous()) {
      *numel = t.numel();
      *data = *numel > 0 ? t.const_data_ptr<int64_t>() : nullptr;
      return true;
    }
  }
  PyErr_Format(PyExc_TypeError, "unchanged: %s must be a contiguous CPU int64 tensor", name);
  return false;
}

// How many tensors share the memory of `t` (its storage's reference count), or -1.
int64_t sharers(PyObject* t) {
  if (!THPVariable_Check(t)) return -1;
  const at::Tensor& tensor = THPVariable_Unpack(t);
  return tensor.has_storage() ? static_cast<int64_t>(tensor.storage().use_count()) : -1;
}

// use_counts(buffers) -> list[int]: sharers() of each buffer, for unchanged() to compare.
PyObject* use_counts(PyObject*, PyObject* buffers) {
  if (!PyList_Check(buffers)) {
    PyErr_SetString(PyExc_TypeError, "use_counts: buffers must be a list");
    return nullptr;
  }
  const Py_ssize_t n = PyList_GET_SIZE(buffers);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyList_SET_ITEM(out, i, PyLong_FromLongLong(sharers(PyList_GET_ITEM(buffers, i))));
  }
  return out;
}

// unchanged(containers, expected, tensors, shapes, buffers, counts) -> bool
//   containers: dicts and lists; expected: their items, concatenated (see same_items);
//   tensors: tensors whose shapes must not change; shapes: a CPU int64 tensor holding,
//   for each of them in order, its number of dimensions and then its sizes;
//   buffers: tensors whose memory must be shared by as many tensors as before (counts, a
//   CPU int64 tensor from use_counts). A view of a bucket given other memory
//   (`view.data = ...`, `view.set_(...)`: the object stays, the memory moves) lowers its
//   buffer's count: one comparison per buffer instead of one per view.
PyObject* unchanged(PyObject*, PyObject* args) {
  PyObject *containers, *expected, *tensors, *shapes_obj, *buffers, *counts_obj;
  if (!PyArg_ParseTuple(args, "O!O!O!OO!O", &PyList_Type, &containers, &PyList_Type, &expected,
                        &PyList_Type, &tensors, &shapes_obj, &PyList_Type, &buffers, &counts_obj)) {
    return nullptr;
  }
  int64_t n_shapes = 0, n_counts = 0;
  const int64_t *want = nullptr, *count = nullptr;
  if (!int64_data(shapes_obj, "shapes", &want, &n_shapes) ||
      !int64_data(counts_obj, "counts", &count, &n_counts)) {
    return nullptr;
  }
  if (n_counts != PyList_GET_SIZE(buffers)) {
    PyErr_SetString(PyExc_ValueError, "unchanged: buffers and counts differ in length");
    return nullptr;
  }
  Py_ssize_t at = 0;
  const Py_ssize_t n = PyList_GET_SIZE(containers);
  for (Py_ssize_t c = 0; c < n; ++c) {
    if (!same_items(PyList_GET_ITEM(containers, c), expected, &at)) Py_RETURN_FALSE;
  }
  if (at != PyList_GET_SIZE(expected)) Py_RETURN_FALSE;
  const int64_t* const want_end = want + n_shapes;
  const Py_ssize_t m = PyList_GET_SIZE(tensors);
  for (Py_ssize_t j = 0; j < m; ++j) {
    PyObject* t = PyList_GET_ITEM(tensors, j);
    if (!THPVariable_Check(t) || want == want_end) Py_RETURN_FALSE;
    const auto sizes = THPVariable_Unpack(t).sym_sizes();
    const int64_t dim = *want++;
    if (static_cast<int64_t>(sizes.size()) != dim || want + dim > want_end) Py_RETURN_FALSE;
    for (int64_t d = 0; d < dim; ++d) {
      const auto size = sizes[d].maybe_as_int();
      if (!size.has_value() || *size != want[d]) Py_RETURN_FALSE;
    }
    want += dim;
  }
  if (want != want_end) Py_RETURN_FALSE;
  for (int64_t k = 0; k < n_counts; ++k) {
    if (sharers(PyList_GET_ITEM(buffers, k)) != count[k]) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// grads_of(params) -> (grads, missing, mixed): `p.grad` of every parameter in the list
// (None where there is none), how many are None, and whether the others have more than
// one dtype. The step's per-parameter gathering in one C loop: a Python loop over
// 20,000 parameters (the list, the None test, the dtype set) cost more than the check
// above. Exact torch.Tensor / nn.Parameter objects are read directly, as their `grad`
// property does; anything else (a tensor subclass) through its own attribute.
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
  bool mixed = false, seen = false;
  at::ScalarType dtype = at::kFloat;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyList_GET_ITEM(params, i);
    PyObject* g = nullptr;
    if (THPVariable_CheckExact(p)) {
      const at::Tensor& grad = THPVariable_Unpack(p).grad();
      g = grad.defined() ? THPVariable_Wrap(grad) : Py_NewRef(Py_None);
    } else {
      g = PyObject_GetAttr(p, grad_name);
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
  return Py_BuildValue("(NnO)", grads, missing, mixed ? Py_True : Py_False);
}

PyMethodDef kMethods[] = {
    {"grads_of", grads_of, METH_O, "grads_of(params) -> (grads, missing, mixed)"},
    {"unchanged", unchanged, METH_VARARGS,
     "unchanged(containers, expected, tensors, shapes, buffers, counts) -> bool "
     "(Note [Fused state coherence])"},
    {"use_counts", use_counts, METH_O, "use_counts(buffers) -> list[int]"},
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
#if defined(CPU_CAPABILITY_AVX2)
  PyModule_AddStringConstant(m, "cpu_isa", "avx2");
#else
  PyModule_AddStringConstant(m, "cpu_isa", "default");
#endif
  PyModule_AddIntConstant(m, "stats_chunk", ruda::kStatsChunk);
  PyModule_AddIntConstant(m, "merge_fan_in", ruda::kMergeFanIn);
  return m;
}
