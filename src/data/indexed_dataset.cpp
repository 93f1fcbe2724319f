// Megatron MMIDIDX datasets: the streaming writer, and the reader that validates every .idx
// array against the file sizes before anything reads through the mappings.
#include "data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace dstrain {

// The .idx arrays and the .bin tokens are little-endian and are copied straight out of the mappings.
static_assert(std::endian::native == std::endian::little,
              "indexed datasets are read in place and assume a little-endian host");

namespace {

constexpr const char* kRecreate = "re-create it with dstrain-prep";

// Loads of any width from any byte offset: the .idx arrays start at byte 34 and are packed,
// so their elements are not aligned for their type.
template <class T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct Mapping {
  const unsigned char* data = nullptr;  // null for an empty file
  size_t bytes = 0;
};

// Maps a whole file read-only. `what` names the file's role in errors ("index", "data").
Mapping map_file(const std::string& path, const char* what, const std::string& prefix) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0,
           "cannot open the {} file {} of Megatron dataset {}: {}; check the prefix (the dataset is PREFIX.idx "
           "and PREFIX.bin, written by dstrain-prep --format megatron)",
           what, path, prefix, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    DS_FAIL("cannot stat {}: {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    DS_FAIL("{} is not a regular file; pass the prefix of a Megatron dataset (PREFIX.idx, PREFIX.bin)", path);
  }
  Mapping m;
  m.bytes = size_t(st.st_size);
  if (m.bytes > 0) {
    void* p = ::mmap(nullptr, m.bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);  // the mapping keeps the file alive
    DS_CHECK(p != MAP_FAILED, "cannot mmap {} ({} bytes): {}", path, m.bytes, std::strerror(err));
    m.data = static_cast<const unsigned char*>(p);
  } else {
    ::close(fd);
  }
  return m;
}

void unmap_file(const unsigned char*& data, size_t& bytes) noexcept {
  if (data) ::munmap(const_cast<unsigned char*>(data), bytes);
  data = nullptr;
  bytes = 0;
}

std::string hex_bytes(const unsigned char* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) s += fmt::format("{}{:02x}", i ? " " : "", p[i]);
  return s;
}

}  // namespace

int indexed_dtype_size(uint8_t code) {
  switch (code) {
    case 1: case 2: return 1;
    case 3: case 8: return 2;
    case 4: case 7: return 4;
    case 5: case 6: return 8;
    default: return 0;
  }
}

const char* indexed_dtype_name(uint8_t code) {
  switch (code) {
    case 1: return "uint8";
    case 2: return "int8";
    case 3: return "int16";
    case 4: return "int32";
    case 5: return "int64";
    case 6: return "float64";
    case 7: return "float32";
    case 8: return "uint16";
    default: return "unknown";
  }
}

IndexedDtype optimal_indexed_dtype(int64_t vocab_size) {
  return vocab_size < 65500 ? IndexedDtype::kUint16 : IndexedDtype::kInt32;
}

std::string idx_path_of(const std::string& prefix) { return prefix + ".idx"; }
std::string bin_path_of(const std::string& prefix) { return prefix + ".bin"; }

// ---- writer ---------------------------------------------------------------------------------

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexedDtype dtype)
    : prefix_(std::move(prefix)), dtype_(dtype), itemsize_(indexed_dtype_size(uint8_t(dtype))) {
  DS_CHECK(dtype == IndexedDtype::kUint16 || dtype == IndexedDtype::kInt32,
           "cannot write Megatron dataset {} as {}: token ids are written as uint16 (vocabularies below 65500) or "
           "int32",
           prefix_, indexed_dtype_name(uint8_t(dtype)));
  const std::string tmp = bin_path_of(prefix_) + ".tmp";
  bin_ = std::fopen(tmp.c_str(), "wb");
  DS_CHECK(bin_ != nullptr, "cannot create {}: {}; check that its directory exists and is writable", tmp,
           std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (!finalized_) discard();
}

void IndexedDatasetWriter::discard() noexcept {
  if (bin_) std::fclose(bin_);
  bin_ = nullptr;
  std::remove((bin_path_of(prefix_) + ".tmp").c_str());
  std::remove((idx_path_of(prefix_) + ".tmp").c_str());
}

void IndexedDatasetWriter::write_bin(const void* data, size_t bytes) {
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, bin_) != bytes) {
    const int err = errno;
    discard();
    DS_FAIL("writing the tokens of {}.tmp failed: {}; check free disk space and permissions", bin_path_of(prefix_),
            std::strerror(err));
  }
}

