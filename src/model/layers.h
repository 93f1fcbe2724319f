// The pieces of a decoder layer: the attention and feed-forward interfaces that dense, MLA and
// MoE blocks implement, the dense blocks (grouped-query attention, SwiGLU MLP), the decoder
// layer that joins them with pre-norm residuals, and what they share (rotary tables, loss
// scales, routing statistics). They run in a Ctx (model/ctx.h).
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

// Rotary tables for positions 0..T-1: (T, dim/2) of cos and sin. DeepSeek-LLM uses plain
// frequencies over the head dim; DeepSeek-V2/V3 YaRN frequencies over qk_rope_head_dim.
struct RopeCache {
  Buffer cos, sin;
  int64_t T = 0;
  int dim = 0;
  void ensure(int64_t T_needed, const ModelConfig& config, Device device = Device::cpu());
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
  // Expert parallelism: expert rows this rank received to compute (its experts' share of the
  // expert group's tokens), the all-to-alls' bytes sent (dispatch and combine, forward and
  // backward), the time the layer waited for them (dispatch: the counts and the rows on their
  // way to the experts, forward and backward; combine: the results on their way back), and the
  // time in the expert GEMMs.
  int64_t received_rows = 0;
  double a2a_bytes = 0, dispatch_seconds = 0, combine_seconds = 0, expert_seconds = 0;
  // With an expert capacity (moe.capacity_factor): the (token, slot) pairs of this rank's rows
  // dropped because their expert was full. tokens_per_expert counts them (the router's choice).
  int64_t dropped_rows = 0;
  void reset() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0);
    aux_loss = route_seconds = permute_seconds = 0;
    received_rows = dropped_rows = 0;
    a2a_bytes = dispatch_seconds = combine_seconds = expert_seconds = 0;
  }
};

// The scratch of a row-parallel output: the fp32 partial sum and this rank's rows of the sum
// ("{name}" and "{name}.mine"), interned when the block is built.
struct RowParallelSlots {
  ActKey partial, mine;
  explicit RowParallelSlots(const std::string& name) : partial(act_key(name)), mine(act_key(name + ".mine")) {}
};
// The scratch slots every block's backward uses for its output gradient and its input gradient
// under tensor parallelism ("sp.dout", "layer.dout16", "tp.dx", "tp.dx.mine").
struct BlockGradSlots {
  ActKey sp_dout = act_key("sp.dout"), dout16 = act_key("layer.dout16");
  ActKey dx = act_key("tp.dx"), dx_mine = act_key("tp.dx.mine");
};

// The blocks keep nothing per micro-batch: what a forward saves for its backward goes into
// ctx.acts under the block's key prefix ("layers.3.attn.") and micro-batch mb, and the backward
// is given the forward's input again. Weight gradients of linear maps go through ctx.wgrad, so
// a backward can leave them for WeightGradStore::run.
class AttentionBlock {
 public:
  virtual ~AttentionBlock() = default;
  // x (B,T,C) normalised input -> out (B,T,C), added to out. ctx.rope holds the tables.
  virtual void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) = 0;
  // x: the forward's input again; dout (B,T,C) -> dx (B,T,C) (overwritten); parameter
  // gradients accumulated.
  virtual void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) = 0;
};

class FeedForwardBlock {
 public:
  virtual ~FeedForwardBlock() = default;
  virtual void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) = 0;  // x (B,T,C); added to out
  virtual void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) = 0;
  // Scales of the auxiliary terms for the next forwards (MoE only).
  virtual void set_loss_scales(const LossScales&) {}
  // Key prefixes of what the block's replay (Ctx::replay) reads from its first forward, kept
  // when a recomputed layer's activations are handed back (a MoE layer's routing decisions).
  // Read once, when the decoder layer is built.
  virtual std::vector<std::string> kept_for_replay() const { return {}; }
  // Routing statistics, or null for a dense block.
  virtual RoutingStats* routing() { return nullptr; }
  // The auxiliary-loss-free balancing of DeepSeek-V3: each routing bias moves by gamma
  // towards balance given the experts' token counts over the global batch.
  virtual void update_routing_bias(const std::vector<int64_t>& global_tokens_per_expert, double gamma) {}
};

