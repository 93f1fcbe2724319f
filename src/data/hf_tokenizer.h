// A Hugging Face tokenizer.json byte-level BPE tokenizer (as DeepSeek ships it) behind dstrain's
// Tokenizer interface, producing the ids the `tokenizers` library produces for the same file.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace dstrain {

// Supported components: model BPE (no byte fallback, no dropout, no subword prefix/suffix);
// normalizer null or an empty Sequence; pre_tokenizer null, Split, ByteLevel, Digits or a
// Sequence of them; decoder null or ByteLevel; added_tokens; post_processor recorded but never
// applied (dstrain-prep writes its own document separators). Anything else fails at load with
// the file and the JSON key named.
//
// Split regexes run on PCRE2 (UTF-8, Unicode properties, JIT); the library uses Oniguruma with
// Ruby syntax, so patterns are compiled with the Oniguruma meanings where the two differ: ^ and $
// match at line breaks, \uHHHH is a code point. Text that is not valid UTF-8 is encoded byte by
// byte where the library could not take it at all: regexes never match across invalid bytes and
// ByteLevel maps them like any other byte, so decode(encode(text)) == text for any bytes.
//
// encode() and decode() may run on many threads at once on one tokenizer; the setters may not.
class HFTokenizer final : public Tokenizer {
 public:
  ~HFTokenizer() override;
  HFTokenizer(const HFTokenizer&) = delete;
  HFTokenizer& operator=(const HFTokenizer&) = delete;

  // The ids of the library's encode(text, add_special_tokens=False) with its
  // encode_special_tokens flag set: non-special added tokens in the text become their ids,
  // special ones are encoded as plain text (the Tokenizer contract: no forged document
  // boundaries). set_encode_special_tokens(false) gives the library's default instead.
  std::vector<int32_t> encode(std::string_view text) const override;
  // Token strings concatenated, the ByteLevel byte mapping undone. Unlike the library, bytes
  // that are not valid UTF-8 are returned as they are, not replaced by U+FFFD.
  std::string decode(const std::vector<int32_t>& ids) const override;
  // Largest id over model.vocab and added_tokens, plus one.
  int64_t vocab_size() const override;
  // The special added tokens named like a document start / end ("<｜begin▁of▁sentence｜>",
  // "<s>", "<|begin_of_text|>" / "<｜end▁of▁sentence｜>", "</s>", "<|end_of_text|>",
  // "<|endoftext|>"), or what set_special_ids() chose. Throws when there is neither.
  int32_t bos_id() const override;
  int32_t eos_id() const override;
  std::string name() const override;  // "hf:" + the path it was loaded from

  // Overrides the bos/eos found by name; both must be ids of this vocabulary.
  void set_special_ids(int32_t bos, int32_t eos);
  // The library's `encode_special_tokens` flag. true (dstrain's default): special added tokens
  // inside the text are encoded as plain text. false (the library's default): they become their
  // ids, so text can hold an eos. Non-special added tokens match either way.
  void set_encode_special_tokens(bool as_text);

  std::optional<int32_t> token_to_id(std::string_view token) const;  // vocab or added token
  std::string id_to_token(int32_t id) const;                          // throws outside the vocabulary
  // The post_processor's "type" ("" when null): parsed, recorded, never applied.
  const std::string& post_processor_type() const;

  struct Impl;

 private:
  explicit HFTokenizer(std::unique_ptr<Impl> impl);
  friend std::unique_ptr<HFTokenizer> load_hf_tokenizer_from_json_text(std::string_view text, std::string source);
  std::unique_ptr<Impl> impl_;
};

// `path` is a tokenizer.json file or a directory holding one. Errors name the file and the key.
std::unique_ptr<HFTokenizer> load_hf_tokenizer(const std::string& path);
// The same from the text of a tokenizer.json; `source` names it in errors and in name().
std::unique_ptr<HFTokenizer> load_hf_tokenizer_from_json_text(std::string_view text, std::string source);

}  // namespace dstrain
