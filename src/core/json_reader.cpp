#include "core/json_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <regex>

#include "core/error.h"

namespace dstrain {
namespace {

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string type_of(const json& v) { return describe_json(v); }

// Refuses text nested deeper than the limit before it is parsed, naming where the limit is
// passed. Strings (and, when allowed, comments) are skipped: brackets inside them do not count.
void check_depth(std::string_view text, const std::string& source, const JsonLimits& limits, bool comments) {
  int depth = 0;
  int64_t line = 1, column_start = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\n') {
      ++line;
      column_start = int64_t(i) + 1;
    } else if (c == '"') {
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;
      }
    } else if (comments && c == '/' && i + 1 < text.size() && (text[i + 1] == '/' || text[i + 1] == '*')) {
      const bool block = text[i + 1] == '*';
      for (i += 2; i < text.size(); ++i) {
        if (text[i] == '\n') {
          ++line;
          column_start = int64_t(i) + 1;
          if (!block) break;
        }
        if (block && text[i] == '*' && i + 1 < text.size() && text[i + 1] == '/') {
          ++i;
          break;
        }
      }
    } else if (c == '[' || c == '{') {
      if (++depth > limits.max_depth) {
        throw Error(fmt::format("{}: arrays and objects nest deeper than {} levels (line {}, column {}), deeper than "
                                "{} ever needs; the file is corrupt or not {}",
                                source, limits.max_depth, line, int64_t(i) - column_start + 1, limits.what,
                                limits.what));
      }
    } else if (c == ']' || c == '}') {
      depth = std::max(0, depth - 1);
    }
  }
}

}  // namespace

std::string shown(std::string_view s, size_t limit) {
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < limit; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20 || c == 0x7F) {
      out += fmt::format("\\x{:02x}", c);
    } else {
      out += char(c);
    }
  }
  if (s.size() > limit) out += "...";
  return out + "\"";
}

std::string describe_json(const json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return std::string("boolean ") + (v.get<bool>() ? "true" : "false");
  if (v.is_number_integer()) return "integer " + v.dump();
  if (v.is_number()) return "number " + v.dump();
  if (v.is_string()) return "string " + shown(v.get_ref<const std::string&>());
  if (v.is_array()) return "an array";
  return "an object";
}

json parse_json(std::string_view text, const std::string& source, const JsonLimits& limits, bool comments) {
  if (int64_t(text.size()) > limits.max_bytes) {
    throw Error(fmt::format("{}: {} bytes of JSON, more than the {} MB that {} may take; the file is corrupt or not {}",
                            source, text.size(), limits.max_bytes / 1000000, limits.what, limits.what));
  }
  check_depth(text, source, limits, comments);
  try {
    return json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/true, comments);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for a number like 1e400
    throw Error(fmt::format("{}: not valid JSON: {}", source, e.what()));
  }
}

std::string read_text_file(const std::string& path, int64_t max_bytes, const std::string& what) {
  // Opened without blocking, so that a FIFO is refused instead of waiting for a writer.
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("cannot open {} '{}': {}; check the path", what, path, std::strerror(errno)));
  struct stat st {};
  const bool ok = ::fstat(fd, &st) == 0;
  if (!ok || !S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = !ok                   ? "unreadable"
                       : S_ISDIR(st.st_mode)  ? "a directory"
                       : S_ISFIFO(st.st_mode) ? "a FIFO"
                       : S_ISCHR(st.st_mode)  ? "a character device"
                       : S_ISSOCK(st.st_mode) ? "a socket"
                                              : "not a regular file";
    throw Error(fmt::format("{} '{}' is {}: give a regular file", what, path, kind));
  }
  if (int64_t(st.st_size) > max_bytes) {
    ::close(fd);
    throw Error(fmt::format("{} '{}' is {} bytes, more than the {} MB such a file may take; is it the right file?",
                            what, path, int64_t(st.st_size), max_bytes / 1000000));
  }
  std::string text(size_t(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      throw Error(fmt::format("reading {} '{}' failed after {} of {} bytes: {}", what, path, got, text.size(),
                              n == 0 ? "it became shorter while it was read" : std::strerror(err)));
    }
    got += size_t(n);
  }
  ::close(fd);
  return text;
}

// ---- JsonNode -------------------------------------------------------------------------------

void JsonNode::fail(const std::string& what) const {
  throw Error(fmt::format("{}: {} {}", *source_, path_.empty() ? "the top level" : path_, what));
}

