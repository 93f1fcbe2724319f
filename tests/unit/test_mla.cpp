// DeepSeek-V2/V3 attention: the YaRN rotary tables and the interleaved rotary embedding
// against double-precision evaluations of Hugging Face's formulas, and Multi-head Latent
// Attention against finite differences and a naive double-precision forward.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <numbers>
#include <ostream>
#include <random>
#include <vector>

#include "finite_difference.h"
#include "backend/ops.h"
#include "model/mla.h"

namespace dstrain {
namespace {

struct Host {
  std::vector<float> v;
  Shape shape;
  Host(Shape s, std::mt19937& rng, float scale = 1.0f) : v(static_cast<size_t>(s.numel())), shape(s) {
    std::normal_distribution<float> nd(0.0f, scale);
    for (auto& x : v) x = nd(rng);
  }
  explicit Host(Shape s) : v(static_cast<size_t>(s.numel()), 0.0f), shape(s) {}
  Tensor t() { return Tensor(v.data(), DType::F32, shape); }
};

// Runs the enclosing scope on one thread: finite differences make hundreds of tiny
// forwards, where thread start-up would dominate. Restores the count on any exit.
struct OneThread {
  int saved = omp_get_max_threads();
  OneThread() { omp_set_num_threads(1); }
  ~OneThread() { omp_set_num_threads(saved); }
};

double dot(const std::vector<float>& a, const std::vector<float>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += double(a[i]) * double(b[i]);
  return s;
}

// Central differences of L at `samples` random positions of x (all when x is smaller) against
// the analytic gradient: steps h and h/2 combined by Richardson extrapolation (truncation
// O(h^4)), over the steps fp32 really took. The error is measured relative to the largest
// gradient element. Returns the largest relative error seen.
double expect_gradient(const std::string& what, float* x, const float* grad, int64_t n,
                       const std::function<double()>& loss, double h, double tol, int samples, unsigned seed) {
  std::mt19937 pick(seed);
  double gmax = 1e-6, worst = 0;
  for (int64_t i = 0; i < n; ++i) gmax = std::max(gmax, double(std::fabs(grad[i])));
  for (int s = 0; s < std::min<int64_t>(samples, n); ++s) {
    const int64_t i = n <= samples ? s : int64_t(pick() % uint32_t(n));
    const double fd = richardson_fd(x, i, h, loss);
    worst = std::max(worst, std::fabs(grad[i] - fd) / gmax);
    EXPECT_NEAR(grad[i], fd, tol * gmax) << what << "[" << i << "]";
  }
  return worst;
}

// max |grad - fd| / max |grad|: measured at most 1.6e-4 (MLA) and 7.2e-6 (the interleaved RoPE).
constexpr double kMlaGradTol = 5e-4, kRopeGradTol = 3e-5;

// ---- YaRN frequencies in double, straight from DeepseekV2YarnRotaryEmbedding -------------
double yarn_get_mscale(double scale, double mscale) { return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; }

struct RefRope {
  std::vector<double> inv_freq;  // (dim/2)
  double m = 1;                  // mscale / mscale_all_dim factor on cos and sin
};

RefRope reference_rope(int dim, double theta, const ops::YarnParams& y) {
  RefRope r;
  const int half = dim / 2;
  std::vector<double> extra(static_cast<size_t>(half)), inter(static_cast<size_t>(half));
  for (int i = 0; i < half; ++i) {
    extra[size_t(i)] = 1.0 / std::pow(theta, double(2 * i) / dim);
    inter[size_t(i)] = 1.0 / (y.factor * std::pow(theta, double(2 * i) / dim));
  }
  if (y.factor <= 1) {
    r.inv_freq = extra;
    return r;
  }
  auto find_dim = [&](double n_rot) {
    return dim * std::log(double(y.original_max_position_embeddings) / (n_rot * 2 * std::numbers::pi)) /
           (2 * std::log(theta));
  };
  const double low = std::max(std::floor(find_dim(y.beta_fast)), 0.0);
  double high = std::min(std::ceil(find_dim(y.beta_slow)), double(dim - 1));
  if (low == high) high += 0.001;
  for (int i = 0; i < half; ++i) {
    const double ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double keep = 1 - ramp;  // inv_freq_mask
    r.inv_freq.push_back(inter[size_t(i)] * (1 - keep) + extra[size_t(i)] * keep);
  }
  r.m = yarn_get_mscale(y.factor, y.mscale) / yarn_get_mscale(y.factor, y.mscale_all_dim);
  return r;
}

struct YarnCase {
  const char* name;
  int dim;
  double theta;
  ops::YarnParams y;
};
// How ctest lists the case (instead of its bytes).
void PrintTo(const YarnCase& k, std::ostream* os) { *os << k.name; }

ops::YarnParams yarn(double factor, int64_t original, double mscale, double mscale_all_dim) {
  ops::YarnParams y;
  y.factor = factor;
  y.original_max_position_embeddings = original;
  y.mscale = mscale;
  y.mscale_all_dim = mscale_all_dim;
  return y;
}

class YarnTables : public ::testing::TestWithParam<YarnCase> {};

TEST_P(YarnTables, MatchTheFormulaInDouble) {
  const YarnCase& k = GetParam();
  const int64_t T = 300, half = k.dim / 2;
  Host cos({T, half}), sin({T, half});
  ops::rope_tables_yarn(cos.t(), sin.t(), k.dim, k.theta, k.y);
  const RefRope ref = reference_rope(k.dim, k.theta, k.y);
  // fp32 angles t * inv_freq carry a relative error of a few ulp (as in torch), so the
  // tolerance grows with the angle; 1e-6 relative near angle 1.
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(t) * ref.inv_freq[size_t(i)];
      const double tol = 1e-6 * ref.m * (1 + angle);
      const double ec = std::fabs(cos.v[size_t(t * half + i)] - std::cos(angle) * ref.m);
      const double es = std::fabs(sin.v[size_t(t * half + i)] - std::sin(angle) * ref.m);
      worst = std::max(worst, std::max(ec, es) / (ref.m * (1 + angle)));
      ASSERT_LE(ec, tol) << "cos t=" << t << " i=" << i;
      ASSERT_LE(es, tol) << "sin t=" << t << " i=" << i;
    }
  }
  RecordProperty("max_error_over_m_times_1_plus_angle", fmt::format("{:.2e}", worst));
}

