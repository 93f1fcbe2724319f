#include "train/trainer.h"

#ifdef __GLIBC__
#include <malloc.h>
#endif

#include <csignal>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <thread>

#include "backend/cuda_device.h"
#include "backend/ops.h"
#include "core/clock.h"
#include "core/log.h"
#include "comm/slow_link.h"
#include "distributed/routed_comm.h"
#include "train/layout_check.h"
#include "train/memory_model.h"
#include "train/startup_checks.h"

namespace dstrain {
namespace {

// The data ranks of one replica under train.gradient_sync (the whole data axis under "sync"),
// split off in the grid before its communicators are wrapped for a device. Errors alike on
// every rank: they see the same placement.
ProcessGrid& split_replicas(ProcessGrid& grid, RunConfig& config) {
  const GradientSyncConfig& gs = config.train.gradient_sync;
  const int dp = grid.size(Axis::Data), ep = grid.size(Axis::Expert), tp = grid.size(Axis::Tensor);
  int S = dp;
  if (gs.async() && gs.over == "data") {
    S = ep;
  } else if (gs.async()) {
    // The data coordinates of this rank's (pipeline, tensor) place, by node: a replica is the
    // block of consecutive data coordinates on one node.
    const std::vector<int> node = grid.node_of_ranks(int(gs.ranks_per_node));
    const int base = grid.coord(Axis::Pipeline) * dp * tp + grid.coord(Axis::Tensor);
    auto node_of = [&](int d) { return node[size_t(base + d * tp)]; };
    S = 1;
    while (S < dp && node_of(S) == node_of(0)) ++S;
    std::string problem;
    for (int d = 0; d < dp && problem.empty(); ++d) {
      const bool same_block = node_of(d) == node_of(d - d % S);
      const bool new_node = d % S != 0 || d == 0 || node_of(d) != node_of(d - 1);
      if (dp % S != 0 || !same_block || !new_node) {
        problem = fmt::format("the data-parallel ranks do not fall into equal blocks of consecutive data coordinates "
                              "per node (data coordinate {} is on the node of world rank {}, {} per node from "
                              "coordinate 0)",
                              d, node_of(d), S);
      }
    }
    const int lo = grid.world().all_reduce_value<int32_t>(problem.empty() ? S : -1, ReduceOp::Min);
    const int hi = grid.world().all_reduce_value<int32_t>(S, ReduceOp::Max);
    DS_CHECK(lo == hi, "{}: train.gradient_sync.over \"nodes\": {}; give each node whole data-parallel groups "
             "(ranks per node a multiple of parallel.tensor, the same on every node), or use over \"data\"",
             config.source, problem.empty() ? "nodes hold different numbers of data-parallel ranks" : problem);
    DS_CHECK(S % ep == 0, "{}: train.gradient_sync.over \"nodes\": a node holds {} data-parallel ranks, which does "
             "not hold whole expert groups of parallel.expert = {}; a replica needs every expert",
             config.source, S, ep);
  }
  grid.split_replicas(S);
  config.train.gradient_sync.data_per_replica = S;
  return grid;
}

}  // namespace

std::vector<char> Trainer::counted_in_norm() const {
  // The optimizer's pieces split each group's local pieces over its data-parallel ranks, and the
  // other axes leave out their replicas.
  const ParamRegistry& reg = model_->params();
  std::vector<char> counted(size_t(reg.size()), 1);
  for (int id = 0; id < reg.size(); ++id) {
    for (const auto& axis : axes_) counted[size_t(id)] = counted[size_t(id)] && axis->counts_in_norm(reg.info(id));
  }
  return counted;
}

void Trainer::reduce_over_data(Tensor t) {
  timed_collective([&] {
    rdp_->all_reduce(t);
    if (across_) across_->all_reduce(t);
  });
}

Trainer::Trainer(RunConfig config, ProcessGrid& grid, Device device)
    : config_(std::move(config)),
      grid_(use_device_communicators(split_replicas(grid, config_), device)),
      dp_(grid.comm(Axis::Data)) {
  rdp_ = &grid_.replica_data();
  across_ = grid_.across_replicas();
  across_bulk_ = grid_.across_replicas_bulk();
  // The layout against the model and the batch (the checks `dstrain validate` runs).
  const CheckedLayout layout = check_layout(config_, grid_.world_size());
  check_same_config(grid_.world(), config_);
  environment_ = check_same_environment(grid_.world(), local_environment());
  const json& env = environment_.record;
  log::info("environment: {}; {}; HDF5 {}; {} ({} kernels); {}; {} ({}); {} rank(s) on {}",
            env["compiler"].get<std::string>(), env["mpi"].get<std::string>(), env["hdf5"].get<std::string>(),
            env["blas"].get<std::string>(), env["blas_kernels"].get<std::string>(), env["gemm"].get<std::string>(), env["cpu_model"].get<std::string>(),
            env["cpu_features"].get<std::string>(), grid_.world_size(), env["hosts"].get<std::string>());
  for (const std::string& w : environment_.warnings) {
    if (grid_.world_rank() == 0) log::warn("{}", w);
  }
  check_model_state_fits(config_, grid_);
  // The model: this rank's tensor piece (over the tensor group), its routed experts (over the
  // expert group, carved out of the data-parallel ranks) and its pipeline chunks.
  const int tp = grid_.size(Axis::Tensor), ep = grid_.size(Axis::Expert), pp = grid_.size(Axis::Pipeline);
  tp_ = tp > 1 ? &grid_.comm(Axis::Tensor) : nullptr;
  ep_ = ep > 1 ? &grid_.comm(Axis::Expert) : nullptr;
  pp_ = pp > 1 ? &grid_.comm(Axis::Pipeline) : nullptr;
  ProcessGroups groups;
  groups.tp = tp_;
  groups.ep = ep_;
  const ParallelConfig& par = config_.parallel;
  std::vector<StageSpec> chunks;
  if (pp_) {
    schedule_ = make_schedule(par.schedule, par.schedule == "interleaved" ? int(par.virtual_stages) : 1);
    chunks = rank_chunks(*schedule_, layout.stages, grid_.coord(Axis::Pipeline), pp);
  } else {
    schedule_ = make_schedule(config_.train.micro_batch_schedule);
  }
  model_ = std::make_unique<Transformer>(
      config_.model, device,
      ShardSpec::tensor_parallel(config_.model, grid_.coord(Axis::Tensor), tp, grid_.coord(Axis::Expert), ep,
                                 layout.sequence_parallel),
      groups, chunks);
  apply_recompute();
  // What each rank holds of the global tensors, for checkpoints and the Hugging Face export.
  sharded_ckpt_ = std::make_unique<ShardedModelCheckpoint>(model_->params(), grid_);
  const ZeroConfig& zc = config_.train.zero;
  const PrecisionConfig& precision = config_.train.precision;
  scaler_ = std::make_unique<LossScaler>(precision.fp16_scaler, precision.fp16);
  // One optimizer for every stage: each rank reduces and (from stage 1) shards its local pieces
  // per parameter group, dense over the data axis, routed experts over the ranks holding the
  // same experts. Checkpoints describe its buffers piece by piece (optimizer_pieces()).
  // Under asynchronous aggregation the groups are the replica's ranks; test_slow_link slows the
  // link between replicas (the data axis itself when synchronous).
  const GradientSyncConfig& gs = config_.train.gradient_sync;
  Communicator* dense = rdp_;
  Communicator* expert = ep > 1 ? &grid_.replica_expert_data() : rdp_;
  if (gs.slow_link()) {
    // `c` from now on through a slowed wrapper that `owner` keeps.
    auto slow = [&](std::unique_ptr<Communicator>& owner, Communicator*& c) {
      owner = std::make_unique<SlowLinkCommunicator>(*c, gs.test_link_latency_ms, gs.test_link_gbit_per_s);
      c = owner.get();
    };
    if (gs.async() && across_) {
      slow(slow_link_, across_);
      slow(slow_link_bulk_, across_bulk_);
    } else if (!gs.async()) {
      slow(slow_link_, dense);
      if (ep > 1) {
        slow(slow_link_expert_, expert);
      } else {
        expert = dense;
      }
    }
  }
  const ParamGroupComms group_comms = ep > 1 ? ParamGroupComms(*dense, *expert) : ParamGroupComms(*dense);
  optimizer_ = std::make_unique<DistributedOptimizer>(zc, config_.train.adamw, model_->params(), group_comms,
                                                      precision.communication_dtype());
  // The axes, in the order their gradient work runs: the tensor group's partial sums before the
  // data-parallel reduction sees them (every micro-step at ZeRO stages 2 and 3, which reduce
  // every micro-step), the pipeline's tied weights after it.
  if (tp_) axes_.push_back(std::make_unique<TensorAxis>(*model_, *tp_, optimizer_->reduces_into_shard()));
  if (ep_) {
    axes_.push_back(std::make_unique<ExpertAxis>(
        *ep_, describe_expert_layout(config_.model, ep, group_comms.describe())));
  }
  axes_.push_back(std::make_unique<DataAxis>(*optimizer_));
  if (pp_) {
    // On GPUs with NCCL the pipeline communicator has in-order channels, which the runner uses
    // when the schedule passes its check at this micro-batch count.
    runner_ = std::make_unique<PipelineRunner>(*model_, *pp_, *schedule_, layout.stages, in_order_channels(*pp_),
                                               int(config_.train.grad_accum));
    axes_.push_back(std::make_unique<PipelineAxis>(
        *runner_, *pp_, schedule_->name(), *model_, *optimizer_,
        fmt::format("pipeline: {} stages over {} ranks, schedule {}; {}", layout.stages.size(), pp, schedule_->name(),
                    describe_stages(layout.stages, piece_costs(config_.model, config_.data.seq_len)))));
  }
  for (auto& axis : axes_) {
    if (ParamHooks* h = axis->hooks()) param_hooks_.add(*h);
    const std::string line = axis->describe();
    if (grid_.world_rank() == 0 && !line.empty()) log::info("{}", line);
  }
  if (runner_ && grid_.world_rank() == 0) {
    log::info("pipeline transport: {}", runner_->transport(int(config_.train.grad_accum)));
  }
  if (runner_) {
    // Each gradient goes to the hooks once every micro-batch has reported it.
    final_hooks_ = std::make_unique<FinalGradHooks>(param_hooks_, model_->params().size());
    model_->set_hooks(final_hooks_.get());
  } else {
    model_->set_hooks(&param_hooks_);
  }
  if (gs.async()) {
    // Each global element counted once in a replica's norms, as the gradient norm counts them.
    sync_ = std::make_unique<GradientSync>(gs, *optimizer_, across_bulk_, grid_.replica_world(), counted_in_norm());
    if (grid_.world_rank() == 0) {
      log::info("gradient sync: {}; {} replica(s) of {} data-parallel rank(s) each (over {})", gs.describe(),
                grid_.replicas(), grid_.data_per_replica(), gs.over);
    }
  }
  ckpt_ = std::make_unique<CheckpointManager>(config_.checkpoint, grid_);
  resolve_epochs();
}

void Trainer::resolve_epochs() {
  TrainConfig& tc = config_.train;
  if (tc.epochs <= 0) return;
  int64_t per_epoch = 0;
  for (const auto& d : data_pipeline().train_sets()) per_epoch += d->samples_per_epoch();
  const auto steps = int64_t(std::ceil(tc.epochs * double(per_epoch) / double(tc.train_batch_size)));
  if (tc.max_steps > 0) {
    log::info("train.max_steps {} decides the run's length; train.epochs {} ({} steps) is not used", tc.max_steps,
              tc.epochs, steps);
    return;
  }
  tc.max_steps = steps;
  log::info("train.epochs {}: {} steps of {} windows over {} windows an epoch (every training dataset once)", tc.epochs,
            steps, tc.train_batch_size, per_epoch);
}

Tokenizer& Trainer::tokenizer() {
  // Training reads token ids only; text needs the tokenizer, made on first use.
  if (!tokenizer_) {
    tokenizer_ = make_tokenizer(config_.data.tokenizer);
    DS_CHECK(tokenizer_->vocab_size() <= config_.model.vocab_size,
             "the {} tokenizer has {} ids but the model's vocab_size is {}: its ids would index the embedding out of "
             "range; set data.tokenizer to the tokenizer the model was built for",
             tokenizer_->name(), tokenizer_->vocab_size(), config_.model.vocab_size);
  }
  return *tokenizer_;
}

void Trainer::inject_process_faults() {
  const FaultInjection& fault = config_.resilience.fault;
  if (!fault.any() || resumed_ || fault.rank != grid_.world_rank()) return;
  if (fault.kill_at_step == step_ + 1) {
    log::any("fault injection: rank {} kills itself at step {}", grid_.world_rank(), step_ + 1);
    std::raise(SIGKILL);
  }
  if (fault.hang_at_step == step_ + 1) {
    log::any("fault injection: rank {} hangs at step {}", grid_.world_rank(), step_ + 1);
    while (true) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

bool Trainer::fault_at_this_step(int64_t FaultInjection::*which) const {
  const FaultInjection& fault = config_.resilience.fault;
  return fault.any() && !resumed_ && fault.rank == grid_.world_rank() && fault.*which == step_ + 1;
}

std::vector<int64_t> Trainer::count_targets(const StepData& data) {
  // Target tokens of the global batch: for the CE, and per multi-token-prediction depth k
  // (position t predicts token t+k+2, so its target is targets column t+k+1).
  const int64_t T = config_.data.seq_len;
  const int D = int(config_.model.num_nextn_predict_layers);
  std::vector<int64_t> counts(size_t(1 + D), 0);
  for (const Batch& b : data.micro) {
    for (int64_t i = 0; i < b.B * T; ++i) {
      if (b.targets[size_t(i)] == ops::kIgnoreIndex) continue;
      const int64_t t = i % T;
      ++counts[0];
      for (int k = 0; k < D; ++k) counts[size_t(1 + k)] += t >= k + 1;
    }
  }
  timed_collective([&] { rdp_->all_reduce(Tensor(counts.data(), DType::I64, Shape{int64_t(counts.size())})); });
  DS_CHECK(counts[0] > 0, "step {}: the global batch has no target tokens (all are the ignore index)", step_ + 1);
  return counts;
}

LossScales Trainer::loss_scales(const std::vector<int64_t>& counts) const {
  const TrainConfig& tc = config_.train;
  // An injected NaN goes into this rank's gradients before they are reduced, as a real one
  // would, so every rank sees it.
  LossScales scales;
  scales.token = fault_at_this_step(&FaultInjection::nan_at_step) ? NAN : float(1.0 / double(counts[0]));
  // Per sequence of the batch the replica trains on (the global batch when synchronous).
  scales.sequence = 1.0 / (double(tc.train_batch_size) * double(rdp_->size()) / double(dp_.size()));
  scales.micro_batch = 1.0 / double(tc.grad_accum * rdp_->size());
  const int D = int(counts.size()) - 1;
  for (int k = 0; k < D; ++k) {
    const int64_t ck = counts[size_t(1 + k)];
    scales.mtp_token.push_back(ck > 0 ? float(tc.mtp_loss_weight / double(D) / double(ck)) : 0.0f);
  }
  if (scaler_->enabled()) {
    // fp16: the backward seeds carry the loss scale; the reported losses are sums the trainer
    // scales itself, and the auxiliary loss is divided by it again (reduce_routing_stats).
    const double ls = scaler_->scale();
    scales.token = float(double(scales.token) * ls);
    scales.sequence *= ls;
    scales.micro_batch *= ls;
    for (float& m : scales.mtp_token) m = float(double(m) * ls);
  }
  return scales;
}

std::string Trainer::forward_backward(StepData& data, const LossScales& scales, std::vector<double>& sums) {
  const TrainConfig& tc = config_.train;
  const int64_t mb = tc.micro_batch, T = config_.data.seq_len;
  const int D = int(config_.model.num_nextn_predict_layers);
  if (runner_) {
    // Pipeline: the schedule over this rank's chunks, activations and gradients between the
    // stages; each gradient goes to the reducer once every micro-batch has reported it. A rank
    // that runs out of memory cannot drop out of the schedule: the others wait on its messages.
    final_hooks_->begin_step(int(tc.grad_accum));
    begin_micro_step(/*communicates=*/true);
    std::vector<PipelineRunner::MicroBatch> micro;
    for (Batch& b : data.micro) micro.push_back({tokens_tensor(b.inputs, mb, T), tokens_tensor(b.targets, mb, T)});
    try {
      for (const LossSums& s : runner_->run_step(micro, scales, timeline_.get(), step_ + 1)) {
        sums[0] += s.sum;
        sums[1] += double(s.count);
        for (int k = 0; k < D && k < int(s.mtp_sum.size()); ++k) sums[size_t(3 + k)] += s.mtp_sum[size_t(k)];
      }
    } catch (const OutOfMemory& e) {
      throw Error(fmt::format("{}; a pipeline stage cannot retry the step with a smaller micro-batch while the other "
                              "stages wait for it half-way: lower train.train_micro_batch_size_per_gpu, or set "
                              "metrics.memory_budget_gb so that the memory model fits the step before it starts",
                              e.what()));
    }
    return "";
  }
  // What the schedule runs for this step's micro-batches on this (the only) stage; the last
  // backward communicates the gradient buckets.
  const std::vector<ScheduleAction> plan = schedule_->actions(0, 1, int(tc.grad_accum));
  size_t last_backward = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    if (plan[i].kind != ScheduleAction::Kind::Forward) last_backward = i;
  }
  try {
    for (size_t i = 0; i < plan.size(); ++i) {
      const ScheduleAction& a = plan[i];
      Batch& b = data.micro[size_t(a.micro_batch)];
      const Timeline::Scope recorded(timeline_.get(), step_ + 1, a);
      switch (a.kind) {
        case ScheduleAction::Kind::Forward: {
          if (i == 0 && fault_at_this_step(&FaultInjection::oom_at_step) && !oom_fault_fired_) {
            oom_fault_fired_ = true;  // once: the retried step gets through
            throw OutOfMemory(fmt::format("fault injection: allocation failure at step {}", step_ + 1));
          }
          for (auto& axis : axes_) axis->begin_forward();
          const LossSums s =
              model_->forward(a.micro_batch, tokens_tensor(b.inputs, mb, T), tokens_tensor(b.targets, mb, T), scales);
          sums[0] += s.sum;
          sums[1] += double(s.count);
          for (int k = 0; k < D && k < int(s.mtp_sum.size()); ++k) sums[size_t(3 + k)] += s.mtp_sum[size_t(k)];
          break;
        }
        case ScheduleAction::Kind::Backward:
        case ScheduleAction::Kind::BackwardInput:
          begin_micro_step(/*communicates=*/i == last_backward);
          model_->backward(a.micro_batch, a.kind == ScheduleAction::Kind::Backward ? BackwardPart::Full
                                                                                    : BackwardPart::Input);
          break;
        case ScheduleAction::Kind::BackwardWeight:
          begin_micro_step(/*communicates=*/i == last_backward);
          model_->backward_weights(a.micro_batch);
          break;
      }
    }
  } catch (const OutOfMemory& e) {
    // Micro-batches in flight are dropped. This rank still takes part in every gradient
    // bucket the others reduce; the step is then discarded everywhere.
    if (optimizer_->reduces_into_shard()) {
      // The other ranks go on reducing every micro-step's gradients: this rank cannot match
      // them with a smaller micro-batch, so the run ends (on every rank, through the error).
      throw Error(fmt::format("{}; ZeRO stage {} reduces gradients every micro-step and cannot retry the step with a "
                              "smaller micro-batch half-way: lower train.train_micro_batch_size_per_gpu, or set "
                              "metrics.memory_budget_gb so that the memory model fits the step before it starts",
                              e.what(), optimizer_->stage()));
    }
    model_->release_activations();
    sums[2] = 1;
    begin_micro_step(/*communicates=*/true);
    return e.what();
  }
  return "";
}

void Trainer::judge_step(StepRecord& r) {
  // Every rank sees the same global loss and norm, so every rank decides alike.
  if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
    r.skipped = true;
    r.skip_reason = !std::isfinite(r.loss) ? "non-finite loss" : "non-finite gradient norm";
  } else if (spikes_ && spikes_->is_spike(r.loss)) {
    r.skipped = true;
    r.skip_reason = fmt::format("loss spike ({:.4f}, z-score above {})", r.loss, config_.resilience.spike_zscore);
  }
  if (!r.skipped) {
    skipped_in_a_row_ = 0;
    if (spikes_) spikes_->accept(r.loss);
    return;
  }
  ++skipped_in_a_row_;
  ++skipped_total_;
  last_skip_reason_ = r.skip_reason;
  log::warn("step {} skipped: {} ({} in a row, {} in all)", r.step, r.skip_reason, skipped_in_a_row_, skipped_total_);
  if (skipped_in_a_row_ >= config_.resilience.max_skipped_steps) {
    // No checkpoint was written during the streak, so the newest one predates it (one still
    // being written counts: every rank waits for it alike).
    ckpt_->wait();
    const std::vector<std::string> kept = ckpt_->list();
    throw Error(fmt::format("training stopped: {} consecutive steps skipped (last: {}); resume from the last "
                            "checkpoint{} with a lower learning rate or check the data",
                            skipped_in_a_row_, r.skip_reason,
                            kept.empty() ? std::string(" (none was written yet)")
                                         : fmt::format(" ({}, written before the skipped steps)", kept.front())));
  }
}

void Trainer::update_weights(StepRecord& r) {
  const TrainConfig& tc = config_.train;
  const PhaseTimer::Scope timed(model_->ctx().phases, Phase::Optimizer);
  // The clipping coefficient (of the unscaled norm: under local SGD and DiLoCo the replica's own) and
  // the loss-scale unscale are applied by
  // AdamW as it reads each gradient: no pass over the gradients of their own.
  const double clip = tc.gradient_clipping > 0 ? clip_coefficient(tc.gradient_clipping, r.replica_grad_norm) : 1.0;
  const double grad_scale = scaler_->enabled() ? clip / r.loss_scale : clip;
  optimizer_->step(r.lr, grad_scale);
  collective_wait_seconds_ += optimizer_->take_exposed_seconds();  // the weights' all-gather
  // DeepSeek-V3's auxiliary-loss-free balancing: routing biases follow the global loads.
  const auto moe = model_->moe_layers();
  for (const auto& [l, ffn] : moe) {
    auto it = std::find_if(r.moe.begin(), r.moe.end(), [&](const MoeLayerStats& ms) { return ms.layer == l; });
    DS_CHECK(it != r.moe.end(), "no routing statistics of MoE layer {}", l);
    ffn->update_routing_bias(it->tokens, tc.router_bias_update_rate);
  }
  const ParamRegistry& reg = model_->params();
  for (int id = 0; id < reg.size(); ++id) {
    if (!reg.info(id).trainable) optimizer_->take_rule_update(id);
  }
}

bool Trainer::gradients_overflowed(double scaled_norm) {
  // Every rank's reduced gradients normally agree, but a group reduced over fewer ranks
  // (experts) or one not communicated at all would hide another rank's overflow.
  int32_t mine = std::isfinite(scaled_norm) ? 0 : 1;
  timed_collective([&] { mine = grid_.world().all_reduce_value<int32_t>(mine, ReduceOp::Max); });
  return mine != 0;
}

void Trainer::begin_micro_step(bool communicates) {
  for (auto& axis : axes_) axis->begin_micro_step(communicates);
}

bool Trainer::train_step(StepRecord& r) {
  const auto t0 = Clock::now();
  const TrainConfig& tc = config_.train;
  collective_wait_seconds_ = 0;
  // Where a step cannot be abandoned half-way, every rank checks that its step fits before the
  // step's first collective, and all change alike when one does not.
  if (runner_ || optimizer_->reduces_into_shard()) agree_on_step_memory(step_);
  // A killed or hung rank stands for one lost inside the step, after that agreement.
  inject_process_faults();
  // The whole step's micro-batches come at once (read ahead by the pipeline): the loss is the
  // mean over every target token of the global batch, so each backward needs the global
  // token count.
  StepData data = data_pipeline().next();
  const double data_wait = data_pipeline().take_wait_seconds();
  const std::vector<int64_t> counts = count_targets(data);  // the replica's
  const LossScales scales = loss_scales(counts);
  // The whole batch's, for the reported losses (every replica reports the same).
  std::vector<int64_t> global_counts = counts;
  if (across_) {
    timed_collective([&] { across_->all_reduce(Tensor(global_counts.data(), DType::I64, Shape{int64_t(counts.size())})); });
  }
  for (auto& [l, ffn] : model_->moe_layers()) ffn->routing()->reset();

  for (auto& axis : axes_) axis->begin_step();
  const int D = int(config_.model.num_nextn_predict_layers);
  // loss sum, target count, ranks out of memory, then the MTP loss sum per depth
  std::vector<double> sums(size_t(3 + D), 0.0);
  // The step's scalars stay on the model's device and are read once, after the backward: the
  // loss sums every micro-batch's forward adds up, then the sums of squares of the gradient
  // runs of the norm (delayed aggregation replaces the gradients later: its norm is read then).
  const bool norm_after_exchange = sync_ && sync_->config().mode == "delayed";
  const std::vector<Tensor> norm_runs =
      norm_after_exchange ? std::vector<Tensor>{} : optimizer_->grad_norm_runs(counted_in_norm());
  const int64_t n_loss = model_->loss_sums_size();
  const Device device = model_->params().device();
  Buffer scalars("step.scalars", MemCategory::Workspace, DType::F64, n_loss + int64_t(norm_runs.size()), device);
  {
    const std::vector<double> zeros(size_t(n_loss), 0.0);
    ops::copy(scalars.tensor(0, {n_loss}), Tensor(const_cast<double*>(zeros.data()), DType::F64, Shape{n_loss}));
  }
  std::string oom;
  model_->accumulate_losses_into(scalars.tensor(0, {n_loss}));
  try {
    oom = forward_backward(data, scales, sums);
  } catch (...) {
    model_->accumulate_losses_into(Tensor());
    throw;
  }
  model_->accumulate_losses_into(Tensor());
  ReduceTimings rt;
  {
    const Timeline::Scope recorded(timeline_.get(), "reduce", step_ + 1, -1);
    for (auto& axis : axes_) axis->finish_gradients(rt);
  }
  double norm_sum_squares = 0;  // this rank's part, in the order of the runs
  {
    std::vector<double> on_host(norm_runs.size(), 0.0);
    for (size_t i = 0; i < norm_runs.size(); ++i) {
      // A run in host memory (an offloaded shard) is summed where it is.
      if (norm_runs[i].device() == device) {
        ops::sum_squares(scalars.tensor(n_loss + int64_t(i), {1}), norm_runs[i]);
      } else {
        on_host[i] = ops::read_sum_squares(norm_runs[i]);
      }
    }
    std::vector<double> h(size_t(scalars.numel()));
    ops::copy(Tensor(h.data(), DType::F64, Shape{scalars.numel()}), scalars.tensor());  // the read
    const LossSums ls = model_->sums_from(h.data(), /*with_mtp=*/true);
    sums[0] += ls.sum;
    sums[1] += double(ls.count);
    for (int k = 0; k < D && k < int(ls.mtp_sum.size()); ++k) sums[size_t(3 + k)] += ls.mtp_sum[size_t(k)];
    for (size_t i = 0; i < norm_runs.size(); ++i) {
      norm_sum_squares += norm_runs[i].device() == device ? h[size_t(n_loss) + i] : on_host[i];
    }
  }
  reduce_over_data(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())}));
  // The loss is the last stage's: every stage gets it (the others add zeros).
  if (pp_) timed_collective([&] { pp_->all_reduce(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())})); });
  if (sums[2] > 0) {
    shrink_micro_batch(oom.empty() ? fmt::format("{:.0f} rank(s) ran out of memory", sums[2])
                                   : fmt::format("{} (and {:.0f} rank(s) in all)", oom, sums[2]),
                       step_, data.blend_before);
    return false;
  }

  // Delayed aggregation: this step's gradients go out to the other replicas, the previous step's
  // average comes in to be applied (after the step is known to stand: a retried one sends none).
  bool update_ready = true;
  if (sync_ && sync_->config().mode == "delayed") update_ready = sync_->exchange_gradients();
  r = StepRecord{};
  r.step = step_ + 1;
  // The step's loss: CE + the MoE layers' auxiliary terms + the weighted MTP losses.
  r.ce_loss = sums[0] / sums[1];
  for (int k = 0; k < D; ++k) {
    const int64_t ck = global_counts[size_t(1 + k)];
    if (ck > 0) r.mtp_loss += tc.mtp_loss_weight / double(D) * sums[size_t(3 + k)] / double(ck);
  }
  reduce_routing_stats(r);
  if (routing_comm().size() != dp_.size() && across_ && !r.moe.empty()) {
    // Each replica's auxiliary loss: the reported one is their mean.
    timed_collective([&] { r.aux_loss = across_->all_reduce_value<double>(r.aux_loss) / double(across_->size()); });
  }
  r.loss = r.ce_loss + r.aux_loss + r.mtp_loss;
  {
    double sq = norm_after_exchange ? optimizer_->local_grad_sum_squares(counted_in_norm()) : norm_sum_squares;
    // Under asynchronous aggregation, each replica's own gradient (delayed: the average it
    // applies, the same in every replica).
    Communicator& norm_comm = sync_ ? grid_.replica_world() : grid_.world();
    if (norm_comm.size() > 1) timed_collective([&] { sq = norm_comm.all_reduce_value<double>(sq); });
    r.replica_grad_norm = r.grad_norm = std::sqrt(sq);
    if (sync_ && sync_->config().local() && across_) {
      // Replicas clip with their own norms; they report (and judge the step by) the root mean square.
      timed_collective([&] { sq = across_->all_reduce_value<double>(sq); });
      r.grad_norm = std::sqrt(sq / double(across_->size()));
    }
    if (!update_ready) {
      r.replica_grad_norm = r.grad_norm = 0;
      r.update_applied = false;
      if (!delayed_first_logged_ && grid_.world_rank() == 0) {
        log::info("step {}: gradient_sync \"delayed\": this step's gradient is applied at the next step (no update now)",
                  r.step);
      }
      delayed_first_logged_ = true;
    }
  }
  // As DeepSpeed, a step skipped for an fp16 overflow does not advance the learning-rate
  // schedule (one skipped as a fault does).
  // Delayed aggregation: the k-th update is step k+1's, at the schedule's k-th rate.
  const int64_t delay = sync_ && sync_->config().mode == "delayed" ? 1 : 0;
  r.lr = tc.schedule.lr_at(std::max<int64_t>(0, step_ - overflow_steps_ - delay), tc.adamw.lr);
  r.loss_scale = scaler_->scale();
  if (scaler_->enabled()) {
    // fp16: an overflow on any rank skips the step everywhere and lowers the scale; it is not
    // a fault (no count against resilience.max_skipped_steps).
    r.overflow = gradients_overflowed(r.grad_norm);
    r.grad_norm /= r.loss_scale;
    r.replica_grad_norm /= r.loss_scale;
    const LossScaler::Change change = scaler_->update(r.overflow, r.step);
    overflow_steps_ += r.overflow;
    if (r.overflow) {
      log::info("step {}: fp16 gradients overflowed at loss scale {}: step skipped on every rank; {} ({} overflow(s) "
                "in all)",
                r.step, r.loss_scale,
                change == LossScaler::Change::Lowered
                    ? fmt::format("scale lowered to {}", scaler_->scale())
                    : change == LossScaler::Change::HysteresisUsed
                          ? fmt::format("scale kept (hysteresis {} left)", scaler_->hysteresis_left())
                          : std::string("static scale kept"),
                overflow_steps_);
    } else if (change == LossScaler::Change::Raised) {
      log::info("step {}: {} steps without overflow: loss scale raised to {}", r.step,
                config_.train.precision.fp16_scaler.loss_scale_window, scaler_->scale());
    }
    last_overflowed_ = r.overflow;
    // A dynamic scale recovers (or stops at min_loss_scale with an error); a static one never does.
    static_overflows_in_a_row_ = r.overflow && !scaler_->dynamic() ? static_overflows_in_a_row_ + 1 : 0;
    DS_CHECK(static_overflows_in_a_row_ < config_.resilience.max_skipped_steps,
             "training stopped: {} consecutive steps overflowed at the static fp16 loss scale {} "
             "(resilience.max_skipped_steps); lower train.fp16.loss_scale, or set it to 0 for dynamic loss scaling",
             static_overflows_in_a_row_, r.loss_scale);
  }
  if (!r.overflow) {
    judge_step(r);
    if (!r.skipped && r.update_applied) update_weights(r);
  }
  if (sync_) {
    // Local SGD and DiLoCo: the outer steps due after this step, skipped or not (every replica
    // counts steps alike).
    sync_->after_step(r.step);
    const GradientSyncStep st = sync_->take_step_stats();
    r.gradient_sync = true;
    // Everything that crossed between replicas: the aggregation's collectives and the step's few
    // scalars (token counts, losses, norms).
    const CommStats a = across_ ? across_->stats() : CommStats{};
    const CommStats b = across_bulk_ ? across_bulk_->stats() : CommStats{};
    r.sync_bytes = a.bytes - across_before_.bytes + b.bytes - bulk_before_.bytes;
    across_before_ = a;
    bulk_before_ = b;
    r.sync_wait_seconds = st.wait_seconds;
    r.sync_outer_steps = st.outer_steps;
    r.sync_drift = st.drift;
    r.sync_outer_delta_norm = st.outer_delta_norm;
    collective_wait_seconds_ += st.wait_seconds;
  }
  {
    const CommStats now = rdp_->stats();
    r.dp_comm_bytes = now.bytes - inner_before_.bytes;
    inner_before_ = now;
  }
  // The phases in the device's time, read once per step (on a GPU, the step's one wait for it).
  const PhaseSeconds phases = model_->ctx().phases->take();
  r.forward_seconds = phases.forward;
  r.backward_seconds = phases.backward;
  r.optimizer_seconds = phases.optimizer;
  ++step_;
  consumed_samples_ += tc.train_batch_size;
  r.step_seconds = seconds_since(t0);
  r.tokens_per_s = double(tc.train_batch_size * config_.data.seq_len) / r.step_seconds;
  r.data_wait_seconds = data_wait;
  r.comm_seconds = rt.comm_seconds;
  r.exposed_comm_seconds = rt.exposed_seconds + collective_wait_seconds_;
  for (auto& axis : axes_) axis->record(r);
  gather_rank_timings(r);
