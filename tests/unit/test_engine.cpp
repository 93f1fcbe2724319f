// The Transformer as an engine of micro-batches: two micro-batches in flight give the gradients
// of running them one after the other, a backward split into its input and weight parts gives
// those of the whole backward, the activation store's memory is reused round after round, the
// parameter hooks fire where and when they should, and ShardSpec refuses what it cannot split,
// naming why.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "model/mla.h"
#include "model/moe.h"
#include "model/transformer.h"
#include "fake_backend.h"
#include "tiny_models.h"

namespace dstrain {
namespace {

ModelConfig dense_config() { return tiny_dense(/*gqa=*/true, /*tied=*/false); }
ModelConfig v3_config() { return tiny_v3(/*mtp_depth=*/1); }

struct Batch {
  std::vector<int32_t> tokens, targets;
  int64_t B, T;
  Batch(int64_t b, int64_t t, int64_t V, unsigned seed) : tokens(size_t(b * t)), targets(size_t(b * t)), B(b), T(t) {
    std::mt19937 rng(seed);
    for (auto& x : tokens) x = int32_t(rng() % V);
    for (auto& x : targets) x = int32_t(rng() % V);
    targets[1] = ops::kIgnoreIndex;
  }
  Tensor tok() { return Tensor(tokens.data(), DType::I32, Shape{B, T}); }
  Tensor tgt() { return Tensor(targets.data(), DType::I32, Shape{B, T}); }
};

LossScales scales_for(const Transformer& m, int64_t B, int64_t T) {
  LossScales s;
  s.token = float(1.0 / double(2 * B * T));
  s.sequence = 1.0 / double(2 * B);
  s.micro_batch = 0.5;
  for (int k = 0; k < m.mtp_depth(); ++k) s.mtp_token.push_back(0.3f / float(2 * B * T));
  return s;
}

std::vector<float> grad_of(const Transformer& m, int id) {
  Tensor g = m.params().grad(id);
  return std::vector<float>(g.data<float>(), g.data<float>() + g.numel());
}

bool in_main_layer(const Transformer& m, int id) {
  const int l = m.params().info(id).layer;
  return l >= 0 && l < m.config().num_hidden_layers;
}

// Bitwise, or within `rel` of the tensor's largest magnitude when rel > 0.
void expect_same(const std::vector<float>& a, const std::vector<float>& b, double rel, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (rel == 0) {
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what << ": not bitwise equal";
    return;
  }
  double worst = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  EXPECT_LE(worst, rel * scale) << what;
}

void expect_same_sums(const LossSums& a, const LossSums& b) {
  EXPECT_EQ(a.sum, b.sum);
  EXPECT_EQ(a.count, b.count);
  EXPECT_EQ(a.mtp_sum, b.mtp_sum);
  EXPECT_EQ(a.mtp_count, b.mtp_count);
}

// Records the hooks' calls.
struct Recorder : ParamHooks {
  std::vector<std::pair<int, int>> used, ready;
  void before_use(int first, int last) override { used.emplace_back(first, last); }
  void grad_ready(int first, int last) override { ready.emplace_back(first, last); }
};

// Gradients formed in two orders of the same two micro-batches differ only by the order in
// which fp32 sums accumulate into them (a + b vs b + a is exact, a GEMM's or a norm's running
// sums over two micro-batches are not): within this of the tensor's largest magnitude.
constexpr double kOrderTol = 1e-6;

class Engine : public ::testing::TestWithParam<bool> {
 protected:
  ModelConfig config() const { return GetParam() ? v3_config() : dense_config(); }
};

// forward(0), forward(1), backward(1), backward(0) against the two micro-batches one after the
// other (1 first, then 0): every parameter of the decoder layers and the final norm gets its
// gradients in the same order, so they are bitwise equal; the head and the MTP modules, whose
// gradients form in the forward (0 first here), and the embedding that both feed, are equal up
// to the order of two accumulations.
TEST_P(Engine, TwoMicroBatchesInFlightGiveTheGradientsOfOneAfterTheOther) {
  const ModelConfig c = config();
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  Transformer a(c, Device::cpu()), r(c, Device::cpu());
  a.init_weights(3);
  r.init_weights(3);
  const LossScales s = scales_for(a, B, T);

  const LossSums a0 = a.forward(0, d0.tok(), d0.tgt(), s);
  const LossSums a1 = a.forward(1, d1.tok(), d1.tgt(), s);
  EXPECT_EQ(a.activations().in_flight(), (std::vector<int>{0, 1}));
  a.backward(1);
  EXPECT_EQ(a.activations().in_flight(), (std::vector<int>{0}));
  a.backward(0);
  EXPECT_TRUE(a.activations().in_flight().empty());
  EXPECT_EQ(a.activations().bytes_in_use(), 0);

  const LossSums r1 = r.forward(0, d1.tok(), d1.tgt(), s);
  r.backward(0);
  const LossSums r0 = r.forward(0, d0.tok(), d0.tgt(), s);
  r.backward(0);
  expect_same_sums(a0, r0);
  expect_same_sums(a1, r1);

  int bitwise = 0;
  for (int id = 0; id < a.params().size(); ++id) {
    const std::string& name = a.params().info(id).name;
    const bool same_order = in_main_layer(a, id) || name == "model.norm.weight";
    bitwise += same_order;
    expect_same(grad_of(a, id), grad_of(r, id), same_order ? 0.0 : kOrderTol, name);
  }
  EXPECT_GT(bitwise, 10);
  // A backward needs its forward, and a micro-batch is in flight once.
  EXPECT_THROW(a.backward(0), Error);
  a.forward(2, d0.tok(), d0.tgt(), s);
  EXPECT_THROW(a.forward(2, d1.tok(), d1.tgt(), s), Error);
}

// Round after round of two micro-batches in flight, the store's buffers come back from its pool:
// nothing more is allocated after the first round, and nothing is held between rounds.
TEST_P(Engine, ActivationMemoryIsReusedAcrossRounds) {
  const ModelConfig c = config();
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  Transformer m(c, Device::cpu());
  m.init_weights(3);
  const LossScales s = scales_for(m, B, T);
  m.forward(0, d0.tok(), d0.tgt(), s);
  m.backward(0);
  const int64_t one_in_flight = m.activations().bytes_allocated();
  std::vector<int64_t> allocated;
  for (int round = 0; round < 4; ++round) {
    m.forward(0, d0.tok(), d0.tgt(), s);
    m.forward(1, d1.tok(), d1.tgt(), s);
    m.backward(1);
    m.backward(0);
    EXPECT_EQ(m.activations().bytes_in_use(), 0) << round;
    allocated.push_back(m.activations().bytes_allocated());
  }
  for (size_t i = 1; i < allocated.size(); ++i) EXPECT_EQ(allocated[i], allocated[0]) << "round " << i;
  // Two micro-batches hold twice what one does (the same shapes), no more.
  EXPECT_EQ(allocated[0], 2 * one_in_flight);
  m.release_activations();
  EXPECT_EQ(m.activations().bytes_allocated(), 0);
}

// Every activation key and scratch slot is interned when the model is built: training steps
// (two micro-batches in flight, full recomputation with its replays and host offload, then the
// selective kinds), evaluation and generation intern none, so no op builds or hashes a name.
TEST_P(Engine, StepsInternNoKeysAfterConstruction) {
  const ModelConfig c = config();
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  Transformer full(c, Device::cpu()), selective(c, Device::cpu());
  full.init_weights(3);
  selective.init_weights(3);
  RecomputePolicy policy;
  policy.full = true;
  policy.cpu_checkpointing = true;
  full.set_recompute(policy);
  RecomputePolicy sel;
  sel.layernorm = sel.moe_act = true;
  sel.mla_up_proj = c.mla();
  selective.set_recompute(sel);
  const LossScales s = scales_for(full, B, T);
  std::vector<float> logits(size_t(B * c.vocab_size));
  const int64_t calls = act_key_calls();
  for (Transformer* m : {&full, &selective}) {
    m->forward(0, d0.tok(), d0.tgt(), s);
    m->forward(1, d1.tok(), d1.tgt(), s);
    m->backward(1);
    m->backward(0);
    m->forward_loss(d0.tok(), d0.tgt());
    m->last_logits(d0.tok(), Tensor(logits.data(), DType::F32, Shape{B, c.vocab_size}));
  }
  EXPECT_EQ(act_key_calls(), calls);
  // The counter counts: one more key is one more call.
  act_key("layers.0.attn.qkv");
  EXPECT_EQ(act_key_calls(), calls + 1);
}

// Generation runs forwards of growing length: buffers too small for the next length are
// replaced, not kept, so the store holds what the longest forward needs, as buffers that
// grow in place would.
TEST_P(Engine, GrowingForwardsKeepMemoryOfTheLongest) {
  const ModelConfig c = config();
  const int64_t B = 2, Tmax = 16;
  Batch d(B, Tmax, c.vocab_size, 6);
  Transformer growing(c, Device::cpu()), longest(c, Device::cpu());
  growing.init_weights(2);
  longest.init_weights(2);
  std::vector<float> logits(size_t(B * c.vocab_size));
  const Tensor out(logits.data(), DType::F32, Shape{B, c.vocab_size});
  for (int64_t T = 1; T <= Tmax; ++T) {
    std::vector<int32_t> prefix;
    for (int64_t b = 0; b < B; ++b) prefix.insert(prefix.end(), d.tokens.begin() + b * Tmax, d.tokens.begin() + b * Tmax + T);
    growing.last_logits(Tensor(prefix.data(), DType::I32, Shape{B, T}), out);
  }
  longest.last_logits(d.tok(), out);
  const double ratio = double(growing.activations().bytes_allocated()) / double(longest.activations().bytes_allocated());
  std::printf("[ activations ] after forwards of length 1..%ld: %.3f x those of one of length %ld\n", long(Tmax), ratio,
              long(Tmax));
  EXPECT_EQ(growing.activations().bytes_allocated(), longest.activations().bytes_allocated());
}

// forward(0), forward(1), backward(0, Input), backward(1, Input), backward_weights(1),
// backward_weights(0) against whole backwards: before backward_weights the layers' linear
// weights have no gradient yet and their norms have theirs; after it, the linear weights
// (accumulated 1 then 0) equal those of the micro-batches run 1 then 0 and everything else
// (accumulated 0 then 1) those run 0 then 1, bitwise for the decoder layers.
TEST_P(Engine, SplitBackwardGivesTheGradientsOfTheWholeBackward) {
  const ModelConfig c = config();
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  Transformer a(c, Device::cpu()), r01(c, Device::cpu()), r10(c, Device::cpu());
  for (Transformer* m : {&a, &r01, &r10}) m->init_weights(5);
  const LossScales s = scales_for(a, B, T);
  Recorder hooks;
  a.set_hooks(&hooks);

  a.forward(0, d0.tok(), d0.tgt(), s);
  a.forward(1, d1.tok(), d1.tgt(), s);
  EXPECT_TRUE(hooks.ready.empty()) << "grad_ready fired in a forward: a micro-step's reports come from its backward";
  a.backward(0, BackwardPart::Input);
  a.backward(1, BackwardPart::Input);
  // The MTP modules, whose backward ran in the forward, reported first in each backward; nothing
  // else before the weight gradients exist.
  const size_t ready_in_forward = hooks.ready.size();
  EXPECT_EQ(ready_in_forward, 2 * size_t(a.mtp_depth())) << "grad_ready fired before the weight gradients exist";
  if (a.mtp_depth() > 0) {
    const int mtp_first = a.params().find(layer_name(int(c.num_hidden_layers), "enorm.weight"));
    EXPECT_EQ(hooks.ready[0].first, mtp_first);
    EXPECT_EQ(hooks.ready[0].second, a.params().size() - 1);
  }
  EXPECT_TRUE(a.activations().in_flight().empty());
  int linear = 0, norms = 0;
  for (int id = 0; id < a.params().size(); ++id) {
    if (!in_main_layer(a, id)) continue;
    const ParamInfo& p = a.params().info(id);
    const std::vector<float> g = grad_of(a, id);
    const bool any = std::any_of(g.begin(), g.end(), [](float v) { return v != 0.0f; });
    if (p.kind == ParamKind::Linear) {
      EXPECT_FALSE(any) << p.name << ": a weight gradient before backward_weights";
      ++linear;
    } else if (p.kind == ParamKind::Norm) {
      EXPECT_TRUE(any) << p.name << ": a norm gradient missing after the input part";
      ++norms;
    }
  }
  EXPECT_GT(linear, 0);
  EXPECT_GT(norms, 0);
  a.backward_weights(1);
  const size_t ready_per_backward = hooks.ready.size() - ready_in_forward;
  // final norm, lm_head, every layer (last first), the embedding
  EXPECT_EQ(ready_per_backward, size_t(c.num_hidden_layers) + 3);
  EXPECT_EQ(hooks.ready[ready_in_forward], (std::pair<int, int>{a.params().find("model.norm.weight"),
                                                                a.params().find("model.norm.weight")}));
  a.backward_weights(0);
  EXPECT_EQ(hooks.ready.size(), ready_in_forward + 2 * ready_per_backward);

  for (Transformer* m : {&r01, &r10}) {
    Batch& first = m == &r01 ? d0 : d1;
    Batch& second = m == &r01 ? d1 : d0;
    m->forward(0, first.tok(), first.tgt(), s);
    m->backward(0);
    m->forward(0, second.tok(), second.tgt(), s);
    m->backward(0);
  }
  for (int id = 0; id < a.params().size(); ++id) {
    const ParamInfo& p = a.params().info(id);
    const bool deferred = in_main_layer(a, id) && p.kind == ParamKind::Linear;
    expect_same(grad_of(a, id), grad_of(deferred ? r10 : r01, id), in_main_layer(a, id) ? 0.0 : kOrderTol, p.name);
  }
  // Every layer's parameters were announced before each use: two forwards, two backwards.
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    int first = -1, last = -1;
    for (int id = 0; id < a.params().size(); ++id) {
      if (a.params().info(id).layer != l) continue;
      if (first < 0) first = id;
      last = id;
    }
    EXPECT_EQ(std::count(hooks.used.begin(), hooks.used.end(), std::pair<int, int>{first, last}), 4) << "layer " << l;
  }
}

// Activation recomputation (whole layers run again before their backward, or selected parts
// formed again in it) gives bitwise the gradients and losses of keeping every activation, for
// every method, with two micro-batches in flight, holding less in the store after the forwards. A MoE layer's replay
// takes the first forward's routing: the routing biases are moved between the forwards and the
// backwards (a replay that routed again would send tokens to other experts and change the
// gradients), and the loads and auxiliary losses are counted once.
TEST_P(Engine, RecomputationIsBitwiseTheSameAndReplaysTheRouting) {
  ModelConfig c = config();
  c.num_hidden_layers = 5;  // groups before the last, which keeps its activations
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  struct Case {
    const char* name;
    bool full;
    RecomputePolicy::Method method;
    int64_t num_layers;
    bool selective;
    bool mla_up_proj = false;  // MLA models only
  };
  const Case cases[] = {{"uniform 1", true, RecomputePolicy::Method::Uniform, 1, false},
                        {"uniform 2", true, RecomputePolicy::Method::Uniform, 2, false},
                        {"block 1", true, RecomputePolicy::Method::Block, 1, false},
                        {"selective layernorm, moe_act", false, RecomputePolicy::Method::Uniform, 1, true},
                        {"selective mla_up_proj", false, RecomputePolicy::Method::Uniform, 1, false, true},
                        {"selective layernorm, moe_act, mla_up_proj", false, RecomputePolicy::Method::Uniform, 1, true,
                         true},
                        {"uniform 1 and selective", true, RecomputePolicy::Method::Uniform, 1, true, true}};
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    if (k.mla_up_proj && !k.selective && !c.mla()) continue;
    Transformer a(c, Device::cpu()), r(c, Device::cpu());
    a.init_weights(7);
    r.init_weights(7);
    RecomputePolicy policy;
    policy.full = k.full;
    policy.method = k.method;
    policy.num_layers = k.num_layers;
    policy.layernorm = policy.moe_act = k.selective;
    policy.mla_up_proj = k.mla_up_proj && c.mla();
    a.set_recompute(policy);
    const LossScales s = scales_for(a, B, T);
    const LossSums a0 = a.forward(0, d0.tok(), d0.tgt(), s), a1 = a.forward(1, d1.tok(), d1.tgt(), s);
    const LossSums r0 = r.forward(0, d0.tok(), d0.tgt(), s), r1 = r.forward(1, d1.tok(), d1.tgt(), s);
    EXPECT_LT(a.activations().bytes_in_use(), r.activations().bytes_in_use());
    int moved = 0;
    for (Transformer* m : {&a, &r}) {
      for (auto [l, ffn] : m->moe_layers()) {
        auto* moe = dynamic_cast<MoEBlock*>(ffn);
        if (!moe || moe->bias_param() < 0) continue;
        Tensor bias = m->params().param(moe->bias_param());
        for (int64_t e = 0; e < bias.numel(); ++e) bias.data<float>()[e] = e % 2 ? 10.0f : -10.0f;
        ++moved;
      }
    }
    if (GetParam()) EXPECT_GT(moved, 0);
    a.backward(1);
    a.backward(0);
    r.backward(1);
    r.backward(0);
    expect_same_sums(a0, r0);
    expect_same_sums(a1, r1);
    for (int id = 0; id < a.params().size(); ++id) {
      expect_same(grad_of(a, id), grad_of(r, id), 0.0, a.params().info(id).name);
    }
    const auto am = a.moe_layers(), rm = r.moe_layers();
    ASSERT_EQ(am.size(), rm.size());
    for (size_t i = 0; i < am.size(); ++i) {
      const RoutingStats* sa = am[i].second->routing();
      const RoutingStats* sr = rm[i].second->routing();
      EXPECT_EQ(sa->tokens_per_expert, sr->tokens_per_expert) << "layer " << am[i].first << ": loads counted again";
      EXPECT_EQ(sa->aux_loss, sr->aux_loss) << "layer " << am[i].first;
      EXPECT_EQ(sa->received_rows, sr->received_rows) << "layer " << am[i].first;
    }
    EXPECT_TRUE(a.activations().in_flight().empty());
  }
}

