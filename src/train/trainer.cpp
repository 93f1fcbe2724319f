#include "train/trainer.h"

#include <chrono>
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <cmath>
#include <csignal>
#include <cstring>
#include <thread>
#include <filesystem>
#include <map>
#include <optional>
#include <set>

#include "core/clock.h"
#include "core/log.h"
#include "backend/cuda_device.h"
#include "distributed/routed_comm.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "io/sharded_model_state.h"
#include "backend/ops.h"
#include "train/generate.h"
#include "train/layout_check.h"

namespace dstrain {
namespace {

Tensor tokens_tensor(std::vector<int32_t>& v, int64_t B, int64_t T) { return Tensor(v.data(), DType::I32, Shape{B, T}); }

}  // namespace

double model_state_bytes_per_rank(const RunConfig& config, int64_t dp) {
  // Tensor parallelism splits (nearly) every parameter over the tensor group, except the routed
  // experts, which expert parallelism splits over the expert group; pipeline parallelism splits
  // the layers over the stages (evenly, in this estimate). ZeRO shards the dense parameters over
  // the data axis and the routed experts over the ranks holding the same experts.
  const ModelConfig& mc = config.model;
  double routed = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers + mc.num_nextn_predict_layers; ++l) {
    if (mc.is_moe_layer(l)) routed += 3.0 * double(mc.n_routed_experts * mc.moe_intermediate_size * mc.hidden_size);
  }
  const double tp = double(std::max<int64_t>(config.parallel.tensor, 1));
  const double pp = double(std::max<int64_t>(config.parallel.pipeline, 1));
  const double ep = double(std::max<int64_t>(config.parallel.expert, 1));
  const double dense = (double(mc.num_parameters()) - routed) / tp / pp, experts = routed / ep / pp;
  const double params = dense + experts;
  const double n = double(std::max<int64_t>(dp, 1)), n_experts = std::max(n / ep, 1.0);
  const double sharded = dense / n + experts / n_experts;
  const PrecisionConfig& pc = config.train.precision;
  // Whole weights (4) and their 16-bit compute copy; gradients (4) and a 16-bit all-reduce's
  // wire buffer; fp32 masters and AdamW's two moments (12, the ZeRO paper's K). Stage 0 keeps
  // the weights as the masters (16 bytes in all); ZeRO shards the masters and moments (stage
  // 1), the gradients (2) and the weights (3) over the data-parallel ranks.
  const double compute = pc.compute_dtype() != DType::F32 ? 2 : 0;
  const double wire = pc.communication_dtype() != DType::F32 ? 2 : 0;
  // (Stages 2 and 3 hold 16-bit wire copies only of the gradients being reduced.)
  switch (config.train.zero.stage) {
    case 0: return params * (16 + compute + wire);
    case 1: return params * (4 + compute + 4 + wire) + 12 * sharded;
    case 2: return params * (4 + compute) + 16 * sharded;
    default: return 16 * sharded;
  }
}

namespace {

// The flat buffers a checkpoint writes or reads (weights and AdamW moments), where the host can
// reach them: the buffers themselves in a run on the host; host copies in a run on a device,
// sent back by write_back() after a read. A moment tensor may be undefined (none).
class HostState {
 public:
  HostState(Tensor values, Tensor exp_avg, Tensor exp_avg_sq) {
    values_.emplace(values);
    if (exp_avg.defined()) exp_avg_.emplace(exp_avg);
    if (exp_avg_sq.defined()) exp_avg_sq_.emplace(exp_avg_sq);
  }
  float* values() const { return values_->data<float>(); }
  float* exp_avg() const { return exp_avg_ ? exp_avg_->data<float>() : nullptr; }
  float* exp_avg_sq() const { return exp_avg_sq_ ? exp_avg_sq_->data<float>() : nullptr; }
  void write_back() const {
    values_->write_back();
    if (exp_avg_) exp_avg_->write_back();
    if (exp_avg_sq_) exp_avg_sq_->write_back();
  }

 private:
  std::optional<ops::HostView> values_, exp_avg_, exp_avg_sq_;
};

// The optimizer's state where checkpoints write and read it: the whole local weights and moments
// (stage 0), or every rank its own rows of every tensor (ZeRO).
HostState optimizer_host_state(DistributedOptimizer& z) {
  return HostState(z.master().tensor(), z.exp_avg().tensor(), z.exp_avg_sq().tensor());
}

CheckpointBuffers zero_checkpoint_buffers(DistributedOptimizer& z, const HostState& h) {
  CheckpointBuffers b;
  b.values = h.values();
  b.exp_avg = h.exp_avg();
  b.exp_avg_sq = h.exp_avg_sq();
  b.piece_offsets = std::make_shared<const std::vector<int64_t>>(z.shard_offsets());
  b.numel = z.shard_numel();
  return b;
}

CheckpointTargets zero_checkpoint_targets(DistributedOptimizer& z, const HostState& h) {
  CheckpointTargets t;
  t.values = h.values();
  t.exp_avg = h.exp_avg();
  t.exp_avg_sq = h.exp_avg_sq();
  t.piece_offsets = std::make_shared<const std::vector<int64_t>>(z.shard_offsets());
  return t;
}

// ZeRO's masters and moments in the registry's full local layout (on the masters' device, with
// host views of them): what the tensor, pipeline and expert checkpoint staging reads and
// writes. Gathered from every rank's pieces when `gather`.
struct ZeroLocalState {
  ZeroLocalState(DistributedOptimizer& z, int64_t numel, bool gather = true)
      : values("checkpoint.zero_local_values", MemCategory::Checkpoint, DType::F32, numel, z.master().device()),
        exp_avg("checkpoint.zero_local_exp_avg", MemCategory::Checkpoint, DType::F32, numel, z.master().device()),
        exp_avg_sq("checkpoint.zero_local_exp_avg_sq", MemCategory::Checkpoint, DType::F32, numel,
                   z.master().device()),
        host(prepared(z, gather), exp_avg.tensor(), exp_avg_sq.tensor()) {}
  Buffer values, exp_avg, exp_avg_sq;
  HostState host;  // after the buffers: made from them once they are gathered

 private:
  Tensor prepared(DistributedOptimizer& z, bool gather) {
    if (gather) z.gather_state(values.tensor(), exp_avg.tensor(), exp_avg_sq.tensor());
    return values.tensor();
  }
};

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

}  // namespace

