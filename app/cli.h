// Command-line checks shared by dstrain, dstrain-prep and dstrain-ckpt: every bad command line
// ends with status 2 and one line naming the option, the value given and what it accepts.
#pragma once

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace dstrain::cli {

inline constexpr int kExitBadCommandLine = 2;

// An integer in [min, max]. CLI11's own range check prints the bounds of a double (a 309-digit
// number) and accepts 2.5 where a count is meant.
inline CLI::Validator integer_in(int64_t min, int64_t max = INT64_MAX) {
  const std::string range = max == INT64_MAX ? fmt::format("an integer >= {}", min)
                                             : fmt::format("an integer from {} to {}", min, max);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        int64_t v = 0;
        const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
        if (ec != std::errc() || end != text.data() + text.size() || v < min || v > max) {
          return fmt::format("expects {}, got '{}'", range, text);
        }
        return {};
      },
      range);
}

// A finite number >= min: nan and inf pass every comparison-based check and reach the maths.
inline CLI::Validator finite_at_least(double min) {
  const std::string range = fmt::format("a finite number >= {}", min);
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        size_t used = 0;
        double v = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !std::isfinite(v) || v < min) {
          return fmt::format("expects {}, got '{}'", range, text);
        }
        return {};
      },
      range);
}

// One of a fixed list of words.
inline CLI::Validator one_of(std::vector<std::string> allowed) {
  std::string list;
  for (size_t i = 0; i < allowed.size(); ++i) list += (i ? ", " : "") + allowed[i];
  return CLI::Validator(
      [=](std::string& text) -> std::string {
        for (const std::string& a : allowed) {
          if (text == a) return {};
        }
        return fmt::format("expects one of {}, got '{}'", list, text);
      },
      "one of " + list);
}

// Reports a parse error and returns the exit status: 0 after --help, 2 otherwise. `usage` is
// the command whose --help lists the options ("dstrain train"). When `quiet`, nothing is
// printed (the other ranks of an MPI job, so the line appears once).
inline int report(const CLI::App& app, const CLI::ParseError& e, const std::string& program,
                  const std::string& usage, bool quiet = false) {
  if (e.get_exit_code() == 0) return quiet ? 0 : app.exit(e);
  if (!quiet) {
    fmt::print(stderr, "{}: error: {}\nRun '{} --help' for the options.\n", program, e.what(), usage);
  }
  return kExitBadCommandLine;
}

// The same for a check made after parsing (options that exclude each other, a missing file).
inline int report(const std::string& program, const std::string& message, const std::string& usage,
                  bool quiet = false) {
  if (!quiet) fmt::print(stderr, "{}: error: {}\nRun '{} --help' for the options.\n", program, message, usage);
  return kExitBadCommandLine;
}

}  // namespace dstrain::cli
