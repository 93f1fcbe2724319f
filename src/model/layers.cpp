#include "model/layers.h"

#include <cmath>

#include "model/init.h"

namespace dstrain {

std::string layer_name(int layer, const std::string& rest) { return fmt::format("model.layers.{}.{}", layer, rest); }

// ---------------------------------------------------------------------------------------
void RopeCache::ensure(int64_t T_needed, const ModelConfig& c, Device device) {
  if (T_needed <= T) return;
  dim = int(c.mla() ? c.qk_rope_head_dim : c.head_dim());
  cos = Buffer("rope.cos", MemCategory::Workspace, DType::F32, T_needed * dim / 2, device);
  sin = Buffer("rope.sin", MemCategory::Workspace, DType::F32, T_needed * dim / 2, device);
  T = T_needed;
  if (c.mla()) {
    ops::YarnParams y;
    if (c.rope_scaling.yarn()) {
      y.factor = c.rope_scaling.factor;
      y.original_max_position_embeddings = c.rope_scaling.original_max_position_embeddings;
      y.beta_fast = c.rope_scaling.beta_fast;
      y.beta_slow = c.rope_scaling.beta_slow;
      y.mscale = c.rope_scaling.mscale;
      y.mscale_all_dim = c.rope_scaling.mscale_all_dim;
    }
    ops::rope_tables_yarn(cos_table(), sin_table(), dim, c.rope_theta, y);
  } else {
    ops::rope_tables(cos_table(), sin_table(), dim, c.rope_theta);
  }
}

namespace {
Tensor rows_of(Tensor t) { return t.view({t.numel() / t.size(-1), t.size(-1)}); }
}  // namespace

Tensor sp_gather(const Ctx& ctx, Tensor rows, ActKey slot) {
  if (!ctx.sequence_parallel || ctx.tp_size() == 1) return rows;
  const int64_t C = rows.size(-1), n = rows.numel() / C;
  Tensor full = ctx.scratch->get(slot, {n * ctx.tp_size(), C}, rows.dtype());
  ctx.groups.tp->all_gather(full, rows.view({n, C}));
  return full;
}

Tensor in_compute_dtype(const Ctx& ctx, Tensor t, ActKey slot) {
  // bf16 only: a loss-scaled gradient can leave fp16's narrow range, and the CPU backend's fp16
  // products widen their operands to fp32 anyway (gemm16.h).
  if (ctx.compute_dtype != DType::BF16 || t.dtype() != DType::F32) return t;
  Tensor r = ctx.scratch->get(slot, t.shape(), ctx.compute_dtype);
  ops::cast(r, t);
  return r;
}

Tensor reduce_over_tensor_group(const Ctx& ctx, Tensor partial, ActKey slot) {
  if (!ctx.sequence_parallel || ctx.tp_size() == 1) {
    ctx.tp_all_reduce(partial);
    return partial;
  }
  const int64_t C = partial.size(-1), N = partial.numel() / C;
  Tensor mine = ctx.scratch->get(slot, {N / ctx.tp_size(), C}, partial.dtype());
  ctx.groups.tp->reduce_scatter(mine, partial.view({N, C}));
  return mine;
}

void row_parallel_forward(const Ctx& ctx, bool sharded, Tensor out, Tensor x, Tensor w, const RowParallelSlots& slots) {
  if (!sharded) {
    ops::linear_forward(out, x, w, /*accumulate=*/true);
    return;
  }
  // In fp32 (the residual's dtype): the pieces are summed in fp32.
  Tensor partial = ctx.scratch->get(slots.partial, {x.numel() / x.size(-1), w.size(0)}, out.dtype());
  ops::linear_forward(partial, x, w);
  Tensor sum = reduce_over_tensor_group(ctx, partial, slots.mine);
  ops::add(out, out, sum.view(out.shape()));
}

Tensor column_parallel_grad(const Ctx& ctx, bool sharded, Tensor dx, Tensor x, ActKey slot) {
  const bool all_rows = dx.numel() == x.numel();
  if (!sharded || (dx.dtype() == DType::F32 && all_rows)) return dx;
  return ctx.scratch->get(slot, x.shape(), DType::F32);
}

void reduce_column_parallel_grad(const Ctx& ctx, Tensor partial, Tensor dx, ActKey mine) {
  if (partial.raw() == dx.raw()) {
    ctx.tp_all_reduce(partial);
    return;
  }
  Tensor sum = reduce_over_tensor_group(ctx, partial, mine);
  ops::cast(dx, sum.view(dx.shape()));
}

int add_tp_piece(ParamRegistry& reg, const std::string& name, Shape local, Shape global, int dim, const ShardSpec& shard,
              int layer, bool follow_previous) {
  ParamOptions o;
  o.follow_previous = follow_previous;
  if (shard.tp_size > 1) {
    o.placement.kind = Placement::Kind::Shard;
    o.placement.dim = dim;
    o.placement.axis = "tensor";
    // Piece index of count along dim: the tensor rank's, or for key/value heads replicated over
    // several ranks (fewer heads than ranks), the head's.
    o.placement.count = global[dim] / local[dim];
    o.placement.index = o.placement.count == shard.tp_size ? shard.tp_rank
                                                           : int64_t(shard.tp_rank) * o.placement.count / shard.tp_size;
    o.global_shape = global;
  }
  return reg.add(name, local, ParamKind::Linear, layer, o);
}

// ---------------------------------------------------------------------------------------
GQAttention::GQAttention(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer)
    : reg_(reg),
      key_(fmt::format("layers.{}.attn.", layer)),
      qkv_key_(act_key(key_ + "qkv")),
      out_key_(act_key(key_ + "out")),
      lse_key_(act_key(key_ + "lse")),
      sharded_(shard.tp_size > 1) {
  const int64_t C = c.hidden_size, D = c.head_dim(), Hg = c.num_attention_heads, Hkvg = c.num_key_value_heads;
  const int64_t H = shard.heads.size(), Hkv = shard.kv_heads.size();
  // Split key/value heads keep the grouping; a replicated one serves all of this rank's query heads.
  DS_CHECK(shard.kv_replicas > 1 ? Hkv == 1 && (Hg / Hkvg) % H == 0 : H * Hkvg == Hkv * Hg,
           "layer {}: {} of {} query heads and {} of {} key/value heads on this rank do not "
           "keep the grouping of grouped-query attention", layer, H, Hg, Hkv, Hkvg);
  q_ = add_tp_piece(reg, layer_name(layer, "self_attn.q_proj.weight"), {H * D, C}, {Hg * D, C}, 0, shard, layer);
  k_ = add_tp_piece(reg, layer_name(layer, "self_attn.k_proj.weight"), {Hkv * D, C}, {Hkvg * D, C}, 0, shard, layer,
                 true);
  v_ = add_tp_piece(reg, layer_name(layer, "self_attn.v_proj.weight"), {Hkv * D, C}, {Hkvg * D, C}, 0, shard, layer,
                 true);
  o_ = add_tp_piece(reg, layer_name(layer, "self_attn.o_proj.weight"), {C, H * D}, {C, Hg * D}, 1, shard, layer);
  layout_.n_head = int(H);
  layout_.n_kv_head = int(Hkv);
  layout_.qk_dim = int(D);
  layout_.v_dim = int(D);
  layout_.q_offset = 0;
  layout_.k_offset = H * D;
  layout_.v_offset = (H + Hkv) * D;
  layout_.row_stride = (H + 2 * Hkv) * D;
  scale_ = float(1.0 / std::sqrt(double(D)));
}

void GQAttention::forward(const Ctx& ctx, int mb, Tensor x, Tensor out) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = layout_.n_head, D = layout_.qk_dim;
  const RopeCache& rope = *ctx.rope;
  const DType cd = ctx.compute_dtype;
  Tensor qkv = ctx.acts->put(mb, qkv_key_, {B, T, layout_.row_stride}, cd);
  Tensor att = ctx.acts->put(mb, out_key_, {B, T, H * D}, cd);
  Tensor lse = ctx.acts->put(mb, lse_key_, {B, H, T});
  ops::linear_forward(rows_of(qkv), rows_of(x), reg_.compute_rows(q_, v_));
  // q and k heads are adjacent in each row: rotate them in one pass.
  ops::rope_forward(qkv, 0, layout_.n_head + layout_.n_kv_head, int(D), rope.cos_table(), rope.sin_table());
  ops::attention_forward(att, lse, qkv, layout_, scale_);
  row_parallel_forward(ctx, sharded_, rows_of(out), rows_of(att), reg_.compute(o_), partial_);
}

