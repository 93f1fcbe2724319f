// Unit tests of the Hugging Face tokenizer.json BPE tokenizer. Expected ids are derived by hand
// from tests/data/tokenizers/make_test_tokenizers.py (byte b has id b there) and the rules of
// the `tokenizers` library; validation/compare_tokenizers.py checks against the library itself.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"
#include "core/json_reader.h"
#include "data/hf_tokenizer.h"
#include "data/tokenizer.h"

namespace fs = std::filesystem;
using namespace dstrain;
using Ids = std::vector<int32_t>;

namespace {

const std::string kDataDir = std::string(DSTRAIN_SOURCE_DIR) + "/tests/data/tokenizers/";
const std::string kByteBpe = kDataDir + "byte_bpe.json";
const std::string kDeepSeek = kDataDir + "deepseek_style.json";
const std::string kBos = "<｜begin▁of▁sentence｜>";
const std::string kEos = "<｜end▁of▁sentence｜>";

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a dstrain::Error";
  return {};
}

#define EXPECT_CONTAINS(haystack, needle)                      \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) \
      << "missing \"" << (needle) << "\" in: " << (haystack)

json read_json(const std::string& path) { return read_json_file(path); }

std::unique_ptr<HFTokenizer> load_json(const json& j, const std::string& source = "test.json") {
  return load_hf_tokenizer_from_json_text(j.dump(), source);
}

// A tokenizer whose vocabulary is every string of up to 4 characters over a small alphabet,
// with ignore_merges: each pre-tokenized piece of up to 4 characters becomes one token, so the
// token strings show exactly how the pre-tokenizer cut the text.
json piece_tokenizer(const json& pre_tokenizer) {
  const std::vector<std::string> alphabet = {"a", "b", "1", "2", "-", " ", "x", "٣"};
  json vocab = json::object();
  std::vector<std::string> level = {""};
  for (int len = 1; len <= 4; ++len) {
    std::vector<std::string> next;
    for (const std::string& prefix : level) {
      for (const std::string& c : alphabet) {
        next.push_back(prefix + c);
        vocab[prefix + c] = int(vocab.size());
      }
    }
    level = std::move(next);
  }
  return json{{"version", "1.0"},
              {"truncation", nullptr},
              {"padding", nullptr},
              {"added_tokens", json::array()},
              {"normalizer", nullptr},
              {"pre_tokenizer", pre_tokenizer},
              {"post_processor", nullptr},
              {"decoder", nullptr},
              {"model",
               {{"type", "BPE"}, {"ignore_merges", true}, {"vocab", vocab}, {"merges", json::array()}}}};
}

std::vector<std::string> pieces(const HFTokenizer& tok, std::string_view text) {
  std::vector<std::string> out;
  for (int32_t id : tok.encode(text)) out.push_back(tok.id_to_token(id));
  return out;
}

json split(const std::string& kind, const std::string& pattern, const std::string& behavior, bool invert = false) {
  return json{{"type", "Split"}, {"pattern", {{kind, pattern}}}, {"behavior", behavior}, {"invert", invert}};
}

// A minimal model over characters (no ByteLevel), for unk and error tests.
json char_model(const json& vocab, const json& merges = json::array()) {
  return json{{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}}}};
}

}  // namespace

// ---- added tokens -----------------------------------------------------------------------------

TEST(HFTokenizer, SpecialTokensAreMatchedBeforePreTokenizing) {
  // The library's default: special tokens in the text become their ids.
  const auto tok = load_hf_tokenizer(kByteBpe);
  tok->set_encode_special_tokens(false);
  // "the": t h e, merge "h e" -> 259.
  EXPECT_EQ(tok->encode(kBos + "the" + kEos), (Ids{267, 116, 259, 268}));
  EXPECT_EQ(tok->encode(kEos), (Ids{268}));
  EXPECT_EQ(tok->bos_id(), 267);
  EXPECT_EQ(tok->eos_id(), 268);
  EXPECT_EQ(tok->vocab_size(), 272);
  EXPECT_EQ(tok->name(), "hf:" + kByteBpe);
  EXPECT_EQ(tok->post_processor_type(), "TemplateProcessing");  // recorded, not applied
}

