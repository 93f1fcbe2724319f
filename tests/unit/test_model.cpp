// Model-level checks: gradients of the whole dense and DeepSeek-V3 models (MLA, MoE with
// sigmoid/noaux_tc routing and its aux loss, MTP) against finite differences, the MTP input
// convention, consistency of the three forward paths, gradient accumulation, and bitwise
// reproducibility.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "finite_difference.h"
#include "tiny_models.h"
#include "core/buffer.h"
#include "model/init.h"
#include "model/moe.h"
#include "model/transformer.h"

namespace dstrain {
namespace {

// Runs the enclosing scope on one thread: finite differences make hundreds of tiny
// forwards, where thread start-up would dominate. Restores the count on any exit.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

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

// |grad - fd| / max |grad| of the tensor: measured at most 2.9e-4.
constexpr double kDenseGradTol = 1e-3;

class ModelGradients : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(ModelGradients, MatchFiniteDifferences) {
  const auto [gqa, tied] = GetParam();
  const OneThread one_thread;
  Transformer m(tiny_dense(gqa, tied), Device::cpu());
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
  double worst = 0;
  std::string worst_name;
  int checked = 0;
  for (int id = 0; id < m.params().size(); ++id) {
    const ParamInfo& p = m.params().info(id);
    float* w = m.params().param(id).data<float>();
    const float* g = m.params().grad(id).data<float>();
    double gmax = 1e-4;
    for (int64_t i = 0; i < p.numel(); ++i) gmax = std::max(gmax, double(std::fabs(g[i])));
    const int samples = 24;
    for (int k = 0; k < std::min<int64_t>(samples, p.numel()); ++k) {
      const int64_t i = p.numel() <= samples ? k : int64_t(pick() % uint32_t(p.numel()));
      const double fd = richardson_fd(w, i, 2e-2, loss), err = std::fabs(g[i] - fd) / gmax;
      EXPECT_NEAR(g[i], fd, kDenseGradTol * gmax) << p.name << "[" << i << "]";
      ++checked;
      if (err > worst) {
        worst = err;
        worst_name = p.name;
      }
    }
  }
  std::printf("[ model FD ] %s %s: max |grad - fd| / max|grad| %.1e (%s) over %d elements\n", gqa ? "gqa" : "mha",
              tied ? "tied" : "untied", worst, worst_name.c_str(), checked);
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelGradients,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& tp) {
                           return std::string(std::get<0>(tp.param) ? "gqa" : "mha") +
                                  (std::get<1>(tp.param) ? "_tied" : "_untied");
                         });

TEST(Model, ForwardPathsAgree) {
  Transformer m(tiny_dense(true, false), Device::cpu());
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
  // The last-position path multiplies B rows by the head where the full path multiplies B*T:
  // the BLAS may block the two differently, so they agree to GEMM rounding, not bitwise.
  float scale = 0;
  for (float l : logits) scale = std::max(scale, std::fabs(l));
  for (int64_t b = 0; b < d.B; ++b)
    for (int64_t v = 0; v < V; ++v)
      EXPECT_NEAR(last[size_t(b * V + v)], logits[size_t(((b * d.T) + d.T - 1) * V + v)], 2e-6f * scale);
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
  Transformer m(tiny_dense(true, true), Device::cpu());
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
  Transformer a(tiny_dense(false, false), Device::cpu()), b(tiny_dense(false, false), Device::cpu());
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
  Transformer m(tiny_dense(true, false), Device::cpu());
  const ParamRegistry& r = m.params();
  const ParamInfo& q = r.info(r.find("model.layers.0.self_attn.q_proj.weight"));
  const ParamInfo& k = r.info(r.find("model.layers.0.self_attn.k_proj.weight"));
  const ParamInfo& v = r.info(r.find("model.layers.0.self_attn.v_proj.weight"));
  EXPECT_EQ(k.offset, q.offset + q.numel());
  EXPECT_EQ(v.offset, k.offset + k.numel());
  EXPECT_EQ(k.shape, (Shape{8, 16}));
  EXPECT_EQ(r.find("lm_head.weight") >= 0, true);
  Transformer t(tiny_dense(true, true), Device::cpu());
  EXPECT_EQ(t.params().find("lm_head.weight"), -1);
}

// "mla_up_proj" on a model without MLA is refused, naming the part and the model type.
TEST(Model, MlaUpProjRecomputationNeedsMla) {
  Transformer m(tiny_dense(true, false), Device::cpu());
  RecomputePolicy rp;
  rp.mla_up_proj = true;
  try {
    m.set_recompute(rp);
    FAIL() << "mla_up_proj was accepted for a model without MLA";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("\"mla_up_proj\" forms MLA's heads again, but model_type"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(m.recompute().mla_up_proj);
}

// The activation estimate the OOM fallback and the memory budget rely on matches what a
// forward and backward really allocate: dense, GQA, and DeepSeek-V3 with MLA, MoE and MTP.
TEST(Model, ActivationEstimateMatchesWhatATrainingStepAllocates) {
  ModelConfig v3 = load_hf_config(std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/deepseek-v3-tiny.json");
  ModelConfig dense = tiny_dense(true, false);
  dense.max_position_embeddings = 64;
  // Layers enough for recomputed groups before the last (which keeps its activations).
  dense.num_hidden_layers = 6;
  v3.num_hidden_layers = 6;
  struct Policy {
    const char* name;
    bool full;
    RecomputePolicy::Method method;
    int64_t num_layers;
    bool selective = false;
    bool mla_up_proj = false;  // MLA models only
    bool cpu_checkpointing = false;
  };
  const Policy policies[] = {{"none", false, RecomputePolicy::Method::Uniform, 1},
                             {"full uniform 1", true, RecomputePolicy::Method::Uniform, 1},
                             {"full uniform 2", true, RecomputePolicy::Method::Uniform, 2},
                             {"full block 1", true, RecomputePolicy::Method::Block, 1},
                             {"selective layernorm, moe_act", false, RecomputePolicy::Method::Uniform, 1, true},
                             {"selective mla_up_proj", false, RecomputePolicy::Method::Uniform, 1, false, true},
                             {"full uniform 1 and selective", true, RecomputePolicy::Method::Uniform, 1, true, true},
                             {"full uniform 1, cpu_checkpointing", true, RecomputePolicy::Method::Uniform, 1, false,
                              false, true}};
  for (const ModelConfig& c : {dense, v3}) {
   for (const Policy& pol : policies) {
    if (pol.mla_up_proj && !c.mla()) continue;
    Transformer m(c, Device::cpu());
    m.init_weights(5);
    RecomputePolicy rp;
    rp.full = pol.full;
    rp.method = pol.method;
    rp.num_layers = pol.num_layers;
    rp.layernorm = rp.moe_act = pol.selective;
    rp.mla_up_proj = pol.mla_up_proj;
    rp.cpu_checkpointing = pol.cpu_checkpointing;
    m.set_recompute(rp);
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
    std::printf("[ activations ] %s, recompute %s: estimated %.0f bytes, allocated %.0f (ratio %.3f)\n",
                c.mla() ? c.model_type.c_str() : "dense", pol.name, estimate, used, estimate / used);
    EXPECT_NEAR(estimate / used, 1.0, 0.15) << c.model_type << ", recompute " << pol.name << ": estimated " << estimate
                                            << " bytes, allocated " << used;
    m.release_activations();
   }
  }
}

// ---- DeepSeek-V3: MLA + MoE (sigmoid scores, noaux_tc, aux loss) + MTP ------------------
// Norms away from 1, routers with widely spread logits (small perturbations rarely change
// a choice) and nonzero routing biases.
void init_v3(Transformer& m, uint64_t seed) {
  m.init_weights(seed);
  perturb_norms(m);
  ParamRegistry& r = m.params();
  for (int id = 0; id < r.size(); ++id) {
    const ParamInfo& p = r.info(id);
    float* w = r.param(id).data<float>();
    if (p.kind == ParamKind::RouterBias) {
      for (int64_t e = 0; e < p.numel(); ++e) w[e] = 0.05f * std::sin(3.0f * float(e) + float(id));
    } else if (p.name.find("mlp.gate.weight") != std::string::npos) {
      fill_normal(r.param(id), 1.0, seed, stream_id(p.name));
    }
  }
}

LossScales v3_scales(const Transformer& m, int64_t B, int64_t T, bool with_ce) {
  LossScales s;
  s.token = with_ce ? float(1.0 / double(B * T)) : 0.0f;
  s.sequence = 1.0 / double(B);
  s.micro_batch = 1.0;
  for (int k = 0; k < m.mtp_depth(); ++k) s.mtp_token.push_back(float(0.3 / m.mtp_depth() / double(B * (T - k - 1))));
  return s;
}

struct V3Loss {
  double total = 0, aux = 0, mtp = 0;
  LossSums sums;
  std::vector<std::vector<int32_t>> routing;  // chosen experts of every MoE layer
};

// One forward and backward (gradients accumulate; callers zero them): the loss it
// differentiates, its parts, and the routing it took.
V3Loss v3_step(Transformer& m, Data& d, const LossScales& s) {
  for (auto& [l, ffn] : m.moe_layers()) ffn->routing()->reset();
  V3Loss r;
  r.sums = m.forward(0, d.tok(), d.tgt(), s);
  for (auto& [l, ffn] : m.moe_layers()) {
    r.aux += ffn->routing()->aux_loss;
    Tensor ids = dynamic_cast<MoEBlock&>(*ffn).ids(m.activations(), 0);
    r.routing.emplace_back(ids.data<int32_t>(), ids.data<int32_t>() + ids.numel());
  }
  m.backward(0);
  for (size_t k = 0; k < r.sums.mtp_sum.size(); ++k) r.mtp += r.sums.mtp_sum[k] * double(s.mtp_token[k]);
  r.total = r.sums.sum * double(s.token) + r.aux + r.mtp;
  return r;
}

// |grad - fd| / max |grad| of the tensor: measured at most 1.0e-3 (fp32 forwards; the
// smallest gradients, of the MTP + aux loss alone, sit near fp32's resolution of the loss).
constexpr double kV3GradTol = 3e-3;

// Every trainable tensor of a V3 model at `samples` random elements (all of the small ones),
// twice: with the full loss, and with the CE term dropped so that the MTP and aux terms,
// which are small next to it, are checked on their own (the MTP gradient into the main
// model flows through the final norm output).
TEST(DeepSeekV3Gradients, WholeModelWithMTPAndAuxLossMatchFiniteDifferences) {
  const OneThread one_thread;
  Transformer m(tiny_v3(1), Device::cpu());
  init_v3(m, 17);
  Data d(2, 6, m.config().vocab_size, 8);
  d.targets[3] = ops::kIgnoreIndex;
  ParamRegistry& r = m.params();
  for (bool with_ce : {true, false}) {
    const LossScales s = v3_scales(m, d.B, d.T, with_ce);
    r.grads().zero();
    const V3Loss base = v3_step(m, d, s);
    ASSERT_GT(base.aux, 0.0);
    ASSERT_GT(base.mtp, 0.0);
    const std::vector<float> grads(r.grads().data<float>(), r.grads().data<float>() + r.flat_numel());
    const double h = 2e-2;
    double worst = 0, worst_mtp = 0;
    std::string worst_name;
    int checked = 0, skipped = 0;
    std::mt19937 pick(13);
    for (int id = 0; id < r.size(); ++id) {
      const ParamInfo& p = r.info(id);
      if (!p.trainable) continue;
      float* w = r.param(id).data<float>();
      const float* g = grads.data() + p.offset;
      double gmax = 1e-3;
      for (int64_t i = 0; i < p.numel(); ++i) gmax = std::max(gmax, double(std::fabs(g[i])));
      const int samples = 8;
      for (int k = 0; k < std::min<int64_t>(samples, p.numel()); ++k) {
        const int64_t i = p.numel() <= samples ? k : int64_t(pick() % uint32_t(p.numel()));
        bool same_routing = true;
        const double fd = richardson_fd(w, i, h, [&] {
          const V3Loss l = v3_step(m, d, s);
          same_routing = same_routing && l.routing == base.routing;
          return l.total;
        });
        if (!same_routing) {
          ++skipped;
          continue;
        }
        ++checked;
        const double err = std::fabs(g[i] - fd) / gmax;
        EXPECT_NEAR(g[i], fd, kV3GradTol * gmax) << p.name << "[" << i << "]" << (with_ce ? "" : " without CE");
        if (err > worst) {
          worst = err;
          worst_name = p.name;
        }
        if (p.layer >= m.config().num_hidden_layers) worst_mtp = std::max(worst_mtp, err);
      }
    }
    std::printf("[ V3 FD ] %s: max |grad - fd| / max|grad| %.1e (%s), MTP module %.1e; %d checked, %d skipped "
                "(routing flipped)\n",
                with_ce ? "full loss " : "MTP + aux ", worst, worst_name.c_str(), worst_mtp, checked, skipped);
    EXPECT_LT(skipped * 5, checked) << "too many samples changed the routing";
  }
}

// Copies every parameter of `from` whose name, with `rename` applied, exists in `to`.
void copy_params(const ParamRegistry& from, ParamRegistry& to, const std::function<std::string(std::string)>& rename) {
  for (int id = 0; id < from.size(); ++id) {
    const int dst = to.find(rename(from.info(id).name));
    if (dst < 0) continue;
    ASSERT_EQ(to.info(dst).numel(), from.info(id).numel()) << from.info(id).name;
    std::memcpy(to.param(dst).data<float>(), from.param(id).data<float>(), size_t(from.info(id).numel()) * sizeof(float));
  }
}

// (rows, C) -> RMSNorm with weight w, in double.
std::vector<double> rmsnorm_rows(const std::vector<double>& x, const float* w, int64_t C, double eps) {
  std::vector<double> y(x.size());
  for (size_t n = 0; n < x.size() / size_t(C); ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += x[n * size_t(C) + size_t(c)] * x[n * size_t(C) + size_t(c)];
    const double rs = 1.0 / std::sqrt(ss / double(C) + eps);
    for (int64_t c = 0; c < C; ++c) y[n * size_t(C) + size_t(c)] = double(w[c]) * x[n * size_t(C) + size_t(c)] * rs;
  }
  return y;
}

// The MTP module reads the main model's output after model.norm (the final RMSNorm), as
// vLLM's and Megatron-Core's DeepSeek MTP do. Rebuilt here step by step: the main model's
// normed output h (a copy of the main model whose head is the identity), then by hand
// x = eh_proj [enorm(embed(t_{i+1})); hnorm(h_i)], then the MTP decoder layer (a one-layer
// model holding the MTP layer's weights, whose embedding rows are x and whose final norm is
// shared_head.norm), then the shared head and the cross-entropy by hand.
TEST(MultiTokenPrediction, ReadsThePostNormOutputOfTheMainModel) {
  const ModelConfig c = tiny_v3(1);
  Transformer m(c, Device::cpu());
  init_v3(m, 23);
  Data d(2, 6, c.vocab_size, 9);
  const int64_t B = d.B, T = d.T, N = B * T, C = c.hidden_size, V = c.vocab_size, L = c.num_hidden_layers;
  const LossScales s = v3_scales(m, B, T, true);
  const V3Loss got = v3_step(m, d, s);
  auto P = [&](const std::string& name) {
    const int id = m.params().find(name);
    EXPECT_GE(id, 0) << name;
    return m.params().param(id).data<float>();
  };

  // h (N,C): the main model's output after model.norm.
  ModelConfig main_cfg = c;
  main_cfg.num_nextn_predict_layers = 0;
  Transformer main(main_cfg, Device::cpu());
  copy_params(m.params(), main.params(), [](std::string n) { return n; });
  float* head = main.params().param(main.params().find("lm_head.weight")).data<float>();
  std::fill(head, head + V * C, 0.0f);
  for (int64_t i = 0; i < C; ++i) head[i * C + i] = 1.0f;  // (V,C) = [I; 0]
  std::vector<float> h_logits(size_t(N * V));
  main.forward_logits(d.tok(), Tensor(h_logits.data(), DType::F32, Shape{B, T, V}));
  std::vector<double> h(size_t(N * C)), emb(size_t(N * C));
  const float* table = P("model.embed_tokens.weight");
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < C; ++i) h[size_t(n * C + i)] = h_logits[size_t(n * V + i)];
    // Position t reads token t+1: the main model's target at t.
    for (int64_t i = 0; i < C; ++i) emb[size_t(n * C + i)] = table[int64_t(d.targets[size_t(n)]) * C + i];
  }
  const std::string mtp = fmt::format("model.layers.{}.", L);
  const std::vector<double> en = rmsnorm_rows(emb, P(mtp + "enorm.weight"), C, c.rms_norm_eps);
  const std::vector<double> hn = rmsnorm_rows(h, P(mtp + "hnorm.weight"), C, c.rms_norm_eps);
  const float* eh = P(mtp + "eh_proj.weight");  // (C, 2C)

  // The MTP decoder layer as layer 0 of a one-layer model; embedding row n = x[n].
  ModelConfig layer_cfg = c;
  layer_cfg.num_hidden_layers = 1;
  layer_cfg.first_k_dense_replace = 0;
  layer_cfg.num_nextn_predict_layers = 0;
  layer_cfg.vocab_size = std::max(N, C);
  const int64_t Vq = layer_cfg.vocab_size;
  Transformer layer(layer_cfg, Device::cpu());
  copy_params(m.params(), layer.params(), [&](std::string n) {
    if (n == mtp + "shared_head.norm.weight") return std::string("model.norm.weight");
    if (n.rfind(mtp, 0) == 0) return "model.layers.0." + n.substr(mtp.size());
    return std::string("-");
  });
  ParamRegistry& lr = layer.params();
  float* x = lr.param(lr.find("model.embed_tokens.weight")).data<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t o = 0; o < C; ++o) {
      double acc = 0;
      for (int64_t i = 0; i < C; ++i) acc += double(eh[o * 2 * C + i]) * en[size_t(n * C + i)];
      for (int64_t i = 0; i < C; ++i) acc += double(eh[o * 2 * C + C + i]) * hn[size_t(n * C + i)];
      x[n * C + o] = float(acc);
    }
  float* id_head = lr.param(lr.find("lm_head.weight")).data<float>();
  std::fill(id_head, id_head + Vq * C, 0.0f);
  for (int64_t i = 0; i < C; ++i) id_head[i * C + i] = 1.0f;
  std::vector<int32_t> rows(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) rows[size_t(n)] = int32_t(n);
  std::vector<float> out(size_t(N * Vq));
  layer.forward_logits(Tensor(rows.data(), DType::I32, Shape{B, T}), Tensor(out.data(), DType::F32, Shape{B, T, Vq}));

  // Shared head and CE: position t predicts token t+2 (the main target at t+1); the last
  // position has none.
  const float* W = P("lm_head.weight");
  double sum = 0;
  int64_t count = 0;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t + 1 < T; ++t) {
      const int64_t n = b * T + t;
      std::vector<double> logit(static_cast<size_t>(V));
      double mx = -1e300, z = 0;
      for (int64_t v = 0; v < V; ++v) {
        for (int64_t i = 0; i < C; ++i) logit[size_t(v)] += double(W[v * C + i]) * out[size_t(n * Vq + i)];
        mx = std::max(mx, logit[size_t(v)]);
      }
      for (double l : logit) z += std::exp(l - mx);
      sum += mx + std::log(z) - logit[size_t(d.targets[size_t(n + 1)])];
      ++count;
    }
  ASSERT_EQ(got.sums.mtp_count.size(), 1u);
  EXPECT_EQ(got.sums.mtp_count[0], count);
  std::printf("[ MTP ] MTP CE sum %.7f, rebuilt from the post-norm main output %.7f (relative error %.1e)\n",
              got.sums.mtp_sum[0], sum, std::fabs(got.sums.mtp_sum[0] - sum) / sum);
  EXPECT_NEAR(got.sums.mtp_sum[0], sum, 2e-6 * sum);
}

