#include "train/metrics.h"

#include <omp.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <thread>

#include "backend/cpu/gemm16.h"
#include "backend/cpu/sgemm.h"
#include "core/buffer.h"
#include "core/log.h"
#include "train/http_endpoint.h"
#include "train/tensorboard.h"

namespace dstrain {

MetricsConfig MetricsConfig::from_json(const JsonReader& r) {
  MetricsConfig c;
  c.progress = r.get<std::string>("progress", c.progress);
  c.prometheus_port = r.get<int64_t>("prometheus_port", c.prometheus_port);
  c.prometheus_bind = r.get<std::string>("prometheus_bind", c.prometheus_bind);
  if (r.has("prometheus_host")) {
    r.error("prometheus_host", "was renamed metrics.prometheus_bind (default 127.0.0.1: this host only; 0.0.0.0 "
                               "serves every interface, without authentication)");
  }
  // null (what the resolved configuration shows when measured) or absent: measured at start.
  if (r.has("peak_tflops") && !r.is_null("peak_tflops")) {
    c.peak_tflops = r.get<double>("peak_tflops");
    if (!(c.peak_tflops > 0) || !std::isfinite(c.peak_tflops)) {
      r.error("peak_tflops", fmt::format("must be a positive number of TFLOP/s per rank, got {} (leave the key out "
                                         "to measure the peak at start)",
                                         c.peak_tflops));
    }
  } else if (r.has("peak_tflops")) {
    r.raw("peak_tflops");
  }
  c.memory_budget_gb = r.get<double>("memory_budget_gb", c.memory_budget_gb);
  c.expert_imbalance = r.get<double>("expert_imbalance", c.expert_imbalance);
  c.timeline_steps = TimelineSteps::from_json(r, "timeline_steps");
  c.tensorboard_dir = r.get<std::string>("tensorboard_dir", c.tensorboard_dir);
  if (c.progress != "auto" && c.progress != "bar" && c.progress != "lines") {
    r.error("progress", "must be \"auto\", \"bar\" or \"lines\"");
  }
  if (c.prometheus_port < 0 || c.prometheus_port > 65535) r.error("prometheus_port", "must be 0 (off) or a TCP port");
  if (c.memory_budget_gb < 0) r.error("memory_budget_gb", "must be >= 0 (0: the node's memory over its ranks)");
  if (!(c.expert_imbalance >= 1) || !std::isfinite(c.expert_imbalance)) {
    r.error("expert_imbalance", fmt::format("must be a ratio >= 1 (the most rows an expert rank receives over the "
                                            "mean; 1: balanced), got {}",
                                            c.expert_imbalance));
  }
  r.done();
  return c;
}

json MetricsConfig::to_json() const {
  return {{"progress", progress},       {"prometheus_port", prometheus_port}, {"prometheus_bind", prometheus_bind},
          {"peak_tflops", peak_tflops > 0 ? json(peak_tflops) : json(nullptr)}, {"memory_budget_gb", memory_budget_gb},
          {"expert_imbalance", expert_imbalance}, {"timeline_steps", timeline_steps.to_json()},
          {"tensorboard_dir", tensorboard_dir}};
}

Utilisation utilisation(double global_tokens_per_s, double flops_per_token, int world_size, double peak_flops) {
  Utilisation u;
  u.model_flops_per_s = global_tokens_per_s * flops_per_token / double(std::max(world_size, 1));
  u.mfu = peak_flops > 0 ? u.model_flops_per_s / peak_flops : 0;
  return u;
}

Peak measure_peak_flops(int trials, double trial_seconds, DType compute) {
  // The GEMM the layers use, large enough that it runs its steady-state kernel on every thread:
  // the fp32 sgemm (backend/cpu/sgemm.h), or with bf16 compute on hardware bf16 the bf16 product
  // (backend/cpu/gemm16.h), whose peak is about twice as high.
  constexpr int n = 1024;
  const bool bf16 = compute == DType::BF16 && cpu::gemm16_bf16_hardware();
  const size_t nn = static_cast<size_t>(n) * n;
  std::vector<float> a(bf16 ? 0 : nn, 0.5f), b(a.size(), 0.25f), c(nn);
  std::vector<uint16_t> ah(bf16 ? nn : 0, f32_to_bf16(0.5f)), bh(ah.size(), f32_to_bf16(0.25f));
  auto gemm = [&] {
    if (bf16) {
      cpu::gemm_mixed(false, true, n, n, n, {ah.data(), DType::BF16}, {bh.data(), DType::BF16}, false, c.data(),
                      DType::F32);
    } else {
      cpu::sgemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
    }
  };
  // Where one sgemm is slow (generic kernels, oversubscribed cores) fewer trials keep the start
  // short: at least 3, and no new one after half a second.
  constexpr int kMinTrials = 3;
  constexpr double kBudgetSeconds = 0.5;
  const auto start = std::chrono::steady_clock::now();
  gemm();  // warms up the threads and the caches
  double best = 0;
  int done = 0;
  for (; done < trials; ++done) {
    if (done >= kMinTrials &&
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > kBudgetSeconds) {
      break;
    }
    const auto t0 = std::chrono::steady_clock::now();
    int64_t reps = 0;
    double s = 0;
    do {
      gemm();
      ++reps;
      s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } while (s < trial_seconds);
    best = std::max(best, 2.0 * n * double(n) * n * double(reps) / s);
  }
  if (bf16) {
    return {best, fmt::format("measured: best of {} trials of a bf16 GEMM {}x{}x{} on {} threads (oneDNN bf16 matmul, "
                              "dstrain's thread split)",
                              done, n, n, n, omp_get_max_threads())};
  }
  return {best, fmt::format("measured: best of {} trials of sgemm {}x{}x{} on {} threads ({})", done, n, n, n,
                            omp_get_max_threads(), cpu::sgemm_path_name())};
}

double node_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (in >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024.0;
    in.ignore(256, '\n');
  }
  return 0;
}

