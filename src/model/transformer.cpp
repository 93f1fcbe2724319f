#include "model/transformer.h"

#include <algorithm>
#include <cmath>

#include "backend/meta.h"
#include "comm/shape_only_comm.h"
#include "model/init.h"
#include "model/mla.h"
#include "model/moe.h"

#include <chrono>

namespace dstrain {

// ---------------------------------------------------------------------------------------
Transformer::Transformer(const ModelConfig& config, Device device)
    : Transformer(config, device, ShardSpec::whole(config)) {}

namespace {
// Errors unless the chunks are distinct stages of one split that hold whole pieces.
void check_chunks(const ModelConfig& c, const std::vector<StageSpec>& chunks) {
  std::vector<int> owner(size_t(c.num_hidden_layers), -1);
  for (size_t k = 0; k < chunks.size(); ++k) {
    const StageSpec& s = chunks[k];
    DS_CHECK(s.first_layer >= 0 && s.first_layer <= s.end_layer && s.end_layer <= c.num_hidden_layers,
             "{}: layers [{}, {}) outside the model's {}", s.str(), s.first_layer, s.end_layer, c.num_hidden_layers);
    DS_CHECK(!s.mtp || s.head, "{}: the MTP modules go with the head", s.str());
    for (int l = s.first_layer; l < s.end_layer; ++l) {
      DS_CHECK(owner[size_t(l)] < 0, "layer {} is in two chunks of this rank ({} and {})", l, owner[size_t(l)], k);
      owner[size_t(l)] = int(k);
    }
  }
}
}  // namespace

Transformer::Transformer(const ModelConfig& config, Device device, const ShardSpec& shard, ProcessGroups groups,
                         std::vector<StageSpec> chunks)
    : config_(config),
      shard_(shard),
      chunks_(chunks.empty() ? split_stages(config, 1) : std::move(chunks)),
      acts_(device),
      offloaded_(MemCategory::OffloadedActivations, /*pinned_host=*/true, device),
      wgrad_(device),
      scratch_(device),
      phases_(device) {
  const ModelConfig& c = config_;
  check_chunks(c, chunks_);
  // The model's own keys: the residual stream after each layer and the head's.
  for (int64_t l = 0; l <= c.num_hidden_layers; ++l) keys_.residual.push_back(act_key(fmt::format("residual.{}", l)));
  keys_.head = {keys_.head_dxf, keys_.final_norm_out, keys_.final_norm_rstd};
  auto any_chunk = [&](bool StageSpec::*what) {
    return std::any_of(chunks_.begin(), chunks_.end(), [&](const StageSpec& s) { return s.*what; });
  };
  const bool has_embedding = any_chunk(&StageSpec::embedding), has_head = any_chunk(&StageSpec::head);
  const bool has_mtp = any_chunk(&StageSpec::mtp) && c.num_nextn_predict_layers > 0;
  DS_CHECK(ProcessGroups::size_of(groups.tp) == shard.tp_size,
           "the tensor-parallel group has {} ranks but the shard is one of {} pieces", ProcessGroups::size_of(groups.tp),
           shard.tp_size);
  ctx_.device = device;
  ctx_.sequence_parallel = shard.sequence_parallel && shard.tp_size > 1;
  ctx_.stream.device = device;
  ctx_.groups = groups;
  ctx_.acts = &acts_;
  ctx_.wgrad = &wgrad_;
  ctx_.scratch = &scratch_;
  ctx_.rope = &rope_;
  ctx_.phases = &phases_;
  // The embedding and the head: this rank's rows of the vocabulary (vocabulary-parallel).
  auto vocab_rows = [&](const char* name, ParamKind kind, bool pipeline_copy = false) {
    ParamOptions o;
    o.pipeline_copy = pipeline_copy;
    if (shard.tp_size > 1) {
      o.placement.kind = Placement::Kind::Shard;
      o.placement.dim = 0;
      o.placement.axis = "tensor";
      o.placement.index = shard.tp_rank;
      o.placement.count = shard.tp_size;
      o.global_shape = Shape{c.vocab_size, c.hidden_size};
    }
    return reg_.add(name, {shard.vocab.size(), c.hidden_size}, kind, -1, o);
  };
  // The last stage reads the embedding for a tied head and for the MTP modules' inputs.
  const bool reads_embedding = has_embedding || (has_head && c.tie_word_embeddings) || has_mtp;
  embed_ = reads_embedding ? vocab_rows("model.embed_tokens.weight", ParamKind::Embedding, !has_embedding) : -1;
  layers_.reserve(size_t(c.num_hidden_layers));
  // DeepSeek-LLM: GQA + SwiGLU; DeepSeek-V2/V3: MLA + DeepSeekMoE (dense in the first layers).
  auto make_layer = [&](int l) {
    const int first = reg_.size();
    std::unique_ptr<AttentionBlock> attn;
    if (c.mla()) {
      attn = std::make_unique<MLAttention>(c, shard_, reg_, l);
    } else {
      attn = std::make_unique<GQAttention>(c, shard_, reg_, l);
    }
    std::unique_ptr<FeedForwardBlock> ffn;
    if (c.is_moe_layer(l)) {
      ffn = std::make_unique<MoEBlock>(c, shard_, reg_, l);
    } else {
      ffn = std::make_unique<SwiGLUMLP>(c, shard_, reg_, l);
    }
    auto layer = std::make_unique<DecoderLayer>(c, reg_, l, std::move(attn), std::move(ffn));
    layer->set_param_range(first, reg_.size() - 1);
    return layer;
  };
  local_layer_.assign(size_t(c.num_hidden_layers), -1);
  for (int l = 0; l < int(c.num_hidden_layers); ++l) {
    const bool held = std::any_of(chunks_.begin(), chunks_.end(),
                                  [&](const StageSpec& s) { return l >= s.first_layer && l < s.end_layer; });
    if (!held) continue;
    local_layer_[size_t(l)] = int(layers_.size());
    layers_.push_back(std::move(*make_layer(l)));
  }
  final_norm_ = has_head ? reg_.add("model.norm.weight", {c.hidden_size}, ParamKind::Norm, -1) : -1;
  lm_head_ = has_head && !c.tie_word_embeddings ? vocab_rows("lm_head.weight", ParamKind::Head) : -1;
  // Multi-token prediction modules, stored as the layers after the last one (as DeepSeek-V3's
  // checkpoints do); they share the embedding and the head.
  for (int k = 0; has_mtp && k < int(c.num_nextn_predict_layers); ++k) {
    const int l = int(c.num_hidden_layers) + k;
    MtpModule m;
    m.layer_index = l;
    // Interned before its decoder layer, so that the layer's keys ("layers.{l}.") hold them too
    // in every model of the process.
    auto key = [&](const char* what) { return act_key(fmt::format("layers.{}.mtp.{}", l, what)); };
    m.keys = {key("inputs"), key("targets"), key("emb"),   key("cat"),      key("hnorm"),   key("e_rstd"),
              key("h_rstd"), key("h_in"),    key("h_out"), key("out_norm"), key("out_rstd")};
    m.first_param = reg_.size();
    m.enorm = reg_.add(layer_name(l, "enorm.weight"), {c.hidden_size}, ParamKind::Norm, l);
    m.hnorm = reg_.add(layer_name(l, "hnorm.weight"), {c.hidden_size}, ParamKind::Norm, l);
    m.eh_proj = reg_.add(layer_name(l, "eh_proj.weight"), {c.hidden_size, 2 * c.hidden_size}, ParamKind::Linear, l);
    m.layer = make_layer(l);
    m.head_norm = reg_.add(layer_name(l, "shared_head.norm.weight"), {c.hidden_size}, ParamKind::Norm, l);
    m.all_keys = act_keys_with_prefix(fmt::format("layers.{}.", l));
    slots_.mtp_d_out.push_back(act_key(fmt::format("mtp.{}.d_out", k)));
    m.last_param = reg_.size() - 1;
    mtp_.push_back(std::move(m));
  }
  // With sequence parallelism every replicated parameter (norms, the router, routed experts,
  // MTP's projection) sees only this rank's token rows: its gradient is a partial sum.
  for (int id = 0; ctx_.sequence_parallel && id < reg_.size(); ++id) {
    const ParamInfo& p = reg_.info(id);
    if (p.placement.held_whole() && p.trainable) reg_.set_tp_partial_grad(id, true);
  }
  reg_.allocate(device);
}

namespace {
// normal(0, std) values of the global tensor at the elements this rank's piece holds, so that a
// sharded model starts from the same weights as the whole one.
void fill_normal_piece(Tensor x, const ParamInfo& p, double std, uint64_t seed) {
  const uint64_t stream = stream_id(p.name);
  // A whole tensor, or one expert of several (itself whole, under its own name).
  if (p.placement.held_whole()) {
    ops::fill_normal(x, std, seed, stream, 0);
    return;
  }
  DS_CHECK(p.placement.kind == Placement::Kind::Shard && x.ndim() == 2 && (p.placement.dim == 0 || p.placement.dim == 1),
           "{}: initialising a piece placed as {} along dim {} is not implemented", p.name, int(p.placement.kind),
           p.placement.dim);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (p.placement.dim == 0) {  // rows [index*rows, ...): contiguous in the global tensor
    ops::fill_normal(x, std, seed, stream, uint64_t(p.placement.index * rows * cols));
    return;
  }
  const int64_t global_cols = p.global_shape[1], c0 = p.placement.index * cols;
  for (int64_t r = 0; r < rows; ++r) {
    ops::fill_normal(x.slice(r, r + 1), std, seed, stream, uint64_t(r * global_cols + c0));
  }
}
}  // namespace

void Transformer::init_weights(uint64_t seed) {
  for (int id = 0; id < reg_.size(); ++id) {
    const ParamInfo& p = reg_.info(id);
    if (p.kind == ParamKind::Norm) {
      ops::fill(reg_.param(id), 1.0f);
    } else if (p.kind == ParamKind::RouterBias) {
      ops::fill(reg_.param(id), 0.0f);
    } else {
      fill_normal_piece(reg_.param(id), p, config_.initializer_range, seed);
    }
  }
  reg_.refresh_compute();
}

void Transformer::set_compute_dtype(DType dtype) {
  reg_.allocate_compute(dtype);
  ctx_.compute_dtype = dtype;
}

// The head is a GEMM: it reads the compute copy (the embedding's, when tied).
Tensor Transformer::head_weight() const { return reg_.compute(lm_head_ >= 0 ? lm_head_ : embed_); }
Tensor Transformer::head_grad() const { return reg_.grad(lm_head_ >= 0 ? lm_head_ : embed_); }

int64_t Transformer::head_chunk_rows() const {
  // About 64 MiB of logits at a time.
  const int64_t rows = (int64_t(16) << 20) / shard_.vocab.size();
  return std::max<int64_t>(rows, 32);
}

int64_t Transformer::activation_bytes(int64_t B, int64_t T) const {
  // A twin of this rank's piece on the meta device (backend/meta.h) runs one micro-batch's
  // forward and backward under the same compute dtype and recompute policy: what it allocates
  // is what the layers save, by construction.
  meta::ensure_registered();
  ShapeOnlyCommunicator tp("tensor", shard_.tp_rank, shard_.tp_size), ep("expert", shard_.ep_rank, shard_.ep_size);
  ProcessGroups groups;
  groups.tp = ctx_.groups.tp ? &tp : nullptr;
  groups.ep = ctx_.groups.ep ? &ep : nullptr;
  reset_memory_peaks(DeviceType::Meta);
  {
    Transformer twin(config_, Device::meta(), shard_, groups, chunks_);
    if (ctx_.compute_dtype != DType::F32) twin.set_compute_dtype(ctx_.compute_dtype);
    twin.set_recompute(recompute_);
    twin.set_expert_imbalance(ctx_.expert_imbalance);
    std::vector<int32_t> tokens(size_t(B * T), 0);
    const Tensor tok(tokens.data(), DType::I32, Shape{B, T});
    LossScales scales;
    scales.token = 1.0f;
    scales.sequence = scales.micro_batch = 1.0;
    scales.mtp_token.assign(size_t(config_.num_nextn_predict_layers), 1.0f);
    if (num_chunks() == 1 && chunks_[0].embedding && chunks_[0].head) {
      twin.forward(0, tok, tok, scales);
      twin.backward(0);
    } else {
      // The chunk boundaries' messages are the pipeline runner's (communication buffers).
      const Shape shape = twin.boundary_shape(B, T);
      Buffer in("pipeline.message", MemCategory::CommBuffers, DType::F32, shape.numel(), Device::meta());
      Buffer grad("pipeline.message", MemCategory::CommBuffers, DType::F32, shape.numel(), Device::meta());
      for (int c = 0; c < num_chunks(); ++c) {
        twin.forward_chunk(0, c, tok, tok, scales, chunks_[size_t(c)].embedding ? Tensor() : in.tensor(0, shape));
      }
      for (int c = num_chunks() - 1; c >= 0; --c) {
        const StageSpec& s = chunks_[size_t(c)];
        twin.backward_chunk(0, c, s.head ? Tensor() : grad.tensor(0, shape), s.embedding ? Tensor() : in.tensor(0, shape));
      }
    }
  }
  const MemoryStats m = memory_stats(DeviceType::Meta);
  return m.peak[size_t(MemCategory::Activations)] + m.peak[size_t(MemCategory::Workspace)];
}

void Transformer::release_activations() {
  acts_.clear();
  offloaded_.clear();
  scratch_.release();
  wgrad_.clear();
  ready_after_weights_.clear();
}

void Transformer::forward_body(int slot, const StageSpec& st, Tensor tokens, Tensor in) {
  DS_CHECK(tokens.ndim() == 2, "tokens must be (B, T), got {}", tokens.shape().str());
  const int64_t B = tokens.size(0), T = tokens.size(1), C = config_.hidden_size;
  DS_CHECK(T <= config_.max_position_embeddings, "sequence length {} exceeds max_position_embeddings {}", T,
           config_.max_position_embeddings);
  rope_.ensure(T, config_, ctx_.device);
  // Sequence parallelism splits the token rows over the tensor group; a forward without a
  // backward (evaluation, generation) whose rows do not split runs without it (the same
  // parameters serve both layouts).
  ctx_.sequence_parallel = rows_split(B, T, slot == kInferenceMb);
  // A copy, so the caller's tokens need not outlive the forward.
  Tensor tok = acts_.put(slot, keys_.tokens, {B, T}, DType::I32);
  ops::copy(tok, tokens);
  acts_.meta<Shape>(slot, keys_.batch_shape) = Shape{B, T};
  // The residual stream, in fp32 whatever the compute dtype: "residual.0" the embedding output
  // (looked up in the fp32 master), "residual.{l+1}" after layer l; a later pipeline stage
  // starts from the previous one's output. With sequence parallelism it holds this rank's
  // rows only.
  const Shape rs = residual_shape(B, T);
  auto residual = [&](int l) { return acts_.put(slot, keys_.residual[size_t(l)], rs); };
  Tensor x = residual(st.first_layer);
  if (st.embedding) {
    embed(x, tok);
  } else {
    DS_CHECK(in.numel() == rs.numel(), "{}: its input holds {} values, the previous stage's output is {}", st.str(),
             in.numel(), rs.str());
    ops::copy(x, in.view(rs));
  }
  for (int l = st.first_layer; l < st.end_layer; ++l) {
    Tensor next = residual(l + 1);
    layer(l).forward(ctx_, slot, x, next);
    x = next;
    // The end of a recomputed group: its layers' activations go back to the pool (a MoE layer's
    // routing decisions stay, for the replay), and so do the residuals inside the group.
    const auto [g0, g1] = slot == kInferenceMb ? std::pair{l, l} : recompute_group(st, l);
    if (g1 != l + 1) continue;
    for (int j = g0; j < g1; ++j) {
      layer(j).release_activations(acts_, slot, /*for_replay=*/true);
      if (j > g0) acts_.release_key(slot, keys_.residual[size_t(j)]);
    }
    // The group's input waits for the replay in host memory.
    if (recompute_.cpu_checkpointing) offload(slot, keys_.residual[size_t(g0)]);
  }
  if (!st.head) return;
  const int64_t n = rs.numel() / C;
  ctx_.before_use(final_norm_, final_norm_);
  ops::rmsnorm_forward(acts_.put(slot, keys_.final_norm_out, {n, C}, ctx_.compute_dtype),
                       acts_.put(slot, keys_.final_norm_rstd, {n}), x.view({n, C}), reg_.param(final_norm_),
                       float(config_.rms_norm_eps));
  ctx_.after_use(final_norm_, final_norm_);
}

void Transformer::set_recompute(const RecomputePolicy& policy) {
  DS_CHECK(!policy.full || policy.num_layers >= 1, "activation recomputation: num_layers must be at least 1, got {}",
           policy.num_layers);
  DS_CHECK(!policy.mla_up_proj || config_.mla(),
           "selective recomputation \"mla_up_proj\" forms MLA's heads again, but model_type '{}' has no MLA",
           config_.model_type);
  DS_CHECK(!policy.cpu_checkpointing || policy.full,
           "activation recomputation: cpu_checkpointing keeps the inputs of recomputed layers in host memory, so it "
           "needs full recomputation");
  recompute_ = policy;
  ctx_.recompute_layernorm = policy.layernorm;
  ctx_.recompute_moe_act = policy.moe_act;
  ctx_.recompute_mla_up_proj = policy.mla_up_proj;
}

std::pair<int, int> Transformer::recompute_group(const StageSpec& st, int l) const {
  if (!recompute_.full) return {l, l};
  const int i = l - st.first_layer, k = int(recompute_.num_layers);
  std::pair<int, int> g{l, l};
  if (recompute_.method == RecomputePolicy::Method::Block) {
    if (i < k) g = {l, l + 1};
  } else {
    const int g0 = st.first_layer + i / k * k;
    g = {g0, std::min(g0 + k, st.end_layer)};
  }
  // The last group of the chunk holding the head keeps its activations: its backward follows
  // the head's at once, so dropping them would free nothing at the peak and cost a replay.
  if (st.head && g.second == st.end_layer) return {l, l};
  return g;
}

void Transformer::offload(int slot, ActKey key) {
  Tensor x = acts_.get(slot, key);
  ops::copy(offloaded_.put(slot, key, x.shape(), x.dtype()), x);
  acts_.release_key(slot, key);
}

void Transformer::bring_back(int slot, ActKey key) {
  Tensor held = offloaded_.get(slot, key);
  ops::copy(acts_.put(slot, key, held.shape(), held.dtype()), held);
  offloaded_.release_key(slot, key);
}

void Transformer::replay_layers(int slot, int first, int end) {
  const Shape bt = acts_.meta<Shape>(slot, keys_.batch_shape);
  const Shape rs = residual_shape(bt[0], bt[1]);
  const ActKey input = keys_.residual[size_t(first)];
  if (offloaded_.has(slot, input)) bring_back(slot, input);
  ctx_.replay = true;
  try {
    for (int j = first; j < end; ++j) {
      Tensor x = acts_.get(slot, keys_.residual[size_t(j)]);
      // The group's output is not needed again (its gradient is in hand): it goes to scratch.
      Tensor out = j + 1 < end ? acts_.put(slot, keys_.residual[size_t(j + 1)], rs)
                               : scratch_.get(slots_.recompute_out, rs);
      layer(j).forward(ctx_, slot, x, out);
    }
  } catch (...) {
    ctx_.replay = false;
    throw;
  }
  ctx_.replay = false;
}

int Transformer::head_chunk() const {
  for (int k = 0; k < num_chunks(); ++k) {
    if (chunks_[size_t(k)].head) return k;
  }
  return -1;
}

bool Transformer::rows_split(int64_t B, int64_t T, bool inference) const {
  return shard_.sequence_parallel && shard_.tp_size > 1 && (!inference || B * T % shard_.tp_size == 0);
}

Shape Transformer::boundary_shape(int64_t B, int64_t T, bool inference) const {
  const int tp = shard_.tp_size;
  if (!rows_split(B, T, inference)) return Shape{B, T, config_.hidden_size};
  DS_CHECK(B * T % tp == 0, "{} x {} token rows do not split over {} tensor-parallel ranks", B, T, tp);
  return Shape{B * T / tp, config_.hidden_size};
}

void Transformer::require_whole_model(const char* what) const {
  DS_CHECK(num_chunks() == 1 && chunks_[0].embedding && chunks_[0].head,
           "{} runs the whole model, but this rank holds {}: use the chunk's form", what, chunks_[0].str());
}

void Transformer::forward_head_body(Tensor tokens, Tensor in) {
  const int k = head_chunk();
  DS_CHECK(k >= 0, "this rank holds no head: it is not the last pipeline stage");
  forward_body(kInferenceMb, chunks_[size_t(k)], tokens, in);
}

void Transformer::forward_hidden(int chunk, Tensor tokens, Tensor in, Tensor out) {
  DS_CHECK(chunk >= 0 && chunk < num_chunks(), "chunk {} of {}", chunk, num_chunks());
  const StageSpec& st = chunks_[size_t(chunk)];
  DS_CHECK(!st.head, "{} holds the head: use forward_loss or last_logits", st.str());
  forward_body(kInferenceMb, st, tokens, in);
  Tensor x = acts_.get(kInferenceMb, keys_.residual[size_t(st.end_layer)]);
  DS_CHECK(out.numel() == x.numel(), "{}: output of {} values for {}", st.str(), out.numel(), x.shape().str());
  ops::copy(out.view(x.shape()), x);
  acts_.release(kInferenceMb);
}

Tensor Transformer::chunk_output(int mb, int chunk) const {
  const StageSpec& st = chunks_.at(size_t(chunk));
  DS_CHECK(!st.head, "{} holds the head: its output is the loss", st.str());
  return acts_.get(slot(mb, chunk), keys_.residual[size_t(st.end_layer)]);
}

Shape Transformer::residual_shape(int64_t B, int64_t T) const {
  const int64_t C = config_.hidden_size;
  if (!ctx_.sequence_parallel) return Shape{B, T, C};
  return Shape{ctx_.token_rows(B * T).size(), C};
}

void Transformer::embed(Tensor out, Tensor tokens) {
  const int64_t C = config_.hidden_size, N = tokens.numel();
  ctx_.before_use(embed_, embed_);
  if (shard_.tp_size == 1) {
    ops::embedding_forward(out.view({N, C}), tokens.view({N}), reg_.param(embed_));
  } else {
    // Each rank looks up the tokens of its vocabulary rows (zeros for the others); the sum over
    // the tensor group is the embedding (reduce-scattered to the rank's rows with sequence
    // parallelism).
    Tensor partial = scratch_.get(slots_.embed_partial, {N, C});
    ops::embedding_shard_forward(partial, tokens.view({N}), reg_.param(embed_), shard_.vocab.begin, config_.vocab_size);
    ops::copy(out, reduce_over_tensor_group(ctx_, partial, slots_.embed_mine).view(out.shape()));
  }
  ctx_.after_use(embed_, embed_);
}

void Transformer::embed_backward(Tensor dout, Tensor tokens) {
  const int64_t C = config_.hidden_size, N = tokens.numel();
  ctx_.before_use(embed_, embed_);
  if (shard_.tp_size == 1) {
    ops::embedding_backward(reg_.grad(embed_), dout.view({N, C}), tokens.view({N}));
  } else {
    Tensor all = sp_gather(ctx_, dout.view({dout.numel() / C, C}), slots_.embed_dout);
    ops::embedding_shard_backward(reg_.grad(embed_), all, tokens.view({N}), shard_.vocab.begin);
  }
  ctx_.after_use(embed_, embed_);
}

void Transformer::head(Tensor x, Tensor targets, bool backward, float scale, Tensor dx, Tensor sums,
                       int64_t* correct) {
  const int64_t C = config_.hidden_size, N = targets.numel(), Vl = shard_.vocab.size();
  const int tp = shard_.tp_size;
  // Every row's logits: x (this rank's rows under sequence parallelism) gathered.
  Tensor xr = sp_gather(ctx_, x.view({x.numel() / C, C}), slots_.head_x);
  DS_CHECK(xr.size(0) == N, "targets {} for {} positions", targets.shape().str(), xr.size(0));
  Tensor tg = targets.view({N});
  ctx_.before_use(head_param(), head_param());
  Tensor w = head_weight();
  const int64_t chunk = std::min(N, head_chunk_rows());
  // Transient: each chunk's loss and gradient are formed at once, so the head keeps nothing
  // for the backward. The logits are an fp32 GEMM output (from the compute-dtype x and
  // weights) and the cross-entropy is fp32; dx has x's dtype. Vocabulary-parallel: the logits
  // of this rank's vocabulary rows only; the ranks exchange each row's log-sum-exp and target
  // logit ((N, 2) values), never the logits.
  Tensor losses = scratch_.get(slots_.head_losses, {N});
  Tensor logits_buf = scratch_.get(slots_.head_logits, {chunk, Vl});
  Tensor lse_buf = scratch_.get(slots_.head_lse, {chunk});
  Tensor stats_buf = tp > 1 ? scratch_.get(slots_.head_stats, {chunk, 2}) : Tensor();
  Tensor all_stats_buf = tp > 1 ? scratch_.get(slots_.head_all_stats, {tp * chunk * 2}) : Tensor();
  Tensor top_buf = correct ? scratch_.get(slots_.head_max_and_target, {chunk, 2}) : Tensor();
  std::vector<float> top_host(correct ? size_t(2 * chunk) : 0);
  // This rank's part of the input gradient of every row, summed over the group after the loop.
  Tensor dxp =
      backward ? column_parallel_grad(ctx_, tp > 1, dx.view({dx.numel() / C, C}), xr, slots_.head_dx) : Tensor();
  // The loss of each chunk is final as soon as its logits exist, so its gradient is formed
  // right away and the full (N, V) logits never exist at once.
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t r1 = std::min(N, r0 + chunk), n = r1 - r0;
    Tensor logits = logits_buf.slice(0, n);
    Tensor lse = lse_buf.slice(0, n);
    ops::linear_forward(logits, xr.slice(r0, r1), w);
    if (tp == 1) {
      ops::cross_entropy_forward(losses.slice(r0, r1), lse, logits, tg.slice(r0, r1));
    } else {
      Tensor stats = stats_buf.slice(0, n);
      Tensor all_stats = all_stats_buf.slice(0, tp * n * 2).view({tp, n, 2});
      ops::cross_entropy_shard_forward(stats, logits, tg.slice(r0, r1), shard_.vocab.begin, config_.vocab_size);
      ctx_.groups.tp->all_gather(all_stats, stats);
      ops::cross_entropy_combine(losses.slice(r0, r1), lse, all_stats, tg.slice(r0, r1));
    }
    if (correct) {
      // Each row's largest logit and its target's (over the vocabulary shards: their maxima).
      Tensor top = top_buf.slice(0, n);
      ops::logit_max_and_target(top, logits, tg.slice(r0, r1), shard_.vocab.begin);
      if (tp > 1) ctx_.groups.tp->all_reduce(top, ReduceOp::Max);
      ops::copy(Tensor(top_host.data(), DType::F32, Shape{n, 2}), top);
      for (int64_t i = 0; i < n; ++i) *correct += top_host[size_t(2 * i + 1)] >= top_host[size_t(2 * i)];
    }
    if (backward) {
      const PhaseTimer::Scope timed(ctx_.phases, Phase::Backward);
      if (tp == 1) {
        ops::cross_entropy_backward(logits, logits, lse, tg.slice(r0, r1), scale);
      } else {
        ops::cross_entropy_shard_backward(logits, logits, lse, tg.slice(r0, r1), scale, shard_.vocab.begin);
      }
      ops::linear_backward(dxp.slice(r0, r1), head_grad(), in_compute_dtype(ctx_, logits, slots_.head_dlogits16),
                           xr.slice(r0, r1), w);
    }
  }
  if (backward) {
    const PhaseTimer::Scope timed(ctx_.phases, Phase::Backward);
    reduce_column_parallel_grad(ctx_, dxp, dx.view({dx.numel() / C, C}), slots_.tp_dx_mine);
  }
  ops::loss_sums(sums, losses, tg);
  ctx_.after_use(head_param(), head_param());
}

