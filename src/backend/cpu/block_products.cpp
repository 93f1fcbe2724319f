// Small block products on AVX-512 (block_products.h). One register tile of up to 6 rows x 64
// columns of fp32 sums (24 zmm accumulators): per step it loads the 4 vectors of B's row once and
// broadcasts each row's A element (a bf16 pair, or an fp32 value) against them.
#include "backend/cpu/block_products.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "backend/cpu/convert16.h"
#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DS_X86 1
#endif

namespace dstrain::cpu {

#ifdef DS_X86
namespace {

// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*: GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
// The fp32 instantiations use no bf16 instruction: they run on any AVX-512 F/BW/VL CPU.
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kRows = 6;     // rows of a register tile
constexpr int kVectors = 4;  // 16-column vectors of a register tile

// The two kinds of product. Bf16: A holds bf16 pairs (read 32 bits at a time), B 32-bit pairs,
// a step is vdpbf16ps. F32: A and B fp32, a step is an FMA.
struct Bf16 {
  using A = uint16_t;
  using B = uint32_t;
  static DS_AVX512 inline __m512i load(const B* p) { return _mm512_loadu_si512(p); }
  static DS_AVX512 inline __m512i load(const B* p, __mmask16 m) { return _mm512_maskz_loadu_epi32(m, p); }
  static DS_AVX512 inline __m512i broadcast(const A* p) {
    int pair;
    std::memcpy(&pair, p, sizeof pair);
    return _mm512_set1_epi32(pair);
  }
  static DS_AVX512 inline __m512 step(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};
struct F32 {
  using A = float;
  using B = float;
  static DS_AVX512 inline __m512 load(const B* p) { return _mm512_loadu_ps(p); }
  static DS_AVX512 inline __m512 load(const B* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
  static DS_AVX512 inline __m512 broadcast(const A* p) { return _mm512_set1_ps(*p); }
  static DS_AVX512 inline __m512 step(__m512 acc, __m512 a, __m512 b) { return _mm512_fmadd_ps(a, b, acc); }
};

// C tile (MR rows, NV vectors, the last one masked by `last`) = alpha * A B (+ C), over k steps.
template <class K, int MR, int NV>
DS_AVX512 void tile(int64_t k, const typename K::A* a, int64_t ars, int64_t aps, const typename K::B* b, int64_t ldb,
                    __mmask16 last, float alpha, bool accumulate, float* c, int64_t ldc) {
  using BV = decltype(K::load(b));
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < k; ++p) {
    const typename K::B* bp = b + p * ldb;
    BV bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = K::load(bp + 16 * v);
    bv[NV - 1] = K::load(bp + 16 * (NV - 1), last);
    const typename K::A* ap = a + p * aps;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const auto av = K::broadcast(ap + r * ars);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = K::step(acc[r][v], av, bv[v]);
    }
  }
  const __m512 al = _mm512_set1_ps(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* cp = c + r * ldc + 16 * v;
      const __mmask16 m = v == NV - 1 ? last : __mmask16(0xffff);
      __m512 x = _mm512_mul_ps(acc[r][v], al);
      if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, cp));
      _mm512_mask_storeu_ps(cp, m, x);
    }
  }
}

template <class K>
using Tile = void (*)(int64_t, const typename K::A*, int64_t, int64_t, const typename K::B*, int64_t, __mmask16, float,
                      bool, float*, int64_t);

template <class K, int MR>
constexpr Tile<K> tile_for(int nv) {
  return nv == 1 ? &tile<K, MR, 1> : nv == 2 ? &tile<K, MR, 2> : nv == 3 ? &tile<K, MR, 3> : &tile<K, MR, 4>;
}
template <class K>
Tile<K> tile_for(int mr, int nv) {
  switch (mr) {
    case 1: return tile_for<K, 1>(nv);
    case 2: return tile_for<K, 2>(nv);
    case 3: return tile_for<K, 3>(nv);
    case 4: return tile_for<K, 4>(nv);
    case 5: return tile_for<K, 5>(nv);
    default: return tile_for<K, 6>(nv);
  }
}

// C (m, n) = alpha A B (+ C): 64-column panels of B, each swept by tiles of 6 rows of A.
template <class K>
DS_AVX512 void product_avx512(int64_t m, int64_t n, int64_t k, const typename K::A* a, int64_t ars, int64_t aps,
                              const typename K::B* b, int64_t ldb, float alpha, bool accumulate, float* c,
                              int64_t ldc) {
  if (m <= 0 || n <= 0) return;
  for (int64_t j0 = 0; j0 < n; j0 += 16 * kVectors) {
    const int64_t cols = std::min<int64_t>(16 * kVectors, n - j0);
    const int nv = int((cols + 15) / 16);
    const int rem = int(cols - 16 * (nv - 1));
    const __mmask16 last = __mmask16((1u << rem) - 1u);
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int mr = int(std::min<int64_t>(kRows, m - i0));
      tile_for<K>(mr, nv)(k, a + i0 * ars, ars, aps, b + j0, ldb, last, alpha, accumulate, c + i0 * ldc + j0, ldc);
    }
  }
}

// dst[p][c] = (src[2p][c], src[2p + 1][c]) for 16 columns at a time.
DS_AVX512 void pack_row_pairs_avx512(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
                                     int64_t cols) {
  for (int64_t p = 0; 2 * p < rows; ++p) {
    const uint16_t* r0 = src + 2 * p * lds;
    const uint16_t* r1 = 2 * p + 1 < rows ? r0 + lds : nullptr;
    uint32_t* d = dst + p * ldd;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + c)));
      const __m512i hi = r1 != nullptr
                             ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + c)))
                             : _mm512_setzero_si512();
      _mm512_storeu_si512(d + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; c < cols; ++c) d[c] = uint32_t(r0[c]) | (r1 != nullptr ? uint32_t(r1[c]) << 16 : 0u);
  }
}

