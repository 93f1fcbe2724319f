// exp(x) for the fp32 kernels, eight lanes at a time with AVX2+FMA and one at a time with the
// same arithmetic: x = n ln2 + r with |r| <= ln2/2 (ln2 split in two for an exact reduction),
// exp(r) by Cephes' degree-7 polynomial, times 2^n applied in two halves so that results in the
// subnormal range round once. Within 2 ulp of the correctly rounded exp over the whole fp32 range
// (tests/unit/test_kernels.cpp sweeps it); exp(-inf) = 0, exp(+inf) = +inf, NaN stays NaN.
//
// exp8 and exp1 give the same bits for the same input, so a kernel that runs its vector loop with
// exp8 and its tail with exp1 gives results that do not depend on where an element falls, and the
// scalar kernels (CPUs without AVX2) give the same results as the vector ones.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace dstrain::cpu {

#define DS_TARGET_AVX2 __attribute__((target("avx2,fma")))

namespace vexp {
constexpr float kLo = -104.0f;  // below: 0 (exp(-104) is under half the smallest subnormal)
constexpr float kHi = 89.0f;    // above: +inf (the final product overflows)
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f;  // 16 significant bits: n * kLn2Hi is exact
constexpr float kLn2Lo = 1.42860682030941723212e-6f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f, kP3 = 4.1665795894e-2f,
                kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace vexp

// Whether the kernels take their AVX2+FMA paths: when the CPU has them (checked once at run time,
// never assumed from the build machine), unless turned off.
inline bool& avx2_kernels_flag() {
  static bool on = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return on;
}
inline bool cpu_has_avx2() { return avx2_kernels_flag(); }
// Tests run the scalar paths on an AVX2 machine with use_avx2_kernels(false); true restores the
// CPU's answer. Not for use while kernels run.
inline void use_avx2_kernels(bool on) {
  avx2_kernels_flag() = on && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

inline float exp1(float x) {
  using namespace vexp;
  // min/max in this order keep a NaN (as the vector form does).
  x = std::isnan(x) ? x : std::fmin(kHi, std::fmax(kLo, x));
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kP0, r, kP1);
  p = std::fma(p, r, kP2);
  p = std::fma(p, r, kP3);
  p = std::fma(p, r, kP4);
  p = std::fma(p, r, kP5);
  p = std::fma(p, r * r, r + 1.0f);
  if (std::isnan(x)) return x;
  const int32_t ni = int32_t(n), n1 = ni >> 1, n2 = ni - n1;
  const uint32_t b1 = uint32_t(n1 + 127) << 23, b2 = uint32_t(n2 + 127) << 23;
  float s1, s2;
  std::memcpy(&s1, &b1, 4);
  std::memcpy(&s2, &b2, 4);
  return p * s1 * s2;
}

DS_TARGET_AVX2 inline __m256 exp8(__m256 x) {
  using namespace vexp;
  // maxps/minps return their second operand when either is NaN: NaN passes through.
  x = _mm256_min_ps(_mm256_set1_ps(kHi), _mm256_max_ps(_mm256_set1_ps(kLo), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // NaN lanes convert to INT_MIN; their p is NaN, and NaN times anything stays NaN.
  const __m256i ni = _mm256_cvtps_epi32(n);
  const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

// exp8's arithmetic on sixteen lanes (AVX-512F): the same bits per lane as exp8 and exp1.
#define DS_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
DS_TARGET_AVX512 inline __m512 exp16(__m512 x) {
  using namespace vexp;
  x = _mm512_min_ps(_mm512_set1_ps(kHi), _mm512_max_ps(_mm512_set1_ps(kLo), x));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i ni = _mm512_cvtps_epi32(n);
  const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
  const __m512i bias = _mm512_set1_epi32(127);
  const __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  return _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
}

// Horizontal sum of eight lanes in a fixed order ((0+4)+(2+6))+((1+5)+(3+7)).
DS_TARGET_AVX2 inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

DS_TARGET_AVX2 inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace dstrain::cpu