double current_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  double kb = 0;
  while (in >> key) {
    if (key == "VmRSS:" && in >> kb) return kb * 1024.0;
    in.ignore(4096, '\n');
  }
  return 0;
}

namespace {

double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) * 1024.0;
}

std::string hms(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  return fmt::format("{:02d}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct RankSpread {
  double max = 0, min = 0, mean = 0;
  int slowest = 0;
  double spread() const { return mean > 0 ? (max - min) / mean : 0; }
};
RankSpread spread_of(const std::vector<double>& v) {
  RankSpread s;
  if (v.empty()) return s;
  s.max = s.min = v[0];
  for (size_t r = 0; r < v.size(); ++r) {
    s.mean += v[r];
    if (v[r] > s.max) {
      s.max = v[r];
      s.slowest = int(r);
    }
    s.min = std::min(s.min, v[r]);
  }
  s.mean /= double(v.size());
  return s;
}

}  // namespace

struct Metrics::Impl {
  std::ofstream jsonl;
  mutable std::mutex mutex;  // the endpoint thread reads what the training thread writes
  StepMetrics last;
  bool have_step = false;
  double last_eval = -1, last_eval_accuracy = -1;
  json last_extra = json::object();
  int64_t outer_steps_total = 0;  // gradient sync: fragments synchronised so far
  double last_drift = -1;         // and the drift before the last outer step
  // Per-step shares of the run, for the summary.
  std::vector<double> mfu, data, comm, compute, optimizer, checkpoint, imbalance, tokens_per_s, memory;
  // MoE runs: the busiest expert over the mean (worst layer), dead experts (all layers), and
  // the share of the step in routing and permutation.
  std::vector<double> moe_load, moe_dead, moe_share;
  std::vector<double> tp_share;  // tensor-group collectives over the step
  std::vector<double> gpu_util;  // NVML's utilisation of rank 0's GPU, 0..1
  // Expert parallelism: the busiest rank's received rows over the mean, and the all-to-alls'
  // share of the step.
  std::vector<double> ep_load, ep_share;
  int64_t checkpoints = 0;
  int64_t last_warn_step[4] = {-1000000, -1000000, -1000000, -1000000};
  double peak_flops = 0;  // what the endpoint thread shows
  std::string peak_source;
  std::unique_ptr<HttpEndpoint> server;
  // metrics.tensorboard_dir: this run's events file; flushed at each print interval, after a
  // checkpoint's step, at an evaluation and at the end.
  std::unique_ptr<TensorBoardWriter> tensorboard;
  bool tensorboard_started = false, tensorboard_flush_next = false;
};

Metrics::Metrics(const MetricsConfig& config, const ModelConfig& model, int64_t seq_len, int rank, int world_size,
                 int local_size, const std::string& output_dir, int64_t steps_per_print, PeakMeasure measure)
    : config_(config),
      rank_(rank),
      world_(world_size),
      steps_per_print_(steps_per_print),
      measure_(measure ? std::move(measure) : PeakMeasure([] { return measure_peak_flops(); })),
      impl_(std::make_unique<Impl>()) {
  flops_per_token_ = model.train_flops_per_token(seq_len);
  if (config_.peak_tflops > 0) {
    peak_flops_ = config_.peak_tflops * 1e12;
    peak_source_ = "from config metrics.peak_tflops";
  } else {
    const Peak p = measure_();
    peak_flops_ = p.flops;
    peak_source_ = p.source;
  }
  impl_->peak_flops = peak_flops_;
  impl_->peak_source = peak_source_;
  budget_bytes_ = config_.memory_budget_gb > 0 ? config_.memory_budget_gb * 1e9
                                               : node_memory_bytes() / double(std::max(local_size, 1));
  bar_ = config_.progress == "bar" || (config_.progress == "auto" && isatty(STDOUT_FILENO));
  if (rank_ != 0) return;
  jsonl_path_ = output_dir + "/metrics.jsonl";
  impl_->jsonl.open(jsonl_path_, std::ios::app);
  DS_CHECK(impl_->jsonl.good(), "cannot write {}: check output.dir", jsonl_path_);
  log::info("metrics: {} model FLOP per token, peak {:.1f} GFLOP/s per rank ({}), memory budget {:.1f} GB per rank, "
            "{}",
            flops_per_token_, peak_flops_ / 1e9, peak_source_,
            budget_bytes_ / 1e9, jsonl_path_);
  if (!config_.tensorboard_dir.empty()) {
    impl_->tensorboard = std::make_unique<TensorBoardWriter>(config_.tensorboard_dir);
    log::info("metrics: TensorBoard events in {} (tensorboard --logdir {})", impl_->tensorboard->path(),
              config_.tensorboard_dir);
  }
  if (config_.prometheus_port > 0) {
    try {
      impl_->server = std::make_unique<HttpEndpoint>(config_.prometheus_bind, int(config_.prometheus_port), "/metrics",
                                                     "text/plain; version=0.0.4; charset=utf-8",
                                                     [this] { return prometheus_text(); });
    } catch (const Error& e) {
      throw Error(fmt::format("metrics.prometheus_port: {}; choose another port (or metrics.prometheus_bind), or set "
                              "the port to 0 to turn the endpoint off",
                              e.what()));
    }
    const bool loopback = config_.prometheus_bind == "127.0.0.1" || config_.prometheus_bind == "::1" ||
                          config_.prometheus_bind == "localhost";
    log::info("metrics: Prometheus endpoint on http://{}:{}/metrics ({})", config_.prometheus_bind,
              config_.prometheus_port,
              loopback ? "this host only; metrics.prometheus_bind = \"0.0.0.0\" serves other hosts"
                       : "every host that reaches this address, without authentication");
  }
}

