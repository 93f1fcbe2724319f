// What a run checks as it starts, under MPI at 1, 2 and 4 ranks: every rank starts from the
// same weights and resumes from the same file, weights are finite, a checkpoint of another
// model or a run whose checkpoints are gone is reported as such, max_steps below the resumed
// step is an error, and one directory takes one run at a time (a lock naming host and pid).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>

#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// `f` must throw dstrain::Error on this rank with every one of `parts` in its message.
void expect_error(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error on rank " << world_rank();
  } catch (const Error& e) {
    for (const std::string& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << p << "\n" << e.what();
  }
}

// Hugging Face weights of the run's model initialised from `seed`, written by rank 0.
void write_hf(const RunFiles& files, ProcessGrid& grid, int seed, const fs::path& dir,
              const std::function<void(ParamRegistry&)>& edit = {}) {
  Trainer t(files.config({fmt::format("train.seed={}", seed)}), grid);
  t.init_weights("");
  if (edit) edit(t.model().params());
  t.save_hf(dir.string());
}

TEST(RunStart, RanksThatLoadDifferentWeightsAreAnErrorOnEveryRank) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const fs::path a = files.dir() / "hf_a", b = files.dir() / "hf_b";
  write_hf(files, grid, 17, a);
  write_hf(files, grid, 18, b);
  const int n = world_size();
  Trainer same(files.config(), grid);
  same.init_weights(a.string());  // the same files everywhere: fine
  Trainer t(files.config(), grid);
  const fs::path mine = world_rank() == n - 1 && n > 1 ? b : a;
  if (n == 1) {
    t.init_weights(mine.string());
    return;
  }
  expect_error([&] { t.init_weights(mine.string()); },
               {"ranks start from different weights", "first differing tensor",
                fmt::format("rank 0 (host {}): --init-from {},", host_name(), a.string()),
                fmt::format("rank {} (host {}): --init-from {},", n - 1, host_name(), b.string())});
}

TEST(RunStart, NonFiniteInitFromWeightsAreAnErrorNamingFileAndTensor) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const fs::path dir = files.dir() / "hf_nan";
  write_hf(files, grid, 17, dir, [](ParamRegistry& reg) {
    float* w = reg.param(reg.find("model.norm.weight")).data<float>();
    w[3] = NAN;
    w[7] = INFINITY;
  });
  Trainer t(files.config(), grid);
  expect_error([&] { t.init_weights(dir.string()); },
               {"non-finite", "'model.norm.weight' in '" + (dir / "model.safetensors").string() + "'",
                "2 of 32 values are NaN or Inf"});
}

// Under tensor parallelism each rank reads only its own pieces from the files: a NaN in the
// last rank's piece of q_proj is still an error on every rank (the findings are pooled), naming
// the file, the tensor and the piece.
TEST(RunStartMultiRank, NonFiniteValuesInOneRanksPieceAreAnErrorOnEveryRank) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(2);
  const fs::path dir = files.dir() / "hf_nan_piece";
  {
    ProcessGrid grid(MPI_COMM_WORLD, {});
    write_hf(files, grid, 17, dir, [](ParamRegistry& reg) {
      const Tensor q = reg.param(reg.find("model.layers.0.self_attn.q_proj.weight"));
      q.data<float>()[q.numel() - 1] = NAN;
    });
  }
  const RunConfig cfg = files.config({"parallel.tensor=" + std::to_string(world_size())});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  expect_error([&] { t.init_weights(dir.string()); },
               {"non-finite", "'model.layers.0.self_attn.q_proj.weight' in '" + (dir / "model.safetensors").string() + "'",
                fmt::format("1 of {} values of this rank's piece are NaN or Inf", 32 * 32 / world_size())});
}

// A run of `steps` steps with a checkpoint every 2 steps in files.dir()/out/checkpoints.
void train_with_checkpoints(const RunFiles& files, ProcessGrid& grid, int steps) {
  Trainer t(files.config({fmt::format("train.max_steps={}", steps), "checkpoint.interval_steps=2"}), grid);
  t.init_weights("");
  t.train();
}

TEST(RunStart, ResumeAutoAfterEveryCheckpointWasRemovedIsAnError) {
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  train_with_checkpoints(files, grid, 4);
  const fs::path ck = files.dir() / "out" / "checkpoints";
  MPI_Barrier(MPI_COMM_WORLD);
  if (world_rank() == 0) {
    fs::remove(ck / "step_00000002.h5");
    fs::remove(ck / "step_00000004.h5");
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer t(files.config(), grid);
  expect_error([&] { t.resume("auto"); },
               {"latest says this run completed checkpoint step_00000004.h5", "holds no checkpoint",
                "remove " + (ck / "latest").string()});
}

TEST(RunStart, ResumingAnotherModelSaysWhatDiffers) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  train_with_checkpoints(files, grid, 2);
  const std::string path = (files.dir() / "out" / "checkpoints" / "step_00000002.h5").string();
  for (const std::string& spec : {std::string("auto"), path}) {
    Trainer wider(files.config({"model.hidden_size=64"}), grid);
    expect_error([&] { wider.resume(spec); },
                 {"'" + path + "' was written for a different model: hidden_size 32 in the checkpoint vs 64 in the "
                               "config"});
  }
  // Fewer layers: the file's tensors would all be found, leaving the model cut short.
  Trainer shallower(files.config({"model.num_hidden_layers=1"}), grid);
  expect_error([&] { shallower.resume("auto"); },
               {"written for a different model: num_hidden_layers 2 in the checkpoint vs 1 in the config"});
}

