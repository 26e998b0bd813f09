// Small CUDA helpers shared by the kernels: conversions, vector accesses, grid sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <type_traits>
#include <utility>

#include "quant8.h"

#define RUDA_CUDA_CHECK(expr)                               \
  do {                                                      \
    cudaError_t err_ = (expr);                              \
    TORCH_CHECK(err_ == cudaSuccess, "ruda_torch: ", #expr, \
                " failed: ", cudaGetErrorString(err_));     \
  } while (0)

#define RUDA_CUDA_CHECK_LAUNCH()                                                      \
  do {                                                                                \
    cudaError_t err_ = cudaGetLastError();                                            \
    TORCH_CHECK(err_ == cudaSuccess,                                                  \
                "ruda_torch: CUDA kernel launch failed: ", cudaGetErrorString(err_)); \
  } while (0)

namespace ruda {

// Exact conversions to FP32 (every FP16 and BF16 value is representable).
__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(__half x) { return __half2float(x); }
__device__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <int N, typename T>
__device__ inline bool is_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (N * sizeof(T)) == 0;
}

// Four 16-bit values with one 8-byte global load / store (caller checked alignment). A
// plain struct of four uint16_t compiles to a generic-space load and to four 2-byte
// stores; the cache intrinsics on uint2 keep each one instruction (tests/test_cuda_ptx.py).
__device__ inline void load_bits16(const uint16_t* p, uint16_t* out) {
  const uint2 v = __ldca(reinterpret_cast<const uint2*>(p));
  out[0] = static_cast<uint16_t>(v.x & 0xFFFFu);
  out[1] = static_cast<uint16_t>(v.x >> 16);
  out[2] = static_cast<uint16_t>(v.y & 0xFFFFu);
  out[3] = static_cast<uint16_t>(v.y >> 16);
}

__device__ inline void store_bits16(uint16_t* p, const uint16_t* in) {
  const uint2 v = make_uint2(static_cast<uint32_t>(in[0]) | (static_cast<uint32_t>(in[1]) << 16),
                             static_cast<uint32_t>(in[2]) | (static_cast<uint32_t>(in[3]) << 16));
  __stwb(reinterpret_cast<uint2*>(p), v);
}

template <typename T>
__device__ inline T bits_as(uint16_t b);
template <>
__device__ inline __half bits_as<__half>(uint16_t b) {
  return __ushort_as_half(b);
}
template <>
__device__ inline __nv_bfloat16 bits_as<__nv_bfloat16>(uint16_t b) {
  return __ushort_as_bfloat16(b);
}

