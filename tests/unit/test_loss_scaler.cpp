// The fp16 loss scaler: every transition of DeepSpeed's DynamicLossScaler (hysteresis,
// window, minimum, consecutive hysteresis), the static scale, the disabled scaler, and its
// state round trip.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "optim/loss_scaler.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;
using Change = LossScaler::Change;

LossScalerConfig dynamic_config(int64_t power, int64_t window, int64_t hysteresis, double min_scale = 1) {
  LossScalerConfig c;
  c.initial_scale_power = power;
  c.loss_scale_window = window;
  c.hysteresis = hysteresis;
  c.min_loss_scale = min_scale;
  return c;
}

TEST(LossScaler, StartsAtTwoToTheInitialPowerWithDeepSpeedsDefaults) {
  LossScalerConfig c;
  EXPECT_EQ(c.loss_scale, 0);
  EXPECT_EQ(c.initial_scale_power, 16);
  EXPECT_EQ(c.loss_scale_window, 1000);
  EXPECT_EQ(c.hysteresis, 2);
  EXPECT_EQ(c.min_loss_scale, 1);
  LossScaler s(c, true);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.scale(), 65536.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
}

TEST(LossScaler, HysteresisSetsHowManyOverflowsHalveTheScale) {
  LossScaler s(dynamic_config(10, 1000, 3), true);
  EXPECT_EQ(s.update(true), Change::HysteresisUsed);
  EXPECT_EQ(s.scale(), 1024.0);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_EQ(s.update(true), Change::HysteresisUsed);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_EQ(s.update(true), Change::Lowered);
  EXPECT_EQ(s.scale(), 512.0);
  // The hysteresis stays used up: every further overflow halves until a window refills it.
  EXPECT_EQ(s.update(true), Change::Lowered);
  EXPECT_EQ(s.scale(), 256.0);
  EXPECT_EQ(s.overflows(), 4);
}

TEST(LossScaler, ACleanStepDoesNotRefillTheHysteresisByDefault) {
  LossScaler s(dynamic_config(10, 1000, 2), true);
  s.update(true);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_EQ(s.update(true), Change::Lowered);  // not consecutive, still halves
  EXPECT_EQ(s.scale(), 512.0);
}

TEST(LossScaler, ConsecutiveHysteresisRefillsAtEveryCleanStep) {
  LossScalerConfig c = dynamic_config(10, 1000, 2);
  c.consecutive_hysteresis = true;
  LossScaler s(c, true);
  s.update(true);
  EXPECT_EQ(s.hysteresis_left(), 1);
  s.update(false);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_EQ(s.update(true), Change::HysteresisUsed);
  EXPECT_EQ(s.scale(), 1024.0);
}

TEST(LossScaler, TheScaleDoublesEveryWindowOfCleanStepsAfterTheLastOverflow) {
  // DeepSpeed counts the clean steps before the current one since the last overflow: a clean
  // step that follows `window` of them doubles the scale, and so on every window.
  LossScaler s(dynamic_config(4, 3, 1), true);
  EXPECT_EQ(s.update(false), Change::None);  // iteration 0: 0 clean steps before it
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::Raised);  // 3 clean steps before it
  EXPECT_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::Raised);  // 6
  EXPECT_EQ(s.scale(), 64.0);
  // An overflow restarts the count from itself.
  EXPECT_EQ(s.update(true), Change::Lowered);
  EXPECT_EQ(s.scale(), 32.0);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::None);
  EXPECT_EQ(s.update(false), Change::Raised);
  EXPECT_EQ(s.scale(), 64.0);
}

TEST(LossScaler, DoublingRefillsTheHysteresis) {
  LossScaler s(dynamic_config(4, 2, 2), true);
  s.update(true);
  EXPECT_EQ(s.hysteresis_left(), 1);
  s.update(false);
  s.update(false);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_EQ(s.update(false), Change::Raised);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_EQ(s.scale(), 32.0);
}

TEST(LossScaler, NeverBelowTheMinimumAndOverflowingThereIsAnError) {
  // 2 -> 1.5 (clamped, not 1) -> error at the next overflow.
  LossScaler s(dynamic_config(1, 1000, 1, 1.5), true);
  EXPECT_EQ(s.update(true, 7), Change::Lowered);
  EXPECT_EQ(s.scale(), 1.5);
  try {
    s.update(true, 8);
    FAIL() << "no error at the minimum scale";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("step 8"));
    EXPECT_THAT(e.what(), HasSubstr("train.fp16.min_loss_scale = 1.5"));
    EXPECT_THAT(e.what(), HasSubstr("lower learning rate"));
  }
}

TEST(LossScaler, HysteresisIsSpentBeforeTheMinimumIsAnError) {
  LossScaler s(dynamic_config(0, 1000, 2), true);  // scale 1 = min_loss_scale
  EXPECT_EQ(s.update(true), Change::HysteresisUsed);
  EXPECT_THROW(s.update(true), Error);
}

TEST(LossScaler, AStaticScaleNeverChangesButCountsOverflows) {
  LossScalerConfig c;
  c.loss_scale = 128;
  LossScaler s(c, true);
  EXPECT_FALSE(s.dynamic());
  EXPECT_EQ(s.scale(), 128.0);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(s.update(true), Change::None);
  for (int i = 0; i < 3000; ++i) s.update(false);
  EXPECT_EQ(s.scale(), 128.0);
  EXPECT_EQ(s.overflows(), 5);
}

TEST(LossScaler, DisabledIsOneAndNeverChanges) {
  LossScaler s(LossScalerConfig{}, false);
  EXPECT_FALSE(s.enabled());
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.update(true), Change::None);
  EXPECT_EQ(s.scale(), 1.0);
  EXPECT_EQ(s.overflows(), 0);
}

TEST(LossScaler, StateRoundTripContinuesIdentically) {
  const LossScalerConfig c = dynamic_config(8, 3, 2);
  LossScaler a(c, true);
  const bool pattern[] = {true, false, true, false, false, false, false, true};
  for (bool o : pattern) a.update(o);
  LossScaler b(c, true);
  b.load_state(json::parse(a.state().dump()), "test");
  EXPECT_EQ(b.state(), a.state());
  for (int i = 0; i < 20; ++i) {
    const bool o = i % 7 == 3;
    EXPECT_EQ(a.update(o), b.update(o)) << i;
    EXPECT_EQ(a.scale(), b.scale()) << i;
  }
  EXPECT_EQ(a.state(), b.state());
}

TEST(LossScaler, ABrokenStateIsAnErrorNamingItsSource) {
  LossScaler s(dynamic_config(8, 3, 2), true);
  json st = s.state();
  st["scale"] = -1.0;
  try {
    s.load_state(st, "checkpoint 'x.h5'");
    FAIL();
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("checkpoint 'x.h5'"));
  }
  st = s.state();
  st.erase("cur_iter");
  EXPECT_THROW(s.load_state(st, "x"), Error);
}

}  // namespace
}  // namespace dstrain
