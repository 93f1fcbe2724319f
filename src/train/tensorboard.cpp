#include "train/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace dstrain {

namespace tfrecord {

namespace {
// Byte-at-a-time table of the reflected Castagnoli polynomial.
constexpr std::array<uint32_t, 256> crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = crc32c_table();

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}
}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = kCrc32cTable[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}

std::string frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, data.size(), 8);
  put_le(out, mask(crc32c(out.data(), 8)), 4);
  out.append(data);
  put_le(out, mask(crc32c(data.data(), data.size())), 4);
  return out;
}

}  // namespace tfrecord

namespace {

// Protobuf wire format: a field's key is (number << 3) | wire type.
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5 };

void put_key(std::string& out, uint32_t field, Wire wire) { tfrecord::put_varint(out, (uint64_t(field) << 3) | wire); }

void put_double(std::string& out, uint32_t field, double v) {
  put_key(out, field, kFixed64);
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  for (int i = 0; i < 8; ++i) out.push_back(char((bits >> (8 * i)) & 0xff));
}

void put_float(std::string& out, uint32_t field, float v) {
  put_key(out, field, kFixed32);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  for (int i = 0; i < 4; ++i) out.push_back(char((bits >> (8 * i)) & 0xff));
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_key(out, field, kLength);
  tfrecord::put_varint(out, bytes.size());
  out.append(bytes);
}

void put_packed_doubles(std::string& out, uint32_t field, const std::vector<double>& v) {
  std::string packed;
  for (double x : v) {
    uint64_t bits;
    std::memcpy(&bits, &x, 8);
    for (int i = 0; i < 8; ++i) packed.push_back(char((bits >> (8 * i)) & 0xff));
  }
  put_bytes(out, field, packed);
}

// tensorboard.HistogramProto: min 1, max 2, num 3, sum 4, sum_squares 5 (double); bucket_limit
// 6 and bucket 7 (packed repeated double).
std::string histogram_proto(const TbHistogram& h) {
  std::string out;
  put_double(out, 1, h.min);
  put_double(out, 2, h.max);
  put_double(out, 3, h.num);
  put_double(out, 4, h.sum);
  put_double(out, 5, h.sum_squares);
  put_packed_doubles(out, 6, h.limits);
  put_packed_doubles(out, 7, h.counts);
  return out;
}

constexpr const char* kEventsPrefix = "events.out.tfevents.";

}  // namespace

TbHistogram expert_load_histogram(const std::vector<int64_t>& tokens_per_expert) {
  TbHistogram h;
  const size_t n = tokens_per_expert.size();
  h.min = -0.5;
  h.max = double(n) - 0.5;
  for (size_t e = 0; e < n; ++e) {
    const double c = double(tokens_per_expert[e]), x = double(e);
    h.limits.push_back(x + 0.5);
    h.counts.push_back(c);
    h.num += c;
    h.sum += c * x;
    h.sum_squares += c * x * x;
  }
  return h;
}

std::vector<std::pair<std::string, double>> tensorboard_step_scalars(const json& r) {
  std::vector<std::pair<std::string, double>> out;
  // Numbers only: a key the run does not report (the MoE losses of a dense model, the loss
  // scale of a bf16 run) has no tag.
  auto add = [&](std::string tag, const json& record, const char* key) {
    const auto it = record.find(key);
    if (it != record.end() && it->is_number()) out.emplace_back(std::move(tag), it->get<double>());
  };
  add("loss/total", r, "loss");
  add("loss/ce", r, "ce_loss");
  add("loss/aux", r, "aux_loss");
  add("loss/mtp", r, "mtp_loss");
  add("lr", r, "lr");
  add("grad_norm", r, "grad_norm");
  add("throughput/tokens_per_s", r, "tokens_per_s");
  add("throughput/mfu", r, "mfu");
  add("throughput/model_flops_per_s", r, "model_flops_per_s");
  add("throughput/tokens", r, "tokens");
  add("time/step", r, "step_time_s");
  if (r.contains("time_s")) {
    for (const auto& [phase, v] : r["time_s"].items()) add("time/" + phase, r["time_s"], phase.c_str());
  }
  add("time/step_max_over_ranks", r, "step_time_max_s");
  add("time/step_min_over_ranks", r, "step_time_min_s");
  if (r.contains("memory_bytes")) {
    for (const auto& [category, v] : r["memory_bytes"].items()) {
      add("memory/" + category, r["memory_bytes"], category.c_str());
    }
  }
  add("memory/peak_rss", r, "peak_rss_bytes");
  add("skipped_steps", r, "skipped_total");
  add("loss_scale", r, "loss_scale");
  add("overflow_skipped_steps", r, "overflow_skipped_total");
  if (r.contains("moe")) {
    for (const auto& [layer, v] : r["moe"].items()) {
      const std::string at = "moe/layer_" + layer + "/";
      add(at + "max_over_mean_load", v, "max_over_mean_load");
      add(at + "dead_experts", v, "dead_experts");
      add(at + "aux_loss", v, "aux_loss");
      add(at + "dropped_rows", v, "dropped_rows");
    }
  }
  return out;
}

