// Tensor (and sequence) parallelism end to end, through the trainer, at 1, 2 and 4 ranks: the
// dense models (GQA and MHA, tied and untied embeddings) and DeepSeek-V2/V3 (MLA with and
// without q LoRA, MoE, MTP) trained at tensor = the world size, with sequence parallelism off
// and on, equal the same run at tensor 1 within 1e-5 in every step's loss and gradient norm and
// in every weight after the steps; tensor x data (2 x 2) does too; a checkpoint written at one
// tensor-parallel size resumes at another with the same losses; the metrics report the tensor
// group's communication; and a size that does not split the model is an error naming why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "io/sharded_model_state.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 3;

json model_of(const std::string& name) {
  if (name == "v2") return v2_model();
  if (name == "v3") return v3_model();  // with the routing-bias updates and the MTP loss
  if (name == "mha_tied") return {{"model", {{"num_key_value_heads", 4}, {"tie_word_embeddings", true}}}};
  if (name == "mha_untied") return {{"model", {{"num_key_value_heads", 4}}}};
  if (name == "gqa_tied") return {{"model", {{"tie_word_embeddings", true}}}};
  return json::object();  // RunFiles' dense model: GQA (4 heads, 2 key/value heads), untied
}

// The global tensors of a trainer's weights by name (gathered over its tensor group).
std::map<std::string, std::vector<float>> global_weights(Trainer& t, Communicator* tp) {
  std::map<std::string, std::vector<float>> out;
  const ParamRegistry& reg = t.model().params();
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    std::vector<float>& g = out[p.name];
    g.resize(size_t(p.global_shape.numel()));
    gather_global(p, reg.param(id), tp, Tensor(g.data(), DType::F32, p.global_shape));
  }
  return out;
}

void expect_same_training(Trainer& ref, Trainer& tp, Communicator* tp_comm, const std::string& what) {
  ASSERT_EQ(ref.history().size(), tp.history().size());
  for (size_t i = 0; i < ref.history().size(); ++i) {
    const StepRecord &a = tp.history()[i], &b = ref.history()[i];
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(b.loss)) << what << ": loss of step " << i + 1;
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm) << what << ": gradient norm of step " << i + 1;
  }
  const auto wr = global_weights(ref, nullptr), wt = global_weights(tp, tp_comm);
  ASSERT_EQ(wr.size(), wt.size()) << what;
  double worst = 0;
  for (const auto& [name, w] : wr) {
    ASSERT_TRUE(wt.count(name)) << what << ": " << name;
    const double e = rel_error(wt.at(name), w);
    EXPECT_LE(e, kLayoutWeightTolerance) << what << ": " << name << " after " << ref.history().size() << " steps";
    worst = std::max(worst, e);
  }
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.6f vs %.6f (tensor 1), worst weight error %.2e\n", world_size(),
                what.c_str(), tp.history().back().loss, ref.history().back().loss, worst);
  }
}

// The layout overrides of a run at tensor `tp` (data: what is left) with sequence parallelism.
std::vector<std::string> layout(int tp, bool sp, std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"parallel.tensor=" + std::to_string(tp),
                                std::string("parallel.sequence_parallel=") + (sp ? "true" : "false")};
  o.insert(o.end(), more.begin(), more.end());
  return o;
}

class TensorParallelTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(TensorParallelTraining, MatchesTensorOneInLossesAndWeights) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(kSteps, model_of(GetParam()));
  // The reference: the whole model on every rank alone (one data-parallel rank, the same
  // micro-batches in the same order as the tensor-parallel run's).
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.config(), solo);
  ref.init_weights("");
  ref.train();
  const int W = world_size();
  for (bool sp : {false, true}) {
    const RunConfig cfg = files.config(layout(W, sp));
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    Communicator* tp = W > 1 ? &grid.comm(Axis::Tensor) : nullptr;
    expect_same_training(ref, t, tp,
                         GetParam() + " tensor " + std::to_string(W) + (sp ? " sequence-parallel" : ""));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, TensorParallelTraining, ::testing::Values("gqa_untied", "gqa_tied", "mha_untied", "mha_tied", "v2", "v3"));