void GQAttention::backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = layout_.n_head, D = layout_.qk_dim;
  const RopeCache& rope = *ctx.rope;
  Tensor qkv = ctx.acts->get(mb, qkv_key_);
  Tensor att = ctx.acts->get(mb, out_key_);
  Tensor lse = ctx.acts->get(mb, lse_key_);
  const DType cd = ctx.compute_dtype;
  Tensor datt = ctx.scratch->get(datt_slot_, {B, T, H * D}, cd);
  Tensor dqkv = ctx.scratch->get(dqkv_slot_, {B, T, layout_.row_stride}, cd);
  ctx.wgrad->linear(rows_of(datt), reg_.grad(o_),
                    in_compute_dtype(ctx, sp_gather(ctx, rows_of(dout), grad_slots_.sp_dout), grad_slots_.dout16),
                    rows_of(att), reg_.compute(o_));
  ops::attention_backward(dqkv, datt, qkv, att, lse, layout_, scale_);
  ops::rope_backward(dqkv, 0, layout_.n_head + layout_.n_kv_head, int(D), rope.cos_table(), rope.sin_table());
  // Every rank's heads read the whole input: its gradient is the sum over the pieces.
  Tensor dxp = column_parallel_grad(ctx, sharded_, dx, x, grad_slots_.dx);
  ctx.wgrad->linear(rows_of(dxp), reg_.grad_rows(q_, v_), rows_of(dqkv), rows_of(x), reg_.compute_rows(q_, v_));
  reduce_column_parallel_grad(ctx, dxp, dx, grad_slots_.dx_mine);
}