TEST(HFTokenizer, OverlappingAddedTokensTakeTheLongest) {
  const auto tok = load_hf_tokenizer(kByteBpe);
  tok->set_encode_special_tokens(false);
  EXPECT_EQ(tok->encode("<|x|>y"), (Ids{270}));
  EXPECT_EQ(tok->encode("<|x|>z"), (Ids{269, 122}));
  EXPECT_EQ(tok->encode("a<|x|>"), (Ids{97, 269}));
  EXPECT_EQ(tok->encode("<|x|><|x|>y"), (Ids{269, 270}));
}

TEST(HFTokenizer, AddedTokenInsideAWord) {
  const auto tok = load_hf_tokenizer(kByteBpe);
  // "zz" (271, normalized) splits the word; "fi" and "bu" stay bytes.
  EXPECT_EQ(tok->encode("fizzbuzz"), (Ids{102, 105, 271, 98, 117, 271}));
}

TEST(HFTokenizer, SpecialTokensAreTextByDefault) {
  // dstrain's Tokenizer contract (the library's encode_special_tokens): a document cannot
  // forge a document boundary.
  const auto tok = load_hf_tokenizer(kByteBpe);
  // <｜end▁of▁sentence｜> by the GPT-2 regex: "<", then ｜ (EF BD 9C) "end" ... as bytes.
  const Ids ids = tok->encode("a" + kEos + "b");
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 268), 0);
  EXPECT_EQ(tok->decode(ids), "a" + kEos + "b");
  EXPECT_EQ(tok->encode(kEos).front(), int32_t('<'));
  // The longest match "<|x|>y" is not special and still matches; a matched special token is
  // skipped whole: GPT-2 pieces "<|", "x", "|>", "z".
  EXPECT_EQ(tok->encode("<|x|>y"), (Ids{270}));
  EXPECT_EQ(tok->encode("<|x|>z"), (Ids{60, 124, 120, 124, 62, 122}));
  EXPECT_EQ(tok->encode("fizz"), (Ids{102, 105, 271}));  // non-special added tokens still match
}

TEST(HFTokenizer, AddedTokenStripAndSingleWord) {
  json j = read_json(kByteBpe);
  j["added_tokens"][2]["special"] = false;  // <|x|>: matched in the text
  // Without strip: "a", " " (GPT-2 \s+(?!\S)), <|x|>, " b".
  EXPECT_EQ(load_json(j)->encode("a <|x|> b"), (Ids{97, 32, 269, 32, 98}));
  j["added_tokens"][2]["lstrip"] = true;
  j["added_tokens"][2]["rstrip"] = true;
  EXPECT_EQ(load_json(j)->encode("a <|x|> b"), (Ids{97, 269, 98}));
  EXPECT_EQ(load_json(j)->encode("a \t<|x|>\n\n b"), (Ids{97, 269, 98}));
  j["added_tokens"][4]["single_word"] = true;
  const auto tok = load_json(j);
  EXPECT_EQ(tok->encode("fizzbuzz"), (Ids{102, 105, 122, 122, 98, 117, 122, 122}));  // inside a word: text
  EXPECT_EQ(tok->encode(" zz "), (Ids{32, 271, 32}));
  EXPECT_EQ(tok->encode("zz"), (Ids{271}));
  // Found by validation/compare_tokenizers.py: the character before the token is multi-byte
  // (é: C3 A9, 中: E4 B8 AD, ideographic space U+3000: E3 80 80).
  EXPECT_EQ(tok->encode("ézz"), (Ids{261, 122, 122}));  // é is "Ã ©", merged (rank 5)
  EXPECT_EQ(tok->encode("中zz"), (Ids{0xE4, 0xB8, 0xAD, 122, 122}));
  EXPECT_EQ(tok->encode("\u3000zz"), (Ids{0xE3, 0x80, 0x80, 271}));
  EXPECT_EQ(tok->encode("a\u3000<|x|>\u3000b"), (Ids{97, 269, 98}));  // lstrip/rstrip over U+3000
}

// ---- ByteLevel and BPE ------------------------------------------------------------------------