#ifdef __GLIBC__
  // Buffers whose sizes change from step to step (a MoE layer's rows, a pipeline's messages)
  // leave holes in the C heap that glibc keeps: the process's RSS would creep above what the
  // allocator's accounting holds, step after step. Handing the free pages back costs about a
  // millisecond a step.
  malloc_trim(0);
#endif
  return true;
}

void Trainer::apply_recompute() {
  const ActivationCheckpointingConfig& ac = config_.train.activation_checkpointing;
  model_->set_recompute(recompute_policy(ac));
  if (ac.granularity == "selective") {
    std::string parts;
    for (const std::string& p : ac.selective) parts += (parts.empty() ? "" : ", ") + p;
    log::info("activation recomputation: selective ({}); the fused attention keeps no scores in any case", parts);
  }
  if (!ac.full()) return;
  log::info("activation recomputation: full, {} {} layer(s) of each pipeline chunk; a recomputed layer keeps its "
            "input{} (a MoE layer its routing decisions too) and runs its forward again before its backward",
            ac.method == "block" ? "the first" : "in groups of", ac.num_layers,
            ac.cpu_checkpointing ? " in host memory (cpu_checkpointing)" : "");
}

bool Trainer::recompute_to_fit() {
  ActivationCheckpointingConfig& ac = config_.train.activation_checkpointing;
  if (!config_.resilience.oom_recompute || ac.full()) return false;
  ac.set_full();
  apply_recompute();
  return true;
}

