// Per-op checks of the CPU kernels: every backward against central finite differences of
// its forward, and attention against a naive O(T^2) reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <cstdio>
#include <functional>
#include <random>
#include <vector>

#include "finite_difference.h"
#include "backend/cpu/vec_exp.h"
#include "backend/cpu/block_products.h"
#include "backend/ops.h"
#include "optim/adamw.h"

namespace dstrain {
namespace {

struct Host {
  std::vector<float> v;
  Shape shape;
  Host(Shape s, std::mt19937& rng, float scale = 1.0f) : v(size_t(s.numel())), shape(s) {
    std::normal_distribution<float> nd(0.0f, scale);
    for (auto& x : v) x = nd(rng);
  }
  explicit Host(Shape s) : v(size_t(s.numel()), 0.0f), shape(s) {}
  Tensor t() { return Tensor(v.data(), DType::F32, shape); }
};

// max |grad - fd| / max |grad|: measured at most 1.8e-5 for the elementwise, norm, linear and
// RoPE kernels, 1.2e-4 for cross-entropy and attention (sharper curvature, larger values).
constexpr double kKernelGradTol = 6e-5, kKernelGradTolSoftmax = 4e-4;

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// Compares analytic gradient `grad` of L(x) with central differences at up to `samples`
// positions of x. L is evaluated in double from fp32 forwards, so the step is not tiny: steps
// h and h/2 are combined by Richardson extrapolation (truncation O(h^4)), over the steps fp32
// really took. The error is relative to the largest gradient element; the largest is printed.
void expect_gradient(const char* what, std::vector<float>& x, const std::vector<float>& grad,
                     const std::function<double()>& loss, double h = 1e-2, double tol = kKernelGradTol,
                     int samples = 80) {
  ASSERT_EQ(x.size(), grad.size());
  std::mt19937 pick(7);
  double gmax = 1e-6, worst = 0;
  for (float g : grad) gmax = std::max(gmax, double(std::fabs(g)));
  const int n = int(x.size());
  for (int s = 0; s < std::min(samples, n); ++s) {
    const size_t i = n <= samples ? size_t(s) : size_t(pick() % unsigned(n));
    const double fd = richardson_fd(x.data(), int64_t(i), h, loss);
    worst = std::max(worst, std::fabs(grad[i] - fd) / gmax);
    EXPECT_NEAR(grad[i], fd, tol * gmax) << what << " element " << i;
  }
  std::printf("[ kernel FD ] %-8s max |grad - fd| / max|grad| %.1e\n", what, worst);
}

TEST(Kernels, LinearGradients) {
  std::mt19937 rng(1);
  const int64_t M = 7, K = 5, N = 6;
  Host x({M, K}, rng), w({N, K}, rng), r({M, N}, rng), out({M, N});
  auto loss = [&] {
    ops::linear_forward(out.t(), x.t(), w.t());
    return dot(out.v, r.v);
  };
  Host dx({M, K}), dw({N, K});
  ops::linear_backward(dx.t(), dw.t(), r.t(), x.t(), w.t());
  expect_gradient("dx", x.v, dx.v, loss);
  expect_gradient("dw", w.v, dw.v, loss);
  // dw accumulates, dx accumulates only on request.
  ops::linear_backward(dx.t(), dw.t(), r.t(), x.t(), w.t(), /*accumulate_dx=*/true);
  Host dx1({M, K}), dw1({N, K});
  ops::linear_backward(dx1.t(), dw1.t(), r.t(), x.t(), w.t());
  for (size_t i = 0; i < dw.v.size(); ++i) EXPECT_NEAR(dw.v[i], 2 * dw1.v[i], 1e-5);
  for (size_t i = 0; i < dx.v.size(); ++i) EXPECT_NEAR(dx.v[i], 2 * dx1.v[i], 1e-5);
}

TEST(Kernels, RMSNormGradients) {
  std::mt19937 rng(2);
  const int64_t N = 5, C = 12;
  Host x({N, C}, rng), w({C}, rng), r({N, C}, rng), out({N, C}), rstd({N});
  auto loss = [&] {
    ops::rmsnorm_forward(out.t(), rstd.t(), x.t(), w.t(), 1e-5f);
    return dot(out.v, r.v);
  };
  loss();
  // Forward matches the definition.
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t c = 0; c < C; ++c) ss += double(x.v[size_t(n * C + c)]) * x.v[size_t(n * C + c)];
    const double rs = 1.0 / std::sqrt(ss / C + 1e-5);
    for (int64_t c = 0; c < C; ++c)
      EXPECT_NEAR(out.v[size_t(n * C + c)], w.v[size_t(c)] * x.v[size_t(n * C + c)] * rs, 1e-5);
  }
  Host dx({N, C}), dw({C});
  ops::rmsnorm_backward(dx.t(), dw.t(), r.t(), x.t(), w.t(), rstd.t());
  expect_gradient("dx", x.v, dx.v, loss);
  expect_gradient("dw", w.v, dw.v, loss);
}

