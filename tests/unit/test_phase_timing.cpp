// The training step's forward / backward / optimizer split (model/ctx.h's PhaseTimer) from timing
// marks (backend/timing.h): a mark at every phase boundary, the time read once per step, and on
// a model every op of a forward and a backward counted in exactly one phase. A recording clock
// stands in for a GPU's events; on a machine with a GPU the CUDA events are checked too.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda_device.h"
#include "backend/ops.h"
#include "backend/timing.h"
#include "core/buffer.h"
#include "core/clock.h"
#include "../gpu_test.h"
#include "fake_backend.h"
#include "model/ctx.h"
#include "model/transformer.h"
#include "tiny_models.h"

namespace dstrain {
namespace {

// What the recording clocks saw: the time of each mark of the round, the waits for the device
// (a GPU clock's first read of a round), the rounds and the most marks one round held.
struct Recording {
  std::vector<double> marks;
  int waits = 0, restarts = 0;
  size_t pool = 0;
};

// A clock whose time is a number the test (or the counting backend below) sets, read as a GPU's
// events are: a read after a mark first waits, once, for the round's last mark.
class RecordingClock final : public MarkClock {
 public:
  RecordingClock(Recording* rec, std::function<double()> now) : rec_(rec), now_(std::move(now)) {}
  int mark() override {
    rec_->marks.push_back(now_());
    rec_->pool = std::max(rec_->pool, rec_->marks.size());
    waited_ = false;
    return int(rec_->marks.size()) - 1;
  }
  double seconds(int from, int to) override {
    EXPECT_LE(from, to);
    EXPECT_LT(size_t(to), rec_->marks.size());
    if (!waited_) {
      ++rec_->waits;
      waited_ = true;
    }
    return rec_->marks[size_t(to)] - rec_->marks[size_t(from)];
  }
  void restart() override {
    rec_->marks.clear();
    ++rec_->restarts;
    waited_ = false;
  }