// Grouped-query attention with fused q/k/v projection weights. Sharded: this rank's query
// heads and their key/value heads (column-parallel q/k/v, row-parallel o_proj).
class GQAttention : public AttentionBlock {
 public:
  GQAttention(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer);
  void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) override;
  void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) override;

 private:
  ParamRegistry& reg_;
  std::string key_;  // "layers.{layer}.attn."
  ActKey qkv_key_, out_key_, lse_key_;  // key_ + "qkv", "out", "lse"
  ActKey datt_slot_ = act_key("attn.datt"), dqkv_slot_ = act_key("attn.dqkv");
  RowParallelSlots partial_{"attn.partial"};
  BlockGradSlots grad_slots_;
  ops::AttentionLayout layout_;
  int q_, k_, v_, o_;  // parameter ids
  float scale_;
  bool sharded_;
  // Stored per micro-batch: qkv (B,T,(H+2Hkv)*D) post-rope and out (B,T,H*D) in the compute
  // dtype, lse (B,H,T) in fp32.
};

// SwiGLU MLP with fused gate/up projection weights. Sharded: this rank's columns of the
// intermediate size (column-parallel gate/up, row-parallel down).
class SwiGLUMLP : public FeedForwardBlock {
 public:
  SwiGLUMLP(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer);
  void forward(const Ctx& ctx, int mb, Tensor x, Tensor out) override;
  void backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) override;

 private:
  ParamRegistry& reg_;
  std::string key_;  // "layers.{layer}.mlp."
  ActKey gate_up_key_, h_key_;  // key_ + "gate_up", "h"
  ActKey dh_slot_ = act_key("mlp.dh"), dgate_up_slot_ = act_key("mlp.dgate_up");
  RowParallelSlots partial_{"mlp.partial"};
  BlockGradSlots grad_slots_;
  int gate_, up_, down_;
  int64_t inter_;  // local columns of the intermediate size
  bool sharded_;
  // Stored per micro-batch, in the compute dtype: gate_up (B*T,2I), h (B*T,I).
};

// Tensor parallelism inside a block. A block's forward reads x (B,T,C), all the micro-batch's
// token rows, and adds its output to `out`, the rows this rank holds of the residual stream:
// all of them, or with sequence parallelism (ctx.sequence_parallel) rows ctx.token_rows(N).
// Its backward gets x again, dout and dx for the same rows as out.
//
// The (n, C) rows of every tensor rank gathered, in rank order, into the (N, C) rows of the
// micro-batch (in ctx.scratch under `slot`); without sequence parallelism `rows` itself.
Tensor sp_gather(const Ctx& ctx, Tensor rows, ActKey slot);

// A gradient as a layer's backward products take it. The residual stream's and the loss's
// gradients are fp32; with bf16 compute they are rounded once to bf16 into scratch `slot` (where
// PyTorch's autocast rounds them, at the cast into the layer), so the layer's two products run
// on bf16 operands rather than in fp32. Otherwise (fp32, fp16 compute) `t` itself.
Tensor in_compute_dtype(const Ctx& ctx, Tensor t, ActKey slot);
// The sum over the tensor group of partial (N, C): all of it, in place, or with sequence
// parallelism this rank's rows (n, C), in ctx.scratch under `slot`.
Tensor reduce_over_tensor_group(const Ctx& ctx, Tensor partial, ActKey slot);
// Row-parallel output: out (this rank's rows) += x (N,K) · w^T summed over the tensor group: an
// all-reduce, or with sequence parallelism a reduce-scatter, of an fp32 partial in ctx.scratch
// under `slots`; unsharded it is one accumulating GEMM.
void row_parallel_forward(const Ctx& ctx, bool sharded, Tensor out, Tensor x, Tensor w, const RowParallelSlots& slots);
// The input gradient of a column-parallel projection is summed over the tensor group:
// column_parallel_grad gives where to form this rank's partial gradient of all of x's rows (dx
// itself, when it is fp32 and holds all rows, else an fp32 temporary shaped like x in
// ctx.scratch under `slot`), and reduce_column_parallel_grad sums it over the group (all-reduce,
// or reduce-scatter into dx's rows with sequence parallelism), rounding into dx when it was the
// temporary (through scratch `mine` with sequence parallelism). Unsharded, the pair is dx and
// nothing.
Tensor column_parallel_grad(const Ctx& ctx, bool sharded, Tensor dx, Tensor x, ActKey slot);
void reduce_column_parallel_grad(const Ctx& ctx, Tensor partial, Tensor dx, ActKey mine);