// ---------------------------------------------------------------------------------------
SwiGLUMLP::SwiGLUMLP(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer)
    : reg_(reg),
      key_(fmt::format("layers.{}.mlp.", layer)),
      gate_up_key_(act_key(key_ + "gate_up")),
      h_key_(act_key(key_ + "h")),
      inter_(shard.ffn.size()),
      sharded_(shard.tp_size > 1) {
  const int64_t C = c.hidden_size, I = inter_, Ig = c.intermediate_size;
  gate_ = add_tp_piece(reg, layer_name(layer, "mlp.gate_proj.weight"), {I, C}, {Ig, C}, 0, shard, layer);
  up_ = add_tp_piece(reg, layer_name(layer, "mlp.up_proj.weight"), {I, C}, {Ig, C}, 0, shard, layer, true);
  down_ = add_tp_piece(reg, layer_name(layer, "mlp.down_proj.weight"), {C, I}, {C, Ig}, 1, shard, layer);
}

void SwiGLUMLP::forward(const Ctx& ctx, int mb, Tensor x, Tensor out) {
  const int64_t N = x.numel() / x.size(-1);
  Tensor gu = ctx.acts->put(mb, gate_up_key_, {N, 2 * inter_}, ctx.compute_dtype);
  Tensor h = ctx.acts->put(mb, h_key_, {N, inter_}, ctx.compute_dtype);
  ops::linear_forward(gu, rows_of(x), reg_.compute_rows(gate_, up_));
  ops::swiglu_forward(h, gu);
  row_parallel_forward(ctx, sharded_, rows_of(out), h, reg_.compute(down_), partial_);
}