TEST(HFTokenizer, ByteLevelAlphabet) {
  const auto tok = load_hf_tokenizer(kByteBpe);
  // GPT-2's table: printable bytes are themselves, the rest are U+0100.. in byte order.
  EXPECT_EQ(tok->token_to_id("Ġ"), 32);   // U+0120: space, the 33rd unprintable byte
  EXPECT_EQ(tok->token_to_id("Ċ"), 10);   // U+010A
  EXPECT_EQ(tok->token_to_id("ĉ"), 9);    // U+0109
  EXPECT_EQ(tok->token_to_id("ġ"), 127);  // U+0121: DEL follows space
  EXPECT_EQ(tok->token_to_id("Ń"), 173);  // U+0143: soft hyphen, the last one
  EXPECT_EQ(tok->token_to_id("!"), 33);
  EXPECT_EQ(tok->token_to_id("ÿ"), 255);
  EXPECT_EQ(tok->encode("\n\t"), (Ids{10, 9}));  // one \s+ piece, no merges
  EXPECT_EQ(tok->encode(std::string("\x01\x7f", 2)), (Ids{1, 127}));
  EXPECT_EQ(tok->encode("中文"), (Ids{0xE4, 0xB8, 0xAD, 0xE6, 0x96, 0x87}));
  EXPECT_EQ(tok->encode("😀"), (Ids{0xF0, 0x9F, 0x98, 0x80}));
  // café: c a f Ã © -> "Ã ©" (rank 5) -> "c a" (6) -> "f Ã©" (7) -> "ca fÃ©" (8).
  EXPECT_EQ(tok->encode("café"), (Ids{264}));
  EXPECT_EQ(tok->encode("12"), (Ids{265}));
}

TEST(HFTokenizer, MergesGoByRankNotByPosition) {
  const auto tok = load_hf_tokenizer(kByteBpe);
  // "a b" is leftmost but rank 1; "b c" has rank 0 and wins: a + bc, never ab + c.
  EXPECT_EQ(tok->encode("abc"), (Ids{97, 256}));
  EXPECT_EQ(tok->encode("ab"), (Ids{257}));
  // " the": Ġt (2), he (3), Ġthe (4).
  EXPECT_EQ(tok->encode(" the"), (Ids{260}));
  EXPECT_EQ(tok->encode("the"), (Ids{116, 259}));
  // Equal ranks: leftmost first, so three spaces are ĠĠ + Ġ.
  EXPECT_EQ(tok->encode("a   "), (Ids{97, 266, 32}));
  // GPT-2 regex: "a", " " (\s+(?!\S)), " b".
  EXPECT_EQ(tok->encode("a  b"), (Ids{97, 32, 32, 98}));
  // A long piece (past the cache's limit): 1001 spaces -> 500 x ĠĠ + Ġ.
  Ids spaces(500, 266);
  spaces.push_back(32);
  EXPECT_EQ(tok->encode(std::string(1001, ' ')), spaces);
  EXPECT_EQ(tok->encode(std::string(1001, ' ')), spaces);  // second time from the same scratch
}

TEST(HFTokenizer, AddPrefixSpace) {
  json j = read_json(kByteBpe);
  j["pre_tokenizer"]["add_prefix_space"] = true;
  const auto tok = load_json(j);
  EXPECT_EQ(tok->encode("the"), (Ids{260}));
  EXPECT_EQ(tok->encode(" the"), (Ids{260}));
  // Each text piece between added tokens gets its own prefix space.
  tok->set_encode_special_tokens(false);
  EXPECT_EQ(tok->encode("a<|x|>the"), (Ids{32, 97, 269, 260}));
  EXPECT_EQ(tok->decode(tok->encode("the")), " the");  // the decoder keeps it, as in the library
}

// ---- DeepSeek-V3's pre-tokenizer --------------------------------------------------------------

