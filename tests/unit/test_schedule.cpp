// Schedules: what each stage runs, checked by simulating the stages against each other.
#include <gtest/gtest.h>

#include "core/error.h"
#include "distributed/schedule.h"

namespace dstrain {
namespace {

std::string joined(const std::vector<ScheduleAction>& a) {
  std::string s;
  for (const auto& x : a) {
    if (!s.empty()) s += ' ';
    s += to_string(x);
  }
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
  // Without virtual stages the interleaved schedule is an error that asks for them.
  EXPECT_THROW(make_schedule("interleaved"), Error);
}

using K = ScheduleAction::Kind;

TEST(Schedule, ActionsNameTheirChunk) {
  EXPECT_EQ(to_string({K::Forward, 3}), "F3");
  EXPECT_EQ(to_string({K::Forward, 3, 1}), "F3.1");
  EXPECT_EQ(to_string({K::BackwardWeight, 0, 2}), "BW0.2");
}

TEST(Schedule, MakeScheduleKnowsEveryName) {
  for (const char* name : {"grad_accumulation", "all_forward_all_backward", "1f1b", "dualpipev"})
    EXPECT_EQ(make_schedule(name)->name(), name);
  EXPECT_EQ(make_schedule("interleaved", 2)->name(), "interleaved");
  EXPECT_EQ(make_schedule("interleaved", 3)->chunks(), 3);
  EXPECT_THROW(make_schedule("interleaved", 1), Error);
  try {
    make_schedule("zb-h1");
    ADD_FAILURE() << "unknown schedule accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* name : {"grad_accumulation", "all_forward_all_backward", "1f1b", "interleaved", "dualpipev"})
      EXPECT_NE(what.find(name), std::string::npos) << what;
  }
}

TEST(Schedule, StageMapsPlaceEveryModelStageOnce) {
  // Interleaved, P = 4, V = 2: rank r holds r and r + 4.
  EXPECT_EQ(stage_map(InterleavedOneFOneBSchedule(2), 4), (std::vector<std::vector<int>>{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  // DualPipeV, P = 4: down the ranks and back up; the last stage (the loss) is on rank 0.
  EXPECT_EQ(stage_map(DualPipeVSchedule(), 4), (std::vector<std::vector<int>>{{0, 7}, {1, 6}, {2, 5}, {3, 4}}));
  EXPECT_EQ(stage_map(OneFOneBSchedule(), 3), (std::vector<std::vector<int>>{{0}, {1}, {2}}));
  // A map that puts two chunks on one model stage is refused.
  EXPECT_NE(validate_schedule({{}, {}}, 1, {{0}, {0}}).find("stage map"), std::string::npos);
}

TEST(Schedule, InterleavedFollowsMegatron) {
  InterleavedOneFOneBSchedule s(2);
  // P = 2, m = 4: rank 0 warms up with (2-0-1)*2 + (2-1)*2 = 4 forwards, groups of 2 per chunk.
  EXPECT_EQ(joined(s.actions(0, 2, 4)), "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3");
  EXPECT_EQ(joined(s.actions(1, 2, 4)), "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3");
  // m == P: every forward first (Megatron's all-warm-up case).
  EXPECT_EQ(joined(s.actions(1, 2, 2)), "F0 F1 F0.1 F1.1 B0.1 B1.1 B0 B1");
  for (int P : {2, 4}) {
    for (int m : {P, 2 * P, 8}) {
      const auto table = schedule_table(s, P, m);
      EXPECT_EQ(validate_schedule(table, m, stage_map(s, P)), "") << P << " ranks, " << m;
      for (int r = 0; r < P; ++r) {
        // Megatron's bound: the warm-up forwards plus the steady state's one extra.
        const int warmup = m == P ? 2 * m : std::min((P - r - 1) * 2 + P, 2 * m);
        EXPECT_EQ(peak_in_flight(table[size_t(r)]), std::min(warmup + 1, 2 * m)) << P << " ranks, " << m << ", rank " << r;
      }
    }
  }
  try {
    s.actions(0, 4, 6);
    ADD_FAILURE() << "6 micro-batches on 4 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("divisible by the pipeline size P"), std::string::npos) << e.what();
  }
}

TEST(Schedule, DualPipeVValidatesAndSplitsTheCoolDown) {
  DualPipeVSchedule s;
  // P = 2, m = 4, rank 1 (the turn of the V): F0 F0.1 pairs, the F0 B1 F1 B0 steady state, then
  // the cool-down's second half split, its weight parts last.
  EXPECT_EQ(joined(s.actions(1, 2, 4)),
            "F0 F0.1 F1 F1.1 F2 B0.1 F2.1 B0 F3 B1.1 F3.1 B1 B2.1 B2 BI3.1 BI3 BW3.1 BW3");
  for (int P : {1, 2, 4}) {
    for (int m : {2 * P, 8, 2 * P + 3}) {
      if (m < 2 * P) continue;
      const auto table = schedule_table(s, P, m);
      EXPECT_EQ(validate_schedule(table, m, stage_map(s, P)), "") << P << " ranks, " << m;
      for (int r = 0; r < P; ++r) {
        int weight_parts = 0;
        for (const ScheduleAction& a : table[size_t(r)]) weight_parts += a.kind == K::BackwardWeight;
        // Split backwards: P - r - 1 in B1 W F1, r + 1 in the cool-down, P - r - 1 in W B0.
        EXPECT_EQ(weight_parts, 2 * P - r - 1) << P << " ranks, " << m << ", rank " << r;
      }
    }
  }
  try {
    s.actions(0, 4, 6);
    ADD_FAILURE() << "6 micro-batches on 4 ranks accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at least twice the pipeline size P"), std::string::npos) << e.what();
  }
}

TEST(Schedule, ValidationFollowsModelStagesAcrossChunks) {
  // Two ranks, V-shaped: model stages 0 (rank 0), 1 (rank 1), 2 (rank 1), 3 (rank 0). Rank 0
  // running stage 3's forward before rank 1 ran stage 2's is a deadlock if rank 1 waits on it.
  const std::vector<std::vector<int>> v = {{0, 3}, {1, 2}};
  const std::vector<std::vector<ScheduleAction>> ok = {
      {{K::Forward, 0, 0}, {K::Forward, 0, 1}, {K::Backward, 0, 1}, {K::Backward, 0, 0}},
      {{K::Forward, 0, 0}, {K::Forward, 0, 1}, {K::Backward, 0, 1}, {K::Backward, 0, 0}}};
  EXPECT_EQ(validate_schedule(ok, 1, v), "");
  // Rank 1 runs stage 2's backward before stage 3 (rank 0) has sent its gradient, and rank 0
  // runs stage 0's backward before stage 3's forward: rank 0 waits for rank 1's B, which waits
  // for rank 0's F.
  const std::vector<std::vector<ScheduleAction>> crossed = {
      {{K::Forward, 0, 0}, {K::Backward, 0, 0}, {K::Forward, 0, 1}, {K::Backward, 0, 1}},
      {{K::Forward, 0, 0}, {K::Forward, 0, 1}, {K::Backward, 0, 1}, {K::Backward, 0, 0}}};
  EXPECT_NE(validate_schedule(crossed, 1, v).find("deadlock"), std::string::npos);
  // A chunk the map does not have, and a chunk left without its backward.
  EXPECT_NE(validate_schedule({{{K::Forward, 0, 1}, {K::Backward, 0, 1}}}, 1).find("outside its 1 chunks"),
            std::string::npos);
  EXPECT_NE(validate_schedule({{{K::Forward, 0, 0}, {K::Backward, 0, 0}, {K::Forward, 0, 1}}}, 1, {{0, 1}})
                .find("of chunk 1 does not run"),
            std::string::npos);
}

double bubble(const Schedule& s, int P, int m, const ActionCosts& costs = {}) {
  return bubble_fraction(schedule_table(s, P, m), stage_map(s, P), costs);
}

TEST(Schedule, BubbleOfOneFOneBIsTheAnalyticOne) {
  OneFOneBSchedule s;
  for (int P : {1, 2, 4, 8})
    for (int m : {1, 4, 8, 16}) EXPECT_DOUBLE_EQ(bubble(s, P, m), double(P - 1) / (m + P - 1)) << P << " ranks, " << m;
  // The costs are parameters: with B = 3F the bubble is still (P-1)/(m+P-1).
  EXPECT_DOUBLE_EQ(bubble(s, 4, 8, {.forward = 1, .backward = 3}), 3.0 / 11);
}

TEST(Schedule, InterleavingAndDualPipeVShrinkTheBubble) {
  OneFOneBSchedule one;
  DualPipeVSchedule dual;
  for (int V : {2, 3, 4}) {
    InterleavedOneFOneBSchedule inter(V);
    for (int P : {2, 4, 8}) {
      for (int m : {P, 2 * P, 16}) {
        // Megatron's analytic bubble, (P-1)/V forward-backward times out of m + (P-1)/V: exact
        // in the simulator (the fraction does not depend on a chunk being 1/V of a rank's work).
        EXPECT_NEAR(bubble(inter, P, m), double(P - 1) / (V * m + P - 1), 1e-12) << V << " chunks, " << P << " ranks, " << m;
      }
    }
  }
  // DualPipeV (two chunks per rank) below interleaved with two chunks, below 1F1B. Measured:
  // P=2 m=4: 0.0400 / 0.1111 / 0.2000; P=4 m=8: 0.0588 / 0.1579 / 0.2727; P=8 m=16: 0.0680 /
  // 0.1795 / 0.3043.
  InterleavedOneFOneBSchedule inter(2);
  for (int P : {2, 4, 8}) {
    for (int m : {2 * P, 16, 4 * P}) {
      const double b1 = bubble(one, P, m), bi = bubble(inter, P, m), bd = bubble(dual, P, m);
      EXPECT_LT(bi, b1) << P << " ranks, " << m;
      EXPECT_LT(bd, bi) << P << " ranks, " << m;
    }
  }
  EXPECT_NEAR(bubble(dual, 2, 4), 1.0 / 25, 1e-12);
  EXPECT_NEAR(bubble(dual, 4, 8), 1.0 / 17, 1e-12);
  // An odd number of micro-batches is fine for DualPipeV, and still below 1F1B.
  EXPECT_LT(bubble(dual, 4, 11), bubble(one, 4, 11));
}

TEST(Schedule, DualPipeVKeepsTwoPPlusOneChunksInFlight) {
  // 2P warm-up forwards (2(P-r-1) of chunk 0, r+1 of each chunk) and one more in the steady
  // state, on every rank: P + 1/2 micro-batches of a rank's whole activations.
  DualPipeVSchedule s;
  for (int P : {1, 2, 4, 8})
    for (int m : {2 * P, 16})
      for (int r = 0; r < P; ++r) EXPECT_EQ(peak_in_flight(s.actions(r, P, m)), 2 * P + 1) << P << " ranks, " << m << ", rank " << r;
}

}  // namespace
}  // namespace dstrain
