// Model-level checks of the dense transformer: gradients of the whole model against finite
// differences, consistency of the three forward paths, gradient accumulation, and
// bitwise reproducibility.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/buffer.h"
#include "model/init.h"
#include "model/transformer.h"

namespace dstrain {
namespace {

ModelConfig tiny(bool gqa, bool tied) {
  ModelConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = gqa ? 2 : 4;
  c.vocab_size = 23;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.3;
  return c;
}

struct Data {
  std::vector<int32_t> tokens, targets;
  int64_t B, T;
  Data(int64_t b, int64_t t, int64_t V, unsigned seed) : tokens(size_t(b * t)), targets(size_t(b * t)), B(b), T(t) {
    std::mt19937 rng(seed);
    for (auto& x : tokens) x = int32_t(rng() % V);
    for (auto& x : targets) x = int32_t(rng() % V);
  }
  Tensor tok() { return Tensor(tokens.data(), DType::I32, Shape{B, T}); }
  Tensor tgt() { return Tensor(targets.data(), DType::I32, Shape{B, T}); }
};

void perturb_norms(Transformer& m) {
  // Norm weights away from 1 so their gradients are exercised.
  for (int id = 0; id < m.params().size(); ++id) {
    if (m.params().info(id).kind != ParamKind::Norm) continue;
    float* p = m.params().param(id).data<float>();
    for (int64_t i = 0; i < m.params().info(id).numel(); ++i) p[i] = 1.0f + 0.2f * std::sin(float(i + id));
  }
}

class ModelGradients : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(ModelGradients, MatchFiniteDifferences) {
  const auto [gqa, tied] = GetParam();
  Transformer m(tiny(gqa, tied), Device::cpu());
  m.init_weights(11);
  perturb_norms(m);
  Data d(2, 7, m.config().vocab_size, 3);
  d.targets[4] = ops::kIgnoreIndex;
  auto loss = [&] {
    LossSums s = m.forward_loss(d.tok(), d.tgt());
    return s.sum / double(s.count);
  };
  const LossSums s0 = m.forward_loss(d.tok(), d.tgt());
  m.params().grads().zero();
  m.forward_backward(d.tok(), d.tgt(), float(1.0 / double(s0.count)));
  std::mt19937 pick(5);
  for (int id = 0; id < m.params().size(); ++id) {
    const ParamInfo& p = m.params().info(id);
    float* w = m.params().param(id).data<float>();
    const float* g = m.params().grad(id).data<float>();
    double gmax = 1e-4;
    for (int64_t i = 0; i < p.numel(); ++i) gmax = std::max(gmax, double(std::fabs(g[i])));
    for (int k = 0; k < 6; ++k) {
      const int64_t i = int64_t(pick() % uint32_t(p.numel()));
      const float orig = w[i];
      const double h = 1e-2;
      w[i] = float(orig + h);
      const double lp = loss();
      w[i] = float(orig - h);
      const double lm = loss();
      w[i] = orig;
      EXPECT_NEAR(g[i], (lp - lm) / (2 * h), 3e-2 * gmax) << p.name << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelGradients,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& tp) {
                           return std::string(std::get<0>(tp.param) ? "gqa" : "mha") +
                                  (std::get<1>(tp.param) ? "_tied" : "_untied");
                         });

TEST(Model, ForwardPathsAgree) {
  Transformer m(tiny(true, false), Device::cpu());
  m.init_weights(1);
  Data d(2, 9, m.config().vocab_size, 4);
  const int64_t V = m.config().vocab_size;
  std::vector<float> logits(size_t(d.B * d.T * V)), last(size_t(d.B * V));
  m.forward_logits(d.tok(), Tensor(logits.data(), DType::F32, Shape{d.B, d.T, V}));
  m.last_logits(d.tok(), Tensor(last.data(), DType::F32, Shape{d.B, V}));
  double loss = 0;
  for (int64_t n = 0; n < d.B * d.T; ++n) {
    const float* row = logits.data() + n * V;
    double mx = *std::max_element(row, row + V), z = 0;
    for (int64_t v = 0; v < V; ++v) z += std::exp(row[v] - mx);
    loss += mx + std::log(z) - row[d.targets[size_t(n)]];
  }
  const LossSums s = m.forward_loss(d.tok(), d.tgt());
  EXPECT_EQ(s.count, d.B * d.T);
  EXPECT_NEAR(s.sum, loss, 1e-4 * std::fabs(loss));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t v = 0; v < V; ++v)
      EXPECT_FLOAT_EQ(last[size_t(b * V + v)], logits[size_t(((b * d.T) + d.T - 1) * V + v)]);
  // A prefix of a sequence sees the same logits (causality).
  std::vector<float> prefix(size_t(4 * V));
  Data p = d;
  p.B = 1;
  p.T = 4;
  p.tokens.assign(d.tokens.begin(), d.tokens.begin() + 4);
  m.forward_logits(p.tok(), Tensor(prefix.data(), DType::F32, Shape{1, 4, V}));
  for (int64_t i = 0; i < 4 * V; ++i) EXPECT_NEAR(prefix[size_t(i)], logits[size_t(i)], 1e-5);
}

TEST(Model, GradientAccumulationEqualsOneBigBatch) {
  Transformer m(tiny(true, true), Device::cpu());
  m.init_weights(2);
  Data d(4, 6, m.config().vocab_size, 5);
  const float scale = 1.0f / float(d.B * d.T);
  m.params().grads().zero();
  m.forward_backward(d.tok(), d.tgt(), scale);
  std::vector<float> big(m.params().grads().data<float>(), m.params().grads().data<float>() + m.params().flat_numel());
  m.params().grads().zero();
  for (int64_t h = 0; h < 2; ++h) {
    Tensor tok = d.tok().slice(2 * h, 2 * h + 2), tgt = d.tgt().slice(2 * h, 2 * h + 2);
    m.forward_backward(tok, tgt, scale);
  }
  const float* acc = m.params().grads().data<float>();
  double gmax = 0;
  for (float g : big) gmax = std::max(gmax, double(std::fabs(g)));
  for (size_t i = 0; i < big.size(); ++i) ASSERT_NEAR(acc[i], big[i], 1e-5 * gmax) << i;
}

TEST(Model, InitialisationIsReproducibleAndHasTheConfiguredSpread) {
  Transformer a(tiny(false, false), Device::cpu()), b(tiny(false, false), Device::cpu());
  a.init_weights(42);
  b.init_weights(42);
  ASSERT_EQ(0, std::memcmp(a.params().values().data(), b.params().values().data(), a.params().values().nbytes()));
  b.init_weights(43);
  EXPECT_NE(0, std::memcmp(a.params().values().data(), b.params().values().data(), a.params().values().nbytes()));
  const int id = a.params().find("model.layers.1.mlp.down_proj.weight");
  ASSERT_GE(id, 0);
  const Tensor w = a.params().param(id);
  double s2 = 0, s1 = 0;
  for (int64_t i = 0; i < w.numel(); ++i) {
    s1 += w.data<float>()[i];
    s2 += double(w.data<float>()[i]) * w.data<float>()[i];
  }
  const double mean = s1 / double(w.numel()), stdev = std::sqrt(s2 / double(w.numel()) - mean * mean);
  EXPECT_NEAR(stdev, 0.3, 0.05);
  const int norm = a.params().find("model.norm.weight");
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(a.params().param(norm).data<float>()[i], 1.0f);
}

TEST(Model, FusedProjectionsAreContiguousInTheRegistry) {
  Transformer m(tiny(true, false), Device::cpu());
  const ParamRegistry& r = m.params();
  const ParamInfo& q = r.info(r.find("model.layers.0.self_attn.q_proj.weight"));
  const ParamInfo& k = r.info(r.find("model.layers.0.self_attn.k_proj.weight"));
  const ParamInfo& v = r.info(r.find("model.layers.0.self_attn.v_proj.weight"));
  EXPECT_EQ(k.offset, q.offset + q.numel());
  EXPECT_EQ(v.offset, k.offset + k.numel());
  EXPECT_EQ(k.shape, (Shape{8, 16}));
  EXPECT_EQ(r.find("lm_head.weight") >= 0, true);
  Transformer t(tiny(true, true), Device::cpu());
  EXPECT_EQ(t.params().find("lm_head.weight"), -1);
}

// The activation estimate the OOM fallback and the memory budget rely on matches what a
// forward and backward really allocate: dense, GQA, and DeepSeek-V3 with MLA, MoE and MTP.
TEST(Model, ActivationEstimateMatchesWhatATrainingStepAllocates) {
  ModelConfig v3 = load_hf_config(std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/deepseek-v3-tiny.json");
  ModelConfig dense = tiny(true, false);
  dense.max_position_embeddings = 64;
  for (const ModelConfig& c : {dense, v3}) {
    Transformer m(c, Device::cpu());
    m.init_weights(5);
    const int64_t B = 2, T = 64;
    Data d(B, T, c.vocab_size, 9);
    LossScales scales;
    scales.token = float(1.0 / double(B * T));
    scales.sequence = 1.0 / double(B);
    scales.micro_batch = 1.0;
    for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k) scales.mtp_token.push_back(0.3f / float(B * T));
    const auto before = memory_stats();
    m.forward_backward(d.tok(), d.tgt(), scales);
    const auto after = memory_stats();
    const auto held = [](const MemoryStats& s) {
      return s.bytes[size_t(MemCategory::Activations)] + s.bytes[size_t(MemCategory::Workspace)];
    };
    const double used = double(held(after) - held(before)), estimate = double(m.activation_bytes(B, T));
    EXPECT_GT(used, 0.0);
    std::printf("[ activations ] %s: estimated %.0f bytes, allocated %.0f (ratio %.3f)\n",
                c.mla() ? c.model_type.c_str() : "dense", estimate, used, estimate / used);
    EXPECT_NEAR(estimate / used, 1.0, 0.15) << c.model_type << ": estimated " << estimate << " bytes, allocated "
                                            << used;
    m.release_activations();
  }
}

}  // namespace
}  // namespace dstrain
