// Resilience under MPI at 1, 2 and 4 ranks: non-finite steps are skipped by every rank alike,
// a micro-batch over the memory budget or failing to allocate is halved (global batch kept)
// with the results of a run started that way, and a stop signal on one rank stops every rank
// at the same step after a checkpoint from which the run continues bit for bit, and a diverged
// run never saves (or rotates) over the checkpoints written before it went wrong.
#include <gtest/gtest.h>

#include <unistd.h>

#include <csignal>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>

#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

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

// fp16: a NaN in one rank's gradients is an overflow, not a fault: the step is skipped on
// every rank, the scale drops, the learning-rate schedule stands still, and it does not count
// against resilience.max_skipped_steps.
TEST(Resilience, AnFp16OverflowOnOneRankSkipsTheStepEverywhereWithoutCountingAsAFault) {
  RunFiles files(6);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string fault = fmt::format("resilience.fault={{\"rank\": {}, \"nan_at_step\": 3}}", world_size() - 1);
  Trainer t(files.config({fault, "resilience.max_skipped_steps=1",
                          "train.fp16={\"enabled\": true, \"initial_scale_power\": 12, \"hysteresis\": 1}"}),
            grid);
  std::vector<uint64_t> sums;
  t.on_step = [&](const StepRecord&) {
    const Buffer& p = t.model().params().values();
    sums.push_back(checksum(p.data(), p.nbytes()));
  };
  t.init_weights("");
  t.train();  // no "consecutive steps skipped" error
  ASSERT_EQ(t.history().size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    const StepRecord& r = t.history()[i];
    EXPECT_FALSE(r.skipped) << "step " << r.step << " counted as a fault";
    EXPECT_EQ(r.overflow, i == 2) << "step " << r.step;
    EXPECT_EQ(r.loss_scale, i <= 2 ? 4096.0 : 2048.0) << "step " << r.step;
    if (i != 2) EXPECT_TRUE(std::isfinite(r.loss) && std::isfinite(r.grad_norm)) << "step " << r.step;
  }
  EXPECT_EQ(sums[2], sums[1]) << "an overflowed step leaves the weights as they were";
  EXPECT_NE(sums[3], sums[2]);
  EXPECT_EQ(t.optimizer().steps_taken(), 5);
  EXPECT_EQ(t.loss_scaler().overflows(), 1);
  EXPECT_EQ(t.loss_scaler().scale(), 2048.0);
  // The schedule did not advance at the skipped step: step 4 has the learning rate of step 3.
  const TrainConfig& tc = t.config().train;
  EXPECT_EQ(t.history()[3].lr, tc.schedule.lr_at(2, tc.adamw.lr));
  EXPECT_EQ(t.history()[5].lr, tc.schedule.lr_at(4, tc.adamw.lr));
}

