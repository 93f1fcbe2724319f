// The pieces of a decoder layer: the attention and feed-forward interfaces that dense, MLA and
// MoE blocks implement, the dense blocks (grouped-query attention, SwiGLU MLP), the decoder
// layer that joins them with pre-norm residuals, and what they share (rotary tables, loss
// scales, routing statistics, backward temporaries).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "backend/ops.h"
#include "core/buffer.h"
#include "model/ctx.h"
#include "model/model_config.h"
#include "state/params.h"

namespace dstrain {

// The Hugging Face name of a decoder layer's parameter: "model.layers.{layer}.{rest}".
std::string layer_name(int layer, const std::string& rest);

// An activation buffer that keeps its allocation and is viewed at the current (B, T).
class Activation {
 public:
  Activation() = default;
  explicit Activation(std::string label) : label_(std::move(label)) {}
  Tensor view(Shape shape);  // grows the allocation when needed
  void release() { buffer_ = Buffer(); }

 private:
  std::string label_;
  Buffer buffer_;
};

// Rotary tables for positions 0..T-1: (T, dim/2) of cos and sin. DeepSeek-LLM uses plain
// frequencies over the head dim; DeepSeek-V2/V3 YaRN frequencies over qk_rope_head_dim.
struct RopeCache {
  Buffer cos, sin;
  int64_t T = 0;
  int dim = 0;
  void ensure(int64_t T_needed, const ModelConfig& config);
  Tensor cos_table() const { return cos.tensor(0, {T, dim / 2}); }
  Tensor sin_table() const { return sin.tensor(0, {T, dim / 2}); }
};

// How the gradient of each loss term is scaled in a backward pass, so that the sum over
// micro-batches and data-parallel ranks is the gradient of the step's loss:
//   loss = mean CE over the global batch's target tokens
//        + auxiliary (load-balancing) terms + mtp_weight x mean multi-token-prediction CE.
struct LossScales {
  float token = 0;         // 1 / (target tokens of the global batch)
  double sequence = 0;     // 1 / (sequences of the global batch): per-sequence terms (seq_aux)
  double micro_batch = 0;  // 1 / (micro-batches of the global batch, all ranks): per-batch terms
  // Per multi-token-prediction depth k: mtp_weight / (depth x the depth's target tokens of the
  // global batch). Empty: the MTP loss is not computed.
  std::vector<float> mtp_token;
};

// What a DeepSeekMoE layer reports: expert loads for balance metrics and the bias update,
// and its auxiliary loss as it enters the step's loss (already scaled). Both accumulate over
// the micro-batches of a step until reset.
struct RoutingStats {
  std::vector<int64_t> tokens_per_expert;  // (n_routed_experts)
  double aux_loss = 0;
  // Wall time in the router (gate GEMM, scores, top-k, plan, aux loss; forward and backward)
  // and in moving token rows into and out of expert order.
  double route_seconds = 0, permute_seconds = 0;
  void reset() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0);
    aux_loss = route_seconds = permute_seconds = 0;
  }
};

class AttentionBlock {
 public:
  virtual ~AttentionBlock() = default;
  virtual void release_activations() = 0;
  // x (B,T,C) normalised input -> out (B,T,C), added to out.
  virtual void forward(Tensor x, Tensor out, RopeCache& rope) = 0;
  // dout (B,T,C) -> dx (B,T,C) (overwritten); parameter gradients accumulated.
  virtual void backward(Tensor dout, Tensor dx, RopeCache& rope, Scratch& scratch) = 0;
};

class FeedForwardBlock {
 public:
  virtual ~FeedForwardBlock() = default;
  virtual void release_activations() = 0;
  virtual void forward(Tensor x, Tensor out) = 0;  // x (B,T,C); the result is added to out
  virtual void backward(Tensor dout, Tensor dx, Scratch& scratch) = 0;
  // Scales of the auxiliary terms for the next forward and backward (MoE only).
  virtual void set_loss_scales(const LossScales&) {}
  // Routing statistics, or null for a dense block.
  virtual RoutingStats* routing() { return nullptr; }
  // The auxiliary-loss-free balancing of DeepSeek-V3: each routing bias moves by gamma
  // towards balance given the experts' token counts over the global batch.
  virtual void update_routing_bias(const std::vector<int64_t>& global_tokens_per_expert, double gamma) {}
};

// Grouped-query attention with fused q/k/v projection weights.
class GQAttention : public AttentionBlock {
 public:
  GQAttention(const ModelConfig& c, ParamRegistry& reg, int layer);
  void release_activations() override {
    qkv_.release();
    att_.release();
    lse_.release();
  }
  void forward(Tensor x, Tensor out, RopeCache& rope) override;
  void backward(Tensor dout, Tensor dx, RopeCache& rope, Scratch& scratch) override;

 private:
  ParamRegistry& reg_;
  ops::AttentionLayout layout_;
  int q_, k_, v_, o_;  // parameter ids
  float scale_;
  Tensor x_;           // saved input (owned by the decoder layer)
  Activation qkv_, att_, lse_;  // (B,T,(H+2Hkv)*D) post-rope, (B,T,H*D), (B,H,T)
};

// SwiGLU MLP with fused gate/up projection weights.
class SwiGLUMLP : public FeedForwardBlock {
 public:
  SwiGLUMLP(const ModelConfig& c, ParamRegistry& reg, int layer);
  void release_activations() override {
    gate_up_.release();
    h_.release();
  }
  void forward(Tensor x, Tensor out) override;
  void backward(Tensor dout, Tensor dx, Scratch& scratch) override;

 private:
  ParamRegistry& reg_;
  int gate_, up_, down_;
  int64_t inter_;
  Tensor x_;
  Activation gate_up_, h_;  // (B,T,2I), (B,T,I)
};

class DecoderLayer {
 public:
  void release_activations();
  DecoderLayer(const ModelConfig& c, ParamRegistry& reg, int layer, std::unique_ptr<AttentionBlock> attn,
               std::unique_ptr<FeedForwardBlock> ffn);
  // x_in (B,T,C) must stay alive until backward; x_out (B,T,C) is written.
  void forward(Tensor x_in, Tensor x_out, RopeCache& rope);
  // dx: gradient w.r.t. x_out on entry, w.r.t. x_in on return.
  void backward(Tensor dx, RopeCache& rope, Scratch& scratch);
  // Parameter ids [first, last] of this layer, for the gradient-ready hook.
  FeedForwardBlock& ffn() { return *ffn_; }
  void set_param_range(int first, int last) {
    first_param_ = first;
    last_param_ = last;
  }
  int first_param() const { return first_param_; }
  int last_param() const { return last_param_; }

 private:
  ParamRegistry& reg_;
  float eps_;
  int ln1_, ln2_;
  int first_param_ = 0, last_param_ = -1;
  std::unique_ptr<AttentionBlock> attn_;
  std::unique_ptr<FeedForwardBlock> ffn_;
  Tensor x_in_;
  Activation ln1_out_, rstd1_, x_mid_, ln2_out_, rstd2_;
};

}  // namespace dstrain
