// The decoder-only transformer of DeepSeek-LLM (Hugging Face LlamaForCausalLM), with an
// explicit forward and backward:
//   x = embed(tokens)
//   per layer: x = x + o_proj(attn(rope(qkv_proj(rmsnorm(x)))))
//              x = x + down_proj(silu(gate_proj(h)) * up_proj(h)),  h = rmsnorm(x)
//   logits = lm_head(rmsnorm(x))
// Layers hold views into the parameter registry and keep their activations in the
// activation store of the model's Ctx, keyed by micro-batch. The attention and feed-forward
// parts sit behind small interfaces so that MLA and MoE layers slot into the same decoder
// layer.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <unordered_map>
#include <vector>

#include "model/layers.h"
#include "model/model_config.h"
#include "model/stage.h"
#include "state/params.h"

namespace dstrain {

// Sum of token losses and the number of tokens that had a target; for models with
// multi-token prediction the same per depth.
struct LossSums {
  double sum = 0;
  int64_t count = 0;
  std::vector<double> mtp_sum;
  std::vector<int64_t> mtp_count;
  int64_t correct = 0;  // evaluation: targets the model ranks first (token accuracy)
  double mean() const { return count ? sum / double(count) : 0.0; }
  double accuracy() const { return count ? double(correct) / double(count) : 0.0; }
};

// Called during the backward each time the gradients of parameters [first, last] are final
// for this micro-batch, in the order they become ready (last layer first). The same meaning
// as ParamHooks::grad_ready.
using GradReadyFn = std::function<void(int first, int last)>;

// Which part of a micro-batch's backward runs now: everything, or the input gradients with
// the weight gradients of linear maps left for backward_weights (zero-bubble schedules).
enum class BackwardPart { Full, Input };

// Activation recomputation of whole decoder layers (Megatron-Core's recompute_granularity
// "full"): a recomputed group of layers keeps only its input residual (and a MoE layer its
// routing decisions) during the forward, and runs its forward again, in the same order with
// the same ops, right before its backward. Megatron's methods, per pipeline chunk: "uniform"
// recomputes every group of num_layers consecutive layers as a unit (only the group's input is
// kept); "block" recomputes each of the first num_layers layers on its own and keeps the rest.
// In the chunk that holds the head the last group is not recomputed: its backward comes right
// after the head's, so its activations would be made again at once, for no lower peak.
// cpu_checkpointing (DeepSpeed's name) keeps each recomputed group's input residual in
// page-locked host memory (MemCategory::OffloadedActivations) from the end of the group's
// forward until its replay, copied there and back with the same transfer op on any device.
//
// Selective recomputation (Megatron-Core's recompute_granularity "selective" with its
// recompute_modules names) keeps the layers' other activations and forms these again in the
// backward, with the same op: "layernorm", the two norms' outputs of every decoder layer (from
// the residual, whose rstd is kept); "moe_act", the routed experts' SwiGLU output (from their
// gate|up); "mla_up_proj", MLA's per-head q|k|v (q_b_proj or q_proj, kv_b_proj, the copies of
// k_pe and the rope, from the normed latents, which are kept, and k_pe, kept before the rope:
// model/mla.h), an error on a model without MLA. The attention core ("core_attn") keeps no
// scores or probabilities in any case: the fused kernel keeps q|k|v, its output and a
// log-sum-exp per row and forms the rest again.
struct RecomputePolicy {
  enum class Method { Uniform, Block };
  bool full = false;
  Method method = Method::Uniform;
  int64_t num_layers = 1;
  bool layernorm = false;
  bool moe_act = false;
  bool mla_up_proj = false;
  bool cpu_checkpointing = false;  // with `full` only
};

class Transformer {
 public:
  // The whole model on one rank.
  Transformer(const ModelConfig& config, Device device);
  // This rank's piece of the model (see ShardSpec), with the groups its layers reduce over, and
  // the pipeline stages it holds (its chunks, in chunk order: one, or several for interleaved
  // and DualPipeV schedules; empty: the whole model as one chunk). A rank holds the parameters
  // of its chunks' pieces, and a copy (ParamInfo::pipeline_copy) of the embedding when its
  // last-stage chunk reads it (a tied head, the MTP modules) without holding the first stage.
  Transformer(const ModelConfig& config, Device device, const ShardSpec& shard, ProcessGroups groups = {},
              std::vector<StageSpec> chunks = {});
  // Layers hold references into the registry: a model stays where it was built.
  Transformer(const Transformer&) = delete;
  Transformer& operator=(const Transformer&) = delete;
  const ModelConfig& config() const { return config_; }
  const ShardSpec& shard() const { return shard_; }
  ParamRegistry& params() { return reg_; }
  const ParamRegistry& params() const { return reg_; }
  // Where ZeRO-3 gathers and gradient buckets plug in (null: none); not owned.
  void set_hooks(ParamHooks* hooks) { ctx_.hooks = hooks; }
  const Ctx& ctx() const { return ctx_; }
  // Mixed precision: the dtype the forward and backward compute in (F32, BF16 or F16). The
  // masters, gradients and optimizer state stay fp32; a 16-bit dtype makes the registry's
  // compute copy of the weights (from the masters as they are now: set it after loading them,
  // or call params().refresh_compute() after changing them), which the GEMMs read (but the
  // MoE router's, fp32 as Hugging Face's MoEGate), and stores the activations that only feed
  // GEMMs in that dtype, the residual stream, norms' rstd, logits and loss in fp32.
  void set_compute_dtype(DType dtype);
  DType compute_dtype() const { return ctx_.compute_dtype; }
  const ActivationStore& activations() const { return acts_; }
  // The recomputed groups' inputs held in host memory (RecomputePolicy::cpu_checkpointing).
  const ActivationStore& offloaded_activations() const { return offloaded_; }
  // Which layers are recomputed in the backward (none by default).
  void set_recompute(const RecomputePolicy& policy);
  // On the meta device: this rank's experts receive `ratio` x a balanced share of the rows
  // (Ctx::expert_imbalance).
  void set_expert_imbalance(double ratio) { ctx_.expert_imbalance = ratio; }
  const RecomputePolicy& recompute() const { return recompute_; }

