// dstrain-prep: text or JSONL files -> llm.c token shards (PREFIX_val_000000.bin, PREFIX_train_000000.bin,
// ...) or Megatron indexed datasets (PREFIX_text_document.idx/.bin). Every document ends with the eos id.
// Exit status: 0 done, 1 error, 2 bad command line (including inputs that are missing or not text).
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "cli.h"
#include "core/error.h"
#include "core/json_reader.h"
#include "data/indexed_dataset.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "data/window_dataset.h"

namespace {

using namespace dstrain;
using Clock = std::chrono::steady_clock;

struct PrepOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::string format = "llmc";
  std::string tokenizer = "byte";
  std::optional<std::string> split_on_line;
  bool jsonl = false;  // every input is JSONL, whatever its name
  std::string json_key = "text";
  int64_t val_docs = 0;
  int64_t shard_tokens = 100'000'000;
  bool shard_tokens_given = false;
  std::optional<int> version;  // llmc; default: 1 if the vocabulary fits uint16, else 7
  std::string dtype = "auto";  // megatron; auto: uint16 below 65500 ids, else int32
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
};

// How much of each input is checked to be text before any work.
constexpr size_t kTextCheckBytes = size_t(64) << 10;

// Fails when the first bytes of an input are not text: the byte tokenizer takes any bytes, so
// a compressed or binary file would otherwise become plausible-looking tokens. A few invalid
// UTF-8 sequences (a stray Latin-1 character) are tolerated; binary data has many.
void check_is_text(const std::string& path, std::string_view head) {
  struct Magic {
    std::string_view bytes, name, decompress;
  };
  static constexpr Magic kCompressed[] = {{"\x1f\x8b", "gzip", "gunzip -k"},
                                          {"\x28\xb5\x2f\xfd", "zstd", "zstd -d"},
                                          {"\xfd\x37\x7a\x58\x5a\x00", "xz", "xz -dk"},
                                          {"BZh", "bzip2", "bunzip2 -k"}};
  for (const Magic& m : kCompressed) {
    DS_CHECK(!head.starts_with(m.bytes),
             "input {} is {}-compressed (its first bytes, at offset 0, are the {} magic number); decompress it "
             "first ({} {}) and pass the text",
             path, m.name, m.name, m.decompress, path);
  }
  DS_CHECK(!head.starts_with("\xff\xfe") && !head.starts_with("\xfe\xff"),
           "input {} is UTF-16 text (it starts with a UTF-16 byte-order mark at offset 0); convert it to UTF-8 first "
           "(iconv -f utf-16 -t utf-8)",
           path);
  const size_t nul = head.find('\0');
  DS_CHECK(nul == std::string_view::npos,
           "input {} holds a NUL byte at offset {}: it is a binary file, not text; pass text or JSONL files (token "
           "shards and .bin/.idx datasets are already prepared: give them to data.train directly)",
           path, nul);
  size_t invalid = 0, first_invalid = 0;
  for (size_t i = 0; i < head.size();) {
    const auto c = uint8_t(head[i]);
    const size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    bool ok = len > 0;
    if (ok && i + len > head.size()) break;  // a character cut by the end of the checked bytes
    for (size_t k = 1; ok && k < len; ++k) ok = (uint8_t(head[i + k]) & 0xc0) == 0x80;
    if (ok) {
      i += len;
    } else {
      if (invalid++ == 0) first_invalid = i;
      ++i;
    }
  }
  // At most 1 in 100 bytes: Latin-1 prose stays below that, binary data is far above.
  DS_CHECK(invalid <= std::max<size_t>(4, head.size() / 100),
           "input {} is not UTF-8 text: {} invalid byte sequences in its first {} bytes, the first at offset {}; "
           "convert it to UTF-8 first (for example iconv -f latin1 -t utf-8), or, if it is binary, pass the text it "
           "was made from",
           path, invalid, head.size(), first_invalid);
}

