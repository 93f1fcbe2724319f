#include "backend/cpu/sgemm.h"

#include <cblas.h>
#include <dnnl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/error.h"

namespace dstrain::cpu {
namespace {

std::atomic<int> g_library{-1};

}  // namespace

SgemmLibrary parse_sgemm_library(const char* v) {
  if (v == nullptr || *v == '\0' || std::strcmp(v, "onednn") == 0) return SgemmLibrary::kOneDnn;
  if (std::strcmp(v, "openblas") == 0) return SgemmLibrary::kOpenBlas;
  DS_FAIL("DSTRAIN_CPU_SGEMM={}: expected 'onednn' (the default) or 'openblas'; unset it or fix the job's environment",
          v);
}

SgemmLibrary sgemm_library() {
  int l = g_library.load(std::memory_order_relaxed);
  if (l < 0) {
    static std::mutex m;
    std::lock_guard<std::mutex> lock(m);
    l = g_library.load(std::memory_order_relaxed);
    if (l < 0) {
      l = int(parse_sgemm_library(std::getenv("DSTRAIN_CPU_SGEMM")));
      g_library.store(l, std::memory_order_relaxed);
    }
  }
  return SgemmLibrary(l);
}

void set_sgemm_library(SgemmLibrary library) { g_library.store(int(library), std::memory_order_relaxed); }

std::string sgemm_library_name() {
  if (sgemm_library() == SgemmLibrary::kOneDnn) {
    const dnnl_version_t* v = dnnl_version();
    return fmt::format("oneDNN {}.{}.{} sgemm", v->major, v->minor, v->patch);
  }
  // openblas_get_config(): "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY ..."; keep name and version.
  std::string config = openblas_get_config();
  const size_t second_space = config.find(' ', config.find(' ') + 1);
  return config.substr(0, second_space) + " sgemm";
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
  if (sgemm_library() == SgemmLibrary::kOpenBlas) {
    cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, int(m), int(n), int(k),
                alpha, a, int(lda), b, int(ldb), beta, c, int(ldc));
    return;
  }
  const dnnl_status_t s =
      dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  DS_CHECK(s == dnnl_success, "oneDNN sgemm failed (status {}) on a {}x{}x{} product{}{}", int(s), m, n, k,
           ta ? ", A transposed" : "", tb ? ", B transposed" : "");
}

}  // namespace dstrain::cpu
