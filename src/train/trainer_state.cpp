// The trainer's state in and out: initial weights, checkpoints (save, resume, the state they
// record), Hugging Face export.
#include "train/trainer.h"

#include <chrono>
#include <filesystem>
#include <optional>

#include "backend/ops.h"
#include "core/clock.h"
#include "core/log.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "train/startup_checks.h"
#include "train/tensorboard.h"

namespace dstrain {
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
  // What a checkpoint writes from these buffers, or reads into them, as `pieces` lay them out.
  CheckpointBuffers buffers(std::shared_ptr<const ShardedState> pieces) const {
    return {values(), exp_avg(), exp_avg_sq(), std::move(pieces)};
  }
  CheckpointTargets targets(std::shared_ptr<const ShardedState> pieces) const {
    return {values(), exp_avg(), exp_avg_sq(), std::move(pieces)};
  }
  void write_back() const {
    values_->write_back();
    if (exp_avg_) exp_avg_->write_back();
    if (exp_avg_sq_) exp_avg_sq_->write_back();
  }

 private:
  std::optional<ops::HostView> values_, exp_avg_, exp_avg_sq_;
};

// The optimizer's state where checkpoints write and read it: the whole local weights and moments
// (stage 0), or its shards (ZeRO).
HostState optimizer_host_state(DistributedOptimizer& z) {
  return HostState(z.master().tensor(), z.exp_avg().tensor(), z.exp_avg_sq().tensor());
}

}  // namespace

std::shared_ptr<const ShardedState> Trainer::optimizer_pieces() const {
  const DistributedOptimizer& o = *optimizer_;
  ShardedModelCheckpoint::Shard shard;
  shard.rows = [&o](int id) { return o.piece(id); };
  shard.at = [&o](int id) { return o.shard_offset(id); };
  shard.numel = o.stage() == 0 ? model_->params().flat_numel() : o.shard_numel();
  shard.replicated_over_data = o.stage() == 0;
  // Under asynchronous aggregation the optimizer's groups are a replica's data ranks.
  const ParamGroupComms groups = grid_.size(Axis::Expert) == 1
                                     ? ParamGroupComms(grid_.replica_data())
                                     : ParamGroupComms(grid_.replica_data(), grid_.replica_expert_data());
  shard.groups = &groups;
  return sharded_ckpt_->describe(shard);
}

