// The DeepSeekMoE feed-forward layer (DeepseekV2MoE / DeepseekV3MoE of modeling_deepseek.py)
// with an explicit forward and backward: a router picks num_experts_per_tok routed experts
// per token, tokens are grouped by expert so that each expert is one GEMM over its tokens,
// and shared experts see every token.
//
// Forward, N = B*T tokens, E routed experts, k chosen per token, M = N*k rows:
//   scores (N,E)        = softmax|sigmoid(x · gate^T)                   ops::moe_scores
//   ids, weights (N,k)  = top-k of scores (+ bias for noaux_tc)         ops::moe_route
//   offsets, sorted     = the (token, slot) pairs grouped by expert     ops::moe_dispatch_plan
//   [at most capacity rows per expert, the others dropped]            ops::moe_capacity_plan
//   grouped (M,C)       = x rows in expert order                        ops::moe_permute
//   gate_up, h, grouped = per expert e, rows [offsets[e], offsets[e+1]):
//                         down_e(silu(gate_e(xg)) * up_e(xg)), in place over xg
//   out (N,C)          += sum_k weights * grouped rows + shared(x)     ops::moe_unpermute
// Expert parallelism (ShardSpec::experts, ctx.groups.ep of ep ranks; DeepSeek-V3's and
// Megatron-Core's all-to-all dispatcher): rank r holds routed experts [r*El, (r+1)*El), El =
// E/ep, so the grouped rows of one owner are contiguous. Routing and the plan stay on the
// token's rank, over all E experts. Dispatch: the per-expert row counts are exchanged first
// (all_to_all, El per rank), then the rows (all_to_all_v), which arrive by source rank; a local
// permutation (sort_chunks) puts them in expert order, the expert GEMMs run over them, and the
// way back mirrors it (combine) into `grouped` before moe_unpermute. The dispatch is in flight
// while the shared experts compute. The backward sends the output gradients the same way and
// returns the input gradients. Each owner keeps the rows it received for its weight gradients.
// ep = 1 skips all of it: the experts run on `grouped` in place.
//
// Training semantics beyond Hugging Face: the load-balancing loss (aux_loss_alpha > 0; with
// sigmoid scores on affinities normalised per token, DeepSeek-V3 eqs. 18-20) is
// scaled by LossScales (sequence-wise with seq_aux, else per micro-batch) and its gradient
// flows through the scores only; noaux_tc's e_score_correction_bias is not trained but moved
// by update_routing_bias (DeepSeek-V3's auxiliary-loss-free balancing).
//
// Token dropping (optional, off by default: DeepSeek drops no tokens): with
// ModelConfig::moe_capacity_factor f > 0, each expert takes at most capacity = ceil(M / E * f)
// rows of a micro-batch's M = n*k routed rows on this rank (Megatron-Core's get_capacity and
// moe_token_drop_policy: those of the largest routing weights, "probs", or the earliest tokens,
// "position"). A dropped (token, slot) pair is cut from the plan on the token's rank, before the
// dispatch: no expert sees its row, it adds nothing to out and its weight gets no gradient. The
// split over an expert group is still the whole model's result. The aux loss and
// tokens_per_expert are those of the router's choice before dropping; RoutingStats::dropped_rows
// counts the dropped pairs.
//
// Tensor parallelism (ShardSpec::tensor_parallel, as Megatron-Core): the router (gate weight,
// e_score_correction_bias) is replicated and the routed experts stay whole (their axis is
// expert parallelism); the shared experts are split by columns like a dense MLP (column-
// parallel gate/up, row-parallel down summed over the tensor group). Routing decisions are the
// same on every tensor rank for the same token.
//   Without sequence parallelism every tensor rank routes all N rows and runs the routed
//   experts on them: that output is complete and is added as it is; only the shared experts'
//   partial output (and in the backward their partial input gradient) is summed over the group.
//   With sequence parallelism (ctx.sequence_parallel) a rank routes and runs the routed experts
//   on its rows ctx.token_rows(N) only, the rows of out it holds; the shared experts read all
//   rows and are reduce-scattered into the rank's rows. The router's and routed experts'
//   gradients are then partial sums over the tensor group (the model marks them
//   tp_partial_grad). The auxiliary loss still needs whole sequences (or the micro-batch): the
//   scores (N,E) and ids (N,k) are all-gathered over the tensor group, every rank computes the
//   same loss and coefficients, and its backward adds this rank's rows of their gradient.
//   RoutingStats then hold: tokens_per_expert for this rank's rows only (to be summed over the
//   tensor group, as over data-parallel ranks), aux_loss for the whole micro-batch (the same on
//   every tensor rank: not to be summed over it).
#pragma once

