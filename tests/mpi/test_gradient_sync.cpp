// Aggregation between replicas (train.gradient_sync): DiLoCo's degenerate case against
// synchronous training, the delayed mode's one-step lag, determinism, and composition with
// tensor, pipeline, expert parallelism and ZeRO inside a replica.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "resume_check.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {


// The weights of every rank's model, gathered to compare across ranks: checksum per rank.
uint64_t weights_checksum(Trainer& t) {
  const Buffer& b = t.model().params().values();
  return checksum(b.data(), b.nbytes());
}

struct RunResult {
  std::vector<double> losses;
  std::vector<std::vector<float>> weights;  // per parameter, this rank's local tensor
};

RunResult train(RunFiles& files, ProcessGrid& grid, std::vector<std::string> overrides,
          const std::function<void(Trainer&, const StepRecord&)>& on_step = {}) {
  Trainer t(files.config(std::move(overrides)), grid);
  if (on_step) t.on_step = [&](const StepRecord& r) { on_step(t, r); };
  t.init_weights("");
  t.train();
  RunResult run;
  for (const StepRecord& r : t.history()) run.losses.push_back(r.loss);
  const ParamRegistry& reg = t.model().params();
  for (int id = 0; id < reg.size(); ++id) {
    const float* p = reg.param(id).data<float>();
    run.weights.emplace_back(p, p + reg.info(id).numel());
  }
  return run;
}

// One replica (the data axis of one rank; the other ranks split tensor and pipeline): DiLoCo
// with H = 1, outer SGD at lr 1 takes the inner step and then theta_outer - (theta_outer -
// theta) = theta, the synchronous step, to rounding (the two subtractions are exact where an
// element keeps its sign and moves by less than half its size: Sterbenz). Local SGD averages
// the one replica's parameters: the same bits.
TEST(GradientSync, DiLoCoWithOneInnerStepAndOuterSgdAtLrOneIsSynchronousTraining) {
  const int n = world_size();
  std::vector<std::string> layout;
  if (n == 2) layout = {"parallel.tensor=2"};
  if (n == 4) layout = {"parallel.tensor=2", "parallel.pipeline=2"};
  RunFiles files(6);
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> o = layout;
    o.insert(o.end(), extra.begin(), extra.end());
    return o;
  };
  ParallelConfig pc;
  pc.tensor = n >= 2 ? 2 : 1;
  pc.pipeline = n == 4 ? 2 : 1;
  ProcessGrid g(MPI_COMM_WORLD, pc);
  const RunResult synced = train(files, g, with({}));
  const RunResult diloco = train(files, g, with({R"(train.gradient_sync={"mode": "diloco", "every": 1, "outer_optimizer": {"type": "sgd", "lr": 1.0}})"}));
  ASSERT_EQ(synced.losses.size(), diloco.losses.size());
  for (size_t i = 0; i < synced.losses.size(); ++i) {
    EXPECT_NEAR(diloco.losses[i], synced.losses[i], 1e-6 * std::fabs(synced.losses[i])) << "step " << i + 1;
  }
  double worst = 0;
  for (size_t p = 0; p < synced.weights.size(); ++p) {
    worst = std::max(worst, rel_error(diloco.weights[p].data(), synced.weights[p].data(), int64_t(synced.weights[p].size())));
  }
  EXPECT_LE(worst, 1e-6) << "weights after 6 steps";
  // Local SGD with H = 1 and one replica averages one replica's parameters: the same bits.
  const RunResult local = train(files, g, with({R"(train.gradient_sync={"mode": "local_sgd", "every": 1})"}));
  EXPECT_EQ(local.losses, synced.losses);
  for (size_t p = 0; p < synced.weights.size(); ++p) EXPECT_EQ(local.weights[p], synced.weights[p]) << "parameter " << p;
  if (world_rank() == 0) std::printf("[ %d ranks ] DiLoCo H=1 against synchronous: worst weight error %.2e\n", world_size(), worst);
}