// Before any work: a typo in the last of many inputs should not cost a run over the others.
// Returns the inputs' total size in bytes, or nullopt when one is not a regular file (a pipe,
// checked to be text when it is read).
std::optional<int64_t> check_inputs(const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  int64_t total = 0;
  bool known = true;
  for (const std::string& path : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    DS_CHECK(fs::exists(st), "input {} does not exist; check the path", path);
    DS_CHECK(!fs::is_directory(st), "input {} is a directory; pass the files inside it (e.g. {}/*)", path, path);
    if (fs::is_regular_file(st)) {
      total += int64_t(fs::file_size(path, ec));
      std::FILE* f = std::fopen(path.c_str(), "rb");
      DS_CHECK(f != nullptr, "cannot open input {}: {}", path, std::strerror(errno));
      std::string head(kTextCheckBytes, '\0');
      head.resize(std::fread(head.data(), 1, head.size(), f));
      std::fclose(f);
      check_is_text(path, head);
    } else {
      known = false;
    }
  }
  return known ? std::optional<int64_t>(total) : std::nullopt;
}

// Options that exclude each other: a bad command line, found before any work.
void check_option_combinations(const PrepOptions& opt) {
  const bool megatron = opt.format == "megatron";
  DS_CHECK(megatron || opt.dtype == "auto", "--dtype applies to --format megatron; llm.c shards take --version");
  DS_CHECK(!megatron || !opt.version, "--version applies to --format llmc; Megatron datasets take --dtype");
  DS_CHECK(!megatron || !opt.shard_tokens_given,
           "--shard-tokens applies to --format llmc; a Megatron dataset is one .bin of any size");
}

bool is_jsonl(const std::string& path, const PrepOptions& opt) {
  return opt.jsonl || path.ends_with(".jsonl") || path.ends_with(".json");
}

// The whole file: documents are views into it. Reads in pieces so pipes work too.
std::string read_input(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  DS_CHECK(f != nullptr, "cannot open input {}: {}", path, std::strerror(errno));
  std::string text;
  std::vector<char> piece(size_t(1) << 20);
  size_t n;
  while ((n = std::fread(piece.data(), 1, piece.size(), f)) > 0) text.append(piece.data(), n);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  DS_CHECK(!failed, "reading input {} failed after {} bytes: {}", path, text.size(), std::strerror(err));
  return text;
}

// A document before encoding: plain text, or one JSONL line whose text field is extracted on
// the encoding threads (parsing JSON costs about as much as byte-level tokenizing).
struct RawDocument {
  std::string_view bytes;
  int64_t line = 0;  // 1-based line number for JSONL, for errors
};

// Without a separator the whole text is one document. With one, a line that is exactly the
// separator ends a document (fortune(6) files use "%"); the document keeps the newline of its
// last line. Empty documents are dropped.
std::vector<RawDocument> split_documents(std::string_view text, const std::optional<std::string>& separator) {
  std::vector<RawDocument> docs;
  if (!separator) {
    if (!text.empty()) docs.push_back({text});
    return docs;
  }
  size_t doc_begin = 0, line_begin = 0;
  while (line_begin < text.size()) {
    const size_t newline = text.find('\n', line_begin);
    const size_t line_end = newline == std::string_view::npos ? text.size() : newline;
    const size_t next_line = newline == std::string_view::npos ? text.size() : newline + 1;
    if (text.substr(line_begin, line_end - line_begin) == *separator) {
      if (line_begin > doc_begin) docs.push_back({text.substr(doc_begin, line_begin - doc_begin)});
      doc_begin = next_line;
    }
    line_begin = next_line;
  }
  if (text.size() > doc_begin) docs.push_back({text.substr(doc_begin)});
  return docs;
}

// One JSON object per line. Empty lines (a trailing newline, a blank line between records)
// are skipped; every other line is parsed later and must hold the key.
std::vector<RawDocument> split_jsonl(std::string_view text) {
  std::vector<RawDocument> docs;
  size_t begin = 0;
  int64_t line = 1;
  while (begin < text.size()) {
    const size_t newline = text.find('\n', begin);
    const size_t end = newline == std::string_view::npos ? text.size() : newline;
    std::string_view l = text.substr(begin, end - begin);
    if (!l.empty() && l.back() == '\r') l.remove_suffix(1);
    if (!l.empty()) docs.push_back({l, line});
    begin = end + 1;
    ++line;
  }
  return docs;
}

// How the documents of one input file are read.
struct Source {
  std::string path;
  bool jsonl = false;
  std::string json_key;
};

