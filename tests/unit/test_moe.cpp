// DeepSeekMoE checks: routing kernels against a straightforward reference for each top-k
// method, the token permutation, the MoE layer's gradients against finite differences (aux
// loss included), its forward against a naive per-token double-precision version, the
// auxiliary-loss-free bias update, thread-count independence, and the optional expert capacity
// (token dropping) against its definition.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "finite_difference.h"
#include "model/init.h"
#include "model/moe.h"

namespace dstrain {
namespace {

using ops::MoEScoring;
using ops::MoETopK;

// Runs the enclosing scope on one thread: finite differences make hundreds of tiny
// forwards, where thread start-up would dominate. Restores the count on any exit.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

Tensor f32(std::vector<float>& v, Shape s) { return Tensor(v.data(), DType::F32, s); }
Tensor i32(std::vector<int32_t>& v, Shape s) { return Tensor(v.data(), DType::I32, s); }

// The op's aux loss, read back from its one-element tensor.
double moe_aux(Tensor coef, Tensor scores, Tensor ids, MoEScoring scoring) {
  double aux = -1;
  ops::moe_aux_loss(Tensor(&aux, DType::F64, Shape{1}), coef, scores, ids, scoring);
  return aux;
}

std::vector<float> normal(size_t n, std::mt19937& rng, float stdev = 1.0f) {
  std::normal_distribution<float> nd(0.0f, stdev);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// ---- reference routing, written from the definition -----------------------------------
// Indices of v sorted by descending value, ties to the lower index (a stable sort).
std::vector<int> ranked(const std::vector<double>& v) {
  std::vector<int> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[size_t(a)] > v[size_t(b)]; });
  return idx;
}

struct RefRoute {
  std::vector<int> ids;
  std::vector<double> weights;
};

RefRoute ref_route(const std::vector<double>& s, const std::vector<double>& bias, const ops::MoERouteParams& p) {
  const int E = int(s.size()), k = p.top_k;
  std::vector<double> choice = s;
  if (p.method == MoETopK::NoAuxTC)
    for (int e = 0; e < E; ++e) choice[size_t(e)] += bias[size_t(e)];
  if (p.method != MoETopK::Greedy && p.n_group > 1) {
    const int gs = E / p.n_group;
    std::vector<double> gscore(size_t(p.n_group));
    for (int g = 0; g < p.n_group; ++g) {
      std::vector<double> members(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
      std::sort(members.rbegin(), members.rend());
      gscore[size_t(g)] = p.method == MoETopK::GroupLimitedGreedy ? members[0] : members[0] + members[1];
    }
    const std::vector<int> gr = ranked(gscore);
    std::set<int> kept(gr.begin(), gr.begin() + p.topk_group);
    for (int e = 0; e < E; ++e)
      if (!kept.count(e / gs)) choice[size_t(e)] = 0.0;
  }
  RefRoute r;
  const std::vector<int> order = ranked(choice);
  r.ids.assign(order.begin(), order.begin() + k);
  double sum = 0;
  for (int e : r.ids) {
    r.weights.push_back(s[size_t(e)]);
    sum += s[size_t(e)];
  }
  const bool norm = k > 1 && p.norm_topk_prob;
  for (double& w : r.weights) {
    if (norm) w /= sum + 1e-20;
    if (!norm || p.method == MoETopK::NoAuxTC) w *= p.routed_scaling_factor;
  }
  return r;
}

std::vector<double> ref_scores(const float* logits, int E, MoEScoring f) {
  std::vector<double> s(static_cast<size_t>(E));
  double mx = -1e300, z = 0;
  for (int e = 0; e < E; ++e) mx = std::max(mx, double(logits[e]));
  for (int e = 0; e < E; ++e) {
    s[size_t(e)] = f == MoEScoring::Sigmoid ? 1.0 / (1.0 + std::exp(-double(logits[e]))) : std::exp(logits[e] - mx);
    z += s[size_t(e)];
  }
  if (f == MoEScoring::Softmax)
    for (double& v : s) v /= z;
  return s;
}

struct RouteCase {
  const char* name;
  MoEScoring scoring;
  MoETopK method;
  int n_group, topk_group;
  bool norm;
};

void PrintTo(const RouteCase& c, std::ostream* os) { *os << c.name; }

class MoERoute : public ::testing::TestWithParam<RouteCase> {};

TEST_P(MoERoute, MatchesReference) {
  const RouteCase rc = GetParam();
  const int64_t N = 97, E = 16;
  std::mt19937 rng(11);
  std::vector<float> logits = normal(size_t(N * E), rng, 2.0f), scores(size_t(N * E));
  std::vector<float> bias = normal(size_t(E), rng, 0.3f);
  ops::moe_scores(f32(scores, {N, E}), f32(logits, {N, E}), rc.scoring);
  for (int64_t n = 0; n < N; ++n) {
    const std::vector<double> s = ref_scores(logits.data() + n * E, int(E), rc.scoring);
    for (int64_t e = 0; e < E; ++e) ASSERT_NEAR(scores[size_t(n * E + e)], s[size_t(e)], 1e-6);
  }
  const std::vector<double> bias_d(bias.begin(), bias.end()), no_bias(size_t(E), 0.0);
  for (int k : {1, 4}) {
    for (float rsf : {1.0f, 2.5f}) {
      ops::MoERouteParams p;
      p.method = rc.method;
      p.top_k = k;
      p.n_group = rc.n_group;
      p.topk_group = rc.topk_group;
      p.norm_topk_prob = rc.norm;
      p.routed_scaling_factor = rsf;
      std::vector<int32_t> ids(size_t(N * k));
      std::vector<float> w(size_t(N * k));
      const bool noaux = rc.method == MoETopK::NoAuxTC;
      ops::moe_route(i32(ids, {N, k}), f32(w, {N, k}), f32(scores, {N, E}), noaux ? f32(bias, {E}) : Tensor(), p);
      int changed_by_bias = 0, changed_by_groups = 0;
      for (int64_t n = 0; n < N; ++n) {
        const std::vector<double> s(scores.begin() + n * E, scores.begin() + (n + 1) * E);
        const RefRoute r = ref_route(s, bias_d, p);
        for (int j = 0; j < k; ++j) {
          ASSERT_EQ(ids[size_t(n * k + j)], r.ids[size_t(j)]) << "token " << n << " slot " << j;
          ASSERT_NEAR(w[size_t(n * k + j)], r.weights[size_t(j)], 1e-6 * rsf) << "token " << n << " slot " << j;
        }
        if (noaux) changed_by_bias += ref_route(s, no_bias, p).ids != r.ids;
        ops::MoERouteParams greedy = p;
        greedy.method = MoETopK::Greedy;
        changed_by_groups += ref_route(s, no_bias, greedy).ids != ref_route(s, no_bias, p).ids;
      }
      // The cases exercise what they claim: the bias and the group limit change choices.
      if (noaux) {
        EXPECT_GT(changed_by_bias, 0);
      }
      if (rc.method != MoETopK::Greedy && rc.n_group > 1 && k > 1) {
        EXPECT_GT(changed_by_groups, 0);
      }
      // Normalised weights sum to the scaling factor (V3) or to 1 (V2).
      if (k > 1 && rc.norm) {
        const double expect = noaux ? rsf : 1.0;
        for (int64_t n = 0; n < N; ++n) {
          double sum = 0;
          for (int j = 0; j < k; ++j) sum += w[size_t(n * k + j)];
          EXPECT_NEAR(sum, expect, 1e-5 * expect);
        }
      }
    }
  }
}

TEST_P(MoERoute, TiesGoToTheLowerIndex) {
  const RouteCase rc = GetParam();
  const int64_t E = 16, k = 4;
  std::vector<float> scores(size_t(E), 0.25f), bias(size_t(E), 0.0f);
  ops::MoERouteParams p;
  p.method = rc.method;
  p.top_k = int(k);
  p.n_group = rc.n_group;
  p.topk_group = rc.topk_group;
  std::vector<int32_t> ids(static_cast<size_t>(k));
  std::vector<float> w(static_cast<size_t>(k));
  ops::moe_route(i32(ids, {1, k}), f32(w, {1, k}), f32(scores, {1, E}),
                 rc.method == MoETopK::NoAuxTC ? f32(bias, {E}) : Tensor(), p);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 1, 2, 3}));
}

