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

// Note [8-bit CUDA lanes]
// Note [8-bit moments] in csrc/quant8.h, on the GPU: one warp codes one block of kBlock8
// elements, lane l holding its elements 8 l .. 8 l + 7 (kPerLane8 of them), so that a
// lane reads and writes them with wide accesses (two 128-bit accesses of FP32 values, one
// of 16-bit values, one 64-bit access of codes) and the block's scale is a butterfly of
// shuffles (every lane gets it): no barrier or shared memory. The maximum is of the
// magnitudes' bits, which any order of reduction gives alike: the CPU kernels' scale. A
// block the lanes cannot access so (the last, shorter block of a tensor, or a tensor view
// that is not 16-byte aligned) goes through shared memory (Stage8 below): the warp copies
// it there element by element (coalesced), elements past the block's end as zeros (which
// step to zeros and change no maximum), the lanes step it from there, and the warp copies
// it back.
constexpr int kPerLane8 = static_cast<int>(kBlock8) / 32;
static_assert(kPerLane8 == 8, "a lane holds 8 elements: two 32-bit words of codes");

__device__ inline uint32_t warp_largest(uint32_t bits) {
#pragma unroll
  for (int s = 16; s > 0; s >>= 1) {
    const uint32_t other = __shfl_xor_sync(0xffffffffu, bits, s);
    bits = other > bits ? other : bits;
  }
  return bits;
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

// Four FP32 values (words) with one 128-bit store, to global memory (16-byte aligned) or
// to shared memory.
__device__ inline void store_words8_half(float* p, const uint32_t* w) {
  __stwb(reinterpret_cast<uint4*>(p), make_uint4(w[0], w[1], w[2], w[3]));
}

__device__ inline void store_words8_half_shared(float* p, const uint32_t* w) {
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}

// Element j of 8 held as words (load_words8): its bits (16-bit types) and its value.
template <typename T>
__device__ inline uint16_t bits16_of(const uint32_t* w, int j) {
  return static_cast<uint16_t>((j & 1) != 0 ? w[j / 2] >> 16 : w[j / 2] & 0xFFFFu);
}

template <typename T>
__device__ inline float value_of(const uint32_t* w, int j) {
  if constexpr (sizeof(T) == 4) {
    return __uint_as_float(w[j]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // the bits in the top half
    return __uint_as_float((j & 1) != 0 ? w[j / 2] & 0xFFFF0000u : w[j / 2] << 16);
  } else {
    return to_float(bits_as<T>(bits16_of<T>(w, j)));
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

  // Element j of quarter h set: an FP32 value's bits, or a 16-bit value's (low half).
  __device__ inline void set(int h, int j, uint32_t bits) {
    if constexpr (!k16) {
      w[j] = bits;
    } else {
      // The other half kept: it may be a value not stepped yet.
      const int s = slot(h, j);
      w[s / 2] =
          (s & 1) != 0 ? (w[s / 2] & 0xFFFFu) | (bits << 16) : (w[s / 2] & 0xFFFF0000u) | bits;
    }
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

// The largest magnitude (its bits) of a lane's values, for the block's scale.
__device__ inline uint32_t largest_of(const float* x, int n, uint32_t largest) {
#pragma unroll
  for (int j = 0; j < n; ++j) {
    const uint32_t m = magnitude_bits(x[j]);
    largest = m > largest ? m : largest;
  }
  return largest;
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

// The FP32 bits of the FP16 in the low 16 bits of h (exact).
__device__ inline uint32_t f16_to_f32_bits(uint32_t h) {
  return __float_as_uint(__half2float(__ushort_as_half(static_cast<unsigned short>(h))));
}

// The codes of q0 and q1 (|q| <= 1 + 2^-23, finite) in bits 0-7 and 16-23 (Note [8-bit
// codes through FP16] in csrc/cpu/kernels/quant8_vec.h, two lanes of 16 bits in a
// register): the pair to FP16 toward zero in one conversion, the last bit of each set
// where the conversion back lacks its value's bits (rounding to odd), then rounded to
// nearest even with 6 bits dropped, on both halves at once (no carry crosses: each half
// stays below 2^16). Encode8's bits (tests/test_cuda_sim.py over every class of value).
// From the SASS (sm_90, adamw8 p=f32): about 10 instructions per element and moment, the
// product by the inverse and the packing included, where encode8 took about 15; 8-bit
// steps 9 (AdamW) to 13 (AMSGrad) instructions per element shorter.
template <Code8 kCode>
__device__ inline uint32_t encode_pair8(float q0, float q1) {
  float a0, a1;
  if constexpr (kCode == Code8::kSigned) {  // E3M4 is FP16's layout for q 2^-8 (exact)
    a0 = q0 * 0.00390625f;
    a1 = q1 * 0.00390625f;
  } else {
    a0 = __uint_as_float(__float_as_uint(q0) & 0x7FFFFFFFu);
    a1 = __uint_as_float(__float_as_uint(q1) & 0x7FFFFFFFu);
  }
  uint32_t h = f16x2_toward_zero(a0, a1);
  h |= (f16_to_f32_bits(h) != __float_as_uint(a0) ? 1u : 0u) |
       (f16_to_f32_bits(h >> 16) != __float_as_uint(a1) ? 0x10000u : 0u);
  const uint32_t m = kCode == Code8::kSigned ? h & 0x7FFF7FFFu : h;
  uint32_t code = ((m + 0x001F001Fu + ((m >> 6) & 0x00010001u)) >> 6) & 0x03FF03FFu;
  // Bit 15 of a half plus 0x7FFF: whether the half (below 0x8000) is not zero.
  if constexpr (kCode == Code8::kSigned) {  // the sign where the magnitude is not 0
    code |= (h >> 8) & (code + 0x7FFF7FFFu) >> 8 & 0x00800080u;
  } else {  // a value that is not zero (h not zero, its sticky bit included) never codes 0
    code |= (~(code + 0x7FFF7FFFu) & (h + 0x7FFF7FFFu)) >> 15 & 0x00010001u;
  }
  return code;
}

// A lane's 8 codes of x[j] = its element 8 lane + j, in a block of scale s (from
// lane_block_scale): two words, byte j the code of x[j]. A block stored as zeros has
// inverse 0, and 0 codes to 0.
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
  uint32_t pairs[kPerLane8 / 2];
#pragma unroll
  for (int j = 0; j < kPerLane8; j += 2) {
    pairs[j / 2] = encode_pair8<kCode>(x[j] * inverse, x[j + 1] * inverse);
  }
  // Bytes 0 and 2 of each pair, in order.
  return make_uint2(__byte_perm(pairs[0], pairs[1], 0x6420),
                    __byte_perm(pairs[2], pairs[3], 0x6420));
}

// A lane's 8 values of codes c in a block of scale s: dequantize8_scaled's, or in a block
// with non-finite values (the scale's sign, the warp's branch) dequantize8_special's.
template <Code8 kCode>
__device__ inline void decode_lane8(uint2 c, float s, float* x) {
  if (special_block(s)) {
    for (int j = 0; j < kPerLane8; ++j) x[j] = dequantize8_special<kCode>(code_of(c, j), s);
  } else {
#pragma unroll
    for (int j = 0; j < kPerLane8; ++j) x[j] = dequantize8_scaled<kCode>(code_of(c, j), s);
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
