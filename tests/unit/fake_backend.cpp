#include "fake_backend.h"

#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>

#include "core/allocator.h"
#include "core/error.h"

namespace dstrain::fake {
namespace {

std::mutex g_mutex;
EmulatedMemory g_memory;

// Plain aligned host memory, apart from the host allocator's, with counts of what is live so
// that tests see every buffer come back to the allocator it came from.
class EmulatedAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "emulated"; }
  DeviceType device() const override { return DeviceType::Emulated; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.type == DeviceType::Emulated, "the emulated allocator got a request for {}", device.str());
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw OutOfMemory(fmt::format("emulated device: no memory for {} bytes ('{}')", bytes, label));
    std::memset(p, 0, bytes);
    std::lock_guard lock(g_mutex);
    g_memory.live_allocations++;
    g_memory.live_bytes += int64_t(bytes);
    return p;
  }
  void free(Device, void* p, size_t bytes) override {
    if (!p) return;
    std::free(p);
    std::lock_guard lock(g_mutex);
    g_memory.live_allocations--;
    g_memory.live_bytes -= int64_t(bytes);
  }
  void zero(Device, void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
    std::lock_guard lock(g_mutex);
    g_memory.zero_calls++;
  }
};

}  // namespace

Device use_emulated_device() {
  static std::mutex once;
  std::lock_guard lock(once);
  if (!has_allocator(DeviceType::Emulated)) register_allocator(std::make_unique<EmulatedAllocator>());
  return Device::emulated(0);
}

EmulatedMemory emulated_memory() {
  std::lock_guard lock(g_mutex);
  return g_memory;
}

}  // namespace dstrain::fake
