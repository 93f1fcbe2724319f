#include "core/json_reader.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

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

std::string type_of(const json& v) {
  if (v.is_number_integer()) return "integer " + v.dump();
  if (v.is_number()) return "number " + v.dump();
  if (v.is_string()) return "string " + v.dump();
  if (v.is_boolean()) return "boolean " + v.dump();
  if (v.is_null()) return "null";
  if (v.is_array()) return "an array";
  return "an object";
}

}  // namespace

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
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) {
    value = text;
  } else {
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

json read_json_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("cannot open '{}': {}; check the path", path, std::strerror(errno)));
  std::stringstream ss;
  ss << in.rdbuf();
  json parsed;
  try {
    parsed = json::parse(ss.str(), nullptr, true, /*ignore_comments=*/true);
  } catch (const json::parse_error& e) {
    throw Error(fmt::format("'{}' is not valid JSON: {}", path, e.what()));
  }
  check_unique_keys(ss.str(), path);
  return parsed;
}

}  // namespace dstrain