void Trainer::shrink_micro_batch(const std::string& why, int64_t step, const json& blend_before) {
  TrainConfig& tc = config_.train;
  DS_CHECK(config_.resilience.oom_fallback,
           "step {}: {}; lower train.train_micro_batch_size_per_gpu or enable resilience.oom_fallback", step + 1, why);
  if (recompute_to_fit()) {
    // Every rank takes this branch: the ranks out of memory were counted over all of them.
    log::warn("step {}: {}: full activation recomputation turned on (the same results, about a third more compute; "
              "resilience.oom_recompute); the step runs again",
              step + 1, why);
  } else {
    DS_CHECK(tc.micro_batch % 2 == 0,
             "step {}: {}; the micro-batch of {} cannot be halved while keeping the global batch: lower "
             "train.train_micro_batch_size_per_gpu",
             step + 1, why, tc.micro_batch);
    tc.micro_batch /= 2;
    tc.grad_accum *= 2;
    log::warn("step {}: {}: micro-batch halved to {} with {} accumulation steps (global batch {} unchanged); the "
              "step runs again",
              step + 1, why, tc.micro_batch, tc.grad_accum, tc.train_batch_size);
  }
  step_need_bytes_ = -1;  // estimated again for the new split or policy
  model_->release_activations();
  model_->params().grads().zero();
  data_pipeline().reconfigure(tc.micro_batch, tc.grad_accum, step, blend_before);
}

