#include "train/startup_checks.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "backend/ops.h"
#include "comm/environment.h"
#include "core/error.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "train/layout_check.h"
#include "train/metrics.h"

namespace dstrain {

// A model whose state per rank (model_state_bytes_per_rank) cannot fit the rank's memory
// budget is an error that says so, before anything is allocated.
void check_model_state_fits(const RunConfig& config, const ProcessGrid& grid) {
  const double params = double(config.model.num_parameters());
  const int64_t dp = grid.size(Axis::Data);
  const double need = model_state_bytes_per_rank(config, dp);
  const double budget = config.metrics.memory_budget_gb * 1e9;
  const double have = budget > 0 ? budget : node_memory_bytes() / double(std::max(grid.local_size(), 1));
  const int64_t stage = config.train.zero.stage;
  auto count = [](double p) { return p >= 1e9 ? fmt::format("{:.2f}B", p / 1e9) : fmt::format("{:.2f}M", p / 1e6); };
  auto size = [](double b) { return b >= 1e9 ? fmt::format("{:.1f} GB", b / 1e9) : fmt::format("{:.1f} MB", b / 1e6); };
  DS_CHECK(have <= 0 || need < have,
           "{}: the model has {} parameters, whose weights, gradients and AdamW state need {} per rank at ZeRO stage "
           "{} over {} data-parallel rank(s) ({:.1f} bytes per parameter), more than the {} {}; {}",
           config.source, count(params), size(need), stage, dp, need / params, size(have),
           budget > 0 ? "of metrics.memory_budget_gb" : fmt::format("each of the {} rank(s) on this node has", grid.local_size()),
           stage < 3 ? "shard more with zero_optimization.stage (up to 3), run more data-parallel ranks, or train a "
                       "smaller model"
                     : "run more data-parallel ranks or train a smaller model");
}

// Every rank must train the same thing: a rank whose resolved configuration differs from
// rank 0's (another file, other overrides) is an error on every rank.
void check_same_config(Communicator& world, const RunConfig& c) {
  const std::string text = c.to_json().dump();
  uint64_t h = 1469598103934665603ull;
  for (unsigned char ch : text) h = (h ^ ch) * 1099511628211ull;
  std::vector<uint64_t> all(static_cast<size_t>(world.size()));
  world.all_gather(Tensor(all.data(), DType::U32, Shape{2 * world.size()}), Tensor(&h, DType::U32, Shape{2}));
  for (int r = 1; r < world.size(); ++r) {
    DS_CHECK(all[size_t(r)] == all[0],
             "rank {}'s resolved configuration differs from rank 0's: every rank must be started with the same "
             "config file and --set overrides",
             r);
  }
}

bool is_hdf5_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  char sig[8] = {};
  in.read(sig, 8);
  return in.gcount() == 8 && std::memcmp(sig, "\x89HDF\r\n\x1a\n", 8) == 0;
}

// Dotted keys whose values differ between two JSON objects.
void json_diff(const json& a, const json& b, const std::string& prefix, std::vector<std::string>& out) {
  if (a.is_object() && b.is_object()) {
    std::set<std::string> keys;
    for (const auto& [k, v] : a.items()) keys.insert(k);
    for (const auto& [k, v] : b.items()) keys.insert(k);
    for (const std::string& k : keys) {
      const std::string path = prefix.empty() ? k : prefix + "." + k;
      if (!a.contains(k) || !b.contains(k)) {
        out.push_back(path);
      } else {
        json_diff(a.at(k), b.at(k), path, out);
      }
    }
  } else if (a != b) {
    out.push_back(prefix);
  }
}

// "rank r (host h): value" for rank 0 and the ranks whose value differs from rank 0's, the
// first few of them: a job of a thousand ranks must not bury the message.
std::string differing_ranks(const std::vector<std::string>& values, const std::vector<std::string>& hosts) {
  constexpr int kShown = 8;
  std::string lines;
  int shown = 0, more = 0;
  for (size_t r = 0; r < values.size(); ++r) {
    if (r > 0 && values[r] == values[0]) continue;
    if (shown++ < kShown) {
      lines += fmt::format("\n  rank {} (host {}): {}", r, hosts[r], values[r]);
    } else {
      ++more;
    }
  }
  if (more > 0) lines += fmt::format("\n  and {} more rank(s) that differ from rank 0", more);
  return lines;
}

