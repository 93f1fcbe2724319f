// safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the data
// region that the header's data_offsets point into. Reader (mmap, strict) and writer.
#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <unordered_set>

#include "core/json_reader.h"

namespace dstrain {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian and is read without byte swapping");

namespace {

// The limit Hugging Face's own reader applies: a larger header means a corrupt length.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
// Below this many elements a conversion is not worth starting threads for.
constexpr int64_t kParallelMin = int64_t(1) << 16;

std::string errno_text(int err) { return std::strerror(err); }

// Stored elements sit at any byte offset (the header length need not be a multiple of the
// element size), so each one is loaded with memcpy rather than through a typed pointer.
template <class Stored, class Convert>
void convert_to_f32(const std::byte* src, float* dst, int64_t n, Convert convert) {
#pragma omp parallel for schedule(static) if (n >= kParallelMin)
  for (int64_t i = 0; i < n; ++i) {
    Stored s;
    std::memcpy(&s, src + size_t(i) * sizeof(Stored), sizeof(Stored));
    dst[i] = convert(s);
  }
}

// A non-negative integer from the header; `what` says where it is, for the error.
int64_t header_int(const json& v, const std::string& where, const char* what) {
  DS_CHECK(v.is_number_integer(), "{}: {} is {} ({}), expected a non-negative integer", where, what, v.dump(),
           v.type_name());
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    DS_CHECK(u <= uint64_t(INT64_MAX), "{}: {} = {} is too large", where, what, u);
    return int64_t(u);
  }
  const int64_t i = v.get<int64_t>();
  DS_CHECK(i >= 0, "{}: {} is negative ({})", where, what, i);
  return i;
}

SafeTensorInfo parse_entry(const std::string& file, const std::string& name, const json& e, int64_t data_bytes) {
  const std::string where = fmt::format("safetensors file '{}', tensor '{}'", file, name);
  DS_CHECK(e.is_object(), "{}: the header entry is {} ({}), expected an object with dtype, shape and data_offsets",
           where, e.dump(), e.type_name());
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    DS_CHECK(e.contains(key), "{}: the header entry has no \"{}\" (it has {}); the file is corrupt or was written "
             "by a tool that does not follow the safetensors format", where, key, e.dump());
  }
  SafeTensorInfo t;
  t.name = name;

  const json& dt = e["dtype"];
  DS_CHECK(dt.is_string(), "{}: dtype is {}, expected a string such as \"BF16\"", where, dt.dump());
  const std::string dname = dt.get<std::string>();
  DS_CHECK(!dname.starts_with("F8_") || dname == "F8_E4M3",
           "{}: dtype \"{}\" is an FP8 format dstrain does not read; it reads F8_E4M3 (DeepSeek-V3's released "
           "weights, with their weight_scale_inv block scales); convert the checkpoint to BF16 or F8_E4M3 first",
           where, dname);
  DS_CHECK(dtype_from_name(dname, &t.dtype),
           "{}: unknown dtype \"{}\"; dstrain reads F32, BF16, F16, F64, F8_E4M3, I64, I32, U32, U16 and U8", where,
           dname);

  const json& shape = e["shape"];
  DS_CHECK(shape.is_array(), "{}: shape is {}, expected an array of dimensions", where, shape.dump());
  DS_CHECK(shape.size() <= size_t(Shape::kMaxDims), "{}: shape {} has {} dimensions; dstrain supports at most {}",
           where, shape.dump(), shape.size(), Shape::kMaxDims);
  for (size_t d = 0; d < shape.size(); ++d) {
    t.shape.push_back(header_int(shape[d], where, fmt::format("shape[{}] of {}", d, shape.dump()).c_str()));
  }

  const json& off = e["data_offsets"];
  DS_CHECK(off.is_array() && off.size() == 2, "{}: data_offsets is {}, expected [begin, end]", where, off.dump());
  t.begin = header_int(off[0], where, "data_offsets[0]");
  t.end = header_int(off[1], where, "data_offsets[1]");
  DS_CHECK(t.begin <= t.end, "{}: data_offsets [{}, {}] end before they begin", where, t.begin, t.end);
  DS_CHECK(t.end <= data_bytes,
           "{}: data_offsets [{}, {}] lie outside the data region of {} bytes; the file is truncated or corrupt",
           where, t.begin, t.end, data_bytes);

