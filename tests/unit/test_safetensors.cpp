// safetensors reading/writing and Hugging Face checkpoint load/save: round trips compared
// bitwise, hand-built BF16/F16 files against known values, and every validation error.
#include <gtest/gtest.h>

#include <malloc.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <iterator>
#include <set>
#include <vector>

#include "io/hf_weights.h"
#include "io/safetensors.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// Each test gets its own empty directory, removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* t = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           fmt::format("dstrain_test_{}_{}_{}", t->test_suite_name(), t->name(), long(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::set<std::string> listing(const fs::path& d) const {
    std::set<std::string> out;
    for (const auto& e : fs::directory_iterator(d)) out.insert(e.path().filename().string());
    return out;
  }
  fs::path dir_;
};

class SafeTensors : public TempDirTest {};
class HFWeightsIO : public TempDirTest {};

// The message of the dstrain::Error that `f` throws ("" and a test failure if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a dstrain::Error, got another exception: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected a dstrain::Error, nothing was thrown";
  return "";
}

::testing::AssertionResult has(const std::string& message, const std::string& part) {
  if (message.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "'" << part << "' not in the message:\n" << message;
}

// A file exactly as given: declared header length, header text, data bytes.
void write_raw(const std::string& file, uint64_t declared, const std::string& header,
               const std::vector<uint8_t>& data) {
  std::ofstream out(file, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(char(uint8_t(declared >> (8 * i))));
  out.write(header.data(), std::streamsize(header.size()));
  out.write(reinterpret_cast<const char*>(data.data()), std::streamsize(data.size()));
  ASSERT_TRUE(out.good()) << file;
}
void write_raw(const std::string& file, const std::string& header, const std::vector<uint8_t>& data) {
  write_raw(file, header.size(), header, data);
}

void append_u16(std::vector<uint8_t>& bytes, uint16_t v) {
  bytes.push_back(uint8_t(v & 0xff));
  bytes.push_back(uint8_t(v >> 8));
}
template <class T>
void append(std::vector<uint8_t>& bytes, T v) {
  uint8_t b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  bytes.insert(bytes.end(), b, b + sizeof(T));
}

std::vector<float> read_all(const SafeTensorsFile& f, const std::string& name) {
  std::vector<float> v(size_t(f.info(name).shape.numel()));
  f.read_f32(name, Tensor(v.data(), DType::F32, Shape{int64_t(v.size())}));
  return v;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_F(SafeTensors, RoundTripF32) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> matrix = {0.0f, -0.0f, 1.0f, -2.5f, 1e-40f /* fp32 subnormal */, 3.0e38f};
  std::vector<float> scalar = {3.25f};
  std::vector<float> one = {-7.0f};
  std::vector<float> odd(7 * 13);
  for (float& x : odd) x = nd(rng);
  std::vector<float> empty;
  const std::vector<std::pair<std::string, Tensor>> tensors = {
      {"matrix", Tensor(matrix.data(), DType::F32, Shape{2, 3})},
      {"scalar", Tensor(scalar.data(), DType::F32, Shape{})},
      {"one", Tensor(one.data(), DType::F32, Shape{1})},
      {"odd", Tensor(odd.data(), DType::F32, Shape{7, 13})},
      {"empty", Tensor(nullptr, DType::F32, Shape{0, 4})},
  };
  const std::string file = path("round.safetensors");
  write_safetensors(file, tensors, {{"format", "pt"}, {"note", "unit test"}});
  EXPECT_FALSE(fs::exists(file + ".tmp"));

  // The header is padded so that the data region starts 8-byte aligned.
  std::ifstream in(file, std::ios::binary);
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | len[i];
  EXPECT_EQ(header_bytes % 8, 0u);
  EXPECT_EQ(fs::file_size(file), 8 + header_bytes + (6 + 1 + 1 + 91) * 4);

  SafeTensorsFile f(file);
  ASSERT_EQ(f.tensors().size(), 5u);
  // Data in the order given (the empty tensor sits at the end offset of the last one).
  EXPECT_EQ(f.tensors()[0].name, "matrix");
  EXPECT_EQ(f.tensors()[1].name, "scalar");
  EXPECT_EQ(f.tensors()[2].name, "one");
  EXPECT_EQ(f.tensors()[3].name, "odd");
  EXPECT_EQ(f.info("matrix").shape, (Shape{2, 3}));
  EXPECT_EQ(f.info("scalar").shape.ndim(), 0);
  EXPECT_EQ(f.info("one").shape, (Shape{1}));
  EXPECT_EQ(f.info("empty").shape, (Shape{0, 4}));
  EXPECT_EQ(f.info("odd").dtype, DType::F32);
  EXPECT_EQ(f.info("odd").nbytes(), 7 * 13 * 4);
  EXPECT_TRUE(f.has("odd"));
  EXPECT_FALSE(f.has("missing"));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"note", "unit test"}}));

  EXPECT_TRUE(bitwise_equal(read_all(f, "matrix"), matrix));
  EXPECT_TRUE(bitwise_equal(read_all(f, "scalar"), scalar));
  EXPECT_TRUE(bitwise_equal(read_all(f, "one"), one));
  EXPECT_TRUE(bitwise_equal(read_all(f, "odd"), odd));
  EXPECT_TRUE(read_all(f, "empty").empty());

  // Any destination shape with the same element count; another count is an error.
  std::vector<float> flat(6);
  f.read_f32("matrix", Tensor(flat.data(), DType::F32, Shape{6}));
  EXPECT_TRUE(bitwise_equal(flat, matrix));
  std::vector<float> small(5);
  const std::string msg = error_of([&] { f.read_f32("matrix", Tensor(small.data(), DType::F32, Shape{5})); });
  EXPECT_TRUE(has(msg, "'matrix'"));
  EXPECT_TRUE(has(msg, file));
  EXPECT_TRUE(has(msg, "(2, 3)"));
  EXPECT_TRUE(has(error_of([&] { f.info("nope"); }), "'nope'"));
}