std::vector<std::pair<std::string, TbHistogram>> tensorboard_step_histograms(const json& r) {
  std::vector<std::pair<std::string, TbHistogram>> out;
  if (!r.contains("moe")) return out;
  for (const auto& [layer, v] : r["moe"].items()) {
    if (!v.contains("tokens_per_expert")) continue;
    out.emplace_back("moe/layer_" + layer + "/expert_tokens",
                     expert_load_histogram(v["tokens_per_expert"].get<std::vector<int64_t>>()));
  }
  return out;
}

std::vector<std::pair<std::string, double>> tensorboard_eval_scalars(double loss, double accuracy,
                                                                      const json& per_dataset) {
  std::vector<std::pair<std::string, double>> out = {{"eval/loss", loss}, {"eval/accuracy", accuracy}};
  for (const auto& [name, v] : per_dataset.items()) {
    if (v.contains("loss")) out.emplace_back("eval/" + name + "/loss", v["loss"].get<double>());
    if (v.contains("accuracy")) out.emplace_back("eval/" + name + "/accuracy", v["accuracy"].get<double>());
  }
  return out;
}

namespace {
std::string claim(const std::string& dir, const std::string& output_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path absolute = fs::weakly_canonical(fs::absolute(output_dir));
  if (!absolute.has_filename()) absolute = absolute.parent_path();  // "runs/a/" and "runs/a/." are runs/a
  const std::string run = absolute.string();
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    return fmt::format("metrics.tensorboard_dir '{}' cannot be created ({}): choose a writable directory", dir,
                       ec ? ec.message() : "a file of that name exists");
  }
  const fs::path marker = fs::path(dir) / kTensorBoardMarker;
  if (fs::exists(marker)) {
    std::ifstream in(marker);
    const json m = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (!m.is_object() || !m.contains("output_dir") || !m["output_dir"].is_string()) {
      return fmt::format("metrics.tensorboard_dir '{}': {} does not name the run that owns the directory (it cannot "
                         "be read as {{\"output_dir\": ...}}); choose another directory for this run, or delete the "
                         "file if the directory's events are this run's",
                         dir, marker.string());
    }
    const std::string other = m["output_dir"].get<std::string>();
    if (other == run) return "";  // this run, resumed: its new events go next to the earlier ones
    return fmt::format("metrics.tensorboard_dir '{}' holds the TensorBoard events of another run (output.dir '{}', as "
                       "{} says), and this run's output.dir is '{}': its curves would mix into that run's. Give this "
                       "run a directory of its own (such as '{}/tensorboard'), or delete the other run's files "
                       "from '{}' first",
                       dir, other, marker.string(), run, output_dir, dir);
  }
  std::string foreign;
  int64_t count = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.find("tfevents") == std::string::npos) continue;
    ++count;
    if (foreign.empty()) foreign = name;
  }
  if (count > 0) {
    return fmt::format("metrics.tensorboard_dir '{}' holds {} TensorBoard events file(s) of no dstrain run (such as "
                       "{}; no {} names a run): this run's curves would mix into theirs. Choose an empty or new "
                       "directory for this run (such as '{}/tensorboard'), or move those files away",
                       dir, count, foreign, kTensorBoardMarker, output_dir);
  }
  std::ofstream out(marker);
  out << json({{"output_dir", run},
               {"written_by", "dstrain: the run whose TensorBoard events this directory holds; another output.dir "
                              "is refused"}})
             .dump(2)
      << "\n";
  out.close();
  if (!out) return fmt::format("metrics.tensorboard_dir '{}' is not writable ({}): choose a writable directory", dir,
                               std::strerror(errno));
  return "";
}
}  // namespace