void Trainer::fit_memory_budget() {
  const double act_budget = config_.resilience.activation_budget_mb * 1e6;
  const double budget = config_.metrics.memory_budget_gb * 1e9;
  if (act_budget <= 0 && budget <= 0) return;
  TrainConfig& tc = config_.train;
  const int world = grid_.world_size();
  // What goes over which budget under `c` ("" when every rank fits). The last estimate made is
  // always of the configuration in force when the loop below ends: the first step's check
  // (step_memory_need) takes this rank's peak from it instead of estimating again.
  int64_t last_need = -1;
  auto over = [&](const RunConfig& c) -> std::string {
    const MemoryEstimate e = estimate_memory(c, world);
    last_need = e.of_rank(grid_.world_rank()).peak_total;
    std::string why;
    for (const RankMemory& r : e.stages) {
      // Activations and the backward's temporaries, as Transformer::activation_bytes counts them.
      const double act =
          double(r.peak[size_t(MemCategory::Activations)] + r.peak[size_t(MemCategory::Workspace)]);
      if (act_budget > 0 && act > act_budget && why.empty()) {
        why = fmt::format("rank {} needs {:.0f} MB of activations and temporaries, over "
                          "resilience.activation_budget_mb ({:.0f} MB)",
                          r.ranks.front(), act / 1e6, act_budget / 1e6);
      }
      if (budget > 0 && double(r.peak_total) > budget && why.empty()) {
        why = fmt::format("rank {} needs {:.0f} MB at its peak, over metrics.memory_budget_gb ({:.0f} MB)",
                          r.ranks.front(), double(r.peak_total) / 1e6, budget / 1e6);
      }
    }
    return why;
  };
  const ResilienceConfig& rc = config_.resilience;
  std::string why = over(config_);
  while (!why.empty()) {
    const std::string split = fmt::format("micro-batch {} x {} tokens, {}", tc.micro_batch, config_.data.seq_len,
                                          tc.activation_checkpointing.full() ? "full recomputation"
                                                                              : "no full recomputation");
    if (rc.oom_fallback && rc.oom_recompute && !tc.activation_checkpointing.full()) {
      RunConfig full = config_;
      full.train.activation_checkpointing.set_full();
      std::string with_full = over(full);
      if (with_full.empty() || tc.micro_batch % 2 != 0) {
        recompute_to_fit();
        log::warn("memory model: {} ({}): full activation recomputation turned on (the same results, about a third "
                  "more compute; resilience.oom_recompute)",
                  why, split);
        why = std::move(with_full);  // the estimate of the configuration now in force
        continue;
      }
    }
    DS_CHECK(rc.oom_fallback && tc.micro_batch % 2 == 0,
             "memory model: {} ({}); lower train.train_micro_batch_size_per_gpu, turn on "
             "train.activation_checkpointing, raise the ZeRO stage or add ranks (dstrain train --dry-run prints each "
             "rank's memory)",
             why, split);
    tc.micro_batch /= 2;
    tc.grad_accum *= 2;
    log::warn("memory model: {} ({}): micro-batch halved to {} with {} accumulation steps (global batch {} unchanged)",
              why, split, tc.micro_batch, tc.grad_accum, tc.train_batch_size);
    why = over(config_);
  }
  step_need_bytes_ = last_need;
}