// N consecutive elements converted to FP32, with one wide load (caller checked alignment).
// Four FP32 values go through the load intrinsic: like a plain float4 store, a plain
// aligned struct load is not always kept whole (ld.global.v4.f32) by the compiler.
template <int N, typename T>
__device__ inline void load_vec(const T* p, float* out) {
  if constexpr (N == 4 && std::is_same_v<T, float>) {
    const float4 v = __ldca(reinterpret_cast<const float4*>(p));
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else if constexpr (N == 4 && sizeof(T) == 2) {  // FP16/BF16: one 8-byte global load
    uint16_t bits[4];
    load_bits16(reinterpret_cast<const uint16_t*>(p), bits);
#pragma unroll
    for (int j = 0; j < 4; ++j) out[j] = to_float(bits_as<T>(bits[j]));
  } else {
    struct alignas(N * sizeof(T)) Pack {
      T v[N];
    };
    const Pack pack = *reinterpret_cast<const Pack*>(p);
#pragma unroll
    for (int j = 0; j < N; ++j) out[j] = to_float(pack.v[j]);
  }
}

// N consecutive FP32 values with one wide store (caller checked alignment). For N = 4 a
// plain float4 assignment is split into four 32-bit stores in the update kernel; the store
// intrinsic gives one st.global.wb.v4.f32 (write-back, the default cache policy: the
// parameters and moments are read again at the next step). tests/test_cuda_ptx.py checks
// the PTX.
template <int N>
__device__ inline void store_vec(float* p, const float* in) {
  if constexpr (N == 4) {
    __stwb(reinterpret_cast<float4*>(p), make_float4(in[0], in[1], in[2], in[3]));
  } else {
    struct alignas(N * sizeof(float)) Pack {
      float v[N];
    };
    Pack pack;
#pragma unroll
    for (int j = 0; j < N; ++j) pack.v[j] = in[j];
    *reinterpret_cast<Pack*>(p) = pack;
  }
}

// The update's operations on the GPU (adamw_element's Ops): ScalarOps, with the FP32 maximum
// of AMSGrad one max.NaN.f32 (sm_80 and later), where ScalarOps' NaN tests cost a branch per
// element. The bits stored are the same: a NaN maximum is the canonical NaN here and a NaN
// with an operand's payload there, and every NaN is stored canonical (Note [Canonical NaN]) or
// coded alike (8-bit moments); on equal values the two differ only between +0 and -0, which
// AMSGrad never compares (exp_avg_sq is never -0: beta2 v + (1 - beta2) g g with g g >= +0).
struct DeviceOps : ScalarOps {
  template <typename T>
  __device__ static inline T max(T a, T b) {
    if constexpr (sizeof(T) == sizeof(float)) {
#ifdef RUDA_CUDA_SIM
      if (a != a || b != b) return float_from_bits(kCanonicalNaNBits);
      return a > b || (a == b && float_bits(a) == 0u) ? a : b;  // +0 above -0, as the hardware
#else
      float r;
      asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
      return r;
#endif
    } else {
      return ScalarOps::max(a, b);
    }
  }
};

// Note [8-bit CUDA lanes]
// Note [8-bit moments] in csrc/quant8.h, on the GPU: one warp codes one block of kBlock8
// elements, lane l holding its elements 8 l .. 8 l + 7 (kPerLane8 of them), so that a
// lane reads and writes them with wide accesses (two 128-bit accesses of FP32 values, one
// of 16-bit values, one 64-bit access of codes) and the block's scale is one warp reduction
// (every lane gets it): no barrier or shared memory. The maximum is of the
// magnitudes' bits, which any order of reduction gives alike: the CPU kernels' scale. A
// block the lanes cannot access so (the last, shorter block of a tensor, or a tensor view
// that is not 16-byte aligned) goes through shared memory (Stage8 below): the warp copies
// it there element by element (coalesced), elements past the block's end as zeros (which
// step to zeros and change no maximum), the lanes step it from there, and the warp copies
// it back.
constexpr int kPerLane8 = static_cast<int>(kBlock8) / 32;
static_assert(kPerLane8 == 8, "a lane holds 8 elements: two 32-bit words of codes");

// The largest of the warp's 32 values, in every lane: one redux.sync (sm_80 and later) where
// a butterfly of shuffles took 10 instructions; a maximum is the same in any order.
__device__ inline uint32_t warp_largest(uint32_t bits) {
  return __reduce_max_sync(0xffffffffu, bits);
}

// The 32-bit words of 8 consecutive elements of T (4 or 2 bytes): 8 or 4.
template <typename T>
constexpr int kWords8 = static_cast<int>(sizeof(T)) * 8 / 4;

// 8 consecutive elements of T as 32-bit words, from global memory with 128-bit loads (the
// caller checked 16-byte alignment) or from shared memory (kGlobal false).
template <typename T, bool kGlobal>
__device__ inline void load_words8(const T* p, uint32_t* w) {
  const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int h = 0; h < kWords8<T> / 4; ++h) {
    uint4 v;
    if constexpr (kGlobal) {
      v = __ldca(q + h);
    } else {
      v = q[h];
    }
    w[4 * h] = v.x;
    w[4 * h + 1] = v.y;
    w[4 * h + 2] = v.z;
    w[4 * h + 3] = v.w;
  }
}