// Rank 0's `message` on every rank; thrown everywhere when not empty.
void throw_if_root_failed(Communicator& world, const std::string& message) {
  int64_t len = world.rank() == 0 ? int64_t(message.size()) : 0;
  world.broadcast(Tensor(&len, DType::I64, Shape{1}), 0);
  if (len == 0) return;
  std::vector<uint8_t> buf(message.begin(), message.end());
  buf.resize(size_t(len));
  world.broadcast(Tensor(buf.data(), DType::U8, Shape{len}), 0);
  throw Error(std::string(buf.begin(), buf.end()));
}

// Weights with a NaN or Inf cannot be trained from: every step would be skipped.
void check_finite_weights(const ParamRegistry& reg, const std::string& source) {
  std::string report;
  int bad = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const Tensor p = reg.param(id);
    const int64_t n = ops::read_count_non_finite(p);
    if (n > 0 && ++bad <= 5) {
      report += fmt::format("\n  '{}': {} of {} values are NaN or Inf", reg.info(id).name, n, p.numel());
    }
  }
  if (bad > 5) report += fmt::format("\n  and {} more tensor(s)", bad - 5);
  DS_CHECK(bad == 0, "{} holds non-finite weights in {} tensor(s):{}\n  training from them would skip every step; "
           "use weights saved before the run diverged", source, bad, report);
}

// xxh3 of every parameter's values, in registry order.
std::vector<int64_t> weight_hashes(const ParamRegistry& reg) {
  std::vector<int64_t> out(static_cast<size_t>(reg.size()));
#pragma omp parallel for schedule(dynamic)
  for (int id = 0; id < reg.size(); ++id) {
    const ops::HostView p(reg.param(id));
    out[size_t(id)] = int64_t(XXH3_64bits(p.data<float>(), p.get().nbytes()));
  }
  return out;
}

// Every rank must start from the same weights: ranks that loaded different files (another
// directory, a stale copy on a node-local disk) would train a model spliced from both, since
// each checkpoint writes the rows of its own rank. `mine` (weight_hashes) is compared over
// `world`; with skip_experts the routed experts are left out (ranks of an expert group hold
// different ones).
void check_same_weights(Communicator& world, const ParamRegistry& reg, std::vector<int64_t> mine,
                        const std::string& source, bool skip_experts) {
  const int P = reg.size(), n = world.size();
  std::vector<int64_t> all(static_cast<size_t>(P) * size_t(n));
  for (int id = 0; skip_experts && id < P; ++id) {
    if (reg.info(id).placement.kind == Placement::Kind::Expert) mine[size_t(id)] = 0;
  }
  world.all_gather(Tensor(all.data(), DType::I64, Shape{int64_t(all.size())}), Tensor(mine.data(), DType::I64, Shape{P}));
  int first = -1;
  for (int id = 0; id < P && first < 0; ++id) {
    for (int r = 1; r < n; ++r) {
      if (all[size_t(r * P + id)] != all[size_t(id)]) first = id;
    }
  }
  if (first < 0) return;  // the same on every rank, so every rank returns here
  const std::vector<std::string> sources = all_gather_strings(world, source);
  std::vector<std::string> values;
  for (int r = 0; r < n; ++r) {
    values.push_back(fmt::format("{}, xxh3 of {} {:016x}", sources[size_t(r)], reg.info(first).name,
                                 uint64_t(all[size_t(r * P + first)])));
  }
  const std::string lines = differing_ranks(values, all_gather_strings(world, host_name()));
  throw Error(fmt::format("ranks start from different weights (first differing tensor '{}'):{}\n  every rank must "
                          "load identical weights: give every rank the same --init-from, on a filesystem they share "
                          "(or identical copies)",
                          reg.info(first).name, lines));
}

