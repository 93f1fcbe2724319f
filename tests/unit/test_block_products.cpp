// The AVX-512 block products of attention (backend/cpu/block_products.h), bf16 and fp32: the packs
// element for element against their definitions, and the products against double-precision sums
// of the same values, at edge shapes (tails of the 6-row and 64-column register tiles, odd sums),
// in both A layouts, with alpha and accumulate; the same bits on every call and thread. Skipped,
// with a message, on CPUs without AVX-512 BF16 (bf16) or AVX-512 (fp32).
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cpu/block_products.h"
#include "core/dtype.h"

namespace dstrain {
namespace {

namespace bx = cpu::bf16x;
namespace fx = cpu::f32x;

#define SKIP_WITHOUT_AVX512_BF16()                                                               \
  if (!bx::available()) GTEST_SKIP() << "this CPU has no AVX-512 BF16: the bf16 block products " \
                                        "do not run here (attention takes its fp32 path)"

std::vector<uint16_t> random_bf16(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<uint16_t> v(static_cast<size_t>(n));
  for (auto& x : v) x = f32_to_bf16(nd(rng));
  return v;
}

// The pair (lo, hi) at element offset e of bf16 memory.
std::pair<float, float> pair_at(const uint16_t* p, int64_t e) { return {bf16_to_f32(p[e]), bf16_to_f32(p[e + 1])}; }
std::pair<float, float> pair_of(uint32_t u) { return {bf16_to_f32(uint16_t(u & 0xffffu)), bf16_to_f32(uint16_t(u >> 16))}; }

TEST(Bf16Products, PacksHoldTheirDefinedPairs) {
  SKIP_WITHOUT_AVX512_BF16();
  std::mt19937 rng(3);
  for (int64_t rows : {1, 2, 15, 16, 17, 33, 64, 131}) {
    for (int64_t cols : {1, 2, 3, 31, 32, 33, 64, 65}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols);
      const int64_t lds = cols + 5;  // rows of a wider tensor
      const std::vector<uint16_t> src = random_bf16(rows * lds, rng);
      const int64_t pc = (cols + 1) / 2, pr = (rows + 1) / 2;
      const auto at = [&](int64_t r, int64_t c) -> uint32_t {
        return r < rows && c < cols ? src[size_t(r * lds + c)] : 0u;  // past the end: the zero pad
      };
      // Row pairs: dst[p][c] = (src[2p][c], src[2p + 1][c]).
      const int64_t ldr = cols + 3;
      std::vector<uint32_t> rp(size_t(pr * ldr), 0xdeadbeefu);
      bx::pack_row_pairs(rp.data(), ldr, src.data(), lds, rows, cols);
      for (int64_t p = 0; p < pr; ++p) {
        for (int64_t c = 0; c < cols; ++c) {
          ASSERT_EQ(rp[size_t(p * ldr + c)], at(2 * p, c) | at(2 * p + 1, c) << 16) << "row pairs " << p << "," << c;
        }
        ASSERT_EQ(rp[size_t(p * ldr + cols)], 0xdeadbeefu) << "row pairs wrote past its columns";
      }
      // Transposed: dst[p][r] = (src[r][2p], src[r][2p + 1]).
      const int64_t ldt = rows + 3;
      std::vector<uint32_t> tp(size_t(pc * ldt), 0xdeadbeefu);
      bx::pack_transposed(tp.data(), ldt, src.data(), lds, rows, cols);
      for (int64_t p = 0; p < pc; ++p) {
        for (int64_t r = 0; r < rows; ++r) {
          ASSERT_EQ(tp[size_t(p * ldt + r)], at(r, 2 * p) | at(r, 2 * p + 1) << 16) << "transposed " << p << "," << r;
        }
        ASSERT_EQ(tp[size_t(p * ldt + rows)], 0xdeadbeefu) << "transposed wrote past its rows";
      }
    }
  }
}

// C = alpha A B (+ C) against double sums over the same pairs; fp32 sums of exact products in
// a fixed order are within k * 2^-24 of the sum of |terms| (plus the final alpha and add).
TEST(Bf16Products, ProductsMatchDoubleSumsAtEdgeShapes) {
  SKIP_WITHOUT_AVX512_BF16();
  std::mt19937 rng(5);
  for (int64_t m : {1, 5, 6, 7, 13, 64}) {
    for (int64_t n : {1, 15, 16, 17, 64, 65, 130}) {
      for (int64_t kp : {1, 3, 32}) {
        for (bool transposed : {false, true}) {
          for (bool accumulate : {false, true}) {
            SCOPED_TRACE(testing::Message() << "m " << m << " n " << n << " kp " << kp << " A^T " << transposed
                                            << " accumulate " << accumulate);
            const float alpha = accumulate ? 0.375f : 1.0f;
            // A: row-major pairs (ld = 2 kp + 2, even) or the transpose of a row-pair pack (ld m + 1).
            const int64_t lda = transposed ? m + 1 : 2 * kp + 2;
            const std::vector<uint16_t> a = random_bf16(transposed ? 2 * kp * lda : m * lda, rng);
            const bx::PairA pa = transposed ? bx::PairA{a.data(), 2, 2 * lda} : bx::PairA{a.data(), lda, 2};
            const int64_t ldb = n + 2;
            const std::vector<uint16_t> b16 = random_bf16(2 * kp * ldb, rng);
            std::vector<uint32_t> b(size_t(kp * ldb));
            std::memcpy(b.data(), b16.data(), b.size() * 4);
            const int64_t ldc = n + 1;
            std::vector<float> c(size_t(m * ldc));
            for (auto& x : c) x = float(int(rng() % 17) - 8) * 0.25f;
            const std::vector<float> c0 = c;
            bx::product(m, n, kp, pa, b.data(), ldb, alpha, accumulate, c.data(), ldc);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double sum = 0, mag = 0;
                for (int64_t p = 0; p < kp; ++p) {
                  const auto [a0, a1] = pair_at(a.data(), i * pa.row_stride + p * pa.pair_stride);
                  const auto [b0, b1] = pair_of(b[size_t(p * ldb + j)]);
                  sum += double(a0) * b0 + double(a1) * b1;
                  mag += std::abs(double(a0) * b0) + std::abs(double(a1) * b1);
                }
                const double old = c0[size_t(i * ldc + j)];
                const double want = alpha * sum + (accumulate ? old : 0.0);
                const double tol = 2 * kp * 6e-8 * mag * alpha + 1.2e-7 * (std::abs(want) + std::abs(old));
                ASSERT_NEAR(c[size_t(i * ldc + j)], want, tol) << "C[" << i << "][" << j << "]";
              }
              for (int64_t j = n; j < ldc; ++j) {
                ASSERT_EQ(c[size_t(i * ldc + j)], c0[size_t(i * ldc + j)]) << "wrote past column " << n;
              }
            }
          }
        }
      }
    }
  }
}

