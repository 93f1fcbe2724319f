// Parameter groups in the registry (runs of dense and expert parameters, their flat element
// ranges and gradient views) and the hook chain a Ctx calls: every hook sees every
// before_use and grad_ready, in the order the hooks were added.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/param_hooks.h"
#include "model/ctx.h"
#include "state/params.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ParamOptions in_group(ParamGroup g, bool follow_previous = false) {
  ParamOptions o;
  o.group = g;
  o.follow_previous = follow_previous;
  return o;
}

// A small MoE-shaped registry: dense and expert parameters interleave, one fused expert pair.
//   id  name       group   shape   offset (16-element alignment)
//   0   embed      dense   (8,4)     0
//   1   attn       dense   (4,4)    32
//   2   router     dense   (2,4)    48
//   3   e0.gate    expert  (3,4)    64
//   4   e0.up      expert  (3,4)    76  follows e0.gate: one fused (6,4) matrix
//   5   e1.gate    expert  (3,4)    96
//   6   norm       dense   (4)     112
//   7   e2.bias    expert  (5)     128
//   8   head       dense   (8,4)   144
ParamRegistry moe_registry() {
  ParamRegistry reg;
  const auto D = ParamGroup::Dense, E = ParamGroup::Expert;
  reg.add("embed", Shape{8, 4}, ParamKind::Embedding, -1, in_group(D));
  reg.add("attn", Shape{4, 4}, ParamKind::Linear, 0, in_group(D));
  reg.add("router", Shape{2, 4}, ParamKind::Linear, 0, in_group(D));
  reg.add("e0.gate", Shape{3, 4}, ParamKind::Linear, 0, in_group(E));
  reg.add("e0.up", Shape{3, 4}, ParamKind::Linear, 0, in_group(E, /*follow_previous=*/true));
  reg.add("e1.gate", Shape{3, 4}, ParamKind::Linear, 0, in_group(E));
  reg.add("norm", Shape{4}, ParamKind::Norm, 0, in_group(D));
  reg.add("e2.bias", Shape{5}, ParamKind::Linear, 0, in_group(E));
  reg.add("head", Shape{8, 4}, ParamKind::Head, -1, in_group(D));
  return reg;
}

struct Run {
  ParamGroup group;
  int first, last;
  int64_t begin, end;
};

void expect_runs(const std::vector<ParamRun>& got, const std::vector<Run>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE("run " + std::to_string(i));
    EXPECT_EQ(got[i].group, want[i].group);
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].last, want[i].last);
    EXPECT_EQ(got[i].begin, want[i].begin);
    EXPECT_EQ(got[i].end, want[i].end);
  }
}

TEST(ParamGroups, RegistryCutsInterleavedGroupsIntoRuns) {
  ParamRegistry reg = moe_registry();
  const auto D = ParamGroup::Dense, E = ParamGroup::Expert;
  EXPECT_EQ(reg.info(4).offset, 76) << "a follower sits right after its leader";
  expect_runs(reg.runs(), {{D, 0, 2, 0, 56}, {E, 3, 5, 64, 108}, {D, 6, 6, 112, 116}, {E, 7, 7, 128, 133},
                           {D, 8, 8, 144, 176}});
  expect_runs(reg.group_ranges(D), {{D, 0, 2, 0, 56}, {D, 6, 6, 112, 116}, {D, 8, 8, 144, 176}});
  expect_runs(reg.group_ranges(E), {{E, 3, 5, 64, 108}, {E, 7, 7, 128, 133}});
  EXPECT_EQ(reg.group_numel(D), 32 + 16 + 8 + 4 + 32);
  EXPECT_EQ(reg.group_numel(E), 12 + 12 + 12 + 5);
}

TEST(ParamGroups, OneGroupIsOneRun) {
  ParamRegistry reg;
  reg.add("a", Shape{3}, ParamKind::Norm, 0);
  reg.add("b", Shape{5, 2}, ParamKind::Linear, 0);
  expect_runs(reg.runs(), {{ParamGroup::Dense, 0, 1, 0, 26}});
  EXPECT_TRUE(reg.group_ranges(ParamGroup::Expert).empty());
  EXPECT_EQ(reg.group_numel(ParamGroup::Expert), 0);
}

