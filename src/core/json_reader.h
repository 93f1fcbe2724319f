// Every JSON text dstrain reads (run configurations, config.json, safetensors headers,
// tokenizer.json, checkpoint metadata, lock files, JSONL documents) is parsed here, within
// limits on its size and nesting, with errors that name where it came from. Configuration is
// then read strictly: every key is typed, and an unknown key is an error that names the file,
// the dotted key and the closest known key (JsonReader); other files are read through JsonNode,
// whose errors name the file and the key path.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

using json = nlohmann::json;

// How large a JSON text may be and how deeply its arrays and objects may nest. Both are checked
// before it is parsed: a huge or hostile file must fail with a message, not exhaust memory or
// the stack (a parser, and the code that walks or prints what it parsed, grow with the depth).
struct JsonLimits {
  int64_t max_bytes = 0;
  int max_depth = 0;
  const char* what = "";  // what the text is, for the message: "a run configuration"
};
// Run configurations and Hugging Face config.json: written by hand, small.
inline constexpr JsonLimits kConfigJson{int64_t(16) << 20, 64, "a configuration file"};
// tokenizer.json: large vocabularies and merges (DeepSeek-V3's is 7.8 MB).
inline constexpr JsonLimits kTokenizerJson{int64_t(512) << 20, 64, "a tokenizer.json"};
// A safetensors header: the format's own limit (100 MB in the reference implementation).
inline constexpr JsonLimits kSafetensorsHeaderJson{100'000'000, 64, "a safetensors header"};
// What dstrain writes for itself (checkpoint metadata, safetensors index files, lock files)
// and data documents: read back, but from files a user may have touched.
inline constexpr JsonLimits kDataJson{int64_t(256) << 20, 64, "JSON data"};

// Parses `text`, which came from `source` (a file, "command line --set KEY", "'ckpt.h5'
// /scheduler@json"). Comments (// and /* */) are allowed when `comments`. Errors name the
// source and, for syntax, the line and column.
json parse_json(std::string_view text, const std::string& source, const JsonLimits& limits, bool comments = false);

// The bytes of a regular file of at most max_bytes: a FIFO, a device or a directory is
// refused (it could block forever or never end), and so is a larger file. `what` names the
// file's role in the message ("configuration file").
std::string read_text_file(const std::string& path, int64_t max_bytes, const std::string& what);

// The first part of a string for messages: quoted, escaped, and cut short.
std::string shown(std::string_view s, size_t limit = 80);
// A JSON value for messages: its type and (short) value, e.g. `string "x"`, `an array`.
std::string describe_json(const json& v);

// A JSON value and the key path that reached it ("model.merges[3]"), for files that are read
// strictly but are not configuration (tokenizer.json): every error names the file and the key.
class JsonNode {
 public:
  JsonNode(const json& value, std::string path, const std::string& source)
      : v_(&value), path_(std::move(path)), source_(&source) {}

  const json& value() const { return *v_; }
  const std::string& path() const { return path_; }
  bool is_null() const { return v_->is_null(); }

  // "SOURCE: PATH WHAT"
  [[noreturn]] void fail(const std::string& what) const;
  void expect_object() const;
  void expect_array() const;

  // A required member of an object.
  JsonNode at(const char* key) const;
  // An optional member: absent or null gives nullopt.
  std::optional<JsonNode> find(const char* key) const;
  JsonNode element(size_t i) const;
  size_t size() const { return v_->size(); }

  const std::string& str() const;
  bool boolean() const;
  bool boolean_or(const char* key, bool fallback) const;
  // A token id: an integer in [0, 2^31 - 1).
  int32_t id() const;

  // Every key must be one of `known`: an option the reader does not interpret is refused.
  void only_keys(std::initializer_list<const char*> known) const;
  // The "type" member, one of `supported`.
  std::string type(std::initializer_list<const char*> supported) const;

 private:
  std::string child_path(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  [[noreturn]] void child_path_fail(const char* key, const std::string& what) const;

  const json* v_;
  std::string path_;
  const std::string* source_;
};

class JsonReader {
 public:
  // `path` is the dotted prefix of this object ("train.optimizer"), `source` names where
  // the JSON came from (a file, or "command line").
  JsonReader(const json& object, std::string path, std::string source);

  bool has(const std::string& key) const;
  bool is_null(const std::string& key) const;

  template <class T>
  T get(const std::string& key) const;                 // required key
  template <class T>
  T get(const std::string& key, const T& fallback) const;  // optional key

  // Keys that are accepted and deliberately without effect (metadata such as
  // "transformers_version"): marked as known so done() does not reject them.
  void allow(std::initializer_list<const char*> keys) const;

  JsonReader child(const std::string& key) const;  // required object
  const json& raw(const std::string& key) const;   // marks the key as used

  // Throws for the first key never read or allowed.
  void done() const;

  std::string key_path(const std::string& key) const;
  [[noreturn]] void error(const std::string& key, const std::string& what) const;
  const std::string& source() const { return source_; }

 private:
  const json& value_of(const std::string& key) const;
  const json& object_;
  std::string path_;
  std::string source_;
  mutable std::set<std::string> used_;
};

// Applies "a.b.c=value" to a JSON tree. The value is parsed as JSON when it is valid JSON
// (numbers, true/false, null, arrays, objects) and taken as a string otherwise; a number out of
// a double's range (1e400) is an error.
void apply_override(json& root, const std::string& assignment);

// Reads and parses a JSON file written by hand (a run configuration, config.json): comments are
// allowed, and a key given twice in one object is an error; errors name the file, line and
// column. The file must be a regular file within `limits`.
json read_json_file(const std::string& path, const JsonLimits& limits = kConfigJson);

}  // namespace dstrain