Metrics::~Metrics() = default;

void Metrics::write(const json& record) {
  if (!impl_->jsonl.is_open()) return;
  impl_->jsonl << record.dump() << "\n";
  impl_->jsonl.flush();
}

json Metrics::step_record(const StepMetrics& m) const {
  const Utilisation u = utilisation(m.tokens_per_s, flops_per_token_, world_, peak_flops_);
  const RankSpread s = spread_of(m.rank_step_s);
  const MemoryStats mem = memory_stats();
  json memory = json::object();
  for (int c = 0; c < int(MemCategory::kCount); ++c) memory[std::string(mem_category_name(MemCategory(c)))] = mem.bytes[size_t(c)];
  json r = {{"type", "train"},
            {"step", m.step},
            {"loss", m.loss},
            {"lr", m.lr},
            {"grad_norm", m.grad_norm},
            {"tokens_per_s", m.tokens_per_s},
            {"model_flops_per_s", u.model_flops_per_s},
            {"mfu", u.mfu},
            {"mfu_above_peak", u.mfu > 1},
            {"peak_flops", peak_flops_},
            {"tokens", m.tokens},
            {"elapsed_s", m.elapsed_s},
            {"step_time_s", m.time.total},
            {"time_s",
             {{"data_wait", m.time.data_wait},
              {"forward", m.time.forward},
              {"backward", m.time.backward},
              {"exposed_comm", m.time.exposed_comm},
              {"optimizer", m.time.optimizer},
              {"checkpoint", m.time.checkpoint},
              {"other", m.time.other()}}},
            {"data_wait_s", m.time.data_wait},
            {"comm_time_s", m.comm_s},
            {"exposed_comm_time_s", m.time.exposed_comm},
            {"rank_step_time_s", m.rank_step_s},
            {"rank_compute_time_s", m.rank_compute_s},
            {"step_time_max_s", s.max},
            {"step_time_min_s", s.min},
            {"step_time_mean_s", s.mean},
            {"slowest_rank", s.slowest},
            {"memory_bytes", memory},
            {"peak_rss_bytes", *std::max_element(m.rank_peak_rss_bytes.begin(), m.rank_peak_rss_bytes.end())},
            {"skipped", m.skipped},
            {"skipped_total", m.skipped_total}};
  if (m.loss_scaling) {
    r["loss_scale"] = m.loss_scale;
    r["overflow"] = m.overflow;
    r["overflow_skipped_total"] = m.overflow_skipped_total;
  }
  for (const auto& [k, v] : m.extra.items()) r[k] = v;
  return r;
}

void Metrics::on_run_start(const json& environment) {
  if (rank_ != 0) return;
  write({{"type", "environment"}, {"environment", environment}, {"peak_flops", peak_flops_},
         {"peak_source", peak_source_}});
}

