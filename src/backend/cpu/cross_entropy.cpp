// Softmax cross-entropy over the vocabulary, one row per token.
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/parallel.h"
#include "backend/cpu/vec_exp.h"

namespace dstrain::cpu {
namespace {

// The log-sum-exp of a row: its maximum, plus the log of the sum of exp(x - max) taken in double,
// in four lanes as the AVX2 form sums (so both give the same bits).
float row_lse_scalar(const float* row, int64_t V) {
  float mx = -INFINITY;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v]);
  const int64_t v8 = V & ~int64_t(7);
  double s0[4] = {}, s1[4] = {};
  for (int64_t v = 0; v < v8; ++v) {
    const double e = double(exp1(row[v] - mx));
    if (v % 8 < 4) {
      s0[v % 4] += e;
    } else {
      s1[v % 4] += e;
    }
  }
  double lanes[4];
  for (int k = 0; k < 4; ++k) lanes[k] = s0[k] + s1[k];
  double sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  for (int64_t v = v8; v < V; ++v) sum += double(exp1(row[v] - mx));
  return mx + float(std::log(sum));
}

DS_TARGET_AVX2 float row_lse_avx2(const float* row, int64_t V) {
  int64_t v = 0;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (; v + 8 <= V; v += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(row + v));
  float mx = hmax8(mv);
  for (; v < V; ++v) mx = std::max(mx, row[v]);
  const __m256 m8 = _mm256_set1_ps(mx);
  __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
  for (v = 0; v + 8 <= V; v += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + v), m8));
    s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  double sum = (lanes[0] + lanes[2]) + (lanes[1] + lanes[3]);
  for (; v < V; ++v) sum += double(exp1(row[v] - mx));
  return mx + float(std::log(sum));
}

DS_TARGET_AVX2 void scaled_probs_avx2(float* drow, const float* row, int64_t V, float l, float scale) {
  const __m256 l8 = _mm256_set1_ps(l), s8 = _mm256_set1_ps(scale);
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    _mm256_storeu_ps(drow + v, _mm256_mul_ps(s8, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + v), l8))));
  }
  for (; v < V; ++v) drow[v] = scale * exp1(row[v] - l);
}

// The rows of cross_entropy_backward and of its vocabulary shards: logits (N,V) are columns
// [vocab_begin, vocab_begin + V) of the full rows, and the one-hot applies where the target falls
// among them. One code path, so the shards side by side give the unsharded op's bits.
void backward_rows(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale,
                   int64_t vocab_begin) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const float* lp = logits.data<float>();
  const float* lsep = lse.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* dp = dlogits.data<float>();
  const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(dynamic, 16) if (N * V >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    float* drow = dp + n * V;
    if (tp[n] == ops::kIgnoreIndex) {
      for (int64_t v = 0; v < V; ++v) drow[v] = 0.0f;
      continue;
    }
    const float l = lsep[n];
    if (avx2) {
      scaled_probs_avx2(drow, row, V, l, scale);
    } else {
      for (int64_t v = 0; v < V; ++v) drow[v] = scale * exp1(row[v] - l);
    }
    const int64_t t = int64_t(tp[n]) - vocab_begin;
    if (t >= 0 && t < V) drow[t] -= scale;
  }
}

}  // namespace

void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const float* lp = logits.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* out = losses.data<float>();
  float* lsep = lse.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    DS_CHECK(tp[n] == ops::kIgnoreIndex || (tp[n] >= 0 && tp[n] < V),
             "target id {} at position {} is outside the vocabulary [0, {})", tp[n], n, V);
  }
  const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(dynamic, 16) if (N * V >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    const float l = avx2 ? row_lse_avx2(row, V) : row_lse_scalar(row, V);
    lsep[n] = l;
    out[n] = tp[n] == ops::kIgnoreIndex ? 0.0f : l - row[tp[n]];
  }
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale) {
  backward_rows(dlogits, logits, lse, targets, scale, 0);
}

void cross_entropy_shard_forward(Tensor stats, Tensor logits, Tensor targets, int64_t vocab_begin,
                                 int64_t vocab_size) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const float* lp = logits.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* sp = stats.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    DS_CHECK(tp[n] == ops::kIgnoreIndex || (tp[n] >= 0 && tp[n] < vocab_size),
             "target id {} at position {} is outside the vocabulary [0, {})", tp[n], n, vocab_size);
  }
  const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(dynamic, 16) if (N * V >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    const int64_t t = int64_t(tp[n]) - vocab_begin;
    sp[2 * n] = avx2 ? row_lse_avx2(row, V) : row_lse_scalar(row, V);
    sp[2 * n + 1] = tp[n] != ops::kIgnoreIndex && t >= 0 && t < V ? row[t] : 0.0f;
  }
}

void cross_entropy_combine(Tensor losses, Tensor lse, Tensor shard_stats, Tensor targets) {
  const int64_t N = targets.numel(), P = shard_stats.ndim() > 0 ? shard_stats.size(0) : 0;
  const float* sp = shard_stats.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* out = losses.data<float>();
  float* lsep = lse.data<float>();
#pragma omp parallel for schedule(dynamic, 256) if (N * P >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    double mx = -INFINITY;
    for (int64_t p = 0; p < P; ++p) mx = std::max(mx, double(sp[2 * (p * N + n)]));
    double sum = 0, target_logit = 0;
    for (int64_t p = 0; p < P; ++p) {
      sum += std::exp(double(sp[2 * (p * N + n)]) - mx);
      target_logit += double(sp[2 * (p * N + n) + 1]);
    }
    // With one shard, sum is exactly 1: lse and the loss are cross_entropy_forward's bits.
    const float l = float(mx + std::log(sum));
    lsep[n] = l;
    out[n] = tp[n] == ops::kIgnoreIndex ? 0.0f : l - float(target_logit);
  }
}

void cross_entropy_shard_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale,
                                  int64_t vocab_begin) {
  backward_rows(dlogits, logits, lse, targets, scale, vocab_begin);
}

void logit_max_and_target(Tensor out, Tensor logits, Tensor targets, int64_t vocab_begin) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const float* lp = logits.data<float>();
  const int32_t* tp = targets.data<int32_t>();
  float* op = out.data<float>();
#pragma omp parallel for schedule(static) if (N * V >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* row = lp + n * V;
    float m = -INFINITY;
    for (int64_t v = 0; v < V; ++v) m = row[v] > m ? row[v] : m;
    const int64_t t = int64_t(tp[n]) - vocab_begin;
    op[2 * n] = m;
    op[2 * n + 1] = tp[n] != ops::kIgnoreIndex && t >= 0 && t < V ? row[t] : -INFINITY;
  }
}

void loss_sums(Tensor out, Tensor losses, Tensor targets) {
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