void Transformer::gather_logits(Tensor x, Tensor logits) {
  // Inference: the whole vocabulary's logits, gathered from the ranks' vocabulary rows.
  const int64_t C = config_.hidden_size, V = config_.vocab_size, N = x.numel() / C, Vl = shard_.vocab.size();
  ctx_.before_use(head_param(), head_param());
  if (shard_.tp_size == 1) {
    ops::linear_forward(logits.view({N, V}), x.view({N, C}), head_weight());
  } else {
    const int tp = shard_.tp_size;
    Tensor mine = scratch_.get(slots_.logits_mine, {N, Vl});
    Tensor all = scratch_.get(slots_.logits_all, {tp, N, Vl});
    ops::linear_forward(mine, x.view({N, C}), head_weight());
    ctx_.groups.tp->all_gather(all, mine);
    for (int r = 0; r < tp; ++r) {
      ops::copy_blocks(logits.view({N, V}), r * Vl, 0, all.view({tp * N, Vl}).slice(r * N, (r + 1) * N), 0, 0, 1, Vl,
                       false);
    }
  }
  ctx_.after_use(head_param(), head_param());
}

Tensor Transformer::zeroed_sums(int mb) {
  // (2 + 2 x MTP depth) F64: {sum, count} of the main loss, then of each depth.
  const int64_t n = 2 + 2 * int64_t(mtp_.size());
  Tensor sums = acts_.put(mb, keys_.loss_sums, {n}, DType::F64);
  const std::vector<double> zeros(size_t(n), 0.0);
  ops::copy(sums, Tensor(const_cast<double*>(zeros.data()), DType::F64, Shape{n}));
  return sums;
}

