// What the PyTorch reference comparisons share: the case list ctest passes in, reading the
// reference's tensors, the tolerances, and the error measure
// max |dstrain - reference| / max |reference| over a tensor.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "core/json_reader.h"
#include "io/safetensors.h"
#include "model/model_config.h"
#include "model/transformer.h"
#include "train/trainer.h"

namespace dstrain::reference {

// Weights after a few AdamW steps: the first updates are about lr * g / |g| per element, so an
// element whose gradient is near float noise moves by an amount that noise decides; the worst
// tensor (a router gate, whose gradient passes the top-k choice) reached 1.1e-4 on an AMD EPYC
// (AVX2 OpenBLAS kernels) while the same build on other CPUs stays under 1e-4.
constexpr double kLogitsTol = 1e-5, kLossTol = 1e-5, kGradTol = 1e-4, kWeightTol = 3e-4;
// bf16 training against PyTorch's bf16 autocast of the same case (CaseFixture::expect_training_on),
// measured on an AVX-512 BF16 EPYC over the 6 dense and 6 DeepSeek cases: losses within 7.8e-4
// (MoE: 1.2e-2) of autocast's, gradient norms within 3.7e-3 (MoE: 4.9e-2), each tensor's update
// cosine 0.993 and relative difference 0.12 at worst (MoE: 0.873 and 0.52, a layer norm's; the
// routed experts together 0.942 and 0.34). The bounds leave about twice the measured room; a
// run that misses an update, or takes it twice, is outside them by far.
constexpr double kBf16LossTol = 3e-3, kBf16MoeLossTol = 3e-2, kBf16NormTol = 1.5e-2, kBf16MoeNormTol = 0.1;
constexpr double kBf16UpdateCos = 0.98, kBf16UpdateRel = 0.25, kBf16MoeUpdateCos = 0.75, kBf16MoeUpdateRel = 0.8;
constexpr double kBf16ExpertsCos = 0.85, kBf16ExpertsRel = 0.6;
// fp16 training (loss scale 2^12, fp32 masters) against the fp32 reference itself (fp16 keeps 10
// mantissa bits to bf16's 7), measured on the host and on the emulated device over the same
// cases: losses within 9.0e-5 (MoE: 9.5e-3) of the reference's, gradient norms within 7.4e-4
// (MoE: 2.2e-2), each tensor's update cosine 0.9991 and relative difference 0.042 at worst
// (MoE: 0.964 and 0.27, a router gate's; the routed experts together 0.979 and 0.21). The
// bounds leave two to three times the measured room, and are tighter than bf16's throughout.
constexpr double kFp16LossTol = 3e-4, kFp16MoeLossTol = 2e-2, kFp16NormTol = 2e-3, kFp16MoeNormTol = 5e-2;
constexpr double kFp16UpdateCos = 0.995, kFp16UpdateRel = 0.1, kFp16MoeUpdateCos = 0.92, kFp16MoeUpdateRel = 0.5;
constexpr double kFp16ExpertsCos = 0.95, kFp16ExpertsRel = 0.4;

// "a,b,c" -> {"a", "b", "c"}
inline std::vector<std::string> split_names(const std::string& joined) {
  std::vector<std::string> names;
  std::stringstream ss(joined);
  for (std::string n; std::getline(ss, n, ',');) names.push_back(n);
  return names;
}

inline std::vector<float> read(const SafeTensorsFile& f, const std::string& name) {
  std::vector<float> v(static_cast<size_t>(f.info(name).shape.numel()));
  f.read_f32(name, Tensor(v.data(), DType::F32, Shape{int64_t(v.size())}));
  return v;
}

inline std::vector<int32_t> read_i32(const SafeTensorsFile& f, const std::string& name) {
  auto bytes = f.raw(name);
  std::vector<int32_t> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

inline double rel_error(const float* got, const std::vector<float>& want) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff = std::max(diff, double(std::fabs(got[i] - want[i])));
    scale = std::max(scale, double(std::fabs(want[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// A generated case, named by the test parameter: its directory under
// DSTRAIN_REFERENCE_CASE_DIR with config.json, case.json and the reference's
// expected.safetensors.
class CaseFixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    // DSTRAIN_REFERENCE_CASES_AT moves the cases (validation/device/check.sh carries them to a GPU
    // machine, where the build directory does not exist).
    const char* moved = std::getenv("DSTRAIN_REFERENCE_CASES_AT");
    dir_ = std::filesystem::path(moved && *moved ? moved : DSTRAIN_REFERENCE_CASE_DIR) / GetParam();
    ASSERT_TRUE(std::filesystem::exists(dir_ / "expected.safetensors"))
        << "missing reference case " << dir_ << " (made by the reference.make_case tests; needs /usr/bin/python3 "
        << "with torch: .ci/install-deps --tests)";
    expected_ = std::make_unique<SafeTensorsFile>((dir_ / "expected.safetensors").string());
    config_ = load_hf_config((dir_ / "config.json").string());
    case_ = read_json_file((dir_ / "case.json").string());
  }

  // The model's logits on `tokens` (B,T) against the reference's; returns the error.
  double expect_logits(Transformer& model, Tensor tokens) const {
    const int64_t B = tokens.size(0), T = tokens.size(1), V = config_.vocab_size;
    std::vector<float> logits(static_cast<size_t>(B * T * V));
    model.forward_logits(tokens, Tensor(logits.data(), DType::F32, Shape{B, T, V}));
    const double err = rel_error(logits.data(), read(*expected_, "logits"));
    EXPECT_LE(err, kLogitsTol) << "logits";
    return err;
  }

  // ZeRO at `stage` with buckets, prefetch and persistence threshold small enough that these
  // tiny models gather, release, prefetch and reduce parameter by parameter.
  static void set_zero_stage(json& run, int stage) {
    json& z = run["train"]["zero_optimization"];
    z["stage"] = stage;
    z["reduce_bucket_size"] = 2000;
    z["stage3_prefetch_bucket_size"] = 2000;
    z["stage3_param_persistence_threshold"] = 64;
  }

  // The case's hyper-parameters as a dstrain run configuration writing under `work`.
  json run_config(const std::filesystem::path& work) const {
    json run;
    run["model"] = (dir_ / "config.json").string();
    run["train"] = {{"train_micro_batch_size_per_gpu", case_["micro_batch"]},
                    {"gradient_accumulation_steps", case_["grad_accum"]},
                    {"gradient_clipping", case_["gradient_clipping"]},
                    {"optimizer",
                     {{"type", "AdamW"},
                      {"params",
                       {{"lr", case_["lr"]},
                        {"betas", case_["betas"]},
                        {"eps", case_["eps"]},
                        {"weight_decay", case_["weight_decay"]}}}}},
                    {"scheduler", case_["scheduler"]},
                    {"no_weight_decay", case_["no_decay"]},
                    {"max_steps", case_["steps"]},
                    {"steps_per_print", 1}};
    run["data"] = {{"train", (dir_ / "data.bin").string()}, {"seq_len", case_["seq_len"]}, {"shuffle", false}};
    run["output"] = {{"dir", (work / "out").string()}};
    return run;
  }

  // Every step's loss, learning rate and gradient norm against the reference's (relative
  // tolerances; the defaults are fp32's).
  void expect_history(const std::vector<StepRecord>& h, double loss_tol = kLossTol, double norm_tol = kGradTol,
                      size_t norm_steps = size_t(-1)) const {
    const std::vector<float> losses = read(*expected_, "step_losses"), lrs = read(*expected_, "lrs"),
                             norms = read(*expected_, "grad_norms");
    ASSERT_EQ(h.size(), losses.size());
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_NEAR(h[i].loss, losses[i], loss_tol * std::fabs(losses[i])) << "loss of step " << i + 1;
      EXPECT_NEAR(h[i].lr, lrs[i], 1e-6 * lrs[i]) << "learning rate of step " << i + 1;
      if (i < norm_steps) {
        EXPECT_NEAR(h[i].grad_norm, norms[i], norm_tol * norms[i]) << "gradient norm of step " << i + 1;
      }
    }
  }

  // What one tensor (or group of tensors) received from training: the update (final minus
  // initial weights) of dstrain's run against the reference's, by cosine and by the norm of
  // their difference over the reference's.
  struct UpdateAgreement {
    double dot = 0, mine = 0, theirs = 0, diff = 0;
    void add(const float* got, const std::vector<float>& want, const std::vector<float>& initial) {
      for (size_t i = 0; i < want.size(); ++i) {
        const double u = double(got[i]) - initial[i], v = double(want[i]) - initial[i];
        dot += u * v, mine += u * u, theirs += v * v, diff += (u - v) * (u - v);
      }
    }
    double cosine() const { return mine == 0 && theirs == 0 ? 1.0 : dot / std::sqrt(std::max(mine * theirs, 1e-300)); }
    double relative() const { return std::sqrt(diff / std::max(theirs, 1e-300)); }
  };

  // How the mixed-precision runs are held to a reference whose rounding differs from theirs
  // (expect_updates): bounds on every step's loss and gradient norm (relative), and on the
  // update each tensor received (cosine at least, relative difference at most); the routed
  // experts (and routing biases) as one group.
  struct UpdateBounds {
    double loss, norm, cos, rel, experts_cos, experts_rel;
  };
  static UpdateBounds bf16_bounds(bool moe) {
    return moe ? UpdateBounds{kBf16MoeLossTol, kBf16MoeNormTol, kBf16MoeUpdateCos, kBf16MoeUpdateRel, kBf16ExpertsCos,
                              kBf16ExpertsRel}
               : UpdateBounds{kBf16LossTol, kBf16NormTol, kBf16UpdateCos, kBf16UpdateRel, 1, 0};
  }
  static UpdateBounds fp16_bounds(bool moe) {
    return moe ? UpdateBounds{kFp16MoeLossTol, kFp16MoeNormTol, kFp16MoeUpdateCos, kFp16MoeUpdateRel, kFp16ExpertsCos,
                              kFp16ExpertsRel}
               : UpdateBounds{kFp16LossTol, kFp16NormTol, kFp16UpdateCos, kFp16UpdateRel, 1, 0};
  }

  // A mixed-precision run's history `h` and final weights against the reference's training
  // under `prefix` ("bf16.": PyTorch's bf16 autocast; "": the fp32 training): every step's loss
  // and gradient norm, and the update each tensor received by cosine and relative norm. Two runs
  // that round in different places, and AdamW's first steps move an element by about lr
  // whatever the size of its gradient, so one near rounding noise goes either way: the updates
  // agree in direction, not element for element. A run that skipped or misplaced an update
  // reads cosine near 0. With routed experts, a rounding flips a near-tie of the top-k choice
  // and another expert trains on that token: the routed experts (and routing biases) are
  // compared as one group, every other tensor on its own. Prints what it measured.
  void expect_updates(const std::vector<StepRecord>& h, const ParamRegistry& params, const std::string& prefix,
                      const UpdateBounds& b, const std::string& label) const {
    const bool moe = config_.n_routed_experts > 0;
    const SafeTensorsFile initial((dir_ / "model.safetensors").string());
    const std::vector<float> losses = read(*expected_, prefix + "step_losses"),
                             norms = read(*expected_, prefix + "grad_norms"), lrs = read(*expected_, "lrs");
    ASSERT_EQ(h.size(), losses.size());
    double loss_gap = 0, norm_gap = 0;
    for (size_t i = 0; i < h.size(); ++i) {
      loss_gap = std::max(loss_gap, std::fabs(h[i].loss - losses[i]) / std::fabs(losses[i]));
      norm_gap = std::max(norm_gap, std::fabs(h[i].grad_norm - norms[i]) / norms[i]);
      EXPECT_NEAR(h[i].lr, lrs[i], 1e-6 * lrs[i]) << "learning rate of step " << i + 1;
    }
    const std::string theirs = prefix.empty() ? "the fp32 reference's" : "autocast's";
    EXPECT_LE(loss_gap, b.loss) << "the losses against " << theirs;
    EXPECT_LE(norm_gap, b.norm) << "the gradient norms against " << theirs;
    UpdateAgreement experts;
    double worst_cos = 1, worst_rel = 0;
    std::string worst_name;
    for (int id = 0; id < params.size(); ++id) {
      const ParamInfo& p = params.info(id);
      const ops::HostView got(params.param(id));
      const std::vector<float> want = read(*expected_, prefix + "final." + p.name), w0 = read(initial, p.name);
      if (p.placement.kind == Placement::Kind::Expert || p.kind == ParamKind::RouterBias ||
          p.name.find(".mlp.experts.") != std::string::npos) {
        experts.add(got.data<float>(), want, w0);
        continue;
      }
      UpdateAgreement a;
      a.add(got.data<float>(), want, w0);
      EXPECT_GE(a.cosine(), b.cos) << "the update of " << p.name << " against " << theirs;
      EXPECT_LE(a.relative(), b.rel) << "the update of " << p.name << " against " << theirs;
      if (a.cosine() < worst_cos) worst_cos = a.cosine(), worst_name = p.name;
      worst_rel = std::max(worst_rel, a.relative());
    }
    if (moe) {
      EXPECT_GE(experts.cosine(), b.experts_cos) << "the routed experts' update against " << theirs;
      EXPECT_LE(experts.relative(), b.experts_rel) << "the routed experts' update against " << theirs;
    }
    std::printf("[ %s ] %zu steps against %s: losses within %.2e, gradient norms within %.2e; updates: worst cosine "
                "%.5f (%s), worst relative difference %.3f%s\n",
                label.c_str(), h.size(), prefix.empty() ? "the fp32 reference" : "PyTorch bf16 autocast", loss_gap,
                norm_gap, worst_cos, worst_name.c_str(), worst_rel,
                moe ? fmt::format("; routed experts: cosine {:.5f}, relative difference {:.3f}", experts.cosine(),
                                  experts.relative())
                          .c_str()
                    : "");
  }

  // One way expect_training_on trains the case: the compute precision, and the ZeRO layout (a
  // train.zero_optimization block; null: none).
  struct Training {
    std::string name;
    std::string precision;  // "fp32", "bf16" or "fp16"
    json zero;
  };
  // fp16 runs with dynamic loss scaling from 2^12: the gradients are scaled (the backward's
  // seeds are 2^12 over the step's tokens) but no step of these cases overflows, so the run is
  // the reference's three steps (an overflow would skip one: the skip, the scale halved and the
  // schedule held back are checked against the host's in mpi/test_device_training.cpp).
  static constexpr int kFp16ScalePower = 12;
  static std::vector<Training> trainings() {
    json zero3 = {{"stage", 3},
                  {"reduce_bucket_size", 2000},
                  {"stage3_prefetch_bucket_size", 2000},
                  {"stage3_param_persistence_threshold", 64}};
    json offloaded = zero3;
    offloaded["offload_optimizer"] = {{"device", "cpu"}, {"pin_memory", true}};
    offloaded["offload_param"] = {{"device", "cpu"}, {"pin_memory", true}};
    return {{"fp32", "fp32", nullptr},
            {"bf16", "bf16", nullptr},
            {"fp16", "fp16", nullptr},
            {"fp32 ZeRO-3", "fp32", zero3},
            {"fp32 ZeRO-3 offloaded", "fp32", offloaded}};
  }

  // The case's training on `device` (trainings()): in fp32, bf16 and fp16 (fp32 masters), and in
  // fp32 with ZeRO-3 (every parameter but the norms gathered around its use and released after,
  // one rank) and with ZeRO-3 offloaded (the optimizer's masters and moments, and the
  // parameters at rest, in pinned host memory: on a GPU, every gradient goes to the host and
  // every weight comes back). fp32, with or without ZeRO (which must not change the math):
  // every step's loss, learning rate and gradient norm, and the final weights, against the fp32
  // reference at fp32's tolerances. bf16: against the same training under PyTorch's bf16
  // autocast (fp32 weights and optimizer: bf16.* of the case), by expect_updates at bf16's
  // bounds. fp16: every step at the loss scale 2^kFp16ScalePower, none overflowing, and against
  // the fp32 training by expect_updates at fp16's bounds (fp16 keeps 3 more mantissa bits than
  // bf16). `patch` adapts the run configuration (the DeepSeek cases' MTP weight and bias rate).
  // The GPU cases use it.
  void expect_training_on(Device device, const std::function<void(json&)>& patch = {}) const {
    const bool moe = config_.n_routed_experts > 0;
    const std::string name = case_["name"].is_string() ? case_["name"].get<std::string>() : dir_.filename().string();
    int index = 0;
    for (const Training& t : trainings()) {
      const std::string label = name + ", " + t.name + " on " + device.str();
      SCOPED_TRACE(label);
      const auto work = std::filesystem::temp_directory_path() /
                        ("dstrain_gpuref_" + std::to_string(index++) + "_" + std::to_string(::getpid()));
      std::filesystem::create_directories(work);
      json run = run_config(work);
      if (patch) patch(run);
      if (t.precision == "bf16") run["train"]["bf16"] = {{"enabled", true}};
      if (t.precision == "fp16") run["train"]["fp16"] = {{"enabled", true}, {"initial_scale_power", kFp16ScalePower}};
      if (!t.zero.is_null()) run["train"]["zero_optimization"] = t.zero;
      const std::string run_path = (work / "run.json").string();
      std::ofstream(run_path) << run.dump(2);
      ProcessGrid grid(MPI_COMM_WORLD, {});
      Trainer trainer(RunConfig::load(run_path, {}), grid, device);
      trainer.init_weights(dir_.string());
      trainer.train();
      trainer.optimizer().gather_all();  // ZeRO-3: the whole weights, to compare
      const std::vector<StepRecord>& h = trainer.history();
      const ParamRegistry& params = trainer.model().params();
      if (t.precision == "fp32") {
        ASSERT_NO_FATAL_FAILURE(expect_history(h));
        double worst = 0;
        for (int id = 0; id < params.size(); ++id) {
          const ParamInfo& p = params.info(id);
          const ops::HostView got(params.param(id));
          const double err = rel_error(got.data<float>(), read(*expected_, "final." + p.name));
          EXPECT_LE(err, kWeightTol) << "weights of " << p.name;
          worst = std::max(worst, err);
        }
        std::printf("[ %s ] %zu steps: loss %.6f (reference %.6f), worst weight error %.2e\n", label.c_str(), h.size(),
                    h.back().loss, double(read(*expected_, "step_losses").back()), worst);
      } else if (t.precision == "bf16") {
        expect_updates(h, params, "bf16.", bf16_bounds(moe), label);
      } else {
        for (const StepRecord& r : h) {
          EXPECT_FALSE(r.overflow) << "step " << r.step << " overflowed at loss scale " << r.loss_scale;
          EXPECT_EQ(r.loss_scale, std::ldexp(1.0, kFp16ScalePower)) << "the loss scale of step " << r.step;
        }
        expect_updates(h, params, "", fp16_bounds(moe), label);
      }
      std::filesystem::remove_all(work);
    }
  }
  std::filesystem::path dir_;
  std::unique_ptr<SafeTensorsFile> expected_;
  ModelConfig config_;
  json case_;
};

}  // namespace dstrain::reference
