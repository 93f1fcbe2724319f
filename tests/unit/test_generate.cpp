// Sampling for text generation: greedy, the sampled distribution against softmax(logits / T)
// (chi-square over seeded draws), top-k, reproducibility, and ids beyond the tokenizer's
// vocabulary (padded embedding rows) never being chosen.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/transformer.h"
#include "train/generate.h"

namespace dstrain {
namespace {

// A one-layer model of 40 ids and 16 positions, for generation end to end.
ModelConfig tiny_model() {
  ModelConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 16;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.vocab_size = 40;
  c.max_position_embeddings = 16;
  return c;
}

// softmax(logits / temperature) over the top_k largest logits (0: all), in double.
std::vector<double> expected_distribution(const std::vector<float>& logits, double temperature, int64_t top_k) {
  const size_t V = logits.size();
  std::vector<size_t> order(V);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  const size_t k = top_k > 0 ? std::min(size_t(top_k), V) : V;
  std::vector<double> p(V, 0.0);
  double z = 0;
  for (size_t i = 0; i < k; ++i) z += (p[order[i]] = std::exp(double(logits[order[i]]) / temperature));
  for (double& x : p) x /= z;
  return p;
}

// Pearson's chi-square statistic of `draws` samples against `p`, and its degrees of freedom.
// A sample on an id of probability 0 fails the test outright.
std::pair<double, int> chi_square(const std::vector<float>& logits, const std::vector<double>& p, double temperature,
                                  int64_t top_k, uint64_t seed, int draws) {
  std::vector<int> seen(logits.size(), 0);
  for (int d = 0; d < draws; ++d) seen[size_t(sample_token(logits.data(), int64_t(logits.size()), temperature, top_k,
                                                           seed, uint64_t(d)))]++;
  double stat = 0;
  int bins = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == 0) {
      EXPECT_EQ(seen[i], 0) << "id " << i << " is outside the top " << top_k;
      continue;
    }
    const double e = p[i] * draws;
    stat += (seen[i] - e) * (seen[i] - e) / e;
    ++bins;
  }
  return {stat, bins - 1};
}

// Upper 1e-4 quantiles of the chi-square distribution, by degrees of freedom. The draws are
// deterministic (seeded), so a correct sampler passes every time; a wrong distribution of
// these sizes gives statistics in the hundreds or more.
double chi_square_bound(int df) {
  static const double q[] = {0, 15.137, 18.421, 21.108, 23.513, 25.745, 27.856, 29.878};
  return q[df];
}

const std::vector<float> kLogits = {0.0f, 2.0f, 1.0f, -1.0f, 1.9f, 0.5f, -0.3f, 1.2f};

TEST(Sampling, TemperatureZeroIsTheArgmax) {
  std::mt19937 rng(4);
  std::normal_distribution<float> nd;
  for (int trial = 0; trial < 50; ++trial) {
    std::vector<float> l(37);
    for (auto& x : l) x = nd(rng);
    const int32_t best = int32_t(std::max_element(l.begin(), l.end()) - l.begin());
    for (uint64_t d = 0; d < 3; ++d) {
      EXPECT_EQ(sample_token(l.data(), 37, 0.0, 0, trial, d), best);
      EXPECT_EQ(sample_token(l.data(), 37, 0.0, 5, trial, d), best);
    }
  }
}

TEST(Sampling, DrawsFollowSoftmaxOfLogitsOverTemperature) {
  const int draws = 40000;
  for (double temperature : {0.5, 1.0, 2.0}) {
    const auto p = expected_distribution(kLogits, temperature, 0);
    const auto [stat, df] = chi_square(kLogits, p, temperature, 0, 11, draws);
    EXPECT_EQ(df, 7);
    EXPECT_LT(stat, chi_square_bound(df)) << "temperature " << temperature;
  }
}

TEST(Sampling, TopKKeepsExactlyTheKLargestRenormalised) {
  const int draws = 40000;
  for (int64_t k : {1, 2, 3, 5, 8, 20}) {
    for (double temperature : {0.7, 1.5}) {
      const auto p = expected_distribution(kLogits, temperature, k);
      if (k == 1) {
        for (uint64_t d = 0; d < 200; ++d) EXPECT_EQ(sample_token(kLogits.data(), 8, temperature, 1, 2, d), 1);
        continue;
      }
      const auto [stat, df] = chi_square(kLogits, p, temperature, k, 12 + uint64_t(k), draws);
      EXPECT_EQ(df, std::min<int64_t>(k, 8) - 1);
      EXPECT_LT(stat, chi_square_bound(df)) << "top_k " << k << ", temperature " << temperature;
    }
  }
  // top_k at or beyond the vocabulary is no restriction: the very same draws.
  for (uint64_t d = 0; d < 300; ++d)
    EXPECT_EQ(sample_token(kLogits.data(), 8, 1.0, 8, 5, d), sample_token(kLogits.data(), 8, 1.0, 0, 5, d));
}

TEST(Sampling, TheSeedDeterminesTheSequence) {
  auto sequence = [](uint64_t seed) {
    std::vector<int32_t> s;
    for (uint64_t d = 0; d < 200; ++d) s.push_back(sample_token(kLogits.data(), 8, 1.0, 0, seed, d));
    return s;
  };
  EXPECT_EQ(sequence(3), sequence(3));
  const auto a = sequence(3), b = sequence(4);
  int differ = 0;
  for (size_t i = 0; i < a.size(); ++i) differ += a[i] != b[i];
  // Two independent draws from this distribution agree with probability sum p^2 < 0.3.
  EXPECT_GT(differ, 100);

  Transformer m(tiny_model(), Device::cpu());
  m.init_weights(3);
  GenerateConfig g;
  g.max_new_tokens = 20;
  g.temperature = 1.0;
  g.seed = 8;
  const auto first = generate_tokens(m, {1, 2, 3}, g, 16, 40, {});
  EXPECT_EQ(first.size(), 20u);
  EXPECT_EQ(generate_tokens(m, {1, 2, 3}, g, 16, 40, {}), first);
  g.seed = 9;
  EXPECT_NE(generate_tokens(m, {1, 2, 3}, g, 16, 40, {}), first);
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

  Transformer m(tiny_model(), Device::cpu());
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