// cpu_checkpointing: each recomputed group's input waits for its replay in page-locked host
// memory of its own category, copied there and back by the transfer op, so the code is the one
// a GPU runs. On the host and on the emulated device (the fake backend: device memory host code
// may not read), with two micro-batches in flight, the activation store and the device's
// activations category hold less, the host store and category exactly the inputs (none on the
// device), and the losses and gradients are the bits of keeping the inputs in the activation
// store.
TEST_P(Engine, CpuCheckpointingKeepsTheGroupInputsInHostMemoryBitwise) {
  ModelConfig c = config();
  c.num_hidden_layers = 5;  // 4 recomputed groups before the last, which keeps its activations
  const int64_t B = 2, T = 7;
  Batch d0(B, T, c.vocab_size, 1), d1(B, T, c.vocab_size, 2);
  constexpr auto kOffloaded = size_t(MemCategory::OffloadedActivations), kActs = size_t(MemCategory::Activations);
  for (const Device dev : {Device::cpu(), fake::use_fake_backend()}) {
    SCOPED_TRACE(dev.str());
    Transformer a(c, dev), r(c, dev);
    a.init_weights(7);
    r.init_weights(7);
    RecomputePolicy policy;
    policy.full = true;
    r.set_recompute(policy);
    policy.cpu_checkpointing = true;
    a.set_recompute(policy);
    const LossScales s = scales_for(a, B, T);
    const MemoryStats host0 = memory_stats(DeviceType::CPU), dev0 = memory_stats(dev.type);
    const LossSums a0 = a.forward(0, d0.tok(), d0.tgt(), s), a1 = a.forward(1, d1.tok(), d1.tgt(), s);
    const MemoryStats host1 = memory_stats(DeviceType::CPU), dev1 = memory_stats(dev.type);
    const LossSums r0 = r.forward(0, d0.tok(), d0.tgt(), s), r1 = r.forward(1, d1.tok(), d1.tgt(), s);
    const MemoryStats dev2 = memory_stats(dev.type);
    const int64_t inputs = 2 * 4 * B * T * c.hidden_size * int64_t(sizeof(float));
    EXPECT_EQ(a.offloaded_activations().bytes_in_use(), inputs);
    // The store's pool hands the inputs' device buffers on to later tensors (of any size that
    // fits): fewer bytes, not exactly the inputs' fewer.
    EXPECT_LT(a.activations().bytes_in_use(), r.activations().bytes_in_use());
    EXPECT_EQ(host1.bytes[kOffloaded] - host0.bytes[kOffloaded], inputs);
    if (!dev.is_cpu()) EXPECT_EQ(dev1.bytes[kOffloaded], dev0.bytes[kOffloaded]) << "offloaded onto the device";
    EXPECT_LT(dev1.bytes[kActs] - dev0.bytes[kActs], dev2.bytes[kActs] - dev1.bytes[kActs]);
    std::printf("[ cpu_checkpointing ] %s: device activations %ld -> %ld bytes, %ld offloaded\n", dev.str().c_str(),
                long(dev2.bytes[kActs] - dev1.bytes[kActs]), long(dev1.bytes[kActs] - dev0.bytes[kActs]), long(inputs));
    EXPECT_EQ(r.offloaded_activations().bytes_allocated(), 0);
    a.backward(1);
    a.backward(0);
    r.backward(1);
    r.backward(0);
    expect_same_sums(a0, r0);
    expect_same_sums(a1, r1);
    auto grads = [](Transformer& m) {
      const Buffer& g = m.params().grads();
      std::vector<float> host(size_t(g.numel()));
      ops::copy(Tensor(host.data(), DType::F32, Shape{g.numel()}), g.tensor());
      return host;
    };
    expect_same(grads(a), grads(r), 0.0, "gradients");
    EXPECT_TRUE(a.offloaded_activations().in_flight().empty());
    a.release_activations();
    EXPECT_EQ(a.offloaded_activations().bytes_allocated(), 0);
  }
}

