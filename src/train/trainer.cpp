#include "train/trainer.h"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <set>

#include "core/log.h"
#include "io/hf_weights.h"
#include "train/generate.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string hms(double seconds) {
  const int64_t s = int64_t(seconds + 0.5);
  return fmt::format("{:02d}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
}

Tensor tokens_tensor(std::vector<int32_t>& v, int64_t B, int64_t T) { return Tensor(v.data(), DType::I32, Shape{B, T}); }

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
    : config_(std::move(config)), grid_(grid), dp_(grid.comm(Axis::Data)) {
  config_.train.resolve_batch(dp_.size(), config_.source);
  check_same_config(grid_.world(), config_);
  model_ = std::make_unique<Transformer>(config_.model, device);
  optimizer_ = std::make_unique<AdamW>(config_.train.adamw, model_->params());
  reducer_ = std::make_unique<GradReducer>(model_->params(), dp_, config_.train.reduce_bucket_size,
                                           config_.train.overlap_comm);
  ckpt_ = std::make_unique<CheckpointManager>(config_.checkpoint, grid_);
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

}  // namespace

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
  if (init_from.empty()) {
    model_->init_weights(config_.train.seed);
    log::info("initialised {} parameters (seed {})", model_->config().num_parameters(), config_.train.seed);
    return;
  }
  if (std::filesystem::is_regular_file(init_from) && is_hdf5_file(init_from)) {
    const TrainState st = read_checkpoint(init_from, ckpt_->io_comm(), model_->params(), nullptr, nullptr);
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
  auto counts = load_hf_weights(init_from, model_->params());
  log::info("loaded {} tensors from {}", counts.loaded, init_from);
}

StepRecord Trainer::train_step() {
  const auto t0 = Clock::now();
  const TrainConfig& tc = config_.train;
  const int64_t mb = tc.micro_batch, T = config_.data.seq_len, dp = dp_.size(), rank = dp_.rank();
  train_dataset();
  // The global batch of step s is sample positions [s*G, (s+1)*G) whatever the number of
  // ranks; micro-step m of rank r takes the slice at m*(dp*mb) + r*mb. The whole step's
  // micro-batches are read first: the loss is the mean over every target token of the global
  // batch, so each backward needs the global token count.
  micro_batches_.resize(size_t(tc.grad_accum));
  int64_t count = 0;
  for (int64_t m = 0; m < tc.grad_accum; ++m) {
    fill_batch(*train_data_, *sampler_, consumed_samples_ + m * dp * mb + rank * mb, mb, micro_batches_[size_t(m)]);
    for (int32_t t : micro_batches_[size_t(m)].targets) count += t != ops::kIgnoreIndex;
  }
  double waited = 0;  // in blocking collectives of this step
  auto timed = [&](auto&& f) {
    const auto w0 = Clock::now();
    f();
    waited += seconds_since(w0);
  };
  timed([&] { count = dp_.all_reduce_value<int64_t>(count); });
  DS_CHECK(count > 0, "step {}: the global batch has no target tokens (all are the ignore index)", step_ + 1);
  const float scale = float(1.0 / double(count));

  ParamRegistry& params = model_->params();
  params.grads().zero();
  double sums[2] = {0, 0};  // loss sum, target count
  for (int64_t m = 0; m < tc.grad_accum; ++m) {
    Batch& b = micro_batches_[size_t(m)];
    reducer_->begin_micro_step(/*communicates=*/m == tc.grad_accum - 1);
    LossSums s = model_->forward_backward(tokens_tensor(b.inputs, mb, T), tokens_tensor(b.targets, mb, T), scale,
                                          reducer_->hook());
    sums[0] += s.sum;
    sums[1] += double(s.count);
  }
  const ReduceTimings rt = reducer_->finish();
  timed([&] { dp_.all_reduce(Tensor(sums, DType::F64, Shape{2})); });

  StepRecord r;
  r.step = step_ + 1;
  r.loss = sums[0] / sums[1];
  r.grad_norm = grad_norm(params);
  if (tc.gradient_clipping > 0) clip_grad_norm(params, tc.gradient_clipping, r.grad_norm);
  r.lr = tc.schedule.lr_at(step_, tc.adamw.lr);
  optimizer_->step(r.lr);
  ++step_;
  consumed_samples_ += tc.train_batch_size;
  r.step_seconds = seconds_since(t0);
  r.tokens_per_s = double(tc.train_batch_size * T) / r.step_seconds;
  r.comm_seconds = rt.comm_seconds;
  r.exposed_comm_seconds = rt.exposed_seconds + waited;
  // Every rank's timing, for the load-balance view (a small gather outside the timed step).
  const int W = grid_.world_size();
  double mine[2] = {r.step_seconds, r.step_seconds - r.exposed_comm_seconds};
  std::vector<double> all(static_cast<size_t>(2 * W));
  grid_.world().all_gather(Tensor(all.data(), DType::F64, Shape{2 * W}), Tensor(mine, DType::F64, Shape{2}));
  for (int k = 0; k < W; ++k) {
    r.rank_step_seconds.push_back(all[size_t(2 * k)]);
    r.rank_compute_seconds.push_back(all[size_t(2 * k + 1)]);
  }
  return r;
}

