// Small bf16 products on AVX-512 BF16 (bf16_products.h). One register tile of up to 6 rows x 64
// columns of fp32 sums (24 zmm accumulators): per pair step it loads the 4 vectors of B's row
// once and broadcasts each row's A pair against them.
#include "backend/cpu/bf16_products.h"

#include <algorithm>
#include <cstring>

#include "backend/cpu/convert16.h"
#include "core/error.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define DS_X86 1
#endif

namespace dstrain::cpu::bf16x {

#ifdef DS_X86
namespace {

// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*: GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define DS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

constexpr int kRows = 6;     // rows of a register tile
constexpr int kVectors = 4;  // 16-column vectors of a register tile

// C tile (MR rows, NV vectors, the last one masked by `last`) = alpha * A B (+ C).
template <int MR, int NV>
DS_AVX512BF16 void tile(int64_t kp, const uint16_t* a, int64_t ars, int64_t aps, const uint32_t* b, int64_t ldb,
                        __mmask16 last, float alpha, bool accumulate, float* c, int64_t ldc) {
  __m512 acc[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    const uint32_t* bp = b + p * ldb;
    __m512i bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) bv[v] = _mm512_loadu_si512(bp + 16 * v);
    bv[NV - 1] = _mm512_maskz_loadu_epi32(last, bp + 16 * (NV - 1));
    const uint16_t* ap = a + p * aps;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int pair;
      std::memcpy(&pair, ap + r * ars, sizeof pair);
      const __m512i av = _mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)av, (__m512bh)bv[v]);
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

using Tile = void (*)(int64_t, const uint16_t*, int64_t, int64_t, const uint32_t*, int64_t, __mmask16, float, bool,
                      float*, int64_t);

template <int MR>
constexpr Tile tile_for(int nv) {
  return nv == 1 ? &tile<MR, 1> : nv == 2 ? &tile<MR, 2> : nv == 3 ? &tile<MR, 3> : &tile<MR, 4>;
}
Tile tile_for(int mr, int nv) {
  switch (mr) {
    case 1: return tile_for<1>(nv);
    case 2: return tile_for<2>(nv);
    case 3: return tile_for<3>(nv);
    case 4: return tile_for<4>(nv);
    case 5: return tile_for<5>(nv);
    default: return tile_for<6>(nv);
  }
}

DS_AVX512BF16 void product_avx512(int64_t m, int64_t n, int64_t kp, PairA a, const uint32_t* b, int64_t ldb,
                                  float alpha, bool accumulate, float* c, int64_t ldc) {
  for (int64_t j0 = 0; j0 < n; j0 += 16 * kVectors) {
    const int64_t cols = std::min<int64_t>(16 * kVectors, n - j0);
    const int nv = int((cols + 15) / 16);
    const int rem = int(cols - 16 * (nv - 1));
    const __mmask16 last = __mmask16((1u << rem) - 1u);
    for (int64_t i0 = 0; i0 < m; i0 += kRows) {
      const int mr = int(std::min<int64_t>(kRows, m - i0));
      tile_for(mr, nv)(kp, a.p + i0 * a.row_stride, a.row_stride, a.pair_stride, b + j0, ldb, last, alpha, accumulate,
                       c + i0 * ldc + j0, ldc);
    }
  }
}

// dst[p][c] = (src[2p][c], src[2p + 1][c]) for 16 columns at a time.
DS_AVX512BF16 void pack_row_pairs_avx512(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
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
// dst[p][r] = (src[r][2p], src[r][2p + 1]): 16 rows by 16 pairs at a time, loaded as rows and
// transposed in registers (unpacks within 128-bit lanes, then lane shuffles).
DS_AVX512BF16 void pack_transposed_avx512(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows,
                                          int64_t cols) {
  const int64_t pairs = (cols + 1) / 2;
  for (int64_t r0 = 0; r0 < rows; r0 += 16) {
    const int nr = int(std::min<int64_t>(16, rows - r0));
    const __mmask16 row_mask = __mmask16((1u << nr) - 1u);
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      // Elements 2 p0 .. 2 p0 + 31 of each row; past the last column, zeros (the odd pad).
      const int64_t ne = std::min<int64_t>(32, cols - 2 * p0);
      const __mmask32 elem_mask = ne >= 32 ? ~__mmask32(0) : __mmask32((1u << ne) - 1u);
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < nr ? _mm512_maskz_loadu_epi16(elem_mask, src + (r0 + i) * lds + 2 * p0) : _mm512_setzero_si512();
      }
      __m512i t[16], u[16];
      for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
      }
      // u[4i + c], 128-bit lane L: pair 4L + c of rows 4i .. 4i + 3.
      for (int i = 0; i < 4; ++i) {
        u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
      }
      const int np = int(std::min<int64_t>(16, pairs - p0));
      for (int c = 0; c < 4; ++c) {
        const __m512i a = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
        const __m512i b = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
        const __m512i a2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
        const __m512i b2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
        const __m512i col[4] = {_mm512_shuffle_i32x4(a, a2, 0x88), _mm512_shuffle_i32x4(a, a2, 0xDD),
                                _mm512_shuffle_i32x4(b, b2, 0x88), _mm512_shuffle_i32x4(b, b2, 0xDD)};
        for (int l = 0; l < 4; ++l) {
          const int p = 4 * l + c;
          if (p < np) _mm512_mask_storeu_epi32(dst + (p0 + p) * ldd + r0, row_mask, col[l]);
        }
      }
    }
  }
}
#undef DS_AVX512BF16
#pragma GCC diagnostic pop

}  // namespace

bool available() {
  static const bool ok = convert16_isa_supported(ConvertIsa::kAvx512Bf16);
  return ok;
}

void product(int64_t m, int64_t n, int64_t kp, PairA a, const uint32_t* b, int64_t ldb, float alpha, bool accumulate,
             float* c, int64_t ldc) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  if (m <= 0 || n <= 0) return;
  product_avx512(m, n, kp, a, b, ldb, alpha, accumulate, c, ldc);
}

void pack_row_pairs(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  pack_row_pairs_avx512(dst, ldd, src, lds, rows, cols);
}

void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols) {
  DS_CHECK(available(), "bf16 products: this CPU has no AVX-512 BF16 (check bf16x::available)");
  pack_transposed_avx512(dst, ldd, src, lds, rows, cols);
}

#else  // not x86: no AVX-512 BF16, callers take their fp32 paths

bool available() { return false; }
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

}  // namespace dstrain::cpu::bf16x
