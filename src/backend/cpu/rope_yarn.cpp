// DeepSeek-V2/V3 rotary embedding on the CPU: YaRN tables (DeepseekV2YarnRotaryEmbedding)
// and the interleaved pairing of modeling_deepseek's apply_rotary_pos_emb.
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {

void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double theta, const ops::YarnParams& yarn) {
  const int64_t T = cos.size(0), half = dim / 2;
  float m = 1;
  const std::vector<float> inv_freq = ops::yarn_inv_freq(dim, theta, yarn, &m);
  float* cp = cos.data<float>();
  float* sp = sin.data<float>();
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(t) * inv_freq[size_t(i)];
      cp[t * half + i] = std::cos(angle) * m;
      sp[t * half + i] = std::sin(angle) * m;
    }
  }
}

// Forward, per head of x = (x0, x1, ..., x_{d-1}) read as pairs: u = [x0, x2, ... | x1, x3, ...],
// out = [u1*c - u2*s | u2*c + u1*s] written over the head, de-interleaved as Hugging Face
// leaves it. Backward (`inverse`): the transpose of that linear map, so gradients come back
// in the interleaved input layout. It is the transpose, not the inverse, that the chain rule
// needs; they differ by mscale^2 when the YaRN mscale factor is not 1.
void rope_apply_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos, Tensor sin,
                            bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), half = dim / 2;
  float* xp = x.data<float>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
#pragma omp parallel
  {
    std::vector<float> u(static_cast<size_t>(dim));  // one head, so the rotation can run in place
#pragma omp for schedule(static)
    for (int64_t bt = 0; bt < B * T; ++bt) {
      const int64_t t = bt % T;
      const float* c = cp + t * half;
      const float* s = sp + t * half;
      for (int h = 0; h < n_heads; ++h) {
        float* v = xp + bt * W + offset + int64_t(h) * head_stride;
        if (!inverse) {
          for (int64_t i = 0; i < half; ++i) {
            u[size_t(i)] = v[2 * i];
            u[size_t(half + i)] = v[2 * i + 1];
          }
          for (int64_t i = 0; i < half; ++i) {
            const float u1 = u[size_t(i)], u2 = u[size_t(half + i)];
            v[i] = u1 * c[i] - u2 * s[i];
            v[half + i] = u2 * c[i] + u1 * s[i];
          }
        } else {
          for (int64_t i = 0; i < half; ++i) {
            const float g1 = v[i], g2 = v[half + i];
            u[size_t(2 * i)] = g1 * c[i] + g2 * s[i];
            u[size_t(2 * i + 1)] = g2 * c[i] - g1 * s[i];
          }
          std::copy(u.begin(), u.end(), v);
        }
      }
    }
  }
}

}  // namespace dstrain::cpu