void Metrics::check_peak(const StepMetrics& m) {
  // No rank does more than its peak: a step above it means the peak was measured low (another
  // process on the cores at start). A measured peak is measured again, a few times at most and
  // once per print interval (each stalls rank 0 for a fraction of a second), and the higher
  // one kept.
  constexpr int kMaxRemeasures = 3;
  const Utilisation u = utilisation(m.tokens_per_s, flops_per_token_, world_, peak_flops_);
  if (u.mfu <= 1 || config_.peak_tflops > 0 || remeasured_ >= kMaxRemeasures) return;
  if (remeasured_ > 0 && m.step - last_remeasure_step_ < steps_per_print_) return;
  ++remeasured_;
  last_remeasure_step_ = m.step;
  const Peak p = measure_();
  const double before = peak_flops_;
  if (p.flops > peak_flops_) {
    peak_flops_ = p.flops;
    const std::string how = p.source.rfind("measured: ", 0) == 0 ? p.source.substr(10) : p.source;
    peak_source_ = fmt::format("re-measured at step {}: {}", m.step, how);
  }
  log::info("metrics: step {} ran {:.1f} GFLOP/s per rank, above the peak of {:.1f} GFLOP/s measured before; the peak "
            "is now {:.1f} GFLOP/s ({})",
            m.step, u.model_flops_per_s / 1e9, before / 1e9, peak_flops_ / 1e9, peak_source_);
  write({{"type", "peak"}, {"step", m.step}, {"peak_flops", peak_flops_}, {"peak_source", peak_source_},
         {"model_flops_per_s", u.model_flops_per_s}});
}

void Metrics::on_step(const StepMetrics& m) {
  if (rank_ != 0) return;
  check_peak(m);
  const json record = step_record(m);
  write(record);
  if (impl_->tensorboard) {
    // The run's first step opens a session: TensorBoard drops what an earlier attempt wrote
    // from this step on (its steps after the checkpoint this run resumed from).
    if (!impl_->tensorboard_started) impl_->tensorboard->session_start(m.step);
    impl_->tensorboard_started = true;
    impl_->tensorboard->write(m.step, tensorboard_step_scalars(record), tensorboard_step_histograms(record));
    if (impl_->tensorboard_flush_next || m.step % steps_per_print_ == 0 || m.step == m.max_steps) {
      impl_->tensorboard->flush();
      impl_->tensorboard_flush_next = false;
    }
  }
  add_step(m, record);
  warn_if_abnormal(m);
  print_progress(m);
}

void Metrics::add_step(const StepMetrics& m, const json& record) {
  std::lock_guard lock(impl_->mutex);
  impl_->last = m;
  impl_->have_step = true;
  impl_->last_extra = m.extra;
  if (m.extra.contains("gradient_sync")) {
    const json& g = m.extra["gradient_sync"];
    impl_->outer_steps_total += g.value("outer_steps", int64_t(0));
    if (g.contains("drift")) impl_->last_drift = g.value("drift", 0.0);
  }
  const double t = std::max(m.time.total, 1e-12);
  impl_->mfu.push_back(record["mfu"]);
  impl_->peak_flops = peak_flops_;
  impl_->peak_source = peak_source_;
  impl_->data.push_back(m.time.data_wait / t);
  impl_->comm.push_back(m.time.exposed_comm / t);
  impl_->compute.push_back((m.time.forward + m.time.backward) / t);
  impl_->optimizer.push_back(m.time.optimizer / t);
  impl_->checkpoint.push_back(m.time.checkpoint / t);
  impl_->imbalance.push_back(spread_of(m.rank_step_s).spread());
  impl_->tokens_per_s.push_back(m.tokens_per_s);
  impl_->memory.push_back(double(record["peak_rss_bytes"]) / std::max(budget_bytes_, 1.0));
  if (m.extra.contains("moe")) {
    double load = 0, dead = 0;
    for (const auto& [layer, v] : m.extra["moe"].items()) {
      load = std::max(load, v.value("max_over_mean_load", 0.0));
      dead += v.value("dead_experts", 0.0);
    }
    impl_->moe_load.push_back(load);
    impl_->moe_dead.push_back(dead);
    impl_->moe_share.push_back((m.extra.value("moe_route_s", 0.0) + m.extra.value("moe_permute_s", 0.0)) / t);
  }
  if (m.extra.contains("expert_parallel")) {
    const json& ep = m.extra["expert_parallel"];
    impl_->ep_load.push_back(ep.value("received_max_over_mean", 0.0));
    impl_->ep_share.push_back(ep.value("a2a_s", 0.0) / t);
  }
  if (m.extra.contains("tensor_parallel")) impl_->tp_share.push_back(m.extra["tensor_parallel"].value("comm_s", 0.0) / t);
  if (m.extra.contains("gpu") && m.extra["gpu"].contains("utilization_percent")) {
    impl_->gpu_util.push_back(m.extra["gpu"].value("utilization_percent", 0.0) / 100.0);
  }
}