void IndexedDatasetWriter::add_document(const uint32_t* tokens, size_t count) {
  DS_CHECK(!finalized_ && bin_ != nullptr, "Megatron dataset {} is already finalized or failed; add documents before "
           "finalize()", prefix_);
  DS_CHECK(count <= size_t(std::numeric_limits<int32_t>::max()),
           "document {} of Megatron dataset {} has {} tokens, but the .idx stores sequence lengths as int32; split "
           "the document",
           lengths_.size(), prefix_, count);
  const uint32_t limit = dtype_ == IndexedDtype::kUint16 ? 0xFFFFu : uint32_t(std::numeric_limits<int32_t>::max());
  const uint32_t* big = std::find_if(tokens, tokens + count, [&](uint32_t t) { return t > limit; });
  DS_CHECK(big == tokens + count,
           "cannot write token {} of document {} (id {}) to Megatron dataset {} as {}: the largest id it holds is "
           "{}; use --dtype int32 for this vocabulary",
           big - tokens, lengths_.size(), big == tokens + count ? 0u : *big, prefix_,
           indexed_dtype_name(uint8_t(dtype_)), limit);
  // Narrow through a bounded staging buffer, a chunk at a time.
  constexpr size_t kChunk = size_t(1) << 20;
  for (size_t begin = 0; begin < count; begin += kChunk) {
    const size_t n = std::min(kChunk, count - begin);
    staging_.resize(n * size_t(itemsize_));
    if (dtype_ == IndexedDtype::kUint16) {
      for (size_t j = 0; j < n; ++j) {
        const uint16_t v = uint16_t(tokens[begin + j]);
        std::memcpy(staging_.data() + 2 * j, &v, 2);
      }
    } else {
      std::memcpy(staging_.data(), tokens + begin, n * 4);  // ids <= INT32_MAX: same bits as int32
    }
    write_bin(staging_.data(), staging_.size());
  }
  lengths_.push_back(int32_t(count));
  num_tokens_ += int64_t(count);
}

void IndexedDatasetWriter::finalize() {
  DS_CHECK(!finalized_ && bin_ != nullptr, "Megatron dataset {} is already finalized or failed", prefix_);
  const std::string bin_tmp = bin_path_of(prefix_) + ".tmp";
  const std::string idx_tmp = idx_path_of(prefix_) + ".tmp";
  const bool flushed = std::fflush(bin_) == 0;
  const int flush_err = errno;
  const bool closed = std::fclose(bin_) == 0;
  const int close_err = errno;
  bin_ = nullptr;
  if (!flushed || !closed) {
    discard();
    DS_FAIL("closing {} failed: {}; check free disk space", bin_tmp, std::strerror(flushed ? close_err : flush_err));
  }

  std::FILE* f = std::fopen(idx_tmp.c_str(), "wb");
  if (!f) {
    const int err = errno;
    discard();
    DS_FAIL("cannot create {}: {}; check that its directory exists and is writable", idx_tmp, std::strerror(err));
  }
  auto fail = [&](const char* what) {
    const int err = errno;
    std::fclose(f);
    discard();
    DS_FAIL("{} {} failed: {}; check free disk space and permissions", what, idx_tmp, std::strerror(err));
  };
  auto put = [&](const void* p, size_t bytes, const char* what) {
    if (bytes > 0 && std::fwrite(p, 1, bytes, f) != bytes) fail(what);
  };
  const uint64_t S = lengths_.size();
  const uint64_t D = S + 1;  // one sequence per document: indices 0, 1, ..., S
  const uint8_t code = uint8_t(dtype_);
  put(kIdxMagic, sizeof(kIdxMagic), "writing the header of");
  put(&kIdxVersion, 8, "writing the header of");
  put(&code, 1, "writing the header of");
  put(&S, 8, "writing the header of");
  put(&D, 8, "writing the header of");
  put(lengths_.data(), lengths_.size() * 4, "writing the sequence lengths of");
  // Pointers and document indices go through a bounded buffer: S can be 10^8 documents.
  constexpr size_t kChunk = size_t(1) << 16;
  std::vector<int64_t> chunk;
  int64_t pointer = 0;
  for (size_t begin = 0; begin < S; begin += kChunk) {
    const size_t n = std::min<size_t>(kChunk, S - begin);
    chunk.resize(n);
    for (size_t j = 0; j < n; ++j) {
      chunk[j] = pointer;
      pointer += int64_t(lengths_[begin + j]) * itemsize_;
    }
    put(chunk.data(), n * 8, "writing the sequence pointers of");
  }
  for (size_t begin = 0; begin < D; begin += kChunk) {
    const size_t n = std::min<size_t>(kChunk, D - begin);
    chunk.resize(n);
    for (size_t j = 0; j < n; ++j) chunk[j] = int64_t(begin + j);
    put(chunk.data(), n * 8, "writing the document indices of");
  }
  if (std::fflush(f) != 0) fail("flushing");
  if (std::fclose(f) != 0) {
    const int err = errno;
    discard();
    DS_FAIL("closing {} failed: {}; check free disk space", idx_tmp, std::strerror(err));
  }
  // The .bin first: a reader that races the two renames sees a new .bin with the old .idx,
  // which fails validation instead of reading stale sequences.
  for (const auto& [tmp, final_path] :
       {std::pair{bin_tmp, bin_path_of(prefix_)}, std::pair{idx_tmp, idx_path_of(prefix_)}}) {
    if (std::rename(tmp.c_str(), final_path.c_str()) != 0) {
      const int err = errno;
      discard();
      DS_FAIL("cannot rename {} to {}: {}", tmp, final_path, std::strerror(err));
    }
  }
  finalized_ = true;
}