TEST(Kernels, EmbeddingGradientsAndBounds) {
  std::mt19937 rng(3);
  const int64_t V = 9, C = 4, N = 12;
  Host table({V, C}, rng), r({N, C}, rng), out({N, C});
  std::vector<int32_t> tok(static_cast<size_t>(N));
  for (auto& t : tok) t = int32_t(rng() % V);
  tok[3] = tok[7];  // a repeated token accumulates twice
  Tensor tt(tok.data(), DType::I32, Shape{N});
  auto loss = [&] {
    ops::embedding_forward(out.t(), tt, table.t());
    return dot(out.v, r.v);
  };
  Host dtable({V, C});
  ops::embedding_backward(dtable.t(), r.t(), tt);
  expect_gradient("dtable", table.v, dtable.v, loss);
  tok[0] = int32_t(V);
  EXPECT_THROW(ops::embedding_forward(out.t(), tt, table.t()), Error);
}

TEST(Kernels, RopeIsARotationAndItsBackwardTheInverse) {
  std::mt19937 rng(4);
  const int64_t B = 2, T = 5, D = 8, W = 3 * D + 2;  // rotate 2 heads at offset 2 of a wider row
  Host cos({T, D / 2}), sin({T, D / 2});
  ops::rope_tables(cos.t(), sin.t(), int(D), 10000.0);
  Host x({B, T, W}, rng), r({B, T, W}, rng), y({B, T, W});
  auto loss = [&] {
    y.v = x.v;
    ops::rope_forward(y.t(), 2, 2, int(D), cos.t(), sin.t());
    return dot(y.v, r.v);
  };
  loss();
  // Position 0 is the identity; columns outside the rotated heads are untouched.
  for (int64_t c = 0; c < W; ++c) EXPECT_EQ(y.v[size_t(c)], x.v[size_t(c)]);
  for (int64_t bt = 0; bt < B * T; ++bt) {
    EXPECT_EQ(y.v[size_t(bt * W)], x.v[size_t(bt * W)]);
    EXPECT_EQ(y.v[size_t(bt * W + W - 1)], x.v[size_t(bt * W + W - 1)]);
  }
  // Hugging Face rotate_half at t=3, head 0, pair i=1: x1*cos - x2*sin.
  const int64_t t = 3, i = 1;
  const float ang = float(t) * (1.0f / std::pow(10000.0f, float(2 * i) / float(D)));
  const size_t base = size_t(t * W + 2);
  EXPECT_NEAR(y.v[base + i], x.v[base + i] * std::cos(ang) - x.v[base + i + D / 2] * std::sin(ang), 1e-5);
  Host g = r;
  ops::rope_backward(g.t(), 2, 2, int(D), cos.t(), sin.t());
  expect_gradient("dx", x.v, g.v, loss);
}