  // Overflow-checked, so an absurd shape is reported as a size mismatch, not wrapped around.
  int64_t bytes = int64_t(dtype_size(t.dtype));
  bool overflow = false;
  for (int d = 0; d < t.shape.ndim(); ++d) overflow |= __builtin_mul_overflow(bytes, t.shape[d], &bytes);
  DS_CHECK(!overflow && bytes == t.nbytes(),
           "{}: shape {} of {} needs {} bytes but data_offsets [{}, {}] hold {} bytes; the header is inconsistent",
           where, t.shape.str(), dtype_name(t.dtype), overflow ? std::string("too many") : std::to_string(bytes),
           t.begin, t.end, t.nbytes());
  return t;
}

// An output file under path + ".tmp" that becomes `path` only on commit(); any earlier
// exit removes it. Every write is checked: a full disk must not pass for a saved file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)), tmp_(path_ + ".tmp") {
    fd_ = ::open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    DS_CHECK(fd_ >= 0, "cannot create '{}': {}; check that the directory exists, is writable and has space", tmp_,
             errno_text(errno));
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(tmp_.c_str());
  }

  void write(const void* data, size_t bytes) {
    const auto* p = static_cast<const char*>(data);
    while (bytes > 0) {
      // Linux writes at most ~2 GiB per call; larger tensors go in pieces.
      const ssize_t n = ::write(fd_, p, std::min(bytes, size_t(1) << 30));
      if (n < 0 && errno == EINTR) continue;
      DS_CHECK(n > 0, "writing '{}' failed after {} bytes: {}; check free disk space and quotas", tmp_, written_,
               n < 0 ? errno_text(errno) : std::string("no progress"));
      p += n;
      bytes -= size_t(n);
      written_ += int64_t(n);
    }
  }

  void commit() {
    DS_CHECK(::fsync(fd_) == 0, "syncing '{}' failed: {}; the disk may be full", tmp_, errno_text(errno));
    const int rc = ::close(fd_);
    fd_ = -1;
    DS_CHECK(rc == 0, "closing '{}' failed: {}; the disk may be full", tmp_, errno_text(errno));
    DS_CHECK(::rename(tmp_.c_str(), path_.c_str()) == 0, "renaming '{}' to '{}' failed: {}", tmp_, path_,
             errno_text(errno));
    committed_ = true;
  }

 private:
  std::string path_, tmp_;
  int fd_ = -1;
  int64_t written_ = 0;
  bool committed_ = false;
};

}  // namespace

