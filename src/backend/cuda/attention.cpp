// attention_forward/backward on the GPU: the CPU kernel's argument checks, then the tiled
// online-softmax kernels of attention.cu. One wrapper per op serves all three slots: each
// floating-point tensor may be fp32 or the slot's 16-bit type. With 16-bit q, k and v (and
// dout) the products run on tensor cores, probabilities and dS rounded to 16 bits as their
// inputs; otherwise all math is fp32.
#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/cuda_ops.h"
#include "core/buffer.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// The layout checks of the CPU kernel (backend/cpu/attention_common.h), and the head dims the
// CUDA kernels take.
attn::Dims dims_of(const Tensor& qkv, const ops::AttentionLayout& L) {
  DS_CHECK(qkv.ndim() == 3, "attention: qkv must be (B, T, W), got {}", qkv.shape().str());
  DS_CHECK(L.n_head > 0 && L.n_kv_head > 0 && L.n_head % L.n_kv_head == 0,
           "attention: {} query heads cannot share {} kv heads evenly", L.n_head, L.n_kv_head);
  attn::Dims d;
  d.B = qkv.size(0);
  d.T = qkv.size(1);
  d.W = qkv.size(2);
  d.H = L.n_head;
  d.Hkv = L.n_kv_head;
  d.Dqk = L.qk_dim;
  d.Dv = L.v_dim;
  d.q_offset = L.q_offset;
  d.k_offset = L.k_offset;
  d.v_offset = L.v_offset;
  DS_CHECK(L.row_stride == d.W, "attention: layout row stride {} but qkv rows have {}", L.row_stride, d.W);
  DS_CHECK(L.q_offset + d.H * d.Dqk <= d.W && L.k_offset + d.Hkv * d.Dqk <= d.W && L.v_offset + d.Hkv * d.Dv <= d.W,
           "attention: head ranges exceed the qkv row of {}", d.W);
  DS_CHECK(d.Dqk >= 1 && d.Dqk <= attn::kMaxHeadDim && d.Dv >= 1 && d.Dv <= attn::kMaxHeadDim,
           "attention: the CUDA kernels take head dims 1..{}, got qk {} and v {}", attn::kMaxHeadDim, d.Dqk, d.Dv);
  DS_CHECK(L.q_offset >= 0 && L.k_offset >= 0 && L.v_offset >= 0, "attention: negative column offsets {}, {}, {}",
           L.q_offset, L.k_offset, L.v_offset);
  DS_CHECK(d.T <= (int64_t(1) << 30) && d.B <= 65535 && d.H <= 65535,
           "attention: (B, T) = ({}, {}) with {} heads is beyond the CUDA kernels' grid", d.B, d.T, d.H);
  return d;
}

attn::Ptr in(const Tensor& t, const char* op, const char* what) {
  check_on_gpu(t, op, what);
  return {t.raw(), elem_of(t, what)};
}
attn::MutPtr inout(const Tensor& t, const char* op, const char* what) {
  check_on_gpu(t, op, what);
  return {t.raw(), elem_of(t, what)};
}

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale) {
  const attn::Dims d = dims_of(qkv, L);
  DS_CHECK(out.numel() == d.B * d.T * d.H * d.Dv && lse.numel() == d.B * d.H * d.T,
           "attention_forward: out {} lse {}", out.shape().str(), lse.shape().str());
  const attn::MutPtr o = inout(out, "attention_forward", "out"), l = inout(lse, "attention_forward", "lse");
  const attn::Ptr x = in(qkv, "attention_forward", "qkv");
  DS_CHECK(attn::forward(o, l, x, d, scale),
           "attention_forward: no tile size of the CUDA kernel fits this GPU's shared memory (qk {}, v {})", d.Dqk,
           d.Dv);
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const ops::AttentionLayout& L,
                        float scale) {
  const attn::Dims d = dims_of(qkv, L);
  DS_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel() && out.numel() == d.B * d.T * d.H * d.Dv,
           "attention_backward: shape mismatch");
  DS_CHECK(lse.numel() == d.B * d.H * d.T, "attention_backward: lse {} for (B, n_head, T) = ({}, {}, {})",
           lse.shape().str(), d.B, d.H, d.T);
  const char* op = "attention_backward";
  const attn::MutPtr dx = inout(dqkv, op, "dqkv");
  const attn::Ptr dy = in(dout, op, "dout"), x = in(qkv, op, "qkv"), y = in(out, op, "out"), l = in(lse, op, "lse");
  const int64_t n = attn::backward_workspace(d);
  Buffer delta;
  if (n > 0) delta = Buffer("attention delta", MemCategory::Workspace, DType::F32, n, qkv.device());
  DS_CHECK(attn::backward(dx, dy, x, y, l, static_cast<float*>(delta.data()), d, scale),
           "attention_backward: no tile size of the CUDA kernels fits this GPU's shared memory (qk {}, v {})", d.Dqk,
           d.Dv);
}

}  // namespace

void fill_attention(ops::OpTable& t) {
  for (int k = 0; k < kKernelDTypes; ++k) {
    t.attention_forward[k] = attention_forward;
    t.attention_backward[k] = attention_backward;
  }
}

}  // namespace dstrain::cuda