TEST(HFTokenizer, DeepSeekSplitsAndStringMerges) {
  const auto tok = load_hf_tokenizer(kDeepSeek);
  EXPECT_EQ(tok->eos_id(), 270);
  EXPECT_EQ(tok->bos_id(), 269);
  // \p{N}{1,3}: "123" | "45"; 1 2 -> 12 -> 123.
  EXPECT_EQ(tok->encode("12345"), (Ids{260, 52, 53}));
  // "Hello" "," " world" "!": the merges "o ," and "d !" cross piece borders and never apply.
  EXPECT_EQ(tok->encode("Hello, world!"), (Ids{72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33}));
  EXPECT_EQ(tok->encode(" the"), (Ids{258}));
  EXPECT_EQ(tok->encode("café"), (Ids{99, 97, 102, 261}));
  // The CJK/kana split isolates 中 (E4 B8 AD), so "Ń a" cannot merge across it...
  EXPECT_EQ(tok->encode("中a"), (Ids{0xE4, 0xB8, 0xAD, 97}));
  // ...while a soft hyphen (\p{Cf}: not L, P or S) starts the letter piece: C2 AD a -> Â + Ńa.
  EXPECT_EQ(tok->encode("\u00ADa"), (Ids{0xC2, 264}));
  // \p{M}: e + U+0301 (CC 81) is one piece, so "e Ì" merges; "," is a \p{P} piece.
  EXPECT_EQ(tok->encode(" e\u0301,"), (Ids{32, 265, 0x81, 44}));
  // \p{S}: " €" (E2 82 AC) is one piece after \p{N} took "5": Ġ â merges.
  EXPECT_EQ(tok->encode("x €5"), (Ids{120, 266, 0x82, 0xAC, 53}));
  EXPECT_EQ(tok->encode("a\n\nb"), (Ids{97, 267, 98}));     // \s*[\r\n]+
  EXPECT_EQ(tok->encode("a   b"), (Ids{97, 268, 32, 98}));  // \s+(?!\S) leaves " b"
  EXPECT_EQ(tok->encode("don't"), (Ids{100, 111, 110, 39, 116}));  // punctuation + letters
  tok->set_encode_special_tokens(false);
  EXPECT_EQ(tok->encode(kBos + "12" + kEos), (Ids{269, 259, 270}));
}

TEST(HFTokenizer, BothMergeFormatsGiveTheSameTokenizer) {
  json pairs = read_json(kByteBpe);
  json strings = pairs;
  strings["model"]["merges"] = json::array({"#version: 0.2"});
  for (const json& m : pairs["model"]["merges"]) {
    strings["model"]["merges"].push_back(m[0].get<std::string>() + " " + m[1].get<std::string>());
  }
  const auto a = load_json(pairs), b = load_json(strings);
  for (const char* text : {"abc", " the café 12", "a   ", "fizzbuzz"}) {
    EXPECT_EQ(a->encode(text), b->encode(text)) << text;
  }
  EXPECT_EQ(b->encode("abc"), (Ids{97, 256}));
}

// ---- pre-tokenizer behaviours (pieces shown as tokens) --------------------------------------

TEST(HFTokenizer, SplitBehaviours) {
  using P = std::vector<std::string>;
  const auto cut = [](const std::string& behavior, bool invert = false) {
    return pieces(*load_json(piece_tokenizer(split("String", "-", behavior, invert))), "a-b--1");
  };
  EXPECT_EQ(cut("Isolated"), (P{"a", "-", "b", "-", "-", "1"}));
  EXPECT_EQ(cut("Removed"), (P{"a", "b", "1"}));
  EXPECT_EQ(cut("Removed", true), (P{"-", "-", "-"}));
  EXPECT_EQ(cut("MergedWithPrevious"), (P{"a-", "b-", "-", "1"}));
  EXPECT_EQ(cut("MergedWithNext"), (P{"a", "-b", "-", "-1"}));
  EXPECT_EQ(cut("Contiguous"), (P{"a", "-", "b", "--", "1"}));
  // A regex that matches empty: Oniguruma's iteration stops at every character.
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(split("Regex", "x*", "Isolated"))), "ab"), (P{"a", "b"}));
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(split("Regex", "b+", "Isolated"))), "abba1"), (P{"a", "bb", "a1"}));
}

TEST(HFTokenizer, DigitsAndSequences) {
  using P = std::vector<std::string>;
  const json individual = {{"type", "Digits"}, {"individual_digits", true}};
  const json runs = {{"type", "Digits"}, {"individual_digits", false}};
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(individual)), "ab12 1"), (P{"ab", "1", "2", " ", "1"}));
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(runs)), "ab12 1"), (P{"ab", "12", " ", "1"}));
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(individual)), "a٣2"), (P{"a", "٣", "2"}));  // \p{N}, not just 0-9
  const json seq = {{"type", "Sequence"},
                    {"pretokenizers", {split("Regex", "\\s+", "Removed"), runs, split("String", "-", "Isolated")}}};
  EXPECT_EQ(pieces(*load_json(piece_tokenizer(seq)), "ab-12  x-1"), (P{"ab", "-", "12", "x", "-", "1"}));
}

