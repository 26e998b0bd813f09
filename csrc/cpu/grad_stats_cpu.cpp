// CPU kernels of analyze_gradient, merge_gradient_stats and merge_gradient_stats_chunks.
// They follow Note [Canonical reduction order] in csrc/grad_stats.h: the 256 lanes of a
// row are 32 vectors of 8 floats, so the CPU result has the same bits as the CUDA one
// and does not depend on the number of threads (rows are independent work items).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "cpu/vec_load.h"
#include "grad_stats.h"
#include "kernels.h"

namespace ruda {
namespace {

using cpu::Vec;
constexpr int W = Vec::size();
static_assert(kStatsLanes % W == 0, "lanes must be whole vectors");
constexpr int kLaneVecs = kStatsLanes / W;

// Structure-of-arrays lanes, so that the tree levels with stride >= W are vector ops.
struct alignas(64) Lanes {
  float sum[kStatsLanes];
  float max[kStatsLanes];
  float cnt[kStatsLanes];
};

// The halving tree of stats_tree() on SoA lanes; the result is lane 0.
StatsRow lanes_tree(Lanes& l) {
  for (int s = kStatsLanes / 2; s > 0; s >>= 1) {
    int i = 0;
    for (; s >= W && i < s; i += W) {
      (Vec::loadu(l.sum + i) + Vec::loadu(l.sum + i + s)).store(l.sum + i);
      at::vec::maximum(Vec::loadu(l.max + i), Vec::loadu(l.max + i + s)).store(l.max + i);
      (Vec::loadu(l.cnt + i) + Vec::loadu(l.cnt + i + s)).store(l.cnt + i);
    }
    for (; i < s; ++i) {
      const StatsRow r =
          stats_combine({l.sum[i], l.max[i], l.cnt[i]}, {l.sum[i + s], l.max[i + s], l.cnt[i + s]});
      l.sum[i] = r.sum_sq;
      l.max[i] = r.max_abs;
      l.cnt[i] = r.nonfinite;
    }
  }
  return {l.sum[0], l.max[0], l.cnt[0]};
}

// W consecutive unscaled elements starting at k, zero past `count`. A padding zero adds
// +0 to a sum of squares, cannot raise a maximum of absolute values and is finite, so
// padded lanes give the same bits as lanes that stop early (the CUDA kernel's loop).
template <typename T>
inline Vec load_unscaled(const T* g, int64_t k, int64_t count, const Vec& inv_scale) {
  if (k + W <= count) return cpu::load_fp32<T>(g + k) * inv_scale;
  alignas(32) float tail[W] = {};
  for (int64_t i = k; i < count; ++i) tail[i - k] = static_cast<float>(g[i]);
  return Vec::loadu(tail) * inv_scale;
}

// One analyze row of `count` (<= kStatsChunk) elements, Note [Canonical reduction order]:
// lane vector j (lanes 8j .. 8j+7) accumulates the elements 8j + 256 r in increasing r;
// then the halving tree over the 256 lanes. The row is read once, in order; the 32 x 3
// accumulators live in `lanes` (L1). Only the steps r that hold data run, so a short
// tensor costs what it reads.
template <typename T>
StatsRow analyze_row(const T* g, int64_t count, float inv_scale_f) {
  const Vec zero(0.0f), one(1.0f), inv_scale(inv_scale_f);
  const int64_t steps = (count + kStatsLanes - 1) / kStatsLanes;
  Lanes lanes;
  for (int i = 0; i < kStatsLanes; i += W) {
    zero.store(lanes.sum + i);
    zero.store(lanes.max + i);
    zero.store(lanes.cnt + i);
  }
  for (int64_t r = 0; r < steps; ++r) {
    for (int i = 0; i < kStatsLanes; i += W) {
      const Vec x = load_unscaled<T>(g, r * kStatsLanes + i, count, inv_scale);
      const Vec finite = (x - x) == zero;  // all-ones where x is finite
      (Vec::loadu(lanes.sum + i) + Vec::blendv(zero, x * x, finite)).store(lanes.sum + i);
      // clamp_min(v, acc) is max(acc, v), `acc > v ? acc : v`; no NaN reaches it.
      at::vec::clamp_min(Vec::blendv(zero, x.abs(), finite), Vec::loadu(lanes.max + i))
          .store(lanes.max + i);
      (Vec::loadu(lanes.cnt + i) + Vec::blendv(one, zero, finite)).store(lanes.cnt + i);
    }
  }
  return lanes_tree(lanes);
}

template <typename T>
void analyze(const StatsLaunch& L, float inv_scale) {
  at::parallel_for(0, L.n_rows, 16, [&](int64_t r_begin, int64_t r_end) {
    int64_t i = find_tensor(L.table, L.n_tensors, r_begin);
    for (int64_t r = r_begin; r < r_end; ++r) {
      while (i + 1 < L.n_tensors && L.table[i + 1].unit_start <= r) ++i;
      const TensorEntry& e = L.table[i];
      const int64_t begin = (r - e.unit_start) * kStatsChunk;
      const int64_t count = std::min(kStatsChunk, e.numel - begin);
      const T* g = static_cast<const T*>(e.grad) + begin;
      stats_store(L.rows + kStatsWidth * r, analyze_row<T>(g, count, inv_scale));
    }
  });
}

}  // namespace

void analyze_gradient_cpu(const StatsLaunch& L) {
  const float inv_scale = L.grad_scale != nullptr ? 1.0f / L.grad_scale[0] : 1.0f;
  switch (L.grad_dtype) {
    case GradDType::kFloat:
      analyze<float>(L, inv_scale);
      break;
    case GradDType::kHalf:
      analyze<c10::Half>(L, inv_scale);
      break;
    case GradDType::kBFloat16:
      analyze<c10::BFloat16>(L, inv_scale);
      break;
  }
}

void merge_gradient_stats_cpu(const float* rows, int64_t n_rows, float* out) {
  const int64_t n_out = (n_rows + kMergeFanIn - 1) / kMergeFanIn;
  at::parallel_for(0, n_out, 4, [&](int64_t b, int64_t e) {
    for (int64_t k = b; k < e; ++k) {
      const int64_t first = k * kMergeFanIn;
      const int64_t count = std::min(kMergeFanIn, n_rows - first);
      stats_store(out + kStatsWidth * k, stats_merge_rows(rows + kStatsWidth * first, count));
    }
  });
}

void merge_gradient_stats_chunks_cpu(const float* reports, int64_t n_reports, float* out) {
  StatsRow acc = stats_zero();
  for (int64_t k = 0; k < n_reports; ++k) {
    acc = stats_combine(acc, stats_load(reports + kStatsWidth * k));
  }
  stats_store(out, acc);
}

}  // namespace ruda
