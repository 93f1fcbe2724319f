// Unit tests of the data pipeline: llm.c token shards, the byte tokenizer, training windows,
// the shuffled sampler and batch filling.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/data_pipeline.h"
#include "data/indexed_dataset.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "data/window_dataset.h"

namespace fs = std::filesystem;
using namespace dstrain;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            fmt::format("dstrain_test_data_{}_{}_{}_{}", info->test_suite_name(), info->name(), ::getpid(), counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// A shard file byte by byte, so the tests can break it in exactly one way.
void write_raw(const std::string& path, int32_t magic, int32_t version, int32_t count, int64_t token_bytes) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic;
  header[1] = version;
  header[2] = count;
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  const std::vector<char> body(size_t(token_bytes), 1);
  out.write(body.data(), std::streamsize(body.size()));
}

// Message of the dstrain::Error that f throws; fails the test if it throws nothing or another type.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a dstrain::Error";
  return {};
}

std::vector<uint32_t> iota_tokens(int64_t n, uint32_t first = 0) {
  std::vector<uint32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

}  // namespace

// ---- token shards -------------------------------------------------------------------------

TEST(TokenShard, RoundTripVersion1) {
  TempDir dir;
  const std::string path = dir.file("v1.bin");
  const std::vector<uint32_t> tokens{0, 1, 257, 50256, 65535, 7};
  write_token_shard(path, tokens, 1);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(fs::file_size(path), 1024u + 2 * tokens.size());

  const TokenShard shard(path);
  EXPECT_EQ(shard.path(), path);
  EXPECT_EQ(shard.size(), int64_t(tokens.size()));
  EXPECT_EQ(shard.version(), 1);
  EXPECT_EQ(shard.bytes_per_token(), 2);
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(shard.at(int64_t(i)), tokens[i]);
  std::vector<int32_t> back(4);
  shard.read(2, 4, back.data());
  EXPECT_EQ(back, (std::vector<int32_t>{257, 50256, 65535, 7}));
}

TEST(TokenShard, RoundTripVersion7) {
  TempDir dir;
  const std::string path = dir.file("v7.bin");
  const std::vector<uint32_t> tokens{0, 65536, 128000, 129279, 2147483647u};
  write_token_shard(path, tokens, 7);
  EXPECT_EQ(fs::file_size(path), 1024u + 4 * tokens.size());

  const TokenShard shard(path);
  EXPECT_EQ(shard.size(), int64_t(tokens.size()));
  EXPECT_EQ(shard.version(), 7);
  EXPECT_EQ(shard.bytes_per_token(), 4);
  std::vector<int32_t> back(tokens.size());
  shard.read(0, int64_t(tokens.size()), back.data());
  for (size_t i = 0; i < tokens.size(); ++i) {
    EXPECT_EQ(shard.at(int64_t(i)), tokens[i]);
    EXPECT_EQ(uint32_t(back[i]), tokens[i]);
  }
}

TEST(TokenShard, LargeShardRoundTripsAndMoves) {
  TempDir dir;
  const std::string path = dir.file("large.bin");
  const std::vector<uint32_t> tokens = iota_tokens(3'000'000);  // more than one staging chunk
  std::vector<uint32_t> narrow(tokens.size());
  std::transform(tokens.begin(), tokens.end(), narrow.begin(), [](uint32_t t) { return t % 65536; });
  write_token_shard(path, narrow, 1);
  TokenShard moved = TokenShard(path);
  TokenShard shard(std::move(moved));
  ASSERT_EQ(shard.size(), int64_t(narrow.size()));
  std::vector<int32_t> back(narrow.size());
  shard.read(0, shard.size(), back.data());
  for (size_t i = 0; i < narrow.size(); ++i) ASSERT_EQ(uint32_t(back[i]), narrow[i]) << "token " << i;
}

TEST(TokenShard, EmptyShardIsValid) {
  TempDir dir;
  const std::string path = dir.file("empty.bin");
  write_token_shard(path, {}, 7);
  EXPECT_EQ(TokenShard(path).size(), 0);
}

