// The ops dstrain's models are built from: explicit forward and backward, one signature per
// op for every device. Each call dispatches on the device of its tensors to the CPU
// implementation (kernels/cpu/) or the CUDA one (kernels/cuda/). The CPU fp32 versions are
// the reference every other path is tested against.
//
// Conventions: tensors are contiguous row-major fp32 unless noted; "(+=)" marks outputs
// that are accumulated into (gradients), all others are overwritten.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace dstrain::ops {

constexpr int32_t kIgnoreIndex = -100;  // target id that contributes no loss (Hugging Face's)

// ---- dense layers -------------------------------------------------------------------
// out (M,N) = x (M,K) · w (N,K)^T, added to out when accumulate.
void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate = false);
// dx (M,K) = dout (M,N) · w (N,K) (added to dx when accumulate_dx); dw (N,K) (+=) dout^T · x.
// Pass an undefined Tensor to skip dx or dw.
void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx = false);

// ---- embedding ----------------------------------------------------------------------
// out (N,C) = table (V,C)[tokens (N, int32)]; an id outside [0, V) is an error.
void embedding_forward(Tensor out, Tensor tokens, Tensor table);
// dtable (V,C) (+=) scatter of dout (N,C) by tokens.
void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens);

// ---- RMSNorm (Hugging Face LlamaRMSNorm) ---------------------------------------------
// out (N,C) = weight (C) * x * rstd, rstd (N) = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps);
// dx (N,C) (+=), dweight (C) (+=) from dout (N,C).
void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd);

// ---- rotary position embedding (Hugging Face rotate_half convention) ----------------
// Tables (T, head_dim/2) for positions 0..T-1, computed in fp32 exactly as Hugging Face does.
void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta);
// x (B,T,W): rotates n_heads consecutive heads of head_dim starting at each row's column
// `offset`, in place. The backward applies the inverse rotation to the gradient in place.
void rope_forward(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin);
void rope_backward(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin);

// DeepSeek-V2/V3 rotary embedding of dimension `dim`: YaRN-scaled frequencies and the
// mscale factor (DeepseekV2YarnRotaryEmbedding), tables (T, dim/2) in fp32 as Hugging Face
// computes them; with factor 1 (no rope_scaling) the plain frequencies.
struct YarnParams {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all_dim = 0;
};
void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double theta, const YarnParams& yarn);
// DeepSeek's pairing: each head's dim values are read as interleaved pairs (x0,x1),(x2,x3),...
// and written de-interleaved, [rotated evens | rotated odds], as apply_rotary_pos_emb of
// modeling_deepseek does. x (B,T,W): n_heads heads of `dim` at column `offset` with a stride
// of `head_stride` columns between heads. The backward maps gradients back to the
// interleaved input layout.
void rope_forward_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                              Tensor sin);
void rope_backward_interleaved(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                               Tensor sin);

// ---- causal self-attention with grouped-query heads ---------------------------------
// q, k and v are column ranges of one fused activation qkv (B,T,row_stride): head h of q at
// q_offset + h*qk_dim, kv head g of k at k_offset + g*qk_dim and of v at v_offset + g*v_dim.
// Query head h reads kv head h / (n_head / n_kv_head).
struct AttentionLayout {
  int n_head = 0;
  int n_kv_head = 0;
  int qk_dim = 0;
  int v_dim = 0;
  int64_t q_offset = 0, k_offset = 0, v_offset = 0, row_stride = 0;
};
// out (B,T,n_head*v_dim), lse (B,n_head,T) = log-sum-exp of each softmax row (kept for the
// backward, which recomputes probabilities instead of storing a T x T matrix).
void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionLayout& layout, float scale);
// dqkv (B,T,row_stride): the q, k and v column ranges are overwritten.
void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const AttentionLayout& layout,
                        float scale);

// ---- SwiGLU ------------------------------------------------------------------------
// gate_up (N,2I) holds [gate | up] per row; out (N,I) = silu(gate) * up.
void swiglu_forward(Tensor out, Tensor gate_up);
// dgate_up (N,2I) from dout (N,I).
void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up);

// ---- cross-entropy -------------------------------------------------------------------
// losses (N) = logsumexp(logits) - logits[target]; lse (N) kept for the backward.
// Rows whose target is kIgnoreIndex get loss 0. A target outside [0, V) is an error.
void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets);
// dlogits (N,V) = scale * (softmax(logits) - onehot(target)); zero rows for ignored targets.
// dlogits may be the same memory as logits.
void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale);

// ---- elementwise and reductions -----------------------------------------------------
void add(Tensor out, Tensor a, Tensor b);  // out = a + b; out may alias a or b
void add_inplace(Tensor out, Tensor a);    // out += a
void scale_inplace(Tensor x, float s);
void fill(Tensor x, float value);
void copy(Tensor dst, Tensor src);
// Sum of squares in double, summed in a fixed order independent of the thread count.
double sum_squares(Tensor x);

// ---- optimizer -----------------------------------------------------------------------
struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
};
// torch.optim.AdamW: decoupled decay, bias-corrected moments; all tensors of one shape.
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const AdamWStep& s);

}  // namespace dstrain::ops
