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

#include "model/layers.h"
#include "model/model_config.h"
#include "state/params.h"

namespace dstrain {

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