SafeTensorsFile::SafeTensorsFile(std::string path) : path_(std::move(path)) {
  const int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open safetensors file '{}': {}", path_, errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    DS_FAIL("cannot stat safetensors file '{}': {}", path_, errno_text(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    DS_FAIL("'{}' is not a regular file; expected a .safetensors file", path_);
  }
  const int64_t file_bytes = int64_t(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    DS_FAIL("safetensors file '{}' is {} bytes, shorter than its 8-byte header length; it is truncated or not a "
            "safetensors file", path_, file_bytes);
  }
  void* map = ::mmap(nullptr, size_t(file_bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file open
  DS_CHECK(map != MAP_FAILED, "cannot memory-map '{}' ({} bytes): {}", path_, file_bytes, errno_text(map_err));
  map_ = map;
  map_bytes_ = size_t(file_bytes);

  // The destructor does not run when a constructor throws: unmap here on a bad header.
  try {
    const auto* bytes = static_cast<const std::byte*>(map_);
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | uint64_t(bytes[i]);
    DS_CHECK(header_bytes <= kMaxHeaderBytes,
             "safetensors file '{}' declares a header of {} bytes, more than the 100 MB limit; the first 8 bytes "
             "are corrupt or this is not a safetensors file", path_, header_bytes);
    DS_CHECK(header_bytes <= uint64_t(file_bytes - 8),
             "safetensors file '{}' declares a header of {} bytes but only {} bytes follow the length; the file is "
             "truncated or not a safetensors file", path_, header_bytes, file_bytes - 8);
    data_ = bytes + 8 + header_bytes;
    parse_header(std::string_view(reinterpret_cast<const char*>(bytes + 8), size_t(header_bytes)),
                 file_bytes - 8 - int64_t(header_bytes));
  } catch (...) {
    ::munmap(map_, map_bytes_);
    throw;
  }
}

SafeTensorsFile::~SafeTensorsFile() {
  if (map_) ::munmap(map_, map_bytes_);
}

void SafeTensorsFile::parse_header(std::string_view header, int64_t data_bytes) {
  const json h = parse_json(header, fmt::format("safetensors file '{}' (its {}-byte header)", path_, header.size()),
                            kSafetensorsHeaderJson);
  DS_CHECK(h.is_object(), "safetensors file '{}': the header is {}, expected a JSON object", path_, h.type_name());

  for (const auto& [key, value] : h.items()) {
    if (key == "__metadata__") {
      DS_CHECK(value.is_object(), "safetensors file '{}': __metadata__ is {}, expected an object of strings", path_,
               value.type_name());
      for (const auto& [mk, mv] : value.items()) {
        DS_CHECK(mv.is_string(), "safetensors file '{}': __metadata__ \"{}\" is {}, expected a string", path_, mk,
                 mv.dump());
        metadata_[mk] = mv.get<std::string>();
      }
      continue;
    }
    tensors_.push_back(parse_entry(path_, key, value, data_bytes));
  }

  std::sort(tensors_.begin(), tensors_.end(), [](const SafeTensorInfo& a, const SafeTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  // Empty tensors occupy no bytes and cannot overlap anything.
  const SafeTensorInfo* prev = nullptr;
  for (const SafeTensorInfo& t : tensors_) {
    if (t.nbytes() == 0) continue;
    DS_CHECK(!prev || t.begin >= prev->end,
             "safetensors file '{}': tensor '{}' (bytes [{}, {})) overlaps tensor '{}' (bytes [{}, {})); the file is "
             "corrupt", path_, t.name, t.begin, t.end, prev->name, prev->begin, prev->end);
    prev = &t;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const SafeTensorInfo& SafeTensorsFile::info(const std::string& name) const {
  auto it = index_.find(name);
  DS_CHECK(it != index_.end(), "tensor '{}' is not in safetensors file '{}' ({} tensors)", name, path_,
           tensors_.size());
  return tensors_[it->second];
}

std::span<const std::byte> SafeTensorsFile::raw(const std::string& name) const {
  const SafeTensorInfo& t = info(name);
  return {data_ + t.begin, size_t(t.nbytes())};
}

void SafeTensorsFile::release(const std::string& name) const {
  const SafeTensorInfo& t = info(name);
  if (t.nbytes() == 0) return;
  // Reading a page maps its neighbours too, as far as one page table reaches (the kernel's
  // fault-around: 64 KiB by default, 2 MiB at most), so the span released is the tensor's
  // rounded out to 2 MiB; a neighbour's pages released with it are mapped again when read.
  constexpr uintptr_t kSpan = uintptr_t(2) << 20;
  const auto map_begin = reinterpret_cast<uintptr_t>(map_), map_end = map_begin + map_bytes_;
  const uintptr_t b = std::max(map_begin, reinterpret_cast<uintptr_t>(data_ + t.begin) / kSpan * kSpan);
  const uintptr_t e = std::min(map_end, (reinterpret_cast<uintptr_t>(data_ + t.end) + kSpan - 1) / kSpan * kSpan);
  DS_CHECK(::madvise(reinterpret_cast<void*>(b), size_t(e - b), MADV_DONTNEED) == 0,
           "releasing the pages of '{}' in '{}' (madvise) failed: {}", name, path_, errno_text(errno));
}

void SafeTensorsFile::read_f32_range(const std::string& name, int64_t begin, int64_t n, float* dst) const {
  const SafeTensorInfo& t = info(name);
  DS_CHECK(begin >= 0 && n >= 0 && begin + n <= t.shape.numel(),
           "reading elements [{}, {}) of '{}' from '{}': it has {} elements", begin, begin + n, name, path_,
           t.shape.numel());
  if (n == 0) return;
  const std::byte* src = data_ + t.begin + begin * int64_t(dtype_size(t.dtype));
  switch (t.dtype) {
    case DType::F32: convert_to_f32<float>(src, dst, n, [](float v) { return v; }); return;
    case DType::BF16: convert_to_f32<uint16_t>(src, dst, n, [](uint16_t v) { return bf16_to_f32(v); }); return;
    case DType::F16: convert_to_f32<uint16_t>(src, dst, n, [](uint16_t v) { return f16_to_f32(v); }); return;
    case DType::F64: convert_to_f32<double>(src, dst, n, [](double v) { return float(v); }); return;
    // The stored FP8 values, unscaled: HFWeights applies a weight's block scales.
    case DType::F8_E4M3: convert_to_f32<uint8_t>(src, dst, n, [](uint8_t v) { return f8e4m3_to_f32(v); }); return;
    default:
      DS_FAIL("tensor '{}' in '{}' is stored as {}; only F32, BF16, F16, F64 and F8_E4M3 tensors can be read as fp32", name,
              path_, dtype_name(t.dtype));
  }
}

void SafeTensorsFile::read_f32(const std::string& name, Tensor out) const {
  const SafeTensorInfo& t = info(name);
  DS_CHECK(out.device().is_cpu(), "reading '{}' from '{}': the destination is on {}; read into host memory and copy",
           name, path_, out.device().str());
  DS_CHECK(out.dtype() == DType::F32, "reading '{}' from '{}': the destination holds {}, expected F32", name, path_,
           dtype_name(out.dtype()));
  DS_CHECK(out.numel() == t.shape.numel(),
           "reading '{}' from '{}': the file holds shape {} ({} elements) but the destination has shape {} ({} "
           "elements)", name, path_, t.shape.str(), t.shape.numel(), out.shape().str(), out.numel());
  read_f32_range(name, 0, out.numel(), static_cast<float*>(out.raw()));
}

SafeTensorsLayout::SafeTensorsLayout(std::string path, std::vector<SafeTensorInfo> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), tensors_(std::move(tensors)) {
  // ordered_json keeps the header in the order given, which is also the order of the data.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::unordered_set<std::string> seen;
  int64_t offset = 0;
  for (SafeTensorInfo& t : tensors_) {
    DS_CHECK(!t.name.empty() && t.name != "__metadata__", "writing '{}': '{}' cannot be a tensor name", path_, t.name);
    DS_CHECK(seen.insert(t.name).second, "writing '{}': tensor '{}' is given twice", path_, t.name);
    DS_CHECK(t.dtype == DType::F32 || t.dtype == DType::BF16 || t.dtype == DType::F16 || t.dtype == DType::F8_E4M3,
             "writing '{}': tensor '{}' is {}; only F32, BF16, F16 and F8_E4M3 tensors are written", path_, t.name,
             dtype_name(t.dtype));
    std::vector<int64_t> dims;
    for (int d = 0; d < t.shape.ndim(); ++d) dims.push_back(t.shape[d]);
    const int64_t bytes = t.shape.numel() * int64_t(dtype_size(t.dtype));
    t.begin = offset;
    t.end = offset + bytes;
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", dims}, {"data_offsets", {t.begin, t.end}}};
    offset += bytes;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    DS_FAIL("writing '{}': cannot encode the header ({}); tensor names and metadata must be UTF-8", path_, e.what());
  }
  // Hugging Face pads so that the data region starts 8-byte aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  prefix_.resize(8);
  for (int i = 0; i < 8; ++i) prefix_[size_t(i)] = static_cast<char>(uint64_t(text.size()) >> (8 * i));
  prefix_ += text;
}

int64_t SafeTensorsLayout::file_bytes() const {
  return int64_t(prefix_.size()) + (tensors_.empty() ? 0 : tensors_.back().end);
}

namespace {

// pwrite of all `bytes` at `offset`, in pieces of at most 1 GiB.
void write_all_at(int fd, const std::string& path, const char* p, size_t bytes, int64_t offset) {
  while (bytes > 0) {
    const ssize_t n = ::pwrite(fd, p, std::min(bytes, size_t(1) << 30), off_t(offset));
    if (n < 0 && errno == EINTR) continue;
    DS_CHECK(n > 0, "writing '{}' at byte {} failed: {}; check free disk space and quotas", path, offset,
             n < 0 ? errno_text(errno) : std::string("no progress"));
    p += n;
    bytes -= size_t(n);
    offset += n;
  }
}

}  // namespace

void SafeTensorsLayout::create() const {
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  DS_CHECK(fd >= 0, "cannot create '{}': {}; check that the directory exists, is writable and has space", tmp,
           errno_text(errno));
  try {
    write_all_at(fd, tmp, prefix_.data(), prefix_.size(), 0);
    // The data region at its full size (a hole until written), so that writers in any order
    // and any process find it there.
    DS_CHECK(::ftruncate(fd, off_t(file_bytes())) == 0, "sizing '{}' to {} bytes failed: {}", tmp, file_bytes(),
             errno_text(errno));
    DS_CHECK(::fsync(fd) == 0, "syncing '{}' failed: {}; the disk may be full", tmp, errno_text(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  DS_CHECK(::close(fd) == 0, "closing '{}' failed: {}", tmp, errno_text(errno));
}

void SafeTensorsLayout::write(size_t i, const Tensor& t) const {
  DS_CHECK(i < tensors_.size(), "writing '{}': tensor {} of {}", path_, i, tensors_.size());
  const SafeTensorInfo& info = tensors_[i];
  DS_CHECK(t.dtype() == info.dtype && int64_t(t.nbytes()) == info.nbytes() && t.device().is_cpu() &&
               (t.defined() || t.numel() == 0),
           "writing '{}': tensor '{}' must be {} bytes of {} in host memory, got {} bytes of {} on {}", path_, info.name,
           info.nbytes(), dtype_name(info.dtype), t.nbytes(), dtype_name(t.dtype()), t.device().str());
  write_runs(i, {PieceRun{0, 0, t.numel()}}, t.raw());
}

void SafeTensorsLayout::write_runs(size_t i, const std::vector<PieceRun>& runs, const void* data) const {
  DS_CHECK(i < tensors_.size(), "writing '{}': tensor {} of {}", path_, i, tensors_.size());
  const SafeTensorInfo& info = tensors_[i];
  const int64_t es = dtype_size(info.dtype), n = info.shape.numel();
  for (const PieceRun& r : runs) {
    DS_CHECK(r.global >= 0 && r.elems >= 0 && r.global + r.elems <= n,
             "writing '{}': elements [{}, {}) of tensor '{}', which has {}", path_, r.global, r.global + r.elems,
             info.name, n);
  }
  if (runs.empty()) return;
  const std::string tmp = path_ + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open '{}' to write tensor '{}': {}; the file must be visible to every writing rank (a "
           "shared filesystem)", tmp, info.name, errno_text(errno));
  try {
    for (const PieceRun& r : runs) {
      write_all_at(fd, tmp, static_cast<const char*>(data) + r.local * es, size_t(r.elems * es),
                   int64_t(prefix_.size()) + info.begin + r.global * es);
    }
    DS_CHECK(::fdatasync(fd) == 0, "syncing '{}' failed: {}; the disk may be full", tmp, errno_text(errno));
  } catch (...) {
    ::close(fd);
    throw;
  }
  DS_CHECK(::close(fd) == 0, "closing '{}' failed: {}", tmp, errno_text(errno));
}

void SafeTensorsLayout::commit() const {
  const std::string tmp = path_ + ".tmp";
  DS_CHECK(::rename(tmp.c_str(), path_.c_str()) == 0, "renaming '{}' to '{}' failed: {}", tmp, path_,
           errno_text(errno));
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafeTensorInfo> infos;
  for (const auto& [name, t] : tensors) {
    DS_CHECK(t.device().is_cpu(), "writing '{}': tensor '{}' is on {}; copy it to host memory first", path, name,
             t.device().str());
    DS_CHECK(t.defined() || t.numel() == 0, "writing '{}': tensor '{}' has no data", path, name);
    SafeTensorInfo info;
    info.name = name;
    info.dtype = t.dtype();
    info.shape = t.shape();
    infos.push_back(std::move(info));
  }
  const SafeTensorsLayout layout(path, std::move(infos), metadata);
  AtomicFile out(path);
  out.write(layout.prefix().data(), layout.prefix().size());
  for (const auto& [name, t] : tensors) out.write(t.raw(), t.nbytes());
  out.commit();
}

void write_text_file_atomically(const std::string& path, const std::string& text) {
  AtomicFile out(path);
  out.write(text.data(), text.size());
  out.commit();
}

}  // namespace dstrain