LossSums Transformer::read_sums(Tensor sums, bool with_mtp) const {
  // The one read of the forward's results by the host.
  std::vector<double> h(size_t(sums.numel()));
  ops::copy(Tensor(h.data(), DType::F64, Shape{sums.numel()}), sums);
  return sums_from(h.data(), with_mtp);
}

LossSums Transformer::sums_from(const double* h, bool with_mtp) const {
  LossSums s;
  s.sum = h[0];
  s.count = int64_t(h[1]);
  for (size_t k = 0; with_mtp && k < mtp_.size(); ++k) {
    s.mtp_sum.push_back(h[2 + 2 * k]);
    s.mtp_count.push_back(int64_t(h[3 + 2 * k]));
  }
  return s;
}

void Transformer::accumulate_losses_into(Tensor into) {
  if (into.defined()) {
    DS_CHECK(into.dtype() == DType::F64 && into.numel() == loss_sums_size() && into.device() == reg_.device(),
             "accumulate_losses_into: expected {} F64 on {}, got {} {} on {}", loss_sums_size(), reg_.device().str(),
             into.numel(), dtype_name(into.dtype()), into.device().str());
  }
  loss_accumulator_ = into;
}

std::vector<std::pair<int, FeedForwardBlock*>> Transformer::moe_layers() {
  // From the config, not routing(): asking a block for its statistics reads them back.
  std::vector<std::pair<int, FeedForwardBlock*>> out;
  for (int l = 0; l < int(local_layer_.size()); ++l) {
    if (local_layer_[size_t(l)] >= 0 && config_.is_moe_layer(l)) out.emplace_back(l, &layer(l).ffn());
  }
  for (size_t k = 0; k < mtp_.size(); ++k) {
    if (config_.is_moe_layer(mtp_[k].layer_index)) out.emplace_back(mtp_[k].layer_index, &mtp_[k].layer->ffn());
  }
  return out;
}

