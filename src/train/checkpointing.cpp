#include "train/checkpointing.h"

#include <sys/resource.h>
#include <sys/statvfs.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

#include "comm/watchdog.h"
#include "core/clock.h"
#include "core/log.h"

namespace dstrain {
namespace fs = std::filesystem;

namespace {

int64_t step_of(const std::string& filename) {
  static const std::regex re(R"(^step_(\d+)\.h5$)");
  std::smatch m;
  return std::regex_match(filename, m, re) ? std::stoll(m[1]) : -1;
}

int64_t statvfs_free_bytes(const std::string& dir) {
  struct statvfs v {};
  if (::statvfs(dir.c_str(), &v) != 0) return -1;  // unknown: not refused
  return int64_t(v.f_bavail) * int64_t(v.f_frsize);
}

// The process's file size limit (ulimit -f) in bytes, or -1 when there is none.
int64_t file_size_limit() {
  rlimit l{};
  if (::getrlimit(RLIMIT_FSIZE, &l) != 0 || l.rlim_cur == RLIM_INFINITY) return -1;
  return int64_t(l.rlim_cur);
}

std::string mb(int64_t bytes) {
  return bytes >= 1'000'000'000 ? fmt::format("{:.2f} GB", double(bytes) / 1e9)
                                : fmt::format("{:.2f} MB", double(bytes) / 1e6);
}

}  // namespace

CheckpointConfig CheckpointConfig::from_json(const JsonReader& r) {
  CheckpointConfig c;
  c.dir = r.get<std::string>("dir", c.dir);
  c.interval_steps = r.get<int64_t>("interval_steps", c.interval_steps);
  c.interval_minutes = r.get<double>("interval_minutes", c.interval_minutes);
  c.keep_last = r.get<int64_t>("keep_last", c.keep_last);
  c.keep_every = r.get<int64_t>("keep_every", c.keep_every);
  c.async = r.get<bool>("async", c.async);
  c.save_final = r.get<bool>("save_final", c.save_final);
  c.check_free_space = r.get<bool>("check_free_space", c.check_free_space);
  if (c.interval_steps < 0) r.error("interval_steps", "must be >= 0 (0: not by steps)");
  if (c.interval_minutes < 0) r.error("interval_minutes", "must be >= 0 (0: not by time)");
  if (c.keep_last < 1) r.error("keep_last", "must be >= 1: the newest checkpoint is always kept");
  if (c.keep_every < 0) r.error("keep_every", "must be >= 0 (0: none)");
  r.done();
  return c;
}

json CheckpointConfig::to_json() const {
  return {{"dir", dir},           {"interval_steps", interval_steps}, {"interval_minutes", interval_minutes},
          {"keep_last", keep_last}, {"keep_every", keep_every},     {"async", async},
          {"save_final", save_final}, {"check_free_space", check_free_space}};
}

CheckpointManager::CheckpointManager(CheckpointConfig config, ProcessGrid& grid)
    : free_bytes(statvfs_free_bytes), config_(std::move(config)), grid_(grid) {
  io_comm_ = MpiCommHandle(grid.mpi_world());
  if (grid_.world_rank() == 0) fs::create_directories(config_.dir);
  // A file outgrowing `ulimit -f` must fail its write (EFBIG), to be reported like a full
  // disk, rather than kill the rank with SIGXFSZ mid-checkpoint.
  std::signal(SIGXFSZ, SIG_IGN);
  const std::vector<std::string> found = list();
  if (!found.empty()) newest_step_ = step_of(fs::path(found.front()).filename().string());
}


CheckpointManager::~CheckpointManager() {
  if (writer_.joinable()) writer_.join();
}

std::string CheckpointManager::path_for(int64_t step) const {
  return (fs::path(config_.dir) / fmt::format("step_{:08d}.h5", step)).string();
}

std::vector<std::string> CheckpointManager::list() const {
  std::vector<std::pair<int64_t, std::string>> found;
  if (fs::is_directory(config_.dir)) {
    for (const auto& e : fs::directory_iterator(config_.dir)) {
      const int64_t s = step_of(e.path().filename().string());
      if (s >= 0) found.emplace_back(s, e.path().string());
    }
  }
  std::sort(found.rbegin(), found.rend());
  std::vector<std::string> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

int64_t CheckpointManager::size_on_disk(const ParamRegistry& reg, const CheckpointBuffers& bufs,
                                        const TrainState& state) {
  return checkpoint_size_bound(reg, bufs, state);
}

std::string CheckpointManager::not_written(const std::string& cause, int64_t step) const {
  return fmt::format("{} on {}: checkpoint step {} not written; {}", cause, config_.dir, step,
                     newest_step_ >= 0 ? fmt::format("step {} is the newest valid one", newest_step_)
                                       : std::string("no checkpoint has been written yet"));
}

void CheckpointManager::check_room(int64_t step, int64_t need) {
  int64_t verdict[3] = {0, -1, -1};  // 0 fits, 1 no space, 2 over the file size limit; free bytes; limit
  if (grid_.world_rank() == 0) {
    // No save is in flight: a temporary file is what a failed or killed write left.
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(config_.dir, ec)) {
      if (e.path().filename().string().ends_with(".h5.tmp")) fs::remove(e.path(), ec);
    }
    if (config_.check_free_space) {
      verdict[1] = free_bytes(config_.dir);
      verdict[2] = file_size_limit();
      if (verdict[1] >= 0 && verdict[1] < need) {
        verdict[0] = 1;
      } else if (verdict[2] >= 0 && verdict[2] < need) {
        verdict[0] = 2;
      }
    }
  }
  // Rank 0's view decides for every rank: they must all write, or all refuse.
  DS_CHECK(MPI_Bcast(verdict, 3, MPI_INT64_T, 0, io_comm_.get()) == MPI_SUCCESS, "checkpoint: broadcast failed");
  if (verdict[0] == 1) {
    throw Error(not_written("no space left", step) +
                fmt::format("\n  it needs about {} and {} is free there; free some space, lower checkpoint.keep_last "
                            "or choose another checkpoint.dir, then resume (checkpoint.check_free_space=false skips "
                            "this check where the free space reported is wrong)",
                            mb(need), mb(verdict[1])));
  }
  if (verdict[0] == 2) {
    throw Error(not_written("the file size limit (ulimit -f) is too small", step) +
                fmt::format("\n  a checkpoint needs about {} but files may not grow beyond {}; raise `ulimit -f` in "
                            "the job script, then resume",
                            mb(need), mb(verdict[2])));
  }
}

std::string CheckpointManager::explain_stall(int64_t step, int64_t need) const {
  const int64_t free = free_bytes(config_.dir), limit = file_size_limit();
  if (free >= 0 && free < std::max<int64_t>(need / 100, int64_t(1) << 20)) {
    return not_written("no space left", step) + fmt::format(" ({} free)", mb(free));
  }
  if (limit >= 0 && limit < need) return not_written("the file size limit (ulimit -f) is too small", step);
  return not_written("writing stalled", step);
}

std::string CheckpointManager::latest() const {
  std::ifstream in(fs::path(config_.dir) / "latest");
  std::string name;
  in >> name;
  return name;
}

double CheckpointManager::save(const ParamRegistry& reg, const CheckpointBuffers& live, const TrainState& state) {
  const auto t0 = Clock::now();
  wait();  // one save in flight at a time
  check_room(state.step, size_on_disk(reg, live, state));
  if (!config_.async) {
    write_and_publish(reg, live, state, /*threads=*/0);
    return seconds_since(t0);
  }
  // The snapshot is the only part that holds training up.
  const int64_t n = live.pieces ? live.pieces->numel : reg.values().numel();
  if (snap_values_.numel() != n) {
    snap_values_ = Buffer("checkpoint.snapshot.values", MemCategory::Checkpoint, DType::F32, n);
    snap_m_ = Buffer("checkpoint.snapshot.exp_avg", MemCategory::Checkpoint, DType::F32, n);
    snap_v_ = Buffer("checkpoint.snapshot.exp_avg_sq", MemCategory::Checkpoint, DType::F32, n);
  }
  CheckpointBuffers snap;
  const std::pair<const float*, Buffer*> copies[] = {
      {live.values, &snap_values_}, {live.exp_avg, &snap_m_}, {live.exp_avg_sq, &snap_v_}};
  for (auto [src, dst] : copies) {
    if (!src) continue;
    float* d = dst->data<float>();
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < (n + 65535) / 65536; ++c) {
      const int64_t b = c * 65536;
      std::memcpy(d + b, src + b, size_t(std::min<int64_t>(65536, n - b)) * sizeof(float));
    }
  }
  snap.values = snap_values_.data<float>();
  snap.exp_avg = live.exp_avg ? snap_m_.data<float>() : nullptr;
  snap.exp_avg_sq = live.exp_avg_sq ? snap_v_.data<float>() : nullptr;
  snap.pieces = live.pieces;  // shared, immutable: the writer thread reads it
  // The extra groups (asynchronous aggregation's state) are copied too.
  snap_extra_.resize(live.extra.size());
  for (size_t i = 0; i < live.extra.size(); ++i) {
    CheckpointGroup g = live.extra[i];
    if (g.data) {
      const int64_t m = g.pieces ? g.pieces->numel : n;
      if (snap_extra_[i].numel() != m) {
        snap_extra_[i] = Buffer("checkpoint.snapshot." + g.path, MemCategory::Checkpoint, DType::F32, m);
      }
      std::memcpy(snap_extra_[i].data<float>(), g.data, size_t(m) * sizeof(float));
      g.data = snap_extra_[i].data<float>();
    }
    snap.extra.push_back(std::move(g));
  }
  writer_error_.clear();
  writer_ = std::thread([this, &reg, snap, state] {
    try {
      write_and_publish(reg, snap, state, /*threads=*/1);
    } catch (const std::exception& e) {
      writer_error_ = e.what();
    }
  });
  return seconds_since(t0);
}

