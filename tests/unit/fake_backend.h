// A second device for tests: the emulated device, host memory that dstrain must treat as device
// memory. It joins dstrain only through the public registration API, as a GPU backend would:
// an allocator (here) and an op table whose kernels are the CPU backend's, run on the same memory.
// Any code that reads a tensor on it on the host fails (Tensor::data refuses it).
#pragma once

#include <cstdint>

#include "core/device.h"

namespace dstrain::fake {

// Registers the emulated device's allocator unless one is registered; returns the device.
Device use_emulated_device();

// What the emulated device's allocator has handed out and not yet taken back.
struct EmulatedMemory {
  int64_t live_allocations = 0;
  int64_t live_bytes = 0;
  int64_t zero_calls = 0;
};
EmulatedMemory emulated_memory();

}  // namespace dstrain::fake
