// attention_forward/backward on the GPU: the tiled online-softmax kernels of attention.cu, on
// arguments the ops:: wrapper has checked (backend/checks.cpp). One wrapper per op serves all three slots: each
// floating-point tensor may be fp32 or the slot's 16-bit type. With 16-bit q, k and v (and
// dout) the products run on tensor cores, probabilities and dS rounded to 16 bits as their
// inputs; otherwise all math is fp32.
#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/cuda_ops.h"
#include "core/buffer.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// The kernels' dimensions from a layout the ops:: wrapper has checked (backend/checks.cpp), and
// the limits of the CUDA kernels themselves: their head dims and grid.
attn::Dims dims_of(const Tensor& qkv, const ops::AttentionLayout& L) {
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
  DS_CHECK(d.Dqk >= 1 && d.Dqk <= attn::kMaxHeadDim && d.Dv >= 1 && d.Dv <= attn::kMaxHeadDim,
           "attention: the CUDA kernels take head dims 1..{}, got qk {} and v {}", attn::kMaxHeadDim, d.Dqk, d.Dv);
  DS_CHECK(d.T <= (int64_t(1) << 30) && d.B <= 65535 && d.H <= 65535,
           "attention: (B, T) = ({}, {}) with {} heads is beyond the CUDA kernels' grid", d.B, d.T, d.H);
  return d;
}

attn::Ptr in(const Tensor& t, const char* what) { return {t.raw(), elem_of(t, what)}; }
attn::MutPtr inout(const Tensor& t, const char* what) { return {t.raw(), elem_of(t, what)}; }

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale) {
  const attn::Dims d = dims_of(qkv, L);
  const attn::MutPtr o = inout(out, "out"), l = inout(lse, "lse");
  const attn::Ptr x = in(qkv, "qkv");
  DS_CHECK(attn::forward(o, l, x, d, scale),
           "attention_forward: no tile size of the CUDA kernel fits this GPU's shared memory (qk {}, v {})", d.Dqk,
           d.Dv);
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const ops::AttentionLayout& L,
                        float scale) {
  const attn::Dims d = dims_of(qkv, L);
  const attn::MutPtr dx = inout(dqkv, "dqkv");
  const attn::Ptr dy = in(dout, "dout"), x = in(qkv, "qkv"), y = in(out, "out"), l = in(lse, "lse");
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
