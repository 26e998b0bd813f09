// CPU kernels of analyze_gradient, merge_gradient_stats and merge_gradient_stats_chunks.
// They follow Note [Canonical reduction order] in csrc/grad_stats.h: the 32 lanes of an
// analyze row are 4 vectors of 8 floats, so the CPU result has the same bits as the CUDA
// one and does not depend on the number of threads (rows are independent work items).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>

#include "cpu/kernels/vec_load.h"
#include "grad_stats.h"
#include "kernels.h"

namespace ruda {
namespace {

using cpu::Vec;
constexpr int W = Vec::size();
static_assert(kRowLanes % W == 0, "lanes must be whole vectors");
constexpr int kRowVecs = kRowLanes / W;  // lane vector v holds lanes vW .. vW + W - 1

// The halving tree of one row over its lane vectors; the result is lane 0. Levels with
// s >= W pair whole lane vectors (lane i of vector v with lane i of vector v + s/W), so
// they run as vector operations on the registers; the last log2(W) levels are scalar.
StatsRow row_tree(Vec* sum, Vec* max, Vec* cnt) {
  for (int h = kRowVecs / 2; h > 0; h >>= 1) {
    for (int v = 0; v < h; ++v) {
      sum[v] = sum[v] + sum[v + h];
      max[v] = at::vec::maximum(max[v], max[v + h]);
      cnt[v] = cnt[v] + cnt[v + h];
    }
  }
  alignas(64) float s[W], m[W], c[W];
  sum[0].store(s);
  max[0].store(m);
  cnt[0].store(c);
  StatsRow lanes[W];
  for (int j = 0; j < W; ++j) lanes[j] = {s[j], m[j], c[j]};
  stats_tree<W>(lanes);
  return lanes[0];
}

// W consecutive unscaled elements starting at k, zero past `count`. A padding zero adds
// +0 to a sum of squares, cannot raise a maximum of absolute values and is finite, so
// padded lanes give the same bits as lanes that stop early (the CUDA kernel's loop).
// The padding is added after scaling: 0 * inv_scale is NaN for an infinite inverse scale
// (grad_scale 0) or a NaN one, and would count padding as non-finite elements where the
// CUDA kernel counts only real ones.
template <typename T>
inline Vec load_unscaled(const T* g, int64_t k, int64_t count, const Vec& inv_scale) {
  if (k + W <= count) return cpu::load_fp32<T>(g + k) * inv_scale;
  alignas(32) float tail[W] = {};
  alignas(32) float scale[W];
  inv_scale.store(scale);
  for (int64_t i = k; i < count; ++i) tail[i - k] = static_cast<float>(g[i]) * scale[i - k];
  return Vec::loadu(tail);
}

// One analyze row of `count` (<= kStatsChunk) elements, Note [Canonical reduction order]:
// lane vector v accumulates the elements vW + 32 r in increasing r, then the tree. This
// general form masks and counts non-finite values and handles short rows.
template <typename T>
StatsRow analyze_row_general(const T* g, int64_t count, const Vec& inv_scale) {
  const Vec zero(0.0f), one(1.0f);
  Vec sum[kRowVecs], max[kRowVecs], cnt[kRowVecs];
  for (int v = 0; v < kRowVecs; ++v) sum[v] = max[v] = cnt[v] = zero;
  for (int64_t k = 0; k < count; k += kRowLanes) {
    for (int v = 0; v < kRowVecs; ++v) {
      const Vec x = load_unscaled<T>(g, k + v * W, count, inv_scale);
      const Vec finite = (x - x) == zero;  // all-ones where x is finite
      sum[v] = sum[v] + Vec::blendv(zero, x * x, finite);
      // clamp_min(v, acc) is max(acc, v), `acc > v ? acc : v`; no NaN reaches it.
      max[v] = at::vec::clamp_min(Vec::blendv(zero, x.abs(), finite), max[v]);
      cnt[v] = cnt[v] + Vec::blendv(one, zero, finite);
    }
  }
  return row_tree(sum, max, cnt);
}

// Software prefetch of the finite form: one FP32 row (16 KiB) ahead, non-temporal (the
// gradient is read once here; a bucket-sized stream would only evict what the caches
// hold). Measured on a 2-core AVX2 machine against torch's own sum of the same tensor
// in the same process: 1.28x its time without the prefetch, 1.13x with a temporal one,
// 1.06-1.08x with this; 32 and 64 KiB ahead did worse.
constexpr int kPrefetchBytes = 16384;
template <typename T>
constexpr int kStepBytes = kRowLanes * sizeof(T);  // bytes read per step of 32 lanes

// A full row on the assumption that every element is finite: the same lanes, the same
// additions in the same order and the same tree as analyze_row_general, so the same
// bits when the assumption holds, without the mask and the count (on an AVX2 core the
// mask costs more than the memory does). Returns false when the row's sum is not
// finite: then an element was inf or NaN (its square poisons its lane's sum for good)
// or the squares overflowed, and the caller redoes the row in the general form.
template <typename T, bool kScaled>
bool analyze_row_finite(const T* g, const Vec& inv_scale, StatsRow& out) {
  const Vec zero(0.0f);
  Vec sum[kRowVecs], max[kRowVecs], cnt[kRowVecs];
  for (int v = 0; v < kRowVecs; ++v) sum[v] = max[v] = cnt[v] = zero;
  for (int64_t k = 0; k < kStatsChunk; k += kRowLanes) {
    // Past the end of the tensor this touches nothing: a prefetch never faults.
    const char* ahead = reinterpret_cast<const char*>(g + k) + kPrefetchBytes;
    for (int line = 0; line < kStepBytes<T>; line += 64) __builtin_prefetch(ahead + line, 0, 0);
    for (int v = 0; v < kRowVecs; ++v) {
      Vec x = cpu::load_fp32<T>(g + k + v * W);
      if (kScaled) x = x * inv_scale;
      sum[v] = sum[v] + x * x;
      // Finite, non-negative operands: the same maximum as the general form's.
      max[v] = at::vec::clamp_min(x.abs(), max[v]);
    }
  }
  out = row_tree(sum, max, cnt);
  return out.sum_sq - out.sum_sq == 0.0f;
}

template <typename T>
StatsRow analyze_row(const T* g, int64_t count, float inv_scale_f) {
  const Vec inv_scale(inv_scale_f);
  StatsRow row;
  if (count == kStatsChunk) {
    // x * 1 == x for every float, so an unscaled gradient skips the multiply.
    const bool finite = inv_scale_f == 1.0f ? analyze_row_finite<T, false>(g, inv_scale, row)
                                            : analyze_row_finite<T, true>(g, inv_scale, row);
    if (finite) return row;
  }
  return analyze_row_general<T>(g, count, inv_scale);
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
    case DType::kFloat:
      analyze<float>(L, inv_scale);
      break;
    case DType::kHalf:
      analyze<c10::Half>(L, inv_scale);
      break;
    case DType::kBFloat16:
      analyze<c10::BFloat16>(L, inv_scale);
      break;
    case DType::kDouble:  // FP64 gradients have no statistics (the binding rejects them)
    case DType::kUInt8:   // state dtypes, never a gradient's
    case DType::kNibble:
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
