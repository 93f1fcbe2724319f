// What one optimizer step did, as every rank agrees on it (losses, norms, routing, the axes'
// traffic) plus each rank's own timings: what the trainer's on_step callback, the metrics and
// the logs read.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"

namespace dstrain {

// Routing health of one DeepSeekMoE layer over a step's global batch.
struct MoeLayerStats {
  int layer = 0;
  double aux_loss = 0;
  std::vector<int64_t> tokens;  // (n_routed_experts) assignments, the router's choice
  int64_t dropped = 0;          // of those, dropped by moe.capacity_factor
  double max_over_mean() const { return max_over_mean_of(tokens); }
  int64_t dead() const { return std::count(tokens.begin(), tokens.end(), 0); }
  // Expert parallelism: the rows each data-parallel rank's experts computed (index = data
  // coordinate; empty without expert parallelism), and the busiest rank over the mean.
  std::vector<int64_t> received;
  double received_max_over_mean() const { return max_over_mean_of(received); }
  static double max_over_mean_of(const std::vector<int64_t>& v) {
    int64_t total = 0, mx = 0;
    for (int64_t t : v) {
      total += t;
      mx = std::max(mx, t);
    }
    return total ? double(mx) * double(v.size()) / double(total) : 0.0;
  }
};

// Expert parallelism in a step: the rows each data-parallel rank's experts computed over all
// MoE layers, and rank 0's all-to-all bytes sent and its time in the MoE layers' dispatch
// (sending rows to the experts' owners and waiting for them, forward and backward), the
// experts' GEMMs and the combine (the results back to the tokens' ranks).
// Expert-parallel ranks whose received rows exceed the mean by more than this fraction are
// imbalanced: a warning, and "imbalanced" in the metrics.
inline constexpr double kExpertImbalance = 1.10;
struct ExpertParallelStep {
  std::vector<int64_t> received_rows;
  double a2a_bytes = 0, dispatch_seconds = 0, expert_seconds = 0, combine_seconds = 0;
  double received_max_over_mean() const { return MoeLayerStats::max_over_mean_of(received_rows); }
};

struct StepRecord {
  int64_t step = 0;  // 1-based number of the optimizer step
  double loss = 0;   // the step's loss: ce_loss + aux_loss + mtp_loss
  double ce_loss = 0, aux_loss = 0, mtp_loss = 0;
  std::vector<MoeLayerStats> moe;
  // This rank's time in MoE routing and in token permutation (all layers, forward and
  // backward, every micro-step); part of forward_seconds + backward_seconds.
  double moe_route_seconds = 0, moe_permute_seconds = 0;
  double lr = 0;
  double grad_norm = 0;  // before clipping
  double step_seconds = 0;
  double tokens_per_s = 0;       // global
  double data_wait_seconds = 0;  // waiting for this step's batches
  double forward_seconds = 0, backward_seconds = 0, optimizer_seconds = 0, checkpoint_seconds = 0;
  double comm_seconds = 0;       // gradient all-reduce time (overlapped or not)
  double exposed_comm_seconds = 0;  // part of the step spent waiting for communication
  // Tensor parallelism: this rank's time and bytes in the tensor group's collectives (the
  // layers' all-reduces, gathers and reduce-scatters, and the partial gradients' sums), and the
  // latter's share of the time; all of it on the critical path (nothing overlaps it).
  double tp_comm_seconds = 0, tp_comm_bytes = 0, tp_grad_sync_seconds = 0;
  int64_t tp_comm_ops = 0;
  // Pipeline parallelism: this rank's point-to-point bytes (sent + received, the tied weights'
  // sum included), messages, and the time it waited for receives (the bubble it saw).
  double pp_comm_bytes = 0, pp_recv_wait_seconds = 0;
  int64_t pp_messages = 0;
  ExpertParallelStep ep;  // with parallel.expert > 1
  // Data parallelism: this rank's payload bytes in the data ranks' collectives of the step (its
  // replica's under asynchronous aggregation).
  double dp_comm_bytes = 0;
  // Asynchronous aggregation (train.gradient_sync, a mode other than "sync"): this rank's
  // payload bytes and waits between replicas in the step; the fragments synchronised, and
  // before the last of them the replicas' drift (sqrt of the mean over replicas of |theta_r -
  // mean theta|^2) and the outer gradient's norm (-1: no outer step); the norm this replica
  // clipped with (grad_norm is the root mean square over the replicas).
  bool gradient_sync = false;
  double sync_bytes = 0, sync_wait_seconds = 0, sync_drift = -1, sync_outer_delta_norm = -1;
  int64_t sync_outer_steps = 0;
  double replica_grad_norm = 0;
  bool update_applied = true;  // delayed: false at step 1 (no gradient yet to apply)
  bool skipped = false;             // no update: non-finite loss or gradients, or a loss spike
  std::string skip_reason;
  // fp16: the loss scale the step's backward used, and whether its gradients overflowed (the
  // step is then skipped on every rank: no update, and not counted as `skipped` above).
  double loss_scale = 1;
  bool overflow = false;
  // Per rank of the world (index = rank): step time and compute time (step minus exposed
  // communication), for load balance.
  std::vector<double> rank_step_seconds, rank_compute_seconds, rank_peak_rss_bytes;
  // Per world rank: weights + gradients + optimizer state + gathered weights held at the end of
  // the step, and the local parameters (elements) of the dense and expert groups.
  std::vector<double> rank_model_state_bytes;
  // Each rank's peak of the allocator's accounting on the model's device: all categories
  // together, and each category at its own peak (since the start of the run).
  std::vector<double> rank_memory_peak_bytes;
  std::vector<std::array<double, size_t(MemCategory::kCount)>> rank_category_peak_bytes;
  std::vector<std::pair<int64_t, int64_t>> rank_local_params;
};

}  // namespace dstrain