// The text of a document: the bytes themselves, or the JSONL line's text field.
std::string document_text(const Source& src, const RawDocument& doc) {
  if (!src.jsonl) return std::string(doc.bytes);
  nlohmann::json j;
  try {
    j = dstrain::parse_json(doc.bytes, fmt::format("{}:{}", src.path, doc.line), dstrain::kDataJson);
  } catch (const dstrain::Error& e) {
    DS_FAIL("{}; each line of a JSONL input must be one JSON object with a \"{}\" string field", e.what(),
            src.json_key);
  }
  DS_CHECK(j.is_object(), "{}:{}: the line is JSON {}, not an object; each line of a JSONL input must be one JSON "
           "object with a \"{}\" string field", src.path, doc.line, j.type_name(), src.json_key);
  const auto it = j.find(src.json_key);
  DS_CHECK(it != j.end(), "{}:{}: the object has no \"{}\" field; choose the field that holds the document text with "
           "--json-key", src.path, doc.line, src.json_key);
  DS_CHECK(it->is_string(), "{}:{}: field \"{}\" is {}, not a string; choose the field that holds the document text "
           "with --json-key", src.path, doc.line, src.json_key, it->type_name());
  return it->get<std::string>();
}

// The tokens of a run of documents, each followed by eos; doc_end[d] is where document d ends.
// Documents with empty text are dropped, as in text inputs.
struct Encoded {
  std::vector<uint32_t> tokens;
  std::vector<size_t> doc_end;
};

Encoded encode_range(const Tokenizer& tok, const Source& src, std::span<const RawDocument> docs) {
  Encoded out;
  for (const RawDocument& d : docs) {
    const std::string text = document_text(src, d);
    if (text.empty()) continue;
    const std::vector<int32_t> ids = tok.encode(text);
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.tokens.push_back(uint32_t(tok.eos_id()));
    out.doc_end.push_back(out.tokens.size());
  }
  return out;
}

