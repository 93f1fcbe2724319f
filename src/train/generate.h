// Text generation for a quick look at what a model learned: greedy, temperature and top-k
// sampling, reproducible from a seed.
#pragma once

#include <functional>

#include <cstdint>
#include <vector>

#include "model/transformer.h"
#include "train/run_config.h"

namespace dstrain {

// Picks the next token among ids [0, V) from logits: argmax when temperature is 0, otherwise
// a sample from softmax(logits / temperature) restricted to the top_k largest (0: all),
// drawn with uniform number `draw` of the seed's stream. V may be smaller than the model's
// vocabulary: padded embedding rows have no text and are never chosen.
int32_t sample_token(const float* logits, int64_t V, double temperature, int64_t top_k, uint64_t seed,
                     uint64_t draw);

// Continues `prompt` by up to max_new_tokens tokens from ids [0, vocab), stopping early at a
// stop id. The model sees at most `context` most recent tokens. Returns only the new tokens.
std::vector<int32_t> generate_tokens(Transformer& model, const std::vector<int32_t>& prompt, const GenerateConfig& g,
                                     int64_t context, int64_t vocab, const std::vector<int64_t>& stop_ids);
// The same with the last position's logits from `last_logits(tokens (1, T), logits (1, V))` (a
// pipeline of stages): every rank that calls it with the same logits makes the same tokens.
using LastLogitsFn = std::function<void(Tensor tokens, Tensor logits)>;
std::vector<int32_t> generate_tokens(const ModelConfig& c, const LastLogitsFn& last_logits,
                                     const std::vector<int32_t>& prompt, const GenerateConfig& g, int64_t context,
                                     int64_t vocab, const std::vector<int64_t>& stop_ids);

}  // namespace dstrain