std::vector<CheckpointGroup> Trainer::gradient_sync_groups(std::shared_ptr<const ShardedState>& main, float* values,
                                                           float* exp_avg, float* exp_avg_sq, bool writing,
                                                           bool pending,
                                                           std::vector<std::unique_ptr<ops::HostView>>& views) {
  std::vector<CheckpointGroup> out;
  if (!sync_) return out;
  // Replica 0 writes the model, its moments and the state every replica shares; replica r > 0
  // its own weights and moments under gradient_sync/replica_r (local SGD and DiLoCo, where they
  // differ). Every rank reads the shared state, and its own replica's.
  auto empty = std::make_shared<ShardedState>();
  empty->numel = main->numel;
  const std::shared_ptr<const ShardedState> mine = main, none = empty;
  const int q = grid_.replica(), R = grid_.replicas();
  const std::shared_ptr<const ShardedState> shared = writing && q != 0 ? none : mine;
  auto host_of = [&](Buffer& b) {
    views.push_back(std::make_unique<ops::HostView>(b.tensor()));
    return views.back()->data<float>();
  };
  // The shared groups are read by every replica and checked against their checksums by replica
  // 0's ranks (whose pieces tile each tensor once).
  const bool verify = q == 0;
  if (sync_->config().mode == "delayed") {
    if (pending) {
      out.push_back({"gradient_sync/pending_gradient", host_of(sync_->pending_gradient()), shared, verify});
    }
  } else {
    out.push_back({"gradient_sync/outer_params", host_of(sync_->outer_params()), shared, verify});
    if (sync_->has_momentum()) {
      out.push_back({"gradient_sync/outer_momentum", host_of(sync_->outer_momentum()), shared, verify});
    }
    for (int r = 1; r < R; ++r) {
      const std::shared_ptr<const ShardedState> held = q == r ? mine : none;
      const std::string at = fmt::format("gradient_sync/replica_{}/", r);
      out.push_back({at + "model", q == r ? values : nullptr, held});
      out.push_back({at + "exp_avg", q == r ? exp_avg : nullptr, held});
      out.push_back({at + "exp_avg_sq", q == r ? exp_avg_sq : nullptr, held});
    }
  }
  if (q != 0 && (writing || sync_->config().local())) main = none;
  return out;
}

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
      // Another run's TensorBoard events in the directory stop the run before anything is loaded.
      if (!config_.metrics.tensorboard_dir.empty()) {
        const std::string refused = claim_tensorboard_dir(config_.metrics.tensorboard_dir, config_.output.dir);
        if (!refused.empty()) throw Error(refused);
      }
    } catch (const std::exception& e) {
      locks_.clear();
      error = e.what();
    }
  }
  throw_if_root_failed(grid_.world(), error);
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
  if (sync_) sync_->reset_outer();  // theta_outer starts at the weights now in force
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
    // Each rank its whole local pieces.
    const HostState host(model_->params().values().tensor(), Tensor(), Tensor());
    st = read_checkpoint(init_from, ckpt_->io_comm(), file_registry(), host.targets(sharded_ckpt_->describe_registry()));
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
  auto counts = load_hf_weights(init_from, model_->params(), &file_registry(), &grid_.world());
  log::info("loaded {} tensors from {}{}", counts.loaded, init_from,
            counts.fp8_dequantised ? fmt::format(" ({} of them FP8 with block scales, dequantised into the fp32 "
                                                 "master weights)", counts.fp8_dequantised)
                                   : std::string());
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
               {"gradient_sync_replicas", grid_.replicas()},
               {"sequence_parallel", model_->shard().sequence_parallel},
               {"schedule", pp_ ? json(schedule_->name()) : json()},
               {"partition", "every rank held blocks of the global tensors (its tensor, pipeline and expert pieces, "
                             "cut to its ZeRO rows); a block held alike by R ranks was written by them in R row blocks"}};
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
  // Every rank writes the rows of its pieces it is the writing replica of, from the optimizer's
  // buffers as they are (on a device: a host copy).
  const HostState host = optimizer_host_state(*optimizer_);
  CheckpointBuffers bufs = host.buffers(optimizer_pieces());
  std::vector<std::unique_ptr<ops::HostView>> views;
  bufs.extra = gradient_sync_groups(bufs.pieces, host.values(), host.exp_avg(), host.exp_avg_sq(), /*writing=*/true,
                                    sync_ && sync_->has_pending_gradient(), views);
  const double stall = ckpt_->save(file_registry(), bufs, state());
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
    // Another aggregation than the file's is an error, not an invalid file to skip.
    const GradientSyncFile file_sync = check_gradient_sync_resume(path);
    const bool async_file = file_sync.async;
    try {
      // Each rank reads its pieces of the file's global tensors straight into the optimizer's
      // buffers, whatever layout wrote them.
      const HostState host = optimizer_host_state(*optimizer_);
      CheckpointTargets into = host.targets(optimizer_pieces());
      std::vector<std::unique_ptr<ops::HostView>> views;
      // Every replica reads the model groups it needs; replica 0's ranks verify them.
      if (sync_) into.verify = grid_.replica() == 0;
      if (async_file) {
        into.extra = gradient_sync_groups(into.pieces, host.values(), host.exp_avg(), host.exp_avg_sq(), false,
                                          file_sync.pending_gradient, views);
      }
      st = read_checkpoint(path, ckpt_->io_comm(), file_registry(), into);
      host.write_back();
      for (const auto& v : views) v->write_back();
      if (sync_) {
        if (!async_file) sync_->reset_outer();  // theta_outer starts at the checkpoint's weights
        if (sync_->config().mode == "delayed") sync_->set_pending_gradient(async_file && file_sync.pending_gradient);
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
    // A stage's copy of the tied embedding is not in the file: it takes its owner's weights and
    // moments (with ZeRO, its local piece gathered from the shards and scattered back).
    if (runner_ && runner_->has_tie()) {
      const int id = runner_->tied_param();
      const ParamInfo& p = reg.info(id);
      if (sharded) {
        Buffer tied[3];
        for (int k = 0; k < 3; ++k) {
          tied[k] = Buffer("checkpoint.tied_piece", MemCategory::Checkpoint, DType::F32, p.numel(),
                           optimizer_->master().device());
          optimizer_->gather_piece(id, k, tied[k].tensor());
        }
        runner_->copy_tied({tied[0].tensor(0, p.shape), tied[1].tensor(0, p.shape), tied[2].tensor(0, p.shape)});
        for (int k = 0; k < 3; ++k) optimizer_->scatter_piece(id, k, tied[k].tensor());
      } else {
        runner_->copy_tied({reg.param(id), optimizer_->exp_avg().tensor(p.offset, p.shape),
                            optimizer_->exp_avg_sq().tensor(p.offset, p.shape)});
      }
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

Trainer::GradientSyncFile Trainer::check_gradient_sync_resume(const std::string& path) {
  // Rank 0 reads what the file's run aggregated, and whether it holds a delayed gradient.
  std::string verdict;
  if (grid_.world_rank() == 0) {
    json v = {{"error", ""}, {"async", false}, {"pending", false}, {"note", ""}};
    try {
      const CheckpointInfo info = inspect_checkpoint(path, /*verify=*/false);
      const json file_gs = info.state.config.contains("train") ? info.state.config["train"].value("gradient_sync", json::object())
                                                               : json::object();
      const std::string file_mode = file_gs.value("mode", std::string("sync"));
      const int64_t file_every = file_gs.value("every", int64_t(1)), file_fragments = file_gs.value("fragments", int64_t(1));
      const int64_t file_replicas = info.state.layout.value("gradient_sync_replicas", int64_t(1));
      const GradientSyncConfig& gs = config_.train.gradient_sync;
      for (const CheckpointTensorInfo& t : info.tensors) v["pending"] = v["pending"] || t.group == "gradient_sync/pending_gradient";
      if (file_mode != "sync") {
        v["async"] = true;
        std::string differs;
        if (file_mode != gs.mode) differs += fmt::format(", train.gradient_sync.mode \"{}\" (now \"{}\")", file_mode, gs.mode);
        if (file_every != gs.every) differs += fmt::format(", every {} (now {})", file_every, gs.every);
        if (file_fragments != gs.fragments) differs += fmt::format(", fragments {} (now {})", file_fragments, gs.fragments);
        if (file_replicas != grid_.replicas()) {
          differs += fmt::format(", {} replicas (now {})", file_replicas, grid_.replicas());
        }
        if (!differs.empty()) {
          v["error"] = fmt::format("checkpoint '{}' was written with{}: its replicas' state and outer round belong "
                                   "to that aggregation; resume with the same train.gradient_sync and replica count",
                                   path, differs.substr(1));
        }
      } else if (gs.async()) {
        v["note"] = fmt::format("checkpoint '{}' was written by a synchronous run: every replica starts from its "
                                "weights and moments, and the {} outer state from its weights",
                                path, gs.mode);
      }
    } catch (const std::exception&) {
      // An unreadable file: the read below reports it (and --resume auto falls back).
    }
    verdict = v.dump();
  }
  const json v = json::parse(all_gather_strings(grid_.world(), verdict)[0]);
  DS_CHECK(v["error"].get<std::string>().empty(), "{}", v["error"].get<std::string>());
  if (!v["note"].get<std::string>().empty() && grid_.world_rank() == 0) log::info("note: {}", v["note"].get<std::string>());
  return {v["async"].get<bool>(), v["pending"].get<bool>()};
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

void Trainer::save_hf(const std::string& dir) {
  const OutputConfig& out = config_.output;
  HFSaveOptions options;
  options.max_shard_bytes = out.save_hf_shard_bytes;
  options.dtype = hf_export_dtype(out.save_hf_dtype);
  options.block = FP8Block{out.hf_fp8_block.at(0), out.hf_fp8_block.at(1)};
  options.released_layout = out.hf_layout == "released";
  optimizer_->gather_all();  // stage 3: whole weights for the export, handed back after it
  // Every rank writes its rows of its whole local pieces (the replicas of a block share it),
  // into files laid out beforehand: nobody assembles a tensor.
  const ops::HostView host(model_->params().values().tensor());
  save_hf_weights(dir, file_registry(), *sharded_ckpt_->describe_registry(), host.get().data<float>(),
                  config_.model.to_hf_json(), options, &grid_.world());
  grid_.world().barrier();
  optimizer_->release_unused();
  log::info("saved Hugging Face weights ({}{}) to {}",
            out.save_hf_dtype == "fp8" ? fmt::format("fp8 in blocks of {} x {} with their scales, the rest bfloat16",
                                                     options.block.rows, options.block.cols)
                                       : out.save_hf_dtype,
            options.released_layout ? ", DeepSeek's released layout" : "", dir);
}

}  // namespace dstrain