template <typename T, bool kGlobal>
__device__ inline void store_words8(T* p, const uint32_t* w) {
  uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
  for (int h = 0; h < kWords8<T> / 4; ++h) {
    const uint4 v = make_uint4(w[4 * h], w[4 * h + 1], w[4 * h + 2], w[4 * h + 3]);
    if constexpr (kGlobal) {
      __stwb(q + h, v);
    } else {
      q[h] = v;
    }
  }
}

// A lane's 8 elements of T (Note [8-bit CUDA lanes]) stepped a quarter (2 elements) at a
// time, held as 32-bit words with 64-bit accesses: FP32 values a quarter per access, loaded
// before the quarter and stored after it; 16-bit values a half (4) per access, loaded before
// its even quarter and stored after its odd one. From or to global memory (aligned) or
// shared memory. Quarter h's element j is element 2 h + j of the lane's 8.
template <typename T>
struct Quarters8 {
  static constexpr bool k16 = sizeof(T) == 2;
  uint32_t w[2];

  template <bool kGlobal>
  __device__ inline void load(const T* lane_first, int h) {
    if (k16 && (h & 1) != 0) return;  // loaded with the even quarter
    const uint2* q = reinterpret_cast<const uint2*>(lane_first + 2 * h);
    uint2 v;
    if constexpr (kGlobal) {
      v = __ldca(q);
    } else {
      v = *q;
    }
    w[0] = v.x;
    w[1] = v.y;
  }

