// CUDA kernels of analyze_gradient, merge_gradient_stats and merge_gradient_stats_chunks.
// One thread is one lane of Note [Canonical reduction order] (csrc/grad_stats.h): an
// analyze row is one warp (tree by shuffles), a merge output row one block (tree in
// shared memory), with the same pairing as stats_tree(), so the bits equal the CPU
// kernels'. No atomics.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_utils.cuh"
#include "grad_stats.h"
#include "kernels.h"

namespace ruda {
namespace {

static_assert(kRowLanes == 32, "one lane per thread of a warp");
constexpr int kAnalyzeThreads = 256;  // 8 warps: 8 rows in flight per block
constexpr int kRowsPerBlock = kAnalyzeThreads / kRowLanes;

// Combines the warp's lanes with the halving tree; the result is in lane 0. At level s
// lane i < s takes lane i + s, which held a valid value at level 2s; lanes >= s compute
// values nobody reads (a shuffle from past the warp returns the caller's own value).
__device__ inline StatsRow warp_tree(StatsRow v) {
  constexpr unsigned kAll = 0xffffffffu;
#pragma unroll
  for (int s = kRowLanes / 2; s > 0; s >>= 1) {
    const StatsRow other = {__shfl_down_sync(kAll, v.sum_sq, s),
                            __shfl_down_sync(kAll, v.max_abs, s),
                            __shfl_down_sync(kAll, v.nonfinite, s)};
    v = stats_combine(v, other);
  }
  return v;
}

// Combines the block's lanes; the result is returned to thread 0.
__device__ inline StatsRow block_tree(StatsRow mine) {
  __shared__ float s_sum[kMergeLanes], s_max[kMergeLanes], s_cnt[kMergeLanes];
  const int j = threadIdx.x;
  s_sum[j] = mine.sum_sq;
  s_max[j] = mine.max_abs;
  s_cnt[j] = mine.nonfinite;
  __syncthreads();
  for (int s = kMergeLanes / 2; s > 0; s >>= 1) {
    if (j < s) {
      const StatsRow r =
          stats_combine({s_sum[j], s_max[j], s_cnt[j]}, {s_sum[j + s], s_max[j + s], s_cnt[j + s]});
      s_sum[j] = r.sum_sq;
      s_max[j] = r.max_abs;
      s_cnt[j] = r.nonfinite;
    }
    __syncthreads();
  }
  const StatsRow out = {s_sum[0], s_max[0], s_cnt[0]};
  __syncthreads();  // the shared arrays are reused by the block's next row
  return out;
}

// One warp per row at a time (the row loop is warp-uniform, so every lane reaches the
// shuffles); lane j reads elements j, j + 32, ...: each load instruction of the warp
// reads consecutive elements.
template <typename T>
__global__ void __launch_bounds__(kAnalyzeThreads) analyze_kernel(StatsLaunch L) {
  const float inv_scale = L.grad_scale != nullptr ? 1.0f / L.grad_scale[0] : 1.0f;
  const int lane = static_cast<int>(threadIdx.x) % kRowLanes;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kRowLanes;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  for (int64_t r = first; r < L.n_rows; r += stride) {
    const int64_t i = find_tensor(L.table, L.n_tensors, r);
    const TensorEntry e = L.table[i];
    const int64_t begin = (r - e.unit_start) * kStatsChunk;
    const int64_t count = min(kStatsChunk, e.numel - begin);
    const T* g = static_cast<const T*>(e.grad) + begin;
    StatsRow acc = stats_zero();
#pragma unroll 8
    for (int64_t k = lane; k < count; k += kRowLanes) {
      stats_add(acc, to_float(g[k]) * inv_scale);  // static-check: 32-bit (canonical lane order)
    }
    const StatsRow row = warp_tree(acc);
    if (lane == 0) stats_store(L.rows + kStatsWidth * r, row);
  }
}

__global__ void __launch_bounds__(kMergeLanes)
    merge_kernel(const float* rows, int64_t n_rows, float* out, int64_t n_out) {
  for (int64_t o = blockIdx.x; o < n_out; o += gridDim.x) {
    const int64_t first = o * kMergeFanIn;
    const int64_t count = min(kMergeFanIn, n_rows - first);
    StatsRow lane = stats_zero();
    for (int64_t k = threadIdx.x; k < count; k += kMergeLanes) {
      lane = stats_combine(
          lane, stats_load(rows + kStatsWidth * (first + k)));  // static-check: 32-bit (rows)
    }
    const StatsRow row = block_tree(lane);
    if (threadIdx.x == 0) stats_store(out + kStatsWidth * o, row);
  }
}

// A left fold in the order given: tiny (one report per bucket or rank), one thread.
__global__ void __launch_bounds__(1)
    merge_chunks_kernel(const float* reports, int64_t n, float* out) {
  StatsRow acc = stats_zero();
  for (int64_t k = 0; k < n; ++k)
    acc = stats_combine(acc, stats_load(reports + kStatsWidth * k));  // static-check: 32-bit (rows)
  stats_store(out, acc);
}

}  // namespace

void analyze_gradient_cuda(const StatsLaunch& L, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t blocks = (L.n_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  auto run = [&](auto kernel) {
    const auto grid = static_cast<unsigned>(
        std::min<int64_t>(blocks, max_resident_blocks(kernel, kAnalyzeThreads)));
    launch_kernel(kernel, grid, kAnalyzeThreads, stream, L);
  };
  switch (L.grad_dtype) {
    case DType::kFloat:
      run(analyze_kernel<float>);
      break;
    case DType::kHalf:
      run(analyze_kernel<__half>);
      break;
    case DType::kBFloat16:
      run(analyze_kernel<__nv_bfloat16>);
      break;
    case DType::kDouble:  // FP64 gradients have no statistics (the binding rejects them)
    case DType::kUInt8:   // state dtypes, never a gradient's
    case DType::kNibble:
      break;
  }
  RUDA_CUDA_CHECK_LAUNCH();
}

void merge_gradient_stats_cuda(const float* rows, int64_t n_rows, float* out, void* stream_ptr) {
  const int64_t n_out = (n_rows + kMergeFanIn - 1) / kMergeFanIn;
  const int64_t grid = std::min<int64_t>(n_out, max_resident_blocks(merge_kernel, kMergeLanes));
  launch_kernel(merge_kernel, static_cast<unsigned>(grid), kMergeLanes,
                static_cast<cudaStream_t>(stream_ptr), rows, n_rows, out, n_out);
  RUDA_CUDA_CHECK_LAUNCH();
}

void merge_gradient_stats_chunks_cuda(const float* reports, int64_t n, float* out,
                                      void* stream_ptr) {
  launch_kernel(merge_chunks_kernel, 1, 1, static_cast<cudaStream_t>(stream_ptr), reports, n, out);
  RUDA_CUDA_CHECK_LAUNCH();
}

}  // namespace ruda