// ---- reader ---------------------------------------------------------------------------------

IndexedDataset::IndexedDataset(const std::string& prefix)
    : prefix_(prefix), idx_path_(idx_path_of(prefix)), bin_path_(bin_path_of(prefix)) {
  const Mapping idx = map_file(idx_path_, "index", prefix_);
  idx_ = idx.data;
  idx_bytes_ = idx.bytes;
  // From here on a failed check must unmap; the destructor does not run for a throwing constructor.
  try {
    const Mapping bin = map_file(bin_path_, "data", prefix_);
    bin_ = bin.data;
    bin_bytes_ = bin.bytes;
    validate();
  } catch (...) {
    unmap();
    throw;
  }
}

IndexedDataset::~IndexedDataset() { unmap(); }

void IndexedDataset::unmap() noexcept {
  unmap_file(idx_, idx_bytes_);
  unmap_file(bin_, bin_bytes_);
}

int64_t IndexedDataset::load_length(int64_t i) const { return load<int32_t>(idx_ + lengths_offset_ + 4 * i); }
int64_t IndexedDataset::load_pointer(int64_t i) const { return load<int64_t>(idx_ + pointers_offset_ + 8 * i); }
int64_t IndexedDataset::load_doc_index(int64_t i) const { return load<int64_t>(idx_ + doc_indices_offset_ + 8 * i); }

