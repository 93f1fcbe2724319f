// Dense layers through OpenBLAS sgemm. Weights are stored (out_features, in_features) as in
// Hugging Face checkpoints, so the forward multiplies by the transpose.
#include <cblas.h>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {
namespace {
void check_matrix(const Tensor& t, const char* what) {
  DS_CHECK(t.ndim() >= 2, "{}: expected a matrix, got shape {}", what, t.shape().str());
}
int64_t rows(const Tensor& t) { return t.numel() / t.size(-1); }
}  // namespace

void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate) {
  check_matrix(w, "linear weight");
  const int64_t M = rows(x), K = x.size(-1), N = w.size(0);
  DS_CHECK(w.size(1) == K && rows(out) == M && out.size(-1) == N, "linear_forward: x {} · w {}^T -> out {}",
           x.shape().str(), w.shape().str(), out.shape().str());
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, int(M), int(N), int(K), 1.0f, x.data<float>(), int(K),
              w.data<float>(), int(K), accumulate ? 1.0f : 0.0f, out.data<float>(), int(N));
}

void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  const int64_t M = rows(dout), N = dout.size(-1), K = w.size(1);
  DS_CHECK(w.size(0) == N && rows(x) == M && x.size(-1) == K, "linear_backward: dout {} x {} w {}",
           dout.shape().str(), x.shape().str(), w.shape().str());
  if (dx.defined()) {
    DS_CHECK(dx.numel() == M * K, "linear_backward: dx {} for x {}", dx.shape().str(), x.shape().str());
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, int(M), int(K), int(N), 1.0f, dout.data<float>(), int(N),
                w.data<float>(), int(K), accumulate_dx ? 1.0f : 0.0f, dx.data<float>(), int(K));
  }
  if (dw.defined()) {
    DS_CHECK(dw.numel() == N * K, "linear_backward: dw {} for w {}", dw.shape().str(), w.shape().str());
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, int(N), int(K), int(M), 1.0f, dout.data<float>(), int(N),
                x.data<float>(), int(K), 1.0f, dw.data<float>(), int(K));
  }
}

// No fused 16-bit GEMM yet: the generic widening kernels serve linear_forward/backward.
void fill_gemm_16bit(OpTable&) {}

}  // namespace dstrain::cpu
