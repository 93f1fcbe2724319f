// The ops dstrain's models are built from: explicit forward and backward, one signature per
// op for every device. Each call dispatches on the device of its tensors to the CPU
// implementation (backend/cpu/) or the CUDA one (kernels/cuda/). The CPU fp32 versions are
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
// How many elements are NaN or Inf (fp32).
int64_t count_non_finite(Tensor x);

// ---- optimizer -----------------------------------------------------------------------
struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
};
// torch.optim.AdamW: decoupled decay, bias-corrected moments; all tensors of one shape.
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const AdamWStep& s);

// ---- mixture of experts ----------------------------------------------------------------
// DeepSeekMoE routing and token permutation (modeling_deepseek.py's MoEGate and moe_infer),
// split so that expert parallelism can later put an all-to-all between the permutation and
// the expert GEMMs:
//   scores  = moe_scores(x · gate^T)                    (N,E)   router probabilities
//   ids, w  = moe_route(scores, bias)                    (N,k)   top-k experts and weights
//   plan    = moe_dispatch_plan(ids)                     per-expert row ranges
//   xg      = moe_permute(x, plan)                       (N*k,C) rows grouped by expert
//   [all-to-all of xg by expert owner would go here]
//   yg[e]   = expert_e(xg[e])                            one GEMM per expert
//   out    += moe_unpermute(yg, w, plan)                 weighted combine per token
// N tokens, E routed experts, k = num_experts_per_tok, M = N*k dispatched rows.
enum class MoEScoring { Softmax, Sigmoid };
// greedy: top-k of the scores. group_limited_greedy (V2): keep the topk_group groups with the
// largest max score. noaux_tc (V3): choose on scores + bias, groups ranked by the sum of
// their two largest, weights from the unbiased scores.
enum class MoETopK { Greedy, GroupLimitedGreedy, NoAuxTC };
struct MoERouteParams {
  MoETopK method = MoETopK::Greedy;
  int top_k = 1;
  int n_group = 1, topk_group = 1;  // E splits into n_group contiguous groups
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
};

// scores (N,E) = softmax or sigmoid of logits (N,E), per row, in fp32; may alias logits.
void moe_scores(Tensor scores, Tensor logits, MoEScoring scoring);
// dlogits (N,E) from dscores (N,E) and the forward's scores; dlogits may alias dscores.
void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, MoEScoring scoring);

// ids (N,k) int32: the chosen experts of each token, best first, ties to the lower index.
// weights (N,k): the chosen (unbiased) scores, normalised when k > 1 and norm_topk_prob, and
// scaled by routed_scaling_factor when not normalised (V2) or always (noaux_tc, V3).
// bias (E) is e_score_correction_bias for noaux_tc; pass an undefined Tensor otherwise.
void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const MoERouteParams& p);
// dscores (N,E) = d(weights)/d(scores)^T · dweights (N,k): zero outside each token's chosen
// experts (selection is piecewise constant). Overwritten.
void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const MoERouteParams& p);

// Load-balancing loss over G groups of N/G consecutive tokens (G = B sequences for seq_aux,
// G = 1 for the micro-batch-wise loss):
//   aux = sum_g sum_e ce[g,e] * P[g,e],  ce = count of e among the group's ids / (Tg*k/E),
//   P = mean over the group's tokens of the affinities a[t, e].
// Softmax: a = scores (they sum to 1 already). Sigmoid: a[t,e] = scores[t,e] / sum_j
// scores[t,j], the normalised affinities of DeepSeek-V3's sequence-wise balance loss
// (technical report, eqs. 18-20; Megatron-Core's compute_routing_scores_for_aux_loss).
// Returns aux (double, summed in a fixed order); coef (G,E) = ce[g,e] / Tg, kept for the
// backward (ce is a constant: no gradient through the choice).
double moe_aux_loss(Tensor coef, Tensor scores, Tensor ids, MoEScoring scoring);
// dscores (N,E) += scale * d aux / d scores, from coef (G,E) and the forward's scores (N,E):
// softmax: coef[g]; sigmoid: (coef[g,i] - sum_e coef[g,e] a[t,e]) / sum_j scores[t,j].
void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, MoEScoring scoring, float scale);

// Groups the M = N*k (token, slot) pairs by expert, stably (token order, then slot order):
// offsets (E+1) int64: expert e owns grouped rows [offsets[e], offsets[e+1]);
// sorted (M) int32: grouped row p came from pair sorted[p] = n*k + slot;
// position (M) int32: the inverse, pair n*k + slot sits at grouped row position[n*k+slot].
void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids);
// xg (M,C): xg[p] = x (N,C) [sorted[p] / k].
void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k);
// dx (N,C) = sum over slots, in slot order, of dxg (M,C) [position[n*k+slot]]; added to dx
// when accumulate.
void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool accumulate);
// out (N,C) (+=) sum over slots, in slot order, of weights[n,slot] * yg (M,C) [position[n*k+slot]].
void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position);
// With pair = sorted[p] = n*k + slot: dyg (M,C) [p] = weights[pair] * dout (N,C) [n] and
// dweights (N,k) [pair] = <dout[n], yg[p]>. Both overwritten.
void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted);

}  // namespace dstrain::ops