INSTANTIATE_TEST_SUITE_P(
    Methods, MoERoute,
    ::testing::Values(RouteCase{"softmax_greedy", MoEScoring::Softmax, MoETopK::Greedy, 1, 1, false},
                      RouteCase{"softmax_greedy_norm", MoEScoring::Softmax, MoETopK::Greedy, 1, 1, true},
                      RouteCase{"softmax_group_limited", MoEScoring::Softmax, MoETopK::GroupLimitedGreedy, 4, 2, false},
                      RouteCase{"softmax_group_limited_norm", MoEScoring::Softmax, MoETopK::GroupLimitedGreedy, 8, 3,
                                true},
                      RouteCase{"sigmoid_noaux_tc", MoEScoring::Sigmoid, MoETopK::NoAuxTC, 4, 2, false},
                      RouteCase{"sigmoid_noaux_tc_norm", MoEScoring::Sigmoid, MoETopK::NoAuxTC, 4, 2, true},
                      RouteCase{"sigmoid_noaux_tc_one_group", MoEScoring::Sigmoid, MoETopK::NoAuxTC, 1, 1, true}),
    [](const auto& tp) { return std::string(tp.param.name); });

// Central differences of a loss of the fp32 kernels, at every element of x, with steps h
// and h/2 combined by Richardson extrapolation (truncation O(h^4)), over the steps fp32
// really took: max |grad - fd| / max |grad|.
double max_fd_error(std::vector<float>& x, const std::vector<float>& grad, const std::function<double()>& loss,
                    double h) {
  double gmax = 1e-6, err = 0;
  for (float g : grad) gmax = std::max(gmax, double(std::fabs(g)));
  for (size_t i = 0; i < x.size(); ++i) {
    err = std::max(err, std::fabs(grad[i] - richardson_fd(x.data(), int64_t(i), h, loss)) / gmax);
  }
  return err;
}

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// max |grad - fd| / max |grad|: measured at most 8.9e-5.
constexpr double kRouteGradTol = 3e-4;
constexpr double kRouteStep = 1e-2;

TEST(MoERouteGradients, ScoresWeightsAndAuxMatchFiniteDifferences) {
  const int64_t N = 6, E = 8, k = 3;
  std::mt19937 rng(3);
  double worst = 0;
  for (MoEScoring f : {MoEScoring::Softmax, MoEScoring::Sigmoid}) {
    for (bool norm : {false, true}) {
      for (MoETopK m : {MoETopK::Greedy, MoETopK::NoAuxTC}) {
        ops::MoERouteParams p;
        p.method = m;
        p.top_k = int(k);
        p.norm_topk_prob = norm;
        p.routed_scaling_factor = 1.7f;
        std::vector<float> logits = normal(size_t(N * E), rng, 2.0f), scores(size_t(N * E)), w(size_t(N * k));
        std::vector<float> bias = normal(size_t(E), rng, 0.2f), rw = normal(size_t(N * k), rng);
        std::vector<float> rs = normal(size_t(N * E), rng), coef(size_t(2 * E));
        std::vector<int32_t> ids(size_t(N * k)), ids0;
        const Tensor b = m == MoETopK::NoAuxTC ? f32(bias, {E}) : Tensor();
        // L = <w, rw> + <scores, rs> + 0.7 * aux over 2 groups of 3 tokens.
        auto loss = [&] {
          ops::moe_scores(f32(scores, {N, E}), f32(logits, {N, E}), f);
          ops::moe_route(i32(ids, {N, k}), f32(w, {N, k}), f32(scores, {N, E}), b, p);
          const double aux = moe_aux(f32(coef, {2, E}), f32(scores, {N, E}), i32(ids, {N, k}), f);
          return dot(w, rw) + dot(scores, rs) + 0.7 * aux;
        };
        loss();
        ids0 = ids;
        std::vector<float> dscores(size_t(N * E)), dlogits(size_t(N * E));
        ops::moe_route_backward(f32(dscores, {N, E}), f32(rw, {N, k}), i32(ids, {N, k}), f32(scores, {N, E}), p);
        for (size_t i = 0; i < dscores.size(); ++i) dscores[i] += rs[i];
        ops::moe_aux_loss_backward(f32(dscores, {N, E}), f32(coef, {2, E}), f32(scores, {N, E}), f, 0.7f);
        ops::moe_scores_backward(f32(dlogits, {N, E}), f32(dscores, {N, E}), f32(scores, {N, E}), f);
        const double err = max_fd_error(logits, dlogits, loss, kRouteStep);
        loss();
        ASSERT_EQ(ids, ids0) << "the finite differences changed the routing";
        worst = std::max(worst, err);
        EXPECT_LT(err, kRouteGradTol) << (f == MoEScoring::Softmax ? "softmax" : "sigmoid") << " norm " << norm;
      }
    }
  }
  std::printf("[ route FD ] max |grad - fd| / max|grad| %.1e\n", worst);
}

// The balance loss alone (its gradient is small next to the routing weights' and would hide
// under their tolerance above), through the scores into the logits: per sequence (G = 3)
// and per batch (G = 1), softmax and sigmoid scores. With sigmoid scores the gradient runs
// through each token's normaliser sum_j s_j as well.
TEST(MoERouteGradients, AuxLossAloneMatchesFiniteDifferences) {
  const int64_t N = 12, E = 8, k = 2;
  std::mt19937 rng(5);
  double worst = 0;
  for (MoEScoring f : {MoEScoring::Softmax, MoEScoring::Sigmoid}) {
    for (int64_t G : {3, 1}) {
      ops::MoERouteParams p;
      p.top_k = int(k);
      std::vector<float> logits = normal(size_t(N * E), rng, 2.0f), scores(size_t(N * E)), w(size_t(N * k));
      std::vector<float> coef(size_t(G * E));
      std::vector<int32_t> ids(size_t(N * k)), ids0;
      auto loss = [&] {
        ops::moe_scores(f32(scores, {N, E}), f32(logits, {N, E}), f);
        ops::moe_route(i32(ids, {N, k}), f32(w, {N, k}), f32(scores, {N, E}), Tensor(), p);
        return 0.7 * moe_aux(f32(coef, {G, E}), f32(scores, {N, E}), i32(ids, {N, k}), f);
      };
      loss();
      ids0 = ids;
      std::vector<float> dscores(size_t(N * E), 0.0f), dlogits(size_t(N * E));
      ops::moe_aux_loss_backward(f32(dscores, {N, E}), f32(coef, {G, E}), f32(scores, {N, E}), f, 0.7f);
      ops::moe_scores_backward(f32(dlogits, {N, E}), f32(dscores, {N, E}), f32(scores, {N, E}), f);
      const double err = max_fd_error(logits, dlogits, loss, kRouteStep);
      loss();
      ASSERT_EQ(ids, ids0) << "the finite differences changed the routing";
      worst = std::max(worst, err);
      EXPECT_LT(err, kRouteGradTol) << (f == MoEScoring::Softmax ? "softmax" : "sigmoid") << " G " << G;
    }
  }
  std::printf("[ aux FD ] max |grad - fd| / max|grad| %.1e\n", worst);
}