void JsonNode::child_path_fail(const char* key, const std::string& what) const {
  throw Error(fmt::format("{}: {} {}", *source_, child_path(key), what));
}

void JsonNode::expect_object() const {
  if (!v_->is_object()) fail("must be a JSON object, got " + describe_json(*v_));
}

void JsonNode::expect_array() const {
  if (!v_->is_array()) fail("must be a JSON array, got " + describe_json(*v_));
}

JsonNode JsonNode::at(const char* key) const {
  expect_object();
  const auto it = v_->find(key);
  if (it == v_->end()) child_path_fail(key, "is required but missing");
  return JsonNode(*it, child_path(key), *source_);
}

std::optional<JsonNode> JsonNode::find(const char* key) const {
  expect_object();
  const auto it = v_->find(key);
  if (it == v_->end() || it->is_null()) return std::nullopt;
  return JsonNode(*it, child_path(key), *source_);
}

JsonNode JsonNode::element(size_t i) const { return JsonNode((*v_)[i], fmt::format("{}[{}]", path_, i), *source_); }

const std::string& JsonNode::str() const {
  if (!v_->is_string()) fail("must be a string, got " + describe_json(*v_));
  return v_->get_ref<const std::string&>();
}

bool JsonNode::boolean() const {
  if (!v_->is_boolean()) fail("must be true or false, got " + describe_json(*v_));
  return v_->get<bool>();
}

bool JsonNode::boolean_or(const char* key, bool fallback) const {
  const std::optional<JsonNode> n = find(key);
  return n ? n->boolean() : fallback;
}

int32_t JsonNode::id() const {
  if (!v_->is_number_integer()) fail("must be a token id (an integer), got " + describe_json(*v_));
  const bool ok = v_->is_number_unsigned() ? v_->get<uint64_t>() < uint64_t(INT32_MAX)
                                           : (v_->get<int64_t>() >= 0 && v_->get<int64_t>() < INT32_MAX);
  if (!ok) fail(fmt::format("must be a token id in [0, {}), got {}", INT32_MAX, v_->dump()));
  return static_cast<int32_t>(v_->get<int64_t>());
}

void JsonNode::only_keys(std::initializer_list<const char*> known) const {
  expect_object();
  for (auto it = v_->begin(); it != v_->end(); ++it) {
    if (std::none_of(known.begin(), known.end(), [&](const char* k) { return it.key() == k; })) {
      std::string list;
      for (const char* k : known) list += std::string(list.empty() ? "" : ", ") + k;
      child_path_fail(it.key().c_str(), "is not an option this loader knows (known: " + list +
                                            "); it may change how text is encoded, so the file is refused");
    }
  }
}

std::string JsonNode::type(std::initializer_list<const char*> supported) const {
  const std::string& t = at("type").str();
  if (std::none_of(supported.begin(), supported.end(), [&](const char* s) { return t == s; })) {
    std::string list;
    for (const char* s : supported) list += std::string(list.empty() ? "" : ", ") + s;
    child_path_fail("type", shown(t) + " is not supported; supported: " + list);
  }
  return t;
}

JsonReader::JsonReader(const json& object, std::string path, std::string source)
    : object_(object), path_(std::move(path)), source_(std::move(source)) {
  if (!object_.is_object()) {
    throw Error(fmt::format("config error in {}: '{}' must be a JSON object, got {}", source_,
                            path_.empty() ? "<top level>" : path_, type_of(object_)));
  }
}

