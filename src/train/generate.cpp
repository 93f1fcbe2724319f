#include "train/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/philox.h"

namespace dstrain {

int32_t sample_token(const float* logits, int64_t V, double temperature, int64_t top_k, uint64_t seed,
                     uint64_t draw) {
  // nan would make every probability nan and the draw fall through to the last candidate.
  DS_CHECK(std::isfinite(temperature) && temperature >= 0,
           "sampling temperature {} is not a finite number >= 0; use 0 for greedy decoding", temperature);
  DS_CHECK(top_k >= 0, "top_k {} is negative; use 0 to sample from the whole vocabulary", top_k);
  if (temperature == 0.0) return int32_t(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  int64_t k = top_k > 0 ? std::min(top_k, V) : V;
  // Largest logits first; ties broken by id so the choice is deterministic.
  auto larger = [&](int32_t a, int32_t b) { return logits[a] != logits[b] ? logits[a] > logits[b] : a < b; };
  if (k < V) std::nth_element(ids.begin(), ids.begin() + k, ids.end(), larger);
  std::sort(ids.begin(), ids.begin() + k, larger);
  std::vector<double> p(static_cast<size_t>(k));
  const double mx = logits[ids[0]];
  double z = 0;
  for (int64_t i = 0; i < k; ++i) z += (p[size_t(i)] = std::exp((double(logits[ids[size_t(i)]]) - mx) / temperature));
  const double u = philox_uniform(seed, stream_id("dstrain.generate"), draw) * z;
  double acc = 0;
  for (int64_t i = 0; i < k; ++i) {
    acc += p[size_t(i)];
    if (u < acc) return ids[size_t(i)];
  }
  return ids[size_t(k - 1)];
}

std::vector<int32_t> generate_tokens(Transformer& model, const std::vector<int32_t>& prompt, const GenerateConfig& g,
                                     int64_t context, int64_t vocab, const std::vector<int64_t>& stop_ids) {
  return generate_tokens(
      model.config(), [&](Tensor tokens, Tensor logits) { model.last_logits(tokens, logits); }, prompt, g, context,
      vocab, stop_ids);
}

std::vector<int32_t> generate_tokens(const ModelConfig& config, const LastLogitsFn& last_logits,
                                     const std::vector<int32_t>& prompt, const GenerateConfig& g, int64_t context,
                                     int64_t vocab, const std::vector<int64_t>& stop_ids) {
  DS_CHECK(!prompt.empty(), "generation needs at least one prompt token");
  const int64_t V = config.vocab_size;
  DS_CHECK(vocab > 0 && vocab <= V, "generation over {} ids from a model of {}", vocab, V);
  DS_CHECK(g.max_new_tokens > 0, "generate.max_new_tokens is {}; it must be positive", g.max_new_tokens);
  context = std::min(context, config.max_position_embeddings);
  std::vector<int32_t> seq = prompt;
  std::vector<int32_t> out;
  std::vector<float> logits(static_cast<size_t>(V));
  for (int64_t i = 0; i < g.max_new_tokens; ++i) {
    const int64_t start = std::max<int64_t>(0, int64_t(seq.size()) - context);
    std::vector<int32_t> window(seq.begin() + start, seq.end());
    const int64_t T = int64_t(window.size());
    last_logits(Tensor(window.data(), DType::I32, Shape{1, T}), Tensor(logits.data(), DType::F32, Shape{1, V}));
    const int32_t next = sample_token(logits.data(), vocab, g.temperature, g.top_k, g.seed, uint64_t(i));
    if (std::find(stop_ids.begin(), stop_ids.end(), int64_t(next)) != stop_ids.end()) break;
    seq.push_back(next);
    out.push_back(next);
  }
  return out;
}

}  // namespace dstrain
