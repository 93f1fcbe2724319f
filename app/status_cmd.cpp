// `dstrain status RUN_DIR`: where a run stands, from its output.dir (metrics.jsonl, dstrain.lock,
// resolved_config.json, the checkpoints), while it trains or after it ended; it only reads.
#include "status_cmd.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <sstream>
#include <thread>

#include "cli.h"
#include "comm/environment.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "train/metrics.h"

namespace dstrain::cli {
namespace {

namespace fs = std::filesystem;

constexpr size_t kSparkWidth = 60;  // loss points (or buckets of steps) on the sparkline
constexpr size_t kRanksShown = 16;  // ranks listed one per line; more are summarised

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Modification time in seconds since the epoch; -1 when the file is not there.
double mtime_seconds(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return -1;
  return double(st.st_mtim.tv_sec) + 1e-9 * double(st.st_mtim.tv_nsec);
}

std::string utc(double seconds, const char* format = "%Y-%m-%d %H:%M:%S UTC") {
  const std::time_t t = std::time_t(seconds);
  char text[40] = {};
  std::strftime(text, sizeof(text), format, std::gmtime(&t));
  return text;
}

std::string hms(double seconds) {
  const int64_t s = int64_t(std::max(seconds, 0.0) + 0.5);
  return fmt::format("{:02d}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

std::string age(double seconds) {
  if (seconds < 1) return "under 1 s";
  const int64_t s = int64_t(seconds);
  if (s < 120) return fmt::format("{} s", s);
  if (s < 3600) return fmt::format("{} min {} s", s / 60, s % 60);
  if (s < 172800) return fmt::format("{} h {} min", s / 3600, (s / 60) % 60);
  return fmt::format("{} days {} h", s / 86400, (s / 3600) % 24);
}

// A record's number, or `otherwise` when absent or not a number (an fp16 overflow's loss is null).
double num(const json& r, const char* key, double otherwise = 0) {
  if (!r.is_object()) return otherwise;
  const auto it = r.find(key);
  return it != r.end() && it->is_number() ? it->get<double>() : otherwise;
}
int64_t integer(const json& r, const char* key, int64_t otherwise = 0) {
  if (!r.is_object()) return otherwise;
  const auto it = r.find(key);
  return it != r.end() && it->is_number() ? it->get<int64_t>() : otherwise;
}
std::string text(const json& r, const char* key, const std::string& otherwise = "") {
  if (!r.is_object()) return otherwise;
  const auto it = r.find(key);
  return it != r.end() && it->is_string() ? it->get<std::string>() : otherwise;
}
std::vector<double> numbers(const json& r, const char* key) {
  std::vector<double> out;
  if (!r.is_object() || !r.contains(key) || !r[key].is_array()) return out;
  for (const json& v : r[key]) out.push_back(v.is_number() ? v.get<double>() : 0.0);
  return out;
}

// What Metrics::on_step gave the summary for one step, rebuilt from its metrics.jsonl record:
// the step's figures and the record (its MFU and peak RSS). Only the parts the summary reads.
struct SummaryStep {
  StepMetrics m;
  json record;
};

SummaryStep summary_step(const json& r) {
  SummaryStep s;
  StepMetrics& m = s.m;
  m.step = integer(r, "step");
  m.loss = num(r, "loss");
  m.tokens_per_s = num(r, "tokens_per_s");
  m.time.total = num(r, "step_time_s");
  const json times = r.value("time_s", json::object());
  m.time.data_wait = num(times, "data_wait");
  m.time.forward = num(times, "forward");
  m.time.backward = num(times, "backward");
  m.time.exposed_comm = num(times, "exposed_comm");
  m.time.optimizer = num(times, "optimizer");
  m.time.checkpoint = num(times, "checkpoint");
  m.rank_step_s = numbers(r, "rank_step_time_s");
  m.rank_peak_rss_bytes = {num(r, "peak_rss_bytes")};
  m.skipped = r.value("skipped", false);
  m.skipped_total = integer(r, "skipped_total");
  if (r.contains("loss_scale")) {
    m.loss_scaling = true;
    m.loss_scale = num(r, "loss_scale", 1);
    m.overflow = r.value("overflow", false);
    m.overflow_skipped_total = integer(r, "overflow_skipped_total");
  }
  for (const char* key :
       {"expert_parallel", "tensor_parallel", "gpu", "gradient_sync", "moe_route_s", "moe_permute_s"}) {
    if (r.contains(key)) m.extra[key] = r[key];
  }
  if (r.contains("moe") && r["moe"].is_object()) {
    // Per layer, only what the summary reads (not the tokens of every expert).
    for (const auto& [layer, v] : r["moe"].items()) {
      m.extra["moe"][layer] = {{"max_over_mean_load", num(v, "max_over_mean_load")},
                               {"dead_experts", num(v, "dead_experts")}};
    }
  }
  s.record = {{"mfu", num(r, "mfu")}, {"peak_rss_bytes", num(r, "peak_rss_bytes")}};
  return s;
}

// metrics.jsonl read as it grows: complete lines only (a live writer's last line may be partial
// until its newline comes), each read once.
class RecordLog {
 public:
  // One start of `dstrain train` (a resume starts another): from its environment record on.
  struct Segment {
    json environment;
    double peak_flops = 0;
    std::string peak_source;
    int64_t first_step = -1;
    std::vector<SummaryStep> steps;
    json summary;  // its summary record, once written
  };

  explicit RecordLog(fs::path path) : path_(std::move(path)) {}

  void update() {
    std::error_code ec;
    const std::uintmax_t size = fs::file_size(path_, ec);
    if (ec) return;                                // gone for a moment (moved, rotated): keep what was read
    if (size < offset_) *this = RecordLog(path_);  // replaced by a shorter file: read it again
    std::ifstream in(path_, std::ios::binary);
    in.seekg(std::streamoff(offset_));
    std::string carry;
    std::vector<char> block(size_t(8) << 20);
    while (in) {
      in.read(block.data(), std::streamsize(block.size()));
      const std::streamsize got = in.gcount();
      if (got <= 0) break;
      carry.append(block.data(), size_t(got));
      size_t at = 0;
      for (size_t nl; (nl = carry.find('\n', at)) != std::string::npos; at = nl + 1) {
        offset_ += nl + 1 - at;
        const std::string_view line(carry.data() + at, nl - at);
        if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
        json r = json::parse(line.begin(), line.end(), nullptr, /*allow_exceptions=*/false);
        if (r.is_object()) {
          add(r);
        } else {
          ++unreadable;  // a line cut short by a crash, followed by a new run's records
        }
      }
      carry.erase(0, at);
    }
  }

  std::vector<std::pair<int64_t, double>> losses;  // (step, loss) over the whole run, the latest of each step
  json last_train, last_eval, last_checkpoint, last_warning;
  Segment segment;
  int64_t starts = 0;      // environment records: starts of dstrain train in this directory
  int64_t unreadable = 0;  // complete lines that are not JSON objects

 private:
  void add(const json& r) {
    const std::string type = text(r, "type");
    if (type == "environment") {
      ++starts;
      segment = Segment{};
      segment.environment = r.value("environment", json::object());
      segment.peak_flops = num(r, "peak_flops");
      segment.peak_source = text(r, "peak_source");
    } else if (type == "peak") {
      segment.peak_flops = num(r, "peak_flops");
      segment.peak_source = text(r, "peak_source");
    } else if (type == "train") {
      const int64_t step = integer(r, "step");
      // A resumed run repeats the steps after its checkpoint: the later record of a step counts.
      while (!losses.empty() && losses.back().first >= step) losses.pop_back();
      const double loss = num(r, "loss", NAN);
      if (std::isfinite(loss)) losses.emplace_back(step, loss);
      last_train = r;
      if (segment.first_step < 0) segment.first_step = step;
      segment.steps.push_back(summary_step(r));
    } else if (type == "eval") {
      last_eval = r;
    } else if (type == "checkpoint") {
      last_checkpoint = r;
    } else if (type == "warning") {
      last_warning = r;
    } else if (type == "summary") {
      segment.summary = r;
    }
  }

  fs::path path_;
  std::uintmax_t offset_ = 0;
};

// "▁▂▃▅▇": one block character per value, from the lowest (▁) to the highest (█).
std::string sparkline(const std::vector<double>& v) {
  static const char* const kBlocks[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  if (v.empty()) return "";
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  std::string out;
  for (double x : v) {
    const int level = *hi > *lo ? int(std::lround((x - *lo) / (*hi - *lo) * 7.0)) : 3;
    out += kBlocks[std::clamp(level, 0, 7)];
  }
  return out;
}

// The loss over the whole run, each of kSparkWidth points the mean of its bucket of steps, and
// over the last kSparkWidth steps.
json describe_loss(const std::vector<std::pair<int64_t, double>>& losses) {
  if (losses.empty()) return nullptr;
  json out;
  const auto lowest =
      std::min_element(losses.begin(), losses.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  out["last"] = losses.back().second;
  out["min"] = lowest->second;
  out["min_step"] = lowest->first;
  out["first_step"] = losses.front().first;
  out["last_step"] = losses.back().first;
  const size_t n = losses.size();
  std::vector<double> whole;
  const size_t buckets = std::min(n, kSparkWidth);
  for (size_t b = 0; b < buckets; ++b) {
    const size_t from = b * n / buckets, to = (b + 1) * n / buckets;
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += losses[i].second;
    whole.push_back(sum / double(to - from));
  }
  out["sparkline"] = sparkline(whole);
  out["steps_per_point"] = double(n) / double(buckets);
  if (n > kSparkWidth) {
    std::vector<double> recent;
    for (size_t i = n - kSparkWidth; i < n; ++i) recent.push_back(losses[i].second);
    out["recent_sparkline"] = sparkline(recent);
    out["recent_first_step"] = losses[n - kSparkWidth].first;
  }
  return out;
}

// The summary table's text as rows: columns are separated by two spaces or more.
json table_rows(const std::string& table) {
  json rows = json::array();
  std::istringstream in(table);
  std::string line;
  bool header = true;
  while (std::getline(in, line)) {
    if (header) {
      header = false;
      continue;
    }
    if (line.rfind("peak: ", 0) == 0 || line.empty()) continue;
    std::vector<std::string> cols;
    size_t at = 0;
    while (at < line.size()) {
      const size_t gap = line.find("  ", at);
      std::string col = line.substr(at, gap == std::string::npos ? std::string::npos : gap - at);
      if (!col.empty()) cols.push_back(col);
      if (gap == std::string::npos) break;
      at = line.find_first_not_of(' ', gap);
      if (at == std::string::npos) break;
    }
    if (cols.size() < 3) continue;
    rows.push_back({{"metric", cols[0]},
                    {"value", cols[1]},
                    {"normal", cols[2]},
                    {"verdict", cols.size() > 3 ? cols[3] : std::string()}});
  }
  return rows;
}

// Where a run's configuration put its checkpoints, seen from RUN_DIR: checkpoint.dir under
// output.dir moves with it (a relative output.dir was relative to the run's working directory).
fs::path checkpoint_dir(const fs::path& run_dir, const json& config) {
  const json out = config.value("output", json::object()), ck = config.value("checkpoint", json::object());
  const std::string out_dir = text(out, "dir"), dir = text(ck, "dir");
  if (dir.empty()) return run_dir / "checkpoints";
  const fs::path o = fs::path(out_dir).lexically_normal(), c = fs::path(dir).lexically_normal();
  const fs::path rel = c.lexically_relative(o);
  if (!out_dir.empty() && !rel.empty() && *rel.begin() != "..") return rel == "." ? run_dir : run_dir / rel;
  return c;
}

int64_t checkpoint_step(const std::string& filename) {
  static const std::regex re(R"(^step_(\d+)\.h5$)");
  std::smatch m;
  return std::regex_match(filename, m, re) ? std::stoll(m[1]) : -1;
}

// A description of the run for `dstrain status`, read again at each call; checkpoints are
// checked once per file version.
class RunStatus {
 public:
  explicit RunStatus(fs::path dir) : dir_(std::move(dir)), log_(dir_ / "metrics.jsonl") {}

  json collect() {
    log_.update();
    const double now = now_seconds();
    json config;
    try {
      config = read_json_file((dir_ / "resolved_config.json").string());
    } catch (const Error&) {
      config = json::object();  // an older run, or copied without it: no max_steps, default checkpoint.dir
    }
    const json& t = log_.last_train;
    const json train_config = config.value("train", json::object());
    const int64_t max_steps = integer(train_config, "max_steps", -1);
    const int64_t step = integer(t, "step");
    const RecordLog::Segment& seg = log_.segment;

    json s;
    s["run_dir"] = dir_.string();
    s["time"] = utc(now, "%Y-%m-%dT%H:%M:%SZ");
    s["starts"] = log_.starts;
    s["step"] = t.is_null() ? json(nullptr) : json(step);
    s["max_steps"] = max_steps >= 0 ? json(max_steps) : json(nullptr);
    const double metrics_mtime = mtime_seconds(dir_ / "metrics.jsonl");
    s["last_record_age_s"] = metrics_mtime >= 0 ? json(std::max(0.0, now - metrics_mtime)) : json(nullptr);
    describe_state(s, step, max_steps);
    const bool running = s["state"] == "running";
    if (!t.is_null()) {
      // The ETA as the progress line computes it: the mean step of this start of the run.
      const double elapsed = num(t, "elapsed_s");
      const int64_t steps_this_run = std::max<int64_t>(step - seg.first_step + 1, 1);
      s["elapsed_s"] = elapsed;
      // None until this start of the run has a step of its own (a resume's first step).
      s["eta_s"] = running && max_steps > step && seg.first_step >= 0
                       ? json(elapsed / double(steps_this_run) * double(max_steps - step))
                       : json(nullptr);
      s["tokens"] = integer(t, "tokens");
      s["tokens_per_s"] = num(t, "tokens_per_s");
      s["mfu"] = num(t, "mfu");
      s["mfu_above_peak"] = t.value("mfu_above_peak", false);
      s["step_time_s"] = num(t, "step_time_s");
      s["lr"] = num(t, "lr");
      s["grad_norm"] = num(t, "grad_norm");
      s["skipped_total"] = integer(t, "skipped_total");
      s["ranks"] = {{"step", step},
                    {"step_time_s", numbers(t, "rank_step_time_s")},
                    {"slowest", integer(t, "slowest_rank")},
                    {"max_s", num(t, "step_time_max_s")},
                    {"min_s", num(t, "step_time_min_s")},
                    {"mean_s", num(t, "step_time_mean_s")}};
      const double mean = num(t, "step_time_mean_s");
      s["ranks"]["spread"] = mean > 0 ? (num(t, "step_time_max_s") - num(t, "step_time_min_s")) / mean : 0.0;
      s["experts"] = describe_experts(t);
    }
    s["loss"] = describe_loss(log_.losses);
    s["eval"] = log_.last_eval.is_null() ? json(nullptr)
                                         : json{{"step", integer(log_.last_eval, "step")},
                                                {"loss", num(log_.last_eval, "loss")},
                                                {"accuracy", num(log_.last_eval, "accuracy")},
                                                {"tokens", integer(log_.last_eval, "tokens")}};
    s["checkpoint"] = describe_checkpoints(checkpoint_dir(dir_, config), now);
    s["bottlenecks"] = describe_bottlenecks(config);
    s["last_warning"] = log_.last_warning.is_null() ? json(nullptr)
                                                    : json{{"step", integer(log_.last_warning, "step")},
                                                           {"message", text(log_.last_warning, "message")}};
    s["unreadable_lines"] = log_.unreadable;
    return s;
  }

 private:
  // Alive, and if not, how it ended: "state" in one word, "state_detail" a sentence starting with
  // it. A run holds dstrain.lock (host, pid) while it runs and removes it when it ends, on an
  // error too; it writes its summary after its last step, and after the checkpoint of a stop
  // signal.
  void describe_state(json& s, int64_t step, int64_t max_steps) {
    json lock = nullptr;
    const fs::path lock_path = dir_ / "dstrain.lock";
    if (fs::exists(lock_path)) {
      std::ifstream in(lock_path);
      std::stringstream text_of;
      text_of << in.rdbuf();
      lock = json::parse(text_of.str(), nullptr, false);
      if (!lock.is_object()) lock = json{{"damaged", true}};
    }
    const std::string here = host_name();
    const std::string host = text(lock, "host", "?");
    const int64_t pid = integer(lock, "pid", -1);
    json alive = nullptr;  // null: not checked (another host)
    if (lock.is_object() && host == here && pid > 0) {
      alive = ::kill(pid_t(pid), 0) == 0 || errno == EPERM;
    }
    if (lock.is_object()) {
      lock["this_host"] = host == here;
      lock["alive"] = alive;
    }
    s["lock"] = lock;
    s["alive"] = alive;
    const std::string slurm_job = text(lock, "slurm_job_id");
    const int64_t restarts = integer(lock, "slurm_restart_count");
    const json& seg_summary = log_.segment.summary;
    const double record_age = s["last_record_age_s"].is_null() ? 0.0 : s["last_record_age_s"].get<double>();
    const std::string who = fmt::format("pid {} on {}", pid, host);
    std::string state, detail;
    if (!seg_summary.is_null()) {
      const bool done = max_steps < 0 || step >= max_steps;
      state = done ? "finished" : "stopped";
      detail = done ? fmt::format("finished at step {}, with its summary", step)
                    : fmt::format(
                          "stopped at step {} of {} by a stop signal (SIGUSR1 or SIGTERM), after a "
                          "checkpoint, with its summary; exit status 75: resume it with dstrain train "
                          "--resume auto (a Slurm job with --requeue is requeued and does that)",
                          step, max_steps);
      if (alive == true) detail += fmt::format("; {} is exiting", who);
    } else if (lock.is_object() && lock.contains("damaged")) {
      state = "unknown";
      detail = fmt::format("unknown: {} is not a dstrain lock file (damaged?); the last record is {} old",
                           lock_path.string(), age(record_age));
    } else if (lock.is_object() && alive == true) {
      state = "running";
      detail = fmt::format("running: {} (this host; checked with kill(pid, 0)), started {}", who,
                           text(lock, "started", "?"));
    } else if (lock.is_object() && alive.is_null()) {
      // Another host's processes cannot be checked from here: the records' age says what it can.
      const double quiet = std::max(300.0, 20.0 * num(log_.last_train, "step_time_s"));
      state = record_age < quiet ? "running" : "unknown";
      detail = fmt::format("{}: {}, another host, not checked from this one ({}); the last record is {} old{}", state,
                           who, here, age(record_age), state == "running" ? "" : ": it may have died");
    } else if (lock.is_object()) {
      // The lock is left behind by a run that could not remove it.
      state = slurm_job.empty() ? "killed" : "requeued";
      detail = slurm_job.empty() ? fmt::format(
                                       "killed: {} is gone and left its lock, without a summary (SIGKILL, the OOM "
                                       "killer or a crash); resume with dstrain train --resume auto",
                                       who)
                                 : fmt::format(
                                       "requeued: Slurm job {}'s run ({}) is gone without a summary (the job was "
                                       "requeued, or killed); a requeued run takes the lock over and resumes from the "
                                       "newest valid checkpoint",
                                       slurm_job, who);
    } else if (log_.last_train.is_null()) {
      state = "starting";
      detail = "starting: no step recorded yet and no lock held: the run is starting, or ended before its first step";
    } else {
      state = "failed";
      detail = fmt::format(
          "failed: ended at step {} without a summary and released its lock: an error "
          "(its log says which); resume with dstrain train --resume auto",
          step);
    }
    if (!slurm_job.empty() && state == "running") {
      detail += restarts > 0 ? fmt::format("; Slurm job {}, requeued {} time(s)", slurm_job, restarts)
                             : fmt::format("; Slurm job {}", slurm_job);
    }
    s["state"] = state;
    s["state_detail"] = detail;
    s["slurm"] = slurm_job.empty() ? json(nullptr) : json{{"job_id", slurm_job}, {"restart_count", restarts}};
  }

  static json describe_experts(const json& t) {
    json e = json::object();
    if (t.contains("moe") && t["moe"].is_object()) {
      double load = 0, received = 0, dead = 0;
      std::string load_layer, received_layer;
      for (const auto& [layer, v] : t["moe"].items()) {
        if (num(v, "max_over_mean_load") > load) {
          load = num(v, "max_over_mean_load");
          load_layer = layer;
        }
        if (num(v, "received_max_over_mean") > received) {
          received = num(v, "received_max_over_mean");
          received_layer = layer;
        }
        dead += num(v, "dead_experts");
      }
      e["max_over_mean_load"] = load;
      e["max_over_mean_load_layer"] = load_layer;
      e["dead_experts"] = dead;
      if (!received_layer.empty()) {
        e["received_max_over_mean"] = received;
        e["received_max_over_mean_layer"] = received_layer;
      }
    }
    if (t.contains("expert_parallel")) {
      e["expert_parallel_received_max_over_mean"] = num(t["expert_parallel"], "received_max_over_mean");
    }
    return e.empty() ? json(nullptr) : e;
  }

  // dstrain's own checks of a checkpoint without its tensors: a dstrain checkpoint that HDF5
  // opens, metadata checksums and counters verified (dstrain-ckpt info --no-verify), at the
  // step its name says. What --resume auto reads in full and skips when it fails.
  json check_checkpoint(const fs::path& path, int64_t step) {
    std::error_code ec;
    const std::string version = fmt::format("{} {}", mtime_seconds(path), fs::file_size(path, ec));
    auto& [seen, verdict] = checked_[path.string()];
    if (seen == version) return verdict;
    seen = version;
    verdict = {{"valid", false}};
    try {
      const CheckpointInfo info = inspect_checkpoint(path.string(), /*verify=*/false);
      std::vector<std::string> problems = info.metadata_problems;
      if (info.state.step != step) {
        problems.push_back(fmt::format("the file says step {}, its name step {}", info.state.step, step));
      }
      verdict["valid"] = problems.empty();
      verdict["checked"] = info.metadata_sealed ? "metadata checksums verified, tensors not read"
                                                : "opened; written before metadata checksums, so unverified";
      if (!problems.empty()) verdict["problem"] = problems.front();
    } catch (const std::exception& e) {
      verdict["problem"] = e.what();
    }
    return verdict;
  }

  json describe_checkpoints(const fs::path& dir, double now) {
    json c;
    c["dir"] = dir.string();
    std::vector<std::pair<int64_t, fs::path>> files;
    int64_t writing = -1;
    std::error_code ec;
    for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
      const std::string name = it->path().filename().string();
      const int64_t step = checkpoint_step(name);
      if (step >= 0) files.emplace_back(step, it->path());
      if (name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0) {
        writing = std::max(writing, checkpoint_step(name.substr(0, name.size() - 4)));
      }
    }
    std::sort(files.rbegin(), files.rend());
    std::ifstream marker(dir / "latest");
    std::string latest;
    marker >> latest;
    c["files"] = files.size();
    c["latest"] = latest.empty() ? json(nullptr) : json(latest);
    c["writing_step"] = writing >= 0 ? json(writing) : json(nullptr);
    if (files.empty()) return c;
    const auto& [step, path] = files.front();
    c["step"] = step;
    c["path"] = path.string();
    c["age_s"] = std::max(0.0, now - mtime_seconds(path));
    c.update(check_checkpoint(path, step));
    if (!latest.empty() && !fs::exists(dir / latest)) {
      c["latest_missing"] = true;  // --resume auto falls back to the newest present, with a warning
    }
    if (c["valid"] == false) {
      // What --resume auto would take: the newest one that passes.
      for (size_t i = 1; i < files.size(); ++i) {
        if (check_checkpoint(files[i].second, files[i].first)["valid"] == true) {
          c["newest_valid"] = {{"step", files[i].first}, {"path", files[i].second.string()}};
          break;
        }
      }
      if (!c.contains("newest_valid")) c["newest_valid"] = nullptr;
    }
    return c;
  }

  // The end-of-run summary table (Metrics::summary_table), over the steps of this start of the
  // run so far: its summary record once written, until then the records replayed through
  // Metrics. The table reads each step's MFU from its record, so the model's FLOPs per token are
  // not needed: a one-unit model stands in for it.
  json describe_bottlenecks(const json& config) {
    const RecordLog::Segment& seg = log_.segment;
    if (seg.steps.empty()) return nullptr;
    json b;
    std::string table;
    if (!seg.summary.is_null()) {
      table = text(seg.summary, "table");
      b["source"] = "summary";
    } else {
      if (!summary_ || summary_start_ != log_.starts || summary_peak_ != seg.peak_flops) {
        MetricsConfig mc;
        mc.progress = "lines";
        mc.memory_budget_gb = num(config.value("metrics", json::object()), "memory_budget_gb");
        ModelConfig unit;
        unit.hidden_size = unit.num_attention_heads = unit.num_key_value_heads = unit.vocab_size = 1;
        const json& env = seg.environment;
        const int world = int(std::max<int64_t>(integer(env, "world_size", 1), 1));
        // The memory budget's default is the node's memory over its ranks: ranks per host.
        int hosts = 0;
        std::istringstream names(text(env, "hosts"));
        for (std::string word; names >> word;) {
          if (word == "and") {
            int64_t more = 0;
            names >> more;
            hosts += int(more);
            break;
          }
          ++hosts;
        }
        const Peak peak{seg.peak_flops, seg.peak_source};
        // Rank 1 of the job: a Metrics that writes no file and serves nothing.
        summary_ = std::make_unique<Metrics>(mc, unit, 1, /*rank=*/1, world, std::max(world / std::max(hosts, 1), 1),
                                             dir_.string(), 1, [peak] { return peak; });
        summary_start_ = log_.starts;
        summary_peak_ = seg.peak_flops;
        summary_fed_ = 0;
      }
      for (; summary_fed_ < seg.steps.size(); ++summary_fed_) {
        summary_->add_step(seg.steps[summary_fed_].m, seg.steps[summary_fed_].record);
      }
      table = summary_->summary_table();
      b["source"] = "records";
    }
    b["steps"] = seg.steps.size();
    b["table"] = table;
    b["rows"] = table_rows(table);
    return b;
  }

  fs::path dir_;
  RecordLog log_;
  std::map<std::string, std::pair<std::string, json>> checked_;  // path: (mtime and size, verdict)
  std::unique_ptr<Metrics> summary_;
  int64_t summary_start_ = -1;
  double summary_peak_ = -1;
  size_t summary_fed_ = 0;
};

std::string percent(double x) { return fmt::format("{:.1f}%", 100 * x); }

std::string bar(double fraction, int width) {
  const int filled = std::clamp(int(std::lround(fraction * width)), 0, width);
  return std::string(size_t(filled), '#') + std::string(size_t(width - filled), '.');
}

// The terminal view of collect()'s object.
std::string render(const json& s) {
  std::string out;
  auto line = [&](const std::string& label, const std::string& body) { out += fmt::format("{:<12}{}\n", label, body); };
  out += fmt::format("dstrain status {}   {}\n\n", s["run_dir"].get<std::string>(), utc(now_seconds()));
  line("state", s["state_detail"].get<std::string>());
  if (s["step"].is_null()) {
    line("step", "none recorded yet");
  } else {
    const int64_t step = s["step"];
    std::string body = fmt::format("{}", step);
    if (!s["max_steps"].is_null()) {
      const int64_t max_steps = s["max_steps"];
      const double done = max_steps > 0 ? double(step) / double(max_steps) : 1.0;
      body = fmt::format("{} / {}  [{}] {:.1f}%", step, max_steps, bar(done, 30), 100 * done);
    }
    body += fmt::format("   elapsed {}   eta {}", hms(s["elapsed_s"]),
                        s["eta_s"].is_null() ? std::string("-") : hms(s["eta_s"]));
    if (!s["last_record_age_s"].is_null()) body += fmt::format("   last record {} ago", age(s["last_record_age_s"]));
    line("step", body);
  }
  if (s["starts"].get<int64_t>() > 1) {
    line("", fmt::format("started {} times in this directory (resumed from checkpoints)", s["starts"].get<int64_t>()));
  }
  if (!s["loss"].is_null()) {
    const json& l = s["loss"];
    const double per = l["steps_per_point"];
    line("loss", fmt::format("{}  last {:.4f}  min {:.4f} (step {})  steps {}-{}{}", l["sparkline"].get<std::string>(),
                             l["last"].get<double>(), l["min"].get<double>(), l["min_step"].get<int64_t>(),
                             l["first_step"].get<int64_t>(), l["last_step"].get<int64_t>(),
                             per > 1 ? fmt::format(", {:.1f} steps per point", per) : std::string()));
    if (l.contains("recent_sparkline")) {
      line("", fmt::format("{}  the last {} steps, from step {}", l["recent_sparkline"].get<std::string>(), kSparkWidth,
                           l["recent_first_step"].get<int64_t>()));
    }
  }
  if (s.contains("tokens_per_s")) {
    line("throughput", fmt::format("{:.0f} tok/s   MFU {}{}   step {:.4f} s   lr {:.3e}   grad norm {:.4f}{}",
                                   s["tokens_per_s"].get<double>(), percent(s["mfu"]),
                                   s["mfu_above_peak"] == true ? " (above 100%: peak too low)" : "",
                                   s["step_time_s"].get<double>(), s["lr"].get<double>(), s["grad_norm"].get<double>(),
                                   s["skipped_total"].get<int64_t>() > 0
                                       ? fmt::format("   skipped steps {}", s["skipped_total"].get<int64_t>())
                                       : std::string()));
    const json& r = s["ranks"];
    const std::vector<double> times = r["step_time_s"];
    line("ranks",
         fmt::format("step {} over {} rank(s): slowest rank {} at {:.4f} s, min {:.4f} s, mean {:.4f} s, "
                     "spread {}",
                     r["step"].get<int64_t>(), times.size(), r["slowest"].get<int64_t>(), r["max_s"].get<double>(),
                     r["min_s"].get<double>(), r["mean_s"].get<double>(), percent(r["spread"])));
    const double longest = times.empty() ? 0 : *std::max_element(times.begin(), times.end());
    for (size_t i = 0; i < std::min(times.size(), kRanksShown); ++i) {
      line(fmt::format("  rank {}", i),
           fmt::format("{:.4f} s  {}{}", times[i],
                       std::string(size_t(std::lround(40 * times[i] / std::max(longest, 1e-12))), '='),
                       int64_t(i) == r["slowest"].get<int64_t>() ? " slowest" : ""));
    }
    if (times.size() > kRanksShown) line("", fmt::format("... {} more ranks", times.size() - kRanksShown));
    if (!s["experts"].is_null()) {
      const json& e = s["experts"];
      std::string body;
      if (e.contains("max_over_mean_load")) {
        body = fmt::format("busiest expert {:.2f} x the mean (layer {}), dead experts {}",
                           e["max_over_mean_load"].get<double>(), e["max_over_mean_load_layer"].get<std::string>(),
                           e["dead_experts"].get<double>());
      }
      if (e.contains("received_max_over_mean")) {
        body += fmt::format("; expert ranks received max {:.2f} x the mean rows (layer {})",
                            e["received_max_over_mean"].get<double>(),
                            e["received_max_over_mean_layer"].get<std::string>());
      }
      line("experts", body);
    }
  }
  if (!s["eval"].is_null()) {
    const json& e = s["eval"];
    line("eval", fmt::format("step {}: loss {:.4f}, accuracy {:.2f}% over {} tokens", e["step"].get<int64_t>(),
                             e["loss"].get<double>(), 100 * e["accuracy"].get<double>(), e["tokens"].get<int64_t>()));
  }
  const json& c = s["checkpoint"];
  if (!c.contains("step")) {
    line("checkpoint", fmt::format("none in {}", c["dir"].get<std::string>()));
  } else {
    line("checkpoint", fmt::format("step {}, written {} ago: {}", c["step"].get<int64_t>(), age(c["age_s"]),
                                   c["valid"] == true ? fmt::format("valid ({})", c["checked"].get<std::string>())
                                                      : fmt::format("NOT VALID: {}", text(c, "problem", "?"))));
    line("", c["path"].get<std::string>());
    if (c.contains("newest_valid")) {
      line("",
           c["newest_valid"].is_null()
               ? std::string("no valid checkpoint: --resume auto would find none to resume from")
               : fmt::format("newest valid: step {} ({}), which --resume auto takes",
                             c["newest_valid"]["step"].get<int64_t>(), c["newest_valid"]["path"].get<std::string>()));
    }
    line("",
         fmt::format("{} checkpoint(s) in the directory; latest marker: {}{}{}", c["files"].get<int64_t>(),
                     text(c, "latest", "none"), c.contains("latest_missing") ? " (missing)" : "",
                     c["writing_step"].is_null() ? std::string()
                                                 : fmt::format("; writing step {}", c["writing_step"].get<int64_t>())));
  }
  if (!s["last_warning"].is_null()) {
    line("warning", fmt::format("step {}: {}", s["last_warning"]["step"].get<int64_t>(),
                                s["last_warning"]["message"].get<std::string>()));
  }
  if (s["unreadable_lines"].get<int64_t>() > 0) {
    line("", fmt::format("{} line(s) of metrics.jsonl are not JSON records (skipped)",
                         s["unreadable_lines"].get<int64_t>()));
  }
  if (!s["bottlenecks"].is_null()) {
    const json& b = s["bottlenecks"];
    out += fmt::format("\nbottlenecks: {}\n{}",
                       b["source"] == "summary"
                           ? std::string("the run's end-of-run summary")
                           : fmt::format("the end-of-run summary's rows over the {} step(s) of this run so far",
                                         b["steps"].get<int64_t>()),
                       b["table"].get<std::string>());
  }
  return out;
}

std::atomic<bool> g_interrupted{false};
extern "C" void on_interrupt(int) { g_interrupted = true; }

}  // namespace

CLI::App* add_status_command(CLI::App& app, StatusOptions& o) {
  CLI::App* status = app.add_subcommand(
      "status",
      "show a run's progress, loss, throughput, bottlenecks, ranks, checkpoints and whether it is alive, "
      "from its output.dir");
  status->add_option("RUN_DIR", o.run_dir, "the run's output.dir (holding metrics.jsonl)")->required();
  status->add_option("--watch", o.watch, "redraw every SECONDS (default 2) until Ctrl-C")
      ->expected(0, 1)
      ->type_name("[SECONDS]");
  status->add_flag("--json", o.json, "print one JSON object (with --watch: one per line)");
  return status;
}

int cmd_status(const StatusOptions& o) {
  if (log::rank() != 0) return 0;
  double interval = 0;
  const bool watch = !o.watch.empty();
  if (watch) {
    const std::string& v = o.watch.front();
    char* end = nullptr;
    interval = v.empty() ? 2.0 : std::strtod(v.c_str(), &end);
    if (!v.empty() && (end != v.c_str() + v.size() || !(interval >= 0.1) || !std::isfinite(interval))) {
      return report("dstrain status", fmt::format("--watch: expects a number of seconds >= 0.1, got '{}'", v),
                    "dstrain status");
    }
  }
  const fs::path dir = o.run_dir;
  if (!fs::is_directory(dir)) {
    std::fprintf(stderr,
                 "dstrain status: error: %s %s: give the run's output.dir (output.dir of its configuration, "
                 "where metrics.jsonl is written)\n",
                 dir.c_str(), fs::exists(dir) ? "is not a directory" : "does not exist");
    return 1;
  }
  const bool starting = fs::exists(dir / "dstrain.lock") || fs::exists(dir / "resolved_config.json");
  if (!fs::exists(dir / "metrics.jsonl") && !(watch && starting)) {
    std::fprintf(stderr, "dstrain status: error: %s holds no metrics.jsonl: %s\n", dir.c_str(),
                 starting ? "the run has not started training yet; try again in a moment, or use --watch"
                          : "not a dstrain run's output.dir (give output.dir of the run's configuration)");
    return 1;
  }
  RunStatus run(dir);
  if (!watch) {
    const json s = run.collect();
    std::printf("%s", o.json ? (s.dump(2) + "\n").c_str() : render(s).c_str());
    return 0;
  }
  std::signal(SIGINT, on_interrupt);
  bool first = true;
  while (!g_interrupted) {
    std::string screen;
    if (!fs::exists(dir / "metrics.jsonl")) {
      screen = fmt::format("dstrain status {}   {}\n\nwaiting for {}: the run has not started training yet\n",
                           dir.string(), utc(now_seconds()), (dir / "metrics.jsonl").string());
    } else {
      const json s = run.collect();
      screen = o.json ? s.dump() + "\n" : render(s);
    }
    if (o.json) {
      std::fputs(screen.c_str(), stdout);
    } else {
      // Redrawn in place: the screen cleared once, then home, each line cleared to its end, and
      // everything below.
      std::string frame = first ? "\033[H\033[2J" : "\033[H";
      first = false;
      for (size_t at = 0, nl; (nl = screen.find('\n', at)) != std::string::npos; at = nl + 1) {
        frame += screen.substr(at, nl - at) + "\033[K\n";
      }
      std::fputs((frame + "\033[J").c_str(), stdout);
    }
    std::fflush(stdout);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(interval);
    while (!g_interrupted && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  std::signal(SIGINT, SIG_DFL);
  return 0;
}

}  // namespace dstrain::cli
