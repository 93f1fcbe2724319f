// Strict reading of JSON configuration: every key is typed, every unknown key is an error
// that names the file, the dotted key and the closest known key.
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <set>
#include <string>
#include <vector>

namespace dstrain {

using json = nlohmann::json;

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
// (numbers, true/false, null, arrays, objects) and taken as a string otherwise.
void apply_override(json& root, const std::string& assignment);

// Reads and parses a JSON file; errors name the file, line and column.
json read_json_file(const std::string& path);

}  // namespace dstrain
