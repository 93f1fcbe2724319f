// Multi-head Latent Attention of DeepSeek-V2/V3 (DeepseekV2Attention of modeling_deepseek)
// as an AttentionBlock, with an explicit forward and backward.
#pragma once

#include "model/transformer.h"

namespace dstrain {

// Per token, with H heads, Dn = qk_nope_head_dim, Dr = qk_rope_head_dim, Dv = v_head_dim:
//   q   = q_proj(x)  or  q_b_proj(rmsnorm(q_a_proj(x)))          (H, Dn + Dr)
//   [c | k_pe] = kv_a_proj_with_mqa(x)                           (kv_lora_rank), (Dr)
//   [k_nope | v] = kv_b_proj(rmsnorm(c))                         (H, Dn + Dv)
//   rope (interleaved, YaRN tables) on each head's q_pe and on the one shared k_pe
//   out += o_proj(causal softmax(scale * q.[k_nope | k_pe]) v)
// The attention runs on one fused row per token, [q (H, Dn+Dr) | k (H, Dn+Dr) | v (H, Dv)],
// with k_pe copied into every head's key, so the GQA attention kernels serve it unchanged.
//
// Tensor parallelism (as Megatron-Core's MLA): the heads are split, so q_proj / q_b_proj and
// kv_b_proj are column-parallel (this rank's heads' rows) and o_proj row-parallel (their
// columns; the output summed over the tensor group, reduce-scattered into this rank's rows with
// sequence parallelism). q_a_proj, q_a_layernorm, kv_a_proj_with_mqa and kv_a_layernorm are
// replicated and computed by every rank from all rows; as only this rank's heads' gradients
// flow back into them (and into the shared k_pe), their gradients are partial sums over the
// tensor group (ParamInfo::tp_partial_grad), as is the input gradient, which the backward sums.
class MLAttention final : public AttentionBlock {
 public:
  // Sized from the shard's heads (shard.heads of num_attention_heads).
  MLAttention(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer);
  // x (B,T,C) normalised input, all the micro-batch's rows; out (B,T,C), or this rank's rows
  // (n,C) with sequence parallelism, is added to. ctx.rope must hold YaRN tables of dim
  // qk_rope_head_dim for at least T positions (RopeCache::ensure of a deepseek_v2/v3 config).
  void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) override;
  // x: the forward's input again; dout -> dx (overwritten), both for the rows of out; every
  // parameter gradient is accumulated.
  void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) override;

 private:
  // Elements of the buffer that stages the projections: the attention output's (B*T rows), or
  // at least one row of the widest projection, for a lone token.
  int64_t stage_numel(int64_t N) const;
  // The up-projections into the fused rows (N, W): [k_nope | v] of every head from kv_b_proj of
  // the kept normed kv latent, q from q_b_proj of the kept normed query latent (or q_proj of
  // xs (N, C)), each staged through `stage` (stage_numel(N) values) a chunk of rows at a time.
  // k_pe and the rope are left to the caller.
  void up_project(const Ctx& ctx, int mb, Tensor xs, Tensor rows, Tensor stage) const;
  // The forward's post-rope q|k|v (B,T,W) of micro-batch mb: the stored one, or with
  // Ctx::recompute_mla_up_proj formed again in scratch by the forward's ops in its order (the
  // same chunks of rows), from the kept latents, k_pe and x, so the values are the same bits.
  Tensor form_heads(const Ctx& ctx, int mb, Tensor x) const;

  ParamRegistry& reg_;
  std::string key_;  // "layers.{layer}.attn."
  // key_ + the names below, interned when the block is built.
  ActKey qkv_key_, out_key_, lse_key_, k_pe_key_, kv_latent_key_, kv_latent_norm_key_, kv_latent_rstd_key_;
  ActKey q_latent_key_, q_latent_norm_key_, q_latent_rstd_key_;
  ActKey qkv_slot_ = act_key("mla.qkv"), dheads_slot_ = act_key("mla.dheads"), dqkv_slot_ = act_key("mla.dqkv");
  ActKey dlatent_slot_ = act_key("mla.dlatent"), dlatent_norm_slot_ = act_key("mla.dlatent_norm");
  ActKey dk_pe_slot_ = act_key("mla.dk_pe");
  RowParallelSlots partial_{"attn.partial"};
  BlockGradSlots grad_slots_;
  int64_t H_, Dn_, Dr_, Dv_, q_rank_, kv_rank_;
  float eps_, scale_;
  bool sharded_;  // heads split over a tensor group of more than one rank
  ops::AttentionLayout layout_;
  // Parameter ids; q_ is q_proj without a query LoRA, otherwise q_a_/q_norm_/q_b_ are used.
  int q_ = -1, q_a_ = -1, q_norm_ = -1, q_b_ = -1, kv_a_ = -1, kv_norm_ = -1, kv_b_ = -1, o_ = -1;
  // Stored per micro-batch (keys after key_), for all N = B*T rows and this rank's H heads, in
  // the compute dtype but for the rstd and lse (fp32):
  //   q_latent, q_latent_norm, q_latent_rstd   (N,q_lora_rank) x2, (N); only with a query LoRA
  //   kv_latent, kv_latent_norm, kv_latent_rstd  (N,kv_lora_rank) x2, (N)
  //   qkv                                     (B,T,H*(2*(Dn+Dr)+Dv)) post-rope; with selective
  //                                           recomputation "mla_up_proj" in scratch instead,
  //   k_pe                                    and kept (N,Dr) pre-rope, to form it again
  //   out, lse                                (B,T,H*Dv) (at least one row of the widest
  //                                           projection: it stages them), (B,H,T)
};

}  // namespace dstrain