Trainer::Trainer(RunConfig config, ProcessGrid& grid, Device device)
    : config_(std::move(config)), grid_(use_device_communicators(grid, device)), dp_(grid.comm(Axis::Data)) {
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
  // Tensor parallelism: this rank's piece of the model, over the grid's tensor group.
  const int tp = grid_.size(Axis::Tensor);
  const bool sequence_parallel = layout.sequence_parallel;
  tp_ = tp > 1 ? &grid_.comm(Axis::Tensor) : nullptr;
  ProcessGroups groups;
  groups.tp = tp_;
  // Expert parallelism: the routed experts split over the expert group (carved out of the
  // data-parallel ranks), tokens sent to their experts' owners by all-to-alls.
  const int ep = grid_.size(Axis::Expert);
  if (ep > 1) {
    const ModelConfig& mc = config_.model;
    ep_ = &grid_.comm(Axis::Expert);
    groups.ep = ep_;
    if (grid_.world_rank() == 0) {
      // Group-limited routing (V2's device-limited, V3's node-limited) picks topk_group of the
      // n_group expert groups per token; where the groups lie on whole ranks (or nodes) that
      // bounds the ranks a token's rows are sent to.
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
      log::info("expert parallelism: {} routed experts per MoE layer over {} ranks, {} per rank ({}){}",
                mc.n_routed_experts, ep, El, ParamGroupComms::from_grid(grid_).describe(), bound);
    }
  }
  // Pipeline parallelism: the stages, and this rank's chunks of them.
  const int pp = grid_.size(Axis::Pipeline);
  const ParallelConfig& par = config_.parallel;
  std::vector<StageSpec> stages = layout.stages, chunks;
  if (pp > 1) {
    pp_ = &grid_.comm(Axis::Pipeline);
    schedule_ = make_schedule(par.schedule, par.schedule == "interleaved" ? int(par.virtual_stages) : 1);
    chunks = rank_chunks(*schedule_, stages, grid_.coord(Axis::Pipeline), pp);
    if (grid_.world_rank() == 0) {
      log::info("pipeline: {} stages over {} ranks, schedule {}; {}", stages.size(), pp, schedule_->name(),
                describe_stages(stages, piece_costs(config_.model, config_.data.seq_len)));
    }
  }
  model_ = std::make_unique<Transformer>(
      config_.model, device,
      ShardSpec::tensor_parallel(config_.model, grid_.coord(Axis::Tensor), tp, grid_.coord(Axis::Expert), ep,
                                 sequence_parallel),
      groups, chunks);
  if (pp_) runner_ = std::make_unique<PipelineRunner>(*model_, *pp_, *schedule_, stages);
  if (tp_) tp_stats_before_ = tp_->stats();
  // Checkpoints of global tensors from the tensor pieces, pipeline stages and expert owners.
  if (tp_ || pp_ || ep_) sharded_ckpt_ = std::make_unique<ShardedModelCheckpoint>(model_->params(), grid_);
  const ZeroConfig& zc = config_.train.zero;
  const PrecisionConfig& precision = config_.train.precision;
  scaler_ = std::make_unique<LossScaler>(precision.fp16_scaler, precision.fp16);
  // The tensor group's partial gradients are summed before the data-parallel buckets see them.
  tp_sync_ = std::make_unique<TensorParallelGradSync>(model_->params(), tp_);
  if (zc.stage >= 2) tp_sync_->sum_every_micro_step();
  if (tp_sync_->needed()) param_hooks_.add(*tp_sync_);
  // One optimizer for every stage: each rank reduces and (from stage 1) shards its local pieces
  // per parameter group, dense over the data axis, routed experts over the ranks holding the
  // same experts. Without other axes a ZeRO checkpoint splits every tensor over the world's
  // ranks as ZeRO splits it over the data-parallel ones, and each rank writes and reads exactly
  // its own shard; with them, through the staging of the tensor, pipeline and expert pieces
  // (sharded_ckpt_).
  DS_CHECK(zc.stage == 0 || sharded_ckpt_ || (grid_.world_size() == dp_.size() && dp_.rank() == grid_.world_rank()),
           "zero_optimization.stage {} needs every rank on the data-parallel axis ({} of {} are)", zc.stage,
           dp_.size(), grid_.world_size());
  optimizer_ = std::make_unique<DistributedOptimizer>(zc, config_.train.adamw, model_->params(),
                                                      ParamGroupComms::from_grid(grid_), precision.communication_dtype());
  param_hooks_.add(*optimizer_);
  if (zc.stage >= 1) log::info("{}", optimizer_->describe());
  if (runner_) {
    final_hooks_ = std::make_unique<FinalGradHooks>(param_hooks_, model_->params().size());
    model_->set_hooks(final_hooks_.get());
  } else {
    model_->set_hooks(&param_hooks_);
    schedule_ = make_schedule(config_.train.micro_batch_schedule);
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

namespace {

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
                        const std::string& source, bool skip_experts = false) {
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

}  // namespace

void Trainer::claim_output_dirs() {
  std::string error;
  if (grid_.world_rank() == 0) {
    try {
      namespace fs = std::filesystem;
      locks_.push_back(std::make_unique<RunLock>(config_.output.dir));
      // A checkpoint.dir outside output.dir may be shared with another run's output.dir.
      const fs::path out = fs::weakly_canonical(config_.output.dir), ck = fs::weakly_canonical(config_.checkpoint.dir);
      if (ck != out) locks_.push_back(std::make_unique<RunLock>(config_.checkpoint.dir));
      if (!config_.output.save_hf.empty()) check_writable_dir(config_.output.save_hf, "output.save_hf (--save-hf)");
    } catch (const std::exception& e) {
      locks_.clear();
      error = e.what();
    }
  }
  throw_if_root_failed(grid_.world(), error);
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

void Trainer::init_weights(const std::string& init_from) {
  const bool checkpoint = !init_from.empty() && std::filesystem::is_regular_file(init_from) && is_hdf5_file(init_from);
  // A checkpoint is read collectively: no rank may take another way.
  if (grid_.world().all_reduce_value<int32_t>(checkpoint ? 1 : 0, ReduceOp::Max) > 0) {
    check_same_file_on_every_rank(grid_.world(), "--init-from", init_from);
  }
  load_weights(init_from, checkpoint);
  ParamRegistry& reg = model_->params();
  // A stage's copy of the tied embedding takes the owner's values (a checkpoint holds the
  // owner's only).
  if (runner_ && runner_->has_tie()) runner_->copy_tied({reg.param(runner_->tied_param())});
  if (checkpoint) check_finite_weights(reg, "checkpoint '" + init_from + "'");
  // Over the data-parallel ranks: those hold the same pieces (tensor ranks hold different ones);
  // with expert parallelism the same routed experts only where the expert coordinate agrees.
  const std::string source = init_from.empty() ? fmt::format("initialised from train.seed {}", config_.train.seed)
                                               : "--init-from " + init_from;
  const std::vector<int64_t> hashes = weight_hashes(reg);
  check_same_weights(dp_, reg, hashes, source, /*skip_experts=*/ep_ != nullptr);
  if (ep_) check_same_weights(grid_.expert_data(), reg, hashes, source);
  apply_precision();
  optimizer_->adopt_weights();  // each rank keeps its pieces (stage 3: and hands the rest back)
}

void Trainer::apply_precision() {
  const PrecisionConfig& pc = config_.train.precision;
  const DType dt = pc.compute_dtype();
  if (model_->compute_dtype() != dt) {
    model_->set_compute_dtype(dt);  // makes the compute copy from the masters as they are now
  } else if (dt != DType::F32) {
    model_->params().refresh_compute();
  }
  if (precision_logged_) return;
  precision_logged_ = true;
  if (dt == DType::F32) {
    if (pc.communication_dtype() != DType::F32) {
      log::info("precision: fp32; gradients all-reduced in {}", pc.communication_data_type);
    }
    return;
  }
  std::string scaling;
  if (scaler_->enabled()) {
    const LossScalerConfig& s = pc.fp16_scaler;
    scaling = s.dynamic() ? fmt::format("; dynamic loss scale from {} (window {}, hysteresis {}, minimum {})",
                                        scaler_->scale(), s.loss_scale_window, s.hysteresis, s.min_loss_scale)
                          : fmt::format("; static loss scale {}", s.loss_scale);
  }
  log::info("precision: {} compute, fp32 master weights, gradients and AdamW moments; gradients all-reduced in {}{}",
            pc.name(), pc.communication_data_type, scaling);
}

void Trainer::load_weights(const std::string& init_from, bool checkpoint) {
  if (init_from.empty()) {
    model_->init_weights(config_.train.seed);
    log::info("initialised {} parameters (seed {})", model_->config().num_parameters(), config_.train.seed);
    return;
  }
  if (checkpoint) {
    TrainState st;
    const HostState host(model_->params().values().tensor(), Tensor(), Tensor());
    if (sharded_ckpt_) {
      st = read_checkpoint(init_from, ckpt_->io_comm(), file_registry(), sharded_ckpt_->targets(false));
      sharded_ckpt_->unstage(host.values(), nullptr, nullptr);
      sharded_ckpt_->release();
    } else {
      CheckpointTargets whole;
      whole.values = host.values();
      st = read_checkpoint(init_from, ckpt_->io_comm(), model_->params(), whole);
    }
    host.write_back();
    log::info("loaded the model of checkpoint {} (step {}); optimizer state and position start afresh", init_from,
              st.step);
    return;
  }
  // The directory's architecture, when it states one, must be the configured one.
  const auto cfg_path = std::filesystem::path(init_from) / "config.json";
  if (std::filesystem::is_directory(init_from) && std::filesystem::exists(cfg_path)) {
    const json theirs = load_hf_config(cfg_path.string()).to_hf_json();
    const json ours = config_.model.to_hf_json();
    for (const auto& [key, value] : ours.items()) {
      if (key == "torch_dtype" || key == "eos_token_id" || key == "bos_token_id") continue;
      DS_CHECK(theirs.contains(key) && theirs.at(key) == value,
               "--init-from {}: its config.json has {} = {} but the run's model has {}; use the same architecture",
               init_from, key, theirs.contains(key) ? theirs.at(key).dump() : "nothing", value.dump());
    }
  }
  // Every rank reads the files itself: they are identical, and this needs no broadcast of
  // the whole model.
  auto counts = load_hf_weights(init_from, model_->params(), sharded_ckpt_ ? &file_registry() : nullptr, &grid_.world());
  log::info("loaded {} tensors from {}", counts.loaded, init_from);
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
  timed_collective([&] { dp_.all_reduce(Tensor(counts.data(), DType::I64, Shape{int64_t(counts.size())})); });
  DS_CHECK(counts[0] > 0, "step {}: the global batch has no target tokens (all are the ignore index)", step_ + 1);
  return counts;
}

LossScales Trainer::loss_scales(const std::vector<int64_t>& counts) const {
  const TrainConfig& tc = config_.train;
  // An injected NaN goes into this rank's gradients before they are reduced, as a real one
  // would, so every rank sees it.
  LossScales scales;
  scales.token = fault_at_this_step(&FaultInjection::nan_at_step) ? NAN : float(1.0 / double(counts[0]));
  scales.sequence = 1.0 / double(tc.train_batch_size);
  scales.micro_batch = 1.0 / double(tc.grad_accum * dp_.size());
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
      if (fault_at_this_step(&FaultInjection::oom_at_step) && !oom_fault_fired_) {
        oom_fault_fired_ = true;
        throw OutOfMemory(fmt::format("fault injection: allocation failure at step {}", step_ + 1));
      }
      for (const LossSums& s : runner_->run_step(micro, scales, timeline_.get(), step_ + 1)) {
        sums[0] += s.sum;
        sums[1] += double(s.count);
        for (int k = 0; k < D && k < int(s.mtp_sum.size()); ++k) sums[size_t(3 + k)] += s.mtp_sum[size_t(k)];
      }
    } catch (const OutOfMemory& e) {
      throw Error(fmt::format("{}; a pipeline stage cannot retry the step with a smaller micro-batch while the other "
                              "stages wait for it: lower train.train_micro_batch_size_per_gpu",
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
          optimizer_->begin_forward();
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
                              "smaller micro-batch: lower train.train_micro_batch_size_per_gpu",
                              e.what(), optimizer_->stage()));
    }
    model_->release_activations();
    sums[2] = 1;
    begin_micro_step(/*communicates=*/true);
    return e.what();
  }
  return "";
}

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
    timed_collective([&] { dp_.all_reduce(Tensor(routing.data(), DType::F64, Shape{int64_t(routing.size())})); });
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
  // The clipping coefficient (of the unscaled norm) and the loss-scale unscale are applied by
  // AdamW as it reads each gradient: no pass over the gradients of their own.
  const double clip = tc.gradient_clipping > 0 ? clip_coefficient(tc.gradient_clipping, r.grad_norm) : 1.0;
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
  tp_sync_->begin_micro_step(communicates);
  optimizer_->begin_micro_step(communicates);
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
  constexpr int kPer = 6;
  double mine[kPer] = {r.step_seconds,
                       r.step_seconds - r.exposed_comm_seconds,
                       double(usage.ru_maxrss) * 1024.0,
                       held(MemCategory::Parameters) + held(MemCategory::Gradients) +
                           held(MemCategory::OptimizerState) + held(MemCategory::GatheredParameters),
                       double(reg.group_numel(ParamGroup::Dense)),
                       double(reg.group_numel(ParamGroup::Expert))};
  std::vector<double> all(static_cast<size_t>(kPer * W));
  grid_.world().all_gather(Tensor(all.data(), DType::F64, Shape{kPer * W}), Tensor(mine, DType::F64, Shape{kPer}));
  for (int k = 0; k < W; ++k) {
    const double* x = all.data() + kPer * k;
    r.rank_step_seconds.push_back(x[0]);
    r.rank_compute_seconds.push_back(x[1]);
    r.rank_peak_rss_bytes.push_back(x[2]);
    r.rank_model_state_bytes.push_back(x[3]);
    r.rank_local_params.push_back({int64_t(x[4]), int64_t(x[5])});
  }
}

