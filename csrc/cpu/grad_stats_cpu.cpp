// CPU kernels of analyze_gradient, merge_gradient_stats and merge_gradient_stats_chunks.
// They follow Note [Canonical reduction order] in csrc/grad_stats.h: the 256 lanes of a
// row are 32 vectors of 8 floats, so the CPU result has the same bits as the CUDA one
// and does not depend on the number of threads (rows are independent work items).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "grad_stats.h"
#include "kernels.h"

namespace ruda {
namespace {

using Vec = at::vec::Vectorized<float>;
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

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// One analyze row of `count` (<= kStatsChunk) elements. The row is first converted and
// unscaled into a zero-padded buffer: a padding zero adds +0 to a sum of squares, cannot
// raise a maximum of absolute values and is finite, so the padded lanes give the same
// bits as lanes that stop early (stats_row_scalar()).
template <typename T>
StatsRow analyze_row(const T* g, int64_t count, float inv_scale) {
  alignas(64) float buf[kStatsChunk];
  int64_t k = 0;
  for (; k < count; ++k) buf[k] = to_float(g[k]) * inv_scale;
  for (; k < kStatsChunk; ++k) buf[k] = 0.0f;

  Vec sum[kLaneVecs], mx[kLaneVecs], cnt[kLaneVecs];
  const Vec zero(0.0f), one(1.0f);
  for (int j = 0; j < kLaneVecs; ++j) sum[j] = mx[j] = cnt[j] = zero;
  for (int64_t r = 0; r < kStatsChunk; r += kStatsLanes) {
    for (int j = 0; j < kLaneVecs; ++j) {
      const Vec x = Vec::loadu(buf + r + j * W);
      const Vec finite = (x - x) == zero;  // all-ones where x is finite
      sum[j] = sum[j] + Vec::blendv(zero, x * x, finite);
      mx[j] = at::vec::maximum(mx[j], Vec::blendv(zero, x.abs(), finite));
      cnt[j] = cnt[j] + Vec::blendv(one, zero, finite);
    }
  }
  Lanes lanes;
  for (int j = 0; j < kLaneVecs; ++j) {
    sum[j].store(lanes.sum + j * W);
    mx[j].store(lanes.max + j * W);
    cnt[j].store(lanes.cnt + j * W);
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
