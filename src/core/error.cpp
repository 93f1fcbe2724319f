#include "core/error.h"

#include <cstring>

namespace dstrain::detail {

void fail(const char* file, int line, const char* condition, const std::string& message) {
  const char* base = std::strrchr(file, '/');
  base = base ? base + 1 : file;
  if (condition) {
    throw Error(fmt::format("{}\n  (check `{}` failed at {}:{})", message, condition, base, line));
  }
  throw Error(fmt::format("{}\n  (at {}:{})", message, base, line));
}

}  // namespace dstrain::detail