void Transformer::grad_ready(int mb, int first, int last) {
  if (split_mb_ == mb) {
    ready_after_weights_[mb].emplace_back(first, last);
  } else {
    ctx_.grad_ready(first, last);
  }
}

void Transformer::mtp_forward_backward(int mb, const LossScales& scales, Tensor targets, Tensor dxf, Tensor sums) {
  const int64_t B = targets.size(0), T = targets.size(1), C = config_.hidden_size;
  // N: this rank's token rows (all of them but with sequence parallelism).
  const Shape rs = residual_shape(B, T);
  const int64_t N = rs.numel() / C;
  const float eps = float(config_.rms_norm_eps);
  const DType cd = ctx_.compute_dtype;
  // Forward through the depths: module k (0-based) reads token t+k+1 at position t (targets
  // column t+k) and predicts token t+k+2 (targets column t+k+1).
  Tensor h_prev = acts_.get(mb, keys_.final_norm_out);
  std::vector<Tensor> h_prevs(mtp_.size());
  auto act = [&](ActKey key, Shape shape, DType dtype = DType::F32) { return acts_.put(mb, key, shape, dtype); };
  for (size_t k = 0; k < mtp_.size(); ++k) {
    MtpModule& m = mtp_[k];
    ctx_.before_use(m.first_param, m.last_param);
    Tensor inputs = act(m.keys.inputs, {B, T}, DType::I32), tgt = act(m.keys.targets, {B, T}, DType::I32);
    ops::shift_tokens(inputs, targets, int64_t(k), /*fill=*/0, /*ignore_as=*/0);
    ops::shift_tokens(tgt, targets, int64_t(k) + 1, ops::kIgnoreIndex, ops::kIgnoreIndex);
    // As in the main model: the embedding (from the fp32 master), the projection's output h_in
    // (the module's residual stream) and h_out in fp32; the norms' outputs and their
    // concatenation, which only feed eh_proj, in the compute dtype.
    Tensor emb = act(m.keys.emb, {N, C}), cat = act(m.keys.cat, {N, 2 * C}, cd);
    embed(emb, inputs);  // shared with the main model
    Tensor en = scratch_.get(slots_.mtp_enorm, {N, C}, cd), hn = act(m.keys.hnorm, {N, C}, cd);
    ops::rmsnorm_forward(en, act(m.keys.e_rstd, {N}), emb, reg_.param(m.enorm), eps);
    ops::rmsnorm_forward(hn, act(m.keys.h_rstd, {N}), h_prev.view({N, C}), reg_.param(m.hnorm), eps);
    // cat = [enorm(embedding) | hnorm(hidden)] per row.
    ops::copy_blocks(cat, 0, 0, en, 0, 0, 1, C, false);
    ops::copy_blocks(cat, C, 0, hn, 0, 0, 1, C, false);
    Tensor h_in = act(m.keys.h_in, rs), h_out = act(m.keys.h_out, rs);
    ops::linear_forward(h_in.view({N, C}), cat, reg_.compute(m.eh_proj));
    m.layer->forward(ctx_, mb, h_in, h_out);
    Tensor on = act(m.keys.out_norm, {N, C}, cd);
    ops::rmsnorm_forward(on, act(m.keys.out_rstd, {N}), h_out.view({N, C}), reg_.param(m.head_norm), eps);
    h_prevs[k] = h_prev;
    h_prev = h_out;
    ctx_.after_use(m.first_param, m.last_param);
  }
  auto get = [&](ActKey key) { return acts_.get(mb, key); };
  // Each depth's loss: its gradient w.r.t. the normed output is formed at once.
  std::vector<Tensor> d_out(mtp_.size());
  for (size_t k = 0; k < mtp_.size(); ++k) {
    MtpModule& m = mtp_[k];
    d_out[k] = scratch_.get(slots_.mtp_d_out[k], {N, C}, cd);
    head(get(m.keys.out_norm), get(m.keys.targets), true, scales.mtp_token[k], d_out[k],
         sums.slice(2 + 2 * int64_t(k), 4 + 2 * int64_t(k)));
  }
  // Backward from the deepest module: dh carries the gradient w.r.t. h^k from depth k+1. The
  // gradients of fp32 activations (dh, demb) are fp32, those of the norms' outputs and of
  // their concatenation (dcat, de, dhn) in the compute dtype.
  const PhaseTimer::Scope timed(ctx_.phases, Phase::Backward);
  Tensor dh = scratch_.get(slots_.mtp_dh, rs);
  ops::fill(dh, 0.0f);
  for (size_t k = mtp_.size(); k-- > 0;) {
    MtpModule& m = mtp_[k];
    ctx_.before_use(m.first_param, m.last_param);
    ops::rmsnorm_backward(dh.view({N, C}), reg_.grad(m.head_norm), d_out[k], get(m.keys.h_out).view({N, C}),
                          reg_.param(m.head_norm), get(m.keys.out_rstd));
    m.layer->backward(ctx_, mb, dh);  // dh: w.r.t. h_in now
    Tensor dcat = scratch_.get(slots_.mtp_dcat, {N, 2 * C}, cd);
    ops::linear_backward(dcat, reg_.grad(m.eh_proj), in_compute_dtype(ctx_, dh.view({N, C}), slots_.mtp_dh16),
                         get(m.keys.cat),
                         reg_.compute(m.eh_proj));
    Tensor de = scratch_.get(slots_.mtp_de, {N, C}, cd), dhn = scratch_.get(slots_.mtp_dhn, {N, C}, cd);
    ops::copy_blocks(de, 0, 0, dcat, 0, 0, 1, C, false);
    ops::copy_blocks(dhn, 0, 0, dcat, C, 0, 1, C, false);
    Tensor demb = scratch_.get(slots_.mtp_demb, {N, C});
    ops::fill(demb, 0.0f);
    ops::rmsnorm_backward(demb, reg_.grad(m.enorm), de, get(m.keys.emb), reg_.param(m.enorm), get(m.keys.e_rstd));
    embed_backward(demb, get(m.keys.inputs));
    // The gradient w.r.t. h^{k-1}: the main model's normed output for k = 0.
    Tensor dprev = k == 0 ? dxf.view({N, C}) : dh.view({N, C});
    if (k > 0) ops::fill(dprev, 0.0f);
    ops::rmsnorm_backward(dprev, reg_.grad(m.hnorm), dhn, h_prevs[k].view({N, C}), reg_.param(m.hnorm),
                          get(m.keys.h_rstd));
    ctx_.after_use(m.first_param, m.last_param);
  }
}

