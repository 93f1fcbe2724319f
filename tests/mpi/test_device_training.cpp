// The trainer on a device other than the host: the emulated device of the tests (host memory
// that dstrain must treat as device memory, with the CPU kernels behind a second backend; any
// host read of its tensors fails). Training the dense and the DeepSeek-V3 model there gives the
// same bits as on the CPU, at 1, 2 and 4 ranks: so the trainer, its data, reducer, optimizer,
// checks, metrics and checkpoints move every tensor between host and device explicitly, and a
// GPU backend that registers the same way trains with them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <ostream>
#include <string>

#include "../unit/fake_backend.h"
#include "backend/ops.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 3;

// A tensor's fp32 values on the host, copied from wherever it lives.
std::vector<float> host_values(Tensor t) {
  std::vector<float> v(size_t(t.numel()));
  ops::copy(Tensor(v.data(), DType::F32, Shape{t.numel()}), t.view(Shape{t.numel()}));
  return v;
}

void expect_same_bits(Trainer& host, Trainer& dev, const std::string& what) {
  ASSERT_EQ(host.history().size(), dev.history().size()) << what;
  for (size_t i = 0; i < host.history().size(); ++i) {
    const StepRecord &a = dev.history()[i], &b = host.history()[i];
    EXPECT_EQ(a.loss, b.loss) << what << ": loss of step " << i + 1;
    EXPECT_EQ(a.grad_norm, b.grad_norm) << what << ": gradient norm of step " << i + 1;
  }
  const ParamRegistry& reg = dev.model().params();
  const ParamRegistry& ref = host.model().params();
  ASSERT_EQ(reg.size(), ref.size());
  int differ = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const std::vector<float> mine = host_values(reg.param(id)), want = values(ref.param(id));
    if (mine != want) {
      ++differ;
      ADD_FAILURE() << what << ": " << reg.info(id).name << " differs (relative error " << rel_error(mine, want) << ")";
    }
  }
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.7f on the device, %.7f on the host; %d of %d weights differ\n", world_size(),
                what.c_str(), dev.history().back().loss, host.history().back().loss, differ, reg.size());
  }
}

std::string quoted(const std::filesystem::path& p) { return "\"" + p.string() + "\""; }

// A model and the settings it trains with: fp32 data parallel; bf16; and at 2 and 4 ranks the
// layouts whose collectives carry device tensors in other ways (tensor parallel with sequence
// parallelism: all-gathers and reduce-scatters of activations; expert parallel: the token
// all-to-all; ZeRO-2: reduce-scatters of gradients and all-gathers of weights).
struct Setting {
  std::string name, model;
  std::vector<std::string> overrides;
  int min_ranks = 1;
};

void PrintTo(const Setting& s, std::ostream* os) { *os << s.name; }

class DeviceTraining : public ::testing::TestWithParam<Setting> {};

TEST_P(DeviceTraining, TrainsTheBitsOfTheHost) {
  const Setting& s = GetParam();
  DSTRAIN_REQUIRE_RANKS(world_size() >= s.min_ranks, s.min_ranks);
  RunFiles files(kSteps, s.model == "v3" ? v3_model() : json::object());
  // Exports in fp32 whatever the compute precision, so that the round trip is exact.
  std::vector<std::string> overrides = s.overrides;
  overrides.push_back(R"(output.save_hf_dtype="float32")");
  const RunConfig cfg = files.config(overrides);
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer host(cfg, grid);
  host.init_weights("");
  host.train();
  Trainer dev(cfg, grid, fake::use_fake_backend());
  dev.init_weights("");
  dev.train();
  expect_same_bits(host, dev, s.name);
  // Every step's split: forward, backward and the optimizer each marked at their boundaries,
  // and together within the step.
  for (const Trainer* t : {&host, &dev}) {
    for (const StepRecord& r : t->history()) {
      const std::string where = s.name + (t == &dev ? " on the device" : " on the host") + ", step " +
                                std::to_string(r.step);
      EXPECT_GT(r.forward_seconds, 0.0) << where;
      EXPECT_GT(r.backward_seconds, 0.0) << where;
      if (!r.skipped && !r.overflow) {
        EXPECT_GT(r.optimizer_seconds, 0.0) << where;
      }
      EXPECT_LE(r.forward_seconds + r.backward_seconds + r.optimizer_seconds, r.step_seconds) << where;
    }
  }
  // The Hugging Face export of the device run holds the host run's weights, and loads back
  // onto the device.
  const std::string hf = (files.dir() / "hf").string();
  dev.save_hf(hf);
  Trainer back(cfg, grid, fake::use_fake_backend());
  back.init_weights(hf);
  const ParamRegistry& reg = back.model().params();
  for (int id = 0; id < reg.size(); ++id) {
    EXPECT_EQ(host_values(reg.param(id)), values(host.model().params().param(id)))
        << s.name << ": " << reg.info(id).name << " after --save-hf and --init-from on the device";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, DeviceTraining,
    ::testing::Values(Setting{"dense", "dense", {}}, Setting{"v3", "v3", {}},
                      Setting{"dense_bf16", "dense", {R"(train.bf16={"enabled": true})"}},
                      Setting{"v3_fp16", "v3", {R"(train.fp16={"enabled": true, "initial_scale_power": 8})"}}),
    [](const ::testing::TestParamInfo<Setting>& i) { return i.param.name; });
INSTANTIATE_TEST_SUITE_P(
    MultiRankLayouts, DeviceTraining,
    ::testing::Values(Setting{"dense_tensor2_sp", "dense", {"parallel.tensor=2", "parallel.sequence_parallel=true"}, 2},
                      Setting{"v3_expert2", "v3", {"parallel.expert=2"}, 2},
                      Setting{"dense_zero2", "dense", {R"(train.zero_optimization={"stage": 2, "reduce_bucket_size": 3000})"}, 2}),
    [](const ::testing::TestParamInfo<Setting>& i) { return i.param.name; });

// A checkpoint written by a run on the device, resumed on the device and on the host: both
// continue with the losses of the uninterrupted host run, bit for bit, and the file holds
// what the host would have written.
TEST(DeviceCheckpoint, WrittenOnTheDeviceResumesAnywhere) {
  RunFiles files(4, v3_model());
  const std::string dir = "checkpoint.dir=" + quoted(files.dir() / "ckpt");
  const RunConfig base = files.config();
  ProcessGrid grid(MPI_COMM_WORLD, base.parallel);
  Trainer full(base, grid);
  full.init_weights("");
  full.train();
  {
    const RunConfig cfg = files.config({"train.max_steps=2", "checkpoint.save_final=true", dir});
    Trainer dev(cfg, grid, fake::use_fake_backend());
    dev.init_weights("");
    dev.train();
  }
  for (bool on_device : {true, false}) {
    const RunConfig cfg = files.config({dir});
    auto t = on_device ? std::make_unique<Trainer>(cfg, grid, fake::use_fake_backend())
                       : std::make_unique<Trainer>(cfg, grid);
    ASSERT_TRUE(t->resume("auto"));
    EXPECT_EQ(t->step(), 2);
    t->train();
    ASSERT_EQ(t->history().size(), 2u);
    for (const StepRecord& r : t->history()) {
      EXPECT_EQ(r.loss, full.history()[size_t(r.step - 1)].loss)
          << (on_device ? "device" : "host") << " resume, step " << r.step;
    }
  }
}

}  // namespace
}  // namespace dstrain
