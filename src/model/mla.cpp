// Multi-head Latent Attention: the projections and latent norms around the shared causal
// attention kernels, with the copies that build their fused q|k|v rows and the transposes
// of those copies in the backward.
#include "model/mla.h"

#include <algorithm>

namespace dstrain {
namespace {

Tensor rows_of(Tensor t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }

// out = in (N,K) · w (M,K)^T computed `stage.numel() / M` rows at a time into `stage` (1-D), each
// chunk (n, M) handed to scatter(first_row, chunk). The forward has no scratch of its own:
// the projections that only feed the fused q|k|v rows are staged through a buffer that is
// still free at that point instead of being kept per layer.
template <class Scatter>
void staged_linear(Tensor in, Tensor w, Tensor stage, Scatter&& scatter) {
  const int64_t N = in.size(0), M = w.size(0);
  const int64_t chunk = std::min(N, stage.numel() / M);
  DS_CHECK(chunk > 0, "MLA: a staging buffer of {} values cannot hold one row of {}", stage.numel(), M);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    Tensor out = stage.slice(0, n * M).view({n, M});
    ops::linear_forward(out, in.slice(r0, r0 + n), w);
    scatter(r0, out);
  }
}

}  // namespace

MLAttention::MLAttention(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer)
    : reg_(reg),
      key_(fmt::format("layers.{}.attn.", layer)),
      H_(shard.heads.size()),
      Dn_(c.qk_nope_head_dim),
      Dr_(c.qk_rope_head_dim),
      Dv_(c.v_head_dim),
      q_rank_(c.q_lora_rank),
      kv_rank_(c.kv_lora_rank),
      eps_(float(c.rms_norm_eps)),
      scale_(float(c.softmax_scale())),
      sharded_(shard.tp_size > 1) {
  auto key = [&](const char* name) { return act_key(key_ + name); };
  qkv_key_ = key("qkv"), out_key_ = key("out"), lse_key_ = key("lse"), k_pe_key_ = key("k_pe");
  kv_latent_key_ = key("kv_latent"), kv_latent_norm_key_ = key("kv_latent_norm"),
  kv_latent_rstd_key_ = key("kv_latent_rstd");
  q_latent_key_ = key("q_latent"), q_latent_norm_key_ = key("q_latent_norm"), q_latent_rstd_key_ = key("q_latent_rstd");
  DS_CHECK(c.mla(), "MLAttention needs a deepseek_v2/v3 config, got model_type '{}'", c.model_type);
  DS_CHECK(H_ > 0 && Dr_ > 0 && Dr_ % 2 == 0 && Dn_ >= 0 && Dv_ > 0 && kv_rank_ > 0 && q_rank_ >= 0,
           "MLAttention: heads {}, qk_nope {}, qk_rope {} (must be even), v_head {}, kv_lora_rank {}, q_lora_rank {}",
           H_, Dn_, Dr_, Dv_, kv_rank_, q_rank_);
  const int64_t C = c.hidden_size, Dqk = Dn_ + Dr_, Hg = c.num_attention_heads;
  // The down-projections and latent norms are replicated; split by heads, a rank's gradient of
  // them is its heads' share only.
  ParamOptions latent;
  latent.tp_partial_grad = sharded_;
  // Registered in the module order of modeling_deepseek's DeepseekV2Attention.
  if (q_rank_ == 0) {
    q_ = add_tp_piece(reg, layer_name(layer, "self_attn.q_proj.weight"), {H_ * Dqk, C}, {Hg * Dqk, C}, 0, shard, layer);
  } else {
    q_a_ = reg.add(layer_name(layer, "self_attn.q_a_proj.weight"), {q_rank_, C}, ParamKind::Linear, layer, latent);
    q_norm_ = reg.add(layer_name(layer, "self_attn.q_a_layernorm.weight"), {q_rank_}, ParamKind::Norm, layer, latent);
    q_b_ = add_tp_piece(reg, layer_name(layer, "self_attn.q_b_proj.weight"), {H_ * Dqk, q_rank_}, {Hg * Dqk, q_rank_},
                        0, shard, layer);
  }
  kv_a_ = reg.add(layer_name(layer, "self_attn.kv_a_proj_with_mqa.weight"), {kv_rank_ + Dr_, C}, ParamKind::Linear,
                  layer, latent);
  kv_norm_ = reg.add(layer_name(layer, "self_attn.kv_a_layernorm.weight"), {kv_rank_}, ParamKind::Norm, layer, latent);
  kv_b_ = add_tp_piece(reg, layer_name(layer, "self_attn.kv_b_proj.weight"), {H_ * (Dn_ + Dv_), kv_rank_},
                       {Hg * (Dn_ + Dv_), kv_rank_}, 0, shard, layer);
  o_ = add_tp_piece(reg, layer_name(layer, "self_attn.o_proj.weight"), {C, H_ * Dv_}, {C, Hg * Dv_}, 1, shard, layer);
  layout_.n_head = int(H_);
  layout_.n_kv_head = int(H_);
  layout_.qk_dim = int(Dqk);
  layout_.v_dim = int(Dv_);
  layout_.q_offset = 0;
  layout_.k_offset = H_ * Dqk;
  layout_.v_offset = 2 * H_ * Dqk;
  layout_.row_stride = H_ * (2 * Dqk + Dv_);
}