TEST_F(SafeTensors, WritesAndReadsBF16AndF16) {
  const std::vector<float> values = {1.0f, -2.5f, 0.1f, 65504.0f, 3.0e-5f, -0.0f, 1234.5678f};
  std::vector<uint16_t> bf(values.size()), h(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bf[i] = f32_to_bf16(values[i]);
    h[i] = f32_to_f16(values[i]);
  }
  const std::string file = path("half.safetensors");
  write_safetensors(file, {{"bf", Tensor(bf.data(), DType::BF16, Shape{7})},
                           {"h", Tensor(h.data(), DType::F16, Shape{7, 1})}});
  SafeTensorsFile f(file);
  EXPECT_EQ(f.info("bf").dtype, DType::BF16);
  EXPECT_EQ(f.info("h").dtype, DType::F16);
  EXPECT_EQ(f.info("h").nbytes(), 14);
  const std::vector<float> rb = read_all(f, "bf"), rh = read_all(f, "h");
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(rb[i], bf16_to_f32(bf[i])) << i;
    EXPECT_EQ(rh[i], f16_to_f32(h[i])) << i;
    EXPECT_NEAR(rb[i], values[i], std::fabs(values[i]) / 128) << i;  // 8 significant bits
  }
}

// A piece of a tensor read from its own bytes: every row range and column range of a 6 x 10
// BF16 matrix (behind an F32 tensor, so offsets are not those of the first) equals the same
// elements of the whole read; ranges past the end are an error naming the tensor.
TEST_F(SafeTensors, ReadsElementRangesOfATensor) {
  std::vector<float> first(5, 1.0f);
  std::vector<uint16_t> m(60);
  for (size_t i = 0; i < m.size(); ++i) m[i] = f32_to_bf16(0.25f * float(i) - 3.0f);
  const std::string file = path("ranges.safetensors");
  write_safetensors(file, {{"a", Tensor(first.data(), DType::F32, Shape{5})}, {"m", Tensor(m.data(), DType::BF16, Shape{6, 10})}});
  SafeTensorsFile f(file);
  const std::vector<float> whole = read_all(f, "m");
  for (int64_t begin = 0; begin < 60; begin += 7) {
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(5), 60 - begin}) {
      if (begin + n > 60) continue;
      std::vector<float> got(size_t(n) + 1, -99.0f);
      f.read_f32_range("m", begin, n, got.data());
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(got[size_t(i)], whole[size_t(begin + i)]) << begin << "+" << i;
      EXPECT_EQ(got[size_t(n)], -99.0f) << "wrote past the range";
    }
  }
  float x = 0;
  try {
    f.read_f32_range("m", 55, 6, &x);
    ADD_FAILURE() << "a range past the end was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[55, 61) of 'm'"), std::string::npos) << e.what();
  }
}

// Bytes built by hand, at odd offsets (a 3-byte tensor first, an unpadded header), against
// values known independently of dstrain's converters.
TEST_F(SafeTensors, ReadsHandBuiltHalfPrecisionUnaligned) {
  std::vector<uint8_t> data = {1, 2, 3};  // "pad", U8
  for (uint16_t v : {0x3F80, 0xC020, 0x3DCD}) append_u16(data, v);                  // BF16 1, -2.5, 0.1
  for (uint16_t v : {0x3C00, 0xC100, 0x2E66, 0x0001, 0x83FF}) append_u16(data, v);  // F16
  append<double>(data, 1.5);
  append<double>(data, 0.1);
  const std::string header =
      R"({"pad":{"dtype":"U8","shape":[3],"data_offsets":[0,3]},)"
      R"("bf":{"dtype":"BF16","shape":[3],"data_offsets":[3,9]},)"
      R"("h":{"dtype":"F16","shape":[5],"data_offsets":[9,19]},)"
      R"("d":{"dtype":"F64","shape":[2],"data_offsets":[19,35]}})";
  ASSERT_EQ(data.size(), 35u);
  const std::string file = path("hand.safetensors");
  write_raw(file, header, data);

  SafeTensorsFile f(file);
  EXPECT_EQ(read_all(f, "bf"), (std::vector<float>{1.0f, -2.5f, 0.10009765625f}));
  // 0.1 in F16 is 0.0999755859375; 0x0001 is the smallest subnormal 2^-24; 0x83FF is the
  // largest subnormal, negated: -1023 * 2^-24.
  EXPECT_EQ(read_all(f, "h"),
            (std::vector<float>{1.0f, -2.5f, 0.0999755859375f, 5.9604644775390625e-08f, -6.097555160522461e-05f}));
  EXPECT_EQ(read_all(f, "d"), (std::vector<float>{1.5f, 0.1f}));

  const std::string msg = error_of([&] { read_all(f, "pad"); });
  EXPECT_TRUE(has(msg, "'pad'"));
  EXPECT_TRUE(has(msg, "U8"));
  EXPECT_TRUE(has(msg, file));
}

