// The trainer on a device other than the host: the emulated device of the tests (host memory
// that dstrain must treat as device memory, with the CPU kernels behind a second backend; any
// host read of its tensors fails). Training the dense and the DeepSeek-V3 model there gives the
// same bits as on the CPU, at 1, 2 and 4 ranks, in fp32, bf16 and fp16 (its overflows, skipped
// steps and loss scales too), under ZeRO-2 and ZeRO-3 and with ZeRO offload: so the trainer, its
// data, reducer, optimizer, checks, metrics and checkpoints move every tensor between host and
// device explicitly, and a GPU backend that registers the same way trains with them.
#include <gtest/gtest.h>

#include <algorithm>
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

// The same number, or both NaN (the gradient norm of a step whose fp16 gradients overflowed).
bool same_value(double a, double b) { return a == b || (std::isnan(a) && std::isnan(b)); }

void expect_same_bits(Trainer& host, Trainer& dev, const std::string& what) {
  ASSERT_EQ(host.history().size(), dev.history().size()) << what;
  for (size_t i = 0; i < host.history().size(); ++i) {
    const StepRecord &a = dev.history()[i], &b = host.history()[i];
    EXPECT_EQ(a.loss, b.loss) << what << ": loss of step " << i + 1;
    EXPECT_TRUE(same_value(a.grad_norm, b.grad_norm))
        << what << ": gradient norm of step " << i + 1 << ": " << a.grad_norm << " on the device, " << b.grad_norm
        << " on the host";
    // fp16: the same steps overflow and are skipped, at the same loss scales, and the schedule
    // (held back by each overflow) gives the same rates.
    EXPECT_EQ(a.overflow, b.overflow) << what << ": overflow of step " << i + 1;
    EXPECT_EQ(a.skipped, b.skipped) << what << ": skip of step " << i + 1;
    EXPECT_EQ(a.loss_scale, b.loss_scale) << what << ": loss scale of step " << i + 1;
    EXPECT_EQ(a.lr, b.lr) << what << ": learning rate of step " << i + 1;
  }
  // ZeRO-3 keeps only the persistent parameters whole between steps: every one is gathered
  // (on every rank) before the weights are compared.
  host.optimizer().gather_all();
  dev.optimizer().gather_all();
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

// A model and the settings it trains with: fp32 data parallel; bf16; fp16 with dynamic loss
// scaling, from a scale so high that the first steps overflow (skipped, the scale halved each
// time: hysteresis 1) until one fits; ZeRO-3 (parameters sharded at rest, gathered around each
// use and released after; small buckets and persistence threshold so that these tiny models
// gather, prefetch and reduce parameter by parameter); ZeRO offload (the optimizer's masters and
// moments, and with offload_param the parameters at rest, in host memory, pinned or pageable:
// every gradient goes to the host and every updated weight comes back, real copies on a GPU);
// and at 2 and 4 ranks the layouts whose collectives carry device tensors in other ways (tensor
// parallel with sequence parallelism: all-gathers and reduce-scatters of activations; expert
// parallel: the token all-to-all; ZeRO-2: reduce-scatters of gradients and all-gathers of weights).
struct Setting {
  std::string name, model;
  std::vector<std::string> overrides;
  int min_ranks = 1;
  int steps = kSteps;
  bool overflows = false;  // some steps (not all) overflow in fp16
};

// ZeRO-3 with buckets, prefetch and persistence threshold small enough that the tiny models
// gather, release, prefetch and reduce parameter by parameter (only the norms stay whole).
constexpr const char* kZero3 = R"("stage": 3, "reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 2000, )"
                               R"("stage3_param_persistence_threshold": 64)";
std::string zero(const std::string& fields) { return "train.zero_optimization={" + fields + "}"; }
const std::string kOffloadOptimizer = R"("offload_optimizer": {"device": "cpu", "pin_memory": false})";
const std::string kOffloadBoth =
    R"("offload_optimizer": {"device": "cpu", "pin_memory": true}, "offload_param": {"device": "cpu", "pin_memory": true})";
// fp16 from 2^22: the scaled gradients overflow fp16 (65504) in the first steps (how many depends
// on the model and the rank count); each one is skipped and halves the scale (hysteresis 1)
// until a scale fits and the steps train; clean steps double it again (loss_scale_window 2).
const std::string kFp16Overflow =
    R"(train.fp16={"enabled": true, "initial_scale_power": 22, "hysteresis": 1, "loss_scale_window": 2})";

void PrintTo(const Setting& s, std::ostream* os) { *os << s.name; }

class DeviceTraining : public ::testing::TestWithParam<Setting> {};