// Delayed: step 1 applies nothing, step t the average of step t-1's gradients; every replica
// holds the same bits after every step.
TEST(GradientSyncMultiRank, DelayedAppliesThePreviousStepsAverageOnEveryReplica) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  const int n = world_size();
  RunFiles files(3);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  std::vector<uint64_t> initial;
  std::vector<std::vector<uint64_t>> after;
  const RunResult delayed = train(files, grid, {R"(train.gradient_sync={"mode": "delayed"})"},
                            [&](Trainer& t, const StepRecord& r) {
                              uint64_t mine = weights_checksum(t);
                              std::vector<uint64_t> all(static_cast<size_t>(n));
                              MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
                              for (int k = 1; k < n; ++k) EXPECT_EQ(all[size_t(k)], all[0]) << "rank " << k << " after step " << r.step;
                              EXPECT_EQ(r.update_applied, r.step > 1);
                              after.push_back(all);
                            });
  // The one-step synchronous run: delayed's weights after step 2 are its weights after step 1
  // (the same average of the first batch, applied at the same learning rate), to rounding (the
  // average is summed in another order).
  Trainer sync1(files.config({"train.max_steps=1"}), grid);
  sync1.init_weights("");
  const ParamRegistry& reg = sync1.model().params();
  std::vector<std::vector<float>> init;
  for (int id = 0; id < reg.size(); ++id) {
    const float* p = reg.param(id).data<float>();
    init.emplace_back(p, p + reg.info(id).numel());
  }
  sync1.train();
  Trainer delayed2(files.config({"train.max_steps=2", R"(train.gradient_sync={"mode": "delayed"})"}), grid);
  delayed2.init_weights("");
  delayed2.train();
  Trainer delayed1(files.config({"train.max_steps=1", R"(train.gradient_sync={"mode": "delayed"})"}), grid);
  delayed1.init_weights("");
  delayed1.train();
  double worst = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const int64_t k = reg.info(id).numel();
    EXPECT_EQ(std::memcmp(delayed1.model().params().param(id).data<float>(), init[size_t(id)].data(), k * sizeof(float)), 0)
        << reg.info(id).name << " moved at step 1";
    worst = std::max(worst, rel_error(delayed2.model().params().param(id).data<float>(), reg.param(id).data<float>(), k));
  }
  EXPECT_LE(worst, 1e-6) << "delayed after 2 steps against synchronous after 1, " << n << " replicas";
  // The loss of step 2 is the second batch's at the initial weights: not the synchronous run's
  // (taken after one update).
  ASSERT_EQ(delayed.losses.size(), 3u);
  EXPECT_EQ(delayed2.history()[1].lr, sync1.history()[0].lr);
}

// DiLoCo over 2 replicas: the same run twice gives the same bits; after each outer step every
// replica holds the same weights; between them they drift; and the same replicas cut into more
// ranks (ZeRO, tensor, pipeline, nodes of 2 data ranks) train alike.
TEST(GradientSyncMultiRank, DiLoCoIsDeterministicAndReplicasMeetAtEachOuterStep) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  const int n = world_size();
  RunFiles files(8);
  const std::string diloco = R"(train.gradient_sync={"mode": "diloco", "every": 4, "over": "nodes", "ranks_per_node": )" +
                             std::to_string(n / 2) + R"(, "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}})";
  ProcessGrid grid(MPI_COMM_WORLD, {});
  std::vector<double> drift;
  auto check = [&](Trainer& t, const StepRecord& r) {
    uint64_t mine = weights_checksum(t);
    std::vector<uint64_t> all(static_cast<size_t>(n));
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    // Ranks of one replica (a "node" of n/2) always agree; replicas agree after an outer step.
    for (int k = 0; k < n; ++k) {
      if (k / (n / 2) == 0 || r.step % 4 == 0) {
        EXPECT_EQ(all[size_t(k)], all[0]) << "rank " << k << " after step " << r.step;
      }
    }
    if (r.step % 4 != 0) {
      EXPECT_NE(all[size_t(n - 1)], all[0]) << "the replicas train apart inside a round";
      EXPECT_EQ(r.sync_outer_steps, 0);
    } else {
      EXPECT_EQ(r.sync_outer_steps, 1);
      EXPECT_GT(r.sync_drift, 0);
      drift.push_back(r.sync_drift);
    }
  };
  const RunResult a = train(files, grid, {diloco}, check);
  EXPECT_EQ(drift.size(), 2u);
  const RunResult b = train(files, grid, {diloco});
  EXPECT_EQ(a.losses, b.losses);
  for (size_t p = 0; p < a.weights.size(); ++p) EXPECT_EQ(a.weights[p], b.weights[p]) << "parameter " << p;
  // The same 2 replicas with the work inside each split other ways: each replica reads the same
  // rows in the same micro-batches (at 4 ranks, 2 data ranks of micro-batch 1 per replica, or
  // one of micro-batch 2).
  struct Layout {
    ParallelConfig pc;
    std::vector<std::string> set;
  };
  std::vector<Layout> layouts = {{{}, {diloco, "train.zero_optimization.stage=1"}}};
  const std::string mb1 = "train.train_micro_batch_size_per_gpu=1";
  const std::string over_data =
      R"(train.gradient_sync={"mode": "diloco", "every": 4, "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}})";
  RunResult base = a;
  if (n == 4) {
    base = train(files, grid, {diloco, mb1});
    layouts = {{{}, {diloco, mb1, "train.zero_optimization.stage=1"}},
               {{}, {diloco, mb1, "train.zero_optimization.stage=2"}}};
    ParallelConfig tp;
    tp.tensor = 2;
    layouts.push_back({tp, {over_data, "parallel.tensor=2"}});
    ParallelConfig pp;
    pp.pipeline = 2;
    layouts.push_back({pp, {over_data, "parallel.pipeline=2", "train.zero_optimization.stage=1"}});
  }
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.set.back());
    ProcessGrid g(MPI_COMM_WORLD, l.pc);
    const RunResult c = train(files, g, l.set);
    ASSERT_EQ(c.losses.size(), base.losses.size());
    for (size_t i = 0; i < base.losses.size(); ++i) {
      EXPECT_NEAR(c.losses[i], base.losses[i], 1e-5 * std::fabs(base.losses[i])) << "step " << i + 1;
    }
  }
}

