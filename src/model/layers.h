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
  void reset() {
    std::fill(tokens_per_expert.begin(), tokens_per_expert.end(), 0);
    aux_loss = route_seconds = permute_seconds = 0;
  }
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
  int gate_, up_, down_;
  int64_t inter_;  // local columns of the intermediate size
  bool sharded_;
  // Stored per micro-batch, in the compute dtype: gate_up (B*T,2I), h (B*T,I).
};

// Row-parallel output: out += x · w^T, summed over the tensor group first when the layer is
// sharded (through a temporary in ctx.scratch); unsharded it is one accumulating GEMM.
void row_parallel_forward(const Ctx& ctx, bool sharded, Tensor out, Tensor x, Tensor w, const char* slot);
// The input gradient dx of a column-parallel projection is summed over the tensor group. MPI
// sums fp32 only: column_parallel_grad gives where to form the local gradient (dx itself, or,
// for a 16-bit dx of a sharded layer, an fp32 temporary in ctx.scratch under `slot`), and
// reduce_column_parallel_grad sums it over the group and rounds it into dx when it was the
// temporary. Unsharded, the pair is dx and nothing.
Tensor column_parallel_grad(const Ctx& ctx, bool sharded, Tensor dx, const char* slot);
void reduce_column_parallel_grad(const Ctx& ctx, Tensor partial, Tensor dx);

class DecoderLayer {
 public:
  DecoderLayer(const ModelConfig& c, ParamRegistry& reg, int layer, std::unique_ptr<AttentionBlock> attn,
               std::unique_ptr<FeedForwardBlock> ffn);
  // x_in (B,T,C) must stay alive and unchanged until backward; x_out (B,T,C) is written.
  void forward(const Ctx& ctx, int mb, Tensor x_in, Tensor x_out);
  // dx: gradient w.r.t. x_out on entry, w.r.t. x_in on return.
  void backward(const Ctx& ctx, int mb, Tensor dx);
  FeedForwardBlock& ffn() { return *ffn_; }
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
  float eps_;
  int ln1_, ln2_;
  int first_param_ = 0, last_param_ = -1;
  std::unique_ptr<AttentionBlock> attn_;
  std::unique_ptr<FeedForwardBlock> ffn_;
  // Stored per micro-batch: ln1 (B,T,C) and ln2 (B,T,C) in the compute dtype; rstd1 (B,T),
  // x_mid (B,T,C), rstd2 (B,T) in fp32; and (meta) the view of x_in (fp32, the residual).
};

}  // namespace dstrain