void Trainer::agree_on_step_memory(int64_t step) {
  for (;;) {
    std::string mine;  // why this rank cannot fit the step ("": it can)
    if (fault_at_this_step(&FaultInjection::oom_at_step) && !oom_fault_fired_) {
      oom_fault_fired_ = true;  // once: the step then gets through
      mine = "an allocation failed (fault injection)";
    } else if (const int64_t need = step_memory_need(); need > 0) {
      const int64_t have = memory_available ? memory_available() : default_memory_available();
      if (have >= 0 && need > have) {
        mine = fmt::format("the memory model puts its step's peak at {:.1f} MB and it can have {:.1f} MB", need / 1e6,
                           have / 1e6);
      }
    }
    int32_t failed = mine.empty() ? 0 : 1;
    timed_collective([&] { failed = grid_.world().all_reduce_value<int32_t>(failed, ReduceOp::Sum); });
    if (failed == 0) return;
    const std::string why = fmt::format("{} rank(s) would run out of memory in the step{}", failed,
                                        mine.empty() ? "" : fmt::format(" (rank {}: {})", grid_.world_rank(), mine));
    shrink_micro_batch(why, step, data_pipeline().blend_state());
  }
}

int64_t Trainer::step_memory_need() {
  if (step_need_bytes_ >= 0) return step_need_bytes_;
  try {
    step_need_bytes_ = estimate_rank_memory(config_, grid_.world_size(), grid_.world_rank()).peak_total;
  } catch (const Error& e) {
    step_need_bytes_ = 0;
    log::warn("memory model: no estimate for this rank's step ({}): steps start without checking that they fit",
              e.what());
  }
  return step_need_bytes_;
}

