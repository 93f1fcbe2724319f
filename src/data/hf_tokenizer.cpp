// Hugging Face tokenizer.json byte-level BPE: strict loading, then encoding that follows the
// `tokenizers` library step by step (added tokens, pre-tokenizers, ByteLevel, BPE by merge rank).
#include "data/hf_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "core/json_reader.h"

namespace dstrain {
namespace {

// ---- UTF-8 ------------------------------------------------------------------------------

// Length of the valid UTF-8 sequence starting at s[i]; 1 where the bytes are not valid UTF-8,
// so that invalid input is walked byte by byte.
size_t utf8_len(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](size_t k) { return i + k < s.size() && (b(k) & 0xC0) == 0x80; };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return cont(1) ? 2 : 1;
  if (c >= 0xE0 && c <= 0xEF) {
    if (!cont(1) || !cont(2)) return 1;
    if (c == 0xE0 && b(1) < 0xA0) return 1;  // overlong
    if (c == 0xED && b(1) > 0x9F) return 1;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (!cont(1) || !cont(2) || !cont(3)) return 1;
    if (c == 0xF0 && b(1) < 0x90) return 1;  // overlong
    if (c == 0xF4 && b(1) > 0x8F) return 1;  // above U+10FFFF
    return 4;
  }
  return 1;
}

// The code point of the valid sequence of length n at s[i] (n from utf8_len); an invalid
// single byte gives 0xFFFFFFFF, which no Unicode property test accepts.
char32_t utf8_decode(std::string_view s, size_t i, size_t n) {
  const auto b = [&](size_t k) { return char32_t(static_cast<unsigned char>(s[i + k])); };
  switch (n) {
    case 1: return b(0) < 0x80 ? b(0) : char32_t(0xFFFFFFFF);
    case 2: return ((b(0) & 0x1F) << 6) | (b(1) & 0x3F);
    case 3: return ((b(0) & 0x0F) << 12) | ((b(1) & 0x3F) << 6) | (b(2) & 0x3F);
    default: return ((b(0) & 0x07) << 18) | ((b(1) & 0x3F) << 12) | ((b(2) & 0x3F) << 6) | (b(3) & 0x3F);
  }
}

void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(char(c));
  } else if (c < 0x800) {
    out.push_back(char(0xC0 | (c >> 6)));
    out.push_back(char(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(char(0xE0 | (c >> 12)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(char(0x80 | (c & 0x3F)));
  } else {
    out.push_back(char(0xF0 | (c >> 18)));
    out.push_back(char(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(char(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(char(0x80 | (c & 0x3F)));
  }
}

// Rust's char::is_whitespace (the Unicode White_Space property): what lstrip/rstrip remove.
bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Start of the last character of s[0, end): back over continuation bytes to the lead byte; a
// byte that is not part of a valid sequence ending at `end` is a character of its own.
size_t last_char_start(std::string_view s, size_t end) {
  for (size_t back = 1; back <= 4 && back <= end; ++back) {
    const size_t i = end - back;
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) return utf8_len(s, i) == back ? i : end - 1;
  }
  return end - 1;
}

// ---- GPT-2 byte-level alphabet ------------------------------------------------------------

// GPT-2's bytes_to_unicode: the 188 printable bytes stand for themselves, the other 68 for
// U+0100.. in byte order, so every byte string becomes printable text without spaces.
struct ByteLevelTable {
  std::array<char32_t, 256> code_point{};
  std::array<std::string, 256> utf8;
  std::unordered_map<char32_t, unsigned char> byte_of;

  ByteLevelTable() {
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      code_point[size_t(b)] = printable ? char32_t(b) : next++;
      utf8_append(utf8[size_t(b)], code_point[size_t(b)]);
      byte_of[code_point[size_t(b)]] = static_cast<unsigned char>(b);
    }
  }
};

const ByteLevelTable& byte_level() {
  static const ByteLevelTable table;
  return table;
}

// The bytes a token string stands for when every character is in the byte-level alphabet;
// otherwise the token as it is (added tokens such as "<｜end▁of▁sentence｜>"), as the
// library's ByteLevel decoder does.
std::string byte_level_decode(std::string_view token) {
  const ByteLevelTable& t = byte_level();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const size_t n = utf8_len(token, i);
    const auto it = t.byte_of.find(utf8_decode(token, i, n));
    if (it == t.byte_of.end()) return std::string(token);
    bytes.push_back(char(it->second));
    i += n;
  }
  return bytes;
}

// ---- strict JSON access: JsonNode (core/json_reader.h) ----------------------------------

using Node = JsonNode;

// ---- PCRE2 --------------------------------------------------------------------------------

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  pcre2_get_error_message(code, buf.data(), buf.size());
  return reinterpret_cast<const char*>(buf.data());
}

// Code points the library's regex engine (Oniguruma, Unicode 16) puts in these general
// categories and Debian's PCRE2 10.42 (Unicode 14) does not: letters, marks and digits of newer
// scripts, newer emoji. Added to \p{X} and \d so both engines cut text alike.
// Generated by validation/compare_tokenizers.py --print-unicode-delta (tokenizers 0.23.3).
struct CategoryDelta {
  const char* name;
  const char* ranges;
};
constexpr CategoryDelta kNewerUnicode[] = {
    {"L",
     "\\x{1C89}-\\x{1C8A}\\x{A7CB}-\\x{A7CD}\\x{A7DA}-\\x{A7DC}\\x{105C0}-\\x{105F3}\\x{10D4A}-\\x{10D65}"
     "\\x{10D6F}-\\x{10D85}\\x{10EC2}-\\x{10EC4}\\x{1123F}-\\x{11240}\\x{11380}-\\x{11389}\\x{1138B}"
     "\\x{1138E}\\x{11390}-\\x{113B5}\\x{113B7}\\x{113D1}\\x{113D3}\\x{11BC0}-\\x{11BE0}\\x{11F02}"
     "\\x{11F04}-\\x{11F10}\\x{11F12}-\\x{11F33}\\x{1342F}\\x{13441}-\\x{13446}\\x{13460}-\\x{143FA}"
     "\\x{16100}-\\x{1611D}\\x{16D40}-\\x{16D6C}\\x{18CFF}\\x{1B132}\\x{1B155}\\x{1DF25}-\\x{1DF2A}"
     "\\x{1E030}-\\x{1E06D}\\x{1E4D0}-\\x{1E4EB}\\x{1E5D0}-\\x{1E5ED}\\x{1E5F0}\\x{2B739}"
     "\\x{2EBF0}-\\x{2EE5D}\\x{31350}-\\x{323AF}"},
    {"M",
     "\\x{897}\\x{CF3}\\x{ECE}\\x{10D69}-\\x{10D6D}\\x{10EFC}-\\x{10EFF}\\x{11241}\\x{113B8}-\\x{113C0}"
     "\\x{113C2}\\x{113C5}\\x{113C7}-\\x{113CA}\\x{113CC}-\\x{113D0}\\x{113D2}\\x{113E1}-\\x{113E2}"
     "\\x{11F00}-\\x{11F01}\\x{11F03}\\x{11F34}-\\x{11F3A}\\x{11F3E}-\\x{11F42}\\x{11F5A}\\x{13440}"
     "\\x{13447}-\\x{13455}\\x{1611E}-\\x{1612F}\\x{1E08F}\\x{1E4EC}-\\x{1E4EF}\\x{1E5EE}-\\x{1E5EF}"},
    {"N",
     "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
     "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1D2C0}-\\x{1D2D3}"
     "\\x{1E4F0}-\\x{1E4F9}\\x{1E5F1}-\\x{1E5FA}"},
    {"P",
     "\\x{1B4E}-\\x{1B4F}\\x{1B7F}\\x{10D6E}\\x{113D4}-\\x{113D5}\\x{113D7}-\\x{113D8}"
     "\\x{11B00}-\\x{11B09}\\x{11BE1}\\x{11F43}-\\x{11F4F}\\x{16D6D}-\\x{16D6F}\\x{1E5FF}"},
    {"S",
     "\\x{2427}-\\x{2429}\\x{2FFC}-\\x{2FFF}\\x{31E4}-\\x{31E5}\\x{31EF}\\x{10D8E}-\\x{10D8F}"
     "\\x{1CC00}-\\x{1CCEF}\\x{1CD00}-\\x{1CEB3}\\x{1F6DC}\\x{1F774}-\\x{1F776}\\x{1F77B}-\\x{1F77F}"
     "\\x{1F7D9}\\x{1F8B2}-\\x{1F8BB}\\x{1F8C0}-\\x{1F8C1}\\x{1FA75}-\\x{1FA77}\\x{1FA87}-\\x{1FA89}"
     "\\x{1FA8F}\\x{1FAAD}-\\x{1FAAF}\\x{1FABB}-\\x{1FABF}\\x{1FAC6}\\x{1FACE}-\\x{1FACF}"
     "\\x{1FADA}-\\x{1FADC}\\x{1FADF}\\x{1FAE8}-\\x{1FAE9}\\x{1FAF7}-\\x{1FAF8}\\x{1FBCB}-\\x{1FBEF}"},
    {"Nd",
     "\\x{10D40}-\\x{10D49}\\x{116D0}-\\x{116E3}\\x{11BF0}-\\x{11BF9}\\x{11F50}-\\x{11F59}"
     "\\x{16130}-\\x{16139}\\x{16D70}-\\x{16D79}\\x{1CCF0}-\\x{1CCF9}\\x{1E4F0}-\\x{1E4F9}"
     "\\x{1E5F1}-\\x{1E5FA}"},
};

const char* newer_unicode(std::string_view category) {
  for (const CategoryDelta& d : kNewerUnicode) {
    if (category == d.name) return d.ranges;
  }
  return nullptr;
}

// Oniguruma's \s: the White_Space property (PCRE2's also has U+180E), as class members.
constexpr std::string_view kOnigSpace =
    R"(\t-\r\x20\x85\xA0\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";
// Everything but Oniguruma's \h, which is a hex digit (PCRE2's is horizontal space).
constexpr std::string_view kOnigNotHex = R"(\x{0}-\x{2F}\x{3A}-\x{40}\x{47}-\x{60}\x{67}-\x{10FFFF})";

// Rewrites an Oniguruma (Ruby syntax) pattern, as the library compiles it, into PCRE2 with the
// same meaning where the two differ on what tokenizer patterns use: \uHHHH, \s, \S, \d, \D, \h,
// \H, and \p{L|M|N|P|S} (Unicode version). A negated class shorthand inside [...] that cannot be
// widened (\D, \P{L}) is left as PCRE2 reads it; everything else passes through unchanged.
std::string oniguruma_to_pcre2(std::string_view p) {
  std::string out;
  out.reserve(p.size() + 64);
  bool in_class = false;
  const auto member = [&](std::string_view body) {  // a set of characters, inside or outside [...]
    if (in_class) {
      out += body;
    } else {
      out += '[';
      out += body;
      out += ']';
    }
  };
  const auto not_member = [&](std::string_view body) {  // only outside [...]
    out += "[^";
    out += body;
    out += ']';
  };
  const auto category = [](std::string_view name) {
    std::string body = "\\p{" + std::string(name) + "}";
    if (const char* extra = newer_unicode(name)) body += extra;
    return body;
  };
  for (size_t i = 0; i < p.size();) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[i + 1];
      if (e == 'Q') {  // \Q...\E: literal text
        const size_t end = p.find("\\E", i + 2);
        const size_t stop = end == std::string_view::npos ? p.size() : end + 2;
        out.append(p.substr(i, stop - i));
        i = stop;
      } else if (e == 'u' && i + 5 < p.size() &&
                 std::all_of(p.begin() + long(i) + 2, p.begin() + long(i) + 6,
                             [](char h) { return std::isxdigit(static_cast<unsigned char>(h)) != 0; })) {
        out += "\\x{";
        out.append(p.substr(i + 2, 4));
        out += '}';
        i += 6;
      } else if (e == 's') {
        member(kOnigSpace);
        i += 2;
      } else if (e == 'S') {
        if (in_class) {
          out += "\\S\\x{180E}";
        } else {
          not_member(kOnigSpace);
        }
        i += 2;
      } else if (e == 'd') {
        member(category("Nd"));
        i += 2;
      } else if (e == 'D' && !in_class) {
        not_member(category("Nd"));
        i += 2;
      } else if (e == 'h') {
        member("0-9a-fA-F");
        i += 2;
      } else if (e == 'H') {
        member(kOnigNotHex);
        i += 2;
      } else if ((e == 'p' || e == 'P') && i + 2 < p.size() && p[i + 2] == '{' &&
                 p.find('}', i + 3) != std::string_view::npos) {
        const size_t close = p.find('}', i + 3);
        std::string_view name = p.substr(i + 3, close - i - 3);
        bool negated = e == 'P';
        if (!name.empty() && name[0] == '^') {
          negated = !negated;
          name.remove_prefix(1);
        }
        if (newer_unicode(name) != nullptr && !negated) {
          member(category(name));
        } else if (newer_unicode(name) != nullptr && !in_class) {
          not_member(category(name));
        } else {
          out.append(p.substr(i, close + 1 - i));
        }
        i = close + 1;
      } else {
        const size_t n = 1 + utf8_len(p, i + 1);  // an escape pair stays a pair: "\\s" is \, then s
        out.append(p.substr(i, n));
        i += n;
      }
    } else if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      ++i;
      if (i < p.size() && p[i] == '^') out += p[i++];
      if (i < p.size() && p[i] == ']') out += p[i++];  // a leading ] is a member
    } else if (c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:] inside a class
      const size_t end = p.find(":]", i + 2);
      const size_t stop = end == std::string_view::npos ? i + 1 : end + 2;
      out.append(p.substr(i, stop - i));
      i = stop;
    } else {
      if (c == ']' && in_class) in_class = false;
      out += c;
      ++i;
    }
  }
  return out;
}