TEST(Kernels, SwiGLUGradients) {
  std::mt19937 rng(5);
  const int64_t N = 4, I = 6;
  Host gu({N, 2 * I}, rng, 2.0f), r({N, I}, rng), out({N, I});
  auto loss = [&] {
    ops::swiglu_forward(out.t(), gu.t());
    return dot(out.v, r.v);
  };
  loss();
  const float g = gu.v[1], u = gu.v[size_t(I + 1)];
  EXPECT_NEAR(out.v[1], g / (1 + std::exp(-g)) * u, 1e-6);
  Host dgu({N, 2 * I});
  ops::swiglu_backward(dgu.t(), r.t(), gu.t());
  expect_gradient("dgate_up", gu.v, dgu.v, loss);
}

TEST(Kernels, CrossEntropyGradientsAndIgnoreIndex) {
  std::mt19937 rng(6);
  const int64_t N = 6, V = 11;
  Host logits({N, V}, rng, 3.0f), losses({N}), lse({N});
  std::vector<int32_t> tg = {1, 0, 10, ops::kIgnoreIndex, 5, 5};
  Tensor tt(tg.data(), DType::I32, Shape{N});
  auto loss = [&] {
    ops::cross_entropy_forward(losses.t(), lse.t(), logits.t(), tt);
    double s = 0;
    for (float l : losses.v) s += l;
    return s;
  };
  loss();
  EXPECT_EQ(losses.v[3], 0.0f);
  double mx = -1e30, sum = 0;
  for (int64_t v = 0; v < V; ++v) mx = std::max(mx, double(logits.v[size_t(v)]));
  for (int64_t v = 0; v < V; ++v) sum += std::exp(logits.v[size_t(v)] - mx);
  EXPECT_NEAR(losses.v[0], mx + std::log(sum) - logits.v[1], 1e-5);
  Host dl({N, V});
  ops::cross_entropy_backward(dl.t(), logits.t(), lse.t(), tt, 1.0f);
  for (int64_t v = 0; v < V; ++v) EXPECT_EQ(dl.v[size_t(3 * V + v)], 0.0f);
  expect_gradient("dlogits", logits.v, dl.v, loss, 1e-2, kKernelGradTolSoftmax);
  // In place (dlogits aliasing logits) gives the same result.
  loss();  // lse of the unperturbed logits
  Host inplace = logits;
  ops::cross_entropy_backward(inplace.t(), inplace.t(), lse.t(), tt, 1.0f);
  for (size_t i = 0; i < dl.v.size(); ++i) EXPECT_FLOAT_EQ(inplace.v[i], dl.v[i]);
  tg[0] = int32_t(V);
  EXPECT_THROW(loss(), Error);
}

// Naive attention in double: out[b,t,h] = softmax_j<=t(q.k_j * scale) v_j.
std::vector<double> naive_attention(const std::vector<float>& qkv, const ops::AttentionLayout& L, int64_t B,
                                    int64_t T, float scale) {
  const int64_t H = L.n_head, group = L.n_head / L.n_kv_head, W = L.row_stride;
  std::vector<double> out(size_t(B * T * H * L.v_dim));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t g = h / group;
        std::vector<double> s(size_t(t + 1));
        double mx = -1e300;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int e = 0; e < L.qk_dim; ++e)
            d += double(qkv[size_t((b * T + t) * W + L.q_offset + h * L.qk_dim + e)]) *
                 qkv[size_t((b * T + j) * W + L.k_offset + g * L.qk_dim + e)];
          s[size_t(j)] = d * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        double z = 0;
        for (auto& x : s) z += (x = std::exp(x - mx));
        for (int e = 0; e < L.v_dim; ++e) {
          double acc = 0;
          for (int64_t j = 0; j <= t; ++j)
            acc += s[size_t(j)] / z * qkv[size_t((b * T + j) * W + L.v_offset + g * L.v_dim + e)];
          out[size_t(((b * T + t) * H + h) * L.v_dim + e)] = acc;
        }
      }
  return out;
}