void Metrics::warn_if_abnormal(const StepMetrics& m) {
  // Each kind of warning at most once per steps_per_print steps.
  auto once = [&](int kind) {
    if (m.step - impl_->last_warn_step[kind] < steps_per_print_) return false;
    impl_->last_warn_step[kind] = m.step;
    return true;
  };
  const RankSpread s = spread_of(m.rank_step_s);
  if (world_ > 1 && s.spread() > 0.10 && once(0)) {
    log::warn("step {}: load imbalance: step times over ranks spread {:.0f}% (max {:.3f} s, min {:.3f} s, mean {:.3f} "
              "s); rank {} is the slowest",
              m.step, 100 * s.spread(), s.max, s.min, s.mean, s.slowest);
  }
  const double comm = m.time.total > 0 ? m.time.exposed_comm / m.time.total : 0;
  if (comm > 0.15 && once(1)) {
    log::warn("step {}: exposed communication is {:.0f}% of the step (above 15%): enable overlap_comm, use larger "
              "buckets or micro-batches, or check the interconnect",
              m.step, 100 * comm);
  }
  const double rss = *std::max_element(m.rank_peak_rss_bytes.begin(), m.rank_peak_rss_bytes.end());
  if (rss > 0.9 * budget_bytes_ && once(2)) {
    log::warn("step {}: memory at {:.0f}% of the budget ({:.1f} of {:.1f} GB peak resident per rank)", m.step,
              100 * rss / budget_bytes_, rss / 1e9, budget_bytes_ / 1e9);
  }
  const Utilisation u = utilisation(m.tokens_per_s, flops_per_token_, world_, peak_flops_);
  if (u.mfu > 1 && once(3)) {
    const std::string message = fmt::format(
        "step {}: MFU reads {:.0f}%, above 100%: the peak of {:.1f} GFLOP/s per rank ({}) is too low and MFU means "
        "nothing until it is right; {}",
        m.step, 100 * u.mfu, peak_flops_ / 1e9, peak_source_,
        config_.peak_tflops > 0 ? "correct metrics.peak_tflops"
                                : "set metrics.peak_tflops to this CPU's peak, or start the run when no other process "
                                  "is busy on its cores");
    log::warn("{}", message);
    write({{"type", "warning"}, {"step", m.step}, {"what", "mfu_above_peak"}, {"message", message}});
  }
}

void Metrics::print_progress(const StepMetrics& m) {
  const double eta = m.elapsed_s / double(std::max<int64_t>(m.steps_this_run, 1)) * double(m.max_steps - m.step);
  const Utilisation u = utilisation(m.tokens_per_s, flops_per_token_, world_, peak_flops_);
  const std::string line =
      fmt::format("step {:>6}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {:.0f} tok/s | MFU {:.1f}%{} | "
                  "elapsed {} | eta {}{}",
                  m.step, m.max_steps, m.loss, m.lr, m.grad_norm, m.tokens_per_s, 100 * u.mfu,
                  u.mfu > 1 ? " (above 100%: peak too low)" : "", hms(m.elapsed_s), hms(eta),
                  m.skipped ? " | skipped" : m.overflow ? fmt::format(" | fp16 overflow, skipped (scale {})", m.loss_scale) : "");
  const bool milestone = m.steps_this_run == 1 || m.step % steps_per_print_ == 0 || m.step == m.max_steps;
  if (bar_) {
    // A live bar on a terminal: redrawn every step, kept as a line at each print interval.
    const int width = 24, filled = int(double(width) * double(m.step) / double(std::max<int64_t>(m.max_steps, 1)));
    std::printf("\r[%s%s] %s\033[K", std::string(size_t(filled), '#').c_str(),
                std::string(size_t(width - filled), '.').c_str(), line.c_str());
    if (milestone) std::printf("\n");
    std::fflush(stdout);
  } else if (milestone) {
    log::info("{}", line);
  }
}

void Metrics::on_eval(int64_t step, double loss, double accuracy, int64_t tokens, const json& per_dataset) {
  if (rank_ != 0) return;
  write({{"type", "eval"}, {"step", step}, {"loss", loss}, {"accuracy", accuracy}, {"tokens", tokens},
         {"datasets", per_dataset}});
  if (impl_->tensorboard) {
    impl_->tensorboard->write(step, tensorboard_eval_scalars(loss, accuracy, per_dataset));
    impl_->tensorboard->flush();
  }
  std::lock_guard lock(impl_->mutex);
  impl_->last_eval = loss;
  impl_->last_eval_accuracy = accuracy;
}

void Metrics::on_checkpoint(int64_t step, double stall_s, bool async) {
  if (rank_ != 0) return;
  write({{"type", "checkpoint"}, {"step", step}, {"stall_s", stall_s}, {"async", async}});
  if (impl_->tensorboard) impl_->tensorboard_flush_next = true;  // the checkpoint's step comes next
  std::lock_guard lock(impl_->mutex);
  ++impl_->checkpoints;
}

