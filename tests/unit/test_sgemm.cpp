// The CPU backend's fp32 GEMM (backend/cpu/sgemm.h), through each library it can use: every
// transposition, padded leading dimensions, alpha and beta (beta = 0 must not read C: it holds
// NaN here), odd and degenerate shapes, against a double-precision product; the same inputs give
// the same bits twice; a bad DSTRAIN_CPU_SGEMM is an error naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/cpu/sgemm.h"
#include "core/error.h"

namespace dstrain {
namespace {

using cpu::SgemmLibrary;

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
};

// Restores the library the process had when a test forced another.
struct LibraryGuard {
  SgemmLibrary saved = cpu::sgemm_library();
  ~LibraryGuard() { cpu::set_sgemm_library(saved); }
};

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Runs one case on the current library; returns the worst error relative to the largest |C|
// (infinite when a result is not finite or the padding between C's rows was written).
double worst_error(const Case& c, std::vector<float>* out = nullptr) {
  // Stored shapes with 3 columns of padding: A (m,k) or (k,m), B (k,n) or (n,k), C (m,n).
  const int64_t a_rows = c.ta ? c.k : c.m, a_cols = c.ta ? c.m : c.k;
  const int64_t b_rows = c.tb ? c.n : c.k, b_cols = c.tb ? c.k : c.n;
  const int64_t lda = a_cols + 3, ldb = b_cols + 3, ldc = c.n + 3;
  const std::vector<float> a = random_values(size_t(a_rows * lda), 1), b = random_values(size_t(b_rows * ldb), 2);
  std::vector<float> c0 = random_values(size_t(c.m * ldc), 3);
  if (c.beta == 0.0f) std::fill(c0.begin(), c0.end(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> got = c0;
  cpu::sgemm(c.ta, c.tb, c.m, c.n, c.k, c.alpha, a.data(), lda, b.data(), ldb, c.beta, got.data(), ldc);
  double worst = 0, largest = 1e-30;
  for (int64_t i = 0; i < c.m; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      double sum = 0;
      for (int64_t p = 0; p < c.k; ++p) {
        const double x = c.ta ? a[size_t(p * lda + i)] : a[size_t(i * lda + p)];
        const double y = c.tb ? b[size_t(j * ldb + p)] : b[size_t(p * ldb + j)];
        sum += x * y;
      }
      const double want = c.alpha * sum + (c.beta == 0.0f ? 0.0 : c.beta * double(c0[size_t(i * ldc + j)]));
      const double g = got[size_t(i * ldc + j)];
      worst = std::isfinite(g) ? std::max(worst, std::abs(g - want)) : std::numeric_limits<double>::infinity();
      largest = std::max(largest, std::abs(want));
    }
    for (int64_t j = c.n; j < ldc && i + 1 < c.m; ++j) {
      const float before = c0[size_t(i * ldc + j)], after = got[size_t(i * ldc + j)];
      if (std::memcmp(&before, &after, 4) != 0) return std::numeric_limits<double>::infinity();
    }
  }
  if (out) *out = got;
  return worst / largest;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{37, 19, 53}, {1, 7, 3}, {64, 48, 256}, {5, 1, 1}}) {
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.5f, 1.0f}, {-2.0f, 0.25f}}) {
          v.push_back({ta, tb, m, n, k, alpha, beta});
        }
      }
    }
  }
  return v;
}

class Sgemm : public ::testing::TestWithParam<SgemmLibrary> {};

TEST_P(Sgemm, MatchesADoublePrecisionProductInEveryLayout) {
  LibraryGuard guard;
  cpu::set_sgemm_library(GetParam());
  for (const Case& c : cases()) {
    SCOPED_TRACE(::testing::Message() << (c.ta ? "T" : "N") << (c.tb ? "T" : "N") << " m " << c.m << " n " << c.n
                                      << " k " << c.k << " alpha " << c.alpha << " beta " << c.beta);
    EXPECT_LT(worst_error(c), 1e-5);
  }
}

TEST_P(Sgemm, GivesTheSameBitsTwice) {
  LibraryGuard guard;
  cpu::set_sgemm_library(GetParam());
  const Case c{false, true, 300, 200, 256, 1.0f, 0.0f};
  std::vector<float> first, second;
  worst_error(c, &first);
  worst_error(c, &second);
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * 4));
}

TEST_P(Sgemm, AnEmptyProductScalesC) {
  LibraryGuard guard;
  cpu::set_sgemm_library(GetParam());
  std::vector<float> c = {1.0f, 2.0f, 3.0f, 4.0f};
  const float a = 7.0f, b = 9.0f;
  cpu::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
  std::fill(c.begin(), c.end(), std::numeric_limits<float>::quiet_NaN());
  cpu::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f}));
}

INSTANTIATE_TEST_SUITE_P(Libraries, Sgemm, ::testing::Values(SgemmLibrary::kOneDnn, SgemmLibrary::kOpenBlas),
                         [](const ::testing::TestParamInfo<SgemmLibrary>& p) {
                           return p.param == SgemmLibrary::kOneDnn ? std::string("OneDnn") : std::string("OpenBlas");
                         });

TEST(SgemmLibraryChoice, TheEnvironmentNamesOneDnnOrOpenBlas) {
  EXPECT_EQ(cpu::parse_sgemm_library(nullptr), SgemmLibrary::kOneDnn);
  EXPECT_EQ(cpu::parse_sgemm_library(""), SgemmLibrary::kOneDnn);
  EXPECT_EQ(cpu::parse_sgemm_library("onednn"), SgemmLibrary::kOneDnn);
  EXPECT_EQ(cpu::parse_sgemm_library("openblas"), SgemmLibrary::kOpenBlas);
  try {
    cpu::parse_sgemm_library("mkl");
    FAIL() << "DSTRAIN_CPU_SGEMM=mkl was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("DSTRAIN_CPU_SGEMM=mkl"), std::string::npos) << what;
    EXPECT_NE(what.find("'openblas'"), std::string::npos) << what;
  }
}

TEST(SgemmLibraryChoice, TheNameSaysWhichLibraryRuns) {
  LibraryGuard guard;
  cpu::set_sgemm_library(SgemmLibrary::kOneDnn);
  EXPECT_EQ(cpu::sgemm_library_name().rfind("oneDNN ", 0), 0u) << cpu::sgemm_library_name();
  cpu::set_sgemm_library(SgemmLibrary::kOpenBlas);
  EXPECT_EQ(cpu::sgemm_library_name().rfind("OpenBLAS ", 0), 0u) << cpu::sgemm_library_name();
}

}  // namespace
}  // namespace dstrain
