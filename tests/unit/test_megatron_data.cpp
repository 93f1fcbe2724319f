// Unit tests of Megatron data: MMIDIDX indexed datasets (writer, reader, every validation
// error), GPT samples over them (order, spans, epochs, splits, threads) and vocabulary checks.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"

namespace fs = std::filesystem;
using namespace dstrain;

namespace {

// A fresh directory under the system temp dir, removed with everything in it.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() / fmt::format("dstrain_test_megatron_{}_{}_{}_{}", info->test_suite_name(),
                                                    info->name(), ::getpid(), counter++);
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

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

template <class T>
void append_le(std::string& bytes, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // the tests run on little-endian hosts, as the reader requires
  bytes.append(b, sizeof(T));
}

// An .idx built byte by byte from the format description, independent of the writer, so a
// test can break it in exactly one way. Counts default to the array sizes.
struct IdxSpec {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  uint64_t version = 1;
  uint8_t dtype = 8;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;
  std::vector<int64_t> doc_indices;
  std::optional<uint64_t> sequence_count, doc_index_count;
  std::string trailing;

  std::string bytes() const {
    std::string b = magic;
    append_le(b, version);
    append_le(b, dtype);
    append_le(b, sequence_count.value_or(lengths.size()));
    append_le(b, doc_index_count.value_or(doc_indices.size()));
    for (int32_t v : lengths) append_le(b, v);
    for (int64_t v : pointers) append_le(b, v);
    for (int64_t v : doc_indices) append_le(b, v);
    return b + trailing;
  }
};

// Offsets of the packed arrays for S sequences.
int64_t length_offset(int64_t, int64_t i) { return 34 + 4 * i; }
int64_t pointer_offset(int64_t S, int64_t i) { return 34 + 4 * S + 8 * i; }
int64_t doc_index_offset(int64_t S, int64_t j) { return 34 + 12 * S + 8 * j; }

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), std::streamsize(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string u16_bytes(const std::vector<uint16_t>& tokens) {
  std::string b;
  for (uint16_t t : tokens) append_le(b, t);
  return b;
}

// A valid 2-document uint16 dataset: document 0 is sequences 0 (2 tokens) and 1 (empty),
// document 1 is sequence 2 (3 tokens).
IdxSpec small_spec() {
  IdxSpec s;
  s.lengths = {2, 0, 3};
  s.pointers = {0, 4, 4};
  s.doc_indices = {0, 2, 3};
  return s;
}
const std::vector<uint16_t> kSmallTokens = {10, 11, 20, 21, 22};

// Writes prefix.idx from spec and prefix.bin from bin, then opens it expecting an error.
std::string open_error(const std::string& prefix, const IdxSpec& spec, const std::string& bin) {
  write_bytes(prefix + ".idx", spec.bytes());
  write_bytes(prefix + ".bin", bin);
  return error_of([&] { IndexedDataset d(prefix); });
}

// Writes documents with the writer and opens them.
std::shared_ptr<const IndexedDataset> make_dataset(const std::string& prefix,
                                                   const std::vector<std::vector<uint32_t>>& docs,
                                                   IndexedDtype dtype = IndexedDtype::kUint16) {
  IndexedDatasetWriter w(prefix, dtype);
  for (const auto& d : docs) w.add_document(d);
  w.finalize();
  return std::make_shared<const IndexedDataset>(prefix);
}

// Documents of the given lengths with distinct-ish ids below 1000.
std::vector<std::vector<uint32_t>> make_docs(const std::vector<int>& lengths) {
  std::vector<std::vector<uint32_t>> docs;
  uint32_t next = 0;
  for (int n : lengths) {
    std::vector<uint32_t>& d = docs.emplace_back();
    for (int j = 0; j < n; ++j) d.push_back(next++ % 997);
  }
  return docs;
}

std::vector<int32_t> read_sample(const SampleDataset& d, int64_t i) {
  std::vector<int32_t> out(static_cast<size_t>(d.seq_len() + 1), -1);
  d.read_sample(i, out.data());
  return out;
}

}  // namespace

// ---- indexed dataset: writer and reader ------------------------------------------------------

