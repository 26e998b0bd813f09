// Operator schemas (TORCH_LIBRARY) and the rejection kernels (sparse tensors; CUDA tensors
// in a build without CUDA kernels). Each backend registers its kernels in its own
// TORCH_LIBRARY_IMPL file: csrc/cpu/ops_cpu.cpp and csrc/cuda/ops_cuda.cpp. The Python
// module object is in csrc/module.cpp.
#include <torch/library.h>

#include <string>

#include "bindings.h"

TORCH_LIBRARY(ruda_torch, m) {
  // In-place AdamW/AMSGrad over one bucket (docs/design.md sections 1-2). `slots` is a CPU int64
  // tensor [n, 2]: the element offset of params[i]'s slice in the flat state buffers and
  // the index of its step counter in `steps`. Skip/clip/scale are read on the device.
  // `master`: FP32 master weights of 16-bit params (same layout as exp_avg), or int16
  // remainders of BF16 params' FP32 masters (Note [Remainder master]); `lr_tensor`:
  // a one-element lr read by the kernel; `rounding` 1: stochastic rounding of BF16 params
  // with `seed` (Note [Parameter dtypes] in csrc/adamw_math.h); `decoupled` false: Adam's
  // L2 decay, weight_decay * param added to the gradient (Note [Weight decay modes]).
  // 8-bit (uint8) moments: packed, each buffer its codes then its scales, or with
  // `scales` the codes alone and the scales of all moments in `scales`, one run each
  // (Note [8-bit moments] in csrc/quant8.h). 4-bit moments: int8 buffers of two codes per
  // byte, with `scales` (Note [4-bit moments] in csrc/quant4.h).
  m.def(
      "adamw_scaled_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!) exp_avg, "
      "Tensor(c!) exp_avg_sq, Tensor(d!)? max_exp_avg_sq, Tensor(e!) steps, Tensor slots, "
      "Tensor? grad_scale, Tensor? found_inf, Tensor? stats, Tensor? clip_coef, float lr, "
      "float beta1, float beta2, float eps, float weight_decay, float max_grad_norm, "
      "bool maximize, *, Tensor(f!)? master=None, Tensor? lr_tensor=None, int rounding=0, "
      "int seed=0, bool decoupled=True, Tensor(g!)? scales=None) -> ()");
  // The validation of adamw_scaled_ alone: raises what adamw_scaled_ would raise for the
  // same arguments and writes nothing. The optimizer runs it for every kernel call of a
  // step that has more than one, before the first one writes (Note [Atomic step] in
  // ruda_torch/optimizer.py).
  m.def(
      "check_adamw_scaled(Tensor[] params, Tensor[] grads, Tensor exp_avg, Tensor exp_avg_sq, "
      "Tensor? max_exp_avg_sq, Tensor steps, Tensor slots, Tensor? grad_scale, Tensor? found_inf, "
      "Tensor? stats, Tensor? clip_coef, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, float max_grad_norm, bool maximize, *, Tensor? master=None, "
      "Tensor? lr_tensor=None, int rounding=0, int seed=0, bool decoupled=True, "
      "Tensor? scales=None) -> ()");
  // One statistics row per kStatsChunk elements of each gradient (Note [Statistics row]).
  m.def("analyze_gradient(Tensor[] grads, Tensor? grad_scale, Tensor(a!) rows) -> ()");
  // One tree level: out[k] combines rows[1024k : 1024(k+1)].
  m.def("merge_gradient_stats(Tensor rows, Tensor(a!) out) -> ()");
  // Left fold of several reports (buckets, ranks in rank order) into one.
  m.def("merge_gradient_stats_chunks(Tensor reports, Tensor(a!) out) -> ()");
  // Blockwise 8-bit codes (Note [8-bit moments] in csrc/quant8.h): `codes` (uint8, one per
  // element of x) and `scales` (float32, one per block of 256) := x's; `code` 0 signed
  // (exp_avg), 1 unsigned (exp_avg_sq). dequantize_8bit writes the decoded values to out.
  m.def("quantize_8bit(Tensor x, Tensor(a!) codes, Tensor(b!) scales, int code) -> ()");
  m.def("dequantize_8bit(Tensor codes, Tensor scales, Tensor(a!) out, int code) -> ()");
  // Blockwise 4-bit codes (Note [4-bit moments] in csrc/quant4.h): `codes` (uint8, two per
  // byte, ceil(n / 2) bytes) and `scales` (float32, one per block of 128) := x's.
  m.def("quantize_4bit(Tensor x, Tensor(a!) codes, Tensor(b!) scales, int code) -> ()");
  m.def("dequantize_4bit(Tensor codes, Tensor scales, Tensor(a!) out, int code) -> ()");
}

