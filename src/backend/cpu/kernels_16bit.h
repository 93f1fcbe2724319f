// Building blocks of the CPU backend's fused 16-bit kernels (kernels_16bit.cpp,
// attention_16bit.cpp): element conversions that give exactly the bits of core/dtype.h's scalar
// ones (f32_to_bf16, f32_to_f16, ... : round to nearest even, NaN quiet) but are written
// branch-free so that loops over them vectorise, and row primitives (convert a row, a strided
// tile) compiled once per instruction set and chosen at load time from CPUID.
//
// Each hot function is a plain C++ loop over fp32 values marked DS_CPU_CLONES: GCC builds an
// AVX-512 (x86-64-v4), an AVX2+FMA+F16C (x86-64-v3) and a baseline version of it and an ifunc
// resolver picks one when the program is loaded, so every version is the same source as the one
// the tests run here (which is the x86-64-v3 one on an AVX2 machine). A tensor's element type is
// a run-time DType (F32, BF16 or F16) dispatched once per row, outside the loops (with_elem).
// Row conversions go through convert16.h's bulk conversions (hand-written AVX-512 BF16 and
// AVX2/F16C code, chosen from CPUID); the tests run both them and the portable loops
// (set_x86_conversions).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

#include "core/dtype.h"
#include "backend/ops.h"
#include "core/tensor.h"

#if defined(__SANITIZE_THREAD__)
// ThreadSanitizer instruments the ifunc resolvers, which run before its runtime starts (and
// crash): a ThreadSanitizer build (tests/sanitize) compiles one version, for the build's ISA.
#define DS_CPU_CLONES
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && defined(__FMA__)
#define DS_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// A build for the baseline ISA (DSTRAIN_NATIVE=OFF) has fp32 kernels without FMA: the clones
// must not fuse a*b+c either, or their results would differ from those kernels' in the last bit.
#define DS_CPU_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"), optimize("fp-contract=off")))
#else
#define DS_CPU_CLONES
#endif
#define DS_CPU_INLINE inline __attribute__((always_inline))

