#include "data/data_pipeline.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <filesystem>

#include "core/log.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "data/llmc_dataset.h"

namespace dstrain {

// ---- configuration --------------------------------------------------------------------

json DataSource::to_json() const {
  return {{"name", name}, {"format", format}, {"path", paths}, {"weight", weight}};
}

namespace {

// The format of a dataset whose configuration names none: a path P with P.bin and P.idx is a
// Megatron prefix; anything else is read as llm.c shard patterns. Without this, a Megatron
// prefix would be globbed as a shard pattern and fail with "no file matches".
std::string detect_format(const JsonReader& r, const std::string& key, const std::vector<std::string>& paths) {
  namespace fs = std::filesystem;
  if (paths.size() != 1 || paths[0].find_first_of("*?[") != std::string::npos) return "llmc";
  const std::string& p = paths[0];
  const bool idx = fs::exists(p + ".idx"), bin = fs::exists(p + ".bin");
  if (idx && bin) return "megatron";
  if (idx != bin) {
    r.error(key, fmt::format("names {}, which has {} but no {}; a Megatron dataset needs both files (copy the "
                             "missing one, or run dstrain-prep --format megatron again)",
                             p, idx ? p + ".idx" : p + ".bin", idx ? p + ".bin" : p + ".idx"));
  }
  return "llmc";
}

// default_format "" means: detect each dataset's format from its files.
std::vector<DataSource> read_sources(const JsonReader& r, const std::string& key, const std::string& default_format) {
  std::vector<DataSource> out;
  const json& v = r.raw(key);
  auto from_paths = [&](std::vector<std::string> paths, const std::string& format) {
    DataSource s;
    s.format = format.empty() ? detect_format(r, key, paths) : format;
    s.paths = std::move(paths);
    s.name = s.paths.empty() ? key : std::filesystem::path(s.paths[0]).filename().string();
    return s;
  };
  if (v.is_string()) {
    out.push_back(from_paths({v.get<std::string>()}, default_format));
  } else if (v.is_array() && !v.empty() && v[0].is_string()) {
    out.push_back(from_paths(r.get<std::vector<std::string>>(key), default_format));  // one dataset of several files
  } else if (v.is_array()) {
    for (size_t i = 0; i < v.size(); ++i) {
      JsonReader e(v[i], fmt::format("{}[{}]", r.key_path(key), i), r.source());
      const std::string format = e.has("format") ? e.get<std::string>("format") : default_format;
      DataSource s = from_paths(e.get<std::vector<std::string>>("path"), format);
      s.weight = e.get<double>("weight", 1.0);
      s.name = e.get<std::string>("name", s.name);
      if (s.weight < 0) e.error("weight", "must be >= 0");
      e.done();
      out.push_back(std::move(s));
    }
  } else {
    r.error(key, "must be a path, a list of paths (one dataset), or a list of {\"path\", \"weight\", \"name\", "
                 "\"format\"} objects (datasets to blend)");
  }
  if (out.empty()) r.error(key, "must name at least one dataset");
  for (const DataSource& s : out) {
    if (s.format != "llmc" && s.format != "megatron") {
      r.error(key, fmt::format("has format \"{}\"; supported: \"llmc\" (llm.c token shards), \"megatron\" (Megatron "
                               "indexed dataset prefix)",
                               s.format));
    }
    if (s.format == "megatron" && s.paths.size() != 1) {
      r.error(key, "a Megatron dataset is one prefix (PREFIX.idx + PREFIX.bin); list several prefixes as separate "
                   "{\"path\", \"weight\"} objects to blend them");
    }
  }
  return out;
}

}  // namespace

DataConfig DataConfig::from_json(const JsonReader& r) {
  DataConfig d;
  // Without data.format, each dataset's format is detected from its files.
  const std::string format = r.get<std::string>("format", "");
  if (r.has("format") && format != "llmc" && format != "megatron") {
    r.error("format", fmt::format("is \"{}\"; supported: \"llmc\" (llm.c token shards), \"megatron\" (Megatron "
                                  "indexed dataset prefix), or leave it out to detect the format from the files",
                                  format));
  }
  d.train = read_sources(r, "train", format);
  if (r.has("val")) d.val = read_sources(r, "val", format);
  d.split = r.get<std::vector<double>>("split", {});
  if (!d.split.empty()) {
    if (d.split.size() != 2 || d.split[0] <= 0 || d.split[1] < 0) {
      r.error("split", "must be [train, validation] shares of each Megatron dataset's documents, e.g. [98, 2]");
    }
    if (!d.val.empty()) r.error("split", "and data.val both define validation data; keep one");
    for (const DataSource& s : d.train) {
      if (s.format != "megatron") r.error("split", "splits Megatron datasets by document; llm.c data needs val shards");
    }
  }
  std::vector<double> w;
  for (const DataSource& s : d.train) w.push_back(s.weight);
  d.schedule.push_back({0, w});
  if (r.has("blend_schedule")) {
    const json& sched = r.raw("blend_schedule");
    if (!sched.is_array()) r.error("blend_schedule", "must be a list of {\"step\", \"weights\"}");
    for (size_t i = 0; i < sched.size(); ++i) {
      JsonReader e(sched[i], fmt::format("{}[{}]", r.key_path("blend_schedule"), i), r.source());
      BlendPhase p{e.get<int64_t>("step"), e.get<std::vector<double>>("weights")};
      if (p.weights.size() != d.train.size()) {
        e.error("weights", fmt::format("has {} weights for {} training datasets", p.weights.size(), d.train.size()));
      }
      if (p.from_step <= d.schedule.back().from_step) e.error("step", "must increase along the schedule (and be > 0)");
      e.done();
      d.schedule.push_back(std::move(p));
    }
  }
  d.seq_len = r.get<int64_t>("seq_len");
  if (d.seq_len <= 0) r.error("seq_len", "must be positive");
  d.shuffle = r.get<bool>("shuffle", d.shuffle);
  d.tokenizer = r.get<std::string>("tokenizer", d.tokenizer);
  d.validate = r.get<std::string>("validate", d.validate);
  if (d.validate != "full" && d.validate != "sample" && d.validate != "off") {
    r.error("validate", "must be \"full\", \"sample\" or \"off\"");
  }
  d.prefetch = r.get<int64_t>("prefetch", d.prefetch);
  if (d.prefetch < 0) r.error("prefetch", "must be >= 0");
  r.done();
  return d;
}

json DataConfig::to_json() const {
  json tr = json::array(), va = json::array(), sched = json::array();
  for (const auto& s : train) tr.push_back(s.to_json());
  for (const auto& s : val) va.push_back(s.to_json());
  for (size_t i = 1; i < schedule.size(); ++i) sched.push_back({{"step", schedule[i].from_step}, {"weights", schedule[i].weights}});
  json out = {{"train", tr},         {"split", split},     {"blend_schedule", sched}, {"seq_len", seq_len},
              {"shuffle", shuffle},  {"tokenizer", tokenizer}, {"validate", validate}, {"prefetch", prefetch}};
  // An empty list is not a value of data.val (the reader asks for at least one dataset).
  if (!val.empty()) out["val"] = va;
  return out;
}

// ---- datasets --------------------------------------------------------------------------

std::vector<std::shared_ptr<SampleDataset>> open_datasets(const std::vector<DataSource>& sources,
                                                          const DataConfig& config, int64_t vocab_size, uint64_t seed,
                                                          bool validation) {
  std::vector<std::shared_ptr<SampleDataset>> out;
  const bool shuffle = config.shuffle && !validation;
  for (size_t i = 0; i < sources.size(); ++i) {
    const DataSource& s = sources[i];
    // Each dataset shuffles with its own seed, so adding a dataset does not reorder another.
    const uint64_t ds_seed = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    if (s.format == "llmc") {
      out.push_back(std::make_shared<LlmcDataset>(s.paths, config.seq_len, vocab_size, shuffle, ds_seed));
    } else {
      auto idx = std::make_shared<const IndexedDataset>(s.paths[0]);
      int64_t begin = 0, end = idx->num_documents();
      if (!config.split.empty()) {
        std::tie(begin, end) = split_range(idx->num_documents(), config.split, validation ? 1 : 0);
      }
      out.push_back(std::make_shared<GPTDataset>(idx, begin, end, config.seq_len, vocab_size, shuffle, ds_seed));
    }
  }
  return out;
}

void check_same_files_everywhere(const std::vector<std::string>& files, const std::string& mode,
                                 Communicator& world) {
  if (mode == "off") return;
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<uint64_t> mine;
  double bytes_read = 0;
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY);
    DS_CHECK(fd >= 0, "cannot open dataset file {}: {}", f, std::strerror(errno));
    struct stat st {};
    ::fstat(fd, &st);
    const uint64_t size = uint64_t(st.st_size);
    XXH64_state_t* h = XXH64_createState();
    XXH64_reset(h, 0);
    XXH64_update(h, &size, sizeof(size));
    std::vector<char> buf(size_t(1) << 20);
    auto hash_range = [&](uint64_t off, uint64_t len) {
      while (len > 0) {
        const ssize_t n = ::pread(fd, buf.data(), std::min<uint64_t>(len, buf.size()), off_t(off));
        DS_CHECK(n > 0, "reading dataset file {} at byte {} failed: {}", f, off, n < 0 ? std::strerror(errno) : "EOF");
        XXH64_update(h, buf.data(), size_t(n));
        off += uint64_t(n);
        len -= uint64_t(n);
        bytes_read += double(n);
      }
    };
    if (mode == "full" || size <= 64 * buf.size()) {
      hash_range(0, size);
    } else {
      for (uint64_t k = 0; k < 64; ++k) hash_range((size - buf.size()) / 63 * k, buf.size());
    }
    mine.push_back(XXH64_digest(h));
    XXH64_freeState(h);
    ::close(fd);
  }
  const int n = world.size();
  std::vector<uint64_t> all(mine.size() * size_t(n));
  if (!mine.empty()) {
    world.all_gather(Tensor(all.data(), DType::U32, Shape{int64_t(all.size()) * 2}),
                     Tensor(mine.data(), DType::U32, Shape{int64_t(mine.size()) * 2}));
  }
  std::string report;
  for (size_t f = 0; f < files.size(); ++f) {
    for (int r = 1; r < n; ++r) {
      const uint64_t a = all[f], b = all[size_t(r) * files.size() + f];
      if (a != b) report += fmt::format("\n  {}: rank 0 has xxh64 {:016x}, rank {} has {:016x}", files[f], a, r, b);
    }
  }
  if (!report.empty()) {
    throw Error("dataset files differ between ranks (every rank must read identical data; check shared filesystem "
                "copies and stale files):" + report);
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log::info("data: {} file(s) identical on all {} rank(s) (xxh64, {}: {:.0f} MB hashed per rank in {:.2f} s)",
            files.size(), n, mode, bytes_read / 1e6, secs);
}