// The balance loss written straight from its definition, in double: sequence-wise (G = B)
// and batch-wise (G = 1). Softmax scores enter as they are (Hugging Face's DeepSeek-V2 gate);
// sigmoid scores as the normalised affinities s'_{i,t} = s_{i,t} / sum_j s_{j,t} of the
// DeepSeek-V3 technical report, eqs. 18-20: P_i = 1/T sum_t s'_{i,t}, f_i = E/(kT) count_i.
double aux_definition(const std::vector<float>& scores, const std::vector<int32_t>& ids, int64_t G, int64_t T,
                      int64_t E, int64_t k, MoEScoring f) {
  double aux = 0;
  for (int64_t g = 0; g < G; ++g) {
    std::vector<double> count(static_cast<size_t>(E)), P(static_cast<size_t>(E));
    for (int64_t t = g * T; t < (g + 1) * T; ++t) {
      double S = 0;
      for (int64_t e = 0; e < E; ++e) S += scores[size_t(t * E + e)];
      for (int64_t j = 0; j < k; ++j) count[size_t(ids[size_t(t * k + j)])] += 1;
      for (int64_t e = 0; e < E; ++e) {
        const double a = f == MoEScoring::Sigmoid ? scores[size_t(t * E + e)] / S : scores[size_t(t * E + e)];
        P[size_t(e)] += a / double(T);
      }
    }
    for (int64_t e = 0; e < E; ++e) aux += double(E) * count[size_t(e)] / double(k * T) * P[size_t(e)];
  }
  return aux;
}

TEST(MoERouteGradients, AuxLossMatchesDefinition) {
  const int64_t B = 3, T = 4, N = B * T, E = 6, k = 2;
  for (MoEScoring f : {MoEScoring::Softmax, MoEScoring::Sigmoid}) {
    std::mt19937 rng(8);
    std::vector<float> logits = normal(size_t(N * E), rng), scores(size_t(N * E)), w(size_t(N * k));
    std::vector<int32_t> ids(size_t(N * k));
    ops::moe_scores(f32(scores, {N, E}), f32(logits, {N, E}), f);
    ops::MoERouteParams p;
    p.top_k = int(k);
    ops::moe_route(i32(ids, {N, k}), f32(w, {N, k}), f32(scores, {N, E}), Tensor(), p);
    std::vector<float> coef_seq(size_t(B * E)), coef_batch(static_cast<size_t>(E));
    const double seq = moe_aux(f32(coef_seq, {B, E}), f32(scores, {N, E}), i32(ids, {N, k}), f);
    const double batch = moe_aux(f32(coef_batch, {1, E}), f32(scores, {N, E}), i32(ids, {N, k}), f);
    const double ref_seq = aux_definition(scores, ids, B, T, E, k, f);
    const double ref_batch = aux_definition(scores, ids, 1, N, E, k, f);
    const char* name = f == MoEScoring::Sigmoid ? "sigmoid" : "softmax";
    EXPECT_NEAR(seq, ref_seq, 1e-6 * ref_seq) << name;
    EXPECT_NEAR(batch, ref_batch, 1e-6 * ref_batch) << name;
  }
}

// A case small enough to work out by hand from eqs. 18-20 (T = 2 tokens, E = 4, k = 2):
//   s_0 = (0.8, 0.4, 0.6, 0.2), S_0 = 2 -> s'_0 = (0.4, 0.2, 0.3, 0.1), chosen {0, 1}
//   s_1 = (0.2, 0.6, 0.1, 0.1), S_1 = 1 -> s'_1 = (0.2, 0.6, 0.1, 0.1), chosen {1, 3}
//   f = E/(kT) (1, 2, 0, 1) = (1, 2, 0, 1),  P = (0.3, 0.4, 0.2, 0.1)
//   aux = sum_i f_i P_i = 0.3 + 0.8 + 0 + 0.1 = 1.2   (the raw scores would give 1.65)
//   d aux / d s_{i,t} = (f_i - sum_e f_e s'_{e,t}) / (T S_t):
//     t = 0: sum f s' = 0.9 -> (0.025, 0.275, -0.225, 0.025)
//     t = 1: sum f s' = 1.5 -> (-0.25, 0.25, -0.75, -0.25)
TEST(MoERouteGradients, SigmoidAuxLossOnAHandWorkedCase) {
  std::vector<float> scores = {0.8f, 0.4f, 0.6f, 0.2f, 0.2f, 0.6f, 0.1f, 0.1f}, coef(4);
  std::vector<int32_t> ids = {0, 1, 1, 3};
  const double aux = moe_aux(f32(coef, {1, 4}), f32(scores, {2, 4}), i32(ids, {2, 2}), MoEScoring::Sigmoid);
  EXPECT_NEAR(aux, 1.2, 1e-6);
  std::vector<float> d(8, 1.0f);  // added to
  ops::moe_aux_loss_backward(f32(d, {2, 4}), f32(coef, {1, 4}), f32(scores, {2, 4}), MoEScoring::Sigmoid, 2.0f);
  const std::vector<double> want = {0.025, 0.275, -0.225, 0.025, -0.25, 0.25, -0.75, -0.25};
  for (size_t i = 0; i < 8; ++i) EXPECT_NEAR(d[i], 1.0 + 2.0 * want[i], 1e-6) << i;
  // Softmax scores are used as they are (these rows do not sum to 1, which shows it).
  const double raw = moe_aux(f32(coef, {1, 4}), f32(scores, {2, 4}), i32(ids, {2, 2}), MoEScoring::Softmax);
  EXPECT_NEAR(raw, 1.65, 1e-6);
}

// ---- permutation ------------------------------------------------------------------------
TEST(MoEPermute, GroupsByExpertInTokenOrderAndRoundTrips) {
  const int64_t N = 37, k = 3, E = 7, C = 5, M = N * k;
  std::mt19937 rng(2);
  std::vector<int32_t> ids(static_cast<size_t>(M));
  for (int64_t n = 0; n < N; ++n) {
    // k distinct experts per token, never expert 4 (an expert with no tokens).
    std::vector<int32_t> pool = {0, 1, 2, 3, 5, 6};
    std::shuffle(pool.begin(), pool.end(), rng);
    for (int64_t j = 0; j < k; ++j) ids[size_t(n * k + j)] = pool[size_t(j)];
  }
  std::vector<int64_t> offsets(size_t(E + 1));
  std::vector<int32_t> sorted(static_cast<size_t>(M)), position(static_cast<size_t>(M));
  ops::moe_dispatch_plan(Tensor(offsets.data(), DType::I64, Shape{E + 1}), i32(sorted, {M}), i32(position, {M}),
                         i32(ids, {N, k}));
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(offsets[size_t(E)], M);
  EXPECT_EQ(offsets[4], offsets[5]);
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int32_t id : ids) count += id == e;
    EXPECT_EQ(offsets[size_t(e + 1)] - offsets[size_t(e)], count) << "expert " << e;
    for (int64_t p = offsets[size_t(e)]; p < offsets[size_t(e + 1)]; ++p) {
      EXPECT_EQ(ids[size_t(sorted[size_t(p)])], e) << "row " << p;
      if (p > offsets[size_t(e)]) {
        EXPECT_LT(sorted[size_t(p - 1)], sorted[size_t(p)]) << "token order, row " << p;
      }
    }
  }
  for (int64_t i = 0; i < M; ++i) EXPECT_EQ(sorted[size_t(position[size_t(i)])], i);

  std::vector<float> x = normal(size_t(N * C), rng), xg(size_t(M * C)), w = normal(size_t(M), rng);
  ops::moe_permute(f32(xg, {M, C}), f32(x, {N, C}), i32(sorted, {M}), int(k));
  for (int64_t p = 0; p < M; ++p)
    for (int64_t c = 0; c < C; ++c) ASSERT_EQ(xg[size_t(p * C + c)], x[size_t(sorted[size_t(p)] / k * C + c)]);
  // Round trip: out = sum_slots w * x, in slot order.
  std::vector<float> out(size_t(N * C), 1.0f);
  ops::moe_unpermute(f32(out, {N, C}), f32(xg, {M, C}), f32(w, {N, k}), i32(position, {M}));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t c = 0; c < C; ++c) {
      float acc = 0;
      for (int64_t j = 0; j < k; ++j) acc += w[size_t(n * k + j)] * x[size_t(n * C + c)];
      ASSERT_NEAR(out[size_t(n * C + c)], 1.0f + acc, 1e-6) << n << "," << c;
    }
  // The backwards are the adjoints: <permute(x), G> = <x, permute_backward(G)>, and the
  // unpermute backward gives <dout, d unpermute> for each input.
  std::vector<float> G = normal(size_t(M * C), rng), dx(size_t(N * C), 5.0f), dout = normal(size_t(N * C), rng);
  ops::moe_permute_backward(f32(dx, {N, C}), f32(G, {M, C}), i32(position, {M}), false);
  EXPECT_NEAR(dot(xg, G), dot(x, dx), 1e-4);
  std::vector<float> dyg(size_t(M * C)), dw(static_cast<size_t>(M));
  ops::moe_unpermute_backward(f32(dyg, {M, C}), f32(dw, {N, k}), f32(dout, {N, C}), f32(G, {M, C}), f32(w, {N, k}),
                              i32(sorted, {M}));
  std::vector<float> y(size_t(N * C), 0.0f);
  ops::moe_unpermute(f32(y, {N, C}), f32(G, {M, C}), f32(w, {N, k}), i32(position, {M}));
  EXPECT_NEAR(dot(y, dout), dot(dyg, G), 1e-4);  // linear in yg
  EXPECT_NEAR(dot(y, dout), dot(dw, w), 1e-4);   // and in the weights
}

