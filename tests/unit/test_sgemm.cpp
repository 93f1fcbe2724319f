// The CPU backend's fp32 GEMM (backend/cpu/sgemm.h), on each of its paths: every
// transposition, padded leading dimensions, alpha and beta (beta = 0 must not read C: it holds
// NaN here), odd and degenerate shapes, against a double-precision product; the same inputs give
// the same bits twice; the split path inside a parallel region and across blocks that do not
// divide evenly; a bad DSTRAIN_CPU_SGEMM is an error naming it.
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

using cpu::SgemmPath;

struct Case {
  bool ta, tb;
  int64_t m, n, k;
  float alpha, beta;
};

// Restores the path the process had when a test forced another.
struct PathGuard {
  SgemmPath saved = cpu::sgemm_path();
  ~PathGuard() { cpu::set_sgemm_path(saved); }
};

std::vector<float> random_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = u(rng);
  return v;
}

// Runs one case on the current path; returns the worst error relative to the largest |C|
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
      // The last two are split over the threads: by rows (301 of them) and by columns.
      for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{37, 19, 53}, {1, 7, 3}, {64, 48, 256}, {5, 1, 1},
                             {301, 67, 129}, {70, 333, 97}}) {
        for (auto [alpha, beta] : {std::pair{1.0f, 0.0f}, {0.5f, 1.0f}, {-2.0f, 0.25f}}) {
          v.push_back({ta, tb, m, n, k, alpha, beta});
        }
      }
    }
  }
  return v;
}

class Sgemm : public ::testing::TestWithParam<SgemmPath> {};

TEST_P(Sgemm, MatchesADoublePrecisionProductInEveryLayout) {
  PathGuard guard;
  cpu::set_sgemm_path(GetParam());
  for (const Case& c : cases()) {
    SCOPED_TRACE(::testing::Message() << (c.ta ? "T" : "N") << (c.tb ? "T" : "N") << " m " << c.m << " n " << c.n
                                      << " k " << c.k << " alpha " << c.alpha << " beta " << c.beta);
    EXPECT_LT(worst_error(c), 1e-5);
  }
}

TEST_P(Sgemm, GivesTheSameBitsTwice) {
  PathGuard guard;
  cpu::set_sgemm_path(GetParam());
  const Case c{false, true, 300, 200, 256, 1.0f, 0.0f};
  std::vector<float> first, second;
  worst_error(c, &first);
  worst_error(c, &second);
  EXPECT_EQ(0, std::memcmp(first.data(), second.data(), first.size() * 4));
}

TEST_P(Sgemm, AnEmptyProductScalesC) {
  PathGuard guard;
  cpu::set_sgemm_path(GetParam());
  std::vector<float> c = {1.0f, 2.0f, 3.0f, 4.0f};
  const float a = 7.0f, b = 9.0f;
  cpu::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.5f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.5f, 1.0f, 1.5f, 2.0f}));
  std::fill(c.begin(), c.end(), std::numeric_limits<float>::quiet_NaN());
  cpu::sgemm(false, false, 2, 2, 0, 1.0f, &a, 1, &b, 2, 0.0f, c.data(), 2);
  EXPECT_EQ(c, (std::vector<float>{0.0f, 0.0f, 0.0f, 0.0f}));
}

// Products called from inside a parallel region (the attention's tasks do): each thread's own
// product, on the calling thread, as if called alone.
TEST_P(Sgemm, InsideAParallelRegionEachThreadGetsItsOwnProduct) {
  PathGuard guard;
  cpu::set_sgemm_path(GetParam());
  const Case c{false, true, 301, 67, 129, 1.0f, 0.0f};
  std::vector<float> alone;
  worst_error(c, &alone);
  std::vector<double> errors(4, -1);
  std::vector<std::vector<float>> results(4);
#pragma omp parallel for num_threads(2) schedule(static, 1)
  for (int i = 0; i < 4; ++i) errors[size_t(i)] = worst_error(c, &results[size_t(i)]);
  for (int i = 0; i < 4; ++i) {
    EXPECT_LT(errors[size_t(i)], 1e-5) << "task " << i;
    EXPECT_EQ(results[size_t(i)].size(), alone.size());
  }
}

INSTANTIATE_TEST_SUITE_P(Paths, Sgemm, ::testing::Values(SgemmPath::kSplit, SgemmPath::kOneDnn, SgemmPath::kOpenBlas),
                         [](const ::testing::TestParamInfo<SgemmPath>& p) {
                           return p.param == SgemmPath::kSplit    ? std::string("Split")
                                  : p.param == SgemmPath::kOneDnn ? std::string("OneDnn")
                                                                  : std::string("OpenBlas");
                         });

TEST(SgemmPathChoice, TheEnvironmentNamesSplitOneDnnOrOpenBlas) {
  EXPECT_EQ(cpu::parse_sgemm_path(nullptr), SgemmPath::kSplit);
  EXPECT_EQ(cpu::parse_sgemm_path(""), SgemmPath::kSplit);
  EXPECT_EQ(cpu::parse_sgemm_path("split"), SgemmPath::kSplit);
  EXPECT_EQ(cpu::parse_sgemm_path("onednn"), SgemmPath::kOneDnn);
  EXPECT_EQ(cpu::parse_sgemm_path("openblas"), SgemmPath::kOpenBlas);
  try {
    cpu::parse_sgemm_path("mkl");
    FAIL() << "DSTRAIN_CPU_SGEMM=mkl was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("DSTRAIN_CPU_SGEMM=mkl"), std::string::npos) << what;
    EXPECT_NE(what.find("'openblas'"), std::string::npos) << what;
  }
}

TEST(SgemmPathChoice, TheNameSaysWhichLibrariesRun) {
  PathGuard guard;
  cpu::set_sgemm_path(SgemmPath::kSplit);
  EXPECT_EQ(cpu::sgemm_path_name().rfind("dstrain's thread split over oneDNN ", 0), 0u) << cpu::sgemm_path_name();
  cpu::set_sgemm_path(SgemmPath::kOneDnn);
  EXPECT_EQ(cpu::sgemm_path_name().rfind("oneDNN ", 0), 0u) << cpu::sgemm_path_name();
  cpu::set_sgemm_path(SgemmPath::kOpenBlas);
  EXPECT_EQ(cpu::sgemm_path_name().rfind("OpenBLAS ", 0), 0u) << cpu::sgemm_path_name();
}

}  // namespace
}  // namespace dstrain
