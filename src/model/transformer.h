// The decoder-only transformer of DeepSeek-LLM (Hugging Face LlamaForCausalLM), with an
// explicit forward and backward:
//   x = embed(tokens)
//   per layer: x = x + o_proj(attn(rope(qkv_proj(rmsnorm(x)))))
//              x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),  h = rmsnorm(x)
//   logits = lm_head(rmsnorm(x))
// Layers hold views into the parameter registry and own their activation buffers. The
// attention and feed-forward parts sit behind small interfaces so that MLA and MoE layers
// slot into the same decoder layer.
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"
#include "kernels/ops.h"
#include "model/model_config.h"
#include "model/params.h"

namespace dstrain {

// Shared temporaries for the backward pass, grown on demand and reused by every layer.
class Scratch {
 public:
  Tensor get(const std::string& slot, Shape shape);
  void release() { buffers_.clear(); }

 private:
  std::unordered_map<std::string, Buffer> buffers_;
};

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

// Sum of token losses and the number of tokens that had a target; for models with
// multi-token prediction the same per depth.
struct LossSums {
  double sum = 0;
  int64_t count = 0;
  std::vector<double> mtp_sum;
  std::vector<int64_t> mtp_count;
  double mean() const { return count ? sum / double(count) : 0.0; }
};

// Called during the backward each time the gradients of parameters [first, last] are final
// for this micro-batch, in the order they become ready (last layer first).
using GradReadyFn = std::function<void(int first, int last)>;

class Transformer {
 public:
  Transformer(const ModelConfig& config, Device device);
  // Layers hold references into the registry: a model stays where it was built.
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;
  const ModelConfig& config() const { return config_; }
  ParamRegistry& params() { return reg_; }
  const ParamRegistry& params() const { return reg_; }

  // Hugging Face's initialisation: normal(0, initializer_range) for linear and embedding
  // weights, ones for norms; each tensor from its own counter-based stream.
  void init_weights(uint64_t seed);

  // tokens, targets: (B,T) int32. Accumulates the gradient of this micro-batch's share of
  // the step's loss (CE, auxiliary terms, MTP; scaled as `scales` says) and returns its loss
  // sums. MoE layers add their auxiliary terms to their routing statistics.
  LossSums forward_backward(Tensor tokens, Tensor targets, const LossScales& scales, const GradReadyFn& ready = {});
  // The CE-only form: d(loss_scale x sum of token losses).
  LossSums forward_backward(Tensor tokens, Tensor targets, float loss_scale, const GradReadyFn& ready = {});
  LossSums forward_loss(Tensor tokens, Tensor targets);
  // logits (B,T,V) for every position.
  void forward_logits(Tensor tokens, Tensor logits);
  // logits (B,V) of the last position of each sequence (generation).
  void last_logits(Tensor tokens, Tensor logits);

  // Rows of the vocabulary projection computed at once: bounds the logits memory.
  int64_t head_chunk_rows() const;
  // The DeepSeekMoE layers (main and MTP) with their layer indices.
  std::vector<std::pair<int, FeedForwardBlock*>> moe_layers();
  int mtp_depth() const { return int(mtp_.size()); }
  // Seconds spent in forward and backward computation since the last call.
  std::pair<double, double> take_timings();
  // Bytes of activations and backward temporaries a micro-batch of (B, T) needs.
  int64_t activation_bytes(int64_t B, int64_t T) const;
  // Frees every activation buffer (they are reallocated at the next forward's size).
  void release_activations();

 private:
  void forward_body(Tensor tokens);  // fills x_final_norm_ (B,T,C)
  // Chunked vocabulary projection and cross-entropy of x (N,C) against targets (N); with
  // backward, dx (N,C) is overwritten with scale x d(sum of losses)/dx.
  LossSums head(Tensor x, Tensor targets, bool backward, float scale, Tensor dx);
  // One multi-token-prediction depth: the module, its shifted inputs and targets.
  struct MtpModule {
    int enorm = -1, hnorm = -1, eh_proj = -1, head_norm = -1;
    int first_param = 0, last_param = -1;
    std::unique_ptr<DecoderLayer> layer;
    std::vector<int32_t> inputs, targets;  // (B*T)
    Activation emb, e_rstd, hn_in, h_rstd, cat, h_in, h_out, out_norm, out_rstd;
    Tensor h_prev;  // (B,T,C) the hidden state it read (h^{k-1})
  };
  void mtp_forward_backward(const LossScales& scales, Tensor targets, Tensor dxf, LossSums& sums,
                            const GradReadyFn& ready);
  Tensor head_weight() const;
  Tensor head_grad() const;

  ModelConfig config_;
  ParamRegistry reg_;
  int embed_, final_norm_, lm_head_;
  std::vector<DecoderLayer> layers_;
  std::vector<MtpModule> mtp_;
  RopeCache rope_;
  Scratch scratch_;
  Tensor tokens_;
  int64_t B_ = 0, T_ = 0;
  std::vector<Activation> x_;  // residual stream: x_[0] embedding output, x_[l+1] after layer l
  Activation xf_, rstdf_;      // final norm output (B,T,C) and rstd (B,T)
  Activation logits_, losses_, lse_;
  // Backward work done inside the forward pass (head chunks, MTP modules), moved to backward_s_.
  double forward_s_ = 0, backward_s_ = 0, early_backward_s_ = 0;
};

}  // namespace dstrain
