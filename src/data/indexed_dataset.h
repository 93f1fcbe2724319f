// Megatron-LM indexed datasets (MMIDIDX version 1): PREFIX.idx holds the sequence lengths,
// byte pointers and document boundaries, PREFIX.bin the tokens. Written atomically, read in place.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

namespace dstrain {

// Megatron's element type codes (megatron/core/datasets/indexed_dataset.py, DType).
enum class IndexedDtype : uint8_t {
  kUint8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUint16 = 8,
};

// .idx header: 9-byte magic, u64 version, u8 dtype, u64 sequence count S, u64 document-index
// count D; then, packed and unaligned, int32 lengths (S), int64 byte pointers (S), int64
// document indices (D).
inline constexpr char kIdxMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIdxVersion = 1;
inline constexpr int64_t kIdxVersionOffset = 9;
inline constexpr int64_t kIdxDtypeOffset = 17;
inline constexpr int64_t kIdxSequenceCountOffset = 18;
inline constexpr int64_t kIdxDocumentCountOffset = 26;
inline constexpr int64_t kIdxHeaderBytes = 34;

// Bytes per element, or 0 for a code Megatron does not define.
int indexed_dtype_size(uint8_t code);
// "uint16", "int32", ...; "unknown" for a code Megatron does not define.
const char* indexed_dtype_name(uint8_t code);
// uint16 when every id of a vocabulary of vocab_size fits with room to spare, else int32
// (Megatron's DType.optimal_dtype uses the same 65500 threshold).
IndexedDtype optimal_indexed_dtype(int64_t vocab_size);

std::string idx_path_of(const std::string& prefix);  // PREFIX.idx
std::string bin_path_of(const std::string& prefix);  // PREFIX.bin

// Writes one sequence per document, as Megatron's preprocess_data.py does by default. Tokens
// stream to PREFIX.bin.tmp; finalize() writes PREFIX.idx.tmp and renames both, so a reader
// never sees a half-written dataset. Without finalize() the .tmp files are removed.
class IndexedDatasetWriter {
 public:
  // dtype: kUint16 or kInt32 (what Megatron's preprocess writes for token ids).
  IndexedDatasetWriter(std::string prefix, IndexedDtype dtype);
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;
  ~IndexedDatasetWriter();

  // Appends one document (tokens). Every id must fit the dtype.
  void add_document(const std::vector<uint32_t>& tokens) { add_document(tokens.data(), tokens.size()); }
  void add_document(const uint32_t* tokens, size_t count);
  void finalize();

  const std::string& prefix() const { return prefix_; }
  IndexedDtype dtype() const { return dtype_; }
  int64_t num_documents() const { return int64_t(lengths_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void write_bin(const void* data, size_t bytes);
  void discard() noexcept;

  std::string prefix_;
  IndexedDtype dtype_;
  int itemsize_;
  std::FILE* bin_ = nullptr;      // PREFIX.bin.tmp while open
  std::vector<int32_t> lengths_;  // (documents) tokens per sequence
  std::vector<unsigned char> staging_;
  int64_t num_tokens_ = 0;
  bool finalized_ = false;
};

// A read-only view of PREFIX.idx and PREFIX.bin through mmap. Opening validates every
// array, so afterwards the .bin is known to be exactly the concatenation of the sequences
// (pointer[0] == 0, no gaps, no trailing bytes): token k of the .bin as one flat array is at
// byte offset k * itemsize. Const methods are safe to call from several threads.
class IndexedDataset {
 public:
  // Errors name the file, the byte offset at fault and what to do.
  explicit IndexedDataset(const std::string& prefix);
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  const std::string& idx_path() const { return idx_path_; }
  const std::string& bin_path() const { return bin_path_; }
  IndexedDtype dtype() const { return dtype_; }
  int itemsize() const { return itemsize_; }

  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_doc_indices_ - 1; }
  int64_t num_tokens() const { return num_tokens_; }  // all sequences

  int64_t sequence_length(int64_t sequence) const;   // tokens
  int64_t sequence_pointer(int64_t sequence) const;  // byte offset in the .bin
  // Sequences [first, last) of a document.
  std::pair<int64_t, int64_t> document_sequences(int64_t document) const;
  // Tokens [first, last) of a document in the flat token array.
  std::pair<int64_t, int64_t> document_tokens(int64_t document) const;

  // Tokens [offset, offset + count) of one sequence into out (count), as int32 ids.
  // Bounds-checked; a stored value that is negative or does not fit int32 is an error
  // naming the .bin and the byte offset.
  void read(int64_t sequence, int64_t offset, int64_t count, int32_t* out) const;
  // Tokens [first, first + count) of the flat token array into out (count); same checks.
  void read_flat(int64_t first, int64_t count, int32_t* out) const;

 private:
  int64_t load_length(int64_t i) const;
  int64_t load_pointer(int64_t i) const;
  int64_t load_doc_index(int64_t i) const;
  void validate();
  void unmap() noexcept;

  std::string prefix_, idx_path_, bin_path_;
  const unsigned char* idx_ = nullptr;  // the whole .idx
  size_t idx_bytes_ = 0;
  const unsigned char* bin_ = nullptr;  // the whole .bin (null when it is empty)
  size_t bin_bytes_ = 0;
  IndexedDtype dtype_ = IndexedDtype::kUint16;
  int itemsize_ = 0;
  int64_t num_sequences_ = 0;    // S
  int64_t num_doc_indices_ = 0;  // D = documents + 1
  int64_t num_tokens_ = 0;
  int64_t lengths_offset_ = 0, pointers_offset_ = 0, doc_indices_offset_ = 0;  // byte offsets in the .idx
};

}  // namespace dstrain
