// Mixed precision of the model (PRECISION.md): the 16-bit compute copy of the fp32 master
// weights, a bf16/fp16 forward and backward against the fp32 one from the same weights, the
// dtypes of what the forward stores and the activation estimate, the split backward, and
// training in bf16. On the tiny dense (GQA, tied and untied) and DeepSeek-V3 (MLA, MoE with
// sigmoid/noaux_tc routing and the aux loss, MTP) models of tiny_models.h.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "tiny_models.h"
#include "core/buffer.h"
#include "model/init.h"
#include "model/moe.h"
#include "model/transformer.h"
#include "optim/adamw.h"

namespace dstrain {
namespace {

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

struct Case {
  const char* name;
  ModelConfig config;
};

std::vector<Case> cases() {
  return {{"dense_gqa_untied", tiny_dense(true, false)},
          {"dense_gqa_tied", tiny_dense(true, true)},
          {"v3_mla_moe_mtp", tiny_v3(1)}};
}

// Hugging Face's initialisation, with norms away from 1, widely spread router logits (a
// 16-bit rounding of the router's input rarely changes a choice) and nonzero routing biases.
void init(Transformer& m, uint64_t seed) {
  m.init_weights(seed);
  ParamRegistry& r = m.params();
  for (int id = 0; id < r.size(); ++id) {
    const ParamInfo& p = r.info(id);
    float* w = r.param(id).data<float>();
    if (p.kind == ParamKind::Norm) {
      for (int64_t i = 0; i < p.numel(); ++i) w[i] = 1.0f + 0.2f * std::sin(float(i + id));
    } else if (p.kind == ParamKind::RouterBias) {
      for (int64_t e = 0; e < p.numel(); ++e) w[e] = 0.05f * std::sin(3.0f * float(e) + float(id));
    } else if (p.name.find("mlp.gate.weight") != std::string::npos) {
      fill_normal(r.param(id), 1.0, seed, stream_id(p.name));
    }
  }
  r.refresh_compute();  // the masters changed
}

LossScales scales_for(const Transformer& m, int64_t B, int64_t T) {
  LossScales s;
  s.token = float(1.0 / double(B * T));
  s.sequence = 1.0 / double(B);
  s.micro_batch = 1.0;
  for (int k = 0; k < m.mtp_depth(); ++k) s.mtp_token.push_back(float(0.3 / m.mtp_depth() / double(B * (T - k - 1))));
  return s;
}

// The step's loss as the backward differentiates it: CE + aux + weighted MTP.
double step_loss(Transformer& m, const LossSums& sums, const LossScales& s) {
  double total = sums.sum * double(s.token);
  for (auto& [l, ffn] : m.moe_layers()) {
    total += ffn->routing()->aux_loss;
    ffn->routing()->reset();
  }
  for (size_t k = 0; k < sums.mtp_sum.size(); ++k) total += sums.mtp_sum[k] * double(s.mtp_token[k]);
  return total;
}

uint16_t round_to(DType dt, float v) { return dt == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v); }

// The number of elements of every parameter whose compute copy is not its rounded master.
int64_t copy_mismatches(const ParamRegistry& r, DType dt, std::string* first = nullptr) {
  int64_t bad = 0;
  for (int id = 0; id < r.size(); ++id) {
    const float* w = r.param(id).data<float>();
    const uint16_t* c = static_cast<const uint16_t*>(r.compute(id).raw());
    for (int64_t i = 0; i < r.info(id).numel(); ++i) {
      if (c[i] != round_to(dt, w[i])) {
        if (!bad && first) *first = r.info(id).name + "[" + std::to_string(i) + "]";
        ++bad;
      }
    }
  }
  return bad;
}

std::vector<float> grads_of(const ParamRegistry& r) {
  return std::vector<float>(r.grads().data<float>(), r.grads().data<float>() + r.flat_numel());
}

// ---- (1) the compute copy --------------------------------------------------------------------

TEST(MixedPrecision, ComputeCopyIsTheRoundedMastersThroughInitLoadAndAdamW) {
  for (DType dt : {DType::BF16, DType::F16}) {
    for (const Case& cs : cases()) {
      SCOPED_TRACE(std::string(cs.name) + " " + std::string(dtype_name(dt)));
      Transformer m(cs.config, Device::cpu());
      ParamRegistry& r = m.params();
      EXPECT_FALSE(r.has_compute_copy());
      init(m, 3);
      m.set_compute_dtype(dt);
      ASSERT_TRUE(r.has_compute_copy());
      EXPECT_EQ(r.compute_dtype(), dt);
      EXPECT_EQ(m.compute_dtype(), dt);
      EXPECT_EQ(r.compute(0).dtype(), dt);
      std::string where;
      EXPECT_EQ(copy_mismatches(r, dt, &where), 0) << "after set_compute_dtype, first at " << where;

      // A new initialisation refreshes it.
      m.init_weights(4);
      EXPECT_EQ(copy_mismatches(r, dt, &where), 0) << "after init_weights, first at " << where;

      // Masters written from outside (a checkpoint or Hugging Face load) are stale in the copy
      // until refresh_compute.
      std::vector<float> loaded(size_t(r.flat_numel()));
      std::mt19937 rng(7);
      std::normal_distribution<float> nd(0.0f, 0.5f);
      for (float& v : loaded) v = nd(rng);
      ops::copy(r.values().tensor(), Tensor(loaded.data(), DType::F32, Shape{r.flat_numel()}));
      EXPECT_GT(copy_mismatches(r, dt), 0);
      r.refresh_compute();
      EXPECT_EQ(copy_mismatches(r, dt, &where), 0) << "after refresh_compute, first at " << where;

      // AdamW updates the copy with the masters; the routing-bias rule does too.
      init(m, 5);
      AdamW opt(AdamWConfig{.lr = 1e-2, .weight_decay = 0.1}, r);
      Data d(2, 6, cs.config.vocab_size, 9);
      const LossScales s = scales_for(m, d.B, d.T);
      for (int step = 0; step < 3; ++step) {
        r.grads().zero();
        m.forward_backward(d.tok(), d.tgt(), s);
        opt.step(1e-2);
        for (auto& [l, ffn] : m.moe_layers()) {
          std::vector<int64_t> counts = ffn->routing()->tokens_per_expert;
          ffn->update_routing_bias(counts, 1e-3);
          ffn->routing()->reset();
        }
        EXPECT_EQ(copy_mismatches(r, dt, &where), 0) << "after step " << step << ", first at " << where;
      }

      // Back to fp32: the copy is dropped and the layers read the masters.
      m.set_compute_dtype(DType::F32);
      EXPECT_FALSE(r.has_compute_copy());
      EXPECT_EQ(r.compute_dtype(), DType::F32);
      EXPECT_EQ(r.compute(1).raw(), r.param(1).raw());
      EXPECT_EQ(r.compute(1).dtype(), DType::F32);
    }
  }
}

// ---- (2) 16-bit forward and backward against fp32 --------------------------------------------

struct Result {
  double loss = 0;
  std::vector<float> grads;
  std::vector<std::vector<int32_t>> routing;
};

Result run_once(const ModelConfig& c, DType dt, Data& d, uint64_t seed) {
  Transformer m(c, Device::cpu());
  init(m, seed);
  m.set_compute_dtype(dt);
  const LossScales s = scales_for(m, d.B, d.T);
  m.params().grads().zero();
  Result r;
  const LossSums sums = m.forward(0, d.tok(), d.tgt(), s);
  for (auto& [l, ffn] : m.moe_layers()) {
    Tensor ids = dynamic_cast<MoEBlock&>(*ffn).ids(m.activations(), 0);
    r.routing.emplace_back(ids.data<int32_t>(), ids.data<int32_t>() + ids.numel());
  }
  m.backward(0);
  r.loss = step_loss(m, sums, s);
  r.grads = grads_of(m.params());
  return r;
}

TEST(MixedPrecision, SixteenBitForwardBackwardMatchesFp32) {
  for (const Case& cs : cases()) {
    Data d(2, 8, cs.config.vocab_size, 11);
    d.targets[5] = ops::kIgnoreIndex;
    const Result ref = run_once(cs.config, DType::F32, d, 21);
    Transformer shape(cs.config, Device::cpu());  // for the parameter table
    const ParamRegistry& reg = shape.params();
    for (DType dt : {DType::BF16, DType::F16}) {
      SCOPED_TRACE(std::string(cs.name) + " " + std::string(dtype_name(dt)));
      const Result got = run_once(cs.config, dt, d, 21);
      const double rel = std::abs(got.loss - ref.loss) / std::abs(ref.loss);
      EXPECT_LT(rel, 1e-2) << "loss " << got.loss << " vs fp32 " << ref.loss;
      // The tiny routers' choices survive the rounding of their inputs (else the gradients of
      // different experts would be compared).
      EXPECT_EQ(got.routing, ref.routing);
      double worst = 1;
      std::string worst_name;
      int compared = 0;
      for (int id = 0; id < reg.size(); ++id) {
        const ParamInfo& p = reg.info(id);
        double dot = 0, na = 0, nb = 0;
        for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
          const double a = ref.grads[size_t(i)], b = got.grads[size_t(i)];
          ASSERT_TRUE(std::isfinite(b)) << p.name;
          dot += a * b;
          na += a * a;
          nb += b * b;
        }
        if (na == 0) {  // no gradient (the routing bias, experts no token chose): none in 16-bit either
          EXPECT_EQ(nb, 0.0) << p.name;
          continue;
        }
        const double cosine = dot / std::sqrt(na * nb);
        ++compared;
        EXPECT_GE(cosine, 0.999) << p.name;
        if (cosine < worst) {
          worst = cosine;
          worst_name = p.name;
        }
      }
      EXPECT_GT(compared, reg.size() / 2);
      std::printf("[ mixed ] %s %s: loss %.6f vs fp32 %.6f (rel %.2e); worst gradient cosine %.6f (%s) of %d\n",
                  cs.name, std::string(dtype_name(dt)).c_str(), got.loss, ref.loss, rel, worst, worst_name.c_str(),
                  compared);
    }
  }
}

