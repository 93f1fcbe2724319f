// The DeepSeekMoE feed-forward layer (DeepseekV2MoE / DeepseekV3MoE of modeling_deepseek.py)
// with an explicit forward and backward: a router picks num_experts_per_tok routed experts
// per token, tokens are grouped by expert so that each expert is one GEMM over its tokens,
// and shared experts see every token.
//
// Forward, N = B*T tokens, E routed experts, k chosen per token, M = N*k rows:
//   scores (N,E)        = softmax|sigmoid(x · gate^T)                   ops::moe_scores
//   ids, weights (N,k)  = top-k of scores (+ bias for noaux_tc)         ops::moe_route
//   offsets, sorted     = the (token, slot) pairs grouped by expert     ops::moe_dispatch_plan
//   grouped (M,C)       = x rows in expert order                        ops::moe_permute
//   gate_up, h, grouped = per expert e, rows [offsets[e], offsets[e+1]):
//                         down_e(silu(gate_e(xg)) * up_e(xg)), in place over xg
//   out (N,C)          += sum_k weights * grouped rows + shared(x)     ops::moe_unpermute
// Expert parallelism slots in between moe_permute and the expert GEMMs (an all-to-all of the
// grouped rows by expert owner, with the per-expert counts from the plan) and between the
// GEMMs and moe_unpermute (the way back); routing and the plan stay on the token's rank.
//
// Training semantics beyond Hugging Face: the load-balancing loss (aux_loss_alpha > 0; with
// sigmoid scores on affinities normalised per token, DeepSeek-V3 eqs. 18-20) is
// scaled by LossScales (sequence-wise with seq_aux, else per micro-batch) and its gradient
// flows through the scores only; noaux_tc's e_score_correction_bias is not trained but moved
// by update_routing_bias (DeepSeek-V3's auxiliary-loss-free balancing).
#pragma once

#include <vector>

#include "backend/ops.h"
#include "model/transformer.h"

namespace dstrain {

class MoEBlock : public FeedForwardBlock {
 public:
  // Registers model.layers.{layer}.mlp.gate.weight (E,C), gate.e_score_correction_bias (E)
  // (noaux_tc only, not trainable), experts.{j}.{gate,up,down}_proj.weight with each expert's
  // gate and up adjacent (one (2I,C) matrix), and shared_experts.* when n_shared_experts > 0.
  MoEBlock(const ModelConfig& c, ParamRegistry& reg, int layer);

  void release_activations() override;
  // x (B,T,C) must stay alive until backward; the layer's output is added to out (B,T,C).
  // Also accumulates the routing statistics and, with aux_loss_alpha > 0, the scaled
  // auxiliary loss (using the scales of the last set_loss_scales).
  void forward(Tensor x, Tensor out) override;
  // dout (B,T,C) -> dx (B,T,C) overwritten; gradients of the gate, the routed and shared
  // experts accumulated. One backward per forward (it reuses the forward's buffers).
  void backward(Tensor dout, Tensor dx, Scratch& scratch) override;
  void set_loss_scales(const LossScales& s) override { scales_ = s; }
  RoutingStats* routing() override { return &stats_; }
  // noaux_tc: bias[e] += gamma when expert e had fewer tokens than the mean, -= gamma when
  // more; unchanged otherwise and for the other routing methods.
  void update_routing_bias(const std::vector<int64_t>& global_tokens_per_expert, double gamma) override;

  // The routing of the last forward: ids (N,k) int32, weights (N,k), scores (N,E),
  // offsets (E+1) int64 (expert e's rows of the grouped buffer).
  Tensor last_ids() { return ids_.tensor(0, {N_, route_.top_k}); }
  Tensor last_weights() { return weights_.view({N_, route_.top_k}); }
  Tensor last_scores() { return scores_.view({N_, n_experts_}); }
  Tensor last_offsets() { return offsets_.tensor(0, {n_experts_ + 1}); }
  const ops::MoERouteParams& route_params() const { return route_; }
  ops::MoEScoring scoring() const { return scoring_; }
  int bias_param() const { return bias_; }  // -1 unless noaux_tc

 private:
  template <class Fn>
  void for_each_expert(Fn&& fn) const;

  ParamRegistry& reg_;
  int64_t n_experts_, inter_, shared_inter_;
  ops::MoERouteParams route_;
  ops::MoEScoring scoring_;
  double aux_alpha_;
  bool seq_aux_;
  int gate_ = -1, bias_ = -1;
  std::vector<int> expert_gate_, expert_up_, expert_down_;  // (E) parameter ids
  int shared_gate_ = -1, shared_up_ = -1, shared_down_ = -1;
  LossScales scales_;
  RoutingStats stats_;

  // State of the last forward.
  Tensor x_;
  int64_t B_ = 0, T_ = 0, N_ = 0;
  float aux_scale_ = 0;       // d(loss)/d(aux) of the last forward: alpha * the loss scale
  bool grouped_is_output_ = false;  // grouped_ holds the experts' outputs, not yet consumed
  std::vector<int64_t> active_;  // experts with rows, largest first
  Activation scores_;         // (N,E) router scores (after softmax/sigmoid)
  Activation weights_;        // (N,k) routing weights
  Activation coef_;           // (G,E) aux-loss coefficients, G = B (seq_aux) or 1
  Buffer ids_;                // (N,k) int32 chosen experts
  Buffer offsets_;            // (E+1) int64
  Buffer sorted_, position_;  // (M) int32 each: the dispatch plan
  Activation grouped_;        // (M,C) expert inputs in expert order, then their outputs
  Activation gate_up_, h_;    // (M,2I), (M,I)
  Activation shared_gate_up_, shared_h_;  // (N,2*I*S), (N,I*S)
};

}  // namespace dstrain