TEST(IndexedDataset, RoundTripUint16) {
  TempDir dir;
  const std::string prefix = dir.file("ds_text_document");
  const std::vector<std::vector<uint32_t>> docs = {{1, 2, 3}, {}, {65535, 0}, {7}};
  const auto d = make_dataset(prefix, docs, IndexedDtype::kUint16);
  EXPECT_EQ(d->dtype(), IndexedDtype::kUint16);
  EXPECT_EQ(d->itemsize(), 2);
  EXPECT_EQ(d->num_sequences(), 4);
  EXPECT_EQ(d->num_documents(), 4);
  EXPECT_EQ(d->num_tokens(), 6);
  EXPECT_EQ(fs::file_size(prefix + ".idx"), 34u + 12u * 4u + 8u * 5u);
  EXPECT_EQ(fs::file_size(prefix + ".bin"), 12u);
  EXPECT_FALSE(fs::exists(prefix + ".idx.tmp"));
  EXPECT_FALSE(fs::exists(prefix + ".bin.tmp"));
  EXPECT_EQ(d->idx_path(), prefix + ".idx");
  EXPECT_EQ(d->bin_path(), prefix + ".bin");
  int64_t token = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    EXPECT_EQ(d->sequence_length(int64_t(i)), int64_t(docs[i].size()));
    EXPECT_EQ(d->sequence_pointer(int64_t(i)), 2 * token);
    EXPECT_EQ(d->document_sequences(int64_t(i)), std::make_pair(int64_t(i), int64_t(i) + 1));
    EXPECT_EQ(d->document_tokens(int64_t(i)), std::make_pair(token, token + int64_t(docs[i].size())));
    std::vector<int32_t> back(docs[i].size());
    d->read(int64_t(i), 0, int64_t(back.size()), back.data());
    EXPECT_TRUE(std::equal(back.begin(), back.end(), docs[i].begin())) << "document " << i;
    token += int64_t(docs[i].size());
  }
  std::vector<int32_t> one(1);
  d->read(0, 2, 1, one.data());
  EXPECT_EQ(one[0], 3);
}

TEST(IndexedDataset, RoundTripInt32) {
  TempDir dir;
  const std::string prefix = dir.file("big");
  const uint32_t max_id = uint32_t(std::numeric_limits<int32_t>::max());
  std::vector<uint32_t> long_doc(300000);
  std::iota(long_doc.begin(), long_doc.end(), 100000u);
  const std::vector<std::vector<uint32_t>> docs = {{70000, max_id}, long_doc, {0}};
  const auto d = make_dataset(prefix, docs, IndexedDtype::kInt32);
  EXPECT_EQ(d->dtype(), IndexedDtype::kInt32);
  EXPECT_EQ(d->num_documents(), 3);
  EXPECT_EQ(d->num_tokens(), 2 + 300000 + 1);
  for (size_t i = 0; i < docs.size(); ++i) {
    std::vector<int32_t> back(docs[i].size());
    d->read(int64_t(i), 0, int64_t(back.size()), back.data());
    EXPECT_TRUE(std::equal(back.begin(), back.end(), docs[i].begin())) << "document " << i;
  }
  std::vector<int32_t> flat(4);
  d->read_flat(1, 4, flat.data());
  EXPECT_EQ(flat, (std::vector<int32_t>{int32_t(max_id), 100000, 100001, 100002}));
}

TEST(IndexedDataset, EmptyDatasetRoundTrips) {
  TempDir dir;
  const auto d = make_dataset(dir.file("empty"), {});
  EXPECT_EQ(d->num_sequences(), 0);
  EXPECT_EQ(d->num_documents(), 0);
  EXPECT_EQ(d->num_tokens(), 0);
}

TEST(IndexedDataset, WriterChecksIdsAndDtype) {
  TempDir dir;
  {
    IndexedDatasetWriter w(dir.file("u16"), IndexedDtype::kUint16);
    const std::string msg = error_of([&] { w.add_document({1, 65536}); });
    EXPECT_NE(msg.find("65536"), std::string::npos) << msg;
    EXPECT_NE(msg.find("int32"), std::string::npos) << msg;
  }
  {
    IndexedDatasetWriter w(dir.file("i32"), IndexedDtype::kInt32);
    EXPECT_NE(error_of([&] { w.add_document({0x80000000u}); }).find("2147483648"), std::string::npos);
  }
  EXPECT_NE(error_of([&] { IndexedDatasetWriter w(dir.file("x"), IndexedDtype::kInt64); }).find("int64"),
            std::string::npos);
  EXPECT_NE(error_of([&] { IndexedDatasetWriter w(dir.file("no/such/dir/x"), IndexedDtype::kInt32); })
                .find("no/such/dir"),
            std::string::npos);
  // Abandoned writers leave nothing behind, and a finalized one cannot grow.
  EXPECT_FALSE(fs::exists(dir.file("u16.bin.tmp")));
  EXPECT_FALSE(fs::exists(dir.file("u16.bin")));
  IndexedDatasetWriter w(dir.file("done"), IndexedDtype::kUint16);
  w.finalize();
  EXPECT_NE(error_of([&] { w.add_document({1}); }).find("finalize"), std::string::npos);
}