LossSums Transformer::forward_loss(Tensor tokens, Tensor targets) { return forward_loss(tokens, targets, Tensor()); }

LossSums Transformer::forward_loss(Tensor tokens, Tensor targets, Tensor in) {
  forward_head_body(tokens, in);
  Tensor sums = zeroed_sums(kInferenceMb);
  Tensor tgt = acts_.put(kInferenceMb, keys_.targets, targets.shape(), DType::I32);
  ops::copy(tgt, targets);
  int64_t correct = 0;
  head(acts_.get(kInferenceMb, keys_.final_norm_out), tgt, /*backward=*/false, 0.0f, Tensor(), sums.slice(0, 2),
       &correct);
  LossSums s = read_sums(sums, /*with_mtp=*/false);
  s.correct = correct;
  acts_.release(kInferenceMb);
  return s;
}

LossSums Transformer::forward_backward(Tensor tokens, Tensor targets, float loss_scale, const GradReadyFn& ready) {
  LossScales scales;
  scales.token = loss_scale;
  scales.sequence = tokens.ndim() == 2 ? 1.0 / double(tokens.size(0)) : 0.0;
  scales.micro_batch = 1.0;
  scales.mtp_token.assign(mtp_.size(), 0.0f);
  return forward_backward(tokens, targets, scales, ready);
}