void SwiGLUMLP::backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) {
  const int64_t N = x.numel() / x.size(-1);
  Tensor gu = ctx.acts->get(mb, gate_up_key_);
  Tensor h = ctx.acts->get(mb, h_key_);
  Tensor dh = ctx.scratch->get(dh_slot_, {N, inter_}, ctx.compute_dtype);
  Tensor dgu = ctx.scratch->get(dgate_up_slot_, {N, 2 * inter_}, ctx.compute_dtype);
  ctx.wgrad->linear(dh, reg_.grad(down_),
                    in_compute_dtype(ctx, sp_gather(ctx, rows_of(dout), grad_slots_.sp_dout), grad_slots_.dout16), h,
                    reg_.compute(down_));
  ops::swiglu_backward(dgu, dh, gu);
  // Every rank's columns read the whole input: its gradient is the sum over the pieces.
  Tensor dxp = column_parallel_grad(ctx, sharded_, dx, x, grad_slots_.dx);
  ctx.wgrad->linear(rows_of(dxp), reg_.grad_rows(gate_, up_), dgu, rows_of(x), reg_.compute_rows(gate_, up_));
  reduce_column_parallel_grad(ctx, dxp, dx, grad_slots_.dx_mine);
}

// ---------------------------------------------------------------------------------------
DecoderLayer::DecoderLayer(const ModelConfig& c, ParamRegistry& reg, int layer, std::unique_ptr<AttentionBlock> attn,
                           std::unique_ptr<FeedForwardBlock> ffn)
    : reg_(reg),
      key_(fmt::format("layers.{}.", layer)),
      x_in_key_(act_key(key_ + "x_in")),
      ln1_key_(act_key(key_ + "input_layernorm.out")),
      rstd1_key_(act_key(key_ + "input_layernorm.rstd")),
      x_mid_key_(act_key(key_ + "residual_mid")),
      ln2_key_(act_key(key_ + "post_attention_layernorm.out")),
      rstd2_key_(act_key(key_ + "post_attention_layernorm.rstd")),
      batch_shape_key_(act_key(kBatchShapeKey)),
      eps_(float(c.rms_norm_eps)),
      attn_(std::move(attn)),
      ffn_(std::move(ffn)) {
  ln1_ = reg.add(layer_name(layer, "input_layernorm.weight"), {c.hidden_size}, ParamKind::Norm, layer);
  ln2_ = reg.add(layer_name(layer, "post_attention_layernorm.weight"), {c.hidden_size}, ParamKind::Norm, layer);
  // The blocks interned their keys when they were built, before this layer: every key under
  // "layers.{layer}." is known now, and recomputation hands them back by these lists.
  all_keys_ = act_keys_with_prefix(key_);
  replay_keys_ = act_keys_with_prefix(key_, ffn_->kept_for_replay());
}

namespace {
// The blocks' input (B,T,C): the norm's output of every row (gathered with sequence parallelism).
Tensor block_input(const Ctx& ctx, int mb, Tensor ln, ActKey batch_shape, ActKey slot) {
  const Shape bt = ctx.acts->meta<Shape>(mb, batch_shape);
  DS_CHECK(bt.ndim() == 2, "micro-batch {}: the model did not record its batch shape", mb);
  return sp_gather(ctx, ln, slot).view({bt[0], bt[1], ln.size(-1)});
}
}  // namespace

