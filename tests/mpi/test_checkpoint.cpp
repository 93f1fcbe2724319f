// Checkpoints under MPI at 1, 2 and 4 ranks: stopping and resuming is bitwise exact (sync and
// async saves), a file written at one rank count continues at another with the same loss
// sequence, rotation keeps what it promises, a corrupt or truncated newest checkpoint is
// reported and the previous one used, a save with no room is refused alike on every rank, and
// altered metadata is an error naming the field.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <mutex>
#include <thread>

#include "comm/watchdog.h"
#include "io/hdf5_util.h"
#include "resume_check.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

std::vector<double> losses_of(const Trainer& t) {
  std::vector<double> out;
  for (const StepRecord& r : t.history()) out.push_back(r.loss);
  return out;
}

class ResumeExactness : public ::testing::TestWithParam<bool> {};

TEST_P(ResumeExactness, StopAndResumeEqualsOneRun) {
  RunFiles files(8);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  expect_resume_is_bitwise(files, grid, 4, {std::string("checkpoint.async=") + (GetParam() ? "true" : "false")});
}

INSTANTIATE_TEST_SUITE_P(Saves, ResumeExactness, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "async" : "sync"; });

// Mixed precision: the loss scaler (its scale, window position and overflows) is in the
// checkpoint, so a resumed fp16 run continues exactly; bf16 likewise.
class ResumeExactnessMixed : public ::testing::TestWithParam<const char*> {};

TEST_P(ResumeExactnessMixed, StopAndResumeEqualsOneRun) {
  RunFiles files(8);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string p = GetParam();
  // fp16: a window of 2 moves the scale before the stop, and a NaN on the last rank at step 2
  // overflows: the scaler's whole state and the overflow count matter to the steps after.
  const std::vector<std::string> o =
      p == "fp16" ? std::vector<std::string>{"train.fp16={\"enabled\": true, \"initial_scale_power\": 10, "
                                             "\"loss_scale_window\": 2, \"hysteresis\": 2}",
                                             fmt::format("resilience.fault={{\"rank\": {}, \"nan_at_step\": 2}}",
                                                         world_size() - 1)}
                  : std::vector<std::string>{"train.bf16={\"enabled\": true}"};
  expect_resume_is_bitwise(files, grid, 4, o);
}

INSTANTIATE_TEST_SUITE_P(Precisions, ResumeExactnessMixed, ::testing::Values("fp16", "bf16"),
                         [](const auto& p) { return std::string(p.param); });