// A compiled pattern, shared read-only by every encoding thread.
class Regex {
 public:
  // `where` names the pattern in errors ("tokenizer.json: pre_tokenizer.pattern.Regex").
  Regex(std::string_view pattern, bool literal, std::string where) : where_(std::move(where)) {
    // Invalid UTF-8 in the text is allowed and never matched. Oniguruma's Ruby syntax, which
    // the library uses, makes ^ and $ line anchors: PCRE2_MULTILINE.
    uint32_t options = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF;
    std::string pcre = literal ? std::string(pattern) : oniguruma_to_pcre2(pattern);
    options |= literal ? PCRE2_LITERAL : (PCRE2_UCP | PCRE2_MULTILINE);
    int error = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pcre.data()), pcre.size(), options, &error, &offset, nullptr);
    if (code_ == nullptr) {
      const std::string rewritten =
          pcre == pattern ? "" : fmt::format(" (as PCRE2 reads it: {})", shown(pcre, 200));
      DS_FAIL("{} {} does not compile: {} at offset {}{}; fix the pattern", where_, shown(pattern, 200),
              pcre2_message(error), offset, rewritten);
    }
    // Without JIT the interpreter runs the same pattern, only slower.
    (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  ~Regex() { pcre2_code_free(code_); }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  const pcre2_code* code() const { return code_; }
  const std::string& where() const { return where_; }

 private:
  pcre2_code* code_ = nullptr;
  std::string where_;
};

