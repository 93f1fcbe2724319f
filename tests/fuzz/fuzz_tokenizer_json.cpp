// libFuzzer target: arbitrary bytes as a tokenizer.json. Loading may fail only with
// dstrain::Error; a tokenizer that loads must encode and decode a fixed text without crashing.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "data/hf_tokenizer.h"

namespace {

// Text that reaches every stage: added-token candidates, letters, digits, punctuation,
// whitespace runs, multi-byte UTF-8 (é, CJK, emoji) and bytes that are not UTF-8 at all.
const std::string kText =
    "Hello, world! <｜end▁of▁sentence｜> <s>  12345 café 中文 😀\n\t\r\n  x'll <|x|>y \xff\xfe\xc3";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view json(reinterpret_cast<const char*>(data), size);
  std::unique_ptr<dstrain::HFTokenizer> tok;
  try {
    tok = dstrain::load_hf_tokenizer_from_json_text(json, "fuzz.json");
  } catch (const dstrain::Error&) {
    return 0;  // a clear refusal is the expected outcome for most inputs
  }
  for (bool as_text : {true, false}) {
    tok->set_encode_special_tokens(as_text);
    try {
      const std::vector<int32_t> ids = tok->encode(kText);
      const std::string back = tok->decode(ids);
      (void)back;
      (void)tok->vocab_size();
    } catch (const dstrain::Error&) {
      // e.g. a symbol missing from the vocabulary, or a pattern that exceeds PCRE2's limits
    }
  }
  try {
    (void)tok->eos_id();
    (void)tok->bos_id();
  } catch (const dstrain::Error&) {
  }
  return 0;
}