TEST(HFTokenizer, UnknownSymbols) {
  json j = char_model({{"a", 0}, {"b", 1}, {"[UNK]", 2}});
  j["model"]["unk_token"] = "[UNK]";
  EXPECT_EQ(load_json(j)->encode("axxb"), (Ids{0, 2, 2, 1}));
  j["model"]["fuse_unk"] = true;
  EXPECT_EQ(load_json(j)->encode("axxb"), (Ids{0, 2, 1}));
}

// ---- decoding ---------------------------------------------------------------------------------

TEST(HFTokenizer, DecodeUndoesTheByteMapping) {
  const auto tok = load_hf_tokenizer(kByteBpe);
  EXPECT_EQ(tok->decode({267, 116, 259, 268}), kBos + "the" + kEos);
  EXPECT_EQ(tok->decode({260, 10, 9, 264}), " the\n\tcafé");
  EXPECT_EQ(tok->decode({0xE4, 0xB8}), "\xE4\xB8");  // half a character: bytes as they are
  EXPECT_EQ(tok->id_to_token(266), "ĠĠ");
}

TEST(HFTokenizer, RoundTripsAnyText) {
  const auto byte_bpe = load_hf_tokenizer(kByteBpe);
  const auto deepseek = load_hf_tokenizer(kDeepSeek);
  std::mt19937 rng(1234);
  // Code points from the ranges text is made of: ASCII, Latin, combining marks, CJK, kana,
  // symbols, emoji, plus control characters and whitespace.
  const std::vector<std::pair<char32_t, char32_t>> ranges = {
      {0x00, 0x7F}, {0x80, 0x2FF}, {0x300, 0x36F}, {0x2000, 0x206F}, {0x3040, 0x30FF}, {0x4E00, 0x9FFF},
      {0x1F300, 0x1F6FF}, {0xAC00, 0xD7A3}, {0xE000, 0xF8FF}, {0x10000, 0x10FFFF}};
  const auto append_utf8 = [](std::string& s, char32_t c) {
    if (c < 0x80) {
      s += char(c);
    } else if (c < 0x800) {
      s += char(0xC0 | (c >> 6));
      s += char(0x80 | (c & 0x3F));
    } else if (c < 0x10000) {
      s += char(0xE0 | (c >> 12));
      s += char(0x80 | ((c >> 6) & 0x3F));
      s += char(0x80 | (c & 0x3F));
    } else {
      s += char(0xF0 | (c >> 18));
      s += char(0x80 | ((c >> 12) & 0x3F));
      s += char(0x80 | ((c >> 6) & 0x3F));
      s += char(0x80 | (c & 0x3F));
    }
  };
  for (int trial = 0; trial < 400; ++trial) {
    std::string text;
    const int n = int(rng() % 40);
    for (int i = 0; i < n; ++i) {
      const auto& [lo, hi] = ranges[rng() % ranges.size()];
      char32_t c = lo + char32_t(rng() % (hi - lo + 1));
      if (c >= 0xD800 && c <= 0xDFFF) c = 'x';  // no surrogates in UTF-8
      append_utf8(text, c);
      if (rng() % 5 == 0) text += (rng() % 2) ? " " : "\n";
      if (rng() % 50 == 0) text += kEos;
    }
    EXPECT_EQ(byte_bpe->decode(byte_bpe->encode(text)), text);
    EXPECT_EQ(deepseek->decode(deepseek->encode(text)), text);
  }
  // Bytes that are not UTF-8 at all: the library cannot take them; dstrain keeps every byte.
  for (int trial = 0; trial < 200; ++trial) {
    std::string bytes(rng() % 30, '\0');
    for (char& c : bytes) c = char(rng() % 256);
    EXPECT_EQ(byte_bpe->decode(byte_bpe->encode(bytes)), bytes);
    EXPECT_EQ(deepseek->decode(deepseek->encode(bytes)), bytes);
  }
  EXPECT_TRUE(byte_bpe->encode("").empty());
}