TEST(TokenShard, ReadsAreBoundsChecked) {
  TempDir dir;
  const std::string path = dir.file("small.bin");
  write_token_shard(path, iota_tokens(10), 1);
  const TokenShard shard(path);
  std::vector<int32_t> out(11);
  EXPECT_NO_THROW(shard.read(0, 10, out.data()));
  EXPECT_NO_THROW(shard.read(10, 0, out.data()));
  EXPECT_THROW(shard.read(0, 11, out.data()), Error);
  EXPECT_THROW(shard.read(5, 6, out.data()), Error);
  EXPECT_THROW(shard.read(-1, 1, out.data()), Error);
  EXPECT_THROW(shard.at(10), Error);
  EXPECT_THROW(shard.at(-1), Error);
}

TEST(TokenShard, BadMagicNamesFile) {
  TempDir dir;
  const std::string path = dir.file("bad_magic.bin");
  write_raw(path, 12345, 1, 4, 8);
  const std::string msg = error_of([&] { TokenShard s(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("12345"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 0"), std::string::npos) << msg;
  EXPECT_NE(msg.find("dstrain-prep"), std::string::npos) << msg;
}

TEST(TokenShard, VersionMismatchNamesFile) {
  TempDir dir;
  const std::string v1_magic_v7 = dir.file("u16_says_v7.bin");
  write_raw(v1_magic_v7, kShardMagicU16, 7, 4, 8);
  std::string msg = error_of([&] { TokenShard s(v1_magic_v7); });
  EXPECT_NE(msg.find(v1_magic_v7), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 4"), std::string::npos) << msg;

  const std::string v7_magic_v1 = dir.file("u32_says_v1.bin");
  write_raw(v7_magic_v1, kShardMagicU32, 1, 4, 16);
  msg = error_of([&] { TokenShard s(v7_magic_v1); });
  EXPECT_NE(msg.find(v7_magic_v1), std::string::npos) << msg;
}

TEST(TokenShard, TruncatedNamesFileAndOffset) {
  TempDir dir;
  const std::string path = dir.file("truncated.bin");
  write_raw(path, kShardMagicU32, 7, 100, 4 * 99 + 2);  // tokens end at 1024 + 400
  const std::string msg = error_of([&] { TokenShard s(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1424"), std::string::npos) << msg;  // where the tokens should end
  EXPECT_NE(msg.find("1422"), std::string::npos) << msg;  // where the file ends

  const std::string header_only = dir.file("short_header.bin");
  {
    std::ofstream out(header_only, std::ios::binary);
    out << "not a shard";
  }
  const std::string short_msg = error_of([&] { TokenShard s(header_only); });
  EXPECT_NE(short_msg.find(header_only), std::string::npos) << short_msg;
  EXPECT_NE(short_msg.find("too short"), std::string::npos) << short_msg;
}

TEST(TokenShard, TrailingBytesNamesFile) {
  TempDir dir;
  const std::string path = dir.file("trailing.bin");
  write_raw(path, kShardMagicU16, 1, 10, 2 * 10 + 3);
  const std::string msg = error_of([&] { TokenShard s(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("3 trailing bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("1044"), std::string::npos) << msg;  // where the tokens end
}

TEST(TokenShard, MissingFileAndDirectoryAreErrors) {
  TempDir dir;
  const std::string missing = dir.file("missing.bin");
  EXPECT_NE(error_of([&] { TokenShard s(missing); }).find(missing), std::string::npos);
  EXPECT_NE(error_of([&] { TokenShard s(dir.path().string()); }).find("directory"), std::string::npos);
}

TEST(TokenShard, Version1RejectsTokensAbove65535) {
  TempDir dir;
  const std::string path = dir.file("too_big.bin");
  const std::string msg = error_of([&] { write_token_shard(path, {1, 2, 65536, 3}, 1); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("65536"), std::string::npos) << msg;
  EXPECT_NE(msg.find("version 7"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_NO_THROW(write_token_shard(path, {1, 2, 65535, 3}, 1));
}

TEST(TokenShard, UnknownWriteVersionIsError) {
  TempDir dir;
  EXPECT_THROW(write_token_shard(dir.file("v3.bin"), {1, 2}, 3), Error);
}

TEST(TokenShard, WriteIntoMissingDirectoryIsError) {
  TempDir dir;
  const std::string path = dir.file("no/such/dir/x.bin");
  EXPECT_NE(error_of([&] { write_token_shard(path, {1}, 1); }).find("no/such/dir"), std::string::npos);
}

TEST(TokenShard, TokenAboveInt32MaxIsErrorOnRead) {
  TempDir dir;
  const std::string path = dir.file("huge_id.bin");
  write_token_shard(path, {5, 0x80000000u, 6}, 7);
  const TokenShard shard(path);
  EXPECT_EQ(shard.at(1), 0x80000000u);
  std::vector<int32_t> out(3);
  const std::string msg = error_of([&] { shard.read(0, 3, out.data()); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 1"), std::string::npos) << msg;
}

// ---- tokenizers ---------------------------------------------------------------------------

TEST(ByteTokenizer, RoundTripsUtf8) {
  const ByteTokenizer tok;
  const std::string text = "Grüße, 世界! 🚀\n\ttabs and \x01 control bytes";
  const std::vector<int32_t> ids = tok.encode(text);
  EXPECT_EQ(ids.size(), text.size());  // one id per UTF-8 byte
  for (int32_t id : ids) EXPECT_TRUE(id >= 0 && id < 256);
  EXPECT_EQ(ids[2], 0xC3);  // first byte of "ü"
  EXPECT_EQ(tok.decode(ids), text);
  EXPECT_TRUE(tok.encode("").empty());
}

TEST(ByteTokenizer, SpecialIds) {
  const ByteTokenizer tok;
  EXPECT_EQ(tok.vocab_size(), 258);
  EXPECT_EQ(tok.bos_id(), 256);
  EXPECT_EQ(tok.eos_id(), 257);
  EXPECT_EQ(tok.name(), "byte");
  std::vector<int32_t> ids{tok.bos_id()};
  for (int32_t id : tok.encode("hé")) ids.push_back(id);
  ids.push_back(tok.eos_id());
  EXPECT_EQ(tok.decode(ids), "<|begin_of_text|>hé<|end_of_text|>");
}

TEST(ByteTokenizer, SpecialStringsInTextStayBytes) {
  const ByteTokenizer tok;
  const std::vector<int32_t> ids = tok.encode("a<|end_of_text|>b");
  EXPECT_EQ(ids.size(), 17u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.eos_id()), 0);
  EXPECT_EQ(ids[1], int32_t('<'));
}

TEST(ByteTokenizer, DecodeRejectsIdsOutsideVocabulary) {
  const ByteTokenizer tok;
  EXPECT_NE(error_of([&] { (void)tok.decode({65, 258}); }).find("258"), std::string::npos);
  EXPECT_THROW((void)tok.decode({-1}), Error);
}

TEST(Tokenizer, MakeTokenizerByName) {
  const std::unique_ptr<Tokenizer> tok = make_tokenizer("byte");
  ASSERT_NE(tok, nullptr);
  EXPECT_EQ(tok->name(), "byte");
  EXPECT_EQ(tok->vocab_size(), 258);
  const std::string msg = error_of([] { (void)make_tokenizer("deepseek-ai/tokenizer.json"); });
  EXPECT_NE(msg.find("only \"byte\""), std::string::npos) << msg;
}

// ---- windows ------------------------------------------------------------------------------

TEST(WindowDataset, WindowCountIsNMinusOneOverT) {
  TempDir dir;
  const int64_t T = 4;
  for (int64_t n : {5, 8, 9, 10, 13, 100}) {
    const std::string path = dir.file(fmt::format("n{}.bin", n));
    write_token_shard(path, iota_tokens(n), 1);
    const WindowDataset data({path}, T, 1000);
    EXPECT_EQ(data.num_windows(), (n - 1) / T) << "n = " << n;
    EXPECT_EQ(data.num_tokens(), n);
  }
}

TEST(WindowDataset, TargetsAreInputsShiftedByOne) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  write_token_shard(path, iota_tokens(23, 100), 7);  // tokens 100..122
  const int64_t T = 5;
  const WindowDataset data({path}, T, 1000);
  ASSERT_EQ(data.num_windows(), 4);
  std::vector<int32_t> in(T), tg(T);
  for (int64_t w = 0; w < data.num_windows(); ++w) {
    data.read_window(w, in.data(), tg.data());
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(in[size_t(t)], 100 + w * T + t);  // window w covers tokens [w*T, w*T + T]
      EXPECT_EQ(tg[size_t(t)], in[size_t(t)] + 1);
    }
  }
  EXPECT_THROW(data.read_window(4, in.data(), tg.data()), Error);
  EXPECT_THROW(data.read_window(-1, in.data(), tg.data()), Error);
}

TEST(WindowDataset, WindowsAreNumberedAcrossShardsAndNeverCrossOne) {
  TempDir dir;
  const int64_t T = 4;
  // Shard a: 11 tokens (2 windows, 2 tokens unused); shard b: 9 tokens (2 windows); an empty
  // shard and a 4-token shard in between contribute none.
  write_token_shard(dir.file("a.bin"), iota_tokens(11, 1000), 1);
  write_token_shard(dir.file("b.bin"), {}, 1);
  write_token_shard(dir.file("c.bin"), iota_tokens(4, 3000), 1);
  write_token_shard(dir.file("d.bin"), iota_tokens(9, 2000), 1);
  const WindowDataset data({dir.file("a.bin"), dir.file("b.bin"), dir.file("c.bin"), dir.file("d.bin")}, T, 5000);
  ASSERT_EQ(data.num_windows(), 4);
  EXPECT_EQ(data.num_tokens(), 24);
  std::vector<int32_t> in(T), tg(T);
  const std::vector<int32_t> first_token{1000, 1004, 2000, 2004};
  for (int64_t w = 0; w < 4; ++w) {
    data.read_window(w, in.data(), tg.data());
    EXPECT_EQ(in[0], first_token[size_t(w)]) << "window " << w;
    // Every input and target of a window comes from the same shard: consecutive ids.
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(in[size_t(t)], first_token[size_t(w)] + t);
      EXPECT_EQ(tg[size_t(t)], first_token[size_t(w)] + t + 1);
    }
  }
}

TEST(WindowDataset, TokenOutsideVocabularyNamesFileAndOffset) {
  TempDir dir;
  const std::string good = dir.file("good.bin");
  const std::string bad = dir.file("bad.bin");
  write_token_shard(good, iota_tokens(9), 1);
  std::vector<uint32_t> tokens(9, 3);
  tokens[6] = 300;  // window 1 (tokens 4..8 at T=4) in the second shard
  write_token_shard(bad, tokens, 1);
  const WindowDataset data({good, bad}, 4, 258);
  std::vector<int32_t> in(4), tg(4);
  EXPECT_NO_THROW(data.read_window(2, in.data(), tg.data()));
  const std::string msg = error_of([&] { data.read_window(3, in.data(), tg.data()); });
  EXPECT_NE(msg.find(bad), std::string::npos) << msg;
  EXPECT_NE(msg.find("token 6"), std::string::npos) << msg;
  EXPECT_NE(msg.find("id 300"), std::string::npos) << msg;
  EXPECT_NE(msg.find("vocabulary"), std::string::npos) << msg;

  // The last token of a window appears only among the targets; it is checked too.
  tokens.assign(9, 3);
  tokens[8] = 258;
  write_token_shard(bad, tokens, 1);
  const WindowDataset data2({bad}, 4, 258);
  EXPECT_NE(error_of([&] { data2.read_window(1, in.data(), tg.data()); }).find("token 8"), std::string::npos);
}

TEST(WindowDataset, ZeroWindowsIsErrorNamingFilesAndT) {
  TempDir dir;
  const std::string path = dir.file("tiny.bin");
  write_token_shard(path, iota_tokens(8), 1);
  const std::string msg = error_of([&] { WindowDataset d({path}, 8, 1000); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("T+1 = 9"), std::string::npos) << msg;
  EXPECT_EQ(WindowDataset({path}, 7, 1000).num_windows(), 1);
}

TEST(WindowDataset, GlobPatternsExpandSorted) {
  TempDir dir;
  for (const char* name : {"x_train_000002.bin", "x_train_000000.bin", "x_train_000001.bin", "x_val_000000.bin"}) {
    write_token_shard(dir.file(name), iota_tokens(5), 1);
  }
  const std::vector<std::string> files = expand_globs({dir.file("x_train_*.bin"), dir.file("x_val_000000.bin")});
  EXPECT_EQ(files, (std::vector<std::string>{dir.file("x_train_000000.bin"), dir.file("x_train_000001.bin"),
                                             dir.file("x_train_000002.bin"), dir.file("x_val_000000.bin")}));
  const WindowDataset data({dir.file("x_train_*.bin")}, 2, 100);
  EXPECT_EQ(data.shards().size(), 3u);
  EXPECT_EQ(data.num_windows(), 6);
}

TEST(WindowDataset, GlobWithoutMatchIsErrorNamingPattern) {
  TempDir dir;
  const std::string pattern = dir.file("nothing_*.bin");
  EXPECT_NE(error_of([&] { (void)expand_globs({pattern}); }).find(pattern), std::string::npos);
  EXPECT_NE(error_of([&] { WindowDataset d({pattern}, 4, 100); }).find(pattern), std::string::npos);
}

TEST(WindowDataset, FillBatchReadsConsecutivePositions) {
  TempDir dir;
  const std::string path = dir.file("shard.bin");
  write_token_shard(path, iota_tokens(13), 1);  // 4 windows at T=3
  const WindowDataset data({path}, 3, 100);
  const WindowSampler sampler(data.num_windows(), false, 0);
  Batch batch;
  fill_batch(data, sampler, 3, 2, batch);  // positions 3 and 4: windows 3 and 0 (next epoch)
  EXPECT_EQ(batch.B, 2);
  EXPECT_EQ(batch.T, 3);
  EXPECT_EQ(batch.inputs, (std::vector<int32_t>{9, 10, 11, 0, 1, 2}));
  EXPECT_EQ(batch.targets, (std::vector<int32_t>{10, 11, 12, 1, 2, 3}));
  EXPECT_THROW(fill_batch(data, WindowSampler(5, false, 0), 0, 1, batch), Error);
}

// ---- sampler ------------------------------------------------------------------------------

namespace {
std::vector<int64_t> epoch_order(const WindowSampler& s, int64_t epoch) {
  std::vector<int64_t> order;
  for (int64_t k = 0; k < s.num_windows(); ++k) order.push_back(s.window_at(epoch * s.num_windows() + k));
  return order;
}
}  // namespace

TEST(WindowSampler, WithoutShuffleIsIdentityModuloWindows) {
  const WindowSampler s(7, false, 123);
  for (int64_t p = 0; p < 30; ++p) {
    EXPECT_EQ(s.window_at(p), p % 7);
    EXPECT_EQ(s.epoch_of(p), p / 7);
  }
  EXPECT_THROW(s.window_at(-1), Error);
}

TEST(WindowSampler, ShuffledEpochIsPermutation) {
  const int64_t n = 1000;
  const WindowSampler s(n, true, 42);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int64_t> order = epoch_order(s, epoch);
    std::sort(order.begin(), order.end());
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), int64_t(0));
    EXPECT_EQ(order, all) << "epoch " << epoch;
  }
  const WindowSampler one(1, true, 42);
  EXPECT_EQ(one.window_at(0), 0);
  EXPECT_EQ(one.window_at(5), 0);
}

TEST(WindowSampler, ShuffleDiffersBetweenEpochsAndSeeds) {
  const int64_t n = 100;
  const WindowSampler a(n, true, 1), b(n, true, 2);
  const std::vector<int64_t> a0 = epoch_order(a, 0);
  EXPECT_NE(a0, epoch_order(a, 1));
  EXPECT_NE(a0, epoch_order(b, 0));
  std::vector<int64_t> identity(static_cast<size_t>(n));
  std::iota(identity.begin(), identity.end(), int64_t(0));
  EXPECT_NE(a0, identity);
}

TEST(WindowSampler, SameSeedGivesSameOrderInAnyAccessOrder) {
  const int64_t n = 50;
  const WindowSampler a(n, true, 7), b(n, true, 7);
  // b is read epochs 2, 0, 1 (and back and forth), a in order: the cache must not matter.
  const std::vector<int64_t> b2 = epoch_order(b, 2), b0 = epoch_order(b, 0), b1 = epoch_order(b, 1);
  EXPECT_EQ(epoch_order(a, 0), b0);
  EXPECT_EQ(epoch_order(a, 1), b1);
  EXPECT_EQ(epoch_order(a, 2), b2);
  for (int64_t p = 0; p < 3 * n; p += 17) EXPECT_EQ(WindowSampler(n, true, 7).window_at(p), a.window_at(p));
}

// ---- data configuration --------------------------------------------------------------------

TEST(DataConfig, FormatIsDetectedFromTheFilesWhenNotGiven) {
  TempDir d;
  IndexedDatasetWriter web(d.file("web_text_document"), IndexedDtype::kUint16);
  web.add_document(iota_tokens(40));
  web.add_document(iota_tokens(30, 5));
  web.finalize();
  write_token_shard(d.file("code_train_000000.bin"), iota_tokens(50), 1);
  const json j = {{"train", d.file("web_text_document")},
                  {"val", {{{"path", d.file("code_train_*.bin")}}, {{"path", d.file("web_text_document")}}}},
                  {"seq_len", 8}};
  const DataConfig c = DataConfig::from_json(JsonReader(j, "data", "run.json"));
  ASSERT_EQ(c.train.size(), 1u);
  EXPECT_EQ(c.train[0].format, "megatron");
  ASSERT_EQ(c.val.size(), 2u);
  EXPECT_EQ(c.val[0].format, "llmc");
  EXPECT_EQ(c.val[1].format, "megatron");
  // The detected Megatron prefix opens, instead of failing as a shard pattern that matches nothing.
  const auto sets = open_datasets(c.train, c, 258, 1, /*validation=*/false);
  ASSERT_EQ(sets.size(), 1u);
  EXPECT_EQ(sets[0]->num_tokens(), 70);

  // A format given in the configuration is kept.
  json k = j;
  k["format"] = "llmc";
  EXPECT_EQ(DataConfig::from_json(JsonReader(k, "data", "run.json")).train[0].format, "llmc");
  k["format"] = "arrow";
  EXPECT_THAT(error_of([&] { DataConfig::from_json(JsonReader(k, "data", "run.json")); }),
              ::testing::HasSubstr("key 'data.format' is \"arrow\""));

  // Half a Megatron dataset is named as such, not reported as a pattern without matches.
  std::filesystem::remove(d.file("web_text_document.bin"));
  const std::string msg = error_of([&] { DataConfig::from_json(JsonReader(j, "data", "run.json")); });
  EXPECT_THAT(msg, ::testing::HasSubstr("web_text_document.idx but no " + d.file("web_text_document.bin")));
  EXPECT_THAT(msg, ::testing::HasSubstr("data.train"));
}
