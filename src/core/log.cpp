#include "core/log.h"

#include <cstdio>
#include <mutex>

namespace dstrain::log {
namespace {
int g_rank = 0;
int g_world = 1;
std::mutex g_mutex;

void emit(std::FILE* stream, const std::string& tag, const std::string& text) {
  std::lock_guard lock(g_mutex);
  std::string prefix = g_world > 1 && g_rank != 0 ? fmt::format("[rank {}] ", g_rank) : std::string();
  // Multi-line messages keep the prefix on every line.
  size_t start = 0;
  while (start <= text.size()) {
    size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::fprintf(stream, "%s%s%.*s\n", prefix.c_str(), tag.c_str(), int(end - start), text.data() + start);
    if (end == text.size()) break;
    start = end + 1;
  }
  std::fflush(stream);
}
}  // namespace

void set_rank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}
int rank() { return g_rank; }

void info_line(const std::string& line) {
  if (g_rank == 0) emit(stdout, "", line);
}
void any_line(const std::string& line) { emit(stdout, "", line); }
void warn_line(const std::string& line) { emit(stderr, "warning: ", line); }
void error_line(const std::string& line) { emit(stderr, "error: ", line); }

}  // namespace dstrain::log