// ---- the MoE layer ----------------------------------------------------------------------
struct BlockCase {
  const char* name;
  std::string scoring, method;
  int64_t experts, n_group, topk_group, shared;
  bool seq_aux, norm;
  double rsf;
};

void PrintTo(const BlockCase& c, std::ostream* os) { *os << c.name; }

ModelConfig block_config(const BlockCase& bc, int64_t C = 12, int64_t I = 5, int64_t k = 2) {
  ModelConfig c;
  c.model_type = "deepseek_v2";
  c.hidden_size = C;
  c.n_routed_experts = bc.experts;
  c.n_shared_experts = bc.shared;
  c.num_experts_per_tok = k;
  c.moe_intermediate_size = I;
  c.scoring_func = bc.scoring;
  c.topk_method = bc.method;
  c.n_group = bc.n_group;
  c.topk_group = bc.topk_group;
  c.norm_topk_prob = bc.norm;
  c.routed_scaling_factor = bc.rsf;
  c.aux_loss_alpha = 0.3;  // large, so the aux gradient is visible next to the main one
  c.seq_aux = bc.seq_aux;
  return c;
}

// A layer with its own registry: experts normal(0, 0.4), a router whose logits spread
// widely (so small perturbations rarely change the choice), a nonzero routing bias.
struct Layer {
  ModelConfig config;
  ParamRegistry reg;
  std::unique_ptr<MoEBlock> block;
  Scratch scratch;
  ActivationStore acts;
  WeightGradStore wgrad;
  Ctx ctx;
  Layer(const ModelConfig& c, uint64_t seed) : config(c) {
    ctx.acts = &acts;
    ctx.wgrad = &wgrad;
    ctx.scratch = &scratch;
    block = std::make_unique<MoEBlock>(c, ShardSpec::whole(c), reg, 0);
    reg.allocate(Device::cpu());
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      if (p.kind == ParamKind::RouterBias) {
        float* b = reg.param(id).data<float>();
        for (int64_t e = 0; e < p.numel(); ++e) b[e] = 0.15f * float(std::sin(3.0 * double(e) + 1.0));
      } else {
        const bool router = p.name.find("mlp.gate.weight") != std::string::npos;
        fill_normal(reg.param(id), router ? 1.0 : 0.4, seed, stream_id(p.name));
      }
    }
    LossScales s;
    s.sequence = 0.5;  // 1 / B with B = 2
    s.micro_batch = 1.0;
    block->set_loss_scales(s);
  }
  // <out, R> + the layer's aux loss; out starts from zero.
  double loss(std::vector<float>& x, const std::vector<float>& R, int64_t B, int64_t T) {
    const int64_t C = config.hidden_size;
    std::vector<float> out(x.size(), 0.0f);
    block->routing()->reset();
    block->forward(ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
    return dot(out, R) + block->routing()->aux_loss;
  }
  // Each token's experts that computed its row: the chosen ones, less those dropped by capacity.
  std::vector<std::set<int32_t>> chosen() {
    Tensor ids = block->ids(acts, 0);
    const int32_t* pos = block->positions(acts, 0).data<int32_t>();
    const int64_t N = ids.size(0), k = ids.size(1);
    std::vector<std::set<int32_t>> s(static_cast<size_t>(N));
    for (int64_t i = 0; i < N * k; ++i)
      if (pos[i] >= 0) s[size_t(i / k)].insert(ids.data<int32_t>()[i]);
    return s;
  }
};

// |grad - fd| / max |grad| of the tensor: measured at most 4.9e-4 (fp32 forwards).
constexpr double kBlockGradTol = 1.5e-3;

// The layer's gradients (of x, the router, the routed and shared experts) against finite
// differences of its loss, samples whose routing (or dropping) flips skipped; `label` names it.
// Returns the rows an expert capacity dropped in the unperturbed forward.
int64_t expect_block_gradients_match_fd(const ModelConfig& config, const std::string& label) {
  const OneThread one_thread;
  const int64_t B = 2, T = 5, C = 12, N = B * T;
  Layer L(config, 21);
  std::mt19937 rng(4);
  std::vector<float> x = normal(size_t(N * C), rng);
  int64_t dropped = 0;
  // Two losses: the full one, and the aux term alone (R = 0), whose gradient reaches only the
  // router and x and would otherwise hide under the tolerance of the main term.
  for (bool aux_only : {false, true}) {
    std::vector<float> R = aux_only ? std::vector<float>(size_t(N * C), 0.0f) : normal(size_t(N * C), rng);
    L.reg.grads().zero();
    L.loss(x, R, B, T);
    dropped = L.block->routing()->dropped_rows;
    const auto routing0 = L.chosen();
    std::vector<float> dx(size_t(N * C), 7.0f);  // overwritten, not accumulated
    L.block->backward(L.ctx, 0, f32(x, {B, T, C}), f32(R, {B, T, C}), f32(dx, {B, T, C}));
    const double h = 1e-2;
    int checked = 0, skipped = 0;
    // Central differences at element i of v with steps h and h/2, combined by Richardson
    // extrapolation (truncation O(h^4)), over the steps fp32 really took; false when the
    // routing changed.
    auto fd = [&](float* v, int64_t i, double* out) {
      bool same = true;
      *out = richardson_fd(v, i, h, [&] {
        const double l = L.loss(x, R, B, T);
        same = same && L.chosen() == routing0;
        return l;
      });
      return same;
    };
    auto check = [&](const std::string& what, float* v, const float* g, int64_t n, int samples) {
      double gmax = 1e-6, err = 0;
      for (int64_t i = 0; i < n; ++i) gmax = std::max(gmax, double(std::fabs(g[i])));
      std::mt19937 pick(9);
      for (int s = 0; s < std::min<int64_t>(samples, n); ++s) {
        const int64_t i = n <= samples ? s : int64_t(pick() % uint32_t(n));
        double d;
        if (!fd(v, i, &d)) {
          ++skipped;
          continue;
        }
        ++checked;
        err = std::max(err, std::fabs(g[i] - d) / gmax);
        EXPECT_NEAR(g[i], d, kBlockGradTol * gmax) << what << "[" << i << "]";
      }
      return err;
    };
    double err_x = check("x", x.data(), dx.data(), N * C, int(N * C));
    double err_router = 0, err_experts = 0, err_shared = 0;
    for (int id = 0; id < L.reg.size(); ++id) {
      const ParamInfo& p = L.reg.info(id);
      if (!p.trainable) {
        const float* g = L.reg.grad(id).data<float>();
        for (int64_t i = 0; i < p.numel(); ++i) EXPECT_EQ(g[i], 0.0f) << p.name;
        continue;
      }
      const double e = check(p.name, L.reg.param(id).data<float>(), L.reg.grad(id).data<float>(), p.numel(), 16);
      if (p.name.find("mlp.gate.") != std::string::npos) err_router = std::max(err_router, e);
      if (p.name.find("mlp.experts.") != std::string::npos) err_experts = std::max(err_experts, e);
      if (p.name.find("mlp.shared_experts.") != std::string::npos) err_shared = std::max(err_shared, e);
    }
    std::printf("[ MoE FD ] %-26s %s: max |grad - fd| / max|grad|: x %.1e router %.1e experts %.1e shared %.1e "
                "(%d checked, %d skipped: routing flipped)\n",
                label.c_str(), aux_only ? "aux only " : "full loss", err_x, err_router, err_experts, err_shared, checked,
                skipped);
    EXPECT_LT(skipped * 10, checked) << "too many samples changed the routing";
  }
  return dropped;
}