// MTP runs on all T positions. Depth 1 at the last position reads the window's last token
// and the main model's output there, and has no target (it would predict the token after the
// window): what it reads does not change the MTP loss (attention is causal, earlier
// positions do not see it). It still passes through the MTP layer's MoE and so counts in
// that layer's expert loads and in its balance loss, like every other position.
TEST(MultiTokenPrediction, TheLastPositionCountsInTheMoELoadsButNotInTheLoss) {
  const ModelConfig c = tiny_v3(1);
  Transformer m(c, Device::cpu());
  init_v3(m, 29);
  Data d(2, 6, c.vocab_size, 10);
  const int64_t B = d.B, T = d.T, k = c.num_experts_per_tok;
  const LossScales s = v3_scales(m, B, T, true);
  FeedForwardBlock* mtp_moe = nullptr;
  for (auto& [l, ffn] : m.moe_layers())
    if (l == c.num_hidden_layers) mtp_moe = ffn;
  ASSERT_NE(mtp_moe, nullptr);
  auto run = [&] {
    const V3Loss r = v3_step(m, d, s);
    const std::vector<int64_t> load = mtp_moe->routing()->tokens_per_expert;
    const double aux = mtp_moe->routing()->aux_loss;
    return std::tuple{r, load, aux};
  };
  const auto [r0, load0, aux0] = run();
  int64_t routed = 0;
  for (int64_t n : load0) routed += n;
  EXPECT_EQ(routed, B * T * k) << "every position of every sequence is routed in the MTP layer";
  EXPECT_EQ(r0.sums.mtp_count[0], B * (T - 1)) << "the last position has no MTP target";
  // What the last position reads: the main model's output there (through its last token).
  for (int64_t b = 0; b < B; ++b) {
    int32_t& t = d.tokens[size_t(b * T + T - 1)];
    t = int32_t((t + 7) % c.vocab_size);
  }
  const auto [r1, load1, aux1] = run();
  EXPECT_NE(r1.sums.sum, r0.sums.sum) << "the main model's last position changed";
  EXPECT_EQ(r1.sums.mtp_count[0], r0.sums.mtp_count[0]);
  EXPECT_NEAR(r1.sums.mtp_sum[0], r0.sums.mtp_sum[0], 1e-6 * r0.sums.mtp_sum[0]) << "the last position has no target";
  EXPECT_GT(std::fabs(aux1 - aux0), 1e-4 * aux0) << "the last position's scores enter the MTP layer's balance loss";
  routed = 0;
  for (int64_t n : load1) routed += n;
  EXPECT_EQ(routed, B * T * k);
}

}  // namespace
}  // namespace dstrain
