// DeepSeekMoE routing (scores, top-k selection, routing weights, load-balancing loss) and the
// token permutation between token order and expert-grouped order, on the CPU. Every loop is
// parallel over independent rows and every sum has a fixed order, so results do not depend
// on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {
namespace {

int64_t rows(const Tensor& t) { return t.numel() / t.size(-1); }

// The k largest of v[0..n) into idx[0..k) (best first; on equal values the lower index
// wins, as a stable descending sort would give). O(n*k), which beats a sort for the small k
// of routing (k <= 8 experts, topk_group <= 8 groups).
void top_k(const float* v, int n, int k, int* idx) {
  int filled = 0;
  for (int i = 0; i < n; ++i) {
    if (filled == k && !(v[i] > v[idx[k - 1]])) continue;
    int pos = filled < k ? filled++ : k - 1;
    // Strictly greater moves ahead: an equal earlier index keeps its place.
    while (pos > 0 && v[i] > v[idx[pos - 1]]) {
      idx[pos] = idx[pos - 1];
      --pos;
    }
    idx[pos] = i;
  }
}

bool normalised(const ops::MoERouteParams& p) { return p.top_k > 1 && p.norm_topk_prob; }

}  // namespace

void moe_scores(Tensor scores, Tensor logits, ops::MoEScoring scoring) {
  const int64_t E = logits.size(-1), N = rows(logits);
  const float* lp = logits.data<float>();
  float* sp = scores.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* l = lp + n * E;
    float* s = sp + n * E;
    if (scoring == ops::MoEScoring::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) s[e] = 1.0f / (1.0f + std::exp(-l[e]));
      continue;
    }
    float mx = l[0];
    for (int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
    float z = 0;
    for (int64_t e = 0; e < E; ++e) {
      s[e] = std::exp(l[e] - mx);
      z += s[e];
    }
    const float inv = 1.0f / z;
    for (int64_t e = 0; e < E; ++e) s[e] *= inv;
  }
}

void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, ops::MoEScoring scoring) {
  const int64_t E = scores.size(-1), N = rows(scores);
  const float* sp = scores.data<float>();
  const float* dsp = dscores.data<float>();
  float* dlp = dlogits.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* s = sp + n * E;
    const float* ds = dsp + n * E;
    float* dl = dlp + n * E;
    if (scoring == ops::MoEScoring::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) dl[e] = ds[e] * s[e] * (1.0f - s[e]);
      continue;
    }
    // softmax: dl = s * (ds - <ds, s>)
    double dot = 0;
    for (int64_t e = 0; e < E; ++e) dot += double(ds[e]) * double(s[e]);
    for (int64_t e = 0; e < E; ++e) dl[e] = float(double(s[e]) * (double(ds[e]) - dot));
  }
}

void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const ops::MoERouteParams& p) {
  const bool noaux = p.method == ops::MoETopK::NoAuxTC;
  const int E = int(scores.size(-1)), k = p.top_k;
  const int64_t N = rows(scores);
  const bool grouped = p.method != ops::MoETopK::Greedy && p.n_group > 1;
  const int G = p.n_group, gs = E / p.n_group;
  const float* sp = scores.data<float>();
  const float* bp = noaux ? bias.data<float>() : nullptr;
  int32_t* ip = ids.data<int32_t>();
  float* wp = weights.data<float>();
#pragma omp parallel
  {
    std::vector<float> choice(static_cast<size_t>(E)), group_score(static_cast<size_t>(G));
    std::vector<int> sel(static_cast<size_t>(std::max(k, G))), kept(static_cast<size_t>(G));
    std::vector<char> keep(static_cast<size_t>(G));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const float* s = sp + n * E;
      for (int e = 0; e < E; ++e) choice[size_t(e)] = noaux ? s[e] + bp[e] : s[e];
      if (grouped) {
        for (int g = 0; g < G; ++g) {
          const float* c = choice.data() + g * gs;
          if (p.method == ops::MoETopK::GroupLimitedGreedy) {
            float mx = c[0];
            for (int i = 1; i < gs; ++i) mx = std::max(mx, c[i]);
            group_score[size_t(g)] = mx;
          } else {
            int two[2];
            top_k(c, gs, 2, two);
            group_score[size_t(g)] = c[two[0]] + c[two[1]];
          }
        }
        top_k(group_score.data(), G, p.topk_group, kept.data());
        std::fill(keep.begin(), keep.end(), 0);
        for (int j = 0; j < p.topk_group; ++j) keep[size_t(kept[size_t(j)])] = 1;
        // Hugging Face masks the dropped groups with 0.0 (not -inf) before the final top-k.
        for (int e = 0; e < E; ++e)
          if (!keep[size_t(e / gs)]) choice[size_t(e)] = 0.0f;
      }
      top_k(choice.data(), E, k, sel.data());
      int32_t* id = ip + n * k;
      float* w = wp + n * k;
      float sum = 0;
      for (int j = 0; j < k; ++j) {
        id[j] = int32_t(sel[size_t(j)]);
        w[j] = s[sel[size_t(j)]];
        sum += w[j];
      }
      if (normalised(p)) {
        const float denom = sum + 1e-20f;
        for (int j = 0; j < k; ++j) w[j] /= denom;
        if (noaux)
          for (int j = 0; j < k; ++j) w[j] *= p.routed_scaling_factor;
      } else {
        for (int j = 0; j < k; ++j) w[j] *= p.routed_scaling_factor;
      }
    }
  }
}