// The evaluation and generation paths in bf16: forward_loss gives the training forward's loss,
// forward_logits the fp32 model's logits up to bf16 rounding, last_logits its last positions.
TEST(MixedPrecision, Bf16EvaluationAndGenerationPathsAgree) {
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.name);
    const int64_t B = 2, T = 6, V = cs.config.vocab_size;
    Data d(B, T, V, 14);
    Transformer ref(cs.config, Device::cpu()), m(cs.config, Device::cpu());
    init(ref, 15);
    init(m, 15);
    m.set_compute_dtype(DType::BF16);
    const LossScales s = scales_for(m, B, T);
    const LossSums train = m.forward(0, d.tok(), d.tgt(), s);
    m.backward(0);
    const LossSums eval = m.forward_loss(d.tok(), d.tgt());
    EXPECT_EQ(eval.sum, train.sum);
    EXPECT_EQ(eval.count, train.count);
    std::vector<float> logits(size_t(B * T * V)), want(logits.size()), last(size_t(B * V));
    m.forward_logits(d.tok(), Tensor(logits.data(), DType::F32, Shape{B, T, V}));
    ref.forward_logits(d.tok(), Tensor(want.data(), DType::F32, Shape{B, T, V}));
    m.last_logits(d.tok(), Tensor(last.data(), DType::F32, Shape{B, V}));
    double diff = 0, scale = 0, d2 = 0, w2 = 0;
    for (size_t i = 0; i < logits.size(); ++i) {
      diff = std::max(diff, std::abs(double(logits[i]) - want[i]));
      scale = std::max(scale, std::abs(double(want[i])));
      d2 += (double(logits[i]) - want[i]) * (double(logits[i]) - want[i]);
      w2 += double(want[i]) * want[i];
    }
    std::printf("[ mixed ] %s bf16 logits: max |diff| %.3e of max |logit| %.3e, rms diff / rms logit %.3e\n", cs.name,
                diff, scale, std::sqrt(d2 / w2));
    // Measured 1.4e-2 (1.0e-2 of it with the fp32 model on bf16-rounded weights: the tiny
    // models' large weights amplify the activations' roundings); f16 is 8x closer.
    EXPECT_LT(std::sqrt(d2 / w2), 3e-2) << "bf16 logits against fp32";
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t v = 0; v < V; ++v) {
        EXPECT_NEAR(last[size_t(b * V + v)], logits[size_t((b * T + T - 1) * V + v)], 1e-5 * scale);
      }
    }
  }
}