INSTANTIATE_TEST_SUITE_P(
    Cases, YarnTables,
    ::testing::Values(
        // DeepSeek-V2's rope: dim 64, factor 40 over 4096 positions; mscale 1 against
        // mscale_all_dim 0 makes the cos/sin factor 1 + 0.1 ln 40.
        YarnCase{"v2_factor40", 64, 10000.0, yarn(40, 4096, 1.0, 0.0)},
        YarnCase{"factor4_mscale_ratio", 64, 10000.0, yarn(4, 512, 1.0, 0.707)},
        YarnCase{"no_scaling", 64, 10000.0, ops::YarnParams{}},
        // Both correction dims below 1: low == high == 0, the ramp's +0.001 guard.
        YarnCase{"degenerate_ramp", 8, 10000.0, yarn(4, 4, 1.0, 0.0)}),
    [](const auto& tp) { return std::string(tp.param.name); });

TEST(YarnTables, HandComputedValue) {
  // dim 64, theta 1e4, factor 40, original 4096, beta 32/1: the correction dims are
  // 64 ln(4096/(32*2pi)) / (2 ln 1e4) = 10.47 and 64 ln(4096/(2pi)) / (2 ln 1e4) = 22.51, so
  // low = 10, high = 23. Frequency i = 16 has ramp 6/13 and blends 1e4^(-1/2) = 0.01 with
  // 0.01/40: 0.01 * 7/13 + 0.00025 * 6/13 = 0.0055 exactly. At t = 100 the angle is 0.55;
  // m = 1 + 0.1 ln 40 = 1.3688879454; cos = 0.8525245221 m, sin = 0.5226872289 m.
  const int64_t T = 101, half = 32;
  Host cos({T, half}), sin({T, half});
  ops::rope_tables_yarn(cos.t(), sin.t(), 64, 10000.0, yarn(40, 4096, 1.0, 0.0));
  EXPECT_NEAR(cos.v[size_t(100 * half + 16)], 1.167010541414867, 2e-6);
  EXPECT_NEAR(sin.v[size_t(100 * half + 16)], 0.7155002469036649, 2e-6);
  // Below the ramp the original frequency: i = 0 at t = 1 is cos(1) m.
  EXPECT_NEAR(cos.v[size_t(half)], std::cos(1.0) * 1.3688879454113936, 1e-6);
  // Position 0: cos = m, sin = 0.
  EXPECT_FLOAT_EQ(cos.v[5], 1.3688879454113936f);
  EXPECT_EQ(sin.v[5], 0.0f);
}