// The transpose of a matrix of 32-bit elements (rows, n32): dst[q][r] = element q of row r, 16 rows
// by 16 elements at a time, loaded as rows by load_row(row, first element, count) and transposed in
// registers (unpacks within 128-bit lanes, then lane shuffles).
template <class LoadRow>
DS_AVX512 void transpose32(void* dst_v, int64_t ldd, int64_t rows, int64_t n32, LoadRow load_row) {
  char* dst = static_cast<char*>(dst_v);
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int nr = int(std::min<int64_t>(16, rows - r0));
    const __mmask16 row_mask = __mmask16((1u << nr) - 1u);
    for (int64_t q0 = 0; q0 < n32; q0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = i < nr ? load_row(r0 + i, q0) : _mm512_setzero_si512();
      __m512i t[16], u[16];
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      // u[4i + c], 128-bit lane L: element 4L + c of rows 4i .. 4i + 3.
      for (int i = 0; i < 4; ++i) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      const int nq = int(std::min<int64_t>(16, n32 - q0));
      for (int c = 0; c < 4; ++c) {
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i a2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i b2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        const __m512i col[4] = {_mm512_shuffle_i32x4(a, a2, 0x88), _mm512_shuffle_i32x4(a, a2, 0xDD),
                                _mm512_shuffle_i32x4(b, b2, 0x88), _mm512_shuffle_i32x4(b, b2, 0xDD)};
        for (int l = 0; l < 4; ++l) {
          const int q = 4 * l + c;
          if (q < nq) _mm512_mask_storeu_epi32(dst + ((q0 + q) * ldd + r0) * 4, row_mask, col[l]);
        }
      }
    }
  }
}

// bf16 pairs: elements 2 q0 .. 2 q0 + 31 of a row; past the last column, zeros (the odd pad).
DS_AVX512 void pack_transposed_bf16(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
                                    int64_t cols) {
  transpose32(dst, ldd, rows, (cols + 1) / 2, [&](int64_t r, int64_t q0) DS_AVX512 {
    const int64_t ne = std::min<int64_t>(32, cols - 2 * q0);
    const __mmask32 m = ne >= 32 ? ~__mmask32(0) : __mmask32((1u << ne) - 1u);
    return _mm512_maskz_loadu_epi16(m, src + r * lds + 2 * q0);
  });
}

DS_AVX512 void pack_transposed_f32(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows,
                                   int64_t cols) {
  transpose32(dst, ldd, rows, cols, [&](int64_t r, int64_t q0) DS_AVX512 {
    const int64_t ne = std::min<int64_t>(16, cols - q0);
    const __mmask16 m = ne >= 16 ? __mmask16(0xffff) : __mmask16((1u << ne) - 1u);
    return _mm512_maskz_loadu_epi32(m, src + r * lds + q0);
  });
}
#undef DS_AVX512
#pragma GCC diagnostic pop

}  // namespace
#endif  // DS_X86

namespace bf16x {

bool available() {
  static const bool ok = convert16_isa_supported(ConvertIsa::kAvx512Bf16);
  return ok;
}

#ifdef DS_X86
void product(int64_t m, int64_t n, int64_t kp, PairA a, const uint32_t* b, int64_t ldb, float alpha, bool accumulate,
             float* c, int64_t ldc) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  product_avx512<Bf16>(m, n, kp, a.p, a.row_stride, a.pair_stride, b, ldb, alpha, accumulate, c, ldc);
}

void pack_row_pairs(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  pack_row_pairs_avx512(dst, ldd, src, lds, rows, cols);
}

void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  pack_transposed_bf16(dst, ldd, src, lds, rows, cols);
}
#else  // not x86: callers take their other paths
void product(int64_t, int64_t, int64_t, PairA, const uint32_t*, int64_t, float, bool, float*, int64_t) {
  DS_FAIL("bf16 products: AVX-512 BF16 exists only on x86-64 CPUs");
}
void pack_row_pairs(uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t) {
  DS_FAIL("bf16 products: AVX-512 BF16 exists only on x86-64 CPUs");
}
void pack_transposed(uint32_t*, int64_t, const uint16_t*, int64_t, int64_t, int64_t) {
  DS_FAIL("bf16 products: AVX-512 BF16 exists only on x86-64 CPUs");
}
#endif

}  // namespace bf16x

namespace f32x {

std::atomic<bool> g_enabled{true};

bool set_enabled(bool on) { return g_enabled.exchange(on); }

bool available() {
#ifdef DS_X86
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok && g_enabled.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

#ifdef DS_X86
void product(int64_t m, int64_t n, int64_t k, MatA a, const float* b, int64_t ldb, float alpha, bool accumulate,
             float* c, int64_t ldc) {
  DS_CHECK(available(), "fp32 block products: this CPU has no AVX-512 (check f32x::available)");
  product_avx512<F32>(m, n, k, a.p, a.row_stride, a.col_stride, b, ldb, alpha, accumulate, c, ldc);
}

void pack_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols) {
  DS_CHECK(available(), "fp32 block products: this CPU has no AVX-512 (check f32x::available)");
  pack_transposed_f32(dst, ldd, src, lds, rows, cols);
}
#else
void product(int64_t, int64_t, int64_t, MatA, const float*, int64_t, float, bool, float*, int64_t) {
  DS_FAIL("fp32 block products: AVX-512 exists only on x86-64 CPUs");
}
void pack_transposed(float*, int64_t, const float*, int64_t, int64_t, int64_t) {
  DS_FAIL("fp32 block products: AVX-512 exists only on x86-64 CPUs");
}
#endif

}  // namespace f32x
}  // namespace dstrain::cpu
