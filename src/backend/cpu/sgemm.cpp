#include "backend/cpu/sgemm.h"

#include <cblas.h>
#include <dnnl.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>

#include "core/error.h"

namespace dstrain::cpu {
namespace {

std::atomic<int> g_path{-1};


void openblas(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
              const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n), int(k),
              alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
}

void onednn(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
            const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  const dnnl_status_t s = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  DS_CHECK(s == dnnl_success, "oneDNN sgemm failed (status {}) on a {}x{}x{} product{}{}", int(s), m, n, k,
           ta ? ", A transposed" : "", tb ? ", B transposed" : "");
}

// One thread's block of a split product: a weight gradient's layout (A^T·B) on OpenBLAS's
// kernel, the others on oneDNN's (each the faster of the two on one thread for that layout).
void block(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (ta && !tb) {
    openblas(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  } else {
    onednn(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
}

void split(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  // Whole, inside a parallel region (the attention's tasks, the experts spread over threads), the
  // product runs on the calling thread with its layout's library. The layout alone picks the
  // library, so a product gets the same kernel wherever it is called: an expert's weight gradient
  // computed later (a split backward) equals the one computed at once.
  split_product(m, n, k, [&](int64_t lo, int64_t hi, bool by_rows) {
    if (by_rows) {
      block(ta, tb, hi - lo, n, k, alpha, ta ? a + lo : a + lo * lda, lda, b, ldb, beta, c + lo * ldc, ldc);
    } else {
      block(ta, tb, m, hi - lo, k, alpha, a, lda, tb ? b + lo * ldb : b + lo, ldb, beta, c + lo, ldc);
    }
  });
}
}  // namespace

void split_product(int64_t m, int64_t n, int64_t k, const std::function<void(int64_t, int64_t, bool)>& block) {
  // Smaller products, or fewer rows (columns) a thread, are not split: a parallel region would
  // cost more than it saves.
  constexpr int64_t kMinSplitWork = int64_t(1) << 18, kMinRowsPerThread = 32;
  const int threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  const bool by_rows = m >= n;
  const int64_t extent = by_rows ? m : n;
  if (threads == 1 || m * n * k < kMinSplitWork || extent < kMinRowsPerThread * threads) {
    block(0, extent, by_rows);
    return;
  }
  const int64_t per = (extent + threads - 1) / threads;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int64_t lo = std::min(extent, omp_get_thread_num() * per), hi = std::min(extent, lo + per);
    try {
      if (hi > lo) block(lo, hi, by_rows);
    } catch (...) {
#pragma omp critical(split_product_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

SgemmPath parse_sgemm_path(const char* v) {
  if (v == nullptr || *v == '\0' || std::strcmp(v, "split") == 0) return SgemmPath::kSplit;
  if (std::strcmp(v, "onednn") == 0) return SgemmPath::kOneDnn;
  if (std::strcmp(v, "openblas") == 0) return SgemmPath::kOpenBlas;
  DS_FAIL(
      "DSTRAIN_CPU_SGEMM={}: expected 'split' (the default), 'onednn' or 'openblas'; unset it or fix the job's "
      "environment",
      v);
}

SgemmPath sgemm_path() {
  int p = g_path.load(std::memory_order_relaxed);
  if (p < 0) {
    static std::mutex m;
    std::lock_guard<std::mutex> lock(m);
    p = g_path.load(std::memory_order_relaxed);
    if (p < 0) {
      p = int(parse_sgemm_path(std::getenv("DSTRAIN_CPU_SGEMM")));
      g_path.store(p, std::memory_order_relaxed);
    }
  }
  return SgemmPath(p);
}

void set_sgemm_path(SgemmPath path) { g_path.store(int(path), std::memory_order_relaxed); }

std::string sgemm_path_name() {
  const dnnl_version_t* v = dnnl_version();
  const std::string dnnl = fmt::format("oneDNN {}.{}.{}", v->major, v->minor, v->patch);
  // openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY ..."; keep name and version.
  const std::string config = openblas_get_config();
  const std::string blas = config.substr(0, config.find(' ', config.find(' ') + 1));
  switch (sgemm_path()) {
    case SgemmPath::kSplit: return fmt::format("dstrain's thread split over {} and {} sgemm", dnnl, blas);
    case SgemmPath::kOneDnn: return dnnl + " sgemm";
    case SgemmPath::kOpenBlas: return blas + " sgemm";
  }
  return "?";
}

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
           const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum: oneDNN would leave C as it was
    for (int64_t i = 0; i < m; ++i) {
      float* row = c + i * ldc;
      for (int64_t j = 0; j < n; ++j) row[j] = beta == 0.0f ? 0.0f : beta * row[j];
    }
    return;
  }
  switch (sgemm_path()) {
    case SgemmPath::kSplit: split(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
    case SgemmPath::kOneDnn: onednn(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
    case SgemmPath::kOpenBlas: openblas(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc); return;
  }
}

}  // namespace dstrain::cpu