TEST_F(SafeTensors, RejectsCorruptFiles) {
  const std::vector<uint8_t> twelve(12, 0);
  struct Case {
    std::string name, header;
    std::vector<uint8_t> data;
    std::vector<std::string> expect;  // parts of the message besides the file name
  };
  const std::vector<Case> cases = {
      {"bad_json", R"({"w": {"dtype": "F32",)", twelve, {"not valid JSON"}},
      {"not_object", "[1, 2]", twelve, {"expected a JSON object"}},
      {"no_dtype", R"({"w":{"shape":[3],"data_offsets":[0,12]}})", twelve, {"'w'", "\"dtype\""}},
      {"no_offsets", R"({"w":{"dtype":"F32","shape":[3]}})", twelve, {"'w'", "\"data_offsets\""}},
      {"unknown_dtype", R"({"w":{"dtype":"C64","shape":[12],"data_offsets":[0,12]}})", twelve,
       {"'w'", "unknown dtype \"C64\""}},
      {"fp8_e5m2", R"({"w":{"dtype":"F8_E5M2","shape":[12],"data_offsets":[0,12]}})", twelve,
       {"'w'", "\"F8_E5M2\" is an FP8 format dstrain does not read", "it reads F8_E4M3"}},
      {"negative_dim", R"({"w":{"dtype":"F32","shape":[-3],"data_offsets":[0,12]}})", twelve, {"'w'", "negative"}},
      {"size_mismatch", R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}})", twelve,
       {"'w'", "needs 16 bytes", "hold 12 bytes"}},
      {"out_of_range", R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[4,20]}})", twelve,
       {"'w'", "outside the data region of 12 bytes"}},
      {"overlap",
       R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
       R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
       twelve, {"'b'", "overlaps tensor 'a'"}},
      {"bad_metadata", R"({"__metadata__":{"format":3}})", {}, {"__metadata__", "\"format\""}},
      // 1.2 MB of {"a": nesting once overflowed the stack (SIGSEGV) when its entry was printed.
      {"deep_nesting", [] {
         std::string h;
         for (int i = 0; i < 240000; ++i) h += R"({"a":)";
         return h + "1" + std::string(240000, '}');
       }(), twelve, {"nest deeper than 64 levels", "not a safetensors header"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string file = path(c.name + ".safetensors");
    write_raw(file, c.header, c.data);
    const std::string msg = error_of([&] { SafeTensorsFile f(file); });
    EXPECT_TRUE(has(msg, file));
    for (const std::string& part : c.expect) EXPECT_TRUE(has(msg, part));
  }

  // The first 8 bytes: too few of them, or a length the file cannot hold.
  const std::string truncated = path("truncated.safetensors");
  { std::ofstream(truncated, std::ios::binary) << "abcde"; }
  std::string msg = error_of([&] { SafeTensorsFile f(truncated); });
  EXPECT_TRUE(has(msg, truncated));
  EXPECT_TRUE(has(msg, "is 5 bytes"));

  const std::string short_header = path("short_header.safetensors");
  write_raw(short_header, 1000, "{}", {});
  msg = error_of([&] { SafeTensorsFile f(short_header); });
  EXPECT_TRUE(has(msg, short_header));
  EXPECT_TRUE(has(msg, "1000 bytes but only 2 bytes follow"));

  const std::string absurd = path("absurd.safetensors");
  write_raw(absurd, uint64_t(1) << 40, "{}", {});
  msg = error_of([&] { SafeTensorsFile f(absurd); });
  EXPECT_TRUE(has(msg, absurd));
  EXPECT_TRUE(has(msg, "100 MB"));

  msg = error_of([&] { SafeTensorsFile f(path("does_not_exist.safetensors")); });
  EXPECT_TRUE(has(msg, path("does_not_exist.safetensors")));
  EXPECT_TRUE(has(msg, "No such file"));

  // A valid empty file, for contrast.
  const std::string empty = path("empty.safetensors");
  write_raw(empty, "{}", {});
  EXPECT_TRUE(SafeTensorsFile(empty).tensors().empty());
}

