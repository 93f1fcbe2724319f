// Bulk fp32 <-> BF16 / F16 conversions (see convert16.h). Each vector kernel gives exactly what
// the scalar conversion of core/dtype.h gives, element for element:
// - bf16 -> fp32 is a shift; fp32 -> bf16 is the integer round-to-nearest-even of f32_to_bf16,
//   with NaN kept quiet as (bits >> 16) | 0x40.
// - AVX-512 BF16's vcvtne2ps2bf16 rounds the same way and makes the same NaNs, but it treats
//   denormal inputs as zero; a block holding a denormal is converted the exact way instead.
// - F16C's vcvtph2ps / vcvtps2ph round like f16_to_f32 / f32_to_f16 (nearest even, subnormals,
//   overflow to inf) but keep NaN payloads where dtype.h makes canonical NaNs: NaN lanes (rare)
//   are redone with the scalar conversion.
// Kernels for an instruction set are compiled for it per function (target attribute) and picked
// at run time from CPUID, so one binary runs on any x86-64 CPU.
#include "backend/cpu/convert16.h"

#include <omp.h>

#include <algorithm>
#include <atomic>

#include "core/dtype.h"
#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DS_X86 1
#endif

namespace dstrain::cpu {
namespace {

using Widen = void (*)(const uint16_t*, float*, int64_t);
using Narrow = void (*)(const float*, uint16_t*, int64_t);

// ---- scalar (the reference, and every kernel's tail) ------------------------------------
void bf16_to_f32_scalar(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}
void f32_to_bf16_scalar(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_bf16(s[i]);
}
void f16_to_f32_scalar(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f16_to_f32(s[i]);
}
void f32_to_f16_scalar(const float* s, uint16_t* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = f32_to_f16(s[i]);
}

#ifdef DS_X86
// ---- AVX2 (+ F16C) ------------------------------------------------------------------------
__attribute__((target("avx2"))) void bf16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  bf16_to_f32_scalar(s + i, d + i, n - i);
}

// f32_to_bf16 on 8 lanes, the result in the low 16 bits of each 32-bit lane.
__attribute__((target("avx2"))) inline __m256i round_bf16_avx2(__m256i u) {
  const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  return _mm256_blendv_epi8(rounded, quiet, nan);
}

__attribute__((target("avx2"))) void f32_to_bf16_avx2(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i a = round_bf16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    const __m256i b = round_bf16_avx2(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 8)));
    // packus works per 128-bit lane: (a0 b0 a1 b1) -> (a0 a1 b0 b1).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), packed);
  }
  f32_to_bf16_scalar(s + i, d + i, n - i);
}

__attribute__((target("avx2,f16c"))) void f16_to_f32_avx2(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
    _mm256_storeu_ps(d + i, f);
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) f16_to_f32_scalar(s + i, d + i, 8);
  }
  f16_to_f32_scalar(s + i, d + i, n - i);
}

__attribute__((target("avx2,f16c"))) void f32_to_f16_avx2(const float* s, uint16_t* d, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 f = _mm256_loadu_ps(s + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (_mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)) != 0) f32_to_f16_scalar(s + i, d + i, 8);
  }
  f32_to_f16_scalar(s + i, d + i, n - i);
}

// ---- AVX-512 BF16 -------------------------------------------------------------------------
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*: GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define DS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
DS_AVX512BF16 void bf16_to_f32_avx512(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_si512(d + i, _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  bf16_to_f32_avx2(s + i, d + i, n - i);
}

DS_AVX512BF16 void f32_to_bf16_avx512(const float* s, uint16_t* d, int64_t n) {
  const __m512i exp_bits = _mm512_set1_epi32(0x7f800000), abs_bits = _mm512_set1_epi32(0x7fffffff);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512 lo = _mm512_loadu_ps(s + i), hi = _mm512_loadu_ps(s + i + 16);
    const __m512i ulo = _mm512_castps_si512(lo), uhi = _mm512_castps_si512(hi);
    // Denormal: exponent bits 0, magnitude not 0 (vcvtne2ps2bf16 would make them zeros).
    const __mmask16 dlo = _mm512_test_epi32_mask(ulo, abs_bits) & ~_mm512_test_epi32_mask(ulo, exp_bits);
    const __mmask16 dhi = _mm512_test_epi32_mask(uhi, abs_bits) & ~_mm512_test_epi32_mask(uhi, exp_bits);
    if ((dlo | dhi) != 0) {
      f32_to_bf16_avx2(s + i, d + i, 32);
      continue;
    }
    const __m512bh r = _mm512_cvtne2ps_pbh(hi, lo);  // words 0-15 from lo, 16-31 from hi
    _mm512_storeu_si512(d + i, reinterpret_cast<const __m512i&>(r));
  }
  f32_to_bf16_avx2(s + i, d + i, n - i);
}
#undef DS_AVX512BF16
#pragma GCC diagnostic pop
#endif  // DS_X86

