// llm.c token shards: a 1024-byte header of 256 little-endian int32 (magic, version, token
// count, unused) followed by the tokens, read in place through a read-only mmap.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain {

// The two layouts llm.c writes; the magic fixes the version and the token width.
inline constexpr int32_t kShardMagicU16 = 20240520;  // version 1, uint16 tokens (GPT-2 sized vocabularies)
inline constexpr int32_t kShardMagicU32 = 20240801;  // version 7, uint32 tokens (e.g. Llama 3, DeepSeek)
inline constexpr int kShardHeaderInts = 256;
inline constexpr int64_t kShardHeaderBytes = kShardHeaderInts * 4;

class TokenShard {
 public:
  // Opens and validates the header against the file size; errors name the file, the byte
  // offset at fault and what to do.
  explicit TokenShard(const std::string& path);
  TokenShard(TokenShard&& other) noexcept;
  TokenShard& operator=(TokenShard&& other) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::string& path() const { return path_; }
  int64_t size() const { return size_; }  // tokens
  int version() const { return version_; }
  int bytes_per_token() const { return bytes_per_token_; }

  // Token i, bounds-checked.
  uint32_t at(int64_t i) const;
  // Tokens [begin, begin + count) widened to int32 into out (count). Bounds-checked; a uint32
  // token of 2^31 or more cannot be an int32 id and is an error naming its offset.
  void read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  void unmap() noexcept;

  std::string path_;
  const unsigned char* map_ = nullptr;  // the whole file, header included
  size_t map_bytes_ = 0;
  int64_t size_ = 0;
  int version_ = 0;
  int bytes_per_token_ = 0;
};

// Writes tokens as an llm.c shard: version 1 (uint16; every token must be <= 65535) or 7
// (uint32). Writes path + ".tmp" and renames it, so a reader never sees a half-written shard.
void write_token_shard(const std::string& path, const std::vector<uint32_t>& tokens, int version);

}  // namespace dstrain