TEST_F(SafeTensors, WriteErrorsNameThePathAndLeaveNoFile) {
  std::vector<float> v(4, 1.0f);
  const Tensor t(v.data(), DType::F32, Shape{4});
  const std::string nodir = path("no_such_dir/x.safetensors");
  std::string msg = error_of([&] { write_safetensors(nodir, {{"w", t}}); });
  EXPECT_TRUE(has(msg, nodir));
  EXPECT_TRUE(has(msg, "No such file or directory"));

  msg = error_of([&] { write_safetensors(path("dup.safetensors"), {{"w", t}, {"w", t}}); });
  EXPECT_TRUE(has(msg, "'w' is given twice"));
  std::vector<int32_t> ints(4);
  msg = error_of([&] {
    write_safetensors(path("int.safetensors"), {{"ids", Tensor(ints.data(), DType::I32, Shape{4})}});
  });
  EXPECT_TRUE(has(msg, "'ids' is I32"));
  EXPECT_FALSE(fs::exists(path("dup.safetensors")));

  // A full disk, simulated with a file-size limit: the write fails with errno text, the
  // earlier complete file keeps its name and the temporary file is gone.
  const std::string file = path("full.safetensors");
  write_safetensors(file, {{"w", t}});
  const auto good_size = fs::file_size(file);
  std::vector<float> big(1 << 20, 2.0f);  // 4 MiB
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = old;
  limited.rlim_cur = 64 * 1024;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  msg = error_of([&] { write_safetensors(file, {{"big", Tensor(big.data(), DType::F32, Shape{1 << 20})}}); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(has(msg, file + ".tmp"));
  EXPECT_TRUE(has(msg, "File too large"));
  EXPECT_FALSE(fs::exists(file + ".tmp"));
  EXPECT_EQ(fs::file_size(file), good_size);
  EXPECT_TRUE(SafeTensorsFile(file).has("w"));
}

// A LLaMA-shaped registry registered as the transformer does (fused q/k/v and gate/up).
void build_registry(ParamRegistry& reg, int64_t V, int64_t C, int64_t I, int layers, bool tied) {
  const int64_t kv = C / 2;
  reg.add("model.embed_tokens.weight", Shape{V, C}, ParamKind::Embedding, -1);
  for (int l = 0; l < layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    reg.add(p + "self_attn.q_proj.weight", Shape{C, C}, ParamKind::Linear, l);
    reg.add(p + "self_attn.k_proj.weight", Shape{kv, C}, ParamKind::Linear, l, true);
    reg.add(p + "self_attn.v_proj.weight", Shape{kv, C}, ParamKind::Linear, l, true);
    reg.add(p + "self_attn.o_proj.weight", Shape{C, C}, ParamKind::Linear, l);
    reg.add(p + "input_layernorm.weight", Shape{C}, ParamKind::Norm, l);
    reg.add(p + "post_attention_layernorm.weight", Shape{C}, ParamKind::Norm, l);
    reg.add(p + "mlp.gate_proj.weight", Shape{I, C}, ParamKind::Linear, l);
    reg.add(p + "mlp.up_proj.weight", Shape{I, C}, ParamKind::Linear, l, true);
    reg.add(p + "mlp.down_proj.weight", Shape{C, I}, ParamKind::Linear, l);
  }
  reg.add("model.norm.weight", Shape{C}, ParamKind::Norm, -1);
  if (!tied) reg.add("lm_head.weight", Shape{V, C}, ParamKind::Head, -1);
  reg.allocate(Device::cpu());
}

void fill(const ParamRegistry& reg, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  for (int id = 0; id < reg.size(); ++id) {
    float* p = reg.param(id).data<float>();
    for (int64_t i = 0; i < reg.info(id).numel(); ++i) p[i] = nd(rng);
  }
}

bool same_params(const ParamRegistry& a, const ParamRegistry& b) {
  if (a.size() != b.size()) return false;
  for (int id = 0; id < a.size(); ++id) {
    const Tensor x = a.param(id), y = b.param(id);
    if (a.info(id).name != b.info(id).name || !(x.shape() == y.shape()) ||
        std::memcmp(x.raw(), y.raw(), x.nbytes()) != 0) {
      ADD_FAILURE() << "parameter " << a.info(id).name << " differs";
      return false;
    }
  }
  return true;
}

// Every registry tensor as it would be saved, plus `extra`.
std::vector<std::pair<std::string, Tensor>> tensors_of(const ParamRegistry& reg,
                                                       std::vector<std::pair<std::string, Tensor>> extra = {}) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (int id = 0; id < reg.size(); ++id) out.emplace_back(reg.info(id).name, reg.param(id));
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

TEST_F(HFWeightsIO, ShardedSaveLoadRoundTrip) {
  ParamRegistry reg;
  build_registry(reg, 37, 8, 12, 2, false);
  fill(reg, 1);
  const json config = {{"hidden_size", 8}, {"vocab_size", 37}, {"tie_word_embeddings", false}};
  const std::string dir = path("ckpt");
  save_hf_weights(dir, reg, config, 1500);  // the 1184-byte embedding and head force many shards

  const std::set<std::string> files = listing(dir);
  EXPECT_FALSE(files.count("model.safetensors"));
  ASSERT_TRUE(files.count("model.safetensors.index.json"));
  EXPECT_EQ(read_json_file(dir + "/config.json"), config);
  const json index = read_json_file(dir + "/model.safetensors.index.json");
  const json& weight_map = index["weight_map"];
  ASSERT_EQ(weight_map.size(), size_t(reg.size()));
  std::set<std::string> shards;
  for (const auto& [name, shard] : weight_map.items()) shards.insert(shard.get<std::string>());
  const size_t n = shards.size();
  ASSERT_GE(n, 3u);
  for (size_t i = 1; i <= n; ++i) {
    const std::string shard = fmt::format("model-{:05d}-of-{:05d}.safetensors", i, n);
    EXPECT_TRUE(shards.count(shard)) << shard;
    EXPECT_TRUE(files.count(shard)) << shard;
    SafeTensorsFile f(dir + "/" + shard);
    EXPECT_EQ(f.metadata().at("format"), "pt");
    int64_t bytes = 0;
    for (size_t t = 0; t < f.tensors().size(); ++t) {
      EXPECT_EQ(f.tensors()[t].dtype, DType::F32);
      if (t > 0) {
        EXPECT_LT(f.tensors()[t - 1].name, f.tensors()[t].name);  // sorted by name
      }
      bytes += f.tensors()[t].nbytes();
    }
    EXPECT_TRUE(bytes <= 1500 || f.tensors().size() == 1) << shard << " holds " << bytes << " bytes";
  }
  EXPECT_EQ(files.size(), n + 2);  // shards, index, config.json
  int64_t total = 0;
  for (const ParamInfo& p : reg.all()) total += p.numel() * 4;
  EXPECT_EQ(index["metadata"]["total_size"].get<int64_t>(), total);

  const HFWeights w(dir);
  EXPECT_EQ(w.names().size(), size_t(reg.size()));
  EXPECT_EQ(w.shape("model.layers.1.mlp.down_proj.weight"), (Shape{8, 12}));
  EXPECT_EQ(w.dtype("model.norm.weight"), DType::F32);
  EXPECT_TRUE(w.has("lm_head.weight"));
  EXPECT_FALSE(w.has("model.layers.2.mlp.down_proj.weight"));

  ParamRegistry loaded;
  build_registry(loaded, 37, 8, 12, 2, false);
  const HFLoadStats stats = load_hf_weights(dir, loaded);
  EXPECT_EQ(stats.loaded, reg.size());
  EXPECT_EQ(stats.skipped_inv_freq, 0);
  EXPECT_TRUE(same_params(reg, loaded));
}

TEST_F(HFWeightsIO, SavesInTheRequestedDtypeAndSaysSoInTorchDtype) {
  ParamRegistry reg;
  build_registry(reg, 37, 8, 12, 2, false);
  fill(reg, 5);
  const json config = {{"hidden_size", 8}, {"torch_dtype", "float32"}};
  for (DType dt : {DType::BF16, DType::F16, DType::F32}) {
    const std::string dir = path(fmt::format("hf_{}", dtype_name(dt)));
    save_hf_weights(dir, reg, config, int64_t(5) << 30, dt);
    EXPECT_EQ(read_json_file(dir + "/config.json")["torch_dtype"], torch_dtype_name(dt));
    EXPECT_EQ(read_json_file(dir + "/config.json")["hidden_size"], 8);
    SafeTensorsFile f(dir + "/model.safetensors");
    ASSERT_EQ(f.tensors().size(), size_t(reg.size()));
    for (const SafeTensorInfo& t : f.tensors()) {
      EXPECT_EQ(t.dtype, dt) << t.name;
      EXPECT_EQ(t.nbytes(), reg.info(reg.find(t.name)).numel() * int64_t(dtype_size(dt))) << t.name;
    }
    // Each value is the master rounded to nearest even, and reads back as such.
    ParamRegistry loaded;
    build_registry(loaded, 37, 8, 12, 2, false);
    load_hf_weights(dir, loaded);
    for (int id = 0; id < reg.size(); ++id) {
      const float* a = reg.param(id).data<float>();
      const float* b = loaded.param(id).data<float>();
      for (int64_t i = 0; i < reg.info(id).numel(); ++i) {
        const float want = dt == DType::BF16 ? bf16_to_f32(f32_to_bf16(a[i]))
                           : dt == DType::F16 ? f16_to_f32(f32_to_f16(a[i]))
                                              : a[i];
        ASSERT_EQ(b[i], want) << reg.info(id).name << "[" << i << "] in " << dtype_name(dt);
      }
    }
  }
  // A 16-bit save halves the bytes a shard holds.
  const std::string dir = path("hf_bf16_sharded");
  save_hf_weights(dir, reg, json::object(), 1500, DType::BF16);
  const size_t bf16_files = listing(dir).size();
  save_hf_weights(path("hf_f32_sharded"), reg, json::object(), 1500, DType::F32);
  EXPECT_LT(bf16_files, listing(path("hf_f32_sharded")).size());
  EXPECT_EQ(read_json_file(dir + "/config.json")["torch_dtype"], "bfloat16");
  EXPECT_EQ(dtype_from_torch_name("float16"), DType::F16);
  EXPECT_THROW(dtype_from_torch_name("half"), Error);
}

TEST_F(HFWeightsIO, ResaveWithOtherShardingRemovesStaleFiles) {
  ParamRegistry reg;
  build_registry(reg, 37, 8, 12, 2, false);
  fill(reg, 2);
  const std::string dir = path("ckpt");
  save_hf_weights(dir, reg, json::object(), 1500);
  const size_t many = listing(dir).size();
  { std::ofstream(dir + "/model-00001-of-00009.safetensors.tmp") << "left by a crash"; }
  { std::ofstream(dir + "/README.md") << "not ours"; }

  save_hf_weights(dir, reg, json::object());  // fits one file
  EXPECT_EQ(listing(dir), (std::set<std::string>{"config.json", "model.safetensors", "README.md"}));
  ParamRegistry a;
  build_registry(a, 37, 8, 12, 2, false);
  load_hf_weights(dir, a);
  EXPECT_TRUE(same_params(reg, a));
  // The single file can also be named directly.
  ParamRegistry b;
  build_registry(b, 37, 8, 12, 2, false);
  EXPECT_EQ(load_hf_weights(dir + "/model.safetensors", b).loaded, reg.size());
  EXPECT_TRUE(same_params(reg, b));

  save_hf_weights(dir, reg, json::object(), 3000);  // fewer, larger shards
  std::set<std::string> files = listing(dir);
  EXPECT_FALSE(files.count("model.safetensors"));
  EXPECT_TRUE(files.count("model.safetensors.index.json"));
  EXPECT_LT(files.size(), many + 1);
  save_hf_weights(dir, reg, json::object(), 1500);
  files = listing(dir);
  EXPECT_EQ(files.size(), many + 1);  // + README.md
  for (const std::string& f : files) {
    if (f.find("-of-") != std::string::npos) {
      EXPECT_TRUE(has(f, fmt::format("-of-{:05d}", many - 2)));
    }
  }
  ParamRegistry c;
  build_registry(c, 37, 8, 12, 2, false);
  load_hf_weights(dir, c);
  EXPECT_TRUE(same_params(reg, c));
}

TEST_F(HFWeightsIO, LoadsBF16Checkpoint) {
  ParamRegistry reg;
  build_registry(reg, 11, 4, 6, 1, true);
  fill(reg, 3);
  std::vector<std::vector<uint16_t>> store;
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (int id = 0; id < reg.size(); ++id) {
    const Tensor p = reg.param(id);
    std::vector<uint16_t> h(size_t(p.numel()));
    for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(p.data<float>()[i]);
    store.push_back(std::move(h));
    tensors.emplace_back(reg.info(id).name, Tensor(store.back().data(), DType::BF16, p.shape()));
  }
  const std::string file = path("bf16.safetensors");
  write_safetensors(file, tensors);
  ParamRegistry loaded;
  build_registry(loaded, 11, 4, 6, 1, true);
  load_hf_weights(file, loaded);
  for (int id = 0; id < reg.size(); ++id) {
    for (int64_t i = 0; i < reg.info(id).numel(); ++i) {
      ASSERT_EQ(loaded.param(id).data<float>()[i], bf16_to_f32(store[size_t(id)][size_t(i)])) << reg.info(id).name;
    }
  }
}

// DeepSeek's block-scaled FP8 (DeepSeek-V3 inference/kernel.py): the export stores each
// projection matrix as fp8(x / s) with s = amax / 448 per 8 x 8 block (partial blocks at the
// edges, a block of zeros with scale 0), the rest in BF16, and config.json says so; reading it
// back gives fp8 * s in fp32 (weight_dequant), and exporting that again gives the same bytes.
TEST_F(HFWeightsIO, FP8ExportQuantisesAsDeepSeekAndReadsBackDequantised) {
  ParamRegistry reg;
  build_registry(reg, 11, 20, 24, 2, false);
  fill(reg, 9);
  const int o_proj = reg.find("model.layers.1.self_attn.o_proj.weight");
  for (int r = 8; r < 16; ++r) {
    for (int c = 0; c < 8; ++c) reg.param(o_proj).data<float>()[r * 20 + c] = 0;  // block (1, 0)
  }
  HFSaveOptions options;
  options.dtype = DType::F8_E4M3;
  options.block = FP8Block{8, 8};
  const std::string dir = path("fp8");
  save_hf_weights(dir, reg, json{{"model_type", "llama"}}, options);
  const json config = read_json_file(dir + "/config.json", kDataJson);
  EXPECT_EQ(config["quantization_config"],
            (json{{"activation_scheme", "dynamic"}, {"fmt", "e4m3"}, {"quant_method", "fp8"},
                  {"weight_block_size", {8, 8}}}));
  EXPECT_EQ(config["torch_dtype"], "bfloat16");

  const SafeTensorsFile f(dir + "/model.safetensors");
  int fp8_tensors = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    const float* x = reg.param(id).data<float>();
    if (!is_fp8_weight(p.name)) {
      EXPECT_EQ(f.info(p.name).dtype, DType::BF16) << p.name;
      EXPECT_FALSE(f.has(fp8_scale_name(p.name))) << p.name;
      continue;
    }
    ++fp8_tensors;
    ASSERT_EQ(f.info(p.name).dtype, DType::F8_E4M3) << p.name;
    const int64_t rows = p.shape[0], cols = p.shape[1];
    const SafeTensorInfo& si = f.info(fp8_scale_name(p.name));
    ASSERT_EQ(si.dtype, DType::F32);
    ASSERT_EQ(si.shape, (Shape{(rows + 7) / 8, (cols + 7) / 8})) << p.name;
    const auto codes = f.raw(p.name);
    const std::vector<float> scales = read_all(f, si.name);
    for (int64_t br = 0; br < si.shape[0]; ++br) {
      for (int64_t bc = 0; bc < si.shape[1]; ++bc) {
        float amax = 0;
        for (int64_t r = br * 8; r < std::min(rows, br * 8 + 8); ++r) {
          for (int64_t c = bc * 8; c < std::min(cols, bc * 8 + 8); ++c) amax = std::max(amax, std::fabs(x[r * cols + c]));
        }
        const float s = scales[size_t(br * si.shape[1] + bc)];
        ASSERT_EQ(s, amax / 448.0f) << p.name << " block " << br << "," << bc;
        for (int64_t r = br * 8; r < std::min(rows, br * 8 + 8); ++r) {
          for (int64_t c = bc * 8; c < std::min(cols, bc * 8 + 8); ++c) {
            const auto code = uint8_t(codes[size_t(r * cols + c)]);
            ASSERT_EQ(code, amax == 0 ? uint8_t(0) : f32_to_f8e4m3(x[r * cols + c] / s)) << p.name << " " << r << "," << c;
          }
        }
      }
    }
  }
  EXPECT_EQ(fp8_tensors, 2 * 7);

  ParamRegistry loaded;
  build_registry(loaded, 11, 20, 24, 2, false);
  const HFLoadStats stats = load_hf_weights(dir, loaded);
  EXPECT_EQ(stats.fp8_dequantised, 2 * 7);
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    if (!is_fp8_weight(p.name)) continue;
    const std::vector<float> scales = read_all(f, fp8_scale_name(p.name));
    const auto codes = f.raw(p.name);
    const int64_t cols = p.shape[1], scale_cols = (cols + 7) / 8;
    for (int64_t i = 0; i < p.numel(); ++i) {
      const float want = f8e4m3_to_f32(uint8_t(codes[size_t(i)])) * scales[size_t((i / cols / 8) * scale_cols + (i % cols) / 8)];
      ASSERT_EQ(loaded.param(id).data<float>()[i], want) << p.name << " " << i;
    }
  }
  EXPECT_EQ(loaded.param(o_proj).data<float>()[8 * 20], 0.0f);
  const std::string again = path("fp8_again");
  save_hf_weights(again, loaded, json{{"model_type", "llama"}}, options);
  std::ifstream a(dir + "/model.safetensors", std::ios::binary), b(again + "/model.safetensors", std::ios::binary);
  const std::string bytes_a((std::istreambuf_iterator<char>(a)), {}), bytes_b((std::istreambuf_iterator<char>(b)), {});
  EXPECT_GT(bytes_a.size(), 1000u);
  EXPECT_TRUE(bytes_a == bytes_b) << "FP8 in, FP8 out is not bit for bit";
}

