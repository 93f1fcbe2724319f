// The frequencies of DeepSeek's YaRN rotary embedding (DeepseekV2YarnRotaryEmbedding), shared by
// every backend's rope_tables_yarn: the tables are computed on the host, once.
#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "backend/ops.h"
#include "core/error.h"

namespace dstrain::ops {
namespace {

// yarn_get_mscale of modeling_deepseek (Python floats, so double).
double yarn_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

}  // namespace

std::vector<float> yarn_inv_freq(int dim, double theta, const YarnParams& yarn, float* mscale) {
  const int64_t half = dim / 2;
  DS_CHECK(dim > 0 && dim % 2 == 0, "rope_tables_yarn: dim {} must be positive and even", dim);
  const bool scaled = yarn.factor > 1;
  DS_CHECK(!scaled || yarn.original_max_position_embeddings > 0,
           "rope_tables_yarn: YaRN factor {} needs original_max_position_embeddings > 0", yarn.factor);

  // The correction range is Python float arithmetic in Hugging Face (double here); the
  // frequencies, the ramp and their blend are fp32 tensors there, and are fp32 here.
  double low = 0, high = 1;
  if (scaled) {
    auto correction_dim = [&](double n_rot) {
      return double(dim) * std::log(double(yarn.original_max_position_embeddings) / (n_rot * 2 * std::numbers::pi)) /
             (2 * std::log(theta));
    };
    low = std::max(std::floor(correction_dim(yarn.beta_fast)), 0.0);
    high = std::min(std::ceil(correction_dim(yarn.beta_slow)), double(dim - 1));
    if (low == high) high += 0.001;  // yarn_linear_ramp_mask's guard against a zero-width ramp
  }
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float base_pow = std::pow(float(theta), float(2 * i) / float(dim));
    const float extra = 1.0f / base_pow;
    if (!scaled) {
      inv_freq[size_t(i)] = extra;
      continue;
    }
    const float inter = 1.0f / (float(yarn.factor) * base_pow);
    const float ramp = std::clamp((float(i) - float(low)) / float(high - low), 0.0f, 1.0f);
    const float mask = 1.0f - ramp;  // inv_freq_mask: 1 keeps the original frequency
    // torch rounds each product before the sum; volatile keeps the compiler from fusing
    // them into one FMA, which would change the last bit inside the ramp.
    const volatile float from_inter = inter * (1.0f - mask);
    const volatile float from_extra = extra * mask;
    inv_freq[size_t(i)] = from_inter + from_extra;
  }
  *mscale = scaled ? float(yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)) : 1.0f;
  return inv_freq;
}

}  // namespace dstrain::ops