void check_attention_once(int64_t B, int64_t T, int H, int Hkv, int Dqk, int Dv, int samples) {
  std::mt19937 rng(unsigned(T * 100 + H * 10 + Hkv));
  ops::AttentionLayout L;
  L.n_head = H;
  L.n_kv_head = Hkv;
  L.qk_dim = Dqk;
  L.v_dim = Dv;
  L.q_offset = 0;
  L.k_offset = int64_t(H) * Dqk;
  L.v_offset = L.k_offset + int64_t(Hkv) * Dqk;
  L.row_stride = L.v_offset + int64_t(Hkv) * Dv;
  const float scale = 1.0f / std::sqrt(float(Dqk));
  Host qkv({B, T, L.row_stride}, rng), out({B, T, int64_t(H) * Dv}), lse({B, H, T}), r({B, T, int64_t(H) * Dv}, rng);
  ops::attention_forward(out.t(), lse.t(), qkv.t(), L, scale);
  auto ref = naive_attention(qkv.v, L, B, T, scale);
  for (size_t i = 0; i < ref.size(); ++i) ASSERT_NEAR(out.v[i], ref[i], 1e-5) << "output " << i;
  auto loss = [&] {
    ops::attention_forward(out.t(), lse.t(), qkv.t(), L, scale);
    return dot(out.v, r.v);
  };
  loss();
  Host dqkv({B, T, L.row_stride});
  ops::fill(dqkv.t(), 123.0f);  // the backward must overwrite, not accumulate
  ops::attention_backward(dqkv.t(), r.t(), qkv.t(), out.t(), lse.t(), L, scale);
  expect_gradient("dqkv", qkv.v, dqkv.v, loss, 1e-2, kKernelGradTolSoftmax, samples);
}

// Both ways the fp32 attention forms its products: block_products.h's AVX-512 tile (on CPUs with
// AVX-512) and the sgemm calls of every other CPU, forced here so that both run on any machine.
void check_attention(int64_t B, int64_t T, int H, int Hkv, int Dqk, int Dv, int samples) {
  struct Restore {
    bool was;
    ~Restore() { cpu::f32x::set_enabled(was); }
  };
  for (bool blocks : {true, false}) {
    SCOPED_TRACE(blocks && cpu::f32x::available() ? "block products" : "sgemm calls");
    const Restore restore{cpu::f32x::set_enabled(blocks)};
    if (!blocks) EXPECT_FALSE(cpu::f32x::available()) << "switched off, the block products must not run";
    check_attention_once(B, T, H, Hkv, Dqk, Dv, samples);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(Kernels, AttentionMultiHead) { check_attention(2, 9, 2, 2, 4, 4, 120); }
TEST(Kernels, AttentionGroupedQuery) { check_attention(1, 11, 4, 2, 6, 6, 150); }
TEST(Kernels, AttentionAcrossQueryBlocks) { check_attention(1, 150, 2, 1, 4, 4, 200); }
TEST(Kernels, AttentionDifferentValueDim) { check_attention(2, 7, 2, 2, 6, 4, 120); }

float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

DS_TARGET_AVX2 void exp8_all(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, cpu::exp8(_mm256_loadu_ps(x + i)));
}

// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*: GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
DS_TARGET_AVX512 void exp16_all(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, cpu::exp16(_mm512_loadu_ps(x + i)));
}
#pragma GCC diagnostic pop