class MoEBlockGradients : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MoEBlockGradients, MatchFiniteDifferences) {
  const BlockCase bc = GetParam();
  expect_block_gradients_match_fd(block_config(bc), bc.name);
}

const BlockCase kBlockCases[] = {
    {"softmax_greedy_seq_aux", "softmax", "greedy", 6, 1, 1, 1, true, false, 1.5},
    {"softmax_group_limited_batch_aux", "softmax", "group_limited_greedy", 8, 4, 2, 2, false, true, 1.0},
    {"sigmoid_noaux_tc_groups", "sigmoid", "noaux_tc", 8, 4, 2, 1, true, true, 2.5},
    {"sigmoid_noaux_tc_no_shared", "sigmoid", "noaux_tc", 8, 2, 1, 0, false, false, 2.5},
};

INSTANTIATE_TEST_SUITE_P(Configs, MoEBlockGradients, ::testing::ValuesIn(kBlockCases),
                         [](const auto& tp) { return std::string(tp.param.name); });

// Naive forward, token by token in double: router, reference routing, each chosen expert
// applied to the token alone, shared experts, aux loss.
class MoEBlockForward : public ::testing::TestWithParam<BlockCase> {};

TEST_P(MoEBlockForward, MatchesNaivePerTokenDouble) {
  const BlockCase bc = GetParam();
  const int64_t B = 2, T = 5, C = 12, I = 5, k = 2, N = B * T;
  Layer L(block_config(bc), 5);
  const ModelConfig& c = L.config;
  const int64_t E = c.n_routed_experts, S = c.moe_intermediate_size * c.n_shared_experts;
  std::mt19937 rng(6);
  std::vector<float> x = normal(size_t(N * C), rng), out = normal(size_t(N * C), rng);
  const std::vector<float> out0 = out;
  L.block->routing()->reset();
  L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));

  auto P = [&](const std::string& name) { return L.reg.param(L.reg.find("model.layers.0.mlp." + name)).data<float>(); };
  // y = down(silu(gate x) * up x) for one token.
  auto mlp = [&](const float* g, const float* u, const float* d, int64_t inter, const float* xt, double* y) {
    std::vector<double> hid(static_cast<size_t>(inter));
    for (int64_t i = 0; i < inter; ++i) {
      double a = 0, b = 0;
      for (int64_t cc = 0; cc < C; ++cc) {
        a += double(g[i * C + cc]) * xt[cc];
        b += double(u[i * C + cc]) * xt[cc];
      }
      hid[size_t(i)] = a / (1.0 + std::exp(-a)) * b;
    }
    for (int64_t cc = 0; cc < C; ++cc) {
      double s = 0;
      for (int64_t i = 0; i < inter; ++i) s += double(d[cc * inter + i]) * hid[size_t(i)];
      y[cc] += s;
    }
  };
  ops::MoERouteParams p = L.block->route_params();
  std::vector<double> bias(size_t(E), 0.0);
  if (L.block->bias_param() >= 0)
    for (int64_t e = 0; e < E; ++e) bias[size_t(e)] = L.reg.param(L.block->bias_param()).data<float>()[e];
  const int64_t G = bc.seq_aux ? B : 1, Tg = N / G;
  std::vector<double> count(size_t(G * E)), Pmean(size_t(G * E));
  double worst = 0;
  const int32_t* ids = L.block->ids(L.acts, 0).data<int32_t>();
  for (int64_t n = 0; n < N; ++n) {
    const float* xt = x.data() + n * C;
    std::vector<float> logit(static_cast<size_t>(E));
    std::vector<double> logit_d(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      for (int64_t cc = 0; cc < C; ++cc) logit_d[size_t(e)] += double(P("gate.weight")[e * C + cc]) * xt[cc];
      logit[size_t(e)] = float(logit_d[size_t(e)]);
    }
    const std::vector<double> s = ref_scores(logit.data(), int(E), c.scoring_func == "sigmoid" ? MoEScoring::Sigmoid
                                                                                              : MoEScoring::Softmax);
    const RefRoute r = ref_route(s, bias, p);
    for (int64_t j = 0; j < k; ++j) ASSERT_EQ(ids[n * k + j], r.ids[size_t(j)]) << "token " << n;
    std::vector<double> y(static_cast<size_t>(C), 0.0), routed(static_cast<size_t>(C), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      std::vector<double> ye(static_cast<size_t>(C), 0.0);
      const std::string ex = fmt::format("experts.{}.", r.ids[size_t(j)]);
      mlp(P(ex + "gate_proj.weight"), P(ex + "up_proj.weight"), P(ex + "down_proj.weight"), I, xt, ye.data());
      for (int64_t cc = 0; cc < C; ++cc) routed[size_t(cc)] += r.weights[size_t(j)] * ye[size_t(cc)];
    }
    if (S > 0) {
      mlp(P("shared_experts.gate_proj.weight"), P("shared_experts.up_proj.weight"), P("shared_experts.down_proj.weight"),
          S, xt, y.data());
    }
    for (int64_t cc = 0; cc < C; ++cc) {
      const double ref = out0[size_t(n * C + cc)] + routed[size_t(cc)] + y[size_t(cc)];
      worst = std::max(worst, std::fabs(out[size_t(n * C + cc)] - ref) / std::max(1.0, std::fabs(ref)));
    }
    for (int64_t j = 0; j < k; ++j) count[size_t((n / Tg) * E + r.ids[size_t(j)])] += 1;
    // The balance loss's affinities: sigmoid scores normalised per token (DeepSeek-V3 eq. 19).
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += s[size_t(e)];
    if (c.scoring_func != "sigmoid") sum = 1.0;
    for (int64_t e = 0; e < E; ++e) Pmean[size_t((n / Tg) * E + e)] += s[size_t(e)] / sum / double(Tg);
  }
  double aux = 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < E; ++e)
      aux += count[size_t(g * E + e)] / (double(Tg * k) / double(E)) * Pmean[size_t(g * E + e)];
  aux *= c.aux_loss_alpha * (bc.seq_aux ? 0.5 : 1.0);
  const double aux_err = std::fabs(L.block->routing()->aux_loss - aux) / aux;
  std::printf("[ MoE fwd ] %-26s max relative error of out %.1e, of the aux loss %.1e\n", bc.name, worst, aux_err);
  EXPECT_LT(worst, 1e-5);
  EXPECT_LT(aux_err, 1e-5);
  // Token counts match and accumulate over forwards until reset.
  const std::vector<int64_t> tpe = L.block->routing()->tokens_per_expert;
  for (int64_t e = 0; e < E; ++e) {
    double total = 0;
    for (int64_t g = 0; g < G; ++g) total += count[size_t(g * E + e)];
    EXPECT_EQ(double(tpe[size_t(e)]), total);
  }
  L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  for (int64_t e = 0; e < E; ++e) EXPECT_EQ(L.block->routing()->tokens_per_expert[size_t(e)], 2 * tpe[size_t(e)]);
  EXPECT_NEAR(L.block->routing()->aux_loss, 2 * aux, 1e-5 * aux);
}