bool Trainer::train_step(StepRecord& r) {
  const auto t0 = Clock::now();
  const TrainConfig& tc = config_.train;
  inject_process_faults();
  collective_wait_seconds_ = 0;
  // The whole step's micro-batches come at once (read ahead by the pipeline): the loss is the
  // mean over every target token of the global batch, so each backward needs the global
  // token count.
  StepData data = data_pipeline().next();
  const double data_wait = data_pipeline().take_wait_seconds();
  const std::vector<int64_t> counts = count_targets(data);
  const LossScales scales = loss_scales(counts);
  for (auto& [l, ffn] : model_->moe_layers()) ffn->routing()->reset();

  optimizer_->begin_step();
  const int D = int(config_.model.num_nextn_predict_layers);
  // loss sum, target count, ranks out of memory, then the MTP loss sum per depth
  std::vector<double> sums(size_t(3 + D), 0.0);
  const std::string oom = forward_backward(data, scales, sums);
  ReduceTimings rt;
  {
    const Timeline::Scope recorded(timeline_.get(), "reduce", step_ + 1, -1);
    tp_sync_->finish();
    rt = optimizer_->finish();
    // The tied embedding's two stages add their (data-parallel reduced) gradients: the whole
    // ones, or at ZeRO stages 2 and 3 the two stages' identical pieces of them (the sum is linear).
    if (runner_ && runner_->has_tie()) {
      timed_collective([&] {
        if (optimizer_->reduces_into_shard()) {
          runner_->reduce_tied_grads(optimizer_->grad_piece(runner_->tied_param()));
        } else {
          runner_->reduce_tied_grads();
        }
      });
    }
  }
  timed_collective([&] { dp_.all_reduce(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())})); });
  // The loss is the last stage's: every stage gets it (the others add zeros).
  if (pp_) timed_collective([&] { pp_->all_reduce(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())})); });
  if (sums[2] > 0) {
    shrink_micro_batch(oom.empty() ? fmt::format("{:.0f} rank(s) ran out of memory", sums[2])
                                   : fmt::format("{} (and {:.0f} rank(s) in all)", oom, sums[2]),
                       step_, data.blend_before);
    return false;
  }

  r = StepRecord{};
  r.step = step_ + 1;
  // The step's loss: CE + the MoE layers' auxiliary terms + the weighted MTP losses.
  r.ce_loss = sums[0] / sums[1];
  for (int k = 0; k < D; ++k) {
    const int64_t ck = counts[size_t(1 + k)];
    if (ck > 0) r.mtp_loss += tc.mtp_loss_weight / double(D) * sums[size_t(3 + k)] / double(ck);
  }
  reduce_routing_stats(r);
  r.loss = r.ce_loss + r.aux_loss + r.mtp_loss;
  {
    // Each global element counted on one rank: the optimizer's pieces split each group's local
    // pieces over its data-parallel ranks, and a pipeline copy or a tensor rank holding a
    // replicated parameter does not count.
    const ParamRegistry& reg = model_->params();
    std::vector<char> counted(size_t(reg.size()));
    const int tp_rank = tp_ ? tp_->rank() : 0, tp_size = ProcessGroups::size_of(tp_);
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      counted[size_t(id)] = !p.pipeline_copy && counts_piece(p, tp_rank, tp_size);
    }
    double sq = optimizer_->local_grad_sum_squares(counted);
    if (grid_.world_size() > 1) timed_collective([&] { sq = grid_.world().all_reduce_value<double>(sq); });
    r.grad_norm = std::sqrt(sq);
  }
  // As DeepSpeed, a step skipped for an fp16 overflow does not advance the learning-rate
  // schedule (one skipped as a fault does).
  r.lr = tc.schedule.lr_at(step_ - overflow_steps_, tc.adamw.lr);
  r.loss_scale = scaler_->scale();
  if (scaler_->enabled()) {
    // fp16: an overflow on any rank skips the step everywhere and lowers the scale; it is not
    // a fault (no count against resilience.max_skipped_steps).
    r.overflow = gradients_overflowed(r.grad_norm);
    r.grad_norm /= r.loss_scale;
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
    if (!r.skipped) update_weights(r);
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
  if (tp_) {
    const CommStats now = tp_->stats();
    r.tp_comm_seconds = now.busy_seconds - tp_stats_before_.busy_seconds;
    r.tp_comm_bytes = now.bytes - tp_stats_before_.bytes;
    r.tp_comm_ops = int64_t(now.ops - tp_stats_before_.ops);
    r.tp_grad_sync_seconds = tp_sync_->take_seconds();
    tp_stats_before_ = now;
  }
  if (runner_) {
    const PipelineRunner::Traffic t = runner_->take_traffic();
    r.pp_comm_bytes = t.bytes_sent + t.bytes_received;
    r.pp_recv_wait_seconds = t.recv_wait_seconds;
    r.pp_messages = t.messages;
  }
  gather_rank_timings(r);
  return true;
}

