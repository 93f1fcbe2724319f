// How often a training step waits for the device: the host reads a step's results (the losses
// of every micro-batch, the gradient norm, the fp16 overflow it implies) once, at the end of
// the step, not once per micro-batch or per gradient piece. On a GPU each read is a
// synchronisation that drains the queue of work; on the tests' emulated device (host memory
// that dstrain must treat as device memory, behind a second backend) every one is counted by
// ops::transfer_counts(). A dense model's step reads the device once, whatever its micro-batches,
// layers or precision, at every step. (A DeepSeekMoE layer adds a read per micro-batch, its
// expert row counts, which size the expert GEMMs on the host as in Megatron-Core, and its
// auxiliary-loss terms at the step's end.)
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../unit/fake_backend.h"
#include "backend/ops.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 4;

// The device-to-host reads of each training step after the first (the first also reads what
// the start-up checks and the data pipeline's first batch need).
std::vector<int64_t> reads_per_step(const json& extra, std::vector<std::string> overrides) {
  RunFiles files(kSteps, extra);
  const RunConfig cfg = files.config(overrides);
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid, fake::use_fake_backend());
  t.init_weights("");
  std::vector<int64_t> reads;
  int64_t last = 0;
  t.on_step = [&](const StepRecord&) {
    const int64_t now = ops::transfer_counts().device_to_host;
    reads.push_back(now - last);
    last = now;
  };
  t.train();
  EXPECT_EQ(int(reads.size()), kSteps);
  if (!reads.empty()) reads.erase(reads.begin());
  return reads;
}

std::string str(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : " ") + std::to_string(x);
  return s;
}

json layers(int n) { return {{"model", {{"num_hidden_layers", n}}}}; }

TEST(DeviceReads, ATrainingStepReadsTheDeviceAFixedNumberOfTimes) {
  struct Setting {
    std::string name;
    json extra;
    std::vector<std::string> overrides;
  };
  // Micro-batches of 2 sequences: 1 or 4 per step; 2 or 5 layers; fp32, bf16, fp16. (Not ZeRO-2
  // or 3: they reduce gradient pieces every micro-step over the data-parallel communicator,
  // which on the emulated device, without a device communicator, stages them through host
  // copies; on a GPU they go over NCCL.)
  const std::vector<Setting> settings = {
      {"1 micro-batch", layers(2), {"train.train_batch_size=2"}},
      {"4 micro-batches", layers(2), {"train.train_batch_size=8"}},
      {"4 micro-batches, 5 layers", layers(5), {"train.train_batch_size=8"}},
      {"bf16, 4 micro-batches", layers(2), {"train.train_batch_size=8", R"(train.bf16={"enabled": true})"}},
      {"fp16, 4 micro-batches", layers(2),
       {"train.train_batch_size=8", R"(train.fp16={"enabled": true, "initial_scale_power": 8})"}},
  };
  std::vector<int64_t> first;
  for (const Setting& s : settings) {
    const std::vector<int64_t> reads = reads_per_step(s.extra, s.overrides);
    ASSERT_EQ(int(reads.size()), kSteps - 1) << s.name;
    if (world_rank() == 0) std::printf("[ %d ranks ] %s: device-to-host reads per step %s\n", world_size(),
                                       s.name.c_str(), str(reads).c_str());
    for (int64_t r : reads) EXPECT_EQ(r, reads[0]) << s.name << ": a different number at another step: " << str(reads);
    if (first.empty()) {
      first = reads;
      // The step's scalars (the losses of every micro-batch and the gradient norm) in one read.
      EXPECT_EQ(reads[0], 1) << s.name;
    } else {
      EXPECT_EQ(reads[0], first[0]) << s.name << " reads the device " << reads[0] << " times a step, "
                                    << settings[0].name << " " << first[0] << " times";
    }
  }
}

}  // namespace
}  // namespace dstrain
