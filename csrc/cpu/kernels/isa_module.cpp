// The Python module of one ISA build of the CPU kernels, `ruda_torch._cpu_<isa>`: setup.py
// compiles this directory once per vector ISA, with that ISA's flags, hidden symbols and
// RUDA_ISA_NAME (the ISA's name, a bare word) and RUDA_ISA_INIT (PyInit__cpu_<isa>). The module
// carries one capsule, `kernels`, that `ruda_torch._C.set_cpu_kernels` installs (Note [CPU
// ISA at run time] in csrc/cpu/dispatch.cpp).
#include <Python.h>

#include "kernels.h"

#ifndef RUDA_ISA_NAME
#error "RUDA_ISA_NAME must name the ISA of this build (setup.py defines it)"
#endif
#define RUDA_STRINGIFY_(x) #x
#define RUDA_STRINGIFY(x) RUDA_STRINGIFY_(x)
#define RUDA_ISA RUDA_STRINGIFY(RUDA_ISA_NAME)

namespace {

const ruda::CpuKernels kKernels = {
    ruda::kCpuKernelsAbi,
    RUDA_ISA,
    &ruda::adamw_cpu,
    &ruda::analyze_gradient_cpu,
    &ruda::merge_gradient_stats_cpu,
    &ruda::merge_gradient_stats_chunks_cpu,
    &ruda::quantize_8bit_cpu,
    &ruda::dequantize_8bit_cpu,
    &ruda::quantize_4bit_cpu,
    &ruda::dequantize_4bit_cpu,
};

}  // namespace

extern "C" PyMODINIT_FUNC RUDA_ISA_INIT(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_cpu_" RUDA_ISA, nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&def);
  if (m == nullptr) return nullptr;
  PyObject* capsule =
      PyCapsule_New(const_cast<ruda::CpuKernels*>(&kKernels), ruda::kCpuKernelsCapsule, nullptr);
  if (capsule == nullptr || PyModule_AddObject(m, "kernels", capsule) < 0) {
    Py_XDECREF(capsule);
    Py_DECREF(m);
    return nullptr;
  }
  PyModule_AddStringConstant(m, "isa", RUDA_ISA);
  return m;
}