TEST(IndexedDataset, HandBuiltIndexWithUnalignedArraysReads) {
  TempDir dir;
  const std::string prefix = dir.file("hand");
  const IdxSpec spec = small_spec();
  // Lengths start at byte 34 and pointers at 46: neither is aligned for its type.
  ASSERT_EQ(spec.bytes().size(), 34u + 12u * 3u + 8u * 3u);
  write_bytes(prefix + ".idx", spec.bytes());
  write_bytes(prefix + ".bin", u16_bytes(kSmallTokens));
  const IndexedDataset d(prefix);
  EXPECT_EQ(d.dtype(), IndexedDtype::kUint16);
  EXPECT_EQ(d.num_sequences(), 3);
  EXPECT_EQ(d.num_documents(), 2);
  EXPECT_EQ(d.num_tokens(), 5);
  EXPECT_EQ(d.sequence_length(0), 2);
  EXPECT_EQ(d.sequence_length(1), 0);
  EXPECT_EQ(d.sequence_length(2), 3);
  EXPECT_EQ(d.sequence_pointer(2), 4);
  EXPECT_EQ(d.document_sequences(0), std::make_pair(int64_t(0), int64_t(2)));
  EXPECT_EQ(d.document_sequences(1), std::make_pair(int64_t(2), int64_t(3)));
  EXPECT_EQ(d.document_tokens(0), std::make_pair(int64_t(0), int64_t(2)));
  EXPECT_EQ(d.document_tokens(1), std::make_pair(int64_t(2), int64_t(5)));
  std::vector<int32_t> out(2);
  d.read(2, 1, 2, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{21, 22}));
  d.read(0, 0, 2, out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{10, 11}));
  d.read(1, 0, 0, out.data());  // an empty sequence reads nothing
  // Reads are bounds-checked per sequence, and for the flat array.
  EXPECT_NE(error_of([&] { d.read(0, 1, 2, out.data()); }).find("sequence 0"), std::string::npos);
  EXPECT_NE(error_of([&] { d.read(3, 0, 0, out.data()); }).find("sequence 3"), std::string::npos);
  EXPECT_NE(error_of([&] { d.read(2, -1, 1, out.data()); }).find("outside"), std::string::npos);
  EXPECT_NE(error_of([&] { d.read_flat(4, 2, out.data()); }).find("outside"), std::string::npos);
  EXPECT_NE(error_of([&] { d.document_sequences(2); }).find("document 2"), std::string::npos);
}

TEST(IndexedDataset, HandBuiltOtherDtypesRead) {
  TempDir dir;
  struct Case {
    uint8_t code;
    int size;
  };
  for (const Case c : {Case{1, 1}, Case{3, 2}, Case{4, 4}, Case{5, 8}}) {
    const std::string prefix = dir.file(fmt::format("dtype{}", c.code));
    IdxSpec spec;
    spec.dtype = c.code;
    spec.lengths = {1, 2};
    spec.pointers = {0, c.size};
    spec.doc_indices = {0, 1, 2};
    std::string bin;
    // The low c.size bytes of each little-endian int64.
    for (int64_t v : {5, 6, 7}) bin.append(reinterpret_cast<const char*>(&v), size_t(c.size));
    write_bytes(prefix + ".idx", spec.bytes());
    write_bytes(prefix + ".bin", bin);
    const IndexedDataset d(prefix);
    EXPECT_EQ(d.itemsize(), c.size);
    std::vector<int32_t> out(3);
    d.read_flat(0, 3, out.data());
    EXPECT_EQ(out, (std::vector<int32_t>{5, 6, 7})) << "dtype " << int(c.code);
  }
}