// ---- BPE merges ---------------------------------------------------------------------------

struct Merge {
  int32_t rank;
  int32_t new_id;
};

// Open addressing over (left id, right id): the merge lookup is the inner loop of BPE.
class MergeTable {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 16) cap *= 2;
    slots_.assign(cap, Slot{kEmpty, {0, 0}});
    mask_ = cap - 1;
  }
  // Later entries replace earlier ones, like the library's HashMap built from the merge list.
  void insert(int32_t a, int32_t b, Merge m) {
    const uint64_t k = key(a, b);
    size_t i = hash(k) & mask_;
    while (slots_[i].key != kEmpty && slots_[i].key != k) i = (i + 1) & mask_;
    slots_[i] = Slot{k, m};
  }
  const Merge* find(int32_t a, int32_t b) const {
    if (slots_.empty()) return nullptr;
    const uint64_t k = key(a, b);
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return &slots_[i].merge;
      if (slots_[i].key == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t(0);  // ids are < 2^31, so no pair has this key
  struct Slot {
    uint64_t key;
    Merge merge;
  };
  static uint64_t key(int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); }
  static size_t hash(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return size_t(k);
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0;
};

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <class V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

// ---- added tokens -------------------------------------------------------------------------

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = true;
};

// A byte trie over added-token contents: finds the longest token starting at a position,
// which at the leftmost matching position is the library's leftmost-longest Aho-Corasick match.
class TokenTrie {
 public:
  bool empty() const { return terminal_.size() <= 1; }
  void add(std::string_view s, int32_t token_index) {
    first_[static_cast<unsigned char>(s[0])] = true;
    int32_t node = 0;
    for (char c : s) {
      const uint64_t k = edge(node, c);
      auto it = edges_.find(k);
      if (it == edges_.end()) {
        it = edges_.emplace(k, int32_t(terminal_.size())).first;
        terminal_.push_back(-1);
      }
      node = it->second;
    }
    terminal_[size_t(node)] = token_index;
  }
  // {token index, end} of the longest token at text[i]; {-1, i} when none starts there.
  std::pair<int32_t, size_t> longest_at(std::string_view text, size_t i) const {
    std::pair<int32_t, size_t> best{-1, i};
    if (!first_[static_cast<unsigned char>(text[i])]) return best;
    int32_t node = 0;
    for (size_t j = i; j < text.size(); ++j) {
      const auto it = edges_.find(edge(node, text[j]));
      if (it == edges_.end()) break;
      node = it->second;
      if (terminal_[size_t(node)] >= 0) best = {terminal_[size_t(node)], j + 1};
    }
    return best;
  }

 private:
  static uint64_t edge(int32_t node, char c) { return (uint64_t(uint32_t(node)) << 8) | static_cast<unsigned char>(c); }
  std::array<bool, 256> first_{};
  std::unordered_map<uint64_t, int32_t> edges_;
  std::vector<int32_t> terminal_{-1};  // node -> token index, -1 when no token ends there
};

// A run of the input: an added token (id >= 0) or text still to pre-tokenize (id < 0).
struct Segment {
  int32_t id;
  size_t begin, end;
};

// ---- pre-tokenizer steps -----------------------------------------------------------------

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

struct Step {
  enum class Kind { Split, ByteLevel } kind = Kind::Split;
  const Regex* regex = nullptr;  // Split; ByteLevel with use_regex: the GPT-2 pattern
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  bool add_prefix_space = false;  // ByteLevel
};

constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct Span {
  size_t begin, end;
  bool is_match;
};

// BPE results of pieces seen before: text repeats, and a piece's ids never change. Open
// addressing over flat arrays that grow with use (a node-based map spent its time chasing
// pointers). Pieces longer than kMaxPiece are not kept, and everything is dropped when
// kMaxEntries are held, which bounds each thread's cache to a few MB.
class PieceCache {
 public:
  static constexpr size_t kMaxPiece = 256;
  static constexpr size_t kMaxEntries = 65'536;

  bool append_cached(std::string_view piece, std::vector<int32_t>& out) const {
    if (slots_.empty()) return false;
    const uint64_t h = hash(piece);
    const size_t mask = slots_.size() - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.key_len == 0) return false;
      if (s.hash == h && std::string_view(keys_).substr(s.key_begin, s.key_len) == piece) {
        out.insert(out.end(), ids_.begin() + s.ids_begin, ids_.begin() + s.ids_begin + s.ids_len);
        return true;
      }
    }
  }
  void put(std::string_view piece, const int32_t* ids, size_t n) {
    if (piece.empty() || piece.size() > kMaxPiece) return;
    if (entries_ >= kMaxEntries) {
      slots_.clear();
      keys_.clear();
      ids_.clear();
      entries_ = 0;
    }
    if (2 * (entries_ + 1) > slots_.size()) grow();  // load factor at most 1/2
    const uint64_t h = hash(piece);
    insert(Slot{h, uint32_t(keys_.size()), uint32_t(piece.size()), uint32_t(ids_.size()), uint32_t(n)});
    keys_.append(piece);
    ids_.insert(ids_.end(), ids, ids + n);
    ++entries_;
  }

 private:
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_begin = 0, key_len = 0;  // key_len 0: empty (empty pieces are never kept)
    uint32_t ids_begin = 0, ids_len = 0;
  };
  static uint64_t hash(std::string_view s) { return std::hash<std::string_view>{}(s); }
  void insert(const Slot& slot) {
    const size_t mask = slots_.size() - 1;
    size_t i = slot.hash & mask;
    while (slots_[i].key_len != 0) i = (i + 1) & mask;
    slots_[i] = slot;
  }
  void grow() {
    std::vector<Slot> old(std::max<size_t>(1024, 2 * slots_.size()));
    old.swap(slots_);
    for (const Slot& slot : old) {
      if (slot.key_len != 0) insert(slot);
    }
  }
  std::vector<Slot> slots_;   // a power of two in size
  std::string keys_;          // all cached pieces, end to end (at most kMaxEntries * kMaxPiece bytes)
  std::vector<int32_t> ids_;  // all cached ids, end to end
  size_t entries_ = 0;
};

