// ZeRO composed with the other axes: stages 1, 2 and 3 crossed with tensor (+ sequence),
// pipeline (1F1B, interleaved, DualPipeV) and expert parallelism, each layout against an
// independent single-process run on MPI_COMM_SELF (stage 0, every parameter whole) on the same
// global batches: every step's loss, gradient norm and expert loads within 1e-5, every weight
// (this rank's pieces, gathered whole by ZeRO) and the routing biases after 3 steps. ZeRO shards
// each rank's local pieces per parameter group (dense over the data axis, routed experts over
// the ranks holding the same experts), so these layouts test that the pieces, the per-group
// collectives, the gradient norm's count, the tied embedding's sum and the checkpoint staging
// agree with the whole model. Checkpoints written by one composed layout resume on another
// (and on one process) with the uninterrupted run's losses; a resume on the same layout is
// bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "io/sharded_model_state.h"
#include "resume_check.h"
#include "optim/distributed_optimizer.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 3;

// The model: the dense LLaMA-style default, V2 (MLA, softmax routing, auxiliary loss) or V3
// (MLA, routed experts with the bias updates, MTP: under 1F1B the last pipeline stage holds a
// copy of the embedding). 4 layers, so that every
// schedule has layers on each stage; 8 micro-batches of 2 per data-parallel rank at 1 rank.
json model_of(const std::string& name) {
  json run = name == "v3" ? v3_model() : name == "v2" ? v2_model() : json::object();
  // Tied input and output embeddings: under 1F1B the last stage holds a copy of the first's.
  if (name == "dense_tied") run["model"]["tie_word_embeddings"] = true;
  run["model"]["num_hidden_layers"] = 4;
  run["train"]["train_batch_size"] = 16;
  return run;
}

// This rank's pieces of every weight (gathered by ZeRO stage 3 first) against the same pieces
// cut from the one-process run's whole tensors; the routing biases exactly as the loads move them.
void expect_same_training(Trainer& ref, Trainer& t, ProcessGrid& grid, const std::string& what) {
  expect_same_steps(ref, t, what);
  ASSERT_GE(t.optimizer().stage(), 1) << what;
  t.optimizer().gather_all();
  const ParamRegistry& reg = t.model().params();
  const ParamRegistry& whole = ref.model().params();
  double worst = 0, worst_bias = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    const int w = whole.find(p.name);
    ASSERT_GE(w, 0) << what << ": " << p.name;
    std::vector<float> piece(size_t(p.numel()));
    extract_local(p, whole.param(w), Tensor(piece.data(), DType::F32, p.shape));
    const double e = rel_error(values(reg.param(id)), piece);
    if (p.kind == ParamKind::RouterBias) {
      worst_bias = std::max(worst_bias, e);
      continue;
    }
    EXPECT_LE(e, kLayoutWeightTolerance) << what << ": " << p.name;
    worst = std::max(worst, e);
  }
  EXPECT_LE(worst_bias, 1e-5) << what << ": routing biases";
  t.optimizer().release_unused();
  worst = grid.world().all_reduce_value<double>(worst, ReduceOp::Max);
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.6f vs %.6f (one process), worst weight error %.2e\n", world_size(),
                what.c_str(), t.history().back().loss, ref.history().back().loss, worst);
  }
}

struct Layout {
  std::string model;
  std::vector<std::string> parallel;  // parallel.* overrides
  std::vector<int> stages;            // ZeRO stages to cross it with
};

std::string describe(const Layout& l, int stage) {
  std::string s = l.model + " ZeRO-" + std::to_string(stage);
  for (const std::string& o : l.parallel) s += " " + o.substr(o.find('.') + 1);
  return s;
}

