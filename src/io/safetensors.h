// Reading and writing single safetensors files (Hugging Face's tensor container): strict
// validation of the header on open, conversion of F32/BF16/F16/F64 data to fp32 on read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "io/sharded_state.h"

namespace dstrain {

// One entry of a safetensors header.
struct SafeTensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  int64_t begin = 0, end = 0;  // byte range, relative to the start of the data region
  int64_t nbytes() const { return end - begin; }
};

// A safetensors file opened read-only and memory-mapped. The whole header is validated in
// the constructor, so later reads cannot run outside the file.
class SafeTensorsFile {
 public:
  explicit SafeTensorsFile(std::string path);
  ~SafeTensorsFile();
  SafeTensorsFile(const SafeTensorsFile&) = delete;
  SafeTensorsFile& operator=(const SafeTensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Every tensor, in the order of their data in the file.
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }
  bool has(const std::string& name) const { return index_.count(name) != 0; }
  const SafeTensorInfo& info(const std::string& name) const;  // error when absent
  // The optional "__metadata__" map of the header.
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads tensor `name` into `out` (host, F32, same element count; its shape may differ),
  // converting from the stored F32, BF16, F16, F64 or F8_E4M3 (its values unscaled).
  void read_f32(const std::string& name, Tensor out) const;
  // Elements [begin, begin + n) of tensor `name`, flattened in row-major order, converted to
  // fp32 into dst: only their bytes are read (a piece of a tensor, not the whole).
  void read_f32_range(const std::string& name, int64_t begin, int64_t n, float* dst) const;
  // The stored bytes of tensor `name`, unaligned, valid while this object lives.
  std::span<const std::byte> raw(const std::string& name) const;
  // Unmaps the pages of tensor `name` from this process: they stay in the page cache, and a
  // later read maps them again. A reader that releases each tensor once read keeps one
  // tensor's pages in its resident memory (what RSS, ru_maxrss and batch systems report), not
  // the file's.
  void release(const std::string& name) const;

 private:
  void parse_header(std::string_view header, int64_t data_bytes);

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  const std::byte* data_ = nullptr;  // start of the data region inside the mapping
  std::vector<SafeTensorInfo> tensors_;
  std::unordered_map<std::string, size_t> index_;  // name -> position in tensors_
  std::map<std::string, std::string> metadata_;
};

// A safetensors file written in place, by one process or several: the header (every tensor's
// name, dtype, shape and byte range, in the order of their data) is fixed before any data, so
// that each writer knows where its tensors' bytes go. The bytes are those write_safetensors
// writes. create() makes path + ".tmp" at its full size with the header; write() puts a
// tensor's bytes in place (pwrite, from any process that sees the file) and syncs them;
// commit() renames the file to `path` once every write is done.
class SafeTensorsLayout {
 public:
  // `tensors`: name, dtype (F32, BF16, F16 or F8_E4M3) and shape of each, in the order of their data
  // (their byte ranges are computed here).
  SafeTensorsLayout(std::string path, std::vector<SafeTensorInfo> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  const std::string& path() const { return path_; }
  const std::vector<SafeTensorInfo>& tensors() const { return tensors_; }
  // The length prefix and the padded JSON header: the file's bytes before the data.
  const std::string& prefix() const { return prefix_; }
  int64_t file_bytes() const;

  void create() const;
  // Tensor i's data (host, its dtype and element count).
  void write(size_t i, const Tensor& t) const;
  // Runs of tensor i's elements (io/sharded_state.h): run r's `elems` elements from element
  // `local` of `data` (host, the tensor's dtype) go to its element `global`.
  void write_runs(size_t i, const std::vector<PieceRun>& runs, const void* data) const;
  void commit() const;

 private:
  std::string path_, prefix_;
  std::vector<SafeTensorInfo> tensors_;
};

// Writes `tensors` (host; F32, BF16 or F16; each written in its own dtype) to `path`, data in
// the order given, header padded with spaces to a multiple of 8 bytes. The file is written
// to path + ".tmp", synced, then renamed: the final name only ever holds a complete file.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `text` to `path` the same way (".tmp", sync, rename), for the JSON files that sit
// beside the weights.
void write_text_file_atomically(const std::string& path, const std::string& text);

}  // namespace dstrain