TEST_F(HFWeightsIO, ShapeMismatchNamesTensorAndConfig) {
  ParamRegistry reg;
  build_registry(reg, 37, 8, 12, 1, false);
  const std::string dir = path("ckpt");
  save_hf_weights(dir, reg, json::object());
  ParamRegistry other;
  build_registry(other, 40, 8, 12, 1, false);  // another vocab_size
  const std::string msg = error_of([&] { load_hf_weights(dir, other); });
  EXPECT_TRUE(has(msg, "'lm_head.weight'") || has(msg, "'model.embed_tokens.weight'")) << msg;
  EXPECT_TRUE(has(msg, "(37, 8)"));
  EXPECT_TRUE(has(msg, "(40, 8)"));
  EXPECT_TRUE(has(msg, "config.json"));
  EXPECT_TRUE(has(msg, dir + "/model.safetensors"));
}

TEST_F(HFWeightsIO, MissingAndUnexpectedTensorsAreListed) {
  ParamRegistry reg;
  build_registry(reg, 13, 4, 6, 2, false);
  const std::string dir = path("ckpt");
  save_hf_weights(dir, reg, json::object());

  ParamRegistry deeper;  // 4 layers: 18 parameters the file lacks
  build_registry(deeper, 13, 4, 6, 4, false);
  std::string msg = error_of([&] { load_hf_weights(dir, deeper); });
  EXPECT_TRUE(has(msg, "18 parameter(s) missing"));
  EXPECT_TRUE(has(msg, "'model.layers.2.self_attn.q_proj.weight'"));
  EXPECT_TRUE(has(msg, "and 8 more"));
  EXPECT_TRUE(has(msg, dir));
  EXPECT_TRUE(has(msg, "config.json"));

  ParamRegistry shallower;  // 1 layer: the file's layer 1 is left over
  build_registry(shallower, 13, 4, 6, 1, false);
  msg = error_of([&] { load_hf_weights(dir, shallower); });
  EXPECT_TRUE(has(msg, "9 tensor(s) in the files that the model does not have"));
  EXPECT_TRUE(has(msg, "'model.layers.1.mlp.down_proj.weight'"));
  EXPECT_FALSE(has(msg, "missing"));
}

