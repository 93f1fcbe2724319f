// The layout planner behind `dstrain plan`: every layout of a model on N ranks that dstrain
// can run (data, tensor, pipeline with its schedule and virtual stages, expert, ZeRO stage,
// recomputation, micro-batch), each checked by the trainer's own layout check and priced by
// the performance model (plan/perf_model.h); the infeasible ones keep the reason.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "plan/perf_model.h"

namespace dstrain {

struct PlanSpace {
  std::vector<int> tensor, pipeline, expert, zero, micro_batch;
  std::vector<std::string> schedules;  // with a pipeline: "1f1b", "interleaved" (2 virtual stages), "dualpipev"
  std::vector<std::string> recompute;  // "none", "selective", "full"
};

// Every candidate size: tensor among the divisors of the ranks per node that divide the
// attention heads, pipeline among the divisors of the ranks up to the layers, expert among the
// divisors of the routed experts (MoE models), ZeRO 0-3, recompute none and full,
// micro-batches 1, 2 and 4, the pipeline schedules 1f1b, interleaved and dualpipev.
PlanSpace default_plan_space(const RunConfig& base, int world, int ranks_per_node);

struct Candidate {
  std::string label;  // "d8 t1 p4 e1 1f1b z1 rc=none mb=1"
  bool feasible = false;
  std::string reason;  // why not
  Prediction prediction;
  RunConfig config;
  bool full_trace = false;  // priced from a trace of the whole step (else the search's short one)
};

// Every layout of `space` for `base` on `world` ranks, feasible ones first, fastest first.
// `progress(done, total)` is called after each.
std::vector<Candidate> plan_layouts(const RunConfig& base, int world, const HardwareProfile& hw, const PlanSpace& space,
                                    const PredictOptions& opt,
                                    const std::function<void(size_t, size_t)>& progress = nullptr);

// The layout a candidate sets on a configuration.
RunConfig with_layout(const RunConfig& base, int tensor, int pipeline, int expert, const std::string& schedule,
                      int zero, const std::string& recompute, int micro_batch);

}  // namespace dstrain
