// How the CPU kernels share their loops among OpenMP threads.
//
// Loops run in dynamic chunks of a few microseconds of work: when the CPU is shared with other
// work (other jobs, more ranks than cores) a thread often waits for a time slice, and with a
// static split the whole op waits for that thread's half; with chunks the running threads take
// its share. Every element is computed the same way whichever thread computes it, so results do
// not depend on the schedule. Loops over fewer than kParallelMinWork elements stay on the calling
// thread: starting a team costs more than they take.
#pragma once

#include <cstdint>

namespace dstrain::cpu {

constexpr int64_t kParallelMinWork = int64_t(1) << 14;

}  // namespace dstrain::cpu
