// AdamW with the clipping coefficient and the fp16 unscale applied as it reads the gradients
// (grad_scale): the same bits as clipping the gradients in place first, and the gradients
// themselves left untouched.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "optim/adamw.h"

namespace dstrain {
namespace {

void build(ParamRegistry& reg) {
  reg.add("w", Shape{7, 5}, ParamKind::Linear, 0);
  reg.add("norm", Shape{5}, ParamKind::Norm, 0);
  reg.add("head", Shape{3, 5}, ParamKind::Head, -1);
  reg.allocate(Device::cpu());
}

void fill(Buffer& b, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd;
  float* p = b.data<float>();
  for (int64_t i = 0; i < b.numel(); ++i) p[i] = nd(rng) * scale;
}

bool same(const Buffer& a, const Buffer& b) { return std::memcmp(a.data(), b.data(), a.nbytes()) == 0; }

TEST(AdamWGradScale, FusedClippingIsBitwiseTheInPlaceClipping) {
  ParamRegistry a, b;
  build(a);
  build(b);
  fill(a.values(), 1, 1.0f);
  fill(b.values(), 1, 1.0f);
  AdamWConfig c;
  c.weight_decay = 0.1;
  AdamW oa(c, a), ob(c, b);
  for (int t = 1; t <= 4; ++t) {
    fill(a.grads(), 10 + t, 3.0f);  // norms well above 1: clipped
    fill(b.grads(), 10 + t, 3.0f);
    const double norm = grad_norm(a);
    ASSERT_EQ(norm, grad_norm(b));
    const double applied = clip_grad_norm(a, 1.0, norm);
    ASSERT_LT(applied, 1.0);
    oa.step(1e-2);
    const double coef = clip_coefficient(1.0, norm);
    EXPECT_EQ(coef, applied);
    const std::vector<float> before(b.grads().data<float>(), b.grads().data<float>() + b.grads().numel());
    ob.step(1e-2, coef);
    EXPECT_TRUE(same(a.values(), b.values())) << "step " << t;
    EXPECT_TRUE(same(oa.exp_avg(), ob.exp_avg())) << "step " << t;
    EXPECT_TRUE(same(oa.exp_avg_sq(), ob.exp_avg_sq())) << "step " << t;
    EXPECT_EQ(std::memcmp(before.data(), b.grads().data(), b.grads().nbytes()), 0) << "the gradients were changed";
  }
  EXPECT_EQ(clip_coefficient(1.0, 0.5), 1.0) << "below the limit nothing is clipped";
}

TEST(AdamWGradScale, AnFp16LossScaleIsUndoneExactly) {
  // Gradients of a loss scaled by 2^k are 2^k times as large (exactly, in range): a grad_scale
  // of coef / 2^k gives the unscaled run's bits.
  ParamRegistry a, b;
  build(a);
  build(b);
  fill(a.values(), 2, 1.0f);
  fill(b.values(), 2, 1.0f);
  AdamW oa(AdamWConfig{}, a), ob(AdamWConfig{}, b);
  const double scale = std::ldexp(1.0, 14);
  for (int t = 1; t <= 3; ++t) {
    fill(a.grads(), 20 + t, 2.0f);
    fill(b.grads(), 20 + t, float(2.0 * scale));
    const double norm = grad_norm(a);
    EXPECT_EQ(grad_norm(b) / scale, norm);
    const double coef = clip_coefficient(1.0, norm);
    oa.step(1e-2, coef);
    ob.step(1e-2, coef / scale);
    EXPECT_TRUE(same(a.values(), b.values())) << "step " << t;
    EXPECT_TRUE(same(oa.exp_avg_sq(), ob.exp_avg_sq())) << "step " << t;
  }
}

}  // namespace
}  // namespace dstrain
