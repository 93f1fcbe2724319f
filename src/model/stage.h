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