// A zero pad makes an odd sum: pairs whose high halves are zero give the sum of the low halves'
// products alone, even when the other operand's high half is not zero.
TEST(Bf16Products, ZeroPadSumsOneProduct) {
  SKIP_WITHOUT_AVX512_BF16();
  const uint16_t a[2] = {f32_to_bf16(3.0f), 0};
  const uint32_t b[1] = {uint32_t(f32_to_bf16(2.0f)) | uint32_t(f32_to_bf16(1e30f)) << 16};
  float c = -1;
  bx::product(1, 1, 1, bx::PairA{a, 2, 2}, b, 1, 1.0f, false, &c, 1);
  EXPECT_EQ(c, 6.0f);
}

TEST(Bf16Products, SameBitsOnEveryCallAndThread) {
  SKIP_WITHOUT_AVX512_BF16();
  std::mt19937 rng(9);
  const int64_t m = 64, n = 200, kp = 40;
  const std::vector<uint16_t> a = random_bf16(m * 2 * kp, rng);
  const std::vector<uint16_t> b16 = random_bf16(2 * kp * n, rng);
  std::vector<uint32_t> b(size_t(kp * n));
  std::memcpy(b.data(), b16.data(), b.size() * 4);
  std::vector<float> want(size_t(m * n));
  bx::product(m, n, kp, bx::PairA{a.data(), 2 * kp, 2}, b.data(), n, 0.5f, false, want.data(), n);
  std::vector<std::vector<float>> got(8, std::vector<float>(size_t(m * n)));
#pragma omp parallel for num_threads(4) schedule(static, 1)
  for (int t = 0; t < 8; ++t) {
    bx::product(m, n, kp, bx::PairA{a.data(), 2 * kp, 2}, b.data(), n, 0.5f, false, got[size_t(t)].data(), n);
  }
  for (const auto& g : got) EXPECT_EQ(std::memcmp(g.data(), want.data(), want.size() * 4), 0);
}

