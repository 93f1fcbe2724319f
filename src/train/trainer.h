// The training loop. For each step: for each micro-batch, next batch, forward, backward
// (gradients accumulate; each parallel axis's hooks reduce them as the backward finishes them:
// train/parallel_axes.h); then every axis finishes its gradient work, clip, schedule, the
// distributed optimizer's step; then metrics, evaluation, samples. The member functions live in
// trainer.cpp (construction and the step), trainer_state.cpp (weights and checkpoints in and
// out), trainer_metrics.cpp (what a step reports) and trainer_eval.cpp (evaluation, samples).
#pragma once

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "backend/ops.h"
#include "comm/environment.h"
#include "comm/grid.h"
#include "core/clock.h"
#include "data/data_pipeline.h"
#include "data/tokenizer.h"
#include "distributed/grad_reducer.h"
#include "distributed/param_hooks.h"
#include "distributed/schedule.h"
#include "distributed/tensor_parallel.h"
#include "io/sharded_model_state.h"
#include "optim/distributed_optimizer.h"
#include "model/transformer.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "train/checkpointing.h"
#include "train/gpu_monitor.h"
#include "train/layout_check.h"
#include "train/metrics.h"
#include "train/pipeline.h"
#include "train/run_config.h"
#include "train/run_lock.h"
#include "train/step_record.h"
#include "train/parallel_axes.h"
#include "train/timeline.h"

namespace dstrain {

// A batch's token ids (B rows of T) as the model takes them.
inline Tensor tokens_tensor(std::vector<int32_t>& v, int64_t B, int64_t T) {
  return Tensor(v.data(), DType::I32, Shape{B, T});
}

class Trainer {
 public:
  // The grid's data axis gives the data-parallel ranks; the trainer keeps a reference.
  Trainer(RunConfig config, ProcessGrid& grid, Device device = Device::cpu());

  // Initial weights: from a Hugging Face directory, a safetensors file or a dstrain
  // checkpoint (its model tensors) when given, otherwise Hugging Face's initialisation from
  // train.seed. Weights with a NaN or Inf are an error; so are ranks whose weights differ
  // (another --init-from, a stale copy of the files): every rank names its path and host.
  void init_weights(const std::string& init_from);
  // Continues a run: "auto" takes the newest valid checkpoint of checkpoint.dir (an invalid
  // one is reported and the next older one tried); otherwise `spec` is a checkpoint file.
  // Weights, optimizer state, step, schedule and data position are restored. Returns false
  // when "auto" found no checkpoint and no `latest` marker (a run whose checkpoints were all
  // removed is an error). Ranks given different files, and a checkpoint of another model
  // architecture, are errors that say so.
  bool resume(const std::string& spec);
  // Takes output.dir and checkpoint.dir for this run (a lock file naming host and pid, held
  // until the trainer is destroyed) and checks that output.save_hf can be written, before any
  // training; a failure is an error on every rank.
  void claim_output_dirs();
  // Writes a checkpoint of the current state (in the background when checkpoint.async);
  // returns the seconds training was held up.
  double save_checkpoint();
  CheckpointManager& checkpoints() { return *ckpt_; }
  // Trains until train.max_steps optimizer steps have been taken, or until a stop signal
  // (SIGUSR1/SIGTERM) after which every rank saves a checkpoint at the same step boundary.
  enum class Outcome { Completed, StoppedOnSignal };
  Outcome train();
  // Mean token loss over the first `batches` micro-batches of samples of each evaluation
  // dataset, in order (no shuffle), shared out over the data-parallel ranks: one entry per
  // dataset, then the token-weighted total.
  std::vector<LossSums> evaluate_each(int64_t batches);
  LossSums evaluate(int64_t batches) { return evaluate_each(batches).back(); }
  std::string eval_report(const std::vector<LossSums>& e) const;
  // A sample continuation of the configured prompt (the same on every rank).
  std::string sample(const std::string& prompt);
  // Writes Hugging Face weights (rank 0; every rank returns after the files exist).
  void save_hf(const std::string& dir);