void DecoderLayer::forward(const Ctx& ctx, int mb, Tensor x_in, Tensor x_out) {
  const int64_t C = x_in.size(-1), n = x_in.numel() / C;
  ctx.before_use(first_param_, last_param_);
  ctx.acts->meta<Tensor>(mb, x_in_key_) = x_in;
  // The residual stream and the norms' rstd in fp32; the norms' outputs, which only feed the
  // projections, in the compute dtype (rmsnorm_forward rounds them as it writes them).
  // Selective recomputation of the norms: their outputs live in scratch until the blocks have
  // read them, and the backward forms them again (norm_out).
  auto out = [&](ActKey key) {
    return ctx.recompute_layernorm ? ctx.scratch->get(recompute_ln_slot_, {n, C}, ctx.compute_dtype)
                                   : ctx.acts->put(mb, key, {n, C}, ctx.compute_dtype);
  };
  Tensor ln1 = out(ln1_key_);
  Tensor rstd1 = ctx.acts->put(mb, rstd1_key_, {n});
  Tensor x_mid = ctx.acts->put(mb, x_mid_key_, x_in.shape());
  ops::rmsnorm_forward(ln1, rstd1, x_in.view({n, C}), reg_.param(ln1_), eps_);
  ops::copy(x_mid, x_in);
  attn_->forward(ctx, mb, block_input(ctx, mb, ln1, batch_shape_key_, input_slot_), x_mid);
  Tensor ln2 = out(ln2_key_);
  Tensor rstd2 = ctx.acts->put(mb, rstd2_key_, {n});
  ops::rmsnorm_forward(ln2, rstd2, x_mid.view({n, C}), reg_.param(ln2_), eps_);
  ops::copy(x_out, x_mid);
  ffn_->forward(ctx, mb, block_input(ctx, mb, ln2, batch_shape_key_, input_slot_), x_out);
  ctx.after_use(first_param_, last_param_);
}

void DecoderLayer::release_activations(ActivationStore& acts, int mb, bool for_replay) const {
  acts.release_keys(mb, for_replay ? replay_keys_ : all_keys_);
}

void DecoderLayer::backward(const Ctx& ctx, int mb, Tensor dx) {
  const int64_t C = dx.size(-1), n = dx.numel() / C;
  ctx.before_use(first_param_, last_param_);
  const Tensor x_in = ctx.acts->meta<Tensor>(mb, x_in_key_);
  DS_CHECK(x_in.defined(), "{}: backward of micro-batch {} without its forward", key_, mb);
  // The gradient of a norm's output, in its dtype; dx (the residual's) stays fp32.
  Tensor dln = ctx.scratch->get(dln_slot_, dx.shape(), ctx.compute_dtype);
  Tensor dxr = dx.view({n, C}), dlnr = dln.view({n, C});
  // A norm's output: stored, or formed again by the same op (selective recomputation).
  auto norm_out = [&](ActKey key, Tensor x, int w) {
    if (!ctx.recompute_layernorm) return ctx.acts->get(mb, key);
    Tensor ln = ctx.scratch->get(recompute_ln_slot_, {n, C}, ctx.compute_dtype);
    ops::rmsnorm_forward(ln, ctx.scratch->get(recompute_rstd_slot_, {n}), x.view({n, C}), reg_.param(w), eps_);
    return ln;
  };
  // x_out = x_mid + ffn(rmsnorm(x_mid))
  Tensor ln2 = norm_out(ln2_key_, ctx.acts->get(mb, x_mid_key_), ln2_);
  ffn_->backward(ctx, mb, block_input(ctx, mb, ln2, batch_shape_key_, input_slot_), dx, dln);
  ops::rmsnorm_backward(dxr, reg_.grad(ln2_), dlnr, ctx.acts->get(mb, x_mid_key_).view({n, C}), reg_.param(ln2_),
                        ctx.acts->get(mb, rstd2_key_));
  // x_mid = x_in + attn(rmsnorm(x_in))
  Tensor ln1 = norm_out(ln1_key_, x_in, ln1_);
  attn_->backward(ctx, mb, block_input(ctx, mb, ln1, batch_shape_key_, input_slot_), dx, dln);
  ops::rmsnorm_backward(dxr, reg_.grad(ln1_), dlnr, x_in.view({n, C}), reg_.param(ln1_),
                        ctx.acts->get(mb, rstd1_key_));
  ctx.after_use(first_param_, last_param_);
}

}  // namespace dstrain