 private:
  Recording* rec_;
  std::function<double()> now_;
  bool waited_ = false;
};

TEST(Timing, HostMarksReadTheHostClock) {
  HostMarkClock clock;
  const auto before = Clock::now();
  EXPECT_EQ(clock.mark(), 0);
  const auto t0 = Clock::now();
  while (seconds_since(t0) < 0.002) {
  }
  EXPECT_EQ(clock.mark(), 1);
  const double s = clock.seconds(0, 1);
  EXPECT_GE(s, 0.002);
  EXPECT_LE(s, seconds_since(before));
  EXPECT_EQ(clock.seconds(1, 1), 0.0);
  EXPECT_THROW(clock.seconds(0, 2), Error);
  clock.restart();
  EXPECT_EQ(clock.mark(), 0);  // a new round numbers its marks from 0
  // The host, and any device without a clock of its own, times with it.
  EXPECT_NE(dynamic_cast<HostMarkClock*>(make_mark_clock(Device::cpu()).get()), nullptr);
}

TEST(Timing, NestedPhasesSplitTheTimeAtEveryBoundaryAndAreReadOncePerStep) {
  Recording rec;
  double now = 0;
  PhaseTimer timer(std::make_unique<RecordingClock>(&rec, [&now] { return now; }));
  for (int step = 0; step < 3; ++step) {
    {
      const PhaseTimer::Scope forward(&timer, Phase::Forward);
      now += 3;
      {
        const PhaseTimer::Scope head_grad(&timer, Phase::Backward);  // the loss gradient inside the forward
        now += 2;
      }
      now += 1;
    }
    now += 10;  // between phases: in none
    {
      const PhaseTimer::Scope backward(&timer, Phase::Backward);
      now += 5;
      const PhaseTimer::Scope same(&timer, Phase::Backward);  // no boundary, no mark
      now += 1;
    }
    const PhaseTimer::Scope untimed(nullptr, Phase::Forward);  // a Ctx without a timer
    {
      const PhaseTimer::Scope optimizer(&timer, Phase::Optimizer);
      now += 4;
    }
    // One mark per boundary: forward, head gradient in and out, forward's end, backward, optimizer.
    const double s = 16.0 * step + 10.0 * step;
    EXPECT_EQ(rec.marks, (std::vector<double>{s, s + 3, s + 5, s + 6, s + 16, s + 22, s + 22, s + 26}))
        << "step " << step;
    EXPECT_EQ(rec.waits, step);  // nothing waits for the device before the step's split is read
    const PhaseSeconds t = timer.take();
    EXPECT_EQ(rec.waits, step + 1);  // then once
    EXPECT_EQ(t.forward, 4.0);
    EXPECT_EQ(t.backward, 2.0 + 6.0);
    EXPECT_EQ(t.optimizer, 4.0);
    EXPECT_EQ(t.forward + t.backward + t.optimizer, (s + 26) - s - 10) << "every marked span counts once";
    EXPECT_EQ(rec.marks.size(), 0u);  // the round's marks go back to the pool
    EXPECT_EQ(rec.pool, 8u);
  }
  const PhaseSeconds none = timer.take();  // nothing since the last take
  EXPECT_EQ(none.forward + none.backward + none.optimizer, 0.0);
}

TEST(Timing, APhaseLeftByAnErrorOrOpenAcrossATakeIsCountedInFull) {
  Recording rec;
  double now = 0;
  PhaseTimer timer(std::make_unique<RecordingClock>(&rec, [&now] { return now; }));
  try {
    const PhaseTimer::Scope forward(&timer, Phase::Forward);
    now += 2;
    throw std::runtime_error("out of memory");
  } catch (const std::runtime_error&) {
  }
  now += 1;
  PhaseSeconds t;
  {
    const PhaseTimer::Scope backward(&timer, Phase::Backward);
    now += 3;
    t = timer.take();  // up to now; the rest of the phase goes to the next step
    EXPECT_EQ(rec.marks.size(), 1u) << "the open phase goes on from a new mark";
    now += 4;
  }
  EXPECT_EQ(t.forward, 2.0);
  EXPECT_EQ(t.backward, 3.0);
  EXPECT_EQ(timer.take().backward, 4.0);
}

TEST(Timing, ALongRunWithoutATakeKeepsItsMarksBounded) {
  // A loop of forwards whose split is never read (evaluation, a benchmark) must not hold a
  // mark (a GPU event) per call.
  Recording rec;
  double now = 0;
  PhaseTimer timer(std::make_unique<RecordingClock>(&rec, [&now] { return now; }));
  const int n = 20000;
  for (int i = 0; i < n; ++i) {
    const PhaseTimer::Scope forward(&timer, Phase::Forward);
    now += 1;
  }
  EXPECT_LE(rec.pool, 2 * 4096 + 2u);
  EXPECT_GE(rec.restarts, 1);
  EXPECT_EQ(timer.take().forward, double(n));
}

// ---- on a model ---------------------------------------------------------------------------------
// A backend on the emulated device whose ops are the fake backend's, counted, and whose clock
// reads the count: the device's time is the number of ops it has run (1 ms each), so the split
// of a forward and a backward must account for every op of them, each in one phase.

// Ops run on several threads at once (the experts' GEMMs): counted atomically.
std::atomic<int64_t> g_ops{0};
double device_seconds() { return 1e-3 * double(g_ops.load()); }
Recording g_rec;
OpTable g_inner;

using ops::AdamWStep;
using ops::AttentionLayout;
using ops::MoEDropPolicy;
using ops::MoERouteParams;
using ops::MoEScoring;
using ops::YarnParams;

#define DS_OP(name, params, args)  \
  template <size_t K>              \
  void counted_##name params {     \
    ++g_ops;                       \
    g_inner.name[K] args;          \
  }
#include "backend/ops.def"
#undef DS_OP

std::unique_ptr<MarkClock> make_counting_clock(Device) {
  return std::make_unique<RecordingClock>(&g_rec, &device_seconds);
}

// Puts the counting backend in the fake backend's place for the test's lifetime.
class CountingDevice {
 public:
  CountingDevice() {
    device_ = fake::use_fake_backend();
    saved_ = *find_backend(DeviceType::Emulated);
    g_inner = saved_.ops;
    auto b = std::make_unique<Backend>(saved_);
    b->name = "counting";
    b->make_mark_clock = &make_counting_clock;
    static_assert(kKernelDTypes == 3, "one line per kernel dtype below");
#define DS_OP(name, params, args)                                        \
  b->ops.name[0] = g_inner.name[0] ? &counted_##name<0> : nullptr;      \
  b->ops.name[1] = g_inner.name[1] ? &counted_##name<1> : nullptr;      \
  b->ops.name[2] = g_inner.name[2] ? &counted_##name<2> : nullptr;
#include "backend/ops.def"
#undef DS_OP
    unregister_backend(DeviceType::Emulated);
    register_backend(std::move(b));
    g_rec = Recording{};
  }
  ~CountingDevice() {
    unregister_backend(DeviceType::Emulated);
    register_backend(std::make_unique<Backend>(saved_));
  }
  Device device() const { return device_; }

