// The data pipeline under MPI at 1, 2 and 4 ranks: the global batch of a step is the same
// samples at any rank count (blended datasets included), prefetching changes nothing, a
// resumed run continues the blended sequence bit for bit, and files that differ between
// ranks are an error naming them.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "comm/grid.h"
#include "data/data_pipeline.h"
#include "data/token_shard.h"
#include "resume_check.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// Two llm.c datasets of different sizes, blended 3:1, with a weight change at step 2.
json blended_data(const fs::path& dir) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 0) {
    std::mt19937 rng(11);
    for (auto [name, n] : {std::pair{"a.bin", 3000}, {"b.bin", 1700}}) {
      std::vector<uint32_t> t(static_cast<size_t>(n));
      for (auto& x : t) x = rng() % 60;
      write_token_shard((dir / name).string(), t, 1);
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return {{"data",
           {{"train", json::array({{{"path", (dir / "a.bin").string()}, {"weight", 3}, {"name", "a"}},
                                   {{"path", (dir / "b.bin").string()}, {"weight", 1}, {"name", "b"}}})},
            {"blend_schedule", json::array({{{"step", 2}, {"weights", {1, 1}}}})}}}};
}

// Every rank's micro-batches of `steps` steps, gathered in global-batch order on every rank.
std::vector<int32_t> global_batches(DataPipeline& p, Communicator& dp, int steps, int64_t mb, int64_t accum,
                                    int64_t T) {
  std::vector<int32_t> out;
  for (int s = 0; s < steps; ++s) {
    StepData d = p.next();
    for (int64_t m = 0; m < accum; ++m) {
      std::vector<int32_t> all(static_cast<size_t>(dp.size() * mb * T));
      dp.all_gather(Tensor(all.data(), DType::I32, Shape{int64_t(all.size())}),
                    Tensor(d.micro[size_t(m)].inputs.data(), DType::I32, Shape{mb * T}));
      out.insert(out.end(), all.begin(), all.end());
    }
  }
  return out;
}

// train.epochs (the HF Trainer's num_train_epochs): the run's length from the data's size, the
// same at any rank count; a max_steps given too decides.
TEST(DataPipeline, EpochsSetTheStepsFromTheTrainingData) {
  RunFiles files(0);  // 4000 tokens in windows of 16 + 1: 249 samples an epoch; batches of 8
  ProcessGrid grid(MPI_COMM_WORLD, {});
  {
    Trainer t(files.config({"train.epochs=0.5"}), grid);
    EXPECT_EQ(t.config().train.max_steps, 16);  // ceil(0.5 x 249 / 8)
    EXPECT_EQ(t.config().to_json()["train"]["max_steps"], 16) << "the resolved configuration shows it";
    t.init_weights("");
    t.train();
    ASSERT_EQ(t.history().size(), 16u);
  }
  Trainer whole(files.config({"train.epochs=2"}), grid);
  EXPECT_EQ(whole.config().train.max_steps, 63);  // ceil(2 x 249 / 8)
  Trainer capped(files.config({"train.epochs=2", "train.max_steps=5"}), grid);
  EXPECT_EQ(capped.config().train.max_steps, 5);
  // Part of an epoch that is less than a batch still trains one step.
  EXPECT_EQ(Trainer(files.config({"train.epochs=0.01"}), grid).config().train.max_steps, 1);
}

TEST(DataPipeline, GlobalBatchesDoNotDependOnTheRankCount) {
  RunFiles files(6);
  RunFiles blended(6, blended_data(files.dir()));
  const RunConfig c = blended.config();
  const int64_t T = c.data.seq_len, G = 8, mb = 2;
  // One rank, everything in one place: accumulation over G / mb micro-steps.
  ProcessGrid solo(MPI_COMM_SELF, {});
  DataPipeline one(c.data, c.model.vocab_size, c.train.seed, mb, G / mb, solo.comm(Axis::Data), solo.world());
  one.start(0, json());
  const std::vector<int32_t> want = global_batches(one, solo.comm(Axis::Data), 5, mb, G / mb, T);

  ProcessGrid grid(MPI_COMM_WORLD, {});
  const int n = grid.world_size();
  for (int64_t prefetch : {0, 3}) {
    DataConfig dc = c.data;
    dc.prefetch = prefetch;
    DataPipeline p(dc, c.model.vocab_size, c.train.seed, mb, G / (mb * n), grid.comm(Axis::Data), grid.world());
    p.start(0, json());
    EXPECT_EQ(global_batches(p, grid.comm(Axis::Data), 5, mb, G / (mb * n), T), want)
        << n << " ranks, prefetch " << prefetch;
    EXPECT_EQ(p.drawn(), one.drawn());
  }
  // 3:1 for two steps (16 samples: 12 + 4), then 1:1 (24 samples: 12 + 12).
  EXPECT_EQ(one.drawn(), (std::vector<int64_t>{24, 16}));
  EXPECT_NE(one.mix_report().find("a 50.0% (target 50.0%)"), std::string::npos) << one.mix_report();
}

TEST(DataPipeline, ResumingABlendedRunIsBitwiseExact) {
  RunFiles base(6);
  RunFiles files(6, blended_data(base.dir()));
  ProcessGrid grid(MPI_COMM_WORLD, {});
  expect_resume_is_bitwise(files, grid, 3);
}

TEST(DataPipeline, FilesThatDifferBetweenRanksAreAnError) {
  // Each rank runs in its own directory holding "data.bin"; the last rank's differs.
  RunFiles files(2);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const fs::path mine = files.dir() / ("rank" + std::to_string(rank));
  fs::create_directories(mine);
  std::vector<uint32_t> tokens(500, 7);
  if (rank == n - 1 && n > 1) tokens[321] = 8;
  write_token_shard((mine / "data.bin").string(), tokens, 1);
  const fs::path cwd = fs::current_path();
  fs::current_path(mine);
  RunConfig c = files.config({"data.train=\"data.bin\""});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  std::string error;
  try {
    DataPipeline p(c.data, c.model.vocab_size, c.train.seed, 2, 1, grid.comm(Axis::Data), grid.world());
  } catch (const Error& e) {
    error = e.what();
  }
  fs::current_path(cwd);
  if (n == 1) {
    EXPECT_EQ(error, "") << "one rank has nothing to disagree with";
  } else {
    EXPECT_NE(error.find("dataset files differ between ranks"), std::string::npos) << error;
    EXPECT_NE(error.find("data.bin: rank 0 has xxh64"), std::string::npos) << error;
    EXPECT_NE(error.find("rank " + std::to_string(n - 1)), std::string::npos) << error;
  }
}

}  // namespace
}  // namespace dstrain