void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const ops::MoERouteParams& p) {
  const int64_t E = scores.size(-1), N = rows(scores);
  const int k = p.top_k;
  const bool noaux = p.method == ops::MoETopK::NoAuxTC;
  const float* sp = scores.data<float>();
  const float* dwp = dweights.data<float>();
  const int32_t* ip = ids.data<int32_t>();
  float* dsp = dscores.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* s = sp + n * E;
    const float* dw = dwp + n * k;
    const int32_t* id = ip + n * k;
    float* ds = dsp + n * E;
    std::fill(ds, ds + E, 0.0f);
    if (!normalised(p)) {
      for (int j = 0; j < k; ++j) ds[id[j]] = dw[j] * p.routed_scaling_factor;
      continue;
    }
    // w_j = c * r_j / D with D = sum r + 1e-20: dr_j = c * (dw_j / D - <dw, r> / D^2).
    float sum = 0;
    double dot = 0;
    for (int j = 0; j < k; ++j) {
      sum += s[id[j]];
      dot += double(dw[j]) * double(s[id[j]]);
    }
    const double D = double(sum + 1e-20f), c = noaux ? double(p.routed_scaling_factor) : 1.0;
    for (int j = 0; j < k; ++j) ds[id[j]] = float(c * (double(dw[j]) / D - dot / (D * D)));
  }
}

namespace {

// 1 / (sum_e scores[e] + 1e-20) for sigmoid scores (the normaliser of the balance loss's
// affinities, as Megatron-Core writes it), 1 for softmax scores, which sum to 1 already.
double affinity_scale(const float* s, int64_t E, ops::MoEScoring scoring) {
  if (scoring != ops::MoEScoring::Sigmoid) return 1.0;
  double sum = 0;
  for (int64_t e = 0; e < E; ++e) sum += s[e];
  return 1.0 / (sum + 1e-20);
}

}  // namespace

void moe_aux_loss(Tensor aux_out, Tensor coef, Tensor scores, Tensor ids, ops::MoEScoring scoring) {
  const int64_t E = scores.size(-1), N = rows(scores), G = coef.numel() / E;
  const int64_t k = ids.numel() / N;
  const int64_t Tg = N / G;
  const float* sp = scores.data<float>();
  const int32_t* ip = ids.data<int32_t>();
  float* cp = coef.data<float>();
  std::vector<double> part(static_cast<size_t>(G));
#pragma omp parallel
  {
    std::vector<double> P(static_cast<size_t>(E));
    std::vector<int64_t> count(static_cast<size_t>(E));
#pragma omp for schedule(static)
    for (int64_t g = 0; g < G; ++g) {
      std::fill(P.begin(), P.end(), 0.0);
      std::fill(count.begin(), count.end(), 0);
      for (int64_t t = g * Tg; t < (g + 1) * Tg; ++t) {
        const float* s = sp + t * E;
        const double a = affinity_scale(s, E, scoring);
        for (int64_t e = 0; e < E; ++e) P[size_t(e)] += a * s[e];
        for (int64_t j = 0; j < k; ++j) count[size_t(ip[t * k + j])] += 1;
      }
      double aux = 0;
      for (int64_t e = 0; e < E; ++e) {
        const double ce = double(count[size_t(e)]) * double(E) / double(Tg * k);
        aux += ce * P[size_t(e)] / double(Tg);
        cp[g * E + e] = float(ce / double(Tg));
      }
      part[size_t(g)] = aux;
    }
  }
  double total = 0;
  for (double a : part) total += a;
  *aux_out.data<double>() = total;
}