  // The values load() reads, one element at a time, those at or past `left` as zeros (a
  // block's last elements, or a view that is not aligned for wide accesses).
  __device__ inline void load_each(const T* lane_first, int h, int left) {
    if (k16 && (h & 1) != 0) return;  // loaded with the even quarter
    const int first = 2 * h, count = k16 ? 4 : 2;
    uint32_t v[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (int j = 0; j < count; ++j) {
      if (first + j < left) {
        // A block's last elements, or a view not 16-byte aligned:
        if constexpr (k16) {
          v[j] = reinterpret_cast<const uint16_t*>(lane_first)[first + j];
        } else {
          v[j] = __float_as_uint(lane_first[first + j]);  // static-check: 32-bit (edges)
        }
      }
    }
    if constexpr (k16) {
      w[0] = v[0] | (v[1] << 16);
      w[1] = v[2] | (v[3] << 16);
    } else {
      w[0] = v[0];
      w[1] = v[1];
    }
  }

  // Whether quarter h's values are complete in w (to be stored): always for FP32, after the
  // odd quarter for 16-bit values; `first` is then the first element they hold (2 h or 2 h - 2).
  __device__ static inline bool stored_after(int h) { return !k16 || (h & 1) != 0; }
  __device__ static inline int first(int h) { return k16 ? 2 * (h & ~1) : 2 * h; }

  template <bool kGlobal>
  __device__ inline void store(T* lane_first, int h) const {
    uint2* q = reinterpret_cast<uint2*>(lane_first + first(h));
    const uint2 v = make_uint2(w[0], w[1]);
    if constexpr (kGlobal) {
      __stwb(q, v);
    } else {
      *q = v;
    }
  }

  // The position of quarter h's element j in w: word and, for 16-bit values, half.
  __device__ static inline int slot(int h, int j) { return k16 ? 2 * (h & 1) + j : j; }

  __device__ inline uint16_t bits16(int h, int j) const {
    const int s = slot(h, j);
    return static_cast<uint16_t>((s & 1) != 0 ? w[s / 2] >> 16 : w[s / 2] & 0xFFFFu);
  }

  __device__ inline float value(int h, int j) const {
    if constexpr (!k16) {
      return __uint_as_float(w[j]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // the bits in the top half
      const int s = slot(h, j);
      return __uint_as_float((s & 1) != 0 ? w[s / 2] & 0xFFFF0000u : w[s / 2] << 16);
    } else {
      return to_float(bits_as<T>(bits16(h, j)));
    }
  }

  // Both elements of quarter h of 16-bit values set: element 0's bits in the low half.
  __device__ inline void set_pair(int h, uint32_t bits) {
    static_assert(k16, "FP32 values are set one by one");
    w[h & 1] = bits;
  }

  // Element j of quarter h of FP32 values set (its bits).
  __device__ inline void set(int h, int j, uint32_t bits) {
    static_assert(!k16, "16-bit values are set a pair at a time (set_pair)");
    (void)h;
    w[j] = bits;
  }
};

// The byte j of a lane's 8 codes (two words).
__device__ inline uint8_t code_of(uint2 c, int j) {
  return static_cast<uint8_t>((j < 4 ? c.x : c.y) >> (8 * (j % 4)));
}

// Copies n elements of src to dst, the warp's lanes in turn (coalesced), and zeros up to
// kBlock8 where `pad` (a block staged in shared memory, Note [8-bit CUDA lanes]).
template <typename T>
__device__ inline void stage_copy(T* dst, const T* src, int n, int lane, bool pad) {
#pragma unroll 1  // a cold path: kept a loop of one element per lane (it is no hot loop)
  for (int k = lane; k < (pad ? static_cast<int>(kBlock8) : n); k += 32) {
    dst[k] = k < n ? src[k] : T{};  // static-check: 32-bit (staged, coalesced)
  }
}

// The largest magnitude (its bits) of a lane's values, for the block's scale (`largest`: the
// bits so far, 0 at first). One max.NaN of the magnitude per value (FMNMX reads |x| as an
// operand): magnitudes order as their bits do, and a NaN makes the canonical NaN, whose bits
// are above the infinity's like every NaN magnitude's: the maximum of the bits, where
// masking and an integer maximum took two instructions.
__device__ inline uint32_t largest_of(const float* x, int n, uint32_t largest) {
  float l = __uint_as_float(largest);
#pragma unroll
  for (int j = 0; j < n; ++j) l = DeviceOps::max(l, fabsf(x[j]));
  return __float_as_uint(l);
}

// The scale of a block whose lanes hold x[0..n): block_scale() of the warp's largest
// magnitude; a block with a value that is not finite (the maximum at or above kInfBits,
// the same in every lane, so the branch is the warp's) takes a second butterfly for its
// largest finite magnitude (Note [8-bit moments]).
__device__ inline float lane_block_scale(const float* x, int n, uint32_t lane_largest) {
  const uint32_t largest = warp_largest(lane_largest);
  if (largest < kInfBits) return block_scale(largest, false);
  uint32_t finite = 0u;
  for (int j = 0; j < n; ++j) {
    const uint32_t m = finite_magnitude_bits(x[j]);
    finite = m > finite ? m : finite;
  }
  return block_scale(warp_largest(finite), true);
}

// The pair (lo, hi) converted to FP16 rounded toward zero, lo's bits in the low half
// (cvt.rz.f16x2.f32 puts its first operand in the high half).
__device__ inline uint32_t f16x2_toward_zero(float lo, float hi) {
#ifdef RUDA_CUDA_SIM
  return f16_bits_toward_zero(lo) | (f16_bits_toward_zero(hi) << 16);
#else
  uint32_t d;
  asm("cvt.rz.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
#endif
}

// Two FP32 values rounded to nearest even as FP16 (kHalf) or BF16, lo's bits in the low
// half: one conversion for the pair (cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32, subnormals kept),
// round_to_half's and round_to_bf16's bits for every value but a NaN. For the canonical NaN
// (0x7FFFFFFF), the only NaN the kernels round (Note [Canonical NaN]), both give 0x7FFF:
// its payload's top bits are all ones, and so are those of the NaN the hardware makes.
template <bool kHalf>
__device__ inline uint32_t round_pair_nearest16(float lo, float hi) {
#ifdef RUDA_CUDA_SIM
  const uint32_t a = float_bits(lo), b = float_bits(hi);
  if constexpr (kHalf) return round_to_half(a) | (static_cast<uint32_t>(round_to_half(b)) << 16);
  return round_to_bf16(a) | (static_cast<uint32_t>(round_to_bf16(b)) << 16);
#else
  uint32_t d;
  if constexpr (kHalf) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  }
  return d;
#endif
}

// Two canonical FP32 values (Note [Canonical NaN]) rounded stochastically to BF16 with the
// random bits r_lo, r_hi (their low halves), lo's bits in the low half: round_bf16_stochastic's
// bits by Note [Rounding canonical moments] (csrc/cpu/kernels/adamw_cpu.cpp): the bits, as a
// signed integer, clamped to 0x7FFF0000 (the canonical NaN alone changes, and rounds to
// 0x7FFF), plus the random bits; the high halves of the two sums in one byte permutation.
__device__ inline uint32_t round_pair_stochastic_bf16(float lo, float hi, uint32_t r_lo,
                                                      uint32_t r_hi) {
  const int32_t a = min(static_cast<int32_t>(float_bits(lo)), 0x7FFF0000);
  const int32_t b = min(static_cast<int32_t>(float_bits(hi)), 0x7FFF0000);
  return __byte_perm(static_cast<uint32_t>(a) + (r_lo & 0xFFFFu),
                     static_cast<uint32_t>(b) + (r_hi & 0xFFFFu), 0x7632);
}

// prmt.b32 (default mode) with all 4 bits of each selector nibble: where the nibble's msb is
// set, that result byte is the selected byte's sign bit replicated. CUDA's __byte_perm reads
// 3 bits of each nibble and drops it (nvcc folds __byte_perm(x, 0, 0x9180) into
// __byte_perm(x, 0, 0x1100)), so this one goes through inline PTX.
__device__ inline uint32_t prmt_msb(uint32_t x, uint32_t y, uint32_t s) {
#ifdef RUDA_CUDA_SIM
  return ::ruda_sim::prmt_msb(x, y, s);
#else
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(y), "r"(s));
  return d;
#endif
}

// The FP16s in the two halves of h, exactly in FP32: each half converted where it is (one
// HADD2 each, reading .H0 or .H1 of the register); converting h >> 16 made the compiler
// extract the high half first, and shift and mask each half apart.
__device__ inline float2 f16x2_to_f32(uint32_t h) {
#ifdef RUDA_CUDA_SIM
  return make_float2(__half2float(__ushort_as_half(static_cast<unsigned short>(h & 0xFFFFu))),
                     __half2float(__ushort_as_half(static_cast<unsigned short>(h >> 16))));
#else
  float lo, hi;
  asm("{\n\t.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;\n\t}"
      : "=f"(lo), "=f"(hi)
      : "r"(h));
  return make_float2(lo, hi);
#endif
}

// The codes of a0 and a1 in bits 0-7 and 16-23, from h = f16x2_toward_zero(a0, a1) (Note
// [8-bit codes through FP16] in csrc/cpu/kernels/quant8_vec.h, two lanes of 16 bits in a
// register): for unsigned codes a = |q| (|q| <= 1 + 2^-23), for signed ones a = q 2^-8, which
// puts E3M4 on FP16's layout. The pair in FP16 toward zero (one conversion), the last bit of
// each set where the conversion back lacks its value's bits (rounding to odd), then rounded
// to nearest even with 6 bits dropped, on both halves at once (no carry crosses: each half
// stays below 2^16). Bits 8-15 and 24-31 hold garbage (the other half's low bits, the sign of
// a signed half), which the packing drops: a signed code's sign is set by sign_codes8.
// Encode8's bits (tests/test_cuda_sim.py over every class of value).
template <Code8 kCode>
__device__ inline uint32_t encode_pair8(float a0, float a1, uint32_t h) {
  const float2 back = f16x2_to_f32(h);
  h |= (__float_as_uint(back.x) != __float_as_uint(a0) ? 1u : 0u) |
       (__float_as_uint(back.y) != __float_as_uint(a1) ? 0x10000u : 0u);
  if constexpr (kCode == Code8::kUnsigned) {
    // A value that is not zero (h not zero, its sticky bit included) never codes 0: a half
    // of 1 to 63 (which would code 0 or 1) becomes 64 (which codes 1). Halves are unsigned
    // 16-bit lanes: min(h, 1) is 1 where the half is not zero.
    h = __vmaxu2(h, __vminu2(h, 0x00010001u) << 6);
  }
  return (h + 0x001F001Fu + ((h >> 6) & 0x00010001u)) >> 6;
}

// The sign bits of the signed codes in the 4 bytes of w: bit 7 of byte j is the sign of
// the FP16 in half j % 2 of hs[j / 2] (encode_pair8's inputs), where the byte's magnitude is
// not 0 (no code of -0; each byte below 0x80, plus 0x7F, reaches bit 7 iff it is not 0).
__device__ inline uint32_t sign_codes8(uint32_t w, uint32_t h0, uint32_t h1) {
  const uint32_t signs = __byte_perm(h0, h1, 0x7531);  // the FP16s' high bytes
  return w | (signs & (w + 0x7F7F7F7Fu) & 0x80808080u);
}

// A lane's 8 codes of x[j] = its element 8 lane + j, in a block of scale s (from
// lane_block_scale): two words, byte j the code of x[j]. A block stored as zeros has
// inverse 0, and 0 codes to 0.
//
// Note [8-bit CUDA encode]
// The product by the inverse gives each code's input in one instruction: |x| inverse
// (FMUL takes the magnitude of an operand) for unsigned codes, and for signed ones
// x (inverse 2^-8), exactly q 2^-8 where inverse 2^-8 is a normal FP32 value (a scale up
// to 2^118, whose inverse is at least 2^-118; a product below 2^-126 codes 0 either way),
// else (x inverse) 2^-8 as before.
template <Code8 kCode>
__device__ inline uint2 encode_lane8(const float* x, float s) {
  const float inverse = block_inverse(s);
  if (special_block(s)) {  // the warp's branch: a block with non-finite values
    uint32_t w[2] = {0u, 0u};
    for (int j = 0; j < kPerLane8; ++j) {
      w[j / 4] |= static_cast<uint32_t>(encode8_special<kCode>(x[j], inverse)) << (8 * (j % 4));
    }
    return make_uint2(w[0], w[1]);
  }
  float a[kPerLane8];
  if constexpr (kCode == Code8::kUnsigned) {
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) a[j] = fabsf(x[j]) * inverse;
  } else if (s <= 3.3230699894622794e35f) {  // 2^118: inverse 2^-8 is normal (the warp's branch)
    const float inverse8 = inverse * 0.00390625f;
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) a[j] = x[j] * inverse8;
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) a[j] = (x[j] * inverse) * 0.00390625f;
  }
  uint32_t pairs[kPerLane8 / 2], h[kPerLane8 / 2];
