#include "model/layers.h"

#include <cmath>

#include "model/init.h"

namespace dstrain {

std::string layer_name(int layer, const std::string& rest) { return fmt::format("model.layers.{}.{}", layer, rest); }

// ---------------------------------------------------------------------------------------
Tensor Activation::view(Shape shape) {
  if (buffer_.numel() < shape.numel()) {
    buffer_ = Buffer(label_, MemCategory::Activations, DType::F32, shape.numel());
  }
  return buffer_.tensor(0, shape);
}

void RopeCache::ensure(int64_t T_needed, const ModelConfig& c) {
  if (T_needed <= T) return;
  dim = int(c.mla() ? c.qk_rope_head_dim : c.head_dim());
  cos = Buffer("rope.cos", MemCategory::Workspace, DType::F32, T_needed * dim / 2);
  sin = Buffer("rope.sin", MemCategory::Workspace, DType::F32, T_needed * dim / 2);
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

// ---------------------------------------------------------------------------------------
GQAttention::GQAttention(const ModelConfig& c, ParamRegistry& reg, int layer)
    : reg_(reg),
      qkv_(layer_name(layer, "self_attn.qkv")),
      att_(layer_name(layer, "self_attn.out")),
      lse_(layer_name(layer, "self_attn.lse")) {
  const int64_t C = c.hidden_size, D = c.head_dim(), H = c.num_attention_heads, Hkv = c.num_key_value_heads;
  q_ = reg.add(layer_name(layer, "self_attn.q_proj.weight"), {H * D, C}, ParamKind::Linear, layer);
  k_ = reg.add(layer_name(layer, "self_attn.k_proj.weight"), {Hkv * D, C}, ParamKind::Linear, layer, true);
  v_ = reg.add(layer_name(layer, "self_attn.v_proj.weight"), {Hkv * D, C}, ParamKind::Linear, layer, true);
  o_ = reg.add(layer_name(layer, "self_attn.o_proj.weight"), {C, H * D}, ParamKind::Linear, layer);
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

void GQAttention::forward(Tensor x, Tensor out, RopeCache& rope) {
  const int64_t B = x.size(0), T = x.size(1);
  const int64_t H = layout_.n_head, D = layout_.qk_dim;
  x_ = x;
  Tensor qkv = qkv_.view({B, T, layout_.row_stride});
  Tensor att = att_.view({B, T, H * D});
  ops::linear_forward(rows_of(qkv), rows_of(x), reg_.param_rows(q_, v_));
  // q and k heads are adjacent in each row: rotate them in one pass.
  ops::rope_forward(qkv, 0, layout_.n_head + layout_.n_kv_head, int(D), rope.cos_table(), rope.sin_table());
  ops::attention_forward(att, lse_.view({B, H, T}), qkv, layout_, scale_);
  ops::linear_forward(rows_of(out), rows_of(att), reg_.param(o_), /*accumulate=*/true);
}

void GQAttention::backward(Tensor dout, Tensor dx, RopeCache& rope, Scratch& scratch) {
  const int64_t B = dout.size(0), T = dout.size(1);
  const int64_t H = layout_.n_head, D = layout_.qk_dim;
  Tensor qkv = qkv_.view({B, T, layout_.row_stride});
  Tensor att = att_.view({B, T, H * D});
  Tensor datt = scratch.get("attn.datt", {B, T, H * D});
  Tensor dqkv = scratch.get("attn.dqkv", {B, T, layout_.row_stride});
  ops::linear_backward(rows_of(datt), reg_.grad(o_), rows_of(dout), rows_of(att), reg_.param(o_));
  ops::attention_backward(dqkv, datt, qkv, att, lse_.view({B, H, T}), layout_, scale_);
  ops::rope_backward(dqkv, 0, layout_.n_head + layout_.n_kv_head, int(D), rope.cos_table(), rope.sin_table());
  ops::linear_backward(rows_of(dx), reg_.grad_rows(q_, v_), rows_of(dqkv), rows_of(x_), reg_.param_rows(q_, v_));
}

// ---------------------------------------------------------------------------------------
SwiGLUMLP::SwiGLUMLP(const ModelConfig& c, ParamRegistry& reg, int layer)
    : reg_(reg), inter_(c.intermediate_size), gate_up_(layer_name(layer, "mlp.gate_up")), h_(layer_name(layer, "mlp.h")) {
  const int64_t C = c.hidden_size, I = c.intermediate_size;
  gate_ = reg.add(layer_name(layer, "mlp.gate_proj.weight"), {I, C}, ParamKind::Linear, layer);
  up_ = reg.add(layer_name(layer, "mlp.up_proj.weight"), {I, C}, ParamKind::Linear, layer, true);
  down_ = reg.add(layer_name(layer, "mlp.down_proj.weight"), {C, I}, ParamKind::Linear, layer);
}

void SwiGLUMLP::forward(Tensor x, Tensor out) {
  const int64_t B = x.size(0), T = x.size(1);
  x_ = x;
  Tensor gu = gate_up_.view({B * T, 2 * inter_});
  Tensor h = h_.view({B * T, inter_});
  ops::linear_forward(gu, rows_of(x), reg_.param_rows(gate_, up_));
  ops::swiglu_forward(h, gu);
  ops::linear_forward(rows_of(out), h, reg_.param(down_), /*accumulate=*/true);
}

void SwiGLUMLP::backward(Tensor dout, Tensor dx, Scratch& scratch) {
  const int64_t N = dout.numel() / dout.size(-1);
  Tensor gu = gate_up_.view({N, 2 * inter_});
  Tensor h = h_.view({N, inter_});
  Tensor dh = scratch.get("mlp.dh", {N, inter_});
  Tensor dgu = scratch.get("mlp.dgate_up", {N, 2 * inter_});
  ops::linear_backward(dh, reg_.grad(down_), rows_of(dout), h, reg_.param(down_));
  ops::swiglu_backward(dgu, dh, gu);
  ops::linear_backward(rows_of(dx), reg_.grad_rows(gate_, up_), dgu, rows_of(x_), reg_.param_rows(gate_, up_));
}

// ---------------------------------------------------------------------------------------
DecoderLayer::DecoderLayer(const ModelConfig& c, ParamRegistry& reg, int layer, std::unique_ptr<AttentionBlock> attn,
                           std::unique_ptr<FeedForwardBlock> ffn)
    : reg_(reg),
      eps_(float(c.rms_norm_eps)),
      attn_(std::move(attn)),
      ffn_(std::move(ffn)),
      ln1_out_(layer_name(layer, "input_layernorm.out")),
      rstd1_(layer_name(layer, "input_layernorm.rstd")),
      x_mid_(layer_name(layer, "residual_mid")),
      ln2_out_(layer_name(layer, "post_attention_layernorm.out")),
      rstd2_(layer_name(layer, "post_attention_layernorm.rstd")) {
  ln1_ = reg.add(layer_name(layer, "input_layernorm.weight"), {c.hidden_size}, ParamKind::Norm, layer);
  ln2_ = reg.add(layer_name(layer, "post_attention_layernorm.weight"), {c.hidden_size}, ParamKind::Norm, layer);
}

void DecoderLayer::forward(Tensor x_in, Tensor x_out, RopeCache& rope) {
  const int64_t B = x_in.size(0), T = x_in.size(1), C = x_in.size(2);
  x_in_ = x_in;
  Tensor ln1 = ln1_out_.view({B, T, C});
  Tensor x_mid = x_mid_.view({B, T, C});
  Tensor ln2 = ln2_out_.view({B, T, C});
  ops::rmsnorm_forward(ln1, rstd1_.view({B, T}), x_in, reg_.param(ln1_), eps_);
  ops::copy(x_mid, x_in);
  attn_->forward(ln1, x_mid, rope);
  ops::rmsnorm_forward(ln2, rstd2_.view({B, T}), x_mid, reg_.param(ln2_), eps_);
  ops::copy(x_out, x_mid);
  ffn_->forward(ln2, x_out);
}

void DecoderLayer::backward(Tensor dx, RopeCache& rope, Scratch& scratch) {
  const int64_t B = dx.size(0), T = dx.size(1), C = dx.size(2);
  Tensor dln = scratch.get("layer.dln", {B, T, C});
  // x_out = x_mid + ffn(rmsnorm(x_mid))
  ffn_->backward(dx, dln, scratch);
  ops::rmsnorm_backward(dx, reg_.grad(ln2_), dln, x_mid_.view({B, T, C}), reg_.param(ln2_), rstd2_.view({B, T}));
  // x_mid = x_in + attn(rmsnorm(x_in))
  attn_->backward(dx, dln, rope, scratch);
  ops::rmsnorm_backward(dx, reg_.grad(ln1_), dln, x_in_, reg_.param(ln1_), rstd1_.view({B, T}));
}


void DecoderLayer::release_activations() {
  ln1_out_.release();
  rstd1_.release();
  x_mid_.release();
  ln2_out_.release();
  rstd2_.release();
  attn_->release_activations();
  ffn_->release_activations();
}

}  // namespace dstrain
