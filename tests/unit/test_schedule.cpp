// Schedules: what each stage runs, checked by simulating the stages against each other.
#include <gtest/gtest.h>

#include "core/error.h"
#include "distributed/schedule.h"

namespace dstrain {
namespace {

std::string joined(const std::vector<ScheduleAction>& a) {
  std::string s;
  for (const auto& x : a) s += (s.empty() ? "" : " ") + to_string(x);
  return s;
}

std::vector<std::vector<ScheduleAction>> all_stages(const Schedule& sch, int S, int M) {
  std::vector<std::vector<ScheduleAction>> out;
  for (int s = 0; s < S; ++s) out.push_back(sch.actions(s, S, M));
  return out;
}

TEST(Schedule, GradAccumulationRunsEachMicroBatchThrough) {
  GradAccumulationSchedule g;
  EXPECT_EQ(joined(g.actions(0, 1, 3)), "F0 B0 F1 B1 F2 B2");
  EXPECT_EQ(peak_in_flight(g.actions(0, 1, 3)), 1);
  EXPECT_EQ(validate_schedule(all_stages(g, 1, 3), 3), "");
  EXPECT_THROW(g.actions(0, 2, 3), Error);
}

TEST(Schedule, AllForwardAllBackwardKeepsEveryMicroBatchInFlight) {
  AllForwardAllBackwardSchedule g;
  EXPECT_EQ(joined(g.actions(1, 3, 3)), "F0 F1 F2 B0 B1 B2");
  EXPECT_EQ(peak_in_flight(g.actions(0, 1, 4)), 4);
  EXPECT_EQ(validate_schedule(all_stages(g, 3, 4), 4), "");
}

TEST(Schedule, OneFOneBBoundsInFlightByStageDepth) {
  OneFOneBSchedule s;
  // Megatron-Core's non-interleaved schedule, 4 stages, 6 micro-batches.
  EXPECT_EQ(joined(s.actions(0, 4, 6)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(joined(s.actions(3, 4, 6)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  for (int stage = 0; stage < 4; ++stage) EXPECT_EQ(peak_in_flight(s.actions(stage, 4, 6)), 4 - stage);
  for (int S : {1, 2, 4, 8})
    for (int M : {1, 2, 3, 8}) EXPECT_EQ(validate_schedule(all_stages(s, S, M), M), "") << S << " stages, " << M;
}

TEST(Schedule, ValidationFindsDeadlocksAndMissingWork) {
  // Stage 0 waits for stage 1's B0 before its own F1, but stage 1 needs F1 first: a deadlock
  // (stage 1 runs all forwards before any backward, stage 0 interleaves too early).
  std::vector<std::vector<ScheduleAction>> bad = {
      {{ScheduleAction::Kind::Forward, 0}, {ScheduleAction::Kind::Backward, 0}, {ScheduleAction::Kind::Forward, 1},
       {ScheduleAction::Kind::Backward, 1}},
      {{ScheduleAction::Kind::Forward, 0}, {ScheduleAction::Kind::Forward, 1}, {ScheduleAction::Kind::Backward, 0},
       {ScheduleAction::Kind::Backward, 1}}};
  // Stage 0's B0 waits for stage 1's B0, which waits for stage 1's F1, which waits for stage 0's F1.
  EXPECT_NE(validate_schedule(bad, 2).find("deadlock"), std::string::npos);
  std::vector<std::vector<ScheduleAction>> missing = {{{ScheduleAction::Kind::Forward, 0}}};
  EXPECT_NE(validate_schedule(missing, 1).find("does not run"), std::string::npos);
  std::vector<std::vector<ScheduleAction>> early = {{{ScheduleAction::Kind::Backward, 0}, {ScheduleAction::Kind::Forward, 0}}};
  EXPECT_NE(validate_schedule(early, 1).find("before its forward"), std::string::npos);
  // A split backward: input parts of both, then the weight parts, is complete and valid.
  using K = ScheduleAction::Kind;
  std::vector<std::vector<ScheduleAction>> split = {
      {{K::Forward, 0}, {K::Forward, 1}, {K::BackwardInput, 0}, {K::BackwardInput, 1}, {K::BackwardWeight, 1},
       {K::BackwardWeight, 0}}};
  EXPECT_EQ(validate_schedule(split, 2), "");
  std::vector<std::vector<ScheduleAction>> weight_first = {{{K::Forward, 0}, {K::BackwardWeight, 0}, {K::BackwardInput, 0}}};
  EXPECT_NE(validate_schedule(weight_first, 1).find("before the input-gradient part"), std::string::npos);
  EXPECT_THROW(make_schedule("interleaved"), Error);
}

}  // namespace
}  // namespace dstrain
