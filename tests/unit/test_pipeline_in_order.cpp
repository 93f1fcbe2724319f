// The pipeline's in-order transport (train/pipeline.h): what each rank issues for a step, and
// the simulation under NCCL's point-to-point rules (sends and receives matched in issue order
// per channel, rendezvous, one stream per channel) that decides whether a schedule may use it.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

#include "distributed/schedule.h"
#include "train/pipeline.h"

namespace dstrain {
namespace {

using Kind = InOrderOp::Kind;

InOrderOp send(int peer, int channel, int stage, int mb, bool gradient = false) {
  InOrderOp op;
  op.kind = Kind::Send;
  op.peer = peer;
  op.channel = channel;
  op.stage = stage;
  op.micro_batch = mb;
  op.gradient = gradient;
  return op;
}
InOrderOp recv(int peer, int channel, int stage, int mb, bool gradient = false) {
  InOrderOp op = send(peer, channel, stage, mb, gradient);
  op.kind = Kind::Recv;
  return op;
}
InOrderOp wait(int index) {
  InOrderOp op;
  op.kind = Kind::Wait;
  op.op = index;
  return op;
}

std::string verdict(const std::string& schedule, int V, int ranks, int n_micro, int channels = 4) {
  const std::unique_ptr<Schedule> s = make_schedule(schedule, V);
  return simulate_in_order(in_order_programs(*s, ranks, n_micro, channels));
}

bool deadlocks(const std::string& v) { return v.rfind("deadlock: ", 0) == 0; }

// The runner's four channels (activations and gradients, each down and up the ranks): every
// schedule at 2 and 4 ranks (3 and 8 too), with several micro-batch counts, completes with every
// message matched.
TEST(PipelineInOrder, OneFOneBIsSafe) {
  for (int P : {2, 3, 4, 8}) {
    for (int m : {1, 2, 3, 4, 5, 8, 13}) {
      EXPECT_EQ(verdict("1f1b", 1, P, m), "") << P << " ranks, " << m << " micro-batches";
      // 1F1B sends activations down and gradients up only: one channel per direction suffices.
      EXPECT_EQ(verdict("1f1b", 1, P, m, 2), "") << P << " ranks, " << m << " micro-batches";
    }
  }
}

TEST(PipelineInOrder, InterleavedIsSafe) {
  for (int P : {2, 3, 4, 8}) {
    for (int V : {2, 3}) {
      for (int m : {P, 2 * P, 3 * P, 8 * P}) {
        EXPECT_EQ(verdict("interleaved", V, P, m), "") << P << " ranks, " << V << " chunks, " << m << " micro-batches";
      }
    }
  }
}

TEST(PipelineInOrder, DualPipeVIsSafe) {
  for (int P : {2, 3, 4, 8}) {
    for (int m : {2 * P, 2 * P + 1, 2 * P + 2, 4 * P}) {
      EXPECT_EQ(verdict("dualpipev", 2, P, m), "") << P << " ranks, " << m << " micro-batches";
    }
  }
}

TEST(PipelineInOrder, OneChannelPerDirectionDeadlocksInterleavedAndDualPipeV) {
  // Why four channels: with one per direction, the interleaved schedule's ring (the last rank
  // sends its first chunk's activations to rank 0) leaves every rank with a send to its
  // successor at the head of the activations' stream, each waiting for a receive that sits
  // behind its own send; DualPipeV's neighbours each hold a send to the other.
  for (int P : {2, 4}) {
    const std::string v = verdict("interleaved", 2, P, 2 * P, 2);
    EXPECT_TRUE(deadlocks(v)) << v;
    EXPECT_NE(v.find(fmt::format("rank 0 waits for its recv A{}.0 from {} on 0", P, P - 1)), std::string::npos) << v;
    const std::string d = verdict("dualpipev", 2, P, 2 * P, 2);
    EXPECT_TRUE(deadlocks(d)) << d;
  }
}

TEST(PipelineInOrder, OneChannelForBothDirectionsDeadlocks) {
  // 1F1B with activations and gradients on one stream: after the first round trip the first
  // rank sends the next activation while the last sends a gradient back, both at their heads.
  for (int P : {2, 4}) {
    const std::string v = verdict("1f1b", 1, P, 4, /*channels=*/1);
    EXPECT_TRUE(deadlocks(v)) << v;
  }
  EXPECT_NE(verdict("1f1b", 1, 2, 4, 1).find("rank 0 waits for its recv G0.0 from 1 on 0"), std::string::npos);
}

TEST(PipelineInOrder, ProgramsFollowTheScheduleOrder) {
  // 1F1B over 2 ranks, 2 micro-batches: rank 0 runs F0 F1 B0 B1, rank 1 F0 B0 F1 B1. Activations
  // go down (channel 0), gradients up (channel 3).
  const std::unique_ptr<Schedule> s = make_schedule("1f1b", 1);
  const auto programs = in_order_programs(*s, 2, 2);
  std::vector<std::string> r0, r1;
  for (const InOrderOp& op : programs[0]) r0.push_back(to_string(op));
  for (const InOrderOp& op : programs[1]) r1.push_back(to_string(op));
  const std::vector<std::string> want0 = {
      "send A1.0 to 1 on 0", "send A1.1 to 1 on 0",  // F0, F1
      "wait 0", "recv G0.0 from 1 on 3", "wait 3",   // B0: its forward's send, then its gradient
      "wait 1", "recv G0.1 from 1 on 3", "wait 6",   // B1
      "wait 0", "wait 1"};                           // the step's sends
  const std::vector<std::string> want1 = {
      "recv A1.0 from 0 on 0", "wait 0", "send G0.0 to 0 on 3",  // F0 B0
      "recv A1.1 from 0 on 0", "wait 3", "send G0.1 to 0 on 3",  // F1 B1
      "wait 2", "wait 5"};
  EXPECT_EQ(r0, want0);
  EXPECT_EQ(r1, want1);
  // DualPipeV's second chunk sends its activations up the ranks: channel 1.
  const std::unique_ptr<Schedule> d = make_schedule("dualpipev", 1);
  bool up = false;
  for (const InOrderOp& op : in_order_programs(*d, 2, 4)[1]) {
    if (op.kind == Kind::Send && !op.gradient && op.stage == 3) up = up || op.channel == 1;
  }
  EXPECT_TRUE(up);
}

TEST(PipelineInOrder, ReceivesPostedAheadOnOneStreamDeadlock) {
  // Rank 0 posts the gradient's receive before sending the activation, on the one channel: the
  // receive heads its stream, rank 1 waits for the activation behind it.
  std::vector<std::vector<InOrderOp>> p(2);
  p[0] = {recv(1, 0, 0, 0, true), send(1, 0, 1, 0), wait(0), wait(1)};
  p[1] = {recv(0, 0, 1, 0), wait(0), send(0, 0, 0, 0, true), wait(2)};
  const std::string v = simulate_in_order(p);
  EXPECT_NE(v.find("deadlock"), std::string::npos) << v;
  // The same messages in schedule order complete.
  p[0] = {send(1, 0, 1, 0), recv(1, 0, 0, 0, true), wait(1), wait(0)};
  EXPECT_EQ(simulate_in_order(p), "");
}

TEST(PipelineInOrder, TwoRanksThatBothSendFirstDeadlock) {
  std::vector<std::vector<InOrderOp>> p(2);
  p[0] = {send(1, 0, 1, 0), recv(1, 0, 0, 0), wait(1), wait(0)};
  p[1] = {send(0, 0, 0, 0), recv(0, 0, 1, 0), wait(1), wait(0)};
  const std::string v = simulate_in_order(p);
  EXPECT_NE(v.find("deadlock"), std::string::npos) << v;
  EXPECT_NE(v.find("rank 0 waits for its recv A0.0 from 1 on 0"), std::string::npos) << v;
  // On separate channels the two sends meet their receives.
  p[0] = {send(1, 0, 1, 0), recv(1, 1, 0, 0), wait(1), wait(0)};
  p[1] = {send(0, 1, 0, 0), recv(0, 0, 1, 0), wait(1), wait(0)};
  EXPECT_EQ(simulate_in_order(p), "");
}

TEST(PipelineInOrder, MessagesOutOfOrderAreReported) {
  // Rank 0 sends micro-batch 1 before 0; rank 1 receives 0 first: the pair would swap data.
  std::vector<std::vector<InOrderOp>> p(2);
  p[0] = {send(1, 0, 1, 1), send(1, 0, 1, 0), wait(0), wait(1)};
  p[1] = {recv(0, 0, 1, 0), wait(0), recv(0, 0, 1, 1), wait(2)};
  const std::string v = simulate_in_order(p);
  EXPECT_NE(v.find("send A1.1 to 1 on 0 would be taken by rank 1's recv A1.0 from 0 on 0"), std::string::npos) << v;
}

TEST(PipelineInOrder, MalformedProgramsAreReported) {
  std::vector<std::vector<InOrderOp>> p(2);
  p[0] = {send(0, 0, 1, 0)};  // to itself
  EXPECT_NE(simulate_in_order(p).find("another of the 2 ranks"), std::string::npos);
  p[0] = {wait(0)};  // waits for nothing issued before it
  EXPECT_NE(simulate_in_order(p).find("not an earlier send or receive"), std::string::npos);
}

}  // namespace
}  // namespace dstrain