TEST(TensorParallelFourRanks, TensorTimesDataMatchesTensorOne) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4 (tensor 2 x data 2)");
  for (const std::string model : {"gqa_untied", "v3"}) {
    RunFiles files(kSteps, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.config(), solo);
    ref.init_weights("");
    ref.train();
    const RunConfig cfg = files.config(layout(2, true));
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    ASSERT_EQ(grid.size(Axis::Data), 2);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    expect_same_training(ref, t, &grid.comm(Axis::Tensor), model + " tensor 2 x data 2");
  }
}

// Evaluation over vocabulary shards: the loss and the token accuracy (each row's largest logit
// and its target's, combined over the tensor group) of the whole model's.
TEST(TensorParallel, EvaluationOverVocabularyShardsMatchesTheWholeModel) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  for (const std::string model : {"gqa_untied", "v3"}) {
    RunFiles files(3, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.solo_config(), solo);
    ref.init_weights("");
    ref.train();
    const RunConfig cfg = files.config(layout(world_size(), true));
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    const LossSums want = ref.evaluate(4), got = t.evaluate(4);
    EXPECT_EQ(got.count, want.count) << model;
    EXPECT_NEAR(got.mean(), want.mean(), 1e-5 * want.mean()) << model;
    EXPECT_EQ(got.correct, want.correct) << model << ": targets ranked first";
    EXPECT_GT(want.correct, 0) << model << ": nothing ranked first tests nothing";
  }
}

// A checkpoint written at one tensor-parallel size resumes at another: the steps after the
// resume have the losses of the uninterrupted run.
TEST(TensorParallel, CheckpointsResumeAtOtherTensorSizes) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  for (const std::string model : {"gqa_untied", "v3"}) {
    RunFiles files(4, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer full(files.config(), solo);
    full.init_weights("");
    full.train();
    // (written at, resumed at): TP 2 -> 1, TP 1 -> 2, and at 4 ranks TP 2 -> 4 and 4 -> 1.
    std::vector<std::pair<int, int>> moves = {{2, 1}, {1, 2}};
    if (W == 4) moves.insert(moves.end(), {{2, 4}, {4, 1}});
    for (auto [from, to] : moves) {
      const std::string dir = "checkpoint.dir=" + quoted(files.dir() / fmt::format("ckpt_{}_{}_{}", model, from, to));
      {
        const RunConfig cfg =
            files.config(layout(from, from > 1, {"train.max_steps=2", "checkpoint.save_final=true", dir}));
        ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
        Trainer a(cfg, grid);
        a.init_weights("");
        a.train();
      }
      const RunConfig cfg = files.config(layout(to, to > 1, {dir}));
      ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
      Trainer b(cfg, grid);
      ASSERT_TRUE(b.resume("auto"));
      EXPECT_EQ(b.step(), 2);
      b.train();
      ASSERT_EQ(b.history().size(), 2u);
      for (size_t i = 0; i < 2; ++i) {
        const double want = full.history()[2 + i].loss;
        EXPECT_NEAR(b.history()[i].loss, want, 1e-5 * std::fabs(want))
            << model << ": tensor " << from << " -> " << to << ", step " << i + 3;
      }
      Communicator* tp = grid.size(Axis::Tensor) > 1 ? &grid.comm(Axis::Tensor) : nullptr;
      const auto wf = global_weights(full, nullptr), wb = global_weights(b, tp);
      for (const auto& [name, w] : wf) EXPECT_LE(rel_error(wb.at(name), w), 1e-5) << model << ": " << name;
    }
  }
}