  Transformer& model() { return *model_; }
  // The optimizer of every ZeRO stage (stage 0: AdamW on the whole local weights).
  DistributedOptimizer& optimizer() { return *optimizer_; }
  // Asynchronous aggregation between replicas (null: train.gradient_sync.mode "sync").
  GradientSync* gradient_sync() { return sync_.get(); }
  int64_t optimizer_steps() const { return optimizer_->steps_taken(); }
  const LossScaler& loss_scaler() const { return *scaler_; }
  const RunConfig& config() const { return config_; }
  const std::vector<StepRecord>& history() const { return history_; }
  // The run's metrics (null before train()).
  const Metrics* metrics() const { return metrics_.get(); }
  // The job's build, libraries and CPUs, as recorded in checkpoints and metrics.jsonl.
  const json& environment() const { return environment_.record; }
  int64_t step() const { return step_; }
  // Called after every optimizer step (tests check cross-rank agreement here).
  std::function<void(const StepRecord&)> on_step;
  // The clock of checkpoint.interval_minutes. Clocks of different nodes disagree; tests give
  // each rank its own to check that rank 0's alone decides.
  std::function<Clock::time_point()> clock = [] { return Clock::now(); };
  // The bytes this rank may hold in all when a step starts, or -1 when unknown: by default what
  // it holds now plus its share of what the device has free (the host's MemAvailable over the
  // node's ranks; a GPU's free memory), capped by metrics.memory_budget_gb. Tests replace it.
  std::function<int64_t()> memory_available;
  // Whether a checkpoint is due after `step` (by steps, or by rank 0's clock); the same on
  // every rank. Collective over the world.
  bool checkpoint_due(int64_t step);