void train_layouts(const std::vector<Layout>& layouts) {
  for (const Layout& l : layouts) {
    RunFiles files(kSteps, model_of(l.model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.solo_config(), solo);
    ref.init_weights("");
    ref.train();
    for (int stage : l.stages) {
      std::vector<std::string> o = l.parallel;
      o.push_back("train.zero_optimization.stage=" + std::to_string(stage));
      const RunConfig cfg = files.config(o);
      ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
      Trainer t(cfg, grid);
      t.init_weights("");
      t.train();
      expect_same_training(ref, t, grid, describe(l, stage));
    }
  }
}

// Two ranks: each axis alone with ZeRO over what is left of the data axis (expert 2 leaves the
// dense parameters sharded over both ranks and every expert whole on its owner).
TEST(ZeroLayoutsMultiRank, EachAxisWithEveryStage) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 2 || world_size() == 4, "2 or 4");
  // At 4 ranks pipeline 2 leaves a data axis of 2 for ZeRO to shard over.
  train_layouts({
      // The tied embedding (and V3's MTP modules' use of it) on two ranks under 1F1B; on one
      // under DualPipeV, whose first and last stages share a rank.
      {"dense_tied", {"parallel.pipeline=2", "parallel.schedule=\"1f1b\""}, {1, 2, 3}},
      {"v3", {"parallel.pipeline=2", "parallel.schedule=\"1f1b\""}, {1, 2, 3}},
      {"v3", {"parallel.pipeline=2", "parallel.schedule=\"dualpipev\""}, {1, 2, 3}},
      {"v3", {"parallel.expert=2"}, {1, 2, 3}},
      // DeepSeek-V2: softmax routing with group-limited greedy top-k and the auxiliary loss.
      {"v2", {"parallel.expert=2"}, {1, 2, 3}},
      {"v2", {"parallel.pipeline=2", "parallel.schedule=\"1f1b\""}, {1, 3}},
  });
}

// Four ranks: every axis of two with ZeRO sharding over a data axis of 2.
TEST(ZeroLayoutsFourRanks, TensorPipelineAndExpertWithDataParallelZero) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  train_layouts({
      {"dense", {"parallel.tensor=2", "parallel.sequence_parallel=true"}, {1, 2, 3}},
      {"v3", {"parallel.tensor=2"}, {1, 2, 3}},
      {"dense", {"parallel.pipeline=2", "parallel.schedule=\"interleaved\"", "parallel.virtual_stages=2"}, {1, 2, 3}},
      {"v3", {"parallel.expert=2"}, {1, 2, 3}},
  });
}

// DeepSeek-V3's own layout in miniature (pipeline x expert x ZeRO-1 data parallelism, DualPipeV,
// MTP, the bias update), and tensor x expert and tensor x pipeline with ZeRO.
TEST(ZeroLayoutsFourRanks, DeepSeekV3RecipeAndOtherCompositions) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  train_layouts({
      {"v3", {"parallel.pipeline=2", "parallel.schedule=\"dualpipev\"", "parallel.expert=2"}, {1, 2}},
      {"v3", {"parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true"}, {1, 2}},
      {"v2", {"parallel.tensor=2", "parallel.expert=2"}, {1, 3}},
      {"dense", {"parallel.tensor=2", "parallel.pipeline=2", "parallel.schedule=\"1f1b\""}, {1}},
  });
}

// The full 4-D layout at 8 ranks (oversubscribed): pipeline 2 x tensor 2 x data 2, with expert 2
// over the data axis, ZeRO-1 (and 2), on DeepSeek-V3 with MTP under DualPipeV.
TEST(ZeroLayoutsEightRanks, PipelineTensorDataAndExpertAtOnce) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 8, "8");
  train_layouts({
      {"v3",
       {"parallel.pipeline=2", "parallel.schedule=\"dualpipev\"", "parallel.tensor=2", "parallel.expert=2",
        "parallel.sequence_parallel=true"},
       {1, 2}},
  });
}

// Offload (the optimizer, and at stage 3 the parameters at rest) under every axis: the host
// copies of the pieces go the same way whatever split the pieces come from.
TEST(ZeroLayoutsFourRanks, OffloadUnderEveryAxis) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  const std::string optimizer = "train.zero_optimization.offload_optimizer={\"device\": \"cpu\"}";
  const std::string params = "train.zero_optimization.offload_param={\"device\": \"cpu\"}";
  train_layouts({
      {"v3", {"parallel.pipeline=2", "parallel.schedule=\"dualpipev\"", "parallel.expert=2", optimizer, params}, {3}},
      {"dense", {"parallel.tensor=2", "parallel.sequence_parallel=true", optimizer}, {1, 2}},
  });
}

