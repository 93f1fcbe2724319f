// Pipeline parallelism end to end, through the trainer, at 2 and 4 ranks: the dense model
// (tied and untied embeddings) and DeepSeek-V3 (MLA, MoE with the routing-bias updates, MTP),
// 8 decoder layers, trained with pipeline = the world size under each schedule (1F1B,
// interleaved with 2 chunks per rank, DualPipeV), equal the same run on one rank within 1e-5
// in every step's loss and gradient norm and in every weight after the steps; pipeline x data
// and pipeline x tensor (2 x 2) do too; the metrics report the stages' traffic; and a schedule
// that needs more micro-batches than the step has is an error naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "io/hf_weights.h"
#include "io/sharded_model_state.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 3;

json model_of(const std::string& name) {
  json run;
  if (name == "v3") run = v3_model();  // with the routing-bias updates and the MTP loss
  if (name == "dense_tied") run = {{"model", {{"tie_word_embeddings", true}}}};
  run["model"]["num_hidden_layers"] = 8;
  // 8 micro-batches of 2 per step on one data-parallel rank: DualPipeV needs 2 x pipeline.
  run["train"]["train_batch_size"] = 16;
  return run;
}

// Every step's loss and gradient norm, and every weight this rank holds (its stages' pieces,
// gathered over its tensor group) against the one-rank run; every weight of the model is held
// by some rank.
void expect_same_training(Trainer& ref, Trainer& pp, ProcessGrid& grid, const std::string& what) {
  expect_same_steps(ref, pp, what);
  Communicator* tp = grid.size(Axis::Tensor) > 1 ? &grid.comm(Axis::Tensor) : nullptr;
  const ParamRegistry& reg = pp.model().params();
  const ParamRegistry& whole = ref.model().params();
  double worst = 0;
  int owned = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    std::vector<float> g(size_t(p.global_shape.numel()));
    gather_global(p, reg.param(id), tp, Tensor(g.data(), DType::F32, p.global_shape));
    const int w = whole.find(p.name);
    ASSERT_GE(w, 0) << p.name;
    Tensor rw = whole.param(w);
    const double e = rel_error(g, values(rw));
    EXPECT_LE(e, 1e-5) << what << ": " << p.name << (p.pipeline_copy ? " (the last stage's copy)" : "");
    worst = std::max(worst, e);
    owned += !p.pipeline_copy;
  }
  Communicator& pipe = grid.comm(Axis::Pipeline);
  EXPECT_EQ(pipe.all_reduce_value<int32_t>(owned), whole.size()) << what << ": parameters held over the stages";
  worst = grid.world().all_reduce_value<double>(worst, ReduceOp::Max);
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.6f vs %.6f (one rank), worst weight error %.2e\n", world_size(),
                what.c_str(), pp.history().back().loss, ref.history().back().loss, worst);
  }
}

struct Case {
  std::string model, schedule;
};

class PipelineTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(PipelineTraining, MatchesOneRankInLossesAndWeights) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(kSteps, model_of(GetParam()));
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.config(), solo);
  ref.init_weights("");
  ref.train();
  for (const std::string schedule : {"1f1b", "interleaved", "dualpipev"}) {
    std::vector<std::string> o = {"parallel.pipeline=" + std::to_string(W), "parallel.schedule=\"" + schedule + "\""};
    if (schedule == "interleaved") o.push_back("parallel.virtual_stages=2");
    const RunConfig cfg = files.config(o);
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    expect_same_training(ref, t, grid, GetParam() + " pipeline " + std::to_string(W) + " " + schedule);
    // Evaluation through the stages: the last stage's loss and token accuracy reach every rank.
    const LossSums want = ref.evaluate(4), got = t.evaluate(4);
    EXPECT_EQ(got.count, want.count) << schedule;
    EXPECT_NEAR(got.mean(), want.mean(), 1e-5 * want.mean()) << schedule;
    EXPECT_EQ(got.correct, want.correct) << schedule << ": targets ranked first";
    EXPECT_GT(want.correct, 0) << schedule;
  }
}

INSTANTIATE_TEST_SUITE_P(Models, PipelineTraining, ::testing::Values("dense", "dense_tied", "v3"));

TEST(PipelineParallelFourRanks, PipelineTimesDataAndTensorMatchOneRank) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4 (pipeline 2 x data 2, pipeline 2 x tensor 2)");
  for (const std::string model : {"dense_tied", "v3"}) {
    RunFiles files(kSteps, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.config(), solo);
    ref.init_weights("");
    ref.train();
    for (const std::string other : {"tensor", "data"}) {
      std::vector<std::string> o = {"parallel.pipeline=2", "parallel.schedule=\"1f1b\""};
      if (other == "tensor") o.insert(o.end(), {"parallel.tensor=2", "parallel.sequence_parallel=true"});
      const RunConfig cfg = files.config(o);
      ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
      ASSERT_EQ(grid.size(other == "tensor" ? Axis::Tensor : Axis::Data), 2);
      Trainer t(cfg, grid);
      t.init_weights("");
      t.train();
      expect_same_training(ref, t, grid, model + " pipeline 2 x " + other + " 2");
    }
  }
}

