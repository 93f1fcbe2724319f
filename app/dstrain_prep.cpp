// dstrain-prep: text files -> llm.c token shards (PREFIX_val_000000.bin, PREFIX_train_000000.bin, ...)
// that WindowDataset reads. Every document is encoded and followed by the tokenizer's eos id.
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "core/error.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "data/window_dataset.h"

namespace {

using namespace dstrain;

struct PrepOptions {
  std::vector<std::string> inputs;
  std::string output_prefix;
  std::string tokenizer = "byte";
  std::optional<std::string> split_on_line;
  int64_t val_docs = 0;
  int64_t shard_tokens = 100'000'000;
  std::optional<int> version;  // default: 1 if the vocabulary fits uint16, else 7
  int threads = int(std::max(1u, std::thread::hardware_concurrency()));
};

// Before any work: a typo in the last of many inputs should not cost a run over the others.
void check_inputs(const std::vector<std::string>& inputs) {
  namespace fs = std::filesystem;
  for (const std::string& path : inputs) {
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    DS_CHECK(fs::exists(st), "input {} does not exist; check the path", path);
    DS_CHECK(!fs::is_directory(st), "input {} is a directory; pass the files inside it (e.g. {}/*)", path, path);
  }
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

// Without a separator the whole text is one document. With one, a line that is exactly the
// separator ends a document (fortune(6) files use "%"); the document keeps the newline of its
// last line. Empty documents are dropped.
std::vector<std::string_view> split_documents(std::string_view text, const std::optional<std::string>& separator) {
  std::vector<std::string_view> docs;
  if (!separator) {
    if (!text.empty()) docs.push_back(text);
    return docs;
  }
  size_t doc_begin = 0, line_begin = 0;
  while (line_begin < text.size()) {
    const size_t newline = text.find('\n', line_begin);
    const size_t line_end = newline == std::string_view::npos ? text.size() : newline;
    const size_t next_line = newline == std::string_view::npos ? text.size() : newline + 1;
    if (text.substr(line_begin, line_end - line_begin) == *separator) {
      if (line_begin > doc_begin) docs.push_back(text.substr(doc_begin, line_begin - doc_begin));
      doc_begin = next_line;
    }
    line_begin = next_line;
  }
  if (text.size() > doc_begin) docs.push_back(text.substr(doc_begin));
  return docs;
}

// The tokens of a run of documents, each followed by eos; doc_end[d] is where document d ends.
struct Encoded {
  std::vector<uint32_t> tokens;
  std::vector<size_t> doc_end;
};

Encoded encode_range(const Tokenizer& tok, const std::vector<std::string_view>& docs, size_t begin, size_t end) {
  Encoded out;
  for (size_t d = begin; d < end; ++d) {
    const std::vector<int32_t> ids = tok.encode(docs[d]);
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.tokens.push_back(uint32_t(tok.eos_id()));
    out.doc_end.push_back(out.tokens.size());
  }
  return out;
}

// Encodes docs on up to `threads` threads over contiguous runs of about equal bytes, so the
// runs, concatenated, are in document order. Small inputs stay on this thread: starting
// threads costs more than encoding a few KB.
std::vector<Encoded> encode_documents(const Tokenizer& tok, const std::vector<std::string_view>& docs, int threads) {
  size_t bytes = 0;
  for (std::string_view d : docs) bytes += d.size();
  constexpr size_t kMinParallelBytes = size_t(1) << 20;
  const size_t runs = bytes < kMinParallelBytes ? 1 : std::min(docs.size(), size_t(threads));
  if (runs <= 1) return {encode_range(tok, docs, 0, docs.size())};

  std::vector<size_t> bounds{0};  // (runs + 1) document boundaries
  size_t seen = 0;
  for (size_t d = 0; d < docs.size() && bounds.size() < runs; ++d) {
    seen += docs[d].size();
    if (seen * runs >= bytes * bounds.size()) bounds.push_back(d + 1);
  }
  bounds.push_back(docs.size());

  std::vector<Encoded> out(bounds.size() - 1);
  std::vector<std::exception_ptr> errors(out.size());
  std::vector<std::thread> pool;
  for (size_t r = 0; r < out.size(); ++r) {
    pool.emplace_back([&, r] {
      try {
        out[r] = encode_range(tok, docs, bounds[r], bounds[r + 1]);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return out;
}

struct WrittenShard {
  std::string path;
  int64_t tokens;
};

// Cuts one token stream ("train" or "val") into PREFIX_<split>_NNNNNN.bin of at most
// shard_tokens tokens (documents may span two shards, as in llm.c), re-reading each shard
// after writing it.
class ShardWriter {
 public:
  ShardWriter(std::string prefix, std::string split, int version, int64_t shard_tokens)
      : prefix_(std::move(prefix)), split_(std::move(split)), version_(version), shard_tokens_(size_t(shard_tokens)) {}

  void append(const uint32_t* tokens, size_t n) {
    while (n > 0) {
      const size_t take = std::min(n, shard_tokens_ - buffer_.size());
      buffer_.insert(buffer_.end(), tokens, tokens + take);
      tokens += take;
      n -= take;
      if (buffer_.size() == shard_tokens_) flush();
    }
  }
  void finish() {
    if (!buffer_.empty()) flush();
  }
  const std::vector<WrittenShard>& written() const { return written_; }

 private:
  void flush() {
    const std::string path = fmt::format("{}_{}_{:06d}.bin", prefix_, split_, written_.size());
    write_token_shard(path, buffer_, version_);
    verify(path);
    written_.push_back({path, int64_t(buffer_.size())});
    buffer_.clear();
  }

  void verify(const std::string& path) const {
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
      }
    }
  }

  std::string prefix_, split_;
  int version_;
  size_t shard_tokens_;
  std::vector<uint32_t> buffer_;
  std::vector<WrittenShard> written_;
};

// Shards of an earlier run with more shards survive this one, and a glob over the prefix
// would silently train on them.
void warn_stale_shards(const std::string& prefix, const std::vector<WrittenShard>& written) {
  std::set<std::string> ours;
  for (const WrittenShard& w : written) ours.insert(w.path);
  for (const char* split : {"train", "val"}) {
    const std::string pattern = fmt::format("{}_{}_*.bin", prefix, split);
    std::vector<std::string> found;
    try {
      found = expand_globs({pattern});
    } catch (const Error&) {
      continue;  // nothing matches: nothing stale
    }
    for (const std::string& f : found) {
      if (!ours.count(f)) {
        fmt::print(stderr, "dstrain-prep: warning: {} is from an earlier run and was not rewritten; delete it, or "
                           "the pattern {} will include it\n", f, pattern);
      }
    }
  }
}

int run(const PrepOptions& opt) {
  const auto start = std::chrono::steady_clock::now();
  check_inputs(opt.inputs);
  const std::unique_ptr<Tokenizer> tok = make_tokenizer(opt.tokenizer);
  const int version = opt.version.value_or(tok->vocab_size() <= 65536 ? 1 : 7);
  DS_CHECK(version == 7 || tok->vocab_size() <= 65536,
           "--version 1 stores uint16 tokens, but the {} tokenizer has {} ids; use --version 7", tok->name(),
           tok->vocab_size());
  const std::filesystem::path out_dir = std::filesystem::path(opt.output_prefix).parent_path();
  if (!out_dir.empty()) std::filesystem::create_directories(out_dir);
  fmt::print("dstrain-prep: tokenizer {} (vocab {}), version {} shards, up to {} tokens per shard, {} threads\n",
             tok->name(), tok->vocab_size(), version, opt.shard_tokens, opt.threads);

  ShardWriter val(opt.output_prefix, "val", version, opt.shard_tokens);
  ShardWriter train(opt.output_prefix, "train", version, opt.shard_tokens);
  int64_t docs_seen = 0, tokens_seen = 0, text_bytes = 0;
  for (size_t f = 0; f < opt.inputs.size(); ++f) {
    const std::string& path = opt.inputs[f];
    const std::string text = read_input(path);
    const std::vector<std::string_view> docs = split_documents(text, opt.split_on_line);
    int64_t file_tokens = 0;
    for (const Encoded& part : encode_documents(*tok, docs, opt.threads)) {
      size_t doc_begin = 0;
      for (size_t doc_end : part.doc_end) {
        ShardWriter& dest = docs_seen < opt.val_docs ? val : train;
        dest.append(part.tokens.data() + doc_begin, doc_end - doc_begin);
        doc_begin = doc_end;
        ++docs_seen;
      }
      file_tokens += int64_t(part.tokens.size());
    }
    tokens_seen += file_tokens;
    text_bytes += int64_t(text.size());
    fmt::print("[{}/{}] {}: {} documents, {} bytes, {} tokens\n", f + 1, opt.inputs.size(), path, docs.size(),
               text.size(), file_tokens);
  }
  DS_CHECK(docs_seen > 0, "the inputs hold no documents (all {} files are empty{}); check the inputs",
           opt.inputs.size(), opt.split_on_line ? " or only separators" : "");
  val.finish();
  train.finish();

  std::vector<WrittenShard> written = val.written();
  written.insert(written.end(), train.written().begin(), train.written().end());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  fmt::print("dstrain-prep: {} documents ({} val, {} train), {} tokens, {} bytes of text in {:.3f} s ({:.1f} MB/s); "
             "{} file{} written, each verified:\n",
             docs_seen, std::min(docs_seen, opt.val_docs), docs_seen - std::min(docs_seen, opt.val_docs), tokens_seen,
             text_bytes, seconds, double(text_bytes) / 1e6 / std::max(seconds, 1e-9), written.size(),
             written.size() == 1 ? "" : "s");
  for (const WrittenShard& w : written) fmt::print("  {} ({} tokens)\n", w.path, w.tokens);
  if (train.written().empty()) {
    fmt::print(stderr, "dstrain-prep: warning: no training shard written: --val-docs {} took all {} documents\n",
               opt.val_docs, docs_seen);
  }
  warn_stale_shards(opt.output_prefix, written);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    CLI::App app{"dstrain-prep: tokenize text files into llm.c token shards for dstrain"};
    PrepOptions opt;
    app.add_option("--input", opt.inputs, "Input text files; each is one document unless --split-on-line is given")
        ->required();
    app.add_option("--output-prefix", opt.output_prefix,
                   "Output prefix: writes PREFIX_val_000000.bin and PREFIX_train_000000.bin, ...")
        ->required();
    app.add_option("--tokenizer", opt.tokenizer, "Tokenizer (this build: byte)")->capture_default_str();
    app.add_option("--split-on-line", opt.split_on_line,
                   "A line that is exactly this string separates documents (fortune files: %)");
    app.add_option("--val-docs", opt.val_docs, "The first N documents go to the validation shard")->capture_default_str()
        ->check(CLI::NonNegativeNumber);
    app.add_option("--shard-tokens", opt.shard_tokens, "At most this many tokens per shard")->capture_default_str()
        ->check(CLI::Range(int64_t(1), int64_t(2147483647)));
    app.add_option("--version", opt.version, "Shard version: 1 (uint16 tokens) or 7 (uint32); default by vocabulary")
        ->check(CLI::IsMember({1, 7}));
    app.add_option("--threads", opt.threads, "Tokenization threads")->capture_default_str()->check(CLI::PositiveNumber);
    try {
      app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
      if (e.get_exit_code() == 0) return app.exit(e);  // --help
      fmt::print(stderr, "dstrain-prep: error: {}; run dstrain-prep --help for the options\n", e.what());
      return 1;
    }
    return run(opt);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dstrain-prep: error: {}\n", e.what());
    return 1;
  }
}