#define SKIP_WITHOUT_AVX512()                                                                     \
  if (!fx::available()) GTEST_SKIP() << "this CPU has no AVX-512: the fp32 block products do not " \
                                        "run here (attention takes its sgemm path)"

TEST(F32Products, TransposedPackIsTheTranspose) {
  SKIP_WITHOUT_AVX512();
  std::mt19937 rng(13);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t rows : {1, 15, 16, 17, 64, 131}) {
    for (int64_t cols : {1, 3, 16, 17, 64, 65}) {
      SCOPED_TRACE(testing::Message() << rows << " x " << cols);
      const int64_t lds = cols + 3, ldd = rows + 5;
      std::vector<float> src(static_cast<size_t>(rows * lds));
      for (auto& x : src) x = nd(rng);
      std::vector<float> dst(static_cast<size_t>(cols * ldd), -7.0f);
      fx::pack_transposed(dst.data(), ldd, src.data(), lds, rows, cols);
      for (int64_t c = 0; c < cols; ++c) {
        for (int64_t r = 0; r < rows; ++r) ASSERT_EQ(dst[size_t(c * ldd + r)], src[size_t(r * lds + c)]);
        ASSERT_EQ(dst[size_t(c * ldd + rows)], -7.0f) << "wrote past its rows";
      }
    }
  }
}

// One FMA chain in k order per output: within k * 2^-24 of the sum of |terms| of the double sum.
TEST(F32Products, ProductsMatchDoubleSumsAtEdgeShapes) {
  SKIP_WITHOUT_AVX512();
  std::mt19937 rng(17);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (int64_t m : {1, 5, 6, 7, 64}) {
    for (int64_t n : {1, 16, 17, 64, 65, 130}) {
      for (int64_t k : {1, 7, 64}) {
        for (bool transposed : {false, true}) {
          for (bool accumulate : {false, true}) {
            SCOPED_TRACE(testing::Message() << "m " << m << " n " << n << " k " << k << " A^T " << transposed
                                            << " accumulate " << accumulate);
            const float alpha = accumulate ? 0.375f : 1.0f;
            const int64_t lda = transposed ? m + 1 : k + 2;
            std::vector<float> a(static_cast<size_t>(transposed ? k * lda : m * lda));
            for (auto& x : a) x = nd(rng);
            const fx::MatA ma = transposed ? fx::MatA{a.data(), 1, lda} : fx::MatA{a.data(), lda, 1};
            const int64_t ldb = n + 2, ldc = n + 1;
            std::vector<float> b(static_cast<size_t>(k * ldb)), c(static_cast<size_t>(m * ldc));
            for (auto& x : b) x = nd(rng);
            for (auto& x : c) x = float(int(rng() % 17) - 8) * 0.25f;
            const std::vector<float> c0 = c;
            fx::product(m, n, k, ma, b.data(), ldb, alpha, accumulate, c.data(), ldc);
            for (int64_t i = 0; i < m; ++i) {
              for (int64_t j = 0; j < n; ++j) {
                double sum = 0, mag = 0;
                for (int64_t p = 0; p < k; ++p) {
                  const double t = double(ma.p[i * ma.row_stride + p * ma.col_stride]) * b[size_t(p * ldb + j)];
                  sum += t;
                  mag += std::abs(t);
                }
                const double old = c0[size_t(i * ldc + j)];
                const double want = alpha * sum + (accumulate ? old : 0.0);
                const double tol = (k + 1) * 6e-8 * mag * alpha + 1.2e-7 * (std::abs(want) + std::abs(old));
                ASSERT_NEAR(c[size_t(i * ldc + j)], want, tol) << "C[" << i << "][" << j << "]";
              }
              for (int64_t j = n; j < ldc; ++j) {
                ASSERT_EQ(c[size_t(i * ldc + j)], c0[size_t(i * ldc + j)]) << "wrote past column " << n;
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace dstrain
