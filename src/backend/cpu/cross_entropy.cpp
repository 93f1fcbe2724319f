// Softmax cross-entropy over the vocabulary, one row per token.
#include <cmath>

#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {

void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  DS_CHECK(losses.numel() == N && lse.numel() == N && targets.numel() == N,
           "cross_entropy_forward: logits {} targets {}", logits.shape().str(), targets.shape().str());
  const float* lp = logits.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* out = losses.data<float>();
  float* lsep = lse.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    DS_CHECK(tp[n] == ops::kIgnoreIndex || (tp[n] >= 0 && tp[n] < V),
             "target id {} at position {} is outside the vocabulary [0, {})", tp[n], n, V);
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v]);
    double sum = 0;
#pragma omp simd reduction(+ : sum)
    for (int64_t v = 0; v < V; ++v) sum += double(std::exp(row[v] - mx));
    const float l = mx + float(std::log(sum));
    lsep[n] = l;
    out[n] = tp[n] == ops::kIgnoreIndex ? 0.0f : l - row[tp[n]];
  }
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  DS_CHECK(dlogits.numel() == N * V && lse.numel() == N && targets.numel() == N,
           "cross_entropy_backward: shape mismatch");
  const float* lp = logits.data<float>();
  const float* lsep = lse.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* dp = dlogits.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    float* drow = dp + n * V;
    if (tp[n] == ops::kIgnoreIndex) {
      for (int64_t v = 0; v < V; ++v) drow[v] = 0.0f;
      continue;
    }
    const float l = lsep[n];
#pragma omp simd
    for (int64_t v = 0; v < V; ++v) drow[v] = scale * std::exp(row[v] - l);
    drow[tp[n]] -= scale;
  }
}

void loss_sums(Tensor out, Tensor losses, Tensor targets) {
  DS_CHECK(out.numel() == 2 && losses.numel() == targets.numel(), "loss_sums: out {} losses {} targets {}",
           out.shape().str(), losses.shape().str(), targets.shape().str());
  const float* lp = losses.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  double* o = out.data<double>();
  double sum = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < losses.numel(); ++i) {
    if (tp[i] == ops::kIgnoreIndex) continue;
    sum += lp[i];
    ++count;
  }
  o[0] += sum;
  o[1] += double(count);
}

}  // namespace dstrain::cpu