// A checkpoint written at one pipeline size resumes at another: the steps after the resume have
// the losses of the uninterrupted run, and the weights end the same.
TEST(PipelineParallel, CheckpointsResumeAtOtherPipelineSizes) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  for (const std::string model : {"dense_tied", "v3"}) {
    RunFiles files(4, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer full(files.config(), solo);
    full.init_weights("");
    full.train();
    // (written at, resumed at): pipeline W -> 1 and 1 -> 2, and at 4 ranks 2 -> 4 under DualPipeV.
    std::vector<std::tuple<int, int, std::string>> moves = {{W, 1, "1f1b"}, {1, 2, "1f1b"}};
    if (W == 4) moves.push_back({2, 4, "dualpipev"});
    for (auto [from, to, schedule] : moves) {
      const std::string dir = "checkpoint.dir=" + quoted(files.dir() / fmt::format("ckpt_{}_{}_{}", model, from, to));
      auto layout = [&](int pp, std::vector<std::string> more) {
        more.push_back("parallel.pipeline=" + std::to_string(pp));
        more.push_back("parallel.schedule=\"" + schedule + "\"");
        return more;
      };
      {
        const RunConfig cfg = files.config(layout(from, {"train.max_steps=2", "checkpoint.save_final=true", dir}));
        ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
        Trainer a(cfg, grid);
        a.init_weights("");
        a.train();
      }
      const RunConfig cfg = files.config(layout(to, {dir}));
      ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
      Trainer b(cfg, grid);
      ASSERT_TRUE(b.resume("auto"));
      EXPECT_EQ(b.step(), 2);
      b.train();
      ASSERT_EQ(b.history().size(), 2u);
      for (size_t i = 0; i < 2; ++i) {
        const double want = full.history()[2 + i].loss;
        EXPECT_NEAR(b.history()[i].loss, want, 1e-5 * std::fabs(want))
            << model << ": pipeline " << from << " -> " << to << ", step " << i + 3;
      }
      const ParamRegistry& reg = b.model().params();
      for (int id = 0; id < reg.size(); ++id) {
        const ParamInfo& p = reg.info(id);
        Tensor w = full.model().params().param(full.model().params().find(p.name)), mine = reg.param(id);
        EXPECT_LE(rel_error(values(mine), values(w)), 1e-5)
            << model << ": pipeline " << from << " -> " << to << ": " << p.name;
      }
    }
  }
}

// --save-hf of a pipeline run: one process writes every stage's tensors, equal to the one-rank
// run's weights.
TEST(PipelineParallel, HuggingFaceExportHoldsEveryStagesWeights) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  for (const std::string model : {"dense_tied", "v3"}) {
    RunFiles files(2, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.config(), solo);
    ref.init_weights("");
    ref.train();
    const RunConfig cfg = files.config({"parallel.pipeline=" + std::to_string(W)});
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    const std::string dir = (files.dir() / ("hf_" + model)).string();
    t.save_hf(dir);
    if (world_rank() == 0) {
      Transformer loaded(ref.model().config(), Device::cpu());
      const auto counts = load_hf_weights(dir, loaded.params());
      EXPECT_EQ(counts.loaded, int64_t(loaded.params().size())) << model;
      for (int id = 0; id < loaded.params().size(); ++id) {
        const std::string& name = loaded.params().info(id).name;
        Tensor a = loaded.params().param(id), b = ref.model().params().param(ref.model().params().find(name));
        EXPECT_LE(rel_error(values(a), values(b)), 1e-5)
            << model << ": " << name;
      }
    }
  }
}

TEST(PipelineParallel, MetricsReportTheStagesTraffic) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(2, model_of("dense"));
  const RunConfig cfg = files.config({"parallel.pipeline=" + std::to_string(W)});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  // 8 micro-batches of 2 x 16 x 32 fp32 activations each way per stage boundary.
  const double message = 2 * 16 * 32 * 4;
  const int rank = grid.coord(Axis::Pipeline);
  const int boundaries = (rank > 0) + (rank < W - 1);
  for (const StepRecord& r : t.history()) {
    EXPECT_EQ(r.pp_comm_bytes, 8 * 2 * boundaries * message) << "step " << r.step;
    EXPECT_EQ(r.pp_messages, 8 * 2 * boundaries) << "step " << r.step;
  }
  if (world_rank() == 0) {
    const json pp = last_metrics_block(files.dir() / "out" / "metrics.jsonl", "pipeline");
    ASSERT_FALSE(pp.is_null()) << "metrics.jsonl has no pipeline block";
    EXPECT_EQ(pp["size"].get<int>(), W);
    EXPECT_EQ(pp["schedule"].get<std::string>(), "1f1b");
    EXPECT_GT(pp["comm_bytes"].get<double>(), 0);
  }
}

TEST(PipelineParallel, AScheduleThatNeedsMoreMicroBatchesIsAnErrorNamingTheKey) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(1, model_of("dense"));
  // 2 micro-batches per step: DualPipeV needs at least 2 x pipeline.
  const RunConfig cfg = files.config({"parallel.pipeline=" + std::to_string(W), "parallel.schedule=\"dualpipev\"",
                                      "train.train_batch_size=4"});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  try {
    Trainer t(cfg, grid);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient_accumulation_steps"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dualpipev"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dstrain