TEST(HFTokenizer, EncodesTheSameOnManyThreads) {
  const auto tok = load_hf_tokenizer(kDeepSeek);
  std::vector<std::string> docs;
  for (int i = 0; i < 200; ++i) {
    docs.push_back(fmt::format("Doc {} says: hello, world {}! café 中文 {}\n", i, i * 7, kEos));
  }
  std::vector<Ids> expected;
  for (const std::string& d : docs) expected.push_back(tok->encode(d));
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round) {
        for (size_t i = 0; i < docs.size(); ++i) {
          const size_t d = (i * 7 + size_t(t) * 13 + size_t(round)) % docs.size();
          if (tok->encode(docs[d]) != expected[d]) ++mismatches;
        }
      }
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// ---- loading and errors -----------------------------------------------------------------------

TEST(HFTokenizer, MakeTokenizerTakesAFileOrADirectory) {
  const std::unique_ptr<Tokenizer> by_file = make_tokenizer(kDeepSeek);
  EXPECT_EQ(by_file->name(), "hf:" + kDeepSeek);
  EXPECT_EQ(by_file->encode("12345"), (Ids{260, 52, 53}));

  const fs::path dir = fs::temp_directory_path() / fmt::format("dstrain_test_hf_{}", ::getpid());
  fs::create_directories(dir);
  fs::copy_file(kDeepSeek, dir / "tokenizer.json", fs::copy_options::overwrite_existing);
  const std::unique_ptr<Tokenizer> by_dir = make_tokenizer(dir.string());
  EXPECT_EQ(by_dir->eos_id(), 270);
  fs::remove(dir / "tokenizer.json");
  EXPECT_CONTAINS(error_of([&] { (void)make_tokenizer(dir.string()); }), "without a tokenizer.json");
  fs::remove_all(dir);

  EXPECT_EQ(make_tokenizer("byte")->name(), "byte");
  const std::string msg = error_of([] { (void)make_tokenizer("no/such/tokenizer.json"); });
  EXPECT_CONTAINS(msg, "\"byte\"");
  EXPECT_CONTAINS(msg, "tokenizer.json");
}

