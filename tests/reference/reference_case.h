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

namespace dstrain::reference {

constexpr double kLogitsTol = 1e-5, kLossTol = 1e-5, kGradTol = 1e-4, kWeightTol = 1e-4;

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
  std::filesystem::path dir_;
  std::unique_ptr<SafeTensorsFile> expected_;
  ModelConfig config_;
  json case_;
};

}  // namespace dstrain::reference