struct Symbol {
  int32_t id;
  int32_t prev, next;  // neighbours in the word, -1 at the ends
  bool alive;
};

struct QueuedMerge {
  int32_t rank, pos, new_id;
};
// Lowest rank first, then leftmost: the order of the library's merge queue.
struct LaterMerge {
  bool operator()(const QueuedMerge& a, const QueuedMerge& b) const {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  }
};

// Everything one encode() call writes: taken from a pool so threads never share it.
struct Scratch {
  pcre2_match_data* match = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  std::vector<Span> matches;
  std::vector<std::vector<Span>> pieces;  // per step: the pieces of the piece at that step
  std::vector<std::string> prefixed;      // per step: piece with ByteLevel's prefix space
  std::vector<std::string> mapped;        // per step: piece after ByteLevel's byte mapping
  std::vector<Segment> segments, segments2;
  std::vector<Symbol> symbols;
  std::vector<QueuedMerge> queue;
  std::vector<int32_t> word_ids;
  std::string word;
  PieceCache cache;

  explicit Scratch(size_t steps) : pieces(steps), prefixed(steps), mapped(steps) {
    match = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    jit_stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    DS_CHECK(match && context && jit_stack, "out of memory creating PCRE2 match data");
    pcre2_jit_stack_assign(context, nullptr, jit_stack);
    pcre2_set_heap_limit(context, 256 * 1024);  // KiB: bounds the interpreter on hostile patterns
  }
  ~Scratch() {
    pcre2_jit_stack_free(jit_stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(match);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
};

}  // namespace

// ---- the tokenizer --------------------------------------------------------------------------

struct HFTokenizer::Impl {
  std::string source;  // as given: errors and name()

  // model
  StringMap<int32_t> vocab;  // model.vocab
  MergeTable merges;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  std::array<int32_t, 256> byte_id{};  // id of each byte's byte-level character, -1 if none

  // added tokens
  std::vector<AddedToken> added;
  TokenTrie raw_trie;         // normalized: false, matched first on the raw text
  TokenTrie normalized_trie;  // normalized: true, matched in what is left
  std::unique_ptr<Regex> word_char;  // Rust's \w, for single_word
  bool encode_special_as_text = true;  // the Tokenizer contract; the library's default is false

  // pre-tokenizer and decoder
  std::vector<std::unique_ptr<Regex>> regexes;
  std::vector<Step> steps;
  bool final_bytes = false;  // the last step is ByteLevel: BPE sees raw bytes
  bool byte_level_decoder = false;
  std::string post_processor;

  // ids
  struct Entry {
    std::string token;    // as in the file
    std::string decoded;  // what decode() emits for it
  };
  std::vector<Entry> entries;
  std::unordered_map<int32_t, uint32_t> entry_of_id;
  int64_t size = 0;  // max id + 1
  std::optional<int32_t> bos, eos;
  std::string bos_note, eos_note;  // why none was found

  mutable std::mutex pool_mutex;
  mutable std::vector<std::unique_ptr<Scratch>> pool;

  // -- loading
  void load(const json& root);
  void load_model(const Node& model);
  void load_added_tokens(const Node& list);
  void load_pre_tokenizer(const Node& pre);
  void add_pre_tokenizer(const Node& pre, bool nested);
  const Regex* compile(std::string_view pattern, bool literal, const std::string& where);
  void add_id(int32_t id, const std::string& token, const Node& where);
  void find_special_ids();

  // -- encoding
  void encode(std::string_view text, Scratch& s, std::vector<int32_t>& out) const;
  void split_added(std::string_view sentence, size_t base, const TokenTrie& trie, Scratch& s,
                   std::vector<Segment>& out) const;
  bool is_word_char(std::string_view s, size_t i, size_t end, Scratch& scratch) const;
  void pre_tokenize(std::string_view piece, size_t step, Scratch& s, std::vector<int32_t>& out) const;
  void split(std::string_view piece, const Step& step, Scratch& s, std::vector<Span>& out) const;
  void bpe(std::string_view piece, Scratch& s, std::vector<int32_t>& out) const;
  void merge_all(Scratch& s) const;
  [[noreturn]] void missing_symbol(std::string_view piece, std::string_view symbol) const;

