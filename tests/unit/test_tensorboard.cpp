// TensorBoard events written by hand: CRC-32C against its published check values, TFRecord's
// mask, protobuf varints, and records read back by a small decoder written here from the
// formats' descriptions (TFRecord framing, protobuf wire format, tensorboard's event.proto,
// summary.proto and histogram.proto field numbers): the file a Metrics run writes holds the
// file version, a session start, every scalar of metrics.jsonl and the expert-load histograms.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "core/error.h"
#include "train/metrics.h"
#include "train/tensorboard.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;

// ---- a decoder independent of the writer ------------------------------------------------------

uint64_t read_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(s[at + size_t(i)])) << (8 * i);
  return v;
}

// Splits TFRecords, checking both masked CRCs of each.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "truncated record header";
    const uint64_t n = read_le(file, at, 8);
    EXPECT_EQ(uint32_t(read_le(file, at + 8, 4)), tfrecord::mask(tfrecord::crc32c(file.data() + at, 8)));
    const std::string data = file.substr(at + 12, n);
    EXPECT_EQ(uint32_t(read_le(file, at + 12 + n, 4)), tfrecord::mask(tfrecord::crc32c(data.data(), data.size())));
    out.push_back(data);
    at += 12 + n + 4;
  }
  return out;
}

// One protobuf field: its wire type and value (varint, fixed bits or bytes).
struct Field {
  int wire = 0;
  uint64_t number = 0;  // varint or fixed32/fixed64 bits
  std::string bytes;
  double as_double() const {
    double d;
    std::memcpy(&d, &number, 8);
    return d;
  }
  float as_float() const {
    const uint32_t b = uint32_t(number);
    float f;
    std::memcpy(&f, &b, 4);
    return f;
  }
};

uint64_t read_varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t b = uint8_t(s.at(at++));
    v |= uint64_t(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
}