// No silent fallback: tensors that no kernel of this build can take get an error that
// says what to do, instead of the dispatcher's generic "Could not run" message. Boxed
// kernels, so one function serves every operator whatever its signature.
namespace {

// "grads[1]" for the first sparse tensor among the arguments (lists included).
std::string first_sparse_argument(const c10::OperatorHandle& op, const torch::jit::Stack& stack) {
  const auto& args = op.schema().arguments();
  const size_t first = stack.size() - args.size();
  for (size_t a = 0; a < args.size(); ++a) {
    const c10::IValue& v = stack[first + a];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().is_sparse()) return args[a].name();
    if (v.isTensorList()) {
      const auto list = v.toTensorList();
      for (size_t i = 0; i < list.size(); ++i) {
        const at::Tensor t = list.get(i);
        if (t.defined() && t.is_sparse()) return args[a].name() + "[" + std::to_string(i) + "]";
      }
    }
  }
  return "an argument";
}

void reject_sparse(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  TORCH_CHECK(false, "ruda_torch.", op.schema().name().substr(op.schema().name().find("::") + 2),
              ": ", first_sparse_argument(op, *stack),
              " is sparse; sparse gradients are not supported (use dense gradients, e.g. "
              "nn.Embedding(sparse=False))");
}

#ifndef RUDA_TORCH_WITH_CUDA
void reject_cuda(const c10::OperatorHandle& op, torch::jit::Stack*) {
  TORCH_CHECK(false, "ruda_torch.", op.schema().name().substr(op.schema().name().find("::") + 2),
              " got CUDA tensors, but this ruda_torch build has no CUDA kernels (compiled "
              "backends: cpu). Rebuild with a CUDA build of torch and a CUDA toolkit: "
              "`RUDA_TORCH_CUDA=1 pip install --no-build-isolation -e .` (set CUDA_HOME to "
              "the toolkit root if it is not found; see docs/building.md).");
}
#endif

constexpr const char* kOps[] = {"adamw_scaled_",
                                "check_adamw_scaled",
                                "analyze_gradient",
                                "merge_gradient_stats",
                                "merge_gradient_stats_chunks",
                                "quantize_8bit",
                                "dequantize_8bit",
                                "quantize_4bit",
                                "dequantize_4bit"};

}  // namespace

TORCH_LIBRARY_IMPL(ruda_torch, SparseCPU, m) {
  for (const char* op : kOps)
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_sparse>());
}

TORCH_LIBRARY_IMPL(ruda_torch, SparseCUDA, m) {
  for (const char* op : kOps)
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_sparse>());
}

#ifndef RUDA_TORCH_WITH_CUDA
TORCH_LIBRARY_IMPL(ruda_torch, CUDA, m) {
  for (const char* op : kOps) m.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_cuda>());
}
#endif

// check_adamw_scaled reads only metadata and addresses, the same on every backend: one
// kernel for all (the sparse and CPU-only-build CUDA registrations above take precedence).
TORCH_LIBRARY_IMPL(ruda_torch, CompositeExplicitAutograd, m) {
  m.impl("check_adamw_scaled", &ruda::check_adamw_scaled);
}