// What identifies a checkpoint file cheaply: its size and the hash of its first and last MiB.
std::string file_fingerprint(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return fmt::format("cannot be opened ({})", std::strerror(errno));
  struct stat st {};
  ::fstat(fd, &st);
  const int64_t size = st.st_size, span = int64_t(1) << 20;
  std::vector<char> buf(static_cast<size_t>(span));
  XXH64_state_t* h = XXH64_createState();
  XXH64_reset(h, 0);
  for (const int64_t off : {int64_t(0), std::max<int64_t>(0, size - span)}) {
    const ssize_t got = ::pread(fd, buf.data(), buf.size(), off_t(off));
    if (got > 0) XXH64_update(h, buf.data(), size_t(got));
  }
  const uint64_t digest = XXH64_digest(h);
  XXH64_freeState(h);
  ::close(fd);
  return fmt::format("{} bytes, xxh64 of its ends {:016x}", size, digest);
}

// Ranks that read one checkpoint collectively must name the same file, and that name must be
// the same file everywhere (not differing copies on node-local disks): otherwise each rank
// reads its rows from another file and the checksums, combined over the ranks, fail.
void check_same_file_on_every_rank(Communicator& world, const std::string& option, const std::string& path) {
  const std::vector<std::string> all =
      all_gather_strings(world, fmt::format("{} {} ({})", option, path, file_fingerprint(path)));
  if (std::all_of(all.begin(), all.end(), [&](const std::string& a) { return a == all[0]; })) return;
  const std::string lines = differing_ranks(all, all_gather_strings(world, host_name()));
  throw Error(fmt::format("ranks were given different checkpoint files:{}\n  every rank must read the same file: pass "
                          "the same {} to every rank, on a filesystem every rank shares",
                          lines, option));
}

// "" when the checkpoint holds the model's tensors with the model's shapes; otherwise what
// differs, in terms of the model configuration. A file that cannot be read is left to the
// load, which says why.
std::string model_mismatch(const std::string& path, const ParamRegistry& reg, const ModelConfig& model) {
  CheckpointInfo info;
  try {
    info = inspect_checkpoint(path, /*verify=*/false);
  } catch (const std::exception&) {
    return "";  // unreadable: reading it says why, and --resume auto then tries an older one
  }
  if (!info.metadata_problems.empty() || !info.state.config.is_object()) return "";
  std::map<std::string, Shape> stored;
  for (const CheckpointTensorInfo& t : info.tensors) {
    if (t.group == "model") stored.emplace(t.name, t.shape);
  }
  std::string tensor;
  for (const ParamInfo& p : reg.all()) {
    auto it = stored.find(p.name);
    if (it == stored.end()) {
      tensor = fmt::format("the checkpoint has no tensor {}", p.name);
      break;
    }
    if (!(it->second == p.global_shape)) {
      tensor = fmt::format("{} is {} in the checkpoint vs {} in the model", p.name, it->second.str(),
                           p.global_shape.str());
      break;
    }
    stored.erase(it);
  }
  if (tensor.empty() && !stored.empty()) {
    tensor = fmt::format("the checkpoint holds {} tensor(s) the model does not have, such as {}", stored.size(),
                         stored.begin()->first);
  }
  if (tensor.empty()) return "";
  std::string fields;
  const json ours = model.to_hf_json(), theirs = info.state.config.value("model", json::object());
  for (const auto& [key, value] : ours.items()) {
    if (theirs.contains(key) && theirs.at(key) != value) {
      fields += fmt::format("{}{} {} in the checkpoint vs {} in the config", fields.empty() ? "" : ", ", key,
                            theirs.at(key).dump(), value.dump());
    }
  }
  return fmt::format("checkpoint '{}' was written for a different model: {}{}\n  resume with the model configuration "
                     "it was written for (`dstrain-ckpt info {}` shows it), or start the new model in another "
                     "checkpoint.dir",
                     path, fields.empty() ? tensor : fields, fields.empty() ? "" : " (" + tensor + ")", path);
}

// Hugging Face weights are written after the last step: a directory that cannot take them
// must stop the run before it trains, not after.
void check_writable_dir(const std::string& dir, const char* what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  DS_CHECK(!ec && std::filesystem::is_directory(dir),
           "{} '{}' cannot be created ({}); Hugging Face weights are written there when training ends: choose a "
           "writable directory",
           what, dir, ec ? ec.message() : "a file of that name exists");
  const std::string probe = (std::filesystem::path(dir) / fmt::format(".dstrain_write_test.{}", ::getpid())).string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  DS_CHECK(fd >= 0,
           "{} '{}' is not writable ({}); Hugging Face weights are written there when training ends: choose a "
           "writable directory",
           what, dir, std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

}  // namespace dstrain
