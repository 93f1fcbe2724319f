// The byte tokenizer and the factory that picks a tokenizer by name.
#include "data/tokenizer.h"

#include <filesystem>

#include "core/error.h"
#include "data/hf_tokenizer.h"

namespace dstrain {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = int32_t(static_cast<unsigned char>(text[i]));
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id >= 0 && id < 256) {
      text.push_back(char(static_cast<unsigned char>(id)));
    } else if (id == kBos) {
      text += kBosText;
    } else if (id == kEos) {
      text += kEosText;
    } else {
      DS_FAIL("token id {} at position {} is outside the byte tokenizer's vocabulary [0, {}); the ids were made "
              "by another tokenizer, decode them with that one",
              id, i, kVocabSize);
    }
  }
  return text;
}

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& spec) {
  if (spec == "byte") return std::make_unique<ByteTokenizer>();
  // Anything else names a Hugging Face tokenizer.json, or a model directory holding one.
  std::error_code ec;
  if (std::filesystem::exists(spec, ec)) return load_hf_tokenizer(spec);
  DS_FAIL("unknown tokenizer \"{}\": no such file or directory. --tokenizer takes only \"byte\" (UTF-8 bytes as "
          "ids) or the path to a Hugging Face tokenizer.json, or to a directory holding one (a downloaded DeepSeek "
          "model directory); check the path",
          spec);
}

}  // namespace dstrain
