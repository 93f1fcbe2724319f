#include "train/parallel_axes.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/clock.h"
#include "model/transformer.h"
#include "train/pipeline.h"

namespace dstrain {

// ---- tensor -------------------------------------------------------------------------------

TensorAxis::TensorAxis(Transformer& model, Communicator& tp, bool sum_every_micro_step)
    : model_(model), tp_(tp), sync_(model.params(), &tp), before_(tp.stats()) {
  if (sum_every_micro_step) sync_.sum_every_micro_step();
}

std::string TensorAxis::describe() const {
  return fmt::format("tensor parallelism: {} ranks{}", tp_.size(),
                     model_.shard().sequence_parallel ? ", sequence parallel" : "");
}

void TensorAxis::finish_gradients(ReduceTimings&) {
  // On the critical path: nothing overlaps the partial sums (their time is in tp_grad_sync_s).
  sync_.finish();
}

void TensorAxis::record(StepRecord& r) {
  const CommStats now = tp_.stats();
  r.tp_comm_seconds = now.busy_seconds - before_.busy_seconds;
  r.tp_comm_bytes = now.bytes - before_.bytes;
  r.tp_comm_ops = int64_t(now.ops - before_.ops);
  r.tp_grad_sync_seconds = sync_.take_seconds();
  before_ = now;
}

void TensorAxis::add_metrics(const StepRecord& r, json& out) const {
  out["tensor_parallel"] = {{"size", tp_.size()},
                            {"sequence_parallel", model_.shard().sequence_parallel},
                            {"comm_s", r.tp_comm_seconds},
                            {"comm_bytes", r.tp_comm_bytes},
                            {"collectives", r.tp_comm_ops},
                            {"grad_sync_s", r.tp_grad_sync_seconds},
                            {"activation_bytes", model_.activations().bytes_allocated()}};
}

// ---- data ---------------------------------------------------------------------------------

void DataAxis::finish_gradients(ReduceTimings& t) {
  const ReduceTimings z = opt_.finish();
  t.comm_seconds += z.comm_seconds;
  t.exposed_seconds += z.exposed_seconds;
  t.buckets += z.buckets;
}

void DataAxis::add_metrics(const StepRecord&, json& out) const {
  // Rank 0's optimizer state (ZeRO's shard), with the step's peaks of what is only held while
  // in use.
  const ZeroMemory z = opt_.memory();
  out["zero"] = {{"stage", opt_.stage()},
                 {"shard_elements", opt_.shard_numel()},
                 {"master_bytes", z.master},
                 {"optimizer_bytes", z.optimizer},
                 {"grad_shard_bytes", z.grad_shard},
                 {"gathered_bytes", z.gathered},
                 {"gathered_peak_bytes", z.gathered_peak},
                 {"transient_grad_bytes", z.transient_grads},
                 {"transient_grad_peak_bytes", z.transient_grads_peak},
                 {"comm_buffer_bytes", z.comm_buffers}};
}

// ---- pipeline -----------------------------------------------------------------------------

PipelineAxis::PipelineAxis(PipelineRunner& runner, Communicator& pp, std::string schedule, const Transformer& model,
                           DistributedOptimizer& optimizer, std::string description)
    : runner_(runner),
      pp_(pp),
      schedule_(std::move(schedule)),
      model_(model),
      opt_(optimizer),
      description_(std::move(description)) {}

void PipelineAxis::finish_gradients(ReduceTimings& t) {
  if (!runner_.has_tie()) return;
  // The tied embedding's two stages add their (data-parallel reduced) gradients: the whole ones,
  // or at ZeRO stages 2 and 3 the two stages' identical pieces of them (the sum is linear).
  const auto t0 = Clock::now();
  if (opt_.reduces_into_shard()) {
    runner_.reduce_tied_grads(opt_.grad_piece(runner_.tied_param()));
  } else {
    runner_.reduce_tied_grads();
  }
  t.exposed_seconds += seconds_since(t0);
}

void PipelineAxis::record(StepRecord& r) {
  const PipelineRunner::Traffic t = runner_.take_traffic();
  r.pp_comm_bytes = t.bytes_sent + t.bytes_received;
  r.pp_recv_wait_seconds = t.recv_wait_seconds;
  r.pp_messages = t.messages;
}

void PipelineAxis::add_metrics(const StepRecord& r, json& out) const {
  // Rank 0's stage: its point-to-point traffic and the time it waited for the others.
  out["pipeline"] = {{"size", pp_.size()},
                     {"schedule", schedule_},
                     {"stages", runner_.num_stages()},
                     {"comm_bytes", r.pp_comm_bytes},
                     {"messages", r.pp_messages},
                     {"recv_wait_s", r.pp_recv_wait_seconds},
                     {"activation_bytes", model_.activations().bytes_allocated()}};
}

// ---- expert -------------------------------------------------------------------------------

void ExpertAxis::add_metrics(const StepRecord& r, json& out) const {
  // Every data-parallel rank's received rows; rank 0's all-to-all traffic and time split.
  out["expert_parallel"] = {{"size", ep_.size()},
                            {"received_rows", r.ep.received_rows},
                            {"received_max_over_mean", r.ep.received_max_over_mean()},
                            {"imbalanced", r.ep.received_max_over_mean() > kExpertImbalance},
                            {"a2a_bytes", r.ep.a2a_bytes},
                            {"a2a_s", r.ep.dispatch_seconds + r.ep.combine_seconds},
                            {"dispatch_s", r.ep.dispatch_seconds},
                            {"expert_s", r.ep.expert_seconds},
                            {"combine_s", r.ep.combine_seconds}};
}

std::string describe_expert_layout(const ModelConfig& mc, int ep, const std::string& groups) {
  // Group-limited routing (V2's device-limited, V3's node-limited) picks topk_group of the
  // n_group expert groups per token; where the groups lie on whole ranks (or nodes) that bounds
  // the ranks a token's rows are sent to.
  const int64_t El = mc.n_routed_experts / ep, per_group = mc.n_routed_experts / mc.n_group;
  std::string bound;
  if (mc.topk_method != "greedy") {
    // Ranks a group lies on (whole groups per rank: 1), when groups and ranks align.
    const int64_t ranks = per_group % El == 0 ? per_group / El : El % per_group == 0 ? 1 : 0;
    bound = ranks > 0 ? fmt::format("; {} of {} expert groups per token, each on {} rank(s): a token's rows go to "
                                    "at most {} rank(s)",
                                    mc.topk_group, mc.n_group, ranks,
                                    std::min<int64_t>({int64_t(ep), mc.num_experts_per_tok, mc.topk_group * ranks}))
                      : fmt::format("; {} of {} expert groups per token (the groups do not align with the ranks' "
                                    "experts)",
                                    mc.topk_group, mc.n_group);
  }
  return fmt::format("expert parallelism: {} routed experts per MoE layer over {} ranks, {} per rank ({}){}",
                     mc.n_routed_experts, ep, El, groups, bound);
}

}  // namespace dstrain