// Activation recomputation split by heads over the tensor group with sequence parallelism:
// MLA's heads formed again from the latents ("mla_up_proj", with and without a query LoRA),
// with the norms and the experts' SwiGLU, or whole layers replayed from inputs kept in host
// memory (cpu_checkpointing), give every step's loss and gradient norm and every weight bit for
// bit, with fewer activation bytes held.
TEST(TensorParallel, RecomputationIsBitwiseTheSame) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  const std::vector<std::pair<std::string, std::string>> policies = {
      {"selective layernorm, moe_act, mla_up_proj",
       R"(train.activation_checkpointing={"granularity": "selective", "selective": ["layernorm", "moe_act", "mla_up_proj"]})"},
      {"full, cpu_checkpointing", R"(train.activation_checkpointing={"granularity": "full", "cpu_checkpointing": true})"}};
  for (const std::string model : {"v2", "v3"}) {
    RunFiles files(kSteps, model_of(model));
    const RunConfig cfg = files.config(layout(W, true, {"model.num_hidden_layers=3"}));
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer plain(cfg, grid);
    plain.init_weights("");
    plain.train();
    for (const auto& [name, set] : policies) {
      SCOPED_TRACE(model + ", " + name);
      Trainer t(files.config(layout(W, true, {"model.num_hidden_layers=3", set})), grid);
      t.init_weights("");
      t.train();
      ASSERT_EQ(t.history().size(), plain.history().size());
      for (size_t i = 0; i < t.history().size(); ++i) {
        EXPECT_EQ(t.history()[i].loss, plain.history()[i].loss) << "step " << i + 1;
        EXPECT_EQ(t.history()[i].grad_norm, plain.history()[i].grad_norm) << "step " << i + 1;
      }
      const Buffer& a = t.model().params().values();
      EXPECT_EQ(0, std::memcmp(a.data(), plain.model().params().values().data(), a.nbytes()));
      EXPECT_LT(t.model().activation_bytes(2, 16), plain.model().activation_bytes(2, 16));
    }
  }
}

TEST(TensorParallel, MetricsReportTheTensorGroupsCommunication) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(2);
  const RunConfig cfg = files.config(layout(W, true));
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  for (const StepRecord& r : t.history()) {
    EXPECT_GT(r.tp_comm_bytes, 0) << "step " << r.step;
    EXPECT_GT(r.tp_comm_ops, 0) << "step " << r.step;
    EXPECT_GT(r.tp_comm_seconds, 0) << "step " << r.step;
  }
  if (world_rank() == 0) {
    const json tp = last_metrics_block(files.dir() / "out" / "metrics.jsonl", "tensor_parallel");
    ASSERT_FALSE(tp.is_null()) << "metrics.jsonl has no tensor_parallel block";
    EXPECT_EQ(tp["size"].get<int>(), W);
    EXPECT_TRUE(tp["sequence_parallel"].get<bool>());
    EXPECT_GT(tp["comm_bytes"].get<double>(), 0);
  }
}

TEST(TensorParallel, ASizeThatDoesNotSplitTheModelIsAnErrorNamingWhy) {
  ModelConfig c;
  c.hidden_size = 48;
  c.intermediate_size = 96;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 6;
  c.num_key_value_heads = 2;
  c.vocab_size = 96;
  try {
    ShardSpec::tensor_parallel(c, 0, 4);
    ADD_FAILURE() << "tensor 4 accepted for 6 heads";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("num_attention_heads = 6"), std::string::npos) << m;
    EXPECT_NE(m.find("sizes that split this model: 1, 2, 6"), std::string::npos) << m;
  }
  c.num_attention_heads = 8;
  c.num_key_value_heads = 3;
  c.hidden_size = 48;
  try {
    ShardSpec::tensor_parallel(c, 0, 2);
    ADD_FAILURE() << "tensor 2 accepted for 3 key/value heads";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("num_key_value_heads = 3"), std::string::npos) << e.what();
  }
  c.num_key_value_heads = 2;
  c.vocab_size = 98;
  try {
    ShardSpec::tensor_parallel(c, 0, 4);
    ADD_FAILURE() << "tensor 4 accepted for a vocabulary of 98";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size = 98"), std::string::npos) << e.what();
  }
  // Fewer key/value heads than ranks: replicated, accepted.
  c.vocab_size = 96;
  const ShardSpec s = ShardSpec::tensor_parallel(c, 3, 4);
  EXPECT_EQ(s.kv_heads, (Range{1, 2}));
  EXPECT_EQ(s.kv_replicas, 2);
}

}  // namespace
}  // namespace dstrain