// ---- interleaved rotary embedding -----------------------------------------------------
TEST(RopeInterleaved, DeinterleavesRotatesAndItsBackwardIsTheTranspose) {
  std::mt19937 rng(3);
  // 3 heads of dim 8, a stride of 11 columns, starting at column 2 of rows of 36.
  const int64_t B = 2, T = 6, D = 8, half = D / 2, stride = 11, offset = 2, W = 36;
  const int heads = 3;
  Host cos({T, half}), sin({T, half});
  ops::rope_tables_yarn(cos.t(), sin.t(), int(D), 10000.0, yarn(4, 16, 1.0, 0.0));  // m != 1
  const float m = cos.v[0];
  ASSERT_GT(std::fabs(m - 1.0f), 0.05f);
  Host x({B, T, W}, rng), r({B, T, W}, rng), y({B, T, W});
  auto forward = [&] {
    y.v = x.v;
    ops::rope_forward_interleaved(y.t(), offset, heads, stride, int(D), cos.t(), sin.t());
  };
  forward();
  auto in_head = [&](int64_t col) {
    const int64_t rel = col - offset;
    return rel >= 0 && rel < heads * stride && rel % stride < D;
  };
  for (int64_t bt = 0; bt < B * T; ++bt) {
    for (int64_t col = 0; col < W; ++col) {
      if (!in_head(col)) {
        EXPECT_EQ(y.v[size_t(bt * W + col)], x.v[size_t(bt * W + col)]) << "column " << col;
      }
    }
  }
  // Position 0 is the de-interleaving permutation scaled by m.
  for (int h = 0; h < heads; ++h) {
    const size_t base = size_t(offset + h * stride);
    for (int64_t i = 0; i < half; ++i) {
      EXPECT_FLOAT_EQ(y.v[base + size_t(i)], m * x.v[base + size_t(2 * i)]);
      EXPECT_FLOAT_EQ(y.v[base + size_t(half + i)], m * x.v[base + size_t(2 * i + 1)]);
    }
  }
  // Hugging Face at t = 4, head 2, i = 1: u = (x0, x2, x4, x6 | x1, x3, x5, x7),
  // out[i] = u[i] c - u[i+half] s, out[i+half] = u[i+half] c + u[i] s.
  {
    const int64_t t = 4, i = 1, row = (1 * T + t) * W + offset + 2 * stride;
    const double c = cos.v[size_t(t * half + i)], s = sin.v[size_t(t * half + i)];
    const double u1 = x.v[size_t(row + 2 * i)], u2 = x.v[size_t(row + 2 * i + 1)];
    EXPECT_NEAR(y.v[size_t(row + i)], u1 * c - u2 * s, 1e-5);
    EXPECT_NEAR(y.v[size_t(row + half + i)], u2 * c + u1 * s, 1e-5);
  }
  // <r, R x> = <R^T r, x> (the rotated entries only; the rest are the identity).
  Host g = r;
  ops::rope_backward_interleaved(g.t(), offset, heads, stride, int(D), cos.t(), sin.t());
  const double lhs = dot(r.v, y.v), rhs = dot(g.v, x.v);
  EXPECT_NEAR(lhs, rhs, 1e-5 * std::fabs(lhs));
  // And the same map by finite differences.
  auto loss = [&] {
    forward();
    return dot(y.v, r.v);
  };
  const double rope_err = expect_gradient("dx", x.v.data(), g.v.data(), int64_t(x.v.size()), loss, 1e-2, kRopeGradTol, 240, 9);
  std::printf("[ rope FD ] max |grad - fd| / max|grad| %.1e\n", rope_err);
}