// Checkpoints hold the fp32 masters whatever the precision: an fp32 run continues in bf16, and
// that one's checkpoint in fp32 again, and in fp16.
TEST(Checkpoint, ResumesWithThePrecisionSwitched) {
  RunFiles files(9, {{"checkpoint", {{"save_final", true}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const std::string dir = "checkpoint.dir=" + json((files.dir() / "switch").string()).dump();
  {
    Trainer a(files.config({dir, "train.max_steps=3"}), grid);
    a.init_weights("");
    a.train();
  }
  const std::pair<const char*, int> legs[] = {
      {"train.bf16={\"enabled\": true}", 5}, {"train.bf16={\"enabled\": false}", 7}, {"train.fp16={\"enabled\": true}", 9}};
  std::vector<float> before;
  for (const auto& [precision, steps] : legs) {
    Trainer t(files.config({dir, precision, "train.max_steps=" + std::to_string(steps)}), grid);
    ASSERT_TRUE(t.resume("auto"));
    EXPECT_EQ(t.step(), steps - 2);
    const Buffer& v = t.model().params().values();
    if (!before.empty()) {
      // The masters come back exactly as they were saved, whatever this run computes in.
      EXPECT_EQ(std::memcmp(v.data(), before.data(), v.nbytes()), 0) << precision;
    }
    t.train();
    for (const StepRecord& r : t.history()) EXPECT_TRUE(std::isfinite(r.loss)) << precision << " step " << r.step;
    before.assign(v.data<float>(), v.data<float>() + v.numel());
  }
}

TEST(Checkpoint, RestartsOnAnotherRankCount) {
  RunFiles files(8);
  const int n = world_size();
  // The uninterrupted run, at one rank (every rank computes it).
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer reference(files.config({"checkpoint.dir=" + quoted(files.dir() / "ref" / std::to_string(world_rank()))}),
                    solo);
  reference.init_weights("");
  reference.train();
  const std::vector<double> want = losses_of(reference);

  std::vector<int> counts = {1};
  if (n >= 2) counts.push_back(2);
  if (n >= 4) counts.push_back(4);
  int pairs = 0;
  for (int writers : counts) {
    const fs::path dir = files.dir() / ("written_by_" + std::to_string(writers));
    MPI_Comm wcomm = first_ranks(writers);
    if (wcomm != MPI_COMM_NULL) {
      ProcessGrid g(wcomm, {});
      Trainer a(files.config({"train.max_steps=4", "checkpoint.save_final=true", "checkpoint.dir=" + quoted(dir)}), g);
      a.init_weights("");
      a.train();
      MPI_Comm_free(&wcomm);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    for (int readers : counts) {
      if (readers == writers) continue;
      ++pairs;
      MPI_Comm rcomm = first_ranks(readers);
      if (rcomm != MPI_COMM_NULL) {
        ProcessGrid g(rcomm, {});
        Trainer b(files.config({"checkpoint.dir=" + quoted(files.dir() / "unused")}), g);
        ASSERT_TRUE(b.resume((dir / "step_00000004.h5").string()));
        b.train();
        const std::vector<double> got = losses_of(b);
        ASSERT_EQ(got.size(), 4u);
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_NEAR(got[i], want[i + 4], 1e-5 * want[i + 4])
              << "step " << i + 5 << ": written at " << writers << " rank(s), resumed at " << readers;
        }
        MPI_Comm_free(&rcomm);
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
  }
  EXPECT_EQ(pairs, int(counts.size() * (counts.size() - 1)));
}

TEST(Checkpoint, RotationKeepsTheNewestAndTheMilestones) {
  RunFiles files(9, {{"checkpoint", {{"interval_steps", 1}, {"keep_last", 2}, {"keep_every", 4}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer t(files.config(), grid);
  t.init_weights("");
  t.train();
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(t.config().checkpoint.dir)) names.push_back(e.path().filename());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"latest", "step_00000004.h5", "step_00000008.h5", "step_00000009.h5"}));
  std::ifstream latest(fs::path(t.config().checkpoint.dir) / "latest");
  std::string line;
  std::getline(latest, line);
  EXPECT_EQ(line, "step_00000009.h5");
}

TEST(Checkpoint, TimeIntervalIsDecidedForEveryRankAlike) {
  // The ranks' clocks disagree: only rank 0's decision, shared, makes them save together (a
  // rank deciding alone would enter the collective write while another trains on).
  RunFiles files(3, {{"checkpoint", {{"interval_minutes", 30.0}, {"keep_last", 5}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  for (const bool rank0_ahead : {true, false}) {
    SCOPED_TRACE(rank0_ahead ? "rank 0's clock runs ahead" : "rank 0's clock stands still");
    Trainer t(files.config({"checkpoint.dir=" + quoted(files.dir() / (rank0_ahead ? "ahead" : "still"))}), grid);
    // An hour passes at every reading of a clock that runs; a standing clock never reaches
    // the interval.
    const bool runs = (world_rank() == 0) == rank0_ahead;
    const Clock::time_point start = Clock::now();
    int64_t readings = 0;
    t.clock = [&] { return runs ? start + std::chrono::hours(++readings) : start; };
    // Asked directly, every rank answers as rank 0's clock says.
    const int due = t.checkpoint_due(1) ? 1 : 0;
    std::vector<int> all(static_cast<size_t>(world_size()));
    MPI_Allgather(&due, 1, MPI_INT, all.data(), 1, MPI_INT, MPI_COMM_WORLD);
    const auto agree = std::count(all.begin(), all.end(), rank0_ahead ? 1 : 0);
    ASSERT_EQ(agree, world_size()) << "ranks decided by their own clocks";
    t.init_weights("");
    t.train();
    EXPECT_EQ(t.checkpoints().list().size(), rank0_ahead ? 3u : 0u);
  }
}

TEST(Checkpoint, NoRoomRefusesTheSaveOnEveryRankAndKeepsTheOlderOnes) {
  for (const bool async : {false, true}) {
    SCOPED_TRACE(async ? "async" : "sync");
    RunFiles files(6, {{"checkpoint", {{"interval_steps", 2}, {"keep_last", 1}, {"async", async}}}});
    ProcessGrid grid(MPI_COMM_WORLD, {});
    Trainer t(files.config(), grid);
    // Only rank 0's view counts: it sees room for one checkpoint, the others see plenty.
    int64_t probes = 0;
    t.checkpoints().free_bytes = [&](const std::string&) -> int64_t {
      return world_rank() == 0 && ++probes > 1 ? 1000 : int64_t(1) << 40;
    };
    t.init_weights("");
    try {
      t.train();
      ADD_FAILURE() << "a save with no room went ahead";
    } catch (const Error& e) {
      const std::string want = fmt::format("no space left on {}: checkpoint step 4 not written; step 2 is the newest "
                                           "valid one",
                                           t.config().checkpoint.dir);
      EXPECT_EQ(std::string(e.what()).rfind(want, 0), 0u) << e.what();
    }
    const auto kept = t.checkpoints().list();
    ASSERT_EQ(kept.size(), 1u);
    EXPECT_EQ(fs::path(kept[0]).filename(), "step_00000002.h5");
  }
}

TEST(Checkpoint, AStalledWriteIsEndedByTheWatchdogNamingTheFullDisk) {
  RunFiles files(2, {{"checkpoint", {{"interval_steps", 2}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer t(files.config(), grid);
  // Room for the checkpoint up front, but under a megabyte: a disk that filled meanwhile.
  t.checkpoints().free_bytes = [](const std::string&) -> int64_t { return 800'000; };
  std::mutex m;
  std::string reported;
  Watchdog& w = Watchdog::instance();
  w.stop();
  w.set_on_timeout([&](const std::string& msg) {
    std::lock_guard lock(m);
    reported = msg;
  });
  w.start(2.0);
  // The write stalls: another thread holds the HDF5 library for longer than the deadline.
  std::thread holder;
  t.on_step = [&](const StepRecord& r) {
    if (r.step != 2) return;
    std::promise<void> held;
    holder = std::thread([&] {
      std::lock_guard lock(h5::hdf5_lock());
      held.set_value();
      std::this_thread::sleep_for(std::chrono::seconds(4));
    });
    held.get_future().wait();
  };
  t.init_weights("");
  t.train();
  holder.join();
  w.stop();
  w.set_on_timeout(nullptr);
  w.start(120);
  std::lock_guard lock(m);
  const std::string want = fmt::format("no space left on {}: checkpoint step 2 not written; no checkpoint has been "
                                       "written yet",
                                       t.config().checkpoint.dir);
  EXPECT_EQ(reported.rfind(want, 0), 0u) << reported;
  EXPECT_NE(reported.find("writing checkpoint step 2"), std::string::npos) << reported;
}

// Rewrites one attribute of a closed file (rank 0 only), as a bit flip or a hand edit would.
void set_attr(const std::string& path, const std::string& object, const std::string& name, const json& value) {
  std::lock_guard lock(h5::hdf5_lock());
  h5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "H5Fopen");
  h5::Handle o(H5Oopen(f, object.c_str(), H5P_DEFAULT), "H5Oopen");
  DS_H5_CHECK(H5Adelete(o, name.c_str()));
  if (value.is_string()) {
    h5::write_attr(o, name, value.get<std::string>());
  } else {
    h5::write_attr(o, name, value.get<int64_t>());
  }
}

TEST(Checkpoint, AlteredMetadataIsAnErrorNamingTheFieldAndAnUnsealedFileStillLoads) {
  RunFiles files(4, {{"checkpoint", {{"interval_steps", 4}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  {
    Trainer t(files.config(), grid);
    t.init_weights("");
    t.train();
  }
  const fs::path dir = files.dir() / "out" / "checkpoints";
  const std::string good = (dir / "step_00000004.h5").string();
  const std::string flipped = (files.dir() / "flipped.h5").string(), edited = (files.dir() / "edited.h5").string(),
                    unsealed = (files.dir() / "unsealed.h5").string();
  if (world_rank() == 0) {
    for (const auto& p : {flipped, edited, unsealed}) fs::copy_file(good, p);
    set_attr(flipped, "/optimizer", "step", 5);  // 4 with its lowest bit flipped
    json data;
    {
      std::lock_guard lock(h5::hdf5_lock());
      h5::Handle f = h5::open_file(edited, MPI_COMM_NULL);
      data = json::parse(h5::read_attr_string(h5::open_group(f, "data"), "json"));
    }
    data["datasets"][0]["samples_drawn"] = 8;
    set_attr(edited, "/data", "json", data.dump());
    // As the previous dstrain wrote it: no metadata checksums.
    std::lock_guard lock(h5::hdf5_lock());
    h5::Handle f(H5Fopen(unsealed.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "H5Fopen");
    DS_H5_CHECK(H5Adelete(f, "metadata_crc32"));
    DS_H5_CHECK(H5Ldelete(f, "metadata_checksums", H5P_DEFAULT));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  Trainer t(files.config({"checkpoint.dir=" + quoted(files.dir() / "unused")}), grid);
  for (const auto& [path, field] : {std::pair{flipped, "/optimizer@step"}, std::pair{edited, "/data@json"}}) {
    try {
      t.resume(path);
      ADD_FAILURE() << path << " was resumed from";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(std::string(field) + " fails its checksum"), std::string::npos)
          << e.what();
    }
    if (world_rank() == 0) {
      const CheckpointInfo info = inspect_checkpoint(path, /*verify=*/false);
      ASSERT_FALSE(info.metadata_problems.empty());
      EXPECT_EQ(info.metadata_problems[0].rfind(field, 0), 0u) << info.metadata_problems[0];
    }
  }
  ASSERT_TRUE(t.resume(unsealed));
  EXPECT_EQ(t.step(), 4);
  if (world_rank() == 0) {
    const CheckpointInfo info = inspect_checkpoint(unsealed, /*verify=*/false);
    EXPECT_FALSE(info.metadata_sealed);
    EXPECT_TRUE(info.metadata_problems.empty());
    EXPECT_TRUE(inspect_checkpoint(good, false).metadata_sealed);
  }
}

// A bit flip that leaves a metadata field's JSON unparseable: verified and reported as the
// damaged field of that file (not a parser's bare message), and --resume auto falls back to the
// previous checkpoint as for any other damage; without the checksums (an unsealed file) the
// parse error still names the file and the field.
TEST(Checkpoint, DamagedJsonMetadataNamesTheFieldAndFallsBack) {
  RunFiles files(4, {{"checkpoint", {{"interval_steps", 2}, {"keep_last", 3}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  {
    Trainer t(files.config(), grid);
    t.init_weights("");
    t.train();
  }
  const fs::path dir = files.dir() / "out" / "checkpoints";
  const std::string newest = (dir / "step_00000004.h5").string();
  const std::string unsealed = (files.dir() / "unsealed.h5").string();
  // '{' (0x7b) with bit 1 flipped is 'y': no longer JSON.
  auto flipped_json = [](const std::string& path, const std::string& group) {
    std::string text;
    {
      std::lock_guard lock(h5::hdf5_lock());
      h5::Handle f = h5::open_file(path, MPI_COMM_NULL);
      text = h5::read_attr_string(h5::open_group(f, group), "json");
    }
    text[0] = char(text[0] ^ 0x02);
    set_attr(path, "/" + group, "json", text);
  };
  if (world_rank() == 0) {
    fs::copy_file((dir / "step_00000002.h5"), unsealed);
    flipped_json(newest, "scheduler");
    flipped_json(unsealed, "rng");
    std::lock_guard lock(h5::hdf5_lock());
    h5::Handle f(H5Fopen(unsealed.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), "H5Fopen");
    DS_H5_CHECK(H5Adelete(f, "metadata_crc32"));
    DS_H5_CHECK(H5Ldelete(f, "metadata_checksums", H5P_DEFAULT));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  {
    Trainer t(files.config(), grid);
    ASSERT_TRUE(t.resume("auto"));
    EXPECT_EQ(t.step(), 2) << "the damaged step-4 checkpoint must be skipped";
  }
  Trainer t(files.config({"checkpoint.dir=" + quoted(files.dir() / "unused")}), grid);
  const std::pair<std::string, std::string> cases[] = {{newest, "/scheduler@json fails its checksum"},
                                                       {unsealed, "field /rng@json: not valid JSON"}};
  for (const auto& [path, says] : cases) {
    try {
      t.resume(path);
      ADD_FAILURE() << path << " was resumed from";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
    if (world_rank() == 0) {
      // What dstrain-ckpt info shows: the problem, and the rest of the file.
      const CheckpointInfo info = inspect_checkpoint(path, /*verify=*/true);
      ASSERT_FALSE(info.metadata_problems.empty());
      EXPECT_NE(info.metadata_problems[0].find(says.substr(0, says.find(' '))), std::string::npos)
          << info.metadata_problems[0];
      EXPECT_FALSE(info.tensors.empty());
    }
  }
}

// Flips a byte in the middle of a tensor's data, found through HDF5 (rank 0 only).
void corrupt_tensor(const std::string& path, const std::string& dataset) {
  haddr_t offset = 0;
  {
    std::lock_guard lock(h5::hdf5_lock());
    h5::Handle f = h5::open_file(path, MPI_COMM_NULL);
    h5::Handle d(H5Dopen2(f, dataset.c_str(), H5P_DEFAULT), "H5Dopen2");
    offset = H5Dget_offset(d) + 100;
  }
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(std::streamoff(offset));
  char c = 0;
  io.read(&c, 1);
  c = char(c ^ 0x5a);
  io.seekp(std::streamoff(offset));
  io.write(&c, 1);
}

TEST(Checkpoint, CorruptOrTruncatedNewestFallsBackToThePreviousOne) {
  RunFiles files(6, {{"checkpoint", {{"interval_steps", 2}, {"keep_last", 3}, {"async", false}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  {
    Trainer t(files.config(), grid);
    t.init_weights("");
    t.train();
  }
  const fs::path dir = files.dir() / "out" / "checkpoints";
  if (world_rank() == 0) corrupt_tensor((dir / "step_00000006.h5").string(), "/model/model.layers.1.mlp.up_proj.weight");
  MPI_Barrier(MPI_COMM_WORLD);
  {
    Trainer t(files.config(), grid);
    ASSERT_TRUE(t.resume("auto"));
    EXPECT_EQ(t.step(), 4) << "the corrupt step-6 checkpoint must be skipped";
    // Named explicitly, the corrupt file is an error on every rank.
    try {
      t.resume((dir / "step_00000006.h5").string());
      ADD_FAILURE() << "a corrupt checkpoint was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("crc32"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("up_proj"), std::string::npos) << e.what();
    }
  }
  if (world_rank() == 0) fs::resize_file(dir / "step_00000004.h5", fs::file_size(dir / "step_00000004.h5") / 2);
  MPI_Barrier(MPI_COMM_WORLD);
  {
    Trainer t(files.config(), grid);
    ASSERT_TRUE(t.resume("auto"));
    EXPECT_EQ(t.step(), 2) << "the truncated step-4 checkpoint must be skipped too";
  }
}

}  // namespace
}  // namespace dstrain
