// A second device and backend for tests: the emulated device, host memory that dstrain must treat
// as device memory, and the "fake" backend for it. They join dstrain only through the public
// registration APIs (core/allocator.h, backend/backend.h), as a GPU backend would: an allocator,
// and an op table whose kernels are the CPU backend's, run on the same memory with the tensors
// re-tagged as host tensors inside. Any code that reads one of its tensors on the host fails
// (Tensor::data refuses it). A few ops also get bf16 or f16 kernels (fp32 kernels run on widened
// copies), so that the per-dtype slots of the table are exercised too.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/device.h"

namespace dstrain::fake {

// Registers the emulated device's allocator unless one is registered; returns the device.
Device use_emulated_device();
// Registers the allocator and the fake backend unless they are registered; returns the device.
Device use_fake_backend();

// From now on the fake backend corrupts the first tensor argument of `op` after running it
// (an empty name: no op). The op suite must then report that op as failing.
void perturb_op(std::string_view op);

// What the emulated device's allocator has handed out and not yet taken back.
struct EmulatedMemory {
  int64_t live_allocations = 0;
  int64_t live_bytes = 0;
  int64_t zero_calls = 0;
};
EmulatedMemory emulated_memory();

}  // namespace dstrain::fake