namespace {
// A GradReadyFn in front of the model's hooks for one forward_backward.
class ReadyFnHooks final : public ParamHooks {
 public:
  ReadyFnHooks(ParamHooks* inner, const GradReadyFn& ready) : inner_(inner), ready_(ready) {}
  void before_use(int first, int last) override {
    if (inner_) inner_->before_use(first, last);
  }
  void after_use(int first, int last) override {
    if (inner_) inner_->after_use(first, last);
  }
  void grad_ready(int first, int last) override {
    if (inner_) inner_->grad_ready(first, last);
    ready_(first, last);
  }

 private:
  ParamHooks* inner_;
  const GradReadyFn& ready_;
};
}  // namespace

LossSums Transformer::forward_backward(Tensor tokens, Tensor targets, const LossScales& scales,
                                       const GradReadyFn& ready) {
  ParamHooks* saved = ctx_.hooks;
  ReadyFnHooks hooks(saved, ready);
  if (ready) ctx_.hooks = &hooks;
  try {
    const LossSums s = forward(0, tokens, targets, scales);
    backward(0);
    ctx_.hooks = saved;
    return s;
  } catch (...) {
    // A failed step (out of memory) is retried: micro-batch 0 is no longer in flight.
    ctx_.hooks = saved;
    acts_.release(0);
    offloaded_.release(0);
    throw;
  }
}