// ---- (3) what the forward stores, and the activation estimate ---------------------------------

TEST(MixedPrecision, ActivationsAreSixteenBitWhereTheContractSays) {
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.name);
    Transformer m(cs.config, Device::cpu());
    init(m, 2);
    m.set_compute_dtype(DType::BF16);
    Data d(2, 6, cs.config.vocab_size, 4);
    m.forward(0, d.tok(), d.tgt(), scales_for(m, d.B, d.T));
    const ActivationStore& a = m.activations();
    auto dtype = [&](const std::string& key) { return a.get(0, act_key(key)).dtype(); };
    const DType bf = DType::BF16, f32 = DType::F32;
    // The residual stream, rstd and lse: fp32. Norm outputs, projections, attention: bf16.
    EXPECT_EQ(dtype("residual.0"), f32);
    EXPECT_EQ(dtype("residual.2"), f32);
    EXPECT_EQ(dtype("layers.0.residual_mid"), f32);
    EXPECT_EQ(dtype("layers.0.input_layernorm.rstd"), f32);
    EXPECT_EQ(dtype("layers.0.input_layernorm.out"), bf);
    EXPECT_EQ(dtype("layers.1.post_attention_layernorm.out"), bf);
    EXPECT_EQ(dtype("layers.0.attn.qkv"), bf);
    EXPECT_EQ(dtype("layers.0.attn.out"), bf);
    EXPECT_EQ(dtype("layers.0.attn.lse"), f32);
    EXPECT_EQ(dtype("final_norm.out"), bf);
    EXPECT_EQ(dtype("final_norm.rstd"), f32);
    EXPECT_EQ(dtype("head.dxf"), bf);  // the gradient of final_norm.out
    if (cs.config.mla()) {
      for (const char* k : {"kv_latent", "kv_latent_norm", "q_latent", "q_latent_norm"}) {
        EXPECT_EQ(dtype(std::string("layers.0.attn.") + k), bf) << k;
      }
      EXPECT_EQ(dtype("layers.0.attn.kv_latent_rstd"), f32);
      EXPECT_EQ(dtype("layers.0.mlp.gate_up"), bf);  // the dense first layer
      // MoE: the router in fp32, the experts' rows in bf16.
      EXPECT_EQ(dtype("layers.1.mlp.gate.scores"), f32);
      EXPECT_EQ(dtype("layers.1.mlp.gate.weights"), f32);
      EXPECT_EQ(dtype("layers.1.mlp.experts.grouped"), bf);
      EXPECT_EQ(dtype("layers.1.mlp.experts.gate_up"), bf);
      EXPECT_EQ(dtype("layers.1.mlp.shared_experts.h"), bf);
      // The router's logits are F.linear(x.float(), gate.float()): the bf16 input widened
      // and the fp32 master gate (its bf16 copy would be off by ~1e-3 relative).
      {
        const Tensor x = a.get(0, act_key("layers.1.post_attention_layernorm.out")),
                     sc = a.get(0, act_key("layers.1.mlp.gate.scores"));
        const Tensor w = m.params().param(m.params().find("model.layers.1.mlp.gate.weight"));
        const int64_t N = sc.size(0), E = sc.size(1), C = w.size(1);
        double worst = 0;
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t e = 0; e < E; ++e) {
            double logit = 0;
            for (int64_t j = 0; j < C; ++j) {
              logit += double(bf16_to_f32(x.data<bf16>()[n * C + j].bits)) * double(w.data<float>()[e * C + j]);
            }
            const double want = 1.0 / (1.0 + std::exp(-logit));  // sigmoid scoring
            worst = std::max(worst, std::abs(double(sc.data<float>()[n * E + e]) - want) / want);
          }
        }
        EXPECT_LT(worst, 1e-5) << "router scores not from fp32 math on the fp32 gate";
      }
      // MTP: embedding and the module's residual in fp32, norms and [e|h] in bf16.
      EXPECT_EQ(dtype("layers.2.mtp.emb"), f32);
      EXPECT_EQ(dtype("layers.2.mtp.h_in"), f32);
      EXPECT_EQ(dtype("layers.2.mtp.h_out"), f32);
      EXPECT_EQ(dtype("layers.2.mtp.cat"), bf);
      EXPECT_EQ(dtype("layers.2.mtp.hnorm"), bf);
      EXPECT_EQ(dtype("layers.2.mtp.out_norm"), bf);
      EXPECT_EQ(dtype("layers.2.input_layernorm.out"), bf);
    } else {
      EXPECT_EQ(dtype("layers.1.mlp.gate_up"), bf);
      EXPECT_EQ(dtype("layers.1.mlp.h"), bf);
    }
    m.backward(0);
  }
}

