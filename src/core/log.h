// Logging for an SPMD program: rank 0 speaks for the job, every other rank's lines carry
// a "[rank r]" prefix so interleaved batch logs stay readable.
#pragma once

#include <fmt/format.h>

#include <string>

namespace dstrain::log {

void set_rank(int rank, int world_size);
int rank();

// Rank 0 only.
void info_line(const std::string& line);
// Every rank, prefixed with its rank when the job has more than one.
void any_line(const std::string& line);
void warn_line(const std::string& line);
void error_line(const std::string& line);

template <class... A>
void info(fmt::format_string<A...> f, A&&... a) { info_line(fmt::format(f, std::forward<A>(a)...)); }
template <class... A>
void any(fmt::format_string<A...> f, A&&... a) { any_line(fmt::format(f, std::forward<A>(a)...)); }
template <class... A>
void warn(fmt::format_string<A...> f, A&&... a) { warn_line(fmt::format(f, std::forward<A>(a)...)); }

}  // namespace dstrain::log