// ---- the pipeline ----------------------------------------------------------------------

DataPipeline::DataPipeline(const DataConfig& config, int64_t vocab_size, uint64_t seed, int64_t micro_batch,
                           int64_t grad_accum, Communicator& dp, Communicator& world)
    : config_(config),
      mb_(micro_batch),
      accum_(grad_accum),
      dp_size_(dp.size()),
      dp_rank_(dp.rank()),
      G_(micro_batch * grad_accum * dp.size()),
      blender_(int(config.train.size()), config.schedule) {
  train_ = open_datasets(config_.train, config_, vocab_size, seed, /*validation=*/false);
  std::vector<std::string> files;
  for (const auto& d : train_) {
    for (const auto& f : d->files()) files.push_back(f);
  }
  check_same_files_everywhere(files, config_.validate, world);
  for (size_t i = 0; i < train_.size(); ++i) {
    log::info("data: train[{}] {} (weight {:.3g}): {}", i, config_.train[i].name, blender_.weights_at(0)[i],
              train_[i]->describe());
  }
  consumed_blend_ = blender_.state();
  consumed_drawn_ = blender_.drawn();
}

DataPipeline::~DataPipeline() { stop(); }

void DataPipeline::stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void DataPipeline::start(int64_t first_step, const json& blend_state) {
  stop();
  stopping_ = false;
  queue_.clear();
  error_ = nullptr;
  blender_ = Blender(int(config_.train.size()), config_.schedule);
  if (!blend_state.is_null()) blender_.restore(blend_state);
  DS_CHECK(blender_.steps_done() == first_step, "the data position is at step {} but training resumes at step {}",
           blender_.steps_done(), first_step);
  consumed_blend_ = blender_.state();
  consumed_drawn_ = blender_.drawn();
  next_step_ = first_step;
  if (config_.prefetch > 0) thread_ = std::thread([this] { producer_loop(); });
}