std::multimap<uint32_t, Field> parse(const std::string& s) {
  std::multimap<uint32_t, Field> out;
  size_t at = 0;
  while (at < s.size()) {
    const uint64_t key = read_varint(s, at);
    Field f;
    f.wire = int(key & 7);
    if (f.wire == 0) {
      f.number = read_varint(s, at);
    } else if (f.wire == 1 || f.wire == 5) {
      const int n = f.wire == 1 ? 8 : 4;
      f.number = read_le(s, at, n);
      at += size_t(n);
    } else if (f.wire == 2) {
      const uint64_t n = read_varint(s, at);
      f.bytes = s.substr(at, n);
      at += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.emplace(uint32_t(key >> 3), f);
  }
  return out;
}

const Field& one(const std::multimap<uint32_t, Field>& m, uint32_t field) {
  static const Field none;
  EXPECT_EQ(m.count(field), 1u) << "field " << field;
  const auto it = m.find(field);
  return it == m.end() ? none : it->second;
}

std::vector<double> packed_doubles(const std::string& bytes) {
  std::vector<double> v(bytes.size() / 8);
  std::memcpy(v.data(), bytes.data(), v.size() * 8);
  return v;
}

// What a reader takes from an events file: per step, scalars and histograms by tag, and the
// steps with a SessionLog.
struct Decoded {
  std::string file_version;
  std::vector<int64_t> session_starts;
  std::map<std::pair<int64_t, std::string>, float> scalars;
  std::map<std::pair<int64_t, std::string>, std::multimap<uint32_t, Field>> histograms;
};

Decoded decode_events(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Decoded d;
  for (const std::string& record : read_records(file)) {
    const auto event = parse(record);  // Event
    EXPECT_EQ(one(event, 1).wire, 1);  // wall_time: double
    EXPECT_GT(one(event, 1).as_double(), 1.6e9);
    const int64_t step = event.count(2) ? int64_t(one(event, 2).number) : 0;
    if (event.count(3)) d.file_version = one(event, 3).bytes;
    if (event.count(7)) {  // session_log: status 1 = START
      EXPECT_EQ(one(parse(one(event, 7).bytes), 1).number, 1u);
      d.session_starts.push_back(step);
    }
    if (!event.count(5)) continue;
    const auto summary = parse(one(event, 5).bytes);
    for (auto [it, end] = summary.equal_range(1); it != end; ++it) {
      const auto value = parse(it->second.bytes);
      const std::string tag = one(value, 1).bytes;
      if (value.count(2)) {
        EXPECT_EQ(one(value, 2).wire, 5);  // simple_value: float
        d.scalars[{step, tag}] = one(value, 2).as_float();
      }
      if (value.count(5)) d.histograms[{step, tag}] = parse(one(value, 5).bytes);
    }
  }
  return d;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "dstrain_tensorboard_XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::vector<std::string> events() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path)) {
      if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

// ---- the encoding ---------------------------------------------------------------------------

TEST(TensorBoard, Crc32cKnownVectors) {
  // The CRC catalogue's check value, and RFC 3720's (iSCSI) test patterns.
  EXPECT_EQ(tfrecord::crc32c("123456789", 9), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(tfrecord::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  EXPECT_EQ(tfrecord::crc32c(ones.data(), ones.size()), 0x62A8AB43u);
  std::string ascending;
  for (int i = 0; i < 32; ++i) ascending.push_back(char(i));
  EXPECT_EQ(tfrecord::crc32c(ascending.data(), ascending.size()), 0x46DD794Eu);
  EXPECT_EQ(tfrecord::crc32c("", 0), 0u);
  // Continued over pieces, the same CRC.
  EXPECT_EQ(tfrecord::crc32c("6789", 4, tfrecord::crc32c("12345", 5)), 0xE3069283u);
}

TEST(TensorBoard, MaskRotatesRightBy15AndAddsTheConstant) {
  EXPECT_EQ(tfrecord::mask(0), 0xa282ead8u);
  EXPECT_EQ(tfrecord::mask(0x12345678u), 0x4f730f40u);
  EXPECT_EQ(tfrecord::mask(0xE3069283u), 0xc78ab0e5u);
}

TEST(TensorBoard, VarintsLeastSignificantGroupFirst) {
  auto varint = [](uint64_t v) {
    std::string s;
    tfrecord::put_varint(s, v);
    return std::vector<uint8_t>(s.begin(), s.end());
  };
  EXPECT_EQ(varint(0), (std::vector<uint8_t>{0x00}));
  EXPECT_EQ(varint(1), (std::vector<uint8_t>{0x01}));
  EXPECT_EQ(varint(127), (std::vector<uint8_t>{0x7f}));
  EXPECT_EQ(varint(128), (std::vector<uint8_t>{0x80, 0x01}));
  EXPECT_EQ(varint(300), (std::vector<uint8_t>{0xac, 0x02}));
  EXPECT_EQ(varint(UINT64_MAX),
            (std::vector<uint8_t>{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}));
  // A negative int64 step goes out as its two's complement: ten bytes.
  EXPECT_EQ(varint(uint64_t(int64_t(-1))).size(), 10u);
}

TEST(TensorBoard, ARecordRoundTrips) {
  const std::string data = std::string("event\0bytes", 11);
  const std::string framed = tfrecord::frame(data);
  ASSERT_EQ(framed.size(), 8 + 4 + data.size() + 4);
  EXPECT_EQ(read_le(framed, 0, 8), data.size());
  const std::vector<std::string> back = read_records(framed + tfrecord::frame(""));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0], data);
  EXPECT_EQ(back[1], "");
  // A flipped bit in the data fails its CRC.
  std::string bad = framed;
  bad[14] ^= 1;
  EXPECT_NE(uint32_t(read_le(bad, 12 + data.size(), 4)),
            tfrecord::mask(tfrecord::crc32c(bad.data() + 12, data.size())));
}

TEST(TensorBoard, WriterEventsDecodeToWhatWasWritten) {
  TempDir dir;
  {
    TensorBoardWriter w(dir.path.string());
    EXPECT_THAT(w.path(), HasSubstr("events.out.tfevents."));
    w.session_start(5);
    w.write(5, {{"loss/total", 2.25}, {"lr", 1e-3}}, {{"moe/layer_1/expert_tokens", expert_load_histogram({3, 0, 5})}});
    w.write(6, {{"loss/total", 1.0 / 3.0}});
    w.flush();
  }
  ASSERT_EQ(dir.events().size(), 1u);
  const Decoded d = decode_events(dir.events()[0]);
  EXPECT_EQ(d.file_version, "brain.Event:2");
  EXPECT_EQ(d.session_starts, std::vector<int64_t>{5});
  EXPECT_EQ(d.scalars.at({5, "loss/total"}), 2.25f);
  EXPECT_EQ(d.scalars.at({5, "lr"}), float(1e-3));
  EXPECT_EQ(d.scalars.at({6, "loss/total"}), float(1.0 / 3.0));
  const auto& h = d.histograms.at({5, "moe/layer_1/expert_tokens"});
  EXPECT_EQ(one(h, 1).as_double(), -0.5);              // min
  EXPECT_EQ(one(h, 2).as_double(), 2.5);               // max
  EXPECT_EQ(one(h, 3).as_double(), 8.0);               // num
  EXPECT_EQ(one(h, 4).as_double(), 0 * 3 + 2 * 5.0);   // sum of expert indices
  EXPECT_EQ(one(h, 5).as_double(), 0 * 3 + 4 * 5.0);   // sum of their squares
  EXPECT_EQ(packed_doubles(one(h, 6).bytes), (std::vector<double>{0.5, 1.5, 2.5}));
  EXPECT_EQ(packed_doubles(one(h, 7).bytes), (std::vector<double>{3, 0, 5}));
  // A second writer in the same directory sorts after the first (TensorBoard reads in name order).
  TensorBoardWriter second(dir.path.string());
  ASSERT_EQ(dir.events().size(), 2u);
  EXPECT_EQ(dir.events()[1], second.path());
}

// ---- the key, the run's directory and the metrics it receives ---------------------------------

TEST(TensorBoard, TheKeyIsADirectoryOrEmpty) {
  auto parse = [](const json& j) { return MetricsConfig::from_json(JsonReader(j, "metrics", "run.json")); };
  EXPECT_EQ(parse(json::object()).tensorboard_dir, "") << "absent: off";
  EXPECT_EQ(parse({{"tensorboard_dir", "runs/a/tb"}}).tensorboard_dir, "runs/a/tb");
  MetricsConfig c;
  c.tensorboard_dir = "tb";
  EXPECT_EQ(parse(c.to_json()).tensorboard_dir, "tb") << "the resolved configuration reads back";
  try {
    parse({{"tensorboard_dir", 5}});
    ADD_FAILURE() << "a number was taken for a directory";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("metrics.tensorboard_dir"));
  }
}

TEST(TensorBoard, ADirectoryHoldsOneRun) {
  TempDir dir;
  const std::string tb = (dir.path / "tb").string(), run = (dir.path / "run_a").string();
  EXPECT_EQ(claim_tensorboard_dir(tb, run), "");
  EXPECT_TRUE(std::filesystem::exists(dir.path / "tb" / kTensorBoardMarker));
  EXPECT_EQ(claim_tensorboard_dir(tb, run), "") << "the same run (resumed) appends";
  EXPECT_EQ(claim_tensorboard_dir(tb, run + "/."), "") << "the same directory, spelt otherwise";
  const std::string other = claim_tensorboard_dir(tb, (dir.path / "run_b").string());
  EXPECT_THAT(other, HasSubstr("metrics.tensorboard_dir '" + tb + "' holds the TensorBoard events of another run"));
  EXPECT_THAT(other, HasSubstr(std::filesystem::weakly_canonical(run).string()));
  EXPECT_THAT(other, HasSubstr("Give this run a directory of its own"));
  // Events of no dstrain run.
  const std::string foreign = (dir.path / "foreign").string();
  std::filesystem::create_directories(foreign);
  std::ofstream(foreign + "/events.out.tfevents.1700000000.host.1.v2") << "x";
  const std::string refused = claim_tensorboard_dir(foreign, run);
  EXPECT_THAT(refused, HasSubstr("holds 1 TensorBoard events file(s) of no dstrain run"));
  EXPECT_THAT(refused, HasSubstr("events.out.tfevents.1700000000.host.1.v2"));
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(foreign) / kTensorBoardMarker));
}

