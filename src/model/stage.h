// Pipeline stages: the model as a list of stages, each a contiguous run of its pieces
// (embedding, decoder layers, final norm + head + loss, multi-token prediction) and so a
// contiguous range of the parameter registry. Today the model is one stage; a pipeline split
// gives each pipeline rank one (or, for interleaved and DualPipe schedules, two) of them.
// Weights used by more than one piece are declared as ties, so that a split that separates
// their users knows to add up their gradients over the stages holding them.
#pragma once

#include <string>
#include <vector>

#include "model/ctx.h"
#include "model/model_config.h"
#include "state/params.h"

namespace dstrain {

struct StageSpec {
  int index = 0, count = 1;
  bool embedding = false;      // model.embed_tokens (the first stage)
  int first_layer = 0;         // decoder layers [first_layer, end_layer)
  int end_layer = 0;
  bool head = false;           // model.norm, lm_head and the loss (the last stage)
  bool mtp = false;            // the multi-token-prediction modules (after the head; they read its input)
  int num_layers() const { return end_layer - first_layer; }
  std::string str() const;     // "stage 1/2: layers 4-7, head, mtp"
};

// Splits the decoder layers over `count` stages as evenly as possible (earlier stages take the
// remainder, as Megatron-Core's uneven split does by default); the first stage holds the
// embedding, the last the head and the MTP modules. More stages than layers is an error.
std::vector<StageSpec> split_stages(const ModelConfig& c, int count);

// The modelled training cost of each piece of the model, in FLOPs per token of forward plus
// backward (3x the forward: the backward forms input and weight gradients, 2 forward's worth).
// Counted: the matrix products (2 FLOPs per multiply-add) and causal attention; not counted:
// norms, rotary embedding, activations, routing top-k and other elementwise work. The same
// numbers can be replaced by measured per-piece times (split_stages_balanced takes either).
//   embedding   0: a row lookup (its memory traffic, C values a token, is ignored)
//   layer l     attention + feed-forward of decoder layer l:
//     GQA       2C(H + 2Hkv)D (q, k, v) + 2HDC (o) + 2H(D + D)(T+1)/2 (QK^T and PV, causal)
//     MLA       q: 2C q_lora + 2 q_lora H qk (q_lora_rank > 0) or 2CH qk; kv_a 2C(kv_lora + rope);
//               kv_b 2 kv_lora H(nope + v); o 2HvC; attention 2H(qk + v)(T+1)/2
//     dense FFN 3 x 2CI (SwiGLU gate, up, down)
//     MoE FFN   k x 3 x 2C I_moe (routed) + n_shared x 3 x 2C I_moe + 2CE (gate)
//   head        2CV (lm_head) + kCrossEntropyFlopsPerLogit x V
//   mtp[k]      2 x 2C x C (eh_proj) + its decoder layer (layer index L + k) + another head
// with C hidden_size, H heads, Hkv key/value heads, D head_dim, T the sequence length, V the
// vocabulary, E the routed experts, k experts per token. Without the cross-entropy term the
// pieces add up to ModelConfig::train_flops_per_token.
struct PieceCosts {
  // Forward FLOPs per logit of the cross-entropy (max, exp, sum, the normalised gradient).
  static constexpr double kCrossEntropyFlopsPerLogit = 4;
  double embedding = 0;
  std::vector<double> layers;  // decoder layer l
  double head = 0;             // final norm, lm_head and the loss
  std::vector<double> mtp;     // multi-token-prediction module k (eh_proj, its layer, its head)
  double total() const;
};
PieceCosts piece_costs(const ModelConfig& c, int64_t seq_len);
// The cost of the pieces a stage holds.
double stage_cost(const PieceCosts& costs, const StageSpec& s);

// Contiguous stages that minimise the most expensive stage's cost (exact, by dynamic
// programming); among the splits reaching that minimum, the one with the least sum of squared
// stage costs, so that the stages off the critical one are balanced too. The first stage holds
// the embedding, the last the head and the MTP modules; every stage holds at least one decoder
// layer (more stages than num_hidden_layers is an error, as Megatron-Core without its
// empty-first/last-stage options). The second form splits measured or otherwise given costs
// (layers.size() decoder layers; MTP modules when mtp is not empty).
std::vector<StageSpec> split_stages_balanced(const ModelConfig& c, int count, int64_t seq_len);
std::vector<StageSpec> split_stages_balanced(const PieceCosts& costs, int count);

// The stages of a "parallel.partition" override: layers_per_stage[i] decoder layers on stage i.
// Errors unless it has `count` (the pipeline size) entries, each >= 1, adding up to
// num_hidden_layers.
std::vector<StageSpec> split_stages_manual(const ModelConfig& c, int count,
                                           const std::vector<int64_t>& layers_per_stage);

// One line describing a split with each stage's share of the modelled cost:
// "stage 0: embedding + layers 0-3 (24.1%), stage 1: layers 4-7 (25.0%), ...".
std::string describe_stages(const std::vector<StageSpec>& stages, const PieceCosts& costs);

// A parameter read by more than one piece of the model: its owner's name and the pieces that
// also use it. Tie-aware pipelines all-reduce its gradient over the stages of those pieces
// (Megatron-Core's embedding group).
struct TiedParam {
  std::string param;             // e.g. "model.embed_tokens.weight"
  std::vector<std::string> uses;  // "lm_head" (tie_word_embeddings), "mtp.embedding", "mtp.head"
};
// Ties of a config: tie_word_embeddings shares the embedding with the head; DeepSeek-V3's
// MTP modules share the main model's embedding and output head (technical report §2.2).
std::vector<TiedParam> tied_params(const ModelConfig& c);

// The registry's parameter ids of a stage, [first, last], for a registry laid out as the
// Transformer registers it (embedding, layers in order, final norm, head, MTP modules).
// Errors when the stage's parameters are not contiguous.
Range stage_param_range(const ParamRegistry& reg, const StageSpec& s, const ModelConfig& c);

}  // namespace dstrain