std::string Metrics::prometheus_text() const {
  std::lock_guard lock(impl_->mutex);
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help, const std::vector<std::pair<std::string, double>>& samples) {
    out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
    for (const auto& [labels, v] : samples) out += fmt::format("{}{} {}\n", name, labels, v);
  };
  const MemoryStats mem = memory_stats();
  std::vector<std::pair<std::string, double>> memory;
  for (int c = 0; c < int(MemCategory::kCount); ++c) {
    memory.push_back({fmt::format("{{category=\"{}\"}}", mem_category_name(MemCategory(c))), double(mem.bytes[size_t(c)])});
  }
  metric("dstrain_memory_bytes", "gauge", "Bytes held by rank 0 per category.", memory);
  metric("dstrain_peak_rss_bytes", "gauge", "Peak resident memory of rank 0's process in bytes.", {{"", peak_rss_bytes()}});
  metric("dstrain_peak_flops", "gauge", "Peak FLOP/s per rank that MFU is measured against.",
         {{"", impl_->peak_flops}});
  metric("dstrain_world_size", "gauge", "Ranks in the job.", {{"", double(world_)}});
  if (!impl_->have_step) return out;
  const StepMetrics& m = impl_->last;
  const Utilisation u = utilisation(m.tokens_per_s, flops_per_token_, world_, impl_->peak_flops);
  const RankSpread s = spread_of(m.rank_step_s);
  metric("dstrain_step", "counter", "Optimizer steps taken.", {{"", double(m.step)}});
  metric("dstrain_tokens_total", "counter", "Training tokens consumed.", {{"", double(m.tokens)}});
  metric("dstrain_skipped_steps_total", "counter", "Steps skipped (non-finite or spiking loss).",
         {{"", double(m.skipped_total)}});
  if (m.loss_scaling) {
    metric("dstrain_loss_scale", "gauge", "fp16 loss scale of the last step.", {{"", m.loss_scale}});
    metric("dstrain_overflow_skipped_steps_total", "counter",
           "Steps skipped because fp16 gradients overflowed (not in dstrain_skipped_steps_total).",
           {{"", double(m.overflow_skipped_total)}});
  }
  metric("dstrain_loss", "gauge", "Training loss of the last step.", {{"", m.loss}});
  metric("dstrain_learning_rate", "gauge", "Learning rate of the last step.", {{"", m.lr}});
  metric("dstrain_grad_norm", "gauge", "Global gradient norm before clipping.", {{"", m.grad_norm}});
  metric("dstrain_tokens_per_second", "gauge", "Training throughput over all ranks.", {{"", m.tokens_per_s}});
  metric("dstrain_model_flops_per_second", "gauge", "Model FLOP/s per rank.", {{"", u.model_flops_per_s}});
  metric("dstrain_mfu_ratio", "gauge", "Model FLOP utilisation: model FLOP/s over the peak.", {{"", u.mfu}});
  metric("dstrain_mfu_above_peak", "gauge",
         "1 when the last MFU read above 100%: the peak is too low and MFU means nothing until it is right.",
         {{"", u.mfu > 1 ? 1.0 : 0.0}});
  metric("dstrain_step_duration_seconds", "gauge", "Time of the last step by phase.",
         {{"{phase=\"total\"}", m.time.total},
          {"{phase=\"data_wait\"}", m.time.data_wait},
          {"{phase=\"forward\"}", m.time.forward},
          {"{phase=\"backward\"}", m.time.backward},
          {"{phase=\"exposed_comm\"}", m.time.exposed_comm},
          {"{phase=\"optimizer\"}", m.time.optimizer},
          {"{phase=\"checkpoint\"}", m.time.checkpoint},
          {"{phase=\"other\"}", m.time.other()}});
  metric("dstrain_rank_step_duration_seconds", "gauge", "Step time over ranks.",
         {{"{stat=\"max\"}", s.max}, {"{stat=\"min\"}", s.min}, {"{stat=\"mean\"}", s.mean}});
  metric("dstrain_slowest_rank", "gauge", "The rank with the longest last step.", {{"", double(s.slowest)}});
  if (impl_->last_eval >= 0) metric("dstrain_eval_loss", "gauge", "Last evaluation loss.", {{"", impl_->last_eval}});
  if (impl_->last_eval_accuracy >= 0) {
    metric("dstrain_eval_accuracy_ratio", "gauge", "Last evaluation's token accuracy (targets ranked first).",
           {{"", impl_->last_eval_accuracy}});
  }
  if (impl_->last_extra.contains("gpu")) {
    const json& g = impl_->last_extra["gpu"];
    if (g.contains("utilization_percent")) {
      metric("dstrain_gpu_utilization_ratio", "gauge", "NVML's utilisation of rank 0's GPU at the last step (0..1).",
             {{"", g.value("utilization_percent", 0.0) / 100.0}});
      metric("dstrain_gpu_memory_used_bytes", "gauge", "Memory used on rank 0's GPU, every process's (NVML).",
             {{"", g.value("memory_used_bytes", 0.0)}});
    }
    metric("dstrain_gpu_dstrain_memory_bytes", "gauge", "Bytes dstrain's buffers hold on rank 0's GPU.",
           {{"", g.value("dstrain_peak_bytes", 0.0)}});
  }
  if (impl_->last_extra.contains("tensor_parallel")) {
    const json& tp = impl_->last_extra["tensor_parallel"];
    metric("dstrain_tensor_parallel_comm_seconds", "gauge",
           "Rank 0's time in the tensor group's collectives in the last step (on the critical path).",
           {{"", tp.value("comm_s", 0.0)}});
    metric("dstrain_tensor_parallel_comm_bytes", "gauge", "Payload bytes of rank 0's tensor-group collectives in the last step.",
           {{"", tp.value("comm_bytes", 0.0)}});
  }
  if (impl_->last_extra.contains("data_parallel")) {
    metric("dstrain_data_parallel_comm_bytes", "gauge",
           "Payload bytes of rank 0's data-parallel collectives (gradient reductions) in the last step.",
           {{"", impl_->last_extra["data_parallel"].value("comm_bytes", 0.0)}});
  }
  if (impl_->last_extra.contains("gradient_sync")) {
    const json& g = impl_->last_extra["gradient_sync"];
    metric("dstrain_gradient_sync_bytes", "gauge",
           "Payload bytes of rank 0's collectives in the last step: inside its replica, and between replicas.",
           {{"{link=\"inner\"}", g.value("inner_bytes", 0.0)}, {"{link=\"outer\"}", g.value("outer_bytes", 0.0)}});
    metric("dstrain_gradient_sync_wait_seconds", "gauge",
           "Rank 0's time waiting for the collectives between replicas in the last step.",
           {{"", g.value("outer_wait_s", 0.0)}});
    metric("dstrain_gradient_sync_outer_steps_total", "counter", "Outer steps (fragments synchronised) so far.",
           {{"", double(impl_->outer_steps_total)}});
    if (impl_->last_drift >= 0) {
      metric("dstrain_gradient_sync_drift", "gauge",
             "Replicas' root-mean-square distance from their mean before the last outer step.", {{"", impl_->last_drift}});
    }
  }
  if (impl_->last_extra.contains("pipeline")) {
    const json& pp = impl_->last_extra["pipeline"];
    metric("dstrain_pipeline_recv_wait_seconds", "gauge",
           "Rank 0's time waiting for activations and gradients from other pipeline stages in the last step.",
           {{"", pp.value("recv_wait_s", 0.0)}});
    metric("dstrain_pipeline_comm_bytes", "gauge",
           "Bytes rank 0 sent and received between pipeline stages in the last step.", {{"", pp.value("comm_bytes", 0.0)}});
  }
  if (impl_->last_extra.contains("expert_parallel")) {
    const json& ep = impl_->last_extra["expert_parallel"];
    metric("dstrain_expert_parallel_received_max_over_mean", "gauge",
           "Rows the busiest expert-parallel rank's experts computed in the last step over the mean of all ranks.",
           {{"", ep.value("received_max_over_mean", 0.0)}});
    metric("dstrain_expert_parallel_a2a_bytes", "gauge", "Bytes rank 0 sent in the MoE all-to-alls of the last step.",
           {{"", ep.value("a2a_bytes", 0.0)}});
    metric("dstrain_expert_parallel_a2a_seconds", "gauge",
           "Rank 0's time in the MoE all-to-alls (dispatch and combine) of the last step.", {{"", ep.value("a2a_s", 0.0)}});
    metric("dstrain_expert_parallel_duration_seconds", "gauge",
           "Rank 0's time in the MoE layers' dispatch, expert GEMMs and combine in the last step.",
           {{"{part=\"dispatch\"}", ep.value("dispatch_s", 0.0)},
            {"{part=\"compute\"}", ep.value("expert_s", 0.0)},
            {"{part=\"combine\"}", ep.value("combine_s", 0.0)}});
  }
  if (impl_->last_extra.contains("moe")) {
    std::vector<std::pair<std::string, double>> load, dead, aux, dropped;
    for (const auto& [layer, v] : impl_->last_extra["moe"].items()) {
      const std::string l = fmt::format("{{layer=\"{}\"}}", layer);
      load.push_back({l, v.value("max_over_mean_load", 0.0)});
      dead.push_back({l, v.value("dead_experts", 0.0)});
      aux.push_back({l, v.value("aux_loss", 0.0)});
      if (v.contains("dropped_rows")) dropped.push_back({l, v.value("dropped_rows", 0.0)});
    }
    if (!dropped.empty()) {
      metric("dstrain_moe_dropped_rows", "gauge",
             "(Token, expert) pairs dropped by moe.capacity_factor in the last step, per MoE layer.", dropped);
    }
    metric("dstrain_moe_load_max_over_mean", "gauge", "Tokens of the busiest expert over the mean, per MoE layer.", load);
    metric("dstrain_moe_dead_experts", "gauge", "Experts that received no token in the last step, per MoE layer.", dead);
    metric("dstrain_moe_aux_loss", "gauge", "Auxiliary balance loss of the last step, per MoE layer.", aux);
    metric("dstrain_moe_duration_seconds", "gauge", "Time of the last step in MoE routing and token permutation.",
           {{"{part=\"routing\"}", impl_->last_extra.value("moe_route_s", 0.0)},
            {"{part=\"permutation\"}", impl_->last_extra.value("moe_permute_s", 0.0)}});
  }
  return out;
}

