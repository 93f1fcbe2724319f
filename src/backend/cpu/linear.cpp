// Dense layers through the backend's sgemm (sgemm.h). Weights are stored (out_features,
// in_features) as in Hugging Face checkpoints, so the forward multiplies by the transpose.
#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/sgemm.h"

namespace dstrain::cpu {
namespace {
int64_t rows(const Tensor& t) { return t.numel() / t.size(-1); }
}  // namespace

void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate) {
  const int64_t M = rows(x), K = x.size(-1), N = w.size(0);
  sgemm(false, true, M, N, K, 1.0f, x.data<float>(), K, w.data<float>(), K, accumulate ? 1.0f : 0.0f,
        out.data<float>(), N);
}

void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  const int64_t M = rows(dout), N = dout.size(-1), K = w.size(1);
  if (dx.defined()) {
    sgemm(false, false, M, K, N, 1.0f, dout.data<float>(), N, w.data<float>(), K, accumulate_dx ? 1.0f : 0.0f,
          dx.data<float>(), K);
  }
  if (dw.defined()) {
    sgemm(true, false, N, K, M, 1.0f, dout.data<float>(), N, x.data<float>(), K, 1.0f, dw.data<float>(), K);
  }
}

// ---- 16-bit slots (BF16 / F16) ----------------------------------------------------------
// Any mix of fp32 and the slot's 16-bit type (backend/ops.def): x, w 16-bit; out 16-bit, or fp32
// when the layer adds into the fp32 residual (accumulate); dout 16-bit, or the fp32 residual
// gradient; dx 16-bit or fp32; dw fp32 (the master gradient, added to in fp32, never rounded to
// 16 bits). Every product accumulates in fp32 (gemm16.h: oneDNN bf16 on CPUs with hardware bf16,
// else widening to fp32 and sgemm).
void linear_forward_16bit(Tensor out, Tensor x, Tensor w, bool accumulate) {
  const int64_t M = rows(x), K = x.size(-1), N = w.size(0);
  gemm_mixed(false, true, M, N, K, {x.raw(), x.dtype()}, {w.raw(), w.dtype()}, accumulate, out.raw(), out.dtype(),
             TokenDim::kRows);
}

void linear_backward_16bit(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  const int64_t M = rows(dout), N = dout.size(-1), K = w.size(1);
  GemmOperand d{dout.raw(), dout.dtype()};
  // A 16-bit dout read by both products is widened once when they compute in fp32.
  if (dx.defined() && dw.defined() && dout.dtype() != DType::F32 && gemm16_computes_in_f32(dout.dtype())) {
    d = {gemm16_widen_shared(d, M * N), DType::F32};
  }
  if (dx.defined()) {
    gemm_mixed(false, false, M, K, N, d, {w.raw(), w.dtype()}, accumulate_dx, dx.raw(), dx.dtype(), TokenDim::kRows);
  }
  if (dw.defined()) gemm_mixed(true, false, N, K, M, d, {x.raw(), x.dtype()}, true, dw.raw(), dw.dtype(), TokenDim::kSum);
}

// The fused 16-bit linear kernels replace the generic widening ones in both 16-bit slots.
void fill_gemm_16bit(OpTable& t) {
  for (KernelDType k : {KernelDType::BF16, KernelDType::F16}) {
    t.linear_forward[size_t(k)] = &linear_forward_16bit;
    t.linear_backward[size_t(k)] = &linear_backward_16bit;
  }
}

}  // namespace dstrain::cpu
