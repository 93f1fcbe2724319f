#include "plan/perf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <tuple>

#include "core/error.h"
#include "distributed/schedule.h"
#include "train/layout_check.h"

namespace dstrain {
namespace {

// One rank's step on its own clock.
struct Clocked {
  std::vector<double> action_start;  // per Action mark
  double tail_start = 0, end = 0;
  StagePrediction s;
};

Clocked run_clock(const ExecTrace& trace, const AxisSizes& a, const HardwareProfile& hw, const PriceOptions& price,
                  double on_node) {
  Clocked c;
  std::map<std::string, double> slowdown;
  for (const char* cls : {"gemm", "attention", "elementwise", "optimizer"}) slowdown[cls] = oversubscription(hw, cls, on_node);
  double clock = 0;
  std::map<std::string, double> link_free;     // group -> when its link is next free
  std::vector<double> done(size_t(trace.next_id), 0);
  std::vector<std::string> group_of(size_t(trace.next_id));
  bool tail_seen = false;
  for (const TraceEvent& e : trace.events) {
    switch (e.kind) {
      case TraceEvent::Kind::Action:
        c.action_start.push_back(clock);
        break;
      case TraceEvent::Kind::Tail:
        c.tail_start = clock;
        tail_seen = true;
        break;
      case TraceEvent::Kind::Op: {
        const double t = slowdown[op_class(e)] * op_seconds(hw, e, price);
        clock += t;
        c.s.compute += t;
        c.s.by_class[op_class(e)] += t;
        c.s.by_op[e.name] += t;
        c.s.flops += e.flops;
        break;
      }
      case TraceEvent::Kind::Issue: {
        group_of[size_t(e.id)] = e.group;
        if (std::string(e.name) == "send") {
          // Priced by the pipeline's simulation.
          c.s.p2p_bytes = std::max(c.s.p2p_bytes, e.bytes);
          done[size_t(e.id)] = clock;
          break;
        }
        const double t = collective_seconds(hw, e.name, e.bytes, e.group_size, group_spans_nodes(e.group, a, hw.ranks_per_node));
        const double start = std::max(clock, link_free[e.group]);
        link_free[e.group] = start + t;
        done[size_t(e.id)] = start + t;
        c.s.comm_total[e.group] += t;
        break;
      }
      case TraceEvent::Kind::Wait: {
        const double d = done[size_t(e.id)];
        if (d > clock) {
          c.s.comm_exposed[group_of[size_t(e.id)]] += d - clock;
          c.s.exposed_comm += d - clock;
          clock = d;
        }
        break;
      }
    }
  }
  c.end = clock;
  if (!tail_seen) c.tail_start = clock;
  return c;
}

std::string group_label(const std::string& g) { return g; }

}  // namespace

bool group_spans_nodes(const std::string& group, const AxisSizes& a, int rpn) {
  int64_t span = 1;  // ranks from the group's first to its last, in world order (comm/grid.h)
  if (group == "tensor") span = a.tensor;
  else if (group == "data") span = int64_t(a.tensor) * a.data;
  else if (group == "expert") span = int64_t(a.tensor) * a.expert;
  else if (group == "expert_data") span = a.data / std::max(1, a.expert) > 1 ? int64_t(a.tensor) * a.data : 1;
  else if (group == "pipeline") span = int64_t(a.tensor) * a.data * a.pipeline;
  return span > rpn;
}

Prediction predict(const RunConfig& config, int world, const HardwareProfile& hw, const PredictOptions& opt) {
  RunConfig c = config;
  const CheckedLayout layout = check_layout(c, world);
  const AxisSizes& a = layout.sizes;
  const TrainConfig& tc = c.train;
  Prediction p;
  p.world = world;
  p.sizes = a;
  p.profile = hw.name;
  p.profile_calibrated = hw.calibrated;
  p.efficiency_fitted = hw.gemm_efficiency > 0 || !hw.op_fits.empty() || !hw.op_seconds.empty();
  p.micro_batch = tc.micro_batch;
  p.grad_accum = tc.grad_accum;
  p.global_batch = tc.micro_batch * tc.grad_accum * a.data;
  p.seq_len = c.data.seq_len;
  p.zero_stage = int(tc.zero.stage);
  p.recompute = tc.activation_checkpointing.granularity.empty() ? "none" : tc.activation_checkpointing.granularity;
  p.schedule = a.pipeline > 1 ? c.parallel.schedule : tc.micro_batch_schedule;

  const int P = a.pipeline;
  const int n_full = int(tc.grad_accum);
  // The trace runs as few micro-batches as give every action its steady-state cost and the
  // memory its peak (the schedule's most in flight): 2 per pipeline rank (a multiple of them
  // interleaved), 2 without a pipeline; the others take their traced twin's duration. All
  // forwards then all backwards keeps every micro-batch in flight: traced in full.
  int n_trace = n_full;
  if (opt.cap_traced_micro_batches && p.schedule != "all_forward_all_backward") {
    int need = P > 1 ? 2 * P : 2;
    n_trace = std::min(n_full, need);
  }
  RunConfig traced_config = c;
  traced_config.train.grad_accum = n_trace;
  traced_config.train.train_batch_size = tc.micro_batch * n_trace * a.data;
  std::vector<StageTrace> traced = trace_step(traced_config, world);
  // Under asynchronous aggregation the traced step reduces over a replica's data ranks.
  const GradientSyncConfig& gs = tc.gradient_sync;
  int S = a.data;
  if (gs.async()) {
    S = int(gs.data_per_replica > 0 ? gs.data_per_replica
                                      : gs.over == "nodes" ? std::max(a.expert, std::min(a.data, hw.ranks_per_node / a.tensor))
                                                           : a.expert);
    if (S < 1 || a.data % S != 0) S = a.expert;
  }
  AxisSizes a_traced = a;
  a_traced.data = S;
  auto schedule = P > 1 ? make_schedule(c.parallel.schedule,
                                        c.parallel.schedule == "interleaved" ? int(c.parallel.virtual_stages) : 1)
                        : make_schedule(tc.micro_batch_schedule);
  const auto table = schedule_table(*schedule, P, n_full);
  const auto traced_table = schedule_table(*schedule, P, n_trace);
  const double scale = double(n_full) / double(n_trace);
  // Prices the traced steps with `concurrency` ranks busy at once on a node.
  auto assemble = [&](double concurrency) {
    p.stages.clear();
    p.step_seconds = 0;
    p.hardware_flops_per_step = 0;
    std::vector<Clocked> clocks;
    for (int s = 0; s < P; ++s) {
      clocks.push_back(run_clock(traced[size_t(s)].trace, a_traced, hw, opt.price, concurrency));
      clocks.back().s.pipeline = s;
    }
    // Each action's duration on its rank's clock. Untraced micro-batches take the median of the
    // traced ones of the same chunk and kind; the step's last micro-batch keeps its own (it
    // issues the step's gradient reduction). A kind the short trace did not run (a schedule that
    // splits backwards for some micro-batches only) is made of the others: B = BI + BW, and
    // BI = BW = B / 2.
    std::vector<std::vector<double>> dur(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      const Clocked& k = clocks[size_t(r)];
      DS_CHECK(k.action_start.size() == traced_table[size_t(r)].size(),
               "performance model: pipeline rank {} traced {} actions, its schedule has {}", r, k.action_start.size(),
               traced_table[size_t(r)].size());
      std::map<std::pair<int, int>, std::vector<double>> typical;  // (chunk, kind) -> durations
      std::map<std::pair<int, int>, double> last;
      for (size_t i = 0; i < k.action_start.size(); ++i) {
        const double next = i + 1 < k.action_start.size() ? k.action_start[i + 1] : k.tail_start;
        const ScheduleAction& act = traced_table[size_t(r)][i];
        const std::pair<int, int> key{act.chunk, int(act.kind)};
        if (act.micro_batch == n_trace - 1) last[key] = next - k.action_start[i];
        if (act.micro_batch < n_trace - 1 || n_trace == 1) typical[key].push_back(next - k.action_start[i]);
      }
      auto cost = [&](int chunk, ScheduleAction::Kind kind, bool is_last) -> std::optional<double> {
        const std::pair<int, int> key{chunk, int(kind)};
        if (is_last) {
          if (auto it = last.find(key); it != last.end()) return it->second;
        }
        if (auto it = typical.find(key); it != typical.end()) {
          std::vector<double> v = it->second;
          std::nth_element(v.begin(), v.begin() + long(v.size() / 2), v.end());
          return v[v.size() / 2];
        }
        if (auto it = last.find(key); it != last.end()) return it->second;
        return std::nullopt;
      };
      using K = ScheduleAction::Kind;
      for (const ScheduleAction& act : table[size_t(r)]) {
        const bool is_last = act.micro_batch == n_full - 1;
        std::optional<double> d = cost(act.chunk, act.kind, is_last);
        if (!d && act.kind == K::Backward) {
          auto bi = cost(act.chunk, K::BackwardInput, is_last), bw = cost(act.chunk, K::BackwardWeight, is_last);
          if (bi && bw) d = *bi + *bw;
        }
        if (!d && (act.kind == K::BackwardInput || act.kind == K::BackwardWeight)) {
          if (auto b = cost(act.chunk, K::Backward, is_last)) d = *b / 2;
        }
        DS_CHECK(d.has_value(), "performance model: no traced duration for {} on pipeline rank {}", to_string(act), r);
        dur[size_t(r)].push_back(*d);
      }
    }
    for (Clocked& k : clocks) {
      k.s.compute *= scale;
      k.s.flops *= scale;
      for (auto& [cls, t] : k.s.by_class) t *= scale;
      for (auto& [name, t] : k.s.by_op) t *= scale;
    }
    std::vector<double> finish(size_t(P), 0);
    if (P > 1) {
      double p2p = 0;
      for (const Clocked& k : clocks) p2p = std::max(p2p, k.s.p2p_bytes);
      p.p2p_seconds = p2p > 0 ? collective_seconds(hw, "send", p2p, 2, group_spans_nodes("pipeline", a, hw.ranks_per_node)) : 0;
      finish = simulate_step(table, stage_map(*schedule, P), [&](int r, size_t i) { return dur[size_t(r)][i]; },
                             p.p2p_seconds);
    } else {
      for (double d : dur[0]) finish[0] += d;
    }
    double idle = 0, span = 0;
    for (int r = 0; r < P; ++r) span = std::max(span, finish[size_t(r)]);
    for (int r = 0; r < P; ++r) {
      double busy = 0;
      for (double d : dur[size_t(r)]) busy += d;
      clocks[size_t(r)].s.busy = busy;
      idle += span - busy;
    }
    p.bubble_fraction = span > 0 ? idle / (double(P) * span) : 0;
    for (int r = 0; r < P; ++r) {
      StagePrediction& s = clocks[size_t(r)].s;
      s.finish = finish[size_t(r)];
      s.tail = clocks[size_t(r)].end - clocks[size_t(r)].tail_start;
      p.step_seconds = std::max(p.step_seconds, s.finish + s.tail);
      p.hardware_flops_per_step += s.flops * double(a.data) * double(a.tensor);
      p.stages.push_back(s);
    }
    p.tokens_per_second = p.step_seconds > 0 ? double(p.global_batch * p.seq_len) / p.step_seconds : 0;
  };
  const double on_node = double(std::min(world, hw.ranks_per_node));
  assemble(on_node);
  // CPU ranks that wait (pipeline bubbles, exposed communication) leave the node's cores to the
  // others: the ops run at the contention of the ranks busy on average (a fixed point, found in
  // a few rounds).
  if (hw.device_type == "cpu" && on_node > 1) {
    for (int round = 0; round < 4; ++round) {
      double busy = 0;
      for (const StagePrediction& st : p.stages) busy += p.step_seconds > 0 ? std::min(1.0, st.compute / p.step_seconds) : 1;
      busy /= double(p.stages.size());
      assemble(std::max(1.0, on_node * busy));
    }
  }

  // Model FLOPs: what the step computes without recomputation, at balanced expert loads.
  p.model_flops_per_step = p.hardware_flops_per_step;
  const bool recomputes = !p.recompute.empty() && p.recompute != "none";
  if (opt.model_flops && (recomputes || (a.expert > 1 && c.metrics.expert_imbalance > 1))) {
    RunConfig plain = c;
    plain.train.activation_checkpointing = ActivationCheckpointingConfig();
    plain.metrics.expert_imbalance = 1;
    plain.train.grad_accum = traced_config.train.grad_accum;
    plain.train.train_batch_size = traced_config.train.train_batch_size;
    std::vector<StageTrace> t2 = trace_step(plain, world);
    p.model_flops_per_step = 0;
    for (const StageTrace& st : t2) {
      double f = 0;
      for (const TraceEvent& e : st.trace.events) f += e.kind == TraceEvent::Kind::Op ? e.flops : 0;
      p.model_flops_per_step += f * scale * double(a.data) * double(a.tensor);
    }
  }
  // Aggregation between replicas: one all-reduce of each rank's pieces (its local weights, cut
  // by ZeRO over the replica's data ranks) over the replicas, on the slowest link they cross.
  // Local pieces: the parameters over tensor x pipeline x expert ranks (routed experts are most
  // of a MoE model's; its dense part is under-counted by the expert factor).
  const double local_elems = double(c.model.num_parameters()) / double(a.tensor) / double(a.pipeline) / double(a.expert);
  const bool replicas_span_nodes = int64_t(a.tensor) * a.data > hw.ranks_per_node;
  auto outer_seconds = [&](int per_replica, double elem_bytes) {
    const int R = a.data / per_replica;
    const double elems = local_elems / (tc.zero.stage >= 1 ? double(per_replica) : 1.0);
    return R > 1 ? collective_seconds(hw, "all_reduce", elems * elem_bytes, R, replicas_span_nodes) : 0.0;
  };
  p.data_per_replica = S;
  p.replicas = a.data / S;
  p.gradient_sync.mode = gs.async() ? gs.mode : "sync";
  p.gradient_sync.every = gs.every;
  if (gs.async()) {
    const double t = outer_seconds(S, gs.outer_dtype == "bf16" ? 2.0 : 4.0);
    p.gradient_sync.outer_seconds = t;
    p.gradient_sync.exposed_seconds = gs.mode == "delayed" ? std::max(0.0, t - p.step_seconds) : t / double(gs.every);
    p.step_seconds += p.gradient_sync.exposed_seconds;
    p.tokens_per_second = double(p.global_batch * p.seq_len) / p.step_seconds;
  } else if (a.data > a.expert) {
    // The same layout with each expert group a replica: the synchronous data-parallel wait goes,
    // the outer all-reduce comes (delayed: behind the next step; every H steps otherwise).
    for (const StagePrediction& st : p.stages) {
      double w = 0;
      for (const auto& [g, t] : st.comm_exposed) w += g == "data" || g == "expert_data" ? t : 0;
      p.data_exposed_seconds = std::max(p.data_exposed_seconds, w);
    }
    const double base = std::max(0.0, p.step_seconds - p.data_exposed_seconds);
    const double t = outer_seconds(a.expert, 4.0);
    p.sync_alternatives.push_back({"delayed", 1, base + std::max(0.0, t - base), t, std::max(0.0, t - base)});
    for (int64_t H : {8, 32, 128}) p.sync_alternatives.push_back({"diloco", H, base + t / double(H), t, t / double(H)});
  }
  p.gradient_sync.step_seconds = p.step_seconds;
  p.peak_flops_per_rank = peak_flops(hw, dtype_key(tc.precision.compute_dtype()));
  if (p.peak_flops_per_rank > 0 && p.step_seconds > 0)
    p.mfu = p.model_flops_per_step / (p.step_seconds * double(world) * p.peak_flops_per_rank);

  for (StageTrace& st : traced) {
    p.peak_memory = std::max(p.peak_memory, st.memory.peak_total + st.memory.library_peak);
    p.memory.stages.push_back(st.memory);
  }
  p.memory.world = world;
  // A CPU node's memory is shared by its ranks.
  p.memory_available = hw.device_type == "cpu" ? hw.memory_bytes / std::min(world, hw.ranks_per_node) : hw.memory_bytes;
  p.fits = double(p.peak_memory) <= p.memory_available;
  return p;
}

std::vector<std::string> explain(const Prediction& p) {
  std::vector<std::string> out;
  const AxisSizes& a = p.sizes;
  out.push_back(fmt::format("layout: {} ranks = data {} x tensor {} x pipeline {} (expert {} within data), {} schedule, "
                            "ZeRO {}, recompute {}, micro-batch {} x {} accumulation steps, global batch {} x {} tokens",
                            p.world, a.data, a.tensor, a.pipeline, a.expert, p.schedule, p.zero_stage, p.recompute,
                            p.micro_batch, p.grad_accum, p.global_batch, p.seq_len));
  out.push_back(fmt::format("profile: {} ({}{})", p.profile, p.profile_calibrated ? "calibrated" : "uncalibrated",
                            p.efficiency_fitted ? "" : "; no GEMM efficiency fitted: datasheet peak"));
  out.push_back(fmt::format("step {:.4g} s, {:.4g} tokens/s, MFU {:.1f}% (model {:.4g} FLOP per step, hardware {:.4g}, "
                            "peak {:.4g} FLOP/s per rank)",
                            p.step_seconds, p.tokens_per_second, 100 * p.mfu, p.model_flops_per_step,
                            p.hardware_flops_per_step, p.peak_flops_per_rank));
  if (a.pipeline > 1)
    out.push_back(fmt::format("pipeline: bubble {:.1f}% of the stages' time, {:.3g} ms per activation message",
                              100 * p.bubble_fraction, 1e3 * p.p2p_seconds));
  for (const StagePrediction& s : p.stages) {
    std::string line = fmt::format("stage {}: compute {:.4g} s (", s.pipeline, s.compute);
    bool first = true;
    for (const auto& [k, v] : s.by_class) {
      line += fmt::format("{}{} {:.3g}", first ? "" : ", ", k, v);
      first = false;
    }
    line += fmt::format("), actions end at {:.4g} s, then {:.4g} s of gradient reduction and optimizer", s.finish, s.tail);
    out.push_back(line);
    std::vector<std::pair<double, std::string>> ops;
    for (const auto& [name, t] : s.by_op) ops.push_back({t, name});
    std::sort(ops.rbegin(), ops.rend());
    std::string top = "  largest ops:";
    for (size_t i = 0; i < std::min<size_t>(5, ops.size()); ++i)
      top += fmt::format("{} {} {:.3g} s", i ? "," : "", ops[i].second, ops[i].first);
    out.push_back(top);
    for (const auto& [g, t] : s.comm_total) {
      const auto e = s.comm_exposed.find(g);
      out.push_back(fmt::format("  {} collectives: {:.4g} s on the link, {:.4g} s exposed", group_label(g), t,
                                e == s.comm_exposed.end() ? 0.0 : e->second));
    }
  }
  if (p.gradient_sync.mode != "sync") {
    const GradientSyncPrice& g = p.gradient_sync;
    out.push_back(fmt::format("gradient sync: {} over {} replicas of {} data rank(s): one outer all-reduce takes {:.4g} s "
                              "on the link{}, {:.4g} s a step exposed",
                              g.mode, p.replicas, p.data_per_replica, g.outer_seconds,
                              g.mode == "delayed" ? " (behind the next step)" : fmt::format(" every {} steps", g.every),
                              g.exposed_seconds));
  } else if (!p.sync_alternatives.empty()) {
    std::string alts;
    const GradientSyncPrice* best = nullptr;
    for (const GradientSyncPrice& g : p.sync_alternatives) {
      alts += fmt::format("{}{} {:.4g} s", alts.empty() ? "" : ", ",
                          g.mode == "delayed" ? std::string("delayed") : fmt::format("DiLoCo H={}", g.every), g.step_seconds);
      if (!best || g.step_seconds < best->step_seconds) best = &g;
    }
    const double gain = p.step_seconds / best->step_seconds;
    out.push_back(fmt::format(
        "gradient sync: synchronous waits {:.4g} s a step for the data-parallel reduction; with each of the {} expert "
        "groups a replica (train.gradient_sync, one outer all-reduce {:.4g} s on the link) a step would take: {}; {}",
        p.data_exposed_seconds, p.sizes.data / std::max(1, p.sizes.expert), best->outer_seconds, alts,
        gain > 1.05 ? fmt::format("asynchronous aggregation pays off here ({:.2f}x with {}; check its convergence: "
                                  "validation/bench_gradient_sync.py)",
                                  gain, best->mode == "delayed" ? std::string("delayed") : fmt::format("DiLoCo H={}", best->every))
                    : std::string("synchronous aggregation costs little here: keep it")));
  }
  out.push_back(fmt::format("memory: peak {:.2f} GB on the largest rank (with the communication library's) against "
                            "{:.2f} GB: {}",
                            double(p.peak_memory) / 1e9, p.memory_available / 1e9, p.fits ? "fits" : "does not fit"));
  return out;
}

json prediction_to_json(const Prediction& p) {
  json j;
  j["ranks"] = p.world;
  j["layout"] = {{"data", p.sizes.data},           {"tensor", p.sizes.tensor},  {"pipeline", p.sizes.pipeline},
                 {"expert", p.sizes.expert},       {"schedule", p.schedule},    {"zero_stage", p.zero_stage},
                 {"recompute", p.recompute},       {"micro_batch", p.micro_batch}, {"grad_accum", p.grad_accum}};
  j["global_batch"] = p.global_batch;
  j["seq_len"] = p.seq_len;
  j["step_seconds"] = p.step_seconds;
  j["tokens_per_second"] = p.tokens_per_second;
  j["mfu"] = p.mfu;
  j["model_flops_per_step"] = p.model_flops_per_step;
  j["hardware_flops_per_step"] = p.hardware_flops_per_step;
  j["bubble_fraction"] = p.bubble_fraction;
  j["peak_memory_bytes"] = p.peak_memory;
  j["memory_available_bytes"] = p.memory_available;
  j["fits"] = p.fits;
  j["profile"] = p.profile;
  j["profile_calibrated"] = p.profile_calibrated;
  auto price = [](const GradientSyncPrice& g) {
    return json{{"mode", g.mode}, {"every", g.every}, {"step_seconds", g.step_seconds}, {"outer_seconds", g.outer_seconds},
                {"exposed_seconds", g.exposed_seconds}};
  };
  j["gradient_sync"] = price(p.gradient_sync);
  j["gradient_sync"]["replicas"] = p.replicas;
  j["gradient_sync"]["data_per_replica"] = p.data_per_replica;
  if (!p.sync_alternatives.empty()) {
    j["gradient_sync"]["data_exposed_seconds"] = p.data_exposed_seconds;
    json alts = json::array();
    for (const GradientSyncPrice& g : p.sync_alternatives) alts.push_back(price(g));
    j["gradient_sync"]["alternatives"] = alts;
  }
  json stages = json::array();
  for (const StagePrediction& s : p.stages) {
    stages.push_back({{"pipeline", s.pipeline},
                      {"compute_seconds", s.compute},
                      {"compute_by_class", s.by_class},
                      {"finish_seconds", s.finish},
                      {"tail_seconds", s.tail},
                      {"exposed_comm_seconds", s.exposed_comm},
                      {"comm_seconds", s.comm_total},
                      {"comm_exposed_seconds", s.comm_exposed},
                      {"flops", s.flops}});
  }
  j["stages"] = stages;
  return j;
}

}  // namespace dstrain