#pragma unroll
  for (int j = 0; j < kPerLane8; j += 2) {
    h[j / 2] = f16x2_toward_zero(a[j], a[j + 1]);
    pairs[j / 2] = encode_pair8<kCode>(a[j], a[j + 1], h[j / 2]);
  }
  // Bytes 0 and 2 of each pair, in order.
  uint32_t w0 = __byte_perm(pairs[0], pairs[1], 0x6420);
  uint32_t w1 = __byte_perm(pairs[2], pairs[3], 0x6420);
  if constexpr (kCode == Code8::kSigned) {
    w0 = sign_codes8(w0, h[0], h[1]);
    w1 = sign_codes8(w1, h[2], h[3]);
  }
  return make_uint2(w0, w1);
}

// Note [8-bit CUDA decode]
// Two codes at a time through FP16 (the layouts of Note [8-bit codes through FP16]): one
// byte permutation puts the pair in the two halves of a register, a shift puts each code's
// exponent and mantissa where an FP16's are, and each half converts exactly to FP32 (HADD2,
// subnormal codes included). An unsigned code is E4M4 with FP16's bias: the FP16 is its
// value. A signed one is E3M4: the permutation fills each half's high byte with the code's
// sign (its msb replicated), the shift takes the sign to bit 15, and a mask clears the
// copies in bits 13-14 and what crossed into the high half: the FP16 is the code's value
// times 2^-8, and its product by scale 2^8 (exact for a scale below 2^120; above, the FP16 is
// multiplied by 2^8 first, exactly) the value times the scale. So decode8(code) * scale, the
// CPU kernels' bits.
template <Code8 kCode>
__device__ inline void decode_lane8(uint2 c, float s, float* x) {
  if (special_block(s)) {
    for (int j = 0; j < kPerLane8; ++j) x[j] = dequantize8_special<kCode>(code_of(c, j), s);
    return;
  }
  float f[kPerLane8];
#pragma unroll
  for (int j = 0; j < kPerLane8; j += 2) {
    const uint32_t word = j < 4 ? c.x : c.y;
    const uint32_t b = static_cast<uint32_t>(j % 4);  // the pair's first byte in the word
    uint32_t h;
    if constexpr (kCode == Code8::kSigned) {
      // Half i: the code's byte, its sign replicated above it (selector nibble 8 + byte).
      h = (prmt_msb(word, 0u, b | ((8u | b) << 4) | ((b + 1u) << 8) | ((9u + b) << 12)) << 6) &
          0x9FC09FFFu;
    } else {
      h = __byte_perm(word, 0u, b | (4u << 4) | ((b + 1u) << 8) | (4u << 12)) << 6;
    }
    const float2 pair = f16x2_to_f32(h);
    f[j] = pair.x;
    f[j + 1] = pair.y;
  }
  if constexpr (kCode == Code8::kSigned) {
    if (s < 1.329227995784916e36f) {  // 2^120: s 2^8 is exact (the warp's branch)
      const float s8 = s * 256.0f;
#pragma unroll
      for (int j = 0; j < kPerLane8; ++j) x[j] = f[j] * s8;
    } else {
#pragma unroll
      for (int j = 0; j < kPerLane8; ++j) x[j] = (f[j] * 256.0f) * s;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) x[j] = f[j] * s;
  }
}

