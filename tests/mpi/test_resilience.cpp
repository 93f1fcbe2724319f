// Resilience under MPI at 1, 2 and 4 ranks: non-finite steps are skipped by every rank alike,
// a micro-batch over the memory budget or failing to allocate is halved (global batch kept)
// with the results of a run started that way, and a stop signal on one rank stops every rank
// at the same step after a checkpoint from which the run continues bit for bit.
#include <gtest/gtest.h>

#include <csignal>
#include <cmath>
#include <cstring>

#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

TEST(Resilience, NonFiniteGradientsSkipTheStepOnEveryRank) {
  RunFiles files(5);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string fault = fmt::format("resilience.fault={{\"rank\": {}, \"nan_at_step\": 3}}", world_size() - 1);
  Trainer t(files.config({fault}), grid);
  std::vector<uint64_t> sums;
  t.on_step = [&](const StepRecord&) {
    const Buffer& p = t.model().params().values();
    sums.push_back(checksum(p.data(), p.nbytes()));
  };
  t.init_weights("");
  t.train();
  ASSERT_EQ(t.history().size(), 5u);
  EXPECT_TRUE(t.history()[2].skipped);
  EXPECT_EQ(t.history()[2].skip_reason, "non-finite gradient norm");
  EXPECT_EQ(sums[2], sums[1]) << "a skipped step leaves the weights as they were";
  EXPECT_NE(sums[3], sums[2]);
  EXPECT_EQ(t.optimizer().steps_taken(), 4) << "AdamW's step count (bias correction) skips it too";
  // With a limit of one, the same fault stops the run with an error on every rank.
  Trainer u(files.config({fault, "resilience.max_skipped_steps=1"}), grid);
  u.init_weights("");
  try {
    u.train();
    ADD_FAILURE() << "the run went on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("1 consecutive steps skipped"), std::string::npos) << e.what();
  }
}

TEST(Resilience, MicroBatchOverTheBudgetIsHalvedLikeARunStartedSmaller) {
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const int n = world_size();
  // The reference: micro-batch 1 from the start (train_batch_size 8).
  Trainer small(files.config({"train.train_micro_batch_size_per_gpu=1"}), grid);
  small.init_weights("");
  small.train();
  // Micro-batch 2 does not fit a budget between what 1 and 2 need.
  const double need1 = double(small.model().activation_bytes(1, 16)), need2 = double(small.model().activation_bytes(2, 16));
  Trainer big(files.config({fmt::format("resilience.activation_budget_mb={}", (need1 + need2) / 2 / 1e6)}), grid);
  big.init_weights("");
  big.train();
  EXPECT_EQ(big.config().train.micro_batch, 1);
  EXPECT_EQ(big.config().train.grad_accum, 8 / n);
  ASSERT_EQ(big.history().size(), small.history().size());
  for (size_t i = 0; i < big.history().size(); ++i) EXPECT_EQ(big.history()[i].loss, small.history()[i].loss);
  const Buffer& a = big.model().params().values();
  EXPECT_EQ(0, std::memcmp(a.data(), small.model().params().values().data(), a.nbytes()));
}

TEST(Resilience, AllocationFailureOnOneRankHalvesTheMicroBatchEverywhere) {
  RunFiles files(5);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer small(files.config({"train.train_micro_batch_size_per_gpu=1"}), grid);
  small.init_weights("");
  small.train();
  Trainer t(files.config({fmt::format("resilience.fault={{\"rank\": {}, \"oom_at_step\": 3}}", world_size() - 1)}),
            grid);
  t.init_weights("");
  t.train();
  EXPECT_EQ(t.config().train.micro_batch, 1);
  ASSERT_EQ(t.history().size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    const double want = small.history()[i].loss;
    EXPECT_NEAR(t.history()[i].loss, want, 1e-5 * want) << "step " << i + 1;
  }
}

TEST(Resilience, StopSignalOnOneRankStopsAllAtTheSameStepAfterACheckpoint) {
  RunFiles files(6);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  install_stop_signal_handlers();
  clear_stop_signal();
  const std::string dir = "checkpoint.dir=" + json((files.dir() / "ck").string()).dump();
  Trainer full(files.config({"checkpoint.dir=" + json((files.dir() / "full").string()).dump()}), grid);
  full.init_weights("");
  full.train();
  std::vector<double> losses;
  {
    Trainer a(files.config({dir}), grid);
    a.on_step = [&](const StepRecord& r) {
      if (r.step == 3 && world_rank() == world_size() - 1) std::raise(SIGUSR1);
    };
    a.init_weights("");
    EXPECT_EQ(a.train(), Trainer::Outcome::StoppedOnSignal);
    EXPECT_EQ(a.step(), 3);
    for (const auto& r : a.history()) losses.push_back(r.loss);
  }
  clear_stop_signal();
  Trainer b(files.config({dir}), grid);
  ASSERT_TRUE(b.resume("auto"));
  EXPECT_EQ(b.step(), 3);
  EXPECT_EQ(b.train(), Trainer::Outcome::Completed);
  for (const auto& r : b.history()) losses.push_back(r.loss);
  ASSERT_EQ(losses.size(), full.history().size());
  for (size_t i = 0; i < losses.size(); ++i) EXPECT_EQ(losses[i], full.history()[i].loss);
  const Buffer& x = full.model().params().values();
  EXPECT_EQ(0, std::memcmp(x.data(), b.model().params().values().data(), x.nbytes()));
}

}  // namespace
}  // namespace dstrain