// Registers a linear weight's tensor-parallel piece: the local (rows, cols) piece of the global
// matrix split along `dim` (0: column-parallel, by output rows; 1: row-parallel, by input
// columns); whole when the shard is (then exactly the registration of an unsharded model).
int add_tp_piece(ParamRegistry& reg, const std::string& name, Shape local, Shape global, int dim, const ShardSpec& shard,
                 int layer, bool follow_previous = false);

// The micro-batch's (B, T), kept in the activation store's meta under this name by the model's
// forward: with sequence parallelism the residual stream's tensors are this rank's rows (n, C)
// only.
inline constexpr const char* kBatchShapeKey = "batch_shape";

class DecoderLayer {
 public:
  DecoderLayer(const ModelConfig& c, ParamRegistry& reg, int layer, std::unique_ptr<AttentionBlock> attn,
               std::unique_ptr<FeedForwardBlock> ffn);
  // x_in (B,T,C), or this rank's rows (n,C) with sequence parallelism, must stay alive and
  // unchanged until backward; x_out (same shape) is written.
  void forward(const Ctx& ctx, int mb, Tensor x_in, Tensor x_out);
  // dx: gradient w.r.t. x_out on entry, w.r.t. x_in on return.
  void backward(const Ctx& ctx, int mb, Tensor dx);
  FeedForwardBlock& ffn() { return *ffn_; }
  // Hands micro-batch mb's activations of this layer back to the store's pool: all of them, or
  // with `for_replay` all but what its replay reads from the first forward.
  void release_activations(ActivationStore& acts, int mb, bool for_replay) const;
  // Parameter ids [first, last] of this layer, for the parameter hooks.
  void set_param_range(int first, int last) {
    first_param_ = first;
    last_param_ = last;
  }
  int first_param() const { return first_param_; }
  int last_param() const { return last_param_; }

 private:
  ParamRegistry& reg_;
  std::string key_;  // "layers.{layer}."
  // Interned when the layer is built (after its blocks, which intern theirs): what it keeps,
  // and what a forward to be replayed hands back (all but the blocks' kept_for_replay).
  ActKey x_in_key_, ln1_key_, rstd1_key_, x_mid_key_, ln2_key_, rstd2_key_, batch_shape_key_;
  std::vector<ActKey> all_keys_, replay_keys_;
  ActKey input_slot_ = act_key("layer.input"), dln_slot_ = act_key("layer.dln");
  ActKey recompute_ln_slot_ = act_key("recompute.ln"), recompute_rstd_slot_ = act_key("recompute.rstd");
  float eps_;
  int ln1_, ln2_;
  int first_param_ = 0, last_param_ = -1;
  std::unique_ptr<AttentionBlock> attn_;
  std::unique_ptr<FeedForwardBlock> ffn_;
  // Stored per micro-batch, for this rank's n rows: ln1 (n,C) and ln2 (n,C) in the compute
  // dtype; rstd1 (n), x_mid (n,C), rstd2 (n) in fp32; and (meta) the view of x_in (fp32, the
  // residual). With sequence parallelism the blocks' input (all rows) is gathered from ln1/ln2
  // again for their backward rather than kept.
};

}  // namespace dstrain
