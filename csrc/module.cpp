// The Python module `ruda_torch._C`: importing it runs the operator registrations (the
// static initializers of ops.cpp and the backend files); the module itself carries the
// build facts (ruda_torch/_build.py) and one function, `unchanged`, the per-step test of
// Note [Fused state coherence] in ruda_torch/_fused.py.
//
// `unchanged` compares object identities and tensor shapes only, never values: it is a
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

// unchanged(containers, expected, tensors, shapes) -> bool
//   containers: dicts and lists; expected: their items, concatenated (see same_items);
//   tensors: tensors whose shapes must not change; shapes: a CPU int64 tensor holding,
//   for each of them in order, its number of dimensions and then its sizes.
PyObject* unchanged(PyObject*, PyObject* args) {
  PyObject *containers, *expected, *tensors, *shapes_obj;
  if (!PyArg_ParseTuple(args, "O!O!O!O", &PyList_Type, &containers, &PyList_Type, &expected,
                        &PyList_Type, &tensors, &shapes_obj) ||
      !THPVariable_Check(shapes_obj)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "unchanged: shapes must be a tensor");
    return nullptr;
  }
  Py_ssize_t at = 0;
  const Py_ssize_t n = PyList_GET_SIZE(containers);
  for (Py_ssize_t c = 0; c < n; ++c) {
    if (!same_items(PyList_GET_ITEM(containers, c), expected, &at)) Py_RETURN_FALSE;
  }
  if (at != PyList_GET_SIZE(expected)) Py_RETURN_FALSE;
  const at::Tensor& shapes = THPVariable_Unpack(shapes_obj);
  if (shapes.scalar_type() != at::kLong || !shapes.is_cpu() || !shapes.is_contiguous()) {
    PyErr_SetString(PyExc_TypeError, "unchanged: shapes must be a contiguous CPU int64 tensor");
    return nullptr;
  }
  const int64_t* want = shapes.data_ptr<int64_t>();
  const int64_t* const want_end = want + shapes.numel();
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
  Py_RETURN_TRUE;
}

PyMethodDef kMethods[] = {
    {"unchanged", unchanged, METH_VARARGS,
     "unchanged(containers, contents, tensors, shapes) -> bool (Note [Fused state coherence])"},
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