INSTANTIATE_TEST_SUITE_P(Configs, MoEBlockForward, ::testing::ValuesIn(kBlockCases),
                         [](const auto& tp) { return std::string(tp.param.name); });

// ---- expert capacity (token dropping) --------------------------------------------------
// The (token, slot) pairs an expert capacity drops, from the definition: each expert's pairs in
// token order; past `capacity` of them, keep the largest weights (equal ones: the earlier token)
// or, by position, the first ones. dropped[n*k + slot].
std::vector<char> ref_dropped(const int32_t* ids, const float* w, int64_t N, int64_t k, int64_t E, int64_t capacity,
                              bool by_probs) {
  std::vector<char> dropped(size_t(N * k), 0);
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t> pairs;
    for (int64_t i = 0; i < N * k; ++i)
      if (ids[i] == e) pairs.push_back(i);
    if (int64_t(pairs.size()) <= capacity) continue;
    std::vector<int64_t> order = pairs;
    if (by_probs) std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return w[a] > w[b]; });
    for (size_t r = size_t(capacity); r < order.size(); ++r) dropped[size_t(order[r])] = 1;
  }
  return dropped;
}

TEST(MoECapacityPlan, KeepsTheLargestWeightsOrTheEarliestTokens) {
  // 6 tokens, k = 1, E = 2: expert 0 chosen by tokens 0, 1, 3, 4, 5 (weights .1 .5 .5 .2 .7),
  // expert 1 by token 2.
  const int64_t N = 6, E = 2, M = N;
  std::vector<int32_t> ids = {0, 0, 1, 0, 0, 0};
  std::vector<float> w = {0.1f, 0.5f, 0.9f, 0.5f, 0.2f, 0.7f};
  struct Want {
    int64_t capacity;
    ops::MoEDropPolicy policy;
    std::vector<int32_t> kept_pairs;  // in grouped order
  };
  const Want wants[] = {
      {2, ops::MoEDropPolicy::Probs, {1, 5, 2}},     // .7 and the earlier of the two .5
      {3, ops::MoEDropPolicy::Probs, {1, 3, 5, 2}},  // both .5, in token order
      {2, ops::MoEDropPolicy::Position, {0, 1, 2}},
      {5, ops::MoEDropPolicy::Probs, {0, 1, 3, 4, 5, 2}},  // nobody over capacity: the plan as it was
  };
  for (const Want& want : wants) {
    std::vector<int64_t> offsets(size_t(E + 1)), kept(size_t(E + 1));
    std::vector<int32_t> sorted(static_cast<size_t>(M)), position(static_cast<size_t>(M));
    ops::moe_dispatch_plan(Tensor(offsets.data(), DType::I64, Shape{E + 1}), i32(sorted, {M}), i32(position, {M}),
                           i32(ids, {N, 1}));
    const std::vector<int32_t> plan_sorted = sorted, plan_position = position;
    ops::moe_capacity_plan(Tensor(kept.data(), DType::I64, Shape{E + 1}), i32(sorted, {M}), i32(position, {M}),
                           Tensor(offsets.data(), DType::I64, Shape{E + 1}), f32(w, {N, 1}), want.capacity,
                           want.policy);
    const int64_t R = int64_t(want.kept_pairs.size());
    const int64_t kept0 = std::min<int64_t>(want.capacity, 5);
    EXPECT_EQ(kept, (std::vector<int64_t>{0, kept0, kept0 + 1})) << "capacity " << want.capacity;
    EXPECT_EQ(std::vector<int32_t>(sorted.begin(), sorted.begin() + R), want.kept_pairs) << "capacity " << want.capacity;
    for (int64_t p = R; p < M; ++p) EXPECT_EQ(sorted[size_t(p)], -1);
    for (int64_t i = 0; i < M; ++i) {
      const auto at = std::find(want.kept_pairs.begin(), want.kept_pairs.end(), int32_t(i));
      EXPECT_EQ(position[size_t(i)], at == want.kept_pairs.end() ? -1 : int32_t(at - want.kept_pairs.begin()))
          << "pair " << i << ", capacity " << want.capacity;
    }
    if (R == M) {
      EXPECT_EQ(sorted, plan_sorted);
      EXPECT_EQ(position, plan_position);
    }
  }
}

// Token dropping of the layer: a block case with a capacity factor and drop policy.
struct CapacityCase {
  const char* name;
  BlockCase block;
  const char* policy;
  double factor;
};

void PrintTo(const CapacityCase& c, std::ostream* os) { *os << c.name; }

ModelConfig capacity_config(const CapacityCase& cc) {
  ModelConfig c = block_config(cc.block);
  c.moe_capacity_factor = cc.factor;
  c.moe_drop_policy = cc.policy;
  return c;
}

// Forward and backward of one micro-batch: out, dx and every gradient, flattened.
std::vector<float> forward_backward(Layer& L, const std::vector<float>& x0, const std::vector<float>& R0, int64_t B,
                                    int64_t T) {
  const int64_t C = L.config.hidden_size;
  std::vector<float> x = x0, r = R0, out(x0.size(), 0.0f), dx(x0.size(), 0.0f);
  L.reg.grads().zero();
  L.block->routing()->reset();
  L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  L.block->backward(L.ctx, 0, f32(x, {B, T, C}), f32(r, {B, T, C}), f32(dx, {B, T, C}));
  std::vector<float> all = out;
  all.insert(all.end(), dx.begin(), dx.end());
  all.insert(all.end(), L.reg.grads().data<float>(), L.reg.grads().data<float>() + L.reg.flat_numel());
  return all;
}

// A capacity that no expert exceeds changes no bit: the largest load exactly at capacity.
TEST(MoECapacity, AtOrAboveEveryLoadChangesNothing) {
  const int64_t B = 2, T = 8, C = 12, N = B * T, k = 2;
  for (const BlockCase& bc : kBlockCases) {
    const int64_t E = bc.experts, M = N * k;
    std::mt19937 rng(8);
    const std::vector<float> x = normal(size_t(N * C), rng), R = normal(size_t(N * C), rng);
    Layer plain(block_config(bc), 13);
    const std::vector<float> want = forward_backward(plain, x, R, B, T);
    const RoutingStats want_stats = *plain.block->routing();
    const int64_t max_load = *std::max_element(want_stats.tokens_per_expert.begin(), want_stats.tokens_per_expert.end());
    // ceil(M / E * f) = max_load exactly, and a factor far above it.
    for (double factor : {(double(max_load) - 0.5) * double(E) / double(M), double(E)}) {
      ModelConfig c = block_config(bc);
      c.moe_capacity_factor = factor;
      for (const char* policy : {"probs", "position"}) {
        c.moe_drop_policy = policy;
        Layer capped(c, 13);
        const std::vector<float> got = forward_backward(capped, x, R, B, T);
        const RoutingStats& s = *capped.block->routing();
        EXPECT_EQ(0, std::memcmp(got.data(), want.data(), want.size() * sizeof(float)))
            << bc.name << " factor " << factor << " " << policy;
        EXPECT_EQ(s.dropped_rows, 0) << bc.name;
        EXPECT_EQ(s.tokens_per_expert, want_stats.tokens_per_expert) << bc.name;
        EXPECT_EQ(s.aux_loss, want_stats.aux_loss) << bc.name;
        EXPECT_EQ(s.received_rows, M) << bc.name;
      }
    }
  }
}

class MoECapacity : public ::testing::TestWithParam<CapacityCase> {};