TEST(ParamGroups, GradRangeViewsTheGroupsElementsOfTheFlatBuffer) {
  ParamRegistry reg = moe_registry();
  reg.allocate(Device::cpu());
  float* g = reg.grads().data<float>();
  for (int64_t i = 0; i < reg.grads().numel(); ++i) g[i] = float(i);
  for (const ParamRun& r : reg.group_ranges(ParamGroup::Expert)) {
    Tensor t = reg.grad_range(r);
    ASSERT_EQ(t.numel(), r.end - r.begin);
    EXPECT_EQ(t.data<float>()[0], float(r.begin));
    EXPECT_EQ(t.data<float>()[t.numel() - 1], float(r.end - 1));
    // The run's first and last parameters' gradients are inside the view.
    EXPECT_EQ(reg.grad(r.first).data<float>(), t.data<float>());
    EXPECT_EQ(reg.grad(r.last).data<float>() + reg.info(r.last).numel(), t.data<float>() + t.numel());
  }
  ParamRun outside{ParamGroup::Dense, 0, 0, 170, 400};
  EXPECT_THAT(error_of([&] { reg.grad_range(outside); }), HasSubstr("outside the 176 registered elements"));
}

TEST(ParamGroups, FusedParametersMustShareAGroup) {
  ParamRegistry reg;
  reg.add("shared.gate", Shape{3, 4}, ParamKind::Linear, 0);
  const std::string msg =
      error_of([&] { reg.add("e0.up", Shape{3, 4}, ParamKind::Linear, 0, in_group(ParamGroup::Expert, true)); });
  EXPECT_THAT(msg, HasSubstr("'e0.up' (expert) cannot follow 'shared.gate' (dense)"));
}

// Records every call, tagged with the hook's name.
class RecordingHooks : public ParamHooks {
 public:
  RecordingHooks(std::string name, std::vector<std::string>& log) : name_(std::move(name)), log_(log) {}
  void before_use(int first, int last) override { log_.push_back(fmt::format("{}.use({},{})", name_, first, last)); }
  void grad_ready(int first, int last) override { log_.push_back(fmt::format("{}.ready({},{})", name_, first, last)); }

 private:
  std::string name_;
  std::vector<std::string>& log_;
};

TEST(ParamHookChain, EveryHookSeesEveryCallInTheOrderAdded) {
  std::vector<std::string> log;
  RecordingHooks gather("gather", log), buckets("buckets", log);
  ParamHookChain chain;
  chain.add(gather);
  chain.add(buckets);
  EXPECT_EQ(chain.size(), 2);
  // What a two-layer model does through its Ctx: forward uses layer 0 then 1, backward uses
  // them again in reverse and reports their gradients.
  Ctx ctx;
  ctx.hooks = &chain;
  ctx.before_use(0, 2);
  ctx.before_use(3, 5);
  ctx.before_use(3, 5);
  ctx.grad_ready(3, 5);
  ctx.before_use(0, 2);
  ctx.grad_ready(0, 2);
  const std::vector<std::string> want = {
      "gather.use(0,2)",    "buckets.use(0,2)",    "gather.use(3,5)",    "buckets.use(3,5)",
      "gather.use(3,5)",    "buckets.use(3,5)",    "gather.ready(3,5)",  "buckets.ready(3,5)",
      "gather.use(0,2)",    "buckets.use(0,2)",    "gather.ready(0,2)",  "buckets.ready(0,2)",
  };
  EXPECT_EQ(log, want);
}

TEST(ParamHookChain, ChainsNestAndEmptyOnesDoNothing) {
  std::vector<std::string> log;
  RecordingHooks a("a", log), b("b", log), c("c", log);
  ParamHookChain inner, outer, empty;
  inner.add(b);
  inner.add(c);
  outer.add(a);
  outer.add(inner);
  outer.add(empty);
  outer.grad_ready(7, 7);
  EXPECT_EQ(log, (std::vector<std::string>{"a.ready(7,7)", "b.ready(7,7)", "c.ready(7,7)"}));
}

TEST(ParamHookChain, AHookIsAddedOnce) {
  std::vector<std::string> log;
  RecordingHooks a("a", log);
  ParamHookChain chain;
  chain.add(a);
  EXPECT_THAT(error_of([&] { chain.add(a); }), HasSubstr("added twice"));
  EXPECT_THAT(error_of([&] { chain.add(chain); }), HasSubstr("cannot contain itself"));
  chain.before_use(1, 1);
  EXPECT_EQ(log, std::vector<std::string>{"a.use(1,1)"});
}

}  // namespace
}  // namespace dstrain