TEST(IndexedDataset, IdsThatAreNotTokenIdsNameBinAndOffset) {
  TempDir dir;
  struct Case {
    uint8_t code;
    int64_t value;
  };
  for (const Case c : {Case{5, int64_t(1) << 31}, Case{5, -1}, Case{4, -5}, Case{3, -2}}) {
    const int size = indexed_dtype_size(c.code);
    const std::string prefix = dir.file(fmt::format("bad{}_{}", c.code, c.value));
    IdxSpec spec;
    spec.dtype = c.code;
    spec.lengths = {3};
    spec.pointers = {0};
    spec.doc_indices = {0, 1};
    std::string bin;
    for (int64_t v : {int64_t(1), int64_t(2), c.value}) bin.append(reinterpret_cast<const char*>(&v), size_t(size));
    write_bytes(prefix + ".idx", spec.bytes());
    write_bytes(prefix + ".bin", bin);
    const IndexedDataset d(prefix);
    std::vector<int32_t> out(3);
    const std::string msg = error_of([&] { d.read(0, 0, 3, out.data()); });
    EXPECT_NE(msg.find(prefix + ".bin"), std::string::npos) << msg;
    EXPECT_NE(msg.find(fmt::format("byte offset {}", 2 * size)), std::string::npos) << msg;
    d.read(0, 0, 2, out.data());  // the good ones still read
  }
}

// ---- indexed dataset: validation on open -----------------------------------------------------

// Every error names the file at fault and the byte offset.
void expect_names(const std::string& msg, const std::string& file, int64_t offset) {
  EXPECT_NE(msg.find(file), std::string::npos) << "missing file name " << file << " in: " << msg;
  EXPECT_NE(msg.find(fmt::format("byte offset {}", offset)), std::string::npos)
      << "missing byte offset " << offset << " in: " << msg;
}

TEST(IndexedDatasetValidation, TooShortForHeader) {
  TempDir dir;
  const std::string p = dir.file("short");
  write_bytes(p + ".idx", std::string("MMIDIDX\0\0\1", 10));
  write_bytes(p + ".bin", "");
  expect_names(error_of([&] { IndexedDataset d(p); }), p + ".idx", 10);
}

TEST(IndexedDatasetValidation, BadMagic) {
  TempDir dir;
  const std::string p = dir.file("magic");
  IdxSpec s = small_spec();
  s.magic = std::string("MMIDIDY\0\0", 9);
  const std::string msg = open_error(p, s, u16_bytes(kSmallTokens));
  expect_names(msg, p + ".idx", 0);
  EXPECT_NE(msg.find("dstrain-prep"), std::string::npos) << msg;
}

TEST(IndexedDatasetValidation, UnsupportedVersion) {
  TempDir dir;
  const std::string p = dir.file("version");
  IdxSpec s = small_spec();
  s.version = 2;
  expect_names(open_error(p, s, u16_bytes(kSmallTokens)), p + ".idx", 9);
}

TEST(IndexedDatasetValidation, UnknownAndNonTokenDtypes) {
  TempDir dir;
  for (uint8_t code : {0, 2, 6, 7, 9, 255}) {
    const std::string p = dir.file(fmt::format("dtype{}", code));
    IdxSpec s = small_spec();
    s.dtype = code;
    expect_names(open_error(p, s, u16_bytes(kSmallTokens)), p + ".idx", 17);
  }
}

TEST(IndexedDatasetValidation, CountsThatDoNotFitTheFileSize) {
  TempDir dir;
  const std::string p = dir.file("counts");
  const std::string bin = u16_bytes(kSmallTokens);
  IdxSpec s = small_spec();
  s.sequence_count = 4;
  expect_names(open_error(p, s, bin), p + ".idx", 18);
  s.sequence_count = std::numeric_limits<uint64_t>::max();  // 12 * S would overflow
  expect_names(open_error(p, s, bin), p + ".idx", 18);
  s = small_spec();
  s.doc_index_count = uint64_t(1) << 62;
  expect_names(open_error(p, s, bin), p + ".idx", 26);
  s = small_spec();
  s.trailing = "x";
  const std::string msg = open_error(p, s, bin);
  expect_names(msg, p + ".idx", 26);
  EXPECT_NE(msg.find("trailing"), std::string::npos) << msg;
  // A header with no document index at all, not even the leading 0.
  IdxSpec none;
  expect_names(open_error(p, none, ""), p + ".idx", 26);
}