void Trainer::print_progress(const StepRecord& r, double elapsed, int64_t steps_this_run) const {
  const int64_t remaining = config_.train.max_steps - r.step;
  const double eta = elapsed / double(std::max<int64_t>(steps_this_run, 1)) * double(remaining);
  log::info("step {:>6}/{} | loss {:.4f} | lr {:.3e} | grad norm {:.4f} | {:.0f} tok/s | elapsed {} | eta {}", r.step,
            config_.train.max_steps, r.loss, r.lr, r.grad_norm, r.tokens_per_s, hms(elapsed), hms(eta));
}

void Trainer::write_metrics(const json& record) {
  if (!metrics_.is_open()) return;
  metrics_ << record.dump() << "\n";
  metrics_.flush();
}

void Trainer::train() {
  const TrainConfig& tc = config_.train;
  log::info("training {} steps: global batch {} windows x {} tokens = micro-batch {} x {} accumulation steps x {} "
            "data-parallel ranks",
            tc.max_steps, tc.train_batch_size, config_.data.seq_len, tc.micro_batch, tc.grad_accum, dp_.size());
  if (dp_.size() > 1) {
    log::info("gradients: {} bucket(s) of up to {} elements, all-reduce {}", reducer_->num_buckets(),
              tc.reduce_bucket_size, tc.overlap_comm ? "overlapped with the backward" : "after the backward");
  }
  if (grid_.world_rank() == 0) {
    std::filesystem::create_directories(config_.output.dir);
    const auto path = std::filesystem::path(config_.output.dir) / "metrics.jsonl";
    metrics_.open(path, std::ios::app);
    DS_CHECK(metrics_.good(), "cannot write {}: check output.dir", path.string());
  }
  const double flops_per_token = config_.model.train_flops_per_token(config_.data.seq_len);
  const auto t0 = Clock::now();
  const int64_t first_step = step_ + 1;  // after a resume, not 1
  while (step_ < tc.max_steps) {
    StepRecord r = train_step();
    history_.push_back(r);
    if (on_step) on_step(r);
    const double elapsed = seconds_since(t0);
    write_metrics({{"type", "train"},
                   {"step", r.step},
                   {"loss", r.loss},
                   {"lr", r.lr},
                   {"grad_norm", r.grad_norm},
                   {"step_time_s", r.step_seconds},
                   {"comm_time_s", r.comm_seconds},
                   {"exposed_comm_time_s", r.exposed_comm_seconds},
                   {"rank_step_time_s", r.rank_step_seconds},
                   {"rank_compute_time_s", r.rank_compute_seconds},
                   {"tokens_per_s", r.tokens_per_s},
                   {"model_flops_per_s", r.tokens_per_s * flops_per_token},
                   {"tokens", consumed_samples_ * config_.data.seq_len},
                   {"elapsed_s", elapsed}});
    if (r.step == first_step || r.step % tc.steps_per_print == 0 || r.step == tc.max_steps) {
      print_progress(r, elapsed, r.step - first_step + 1);
    }
    if (tc.eval_interval > 0 && !config_.data.val.empty() &&
        (r.step % tc.eval_interval == 0 || r.step == tc.max_steps)) {
      const LossSums e = evaluate(tc.eval_batches);
      log::info("eval   {:>6} | val loss {:.4f} over {} tokens", r.step, e.mean(), e.count);
      write_metrics({{"type", "eval"}, {"step", r.step}, {"loss", e.mean()}, {"tokens", e.count}});
    }
    if (config_.generate.interval > 0 && r.step % config_.generate.interval == 0) {
      log::info("sample {:>6} | {}", r.step, sample(config_.generate.prompt));
    }
    if (checkpoint_due(r.step)) {
      const double stall = save_checkpoint();
      write_metrics({{"type", "checkpoint"}, {"step", r.step}, {"stall_s", stall}, {"async", config_.checkpoint.async}});
    }
  }
  if (config_.checkpoint.save_final && last_saved_step_ != step_) save_checkpoint();
  ckpt_->wait();
}