void MLAttention::forward(const Ctx& ctx, int mb, Tensor x, Tensor out) {
  const int64_t B = x.size(0), T = x.size(1), N = B * T;
  const int64_t Dqk = Dn_ + Dr_, W = layout_.row_stride;
  const RopeCache& rope = *ctx.rope;
  DS_CHECK(rope.dim == Dr_ && rope.T >= T, "MLA: rope tables of dim {} for {} positions, need dim {} for {}",
           rope.dim, rope.T, Dr_, T);
  const DType cd = ctx.compute_dtype;  // every projection and latent; rstd and lse in fp32
  Tensor xs = rows_of(x);             // (N, C)
  // Selective recomputation ("mla_up_proj"): the heads live in scratch until the attention has
  // read them, and the backward forms them again (form_heads) from what is kept below.
  Tensor qkv = ctx.recompute_mla_up_proj
                   ? ctx.scratch->get(qkv_slot_, {B, T, W}, cd)
                   : ctx.acts->put(mb, qkv_key_, {B, T, W}, cd);  // (B, T, [q (H,Dqk) | k (H,Dqk) | v (H,Dv)])
  // The attention output's buffer stages the projections until the attention writes it.
  Tensor stage = ctx.acts->put(mb, out_key_, {stage_numel(N)}, cd);
  Tensor att = stage.slice(0, N * H_ * Dv_).view({B, T, H_ * Dv_});  // the front of the same buffer
  Tensor rows = qkv.view({N, W});

  // The latents: c and k_pe from one weight, the query latent (with a query LoRA); their norms'
  // outputs in the compute dtype, as DeepseekV3RMSNorm gives them (it normalises in fp32 and
  // casts back to its input's dtype).
  Tensor w_kv_a = reg_.compute(kv_a_);  // (kv_rank + Dr, C): rows [c | k_pe]
  Tensor lat = ctx.acts->put(mb, kv_latent_key_, {N, kv_rank_}, cd);
  Tensor lat_norm = ctx.acts->put(mb, kv_latent_norm_key_, {N, kv_rank_}, cd);
  ops::linear_forward(lat, xs, w_kv_a.slice(0, kv_rank_));
  ops::rmsnorm_forward(lat_norm, ctx.acts->put(mb, kv_latent_rstd_key_, {N}), lat, reg_.param(kv_norm_), eps_);
  // k_pe (pre-rope) is kept only for the backward to form the heads again.
  Tensor k_pe_kept = ctx.recompute_mla_up_proj ? ctx.acts->put(mb, k_pe_key_, {N, Dr_}, cd) : Tensor();
  staged_linear(xs, w_kv_a.slice(kv_rank_, kv_rank_ + Dr_), stage, [&](int64_t r0, Tensor k_pe) {  // (n, Dr)
    // The one k_pe of a token into every head's key.
    ops::copy_blocks(rows.slice(r0, r0 + k_pe.size(0)), layout_.k_offset + Dn_, Dqk, k_pe, 0, 0, H_, Dr_, false);
    if (k_pe_kept.defined()) ops::copy(k_pe_kept.slice(r0, r0 + k_pe.size(0)), k_pe);
  });
  if (q_rank_ > 0) {
    Tensor qlat = ctx.acts->put(mb, q_latent_key_, {N, q_rank_}, cd);
    Tensor qlat_norm = ctx.acts->put(mb, q_latent_norm_key_, {N, q_rank_}, cd);
    ops::linear_forward(qlat, xs, reg_.compute(q_a_));
    ops::rmsnorm_forward(qlat_norm, ctx.acts->put(mb, q_latent_rstd_key_, {N}), qlat, reg_.param(q_norm_), eps_);
  }
  up_project(ctx, mb, xs, rows, stage);
  // The rope parts of the q heads and of the k heads share one column pattern (offset Dn,
  // stride Dqk) over 2H heads; rotating each head's copy of k_pe costs little next to the
  // attention and keeps the backward a plain transpose.
  ops::rope_forward_interleaved(qkv, Dn_, int(2 * H_), Dqk, int(Dr_), rope.cos_table(), rope.sin_table());
  ops::attention_forward(att, ctx.acts->put(mb, lse_key_, {B, H_, T}), qkv, layout_, scale_);
  row_parallel_forward(ctx, sharded_, rows_of(out), rows_of(att), reg_.compute(o_), partial_);
}