// Experts: a V3 model over nodes of whole expert groups; the experts' outer state is that of
// the ranks holding the same experts.
TEST(GradientSyncFourRanks, DiLoCoWithExpertParallelReplicasMatchesOneRankPerReplica) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  RunFiles files(4, v3_model());
  const std::string gs = R"(train.gradient_sync={"mode": "diloco", "every": 2, "over": "nodes", "ranks_per_node": 2, "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}})";
  ProcessGrid plain(MPI_COMM_WORLD, {});
  const RunResult ref = train(files, plain, {gs});
  ParallelConfig pc;
  pc.expert = 2;
  ProcessGrid ep(MPI_COMM_WORLD, pc);
  const RunResult got = train(files, ep, {gs, "parallel.expert=2"});
  ASSERT_EQ(got.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(got.losses[i], ref.losses[i], 1e-5 * std::fabs(ref.losses[i])) << "step " << i + 1;
}

// A run stopped inside an outer round (or with a delayed gradient in flight) and resumed from its
// checkpoint equals the uninterrupted run, bit for bit: each replica's weights and moments, the
// outer parameters and momentum (the outer step after the resume uses them), the delayed
// gradient, the round's position.
TEST(GradientSyncMultiRank, ResumeInsideARoundIsBitwiseExact) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  const int n = world_size();
  const std::string nodes = std::to_string(n / 2);
  {
    RunFiles files(10);
    ProcessGrid grid(MPI_COMM_WORLD, {});
    SCOPED_TRACE("diloco, 2 fragments");
    expect_resume_is_bitwise(files, grid, 6,
                             {R"(train.gradient_sync={"mode": "diloco", "every": 4, "fragments": 2, "over": "nodes", )"
                              R"("ranks_per_node": )" + nodes + R"(, "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}})",
                              "train.zero_optimization.stage=1"});
  }
  {
    RunFiles files(6);
    ProcessGrid grid(MPI_COMM_WORLD, {});
    SCOPED_TRACE("delayed");
    expect_resume_is_bitwise(files, grid, 3, {R"(train.gradient_sync={"mode": "delayed"})"});
  }
  {
    RunFiles files(6);
    ProcessGrid grid(MPI_COMM_WORLD, {});
    SCOPED_TRACE("local SGD");
    expect_resume_is_bitwise(files, grid, 3, {R"(train.gradient_sync={"mode": "local_sgd", "every": 4})"});
  }
}

// Another aggregation than the checkpoint's is refused, naming what differs; a synchronous
// checkpoint starts an asynchronous run (every replica from its weights).
TEST(GradientSyncMultiRank, ResumeWithAnotherAggregationIsRefused) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string dir = "checkpoint.dir=" + json((files.dir() / "ck").string()).dump();
  {
    Trainer a(files.config({dir, "checkpoint.save_final=true", R"(train.gradient_sync={"mode": "diloco", "every": 4})"}), grid);
    a.init_weights("");
    a.train();
  }
  Trainer b(files.config({dir, "train.max_steps=6", R"(train.gradient_sync={"mode": "diloco", "every": 8})"}), grid);
  try {
    b.resume("auto");
    ADD_FAILURE() << "resumed with another H";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("every 4 (now 8)"), std::string::npos) << e.what();
  }
  Trainer c(files.config({dir, "train.max_steps=6"}), grid);
  EXPECT_THROW(c.resume("auto"), Error);
}

TEST(GradientSync, BadConfigurationNamesTheKey) {
  RunFiles files(2);
  auto error_of = [&](const std::string& set) {
    try {
      files.config({set});
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(error_of(R"(train.gradient_sync={"mode": "gossip"})").find("gradient_sync.mode"), std::string::npos);
  EXPECT_NE(error_of(R"(train.gradient_sync={"mode": "delayed", "every": 4})").find("gradient_sync.every"), std::string::npos);
  EXPECT_NE(error_of(R"(train.gradient_sync={"mode": "local_sgd", "outer_optimizer": {"lr": 0.5}})").find("outer_optimizer"),
            std::string::npos);
  EXPECT_NE(error_of(R"(train.gradient_sync={"mode": "diloco", "every": 8, "fragments": 3})").find("fragments"),
            std::string::npos);
  EXPECT_NE(error_of(R"(train.gradient_sync={"mode": "diloco", "outer_dtype": "fp8"})").find("outer_dtype"), std::string::npos);
  EXPECT_NO_THROW(files.config({R"(train.gradient_sync={"mode": "diloco", "every": 8, "fragments": 4})"}));
}

}  // namespace
}  // namespace dstrain