  std::unique_ptr<Scratch> take_scratch() const {
    {
      const std::lock_guard<std::mutex> lock(pool_mutex);
      if (!pool.empty()) {
        std::unique_ptr<Scratch> s = std::move(pool.back());
        pool.pop_back();
        return s;
      }
    }
    return std::make_unique<Scratch>(steps.size());
  }
  void give_back(std::unique_ptr<Scratch> s) const {
    const std::lock_guard<std::mutex> lock(pool_mutex);
    pool.push_back(std::move(s));
  }
};

// ---- loading --------------------------------------------------------------------------------

const Regex* HFTokenizer::Impl::compile(std::string_view pattern, bool literal, const std::string& where) {
  regexes.push_back(std::make_unique<Regex>(pattern, literal, where));
  return regexes.back().get();
}

void HFTokenizer::Impl::add_id(int32_t id, const std::string& token, const Node& where) {
  const auto [it, inserted] = entry_of_id.emplace(id, uint32_t(entries.size()));
  if (!inserted) {
    if (entries[it->second].token == token) return;  // an added token that is also in the vocab
    where.fail(fmt::format("gives id {} to {}, but {} already has it; every id must name one token", id,
                           shown(token), shown(entries[it->second].token)));
  }
  entries.push_back({token, byte_level_decoder ? byte_level_decode(token) : token});
  size = std::max(size, int64_t(id) + 1);
}

void HFTokenizer::Impl::load(const json& root) {
  const Node top(root, "", source);
  top.only_keys({"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model",
                 "post_processor", "decoder"});
  if (top.find("truncation")) top.at("truncation").fail("must be null: dstrain encodes whole documents");
  if (top.find("padding")) top.at("padding").fail("must be null: dstrain encodes whole documents");

  if (const std::optional<Node> norm = top.find("normalizer")) {
    // DeepSeek ships an empty Sequence, which changes nothing.
    const std::string t = norm->at("type").str();
    const bool empty_sequence = t == "Sequence" && norm->find("normalizers") &&
                                norm->at("normalizers").value().is_array() && norm->at("normalizers").size() == 0;
    if (!empty_sequence) {
      norm->fail(fmt::format("of type {} is not supported: this loader takes no normalizer (null or an empty "
                             "Sequence); use a tokenizer.json without one",
                             shown(t)));
    }
  }

  if (const std::optional<Node> dec = top.find("decoder")) {
    dec->type({"ByteLevel"});
    dec->only_keys({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    byte_level_decoder = true;
  }
  if (const std::optional<Node> post = top.find("post_processor")) post_processor = post->at("type").str();

  const Node model = top.at("model");
  load_model(model);
  if (const std::optional<Node> list = top.find("added_tokens")) load_added_tokens(*list);
  if (const std::optional<Node> pre = top.find("pre_tokenizer")) load_pre_tokenizer(*pre);
  find_special_ids();
  byte_id.fill(-1);
  for (size_t b = 0; b < 256; ++b) {
    if (const auto it = vocab.find(byte_level().utf8[b]); it != vocab.end()) byte_id[b] = it->second;
  }
}

void HFTokenizer::Impl::load_model(const Node& model) {
  model.type({"BPE"});
  model.only_keys({"type", "dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                   "byte_fallback", "ignore_merges", "vocab", "merges"});
  if (const std::optional<Node> d = model.find("dropout")) {
    if (!d->value().is_number() || d->value().get<double>() != 0.0) d->fail("must be null: dropout is for training");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (const std::optional<Node> n = model.find(key); n && !n->str().empty()) {
      n->fail("must be null or empty: subword prefixes and suffixes are not supported");
    }
  }
  if (model.boolean_or("byte_fallback", false)) {
    model.at("byte_fallback").fail("must be false: byte fallback (<0x..> tokens) is not supported");
  }
  fuse_unk = model.boolean_or("fuse_unk", false);
  ignore_merges = model.boolean_or("ignore_merges", false);

  const Node v = model.at("vocab");
  v.expect_object();
  vocab.reserve(v.size());
  for (auto it = v.value().begin(); it != v.value().end(); ++it) {
    const Node entry(it.value(), v.path() + "." + shown(it.key()), source);
    const int32_t id = entry.id();
    vocab.emplace(it.key(), id);
    add_id(id, it.key(), entry);
  }

  if (const std::optional<Node> unk = model.find("unk_token")) {
    const auto it = vocab.find(unk->str());
    if (it == vocab.end()) unk->fail(shown(unk->str()) + " is not in model.vocab; add it or set unk_token to null");
    unk_id = it->second;
  }

  if (const std::optional<Node> m = model.find("merges")) {
    m->expect_array();
    merges.reserve(m->size());
    // Both forms exist: "a b" strings (older files; "#version" lines skipped) and [a, b] pairs.
    int32_t rank = 0;
    for (size_t i = 0; i < m->size(); ++i) {
      const Node e = m->element(i);
      std::string_view a, b;
      if (e.value().is_string()) {
        const std::string& line = e.str();
        if (line.rfind("#version", 0) == 0) continue;
        const size_t space = line.find(' ');
        if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
          e.fail(fmt::format("{} must be two tokens separated by one space", shown(line)));
        }
        a = std::string_view(line).substr(0, space);
        b = std::string_view(line).substr(space + 1);
      } else if (e.value().is_array()) {
        if (e.size() != 2) e.fail(fmt::format("must be a pair [left, right], got {} elements", e.size()));
        a = e.element(0).str();
        b = e.element(1).str();
      } else {
        e.fail("must be a string \"left right\" or a pair [left, right], got " + describe_json(e.value()));
      }
      const auto ia = vocab.find(a), ib = vocab.find(b);
      std::string joined(a);
      joined += b;
      const auto ij = vocab.find(joined);
      if (ia == vocab.end() || ib == vocab.end() || ij == vocab.end()) {
        const std::string_view missing = ia == vocab.end() ? a : ib == vocab.end() ? b : std::string_view(joined);
        e.fail(fmt::format("merges {} and {}, but {} is not in model.vocab; the vocab and merges do not belong "
                           "together",
                           shown(a), shown(b), shown(missing)));
      }
      merges.insert(ia->second, ib->second, Merge{rank++, ij->second});
    }
  }
}

void HFTokenizer::Impl::load_added_tokens(const Node& list) {
  list.expect_array();
  const int64_t model_size = int64_t(vocab.size());
  std::optional<int32_t> max_added;
  StringMap<size_t> seen;
  for (size_t i = 0; i < list.size(); ++i) {
    const Node e = list.element(i);
    e.only_keys({"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
    AddedToken t;
    t.id = e.at("id").id();
    t.content = e.at("content").str();
    t.special = e.boolean_or("special", false);
    t.single_word = e.boolean_or("single_word", false);
    t.lstrip = e.boolean_or("lstrip", false);
    t.rstrip = e.boolean_or("rstrip", false);
    t.normalized = e.boolean_or("normalized", true);
    if (t.content.empty()) e.at("content").fail("is empty; an added token needs text");
    if (const auto it = seen.find(t.content); it != seen.end()) {
      const AddedToken& before = added[it->second];
      if (before.id == t.id && before.special == t.special && before.single_word == t.single_word &&
          before.lstrip == t.lstrip && before.rstrip == t.rstrip && before.normalized == t.normalized) {
        continue;  // an exact repeat, which the library ignores too
      }
      e.fail(fmt::format("repeats {} with other settings than added_tokens[{}]; keep one", shown(t.content),
                         it->second));
    }
    // The library gives an added token the vocab's id for its text, or else the next id after
    // the vocab and the added tokens so far, whatever the file says; differing ids would make
    // dstrain and the library disagree, so they are refused.
    int32_t expected;
    if (const auto v = vocab.find(t.content); v != vocab.end()) {
      expected = v->second;
    } else if (!max_added) {
      expected = int32_t(std::min<int64_t>(model_size, INT32_MAX - 1));
    } else {
      expected = (*max_added >= model_size || model_size == 0) ? *max_added + 1
                                                               : int32_t(std::min<int64_t>(model_size, INT32_MAX - 1));
    }
    if (t.id != expected) {
      e.at("id").fail(fmt::format("is {} for {}, but the tokenizers library assigns it id {} (the vocab's id for "
                                  "that text, else the next free id after the vocab and the added tokens before "
                                  "it); fix the id",
                                  t.id, shown(t.content), expected));
    }
    max_added = std::max(max_added.value_or(t.id), t.id);
    seen.emplace(t.content, added.size());
    add_id(t.id, t.content, e.at("id"));
    (t.normalized ? normalized_trie : raw_trie).add(t.content, int32_t(added.size()));
    if (t.single_word && !word_char) {
      // Rust regex's Unicode \w, which the library tests next to single_word tokens.
      word_char = std::make_unique<Regex>(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", false,
                                          source + ": single_word");
    }
    added.push_back(std::move(t));
  }
}

void HFTokenizer::Impl::load_pre_tokenizer(const Node& pre) {
  add_pre_tokenizer(pre, false);
  final_bytes = !steps.empty() && steps.back().kind == Step::Kind::ByteLevel;
}

void HFTokenizer::Impl::add_pre_tokenizer(const Node& pre, bool nested) {
  const std::string type = nested ? pre.type({"Split", "ByteLevel", "Digits", "Sequence"})
                                  : pre.type({"Sequence", "Split", "ByteLevel", "Digits"});
  Step step;
  if (type == "Sequence") {
    pre.only_keys({"type", "pretokenizers"});
    const Node list = pre.at("pretokenizers");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) add_pre_tokenizer(list.element(i), true);
    return;
  }
  if (type == "Split") {
    pre.only_keys({"type", "pattern", "behavior", "invert"});
    const Node pattern = pre.at("pattern");
    pattern.only_keys({"Regex", "String"});
    if (pattern.size() != 1) pattern.fail("must hold exactly one of \"Regex\" or \"String\"");
    const bool literal = pattern.find("String").has_value();
    const Node p = pattern.at(literal ? "String" : "Regex");
    step.regex = compile(p.str(), literal, source + ": " + p.path());
    const std::string& behavior = pre.at("behavior").str();
    static const std::pair<const char*, Behavior> kBehaviors[] = {
        {"Removed", Behavior::Removed},
        {"Isolated", Behavior::Isolated},
        {"MergedWithPrevious", Behavior::MergedWithPrevious},
        {"MergedWithNext", Behavior::MergedWithNext},
        {"Contiguous", Behavior::Contiguous}};
    const auto* b = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                 [&](const auto& kv) { return behavior == kv.first; });
    if (b == std::end(kBehaviors)) {
      pre.at("behavior").fail(shown(behavior) + " is not supported; supported: Removed, Isolated, "
                                                 "MergedWithPrevious, MergedWithNext, Contiguous");
    }
    step.behavior = b->second;
    step.invert = pre.boolean_or("invert", false);
  } else if (type == "ByteLevel") {
    pre.only_keys({"type", "add_prefix_space", "trim_offsets", "use_regex"});
    step.kind = Step::Kind::ByteLevel;
    step.add_prefix_space = pre.at("add_prefix_space").boolean();
    (void)pre.boolean_or("trim_offsets", true);  // offsets only
    if (pre.boolean_or("use_regex", true)) step.regex = compile(kGpt2Pattern, false, source + ": GPT-2 pattern");
  } else {  // Digits: each digit alone, or runs of digits (char::is_numeric is \p{N})
    pre.only_keys({"type", "individual_digits"});
    const bool individual = pre.at("individual_digits").boolean();
    step.regex = compile(individual ? R"(\p{N})" : R"(\p{N}+)", false, source + ": " + pre.path());
  }
  steps.push_back(step);
}

void HFTokenizer::Impl::find_special_ids() {
  // Names as the DeepSeek, Llama and GPT-2 families spell them; then anything naming a
  // sentence's begin or end, when exactly one special token does.
  static const char* const kBos[] = {"<｜begin▁of▁sentence｜>", "<|begin_of_text|>", "<s>"};
  static const char* const kEos[] = {"<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>", "<|endoftext|>"};
  const auto pick = [&](const auto& names, const char* word, std::optional<int32_t>& id, std::string& note) {
    for (const char* name : names) {
      for (const AddedToken& t : added) {
        if (t.special && t.content == name) {
          id = t.id;
          return;
        }
      }
    }
    std::vector<const AddedToken*> found;
    for (const AddedToken& t : added) {
      std::string lower = t.content;
      for (char& c : lower) c = char(std::tolower(static_cast<unsigned char>(c)));
      if (t.special && lower.find(word) != std::string::npos && lower.find("sentence") != std::string::npos) {
        found.push_back(&t);
      }
    }
    if (found.size() == 1) {
      id = found[0]->id;
      return;
    }
    std::string list;
    for (const char* name : names) list += std::string(list.empty() ? "" : ", ") + name;
    note = fmt::format("{} special added tokens contain \"{}\" and \"sentence\", and none is named {}", found.size(),
                       word, list);
  };
  pick(kBos, "begin", bos, bos_note);
  pick(kEos, "end", eos, eos_note);
}

// ---- encoding -------------------------------------------------------------------------------

void HFTokenizer::Impl::encode(std::string_view text, Scratch& s, std::vector<int32_t>& out) const {
  // Added tokens first: those matched on raw text, then those matched on normalized text
  // (the same here, without a normalizer) in what is left, as the library does.
  std::vector<Segment>* segs = &s.segments;
  segs->clear();
  if (raw_trie.empty()) {
    segs->push_back({-1, 0, text.size()});
  } else {
    split_added(text, 0, raw_trie, s, *segs);
  }
  if (!normalized_trie.empty()) {
    s.segments2.clear();
    for (const Segment& seg : *segs) {
      if (seg.id >= 0) {
        s.segments2.push_back(seg);
      } else {
        split_added(text.substr(seg.begin, seg.end - seg.begin), seg.begin, normalized_trie, s, s.segments2);
      }
    }
    segs = &s.segments2;
  }
  for (const Segment& seg : *segs) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
    } else if (seg.end > seg.begin) {
      pre_tokenize(text.substr(seg.begin, seg.end - seg.begin), 0, s, out);
    }
  }
}

bool HFTokenizer::Impl::is_word_char(std::string_view s, size_t i, size_t end, Scratch& scratch) const {
  const int rc = pcre2_match(word_char->code(), reinterpret_cast<PCRE2_SPTR>(s.data()), end, i, PCRE2_ANCHORED,
                             scratch.match, scratch.context);
  return rc >= 0;
}

// The library's AddedVocabulary::find_matches on one sentence; offsets are shifted by base.
void HFTokenizer::Impl::split_added(std::string_view sentence, size_t base, const TokenTrie& trie, Scratch& s,
                                    std::vector<Segment>& out) const {
  size_t start_offset = 0;
  for (size_t i = 0; i < sentence.size();) {
    const auto [index, match_end] = trie.longest_at(sentence, i);
    if (index < 0) {
      ++i;
      continue;
    }
    size_t start = i, stop = match_end;
    i = match_end;  // matches never overlap, even when one is then discarded
    const AddedToken& t = added[size_t(index)];
    if (encode_special_as_text && t.special) continue;
    if (t.single_word) {
      // A word character right before or after means the token is inside a word.
      const bool start_space = start == 0 || !is_word_char(sentence, last_char_start(sentence, start), start, s);
      const bool stop_space = stop == sentence.size() || !is_word_char(sentence, stop, sentence.size(), s);
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) {
      size_t k = start;
      while (k > 0) {
        const size_t c = last_char_start(sentence, k);
        if (!is_white_space(utf8_decode(sentence, c, utf8_len(sentence, c)))) break;
        k = c;
      }
      start = k;
    }
    if (t.rstrip) {
      while (stop < sentence.size()) {
        const size_t n = utf8_len(sentence, stop);
        if (!is_white_space(utf8_decode(sentence, stop, n))) break;
        stop += n;
      }
    }
    if (start > start_offset) out.push_back({-1, base + start_offset, base + start});
    out.push_back({t.id, base + start, base + stop});
    start_offset = stop;
  }
  if (start_offset < sentence.size()) out.push_back({-1, base + start_offset, base + sentence.size()});
}

// Depth first through the pre-tokenizer steps: each step works on one piece at a time in the
// library too, so the pieces come out in the same order.
void HFTokenizer::Impl::pre_tokenize(std::string_view piece, size_t step, Scratch& s, std::vector<int32_t>& out) const {
  if (step == steps.size()) {
    bpe(piece, s, out);
    return;
  }
  const Step& st = steps[step];
  std::vector<Span>& pieces = s.pieces[step];
  if (st.kind == Step::Kind::Split) {
    split(piece, st, s, pieces);
    for (const Span& p : pieces) pre_tokenize(piece.substr(p.begin, p.end - p.begin), step + 1, s, out);
    return;
  }
  // ByteLevel: prefix space, GPT-2 split, then the byte mapping (deferred to BPE when last).
  if (st.add_prefix_space && piece[0] != ' ') {
    std::string& buf = s.prefixed[step];
    buf.assign(1, ' ');
    buf.append(piece);
    piece = buf;
  }
  const auto next = [&](std::string_view sub) {
    if (step + 1 == steps.size()) {
      bpe(sub, s, out);
      return;
    }
    std::string& m = s.mapped[step];
    m.clear();
    for (char c : sub) m += byte_level().utf8[static_cast<unsigned char>(c)];
    pre_tokenize(m, step + 1, s, out);
  };
  if (st.regex == nullptr) {
    next(piece);
    return;
  }
  split(piece, st, s, pieces);
  for (const Span& p : pieces) next(piece.substr(p.begin, p.end - p.begin));
}

// The library's NormalizedString::split with a regex pattern: Oniguruma's find_iter (an empty
// match right after a match is skipped; after an empty match the search moves on one
// character), the matches and the gaps between them, merged by the behaviour, empties dropped.
void HFTokenizer::Impl::split(std::string_view piece, const Step& step, Scratch& s, std::vector<Span>& out) const {
  std::vector<Span>& m = s.matches;
  m.clear();
  const auto subject = reinterpret_cast<PCRE2_SPTR>(piece.data());
  size_t prev = 0, last_end = 0;
  bool skip_next_empty = false;
  // Linear patterns backtrack in proportion to the text (\s*[\r\n]+ over a long run of
  // spaces), so the limit grows with the piece; catastrophic patterns still end.
  pcre2_set_match_limit(s.context, uint32_t(std::clamp<size_t>(100 * piece.size(), 10'000'000, UINT32_MAX)));
  while (last_end <= piece.size()) {
    const int rc = pcre2_match(step.regex->code(), subject, piece.size(), last_end, 0, s.match, s.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      DS_FAIL("{}: matching the pattern against a {}-byte piece of text failed: {}; the pattern backtracks too "
              "much on this text: simplify the pattern or shorten the document",
              step.regex->where(), piece.size(), pcre2_message(rc));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.match);
    const size_t start = ov[0], end = ov[1];
    last_end = end;
    if (start == end) {
      last_end += last_end < piece.size() ? utf8_len(piece, last_end) : 1;
      if (skip_next_empty) {
        skip_next_empty = false;
        continue;
      }
    } else {
      skip_next_empty = true;
    }
    if (prev != start) m.push_back({prev, start, false});
    m.push_back({start, end, true});
    prev = end;
  }
  if (prev != piece.size()) m.push_back({prev, piece.size(), false});
  if (step.invert) {
    for (Span& x : m) x.is_match = !x.is_match;
  }

  out.clear();
  const auto keep = [&](size_t b, size_t e) { out.push_back({b, e, false}); };
  switch (step.behavior) {
    case Behavior::Isolated:
      for (const Span& x : m) keep(x.begin, x.end);
      break;
    case Behavior::Removed:
      for (const Span& x : m) {
        if (!x.is_match) keep(x.begin, x.end);
      }
      break;
    case Behavior::Contiguous: {
      bool previous_match = false;
      for (const Span& x : m) {
        if (x.is_match == previous_match && !out.empty()) {
          out.back().end = x.end;
        } else {
          keep(x.begin, x.end);
        }
        previous_match = x.is_match;
      }
      break;
    }
    case Behavior::MergedWithPrevious: {
      bool previous_match = false;
      for (const Span& x : m) {
        if (x.is_match && !previous_match && !out.empty()) {
          out.back().end = x.end;
        } else {
          keep(x.begin, x.end);
        }
        previous_match = x.is_match;
      }
      break;
    }
    case Behavior::MergedWithNext: {
      bool previous_match = false;
      for (auto x = m.rbegin(); x != m.rend(); ++x) {
        if (x->is_match && !previous_match && !out.empty()) {
          out.back().begin = x->begin;
        } else {
          keep(x->begin, x->end);
        }
        previous_match = x->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    }
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const Span& x) { return x.end == x.begin; }), out.end());
}

void HFTokenizer::Impl::missing_symbol(std::string_view piece, std::string_view symbol) const {
  std::string bytes;
  if (final_bytes) {
    for (size_t i = 0; i < symbol.size(); ++i) {
      bytes += fmt::format("{}0x{:02x}", i ? " " : "", static_cast<unsigned char>(symbol[i]));
    }
    DS_FAIL("{}: the text piece {} needs the byte-level symbol {} (byte {}), which is not in model.vocab, and "
            "model.unk_token is null; this tokenizer.json cannot encode the text",
            source, shown(piece), shown(byte_level().utf8[static_cast<unsigned char>(symbol[0])]), bytes);
  }
  DS_FAIL("{}: the text piece {} needs the symbol {}, which is not in model.vocab, and model.unk_token is null; "
          "this tokenizer.json cannot encode the text",
          source, shown(piece), shown(symbol));
}

// The library's BPE model on one piece: its characters (its bytes, when ByteLevel came last)
// become vocab ids, then the merge of lowest rank, leftmost first, is applied until none is.
void HFTokenizer::Impl::bpe(std::string_view piece, Scratch& s, std::vector<int32_t>& out) const {
  if (s.cache.append_cached(piece, out)) return;
  if (ignore_merges) {
    std::string_view word = piece;
    if (final_bytes) {
      s.word.clear();
      for (char c : piece) s.word += byte_level().utf8[static_cast<unsigned char>(c)];
      word = s.word;
    }
    if (const auto it = vocab.find(word); it != vocab.end()) {
      out.push_back(it->second);
      s.cache.put(piece, &it->second, 1);
      return;
    }
  }

  std::vector<Symbol>& syms = s.symbols;
  syms.clear();
  const auto add = [&](int32_t id) {
    const int32_t n = int32_t(syms.size());
    if (n > 0) syms.back().next = n;
    syms.push_back({id, n - 1, -1, true});
  };
  bool pending_unk = false;
  for (size_t i = 0; i < piece.size();) {
    const size_t n = final_bytes ? 1 : utf8_len(piece, i);
    int32_t id = -1;
    if (final_bytes) {
      id = byte_id[static_cast<unsigned char>(piece[i])];
    } else if (const auto it = vocab.find(piece.substr(i, n)); it != vocab.end()) {
      id = it->second;
    }
    if (id >= 0) {
      if (pending_unk) add(*unk_id);
      pending_unk = false;
      add(id);
    } else if (unk_id) {
      if (pending_unk && !fuse_unk) add(*unk_id);
      pending_unk = true;
    } else {
      missing_symbol(piece, piece.substr(i, n));
    }
    i += n;
  }
  if (pending_unk) add(*unk_id);

  merge_all(s);
  std::vector<int32_t>& ids = s.word_ids;
  ids.clear();
  for (const Symbol& sym : syms) {
    if (sym.alive) ids.push_back(sym.id);
  }
  out.insert(out.end(), ids.begin(), ids.end());
  s.cache.put(piece, ids.data(), ids.size());
}

// The library's Word::merge_all without dropout: a queue of candidate merges ordered by
// (rank, position); entries made stale by an earlier merge are recognised and skipped.
void HFTokenizer::Impl::merge_all(Scratch& s) const {
  std::vector<Symbol>& syms = s.symbols;
  std::vector<QueuedMerge>& queue = s.queue;
  queue.clear();
  const LaterMerge later;
  const auto push = [&](int32_t pos, const Merge& m) {
    queue.push_back({m.rank, pos, m.new_id});
    std::push_heap(queue.begin(), queue.end(), later);
  };
  for (size_t i = 0; i + 1 < syms.size(); ++i) {
    if (const Merge* m = merges.find(syms[i].id, syms[i + 1].id)) queue.push_back({m->rank, int32_t(i), m->new_id});
  }
  std::make_heap(queue.begin(), queue.end(), later);
  while (!queue.empty()) {
    std::pop_heap(queue.begin(), queue.end(), later);
    const QueuedMerge top = queue.back();
    queue.pop_back();
    Symbol& cur = syms[size_t(top.pos)];
    if (!cur.alive || cur.next < 0) continue;
    const int32_t right_pos = cur.next;
    const Symbol right = syms[size_t(right_pos)];
    const Merge* now = merges.find(cur.id, right.id);
    if (now == nullptr || now->new_id != top.new_id) continue;

    cur.id = top.new_id;
    cur.next = right.next;
    syms[size_t(right_pos)].alive = false;
    if (right.next >= 0) syms[size_t(right.next)].prev = top.pos;
    if (cur.prev >= 0) {
      if (const Merge* m = merges.find(syms[size_t(cur.prev)].id, cur.id)) push(cur.prev, *m);
    }
    if (cur.next >= 0) {
      if (const Merge* m = merges.find(cur.id, syms[size_t(cur.next)].id)) push(top.pos, *m);
    }
  }
}

// ---- HFTokenizer ----------------------------------------------------------------------------

HFTokenizer::HFTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
HFTokenizer::~HFTokenizer() = default;

std::vector<int32_t> HFTokenizer::encode(std::string_view text) const {
  std::unique_ptr<Scratch> s = impl_->take_scratch();
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 8);
  try {
    impl_->encode(text, *s, ids);
  } catch (...) {
    impl_->give_back(std::move(s));
    throw;
  }
  impl_->give_back(std::move(s));
  return ids;
}