// exp1 (and exp8 and exp16, which must give the same bits) against exp in double, rounded: at most 2 ulp of
// the result (the subnormal ulp below FLT_MIN), over a sweep of every 331st fp32 value from -110
// to 90 and the special values.
TEST(Kernels, VectorExpWithinTwoUlpAndTheSameBitsOneLaneEightOrSixteen) {
  std::vector<float> xs;
  for (uint32_t b = 0; bits_to_float(b) <= 90.0f; b += 331) xs.push_back(bits_to_float(b));
  for (uint32_t b = 0x80000000u; bits_to_float(b) >= -110.0f; b += 331) xs.push_back(bits_to_float(b));
  for (float x : {0.0f, -0.0f, 1.0f, -1.0f, 88.72f, 88.73f, -87.33f, -103.9f, -104.0f, 1e-30f, -1e-30f}) xs.push_back(x);
  const float inf = std::numeric_limits<float>::infinity();
  xs.insert(xs.end(), {inf, -inf, std::numeric_limits<float>::quiet_NaN()});
  while (xs.size() % 16) xs.push_back(0.5f);
  std::vector<float> one(xs.size()), eight(xs.size()), sixteen(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) one[i] = cpu::exp1(xs[i]);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    exp8_all(xs.data(), eight.data(), xs.size());
  } else {
    std::printf("[ no AVX2  ] exp8 not run\n");
    eight = one;
  }
  if (__builtin_cpu_supports("avx512f")) {
    exp16_all(xs.data(), sixteen.data(), xs.size());
  } else {
    std::printf("[ no AVX-512 ] exp16 not run\n");
    sixteen = one;
  }
  double worst = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    const float x = xs[i];
    ASSERT_EQ(std::memcmp(&one[i], &eight[i], 4), 0) << "x = " << x << ": exp1 " << one[i] << ", exp8 " << eight[i];
    ASSERT_EQ(std::memcmp(&one[i], &sixteen[i], 4), 0) << "x = " << x << ": exp1 " << one[i] << ", exp16 " << sixteen[i];
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(one[i]));
      continue;
    }
    const double want = std::exp(double(x));
    const float wf = float(want);
    if (std::isinf(wf) || wf == 0.0f) {
      // Beyond the range, or below half the smallest subnormal: within an ulp of the edge.
      EXPECT_TRUE(one[i] == wf || std::fabs(double(one[i]) - want) <= double(std::numeric_limits<float>::denorm_min()) ||
                  (std::isinf(wf) && one[i] >= std::numeric_limits<float>::max() * 0.99999f))
          << "x = " << x << " exp1 " << one[i] << " want " << want;
      continue;
    }
    const double ulp = wf < std::numeric_limits<float>::min()
                           ? double(std::numeric_limits<float>::denorm_min())
                           : double(std::nextafter(wf, inf)) - double(wf);
    const double err = std::fabs(double(one[i]) - want) / ulp;
    worst = std::max(worst, err);
    ASSERT_LE(err, 2.0) << "x = " << x << ": exp1 " << one[i] << ", exp " << want;
  }
  std::printf("[ exp       ] %zu values, worst %.2f ulp\n", xs.size(), worst);
  EXPECT_EQ(cpu::exp1(-inf), 0.0f);
  EXPECT_EQ(cpu::exp1(inf), inf);
  EXPECT_EQ(cpu::exp1(0.0f), 1.0f);
}

