// The performance model: the step time, throughput and memory of a run configuration on a job
// of N ranks of a hardware profile (plan/hardware.h), before the job is submitted.
//
// It reuses the real thing rather than formulas beside it (DESIGN.md, seam 5). For each
// pipeline stage, one rank's steady-state step runs on the meta device through the trainer's
// own layers, recompute policy, distributed optimizer, parallel axes and pipeline runner
// (train/memory_model.h's trace_step), which gives, in order, every op with its FLOPs and bytes
// and every collective with its group, payload, and where it was issued and waited for. Then:
//
//   one rank's clock   each op costs op_seconds(); a collective runs on its group's link
//                      from the moment it is issued (one at a time per group) and the compute
//                      waits for it only where the code waits (so data-parallel buckets hide
//                      behind the backward that follows them, tensor-parallel reductions do
//                      not); what is left when the compute reaches a wait is exposed.
//   the pipeline       the actions' durations on that clock go through the schedule's own
//                      simulator (distributed/schedule.h, simulate_step) with the activation
//                      message's transfer between stages: the bubble of the real schedule.
//   the step           the slowest stage's end plus its gradient reduction and optimizer.
//
// Memory per rank is the memory model's, from the same runs. MoE layers are priced at the
// load metrics.expert_imbalance states (the traced rank is the hot one).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "plan/hardware.h"
#include "train/memory_model.h"
#include "train/run_config.h"

namespace dstrain {

struct StagePrediction {
  int pipeline = 0;
  double compute = 0;          // seconds of ops in the step
  double exposed_comm = 0;     // seconds the compute waited for collectives
  double busy = 0;             // its actions' seconds (compute + exposed waits inside them)
  double finish = 0;           // when its last action ends, in the pipeline's simulation
  double tail = 0;             // gradient reduction waits, clipping and the optimizer after it
  double flops = 0;            // FLOPs of its ops (recomputation included)
  std::map<std::string, double> by_class;      // op class -> seconds
  std::map<std::string, double> by_op;         // op name -> seconds
  std::map<std::string, double> comm_total;    // group -> seconds its collectives took on the link
  std::map<std::string, double> comm_exposed;  // group -> seconds the compute waited for them
  double p2p_bytes = 0;        // largest point-to-point message
};

// Aggregation between replicas (train.gradient_sync) priced beside the traced step: the outer
// all-reduce of each rank's pieces of the weights (or, delayed, of the gradients) over the
// replicas, on the link their ranks cross.
struct GradientSyncPrice {
  std::string mode = "sync";
  int64_t every = 1;
  double step_seconds = 0;     // the step with this aggregation
  double outer_seconds = 0;    // one outer all-reduce on the link
  double exposed_seconds = 0;  // what a step waits for it, on average
};

struct Prediction {
  int world = 1;
  AxisSizes sizes;
  std::string schedule;
  int64_t global_batch = 0, seq_len = 0, micro_batch = 0, grad_accum = 0;
  int zero_stage = 0;
  std::string recompute;
  double step_seconds = 0;
  double tokens_per_second = 0;
  double model_flops_per_step = 0;     // without recomputation, at balanced expert loads
  double hardware_flops_per_step = 0;  // what the ranks run (recomputation included)
  double mfu = 0;                      // model FLOP/s over the world's peak at the compute dtype
  double peak_flops_per_rank = 0;
  double bubble_fraction = 0;          // idle share of the pipeline's ranks before their tails
  double p2p_seconds = 0;              // one activation message between stages
  int64_t peak_memory = 0;             // the largest rank's peak (memory model)
  double memory_available = 0;         // per rank, from the profile
  bool fits = true;
  std::vector<StagePrediction> stages;
  MemoryEstimate memory;
  std::string profile;
  bool profile_calibrated = false;
  bool efficiency_fitted = false;
  // The run's aggregation (its outer all-reduce already in step_seconds), and for a synchronous
  // run with data parallelism the same layout with each data rank a replica (over "data"):
  // delayed, and DiLoCo / local SGD every 8, 32 and 128 steps.
  GradientSyncPrice gradient_sync;
  int replicas = 1, data_per_replica = 1;
  double data_exposed_seconds = 0;  // the synchronous data-parallel wait the alternatives drop
  std::vector<GradientSyncPrice> sync_alternatives;
};

struct PredictOptions {
  PriceOptions price;
  // Counts model FLOPs in a second trace without recomputation at balanced loads when they
  // differ from the run's (MFU); off, hardware FLOPs stand for them.
  bool model_flops = true;
  // Traces 2 micro-batches per pipeline rank (2 without a pipeline) and gives the others their
  // traced twins' cost: the step time as a full trace prices it (within a fraction of a percent)
  // at a fraction of the cost, but memory from fewer messages in flight than the step holds on
  // the meta device (its sends complete when waited for: an upper bound that grows with the
  // micro-batches), and the limits a full step checks (the pipeline's message tags) unchecked.
  // For searches; off, every micro-batch of the step is traced.
  bool cap_traced_micro_batches = false;
};

// Throws what check_layout throws for a layout dstrain refuses.
Prediction predict(const RunConfig& config, int world, const HardwareProfile& hw, const PredictOptions& opt = {});

// One line per item of the step's breakdown (what `dstrain plan --explain` prints).
std::vector<std::string> explain(const Prediction& p);
json prediction_to_json(const Prediction& p);

// Whether the ranks of a group of this layout sit on more than one node (ranks_per_node each).
bool group_spans_nodes(const std::string& group, const AxisSizes& a, int ranks_per_node);

}  // namespace dstrain