// With one micro-batch and the whole backward, the GradReadyFn of forward_backward sees the
// same ranges, in the same order, as a ParamHooks.
TEST_P(Engine, GradReadyFnAndHooksAgree) {
  const ModelConfig c = config();
  Batch d(2, 5, c.vocab_size, 4);
  Transformer m(c, Device::cpu());
  m.init_weights(1);
  const LossScales s = scales_for(m, 2, 5);
  std::vector<std::pair<int, int>> by_fn;
  m.forward_backward(d.tok(), d.tgt(), s, [&](int a, int b) { by_fn.emplace_back(a, b); });
  Recorder hooks;
  m.set_hooks(&hooks);
  m.forward_backward(d.tok(), d.tgt(), s);
  EXPECT_EQ(hooks.ready, by_fn);
  EXPECT_FALSE(hooks.used.empty());
}

INSTANTIATE_TEST_SUITE_P(Models, Engine, ::testing::Values(false, true),
                         [](const auto& p) { return std::string(p.param ? "v3_mla_moe_mtp" : "dense"); });

// ---- the stores ---------------------------------------------------------------------------

TEST(ActivationStore, KeysByMicroBatchAndReusesReleasedBuffers) {
  ActivationStore acts;
  const ActKey x = act_key("layers.0.x"), y = act_key("layers.0.y"), n = act_key("layers.0.n");
  Tensor a0 = acts.put(0, x, {4, 8});
  Tensor a1 = acts.put(1, x, {4, 8});
  EXPECT_NE(a0.raw(), a1.raw());
  EXPECT_EQ(acts.get(1, x).raw(), a1.raw());
  EXPECT_EQ(acts.get(0, x).shape(), (Shape{4, 8}));
  acts.meta<int>(0, n) = 7;
  EXPECT_EQ(acts.meta<int>(0, n), 7);
  EXPECT_EQ(acts.meta<int>(1, n), 0);
  EXPECT_EQ(acts.bytes_in_use(), 2 * 4 * 8 * 4);
  // Errors name the micro-batch and the key.
  try {
    acts.get(0, y);
    FAIL() << "a missing key was returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("micro-batch 0 has no stored activation 'layers.0.y'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(acts.get(5, x), Error);
  acts.release(0);
  EXPECT_FALSE(acts.has(0, x));
  EXPECT_EQ(acts.in_flight(), std::vector<int>{1});
  EXPECT_EQ(acts.meta<int>(0, n), 0);  // released with its buffers
  // The next micro-batch gets the released buffer back, even for another dtype of the same size.
  Tensor again = acts.put(2, x, {32}, DType::I32);
  EXPECT_EQ(again.raw(), a0.raw());
  EXPECT_EQ(acts.bytes_allocated(), 2 * 4 * 8 * 4);
  acts.clear();
  EXPECT_EQ(acts.bytes_allocated(), 0);
}

// release_keys hands back exactly the listed buffers the micro-batch holds; a key of the same
// role in another layer then takes a handed-back buffer before any other pooled one.
TEST(ActivationStore, ReleasesListedKeysAndPoolsByRole) {
  ActivationStore acts;
  const ActKey q3 = act_key("layers.3.attn.qkv"), o3 = act_key("layers.3.attn.out"), ids3 = act_key("layers.3.mlp.gate.ids");
  const ActKey q5 = act_key("layers.5.attn.qkv");
  const Tensor tq = acts.put(0, q3, {20}), to = acts.put(0, o3, {16});
  acts.put(0, ids3, {4}, DType::I32);
  acts.release_keys(0, {q3, o3, act_key("layers.3.attn.lse")});  // lse: not held, nothing happens
  EXPECT_FALSE(acts.has(0, q3));
  EXPECT_FALSE(acts.has(0, o3));
  EXPECT_TRUE(acts.has(0, ids3));
  EXPECT_EQ(acts.bytes_in_use(), 4 * 4);
  EXPECT_EQ(acts.bytes_allocated(), 4 * 4 + 36 * 4);
  // Both pooled buffers fit; the one of the same role ("attn.qkv") is chosen over the smaller one.
  EXPECT_EQ(acts.put(0, q5, {16}).raw(), tq.raw());
  EXPECT_EQ(acts.put(0, q3, {16}).raw(), to.raw());  // its own pool is empty: the other fits
  EXPECT_EQ(acts.bytes_allocated(), 4 * 4 + 36 * 4);
}

// Keys are interned once: the same name gives the same id, another name another id, and the
// name and role stay with the interner.
TEST(ActKey, OneDenseIdPerName) {
  const int64_t calls = act_key_calls();
  const ActKey a = act_key("layers.7.attn.qkv"), b = act_key("layers.7.attn.qkv");
  const ActKey c = act_key("layers.8.attn.qkv"), d = act_key("layers.7.attn.out"), r = act_key("residual.7");
  EXPECT_EQ(act_key_calls(), calls + 5);
  EXPECT_TRUE(a.valid());
  EXPECT_EQ(a.id, b.id);
  EXPECT_NE(a.id, c.id);
  EXPECT_NE(a.id, d.id);
  EXPECT_NE(c.id, d.id);
  EXPECT_EQ(act_key_name(c), "layers.8.attn.qkv");
  // The role is the part after "layers.{l}.": shared across layers, none outside them.
  EXPECT_EQ(a.role, c.role);
  EXPECT_NE(a.role, d.role);
  EXPECT_GE(a.role, 0);
  EXPECT_EQ(r.role, -1);
  EXPECT_FALSE(ActKey{}.valid());
  // A layer's keys by prefix, less those kept.
  act_key("layers.7.mlp.gate.ids");
  const std::vector<ActKey> all = act_keys_with_prefix("layers.7."), some = act_keys_with_prefix("layers.7.", {"layers.7.mlp.gate."});
  auto holds = [](const std::vector<ActKey>& v, ActKey k) { return std::find(v.begin(), v.end(), k) != v.end(); };
  EXPECT_TRUE(holds(all, a) && holds(all, d) && holds(all, act_key("layers.7.mlp.gate.ids")));
  EXPECT_FALSE(holds(all, c));
  EXPECT_TRUE(holds(some, a));
  EXPECT_FALSE(holds(some, act_key("layers.7.mlp.gate.ids")));
}

// The stores take interned keys only: a string (or literal) does not compile, so no op can
// build one per call.
template <class K>
concept PutTakes = requires(ActivationStore& s, K k) { s.put(0, k, Shape{1}); };
template <class K>
concept GetTakes = requires(const ActivationStore& s, K k) { s.get(0, k); };
template <class K>
concept HasTakes = requires(const ActivationStore& s, K k) { s.has(0, k); };
template <class K>
concept MetaTakes = requires(ActivationStore& s, K k) { s.meta<int>(0, k); };
template <class K>
concept ReleaseTakes = requires(ActivationStore& s, K k) { s.release_key(0, k); };
template <class K>
concept ScratchTakes = requires(Scratch& s, K k) { s.get(k, Shape{1}); };
static_assert(PutTakes<ActKey> && GetTakes<ActKey> && HasTakes<ActKey> && MetaTakes<ActKey> && ReleaseTakes<ActKey> &&
              ScratchTakes<ActKey>);
static_assert(!PutTakes<std::string> && !PutTakes<const char*> && !PutTakes<std::string_view>);
static_assert(!GetTakes<std::string> && !GetTakes<const char*>);
static_assert(!HasTakes<std::string> && !HasTakes<const char*>);
static_assert(!MetaTakes<std::string> && !MetaTakes<const char*>);
static_assert(!ReleaseTakes<std::string> && !ReleaseTakes<const char*>);
static_assert(!ScratchTakes<std::string> && !ScratchTakes<const char*>);
static_assert(!std::is_convertible_v<std::string, ActKey> && !std::is_convertible_v<int, ActKey>);

TEST(WeightGradStore, DefersWeightGradientsUntilRun) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  auto random = [&](size_t n) {
    std::vector<float> v(n);
    for (auto& x : v) x = nd(rng);
    return v;
  };
  const int64_t M = 5, N = 3, K = 4;
  std::vector<float> dout = random(M * N), x = random(M * K), w = random(N * K);
  std::vector<float> dx(M * K), dw(N * K, 0.5f), dx_ref(M * K), dw_ref(N * K, 0.5f);
  auto t = [](std::vector<float>& v, Shape s) { return Tensor(v.data(), DType::F32, s); };
  ops::linear_backward(t(dx_ref, {M, K}), t(dw_ref, {N, K}), t(dout, {M, N}), t(x, {M, K}), t(w, {N, K}));
  WeightGradStore store;
  store.begin_deferral(3);
  store.linear(t(dx, {M, K}), t(dw, {N, K}), t(dout, {M, N}), t(x, {M, K}), t(w, {N, K}));
  store.end_deferral();
  EXPECT_EQ(0, std::memcmp(dx.data(), dx_ref.data(), dx.size() * sizeof(float)));  // the input part now
  EXPECT_EQ(dw, std::vector<float>(N * K, 0.5f));                                    // the weight part later
  EXPECT_EQ(store.pending(3), 1);
  // The store kept its own copies: the caller's buffers may be reused meanwhile.
  const std::vector<float> dout_saved = dout, x_saved = x;
  std::fill(dout.begin(), dout.end(), 0.0f);
  std::fill(x.begin(), x.end(), 0.0f);
  store.run(3);
  EXPECT_EQ(store.pending(3), 0);
  EXPECT_EQ(0, std::memcmp(dw.data(), dw_ref.data(), dw.size() * sizeof(float)));
  // Without deferral both parts run at once.
  dout = dout_saved;
  x = x_saved;
  store.linear(t(dx, {M, K}), t(dw, {N, K}), t(dout, {M, N}), t(x, {M, K}), t(w, {N, K}));
  EXPECT_EQ(store.pending(3), 0);
  EXPECT_NE(dw, dw_ref);
}