// The kernels with AVX2 paths (SwiGLU, cross-entropy, attention's softmax) give the same bits
// through their scalar paths, which CPUs without AVX2 run; rows are long enough for vector loops
// and tails.
TEST(Kernels, ScalarPathsGiveTheBitsOfTheAVX2Paths) {
  if (!cpu::cpu_has_avx2()) GTEST_SKIP() << "no AVX2 on this CPU: only the scalar paths exist";
  std::mt19937 rng(21);
  const int64_t N = 5, I = 21, V = 37, B = 2, T = 70;
  Host gu({N, 2 * I}, rng, 3.0f), dh({N, I}, rng), logits({N, V}, rng, 4.0f);
  std::vector<int32_t> tg = {3, 36, ops::kIgnoreIndex, 0, 17};
  Tensor tt(tg.data(), DType::I32, Shape{N});
  ops::AttentionLayout L;
  L.n_head = 2;
  L.n_kv_head = 1;
  L.qk_dim = L.v_dim = 16;
  L.q_offset = 0;
  L.k_offset = 32;
  L.v_offset = 48;
  L.row_stride = 64;
  Host qkv({B, T, 64}, rng), dout({B, T, 32}, rng);
  auto run = [&] {
    std::vector<std::vector<float>> r;
    Host h({N, I}), dgu({N, 2 * I}), losses({N}), lse({N}), dl({N, V}), out({B, T, 32}), alse({B, 2, T}),
        dqkv({B, T, 64});
    ops::swiglu_forward(h.t(), gu.t());
    ops::swiglu_backward(dgu.t(), dh.t(), gu.t());
    ops::cross_entropy_forward(losses.t(), lse.t(), logits.t(), tt);
    ops::cross_entropy_backward(dl.t(), logits.t(), lse.t(), tt, 0.25f);
    ops::attention_forward(out.t(), alse.t(), qkv.t(), L, 0.25f);
    ops::attention_backward(dqkv.t(), dout.t(), qkv.t(), out.t(), alse.t(), L, 0.25f);
    for (Host* x : {&h, &dgu, &losses, &lse, &dl, &out, &alse, &dqkv}) r.push_back(x->v);
    return r;
  };
  const auto vec = run();
  cpu::use_avx2_kernels(false);
  const auto scalar = run();
  cpu::use_avx2_kernels(true);
  const char* names[] = {"swiglu", "dgate_up", "losses", "lse", "dlogits", "attention", "attention lse", "dqkv"};
  for (size_t k = 0; k < vec.size(); ++k) {
    ASSERT_EQ(vec[k].size(), scalar[k].size());
    EXPECT_EQ(std::memcmp(vec[k].data(), scalar[k].data(), vec[k].size() * 4), 0) << names[k];
  }
}

TEST(Kernels, SumSquaresIsExactAndOrderFixed) {
  std::vector<float> x(100000);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  double ref = 0;
  for (auto& v : x) {
    v = nd(rng);
    ref += double(v) * v;
  }
  Tensor t(x.data(), DType::F32, Shape{int64_t(x.size())});
  EXPECT_NEAR(ops::read_sum_squares(t), ref, 1e-9 * ref);
  EXPECT_EQ(ops::read_sum_squares(t), ops::read_sum_squares(t));
}

TEST(Kernels, CountNonFiniteCountsNanAndBothInfinities) {
  std::vector<float> x(50000, 1.0f);
  x[3] = NAN;
  x[40000] = INFINITY;
  x[49999] = -INFINITY;
  x[7] = std::numeric_limits<float>::max();  // large, but finite
  EXPECT_EQ(ops::read_count_non_finite(Tensor(x.data(), DType::F32, Shape{int64_t(x.size())})), 3);
  EXPECT_EQ(ops::read_count_non_finite(Tensor(x.data(), DType::F32, Shape{3})), 0);
  std::vector<double> d(4, NAN);
  EXPECT_THROW(ops::read_count_non_finite(Tensor(d.data(), DType::F64, Shape{4})), Error);
}

// torch.optim.AdamW's documented algorithm (https://pytorch.org/docs/stable/generated/torch.optim.AdamW.html;
// Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019, Algorithm 2), in double:
//   theta <- theta - lr * wd * theta;  m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   theta <- theta - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
struct AdamWReference {
  std::vector<double> p, m, v;
  explicit AdamWReference(const std::vector<float>& p0) : p(p0.begin(), p0.end()), m(p0.size()), v(p0.size()) {}
  void step(const std::vector<float>& g, double lr, double b1, double b2, double eps, double wd, int t) {
    for (size_t i = 0; i < p.size(); ++i) {
      p[i] -= lr * wd * p[i];
      m[i] = b1 * m[i] + (1 - b1) * g[i];
      v[i] = b2 * v[i] + (1 - b2) * double(g[i]) * g[i];
      const double mhat = m[i] / (1 - std::pow(b1, t)), vhat = v[i] / (1 - std::pow(b2, t));
      p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
    }
  }
};