StepData DataPipeline::produce(int64_t step) {
  StepData d;
  d.blend_before = blender_.state();
  const std::vector<Blender::Assignment> batch = blender_.next_batch(step, G_);
  d.step = step;
  d.micro.resize(size_t(accum_));
  const int64_t T = config_.seq_len;
  std::vector<int32_t> sample(static_cast<size_t>(T + 1));
  for (int64_t m = 0; m < accum_; ++m) {
    Batch& b = d.micro[size_t(m)];
    b.B = mb_;
    b.T = T;
    b.inputs.resize(size_t(mb_ * T));
    b.targets.resize(size_t(mb_ * T));
    for (int64_t i = 0; i < mb_; ++i) {
      const Blender::Assignment& a = batch[size_t(m * dp_size_ * mb_ + dp_rank_ * mb_ + i)];
      train_[size_t(a.dataset)]->read_sample(a.index, sample.data());
      std::copy_n(sample.begin(), T, b.inputs.begin() + i * T);
      std::copy_n(sample.begin() + 1, T, b.targets.begin() + i * T);
    }
  }
  d.blend_after = blender_.state();
  d.drawn_after = blender_.drawn();
  return d;
}

void DataPipeline::producer_loop() {
  int64_t step = next_step_;
  while (true) {
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || int64_t(queue_.size()) < config_.prefetch; });
      if (stopping_) return;
    }
    try {
      StepData d = produce(step++);
      std::lock_guard lock(mutex_);
      queue_.push_back(std::move(d));
    } catch (...) {
      std::lock_guard lock(mutex_);
      error_ = std::current_exception();
      cv_.notify_all();
      return;
    }
    cv_.notify_all();
  }
}