// Layout A trains 2 of 4 steps and saves; layout B resumes the checkpoint and trains on, and so
// does one process at stage 0: the steps after the resume have the uninterrupted one-process
// run's losses and gradient norms (within 1e-5: the sums go in other orders), and B ends with
// its weights.
void expect_reshard(const std::string& model, std::vector<std::string> a, std::vector<std::string> b) {
  constexpr int kAll = 4, kStop = 2;
  RunFiles files(kAll, model_of(model));
  const std::string ckpt = "checkpoint.dir=" + quoted(files.dir() / "ckpt");
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  {
    a.insert(a.end(), {ckpt, "train.max_steps=" + std::to_string(kStop), "checkpoint.save_final=true"});
    const RunConfig cfg = files.config(a);
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
  }
  const auto expect_continues = [&](Trainer& t, const std::string& what) {
    ASSERT_TRUE(t.resume("auto")) << what;
    ASSERT_EQ(t.step(), kStop) << what;
    t.train();
    ASSERT_EQ(t.history().size(), size_t(kAll - kStop)) << what;
    for (size_t i = 0; i < t.history().size(); ++i) {
      const StepRecord &x = t.history()[i], &want = ref.history()[size_t(kStop) + i];
      EXPECT_NEAR(x.loss, want.loss, 1e-5 * std::fabs(want.loss)) << what << ": loss of step " << x.step;
      EXPECT_NEAR(x.grad_norm, want.grad_norm, 1e-5 * want.grad_norm) << what << ": gradient norm of step " << x.step;
    }
  };
  {
    b.push_back(ckpt);
    const RunConfig cfg = files.config(b);
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    std::string what = "resumed on";
    for (const std::string& o : b) what += " " + o.substr(o.find('.') + 1);
    expect_continues(t, what);
    // Its weights after the resumed steps: the uninterrupted run's.
    ASSERT_GE(t.optimizer().stage(), 1);
    t.optimizer().gather_all();
    const ParamRegistry& reg = t.model().params();
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      if (p.kind == ParamKind::RouterBias) continue;
      std::vector<float> piece(size_t(p.numel()));
      extract_local(p, ref.model().params().param(ref.model().params().find(p.name)),
                    Tensor(piece.data(), DType::F32, p.shape));
      EXPECT_LE(rel_error(values(reg.param(id)), piece), kLayoutWeightTolerance) << what << ": " << p.name;
    }
  }
  Trainer one(files.solo_config({ckpt, "checkpoint.save_final=false"}), solo);
  expect_continues(one, "resumed on one process");
}

TEST(ZeroLayoutsMultiRank, CheckpointsReshardBetweenComposedLayouts) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 2 || world_size() == 4, "2 or 4");
  expect_reshard("v3", {"parallel.expert=2", "train.zero_optimization.stage=2"},
                 {"parallel.pipeline=2", "parallel.schedule=\"1f1b\"", "train.zero_optimization.stage=3"});
}

TEST(ZeroLayoutsFourRanks, CheckpointsReshardBetweenComposedLayouts) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  expect_reshard("v3",
                 {"parallel.pipeline=2", "parallel.schedule=\"dualpipev\"", "parallel.expert=2",
                  "train.zero_optimization.stage=1"},
                 {"parallel.tensor=2", "parallel.expert=2", "parallel.sequence_parallel=true",
                  "train.zero_optimization.stage=2"});
  expect_reshard("dense", {"parallel.tensor=2", "train.zero_optimization.stage=3"},
                 {"parallel.pipeline=2", "parallel.schedule=\"interleaved\"", "parallel.virtual_stages=2",
                  "train.zero_optimization.stage=1"});
}

// A resume on the same composed layout is bitwise: the gathered and re-cut shards, the tied
// copy's state and the routing biases come back exactly.
TEST(ZeroLayoutsMultiRank, ResumeOnTheSameComposedLayoutIsBitwise) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 2 || world_size() == 4, "2 or 4");
  RunFiles files(4, model_of("v3"));
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{"parallel.pipeline=2", "parallel.schedule=\"dualpipev\"",
                                              "parallel.expert=" + std::to_string(world_size() / 2),
                                              "train.zero_optimization.stage=1"},
                                             {"parallel.pipeline=2", "parallel.schedule=\"1f1b\"",
                                              "train.zero_optimization.stage=2"},
                                             {"parallel.expert=2", "train.zero_optimization.stage=3"}}) {
    const RunConfig cfg = files.config(layout);
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    SCOPED_TRACE(layout[0] + " " + layout.back());
    expect_resume_is_bitwise(files, grid, 2, layout);
  }
}

}  // namespace
}  // namespace dstrain