// ---- Multi-head Latent Attention -------------------------------------------------------
ModelConfig mla_config(bool q_lora, bool with_yarn) {
  ModelConfig c;
  c.model_type = "deepseek_v2";
  c.hidden_size = 16;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 6;
  c.kv_lora_rank = 8;
  c.q_lora_rank = q_lora ? 12 : 0;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000;
  c.max_position_embeddings = 512;
  if (with_yarn) {
    // Correction dims 1.31 and 2.81 for dim 8: frequency 2 sits inside the ramp.
    c.rope_scaling.type = "yarn";
    c.rope_scaling.factor = 4;
    c.rope_scaling.original_max_position_embeddings = 4096;
    c.rope_scaling.beta_fast = 32;
    c.rope_scaling.beta_slow = 1;
    c.rope_scaling.mscale = 1.0;
    c.rope_scaling.mscale_all_dim = 0.8;  // != mscale: cos/sin and the softmax scale both change
  }
  return c;
}

// One MLA block with its own registry, random weights and norms away from 1.
struct Block {
  ModelConfig c;
  ParamRegistry reg;
  std::unique_ptr<MLAttention> attn;
  RopeCache rope;
  Scratch scratch;
  ActivationStore acts;
  WeightGradStore wgrad;
  Ctx ctx;
  Block(const ModelConfig& config, int layer, unsigned seed) : c(config) {
    ctx.acts = &acts;
    ctx.wgrad = &wgrad;
    ctx.scratch = &scratch;
    ctx.rope = &rope;
    attn = std::make_unique<MLAttention>(c, ShardSpec::whole(c), reg, layer);
    reg.allocate(Device::cpu());
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.0f, 0.3f);
    for (int id = 0; id < reg.size(); ++id) {
      float* p = reg.param(id).data<float>();
      for (int64_t i = 0; i < reg.info(id).numel(); ++i) {
        p[i] = reg.info(id).kind == ParamKind::Norm ? 1.0f + 0.3f * std::sin(float(3 * i + id)) : nd(rng);
      }
    }
  }
};

