#include "train/checkpointing.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>

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
          {"save_final", save_final}};
}

CheckpointManager::CheckpointManager(CheckpointConfig config, ProcessGrid& grid)
    : config_(std::move(config)), grid_(grid) {
  io_comm_ = MpiCommHandle(grid.mpi_world());
  if (grid_.world_rank() == 0) fs::create_directories(config_.dir);
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

std::string CheckpointManager::latest() const {
  std::ifstream in(fs::path(config_.dir) / "latest");
  std::string name;
  in >> name;
  return name;
}

double CheckpointManager::save(const ParamRegistry& reg, const CheckpointBuffers& live, const TrainState& state) {
  const auto t0 = Clock::now();
  wait();  // one save in flight at a time
  if (!config_.async) {
    write_and_publish(reg, live, state, /*threads=*/0);
    return seconds_since(t0);
  }
  // The snapshot is the only part that holds training up.
  const int64_t n = reg.values().numel();
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
  // Every rank learns whether any rank's writer failed.
  int failed = writer_error_.empty() ? 0 : 1, any = 0;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, io_comm_.get());
  if (any) {
    throw Error(writer_error_.empty() ? "writing a checkpoint failed on another rank; the previous checkpoint is kept"
                                      : writer_error_ + "\n  (the previous checkpoint is kept)");
  }
}

void CheckpointManager::write_and_publish(const ParamRegistry& reg, CheckpointBuffers bufs, TrainState state,
                                          int threads) {
  const auto t0 = Clock::now();
  const std::string final_path = path_for(state.step);
  const std::string tmp = final_path + ".tmp";
  MPI_Comm comm = io_comm_.get();
  write_checkpoint(tmp, comm, reg, bufs, state, threads);
  if (grid_.world_rank() == 0) {
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
    // Leftovers of writes that failed earlier.
    for (const auto& e : fs::directory_iterator(config_.dir)) {
      const std::string name = e.path().filename().string();
      if (name.size() > 7 && name.ends_with(".h5.tmp")) fs::remove(e.path());
    }
  }
  MPI_Barrier(comm);
  const double secs = seconds_since(t0);
  const double bytes = double(reg.values().numel()) * 4.0 * (bufs.exp_avg ? 3.0 : 1.0);
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