std::string JsonReader::key_path(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

void JsonReader::error(const std::string& key, const std::string& what) const {
  throw Error(fmt::format("config error in {}: key '{}' {}", source_, key_path(key), what));
}

bool JsonReader::has(const std::string& key) const { return object_.contains(key); }
bool JsonReader::is_null(const std::string& key) const {
  used_.insert(key);
  return !object_.contains(key) || object_.at(key).is_null();
}

const json& JsonReader::value_of(const std::string& key) const {
  used_.insert(key);
  auto it = object_.find(key);
  if (it == object_.end()) error(key, "is required but missing");
  return *it;
}

const json& JsonReader::raw(const std::string& key) const { return value_of(key); }

void JsonReader::allow(std::initializer_list<const char*> keys) const {
  for (const char* k : keys) used_.insert(k);
}

namespace {
template <class T>
T convert(const JsonReader& r, const std::string& key, const json& v);

template <>
bool convert<bool>(const JsonReader& r, const std::string& key, const json& v) {
  if (!v.is_boolean()) r.error(key, "must be true or false, got " + type_of(v));
  return v.get<bool>();
}
template <>
double convert<double>(const JsonReader& r, const std::string& key, const json& v) {
  if (!v.is_number()) r.error(key, "must be a number, got " + type_of(v));
  return v.get<double>();
}
template <>
int64_t convert<int64_t>(const JsonReader& r, const std::string& key, const json& v) {
  if (v.is_number_float()) {
    double d = v.get<double>();
    if (d == double(int64_t(d))) return int64_t(d);  // 1e3 written for 1000
  }
  if (!v.is_number_integer()) r.error(key, "must be an integer, got " + type_of(v));
  return v.get<int64_t>();
}
template <>
int convert<int>(const JsonReader& r, const std::string& key, const json& v) {
  int64_t x = convert<int64_t>(r, key, v);
  if (x < INT32_MIN || x > INT32_MAX) r.error(key, "is out of range: " + v.dump());
  return int(x);
}
template <>
std::string convert<std::string>(const JsonReader& r, const std::string& key, const json& v) {
  if (!v.is_string()) r.error(key, "must be a string, got " + type_of(v));
  return v.get<std::string>();
}
template <>
std::vector<double> convert<std::vector<double>>(const JsonReader& r, const std::string& key, const json& v) {
  if (!v.is_array()) r.error(key, "must be an array of numbers, got " + type_of(v));
  std::vector<double> out;
  for (const auto& e : v) out.push_back(convert<double>(r, key, e));
  return out;
}
template <>
std::vector<int64_t> convert<std::vector<int64_t>>(const JsonReader& r, const std::string& key, const json& v) {
  if (!v.is_array()) r.error(key, "must be an array of integers, got " + type_of(v));
  std::vector<int64_t> out;
  for (const auto& e : v) out.push_back(convert<int64_t>(r, key, e));
  return out;
}
template <>
std::vector<std::string> convert<std::vector<std::string>>(const JsonReader& r, const std::string& key,
                                                           const json& v) {
  if (v.is_string()) return {v.get<std::string>()};  // one path may be given without brackets
  if (!v.is_array()) r.error(key, "must be a string or an array of strings, got " + type_of(v));
  std::vector<std::string> out;
  for (const auto& e : v) out.push_back(convert<std::string>(r, key, e));
  return out;
}
}  // namespace

template <class T>
T JsonReader::get(const std::string& key) const {
  return convert<T>(*this, key, value_of(key));
}

template <class T>
T JsonReader::get(const std::string& key, const T& fallback) const {
  used_.insert(key);
  auto it = object_.find(key);
  if (it == object_.end()) return fallback;
  return convert<T>(*this, key, *it);
}

#define DSTRAIN_INSTANTIATE(T)                                   \
  template T JsonReader::get<T>(const std::string&) const; \
  template T JsonReader::get<T>(const std::string&, const T&) const;
DSTRAIN_INSTANTIATE(bool)
DSTRAIN_INSTANTIATE(double)
DSTRAIN_INSTANTIATE(int64_t)
DSTRAIN_INSTANTIATE(int)
DSTRAIN_INSTANTIATE(std::string)
DSTRAIN_INSTANTIATE(std::vector<double>)
DSTRAIN_INSTANTIATE(std::vector<int64_t>)
DSTRAIN_INSTANTIATE(std::vector<std::string>)
#undef DSTRAIN_INSTANTIATE

JsonReader JsonReader::child(const std::string& key) const {
  const json& v = value_of(key);
  if (!v.is_object()) error(key, "must be an object, got " + type_of(v));
  return JsonReader(v, key_path(key), source_);
}

void JsonReader::done() const {
  for (const auto& [key, value] : object_.items()) {
    if (used_.count(key)) continue;
    std::string best;
    size_t best_d = 4;
    for (const auto& known : used_) {
      size_t d = edit_distance(key, known);
      if (d < best_d) {
        best_d = d;
        best = known;
      }
    }
    std::string hint = best.empty() ? "" : fmt::format(" (did you mean '{}'?)", key_path(best));
    throw Error(fmt::format("config error in {}: unknown key '{}'{}; remove it or fix its spelling", source_,
                            key_path(key), hint));
  }
}

namespace {

// nlohmann::json keeps the last of two equal keys without a word, and its parser reports no
// positions, so a second pass over the (already valid) text finds them with their lines.
// A duplicate usually means an edit that did not take effect: the first value is silently lost.
// `root` is the dotted path of the text's top level ("" for a file).
void check_unique_keys(const std::string& text, const std::string& source, const std::string& root = "") {
  struct Container {
    bool object = false;
    std::string path;                          // dotted path of this container ("" at the top)
    std::map<std::string, int64_t> key_lines;  // object: key -> line it was given on
    std::string key;                           // object: the key whose value comes next
    int64_t index = 0;                         // array: index of the element being read
  };
  std::vector<Container> stack;
  bool expect_key = false;
  int64_t line = 1;
  auto child_path = [&]() -> std::string {
    if (stack.empty()) return root;
    const Container& c = stack.back();
    if (!c.object) return fmt::format("{}[{}]", c.path, c.index);
    return c.path.empty() ? c.key : c.path + "." + c.key;
  };
  for (size_t i = 0; i < text.size(); ++i) {
    const char ch = text[i];
    if (ch == '\n') {
      ++line;
    } else if (ch == '/' && i + 1 < text.size() && (text[i + 1] == '/' || text[i + 1] == '*')) {
      const bool block = text[i + 1] == '*';
      for (i += 2; i < text.size(); ++i) {
        if (text[i] == '\n') {
          ++line;
          if (!block) break;
        }
        if (block && text[i] == '*' && i + 1 < text.size() && text[i + 1] == '/') {
          ++i;
          break;
        }
      }
    } else if (ch == '"') {
      const size_t begin = i;
      for (++i; i < text.size() && text[i] != '"'; ++i) {
        if (text[i] == '\\') ++i;
      }
      if (expect_key && !stack.empty() && stack.back().object) {
        Container& c = stack.back();
        // Decoded, so that a key spelled with escapes matches its plain spelling, as in the parser.
        c.key = json::parse(text.substr(begin, i + 1 - begin)).get<std::string>();
        const auto [it, inserted] = c.key_lines.emplace(c.key, line);
        if (!inserted) {
          throw Error(fmt::format("config error in {}: key '{}' is given twice, on lines {} and {}; only one value "
                                  "can apply, so remove the other",
                                  source, child_path(), it->second, line));
        }
        expect_key = false;
      }
    } else if (ch == '{' || ch == '[') {
      Container c;
      c.object = ch == '{';
      c.path = child_path();
      stack.push_back(std::move(c));
      expect_key = ch == '{';
    } else if (ch == '}' || ch == ']') {
      if (!stack.empty()) stack.pop_back();
      expect_key = false;
    } else if (ch == ',' && !stack.empty()) {
      if (stack.back().object) {
        expect_key = true;
      } else {
        ++stack.back().index;
      }
    }
  }
}

}  // namespace

void apply_override(json& root, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw Error(fmt::format("command line: --set expects KEY=VALUE (for example train.optimizer.params.lr=3e-4), got '{}'",
                            assignment));
  }
  const std::string key = assignment.substr(0, eq);
  const std::string text = assignment.substr(eq + 1);
  const std::string source = "command line --set " + key;
  json value;
  try {
    value = parse_json(text, source, kConfigJson);
  } catch (const Error&) {
    // Not JSON: a plain string, unless it was meant as an array or object (its error says
    // what is wrong) or is a number JSON cannot hold (1e400), which must not become a string.
    const size_t first = text.find_first_not_of(" \t\n");
    if (first != std::string::npos && (text[first] == '[' || text[first] == '{')) throw;
    static const std::regex number(R"(^\s*-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?\s*$)");
    if (std::regex_match(text, number)) {
      throw Error(fmt::format("{}: {} is out of the range of a number (a double: about 1.8e308 at most)", source,
                              text));
    }
    value = text;
  }
  if (!value.is_string()) {
    check_unique_keys(text, "command line --set " + key, key);
  }

  json* node = &root;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    std::string part = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (part.empty()) throw Error(fmt::format("command line: --set key '{}' has an empty component", key));
    if (!node->is_object()) {
      throw Error(fmt::format("command line: --set {}: '{}' is not an object in the configuration", key,
                              key.substr(0, start ? start - 1 : 0)));
    }
    if (dot == std::string::npos) {
      (*node)[part] = value;
      return;
    }
    if (!node->contains(part)) (*node)[part] = json::object();
    node = &(*node)[part];
    start = dot + 1;
  }
}

json read_json_file(const std::string& path, const JsonLimits& limits) {
  const std::string text = read_text_file(path, limits.max_bytes, limits.what);
  json parsed = parse_json(text, "'" + path + "'", limits, /*comments=*/true);
  check_unique_keys(text, path);
  return parsed;
}

}  // namespace dstrain