WindowDataset& Trainer::train_dataset() {
  if (!train_data_) {
    train_data_ = std::make_unique<WindowDataset>(config_.data.train, config_.data.seq_len, config_.model.vocab_size);
    sampler_ = std::make_unique<WindowSampler>(train_data_->num_windows(), config_.data.shuffle, config_.train.seed);
  }
  return *train_data_;
}

TrainState Trainer::state() {
  const WindowDataset& data = train_dataset();
  TrainState st;
  st.step = step_;
  st.consumed_samples = consumed_samples_;
  st.consumed_tokens = consumed_samples_ * config_.data.seq_len;
  st.optimizer_steps = optimizer_->steps_taken();
  st.scheduler = config_.train.schedule.to_json();
  st.scheduler["last_batch_iteration"] = step_ - 1;
  st.scheduler["base_lr"] = config_.train.adamw.lr;
  // dstrain's randomness is counter-based: a seed and a position say everything.
  st.rng = {{"generator", "philox4x32-10"},
            {"seed", config_.train.seed},
            {"parameter_init", "stream FNV-1a(HF parameter name), element index"},
            {"shuffle", "stream FNV-1a(\"dstrain.shuffle\") + epoch, derived from consumed_samples"},
            {"generate_seed", config_.generate.seed}};
  st.data = {{"consumed_samples", consumed_samples_},
             {"epoch", sampler_->epoch_of(consumed_samples_)},
             {"position_in_epoch", consumed_samples_ % data.num_windows()},
             {"num_windows", data.num_windows()},
             {"num_tokens", data.num_tokens()},
             {"seq_len", config_.data.seq_len},
             {"shuffle", config_.data.shuffle},
             {"train", config_.data.train}};
  st.config = config_.to_json();
  st.layout = {{"world_size", grid_.world_size()},
               {"data", grid_.size(Axis::Data)},
               {"tensor", grid_.size(Axis::Tensor)},
               {"pipeline", grid_.size(Axis::Pipeline)},
               {"expert", grid_.size(Axis::Expert)},
               {"partition", "each rank wrote rows [R*r/N, R*(r+1)/N) of dimension 0 of every tensor"}};
  return st;
}

double Trainer::save_checkpoint() {
  ParamRegistry& reg = model_->params();
  CheckpointBuffers live{reg.values().data<float>(), optimizer_->exp_avg().data<float>(),
                         optimizer_->exp_avg_sq().data<float>()};
  const double stall = ckpt_->save(reg, live, state());
  last_saved_step_ = step_;
  last_save_time_ = Clock::now();
  return stall;
}

bool Trainer::checkpoint_due(int64_t step) {
  const CheckpointConfig& c = config_.checkpoint;
  bool due = c.interval_steps > 0 && step % c.interval_steps == 0;
  if (c.interval_minutes > 0) {
    // Clocks differ between ranks: rank 0 decides for everyone.
    int by_time = seconds_since(last_save_time_) >= c.interval_minutes * 60.0 ? 1 : 0;
    grid_.world().broadcast(Tensor(&by_time, DType::I32, Shape{1}), 0);
    due = due || by_time;
  }
  return due;
}