TEST_F(HFWeightsIO, RotaryInvFreqIsCountedNotLoaded) {
  ParamRegistry reg;
  build_registry(reg, 13, 4, 6, 2, false);
  fill(reg, 4);
  std::vector<float> inv_freq = {1.0f, 0.01f};
  const std::string file = path("with_inv_freq.safetensors");
  write_safetensors(file, tensors_of(reg, {{"model.layers.0.self_attn.rotary_emb.inv_freq",
                                            Tensor(inv_freq.data(), DType::F32, Shape{2})},
                                           {"model.layers.1.self_attn.rotary_emb.inv_freq",
                                            Tensor(inv_freq.data(), DType::F32, Shape{2})}}));
  ParamRegistry loaded;
  build_registry(loaded, 13, 4, 6, 2, false);
  const HFLoadStats stats = load_hf_weights(file, loaded);
  EXPECT_EQ(stats.loaded, reg.size());
  EXPECT_EQ(stats.skipped_inv_freq, 2);
  EXPECT_FALSE(stats.tied_lm_head_checked);
  EXPECT_TRUE(same_params(reg, loaded));
}

TEST_F(HFWeightsIO, TiedHeadMustEqualTheEmbedding) {
  ParamRegistry reg;
  build_registry(reg, 13, 4, 6, 1, true);
  fill(reg, 5);
  const Tensor embed = reg.param(reg.find("model.embed_tokens.weight"));
  std::vector<float> head(size_t(embed.numel()));
  std::memcpy(head.data(), embed.raw(), embed.nbytes());

  const std::string same = path("tied_same.safetensors");
  write_safetensors(same, tensors_of(reg, {{"lm_head.weight", Tensor(head.data(), DType::F32, embed.shape())}}));
  ParamRegistry loaded;
  build_registry(loaded, 13, 4, 6, 1, true);
  const HFLoadStats stats = load_hf_weights(same, loaded);
  EXPECT_TRUE(stats.tied_lm_head_checked);
  EXPECT_EQ(stats.loaded, reg.size());
  EXPECT_TRUE(same_params(reg, loaded));

  head[5] = std::nextafter(head[5], 1.0f);  // one ulp is enough to differ
  const std::string differs = path("tied_differs.safetensors");
  write_safetensors(differs, tensors_of(reg, {{"lm_head.weight", Tensor(head.data(), DType::F32, embed.shape())}}));
  const std::string msg = error_of([&] { load_hf_weights(differs, loaded); });
  EXPECT_TRUE(has(msg, "lm_head.weight"));
  EXPECT_TRUE(has(msg, "tie_word_embeddings"));
  EXPECT_TRUE(has(msg, differs));
}