void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, ops::MoEScoring scoring, float scale) {
  const int64_t E = dscores.size(-1), N = rows(dscores), G = coef.numel() / E;
  const int64_t Tg = N / G;
  const float* cp = coef.data<float>();
  const float* sp = scores.data<float>();
  float* dp = dscores.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* c = cp + (n / Tg) * E;
    float* d = dp + n * E;
    if (scoring != ops::MoEScoring::Sigmoid) {
      for (int64_t e = 0; e < E; ++e) d[e] += scale * c[e];
      continue;
    }
    // a_e = s_e / S: d aux / d s_i = (c_i - sum_e c_e a_e) / S, the sum through S.
    const float* s = sp + n * E;
    const double inv = affinity_scale(s, E, scoring);
    double ca = 0;
    for (int64_t e = 0; e < E; ++e) ca += double(c[e]) * double(s[e]) * inv;
    for (int64_t e = 0; e < E; ++e) d[e] += float(double(scale) * (double(c[e]) - ca) * inv);
  }
}

void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids) {
  const int64_t E = offsets.numel() - 1, M = ids.numel();
  const int32_t* ip = ids.data<int32_t>();
  int64_t* off = offsets.data<int64_t>();
  int32_t* sp = sorted.data<int32_t>();
  int32_t* pp = position.data<int32_t>();
  // A counting sort: serial, because it is O(M) with a tiny constant and its order (token,
  // then slot, within each expert) is what makes the grouped rows deterministic.
  std::fill(off, off + E + 1, 0);
  for (int64_t i = 0; i < M; ++i) {
    DS_CHECK(ip[i] >= 0 && ip[i] < E, "moe_dispatch_plan: expert id {} outside [0, {})", ip[i], E);
    off[ip[i] + 1] += 1;
  }
  for (int64_t e = 0; e < E; ++e) off[e + 1] += off[e];
  std::vector<int64_t> cursor(off, off + E);
  for (int64_t i = 0; i < M; ++i) {
    const int64_t p = cursor[size_t(ip[i])]++;
    sp[p] = int32_t(i);
    pp[i] = int32_t(p);
  }
}

void moe_capacity_plan(Tensor kept, Tensor sorted, Tensor position, Tensor offsets, Tensor weights, int64_t capacity,
                       ops::MoEDropPolicy policy) {
  const int64_t E = offsets.numel() - 1, M = sorted.numel();
  const int64_t* off = offsets.data<int64_t>();
  DS_CHECK(off[0] == 0 && off[E] == M, "moe_capacity_plan: offsets cover rows [{}, {}) of a plan of {}", off[0],
           off[E], M);
  const float* wp = weights.data<float>();
  int32_t* sp = sorted.data<int32_t>();
  int32_t* pp = position.data<int32_t>();
  int64_t* kp = kept.data<int64_t>();
  // Serial, like the plan: O(M) plus a sort of each overfull expert's rows. The kept rows move
  // up (to at <= the row they are read from), so the plan is rewritten in place.
  std::vector<int32_t> rows_of_e, order;
  std::vector<char> keep;
  int64_t at = 0;
  kp[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t begin = off[e], end = off[e + 1], n = end - begin;
    DS_CHECK(n >= 0, "moe_capacity_plan: offsets decrease at expert {}", e);
    keep.assign(size_t(n), 1);
    if (n > capacity) {
      std::fill(keep.begin(), keep.end(), 0);
      if (policy == ops::MoEDropPolicy::Position) {
        std::fill(keep.begin(), keep.begin() + capacity, 1);  // the rows are in token order
      } else {
        // The largest weights; a stable sort leaves equal weights in token order.
        order.resize(size_t(n));
        for (int64_t i = 0; i < n; ++i) order[size_t(i)] = int32_t(i);
        std::stable_sort(order.begin(), order.end(),
                         [&](int32_t a, int32_t b) { return wp[sp[begin + a]] > wp[sp[begin + b]]; });
        for (int64_t i = 0; i < capacity; ++i) keep[size_t(order[size_t(i)])] = 1;
      }
    }
    rows_of_e.assign(sp + begin, sp + end);
    for (int64_t i = 0; i < n; ++i) {
      const int32_t pair = rows_of_e[size_t(i)];
      if (keep[size_t(i)]) {
        sp[at] = pair;
        pp[pair] = int32_t(at++);
      } else {
        pp[pair] = -1;
      }
    }
    kp[e + 1] = at;
  }
  std::fill(sp + at, sp + M, -1);
}

