// Blending: the realised mix follows the weights at every prefix, phases of a schedule
// realise their own weights, and a restored state continues the same sequence.
#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "data/blend.h"

namespace dstrain {
namespace {

TEST(Blender, RealisesTheWeightsAtEveryPrefix) {
  Blender b(3, {{0, {5, 3, 2}}});
  std::vector<int64_t> seen(3, 0);
  int64_t total = 0;
  for (int64_t step = 0; step < 20; ++step) {
    for (const auto& a : b.next_batch(step, 7)) {
      EXPECT_EQ(a.index, seen[size_t(a.dataset)]) << "indices within a dataset run in order";
      ++seen[size_t(a.dataset)];
      ++total;
      const double w[3] = {0.5, 0.3, 0.2};
      for (int d = 0; d < 3; ++d) EXPECT_LE(std::fabs(double(seen[size_t(d)]) - w[d] * double(total)), 1.0);
    }
  }
  EXPECT_EQ(b.drawn(), (std::vector<int64_t>{70, 42, 28}));
}

TEST(Blender, EachPhaseRealisesItsOwnWeights) {
  Blender b(2, {{0, {1, 0}}, {3, {1, 3}}});
  for (int64_t s = 0; s < 3; ++s)
    for (const auto& a : b.next_batch(s, 10)) EXPECT_EQ(a.dataset, 0);
  EXPECT_EQ(b.drawn(), (std::vector<int64_t>{30, 0}));
  for (int64_t s = 3; s < 7; ++s) b.next_batch(s, 10);
  EXPECT_EQ(b.drawn(), (std::vector<int64_t>{40, 30}));  // 40 of the phase: 10 and 30
  EXPECT_DOUBLE_EQ(b.weights_at(5)[1], 0.75);
}

TEST(Blender, RestoredStateContinuesTheSameSequence) {
  const std::vector<BlendPhase> phases = {{0, {2, 1, 1}}, {4, {1, 1, 2}}};
  Blender whole(3, phases), first(3, phases);
  std::vector<std::vector<Blender::Assignment>> want;
  for (int64_t s = 0; s < 9; ++s) want.push_back(whole.next_batch(s, 6));
  for (int64_t s = 0; s < 5; ++s) first.next_batch(s, 6);
  Blender second(3, phases);
  second.restore(json::parse(first.state().dump()));
  for (int64_t s = 5; s < 9; ++s) {
    const auto got = second.next_batch(s, 6);
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].dataset, want[size_t(s)][i].dataset);
      EXPECT_EQ(got[i].index, want[size_t(s)][i].index);
    }
  }
  EXPECT_THROW(second.next_batch(3, 6), Error) << "steps come in sequence";
  Blender other(2, {});
  EXPECT_THROW(other.restore(first.state()), Error) << "a state of 3 datasets does not fit 2";
}

TEST(Blender, RejectsBadWeights) {
  auto make = [](std::vector<BlendPhase> p) { Blender b(2, std::move(p)); };
  EXPECT_THROW(make({{0, {1}}}), Error);
  EXPECT_THROW(make({{0, {0, 0}}}), Error);
  EXPECT_THROW(make({{0, {1, -1}}}), Error);
  EXPECT_THROW(make({{5, {1, 1}}}), Error);
}

}  // namespace
}  // namespace dstrain