void IndexedDataset::validate() {
  const std::string& idx = idx_path_;
  const uint64_t size = idx_bytes_;
  if (size < uint64_t(kIdxHeaderBytes)) {
    DS_FAIL("{} is {} bytes, too short for the {}-byte MMIDIDX header (the file ends at byte offset {}); the .idx is "
            "truncated or not a Megatron index: {}",
            idx, size, kIdxHeaderBytes, size, kRecreate);
  }
  if (std::memcmp(idx_, kIdxMagic, sizeof(kIdxMagic)) != 0) {
    DS_FAIL("{}: byte offset 0 holds {}, not the magic \"MMIDIDX\" 00 00 of a Megatron index; this is not a Megatron "
            "indexed dataset (.idx): {}",
            idx, hex_bytes(idx_, sizeof(kIdxMagic)), kRecreate);
  }
  const uint64_t version = load<uint64_t>(idx_ + kIdxVersionOffset);
  DS_CHECK(version == kIdxVersion,
           "{}: byte offset {} holds version {}, but this build reads MMIDIDX version {} only: {} (or with Megatron's "
           "preprocess_data.py)",
           idx, kIdxVersionOffset, version, kIdxVersion, kRecreate);
  const uint8_t code = idx_[kIdxDtypeOffset];
  itemsize_ = indexed_dtype_size(code);
  DS_CHECK(itemsize_ != 0, "{}: byte offset {} holds dtype code {}, which Megatron does not define (1-8); the .idx is "
           "corrupt: {}", idx, kIdxDtypeOffset, code, kRecreate);
  DS_CHECK(code == 1 || code == 3 || code == 4 || code == 5 || code == 8,
           "{}: byte offset {} holds dtype code {} ({}), which cannot hold token ids (uint8, int16, int32, int64 and "
           "uint16 can): {}",
           idx, kIdxDtypeOffset, code, indexed_dtype_name(code), kRecreate);
  dtype_ = IndexedDtype(code);

  // The arrays must fill the rest of the file exactly: 4 S + 8 S + 8 D bytes. Division first,
  // so absurd counts cannot overflow.
  const uint64_t S = load<uint64_t>(idx_ + kIdxSequenceCountOffset);
  const uint64_t D = load<uint64_t>(idx_ + kIdxDocumentCountOffset);
  const uint64_t body = size - uint64_t(kIdxHeaderBytes);
  if (S > body / 12 || D > body / 8 || 12 * S + 8 * D != body) {
    const bool too_big = S > body / 12 || D > body / 8 || 12 * S + 8 * D > body;
    DS_FAIL("{}: the header promises {} sequences (byte offset {}) and {} document indices (byte offset {}), which "
            "need {} + 12 * {} + 8 * {} bytes, but the file is {} bytes; the .idx is {}: {}",
            idx, S, kIdxSequenceCountOffset, D, kIdxDocumentCountOffset, kIdxHeaderBytes, S, D, size,
            too_big ? "truncated or its counts are corrupt" : "followed by trailing data or its counts are corrupt",
            kRecreate);
  }
  DS_CHECK(D >= 1, "{}: byte offset {} holds 0 document indices, but the document index array always holds at least "
           "its leading 0; the .idx is corrupt: {}", idx, kIdxDocumentCountOffset, kRecreate);
  num_sequences_ = int64_t(S);
  num_doc_indices_ = int64_t(D);
  lengths_offset_ = kIdxHeaderBytes;
  pointers_offset_ = lengths_offset_ + 4 * num_sequences_;
  doc_indices_offset_ = pointers_offset_ + 8 * num_sequences_;

  // Sequences must tile the .bin from byte 0 with no gaps; each is checked against the .bin
  // size before the next, so `end` never exceeds bin_bytes_ and cannot overflow.
  const int64_t bin_size = int64_t(bin_bytes_);
  int64_t end = 0;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    const int64_t length = load_length(i);
    DS_CHECK(length >= 0, "{}: sequence {} has negative length {} (byte offset {}); the .idx is corrupt: {}", idx, i,
             length, lengths_offset_ + 4 * i, kRecreate);
    const int64_t pointer = load_pointer(i);
    if (pointer != end) {
      DS_FAIL("{}: sequence {} starts at .bin byte {} (pointer at byte offset {}), but {}; each pointer must be the "
              "previous one plus the previous length times the {}-byte item size: the .idx is corrupt: {}",
              idx, i, pointer, pointers_offset_ + 8 * i,
              i == 0 ? std::string("the first sequence must start at byte 0")
                     : fmt::format("sequence {} ends at .bin byte {}", i - 1, end),
              itemsize_, kRecreate);
    }
    const int64_t bytes = length * itemsize_;
    if (bytes > bin_size - pointer) {
      DS_FAIL("{}: sequence {} (length {} at byte offset {}, pointer {} at byte offset {}) ends at byte {} of {}, "
              "past its end at byte offset {}: the .bin is truncated (or belongs to another .idx); {} (both files)",
              idx, i, length, lengths_offset_ + 4 * i, pointer, pointers_offset_ + 8 * i, pointer + bytes, bin_path_,
              bin_size, kRecreate);
    }
    end = pointer + bytes;
  }
  if (end != bin_size) {
    DS_FAIL("{} is {} bytes, but its index {} describes {} bytes of tokens ending at byte offset {}; the .bin has {} "
            "trailing bytes (appended to, or the .idx is stale): {} (both files)",
            bin_path_, bin_size, idx, end, end, bin_size - end, kRecreate);
  }
  num_tokens_ = bin_size / itemsize_;

  int64_t previous = 0;
  for (int64_t j = 0; j < num_doc_indices_; ++j) {
    const int64_t v = load_doc_index(j);
    const int64_t offset = doc_indices_offset_ + 8 * j;
    DS_CHECK(j > 0 || v == 0, "{}: the first document index (byte offset {}) is {}, but documents must start at "
             "sequence 0; the .idx is corrupt: {}", idx, offset, v, kRecreate);
    DS_CHECK(v >= previous, "{}: document index {} (byte offset {}) is {}, less than the one before it ({}); document "
             "indices must not decrease: the .idx is corrupt: {}", idx, j, offset, v, previous, kRecreate);
    DS_CHECK(v <= num_sequences_, "{}: document index {} (byte offset {}) is {}, past the {} sequences; the .idx is "
             "corrupt: {}", idx, j, offset, v, num_sequences_, kRecreate);
    previous = v;
  }
  DS_CHECK(previous == num_sequences_,
           "{}: the last document index (byte offset {}) is {}, but it must be the sequence count {}: the .idx is "
           "corrupt: {}",
           idx, doc_indices_offset_ + 8 * (num_doc_indices_ - 1), previous, num_sequences_, kRecreate);
}