namespace dstrain::cpu::k16 {

// fp32 storage: the identity.
struct F32E {
  using S = float;
  static DS_CPU_INLINE float ld(float x) { return x; }
  static DS_CPU_INLINE float st(float x) { return x; }
};

// bfloat16: the top half of an fp32 (f32_to_bf16's rounding, branch-free).
struct BF16E {
  using S = uint16_t;
  static DS_CPU_INLINE float ld(uint16_t h) { return std::bit_cast<float>(uint32_t(h) << 16); }
  static DS_CPU_INLINE uint16_t st(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return uint16_t((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
};

// IEEE half (f16_to_f32 / f32_to_f16 of core/dtype.cpp, bit for bit, branch-free).
struct F16E {
  using S = uint16_t;
  static DS_CPU_INLINE float ld(uint16_t h) {
    const uint32_t sign = uint32_t(h & 0x8000u) << 16;
    const uint32_t em = uint32_t(h) & 0x7fffu;
    const uint32_t exp = em >> 10;
    const uint32_t normal = (em << 13) + (112u << 23);
    const uint32_t special = (em << 13) + (224u << 23);  // exponent 31 -> 255: inf, NaN
    // subnormal: mant * 2^-24 = (2^-14 * (1 + mant/1024)) - 2^-14, exact
    const uint32_t sub =
        std::bit_cast<uint32_t>(std::bit_cast<float>((em << 13) + (113u << 23)) - std::bit_cast<float>(113u << 23));
    // A mask rather than a select, so that the subtraction is not moved into a branch (which
    // would keep the loop from vectorising).
    const uint32_t is_sub = 0u - uint32_t(exp == 0);
    const uint32_t big = exp == 31 ? special : normal;
    return std::bit_cast<float>(sign | (sub & is_sub) | (big & ~is_sub));
  }
  // In 32 bits: a loop that stores this to 16 bits directly does not vectorise on AVX2 (GCC
  // narrows the variable shifts to 16-bit lanes), so store_tile narrows in a second pass.
  static DS_CPU_INLINE uint32_t st32(float f) {
    const uint32_t u = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t abs = u & 0x7fffffffu;
    // below 2^-14: the f16 subnormal round(a * 2^24), to nearest even, from a's integer significand
    const uint32_t e = abs >> 23;
    const uint32_t m = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift0 = 126u - (e < 112u ? e : 112u);  // 14 ... 126
    const uint32_t shift = shift0 < 31u ? shift0 : 31u;
    const uint32_t sub = (m + (1u << (shift - 1)) - 1u + ((m >> shift) & 1u)) >> shift;
    const uint32_t normal = (abs + 0xfffu + ((abs >> 13) & 1u) - 0x38000000u) >> 13;
    uint32_t mag = abs < 0x38800000u ? sub : normal;
    mag = abs >= 0x477ff000u ? 0x7c00u : mag;  // overflow to inf
    mag = abs > 0x7f800000u ? 0x7e00u : mag;   // NaN
    return sign | mag;
  }
  static DS_CPU_INLINE uint16_t st(float f) { return uint16_t(st32(f)); }
};

// Calls f(E{}) with E the element type of `dt` (F32, BF16 or F16); f is a lambda marked
// DS_CPU_INLINE_LAMBDA, so that its loops are compiled inside the calling (per-ISA) function.
template <class F>
DS_CPU_INLINE void with_elem(DType dt, F&& f) {
  switch (dt) {
    case DType::BF16: f(BF16E{}); break;
    case DType::F16: f(F16E{}); break;
    default: f(F32E{}); break;
  }
}
#define DS_CPU_INLINE_LAMBDA __attribute__((always_inline))

inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
inline bool is_16(DType t) { return t == DType::BF16 || t == DType::F16; }

// Element i of a float tensor of any of the three types, and the other way.
inline float load1(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::BF16: return BF16E::ld(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::F16: return F16E::ld(static_cast<const uint16_t*>(t.raw())[i]);
    default: return static_cast<const float*>(t.raw())[i];
  }
}
inline void store1(const Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::BF16: static_cast<uint16_t*>(t.raw())[i] = BF16E::st(v); break;
    case DType::F16: static_cast<uint16_t*>(t.raw())[i] = F16E::st(v); break;
    default: static_cast<float*>(t.raw())[i] = v; break;
  }
}

// Byte address of element i of a tensor of type dt.
inline const void* at(const void* base, DType dt, int64_t i) {
  return static_cast<const char*>(base) + i * int64_t(dtype_size(dt));
}
inline void* at(void* base, DType dt, int64_t i) { return static_cast<char*>(base) + i * int64_t(dtype_size(dt)); }

// dst[r*ldd + c] = src[r*lds + c] (element type st) as fp32, for r < rows, c < cols.
void load_tile(float* dst, int64_t ldd, const void* src, DType st, int64_t lds, int64_t rows, int64_t cols);
// dst[r*ldd + c] (element type dt) = src[r*lds + c], rounded once.
void store_tile(void* dst, DType dt, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols);
inline void load_row(float* dst, const void* src, DType st, int64_t n) { load_tile(dst, n, src, st, n, 1, n); }
inline void store_row(void* dst, DType dt, const float* src, int64_t n) { store_tile(dst, dt, n, src, n, 1, n); }

// Row conversions use convert16.h's bulk conversions (the best the CPU has: AVX-512 BF16, AVX2 and
// F16C, or scalar), else the loops over BF16E/F16E above. Tests switch them off to check those
// loops; returns the previous setting. Call it outside kernels.
bool set_x86_conversions(bool on);

}  // namespace dstrain::cpu::k16

namespace dstrain::cpu {
// The 16-bit slots' attention (attention_16bit.cpp): qkv, out, dout and dqkv F32 or 16-bit, lse
// F32; other mixes go to the generic kernel.
void attention_forward_16bit(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale);
void attention_backward_16bit(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                              const ops::AttentionLayout& L, float scale);
}  // namespace dstrain::cpu