int64_t MLAttention::stage_numel(int64_t N) const {
  // At least one row of the widest projection, for a lone token.
  const int64_t Dqk = Dn_ + Dr_;
  return std::max({N * H_ * Dv_, H_ * (Dn_ + Dv_), H_ * Dqk, Dr_});
}

void MLAttention::up_project(const Ctx& ctx, int mb, Tensor xs, Tensor rows, Tensor stage) const {
  const int64_t Dqk = Dn_ + Dr_;
  // Keys and values: kv_b_proj of the normed latent.
  staged_linear(ctx.acts->get(mb, kv_latent_norm_key_), reg_.compute(kv_b_), stage,
                [&](int64_t r0, Tensor kv) {  // kv (n, H*(Dn+Dv))
                  Tensor dst = rows.slice(r0, r0 + kv.size(0));
                  ops::copy_blocks(dst, layout_.k_offset, Dqk, kv, 0, Dn_ + Dv_, H_, Dn_, false);
                  ops::copy_blocks(dst, layout_.v_offset, Dv_, kv, Dn_, Dn_ + Dv_, H_, Dv_, false);
                });
  // Queries, directly or through the normed query latent.
  auto scatter_q = [&](int64_t r0, Tensor q) {  // (n, H*Dqk)
    ops::copy_blocks(rows.slice(r0, r0 + q.size(0)), layout_.q_offset, 0, q, 0, 0, 1, H_ * Dqk, false);
  };
  if (q_rank_ == 0) {
    staged_linear(xs, reg_.compute(q_), stage, scatter_q);
  } else {
    staged_linear(ctx.acts->get(mb, q_latent_norm_key_), reg_.compute(q_b_), stage, scatter_q);
  }
}

Tensor MLAttention::form_heads(const Ctx& ctx, int mb, Tensor x) const {
  const int64_t B = x.size(0), T = x.size(1), N = B * T;
  const int64_t Dqk = Dn_ + Dr_, W = layout_.row_stride;
  const RopeCache& rope = *ctx.rope;
  const DType cd = ctx.compute_dtype;
  if (!ctx.recompute_mla_up_proj) return ctx.acts->get(mb, qkv_key_);
  Tensor qkv = ctx.scratch->get(qkv_slot_, {B, T, W}, cd);
  Tensor rows = qkv.view({N, W});
  // The forward's staging in a buffer of the same size, so every GEMM runs on the same rows.
  up_project(ctx, mb, rows_of(x), rows, ctx.scratch->get(dheads_slot_, {stage_numel(N)}, cd));
  ops::copy_blocks(rows, layout_.k_offset + Dn_, Dqk, ctx.acts->get(mb, k_pe_key_), 0, 0, H_, Dr_, false);
  ops::rope_forward_interleaved(qkv, Dn_, int(2 * H_), Dqk, int(Dr_), rope.cos_table(), rope.sin_table());
  return qkv;
}

