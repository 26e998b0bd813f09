// Note [CPU ISA at run time]
// The CPU kernels are compiled once per vector ISA (default, AVX2, AVX-512 on x86-64),
// each build a module of its own (`ruda_torch._cpu_<isa>`, csrc/cpu/kernels/) with hidden
// symbols: the inline functions of torch's headers that each build instantiates with its
// own instructions stay inside that build (in one shared object the linker would keep one
// copy of each for all ISAs, and an AVX2 copy could reach a machine without AVX2). At
// import, ruda_torch/_build.py picks the best build this CPU runs (or the one asked for
// with RUDA_TORCH_CPU_CAPABILITY, else torch's ATEN_CPU_CAPABILITY) and installs its
// capsule here; every CPU kernel call of `_C` goes through it. The kernels take their
// arithmetic from the shared headers without FMA contraction, and the statistics reduce
// in the canonical order whatever the vector width, so every build gives the same bits
// (tests/test_cpu_isa.py).
#include <Python.h>
#include <c10/util/Exception.h>

#include "kernels.h"

namespace ruda {
namespace {

const CpuKernels* g_kernels = nullptr;

const CpuKernels& kernels() {
  TORCH_CHECK(g_kernels != nullptr,
              "ruda_torch: no CPU kernels are installed (import ruda_torch, which picks them)");
  return *g_kernels;
}

}  // namespace

void adamw_cpu(const AdamWLaunch& launch) { kernels().adamw(launch); }
void analyze_gradient_cpu(const StatsLaunch& launch) { kernels().analyze_gradient(launch); }
void merge_gradient_stats_cpu(const float* rows, int64_t n_rows, float* out) {
  kernels().merge_gradient_stats(rows, n_rows, out);
}
void merge_gradient_stats_chunks_cpu(const float* reports, int64_t n_reports, float* out) {
  kernels().merge_gradient_stats_chunks(reports, n_reports, out);
}
void quantize_8bit_cpu(const Quant8Launch& launch) { kernels().quantize_8bit(launch); }
void dequantize_8bit_cpu(const Quant8Launch& launch) { kernels().dequantize_8bit(launch); }
void quantize_4bit_cpu(const Quant8Launch& launch) { kernels().quantize_4bit(launch); }
void dequantize_4bit_cpu(const Quant8Launch& launch) { kernels().dequantize_4bit(launch); }

// set_cpu_kernels(capsule) -> str: installs an ISA module's kernels, returns its ISA.
PyObject* set_cpu_kernels(PyObject*, PyObject* capsule) {
  auto* k = static_cast<const CpuKernels*>(PyCapsule_GetPointer(capsule, kCpuKernelsCapsule));
  if (k == nullptr) return nullptr;
  if (k->abi != kCpuKernelsAbi) {
    PyErr_Format(PyExc_ImportError,
                 "ruda_torch: the %s CPU kernels are from another build (ABI %d, expected %d); "
                 "rebuild the package",
                 k->isa, k->abi, kCpuKernelsAbi);
    return nullptr;
  }
  g_kernels = k;
  return PyUnicode_FromString(k->isa);
}

// cpu_supports() -> tuple[str, ...]: the ISA builds this CPU can run, best last.
PyObject* cpu_supports(PyObject*, PyObject*) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  // torch's AVX512 vectors use F, BW, VL and DQ.
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512) return Py_BuildValue("(sss)", "default", "avx2", "avx512");
  if (avx2) return Py_BuildValue("(ss)", "default", "avx2");
#endif
  return Py_BuildValue("(s)", "default");
}

}  // namespace ruda
