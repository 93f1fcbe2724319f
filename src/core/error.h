// dstrain's one family of checks. A failure names what went wrong, where, and what to do;
// the top level adds the rank and ends every rank (see app/dstrain.cpp).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dstrain {

// An error dstrain reports to its user: bad input, a missing file, a broken invariant.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An allocation that did not fit: the trainer can retry with a smaller micro-batch.
class OutOfMemory : public Error {
 public:
  using Error::Error;
};

namespace detail {
[[noreturn]] void fail(const char* file, int line, const char* condition, const std::string& message);
}  // namespace detail

}  // namespace dstrain

// DS_CHECK(cond, "format {}", args...): throws dstrain::Error with the message, the failed
// condition and its source location when cond is false.
#define DS_CHECK(cond, ...)                                                        \
  do {                                                                             \
    if (!(cond)) [[unlikely]] {                                                    \
      ::dstrain::detail::fail(__FILE__, __LINE__, #cond, fmt::format(__VA_ARGS__)); \
    }                                                                              \
  } while (0)

// DS_FAIL("format {}", args...): throws unconditionally.
#define DS_FAIL(...) ::dstrain::detail::fail(__FILE__, __LINE__, nullptr, fmt::format(__VA_ARGS__))