void MLAttention::backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) {
  const int64_t B = x.size(0), T = x.size(1), N = B * T;
  const int64_t Dqk = Dn_ + Dr_, W = layout_.row_stride;
  const RopeCache& rope = *ctx.rope;
  Scratch& scratch = *ctx.scratch;
  WeightGradStore& wg = *ctx.wgrad;
  const DType cd = ctx.compute_dtype;  // every gradient here: they belong to compute-dtype tensors
  Tensor xs = rows_of(x);
  // Every rank's heads read all of x: the input gradient of all rows is this rank's partial,
  // summed over the tensor group at the end.
  Tensor dxp = column_parallel_grad(ctx, sharded_, dx, x, grad_slots_.dx);
  Tensor dxs = rows_of(dxp);
  // The heads first: forming them again (selective recomputation) stages through "mla.dheads".
  Tensor qkv = form_heads(ctx, mb, x);
  Tensor att = ctx.acts->get(mb, out_key_).slice(0, N * H_ * Dv_).view({B, T, H_ * Dv_});

  // "mla.dheads" holds one per-head gradient at a time: d(attention output), then dq, then
  // d[k_nope | v]; "mla.dlatent(_norm)" the query latent's, then the kv latent's.
  Tensor datt = scratch.get(dheads_slot_, {N, H_ * Dv_}, cd);
  wg.linear(datt, reg_.grad(o_),
            in_compute_dtype(ctx, sp_gather(ctx, rows_of(dout), grad_slots_.sp_dout), grad_slots_.dout16),
            rows_of(att), reg_.compute(o_));
  Tensor dqkv = scratch.get(dqkv_slot_, {B, T, W}, cd);
  ops::attention_backward(dqkv, datt.view({B, T, H_ * Dv_}), qkv, att, ctx.acts->get(mb, lse_key_), layout_, scale_);
  ops::rope_backward_interleaved(dqkv, Dn_, int(2 * H_), Dqk, int(Dr_), rope.cos_table(), rope.sin_table());
  Tensor drows = dqkv.view({N, W});

  // Queries: dx is overwritten here and accumulated into below.
  Tensor dq = scratch.get(dheads_slot_, {N, H_ * Dqk}, cd);
  ops::copy_blocks(dq, 0, 0, drows, layout_.q_offset, 0, 1, H_ * Dqk, false);
  if (q_rank_ == 0) {
    wg.linear(dxs, reg_.grad(q_), dq, xs, reg_.compute(q_));
  } else {
    Tensor dlat_norm = scratch.get(dlatent_norm_slot_, {N, q_rank_}, cd);
    Tensor dlat = scratch.get(dlatent_slot_, {N, q_rank_}, cd);
    wg.linear(dlat_norm, reg_.grad(q_b_), dq, ctx.acts->get(mb, q_latent_norm_key_), reg_.compute(q_b_));
    ops::fill(dlat, 0.0f);  // rmsnorm_backward accumulates
    ops::rmsnorm_backward(dlat, reg_.grad(q_norm_), dlat_norm, ctx.acts->get(mb, q_latent_key_), reg_.param(q_norm_),
                          ctx.acts->get(mb, q_latent_rstd_key_));
    wg.linear(dxs, reg_.grad(q_a_), dlat, xs, reg_.compute(q_a_));
  }

  // k_pe fed every head's key: its gradient is the sum over (this rank's) heads, in head order.
  Tensor dk_pe = scratch.get(dk_pe_slot_, {N, Dr_}, cd);
  const int64_t k_pe = layout_.k_offset + Dn_;
  ops::copy_blocks(dk_pe, 0, 0, drows, k_pe, 0, 1, Dr_, false);
  ops::copy_blocks(dk_pe, 0, 0, drows, k_pe + Dqk, Dqk, H_ - 1, Dr_, /*accumulate=*/true);
  Tensor w_kv_a = reg_.compute(kv_a_), g_kv_a = reg_.grad(kv_a_);  // rows [c | k_pe]
  wg.linear(dxs, g_kv_a.slice(kv_rank_, kv_rank_ + Dr_), dk_pe, xs, w_kv_a.slice(kv_rank_, kv_rank_ + Dr_),
                       /*accumulate_dx=*/true);

  // Keys and values through kv_b_proj, the latent norm and the latent rows of kv_a_proj.
  const int64_t Dkv = Dn_ + Dv_;
  Tensor dkv = scratch.get(dheads_slot_, {N, H_ * Dkv}, cd);
  ops::copy_blocks(dkv, 0, Dkv, drows, layout_.k_offset, Dqk, H_, Dn_, false);
  ops::copy_blocks(dkv, Dn_, Dkv, drows, layout_.v_offset, Dv_, H_, Dv_, false);
  Tensor dlat_norm = scratch.get(dlatent_norm_slot_, {N, kv_rank_}, cd);
  Tensor dlat = scratch.get(dlatent_slot_, {N, kv_rank_}, cd);
  wg.linear(dlat_norm, reg_.grad(kv_b_), dkv, ctx.acts->get(mb, kv_latent_norm_key_), reg_.compute(kv_b_));
  ops::fill(dlat, 0.0f);
  ops::rmsnorm_backward(dlat, reg_.grad(kv_norm_), dlat_norm, ctx.acts->get(mb, kv_latent_key_), reg_.param(kv_norm_),
                        ctx.acts->get(mb, kv_latent_rstd_key_));
  wg.linear(dxs, g_kv_a.slice(0, kv_rank_), dlat, xs, w_kv_a.slice(0, kv_rank_), /*accumulate_dx=*/true);
  reduce_column_parallel_grad(ctx, dxp, dx, grad_slots_.dx_mine);
}

}  // namespace dstrain
