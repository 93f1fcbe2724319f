// llm.c token shards: validation on open, bounds-checked reads from the mapping, and an
// atomic (write to .tmp, then rename) writer.
#include "data/token_shard.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <utility>

#include "core/error.h"

namespace dstrain {

// Tokens are copied straight out of the mapping; llm.c writes them little-endian.
static_assert(std::endian::native == std::endian::little, "token shards are read in place and assume a little-endian host");

namespace {

constexpr const char* kRecreate = "re-create it with dstrain-prep";

int32_t header_int(const unsigned char* p, int index) {
  int32_t v;
  std::memcpy(&v, p + 4 * index, 4);
  return v;
}

int bytes_per_token_of(int version) { return version == 1 ? 2 : 4; }

}  // namespace

TokenShard::TokenShard(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  DS_CHECK(fd >= 0, "cannot open token shard {}: {}; check the path (shards are written by dstrain-prep)", path,
           std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    DS_FAIL("cannot stat token shard {}: {}", path, std::strerror(err));
  }
  if (S_ISDIR(st.st_mode)) {
    ::close(fd);
    DS_FAIL("token shard {} is a directory; pass the shard files inside it (a glob such as {}/*_train_*.bin works)",
            path, path);
  }
  const int64_t file_bytes = int64_t(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    DS_FAIL("token shard {} is {} bytes, too short for the {}-byte llm.c header (it ends at byte offset {}); "
            "the file is truncated or not a token shard: {}",
            path, file_bytes, kShardHeaderBytes, file_bytes, kRecreate);
  }
  void* map = ::mmap(nullptr, size_t(file_bytes), PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  DS_CHECK(map != MAP_FAILED, "cannot mmap token shard {} ({} bytes): {}", path, file_bytes, std::strerror(map_err));
  map_ = static_cast<const unsigned char*>(map);
  map_bytes_ = size_t(file_bytes);

  // From here on a failed check must unmap; the destructor does not run for a throwing constructor.
  try {
    const int32_t magic = header_int(map_, 0);
    const int32_t version = header_int(map_, 1);
    const int32_t count = header_int(map_, 2);
    if (magic == kShardMagicU16) {
      DS_CHECK(version == 1,
               "token shard {}: byte offset 4 holds version {}, but magic {} (uint16 tokens) requires version 1; "
               "the header is corrupt: {}",
               path, version, magic, kRecreate);
    } else if (magic == kShardMagicU32) {
      DS_CHECK(version == 7,
               "token shard {}: byte offset 4 holds version {}, but magic {} (uint32 tokens) requires version 7; "
               "the header is corrupt: {}",
               path, version, magic, kRecreate);
    } else {
      DS_FAIL("token shard {}: byte offset 0 holds magic {}, expected {} (llm.c, uint16 tokens) or {} "
              "(llm.c, uint32 tokens); this is not an llm.c token shard: {}",
              path, magic, kShardMagicU16, kShardMagicU32, kRecreate);
    }
    version_ = version;
    bytes_per_token_ = bytes_per_token_of(version);
    DS_CHECK(count >= 0, "token shard {}: byte offset 8 holds a negative token count {}; the header is corrupt: {}", path,
             count, kRecreate);
    const int64_t expected = kShardHeaderBytes + int64_t(count) * bytes_per_token_;
    if (file_bytes < expected) {
      DS_FAIL("token shard {} is truncated: its header (byte offset 8) promises {} tokens of {} bytes, which end at "
              "byte offset {}, but the file ends at byte offset {} ({} whole tokens present); {}",
              path, count, bytes_per_token_, expected, file_bytes, (file_bytes - kShardHeaderBytes) / bytes_per_token_,
              kRecreate);
    }
    if (file_bytes > expected) {
      DS_FAIL("token shard {} has {} trailing bytes: its header (byte offset 8) promises {} tokens of {} bytes, "
              "which end at byte offset {}, but the file is {} bytes; it was appended to or its header is stale: {}",
              path, file_bytes - expected, count, bytes_per_token_, expected, file_bytes, kRecreate);
    }
    size_ = count;
  } catch (...) {
    unmap();
    throw;
  }
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      size_(std::exchange(other.size_, 0)),
      version_(other.version_),
      bytes_per_token_(other.bytes_per_token_) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    unmap();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    size_ = std::exchange(other.size_, 0);
    version_ = other.version_;
    bytes_per_token_ = other.bytes_per_token_;
  }
  return *this;
}

TokenShard::~TokenShard() { unmap(); }

void TokenShard::unmap() noexcept {
  if (map_) ::munmap(const_cast<unsigned char*>(map_), map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

uint32_t TokenShard::at(int64_t i) const {
  DS_CHECK(i >= 0 && i < size_, "token index {} is outside token shard {} ({} tokens)", i, path_, size_);
  const unsigned char* p = map_ + kShardHeaderBytes + i * bytes_per_token_;
  if (bytes_per_token_ == 2) {
    uint16_t v;
    std::memcpy(&v, p, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void TokenShard::read(int64_t begin, int64_t count, int32_t* out) const {
  DS_CHECK(begin >= 0 && count >= 0 && begin <= size_ && count <= size_ - begin,
           "token range [{}, {}) is outside token shard {} ({} tokens)", begin, begin + count, path_, size_);
  const unsigned char* p = map_ + kShardHeaderBytes + begin * bytes_per_token_;
  if (bytes_per_token_ == 2) {
    for (int64_t j = 0; j < count; ++j) {
      uint16_t v;
      std::memcpy(&v, p + 2 * j, 2);
      out[j] = int32_t(v);
    }
    return;
  }
  uint32_t high = 0;  // OR of all tokens: one branch for the whole range instead of one per token
  for (int64_t j = 0; j < count; ++j) {
    uint32_t v;
    std::memcpy(&v, p + 4 * j, 4);
    high |= v;
    out[j] = int32_t(v);
  }
  if (high > uint32_t(std::numeric_limits<int32_t>::max())) [[unlikely]] {
    for (int64_t j = 0; j < count; ++j) {
      DS_CHECK(out[j] >= 0,
               "token shard {}: token {} (byte offset {}) is {}, which no int32 token id can hold; "
               "the shard is corrupt or was not written for a language model: {}",
               path_, begin + j, kShardHeaderBytes + (begin + j) * 4, uint32_t(out[j]), kRecreate);
    }
  }
}

void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, int version) {
  DS_CHECK(version == 1 || version == 7,
           "cannot write token shard {} as version {}: use 1 (uint16 tokens, vocabularies up to 65536) or 7 "
           "(uint32 tokens)",
           path, version);
  DS_CHECK(tokens.size() <= size_t(std::numeric_limits<int32_t>::max()),
           "cannot write {} tokens to token shard {}: the llm.c header holds an int32 count; write fewer tokens "
           "per shard (dstrain-prep --shard-tokens)",
           tokens.size(), path);
  if (version == 1) {
    const auto big = std::find_if(tokens.begin(), tokens.end(), [](uint32_t t) { return t > 0xFFFFu; });
    DS_CHECK(big == tokens.end(),
             "cannot write token shard {} as version 1 (uint16 tokens): token {} is {} > 65535; use version 7 "
             "(uint32 tokens) for this vocabulary",
             path, big - tokens.begin(), big == tokens.end() ? 0u : *big);
  }

  std::vector<int32_t> header(kShardHeaderInts, 0);
  header[0] = version == 1 ? kShardMagicU16 : kShardMagicU32;
  header[1] = version;
  header[2] = int32_t(tokens.size());

  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  DS_CHECK(f != nullptr, "cannot create {}: {}; check that its directory exists and is writable", tmp,
           std::strerror(errno));
  auto fail = [&](const char* what) {
    const int err = errno;
    std::fclose(f);
    std::remove(tmp.c_str());
    DS_FAIL("{} token shard {} failed: {}; check free disk space and permissions", what, tmp, std::strerror(err));
  };
  if (std::fwrite(header.data(), 4, header.size(), f) != header.size()) fail("writing the header of");
  if (version == 7) {
    if (std::fwrite(tokens.data(), 4, tokens.size(), f) != tokens.size()) fail("writing the tokens of");
  } else {
    // Narrow through a bounded staging buffer rather than a second copy of the whole shard.
    std::vector<uint16_t> chunk;
    constexpr size_t kChunk = size_t(1) << 20;
    for (size_t begin = 0; begin < tokens.size(); begin += kChunk) {
      const size_t n = std::min(kChunk, tokens.size() - begin);
      chunk.assign(tokens.begin() + int64_t(begin), tokens.begin() + int64_t(begin + n));
      if (std::fwrite(chunk.data(), 2, n, f) != n) fail("writing the tokens of");
    }
  }
  if (std::fflush(f) != 0) fail("flushing");
  if (std::fclose(f) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    DS_FAIL("closing token shard {} failed: {}; check free disk space", tmp, std::strerror(err));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    DS_FAIL("cannot rename {} to {}: {}", tmp, path, std::strerror(err));
  }
}

}  // namespace dstrain
