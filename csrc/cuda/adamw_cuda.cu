// CUDA kernels of adamw_scaled_: launch code only; the math is adamw_element() from
// csrc/adamw_math.h (Note [One math, two backends]). Built with --fmad=false.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <algorithm>

#include "adamw_math.h"
#include "cuda_utils.cuh"
#include "kernels.h"

namespace ruda {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per vector access
static_assert(kCudaTile % (kThreads * kVec) == 0, "a tile is whole block-wide vector steps");

// Advances the step counter of every tensor in the call, unless the step is skipped.
// A separate launch, so that every block of the update kernel reads the new value.
__global__ void advance_steps_kernel(const TensorEntry* table, int64_t n, float* steps,
                                     StepControl control) {
  if (decide_step(control).skip) return;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    float& s = steps[table[i].step_index];
    s = s + 1.0f;
  }
}

template <typename T, bool AMSGRAD>
__device__ inline void update_one(float* p, const T* g, float* m, float* v, float* vm, int64_t k,
                                  const StepCoefs<float>& c) {
  float pk = p[k], mk = m[k], vk = v[k], vmk = AMSGRAD ? vm[k] : 0.0f;
  adamw_element<AMSGRAD, ScalarOps>(pk, to_float(g[k]), mk, vk, vmk, c);
  p[k] = pk;
  m[k] = mk;
  v[k] = vk;
  if (AMSGRAD) vm[k] = vmk;
}

template <typename T, bool AMSGRAD>
__global__ void __launch_bounds__(kThreads) adamw_kernel(AdamWLaunch L) {
  const StepDecision d = decide_step(L.control);
  if (d.skip) return;  // parameters, moments and step counters stay bit-identical
  for (int64_t u = blockIdx.x; u < L.n_units; u += gridDim.x) {
    const int64_t i = find_tensor(L.table, L.n_tensors, u);
    const TensorEntry e = L.table[i];
    const int64_t t = step_count(L.steps[e.step_index]);  // Note [Step counter range]
    const StepCoefs<float> c = make_coefs(L.hyper, d.factor, t);
    const int64_t begin = (u - e.unit_start) * kCudaTile;
    const int64_t end = min(begin + kCudaTile, e.numel);
    float* p = e.param;
    const T* g = static_cast<const T*>(e.grad);
    float* m = L.exp_avg + e.state_offset;
    float* v = L.exp_avg_sq + e.state_offset;
    float* vm = AMSGRAD ? L.max_exp_avg_sq + e.state_offset : nullptr;
    const bool aligned = is_aligned<kVec>(p) && is_aligned<kVec>(g) && is_aligned<kVec>(m) &&
                         is_aligned<kVec>(v) && (!AMSGRAD || is_aligned<kVec>(vm));
    if (aligned) {
      for (int64_t k = begin + int64_t(threadIdx.x) * kVec; k < end; k += kThreads * kVec) {
        if (k + kVec <= end) {
          float pv[kVec], gv[kVec], mv[kVec], vv[kVec], vmv[kVec];
          load_vec<kVec>(p + k, pv);
          load_vec<kVec>(g + k, gv);
          load_vec<kVec>(m + k, mv);
          load_vec<kVec>(v + k, vv);
          if (AMSGRAD) load_vec<kVec>(vm + k, vmv);
#pragma unroll
          for (int j = 0; j < kVec; ++j) {
            adamw_element<AMSGRAD, ScalarOps>(pv[j], gv[j], mv[j], vv[j], vmv[j], c);
          }
          store_vec<kVec>(p + k, pv);
          store_vec<kVec>(m + k, mv);
          store_vec<kVec>(v + k, vv);
          if (AMSGRAD) store_vec<kVec>(vm + k, vmv);
        } else {
          for (int64_t kk = k; kk < end; ++kk) update_one<T, AMSGRAD>(p, g, m, v, vm, kk, c);
        }
      }
    } else {  // a view that is not 16-byte aligned: scalar accesses, same math
      for (int64_t k = begin + threadIdx.x; k < end; k += kThreads) {
        update_one<T, AMSGRAD>(p, g, m, v, vm, k, c);
      }
    }
  }
}

template <typename T>
void launch(const AdamWLaunch& L, cudaStream_t stream) {
  if (L.n_units == 0) return;
  const auto kernel = L.amsgrad ? adamw_kernel<T, true> : adamw_kernel<T, false>;
  const int64_t grid = std::min<int64_t>(L.n_units, max_resident_blocks(kernel, kThreads));
  kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(L);
  RUDA_CUDA_CHECK_LAUNCH();
}

}  // namespace

void adamw_cuda(const AdamWLaunch& L, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t step_blocks = std::min<int64_t>((L.n_tensors + kThreads - 1) / kThreads, 1024);
  advance_steps_kernel<<<static_cast<unsigned>(step_blocks), kThreads, 0, stream>>>(
      L.table, L.n_tensors, L.steps, L.control);
  RUDA_CUDA_CHECK_LAUNCH();
  switch (L.grad_dtype) {
    case GradDType::kFloat:
      launch<float>(L, stream);
      break;
    case GradDType::kHalf:
      launch<__half>(L, stream);
      break;
    case GradDType::kBFloat16:
      launch<__nv_bfloat16>(L, stream);
      break;
  }
}

}  // namespace ruda