void expect_close(const std::vector<float>& got, const std::vector<double>& want, double rel, const char* what,
                  int step) {
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], rel * (1e-3 + std::abs(want[i]))) << what << "[" << i << "] at step " << step;
}

TEST(Kernels, AdamWMatchesTheAlgorithm) {
  // Gradients that change sign and size every step, and betas far apart: with a constant
  // gradient the bias-corrected moments equal g and g^2 whatever the betas, so a swapped or
  // misplaced beta, or a wrong bias correction, would go unseen.
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const int64_t n = 9;
  std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
  for (auto& x : p) x = nd(rng);
  AdamWReference ref(p);
  ops::AdamWStep s;
  s.beta1 = 0.7f;
  s.beta2 = 0.95f;
  s.eps = 1e-6f;
  s.weight_decay = 0.3f;
  for (int t = 1; t <= 8; ++t) {
    s.step = t;
    s.lr = 0.05f / float(t);  // a schedule: each step's own rate goes into the decay and the update
    for (int64_t i = 0; i < n; ++i) g[size_t(i)] = nd(rng) * float(1 + i % 3) * (t % 2 ? 1.0f : -0.4f);
    ops::adamw_update(Tensor(p.data(), DType::F32, Shape{n}), Tensor(g.data(), DType::F32, Shape{n}),
                      Tensor(m.data(), DType::F32, Shape{n}), Tensor(v.data(), DType::F32, Shape{n}), Tensor(), s);
    ref.step(g, s.lr, s.beta1, s.beta2, s.eps, s.weight_decay, t);
    expect_close(m, ref.m, 1e-5, "exp_avg", t);
    expect_close(v, ref.v, 1e-5, "exp_avg_sq", t);
    expect_close(p, ref.p, 1e-5, "param", t);
  }
}

TEST(Kernels, AdamWUnscalesGradientsAndWritesTheWeightsCopyInOnePass) {
  // Mixed precision: gradients of a loss scaled by 2^k come in scaled; grad_scale = 2^-k undoes it
  // exactly as they are read, and the updated weights' 16-bit copy comes out of the same pass.
  // Two sizes: under one chunk, and several chunks over the threads with a partial last one.
  for (const int64_t n : {int64_t(37), int64_t(3 * 8192 + 77)}) {
    SCOPED_TRACE(n);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::vector<float> p(n), g(n), m(n, 0.0f), v(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) {
      p[size_t(i)] = nd(rng);
      g[size_t(i)] = nd(rng);
    }
    std::vector<float> p2 = p, m2 = m, v2 = v, g_scaled(n);
    for (int64_t i = 0; i < n; ++i) g_scaled[size_t(i)] = g[size_t(i)] * 4096.0f;
    std::vector<uint16_t> bf(n), hf(n);
    ops::AdamWStep s;
    s.lr = 0.01f;
    s.weight_decay = 0.1f;
    auto t = [](std::vector<float>& x) { return Tensor(x.data(), DType::F32, Shape{int64_t(x.size())}); };
    for (int step = 1; step <= 3; ++step) {
      s.step = step;
      s.grad_scale = 1.0f;
      ops::adamw_update(t(p), t(g), t(m), t(v), Tensor(), s);
      s.grad_scale = 1.0f / 4096.0f;
      ops::adamw_update(t(p2), t(g_scaled), t(m2), t(v2), Tensor(bf.data(), DType::BF16, Shape{n}), s);
      EXPECT_EQ(p2, p) << "step " << step;
      EXPECT_EQ(m2, m) << "step " << step;
      EXPECT_EQ(v2, v) << "step " << step;
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bf[size_t(i)], f32_to_bf16(p[size_t(i)])) << i;
    }
    // An f16 copy from a state already updated: one more step on each side.
    s.step = 4;
    std::vector<float> p3 = p, m3 = m, v3 = v;
    s.grad_scale = 1.0f;
    ops::adamw_update(t(p), t(g), t(m), t(v), Tensor(), s);
    s.grad_scale = 1.0f / 4096.0f;
    ops::adamw_update(t(p3), t(g_scaled), t(m3), t(v3), Tensor(hf.data(), DType::F16, Shape{n}), s);
    EXPECT_EQ(p3, p);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hf[size_t(i)], f32_to_f16(p[size_t(i)])) << i;
  }
}