// A field of /proc/self/status in bytes ("VmHWM", "VmRSS"); -1 where there is none.
int64_t status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  for (std::string line; std::getline(f, line);) {
    if (line.starts_with(key + ":")) return std::stoll(line.substr(key.size() + 1)) * 1024;
  }
  return -1;
}

// Resets the kernel's peak of this process's resident memory (VmHWM) to its current size.
bool reset_peak_resident() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return f.good();
}

// Loading holds the rank's pieces and, beside them, at most one tensor's mapped file pages:
// no whole tensor is read for a piece, and each tensor's pages are unmapped once read, so
// that resident memory (what batch systems and ru_maxrss report) does not grow with the file.
TEST_F(HFWeightsIO, LoadingHoldsThePiecesAndOneTensorsPagesAtMost) {
  constexpr int64_t C = 1024, R = 2048;  // each tensor 8 MiB in fp32
  const std::vector<std::string> names = {"a", "b", "c", "d", "e", "f"};
  ParamRegistry whole;
  for (const std::string& n : names) whole.add("model." + n + ".weight", Shape{R, C}, ParamKind::Linear, 0);
  whole.allocate(Device::cpu());
  fill(whole, 7);
  const std::string file = path("model.safetensors");
  write_safetensors(file, tensors_of(whole));
  const int64_t tensor_bytes = R * C * 4, file_bytes = int64_t(fs::file_size(file));

  // Tensor rank 1 of 4: rows of a, c, e; a column range of every row of b, d, f.
  ParamRegistry pieces;
  for (size_t i = 0; i < names.size(); ++i) {
    ParamOptions o;
    o.placement.kind = Placement::Kind::Shard;
    o.placement.axis = "tensor";
    o.placement.dim = int(i % 2);
    o.placement.index = 1;
    o.placement.count = 4;
    o.global_shape = Shape{R, C};
    pieces.add("model." + names[i] + ".weight", i % 2 == 0 ? Shape{R / 4, C} : Shape{R, C / 4}, ParamKind::Linear, 0,
               o);
  }
  pieces.allocate(Device::cpu());

  for (ParamRegistry* reg : {&whole, &pieces}) {
    load_hf_weights(file, *reg);  // the code and the file's pages in memory: what follows counts the load alone
    ::malloc_trim(0);  // and what it freed returned, so that a buffer it takes again shows
    const bool peak_reset = reset_peak_resident();
    const int64_t before = status_bytes("VmRSS");
    const HFLoadStats stats = load_hf_weights(file, *reg);
    const int64_t peak = status_bytes("VmHWM");
    int64_t local = 0;
    for (const ParamInfo& p : reg->all()) local += p.numel() * 4;
    EXPECT_EQ(stats.piece_bytes, local);
    EXPECT_EQ(stats.largest_transient_bytes, 0);  // host parameters: read in place
    if (before < 0) continue;  // no /proc: nothing measured
    // A page or two of headers and names; a whole tensor read for a piece would be 8 MiB.
    EXPECT_LT(stats.anon_beyond_pieces(), 256 << 10);
    // Mapping a page may map its neighbours up to 2 MiB either side (the kernel's fault-around,
    // large folios in the page cache).
    constexpr int64_t spill = 4 << 20;
    EXPECT_LE(stats.mapped_file_peak - stats.mapped_file_start, tensor_bytes + spill)
        << "of a " << file_bytes << "-byte file";
    // The kernel's own peak, which no sampling misses: the same bound.
    if (peak_reset) {
      EXPECT_LE(peak - before, tensor_bytes + spill + (512 << 10)) << "of a " << file_bytes << "-byte file";
    }
  }
  // The pieces are tensor rank 1's.
  const int b = pieces.find("model.b.weight"), c = pieces.find("model.c.weight");
  EXPECT_EQ(pieces.param(b).data<float>()[0], whole.param(whole.find("model.b.weight")).data<float>()[C / 4]);
  EXPECT_EQ(pieces.param(c).data<float>()[0], whole.param(whole.find("model.c.weight")).data<float>()[R / 4 * C]);
}

