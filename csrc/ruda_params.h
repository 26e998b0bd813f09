// Plain parameter structs that the bindings (csrc/ops.cpp) fill after validating the
// at::Tensor arguments, and that the CPU and CUDA kernels take. Kernels never see an
// at::Tensor: raw addresses, sizes and scalars only.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RUDA_HOST_DEVICE __host__ __device__
#else
#define RUDA_HOST_DEVICE
#endif

namespace ruda {

// Note [Tensor table]
// One launch covers a whole bucket whatever the number of parameters: the binding
// writes one TensorEntry per tensor into a table (host memory for the CPU kernels, a
// device copy for CUDA). Each tensor is cut into fixed-size units (update tiles, or
// statistics rows); `unit_start` is the prefix sum of the unit counts, so that a block
// finds its tensor by binary search and no unit ever spans two tensors. All sizes and
// offsets are 64-bit: a single tensor may hold more than 2^31 elements.
struct TensorEntry {
  void* param;           // parameter, dtype given by the launch (nullptr for statistics)
  const void* grad;      // gradient, dtype given by the launch
  int64_t numel;         // elements of this tensor
  int64_t state_offset;  // first element of its slice in the flat state buffers
  int64_t step_index;    // its step counter in the flat `steps` buffer
  int64_t unit_start;    // first unit (tile or statistics row) of this tensor
  // With 8-bit or 4-bit moments, the length of the tensor's rows when they are not whole
  // blocks (Note [8-bit row blocks] in csrc/quant8.h, Note [4-bit row blocks] in
  // csrc/quant4.h), and then its first scale in each moment's run of scales; 0 and unused
  // otherwise.
  int64_t row;
  int64_t scale_offset;
};
constexpr int64_t kTableWords = 8;
static_assert(sizeof(TensorEntry) == kTableWords * sizeof(int64_t),
              "TensorEntry is copied as int64[kTableWords]");

// Element types of parameters and gradients. Statistics take the first three; the update
// takes FP64 parameters with FP64 gradients (Note [Parameter dtypes] in adamw_math.h).
// kUInt8: 8-bit moment buffers (Note [8-bit moments] in csrc/quant8.h), never parameters.
// kNibble: 4-bit moment buffers, two codes per byte (Note [4-bit moments] in csrc/quant4.h).
enum class DType : int32_t {
  kFloat = 0,
  kHalf = 1,
  kBFloat16 = 2,
  kDouble = 3,
  kUInt8 = 4,
  kNibble = 5
};

// How an update computed in FP32 is written into a 16-bit parameter.
enum class Rounding : int32_t { kNearestEven = 0, kStochastic = 1 };

struct AdamWHyper {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  // A Tensor lr on the parameters' device, read by the kernel instead of `lr` (at most
  // one is set), so that an LR schedule needs no host sync and changes no argument.
  const float* lr_f32;
  const double* lr_f64;
  // Note [Weight decay modes] in adamw_math.h: false decoupled (AdamW), true L2 (Adam).
  bool l2;
  // The FP32 casts of the constants above (Note [Bias correction] in adamw_math.h), made
  // once with them (set_float_consts in adamw_math.h): the kernels read them as launch
  // constants instead of converting each time.
  float beta1_f, one_minus_beta1_f, beta2_f, one_minus_beta2_f, eps_f, weight_decay_f;
};

// Device-resident control values (any pointer may be null), read by the kernel itself
// so that deciding skip/clip needs no host sync.
struct StepControl {
  const float* grad_scale;  // GradScaler's scale: g = stored / scale
  const float* found_inf;   // nonzero: skip the step
  const float* stats;       // 3-float report [sum_sq, max_abs, nonfinite] of unscaled grads
  const float* clip_coef;   // explicit clip coefficient (tensor-op norm path)
  // The same in FP64, for FP64 parameters (clip_grad_norm_'s coefficient is FP64 there);
  // at most one of the two is set.
  const double* clip_coef_f64;
  double max_grad_norm;  // > 0: clip from `stats`
  bool maximize;
};

struct AdamWLaunch {
  const TensorEntry* table;  // n_tensors entries
  int64_t n_tensors;
  int64_t n_units;  // total update tiles
  DType param_dtype;
  DType grad_dtype;
  bool amsgrad;
  // Flat state: FP64 for FP64 parameters, FP32 (or BF16, state_dtype) for all others.
  void* exp_avg;
  void* exp_avg_sq;
  void* max_exp_avg_sq;  // null without AMSGrad
  // kFloat (kDouble for FP64 parameters), or kBFloat16 for every moment buffer (Note
  // [Low-precision states] in adamw_math.h), or kUInt8: each moment buffer holds the codes
  // of its elements, then one FP32 scale per block of 256 (Note [8-bit moments] in
  // csrc/quant8.h), whose start the *_scales pointers give (null for other dtypes).
  DType state_dtype;
  float* exp_avg_scales;
  float* exp_avg_sq_scales;
  float* max_exp_avg_sq_scales;
  float* master;  // FP32 master weights of 16-bit parameters, or null
  // The masters' low halves of BF16 parameters (master_weights="remainder", Note
  // [Remainder master] in csrc/adamw_math.h), int16 like exp_avg's layout, or null; never
  // set with `master`.
  uint16_t* remainder;
  // 8-bit or 4-bit moments: whether some block of the launch is not a whole block of aligned
  // elements (the last block of a tensor whose size is no multiple of the block, rows that are
  // not whole blocks, a view not aligned for wide accesses), which the CUDA kernels step in a
  // launch of their own (Note [8-bit CUDA registers], Note [4-bit CUDA step] in
  // csrc/cuda/adamw_cuda.cu); set by the binding with the table.
  bool edges;
  // 8-bit or 4-bit moments: whether a tensor has rows that are not whole blocks, of more
  // than a block each, whose whole blocks the CUDA kernels step in a launch of their own
  // (Pass8 in csrc/cuda/adamw_cuda.cu); set by the binding with the table.
  bool rows;
  float* steps;
  Rounding rounding;        // 16-bit parameters without master weights
  Rounding state_rounding;  // BF16 moments
  uint64_t seed;            // of stochastic rounding
  AdamWHyper hyper;
  StepControl control;
};

struct StatsLaunch {
  const TensorEntry* table;  // n_tensors entries; unit = one statistics row
  int64_t n_tensors;
  int64_t n_rows;
  DType grad_dtype;         // kFloat, kHalf or kBFloat16
  const float* grad_scale;  // may be null
  float* rows;              // n_rows x 3
};

// quantize_8bit / dequantize_8bit (Note [8-bit moments] in csrc/quant8.h): n elements in
// blocks of kBlock8, one scale per block; quantize_4bit / dequantize_4bit (Note [4-bit
// moments] in csrc/quant4.h): blocks of kBlock4, `codes` ceil(n / 2) bytes.
struct Quant8Launch {
  const float* x;  // quantize: the values (n); dequantize: null
  uint8_t* codes;  // n bytes (dequantize reads them)
  float* scales;   // one per block (dequantize reads them)
  float* out;      // dequantize: the values (n); quantize: null
  int64_t n;
  int64_t code;  // Code8: 0 signed (exp_avg), 1 unsigned (exp_avg_sq)
};

// Largest unit index u with table[i].unit_start <= u: the tensor that owns unit u.
RUDA_HOST_DEVICE inline int64_t find_tensor(const TensorEntry* table, int64_t n, int64_t u) {
  int64_t lo = 0, hi = n - 1;
  while (lo < hi) {
    int64_t mid = (lo + hi + 1) / 2;
    if (table[mid].unit_start <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

}  // namespace ruda