// Launches `kernel` as `grid` blocks of `threads` threads on `stream`: `<<<...>>>` under
// nvcc; on the emulated device when the kernels are built as host C++ for the tests (Note
// [CUDA emulation] in csrc/cuda_sim/cuda_sim.h). Every launch of csrc/cuda goes through it.
template <typename... Params, typename... Args>
inline void launch_kernel(void (*kernel)(Params...), unsigned grid, unsigned threads,
                          cudaStream_t stream, const Args&... args) {
#ifdef RUDA_CUDA_SIM
  (void)stream;
  ::ruda_sim::launch(grid, threads, [&] { kernel(args...); });
#else
  kernel<<<grid, threads, 0, stream>>>(args...);
#endif
}

// Enough blocks of `kernel` to fill the current device in one wave: SM count x the blocks
// that fit on one SM at `threads_per_block`, as the kernel's registers and shared memory
// allow (cudaOccupancyMaxActiveBlocksPerMultiprocessor; 2048 / threads would assume no
// register limit: a kernel of 64 registers fits 4 blocks of 256 threads, not 8).
// The kernels loop over their work units, so a larger grid would only add a ragged
// tail. Cached per (kernel, device): the query is not free and the answer never changes.
template <typename Kernel>
inline int64_t max_resident_blocks(Kernel kernel, int threads_per_block) {
  int device = 0;
  RUDA_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, int64_t> cache;
  const auto key = std::make_pair(reinterpret_cast<const void*>(kernel), device);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto hit = cache.find(key);
  if (hit != cache.end()) return hit->second;
  int sms = 0, per_sm = 0;
  RUDA_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  RUDA_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads_per_block, 0));
  const int64_t blocks = static_cast<int64_t>(std::max(sms, 1)) * std::max(per_sm, 1);
  cache.emplace(key, blocks);
  return blocks;
}

}  // namespace ruda