// A scale far too large for fp16 overflows the first steps; the scale backs off by halves
// until the gradients fit, and training continues with finite losses (a later overflow, as the
// gradients grow with the warmup, halves it again).
TEST(Resilience, AnFp16ScaleTooLargeBacksOffAndTrainingContinues) {
  RunFiles files(16);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer t(files.config({"resilience.max_skipped_steps=1",
                          "train.fp16={\"enabled\": true, \"initial_scale_power\": 24, \"hysteresis\": 1}"}),
            grid);
  t.init_weights("");
  t.train();
  ASSERT_EQ(t.history().size(), 16u);
  int64_t overflows = 0, leading = 0;
  double scale = std::ldexp(1.0, 24);
  for (const StepRecord& r : t.history()) {
    EXPECT_EQ(r.loss_scale, scale) << "step " << r.step;
    EXPECT_FALSE(r.skipped) << "step " << r.step << " counted as a fault";
    if (r.overflow) {
      ++overflows;
      leading += overflows == r.step;
      scale /= 2;
    } else {
      EXPECT_TRUE(std::isfinite(r.loss) && std::isfinite(r.grad_norm)) << "step " << r.step;
    }
  }
  // Over several ranks the fp16 gradient all-reduce (communication_data_type defaults to fp16)
  // overflows at 2^24 (gradients of the tiny model reach 0.1) whatever the model computes in;
  // at one rank nothing is communicated, and the overflow comes from the model's fp16
  // activations and their gradients.
  if (world_size() > 1) EXPECT_GE(leading, 3) << "2^24 did not overflow fp16 from the first step";
  EXPECT_LE(overflows, 10) << "the scale never came down far enough";
  EXPECT_FALSE(t.history().back().overflow);
  EXPECT_EQ(t.loss_scaler().overflows(), overflows);
  EXPECT_EQ(t.loss_scaler().scale(), std::ldexp(1.0, 24 - int(overflows)));
  EXPECT_EQ(t.optimizer().steps_taken(), 16 - overflows);
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
  Trainer big(files.config({fmt::format("resilience.activation_budget_mb={}", (need1 + need2) / 2 / 1e6),
                            "resilience.oom_recompute=false"}),
              grid);
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
  Trainer t(files.config({fmt::format("resilience.fault={{\"rank\": {}, \"oom_at_step\": 3}}", world_size() - 1),
                          "resilience.oom_recompute=false"}),
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

// Over the budget without recomputation but not with it: full recomputation is turned on and
// the micro-batch kept, and the run is bitwise the one that fit from the start.
TEST(Resilience, ActivationsOverTheBudgetTurnOnRecomputationWithTheSameResults) {
  RunFiles files(7);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::vector<std::string> layers = {"model.num_hidden_layers=4"};
  Trainer plain(files.config(layers), grid);
  plain.init_weights("");
  plain.train();
  std::vector<std::string> full = layers;
  full.push_back("train.activation_checkpointing={\"granularity\": \"full\"}");
  const int64_t mb = plain.config().train.micro_batch;
  const double need = double(plain.model().activation_bytes(mb, 16));
  const double need_full = double(Trainer(files.config(full), grid).model().activation_bytes(mb, 16));
  ASSERT_LT(need_full, need);
  std::vector<std::string> tight = layers;
  tight.push_back(fmt::format("resilience.activation_budget_mb={}", (need + need_full) / 2 / 1e6));
  Trainer t(files.config(tight), grid);
  t.init_weights("");
  t.train();
  EXPECT_TRUE(t.config().train.activation_checkpointing.full());
  EXPECT_EQ(t.config().train.micro_batch, mb);
  ASSERT_EQ(t.history().size(), plain.history().size());
  for (size_t i = 0; i < t.history().size(); ++i) EXPECT_EQ(t.history()[i].loss, plain.history()[i].loss);
  const Buffer& a = t.model().params().values();
  EXPECT_EQ(0, std::memcmp(a.data(), plain.model().params().values().data(), a.nbytes()));
}

// A rank that fails to allocate: every rank turns on full recomputation and the step runs
// again, bitwise as if nothing had failed; a second failure then halves the micro-batch.
TEST(Resilience, AllocationFailureTurnsOnRecomputationEverywhereWithTheSameResults) {
  RunFiles files(8);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer plain(files.config({}), grid);
  plain.init_weights("");
  plain.train();
  Trainer t(files.config({fmt::format("resilience.fault={{\"rank\": {}, \"oom_at_step\": 3}}", world_size() - 1)}),
            grid);
  t.init_weights("");
  t.train();
  EXPECT_TRUE(t.config().train.activation_checkpointing.full());
  EXPECT_EQ(t.config().train.micro_batch, plain.config().train.micro_batch);
  ASSERT_EQ(t.history().size(), plain.history().size());
  for (size_t i = 0; i < t.history().size(); ++i) EXPECT_EQ(t.history()[i].loss, plain.history()[i].loss);
  const Buffer& a = t.model().params().values();
  EXPECT_EQ(0, std::memcmp(a.data(), plain.model().params().values().data(), a.nbytes()));
}

// Where a step cannot be abandoned half-way (ZeRO stage 3 reduces and gathers every
// micro-step; pipeline stages wait on each other), the last rank finds at step 3 that the step
// does not fit, set up by `extra` (configuration keys) and `arm` (on the trainer). Every rank
// changes alike before the step's first collective: full recomputation, and the run is bitwise
// the one that had it from the start; without recomputation the micro-batch is halved
// everywhere, as a run started smaller.
std::vector<std::vector<std::string>> unabandonable_layouts(bool dualpipev) {
  std::vector<std::vector<std::string>> layouts = {{"train.zero_optimization.stage=3"}};
  if (world_size() >= 2) {
    layouts.push_back({"parallel.pipeline=2", "model.num_hidden_layers=4"});
    if (dualpipev) {
      layouts.push_back({"parallel.pipeline=2", "model.num_hidden_layers=4", "parallel.schedule=\"dualpipev\"",
                         "train.zero_optimization.stage=2", "train.train_batch_size=16"});
    }
  }
  return layouts;
}

void expect_every_rank_changes_before_step_3(RunFiles& files, const std::vector<std::string>& layout,
                                             const std::vector<std::string>& extra,
                                             const std::function<void(Trainer&)>& arm) {
  SCOPED_TRACE(layout.front());
  ProcessGrid grid(MPI_COMM_WORLD, files.config(layout).parallel);
  std::vector<std::string> full = layout;
  full.push_back("train.activation_checkpointing={\"granularity\": \"full\"}");
  Trainer reference(files.config(full), grid);
  reference.init_weights("");
  reference.train();
  std::vector<std::string> failing = layout;
  failing.insert(failing.end(), extra.begin(), extra.end());
  Trainer t(files.config(failing), grid);
  arm(t);
  t.init_weights("");
  t.train();
  EXPECT_TRUE(t.config().train.activation_checkpointing.full());
  EXPECT_EQ(t.config().train.micro_batch, reference.config().train.micro_batch);
  ASSERT_EQ(t.history().size(), reference.history().size());
  for (size_t i = 0; i < t.history().size(); ++i) EXPECT_EQ(t.history()[i].loss, reference.history()[i].loss);

  std::vector<std::string> smaller = layout;
  smaller.push_back("train.train_micro_batch_size_per_gpu=1");
  Trainer small(files.config(smaller), grid);
  small.init_weights("");
  small.train();
  failing.push_back("resilience.oom_recompute=false");
  Trainer halved(files.config(failing), grid);
  arm(halved);
  halved.init_weights("");
  halved.train();
  EXPECT_EQ(halved.config().train.micro_batch, 1);
  EXPECT_EQ(halved.config().train.grad_accum, small.config().train.grad_accum);
  EXPECT_FALSE(halved.config().train.activation_checkpointing.full());
  ASSERT_EQ(halved.history().size(), small.history().size());
  for (size_t i = 0; i < halved.history().size(); ++i) {
    const double want = small.history()[i].loss;
    EXPECT_NEAR(halved.history()[i].loss, want, 1e-5 * want) << "step " << i + 1;
  }
}

// An injected allocation failure.
TEST(Resilience, AllocationFailureAtZeroThreeAndUnderPipelineChangesEveryRankBeforeTheStep) {
  RunFiles files(5);
  const std::string fault = fmt::format("resilience.fault={{\"rank\": {}, \"oom_at_step\": 3}}", world_size() - 1);
  for (const auto& layout : unabandonable_layouts(true)) {
    expect_every_rank_changes_before_step_3(files, layout, {fault}, [](Trainer&) {});
  }
}

// A real comparison: before each step every rank compares the memory model's peak for its stage
// with what it may hold (Trainer::memory_available; here the last rank says, at step 3 and until
// something changed, that it may hold 1 byte; otherwise, and on every other rank, it does not
// know, and nothing is checked). Without the fallback every rank stops before the step with an
// error naming it.
TEST(Resilience, AStepTheMemoryModelSaysDoesNotFitChangesEveryRankBeforeItStarts) {
  RunFiles files(5);
  const bool short_rank = world_rank() == world_size() - 1;
  for (const auto& layout : unabandonable_layouts(false)) {
    int64_t asked = 0;
    expect_every_rank_changes_before_step_3(files, layout, {}, [&](Trainer& t) {
      t.memory_available = [&asked, &t, short_rank]() -> int64_t {
        ++asked;
        const TrainConfig& tc = t.config().train;
        const bool unchanged = !tc.activation_checkpointing.full() && tc.micro_batch == 2;
        return short_rank && t.step() == 2 && unchanged ? 1 : -1;
      };
    });
    EXPECT_GE(asked, 10) << "asked before every step of both runs";

    std::vector<std::string> refused = layout;
    refused.push_back("resilience.oom_fallback=false");
    ProcessGrid grid(MPI_COMM_WORLD, files.config(layout).parallel);
    Trainer r(files.config(refused), grid);
    r.memory_available = [&]() -> int64_t { return short_rank && r.step() == 2 ? 1 : -1; };
    r.init_weights("");
    try {
      r.train();
      ADD_FAILURE() << "a step that does not fit started without the fallback";
    } catch (const Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("step 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find("1 rank(s) would run out of memory in the step"), std::string::npos) << msg;
      if (short_rank) {
        EXPECT_NE(msg.find("the memory model puts its step's peak at"), std::string::npos) << msg;
      }
    }
    EXPECT_EQ(r.step(), 2) << "the step did not start";
  }
}

TEST(Resilience, StopSignalOnOneRankStopsAllAtTheSameStepAfterACheckpoint) {
  RunFiles files(6);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  listen_for_stop_signals(StopSignalMode::kRequestStop);
  clear_stop_signal();
  const std::string dir = "checkpoint.dir=" + json((files.dir() / "ck").string()).dump();
  Trainer full(files.config({"checkpoint.dir=" + json((files.dir() / "full").string()).dump()}), grid);
  full.init_weights("");
  full.train();
  std::vector<double> losses;
  {
    Trainer a(files.config({dir}), grid);
    a.on_step = [&](const StepRecord& r) {
      // To the process, as kill, scancel and Slurm send it: any thread may take it. Taken
      // before this step's boundary, as a signal that arrives during the step would be.
      if (r.step == 3 && world_rank() == world_size() - 1) {
        ::kill(::getpid(), SIGUSR1);
        for (int i = 0; i < 5000 && stop_signal_received() == 0; ++i) usleep(1000);
      }
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

// The steps of a checkpoint directory, newest first.
std::vector<int64_t> saved_steps(Trainer& t) {
  std::vector<int64_t> steps;
  for (const std::string& p : t.checkpoints().list()) {
    steps.push_back(std::stoll(std::filesystem::path(p).stem().string().substr(5)));
  }
  return steps;
}

TEST(Resilience, DivergenceNeverRotatesAwayTheLastGoodCheckpoint) {
  // Every step is due; after step 3 the weights become NaN (a diverged update), so every later
  // step is skipped until the run stops. Saving then would leave only poisoned checkpoints.
  RunFiles files(8, {{"checkpoint", {{"interval_steps", 1}, {"keep_last", 2}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer t(files.config({"resilience.max_skipped_steps=3"}), grid);
  t.on_step = [&](const StepRecord& r) {
    if (r.step != 3) return;
    Buffer& w = t.model().params().values();
    std::fill_n(w.data<float>(), w.numel(), std::numeric_limits<float>::quiet_NaN());
  };
  t.init_weights("");
  try {
    t.train();
    ADD_FAILURE() << "the diverged run went on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("step_00000002.h5, written before the skipped steps"), std::string::npos)
        << e.what();
  }
  ASSERT_EQ(t.history().size(), 5u);  // step 6, the third skipped in a row, ends the run
  EXPECT_TRUE(t.history()[3].skipped && t.history()[4].skipped);
  EXPECT_EQ(saved_steps(t), (std::vector<int64_t>{2, 1})) << "steps 3 (NaN weights) to 5 (skipped) were saved";
  // What is kept resumes with finite weights.
  Trainer u(files.config({"checkpoint.dir=" + json((files.dir() / "unused").string()).dump()}), grid);
  ASSERT_TRUE(u.resume(t.checkpoints().path_for(2)));
  const Buffer& w = u.model().params().values();
  EXPECT_TRUE(std::all_of(w.data<float>(), w.data<float>() + w.numel(), [](float x) { return std::isfinite(x); }));
}

// fp16: a run that diverges keeps overflowing (its loss is NaN, its weights finite but huge).
// Each overflow skips the step; a checkpoint due then is deferred, as after any skipped step,
// so that the good checkpoints are not rotated away by diverged ones. At every ZeRO stage, and
// under pipeline parallelism where the ranks allow it.
TEST(Resilience, Fp16OverflowsDeferTheSaveAtEveryStageAndUnderPipelines) {
  std::vector<std::string> layouts = {"train.zero_optimization.stage=0", "train.zero_optimization.stage=1",
                                      "train.zero_optimization.stage=2", "train.zero_optimization.stage=3"};
  if (world_size() % 2 == 0) layouts.push_back("parallel.pipeline=2");
  for (const std::string& layout : layouts) {
    SCOPED_TRACE(layout);
    RunFiles files(12, {{"checkpoint", {{"interval_steps", 1}, {"keep_last", 2}, {"async", true}}}});
    ProcessGrid grid(MPI_COMM_WORLD, files.config({layout}).parallel);
    // A learning rate that throws the weights far off at the first update; a low first scale
    // and no hysteresis, so that the scaler reaches its minimum (an error) within the run.
    Trainer t(files.config({layout, R"(train.fp16={"enabled": true, "initial_scale_power": 6, "hysteresis": 1})",
                            "train.optimizer.params.lr=1e4", "train.gradient_clipping=0"}),
              grid);
    t.init_weights("");
    try {
      t.train();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("min_loss_scale"), std::string::npos) << e.what();
    }
    t.checkpoints().wait();  // the error left a save in flight
    const std::vector<StepRecord>& h = t.history();
    const auto first_overflow = std::find_if(h.begin(), h.end(), [](const StepRecord& r) { return r.overflow; });
    ASSERT_NE(first_overflow, h.end()) << "the run never overflowed: the test does not test the deferral";
    ASSERT_GT(first_overflow - h.begin(), 0) << "the very first step overflowed: nothing good to keep";
    const std::vector<int64_t> saved = saved_steps(t);
    ASSERT_FALSE(saved.empty());
    for (int64_t s : saved) EXPECT_FALSE(h[size_t(s - 1)].overflow) << "step " << s << " overflowed but was saved";
    // The newest checkpoint is the last step before the overflows began.
    EXPECT_EQ(saved.front(), first_overflow->step - 1);
  }
}

// A static scale cannot recover from overflowing: a streak of overflows counts against
// resilience.max_skipped_steps instead of skipping every step of the run and ending "ok".
TEST(Resilience, AStaticFp16ScaleThatAlwaysOverflowsStopsTheRun) {
  RunFiles files(10);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer t(files.config({R"(train.fp16={"enabled": true, "loss_scale": 1.2676506002282294e30})",
                          "resilience.max_skipped_steps=3"}),
            grid);
  t.init_weights("");
  try {
    t.train();
    ADD_FAILURE() << "a run whose every step overflowed went on";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("3 consecutive steps overflowed at the static fp16 loss scale"),
              std::string::npos)
        << e.what();
  }
  ASSERT_EQ(t.history().size(), 2u);  // the third overflow ends the run before it is recorded
  EXPECT_TRUE(t.history()[0].overflow && t.history()[1].overflow);
}

TEST(Resilience, ACheckpointDueAtASkippedStepIsWrittenAtTheNextGoodOne) {
  RunFiles files(6, {{"checkpoint", {{"interval_steps", 3}, {"keep_last", 5}, {"async", true}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string fault = fmt::format("resilience.fault={{\"rank\": {}, \"nan_at_step\": 3}}", world_size() - 1);
  Trainer t(files.config({fault}), grid);
  t.init_weights("");
  t.train();
  ASSERT_TRUE(t.history()[2].skipped);
  EXPECT_EQ(saved_steps(t), (std::vector<int64_t>{6, 4}));
}

}  // namespace
}  // namespace dstrain
