// Data-parallel training gives the results of one rank: every rank also trains the same run
// alone (a grid over MPI_COMM_SELF) and compares. After every step all ranks must hold
// bitwise-identical weights, and overlapped and blocking reduction must agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "distributed/grad_reducer.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 10;

TEST(DataParallel, MatchesOneRankAndKeepsRanksBitwiseIdentical) {
  RunFiles files(kSteps);
  // The one-rank run, on every rank.
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer reference(files.config(), solo);
  reference.init_weights("");
  reference.train();

  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer dist(files.config(), grid);
  const int n = grid.world_size();
  EXPECT_EQ(dist.config().train.grad_accum, 8 / (2 * n));
  int checked = 0;
  dist.on_step = [&](const StepRecord&) {
    // Weights and optimizer state must be the same bits on every rank after every step.
    for (const Buffer* b : {&dist.model().params().values(), &dist.optimizer().exp_avg(),
                            &dist.optimizer().exp_avg_sq()}) {
      uint64_t mine = checksum(b->data(), b->nbytes());
      std::vector<uint64_t> all(static_cast<size_t>(n));
      MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
      for (int r = 0; r < n; ++r) EXPECT_EQ(all[size_t(r)], all[0]) << b->label() << " of rank " << r;
    }
    ++checked;
  };
  dist.init_weights("");
  dist.train();
  EXPECT_EQ(checked, kSteps);

  ASSERT_EQ(dist.history().size(), reference.history().size());
  for (size_t i = 0; i < dist.history().size(); ++i) {
    const double a = dist.history()[i].loss, b = reference.history()[i].loss;
    EXPECT_NEAR(a, b, 1e-5 * std::fabs(b)) << "loss of step " << i + 1 << " at " << n << " ranks";
  }
  const ParamRegistry& pd = dist.model().params();
  const ParamRegistry& pr = reference.model().params();
  double worst = 0;
  for (int id = 0; id < pd.size(); ++id) {
    const double e = rel_error(pd.param(id).data<float>(), pr.param(id).data<float>(), pd.info(id).numel());
    EXPECT_LE(e, 1e-5) << pd.info(id).name << " after " << kSteps << " steps at " << n << " ranks";
    worst = std::max(worst, e);
  }
  if (grid.world_rank() == 0) {
    std::printf("[ %d ranks ] %d steps: loss %.6f vs %.6f (one rank), worst weight error %.2e\n", n, kSteps,
                dist.history().back().loss, reference.history().back().loss, worst);
  }
}

// The gradient buckets start during the last micro-step's backward also in a model with
// multi-token prediction, whose modules' gradients are complete after the forward: they are
// reported in the backward, so the first bucket (the last parameters, MTP's among them) does
// not wait for finish() and hold every later bucket back.
TEST(DataParallelMultiRank, BucketsOfAModelWithMtpStartDuringTheBackward) {
  ProcessGrid grid(MPI_COMM_WORLD, {});
  DSTRAIN_REQUIRE_RANKS(grid.world_size() >= 2, "2 or 4 (one rank reduces nothing)");
  const ModelConfig c = ModelConfig::from_hf_json(v3_model()["model"], "v3");
  ASSERT_GT(c.num_nextn_predict_layers, 0);
  Transformer model(c, Device::cpu());
  model.init_weights(3);
  GradReducer reducer(model.params(), ParamGroupComms::from_grid(grid), /*bucket_elements=*/2000, /*overlap=*/true);
  model.set_hooks(&reducer);
  ASSERT_GT(reducer.num_buckets(), 2);
  const int64_t B = 2, T = 16;
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = int32_t((i * 7 + 3) % size_t(c.vocab_size));
    targets[i] = int32_t((i * 5 + 1) % size_t(c.vocab_size));
  }
  LossScales scales;
  scales.token = 1.0f / float(B * T);
  scales.sequence = 1.0 / double(B);
  scales.micro_batch = 1.0;
  scales.mtp_token.assign(size_t(c.num_nextn_predict_layers), 0.3f / float(B * T));
  model.params().grads().zero();
  model.forward(0, Tensor(tokens.data(), DType::I32, Shape{B, T}), Tensor(targets.data(), DType::I32, Shape{B, T}),
                scales);
  reducer.begin_micro_step(/*communicates=*/true);
  model.backward(0);
  EXPECT_EQ(reducer.launched(), reducer.num_buckets()) << "buckets left for finish(): nothing overlapped the backward";
  reducer.finish();
}

TEST(DataParallel, OverlappedAndBlockingReductionAgreeBitwise) {
  RunFiles files(kSteps);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer overlapped(files.config(), grid);
  Trainer blocking(files.config({"train.zero_optimization.overlap_comm=false"}), grid);
  for (Trainer* t : {&overlapped, &blocking}) {
    t->init_weights("");
    t->train();
  }
  const Buffer& a = overlapped.model().params().values();
  const Buffer& b = blocking.model().params().values();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
  for (size_t i = 0; i < overlapped.history().size(); ++i) {
    EXPECT_EQ(overlapped.history()[i].loss, blocking.history()[i].loss);
  }
}

TEST(DataParallel, DifferentConfigurationsOnRanksAreAnError) {
  RunFiles files(kSteps);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  if (n == 1) return;  // nothing to disagree with
  ProcessGrid grid(MPI_COMM_WORLD, {});
  std::vector<std::string> overrides;
  if (rank == n - 1) overrides.push_back("train.seed=18");
  try {
    Trainer t(files.config(overrides), grid);
    ADD_FAILURE() << "ranks with different seeds were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("differs from rank 0"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dstrain

namespace dstrain {
namespace {

// The trainer runs what its schedule says: every forward before any backward (all micro-batches
// in flight) accumulates each gradient in the same micro-batch order as gradient accumulation,
// so the two schedules train the same bits.
TEST(DataParallel, AllForwardAllBackwardScheduleTrainsTheSameBits) {
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer accumulate(files.config(), grid);
  Trainer all_forward(files.config({"train.micro_batch_schedule=\"all_forward_all_backward\""}), grid);
  for (Trainer* t : {&accumulate, &all_forward}) {
    t->init_weights("");
    t->train();
  }
  EXPECT_EQ(all_forward.config().train.micro_batch_schedule, "all_forward_all_backward");
  const Buffer& a = accumulate.model().params().values();
  const Buffer& b = all_forward.model().params().values();
  EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.nbytes()));
  ASSERT_EQ(accumulate.history().size(), all_forward.history().size());
  for (size_t i = 0; i < accumulate.history().size(); ++i) {
    EXPECT_EQ(accumulate.history()[i].loss, all_forward.history()[i].loss);
  }
  EXPECT_THROW(Trainer(files.config({"train.micro_batch_schedule=\"1f1b\""}), grid), Error);
}

}  // namespace
}  // namespace dstrain
