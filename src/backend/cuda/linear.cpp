// Dense layers of the CUDA backend through cuBLASLt (backend/cpu/linear.cpp is the reference).
// Weights are stored (out_features, in_features) as in Hugging Face checkpoints. cuBLASLt is
// column-major: a row-major (r, c) matrix is its column-major transpose, so C = op(A)·op(B)
// runs as C^T = op(B)^T·op(A)^T with the operands swapped.
//
// Precision: CUBLAS_COMPUTE_32F always (fp32 accumulation, never TF32, so the fp32 slot matches
// the CPU's sgemm to rounding). The operand types cuBLASLt takes with it are A = B in F32, BF16
// or F16 and C = D either fp32 or A's type, which covers the usual mixes of the 16-bit slots
// (16-bit x and w into a 16-bit or fp32 out; 16-bit dout into a 16-bit or fp32 dx and the fp32
// master dw). For the other mixes:
// - one input fp32 and the other 16-bit (an fp32 residual gradient dout against a bf16 w): the
//   fp32 input is rounded to the 16-bit type into scratch first (the product is a 16-bit product
//   with fp32 accumulation, as on tensor cores anyway; the CPU's oneDNN bf16 path rounds the
//   same way). linear_backward rounds such a dout once for both of its products.
// - an output whose type is neither fp32 nor the inputs' (fp32 inputs into a 16-bit out): the
//   product goes to an fp32 scratch (read from the output first when accumulating) and is
//   rounded once into the output.
// A product for which cuBLASLt offers no algorithm (odd shapes or alignments of 16-bit
// operands, in principle) runs on a plain kernel (linear.cu) instead, with a warning once.
#include <cublasLt.h>

#include <array>
#include <map>
#include <mutex>
#include <tuple>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/elementwise_kernels.h"
#include "backend/cuda/linear_kernels.h"
#include "core/buffer.h"
#include "core/error.h"
#include "core/log.h"

#define DS_CUBLAS_CHECK(call)                                                                       \
  do {                                                                                              \
    const cublasStatus_t ds_cublas_st_ = (call);                                                    \
    if (ds_cublas_st_ != CUBLAS_STATUS_SUCCESS) {                                                   \
      DS_FAIL("{} failed: {} ({})", #call, cublasLtGetStatusName(ds_cublas_st_),                    \
              cublasLtGetStatusString(ds_cublas_st_));                                              \
    }                                                                                               \
  } while (0)

namespace dstrain::cuda {
namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // what cuBLASLt asks for on Hopper

bool is16(Elem e) { return e != Elem::F32; }
cudaDataType_t cuda_type(Elem e) {
  switch (e) {
    case Elem::BF16: return CUDA_R_16BF;
    case Elem::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}
DType dtype_of(Elem e) {
  switch (e) {
    case Elem::BF16: return DType::BF16;
    case Elem::F16: return DType::F16;
    default: return DType::F32;
  }
}
size_t elem_size(Elem e) { return e == Elem::F32 ? 4 : 2; }

// The largest power of two (up to 256) that divides the address: cuBLASLt's heuristic must
// know it to pick only algorithms that can read the operand.
uint32_t alignment(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && a % al != 0) al >>= 1;
  return al;
}

// One column-major product's shape, types and alignments: the key of its cached plan.
struct PlanKey {
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  Elem ea, eb, ec;
  uint32_t align_a, align_b, align_c;
  auto tie() const { return std::tie(ta, tb, m, n, k, lda, ldb, ldc, ea, eb, ec, align_a, align_b, align_c); }
  bool operator<(const PlanKey& o) const { return tie() < o.tie(); }
};

// The descriptors and the heuristic's algorithm of one product; kept for the process.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;
};

// cuBLASLt's state on one GPU: a handle, a workspace and the plans of the products seen so far.
struct LtDevice {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  std::map<PlanKey, Plan> plans;
};

std::mutex lt_mutex;

LtDevice& lt_device() {
  static std::array<LtDevice, 64> devices;
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CHECK(dev >= 0 && dev < 64, "CUDA device index {} out of range", dev);
  LtDevice& d = devices[size_t(dev)];
  if (!d.handle) {
    DS_CUBLAS_CHECK(cublasLtCreate(&d.handle));
    DS_CUDA_CHECK(cudaMalloc(&d.workspace, kWorkspaceBytes));
  }
  return d;
}

Plan make_plan(cublasLtHandle_t handle, const PlanKey& k) {
  Plan p;
  DS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t ta = k.ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb = k.tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
  DS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
  // Layouts describe the operands as stored: op(A) (m,k) is A (k,m) when transposed.
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, cuda_type(k.ea), uint64_t(k.ta ? k.k : k.m),
                                             uint64_t(k.ta ? k.m : k.k), k.lda));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, cuda_type(k.eb), uint64_t(k.tb ? k.n : k.k),
                                             uint64_t(k.tb ? k.k : k.n), k.ldb));
  DS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(k.ec), uint64_t(k.m), uint64_t(k.n), k.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &k.align_a,
                                                       sizeof(k.align_a)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &k.align_b,
                                                       sizeof(k.align_b)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &k.align_c,
                                                       sizeof(k.align_c)));
  DS_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &k.align_c,
                                                       sizeof(k.align_c)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    p.algo = result.algo;
    p.has_algo = true;
  } else if (st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_SUCCESS) {
    DS_CUBLAS_CHECK(st);
  }
  return p;
}