  // Hugging Face's initialisation: normal(0, initializer_range) for linear and embedding
  // weights, ones for norms; each tensor from its own counter-based stream.
  void init_weights(uint64_t seed);

  // Training by micro-batch. Several micro-batches may be in flight: forward(mb) keeps what
  // backward(mb) needs in the activation store under mb; backward(mb) releases it.
  //
  // tokens, targets: (B,T) int32. Runs the forward of micro-batch mb and the backward of its
  // vocabulary head (fused, chunk by chunk) and of the multi-token-prediction modules, and
  // returns the loss sums. MoE layers add their auxiliary terms to their routing statistics.
  LossSums forward(int mb, Tensor tokens, Tensor targets, const LossScales& scales);
  // The rest of mb's backward: accumulates the gradient of its share of the step's loss (CE,
  // auxiliary terms, MTP; scaled as the forward's `scales` said). With BackwardPart::Input
  // the weight gradients of the layers' linear maps are queued for backward_weights(mb), and
  // the grad_ready hooks of what this backward touched fire there instead of here. (The
  // head's and the MTP modules' gradients were formed whole in the forward; the MTP modules'
  // grad_ready fires first thing in this backward, so that a micro-step's reports all come
  // from its backward.)
  void backward(int mb, BackwardPart part = BackwardPart::Full);
  void backward_weights(int mb);

  // Pipeline stages: the same, one chunk at a time. forward_chunk runs chunk `chunk` of
  // micro-batch mb from the embedding of tokens (the first stage) or from `in`, the previous
  // stage's output (boundary_shape(B, T), fp32), and on the last stage the head, the loss and
  // the MTP modules as forward() does, returning their sums (empty elsewhere). tokens and
  // targets are the micro-batch's on every stage.
  LossSums forward_chunk(int mb, int chunk, Tensor tokens, Tensor targets, const LossScales& scales, Tensor in = {});
  // Training steps read their losses from the device once, with their other scalars, instead
  // of once per micro-batch: while `into` is defined (F64, loss_sums_size() elements on the
  // model's device, zeroed by the caller), forward() and forward_chunk() add each micro-batch's
  // loss sums into it, in the layout sums_from() reads, and return empty sums. An undefined
  // tensor ends it.
  void accumulate_losses_into(Tensor into);
  // {sum, count} of the main loss, then {sum, count} per MTP depth this rank holds.
  int64_t loss_sums_size() const { return 2 + 2 * int64_t(mtp_.size()); }
  // LossSums from a host copy of such sums (loss_sums_size() values).
  LossSums sums_from(const double* h, bool with_mtp) const;
  // The chunk's output for the next stage (boundary_shape), kept until its backward of mb.
  Tensor chunk_output(int mb, int chunk) const;
  // From dout, the gradient of chunk_output (none on the last stage), to din, the gradient of
  // `in` (none on the first stage; written, fp32).
  void backward_chunk(int mb, int chunk, Tensor dout, Tensor din, BackwardPart part = BackwardPart::Full);
  void backward_weights_chunk(int mb, int chunk);
  // What travels between stages for a (B, T) micro-batch: the residual stream, (B, T, C), or
  // this rank's rows (n, C) with sequence parallelism (an inference batch whose rows do not
  // split runs without it).
  Shape boundary_shape(int64_t B, int64_t T, bool inference = false) const;
  // Inference through a pipeline: out (boundary_shape) = the output of chunk `chunk` (not the
  // last stage) for tokens, from `in` unless the chunk holds the embedding.
  void forward_hidden(int chunk, Tensor tokens, Tensor in, Tensor out);
  // forward_loss and last_logits of the chunk holding the head, from `in` (the previous
  // stage's output) unless it also holds the embedding.
  LossSums forward_loss(Tensor tokens, Tensor targets, Tensor in);
  void last_logits(Tensor tokens, Tensor logits, Tensor in);
  const std::vector<StageSpec>& chunks() const { return chunks_; }
  int num_chunks() const { return int(chunks_.size()); }
  // The chunk holding the head (the last stage), -1 when none.
  int head_chunk() const;