 private:
  Device device_;
  Backend saved_;
};

TEST(TimingOnTheModel, EveryOpOfAForwardAndABackwardIsInExactlyOnePhase) {
  const CountingDevice dev;
  // The head forms its loss gradient inside the forward (both models), and DeepSeek-V3's MTP
  // module runs its backward there: both are marked as backward.
  for (const bool v3 : {false, true}) {
    SCOPED_TRACE(v3 ? "DeepSeek-V3 with MTP" : "dense");
    g_rec = Recording{};
    const ModelConfig c = v3 ? tiny_v3(1) : tiny_dense(true, false);
    Transformer m(c, dev.device());
    m.init_weights(3);
    const int64_t B = 2, T = 8;
    std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = int32_t((7 * i + 3) % size_t(c.vocab_size));
      targets[i] = int32_t((5 * i + 1) % size_t(c.vocab_size));
    }
    const Tensor tok(tokens.data(), DType::I32, Shape{B, T}), tgt(targets.data(), DType::I32, Shape{B, T});
    LossScales scales;
    scales.token = 1.0f / float(B * T);
    scales.sequence = 1.0 / double(B);
    scales.micro_batch = 1.0;
    if (v3) scales.mtp_token = {0.3f / float(B * T)};
    ASSERT_NE(m.ctx().phases, nullptr);
    (void)m.forward_loss(tok, tgt);  // builds the rotary tables, which later forwards reuse
    (void)m.ctx().phases->take();
    size_t marks_of_a_step = 0;
    for (int step = 0; step < 3; ++step) {
      SCOPED_TRACE("step " + std::to_string(step));
      // A forward alone: its ops split between forward and the backward parts it runs.
      double t0 = device_seconds();
      (void)m.forward(0, tok, tgt, scales);
      const double forward_ops = device_seconds() - t0;
      const size_t forward_marks = g_rec.marks.size();
      const PhaseSeconds alone = m.ctx().phases->take();
      EXPECT_GT(alone.forward, 0.5 * forward_ops);
      // At least the cross-entropy gradient and the head's linear backward.
      EXPECT_GE(alone.backward, 2e-3 - 1e-12) << "the loss gradient formed in the forward is backward";
      EXPECT_NEAR(alone.forward + alone.backward, forward_ops, 1e-9);
      EXPECT_EQ(alone.optimizer, 0.0);
      // The backward: all backward.
      t0 = device_seconds();
      m.backward(0);
      const double backward_ops = device_seconds() - t0;
      PhaseSeconds s = m.ctx().phases->take();
      EXPECT_EQ(s.forward, 0.0);
      EXPECT_GT(backward_ops, 0.0);
      EXPECT_NEAR(s.backward, backward_ops, 1e-9);
      // Both in one step, as the trainer runs them: no wait for the device until the split is
      // read, then one.
      const int waits = g_rec.waits;
      t0 = device_seconds();
      (void)m.forward_backward(tok, tgt, scales);
      const double step_ops = device_seconds() - t0;
      EXPECT_EQ(g_rec.waits, waits) << "a phase's end waited for the device";
      if (step == 0) marks_of_a_step = g_rec.marks.size();
      EXPECT_EQ(g_rec.marks.size(), marks_of_a_step);
      EXPECT_EQ(g_rec.marks.size(), forward_marks + 2);  // the backward's start and end
      s = m.ctx().phases->take();
      EXPECT_EQ(g_rec.waits, waits + 1);
      EXPECT_NEAR(s.forward + s.backward, step_ops, 1e-9);
      EXPECT_NEAR(s.forward, alone.forward, 1e-9);
      EXPECT_NEAR(s.backward, alone.backward + backward_ops, 1e-9);
    }
    EXPECT_EQ(g_rec.pool, marks_of_a_step) << "the marks are reused step after step";
  }
}

// ---- on a GPU -------------------------------------------------------------------------------------

TEST(TimingOnGpu, EventMarksReadTheGpusTimeWithoutWaitingAtEveryMark) {
  DSTRAIN_SKIP_WITHOUT_GPU();
  const Device gpu = cuda::use_device(0);
  EXPECT_EQ(dynamic_cast<HostMarkClock*>(make_mark_clock(gpu).get()), nullptr) << "the GPU times with events";
  Buffer big("test.timing", MemCategory::Workspace, DType::F32, int64_t(1) << 28, gpu);  // 1 GiB
  ops::fill(big.tensor(), 0.0f);
  cuda::synchronize();
  PhaseTimer timer(gpu);
  for (int step = 0; step < 2; ++step) {
    const auto h0 = Clock::now();
    {
      const PhaseTimer::Scope forward(&timer, Phase::Forward);
      for (int i = 0; i < 40; ++i) ops::fill(big.tensor(), float(i));
    }
    {
      const PhaseTimer::Scope backward(&timer, Phase::Backward);
      for (int i = 0; i < 20; ++i) ops::fill(big.tensor(), float(i));
    }
    const double issued = seconds_since(h0);
    const PhaseSeconds s = timer.take();
    const double wall = seconds_since(h0);
    SCOPED_TRACE("step " + std::to_string(step));
    EXPECT_GT(s.backward, 0.0);
    EXPECT_NEAR(s.forward / s.backward, 2.0, 0.5);  // twice the fills
    EXPECT_LE(s.forward + s.backward, wall);
    // The marks did not wait for the fills: issuing them took less than running them.
    EXPECT_LT(issued, s.forward + s.backward);
  }
}

}  // namespace
}  // namespace dstrain