// The dropped pairs are those of the definition, no expert computes more than capacity rows,
// and the output is the naive per-token one with the dropped pairs' weights zeroed; the loads
// and the aux loss stay the router's.
TEST_P(MoECapacity, DropsThePairsOverCapacity) {
  const CapacityCase cc = GetParam();
  const int64_t B = 2, T = 5, C = 12, I = 5, k = 2, N = B * T, M = N * k;
  Layer L(capacity_config(cc), 5);
  const ModelConfig& c = L.config;
  const int64_t E = c.n_routed_experts, S = c.moe_intermediate_size * c.n_shared_experts;
  const int64_t capacity = int64_t(std::ceil(double(M) / double(E) * cc.factor));
  std::mt19937 rng(6);
  std::vector<float> x = normal(size_t(N * C), rng), out = normal(size_t(N * C), rng);
  const std::vector<float> out0 = out;
  L.block->routing()->reset();
  L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  const RoutingStats stats = *L.block->routing();

  const int32_t* ids = L.block->ids(L.acts, 0).data<int32_t>();
  const float* w = L.block->weights(L.acts, 0).data<float>();
  const bool by_probs = std::string(cc.policy) == "probs";
  const std::vector<char> dropped = ref_dropped(ids, w, N, k, E, capacity, by_probs);
  const int64_t n_dropped = std::count(dropped.begin(), dropped.end(), 1);
  ASSERT_GT(n_dropped, 0) << "the case must drop rows";
  // The policies choose differently here, so that the case tells them apart.
  EXPECT_NE(ref_dropped(ids, w, N, k, E, capacity, !by_probs), dropped) << "both policies drop the same pairs";
  EXPECT_EQ(stats.dropped_rows, n_dropped);
  EXPECT_EQ(stats.received_rows, M - n_dropped);
  const int32_t* pos = L.block->positions(L.acts, 0).data<int32_t>();
  const int64_t* off = L.block->offsets(L.acts, 0).data<int64_t>();
  for (int64_t i = 0; i < M; ++i) EXPECT_EQ(pos[i] < 0, bool(dropped[size_t(i)])) << "pair " << i;
  for (int64_t e = 0; e < E; ++e) {
    int64_t load = 0;
    for (int64_t i = 0; i < M; ++i) load += ids[i] == e;
    EXPECT_EQ(stats.tokens_per_expert[size_t(e)], load) << "expert " << e << ": the router's load";
    EXPECT_LE(off[e + 1] - off[e], capacity) << "expert " << e;
    EXPECT_EQ(off[e + 1] - off[e], std::min(load, capacity)) << "expert " << e;
  }
  // The aux loss of the same layer without a capacity: the same.
  Layer plain(block_config(cc.block), 5);
  std::vector<float> out_plain(size_t(N * C), 0.0f);
  plain.block->routing()->reset();
  plain.block->forward(plain.ctx, 0, f32(x, {B, T, C}), f32(out_plain, {B, T, C}));
  EXPECT_EQ(stats.aux_loss, plain.block->routing()->aux_loss);

  // Naive, in double: shared experts plus the kept pairs' weighted experts.
  auto P = [&](const std::string& name) { return L.reg.param(L.reg.find("model.layers.0.mlp." + name)).data<float>(); };
  auto mlp = [&](const float* g, const float* u, const float* d, int64_t inter, const float* xt, double* y, double s) {
    std::vector<double> hid(static_cast<size_t>(inter));
    for (int64_t i = 0; i < inter; ++i) {
      double a = 0, b = 0;
      for (int64_t cc2 = 0; cc2 < C; ++cc2) {
        a += double(g[i * C + cc2]) * xt[cc2];
        b += double(u[i * C + cc2]) * xt[cc2];
      }
      hid[size_t(i)] = a / (1.0 + std::exp(-a)) * b;
    }
    for (int64_t cc2 = 0; cc2 < C; ++cc2) {
      double v = 0;
      for (int64_t i = 0; i < inter; ++i) v += double(d[cc2 * inter + i]) * hid[size_t(i)];
      y[cc2] += s * v;
    }
  };
  double worst = 0, worst_plain = 0;
  for (int64_t n = 0; n < N; ++n) {
    const float* xt = x.data() + n * C;
    std::vector<double> y(static_cast<size_t>(C), 0.0);
    for (int64_t j = 0; j < k; ++j) {
      const double weight = dropped[size_t(n * k + j)] ? 0.0 : double(w[n * k + j]);
      const std::string ex = fmt::format("experts.{}.", ids[n * k + j]);
      mlp(P(ex + "gate_proj.weight"), P(ex + "up_proj.weight"), P(ex + "down_proj.weight"), I, xt, y.data(), weight);
    }
    if (S > 0) {
      mlp(P("shared_experts.gate_proj.weight"), P("shared_experts.up_proj.weight"),
          P("shared_experts.down_proj.weight"), S, xt, y.data(), 1.0);
    }
    for (int64_t cc2 = 0; cc2 < C; ++cc2) {
      const double ref = out0[size_t(n * C + cc2)] + y[size_t(cc2)];
      worst = std::max(worst, std::fabs(out[size_t(n * C + cc2)] - ref) / std::max(1.0, std::fabs(ref)));
      worst_plain = std::max(worst_plain, std::fabs(double(out_plain[size_t(n * C + cc2)]) -
                                                    (ref - out0[size_t(n * C + cc2)])));
    }
  }
  std::printf("[ MoE cap ] %-34s capacity %ld: %ld of %ld rows dropped, max relative error of out %.1e\n", cc.name,
              long(capacity), long(n_dropped), long(M), worst);
  EXPECT_LT(worst, 1e-5);
  EXPECT_GT(worst_plain, 1e-3) << "dropping must change the output";
  // The count accumulates over forwards until reset.
  L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  EXPECT_EQ(L.block->routing()->dropped_rows, 2 * n_dropped);
  L.block->routing()->reset();
  EXPECT_EQ(L.block->routing()->dropped_rows, 0);
}

// Gradients of the layer with dropping against finite differences of its loss (a dropped pair
// adds nothing, so its weight and its expert get no gradient from it).
TEST_P(MoECapacity, GradientsMatchFiniteDifferences) {
  const CapacityCase cc = GetParam();
  EXPECT_GT(expect_block_gradients_match_fd(capacity_config(cc), cc.name), 0) << "the case must drop rows";
}

const CapacityCase kCapacityCases[] = {
    {"softmax_greedy_seq_aux_probs", kBlockCases[0], "probs", 1.0},
    {"softmax_greedy_seq_aux_position", kBlockCases[0], "position", 1.0},
    {"softmax_group_limited_probs", kBlockCases[1], "probs", 1.0},
    {"sigmoid_noaux_tc_groups_probs", kBlockCases[2], "probs", 1.0},
    {"sigmoid_noaux_tc_groups_position", kBlockCases[2], "position", 1.0},
    {"sigmoid_noaux_tc_no_shared_position", kBlockCases[3], "position", 0.5},
};

INSTANTIATE_TEST_SUITE_P(Configs, MoECapacity, ::testing::ValuesIn(kCapacityCases),
                         [](const auto& tp) { return std::string(tp.param.name); });