LossSums Transformer::forward(int mb, Tensor tokens, Tensor targets, const LossScales& scales) {
  require_whole_model("forward()");
  return forward_chunk(mb, 0, tokens, targets, scales);
}

LossSums Transformer::forward_chunk(int mb, int chunk, Tensor tokens, Tensor targets, const LossScales& scales,
                                    Tensor in) {
  DS_CHECK(mb >= 0, "micro-batches are numbered from 0, got {}", mb);
  DS_CHECK(chunk >= 0 && chunk < num_chunks(), "chunk {} of this rank's {}", chunk, num_chunks());
  const int sl = slot(mb, chunk);
  DS_CHECK(!acts_.has(sl, keys_.tokens), "micro-batch {} is already in flight: run its backward first", mb);
  const StageSpec& st = chunks_[size_t(chunk)];
  // The head's loss gradient and the MTP modules' backward mark themselves as backward.
  const PhaseTimer::Scope timed(ctx_.phases, Phase::Forward);
  for (int l = st.first_layer; l < st.end_layer; ++l) {
    if (config_.is_moe_layer(l)) layer(l).ffn().set_loss_scales(scales);
  }
  forward_body(sl, st, tokens, in);
  if (!st.head) return LossSums{};
  for (auto& m : mtp_) {
    if (config_.is_moe_layer(m.layer_index)) m.layer->ffn().set_loss_scales(scales);
  }
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T, C = config_.hidden_size;
  DS_CHECK(targets.numel() == N, "targets {} for tokens {}", targets.shape().str(), tokens.shape().str());
  // Of final_norm.out: this rank's rows.
  Tensor dxf = acts_.put(sl, keys_.head_dxf, {residual_shape(B, T).numel() / C, C}, ctx_.compute_dtype);
  // The step's accumulator (accumulate_losses_into: the sums are added to it as they are
  // formed, with nothing read here), or this micro-batch's own sums, read below.
  const bool accumulating = loss_accumulator_.defined();
  Tensor sums = accumulating ? loss_accumulator_ : zeroed_sums(sl);
  // The targets on the model's device (the caller's may be on the host), for the loss and the
  // shifted MTP inputs and targets.
  Tensor tgt = acts_.put(sl, keys_.targets, {B, T}, DType::I32);
  ops::copy(tgt, targets.view({B, T}));
  head(acts_.get(sl, keys_.final_norm_out), tgt, /*backward=*/true, scales.token, dxf, sums.slice(0, 2));
  const bool with_mtp = !mtp_.empty() && !scales.mtp_token.empty();
  if (with_mtp) {
    DS_CHECK(scales.mtp_token.size() == mtp_.size(), "{} MTP loss scales for {} depths", scales.mtp_token.size(),
             mtp_.size());
    mtp_forward_backward(sl, scales, tgt, dxf, sums);
  }
  return accumulating ? LossSums{} : read_sums(sums, with_mtp);
}

void Transformer::backward(int mb, BackwardPart part) {
  DS_CHECK(num_chunks() == 1, "backward() runs the whole model; this rank holds {} chunks: use backward_chunk",
           num_chunks());
  backward_chunk(mb, 0, Tensor(), Tensor(), part);
}

