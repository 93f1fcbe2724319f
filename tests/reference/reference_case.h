// What the PyTorch reference comparisons share: the case list ctest passes in, reading the
// reference's tensors, the tolerances, and the error measure
// max |dstrain - reference| / max |reference| over a tensor.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

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
    dir_ = std::filesystem::path(DSTRAIN_REFERENCE_CASE_DIR) / GetParam();
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

  // Every step's loss, learning rate and gradient norm against the reference's.
  void expect_history(const std::vector<StepRecord>& h) const {
    const std::vector<float> losses = read(*expected_, "step_losses"), lrs = read(*expected_, "lrs"),
                             norms = read(*expected_, "grad_norms");
    ASSERT_EQ(h.size(), losses.size());
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_NEAR(h[i].loss, losses[i], kLossTol * std::fabs(losses[i])) << "loss of step " << i + 1;
      EXPECT_NEAR(h[i].lr, lrs[i], 1e-6 * lrs[i]) << "learning rate of step " << i + 1;
      EXPECT_NEAR(h[i].grad_norm, norms[i], kGradTol * norms[i]) << "gradient norm of step " << i + 1;
    }
  }
  std::filesystem::path dir_;
  std::unique_ptr<SafeTensorsFile> expected_;
  ModelConfig config_;
  json case_;
};

}  // namespace dstrain::reference
