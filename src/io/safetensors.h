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
  // converting from the stored F32, BF16, F16 or F64.
  void read_f32(const std::string& name, Tensor out) const;
  // The stored bytes of tensor `name`, unaligned, valid while this object lives.
  std::span<const std::byte> raw(const std::string& name) const;

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

// Writes `tensors` (host; F32, BF16 or F16; each written in its own dtype) to `path`, data in
// the order given, header padded with spaces to a multiple of 8 bytes. The file is written
// to path + ".tmp", synced, then renamed: the final name only ever holds a complete file.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `text` to `path` the same way (".tmp", sync, rename), for the JSON files that sit
// beside the weights.
void write_text_file_atomically(const std::string& path, const std::string& text);

}  // namespace dstrain