TEST_F(HFWeightsIO, DirectoryAndIndexErrors) {
  // Nothing to load: the message says what was looked for.
  const std::string empty = path("empty");
  fs::create_directories(empty);
  std::string msg = error_of([&] { HFWeights w(empty); });
  EXPECT_TRUE(has(msg, empty + "/model.safetensors'"));
  EXPECT_TRUE(has(msg, empty + "/model.safetensors.index.json'"));
  msg = error_of([&] { HFWeights w(path("nowhere")); });
  EXPECT_TRUE(has(msg, path("nowhere")));

  // An index naming a shard that is not there.
  ParamRegistry reg;
  build_registry(reg, 37, 8, 12, 2, false);
  const std::string dir = path("ckpt");
  save_hf_weights(dir, reg, json::object(), 1500);
  const json index = read_json_file(dir + "/model.safetensors.index.json");
  std::set<std::string> shards;
  for (const auto& [name, shard] : index["weight_map"].items()) shards.insert(shard.get<std::string>());
  const std::string lost = *std::next(shards.begin());
  fs::remove(dir + "/" + lost);
  msg = error_of([&] { HFWeights w(dir); });
  EXPECT_TRUE(has(msg, "'" + lost + "'"));
  EXPECT_TRUE(has(msg, "does not exist"));

  // One tensor in two shards.
  std::vector<float> v = {1, 2};
  const Tensor t(v.data(), DType::F32, Shape{2});
  const std::string dup = path("dup");
  fs::create_directories(dup);
  write_safetensors(dup + "/a.safetensors", {{"x", t}, {"y", t}});
  write_safetensors(dup + "/b.safetensors", {{"x", t}});
  {
    std::ofstream(dup + "/model.safetensors.index.json")
        << R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})";
  }
  msg = error_of([&] { HFWeights w(dup); });
  EXPECT_TRUE(has(msg, "'x' appears in two shards"));
  EXPECT_TRUE(has(msg, "a.safetensors"));
  EXPECT_TRUE(has(msg, "b.safetensors"));

  // An index that puts a tensor in the wrong shard.
  const std::string wrong = path("wrong");
  fs::create_directories(wrong);
  write_safetensors(wrong + "/a.safetensors", {{"w", t}, {"x", t}});
  write_safetensors(wrong + "/b.safetensors", {{"y", t}});
  {
    std::ofstream(wrong + "/model.safetensors.index.json")
        << R"({"weight_map": {"w": "a.safetensors", "x": "b.safetensors", "y": "b.safetensors"}})";
  }
  msg = error_of([&] { HFWeights w(wrong); });
  EXPECT_TRUE(has(msg, "maps tensor 'x' to 'b.safetensors', but it is in '" + wrong + "/a.safetensors'"));

  // Two saves mixed in one directory.
  write_safetensors(dir + "/model.safetensors", {{"x", t}});
  msg = error_of([&] { HFWeights w(dir); });
  EXPECT_TRUE(has(msg, "both model.safetensors and model.safetensors.index.json"));
}

}  // namespace
}  // namespace dstrain