bool Trainer::resume(const std::string& spec) {
  std::vector<std::string> candidates = spec == "auto" ? ckpt_->list() : std::vector<std::string>{spec};
  if (candidates.empty()) {
    log::info("no checkpoint in {}: starting a new run", config_.checkpoint.dir);
    return false;
  }
  ParamRegistry& reg = model_->params();
  for (const std::string& path : candidates) {
    TrainState st;
    const auto t0 = Clock::now();
    try {
      st = read_checkpoint(path, ckpt_->io_comm(), reg, optimizer_->exp_avg().data<float>(),
                           optimizer_->exp_avg_sq().data<float>());
    } catch (const Error& e) {
      if (spec != "auto") throw;
      if (grid_.world_rank() == 0) log::warn("skipping invalid checkpoint: {}", e.what());
      continue;
    }
    step_ = st.step;
    consumed_samples_ = st.consumed_samples;
    optimizer_->set_steps_taken(st.optimizer_steps);
    last_saved_step_ = step_;
    last_save_time_ = Clock::now();
    const WindowDataset& data = train_dataset();
    if (st.data.value("num_windows", int64_t(-1)) != data.num_windows() ||
        st.data.value("seq_len", int64_t(-1)) != config_.data.seq_len) {
      log::warn("the training data differs from the checkpoint's ({} windows of {} then, {} of {} now): the sample "
                "sequence does not continue exactly",
                st.data.value("num_windows", int64_t(-1)), st.data.value("seq_len", int64_t(-1)), data.num_windows(),
                config_.data.seq_len);
    }
    std::vector<std::string> changed;
    json_diff(st.config, config_.to_json(), "", changed);
    if (!changed.empty()) {
      std::string keys;
      for (const std::string& k : changed) keys += (keys.empty() ? "" : ", ") + k;
      log::info("configuration changed since the checkpoint: {}", keys);
    }
    const double secs = seconds_since(t0);
    const double mb = double(reg.values().numel()) * 12.0 / 1e6;
    log::info("resumed from {} at step {} ({} samples consumed; written by {} rank(s), now {}); read and verified "
              "{:.0f} MB in {:.2f} s ({:.0f} MB/s)",
              path, step_, consumed_samples_, st.layout.value("world_size", 0), grid_.world_size(), mb, secs,
              mb / std::max(secs, 1e-9));
    return true;
  }
  throw Error(fmt::format("none of the {} checkpoint(s) in {} is valid (see the warnings above); move them away or "
                          "start without --resume",
                          candidates.size(), config_.checkpoint.dir));
}

WindowDataset& Trainer::eval_dataset() {
  if (!eval_data_) {
    const bool has_val = !config_.data.val.empty();
    if (!has_val) log::info("no data.val configured: evaluating on the first windows of data.train");
    eval_data_ = std::make_unique<WindowDataset>(has_val ? config_.data.val : config_.data.train,
                                                 config_.data.seq_len, config_.model.vocab_size);
  }
  return *eval_data_;
}

LossSums Trainer::evaluate(int64_t batches) {
  WindowDataset& data = eval_dataset();
  const int64_t mb = config_.train.micro_batch, T = config_.data.seq_len;
  const WindowSampler in_order(data.num_windows(), /*shuffle=*/false, 0);
  const int64_t windows = std::min(batches * mb, data.num_windows());
  double sums[2] = {0, 0};
  Batch b;
  // Micro-batch k goes to data-parallel rank k % dp.
  for (int64_t first = dp_.rank() * mb; first < windows; first += dp_.size() * mb) {
    const int64_t n = std::min(mb, windows - first);
    fill_batch(data, in_order, first, n, b);
    LossSums s = model_->forward_loss(tokens_tensor(b.inputs, n, T), tokens_tensor(b.targets, n, T));
    sums[0] += s.sum;
    sums[1] += double(s.count);
  }
  dp_.all_reduce(Tensor(sums, DType::F64, Shape{2}));
  return LossSums{sums[0], int64_t(sums[1])};
}

std::string Trainer::sample(const std::string& prompt) {
  // Documents follow an end-of-document token in the training stream, so a prompt does too.
  Tokenizer& tok = tokenizer();
  std::vector<int32_t> ids = tok.encode(prompt);
  ids.insert(ids.begin(), tok.eos_id());
  std::vector<int64_t> stops = {tok.eos_id()};
  std::vector<int32_t> out = generate_tokens(*model_, ids, config_.generate, config_.data.seq_len, tok.vocab_size(), stops);
  return tok.decode(out);
}

void Trainer::save_hf(const std::string& dir) {
  if (grid_.world_rank() == 0) save_hf_weights(dir, model_->params(), config_.model.to_hf_json());
  grid_.world().barrier();
  log::info("saved Hugging Face weights to {}", dir);
}

}  // namespace dstrain