// The estimate the memory budget sizes micro-batches by follows the dtypes: in bf16 it
// matches what a training step allocates as it does in fp32 (test_model's check), and both
// shrink by the same factor.
TEST(MixedPrecision, ActivationEstimateFollowsTheComputeDtype) {
  ModelConfig v3 = load_hf_config(std::string(DSTRAIN_SOURCE_DIR) + "/inputs/models/deepseek-v3-tiny.json");
  ModelConfig dense = tiny_dense(true, false);
  dense.max_position_embeddings = 64;
  for (const ModelConfig& c : {dense, v3}) {
    const int64_t B = 2, T = 32;
    double estimate[2], used[2];
    for (int i = 0; i < 2; ++i) {
      Transformer m(c, Device::cpu());
      m.init_weights(5);
      m.set_compute_dtype(i == 0 ? DType::F32 : DType::BF16);
      Data d(B, T, c.vocab_size, 9);
      const auto held = [] {
        const MemoryStats s = memory_stats();
        return double(s.bytes[size_t(MemCategory::Activations)] + s.bytes[size_t(MemCategory::Workspace)]);
      };
      const double before = held();
      m.forward_backward(d.tok(), d.tgt(), scales_for(m, B, T));
      used[i] = held() - before;
      estimate[i] = double(m.activation_bytes(B, T));
      m.release_activations();
    }
    const char* name = c.mla() ? "deepseek_v3" : "dense";
    std::printf("[ activations ] %s: fp32 estimated %.0f allocated %.0f; bf16 estimated %.0f allocated %.0f "
                "(ratio %.3f); bf16/fp32 estimated %.3f allocated %.3f\n",
                name, estimate[0], used[0], estimate[1], used[1], estimate[1] / used[1], estimate[1] / estimate[0],
                used[1] / used[0]);
    EXPECT_LT(estimate[1], 0.8 * estimate[0]) << name;
    EXPECT_LT(used[1], 0.8 * used[0]) << name;
    EXPECT_NEAR(estimate[1] / used[1], 1.0, 0.15) << name;
    EXPECT_NEAR((estimate[1] / estimate[0]) / (used[1] / used[0]), 1.0, 0.1) << name;
  }
}

