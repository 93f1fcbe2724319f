// Data-parallel training gives the results of one rank: every rank also trains the same run
// alone (a grid over MPI_COMM_SELF) and compares. After every step all ranks must hold
// bitwise-identical weights, and overlapped and blocking reduction must agree bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "data/token_shard.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 10;

// A directory every rank agrees on, with a token shard and a run configuration.
class RunFiles {
 public:
  RunFiles() {
    int pid = ::getpid();
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    dir_ = std::filesystem::temp_directory_path() / ("dstrain_dp_" + std::to_string(pid));
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      std::filesystem::create_directories(dir_);
      std::mt19937 rng(5);
      std::vector<uint32_t> tokens(4000);
      for (auto& t : tokens) t = rng() % 60;
      write_token_shard((dir_ / "train.bin").string(), tokens, 1);
      json model = {{"hidden_size", 32},         {"intermediate_size", 48},        {"num_hidden_layers", 2},
                    {"num_attention_heads", 4},  {"num_key_value_heads", 2},       {"vocab_size", 64},
                    {"max_position_embeddings", 32}, {"rms_norm_eps", 1e-5},       {"rope_theta", 10000.0},
                    {"tie_word_embeddings", false},  {"initializer_range", 0.1}};
      json run = {
          {"model", model},
          {"train",
           {{"train_batch_size", 8},
            {"train_micro_batch_size_per_gpu", 2},
            {"gradient_clipping", 1.0},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}}}}},
            {"scheduler",
             {{"type", "WarmupCosineLR"},
              {"params", {{"total_num_steps", 20}, {"warmup_num_steps", 3}, {"warmup_type", "linear"}}}}},
            {"max_steps", kSteps},
            {"seed", 17},
            {"zero_optimization", {{"reduce_bucket_size", 3000}, {"overlap_comm", true}}}}},
          {"data", {{"train", (dir_ / "train.bin").string()}, {"seq_len", 16}, {"shuffle", true}}},
          {"output", {{"dir", (dir_ / "out").string()}}}};
      std::ofstream(dir_ / "run.json") << run.dump(2);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~RunFiles() {
    MPI_Barrier(MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::filesystem::remove_all(dir_);
  }
  RunConfig config(std::vector<std::string> overrides = {}) const {
    return RunConfig::load((dir_ / "run.json").string(), overrides);
  }

 private:
  std::filesystem::path dir_;
};

uint64_t checksum(const Buffer& b) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(b.data());
  for (size_t i = 0; i < b.nbytes(); ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

double rel_error(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

TEST(DataParallel, MatchesOneRankAndKeepsRanksBitwiseIdentical) {
  RunFiles files;
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
      uint64_t mine = checksum(*b);
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

TEST(DataParallel, OverlappedAndBlockingReductionAgreeBitwise) {
  RunFiles files;
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
  RunFiles files;
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
