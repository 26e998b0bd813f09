// Gradient statistics: the row, how rows combine, and the one canonical reduction
// order that the CPU and the CUDA kernels both follow.
//
// Note [Statistics row]
// A row (and the final report) is 3 FP32 values, 12 bytes, in this order:
//   [sum_of_squares, max_abs, nonfinite_count]
// over the unscaled gradient g = stored * (1 / gradient_scale). A non-finite g is
// counted and contributes nothing to the other two.
//
// Note [Canonical reduction order]
// No floating-point sum depends on thread scheduling (no atomics):
// * analyze_gradient: each tensor is cut into rows of kStatsChunk elements (the last
//   row of a tensor may be shorter; rows never span tensors). Within a row, lane j of
//   kRowLanes (32) accumulates the elements j, j + 32, j + 64, ... in increasing order;
//   then lanes are combined by a halving tree: for s = L/2, L/4, ..., 1 lane i (i < s)
//   becomes combine(lane i, lane i + s). Lane 0 is the row.
// * merge_gradient_stats: output row k combines input rows [k*1024, (k+1)*1024) in the
//   same pattern over kMergeLanes (256) lanes: lane j takes rows j, j + 256, j + 512,
//   j + 768, then the tree.
// * merge_gradient_stats_chunks: a left fold over the reports in the order given
//   (buckets in optimizer order, ranks in rank order).
// Why 32 lanes of consecutive elements: the row is then read front to back by both
// backends. On the CPU the 32 lanes are 4 vectors of 8 floats held in registers for the
// whole row (a sequential stream the hardware prefetcher follows); on CUDA they are the
// 32 threads of a warp, each load instruction reading 32 consecutive elements. (The
// earlier 256 strided lanes made the CPU either keep its accumulators in L1, a load and
// a store per vector, or read the row with a 1 KiB stride: both ran at about 60% of the
// machine's read bandwidth.) Because addition is commutative in IEEE arithmetic and the
// pairing is fixed, every backend gives the same bits for any thread count.
#pragma once

#include <cstdint>

#include "ruda_params.h"

namespace ruda {

constexpr int64_t kStatsChunk = 4096;  // gradient elements per statistics row
constexpr int kRowLanes = 32;          // lanes of an analyze row (a CUDA warp)
constexpr int kMergeLanes = 256;       // lanes of a merge output row (a CUDA block)
constexpr int64_t kMergeFanIn = 1024;  // rows combined into one by merge_gradient_stats
constexpr int kStatsWidth = 3;         // floats per row

struct StatsRow {
  float sum_sq;
  float max_abs;
  float nonfinite;
};

RUDA_HOST_DEVICE inline StatsRow stats_zero() { return {0.0f, 0.0f, 0.0f}; }

RUDA_HOST_DEVICE inline float stats_max(float a, float b) { return a > b ? a : b; }

// Adds one unscaled gradient element. `g - g == 0` is false exactly for inf and NaN.
RUDA_HOST_DEVICE inline void stats_add(StatsRow& r, float g) {
  if (g - g == 0.0f) {
    r.sum_sq = r.sum_sq + g * g;
    r.max_abs = stats_max(r.max_abs, ::fabsf(g));
  } else {
    r.nonfinite = r.nonfinite + 1.0f;
  }
}

RUDA_HOST_DEVICE inline StatsRow stats_combine(const StatsRow& a, const StatsRow& b) {
  return {a.sum_sq + b.sum_sq, stats_max(a.max_abs, b.max_abs), a.nonfinite + b.nonfinite};
}

RUDA_HOST_DEVICE inline StatsRow stats_load(const float* p) { return {p[0], p[1], p[2]}; }

RUDA_HOST_DEVICE inline void stats_store(float* p, const StatsRow& r) {
  p[0] = r.sum_sq;
  p[1] = r.max_abs;
  p[2] = r.nonfinite;
}

// The halving tree over kLanes lanes, in place; the result is lanes[0]. The CUDA
// kernels run the same pairing with one lane per thread.
template <int kLanes>
RUDA_HOST_DEVICE inline void stats_tree(StatsRow* lanes) {
  for (int s = kLanes / 2; s > 0; s >>= 1) {
    for (int i = 0; i < s; ++i) lanes[i] = stats_combine(lanes[i], lanes[i + s]);
  }
}

// One merge_gradient_stats output row from `count` (<= kMergeFanIn) input rows.
RUDA_HOST_DEVICE inline StatsRow stats_merge_rows(const float* rows, int64_t count) {
  StatsRow lanes[kMergeLanes];
  for (int j = 0; j < kMergeLanes; ++j) {
    lanes[j] = stats_zero();
    for (int64_t k = j; k < count; k += kMergeLanes) {
      lanes[j] = stats_combine(lanes[j], stats_load(rows + kStatsWidth * k));
    }
  }
  stats_tree<kMergeLanes>(lanes);
  return lanes[0];
}

// Rows of a tensor of `numel` elements.
RUDA_HOST_DEVICE inline int64_t stats_rows_for(int64_t numel) {
  return (numel + kStatsChunk - 1) / kStatsChunk;
}

}  // namespace ruda
