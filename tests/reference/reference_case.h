// What the PyTorch reference comparisons share: the case list ctest passes in, reading the
// reference's tensors, the tolerances, and the error measure
// max |dstrain - reference| / max |reference| over a tensor.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "io/safetensors.h"

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

}  // namespace dstrain::reference