void CheckpointManager::wait() {
  if (!writer_.joinable()) return;
  writer_.join();
  // Every rank learns whether any rank's writer failed (they fail together: the write agrees
  // on its outcome).
  int failed = writer_error_.empty() ? 0 : 1, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, io_comm_.get());
  if (any) {
    throw Error(writer_error_.empty() ? "writing a checkpoint failed on another rank; the previous checkpoint is kept"
                                      : writer_error_);
  }
}

void CheckpointManager::write_and_publish(const ParamRegistry& reg, CheckpointBuffers bufs, TrainState state,
                                          int threads) {
  const auto t0 = Clock::now();
  const std::string final_path = path_for(state.step);
  const std::string tmp = final_path + ".tmp";
  MPI_Comm comm = io_comm_.get();
  const int64_t need = size_on_disk(reg, bufs, state);
  // The write is collective: under the watchdog, with the time to write the file at a slow
  // 20 MB/s on top of the collective deadline, and a diagnosis (a full disk) if it stalls.
  WatchScope watch("checkpoint", fmt::format("writing checkpoint step {} to {}", state.step, config_.dir),
                   uint64_t(state.step), Watchdog::instance().deadline() + double(need) / 20e6,
                   [this, step = state.step, need] { return explain_stall(step, need); });
  try {
    write_checkpoint(tmp, comm, reg, bufs, state, threads);
  } catch (const StorageFullError& e) {
    throw Error(not_written(e.cause(), state.step) + "\n  " + e.what());
  } catch (const Error& e) {
    throw Error(not_written("writing failed", state.step) + "\n  " + e.what());
  }
  std::string error;
  if (grid_.world_rank() == 0) {
    try {
      // Complete on disk before it carries its final name and before `latest` points to it.
      fs::rename(tmp, final_path);
      const fs::path marker = fs::path(config_.dir) / "latest";
      {
        std::ofstream out(marker.string() + ".tmp");
        out << fs::path(final_path).filename().string() << "\n";
        out.flush();
        DS_CHECK(out.good(), "cannot write {}.tmp", marker.string());
      }
      fs::rename(marker.string() + ".tmp", marker);
      rotate(state.step);
    } catch (const std::exception& e) {
      error = fmt::format("publishing checkpoint {} failed: {}", final_path, e.what());
    }
  }
  throw_if_any_rank_failed(comm, error);
  newest_step_ = state.step;
  const double secs = seconds_since(t0);
  // The global tensors' bytes (a rank's registry may hold only its pieces of them).
  const double bytes = double(reg.global_numel()) * 4.0 * (bufs.exp_avg ? 3.0 : 1.0);
  log::info("checkpoint {} written in {:.2f} s ({:.0f} MB, {:.0f} MB/s)", final_path, secs, bytes / 1e6,
            bytes / 1e6 / std::max(secs, 1e-9));
}

void CheckpointManager::rotate(int64_t newest_step) const {
  int64_t kept = 0;
  for (const std::string& path : list()) {
    const int64_t s = step_of(fs::path(path).filename().string());
    const bool recent = kept < config_.keep_last && s <= newest_step;
    const bool milestone = config_.keep_every > 0 && s % config_.keep_every == 0;
    if (recent) ++kept;
    // Only checkpoints older than the one just completed are ever removed.
    if (!recent && !milestone && s < newest_step) {
      std::error_code ec;
      fs::remove(path, ec);
      if (ec) log::warn("could not remove old checkpoint {}: {}", path, ec.message());
    }
  }
}

}  // namespace dstrain