int64_t IndexedDataset::sequence_length(int64_t sequence) const {
  DS_CHECK(sequence >= 0 && sequence < num_sequences_, "sequence {} is outside Megatron dataset {} ({} sequences)",
           sequence, prefix_, num_sequences_);
  return load_length(sequence);
}

int64_t IndexedDataset::sequence_pointer(int64_t sequence) const {
  DS_CHECK(sequence >= 0 && sequence < num_sequences_, "sequence {} is outside Megatron dataset {} ({} sequences)",
           sequence, prefix_, num_sequences_);
  return load_pointer(sequence);
}

std::pair<int64_t, int64_t> IndexedDataset::document_sequences(int64_t document) const {
  DS_CHECK(document >= 0 && document < num_documents(), "document {} is outside Megatron dataset {} ({} documents)",
           document, prefix_, num_documents());
  return {load_doc_index(document), load_doc_index(document + 1)};
}

std::pair<int64_t, int64_t> IndexedDataset::document_tokens(int64_t document) const {
  const auto [first, last] = document_sequences(document);
  // Sequences tile the .bin (checked on open), so a sequence's first token is pointer / itemsize.
  const auto token_of = [&](int64_t s) { return s < num_sequences_ ? load_pointer(s) / itemsize_ : num_tokens_; };
  return {token_of(first), token_of(last)};
}

void IndexedDataset::read(int64_t sequence, int64_t offset, int64_t count, int32_t* out) const {
  const int64_t length = sequence_length(sequence);
  DS_CHECK(offset >= 0 && count >= 0 && offset <= length && count <= length - offset,
           "tokens [{}, {}) are outside sequence {} of Megatron dataset {} ({} tokens)", offset, offset + count,
           sequence, prefix_, length);
  read_flat(load_pointer(sequence) / itemsize_ + offset, count, out);
}

void IndexedDataset::read_flat(int64_t first, int64_t count, int32_t* out) const {
  DS_CHECK(first >= 0 && count >= 0 && first <= num_tokens_ && count <= num_tokens_ - first,
           "tokens [{}, {}) are outside Megatron dataset {} ({} tokens)", first, first + count, prefix_, num_tokens_);
  if (count == 0) return;
  const unsigned char* p = bin_ + first * itemsize_;
  // Widths that can hold ids outside [0, 2^31) collect a flag; the slow path finds the culprit.
  bool bad = false;
  switch (dtype_) {
    case IndexedDtype::kUint8:
      for (int64_t j = 0; j < count; ++j) out[j] = int32_t(p[j]);
      break;
    case IndexedDtype::kUint16:
      for (int64_t j = 0; j < count; ++j) out[j] = int32_t(load<uint16_t>(p + 2 * j));
      break;
    case IndexedDtype::kInt16:
      for (int64_t j = 0; j < count; ++j) {
        out[j] = int32_t(load<int16_t>(p + 2 * j));
        bad |= out[j] < 0;
      }
      break;
    case IndexedDtype::kInt32:
      for (int64_t j = 0; j < count; ++j) {
        out[j] = load<int32_t>(p + 4 * j);
        bad |= out[j] < 0;
      }
      break;
    case IndexedDtype::kInt64:
      for (int64_t j = 0; j < count; ++j) {
        const int64_t v = load<int64_t>(p + 8 * j);
        bad |= v < 0 || v > std::numeric_limits<int32_t>::max();
        out[j] = int32_t(v);
      }
      break;
    default:
      DS_FAIL("Megatron dataset {} has dtype {}, which cannot hold token ids", prefix_,
              indexed_dtype_name(uint8_t(dtype_)));
  }
  if (bad) [[unlikely]] {
    for (int64_t j = 0; j < count; ++j) {
      const unsigned char* q = p + j * itemsize_;
      const int64_t v = dtype_ == IndexedDtype::kInt16   ? load<int16_t>(q)
                        : dtype_ == IndexedDtype::kInt32 ? load<int32_t>(q)
                                                         : load<int64_t>(q);
      DS_CHECK(v >= 0 && v <= std::numeric_limits<int32_t>::max(),
               "{}: token {} (byte offset {}) is {}, which is not a token id (ids are in [0, 2^31)); the .bin is "
               "corrupt or does not hold token ids: {}",
               bin_path_, first + j, (first + j) * itemsize_, v, kRecreate);
    }
  }
}

}  // namespace dstrain