StepData DataPipeline::next() {
  const auto t0 = std::chrono::steady_clock::now();
  StepData d;
  if (config_.prefetch == 0) {
    d = produce(next_step_);
  } else {
    std::unique_lock lock(mutex_);
    cv_.wait(lock, [&] { return !queue_.empty() || error_; });
    if (queue_.empty() && error_) std::rethrow_exception(error_);
    d = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    cv_.notify_all();
  }
  DS_CHECK(d.step == next_step_, "data pipeline out of step: got {} for {}", d.step, next_step_);
  ++next_step_;
  consumed_blend_ = d.blend_after;
  consumed_drawn_ = d.drawn_after;
  waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return d;
}

void DataPipeline::reconfigure(int64_t micro_batch, int64_t grad_accum, int64_t step, const json& blend_before) {
  DS_CHECK(micro_batch * grad_accum * dp_size_ == G_, "reconfiguring the data pipeline must keep the global batch {}",
           G_);
  stop();
  mb_ = micro_batch;
  accum_ = grad_accum;
  start(step, blend_before);
}

double DataPipeline::take_wait_seconds() {
  const double w = waited_;
  waited_ = 0;
  return w;
}

std::string DataPipeline::mix_report() const {
  // The current phase's realised shares against its weights.
  const auto start = consumed_blend_.at("phase_start").get<std::vector<int64_t>>();
  int64_t total = 0;
  for (size_t i = 0; i < consumed_drawn_.size(); ++i) total += consumed_drawn_[i] - start[i];
  const std::vector<double>& w = blender_.weights_at(std::max<int64_t>(next_step_ - 1, 0));
  std::string out;
  for (size_t i = 0; i < consumed_drawn_.size(); ++i) {
    const double share = total ? double(consumed_drawn_[i] - start[i]) / double(total) : 0.0;
    out += fmt::format("{}{} {:.1f}% (target {:.1f}%)", i ? ", " : "", config_.train[i].name, 100.0 * share,
                       100.0 * w[i]);
  }
  return out;
}

}  // namespace dstrain
