#include "plan/planner.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace dstrain {
namespace {

std::vector<int> divisors(int64_t n, int64_t up_to) {
  std::vector<int> out;
  for (int64_t d = 1; d <= std::min(n, up_to); ++d)
    if (n % d == 0) out.push_back(int(d));
  return out;
}

}  // namespace

PlanSpace default_plan_space(const RunConfig& base, int world, int ranks_per_node) {
  const ModelConfig& m = base.model;
  PlanSpace s;
  for (int t : divisors(ranks_per_node, ranks_per_node)) {
    if (world % t == 0 && m.num_attention_heads % t == 0) s.tensor.push_back(t);
  }
  for (int p : divisors(world, m.num_hidden_layers)) s.pipeline.push_back(p);
  s.expert = m.n_routed_experts > 0 ? divisors(m.n_routed_experts, world) : std::vector<int>{1};
  s.zero = {0, 1, 2, 3};
  s.micro_batch = {1, 2, 4};
  s.schedules = {"1f1b", "interleaved", "dualpipev"};
  s.recompute = {"none", "full"};
  return s;
}

RunConfig with_layout(const RunConfig& base, int tensor, int pipeline, int expert, const std::string& schedule,
                      int zero, const std::string& recompute, int micro_batch) {
  RunConfig c = base;
  c.parallel.data = 0;  // auto
  c.parallel.tensor = tensor;
  c.parallel.pipeline = pipeline;
  c.parallel.expert = expert;
  c.parallel.partition.clear();
  if (pipeline > 1) {
    c.parallel.schedule = schedule;
    c.parallel.virtual_stages = schedule == "interleaved" ? 2 : 1;
  }
  c.train.zero.stage = zero;
  c.train.activation_checkpointing = ActivationCheckpointingConfig();
  if (recompute == "full") c.train.activation_checkpointing.set_full();
  if (recompute == "selective") c.train.activation_checkpointing.granularity = "selective";
  c.train.micro_batch = micro_batch;
  c.train.grad_accum = 0;
  return c;
}

std::vector<Candidate> plan_layouts(const RunConfig& base, int world, const HardwareProfile& hw, const PlanSpace& space,
                                    const PredictOptions& opt, const std::function<void(size_t, size_t)>& progress) {
  struct Point {
    int t, p, e;
    std::string sched;
    int z;
    std::string rc;
    int mb;
  };
  std::vector<Point> points;
  for (int t : space.tensor)
    for (int p : space.pipeline) {
      if (world % (int64_t(t) * p)) continue;
      const int data = world / (t * p);
      for (int e : space.expert) {
        if (data % e) continue;
        const std::vector<std::string> scheds = p > 1 ? space.schedules : std::vector<std::string>{"none"};
        for (const std::string& sc : scheds)
          for (int z : space.zero)
            for (const std::string& rc : space.recompute)
              for (int mb : space.micro_batch) points.push_back({t, p, e, sc, z, rc, mb});
      }
    }
  std::vector<Candidate> out;
  for (size_t i = 0; i < points.size(); ++i) {
    const Point& pt = points[i];
    Candidate c;
    c.label = fmt::format("d{} t{} p{} e{}{} z{} rc={} mb={}", world / (pt.t * pt.p), pt.t, pt.p, pt.e,
                          pt.p > 1 ? " " + pt.sched : std::string(), pt.z, pt.rc, pt.mb);
    c.config = with_layout(base, pt.t, pt.p, pt.e, pt.sched, pt.z, pt.rc, pt.mb);
    try {
      c.prediction = predict(c.config, world, hw, opt);
      c.feasible = c.prediction.fits;
      if (!c.feasible)
        c.reason = fmt::format("memory: {:.2f} GB per rank at its peak, {:.2f} GB available",
                               double(c.prediction.peak_memory) / 1e9, c.prediction.memory_available / 1e9);
    } catch (const Error& e) {
      c.feasible = false;
      c.reason = e.what();
    }
    out.push_back(std::move(c));
    if (progress) progress(i + 1, points.size());
  }
  std::stable_sort(out.begin(), out.end(), [](const Candidate& x, const Candidate& y) {
    if (x.feasible != y.feasible) return x.feasible;
    return x.prediction.tokens_per_second > y.prediction.tokens_per_second;
  });
  return out;
}

}  // namespace dstrain
