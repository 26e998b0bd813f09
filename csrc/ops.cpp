// Operator schemas (TORCH_LIBRARY), the Python module object, and the CUDA stubs of a
// build without CUDA kernels. Each backend registers its kernels in its own
// TORCH_LIBRARY_IMPL file: csrc/cpu/ops_cpu.cpp and csrc/cuda/ops_cuda.cpp.
#include <Python.h>
#include <torch/library.h>

#include "grad_stats.h"

// Importing ruda_torch._C runs the static registrations below; the module itself only
// carries build facts (see ruda_torch/_build.py).
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
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

TORCH_LIBRARY(ruda_torch, m) {
  // In-place AdamW/AMSGrad over one bucket (SPEC section 1-2). `slots` is a CPU int64
  // tensor [n, 2]: the element offset of params[i]'s slice in the flat state buffers and
  // the index of its step counter in `steps`. Skip/clip/scale are read on the device.
  m.def(
      "adamw_scaled_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) exp_avg, "
      "Tensor(c!) exp_avg_sq, Tensor(d!)? max_exp_avg_sq, Tensor(e!) steps, Tensor slots, "
      "Tensor? grad_scale, Tensor? found_inf, Tensor? stats, Tensor? clip_coef, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, float max_grad_norm, "
      "bool maximize) -> ()");
  // One statistics row per kStatsChunk elements of each gradient (Note [Statistics row]).
  m.def("analyze_gradient(Tensor[] grads, Tensor? grad_scale, Tensor(a!) rows) -> ()");
  // One tree level: out[k] combines rows[1024k : 1024(k+1)].
  m.def("merge_gradient_stats(Tensor rows, Tensor(a!) out) -> ()");
  // Left fold of several reports (buckets, ranks in rank order) into one.
  m.def("merge_gradient_stats_chunks(Tensor reports, Tensor(a!) out) -> ()");
}

#ifndef RUDA_TORCH_WITH_CUDA
// No silent fallback: a CUDA tensor reaching a build without CUDA kernels gets an error
// that says how to build them, instead of the dispatcher's generic message.
namespace {
[[noreturn]] void no_cuda(const char* op) {
  TORCH_CHECK(false, "ruda_torch.", op,
              " got CUDA tensors, but this ruda_torch build has no CUDA kernels (compiled "
              "backends: cpu). Rebuild with a CUDA build of torch and a CUDA toolkit: "
              "`RUDA_TORCH_CUDA=1 pip install --no-build-isolation -e .` (set CUDA_HOME to "
              "the toolkit root if it is not found; see docs/building.md).");
}
void adamw_no_cuda(at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&,
                   const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                   const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double,
                   double, double, double, double, double, bool) {
  no_cuda("adamw_scaled_");
}
void analyze_no_cuda(at::TensorList, const std::optional<at::Tensor>&, const at::Tensor&) {
  no_cuda("analyze_gradient");
}
void merge_no_cuda(const at::Tensor&, const at::Tensor&) { no_cuda("merge_gradient_stats"); }
void chunks_no_cuda(const at::Tensor&, const at::Tensor&) {
  no_cuda("merge_gradient_stats_chunks");
}
}  // namespace

TORCH_LIBRARY_IMPL(ruda_torch, CUDA, m) {
  m.impl("adamw_scaled_", &adamw_no_cuda);
  m.impl("analyze_gradient", &analyze_no_cuda);
  m.impl("merge_gradient_stats", &merge_no_cuda);
  m.impl("merge_gradient_stats_chunks", &chunks_no_cuda);
}
#endif