TEST(MoEBlock, RegistersHuggingFaceNames) {
  ModelConfig c = block_config(kBlockCases[2]);
  ParamRegistry reg;
  MoEBlock block(c, ShardSpec::whole(c), reg, 3);
  const int bias = reg.find("model.layers.3.mlp.gate.e_score_correction_bias");
  ASSERT_GE(bias, 0);
  EXPECT_EQ(reg.info(bias).kind, ParamKind::RouterBias);
  EXPECT_FALSE(reg.info(bias).trainable);
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.gate.weight")).shape, (Shape{8, 12}));
  const ParamInfo& g = reg.info(reg.find("model.layers.3.mlp.experts.7.gate_proj.weight"));
  const ParamInfo& u = reg.info(reg.find("model.layers.3.mlp.experts.7.up_proj.weight"));
  EXPECT_EQ(u.offset, g.offset + g.numel());  // one (2I, C) matrix
  // Routed experts are reduced over the expert data-parallel group; the router and the
  // shared experts with the dense parameters.
  EXPECT_EQ(g.group, ParamGroup::Expert);
  EXPECT_EQ(u.group, ParamGroup::Expert);
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.experts.7.down_proj.weight")).group, ParamGroup::Expert);
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.gate.weight")).group, ParamGroup::Dense);
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.shared_experts.up_proj.weight")).group, ParamGroup::Dense);
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.experts.7.down_proj.weight")).shape, (Shape{12, 5}));
  EXPECT_EQ(reg.info(reg.find("model.layers.3.mlp.shared_experts.up_proj.weight")).shape, (Shape{5, 12}));
  ParamRegistry v2;
  MoEBlock greedy(block_config(kBlockCases[0]), ShardSpec::whole(block_config(kBlockCases[0])), v2, 0);
  EXPECT_EQ(v2.find("model.layers.0.mlp.gate.e_score_correction_bias"), -1);
  ParamRegistry none;
  MoEBlock no_shared(block_config(kBlockCases[3]), ShardSpec::whole(block_config(kBlockCases[3])), none, 0);
  EXPECT_EQ(none.find("model.layers.0.mlp.shared_experts.gate_proj.weight"), -1);
}

TEST(MoEBlock, RoutingBiasUpdate) {
  Layer L(block_config(kBlockCases[2]), 1);
  float* b = L.reg.param(L.block->bias_param()).data<float>();
  const std::vector<float> before(b, b + 8);
  // mean 4: under-loaded experts move up, over-loaded down, exactly balanced ones stay.
  L.block->update_routing_bias({5, 3, 4, 4, 8, 0, 4, 4}, 0.01);
  const std::vector<float> expect_delta = {-0.01f, 0.01f, 0, 0, -0.01f, 0.01f, 0, 0};
  for (size_t e = 0; e < 8; ++e) EXPECT_EQ(b[e], before[e] + expect_delta[e]) << e;
  // A mean that is not an integer (10 / 8 = 1.25).
  L.block->update_routing_bias({1, 2, 1, 1, 1, 2, 1, 1}, 0.5);
  for (size_t e = 0; e < 8; ++e) {
    const float after_first = before[e] + expect_delta[e];
    EXPECT_EQ(b[e], (e == 1 || e == 5) ? after_first - 0.5f : after_first + 0.5f) << e;
  }
  EXPECT_THROW(L.block->update_routing_bias({1, 2}, 0.1), Error);
  // Without noaux_tc there is no bias and the update does nothing.
  Layer G(block_config(kBlockCases[0]), 1);
  std::vector<float> values(G.reg.values().data<float>(), G.reg.values().data<float>() + G.reg.flat_numel());
  G.block->update_routing_bias({1, 2, 3, 4, 5, 6}, 0.1);
  EXPECT_EQ(0, std::memcmp(values.data(), G.reg.values().data(), values.size() * sizeof(float)));
}

// Whether this BLAS gives the same bits for the layer's GEMM shapes (row counts 1..N, as the
// expert groups have, forward and both backward products) at 1, 2 and 3 threads. OpenBLAS does
// on most cores; with some kernels (seen: its Prescott fallback on an unrecognised CPU) the
// tails of a thread's block round differently, and then no layer built on it can be bitwise.
bool blas_is_thread_count_invariant(int64_t n_max, int64_t K, int64_t M) {
  std::mt19937 rng(7);
  const std::vector<float> x = normal(size_t(n_max * K), rng), w = normal(size_t(M * K), rng),
                           dy = normal(size_t(n_max * M), rng);
  auto products = [&](int threads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> all;
    for (int64_t n = 1; n <= n_max; n += (n < 40 ? 1 : 37)) {
      std::vector<float> out(size_t(n * M)), dx(size_t(n * K)), dw(size_t(M * K), 0.0f);
      std::vector<float> xs(x.begin(), x.begin() + n * K), dys(dy.begin(), dy.begin() + n * M), ws = w;
      ops::linear_forward(f32(out, {n, M}), f32(xs, {n, K}), f32(ws, {M, K}));
      ops::linear_backward(f32(dx, {n, K}), f32(dw, {M, K}), f32(dys, {n, M}), f32(xs, {n, K}), f32(ws, {M, K}));
      all.insert(all.end(), out.begin(), out.end());
      all.insert(all.end(), dx.begin(), dx.end());
      all.insert(all.end(), dw.begin(), dw.end());
    }
    omp_set_num_threads(saved);
    return all;
  };
  const std::vector<float> one = products(1);
  for (int threads : {2, 3}) {
    const std::vector<float> other = products(threads);
    if (std::memcmp(one.data(), other.data(), one.size() * sizeof(float)) != 0) return false;
  }
  return true;
}

// Forward and backward of a larger layer under 1 and 2 (and 3) threads: the same bits, where the
// BLAS itself is thread-count invariant; otherwise the same up to that BLAS's rounding (and the
// routing, which is dstrain's own, still identical).
TEST(MoEBlock, BitwiseIndependentOfThreadCount) {
  BlockCase bc{"det", "sigmoid", "noaux_tc", 16, 4, 2, 1, true, true, 2.5};
  const int64_t B = 4, T = 64, C = 64, N = B * T;
  Layer L(block_config(bc, C, 32, 4), 3);
  std::mt19937 rng(1);
  const std::vector<float> x0 = normal(size_t(N * C), rng);
  std::vector<float> R = normal(size_t(N * C), rng);
  auto run = [&](int threads, std::vector<float>& out, std::vector<float>& dx, std::vector<float>& grads) {
    const int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    std::vector<float> x = x0, r = R;
    out.assign(size_t(N * C), 0.0f);
    dx.assign(size_t(N * C), 0.0f);
    L.reg.grads().zero();
    L.block->routing()->reset();
    L.block->forward(L.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
    L.block->backward(L.ctx, 0, f32(x, {B, T, C}), f32(r, {B, T, C}), f32(dx, {B, T, C}));
    grads.assign(L.reg.grads().data<float>(), L.reg.grads().data<float>() + L.reg.flat_numel());
    omp_set_num_threads(saved);
  };
  const bool bitwise = blas_is_thread_count_invariant(N, C, 2 * 32);
  if (!bitwise) std::printf("note: this BLAS rounds differently by thread count; comparing within 1e-5\n");
  // Relative to the tensor's largest magnitude: GEMM rounding, nothing more.
  auto same = [&](const std::vector<float>& a, const std::vector<float>& b, const char* what, int threads) {
    if (bitwise) {
      EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << threads << " threads: " << what;
      return;
    }
    double worst = 0, scale = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      worst = std::max(worst, std::fabs(double(a[i]) - double(b[i])));
      scale = std::max(scale, std::fabs(double(b[i])));
    }
    EXPECT_LE(worst, 1e-5 * scale) << threads << " threads: " << what;
  };
  std::vector<float> o1, d1, g1;
  run(1, o1, d1, g1);
  const std::vector<int64_t> loads1 = L.block->routing()->tokens_per_expert;
  for (int threads : {2, 3}) {
    std::vector<float> o, d, g;
    run(threads, o, d, g);
    EXPECT_EQ(L.block->routing()->tokens_per_expert, loads1) << threads << " threads: expert loads";
    same(o, o1, "out", threads);
    same(d, d1, "dx", threads);
    same(g, g1, "grads", threads);
  }
  std::vector<float> x = x0;
  EXPECT_THROW(L.block->backward(L.ctx, 0, f32(x, {B, T, C}), f32(R, {B, T, C}), f32(d1, {B, T, C})),
               Error);  // a second backward of one forward
}

}  // namespace
}  // namespace dstrain
