// Tokenizers behind one interface: text <-> token ids. make_tokenizer gives the byte tokenizer
// ("byte") or a Hugging Face byte-level BPE tokenizer.json (data/hf_tokenizer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Special-token strings inside text are encoded as plain text, never as special ids, so
  // a document cannot forge a document boundary.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Special ids render as their strings; an id outside [0, vocab_size()) is an error.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual std::string name() const = 0;
};

// Ids 0..255 are the raw bytes of the UTF-8 text; 256 and 257 are the document markers.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int64_t kVocabSize = 258;
  static constexpr std::string_view kBosText = "<|begin_of_text|>";
  static constexpr std::string_view kEosText = "<|end_of_text|>";

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return kVocabSize; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  std::string name() const override { return "byte"; }
};

// "byte" gives a ByteTokenizer; any other spec is an error listing what this build has.
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec);

}  // namespace dstrain