TEST(IndexedDatasetValidation, NegativeLength) {
  TempDir dir;
  const std::string p = dir.file("neg");
  IdxSpec s = small_spec();
  s.lengths[2] = -3;
  expect_names(open_error(p, s, u16_bytes(kSmallTokens)), p + ".idx", length_offset(3, 2));
}

TEST(IndexedDatasetValidation, PointersNotConsecutive) {
  TempDir dir;
  const std::string p = dir.file("ptr");
  const std::string bin = u16_bytes(kSmallTokens);
  IdxSpec s = small_spec();
  s.pointers[2] = 6;  // a gap after sequence 1
  expect_names(open_error(p, s, bin), p + ".idx", pointer_offset(3, 2));
  s = small_spec();
  s.pointers[1] = 2;  // overlaps sequence 0
  expect_names(open_error(p, s, bin), p + ".idx", pointer_offset(3, 1));
  s = small_spec();
  s.pointers = {2, 6, 6};  // leading bytes before the first sequence
  expect_names(open_error(p, s, u16_bytes({0, 10, 11, 20, 21, 22})), p + ".idx", pointer_offset(3, 0));
  s = small_spec();
  s.pointers[2] = -4;
  expect_names(open_error(p, s, bin), p + ".idx", pointer_offset(3, 2));
}