void Transformer::backward_chunk(int mb, int chunk, Tensor dout, Tensor din, BackwardPart part) {
  DS_CHECK(chunk >= 0 && chunk < num_chunks(), "chunk {} of this rank's {}", chunk, num_chunks());
  const StageSpec& st = chunks_[size_t(chunk)];
  const int sl = slot(mb, chunk);
  DS_CHECK(acts_.has(sl, st.head ? keys_.head_dxf : keys_.tokens),
           "backward of micro-batch {} without its training forward", mb);
  ctx_.sequence_parallel = shard_.sequence_parallel;
  const PhaseTimer::Scope timed(ctx_.phases, Phase::Backward);
  if (part == BackwardPart::Input) {
    wgrad_.begin_deferral(sl);
    split_mb_ = sl;
  }
  try {
    Tensor tokens = acts_.get(sl, keys_.tokens);
    const int64_t B = tokens.size(0), T = tokens.size(1), C = config_.hidden_size;
    // The residual-stream gradient flows back through the layers in one buffer (this rank's
    // rows with sequence parallelism).
    const Shape rs = residual_shape(B, T);
    const int64_t n = rs.numel() / C;
    Tensor dx = scratch_.get(slots_.residual_grad, rs);
    if (st.head) {
      // The MTP modules' gradients were completed by the forward; they are reported here, with
      // this micro-batch's backward, so that hooks counting a micro-step's gradients (the
      // data-parallel buckets, the tensor group's sums) see them in the micro-step they belong
      // to and can start on the last parameters at once.
      for (size_t k = mtp_.size(); k-- > 0;) ctx_.grad_ready(mtp_[k].first_param, mtp_[k].last_param);
      ops::fill(dx, 0.0f);
      ctx_.before_use(final_norm_, final_norm_);
      ops::rmsnorm_backward(dx.view({n, C}), reg_.grad(final_norm_), acts_.get(sl, keys_.head_dxf),
                            acts_.get(sl, keys_.residual[size_t(st.end_layer)]).view({n, C}),
                            reg_.param(final_norm_), acts_.get(sl, keys_.final_norm_rstd));
      ctx_.after_use(final_norm_, final_norm_);
      grad_ready(sl, final_norm_, final_norm_);
      if (lm_head_ >= 0) grad_ready(sl, lm_head_, lm_head_);
      if (recompute_.full) {
        // The head's and the MTP modules' activations are done with: the replays take them.
        acts_.release_keys(sl, keys_.head);
        for (const MtpModule& m : mtp_) acts_.release_keys(sl, m.all_keys);
      }
    } else {
      DS_CHECK(dout.numel() == rs.numel(), "{}: output gradient of {} values for {}", st.str(), dout.numel(),
               rs.str());
      ops::copy(dx, dout.view(rs));
    }
    for (int l = st.end_layer; l-- > st.first_layer;) {
      const auto [g0, g1] = recompute_group(st, l);
      if (g1 == l + 1) replay_layers(sl, g0, g1);
      layer(l).backward(ctx_, sl, dx);
      // The layer's activations go back to the pool: the next replay takes them.
      if (recompute_.full) layer(l).release_activations(acts_, sl, /*for_replay=*/false);
      grad_ready(sl, layer(l).first_param(), layer(l).last_param());
    }
    if (st.embedding) {
      embed_backward(dx, tokens);
      grad_ready(sl, embed_, embed_);
    } else {
      DS_CHECK(din.numel() == rs.numel(), "{}: input gradient of {} values for {}", st.str(), din.numel(), rs.str());
      ops::copy(din.view(rs), dx);
      // A last stage's copy of the embedding (tied head, MTP) is final after its backward.
      if (st.head && embed_ >= 0 && reg_.info(embed_).pipeline_copy) grad_ready(sl, embed_, embed_);
    }
  } catch (...) {
    wgrad_.end_deferral();
    split_mb_ = -1;
    throw;
  }
  wgrad_.end_deferral();
  split_mb_ = -1;
  acts_.release(sl);
  offloaded_.release(sl);
}

void Transformer::backward_weights(int mb) { backward_weights_chunk(mb, 0); }

void Transformer::backward_weights_chunk(int mb, int chunk) {
  const PhaseTimer::Scope timed(ctx_.phases, Phase::Backward);
  const int sl = slot(mb, chunk);
  wgrad_.run(sl);
  auto it = ready_after_weights_.find(sl);
  if (it != ready_after_weights_.end()) {
    for (auto [first, last] : it->second) ctx_.grad_ready(first, last);
    ready_after_weights_.erase(it);
  }
}

void Transformer::forward_logits(Tensor tokens, Tensor logits) {
  require_whole_model("forward_logits");
  forward_head_body(tokens, Tensor());
  const int64_t B = tokens.size(0), T = tokens.size(1), N = B * T, C = config_.hidden_size, V = config_.vocab_size;
  DS_CHECK(logits.numel() == N * V, "logits {} for ({}, {}) tokens and vocabulary {}", logits.shape().str(), B, T,
           V);
  gather_logits(sp_gather(ctx_, acts_.get(kInferenceMb, keys_.final_norm_out), slots_.head_x).view({N, C}),
                logits.view({N, V}));
  acts_.release(kInferenceMb);
}

void Transformer::last_logits(Tensor tokens, Tensor logits) { last_logits(tokens, logits, Tensor()); }

void Transformer::last_logits(Tensor tokens, Tensor logits, Tensor in) {
  forward_head_body(tokens, in);
  const int64_t B = tokens.size(0), T = tokens.size(1), V = config_.vocab_size;
  DS_CHECK(logits.numel() == B * V, "logits {} for {} sequences", logits.shape().str(), B);
  const int64_t C = config_.hidden_size;
  Tensor xf = sp_gather(ctx_, acts_.get(kInferenceMb, keys_.final_norm_out), slots_.head_x).view({B, T, C});
  // The last position of each sequence, as rows of one GEMM.
  Tensor last = scratch_.get(slots_.logits_last_x, {B, C}, xf.dtype());
  ops::copy_blocks(last.view({B, C}), 0, 0, xf.view({B, T * C}), (T - 1) * C, 0, 1, C, false);
  gather_logits(last, logits.view({B, V}));
  acts_.release(kInferenceMb);
}

}  // namespace dstrain