void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k) {
  const int64_t C = x.size(-1), M = sorted.numel();
  const float* xp = x.data<float>();
  const int32_t* sp = sorted.data<int32_t>();
  float* gp = xg.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < M; ++p) {
    std::memcpy(gp + p * C, xp + int64_t(sp[p] / top_k) * C, size_t(C) * sizeof(float));
  }
}

void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool accumulate) {
  const int64_t C = dx.size(-1), N = rows(dx), M = position.numel(), k = M / N;
  const float* gp = dxg.data<float>();
  const int32_t* pp = position.data<int32_t>();
  float* dp = dx.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = dp + n * C;
    if (!accumulate) std::fill(d, d + C, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (pp[n * k + j] < 0) continue;  // dropped
      const float* g = gp + int64_t(pp[n * k + j]) * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position) {
  const int64_t C = out.size(-1), N = rows(out), M = position.numel(), k = M / N;
  const float* yp = yg.data<float>();
  const float* wp = weights.data<float>();
  const int32_t* pp = position.data<int32_t>();
  float* op = out.data<float>();
#pragma omp parallel
  {
    std::vector<float> acc(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      // The routed sum first, then onto out: the order Hugging Face adds them in.
      std::fill(acc.begin(), acc.end(), 0.0f);
      float* a = acc.data();
      for (int64_t j = 0; j < k; ++j) {
        if (pp[n * k + j] < 0) continue;  // dropped
        const float w = wp[n * k + j];
        const float* y = yp + int64_t(pp[n * k + j]) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) a[c] += w * y[c];
      }
      float* o = op + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += a[c];
    }
  }
}

void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted) {
  const int64_t C = dout.size(-1), N = rows(dout), M = weights.numel(), k = M / N, R = sorted.numel();
  const float* dop = dout.data<float>();
  const float* yp = yg.data<float>();
  const float* wp = weights.data<float>();
  const int32_t* sp = sorted.data<int32_t>();
  float* dyp = dyg.data<float>();
  float* dwp = dweights.data<float>();
  if (R < M) std::fill(dwp, dwp + M, 0.0f);  // the dropped pairs' weights had no effect
  // Each grouped row belongs to exactly one (token, slot) pair: no two rows write the same
  // dweights entry.
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < R; ++p) {
    const int64_t pair = sp[p];
    const float* d = dop + (pair / k) * C;
    const float* y = yp + p * C;
    float* dy = dyp + p * C;
    const float w = wp[pair];
    float dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) {
      dy[c] = w * d[c];
      dot += d[c] * y[c];
    }
    dwp[pair] = dot;
  }
}

void moe_bias_update(Tensor bias, Tensor tokens_per_expert, float gamma) {
  const int64_t E = bias.numel();
  const int64_t* c = tokens_per_expert.data<int64_t>();
  float* b = bias.data<float>();
  int64_t total = 0;
  for (int64_t e = 0; e < E; ++e) total += c[e];
  for (int64_t e = 0; e < E; ++e) {
    // counts[e] against mean = total / E, compared exactly in integers.
    const int64_t lhs = c[e] * E;
    if (lhs < total) b[e] += gamma;
    if (lhs > total) b[e] -= gamma;
  }
}

}  // namespace dstrain::cpu