  // forward(0) then backward(0), with `ready` called as the gradients become final.
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
  // The MTP modules this rank holds (those of the last stage).
  int mtp_depth() const { return int(mtp_.size()); }
  // The whole model as one stage, and a stage's contiguous range of parameter ids in the
  // whole model's registry; the weights its pieces share (tied_params).
  std::vector<StageSpec> stages() const { return split_stages(config_, 1); }
  Range stage_params(const StageSpec& s) const { return stage_param_range(reg_, s, config_); }
  // Bytes of activations and backward temporaries one micro-batch of (B, T) needs under the
  // compute dtype and recompute policy, at their peaks: from a twin of this rank's piece that
  // runs the micro-batch's forward and backward on the meta device (no memory, no compute).
  // The whole step of a rank, with its schedule, its optimizer and every other category, is
  // the memory model's (train/memory_model.h).
  int64_t activation_bytes(int64_t B, int64_t T) const;
  // Frees every activation buffer, in flight or pooled, and the backward temporaries (they
  // are reallocated at the next forward's size).
  void release_activations();

 private:
  // The micro-batch key of forwards without a backward (evaluation, generation).
  static constexpr int kInferenceMb = -1;
  // The activation store's key of (micro-batch, chunk).
  int slot(int mb, int chunk) const { return mb == kInferenceMb ? kInferenceMb : mb * num_chunks() + chunk; }
  // Runs stage s of micro-batch slot `slot`: "residual.{first_layer}" from the embedding of
  // tokens or a copy of `in`, its layers, and with the head "final_norm.out" (B,T,C).
  void forward_body(int slot, const StageSpec& s, Tensor tokens, Tensor in = {});
  // Whether the token rows between the blocks are split over the tensor group (sequence
  // parallelism): in training always, in inference when they divide.
  bool rows_split(int64_t B, int64_t T, bool inference) const;
  // The recomputed group [first, end) of chunk s holding layer l, or {l, l} when l keeps its
  // activations.
  std::pair<int, int> recompute_group(const StageSpec& s, int l) const;
  // Runs the forward of layers [first, end) of micro-batch `slot` again (Ctx::replay), from
  // "residual.{first}", remaking the activations their backward reads.
  void replay_layers(int slot, int first, int end);
  // cpu_checkpointing: the stored tensor `key` of micro-batch `slot` moves to host memory
  // (offloaded_), and back into the activation store.
  void offload(int slot, ActKey key);
  void bring_back(int slot, ActKey key);
  // Errors unless this rank holds the whole model as one chunk (`what` needs it).
  void require_whole_model(const char* what) const;
  // forward_body of the chunk holding the head for inference.
  void forward_head_body(Tensor tokens, Tensor in);
  // Chunked vocabulary projection and cross-entropy of x (N,C) against targets (N); with
  // backward, dx (N,C) is overwritten with scale x d(sum of losses)/dx. sums (2) F64 +=
  // {sum of losses, count} over the targets that are not ignored.
  // `correct` (evaluation; null in training): += the targets whose logit is the row's largest.
  void head(Tensor x, Tensor targets, bool backward, float scale, Tensor dx, Tensor sums, int64_t* correct = nullptr);
  // Logits (N, V) of the whole vocabulary for x (N, C) (inference; gathered over the tensor
  // group when the vocabulary is split).
  void gather_logits(Tensor x, Tensor logits);
  // The residual stream's shape for a (B, T) micro-batch: (B, T, C), or this rank's rows (n, C)
  // with sequence parallelism.
  Shape residual_shape(int64_t B, int64_t T) const;
  // out (the rank's rows) = the embedding of tokens (B, T), vocabulary-parallel when split; and
  // its backward from the gradient of those rows.
  void embed(Tensor out, Tensor tokens);
  void embed_backward(Tensor dout, Tensor tokens);
  // The loss sums of micro-batch mb on the device, zeroed, and their one read by the host.
  Tensor zeroed_sums(int mb);
  LossSums read_sums(Tensor sums, bool with_mtp) const;
  // One multi-token-prediction depth: its parameters; its activations are keyed by
  // "layers.{layer}.mtp.{name}" in the store.
  struct MtpModule {
    int enorm = -1, hnorm = -1, eh_proj = -1, head_norm = -1;
    int first_param = 0, last_param = -1;
    int layer_index = 0;
    std::unique_ptr<DecoderLayer> layer;
    struct Keys {
      ActKey inputs, targets, emb, cat, hnorm, e_rstd, h_rstd, h_in, h_out, out_norm, out_rstd;
    } keys;
    std::vector<ActKey> all_keys;  // "layers.{layer}.": these and its decoder layer's
  };
  // What the model keeps per micro-batch besides its layers, interned at construction.
  struct Keys {
    ActKey tokens = act_key("tokens"), batch_shape = act_key(kBatchShapeKey), targets = act_key("targets");
    ActKey final_norm_out = act_key("final_norm.out"), final_norm_rstd = act_key("final_norm.rstd");
    ActKey head_dxf = act_key("head.dxf"), loss_sums = act_key("loss_sums");
    std::vector<ActKey> residual;  // "residual.{l}", l = 0 .. num_hidden_layers
    std::vector<ActKey> head;      // head.dxf and final_norm.*: done with after the head's backward
  };
  // The model's scratch slots (some shared with the layers': "tp.dx.mine").
  struct Slots {
    ActKey recompute_out = act_key("recompute.out"), residual_grad = act_key("residual.grad");
    ActKey embed_partial = act_key("embed.partial"), embed_mine = act_key("embed.mine");
    ActKey embed_dout = act_key("embed.dout"), tp_dx_mine = act_key("tp.dx.mine");
    ActKey head_x = act_key("head.x"), head_dx = act_key("head.dx"), head_dlogits16 = act_key("head.dlogits16");
    ActKey head_losses = act_key("head.losses"), head_logits = act_key("head.logits"), head_lse = act_key("head.lse");
    ActKey head_stats = act_key("head.stats"), head_all_stats = act_key("head.all_stats");
    ActKey head_max_and_target = act_key("head.max_and_target");
    ActKey logits_mine = act_key("logits.mine"), logits_all = act_key("logits.all");
    ActKey logits_last_x = act_key("logits.last_x");
    ActKey mtp_enorm = act_key("mtp.enorm"), mtp_dh = act_key("mtp.dh"), mtp_dh16 = act_key("mtp.dh16");
    ActKey mtp_dcat = act_key("mtp.dcat"), mtp_de = act_key("mtp.de"), mtp_dhn = act_key("mtp.dhn");
    ActKey mtp_demb = act_key("mtp.demb");
    std::vector<ActKey> mtp_d_out;  // "mtp.{k}.d_out" per depth
  };
  void mtp_forward_backward(int mb, const LossScales& scales, Tensor targets, Tensor dxf, Tensor sums);
  // The hook that the gradients of [first, last] are final: now, or with a split backward
  // after backward_weights(mb).
  void grad_ready(int mb, int first, int last);
  int head_param() const { return lm_head_ >= 0 ? lm_head_ : embed_; }
  Tensor head_weight() const;
  Tensor head_grad() const;

  ModelConfig config_;
  ShardSpec shard_;
  ParamRegistry reg_;
  int embed_, final_norm_, lm_head_;
  std::vector<StageSpec> chunks_;
  std::vector<DecoderLayer> layers_;  // the decoder layers this rank holds, in order
  std::vector<int> local_layer_;      // decoder layer index -> position in layers_ (-1: not held)
  DecoderLayer& layer(int l) { return layers_[size_t(local_layer_[size_t(l)])]; }
  std::vector<MtpModule> mtp_;
  Tensor loss_accumulator_;  // accumulate_losses_into
  Keys keys_;
  Slots slots_;
  RopeCache rope_;
  ActivationStore acts_;
  ActivationStore offloaded_;  // cpu_checkpointing: page-locked host memory
  WeightGradStore wgrad_;
  Scratch scratch_;
  PhaseTimer phases_;  // ctx_.phases: marks forward and backward; the trainer adds the optimizer
  Ctx ctx_;
  // Parameter ranges whose grad_ready waits for backward_weights, by micro-batch.
  std::map<int, std::vector<std::pair<int, int>>> ready_after_weights_;
  int split_mb_ = -1;  // the micro-batch whose backward is split, while it runs
  RecomputePolicy recompute_;
};

}  // namespace dstrain
