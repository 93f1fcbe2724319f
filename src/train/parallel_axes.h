// Each parallel axis's part in a training step, behind one interface. The trainer builds the
// axes of its layout (an axis of one rank is left out) and runs every axis's part at the same
// points of each step, in the order the gradients need them: the tensor group's partial sums,
// then the data-parallel reduction (the distributed optimizer), then the pipeline's tied
// weights. Nothing in the step asks which axes there are.
//
//   hooks()               the model's parameter hooks the axis adds (gradient sums, buckets,
//                         ZeRO-3's gathers), chained in the axes' order
//   begin_step()          before the step's first forward
//   begin_forward()       before each micro-batch's forward
//   begin_micro_step(l)   before each backward (l: the step's last one)
//   finish_gradients(t)   after the last backward: the axis's gradient work completed, its
//                         communication time and waits added to t
//   counts_in_norm(p)     whether this rank counts parameter p in the global gradient norm (each
//                         global element on exactly one rank)
//   record(r)             the axis's figures of the step
//   add_metrics(r, out)   its block of the metrics record
//   describe()            a line for the log at start-up
//
// The layout checks of each axis (sizes against the model, the batch and the schedule) run
// before any of this is built: train/layout_check.h.
#pragma once

#include <memory>
#include <string>

#include "comm/comm.h"
#include "core/json_reader.h"
#include "distributed/grad_reducer.h"
#include "distributed/tensor_parallel.h"
#include "model/ctx.h"
#include "optim/distributed_optimizer.h"
#include "state/params.h"
#include "train/step_record.h"

namespace dstrain {

class Transformer;
class PipelineRunner;

class ParallelAxis {
 public:
  virtual ~ParallelAxis() = default;
  virtual std::string describe() const { return ""; }
  virtual ParamHooks* hooks() { return nullptr; }
  virtual void begin_step() {}
  virtual void begin_forward() {}
  virtual void begin_micro_step(bool /*last*/) {}
  virtual void finish_gradients(ReduceTimings& /*t*/) {}
  virtual bool counts_in_norm(const ParamInfo& /*p*/) const { return true; }
  virtual void record(StepRecord& /*r*/) {}
  virtual void add_metrics(const StepRecord& /*r*/, json& /*out*/) const {}
};

// Tensor (and sequence) parallelism: the partial gradients of replicated parameters summed over
// the tensor group before the data-parallel reduction sees them; at ZeRO stages 2 and 3 every
// micro-step (the reduction then runs every micro-step too).
class TensorAxis final : public ParallelAxis {
 public:
  TensorAxis(Transformer& model, Communicator& tp, bool sum_every_micro_step);
  std::string describe() const override;
  ParamHooks* hooks() override { return sync_.needed() ? &sync_ : nullptr; }
  void begin_micro_step(bool last) override { sync_.begin_micro_step(last); }
  void finish_gradients(ReduceTimings& t) override;
  bool counts_in_norm(const ParamInfo& p) const override { return counts_piece(p, tp_.rank(), tp_.size()); }
  void record(StepRecord& r) override;
  void add_metrics(const StepRecord& r, json& out) const override;

 private:
  Transformer& model_;
  Communicator& tp_;
  TensorParallelGradSync sync_;
  CommStats before_;
};

// Data parallelism, ZeRO included: the distributed optimizer's reductions (over each parameter
// group's data-parallel ranks) and, at stage 3, its gathers.
class DataAxis final : public ParallelAxis {
 public:
  explicit DataAxis(DistributedOptimizer& optimizer) : opt_(optimizer) {}
  std::string describe() const override { return opt_.describe(); }
  ParamHooks* hooks() override { return &opt_; }
  void begin_step() override { opt_.begin_step(); }
  void begin_forward() override { opt_.begin_forward(); }
  void begin_micro_step(bool last) override { opt_.begin_micro_step(last); }
  void finish_gradients(ReduceTimings& t) override;
  void add_metrics(const StepRecord& r, json& out) const override;

 private:
  DistributedOptimizer& opt_;
};

// Pipeline parallelism: the tied embedding's two stages add their gradients once the data-parallel
// reduction has them (whole, or at ZeRO stages 2 and 3 this rank's reduced pieces); the stage that
// does not own it leaves it out of the norm.
class PipelineAxis final : public ParallelAxis {
 public:
  PipelineAxis(PipelineRunner& runner, Communicator& pp, std::string schedule, const Transformer& model,
               DistributedOptimizer& optimizer, std::string description);
  std::string describe() const override { return description_; }
  void finish_gradients(ReduceTimings& t) override;
  bool counts_in_norm(const ParamInfo& p) const override { return !p.pipeline_copy; }
  void record(StepRecord& r) override;
  void add_metrics(const StepRecord& r, json& out) const override;

 private:
  PipelineRunner& runner_;
  Communicator& pp_;
  std::string schedule_;
  const Transformer& model_;
  DistributedOptimizer& opt_;
  std::string description_;
};

// Expert parallelism: the routed experts split over the expert group, tokens sent to their
// owners by the MoE layers' all-to-alls (the layers hold the traffic; the routing statistics
// gather the received rows).
class ExpertAxis final : public ParallelAxis {
 public:
  ExpertAxis(Communicator& ep, std::string description) : ep_(ep), description_(std::move(description)) {}
  std::string describe() const override { return description_; }
  void add_metrics(const StepRecord& r, json& out) const override;

 private:
  Communicator& ep_;
  std::string description_;
};

// The expert axis's start-up line: experts per rank and how group-limited routing bounds the
// ranks a token's rows go to.
std::string describe_expert_layout(const ModelConfig& mc, int ep, const std::string& groups);

}  // namespace dstrain