TEST(HFTokenizer, ErrorsNameTheFileAndTheKey) {
  const json good = read_json(kDeepSeek);
  const auto error_for = [](const json& j) { return error_of([&] { (void)load_json(j, "my/tokenizer.json"); }); };

  json j = good;
  j["pre_tokenizer"]["pretokenizers"][2] = {{"type", "Metaspace"}, {"replacement", "▁"}};
  std::string msg = error_for(j);
  EXPECT_CONTAINS(msg, "my/tokenizer.json");
  EXPECT_CONTAINS(msg, "pre_tokenizer.pretokenizers[2].type \"Metaspace\" is not supported");
  EXPECT_CONTAINS(msg, "Split, ByteLevel, Digits");

  j = good;
  j["model"].erase("vocab");
  EXPECT_CONTAINS(error_for(j), "model.vocab is required but missing");

  j = good;
  j["normalizer"] = {{"type", "NFKC"}};
  msg = error_for(j);
  EXPECT_CONTAINS(msg, "normalizer");
  EXPECT_CONTAINS(msg, "NFKC");

  j = good;
  j["model"]["type"] = "Unigram";
  EXPECT_CONTAINS(error_for(j), "model.type \"Unigram\" is not supported; supported: BPE");

  j = good;
  j["decoder"] = {{"type", "Metaspace"}};
  EXPECT_CONTAINS(error_for(j), "decoder.type \"Metaspace\" is not supported");

  j = good;
  j["model"]["byte_fallback"] = true;
  EXPECT_CONTAINS(error_for(j), "model.byte_fallback must be false");

  j = good;
  j["model"]["merges"][3] = "1 9";
  EXPECT_CONTAINS(error_for(j), "model.merges[3] merges \"1\" and \"9\", but \"19\" is not in model.vocab");

  j = good;
  j["model"]["merges"][3] = "a b c";
  EXPECT_CONTAINS(error_for(j), "model.merges[3]");

  j = good;
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{N";
  msg = error_for(j);
  EXPECT_CONTAINS(msg, "pre_tokenizer.pretokenizers[0].pattern.Regex");
  EXPECT_CONTAINS(msg, "does not compile");

  j = good;
  j["pre_tokenizer"]["pretokenizers"][1]["behavior"] = "Sideways";
  EXPECT_CONTAINS(error_for(j), "pre_tokenizer.pretokenizers[1].behavior \"Sideways\" is not supported");

  j = good;
  j["added_tokens"][1]["id"] = 300;
  EXPECT_CONTAINS(error_for(j), "added_tokens[1].id is 300");

  j = good;
  j["model"]["vocab"]["Ġt"] = 5;
  EXPECT_CONTAINS(error_for(j), "already has it");  // two tokens, one id

  j = good;
  j["model"]["dropout"] = 0.1;
  EXPECT_CONTAINS(error_for(j), "model.dropout");

  j = good;
  j["model"]["surprise"] = 1;
  EXPECT_CONTAINS(error_for(j), "model.surprise is not an option this loader knows");

  j = good;
  j["truncation"] = {{"max_length", 8}};
  EXPECT_CONTAINS(error_for(j), "truncation must be null");

  msg = error_of([] { (void)load_hf_tokenizer_from_json_text("{\"model\": [1, 2", "broken.json"); });
  EXPECT_CONTAINS(msg, "broken.json: not valid JSON");
  msg = error_of([] {
    (void)load_hf_tokenizer_from_json_text("{\"model\": " + std::string(100000, '[') + std::string(100000, ']') + "}",
                                           "deep.json");
  });
  EXPECT_CONTAINS(msg, "deep.json: arrays and objects nest deeper than 64 levels");
  EXPECT_CONTAINS(error_of([] { (void)load_hf_tokenizer("/no/such/tokenizer.json"); }), "/no/such/tokenizer.json");
}

TEST(HFTokenizer, EncodeAndDecodeErrors) {
  const auto tok = load_hf_tokenizer(kDeepSeek);
  std::string msg = error_of([&] { (void)tok->decode({72, 99999}); });
  EXPECT_CONTAINS(msg, "99999");
  EXPECT_CONTAINS(msg, "position 1");
  EXPECT_THROW((void)tok->decode({-1}), Error);
  EXPECT_THROW((void)tok->id_to_token(271), Error);

  // A character vocabulary without "z" and without unk_token.
  msg = error_of([] { (void)load_json(char_model({{"a", 0}, {"b", 1}}))->encode("abz"); });
  EXPECT_CONTAINS(msg, "symbol \"z\"");
  EXPECT_CONTAINS(msg, "unk_token is null");

  // A byte-level vocabulary missing the byte 'q'.
  json j = read_json(kByteBpe);
  j["model"]["vocab"].erase("q");
  j["model"]["vocab"]["q_"] = 113;  // keep the ids dense
  msg = error_of([&] { (void)load_json(j)->encode("aqa"); });
  EXPECT_CONTAINS(msg, "\"q\"");
  EXPECT_CONTAINS(msg, "0x71");

  // No special token that names an end of document: eos_id() says so, set_special_ids() fixes it.
  json no_eos = read_json(kByteBpe);
  no_eos["added_tokens"][1]["content"] = "<|stop|>";
  auto t = load_json(no_eos);
  EXPECT_CONTAINS(error_of([&] { (void)t->eos_id(); }), "no end-of-document token");
  EXPECT_EQ(t->bos_id(), 267);
  t->set_special_ids(267, 268);
  EXPECT_EQ(t->eos_id(), 268);
  EXPECT_CONTAINS(error_of([&] { t->set_special_ids(267, 5000); }), "5000");
}

// ---- found by fuzzing (tests/fuzz/fuzz_tokenizer_json.cpp) -----------------------------------

TEST(HFTokenizer, FuzzNumberTooLargeForJson) {
  // nlohmann throws out_of_range, not parse_error, for a number beyond double.
  const std::string msg = error_of([] { (void)load_hf_tokenizer_from_json_text("{\"model\": 1e400}", "big.json"); });
  EXPECT_CONTAINS(msg, "big.json: not valid JSON");
}