TEST(TensorBoard, MetricsWritesWhatMetricsJsonlHas) {
  TempDir dir;
  MetricsConfig mc;
  mc.progress = "lines";
  mc.tensorboard_dir = (dir.path / "tb").string();
  ASSERT_EQ(claim_tensorboard_dir(mc.tensorboard_dir, dir.path.string()), "");
  ModelConfig model;
  model.hidden_size = 64;
  model.intermediate_size = 128;
  model.num_hidden_layers = 2;
  model.num_attention_heads = 4;
  model.num_key_value_heads = 2;
  model.vocab_size = 100;
  {
    Metrics m(mc, model, 32, 0, 1, 1, dir.path.string(), 10, [] { return Peak{100e9, "measured: injected"}; });
    for (int64_t step = 4; step <= 5; ++step) {  // a run resumed at step 3
      StepMetrics s;
      s.step = step;
      s.max_steps = 5;
      s.steps_this_run = step - 3;
      s.loss = 2.5 / double(step);
      s.lr = 1e-3 * double(step);
      s.grad_norm = 0.7;
      s.tokens_per_s = 12345.678;
      s.time = {1.0, 0.01, 0.45, 0.4, 0.0, 0.05, 0.0};
      s.rank_step_s = {1.0};
      s.rank_compute_s = {0.9};
      s.rank_peak_rss_bytes = {1e8};
      s.skipped_total = 1;
      s.loss_scaling = true;
      s.loss_scale = 65536;
      s.extra["ce_loss"] = 2.0;
      s.extra["aux_loss"] = 0.01;
      s.extra["mtp_loss"] = 0.3;
      s.extra["moe"] = {{"1", {{"max_over_mean_load", 1.5}, {"dead_experts", 1}, {"aux_loss", 0.01},
                               {"tokens_per_expert", {4, 0, 2, int(step)}}}}};
      m.on_step(s);
    }
    m.on_eval(5, 2.125, 0.25, 640, {{"books", {{"loss", 2.0}, {"accuracy", 0.3}, {"tokens", 320}}}});
    m.on_run_end();
  }
  std::vector<json> records;
  std::ifstream f(dir.path / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) records.push_back(json::parse(line));
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(mc.tensorboard_dir)) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(e.path().string());
  }
  ASSERT_EQ(files.size(), 1u);
  const Decoded d = decode_events(files[0]);
  EXPECT_EQ(d.session_starts, std::vector<int64_t>{4}) << "the run's first step starts a session";
  int checked = 0;
  for (const json& r : records) {
    if (r["type"] == "train") {
      const int64_t step = r["step"];
      auto g = [](const json& v) { return v.get<double>(); };
      const std::map<std::string, double> expected = {
          {"loss/total", g(r["loss"])},
          {"loss/ce", g(r["ce_loss"])},
          {"loss/aux", g(r["aux_loss"])},
          {"loss/mtp", g(r["mtp_loss"])},
          {"lr", g(r["lr"])},
          {"grad_norm", g(r["grad_norm"])},
          {"throughput/tokens_per_s", g(r["tokens_per_s"])},
          {"throughput/mfu", g(r["mfu"])},
          {"time/forward", g(r["time_s"]["forward"])},
          {"time/other", g(r["time_s"]["other"])},
          {"memory/parameters", g(r["memory_bytes"]["parameters"])},
          {"skipped_steps", g(r["skipped_total"])},
          {"loss_scale", g(r["loss_scale"])},
          {"moe/layer_1/dead_experts", g(r["moe"]["1"]["dead_experts"])}};
      for (const auto& [tag, v] : expected) {
        ASSERT_TRUE(d.scalars.count({step, tag})) << tag << " at step " << step;
        EXPECT_EQ(d.scalars.at({step, tag}), float(v)) << tag << " at step " << step;
        ++checked;
      }
      const auto& h = d.histograms.at({step, "moe/layer_1/expert_tokens"});
      EXPECT_EQ(packed_doubles(one(h, 7).bytes), (std::vector<double>{4, 0, 2, double(step)}));
    } else if (r["type"] == "eval") {
      EXPECT_EQ(d.scalars.at({5, "eval/loss"}), float(r["loss"].get<double>()));
      EXPECT_EQ(d.scalars.at({5, "eval/accuracy"}), float(r["accuracy"].get<double>()));
      EXPECT_EQ(d.scalars.at({5, "eval/books/loss"}), float(r["datasets"]["books"]["loss"].get<double>()));
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 14 + 1);
}

}  // namespace
}  // namespace dstrain