// A naive double-precision DeepseekV2Attention forward, written from modeling_deepseek:
// out (B,T,C) for x (B,T,C).
std::vector<double> naive_mla(const Block& blk, int layer, const std::vector<float>& x, int64_t B, int64_t T) {
  const ModelConfig& c = blk.c;
  const int64_t C = c.hidden_size, H = c.num_attention_heads, Dn = c.qk_nope_head_dim, Dr = c.qk_rope_head_dim;
  const int64_t Dv = c.v_head_dim, R = c.kv_lora_rank, Dqk = Dn + Dr, half = Dr / 2;
  auto weight = [&](const char* name) {
    const int id = blk.reg.find(fmt::format("model.layers.{}.self_attn.{}", layer, name));
    EXPECT_GE(id, 0) << name;
    return blk.reg.param(id).data<float>();
  };
  // y (rows) = w (rows, cols) · in (cols)
  auto matvec = [](const float* w, const std::vector<double>& in, int64_t rows) {
    std::vector<double> y(static_cast<size_t>(rows), 0.0);
    const int64_t cols = int64_t(in.size());
    for (int64_t o = 0; o < rows; ++o)
      for (int64_t k = 0; k < cols; ++k) y[size_t(o)] += double(w[o * cols + k]) * in[size_t(k)];
    return y;
  };
  auto rmsnorm = [&](std::vector<double> v, const float* w) {
    double ss = 0;
    for (double e : v) ss += e * e;
    const double r = 1.0 / std::sqrt(ss / double(v.size()) + c.rms_norm_eps);
    for (size_t i = 0; i < v.size(); ++i) v[i] = double(w[i]) * v[i] * r;
    return v;
  };
  ops::YarnParams y;
  if (c.rope_scaling.yarn()) {
    y = yarn(c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings, c.rope_scaling.mscale,
             c.rope_scaling.mscale_all_dim);
    y.beta_fast = c.rope_scaling.beta_fast;
    y.beta_slow = c.rope_scaling.beta_slow;
  }
  const RefRope ref = reference_rope(int(Dr), c.rope_theta, y);
  // apply_rotary_pos_emb: view (d/2, 2), transpose, then x*cos + rotate_half(x)*sin with
  // cos = cat(freqs, freqs) * m.
  auto rope = [&](const double* in, int64_t t) {
    std::vector<double> u(static_cast<size_t>(Dr)), out(static_cast<size_t>(Dr));
    for (int64_t i = 0; i < half; ++i) {
      u[size_t(i)] = in[2 * i];
      u[size_t(half + i)] = in[2 * i + 1];
    }
    for (int64_t j = 0; j < Dr; ++j) {
      const double ang = double(t) * ref.inv_freq[size_t(j % half)];
      const double rot = j < half ? -u[size_t(j + half)] : u[size_t(j - half)];
      out[size_t(j)] = u[size_t(j)] * std::cos(ang) * ref.m + rot * std::sin(ang) * ref.m;
    }
    return out;
  };
  double scale = 1.0 / std::sqrt(double(Dqk));
  if (c.rope_scaling.yarn() && c.rope_scaling.mscale_all_dim != 0) {
    const double ms = yarn_get_mscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    scale *= ms * ms;
  }

  std::vector<double> out(static_cast<size_t>(B * T * C), 0.0);
  for (int64_t b = 0; b < B; ++b) {
    // Per position: query (H, Dqk) and key (H, Dqk) after rope, value (H, Dv).
    std::vector<std::vector<double>> q(static_cast<size_t>(T)), k(static_cast<size_t>(T)), v(static_cast<size_t>(T));
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> xt(static_cast<size_t>(C));
      for (int64_t i = 0; i < C; ++i) xt[size_t(i)] = x[size_t((b * T + t) * C + i)];
      std::vector<double> qt = c.q_lora_rank == 0
                                   ? matvec(weight("q_proj.weight"), xt, H * Dqk)
                                   : matvec(weight("q_b_proj.weight"),
                                            rmsnorm(matvec(weight("q_a_proj.weight"), xt, c.q_lora_rank),
                                                    weight("q_a_layernorm.weight")),
                                            H * Dqk);
      const std::vector<double> ckv = matvec(weight("kv_a_proj_with_mqa.weight"), xt, R + Dr);
      const std::vector<double> latent(ckv.begin(), ckv.begin() + R);
      const std::vector<double> kv =
          matvec(weight("kv_b_proj.weight"), rmsnorm(latent, weight("kv_a_layernorm.weight")), H * (Dn + Dv));
      const std::vector<double> k_pe = rope(ckv.data() + R, t);
      q[size_t(t)].resize(size_t(H * Dqk));
      k[size_t(t)].resize(size_t(H * Dqk));
      v[size_t(t)].resize(size_t(H * Dv));
      for (int64_t h = 0; h < H; ++h) {
        const std::vector<double> q_pe = rope(qt.data() + h * Dqk + Dn, t);
        for (int64_t i = 0; i < Dn; ++i) {
          q[size_t(t)][size_t(h * Dqk + i)] = qt[size_t(h * Dqk + i)];
          k[size_t(t)][size_t(h * Dqk + i)] = kv[size_t(h * (Dn + Dv) + i)];
        }
        for (int64_t i = 0; i < Dr; ++i) {
          q[size_t(t)][size_t(h * Dqk + Dn + i)] = q_pe[size_t(i)];
          k[size_t(t)][size_t(h * Dqk + Dn + i)] = k_pe[size_t(i)];
        }
        for (int64_t i = 0; i < Dv; ++i) v[size_t(t)][size_t(h * Dv + i)] = kv[size_t(h * (Dn + Dv) + Dn + i)];
      }
    }
    const float* wo = weight("o_proj.weight");
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> att(static_cast<size_t>(H * Dv), 0.0);
      for (int64_t h = 0; h < H; ++h) {
        std::vector<double> s(static_cast<size_t>(t + 1));
        double mx = -1e300, z = 0;
        for (int64_t j = 0; j <= t; ++j) {
          double d = 0;
          for (int64_t i = 0; i < Dqk; ++i) d += q[size_t(t)][size_t(h * Dqk + i)] * k[size_t(j)][size_t(h * Dqk + i)];
          s[size_t(j)] = d * scale;
          mx = std::max(mx, s[size_t(j)]);
        }
        for (auto& e : s) z += (e = std::exp(e - mx));
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t i = 0; i < Dv; ++i) att[size_t(h * Dv + i)] += s[size_t(j)] / z * v[size_t(j)][size_t(h * Dv + i)];
      }
      for (int64_t o = 0; o < C; ++o)
        for (int64_t i = 0; i < H * Dv; ++i) out[size_t((b * T + t) * C + o)] += double(wo[o * H * Dv + i]) * att[size_t(i)];
    }
  }
  return out;
}