int64_t Trainer::default_memory_available() const {
  const Device device = model_->ctx().device;
  const int64_t free = allocator_for(device).available_bytes(device);
  if (free < 0) return -1;
  // The host's memory is shared by the node's ranks, a GPU's by no other rank.
  const int64_t share = device.is_cpu() ? free / std::max(grid_.local_size(), 1) : free;
  int64_t have = memory_stats(device.type).total() + share;
  const double budget = config_.metrics.memory_budget_gb * 1e9;
  if (budget > 0) have = std::min(have, int64_t(budget));
  return have;
}

Trainer::Outcome Trainer::train() {
  if (model_->compute_dtype() != config_.train.precision.compute_dtype()) apply_precision();
  fit_memory_budget();
  if (config_.resilience.spike_window > 0 && !spikes_) {
    spikes_ = std::make_unique<SpikeDetector>(config_.resilience.spike_window, config_.resilience.spike_zscore);
  }
  const TrainConfig& tc = config_.train;
  // train.max_steps counts from the run's first step: a resumed run below it has nothing to
  // train, and ending "successfully" would hide that --max-steps was meant as a total.
  DS_CHECK(step_ <= tc.max_steps,
           "resumed at step {} but train.max_steps (--max-steps) is {}: there is nothing to train; max_steps counts "
           "optimizer steps from the start of the run, not from the resume: set it above {} to train further",
           step_, tc.max_steps, step_);
  if (step_ == tc.max_steps) {
    log::info("nothing to train: resumed at step {}, which is train.max_steps", step_);
  } else {
    log::info("training {} steps ({} to {}): global batch {} windows x {} tokens = micro-batch {} x {} accumulation "
              "steps x {} data-parallel ranks",
              tc.max_steps - step_, step_ + 1, tc.max_steps, tc.train_batch_size, config_.data.seq_len, tc.micro_batch,
              tc.grad_accum, dp_.size());
  }
  if (dp_.size() > 1 && optimizer_->reducer()) {
    log::info("gradients: {} bucket(s) of up to {} elements, all-reduce {}", optimizer_->reducer()->num_buckets(),
              tc.zero.reduce_bucket_size, tc.zero.overlap_comm ? "overlapped with the backward" : "after the backward");
  } else if (dp_.size() > 1) {
    log::info("gradients: reduce-scattered per parameter in buckets of up to {} elements, {}",
              tc.zero.reduce_bucket_size, tc.zero.overlap_comm ? "overlapped with the backward" : "after the backward");
  }
  if (grid_.world_rank() == 0) std::filesystem::create_directories(config_.output.dir);
  grid_.world().barrier();
  if (config_.metrics.timeline_steps.enabled() && !timeline_) {
    // The run's start, right after the barrier: the clock the ranks' timelines share.
    // stage/stages: this rank's pipeline coordinate and the pipeline's ranks; chunks: the model
    // chunks each holds (interleaved, DualPipeV).
    const json header = {{"rank", grid_.world_rank()},
                         {"world", grid_.world_size()},
                         {"stage", grid_.coord(Axis::Pipeline)},
                         {"stages", grid_.size(Axis::Pipeline)},
                         {"chunks", schedule_->chunks()},
                         {"micro_batches", tc.grad_accum},
                         {"schedule", schedule_->name()},
                         // The schedule's bubble with the papers' chunk costs (backward = 2 x
                         // forward, its input and weight halves 1 each, free communication),
                         // simulated: what the measured bubble is compared with.
                         {"ideal_bubble", bubble_fraction(schedule_table(*schedule_, grid_.size(Axis::Pipeline),
                                                                         int(tc.grad_accum)),
                                                          stage_map(*schedule_, grid_.size(Axis::Pipeline)))},
                         {"clock", "steady clock; origin taken by every rank right after a barrier at the start"}};
    timeline_ = std::make_unique<Timeline>(
        config_.metrics.timeline_steps, step_ + 1,
        (std::filesystem::path(config_.output.dir) / fmt::format("timeline.rank{}.jsonl", grid_.world_rank())).string(),
        header, Clock::now());
  }
  if (!metrics_) {
    // On a GPU, MFU is against its datasheet bf16 peak, and NVML reports its utilisation and memory.
    // On a CPU, against the GEMM of the run's compute dtype (bf16 hardware has twice fp32's peak).
    PeakMeasure peak = [dt = model_->ctx().compute_dtype] { return measure_peak_flops(5, 0.05, dt); };
    const Device device = model_->ctx().device;
    if (device.type == DeviceType::CUDA) {
      peak = [index = device.index] {
        Peak p;
        p.flops = cuda::bf16_peak_flops(index, &p.source);
        return p;
      };
      gpu_monitor_ = std::make_unique<GpuMonitor>(GpuMonitor::by_pci_bus_id(cuda::pci_bus_id(device.index)));
      if (!gpu_monitor_->available() && grid_.world_rank() == 0) {
        log::warn("GPU utilisation is not reported: {}", gpu_monitor_->unavailable_reason());
      }
    }
    metrics_ = std::make_unique<Metrics>(config_.metrics, config_.model, config_.data.seq_len, grid_.world_rank(),
                                         grid_.world_size(), grid_.local_size(), config_.output.dir,
                                         tc.steps_per_print, peak);
    metrics_->on_run_start(environment_.record);
  }
  if (!data_started_) {
    data_pipeline().reconfigure(tc.micro_batch, tc.grad_accum, step_, resume_blend_);
    data_started_ = true;
  }
  const auto t0 = Clock::now();
  const int64_t first_step = step_ + 1;  // after a resume, not 1
  Outcome outcome = Outcome::Completed;
  while (step_ < tc.max_steps) {
    StepRecord r;
    if (!train_step(r)) {  // the micro-batch was halved: the same step again
      if (timeline_) timeline_->discard_step(step_ + 1);
      continue;
    }
    if (timeline_) timeline_->end_step(r.step);
    history_.push_back(r);
    if (on_step) on_step(r);
    // A checkpoint due at this step belongs to its time split. One deferred by a skipped
    // step is written as soon as a step succeeds again.
    const bool ckpt_due = checkpoint_due(r.step) || (save_deferred_ && !r.skipped && !r.overflow);
    if (ckpt_due) {
      r.checkpoint_seconds = history_.back().checkpoint_seconds = save_checkpoint();
      r.step_seconds += r.checkpoint_seconds;
      if (last_saved_step_ == r.step) metrics_->on_checkpoint(r.step, r.checkpoint_seconds, config_.checkpoint.async);
    }
    const double elapsed = seconds_since(t0);
    metrics_->on_step(step_metrics(r, elapsed, r.step - first_step + 1));
    const bool print = r.step % tc.steps_per_print == 0 || r.step == tc.max_steps || r.step == first_step;
    if (config_.data.train.size() > 1 && print) log::info("data mix {:>6} | {}", r.step, data_pipeline().mix_report());
    if (!r.moe.empty() && print) {
      const MoeLayerStats* worst = &r.moe[0];
      int64_t dead = 0, experts = 0, dropped = 0, assigned = 0;
      for (const MoeLayerStats& ms : r.moe) {
        if (ms.max_over_mean() > worst->max_over_mean()) worst = &ms;
        dead += ms.dead();
        experts += int64_t(ms.tokens.size());
        dropped += ms.dropped;
        for (int64_t t : ms.tokens) assigned += t;
      }
      log::info("routing {:>6} | ce {:.4f} + aux {:.5f} + mtp {:.4f} | worst expert load {:.2f} x mean (layer {}) | "
                "dead experts {} of {} | routing {:.1f}% + permutation {:.1f}% of the step",
                r.step, r.ce_loss, r.aux_loss, r.mtp_loss, worst->max_over_mean(), worst->layer, dead, experts,
                100 * r.moe_route_seconds / r.step_seconds, 100 * r.moe_permute_seconds / r.step_seconds);
      if (config_.model.moe_capacity_factor > 0) {
        log::info("routing {:>6} | moe.capacity_factor {}: {} of {} (token, expert) pairs dropped ({:.2f}%)", r.step,
                  config_.model.moe_capacity_factor, dropped, assigned, assigned ? 100.0 * double(dropped) / double(assigned) : 0.0);
      }
    }
    if (ep_ && print) {
      const ExpertParallelStep& e = r.ep;
      const double mom = e.received_max_over_mean();
      log::info("experts {:>6} | rows received per rank max {:.2f} x mean over {} ranks | all-to-all {:.1f} MB, "
                "dispatch {:.1f}% + experts {:.1f}% + combine {:.1f}% of the step",
                r.step, mom, e.received_rows.size(), e.a2a_bytes / 1e6, 100 * e.dispatch_seconds / r.step_seconds,
                100 * e.expert_seconds / r.step_seconds, 100 * e.combine_seconds / r.step_seconds);
      // Warned again after 10 printed steps at the earliest, so a lasting imbalance does not
      // bury the progress output.
      if (mom > kExpertImbalance && r.step >= ep_warned_step_ + 10 * tc.steps_per_print) {
        ep_warned_step_ = r.step;
        const auto busiest = std::max_element(e.received_rows.begin(), e.received_rows.end()) - e.received_rows.begin();
        log::warn("step {}: expert-parallel load is imbalanced: data-parallel rank {}'s experts computed {:.2f} x the "
                  "mean rows (above {:.2f}); the step waits for it. Its experts are over-chosen: balance the routing "
                  "(aux_loss_alpha, or noaux_tc's train.router_bias_update_rate) or set moe.capacity_factor",
                  r.step, busiest, mom, kExpertImbalance);
      }
      // The budget was fitted by the memory model with the loads it was told to assume.
      double layer_mom = 0;
      for (const MoeLayerStats& l : r.moe) layer_mom = std::max(layer_mom, l.received_max_over_mean());
      if (config_.metrics.memory_budget_gb > 0 && layer_mom > config_.metrics.expert_imbalance * 1.02 &&
          !imbalance_over_model_warned_) {
        imbalance_over_model_warned_ = true;
        log::warn("step {}: an expert rank received {:.2f} x the mean rows in one MoE layer, more than the {:.2f} x "
                  "the memory model assumed when it fitted metrics.memory_budget_gb: the busiest rank holds more "
                  "than it predicted; set metrics.expert_imbalance to at least {:.2f} (dstrain train --dry-run shows "
                  "its effect)",
                  r.step, layer_mom, config_.metrics.expert_imbalance, layer_mom);
      }
    }
    if (tc.eval_interval > 0 && (!config_.data.val.empty() || !config_.data.split.empty()) &&
        (r.step % tc.eval_interval == 0 || r.step == tc.max_steps)) {
      const std::vector<LossSums> e = evaluate_each(tc.eval_batches);
      log::info("eval   {:>6} | {}", r.step, eval_report(e));
      json per = json::object();
      for (size_t d = 0; d + 1 < e.size(); ++d) {
        per[eval_names_[d]] = {{"loss", e[d].mean()}, {"accuracy", e[d].accuracy()}, {"tokens", e[d].count}};
      }
      metrics_->on_eval(r.step, e.back().mean(), e.back().accuracy(), e.back().count, per);
    }
    if (config_.generate.interval > 0 && r.step % config_.generate.interval == 0) {
      log::info("sample {:>6} | {}", r.step, sample(config_.generate.prompt));
    }
    // A stop signal on any rank stops every rank at this same step boundary.
    const int signal = grid_.world().all_reduce_value<int32_t>(stop_signal_received(), ReduceOp::Max);
    if (signal != 0) {
      log::info("stop requested (signal {}) at step {}: saving a checkpoint and exiting with status {} so that the "
                "job can be requeued",
                signal, step_, kExitStoppedForRequeue);
      if (last_saved_step_ != step_) save_checkpoint();
      outcome = Outcome::StoppedOnSignal;
      break;
    }
  }
  if (outcome == Outcome::Completed && config_.checkpoint.save_final && last_saved_step_ != step_) save_checkpoint();
  // After the final checkpoint (which resumes exactly, mid-round or not): a run that ends inside
  // an outer round takes the outer step of every fragment not synchronised at its last step, so
  // that its replicas agree on the model it ends with (its export, its evaluation).
  if (outcome == Outcome::Completed && sync_ && sync_->finish(step_) > 0 && grid_.world_rank() == 0) {
    log::info("gradient sync: the run ends inside an outer round (step {}, every {}): the replicas took their outer "
              "step after the final checkpoint",
              step_, config_.train.gradient_sync.every);
  }
  ckpt_->wait();
  metrics_->on_run_end();
  return outcome;
}

DataPipeline& Trainer::data_pipeline() {
  if (!data_pipeline_) {
    data_pipeline_ = std::make_unique<DataPipeline>(config_.data, config_.model.vocab_size, config_.train.seed,
                                                    config_.train.micro_batch, config_.train.grad_accum, dp_,
                                                    grid_.world());
  }
  return *data_pipeline_;
}

}  // namespace dstrain