// ---- ShardSpec --------------------------------------------------------------------------

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(ShardSpec, RefusesWhatDoesNotDivideNamingTheKey) {
  ModelConfig c = dense_config();  // 4 heads, 2 kv heads, intermediate 24, vocab 23
  EXPECT_NE(error_of([&] { ShardSpec::tensor_parallel(c, 0, 3); }).find("num_attention_heads = 4"), std::string::npos);
  c.num_attention_heads = 12;
  c.num_key_value_heads = 3;
  EXPECT_NE(error_of([&] { ShardSpec::tensor_parallel(c, 1, 4); }).find("num_key_value_heads = 3"), std::string::npos);
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.intermediate_size = 26;
  EXPECT_NE(error_of([&] { ShardSpec::tensor_parallel(c, 1, 4); }).find("intermediate_size = 26"), std::string::npos);
  c.intermediate_size = 24;
  EXPECT_NE(error_of([&] { ShardSpec::tensor_parallel(c, 1, 4); }).find("vocab_size = 23"), std::string::npos);
  c.vocab_size = 24;
  const ShardSpec s = ShardSpec::tensor_parallel(c, 1, 4);
  EXPECT_EQ(s.heads, (Range{2, 4}));
  EXPECT_EQ(s.kv_heads, (Range{1, 2}));
  EXPECT_EQ(s.kv_replicas, 1);
  EXPECT_EQ(s.ffn, (Range{6, 12}));
  EXPECT_EQ(s.vocab, (Range{6, 12}));
  EXPECT_TRUE(ShardSpec::whole(c).is_whole());
  // Fewer key/value heads than ranks: each is replicated on tp / kv ranks, the one its queries use.
  c.num_key_value_heads = 2;
  const ShardSpec r = ShardSpec::tensor_parallel(c, 1, 4);
  EXPECT_EQ(r.kv_heads, (Range{0, 1}));
  EXPECT_EQ(r.kv_replicas, 2);
  EXPECT_EQ(ShardSpec::tensor_parallel(c, 2, 4).kv_heads, (Range{1, 2}));
  // The sizes that work are named.
  EXPECT_NE(error_of([&] { ShardSpec::tensor_parallel(c, 0, 3); }).find("sizes that split this model: 1, 2, 4, 8"),
            std::string::npos);
}