 private:
  // One optimizer step; returns false (and nothing happened) when the micro-batch did not fit
  // and the step must be run again with the smaller one.
  bool train_step(StepRecord& r);
  // The phases of a step, in order.
  void inject_process_faults();  // resilience.fault: a rank killed or hung at a step
  bool fault_at_this_step(int64_t FaultInjection::*which) const;
  std::vector<int64_t> count_targets(const StepData& data);  // global: CE, then per MTP depth
  LossScales loss_scales(const std::vector<int64_t>& counts) const;
  // Every micro-batch's forward and backward, gradients handed to the reducer; the error of a
  // rank that ran out of memory ("" when none did), with sums[2] set.
  std::string forward_backward(StepData& data, const LossScales& scales, std::vector<double>& sums);
  void reduce_routing_stats(StepRecord& r);  // MoE aux losses and loads over the data ranks
  void judge_step(StepRecord& r);            // skipped (non-finite, spike) or not; stops a streak
  void update_weights(StepRecord& r);        // clipping, AdamW, routing biases
  // fp16: whether any rank's gradients hold a NaN or Inf (collective over the world).
  bool gradients_overflowed(double scaled_norm);
  // The model computes in the configured precision from the current masters (after they
  // were initialised or loaded); logs the precision once.
  void apply_precision();
  // Resume: the checkpoint's loss scaler state, and a note when it was written in another
  // precision.
  void restore_precision_state(const TrainState& st, const std::string& path);
  void gather_rank_timings(StepRecord& r);
  void begin_micro_step(bool communicates);
  // The communicator the routing loads of the biases are summed over: the data axis, or a
  // replica's data ranks under local SGD and DiLoCo.
  Communicator& routing_comm() { return sync_ && sync_->config().local() ? *rdp_ : dp_; }
  // Sums over every data-parallel rank: the replica's, then across the replicas.
  void reduce_over_data(Tensor t);
  // Per parameter: whether this rank counts it in a gradient or weight norm (each global
  // element on one rank), from every axis.
  std::vector<char> counted_in_norm() const;
  // Runs a blocking collective of the step, counting its wait as exposed communication.
  template <class F>
  void timed_collective(F&& f) {
    const auto w0 = Clock::now();
    f();
    collective_wait_seconds_ += seconds_since(w0);
  }
  void load_weights(const std::string& init_from, bool checkpoint);
  void shrink_micro_batch(const std::string& why, int64_t step, const json& blend_before);
  // Before the first step, when metrics.memory_budget_gb or resilience.activation_budget_mb is
  // set: the memory model's estimate of every rank (train/memory_model.h) against them; over
  // a budget, with resilience.oom_fallback, full recomputation when the model says it then
  // fits, else the micro-batch halved (the global batch kept), until every rank fits. The
  // same arithmetic on every rank: no agreement needed.
  void fit_memory_budget();
  // Out of memory on a rank where a step cannot be abandoned half-way (ZeRO stages 2 and 3
  // reduce every micro-step, pipeline stages wait on each other's messages): whether any rank
  // cannot fit this step (the memory model's peak for its stage above memory_available(), or
  // an injected allocation fault), agreed over every rank before the step's first collective;
  // then every rank changes alike (full recomputation, else half the micro-batch) until every
  // rank fits, and the step runs with the new split.
  void agree_on_step_memory(int64_t step);
  // The memory model's peak for this rank's step under the configuration in force (estimated
  // once per configuration); 0 where the model cannot estimate it.
  int64_t step_memory_need();
  int64_t default_memory_available() const;
  // train.epochs: max_steps from the training data's size (at construction).
  void resolve_epochs();
  StepMetrics step_metrics(const StepRecord& r, double elapsed, int64_t steps_this_run);
  const std::vector<std::shared_ptr<SampleDataset>>& eval_datasets();
  DataPipeline& data_pipeline();  // the training data (train/pipeline.h is pipeline parallelism)
  Tokenizer& tokenizer();
  TrainState state();
  // The tensors a checkpoint file holds: the model's registry, or with tensor or pipeline
  // parallelism every stage's global tensors.
  ParamRegistry& file_registry() { return sharded_ckpt_->file_registry(); }
  // The model's recompute policy from train.activation_checkpointing.
  void apply_recompute();
  // Turns on full recomputation when resilience.oom_recompute allows and it is off; whether it
  // did.
  bool recompute_to_fit();
  // What this rank holds of the checkpoint's tensors in the optimizer's buffers.
  std::shared_ptr<const ShardedState> optimizer_pieces() const;
  // Asynchronous aggregation's groups of a checkpoint (the outer state or the delayed gradient,
  // the other replicas' weights and moments, from this rank's buffers `values`, `exp_avg`,
  // `exp_avg_sq`); `main` becomes pieces without a piece where replica 0 alone writes (or reads)
  // the model groups. `views` keeps the host copies alive (read back after a read).
  // `pending`: the delayed gradient is written (or read) too.
  std::vector<CheckpointGroup> gradient_sync_groups(std::shared_ptr<const ShardedState>& main, float* values,
                                                    float* exp_avg, float* exp_avg_sq, bool writing, bool pending,
                                                    std::vector<std::unique_ptr<ops::HostView>>& views);
  // Resume: whether `path` holds asynchronous aggregation's state and a delayed gradient; an
  // error on every rank when it was written with another aggregation (mode, H, fragments,
  // replicas). Collective.
  struct GradientSyncFile {
    bool async = false, pending_gradient = false;
  };
  GradientSyncFile check_gradient_sync_resume(const std::string& path);
  // Why the current state must not become a checkpoint ("" when it may): saving it would
  // rotate away the good ones written before training went wrong. Collective.
  std::string unsafe_to_save();