TEST(RunStart, RanksGivenDifferentResumeFilesAreToldSo) {
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  train_with_checkpoints(files, grid, 4);
  const fs::path ck = files.dir() / "out" / "checkpoints";
  const int n = world_size();
  const std::string a = (ck / "step_00000004.h5").string(), b = (ck / "step_00000002.h5").string();
  Trainer t(files.config(), grid);
  if (n == 1) {
    ASSERT_TRUE(t.resume(b));
    EXPECT_EQ(t.step(), 2);
    return;
  }
  expect_error([&] { t.resume(world_rank() == n - 1 ? b : a); },
               {"ranks were given different checkpoint files",
                fmt::format("rank 0 (host {}): --resume {}", host_name(), a),
                fmt::format("rank {} (host {}): --resume {}", n - 1, host_name(), b)});
}

TEST(RunStart, MaxStepsBelowTheResumedStepIsAnError) {
  RunFiles files(4);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  train_with_checkpoints(files, grid, 4);
  Trainer below(files.config({"train.max_steps=3"}), grid);
  ASSERT_TRUE(below.resume("auto"));
  expect_error([&] { below.train(); }, {"resumed at step 4 but train.max_steps (--max-steps) is 3", "above 4"});
  // At max_steps exactly there is nothing to do, which is no error.
  Trainer at(files.config({"train.max_steps=4"}), grid);
  ASSERT_TRUE(at.resume("auto"));
  EXPECT_EQ(at.train(), Trainer::Outcome::Completed);
  EXPECT_TRUE(at.history().empty());
}

// The pid of a process that has ended.
int dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  return int(child);
}

TEST(RunStart, OneRunPerDirectory) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  int pid0 = ::getpid();
  MPI_Bcast(&pid0, 1, MPI_INT, 0, MPI_COMM_WORLD);
  const fs::path lock = files.dir() / "out" / "dstrain.lock";
  {
    Trainer first(files.config(), grid);
    first.claim_output_dirs();
    Trainer second(files.config(), grid);
    expect_error([&] { second.claim_output_dirs(); },
                 {"is in use by another dstrain run", fmt::format("host {}, pid {}", host_name(), pid0),
                  lock.string()});
    // A checkpoint.dir elsewhere that another run's output.dir already holds.
    Trainer third(files.config({"output.dir=" + quoted(files.dir() / "out3"),
                                "checkpoint.dir=" + quoted(files.dir() / "out")}),
                  grid);
    expect_error([&] { third.claim_output_dirs(); }, {"is in use by another dstrain run"});
  }
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(fs::exists(lock)) << "released when the run's trainer ends";
  MPI_Barrier(MPI_COMM_WORLD);
  // A lock left by a run that was killed is taken over.
  if (world_rank() == 0) {
    std::ofstream(lock) << json{{"host", host_name()}, {"pid", dead_pid()}, {"started", "then"}}.dump();
  }
  MPI_Barrier(MPI_COMM_WORLD);
  {
    Trainer again(files.config(), grid);
    again.claim_output_dirs();
    if (world_rank() == 0) {
      std::ifstream in(lock);
      EXPECT_EQ(json::parse(in).value("pid", 0), pid0);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

TEST(RunStart, ARequeuedSlurmJobTakesOverItsEarlierRunsLockFromAnotherNode) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const fs::path lock = files.dir() / "out" / "dstrain.lock";
  ::setenv("SLURM_JOB_ID", "4242", 1);
  ::setenv("SLURM_RESTART_COUNT", "1", 1);
  auto left_by = [&](int64_t restart_count) {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) {
      fs::create_directories(lock.parent_path());
      std::ofstream(lock) << json{{"host", "another-node"}, {"pid", 1}, {"started", "then"},
                                  {"slurm_job_id", "4242"}, {"slurm_restart_count", restart_count}}
                                 .dump();
    }
    MPI_Barrier(MPI_COMM_WORLD);
  };
  left_by(1);  // another step of this same incarnation of the job: still running
  {
    Trainer t(files.config(), grid);
    expect_error([&] { t.claim_output_dirs(); }, {"is in use by another dstrain run (host another-node, pid 1"});
  }
  left_by(0);  // the job before it was requeued
  {
    Trainer t(files.config(), grid);
    t.claim_output_dirs();
  }
  ::unsetenv("SLURM_JOB_ID");
  ::unsetenv("SLURM_RESTART_COUNT");
  MPI_Barrier(MPI_COMM_WORLD);
  EXPECT_FALSE(fs::exists(lock));
}

TEST(RunStart, AnUnwritableSaveHfDirectoryIsAnErrorBeforeTraining) {
  RunFiles files(2);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const fs::path file = files.dir() / "a_file";
  if (world_rank() == 0) std::ofstream(file) << "not a directory\n";
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer t(files.config({"output.save_hf=" + quoted(file / "hf")}), grid);
  expect_error([&] { t.claim_output_dirs(); }, {"output.save_hf (--save-hf) '" + (file / "hf").string() + "'"});
  EXPECT_FALSE(fs::exists(files.dir() / "out" / "dstrain.lock")) << "a refused run holds no lock";
}

}  // namespace
}  // namespace dstrain