// ---- (4) the split backward ---------------------------------------------------------------

TEST(MixedPrecision, SplitBackwardInBf16GivesTheFullBackwardsGradients) {
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.name);
    Transformer full(cs.config, Device::cpu()), split(cs.config, Device::cpu());
    for (Transformer* m : {&full, &split}) {
      init(*m, 8);
      m->set_compute_dtype(DType::BF16);
      m->params().grads().zero();
    }
    Data d(2, 7, cs.config.vocab_size, 6);
    const LossScales s = scales_for(full, d.B, d.T);
    full.forward(0, d.tok(), d.tgt(), s);
    full.backward(0);
    split.forward(0, d.tok(), d.tgt(), s);
    split.backward(0, BackwardPart::Input);
    split.backward_weights(0);
    const ParamRegistry& r = full.params();
    const std::vector<float> a = grads_of(r), b = grads_of(split.params());
    for (int id = 0; id < r.size(); ++id) {
      const ParamInfo& p = r.info(id);
      EXPECT_EQ(std::memcmp(a.data() + p.offset, b.data() + p.offset, size_t(p.numel()) * sizeof(float)), 0)
          << p.name << ": the split backward's gradient differs";
    }
  }
}

// ---- (5) training --------------------------------------------------------------------------

TEST(MixedPrecision, Bf16TrainingLowersTheLossAsFp32Does) {
  for (const Case& cs : cases()) {
    SCOPED_TRACE(cs.name);
    Data d(2, 8, cs.config.vocab_size, 12);
    double first[2], last[2];
    for (int i = 0; i < 2; ++i) {
      Transformer m(cs.config, Device::cpu());
      init(m, 13);
      m.set_compute_dtype(i == 0 ? DType::F32 : DType::BF16);
      AdamW opt(AdamWConfig{.lr = 1e-2}, m.params());
      const LossScales s = scales_for(m, d.B, d.T);
      for (int step = 0; step < 12; ++step) {
        m.params().grads().zero();
        const LossSums sums = m.forward_backward(d.tok(), d.tgt(), s);
        const double loss = step_loss(m, sums, s);
        if (step == 0) first[i] = loss;
        last[i] = loss;
        opt.step(1e-2);
      }
    }
    std::printf("[ training ] %s: fp32 %.4f -> %.4f, bf16 %.4f -> %.4f (drop %.3f of fp32's)\n", cs.name, first[0],
                last[0], first[1], last[1], (first[1] - last[1]) / (first[0] - last[0]));
    // Both memorise the batch; bf16 gets as far as fp32 does, give or take its rounding.
    EXPECT_LT(last[0], 0.5 * first[0]);
    EXPECT_LT(last[1], 0.5 * first[1]);
    EXPECT_NEAR(first[1], first[0], 1e-2 * first[0]);
    EXPECT_NEAR((first[1] - last[1]) / (first[0] - last[0]), 1.0, 0.05);
  }
}

}  // namespace
}  // namespace dstrain