TEST(Kernels, LargeCopiesInPiecesOverTheThreads) {
  // 1.3 MB: five 256 KiB pieces over the threads and a partial sixth.
  const int64_t n = 1100 * 300 + 3;
  std::vector<float> src(static_cast<size_t>(n)), dst(static_cast<size_t>(n), -1.0f);
  for (int64_t i = 0; i < n; ++i) src[size_t(i)] = float(i) * 0.5f - 7.0f;
  ops::copy(Tensor(dst.data(), DType::F32, Shape{n}), Tensor(src.data(), DType::F32, Shape{n}));
  EXPECT_EQ(dst, src);
}

TEST(Kernels, AdamWOptimizerPassesItsConfigurationToEachParameter) {
  // The optimizer over a registry: betas, eps and the step count from its configuration,
  // weight decay on linear weights only (norms are in no_decay), and routing biases (not
  // trainable) left alone.
  ParamRegistry reg;
  const int w = reg.add("w", Shape{3, 4}, ParamKind::Linear, 0);
  const int norm = reg.add("norm", Shape{4}, ParamKind::Norm, 0);
  const int bias = reg.add("bias", Shape{2}, ParamKind::RouterBias, 0, false, /*trainable=*/false);
  reg.allocate(Device::cpu());
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  float* values = reg.values().tensor().data<float>();
  float* grads = reg.grads().tensor().data<float>();
  const int64_t total = reg.values().numel();
  for (int64_t i = 0; i < total; ++i) values[i] = nd(rng);
  const std::vector<float> start(values, values + total);
  AdamWConfig c;
  c.beta1 = 0.6;
  c.beta2 = 0.9;
  c.eps = 1e-7;
  c.weight_decay = 0.2;
  AdamW opt(c, reg);
  std::vector<AdamWReference> refs;
  for (int id : {w, norm}) {
    const Tensor t = reg.param(id);
    refs.emplace_back(std::vector<float>(t.data<float>(), t.data<float>() + t.numel()));
  }
  for (int t = 1; t <= 5; ++t) {
    for (int64_t i = 0; i < total; ++i) grads[i] = nd(rng) * (t % 2 ? 1.0f : -2.0f);
    const double lr = 0.02 * t;
    opt.step(lr);
    int k = 0;
    for (int id : {w, norm}) {
      const Tensor g = reg.grad(id), p = reg.param(id);
      refs[size_t(k)].step(std::vector<float>(g.data<float>(), g.data<float>() + g.numel()), float(lr), float(c.beta1),
                           float(c.beta2), float(c.eps), id == w ? float(c.weight_decay) : 0.0, t);
      expect_close(std::vector<float>(p.data<float>(), p.data<float>() + p.numel()), refs[size_t(k)].p, 1e-5,
                   reg.info(id).name.c_str(), t);
      ++k;
    }
  }
  EXPECT_EQ(opt.steps_taken(), 5);
  const Tensor b = reg.param(bias);
  const int64_t off = reg.info(bias).offset;
  for (int64_t i = 0; i < b.numel(); ++i) EXPECT_EQ(b.data<float>()[i], start[size_t(off + i)]);
}

}  // namespace
}  // namespace dstrain