void Trainer::shrink_micro_batch(const std::string& why, int64_t step, const json& blend_before) {
  TrainConfig& tc = config_.train;
  DS_CHECK(config_.resilience.oom_fallback,
           "step {}: {}; lower train.train_micro_batch_size_per_gpu or enable resilience.oom_fallback", step + 1, why);
  DS_CHECK(tc.micro_batch % 2 == 0,
           "step {}: {}; the micro-batch of {} cannot be halved while keeping the global batch: lower "
           "train.train_micro_batch_size_per_gpu",
           step + 1, why, tc.micro_batch);
  tc.micro_batch /= 2;
  tc.grad_accum *= 2;
  log::warn("step {}: {}: micro-batch halved to {} with {} accumulation steps (global batch {} unchanged); the step "
            "runs again",
            step + 1, why, tc.micro_batch, tc.grad_accum, tc.train_batch_size);
  model_->release_activations();
  model_->params().grads().zero();
  data_pipeline().reconfigure(tc.micro_batch, tc.grad_accum, step, blend_before);
}

void Trainer::apply_activation_budget() {
  const double budget = config_.resilience.activation_budget_mb * 1e6;
  if (budget <= 0) return;
  TrainConfig& tc = config_.train;
  // The same arithmetic on every rank: no agreement needed.
  while (double(model_->activation_bytes(tc.micro_batch, config_.data.seq_len)) > budget) {
    const double need = double(model_->activation_bytes(tc.micro_batch, config_.data.seq_len)) / 1e6;
    DS_CHECK(config_.resilience.oom_fallback && tc.micro_batch % 2 == 0,
             "a micro-batch of {} x {} tokens needs {:.0f} MB of activations, over the budget of {:.0f} MB; lower "
             "train.train_micro_batch_size_per_gpu or raise resilience.activation_budget_mb",
             tc.micro_batch, config_.data.seq_len, need, budget / 1e6);
    tc.micro_batch /= 2;
    tc.grad_accum *= 2;
    log::warn("a micro-batch needs {:.0f} MB of activations, over the budget of {:.0f} MB: micro-batch halved to {} "
              "with {} accumulation steps (global batch {} unchanged)",
              need, budget / 1e6, tc.micro_batch, tc.grad_accum, tc.train_batch_size);
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
    m.extra["ranks"] = {{"model_state_bytes", r.rank_model_state_bytes},
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
  if (tp_) {
    m.extra["tensor_parallel"] = {{"size", tp_->size()},
                                  {"sequence_parallel", model_->shard().sequence_parallel},
                                  {"comm_s", r.tp_comm_seconds},
                                  {"comm_bytes", r.tp_comm_bytes},
                                  {"collectives", r.tp_comm_ops},
                                  {"grad_sync_s", r.tp_grad_sync_seconds},
                                  {"activation_bytes", model_->activations().bytes_allocated()}};
  }
  if (runner_) {
    // Rank 0's stage: its point-to-point traffic and the time it waited for the others.
    m.extra["pipeline"] = {{"size", pp_->size()},
                           {"schedule", schedule_->name()},
                           {"stages", runner_->num_stages()},
                           {"comm_bytes", r.pp_comm_bytes},
                           {"messages", r.pp_messages},
                           {"recv_wait_s", r.pp_recv_wait_seconds},
                           {"activation_bytes", model_->activations().bytes_allocated()}};
  }
  if (ep_) {
    // Every data-parallel rank's received rows; rank 0's all-to-all traffic and time split.
    m.extra["expert_parallel"] = {{"size", ep_->size()},
                                  {"received_rows", r.ep.received_rows},
                                  {"received_max_over_mean", r.ep.received_max_over_mean()},
                                  {"imbalanced", r.ep.received_max_over_mean() > kExpertImbalance},
                                  {"a2a_bytes", r.ep.a2a_bytes},
                                  {"a2a_s", r.ep.dispatch_seconds + r.ep.combine_seconds},
                                  {"dispatch_s", r.ep.dispatch_seconds},
                                  {"expert_s", r.ep.expert_seconds},
                                  {"combine_s", r.ep.combine_seconds}};
  }
  {
    // Rank 0's optimizer state (ZeRO's shard), with the step's peaks of what is only held while
    // in use.
    const ZeroMemory z = optimizer_->memory();
    m.extra["zero"] = {{"stage", optimizer_->stage()},
                       {"shard_elements", optimizer_->shard_numel()},
                       {"master_bytes", z.master},
                       {"optimizer_bytes", z.optimizer},
                       {"grad_shard_bytes", z.grad_shard},
                       {"gathered_bytes", z.gathered},
                       {"gathered_peak_bytes", z.gathered_peak},
                       {"transient_grad_bytes", z.transient_grads},
                       {"transient_grad_peak_bytes", z.transient_grads_peak},
                       {"comm_buffer_bytes", z.comm_buffers}};
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

Trainer::Outcome Trainer::train() {
  if (model_->compute_dtype() != config_.train.precision.compute_dtype()) apply_precision();
  apply_activation_budget();
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

TrainState Trainer::state() {
  DataPipeline& data = data_pipeline();
  TrainState st;
  st.step = step_;
  st.consumed_samples = consumed_samples_;
  st.consumed_tokens = consumed_samples_ * config_.data.seq_len;
  st.optimizer_steps = optimizer_steps();
  st.scheduler = config_.train.schedule.to_json();
  st.scheduler["last_batch_iteration"] = step_ - 1 - overflow_steps_;
  if (overflow_steps_ > 0) st.scheduler["skipped_for_overflow"] = overflow_steps_;
  st.scheduler["base_lr"] = config_.train.adamw.lr;
  // dstrain's randomness is counter-based: a seed and a position say everything.
  st.rng = {{"generator", "philox4x32-10"},
            {"seed", config_.train.seed},
            {"parameter_init", "stream FNV-1a(HF parameter name), element index"},
            {"shuffle", "stream FNV-1a(\"dstrain.shuffle\") + epoch, derived from consumed_samples"},
            {"generate_seed", config_.generate.seed}};
  // The position: samples drawn from each training dataset (the blender's state); each
  // dataset's epoch and order follow from its count and the seed.
  json sets = json::array();
  for (size_t i = 0; i < data.train_sets().size(); ++i) {
    const SampleDataset& d = *data.train_sets()[i];
    const int64_t drawn = data.drawn()[i];
    sets.push_back({{"name", data.train_sources()[i].name},
                    {"describe", d.describe()},
                    {"samples_drawn", drawn},
                    {"epoch", drawn / d.samples_per_epoch()},
                    {"samples_per_epoch", d.samples_per_epoch()},
                    {"num_tokens", d.num_tokens()}});
  }
  st.data = {{"consumed_samples", consumed_samples_},
             {"seq_len", config_.data.seq_len},
             {"shuffle", config_.data.shuffle},
             {"blend", data.blend_state()},
             {"datasets", sets}};
  st.config = config_.to_json();
  st.environment = environment_.record;
  if (scaler_->enabled()) st.loss_scaler = scaler_->state();
  st.layout = {{"world_size", grid_.world_size()},
               {"data", grid_.size(Axis::Data)},
               {"tensor", grid_.size(Axis::Tensor)},
               {"pipeline", grid_.size(Axis::Pipeline)},
               {"expert", grid_.size(Axis::Expert)},
               {"sequence_parallel", model_->shard().sequence_parallel},
               {"schedule", pp_ ? json(schedule_->name()) : json()},
               {"partition", sharded_ckpt_
                                 ? "the ranks of data coordinate 0 (for a routed expert: of its expert rank) wrote, "
                                   "tensor rank t of the pipeline stage holding a global tensor rows "
                                   "[R*t/T, R*(t+1)/T) of its dimension 0"
                                 : "each rank wrote rows [R*r/N, R*(r+1)/N) of dimension 0 of every tensor"}};
  return st;
}

std::string Trainer::unsafe_to_save() {
  if (skipped_in_a_row_ > 0) {
    return fmt::format("step {} was skipped ({}, {} in a row)", step_, last_skip_reason_, skipped_in_a_row_);
  }
  // An overflow leaves the weights as they were, but a run that keeps overflowing is diverging
  // (a NaN loss is an overflow in fp16): its state must not rotate the good checkpoints away.
  if (last_overflowed_) {
    return fmt::format("step {}'s fp16 gradients overflowed (the step was skipped; loss scale now {})", step_,
                       scaler_->scale());
  }
  // Every rank holds the whole state (with ZeRO: its shard); each looks at it, and all agree.
  const Buffer& weights = optimizer_->master();
  const Buffer& m = optimizer_->exp_avg();
  const Buffer& v = optimizer_->exp_avg_sq();
  int64_t bad[3] = {ops::read_count_non_finite(weights.tensor()), ops::read_count_non_finite(m.tensor()),
                    ops::read_count_non_finite(v.tensor())};
  grid_.world().all_reduce(Tensor(bad, DType::I64, Shape{3}), ReduceOp::Max);
  if (bad[0]) return fmt::format("the weights after step {} hold non-finite values", step_);
  if (bad[1] || bad[2]) return fmt::format("AdamW's moments after step {} hold non-finite values", step_);
  return "";
}

double Trainer::save_checkpoint() {
  const std::string unsafe = unsafe_to_save();
  if (!unsafe.empty()) {
    save_deferred_ = true;
    ckpt_->wait();  // a save in flight is the newest one kept: list it
    const std::vector<std::string> kept = ckpt_->list();
    log::warn("checkpoint of step {} deferred until a step succeeds: {}; {}", step_, unsafe,
              kept.empty() ? std::string("no checkpoint exists yet")
                           : "the newest checkpoint, " + kept.front() + ", stays and is not rotated away");
    return 0;
  }
  save_deferred_ = false;
  ParamRegistry& reg = model_->params();
  CheckpointBuffers live;
  std::optional<HostState> host;  // what `live` points into, until the save has it
  const bool sharded = optimizer_->stage() >= 1;
  if (sharded && sharded_ckpt_) {
    // ZeRO under tensor, pipeline or expert splits: the full local state gathered from the
    // pieces (transient: three times the local model), then staged as without ZeRO.
    const ZeroLocalState full(*optimizer_, reg.flat_numel());
    live = sharded_ckpt_->stage(full.host.values(), full.host.exp_avg(), full.host.exp_avg_sq());
  } else {
    host.emplace(optimizer_host_state(*optimizer_));
    live.values = host->values();
    live.exp_avg = host->exp_avg();
    live.exp_avg_sq = host->exp_avg_sq();
    if (sharded) live = zero_checkpoint_buffers(*optimizer_, *host);
    // Tensor parallelism: the global tensors' row blocks, staged by the data-0 tensor group.
    if (sharded_ckpt_) live = sharded_ckpt_->stage(live.values, live.exp_avg, live.exp_avg_sq);
  }
  const double stall = ckpt_->save(file_registry(), live, state());
  if (sharded_ckpt_) sharded_ckpt_->release();  // written, or copied by the asynchronous writer
  last_saved_step_ = step_;
  last_save_time_ = clock();
  return stall;
}

bool Trainer::checkpoint_due(int64_t step) {
  const CheckpointConfig& c = config_.checkpoint;
  bool due = c.interval_steps > 0 && step % c.interval_steps == 0;
  if (c.interval_minutes > 0) {
    // Clocks differ between ranks: rank 0 decides for everyone.
    const double since = std::chrono::duration<double>(clock() - last_save_time_).count();
    int by_time = since >= c.interval_minutes * 60.0 ? 1 : 0;
    grid_.world().broadcast(Tensor(&by_time, DType::I32, Shape{1}), 0);
    due = due || by_time;
  }
  return due;
}

bool Trainer::resume(const std::string& spec) {
  const bool automatic = spec == "auto";
  std::vector<std::string> candidates = automatic ? ckpt_->list() : std::vector<std::string>{spec};
  const std::string latest = automatic ? ckpt_->latest() : "";
  const std::string& dir = config_.checkpoint.dir;
  if (automatic) {
    // Every rank must take the same way: a checkpoint.dir on node-local disks may differ.
    std::string view = "checkpoint.dir " + dir + " holds";
    for (const std::string& c : candidates) view += " " + std::filesystem::path(c).filename().string();
    if (candidates.empty()) view += " no checkpoint" + (latest.empty() ? "" : " (latest: " + latest + ")");
    const std::vector<std::string> views = all_gather_strings(grid_.world(), view);
    if (std::any_of(views.begin(), views.end(), [&](const std::string& v) { return v != views[0]; })) {
      const std::string lines = differing_ranks(views, all_gather_strings(grid_.world(), host_name()));
      throw Error(fmt::format("--resume auto: ranks see different checkpoints:{}\n  checkpoint.dir must be on a "
                              "filesystem every rank shares",
                              lines));
    }
  }
  if (candidates.empty()) {
    // `latest` moves only after a checkpoint is complete: the run reached that step, and
    // starting again from scratch would silently throw its training away.
    DS_CHECK(latest.empty(),
             "--resume auto: {}/latest says this run completed checkpoint {}, but {} holds no checkpoint (were they "
             "deleted or moved?); restore the checkpoint files to continue the run, or remove {}/latest to start a "
             "new run in this directory",
             dir, latest, dir, dir);
    log::info("no checkpoint in {}: starting a new run", dir);
    return false;
  }
  if (automatic && !latest.empty() && latest > std::filesystem::path(candidates.front()).filename().string() &&
      grid_.world_rank() == 0) {
    log::warn("{}/latest names {}, which is missing: resuming from the newest checkpoint present, {}", dir, latest,
              candidates.front());
  }
  ParamRegistry& reg = model_->params();
  const bool sharded = optimizer_->stage() >= 1;
  for (const std::string& path : candidates) {
    TrainState st;
    const auto t0 = Clock::now();
    check_same_file_on_every_rank(grid_.world(), "--resume", path);
    throw_if_root_failed(grid_.world(),
                         grid_.world_rank() == 0 ? model_mismatch(path, file_registry(), config_.model) : "");
    try {
      if (sharded && sharded_ckpt_) {
        // ZeRO under tensor, pipeline or expert splits: the full local state from the staging,
        // the tied copy's from its owner, then this rank's pieces of it.
        ZeroLocalState full(*optimizer_, reg.flat_numel(), /*gather=*/false);
        st = read_checkpoint(path, ckpt_->io_comm(), file_registry(), sharded_ckpt_->targets(true));
        sharded_ckpt_->unstage(full.host.values(), full.host.exp_avg(), full.host.exp_avg_sq());
        sharded_ckpt_->release();
        full.host.write_back();
        if (runner_ && runner_->has_tie()) {
          const ParamInfo& p = reg.info(runner_->tied_param());
          runner_->copy_tied({full.values.tensor(p.offset, p.shape), full.exp_avg.tensor(p.offset, p.shape),
                              full.exp_avg_sq.tensor(p.offset, p.shape)});
        }
        optimizer_->scatter_state(full.values.tensor(), full.exp_avg.tensor(), full.exp_avg_sq.tensor());
      } else {
        const HostState host = optimizer_host_state(*optimizer_);
        if (sharded) {
          st = read_checkpoint(path, ckpt_->io_comm(), reg, zero_checkpoint_targets(*optimizer_, host));
        } else if (sharded_ckpt_) {
          st = read_checkpoint(path, ckpt_->io_comm(), file_registry(), sharded_ckpt_->targets(true));
          sharded_ckpt_->unstage(host.values(), host.exp_avg(), host.exp_avg_sq());
          sharded_ckpt_->release();
        } else {
          CheckpointTargets whole;
          whole.values = host.values();
          whole.exp_avg = host.exp_avg();
          whole.exp_avg_sq = host.exp_avg_sq();
          st = read_checkpoint(path, ckpt_->io_comm(), reg, whole);
        }
        host.write_back();
      }
    } catch (const Error& e) {
      if (spec != "auto") throw;
      if (grid_.world_rank() == 0) log::warn("skipping invalid checkpoint: {}", e.what());
      continue;
    }
    if (sharded) {
      // The masters are this rank's pieces only: the check is over every rank's.
      const int64_t bad =
          grid_.world().all_reduce_value<int64_t>(ops::read_count_non_finite(optimizer_->master().tensor()));
      DS_CHECK(bad == 0, "checkpoint '{}': {} weight values are NaN or Inf; resume from an earlier checkpoint", path, bad);
    } else {
      check_finite_weights(reg, "checkpoint '" + path + "'");
    }
    if (runner_ && runner_->has_tie() && !sharded) {
      const int id = runner_->tied_param();
      const ParamInfo& p = reg.info(id);
      runner_->copy_tied({reg.param(id), optimizer_->exp_avg().tensor(p.offset, p.shape),
                          optimizer_->exp_avg_sq().tensor(p.offset, p.shape)});
    }
    restore_precision_state(st, path);
    step_ = st.step;
    overflow_steps_ = st.scheduler.is_object() ? st.scheduler.value("skipped_for_overflow", int64_t(0)) : 0;
    resumed_ = true;
    consumed_samples_ = st.consumed_samples;
    optimizer_->set_steps_taken(st.optimizer_steps);
    last_saved_step_ = step_;
    last_save_time_ = Clock::now();
    DataPipeline& data = data_pipeline();
    resume_blend_ = st.data.value("blend", json());
    const json sets = st.data.value("datasets", json::array());
    bool same = sets.size() == data.train_sets().size() && st.data.value("seq_len", int64_t(-1)) == config_.data.seq_len;
    for (size_t i = 0; same && i < sets.size(); ++i) {
      same = sets[i].value("samples_per_epoch", int64_t(-1)) == data.train_sets()[i]->samples_per_epoch();
    }
    if (!same && grid_.world_rank() == 0) {
      log::warn("the training data differs from the checkpoint's (datasets, their sizes or seq_len): the sample "
                "sequence does not continue exactly");
    }
    std::vector<std::string> changed;
    json_diff(st.config, config_.to_json(), "", changed);
    if (!changed.empty()) {
      std::string keys;
      for (const std::string& k : changed) keys += (keys.empty() ? "" : ", ") + k;
      log::info("configuration changed since the checkpoint: {}", keys);
    }
    const double secs = seconds_since(t0);
    // The file's tensors (weights and both moments), global whatever this rank holds of them.
    const double mb = double(file_registry().global_numel()) * 12.0 / 1e6;
    log::info("resumed from {} at step {} ({} samples consumed; written by {} rank(s), now {}); read and verified "
              "{:.0f} MB in {:.2f} s ({:.0f} MB/s)",
              path, step_, consumed_samples_, st.layout.value("world_size", 0), grid_.world_size(), mb, secs,
              mb / std::max(secs, 1e-9));
    apply_precision();
    optimizer_->publish_weights();  // the whole weights (stage 3: the persistent ones) from the shards
    return true;
  }
  throw Error(fmt::format("none of the {} checkpoint(s) in {} is valid (see the warnings above); move them away or "
                          "start without --resume",
                          candidates.size(), config_.checkpoint.dir));
}

void Trainer::restore_precision_state(const TrainState& st, const std::string& path) {
  // The precision of the run that wrote the checkpoint, from its resolved configuration.
  const json train = st.config.is_object() ? st.config.value("train", json::object()) : json::object();
  auto enabled = [&](const char* key) {
    return train.contains(key) && train[key].is_object() && train[key].value("enabled", false);
  };
  const std::string theirs = enabled("bf16") ? "bf16" : enabled("fp16") ? "fp16" : "fp32";
  const std::string ours = config_.train.precision.name();
  const bool has_scaler = st.loss_scaler.is_object();
  if (has_scaler && scaler_->enabled()) scaler_->load_state(st.loss_scaler, "checkpoint '" + path + "'");
  if (theirs == ours && (has_scaler || !scaler_->enabled())) return;
  // Checkpoints hold the fp32 masters and moments whatever the precision: switching is exact.
  std::string note = fmt::format("precision: checkpoint {} was written by a {} run; this run trains in {} from its fp32 "
                                 "master weights and AdamW moments",
                                 path, theirs, ours);
  if (scaler_->enabled() && !has_scaler) note += fmt::format(", the loss scale starting at {}", scaler_->scale());
  if (has_scaler && !scaler_->enabled()) {
    note += fmt::format(" (its fp16 loss scale, {}, is not used)", st.loss_scaler.value("scale", 0.0));
  }
  log::info("{}", note);
}

const std::vector<std::shared_ptr<SampleDataset>>& Trainer::eval_datasets() {
  if (eval_sets_.empty()) {
    const DataConfig& dc = config_.data;
    std::vector<DataSource> sources = dc.val;
    if (sources.empty()) {
      sources = dc.train;  // with data.split: their validation documents; otherwise the training data itself
      if (dc.split.empty()) log::info("no data.val configured: evaluating on the first samples of data.train");
    }
    eval_sets_ = open_datasets(sources, dc, config_.model.vocab_size, config_.train.seed, /*validation=*/true);
    for (const DataSource& s : sources) eval_names_.push_back(s.name);
  }
  return eval_sets_;
}

std::vector<LossSums> Trainer::evaluate_each(int64_t batches) {
  const auto& sets = eval_datasets();
  const int64_t mb = config_.train.micro_batch, T = config_.data.seq_len;
  // Per dataset, then over all of them: loss sum, target count, targets ranked first.
  std::vector<double> sums(3 * sets.size() + 3, 0.0);
  std::vector<int32_t> sample(static_cast<size_t>(T + 1)), inputs, targets;
  for (size_t d = 0; d < sets.size(); ++d) {
    const int64_t n = std::min(batches * mb, sets[d]->samples_per_epoch());
    // Micro-batch k of each dataset goes to data-parallel rank k % dp.
    for (int64_t first = dp_.rank() * mb; first < n; first += dp_.size() * mb) {
      const int64_t rows = std::min(mb, n - first);
      inputs.resize(size_t(rows * T));
      targets.resize(size_t(rows * T));
      for (int64_t i = 0; i < rows; ++i) {
        sets[d]->read_sample(first + i, sample.data());
        std::copy_n(sample.begin(), T, inputs.begin() + i * T);
        std::copy_n(sample.begin() + 1, T, targets.begin() + i * T);
      }
      const Tensor x = tokens_tensor(inputs, rows, T), y = tokens_tensor(targets, rows, T);
      LossSums s = runner_ ? runner_->forward_loss(x, y) : model_->forward_loss(x, y);
      sums[3 * d] += s.sum;
      sums[3 * d + 1] += double(s.count);
      sums[3 * d + 2] += double(s.correct);
    }
    for (size_t k = 0; k < 3; ++k) sums[3 * sets.size() + k] += sums[3 * d + k];
  }
  dp_.all_reduce(Tensor(sums.data(), DType::F64, Shape{int64_t(sums.size())}));
  std::vector<LossSums> out;
  for (size_t d = 0; d <= sets.size(); ++d) {
    LossSums ls;
    ls.sum = sums[3 * d];
    ls.count = int64_t(sums[3 * d + 1]);
    ls.correct = int64_t(sums[3 * d + 2]);
    out.push_back(ls);
  }
  return out;
}

std::string Trainer::eval_report(const std::vector<LossSums>& e) const {
  std::string s = fmt::format("val loss {:.4f}, accuracy {:.2f}% over {} tokens", e.back().mean(),
                              100 * e.back().accuracy(), e.back().count);
  if (e.size() > 2) {
    for (size_t d = 0; d + 1 < e.size(); ++d) {
      s += fmt::format("{} {} {:.4f} ({:.2f}%)", d ? "," : " |", eval_names_[d], e[d].mean(), 100 * e[d].accuracy());
    }
  }
  return s;
}

std::string Trainer::sample(const std::string& prompt) {
  // Documents follow an end-of-document token in the training stream, so a prompt does too.
  Tokenizer& tok = tokenizer();
  std::vector<int32_t> ids = tok.encode(prompt);
  ids.insert(ids.begin(), tok.eos_id());
  std::vector<int64_t> stops = {tok.eos_id()};
  // Through the pipeline's stages (the logits reach every rank) or this rank's whole model.
  const LastLogitsFn last_logits = [&](Tensor t, Tensor logits) {
    runner_ ? runner_->last_logits(t, logits) : model_->last_logits(t, logits);
  };
  std::vector<int32_t> out = generate_tokens(config_.model, last_logits, ids, config_.generate, config_.data.seq_len,
                                             tok.vocab_size(), stops);
  return tok.decode(out);
}

void Trainer::save_hf(const std::string& dir) {
  const DType dtype = dtype_from_torch_name(config_.output.save_hf_dtype);
  optimizer_->gather_all();  // stage 3: whole weights for the export, handed back after it
  // Every global tensor is written by one rank, into files laid out beforehand: under tensor,
  // pipeline or expert splits the ranks that write it to checkpoints gather it over their
  // tensor group and their tensor rank 0 writes it; otherwise (replicas) world rank 0 writes
  // them all. Nobody holds more than one global tensor.
  ParamRegistry& file = file_registry();
  const int tp_rank = tp_ ? tp_->rank() : 0;
  Buffer global;
  const GlobalTensorFn fetch = [&](int id) -> Tensor {
    const int local = sharded_ckpt_ ? sharded_ckpt_->local_id(id) : id;
    const bool writes = sharded_ckpt_ ? sharded_ckpt_->writes(id) : grid_.world_rank() == 0;
    if (!writes) return Tensor();
    const ParamInfo& p = model_->params().info(local);
    if (global.numel() < p.global_shape.numel()) {
      global = Buffer("save_hf.global", MemCategory::Checkpoint, DType::F32, p.global_shape.numel());
    }
    const Tensor g = global.tensor(0, p.global_shape);
    // Over the host (a run on a device sends a host copy).
    const ops::HostView piece(model_->params().param(local));
    gather_global(p, piece.get(), tp_, g);
    return tp_rank == 0 ? g : Tensor();
  };
  save_hf_weights(dir, file, fetch, config_.model.to_hf_json(), config_.output.save_hf_shard_bytes, dtype,
                  &grid_.world());
  grid_.world().barrier();
  optimizer_->release_unused();
  log::info("saved Hugging Face weights ({}) to {}", config_.output.save_hf_dtype, dir);
}

}  // namespace dstrain