#include <vector>

#include "backend/ops.h"
#include "model/transformer.h"

namespace dstrain {

class MoEBlock : public FeedForwardBlock {
 public:
  // Registers model.layers.{layer}.mlp.gate.weight (E,C), gate.e_score_correction_bias (E)
  // (noaux_tc only, not trainable), experts.{j}.{gate,up,down}_proj.weight with each expert's
  // gate and up adjacent (one (2I,C) matrix), and shared_experts.* when n_shared_experts > 0
  // (this rank's columns shard.shared_ffn of them). Sized from the shard's experts and columns:
  // with expert parallelism only experts shard.experts are registered (Placement::Expert).
  MoEBlock(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer);

  // x (B,T,C) normalised input, all the micro-batch's rows; the layer's output is added to out
  // (B,T,C), or with sequence parallelism to this rank's rows (n,C). Also accumulates the
  // routing statistics and, with aux_loss_alpha > 0, the scaled auxiliary loss (using the
  // scales of the last set_loss_scales).
  void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) override;
  // x: the forward's input again; dout -> dx (overwritten), both for the rows of out;
  // gradients of the gate, the routed and shared experts accumulated. One backward per forward
  // (it reuses the forward's buffers).
  void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) override;
  void set_loss_scales(const LossScales& s) override { scales_ = s; }
  // The statistics with the auxiliary losses of the forwards so far read from the device.
  RoutingStats* routing() override;
  // The router's scores, ids and weights and the dispatch plan.
  std::vector<std::string> kept_for_replay() const override { return {key_ + "gate.", key_ + "plan."}; }
  // noaux_tc: bias[e] += gamma when expert e had fewer tokens than the mean, -= gamma when
  // more; unchanged otherwise and for the other routing methods.
  void update_routing_bias(const std::vector<int64_t>& global_tokens_per_expert, double gamma) override;

  // The routing of micro-batch mb's forward (until its activations are released), for the
  // rows this rank routed (all N, or its n with sequence parallelism): ids (n,k) int32,
  // weights (n,k), scores (n,E), offsets (E+1) int64 (expert e's grouped rows, after dropping).
  Tensor ids(const ActivationStore& acts, int mb) const { return acts.get(mb, gate_ids_key_); }
  Tensor weights(const ActivationStore& acts, int mb) const { return acts.get(mb, gate_weights_key_); }
  Tensor scores(const ActivationStore& acts, int mb) const { return acts.get(mb, gate_scores_key_); }
  Tensor offsets(const ActivationStore& acts, int mb) const { return acts.get(mb, plan_offsets_key_); }
  // (n*k) int32: the grouped row of each (token, slot) pair, -1 for a pair dropped by capacity.
  Tensor positions(const ActivationStore& acts, int mb) const { return acts.get(mb, plan_position_key_); }
  const ops::MoERouteParams& route_params() const { return route_; }
  ops::MoEScoring scoring() const { return scoring_; }
  int bias_param() const { return bias_; }  // -1 unless noaux_tc

 private:
  // What a forward leaves for its backward besides tensors.
  struct Meta {
    float aux_scale = 0;        // d(loss)/d(aux): alpha * the loss scale
    bool pending = false;       // the grouped buffer holds the experts' outputs, not yet consumed
    std::vector<int64_t> active;  // this rank's experts (local index) with rows, largest first
    std::vector<int64_t> offsets;  // (El+1) this rank's experts' rows in the expert GEMMs' layout
    std::vector<int64_t> plan;     // (E+1) host copy of the plan's offsets (the token rank's rows)
    // Expert parallelism: rows sent to and received from each rank of the expert group, and the
    // received rows per (source rank, local expert), source-major.
    std::vector<int64_t> send_rows, recv_rows, recv_counts;
  };
  template <class Fn>
  void for_each_expert(const Meta& m, Fn&& fn) const;
  // Expert parallelism: rows of `in` to the ranks of the expert group, in_rows[q] rows to rank
  // q in rank order, and out_rows[s] rows from rank s into `out` (all_to_all_v, asynchronous).
  Work exchange_rows(const Ctx& ctx, Tensor out, const std::vector<int64_t>& out_rows, Tensor in,
                     const std::vector<int64_t>& in_rows);
  // The received rows' blocks, (source rank, local expert) source-major, into expert-major order
  // (to_experts) or back; counts (ep x El) rows per block. A permutation of row blocks that a GPU
  // kernel can replace.
  void sort_chunks(Tensor out, Tensor in, const std::vector<int64_t>& counts, bool to_experts) const;
  // The way back: `local` (this rank's experts' rows, expert-major) to the ranks whose tokens
  // they are, into `grouped` (their rows in global expert order). Used by the forward's combine
  // and by the backward's return of the input gradients.
  void return_rows(const Ctx& ctx, const Meta& m, Tensor local, Tensor grouped);
  // The rows each expert may take of `rows` routed (token, slot) pairs.
  int64_t expert_capacity(int64_t rows) const;

  ParamRegistry& reg_;
  std::string key_;  // "layers.{layer}.mlp."
  // key_ + the names of the comment at the end, and "meta", interned when the block is built.
  ActKey meta_key_, gate_scores_key_, gate_weights_key_, gate_ids_key_, gate_scores_all_key_, gate_aux_coef_key_;
  ActKey plan_offsets_key_, plan_sorted_key_, plan_position_key_;
  ActKey experts_grouped_key_, experts_local_in_key_, experts_gate_up_key_, experts_h_key_;
  ActKey shared_experts_gate_up_key_, shared_experts_h_key_;
  // Scratch slots.
  ActKey routed_offsets_slot_ = act_key("moe.routed_offsets"), ids_all_slot_ = act_key("moe.ids_all");
  ActKey a2a_slot_ = act_key("moe.a2a"), local_out_slot_ = act_key("moe.local_out");
  ActKey experts_h_slot_ = act_key("moe.experts.h"), dh_slot_ = act_key("mlp.dh");
  ActKey dgate_up_slot_ = act_key("mlp.dgate_up"), dgrouped_slot_ = act_key("moe.dgrouped");
  ActKey dweights_slot_ = act_key("moe.dweights"), local_dy_slot_ = act_key("moe.local_dy");
  ActKey local_dx_slot_ = act_key("moe.local_dx"), dscores_slot_ = act_key("moe.dscores");
  ActKey daux_slot_ = act_key("moe.daux");
  RowParallelSlots shared_partial_{"moe.shared.partial"};
  BlockGradSlots grad_slots_;
  int64_t n_experts_;        // E, routed experts of the model (the router's width)
  int64_t n_local_, first_;  // El experts held here, from first_
  int ep_ = 1;               // ranks of the expert group
  int64_t inter_, shared_inter_;
  ops::MoERouteParams route_;
  ops::MoEScoring scoring_;
  double aux_alpha_;
  double capacity_factor_;  // 0: no capacity (no token is dropped)
  ops::MoEDropPolicy drop_policy_;
  bool seq_aux_;
  bool sharded_;  // shared experts split over a tensor group of more than one rank
  int gate_ = -1, bias_ = -1;
  std::vector<int> expert_gate_, expert_up_, expert_down_;  // (E) parameter ids
  int shared_gate_ = -1, shared_up_ = -1, shared_down_ = -1;
  LossScales scales_;
  RoutingStats stats_;
  // Auxiliary losses (1) F64 of the forwards not yet read, with their scales: read when the
  // statistics are asked for, so a forward does not wait for them.
  std::vector<Buffer> aux_values_;
  std::vector<double> aux_scales_;
  size_t aux_pending_ = 0;
  // Stored per micro-batch (keys after key_); the router's in fp32, the experts' rows in the
  // compute dtype; n routed rows (N, or this rank's with sequence parallelism), M = n*k, S
  // this rank's shared columns: gate.scores (n,E) after softmax/sigmoid,
  // gate.weights (n,k), gate.ids (n,k) int32, gate.aux_coef (G,E) (G = B with seq_aux, else
  // 1), gate.scores_all (N,E) (the tensor group's scores: only with sequence parallelism and
  // an aux loss), plan.offsets (E+1) int64, plan.sorted and plan.position (M) int32 (with
  // dropping: sorted's first Mk entries are the kept pairs, position -1 for a dropped one),
  // experts.grouped (Mk,C) expert inputs in expert order, then their outputs (Mk = M less the
  // dropped rows), experts.gate_up (R,2I), experts.h (R,I) (R: the rows this rank's experts
  // compute), shared_experts.gate_up (N,2S), shared_experts.h (N,S).
};

}  // namespace dstrain