TEST_P(DeviceTraining, TrainsTheBitsOfTheHost) {
  const Setting& s = GetParam();
  DSTRAIN_REQUIRE_RANKS(world_size() >= s.min_ranks, s.min_ranks);
  RunFiles files(s.steps, s.model == "v3" ? v3_model() : json::object());
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
  if (s.overflows) {
    // The setting does what it is for: some steps overflow and are skipped, each lowering the
    // next step's scale, and some train.
    int overflowed = 0;
    const std::vector<StepRecord>& h = host.history();
    double lowest = h.front().loss_scale;
    int raised = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      lowest = std::min(lowest, h[i].loss_scale);
      raised += i > 0 && h[i].loss_scale > h[i - 1].loss_scale;
      if (!h[i].overflow) continue;
      ++overflowed;
      if (i + 1 < h.size()) {
        EXPECT_EQ(h[i + 1].loss_scale, h[i].loss_scale / 2) << s.name << ": the scale after step " << i + 1;
      }
    }
    EXPECT_GT(overflowed, 0) << s.name << ": no step overflowed (loss scales from " << h.front().loss_scale << ")";
    EXPECT_LT(overflowed, int(h.size())) << s.name << ": every step overflowed";
    // loss_scale_window 2: enough clean steps after an overflow double the scale again.
    EXPECT_GT(raised, 0) << s.name << ": the scale was never raised after the overflows";
    EXPECT_EQ(dev.loss_scaler().overflows(), overflowed) << s.name;
    EXPECT_EQ(dev.loss_scaler().scale(), host.loss_scaler().scale()) << s.name;
    if (world_rank() == 0) {
      std::printf("[ %d ranks ] %s: %d of %zu steps overflowed, loss scale %g, lowered to %g, raised %d time(s), "
                "%g at the end\n",
                world_size(), s.name.c_str(), overflowed, h.size(), h.front().loss_scale, lowest, raised,
                host.loss_scaler().scale());
    }
  }
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
                      Setting{"v3_fp16", "v3", {R"(train.fp16={"enabled": true, "initial_scale_power": 8})"}},
                      Setting{"dense_fp16_overflow", "dense", {kFp16Overflow}, 1, 10, true},
                      Setting{"dense_zero3", "dense", {zero(kZero3)}}, Setting{"v3_zero3", "v3", {zero(kZero3)}},
                      Setting{"dense_zero2_offload_optimizer", "dense",
                              {zero(R"("stage": 2, "reduce_bucket_size": 3000, )" + kOffloadOptimizer)}},
                      Setting{"dense_zero3_offload", "dense", {zero(std::string(kZero3) + ", " + kOffloadBoth)}},
                      Setting{"v3_zero3_offload_fp16_overflow", "v3",
                              {zero(std::string(kZero3) + ", " + kOffloadBoth), kFp16Overflow}, 1, 10, true}),
    [](const ::testing::TestParamInfo<Setting>& i) { return i.param.name; });
INSTANTIATE_TEST_SUITE_P(
    MultiRankLayouts, DeviceTraining,
    ::testing::Values(Setting{"dense_tensor2_sp", "dense", {"parallel.tensor=2", "parallel.sequence_parallel=true"}, 2},
                      Setting{"v3_expert2", "v3", {"parallel.expert=2"}, 2},
                      Setting{"dense_zero2", "dense", {R"(train.zero_optimization={"stage": 2, "reduce_bucket_size": 3000})"}, 2}),
    [](const ::testing::TestParamInfo<Setting>& i) { return i.param.name; });

// A checkpoint written by a run on the device, resumed on the device and on the host: both
// continue with the losses of the uninterrupted host run, bit for bit, and the file holds
// what the host would have written. As the runs are, and with ZeRO-3 offloaded to host memory
// in fp16 (the optimizer's shards written from and read back into pinned host memory, the
// parameters at rest there, and the loss scaler's state).
class DeviceCheckpoint : public ::testing::TestWithParam<Setting> {};

TEST_P(DeviceCheckpoint, WrittenOnTheDeviceResumesAnywhere) {
  const Setting& s = GetParam();
  RunFiles files(4, v3_model());
  const std::string dir = "checkpoint.dir=" + quoted(files.dir() / "ckpt");
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), s.overrides.begin(), s.overrides.end());
    return files.config(more);
  };
  const RunConfig base = with({});
  ProcessGrid grid(MPI_COMM_WORLD, base.parallel);
  Trainer full(base, grid);
  full.init_weights("");
  full.train();
  {
    const RunConfig cfg = with({"train.max_steps=2", "checkpoint.save_final=true", dir});
    Trainer dev(cfg, grid, fake::use_fake_backend());
    dev.init_weights("");
    dev.train();
  }
  for (bool on_device : {true, false}) {
    const RunConfig cfg = with({dir});
    auto t = on_device ? std::make_unique<Trainer>(cfg, grid, fake::use_fake_backend())
                       : std::make_unique<Trainer>(cfg, grid);
    ASSERT_TRUE(t->resume("auto"));
    EXPECT_EQ(t->step(), 2);
    t->train();
    ASSERT_EQ(t->history().size(), 2u);
    for (const StepRecord& r : t->history()) {
      const StepRecord& want = full.history()[size_t(r.step - 1)];
      const std::string where = s.name + ", " + (on_device ? "device" : "host") + " resume, step " + std::to_string(r.step);
      EXPECT_EQ(r.loss, want.loss) << where;
      EXPECT_EQ(r.loss_scale, want.loss_scale) << where;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Layouts, DeviceCheckpoint,
                         ::testing::Values(Setting{"v3", "v3", {}},
                                           Setting{"v3_zero3_offload_fp16", "v3",
                                                   {zero(std::string(kZero3) + ", " + kOffloadBoth),
                                                    R"(train.fp16={"enabled": true, "initial_scale_power": 12})"}}),
                         [](const ::testing::TestParamInfo<Setting>& i) { return i.param.name; });

}  // namespace
}  // namespace dstrain