struct Impl {
  ConvertIsa isa;
  const char* name;
  Widen bf16_to_f32;
  Narrow f32_to_bf16;
  Widen f16_to_f32;
  Narrow f32_to_f16;
};

constexpr Impl kScalar{ConvertIsa::kScalar, "scalar", bf16_to_f32_scalar, f32_to_bf16_scalar, f16_to_f32_scalar,
                       f32_to_f16_scalar};
#ifdef DS_X86
constexpr Impl kAvx2{ConvertIsa::kAvx2, "avx2+f16c", bf16_to_f32_avx2, f32_to_bf16_avx2, f16_to_f32_avx2,
                     f32_to_f16_avx2};
constexpr Impl kAvx512{ConvertIsa::kAvx512Bf16, "avx512bf16", bf16_to_f32_avx512, f32_to_bf16_avx512,
                       f16_to_f32_avx2, f32_to_f16_avx2};
#endif

const Impl* impl_for(ConvertIsa isa) {
#ifdef DS_X86
  switch (isa) {
    case ConvertIsa::kAvx512Bf16: return &kAvx512;
    case ConvertIsa::kAvx2: return &kAvx2;
    default: break;
  }
#endif
  return &kScalar;
}

ConvertIsa best_isa() {
#ifdef DS_X86
  __builtin_cpu_init();
  if (convert16_isa_supported(ConvertIsa::kAvx512Bf16)) return ConvertIsa::kAvx512Bf16;
  if (convert16_isa_supported(ConvertIsa::kAvx2)) return ConvertIsa::kAvx2;
#endif
  return ConvertIsa::kScalar;
}

std::atomic<const Impl*> g_impl{nullptr};

const Impl& impl() {
  const Impl* p = g_impl.load(std::memory_order_acquire);
  if (p == nullptr) {
    p = impl_for(best_isa());
    g_impl.store(p, std::memory_order_release);
  }
  return *p;
}

// Runs f on [0, n) in chunks over the OpenMP threads when that is worth it: a conversion runs at
// memory speed (about a millisecond per million elements on one core), so below a few million
// elements a parallel region costs more than it saves when the cores are shared.
template <class S, class D, class F>
void split(const S* s, D* d, int64_t n, F f) {
  constexpr int64_t kChunk = int64_t(1) << 18;
  if (n < 4 * kChunk || omp_in_parallel() || omp_get_max_threads() == 1) {
    f(s, d, n);
    return;
  }
  const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = c * kChunk;
    f(s + b, d + b, std::min(kChunk, n - b));
  }
}

}  // namespace

bool convert16_isa_supported(ConvertIsa isa) {
  switch (isa) {
    case ConvertIsa::kAuto:
    case ConvertIsa::kScalar: return true;
#ifdef DS_X86
    case ConvertIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case ConvertIsa::kAvx512Bf16:
      return convert16_isa_supported(ConvertIsa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512bf16");
#endif
    default: return false;
  }
}

void set_convert16_isa(ConvertIsa isa) {
  DS_CHECK(convert16_isa_supported(isa), "set_convert16_isa: this CPU cannot run the requested conversion kernels");
  g_impl.store(isa == ConvertIsa::kAuto ? impl_for(best_isa()) : impl_for(isa), std::memory_order_release);
}

std::string_view convert16_isa_name() { return impl().name; }

void bulk_bf16_to_f32(const uint16_t* src, float* dst, int64_t n) { split(src, dst, n, impl().bf16_to_f32); }
void bulk_f32_to_bf16(const float* src, uint16_t* dst, int64_t n) { split(src, dst, n, impl().f32_to_bf16); }
void bulk_f16_to_f32(const uint16_t* src, float* dst, int64_t n) { split(src, dst, n, impl().f16_to_f32); }
void bulk_f32_to_f16(const float* src, uint16_t* dst, int64_t n) { split(src, dst, n, impl().f32_to_f16); }

}  // namespace dstrain::cpu