std::string HFTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string text;
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto it = impl_->entry_of_id.find(ids[i]);
    if (it == impl_->entry_of_id.end()) {
      DS_FAIL("token id {} at position {} is not in the vocabulary of {} (ids 0..{}); the ids were made by another "
              "tokenizer, decode them with that one",
              ids[i], i, impl_->source, impl_->size - 1);
    }
    text += impl_->entries[it->second].decoded;
  }
  return text;
}

int64_t HFTokenizer::vocab_size() const { return impl_->size; }

int32_t HFTokenizer::bos_id() const {
  if (!impl_->bos) {
    DS_FAIL("{} names no beginning-of-document token: {}; choose one with set_special_ids()", impl_->source,
            impl_->bos_note);
  }
  return *impl_->bos;
}

int32_t HFTokenizer::eos_id() const {
  if (!impl_->eos) {
    DS_FAIL("{} names no end-of-document token, which dstrain writes after every document: {}; add it to "
            "added_tokens with \"special\": true, or choose one with set_special_ids()",
            impl_->source, impl_->eos_note);
  }
  return *impl_->eos;
}

std::string HFTokenizer::name() const { return "hf:" + impl_->source; }

void HFTokenizer::set_special_ids(int32_t bos, int32_t eos) {
  for (const auto& [what, id] : {std::pair{"bos", bos}, std::pair{"eos", eos}}) {
    DS_CHECK(impl_->entry_of_id.count(id) == 1, "set_special_ids: {} id {} is not in the vocabulary of {}", what,
             id, impl_->source);
  }
  impl_->bos = bos;
  impl_->eos = eos;
}