// Encodes docs on up to `threads` threads over contiguous runs of about equal bytes, so the
// runs, concatenated, are in document order. Small inputs stay on this thread: starting
// threads costs more than encoding a few KB.
std::vector<Encoded> encode_documents(const Tokenizer& tok, const Source& src, std::span<const RawDocument> docs,
                                      int threads) {
  size_t bytes = 0;
  for (const RawDocument& d : docs) bytes += d.bytes.size();
  constexpr size_t kMinParallelBytes = size_t(1) << 20;
  const size_t runs = bytes < kMinParallelBytes ? 1 : std::min(docs.size(), size_t(threads));
  if (runs <= 1) return {encode_range(tok, src, docs)};

  std::vector<size_t> bounds{0};  // (runs + 1) document boundaries
  size_t seen = 0;
  for (size_t d = 0; d < docs.size() && bounds.size() < runs; ++d) {
    seen += docs[d].bytes.size();
    if (seen * runs >= bytes * bounds.size()) bounds.push_back(d + 1);
  }
  bounds.push_back(docs.size());

  std::vector<Encoded> out(bounds.size() - 1);
  std::vector<std::exception_ptr> errors(out.size());
  std::vector<std::thread> pool;
  for (size_t r = 0; r < out.size(); ++r) {
    pool.emplace_back([&, r] {
      try {
        out[r] = encode_range(tok, src, docs.subspan(bounds[r], bounds[r + 1] - bounds[r]));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& t : pool) t.join();
  // The first failing run holds the earliest bad line.
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

// An order-sensitive 64-bit checksum of token ids (FNV-1a over each id's value), to compare
// what was written with what reads back without keeping the tokens.
class TokenChecksum {
 public:
  template <class Int>
  void add(const Int* ids, size_t n) {
    for (size_t i = 0; i < n; ++i) h_ = (h_ ^ uint64_t(uint32_t(ids[i]))) * 1099511628211ull;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 14695981039346656037ull;
};

// Where the documents of one split ("train" or "val") go.
class DocumentSink {
 public:
  virtual ~DocumentSink() = default;
  virtual void add_document(const uint32_t* tokens, size_t n) = 0;
  // Writes what is left, then re-reads every file written and checks it against what was added.
  virtual void finish() = 0;
  virtual std::vector<std::string> summary() const = 0;  // one line per file written
  virtual std::vector<std::string> paths() const = 0;    // the files written
  virtual int64_t documents() const = 0;
};

// Cuts one token stream into PREFIX_<split>_NNNNNN.bin of at most shard_tokens tokens
// (documents may span two shards, as in llm.c), re-reading each shard after writing it.
class LlmcSink final : public DocumentSink {
 public:
  LlmcSink(std::string prefix, std::string split, int version, int64_t shard_tokens, uint32_t eos)
      : prefix_(std::move(prefix)),
        split_(std::move(split)),
        version_(version),
        shard_tokens_(size_t(shard_tokens)),
        eos_(eos) {}

  void add_document(const uint32_t* tokens, size_t n) override {
    ++documents_;
    while (n > 0) {
      const size_t take = std::min(n, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens, tokens + take);
      tokens += take;
      n -= take;
      if (buffer_.size() == shard_tokens_) flush();
    }
  }
  void finish() override {
    if (!buffer_.empty()) flush();
    // Tokenizers never emit eos inside a document's text, so the shards hold one per document.
    DS_CHECK(eos_read_ == documents_,
             "verifying the {} shards of {} failed: they hold {} end-of-document tokens but {} documents were "
             "written; check the disk and the output directory, then run dstrain-prep again",
             split_, prefix_, eos_read_, documents_);
  }
  std::vector<std::string> summary() const override {
    std::vector<std::string> lines;
    for (const auto& [path, tokens] : written_) lines.push_back(fmt::format("{} ({} tokens)", path, tokens));
    return lines;
  }
  std::vector<std::string> paths() const override {
    std::vector<std::string> p;
    for (const auto& w : written_) p.push_back(w.first);
    return p;
  }
  int64_t documents() const override { return documents_; }

 private:
  void flush() {
    const std::string path = fmt::format("{}_{}_{:06d}.bin", prefix_, split_, written_.size());
    write_token_shard(path, buffer_, version_);
    verify(path);
    written_.emplace_back(path, int64_t(buffer_.size()));
    buffer_.clear();
  }

  void verify(const std::string& path) {
    const TokenShard shard(path);
    DS_CHECK(shard.size() == int64_t(buffer_.size()) && shard.version() == version_,
             "verifying {} failed: it holds {} tokens as version {}, but {} tokens were written as version {}; "
             "check the disk and the output directory, then run dstrain-prep again",
             path, shard.size(), shard.version(), buffer_.size(), version_);
    std::vector<int32_t> back(std::min(buffer_.size(), size_t(1) << 20));
    for (size_t begin = 0; begin < buffer_.size(); begin += back.size()) {
      const size_t n = std::min(back.size(), buffer_.size() - begin);
      shard.read(int64_t(begin), int64_t(n), back.data());
      for (size_t j = 0; j < n; ++j) {
        DS_CHECK(uint32_t(back[j]) == buffer_[begin + j],
                 "verifying {} failed: token {} reads back as {} but {} was written; check the disk and the "
                 "output directory, then run dstrain-prep again",
                 path, begin + j, back[j], buffer_[begin + j]);
        eos_read_ += uint32_t(back[j]) == eos_;
      }
    }
  }

  std::string prefix_, split_;
  int version_;
  size_t shard_tokens_;
  uint32_t eos_;
  std::vector<uint32_t> buffer_;
  std::vector<std::pair<std::string, int64_t>> written_;  // (path, tokens)
  int64_t documents_ = 0;
  int64_t eos_read_ = 0;
};

// One Megatron indexed dataset, one sequence per document; the tokens stream to disk, so
// verification compares counts and a checksum instead of the tokens themselves.
class MegatronSink final : public DocumentSink {
 public:
  MegatronSink(std::string prefix, IndexedDtype dtype) : prefix_(std::move(prefix)), writer_(prefix_, dtype) {}

  void add_document(const uint32_t* tokens, size_t n) override {
    writer_.add_document(tokens, n);
    written_.add(tokens, n);
  }
  void finish() override {
    writer_.finalize();
    const IndexedDataset back(prefix_);
    DS_CHECK(back.num_documents() == writer_.num_documents() && back.num_sequences() == writer_.num_documents() &&
                 back.num_tokens() == writer_.num_tokens() && back.dtype() == writer_.dtype(),
             "verifying {} failed: it holds {} documents ({} sequences) and {} tokens as {}, but {} documents and {} "
             "tokens were written as {}; check the disk and the output directory, then run dstrain-prep again",
             back.idx_path(), back.num_documents(), back.num_sequences(), back.num_tokens(),
             indexed_dtype_name(uint8_t(back.dtype())), writer_.num_documents(), writer_.num_tokens(),
             indexed_dtype_name(uint8_t(writer_.dtype())));
    TokenChecksum read;
    std::vector<int32_t> chunk(static_cast<size_t>(std::min<int64_t>(back.num_tokens(), int64_t(1) << 20)));
    for (int64_t begin = 0; begin < back.num_tokens(); begin += int64_t(chunk.size())) {
      const int64_t n = std::min(int64_t(chunk.size()), back.num_tokens() - begin);
      back.read_flat(begin, n, chunk.data());
      read.add(chunk.data(), size_t(n));
    }
    DS_CHECK(read.value() == written_.value(),
             "verifying {} failed: its tokens read back with checksum {:016x} but {:016x} was written; check the "
             "disk and the output directory, then run dstrain-prep again",
             back.bin_path(), read.value(), written_.value());
  }
  std::vector<std::string> summary() const override {
    return {fmt::format("{}.idx, .bin ({} documents, {} tokens, {})", prefix_, writer_.num_documents(),
                        writer_.num_tokens(), indexed_dtype_name(uint8_t(writer_.dtype())))};
  }
  std::vector<std::string> paths() const override { return {idx_path_of(prefix_), bin_path_of(prefix_)}; }
  int64_t documents() const override { return writer_.num_documents(); }

 private:
  std::string prefix_;
  IndexedDatasetWriter writer_;
  TokenChecksum written_;
};

// Files of an earlier run that this one did not rewrite: a glob over the prefix (or a
// Megatron data path) would silently train on them.
void warn_stale_outputs(const std::string& prefix, const std::vector<std::string>& written,
                        const std::vector<std::string>& patterns) {
  const std::set<std::string> ours(written.begin(), written.end());
  for (const std::string& pattern : patterns) {
    std::vector<std::string> found;
    try {
      found = expand_globs({pattern});
    } catch (const Error&) {
      continue;  // nothing matches: nothing stale
    }
    for (const std::string& f : found) {
      if (!ours.count(f)) {
        fmt::print(stderr, "dstrain-prep: warning: {} is from an earlier run and was not rewritten; delete it, or "
                           "{} will still find it\n", f, pattern.find('*') != std::string::npos
                               ? fmt::format("the pattern {}", pattern) : std::string("a data path naming it"));
      }
    }
  }
}

// On a terminal, one line rewritten in place (at most 10 times a second); elsewhere (logs,
// pipes), one line per input file.
class Progress {
 public:
  Progress(std::optional<int64_t> total_bytes, size_t files)
      : tty_(::isatty(STDERR_FILENO) == 1), total_(total_bytes), files_(files), start_(Clock::now()) {}

  void update(size_t file, const std::string& path, int64_t bytes_done, int64_t documents, bool force = false) {
    if (!tty_) return;
    const auto now = Clock::now();
    if (!force && now - last_ < std::chrono::milliseconds(100)) return;
    last_ = now;
    const double seconds = std::max(std::chrono::duration<double>(now - start_).count(), 1e-9);
    const std::string done = total_ && *total_ > 0
                                 ? fmt::format("{:5.1f}%", 100.0 * double(bytes_done) / double(*total_))
                                 : fmt::format("{:.1f} MB", double(bytes_done) / 1e6);
    fmt::print(stderr, "\r[{}/{}] {}  {}  {:.1f} MB/s  {} documents\033[K", file + 1, files_, path, done,
               double(bytes_done) / 1e6 / seconds, documents);
    std::fflush(stderr);
  }
  void file_done(size_t file, const std::string& path, int64_t documents, int64_t bytes, int64_t tokens) {
    if (tty_) return;
    fmt::print("[{}/{}] {}: {} documents, {} bytes, {} tokens\n", file + 1, files_, path, documents, bytes, tokens);
  }
  void finish() {
    if (tty_) fmt::print(stderr, "\n");
  }

 private:
  bool tty_;
  std::optional<int64_t> total_;
  size_t files_;
  Clock::time_point start_, last_{};
};

int run(const PrepOptions& opt) {
  const auto start = Clock::now();
  const bool megatron = opt.format == "megatron";
  const std::optional<int64_t> total_bytes = check_inputs(opt.inputs);
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(opt.tokenizer);
  const std::filesystem::path out_dir = std::filesystem::path(opt.output_prefix).parent_path();
  if (!out_dir.empty()) std::filesystem::create_directories(out_dir);

  std::unique_ptr<DocumentSink> val, train;
  std::vector<std::string> stale_patterns;
  if (megatron) {
    const IndexedDtype dtype = opt.dtype == "uint16" ? IndexedDtype::kUint16
                               : opt.dtype == "int32" ? IndexedDtype::kInt32
                                                      : optimal_indexed_dtype(tok->vocab_size());
    DS_CHECK(dtype == IndexedDtype::kInt32 || tok->vocab_size() <= 65536,
             "--dtype uint16 stores ids up to 65535, but the {} tokenizer has {} ids; use --dtype int32 (or auto)",
             tok->name(), tok->vocab_size());
    // Megatron names a dataset after its JSON key and level: PREFIX_text_document.
    const std::string suffix = fmt::format("{}_document", opt.json_key);
    if (opt.val_docs > 0) {
      val = std::make_unique<MegatronSink>(fmt::format("{}_val_{}", opt.output_prefix, suffix), dtype);
    }
    train = std::make_unique<MegatronSink>(fmt::format("{}_{}", opt.output_prefix, suffix), dtype);
    if (opt.val_docs == 0) stale_patterns.push_back(fmt::format("{}_val_{}.idx", opt.output_prefix, suffix));
    fmt::print("dstrain-prep: tokenizer {} (vocab {}), Megatron indexed datasets of {} tokens, {} threads\n",
               tok->name(), tok->vocab_size(), indexed_dtype_name(uint8_t(dtype)), opt.threads);
  } else {
    const int version = opt.version.value_or(tok->vocab_size() <= 65536 ? 1 : 7);
    DS_CHECK(version == 7 || tok->vocab_size() <= 65536,
             "--version 1 stores uint16 tokens, but the {} tokenizer has {} ids; use --version 7", tok->name(),
             tok->vocab_size());
    val = std::make_unique<LlmcSink>(opt.output_prefix, "val", version, opt.shard_tokens, uint32_t(tok->eos_id()));
    train = std::make_unique<LlmcSink>(opt.output_prefix, "train", version, opt.shard_tokens, uint32_t(tok->eos_id()));
    for (const char* split : {"train", "val"}) {
      stale_patterns.push_back(fmt::format("{}_{}_*.bin", opt.output_prefix, split));
    }
    fmt::print("dstrain-prep: tokenizer {} (vocab {}), version {} shards, up to {} tokens per shard, {} threads\n",
               tok->name(), tok->vocab_size(), version, opt.shard_tokens, opt.threads);
  }

  // Documents are encoded in batches of about this much text, so progress moves within a
  // large file and the tokens in memory stay bounded.
  constexpr size_t kBatchBytes = size_t(32) << 20;
  Progress progress(total_bytes, opt.inputs.size());
  int64_t docs_seen = 0, tokens_seen = 0, text_bytes = 0;
  for (size_t f = 0; f < opt.inputs.size(); ++f) {
    const Source src{opt.inputs[f], is_jsonl(opt.inputs[f], opt), opt.json_key};
    progress.update(f, src.path, text_bytes, docs_seen, /*force=*/true);
    const std::string text = read_input(src.path);
    if (!total_bytes) check_is_text(src.path, std::string_view(text).substr(0, kTextCheckBytes));
    const std::vector<RawDocument> docs = src.jsonl ? split_jsonl(text) : split_documents(text, opt.split_on_line);
    int64_t file_tokens = 0, file_docs = 0, file_bytes_done = 0;
    for (size_t begin = 0; begin < docs.size();) {
      size_t end = begin, batch_bytes = 0;
      while (end < docs.size() && (end == begin || batch_bytes < kBatchBytes)) batch_bytes += docs[end++].bytes.size();
      const std::span<const RawDocument> batch = std::span(docs).subspan(begin, end - begin);
      for (const Encoded& part : encode_documents(*tok, src, batch, opt.threads)) {
        size_t doc_begin = 0;
        for (size_t doc_end : part.doc_end) {
          DocumentSink& dest = docs_seen < opt.val_docs ? *val : *train;
          dest.add_document(part.tokens.data() + doc_begin, doc_end - doc_begin);
          doc_begin = doc_end;
          ++docs_seen;
          ++file_docs;
        }
        file_tokens += int64_t(part.tokens.size());
      }
      file_bytes_done += int64_t(batch_bytes);
      progress.update(f, src.path, text_bytes + file_bytes_done, docs_seen);
      begin = end;
    }
    tokens_seen += file_tokens;
    text_bytes += int64_t(text.size());
    progress.update(f, src.path, text_bytes, docs_seen, /*force=*/true);
    progress.file_done(f, src.path, file_docs, int64_t(text.size()), file_tokens);
  }
  progress.finish();
  DS_CHECK(docs_seen > 0, "the inputs hold no documents (all {} files are empty{}); check the inputs",
           opt.inputs.size(), opt.split_on_line ? " or only separators" : "");
  if (val) val->finish();
  train->finish();

  std::vector<std::string> lines, written;
  for (const DocumentSink* sink : {val.get(), train.get()}) {
    if (!sink) continue;
    for (const std::string& l : sink->summary()) lines.push_back(l);
    for (const std::string& p : sink->paths()) written.push_back(p);
  }
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  const int64_t val_docs = val ? val->documents() : 0;
  fmt::print("dstrain-prep: {} documents ({} val, {} train), {} tokens, {} bytes of text in {:.3f} s ({:.1f} MB/s); "
             "{} file{} written, each verified:\n",
             docs_seen, val_docs, docs_seen - val_docs, tokens_seen, text_bytes, seconds,
             double(text_bytes) / 1e6 / std::max(seconds, 1e-9), written.size(), written.size() == 1 ? "" : "s");
  for (const std::string& l : lines) fmt::print("  {}\n", l);
  if (train->documents() == 0) {
    fmt::print(stderr, "dstrain-prep: warning: {}: --val-docs {} took all {} documents\n",
               megatron ? "the training dataset is empty" : "no training shard written", opt.val_docs, docs_seen);
  }
  warn_stale_outputs(opt.output_prefix, written, stale_patterns);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    CLI::App app{"dstrain-prep: tokenize text or JSONL files into llm.c token shards or Megatron indexed datasets"};
    PrepOptions opt;
    app.add_option("--input", opt.inputs,
                   "Input files: text (each one document unless --split-on-line is given), or JSONL (*.jsonl, "
                   "*.json or --jsonl: one JSON object per line, one document each)")
        ->required();
    app.add_option("--output-prefix", opt.output_prefix,
                   "Output prefix: llmc writes PREFIX_val_000000.bin, PREFIX_train_000000.bin, ...; megatron writes "
                   "PREFIX_text_document.idx/.bin (and PREFIX_val_text_document.* with --val-docs)")
        ->required();
    app.add_option("--format", opt.format, "Output format: llmc (token shards) or megatron (indexed dataset)")
        ->capture_default_str()
        ->check(cli::one_of({"llmc", "megatron"}));
    app.add_option("--tokenizer", opt.tokenizer,
                   "Tokenizer: byte, or a Hugging Face tokenizer.json (or a model directory holding one)")
        ->capture_default_str();
    app.add_option("--split-on-line", opt.split_on_line,
                   "In text inputs, a line that is exactly this string separates documents (fortune files: %)");
    app.add_flag("--jsonl", opt.jsonl, "Read every input as JSONL, whatever its name");
    app.add_option("--json-key", opt.json_key, "The JSONL field that holds the document text")->capture_default_str();
    app.add_option("--val-docs", opt.val_docs, "The first N documents go to the validation output")
        ->capture_default_str()
        ->check(cli::integer_in(0));
    CLI::Option* shard_tokens =
        app.add_option("--shard-tokens", opt.shard_tokens, "llmc: at most this many tokens per shard")
        ->capture_default_str()
        ->check(cli::integer_in(1, 2147483647));
    app.add_option("--version", opt.version,
                   "llmc shard version: 1 (uint16 tokens) or 7 (uint32); default by vocabulary")
        ->check(cli::one_of({"1", "7"}));
    app.add_option("--dtype", opt.dtype,
                   "megatron token type: uint16, int32, or auto (uint16 when the vocabulary has fewer than 65500 ids, "
                   "as Megatron does)")
        ->capture_default_str()
        ->check(cli::one_of({"auto", "uint16", "int32"}));
    app.add_option("--threads", opt.threads, "Tokenization threads")->capture_default_str()->check(cli::integer_in(1));
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      return cli::report(app, e, "dstrain-prep", "dstrain-prep");
    }
    opt.shard_tokens_given = shard_tokens->count() > 0;
    try {
      check_option_combinations(opt);
    } catch (const Error& e) {
      return cli::report("dstrain-prep", e.what(), "dstrain-prep");
    }
    try {
      check_inputs(opt.inputs);
    } catch (const Error& e) {
      fmt::print(stderr, "dstrain-prep: error: {}\n", e.what());
      return cli::kExitBadCommandLine;
    }
    return run(opt);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dstrain-prep: error: {}\n", e.what());
    return 1;
  }
}