  RunConfig config_;
  ProcessGrid& grid_;
  Communicator& dp_;  // the data axis: the data pipeline's ranks, evaluation
  // The data ranks that train together: the data axis, or under asynchronous aggregation this
  // replica's (train.gradient_sync): the loss scales, the optimizer's reductions.
  Communicator* rdp_ = nullptr;
  Communicator* across_ = nullptr;  // the other replicas' ranks in this rank's place (null: one replica)
  Communicator* across_bulk_ = nullptr;  // the same ranks, for the aggregation's own transfers
  // train.gradient_sync.test_slow_link: the communicators between replicas, slowed.
  std::unique_ptr<Communicator> slow_link_, slow_link_expert_, slow_link_bulk_;
  std::unique_ptr<GradientSync> sync_;  // null: synchronous
  bool delayed_first_logged_ = false;
  CommStats across_before_, bulk_before_, inner_before_;
  JobEnvironment environment_;
  std::vector<std::unique_ptr<RunLock>> locks_;  // released after the checkpoint writer below
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<GpuMonitor> gpu_monitor_;  // a run on a GPU: NVML's view of it
  std::unique_ptr<Timeline> timeline_;  // metrics.timeline_steps (null: off)
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<LossScaler> scaler_;  // fp16's loss scale (1, unchanging, otherwise)
  bool precision_logged_ = false;
  Communicator* tp_ = nullptr;             // the tensor group (null: one rank)
  std::unique_ptr<ShardedModelCheckpoint> sharded_ckpt_;  // what each rank holds of the global tensors
  std::unique_ptr<DistributedOptimizer> optimizer_;  // every ZeRO stage, behind the model's hooks
  // The layout's axes (an axis of one rank left out), in the order their gradient work runs.
  std::vector<std::unique_ptr<ParallelAxis>> axes_;
  std::unique_ptr<Schedule> schedule_;  // the order of the micro-batches' forwards and backwards
  // Pipeline parallelism (null: one stage): the pipeline group, its schedule, the runner of this
  // rank's chunks, and the hook that hands the reducer each gradient once all micro-batches
  // reported it.
  Communicator* pp_ = nullptr;
  Communicator* ep_ = nullptr;  // the expert group (null: every rank holds every expert)
  int64_t ep_warned_step_ = -1000000;  // the last step that warned of expert-parallel imbalance
  bool imbalance_over_model_warned_ = false;  // metrics.expert_imbalance below what the run met, said once
  std::unique_ptr<PipelineRunner> runner_;
  std::unique_ptr<FinalGradHooks> final_hooks_;
  ParamHookChain param_hooks_;  // the model's ParamHooks: the reducer's grad_ready (later ZeRO-3's gathers)
  std::unique_ptr<CheckpointManager> ckpt_;
  int64_t last_saved_step_ = -1;
  std::chrono::steady_clock::time_point last_save_time_ = std::chrono::steady_clock::now();
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<DataPipeline> data_pipeline_;
  bool data_started_ = false;
  json resume_blend_;  // the data position a resume restored, for the pipeline's start
  std::vector<std::shared_ptr<SampleDataset>> eval_sets_;
  std::vector<std::string> eval_names_;
  int64_t step_ = 0;              // optimizer steps taken (skipped ones included)
  bool resumed_ = false;          // injected faults fire only in runs that started from scratch
  bool oom_fault_fired_ = false;
  int64_t step_need_bytes_ = -1;  // step_memory_need(); -1: not estimated for the configuration in force
  int64_t skipped_in_a_row_ = 0, skipped_total_ = 0;
  // Steps skipped for an fp16 overflow, over the run (whatever precision later parts of it
  // used): the learning-rate schedule stands still at them.
  int64_t overflow_steps_ = 0;
  std::string last_skip_reason_;
  // fp16: whether the last step overflowed (skipped), and how many in a row at a static scale,
  // which cannot recover (they count against resilience.max_skipped_steps).
  bool last_overflowed_ = false;
  int64_t static_overflows_in_a_row_ = 0;
  // A checkpoint was due while the state was not worth saving (a skipped step, non-finite
  // weights): it is written at the next good step instead.
  bool save_deferred_ = false;
  std::unique_ptr<class SpikeDetector> spikes_;
  int64_t consumed_samples_ = 0;  // windows consumed by those steps (global)
  double collective_wait_seconds_ = 0;  // in the current step's blocking collectives
  std::vector<StepRecord> history_;
};

}  // namespace dstrain