// Column-major C (m,n) = op(A)·op(B) (+ C when accumulate) through cuBLASLt, C and D the same
// memory. False when cuBLASLt has no algorithm for it.
bool lt_matmul(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const void* a, Elem ea, int64_t lda, const void* b,
               Elem eb, int64_t ldb, void* c, Elem ec, int64_t ldc, bool accumulate) {
  std::lock_guard lock(lt_mutex);
  LtDevice& d = lt_device();
  const PlanKey key{ta, tb, m, n, k, lda, ldb, ldc, ea, eb, ec, alignment(a), alignment(b), alignment(c)};
  auto it = d.plans.find(key);
  if (it == d.plans.end()) it = d.plans.emplace(key, make_plan(d.handle, key)).first;
  const Plan& p = it->second;
  if (!p.has_algo) return false;
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  DS_CUBLAS_CHECK(cublasLtMatmul(d.handle, p.desc, &alpha, a, p.a, b, p.b, &beta, c, p.c, c, p.c, &p.algo,
                                 d.workspace, kWorkspaceBytes, stream()));
  return true;
}

struct Operand {
  const void* data;
  Elem elem;
};

// Row-major C (m,n) = op(A) (m,k) · op(B) (k,n) (+= when accumulate), as cpu::gemm_mixed: op(A)
// = A^T when ta (A stored (k,m)), likewise B (stored (n,k) when tb). A and B are of one type here
// (see run_gemm).
void product(bool ta, bool tb, int64_t m, int64_t n, int64_t k, Operand a, Operand b, bool accumulate, void* c,
             Elem ec) {
  // C^T (n,m) = op(B)^T · op(A)^T in column-major terms: B's buffer is the first operand.
  if (lt_matmul(tb, ta, n, m, k, b.data, b.elem, tb ? k : n, a.data, a.elem, ta ? m : k, c, ec, n, accumulate)) {
    return;
  }
  static std::once_flag warned;
  std::call_once(warned, [&] {
    log::warn("cuda backend: cuBLASLt has no algorithm for a {}x{}x{} product of {} inputs into {}; a plain kernel "
              "computes such products (slowly)", m, n, k, dtype_name(dtype_of(a.elem)), dtype_name(dtype_of(ec)));
  });
  launch_gemm_fallback(ta, tb, m, n, k, a.data, a.elem, b.data, b.elem, c, ec, accumulate);
}

// An operand rounded to `to` in scratch (a Buffer that lives as long as `keep`).
Operand rounded(Operand op, int64_t numel, Elem to, Device device, Buffer& keep) {
  keep = Buffer("linear 16-bit operand", MemCategory::Workspace, dtype_of(to), numel, device);
  launch_cast(keep.data(), to, op.data, op.elem, numel);
  return {keep.data(), to};
}

// Any mix of F32 and 16-bit operands and output (see the top of the file).
void run_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, Operand a, Operand b, bool accumulate, void* c,
              Elem ec, Device device) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // an empty sum
    if (!accumulate) DS_CUDA_CHECK(cudaMemsetAsync(c, 0, size_t(m * n) * elem_size(ec), stream()));
    return;
  }
  const Elem in = is16(a.elem) ? a.elem : is16(b.elem) ? b.elem : Elem::F32;
  Buffer a_scratch, b_scratch;
  if (a.elem != in) a = rounded(a, m * k, in, device, a_scratch);
  if (b.elem != in) b = rounded(b, k * n, in, device, b_scratch);
  if (ec == Elem::F32 || ec == in) {
    product(ta, tb, m, n, k, a, b, accumulate, c, ec);
    return;
  }
  Buffer wide("linear fp32 output", MemCategory::Workspace, DType::F32, m * n, device);
  if (accumulate) launch_cast(wide.data(), Elem::F32, c, ec, m * n);
  product(ta, tb, m, n, k, a, b, accumulate, wide.data(), Elem::F32);
  launch_cast(c, ec, wide.data(), Elem::F32, m * n);
}

int64_t rows(const Tensor& t) { return t.numel() / t.size(-1); }
Operand operand(const Tensor& t, const char* what) { return {t.raw(), elem_of(t, what)}; }

// out (M,N) = x (M,K) · w (N,K)^T (+= when accumulate).
void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate) {
  const int64_t M = rows(x), K = x.size(-1), N = w.size(0);
  run_gemm(false, true, M, N, K, operand(x, "linear_forward: x"), operand(w, "linear_forward: w"), accumulate,
           out.raw(), elem_of(out, "linear_forward: out"), out.device());
}

// dx (M,K) = dout (M,N) · w (N,K) (+= when accumulate_dx); dw (N,K) += dout^T · x (M,K).
void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  const int64_t M = rows(dout), N = dout.size(-1), K = w.size(1);
  Operand d = operand(dout, "linear_backward: dout");
  const Operand wo = operand(w, "linear_backward: w"), xo = operand(x, "linear_backward: x");
  // An fp32 dout against 16-bit w and x is rounded once for both products.
  Buffer d_scratch;
  if (dx.defined() && dw.defined() && d.elem == Elem::F32 && is16(wo.elem) && wo.elem == xo.elem) {
    d = rounded(d, M * N, wo.elem, dout.device(), d_scratch);
  }
  if (dx.defined()) {
    run_gemm(false, false, M, K, N, d, wo, accumulate_dx, dx.raw(), elem_of(dx, "linear_backward: dx"),
             dout.device());
  }
  if (dw.defined()) {
    run_gemm(true, false, N, K, M, d, xo, true, dw.raw(), elem_of(dw, "linear_backward: dw"), dout.device());
  }
}

}  // namespace

void fill_linear(ops::OpTable& t) {
  for (KernelDType k : {KernelDType::F32, KernelDType::BF16, KernelDType::F16}) {
    t.linear_forward[size_t(k)] = &linear_forward;
    t.linear_backward[size_t(k)] = &linear_backward;
  }
}

}  // namespace dstrain::cuda