void HFTokenizer::set_encode_special_tokens(bool as_text) { impl_->encode_special_as_text = as_text; }

std::optional<int32_t> HFTokenizer::token_to_id(std::string_view token) const {
  for (const AddedToken& t : impl_->added) {
    if (t.content == token) return t.id;
  }
  const auto it = impl_->vocab.find(token);
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string HFTokenizer::id_to_token(int32_t id) const {
  const auto it = impl_->entry_of_id.find(id);
  DS_CHECK(it != impl_->entry_of_id.end(), "token id {} is not in the vocabulary of {}", id, impl_->source);
  return impl_->entries[it->second].token;
}

const std::string& HFTokenizer::post_processor_type() const { return impl_->post_processor; }

std::unique_ptr<HFTokenizer> load_hf_tokenizer_from_json_text(std::string_view text, std::string source) {
  const json root = parse_json(text, source, kTokenizerJson);
  auto impl = std::make_unique<HFTokenizer::Impl>();
  impl->source = std::move(source);
  impl->load(root);
  return std::unique_ptr<HFTokenizer>(new HFTokenizer(std::move(impl)));
}

std::unique_ptr<HFTokenizer> load_hf_tokenizer(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::string file = path;
  if (fs::is_directory(path, ec)) {
    file = (fs::path(path) / "tokenizer.json").string();
    DS_CHECK(fs::is_regular_file(file, ec), "{} is a directory without a tokenizer.json; pass the model directory "
                                            "that has one, or the file itself", path);
  }
  return load_hf_tokenizer_from_json_text(read_text_file(file, kTokenizerJson.max_bytes, "tokenizer file"), file);
}

}  // namespace dstrain