TEST(IndexedDatasetValidation, PointerPastEndOfBinSaysTruncated) {
  TempDir dir;
  const std::string p = dir.file("trunc");
  IdxSpec s = small_spec();
  const std::string msg = open_error(p, s, u16_bytes({10, 11, 20, 21}));  // one token short
  expect_names(msg, p + ".idx", pointer_offset(3, 2));
  EXPECT_NE(msg.find(p + ".bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  // A length so large that length * itemsize passes the .bin by far.
  s.lengths[2] = std::numeric_limits<int32_t>::max();
  expect_names(open_error(p, s, u16_bytes(kSmallTokens)), p + ".idx", length_offset(3, 2));
}

TEST(IndexedDatasetValidation, BinWithTrailingData) {
  TempDir dir;
  const std::string p = dir.file("trail");
  const std::string msg = open_error(p, small_spec(), u16_bytes({10, 11, 20, 21, 22, 23}));
  expect_names(msg, p + ".bin", 10);
  EXPECT_NE(msg.find("trailing"), std::string::npos) << msg;
}

TEST(IndexedDatasetValidation, DocumentIndices) {
  TempDir dir;
  const std::string p = dir.file("docs");
  const std::string bin = u16_bytes(kSmallTokens);
  IdxSpec s = small_spec();
  s.doc_indices = {1, 2, 3};  // does not start at 0
  expect_names(open_error(p, s, bin), p + ".idx", doc_index_offset(3, 0));
  s.doc_indices = {0, 2, 1};  // decreases
  expect_names(open_error(p, s, bin), p + ".idx", doc_index_offset(3, 2));
  s.doc_indices = {0, 2, 2};  // does not end at S
  expect_names(open_error(p, s, bin), p + ".idx", doc_index_offset(3, 2));
  s.doc_indices = {0, 4, 3};  // past S
  expect_names(open_error(p, s, bin), p + ".idx", doc_index_offset(3, 1));
}

TEST(IndexedDatasetValidation, MissingFilesNameThePath) {
  TempDir dir;
  const std::string p = dir.file("missing");
  EXPECT_NE(error_of([&] { IndexedDataset d(p); }).find(p + ".idx"), std::string::npos);
  write_bytes(p + ".idx", small_spec().bytes());
  EXPECT_NE(error_of([&] { IndexedDataset d(p); }).find(p + ".bin"), std::string::npos);
  fs::create_directories(p + "_dir.idx");
  EXPECT_NE(error_of([&] { IndexedDataset d(p + "_dir"); }).find("regular file"), std::string::npos);
}

// ---- GPT samples -----------------------------------------------------------------------------

TEST(GPTDataset, WithoutShuffleSampleIsConsecutiveTokensOfConcatenatedDocuments) {
  TempDir dir;
  const auto docs = make_docs({7, 1, 0, 12, 5, 9, 3});
  const auto data = make_dataset(dir.file("gpt"), docs);
  std::vector<int32_t> stream;  // the concatenated documents, built independently of the reader
  for (const auto& d : docs) stream.insert(stream.end(), d.begin(), d.end());
  const int64_t T = 5;
  const GPTDataset gpt(data, 0, data->num_documents(), T, 1000, false, 1);
  ASSERT_EQ(gpt.num_tokens(), int64_t(stream.size()));
  ASSERT_EQ(gpt.samples_per_epoch(), (int64_t(stream.size()) - 1) / T);
  for (int64_t i = 0; i < 3 * gpt.samples_per_epoch(); ++i) {
    const int64_t k = i % gpt.samples_per_epoch();  // epochs repeat the same order
    const std::vector<int32_t> expected(stream.begin() + k * T, stream.begin() + k * T + T + 1);
    EXPECT_EQ(read_sample(gpt, i), expected) << "sample " << i;
  }
}

TEST(GPTDataset, SamplesSpanDocumentsAndShareOneToken) {
  TempDir dir;
  const auto data = make_dataset(dir.file("span"), {{1, 2, 3}, {4, 5, 6}, {7, 8, 9}});
  const GPTDataset gpt(data, 0, 3, 4, 100, false, 0);
  EXPECT_EQ(gpt.samples_per_epoch(), 2);  // (9 - 1) / 4
  EXPECT_EQ(read_sample(gpt, 0), (std::vector<int32_t>{1, 2, 3, 4, 5}));  // documents 0 and 1
  EXPECT_EQ(read_sample(gpt, 1), (std::vector<int32_t>{5, 6, 7, 8, 9}));  // documents 1 and 2
  EXPECT_EQ(read_sample(gpt, 2), read_sample(gpt, 0));                    // the next epoch
  EXPECT_NE(error_of([&] { read_sample(gpt, -1); }).find("negative"), std::string::npos);
}

TEST(GPTDataset, SamplesPerEpochAndTooFewTokens) {
  TempDir dir;
  const auto data = make_dataset(dir.file("count"), make_docs({10, 10, 1}));  // 21 tokens
  for (int64_t T : {1, 2, 3, 4, 5, 7, 10, 19, 20}) {
    EXPECT_EQ(GPTDataset(data, 0, 3, T, 1000, false, 0).samples_per_epoch(), (21 - 1) / T) << "T " << T;
    EXPECT_EQ(GPTDataset(data, 0, 3, T, 1000, true, 0).samples_per_epoch(), (21 - 1) / T) << "T " << T;
  }
  const std::string msg = error_of([&] { GPTDataset(data, 0, 3, 21, 1000, false, 0); });
  EXPECT_NE(msg.find("21 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("T+1 = 22"), std::string::npos) << msg;
  EXPECT_NE(error_of([&] { GPTDataset(data, 1, 1, 1, 1000, false, 0); }).find("0 tokens"), std::string::npos);
  EXPECT_NE(error_of([&] { GPTDataset(data, 2, 4, 1, 1000, false, 0); }).find("outside"), std::string::npos);
  // T+1 must not overflow on the way to the "too few tokens" check.
  EXPECT_NE(error_of([&] { GPTDataset(data, 0, 3, std::numeric_limits<int64_t>::max(), 1000, false, 0); })
                .find("sequence length"),
            std::string::npos);
  EXPECT_NE(error_of([&] { GPTDataset(data, 0, 3, 0, 1000, false, 0); }).find("sequence length"), std::string::npos);
  EXPECT_NE(error_of([&] { GPTDataset(data, 0, 3, 4, 0, false, 0); }).find("vocabulary"), std::string::npos);
  EXPECT_NE(error_of([&] { GPTDataset(nullptr, 0, 3, 4, 10, false, 0); }).find("IndexedDataset"), std::string::npos);
}

TEST(GPTDataset, DocumentRangeReadsOnlyItsDocuments) {
  TempDir dir;
  const auto docs = make_docs({4, 6, 5, 3});
  const auto data = make_dataset(dir.file("range"), docs);
  const GPTDataset gpt(data, 1, 3, 2, 1000, false, 0);
  std::vector<int32_t> stream(docs[1].begin(), docs[1].end());
  stream.insert(stream.end(), docs[2].begin(), docs[2].end());
  EXPECT_EQ(gpt.num_tokens(), 11);
  EXPECT_EQ(gpt.samples_per_epoch(), 5);
  for (int64_t k = 0; k < gpt.samples_per_epoch(); ++k) {
    EXPECT_EQ(read_sample(gpt, k), std::vector<int32_t>(stream.begin() + 2 * k, stream.begin() + 2 * k + 3));
  }
  EXPECT_EQ(gpt.files(), (std::vector<std::string>{dir.file("range.idx"), dir.file("range.bin")}));
  const std::string line = gpt.describe();
  EXPECT_NE(line.find(dir.file("range")), std::string::npos) << line;
  EXPECT_NE(line.find("[1, 3)"), std::string::npos) << line;
  EXPECT_NE(line.find("shuffle off"), std::string::npos) << line;
}

TEST(GPTDataset, SplitRangeArithmetic) {
  using R = std::pair<int64_t, int64_t>;
  EXPECT_EQ(split_range(100, {0.98, 0.02}, 0), R(0, 98));
  EXPECT_EQ(split_range(100, {0.98, 0.02}, 1), R(98, 100));
  EXPECT_EQ(split_range(1000, {98, 2}, 1), R(980, 1000));  // weights are normalised
  // round(3.33) = 3 three times leaves one document over: every boundary after the first moves by it.
  EXPECT_EQ(split_range(10, {1, 1, 1}, 0), R(0, 4));
  EXPECT_EQ(split_range(10, {1, 1, 1}, 1), R(4, 7));
  EXPECT_EQ(split_range(10, {1, 1, 1}, 2), R(7, 10));
  // Half to even as Python's round: round(2.5) = 2, then the surplus of -1 shifts.
  EXPECT_EQ(split_range(5, {0.5, 0.5}, 0), R(0, 3));
  EXPECT_EQ(split_range(5, {0.5, 0.5}, 1), R(3, 5));
  // A zero weight gives an empty range; ranges stay contiguous and cover everything.
  for (int64_t n : {0, 1, 2, 3, 7, 100, 12345}) {
    for (const std::vector<double>& w :
         std::vector<std::vector<double>>{{1}, {0.98, 0.02}, {0, 0.5, 0.5}, {969, 30, 1}, {1, 0, 0}, {0.3, 0.3, 0.4}}) {
      int64_t end = 0;
      for (size_t k = 0; k < w.size(); ++k) {
        const R r = split_range(n, w, int(k));
        EXPECT_EQ(r.first, end) << n;
        EXPECT_LE(r.first, r.second) << n;
        end = r.second;
      }
      EXPECT_EQ(end, n);
    }
  }
  EXPECT_EQ(split_range(3, {0, 0.5, 0.5}, 0), R(0, 0));
  EXPECT_NE(error_of([] { split_range(10, {}, 0); }).find("empty"), std::string::npos);
  EXPECT_NE(error_of([] { split_range(10, {1, -1}, 0); }).find("-1"), std::string::npos);
  EXPECT_NE(error_of([] { split_range(10, {0, 0}, 0); }).find("sum to 0"), std::string::npos);
  EXPECT_NE(error_of([] { split_range(10, {1, 1}, 2); }).find("split 2"), std::string::npos);
}

namespace {

bool is_permutation_of_range(std::vector<int64_t> v, int64_t begin, int64_t end) {
  std::sort(v.begin(), v.end());
  std::vector<int64_t> expected(static_cast<size_t>(end - begin));
  std::iota(expected.begin(), expected.end(), begin);
  return v == expected;
}

}  // namespace

TEST(GPTDataset, ShuffledEpochsAreCompleteAndDiffer) {
  TempDir dir;
  std::vector<int> lengths(60);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = int(i % 9);  // some empty documents
  const auto docs = make_docs(lengths);
  const auto data = make_dataset(dir.file("shuf"), docs);
  const GPTDataset gpt(data, 5, 55, 3, 1000, true, 42);
  std::vector<int64_t> previous;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const std::vector<int64_t> order = gpt.document_order(epoch);
    EXPECT_TRUE(is_permutation_of_range(order, 5, 55)) << "epoch " << epoch;
    EXPECT_TRUE(is_permutation_of_range(gpt.sample_order(epoch), 0, gpt.samples_per_epoch())) << "epoch " << epoch;
    EXPECT_NE(order, previous);
    previous = order;

    // Every sample of the epoch, against the stream built from the epoch's document order.
    std::vector<int32_t> stream;
    for (int64_t d : order) stream.insert(stream.end(), docs[size_t(d)].begin(), docs[size_t(d)].end());
    ASSERT_EQ(int64_t(stream.size()), gpt.num_tokens());
    const std::vector<int64_t> samples = gpt.sample_order(epoch);
    for (int64_t k = 0; k < gpt.samples_per_epoch(); ++k) {
      const int64_t s = samples[size_t(k)];
      const std::vector<int32_t> expected(stream.begin() + s * 3, stream.begin() + s * 3 + 4);
      EXPECT_EQ(read_sample(gpt, epoch * gpt.samples_per_epoch() + k), expected) << "epoch " << epoch << " k " << k;
    }
  }
  EXPECT_NE(gpt.sample_order(0), gpt.sample_order(1));
  const GPTDataset other_seed(data, 5, 55, 3, 1000, true, 43);
  EXPECT_NE(other_seed.document_order(0), gpt.document_order(0));
  EXPECT_NE(gpt.describe().find("seed 42"), std::string::npos);
}

TEST(GPTDataset, SameSeedGivesSameSamplesInAnyCallOrder) {
  TempDir dir;
  const auto data = make_dataset(dir.file("order"), make_docs(std::vector<int>(40, 11)));
  const GPTDataset a(data, 0, 40, 8, 1000, true, 7);
  const GPTDataset b(data, 0, 40, 8, 1000, true, 7);
  const int64_t n = 4 * a.samples_per_epoch();
  std::vector<std::vector<int32_t>> forward;
  for (int64_t i = 0; i < n; ++i) forward.push_back(read_sample(a, i));
  for (int64_t i = n - 1; i >= 0; --i) EXPECT_EQ(read_sample(b, i), forward[size_t(i)]) << "sample " << i;
  // Jumping between epochs (more than the two cached) changes nothing either.
  for (int64_t i : {int64_t(5), 3 * a.samples_per_epoch() + 1, int64_t(6), 2 * a.samples_per_epoch(), int64_t(5)}) {
    EXPECT_EQ(read_sample(b, i), forward[size_t(i)]) << "sample " << i;
  }
}

TEST(GPTDataset, ReadSampleIsThreadSafe) {
  TempDir dir;
  std::vector<int> lengths(200);
  for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = int(1 + (i * 37) % 23);
  const auto data = make_dataset(dir.file("threads"), make_docs(lengths));
  const GPTDataset reference(data, 0, 200, 16, 1000, true, 3);
  const int64_t n = 6 * reference.samples_per_epoch();  // several epochs: the cache turns over
  std::vector<int32_t> expected(static_cast<size_t>(n * 17));
  for (int64_t i = 0; i < n; ++i) reference.read_sample(i, expected.data() + i * 17);

  const GPTDataset shared(data, 0, 200, 16, 1000, true, 3);
  std::vector<int32_t> got_a(expected.size(), -1), got_b(expected.size(), -1);
  // One thread runs forward, the other backward: they keep asking for different epochs.
  std::thread forward([&] {
    for (int64_t i = 0; i < n; ++i) shared.read_sample(i, got_a.data() + i * 17);
  });
  std::thread backward([&] {
    for (int64_t i = n - 1; i >= 0; --i) shared.read_sample(i, got_b.data() + i * 17);
  });
  forward.join();
  backward.join();
  EXPECT_EQ(got_a, expected);
  EXPECT_EQ(got_b, expected);
}

TEST(GPTDataset, TokenOutsideVocabularyNamesBinAndByteOffset) {
  TempDir dir;
  // Document 2 holds id 300 at flat token 6; with uint16 storage that is .bin byte 12.
  const auto data = make_dataset(dir.file("vocab"), {{1, 2, 3}, {4, 5, 6}, {300, 8}, {9, 10}});
  for (bool shuffle : {false, true}) {
    const GPTDataset gpt(data, 0, 4, 2, 258, shuffle, 0);
    bool reported = false;
    for (int64_t i = 0; i < gpt.samples_per_epoch(); ++i) {
      std::vector<int32_t> out(3);
      try {
        gpt.read_sample(i, out.data());
      } catch (const Error& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(dir.file("vocab.bin")), std::string::npos) << msg;
        EXPECT_NE(msg.find("byte offset 12"), std::string::npos) << msg;
        EXPECT_NE(msg.find("id 300"), std::string::npos) << msg;
        EXPECT_NE(msg.find("vocabulary of 258"), std::string::npos) << msg;
        EXPECT_NE(msg.find("tokeniz"), std::string::npos) << msg;
        reported = true;
      }
    }
    EXPECT_TRUE(reported) << "shuffle " << shuffle;
  }
}
