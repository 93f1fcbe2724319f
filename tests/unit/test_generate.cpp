// Sampling for text generation: greedy, temperature, top-k, reproducibility, and ids beyond
// the tokenizer's vocabulary (padded embedding rows) never being chosen.
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "model/transformer.h"
#include "train/generate.h"

namespace dstrain {
namespace {

TEST(Sampling, GreedyTemperatureAndTopK) {
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f, -1.0f, 1.9f};
  EXPECT_EQ(sample_token(logits.data(), 5, 0.0, 0, 1, 0), 1);
  std::map<int32_t, int> seen;
  for (uint64_t d = 0; d < 2000; ++d) seen[sample_token(logits.data(), 5, 1.0, 2, 3, d)]++;
  EXPECT_EQ(seen.size(), 2u) << "top-2 keeps ids 1 and 4 only";
  EXPECT_GT(seen[1], seen[4]);
  // softmax([2, 1.9]): p(1) = 0.525; 2000 draws lie well within 0.45..0.60.
  EXPECT_NEAR(seen[1] / 2000.0, 0.525, 0.075);
  EXPECT_EQ(sample_token(logits.data(), 5, 1.0, 0, 3, 17), sample_token(logits.data(), 5, 1.0, 0, 3, 17));
}

TEST(Sampling, TemperatureAndTopKOutsideTheirRangeAreErrors) {
  const std::vector<float> logits = {0.0f, 2.0f, 1.0f};
  for (double t : {std::nan(""), double(INFINITY), -0.5}) {
    try {
      sample_token(logits.data(), 3, t, 0, 1, 0);
      ADD_FAILURE() << "temperature " << t << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not a finite number >= 0"), std::string::npos) << e.what();
    }
  }
  EXPECT_THROW(sample_token(logits.data(), 3, 1.0, -1, 1, 0), Error);
}

TEST(Sampling, IdsBeyondTheTokenizerAreNeverChosen) {
  // The padded rows carry the largest logits, as an untrained model's may.
  const std::vector<float> logits = {0.1f, 0.2f, 0.3f, 9.0f, 8.0f};
  EXPECT_EQ(sample_token(logits.data(), 3, 0.0, 0, 1, 0), 2);
  for (uint64_t d = 0; d < 500; ++d) EXPECT_LT(sample_token(logits.data(), 3, 1.0, 0, 1, d), 3);

  ModelConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 16;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.vocab_size = 40;
  c.max_position_embeddings = 16;
  Transformer m(c, Device::cpu());
  m.init_weights(3);
  // Make the last rows of the head dominate.
  float* head = m.params().param(m.params().find("lm_head.weight")).data<float>();
  for (int64_t v = 30; v < 40; ++v)
    for (int64_t k = 0; k < 16; ++k) head[v * 16 + k] = 5.0f;
  GenerateConfig g;
  g.max_new_tokens = 12;
  g.temperature = 1.0;
  for (int32_t t : generate_tokens(m, {1, 2, 3}, g, 16, 30, {})) EXPECT_LT(t, 30);
}

}  // namespace
}  // namespace dstrain
