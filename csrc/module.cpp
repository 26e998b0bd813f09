// The Python module `ruda_torch._C`: importing it runs the operator registrations (the
// static initializers of ops.cpp and the backend files); the module itself carries the
// build facts (ruda_torch/_build.py) and the method table of the per-step host helpers,
// defined in py_checks.cpp (the coherence test and gradient gathering) and py_flat.cpp (the
// flat-gradient handles), and of the CPU ISA selection (cpu/dispatch.cpp).
#include <Python.h>

#include "grad_stats.h"
#include "py_records.h"
#include "quant4.h"
#include "quant8.h"

namespace ruda {  // csrc/cpu/dispatch.cpp
PyObject* set_cpu_kernels(PyObject*, PyObject* capsule);
PyObject* cpu_supports(PyObject*, PyObject*);
}  // namespace ruda

namespace {

PyMethodDef kMethods[] = {
    {"grads_of", ruda::py::grads_of, METH_O,
     "grads_of(params) -> (grads, missing, mixed, relayout)"},
    {"unchanged", ruda::py::unchanged, METH_VARARGS,
     "unchanged(containers, counts, expected, tensors, shapes, views, facts) -> bool "
     "(Note [Fused state coherence])"},
    {"view_record", ruda::py::view_record, METH_O,
     "view_record(tensors) -> list[int] (Note [Exact views])"},
    {"set_cpu_kernels", ruda::set_cpu_kernels, METH_O,
     "set_cpu_kernels(capsule) -> str (Note [CPU ISA at run time])"},
    {"cpu_supports", ruda::cpu_supports, METH_NOARGS,
     "cpu_supports() -> tuple of the CPU kernel ISAs this machine runs"},
    {"layout_record", ruda::py::layout_record, METH_O, "layout_record(tensors) -> list[int]"},
    {"flat_bucket", ruda::py::flat_bucket, METH_VARARGS,
     "flat_bucket(owners, params, views, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, steps, "
     "slots, master) -> handle (Note [Flat gradient buckets])"},
    {"flat_check", ruda::py::flat_check, METH_VARARGS,
     "flat_check(handle, clean) -> (current, broken, inactive)"},
    {"flat_mark", ruda::py::flat_mark, METH_VARARGS, "flat_mark(handle, clean, unwritten) -> None"},
    {"flat_analyze", ruda::py::flat_analyze, METH_VARARGS,
     "flat_analyze(handle, active, lo, hi, grad_scale, rows) -> None"},
    {"flat_step", ruda::py::flat_step, METH_VARARGS,
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
  PyModule_AddIntConstant(m, "block_8bit", ruda::kBlock8);
  PyModule_AddIntConstant(m, "block_4bit", ruda::kBlock4);
  return m;
}