std::string Metrics::summary_table() const {
  std::lock_guard lock(impl_->mutex);
  struct Row {
    std::string metric, value, normal;
    bool ok;
    std::string verdict = {};  // instead of "ok"/"CHECK"
  };
  const double mfu = median(impl_->mfu), data = median(impl_->data), comm = median(impl_->comm);
  const double compute = median(impl_->compute), opt = median(impl_->optimizer), ckpt = median(impl_->checkpoint);
  const double imb = median(impl_->imbalance), mem = impl_->memory.empty() ? 0 : *std::max_element(impl_->memory.begin(), impl_->memory.end());
  auto pct = [](double x) { return fmt::format("{:.1f}%", 100 * x); };
  // No step runs above the peak: an MFU over 100% says the peak is wrong, never that the run is fine.
  auto mfu_row = [&] {
    const int64_t above = std::count_if(impl_->mfu.begin(), impl_->mfu.end(), [](double x) { return x > 1; });
    Row r{"MFU (model FLOP/s over the peak)", pct(mfu), "> 30% (GEMM-bound CPU runs reach 50-80%)", mfu > 0.30};
    if (above > 0) {
      r.ok = false;
      r.verdict = fmt::format("CHECK: {} step(s) above 100%, the peak is too low", above);
    }
    return r;
  };
  // Steps skipped as faults (non-finite, spikes) and, in fp16, for overflows: a few of those while
  // the loss scale settles are normal; a run that still overflows at its end, or often, is not.
  auto skipped_row = [&] {
    const StepMetrics& m = impl_->last;
    const int64_t faults = impl_->have_step ? m.skipped_total : 0;
    const int64_t overflows = impl_->have_step && m.loss_scaling ? m.overflow_skipped_total : 0;
    const int64_t steps = int64_t(impl_->tokens_per_s.size());
    if (overflows == 0) return Row{"skipped steps", fmt::format("{}", faults), "0", faults == 0};
    return Row{"skipped steps (+ fp16 overflows)", fmt::format("{} + {}", faults, overflows),
               "0 (+ a few overflows at the start)",
               faults == 0 && !m.overflow && overflows <= std::max<int64_t>(32, steps / 10)};
  };
  std::vector<Row> rows = {
      {"throughput (median)", fmt::format("{:.0f} tok/s", median(impl_->tokens_per_s)), "-", true},
      mfu_row(),
      {"compute share (forward + backward)", pct(compute), "> 80% of a step", compute > 0.80},
      {"data wait", pct(data), "< 5% of a step", data < 0.05},
      {"exposed communication", pct(comm), "< 15% of a step", comm < 0.15},
      {"optimizer", pct(opt), "< 10% of a step", opt < 0.10},
      {"checkpoint stall", pct(ckpt), "< 5% of a step", ckpt < 0.05},
      {"load imbalance (step time spread over ranks)", pct(imb), "< 10%", imb < 0.10},
      {"peak memory / budget", pct(mem), "< 90%", mem < 0.90},
      skipped_row(),
      impl_->gpu_util.empty() ? Row{"GPU utilisation", "n/a (CPU run or no NVML)", "> 90%", true}
                              : Row{"GPU utilisation (rank 0, NVML)", pct(median(impl_->gpu_util)), "> 90%",
                                    median(impl_->gpu_util) > 0.90},
  };
  if (!impl_->moe_load.empty()) {
    const double load = median(impl_->moe_load), dead = impl_->moe_dead.back(), share = median(impl_->moe_share);
    rows.push_back({"expert load (busiest over mean, worst layer)", fmt::format("{:.2f}x", load), "< 2x the mean",
                    load < 2.0});
    rows.push_back({"dead experts (last step, all layers)", fmt::format("{:.0f}", dead), "0", dead == 0});
    rows.push_back({"MoE routing + permutation", pct(share), "< 10% of a step", share < 0.10});
  }
  if (!impl_->ep_load.empty()) {
    const double load = median(impl_->ep_load), share = median(impl_->ep_share);
    rows.push_back({"expert-parallel load (busiest rank over mean)", fmt::format("{:.2f}x", load), "< 1.10x the mean",
                    load < 1.10});
    rows.push_back({"expert-parallel all-to-all", pct(share), "< 20% of a step", share < 0.20});
  }
  if (!impl_->tp_share.empty()) {
    // Blocking and on the critical path: Megatron-style tensor parallelism inside an NVLink node
    // spends 10-20% of a step here; over a slower link it is the first thing to look at.
    const double share = median(impl_->tp_share);
    rows.push_back({"tensor-parallel communication", pct(share), "< 25% of a step", share < 0.25});
  }
  std::string out = fmt::format("{:<46} {:>14}  {:<42} {}\n", "metric", "value", "normal range", "verdict");
  for (const Row& r : rows) {
    const std::string verdict = !r.verdict.empty() ? r.verdict : r.normal == "-" ? "" : r.ok ? "ok" : "CHECK";
    out += fmt::format("{:<46} {:>14}  {:<42} {}\n", r.metric, r.value, r.normal, verdict);
  }
  out += fmt::format("peak: {:.1f} GFLOP/s per rank, {}\n", impl_->peak_flops / 1e9, impl_->peak_source);
  return out;
}

void Metrics::on_run_end() {
  if (impl_->tensorboard) impl_->tensorboard->flush();
  if (rank_ != 0 || !impl_->have_step) return;
  std::printf("%s", bar_ ? "\n" : "");
  log::info("run summary (medians over the steps of this run):\n{}", summary_table());
  write({{"type", "summary"}, {"table", summary_table()}, {"peak_flops", peak_flops_}, {"peak_source", peak_source_}});
}

}  // namespace dstrain