TEST(ShardSpec, ASplitModelNeedsItsGroup) {
  for (ModelConfig c : {dense_config(), v3_config()}) {
    c.vocab_size = 24;
    EXPECT_NE(error_of([&] { Transformer(c, Device::cpu(), ShardSpec::tensor_parallel(c, 0, 2)); })
                  .find("tensor-parallel group has 1 ranks"),
              std::string::npos);
  }
}

// The whole ShardSpec registers today's model: names, shapes, offsets, placements.
TEST(ShardSpec, WholeRegistersTheUnshardedModel) {
  for (const ModelConfig& c : {dense_config(), v3_config()}) {
    Transformer a(c, Device::cpu()), b(c, Device::cpu(), ShardSpec::whole(c));
    ASSERT_EQ(a.params().size(), b.params().size());
    for (int id = 0; id < a.params().size(); ++id) {
      const ParamInfo &p = a.params().info(id), &q = b.params().info(id);
      EXPECT_EQ(p.name, q.name);
      EXPECT_EQ(p.shape, q.shape);
      EXPECT_EQ(p.offset, q.offset);
      EXPECT_EQ(q.placement.kind, Placement::Kind::Whole) << q.name;
    }
  }
}

// A piece of a SwiGLU MLP and of GQA: local shapes, the global shape, the placement.
TEST(ShardSpec, ColumnAndRowParallelPiecesAreRegisteredAsShards) {
  ModelConfig c = dense_config();
  c.vocab_size = 24;
  const ShardSpec s = ShardSpec::tensor_parallel(c, 1, 2);
  ParamRegistry reg;
  SwiGLUMLP mlp(c, s, reg, 0);
  GQAttention attn(c, s, reg, 0);
  auto info = [&](const std::string& rest) { return reg.info(reg.find(layer_name(0, rest))); };
  const ParamInfo gate = info("mlp.gate_proj.weight"), down = info("mlp.down_proj.weight");
  EXPECT_EQ(gate.shape, (Shape{12, 16}));
  EXPECT_EQ(gate.global_shape, (Shape{24, 16}));
  EXPECT_EQ(gate.placement.kind, Placement::Kind::Shard);
  EXPECT_EQ(gate.placement.dim, 0);
  EXPECT_EQ(gate.placement.axis, "tensor");
  EXPECT_EQ(gate.placement.index, 1);
  EXPECT_EQ(gate.placement.count, 2);
  EXPECT_EQ(info("mlp.up_proj.weight").offset, gate.offset + gate.numel());  // still one fused matrix
  EXPECT_EQ(down.shape, (Shape{16, 12}));
  EXPECT_EQ(down.global_shape, (Shape{16, 24}));
  EXPECT_EQ(down.placement.dim, 1);
  EXPECT_EQ(info("self_attn.q_proj.weight").shape, (Shape{8, 16}));  // 2 of 4 heads, head dim 4
  EXPECT_EQ(info("self_attn.k_proj.weight").shape, (Shape{4, 16}));  // 1 of 2 kv heads
  EXPECT_EQ(info("self_attn.o_proj.weight").global_shape, (Shape{16, 16}));
  EXPECT_EQ(info("self_attn.o_proj.weight").placement.dim, 1);
}

}  // namespace
}  // namespace dstrain