std::string claim_tensorboard_dir(const std::string& dir, const std::string& output_dir) {
  try {
    return claim(dir, output_dir);
  } catch (const std::exception& e) {  // every rank must hear of it, not rank 0 alone
    return fmt::format("metrics.tensorboard_dir '{}': {}; choose a readable, writable directory", dir, e.what());
  }
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  namespace fs = std::filesystem;
  int64_t seconds = std::chrono::duration_cast<std::chrono::seconds>(
                        std::chrono::system_clock::now().time_since_epoch()).count();
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(kEventsPrefix, 0) != 0) continue;
    const int64_t theirs = std::strtoll(name.c_str() + std::strlen(kEventsPrefix), nullptr, 10);
    seconds = std::max(seconds, theirs + 1);
  }
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "localhost");
  static std::atomic<int> files{0};
  path_ = (fs::path(dir) / fmt::format("{}{}.{}.{}.{}", kEventsPrefix, seconds, host, ::getpid(), files++)).string();
  file_ = std::fopen(path_.c_str(), "wb");
  DS_CHECK(file_ != nullptr, "cannot write {} ({}): check metrics.tensorboard_dir", path_, std::strerror(errno));
  std::setvbuf(file_, nullptr, _IOFBF, size_t(1) << 20);
  std::string version;
  put_bytes(version, 3, "brain.Event:2");  // Event.file_version
  write_event(0, version);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_) std::fclose(file_);
}

void TensorBoardWriter::write_event(int64_t step, std::string_view payload) {
  // tensorboard.Event: wall_time 1 (double seconds), step 2 (int64), then the payload's field.
  const double wall =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string event;
  put_double(event, 1, wall);
  put_key(event, 2, kVarint);
  tfrecord::put_varint(event, uint64_t(step));
  event.append(payload);
  const std::string record = tfrecord::frame(event);
  DS_CHECK(std::fwrite(record.data(), 1, record.size(), file_) == record.size(), "cannot write {} ({})", path_,
           std::strerror(errno));
}

void TensorBoardWriter::session_start(int64_t step) {
  std::string session, payload;
  put_key(session, 1, kVarint);  // SessionLog.status = START (1)
  tfrecord::put_varint(session, 1);
  put_bytes(payload, 7, session);  // Event.session_log (field 7; 6 is log_message)
  write_event(step, payload);
}

void TensorBoardWriter::write(int64_t step, const std::vector<std::pair<std::string, double>>& scalars,
                              const std::vector<std::pair<std::string, TbHistogram>>& histograms) {
  if (scalars.empty() && histograms.empty()) return;
  // tensorboard.Summary: repeated Value 1 {tag 1, simple_value 2 (float), histo 5}.
  std::string summary;
  for (const auto& [tag, v] : scalars) {
    std::string value;
    put_bytes(value, 1, tag);
    put_float(value, 2, float(v));
    put_bytes(summary, 1, value);
  }
  for (const auto& [tag, h] : histograms) {
    std::string value;
    put_bytes(value, 1, tag);
    put_bytes(value, 5, histogram_proto(h));
    put_bytes(summary, 1, value);
  }
  std::string payload;
  put_bytes(payload, 5, summary);  // Event.summary
  write_event(step, payload);
}

void TensorBoardWriter::flush() {
  DS_CHECK(std::fflush(file_) == 0, "cannot write {} ({})", path_, std::strerror(errno));
}

}  // namespace dstrain