struct MlaCase {
  bool q_lora, yarn;
};
std::string case_name(const ::testing::TestParamInfo<MlaCase>& tp) {
  return std::string(tp.param.q_lora ? "q_lora" : "q_proj") + (tp.param.yarn ? "_yarn" : "_plain");
}
void PrintTo(const MlaCase& k, std::ostream* os) {
  *os << (k.q_lora ? "q_lora" : "q_proj") << (k.yarn ? "_yarn" : "_plain");
}
const auto kMlaCases = ::testing::Values(MlaCase{false, false}, MlaCase{true, false}, MlaCase{false, true},
                                         MlaCase{true, true});

class MLAForward : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MLAForward, MatchesANaiveDoublePrecisionForward) {
  const MlaCase k = GetParam();
  const int layer = 3;
  Block blk(mla_config(k.q_lora, k.yarn), layer, 21);
  // T = 70 spans two query blocks of the attention kernel; one token stages its projections
  // in the smallest buffer.
  for (const auto& [B, T] : {std::pair<int64_t, int64_t>{2, 9}, {1, 70}, {1, 1}}) {
    const int64_t C = blk.c.hidden_size;
    std::mt19937 rng(static_cast<unsigned>(T));
    Host x({B, T, C}, rng), base({B, T, C}, rng);
    Host out = base;
    blk.rope.ensure(T, blk.c);
    blk.attn->forward(blk.ctx, 0, x.t(), out.t());
    const std::vector<double> ref = naive_mla(blk, layer, x.v, B, T);
    double rmax = 0, worst = 0;
    for (double e : ref) rmax = std::max(rmax, std::fabs(e));
    for (size_t i = 0; i < ref.size(); ++i) worst = std::max(worst, std::fabs((out.v[i] - base.v[i]) - ref[i]));
    EXPECT_LT(worst / rmax, 1e-5) << "B " << B << " T " << T;
    RecordProperty("max_error_relative_T" + std::to_string(T), fmt::format("{:.2e}", worst / rmax));
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MLAForward, kMlaCases, case_name);

class MLAGradients : public ::testing::TestWithParam<MlaCase> {};

TEST_P(MLAGradients, MatchFiniteDifferences) {
  const MlaCase k = GetParam();
  const OneThread one_thread;
  Block blk(mla_config(k.q_lora, k.yarn), 0, 5);
  const int64_t B = 2, T = 7, C = blk.c.hidden_size;
  std::mt19937 rng(8);
  Host x({B, T, C}, rng), r({B, T, C}, rng), out({B, T, C}), dx({B, T, C});
  blk.rope.ensure(T, blk.c);
  auto loss = [&] {
    std::fill(out.v.begin(), out.v.end(), 0.0f);
    blk.attn->forward(blk.ctx, 0, x.t(), out.t());
    return dot(out.v, r.v);
  };
  loss();
  blk.reg.grads().zero();
  std::fill(dx.v.begin(), dx.v.end(), 1e3f);  // must be overwritten
  blk.attn->backward(blk.ctx, 0, x.t(), r.t(), dx.t());

  double worst = 0;
  int checked = 0;
  for (int id = 0; id < blk.reg.size(); ++id) {
    const ParamInfo& p = blk.reg.info(id);
    worst = std::max(worst, expect_gradient(p.name, blk.reg.param(id).data<float>(), blk.reg.grad(id).data<float>(),
                                            p.numel(), loss, 1e-2, kMlaGradTol, 32, 11u + unsigned(id)));
    ++checked;
  }
  worst = std::max(worst, expect_gradient("dx", x.v.data(), dx.v.data(), int64_t(x.v.size()), loss, 1e-2, kMlaGradTol, 80, 3));
  std::printf("[ MLA FD ] q_lora %d yarn %d: max |grad - fd| / max|grad| %.1e\n", int(k.q_lora), int(k.yarn), worst);
  EXPECT_EQ(checked, k.q_lora ? 7 : 5);
  RecordProperty("max_error_relative_to_max_gradient", fmt::format("{:.2e}", worst));

  // Gradients accumulate: a second backward of the same forward doubles them; dx does not.
  loss();
  std::vector<float> g1(blk.reg.grads().data<float>(), blk.reg.grads().data<float>() + blk.reg.flat_numel());
  const std::vector<float> dx1 = dx.v;
  blk.attn->backward(blk.ctx, 0, x.t(), r.t(), dx.t());
  const float* g2 = blk.reg.grads().data<float>();
  for (size_t i = 0; i < g1.size(); ++i) ASSERT_NEAR(g2[i], 2 * g1[i], 1e-5 * (1 + std::fabs(g1[i]))) << i;
  for (size_t i = 0; i < dx1.size(); ++i) ASSERT_FLOAT_EQ(dx.v[i], dx1[i]) << i;
}

INSTANTIATE_TEST_SUITE_P(Variants, MLAGradients, kMlaCases, case_name);

class MLAUpProjRecompute : public ::testing::TestWithParam<MlaCase> {};

// Selective recomputation "mla_up_proj": the backward forms q|k|v again from the kept normed
// latents and k_pe, with the forward's ops on the same chunks of rows, so the output, the input
// gradient and every parameter gradient are the same bits as with q|k|v kept; the store holds
// k_pe (N, Dr) instead of q|k|v (N, W). The forward's q|k|v in scratch is overwritten between
// the forward and the backward (as the next layer's forward would), so only heads formed again
// give these gradients. T = 70 stages the up-projections in two chunks, T = 1 in the smallest
// buffer.
TEST_P(MLAUpProjRecompute, IsBitwiseTheSameAndKeepsKPeInsteadOfTheHeads) {
  const MlaCase k = GetParam();
  for (const auto& [B, T] : {std::pair<int64_t, int64_t>{2, 9}, {1, 70}, {1, 1}}) {
    SCOPED_TRACE(fmt::format("B {} T {}", B, T));
    Block kept(mla_config(k.q_lora, k.yarn), 1, 13), formed(mla_config(k.q_lora, k.yarn), 1, 13);
    formed.ctx.recompute_mla_up_proj = true;
    const int64_t C = kept.c.hidden_size, N = B * T;
    std::mt19937 rng(static_cast<unsigned>(T));
    Host x({B, T, C}, rng), r({B, T, C}, rng);
    Host out_kept({B, T, C}), out_formed({B, T, C}), dx_kept({B, T, C}), dx_formed({B, T, C});
    for (Block* b : {&kept, &formed}) {
      b->rope.ensure(T, b->c);
      b->reg.grads().zero();
    }
    kept.attn->forward(kept.ctx, 0, x.t(), out_kept.t());
    formed.attn->forward(formed.ctx, 0, x.t(), out_formed.t());
    // H = 2: W = 2 * (2 * 12 + 6) = 60 per row, k_pe 8.
    const int64_t W = 60, Dr = 8;
    EXPECT_TRUE(kept.acts.has(0, act_key("layers.1.attn.qkv")));
    EXPECT_FALSE(formed.acts.has(0, act_key("layers.1.attn.qkv")));
    EXPECT_EQ(kept.acts.bytes_in_use() - formed.acts.bytes_in_use(), N * (W - Dr) * int64_t(sizeof(float)));
    ops::fill(formed.scratch.get(act_key("mla.qkv"), {B, T, W}), 1e3f);
    kept.attn->backward(kept.ctx, 0, x.t(), r.t(), dx_kept.t());
    formed.attn->backward(formed.ctx, 0, x.t(), r.t(), dx_formed.t());
    EXPECT_EQ(out_formed.v, out_kept.v);
    EXPECT_EQ(dx_formed.v, dx_kept.v);
    for (int id = 0; id < kept.reg.size(); ++id) {
      const float* a = formed.reg.grad(id).data<float>();
      const float* b = kept.reg.grad(id).data<float>();
      EXPECT_EQ(std::vector<float>(a, a + kept.reg.info(id).numel()), std::vector<float>(b, b + kept.reg.info(id).numel()))
          << kept.reg.info(id).name;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, MLAUpProjRecompute, kMlaCases, case_name);

TEST(MLAttention, RegistersHuggingFaceNamesAndShapes) {
  for (const bool q_lora : {false, true}) {
    const ModelConfig c = mla_config(q_lora, true);
    ParamRegistry reg;
    MLAttention attn(c, ShardSpec::whole(c), reg, 2);
    auto shape = [&](const char* name) {
      const int id = reg.find(fmt::format("model.layers.2.self_attn.{}", name));
      return id < 0 ? Shape{} : reg.info(id).shape;
    };
    // H = 2, qk_head_dim 4 + 8, v 6, kv_lora 8, q_lora 12, C = 16.
    if (q_lora) {
      EXPECT_EQ(shape("q_proj.weight"), Shape{});
      EXPECT_EQ(shape("q_a_proj.weight"), (Shape{12, 16}));
      EXPECT_EQ(shape("q_a_layernorm.weight"), (Shape{12}));
      EXPECT_EQ(shape("q_b_proj.weight"), (Shape{24, 12}));
      EXPECT_EQ(reg.info(reg.find("model.layers.2.self_attn.q_a_layernorm.weight")).kind, ParamKind::Norm);
    } else {
      EXPECT_EQ(shape("q_proj.weight"), (Shape{24, 16}));
      EXPECT_EQ(shape("q_a_proj.weight"), Shape{});
    }
    EXPECT_EQ(shape("kv_a_proj_with_mqa.weight"), (Shape{16, 16}));
    EXPECT_EQ(shape("kv_a_layernorm.weight"), (Shape{8}));
    EXPECT_EQ(shape("kv_b_proj.weight"), (Shape{20, 8}));
    EXPECT_EQ(shape("o_proj.weight"), (Shape{16, 12}));
    EXPECT_EQ(reg.size(), q_lora ? 7 : 5);
    for (const ParamInfo& p : reg.all()) EXPECT_EQ(p.layer, 2) << p.name;
  }
}

TEST(MLAttention, ReleasedActivationsAreRebuiltByTheNextForward) {
  Block blk(mla_config(true, true), 0, 2);
  const int64_t B = 1, T = 5, C = blk.c.hidden_size;
  std::mt19937 rng(1);
  Host x({B, T, C}, rng), r({B, T, C}, rng), out({B, T, C}), dx1({B, T, C}), dx2({B, T, C});
  blk.rope.ensure(T, blk.c);
  blk.attn->forward(blk.ctx, 0, x.t(), out.t());
  blk.attn->backward(blk.ctx, 0, x.t(), r.t(), dx1.t());
  const std::vector<float> first = out.v;
  blk.acts.clear();
  blk.scratch.release();
  std::fill(out.v.begin(), out.v.end(), 0.0f);
  blk.attn->forward(blk.ctx, 0, x.t(), out.t());
  blk.attn->backward(blk.ctx, 0, x.t(), r.t(), dx2.t());
  for (size_t i = 0; i < out.v.size(); ++i) EXPECT_EQ(out.v[i], first[i]) << i;
  for (size_t i = 0; i < dx1.v.size(); ++i) EXPECT_EQ(dx1.v[i], dx2.v[i]) << i;
  // A rope cache of another dimension (llama's head dim 16/4) is refused, not misread.
  ModelConfig llama;
  llama.hidden_size = 16;
  llama.num_attention_heads = 4;
  RopeCache wrong;
  wrong.ensure(T, llama);
  Ctx wrong_ctx = blk.ctx;
  wrong_ctx.rope = &wrong;
  EXPECT_THROW(blk.attn->forward(wrong_ctx, 0, x.t(), out.t()), Error);
  // A backward of a micro-batch without its forward is refused, naming what is missing.
  EXPECT_THROW(blk.attn->backward(blk.ctx, 7, x.t(), r.t(), dx2.t()), Error);
}

}  // namespace
}  // namespace dstrain
