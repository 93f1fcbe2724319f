// What a step reports: the MoE layers' routing over every rank, each rank's timings and
// memory, and the metrics record built from them.
#include "train/trainer.h"

#include <sys/resource.h>

#include <algorithm>
#include <optional>

#include "core/log.h"

namespace dstrain {
void Trainer::reduce_routing_stats(StepRecord& r) {
  const auto moe = model_->moe_layers();
  std::vector<double> routing;  // per MoE layer: aux loss, then tokens per expert
  for (auto& [l, ffn] : moe) {
    const RoutingStats& st = *ffn->routing();
    routing.push_back(st.aux_loss);
    for (int64_t c : st.tokens_per_expert) routing.push_back(double(c));
    routing.push_back(double(st.dropped_rows));
  }
  if (!routing.empty() && model_->shard().sequence_parallel) {
    // Each tensor rank routed its own rows: the loads add up over the group. The auxiliary
    // loss is the whole micro-batch's on every rank already: it goes in as zeros elsewhere.
    std::vector<double> loads = routing;
    size_t at = 0;
    for (auto& [l, ffn] : moe) {
      if (tp_->rank() != 0) loads[at] = 0;
      at += 2 + ffn->routing()->tokens_per_expert.size();
    }
    timed_collective([&] { tp_->all_reduce(Tensor(loads.data(), DType::F64, Shape{int64_t(loads.size())})); });
    routing = std::move(loads);
  }
  if (!routing.empty()) {
    // The routing biases follow the loads of the ranks that train together: every data rank,
    // or under local SGD and DiLoCo the replica's (the outer step averages the biases too).
    timed_collective([&] { routing_comm().all_reduce(Tensor(routing.data(), DType::F64, Shape{int64_t(routing.size())})); });
  }
  // Expert parallelism: the rows each data-parallel rank's experts received, per layer (each
  // rank is an expert rank of its group: the max over the mean is the groups' imbalance).
  const int64_t L = int64_t(moe.size()), dp = dp_.size();
  std::vector<int64_t> received(size_t(L * dp), 0);
  if (ep_ && L > 0) {
    std::vector<int64_t> mine;
    for (auto& [l, ffn] : moe) mine.push_back(ffn->routing()->received_rows);
    timed_collective([&] { dp_.all_gather(Tensor(received.data(), DType::I64, Shape{L * dp}), Tensor(mine.data(), DType::I64, Shape{L})); });
  }
  size_t at = 0;
  for (int64_t i = 0; i < L; ++i) {
    const auto& [l, ffn] = moe[size_t(i)];
    const RoutingStats& st = *ffn->routing();
    r.moe_route_seconds += st.route_seconds;
    r.moe_permute_seconds += st.permute_seconds;
    MoeLayerStats ms;
    ms.layer = l;
    ms.aux_loss = routing[at++] / scaler_->scale();
    r.aux_loss += ms.aux_loss;
    for (size_t e = 0; e < st.tokens_per_expert.size(); ++e) ms.tokens.push_back(int64_t(routing[at++]));
    ms.dropped = int64_t(routing[at++]);
    if (ep_) {
      for (int64_t d = 0; d < dp; ++d) ms.received.push_back(received[size_t(d * L + i)]);
      r.ep.a2a_bytes += st.a2a_bytes;
      r.ep.dispatch_seconds += st.dispatch_seconds;
      r.ep.combine_seconds += st.combine_seconds;
      r.ep.expert_seconds += st.expert_seconds;
    }
    r.moe.push_back(std::move(ms));
  }
  if (ep_) {
    // Rows received per data-parallel rank over all layers (with pipeline stages: all stages').
    r.ep.received_rows.assign(size_t(dp), 0);
    for (int64_t d = 0; d < dp; ++d) {
      for (int64_t i = 0; i < L; ++i) r.ep.received_rows[size_t(d)] += received[size_t(d * L + i)];
    }
    if (pp_) {
      timed_collective([&] { pp_->all_reduce(Tensor(r.ep.received_rows.data(), DType::I64, Shape{dp})); });
    }
  }
  if (!pp_) return;
  // Each stage holds some MoE layers: every rank gets every layer's statistics, in layer order.
  json mine = json::array();
  for (const MoeLayerStats& ms : r.moe) mine.push_back({ms.layer, ms.aux_loss, ms.tokens, ms.received, ms.dropped});
  r.moe.clear();
  for (const std::string& theirs : all_gather_strings(*pp_, mine.dump())) {
    for (const json& e : json::parse(theirs)) {
      MoeLayerStats ms;
      ms.layer = e[0].get<int>();
      ms.aux_loss = e[1].get<double>();
      ms.tokens = e[2].get<std::vector<int64_t>>();
      ms.received = e[3].get<std::vector<int64_t>>();
      ms.dropped = e[4].get<int64_t>();
      r.moe.push_back(std::move(ms));
    }
  }
  std::sort(r.moe.begin(), r.moe.end(), [](const MoeLayerStats& a, const MoeLayerStats& b) { return a.layer < b.layer; });
  r.aux_loss = 0;
  for (const MoeLayerStats& ms : r.moe) r.aux_loss += ms.aux_loss;
}

void Trainer::gather_rank_timings(StepRecord& r) {
  // Every rank's timing, for the load-balance view (a small gather outside the timed step).
  const int W = grid_.world_size();
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  // With them each rank's model state (weights, gradients, optimizer state and gathered weights
  // held at the end of the step) and its local parameters per group: a layout's ranks differ
  // (pipeline stages, expert owners), and rank 0 alone would not show it.
  const MemoryStats mem = memory_stats(model_->params().device().type);
  auto held = [&](MemCategory c) { return double(mem.bytes[size_t(c)]); };
  const ParamRegistry& reg = model_->params();
  constexpr int kCats = int(MemCategory::kCount), kPer = 7 + kCats;
  double mine[kPer] = {r.step_seconds,
                       r.step_seconds - r.exposed_comm_seconds,
                       double(usage.ru_maxrss) * 1024.0,
                       held(MemCategory::Parameters) + held(MemCategory::Gradients) +
                           held(MemCategory::OptimizerState) + held(MemCategory::GatheredParameters),
                       double(reg.group_numel(ParamGroup::Dense)),
                       double(reg.group_numel(ParamGroup::Expert)),
                       double(mem.peak_total)};
  for (int c = 0; c < kCats; ++c) mine[7 + c] = double(mem.peak[size_t(c)]);
  std::vector<double> all(static_cast<size_t>(kPer * W));
  grid_.world().all_gather(Tensor(all.data(), DType::F64, Shape{kPer * W}), Tensor(mine, DType::F64, Shape{kPer}));
  for (int k = 0; k < W; ++k) {
    const double* x = all.data() + kPer * k;
    r.rank_step_seconds.push_back(x[0]);
    r.rank_compute_seconds.push_back(x[1]);
    r.rank_peak_rss_bytes.push_back(x[2]);
    r.rank_model_state_bytes.push_back(x[3]);
    r.rank_local_params.push_back({int64_t(x[4]), int64_t(x[5])});
    r.rank_memory_peak_bytes.push_back(x[6]);
    std::array<double, size_t(MemCategory::kCount)> peaks{};
    for (int c = 0; c < kCats; ++c) peaks[size_t(c)] = x[7 + c];
    r.rank_category_peak_bytes.push_back(peaks);
  }
}

StepMetrics Trainer::step_metrics(const StepRecord& r, double elapsed, int64_t steps_this_run) {
  StepMetrics m;
  m.step = r.step;
  m.max_steps = config_.train.max_steps;
  m.loss = r.loss;
  m.lr = r.lr;
  m.grad_norm = r.grad_norm;
  m.tokens_per_s = r.tokens_per_s;
  m.tokens = consumed_samples_ * config_.data.seq_len;
  m.elapsed_s = elapsed;
  m.steps_this_run = steps_this_run;
  m.time.total = r.step_seconds;
  m.time.data_wait = r.data_wait_seconds;
  m.time.forward = r.forward_seconds;
  m.time.backward = r.backward_seconds;
  m.time.exposed_comm = r.exposed_comm_seconds;
  m.time.optimizer = r.optimizer_seconds;
  m.time.checkpoint = r.checkpoint_seconds;
  m.comm_s = r.comm_seconds;
  m.skipped = r.skipped;
  m.skipped_total = skipped_total_;
  if (scaler_->enabled()) {
    m.loss_scaling = true;
    m.loss_scale = r.loss_scale;
    m.overflow = r.overflow;
    m.overflow_skipped_total = overflow_steps_;
  }
  m.rank_step_s = r.rank_step_seconds;
  m.rank_compute_s = r.rank_compute_seconds;
  m.rank_peak_rss_bytes = r.rank_peak_rss_bytes;
  {
    json dense = json::array(), expert = json::array();
    for (const auto& [d, e] : r.rank_local_params) {
      dense.push_back(d);
      expert.push_back(e);
    }
    json by_category = json::object();
    for (int c = 0; c < int(MemCategory::kCount); ++c) {
      json v = json::array();
      for (const auto& peaks : r.rank_category_peak_bytes) v.push_back(peaks[size_t(c)]);
      by_category[std::string(mem_category_name(MemCategory(c)))] = v;
    }
    m.extra["ranks"] = {{"model_state_bytes", r.rank_model_state_bytes},
                        {"memory_peak_bytes", r.rank_memory_peak_bytes},
                        {"peak_rss_bytes", r.rank_peak_rss_bytes},
                        {"memory_peak_bytes_by_category", by_category},
                        {"local_dense_params", dense},
                        {"local_expert_params", expert}};
  }
  if (gpu_monitor_) {
    // This rank's GPU (rank 0's in the record): NVML's utilisation and memory, and what dstrain's
    // own buffers hold on it at their peak.
    json gpu = {{"device", model_->ctx().device.str()},
                {"dstrain_peak_bytes", double(memory_stats(DeviceType::CUDA).total())}};
    if (const std::optional<GpuSample> g = gpu_monitor_->sample()) {
      gpu["utilization_percent"] = g->utilization_percent;
      gpu["memory_used_bytes"] = g->memory_used_bytes;
      gpu["memory_total_bytes"] = g->memory_total_bytes;
    }
    m.extra["gpu"] = gpu;
  }
  if (config_.data.train.size() > 1) m.extra["data_mix"] = data_pipeline().drawn();
  for (const auto& axis : axes_) axis->add_metrics(r, m.extra);
  if (r.gradient_sync) {
    // Rank 0's traffic: inside its replica (the data ranks' reductions) and between replicas.
    json g = {{"mode", sync_->config().mode},
              {"replicas", grid_.replicas()},
              {"every", sync_->config().every},
              {"inner_bytes", r.dp_comm_bytes},
              {"outer_bytes", r.sync_bytes},
              {"outer_wait_s", r.sync_wait_seconds},
              {"outer_steps", r.sync_outer_steps},
              {"replica_grad_norm", r.replica_grad_norm},
              {"update_applied", r.update_applied}};
    if (r.sync_drift >= 0) {
      g["drift"] = r.sync_drift;
      g["outer_delta_norm"] = r.sync_outer_delta_norm;
    }
    m.extra["gradient_sync"] = g;
  } else {
    m.extra["data_parallel"] = {{"comm_bytes", r.dp_comm_bytes}};
  }
  if (r.moe.empty() && config_.model.num_nextn_predict_layers > 0) {
    // A dense model with multi-token prediction: the two parts of its loss.
    m.extra["ce_loss"] = r.ce_loss;
    m.extra["mtp_loss"] = r.mtp_loss;
  }
  if (!r.moe.empty()) {
    m.extra["ce_loss"] = r.ce_loss;
    m.extra["aux_loss"] = r.aux_loss;
    m.extra["mtp_loss"] = r.mtp_loss;
    m.extra["moe_route_s"] = r.moe_route_seconds;
    m.extra["moe_permute_s"] = r.moe_permute_seconds;
    json moe = json::object();
    for (const MoeLayerStats& ms : r.moe) {
      json& layer = moe[std::to_string(ms.layer)];
      layer = {{"max_over_mean_load", ms.max_over_mean()},
               {"dead_experts", ms.dead()},
               {"aux_loss", ms.aux_loss},
               {"tokens_per_expert", ms.tokens}};
      if (config_.model.moe_capacity_factor > 0) layer["dropped_rows"] = ms.dropped;
      if (!ms.received.empty()) {
        layer["received_rows"] = ms.received;
        layer["received_max_over_mean"] = ms.received_max_over_mean();
      }
    }
    m.extra["moe"] = moe;
  }
  return m;
}

}  // namespace dstrain
