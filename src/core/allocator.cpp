#include "core/allocator.h"

#include <Kokkos_Core.hpp>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <vector>

#include "core/error.h"

namespace dstrain {
namespace {

void parallel_zero(void* p, size_t bytes) {
  auto* c = static_cast<unsigned char*>(p);
  const size_t chunk = size_t(1) << 20;
  const int64_t n = int64_t((bytes + chunk - 1) / chunk);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    size_t b = size_t(i) * chunk;
    std::memset(c + b, 0, std::min(chunk, bytes - b));
  }
}

// Kokkos HostSpace memory (labelled for Kokkos' memory tools), zero-filled in parallel so that
// pages land near the threads that use them.
class HostAllocator final : public Allocator {
 public:
  explicit HostAllocator(std::string_view name) : name_(name) {}
  std::string_view name() const override { return name_; }
  DeviceType device() const override { return DeviceType::CPU; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.is_cpu(), "the {} allocator hands out host memory, not memory on {}", name_, device.str());
    void* p = nullptr;
    try {
      p = Kokkos::kokkos_malloc<Kokkos::HostSpace>(label, bytes);
    } catch (const std::exception& e) {
      throw OutOfMemory(e.what());
    }
    parallel_zero(p, bytes);
    return p;
  }
  void free(Device, void* p, size_t) override { Kokkos::kokkos_free<Kokkos::HostSpace>(p); }
  void zero(Device, void* p, size_t bytes) override { parallel_zero(p, bytes); }

  // Anonymous private mappings: the kernel commits a zero page at the first write and takes
  // it back at madvise(MADV_DONTNEED), after which it reads as zeros again.
  void* reserve(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.is_cpu(), "the {} allocator hands out host memory, not memory on {}", name_, device.str());
    if (bytes == 0) return nullptr;
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw OutOfMemory(fmt::format("reserving {} bytes of address space for '{}' failed: {}", bytes, label,
                                    std::strerror(errno)));
    }
    return p;
  }
  void unreserve(Device, void* p, size_t bytes) override {
    if (p) ::munmap(p, bytes);
  }
  int64_t available_bytes(Device) const override {
    std::ifstream meminfo("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    std::string unit;
    while (meminfo >> key >> kib) {
      std::getline(meminfo, unit);
      if (key == "MemAvailable:") return kib * 1024;
    }
    return -1;
  }
  void release_pages(Device, void* p, size_t bytes) override {
    static const size_t page = size_t(::sysconf(_SC_PAGESIZE));
    auto* b = static_cast<unsigned char*>(p);
    unsigned char* e = b + bytes;
    auto* pb = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(b) + page - 1) / page * page);
    auto* pe = reinterpret_cast<unsigned char*>(reinterpret_cast<uintptr_t>(e) / page * page);
    if (pb >= pe) {
      std::memset(b, 0, bytes);
      return;
    }
    std::memset(b, 0, size_t(pb - b));  // the partial pages at the ends are shared with neighbours
    std::memset(pe, 0, size_t(e - pe));
    DS_CHECK(::madvise(pb, size_t(pe - pb), MADV_DONTNEED) == 0, "madvise(MADV_DONTNEED) failed: {}",
             std::strerror(errno));
  }

 private:
  std::string name_;
};

std::string missing_backend_hint(DeviceType type) {
  switch (type) {
    case DeviceType::CUDA: return "this build has no CUDA backend";
    case DeviceType::Emulated: return "the emulated device exists only in tests that register its backend";
    case DeviceType::Meta: return "the meta device is registered by the memory model (backend/meta.h)";
    case DeviceType::CPU: break;
  }
  return "this build has no backend for it";
}

struct Registry {
  std::mutex mutex;
  std::array<Allocator*, kDeviceTypes> by_type{};
  Allocator* pinned = nullptr;
  // Every allocator ever registered, kept until exit: buffers from an unregistered or replaced
  // allocator are still returned to it.
  std::vector<std::unique_ptr<Allocator>> owned;

  Registry() {
    owned.push_back(std::make_unique<HostAllocator>("host"));
    by_type[size_t(DeviceType::CPU)] = owned.back().get();
    owned.push_back(std::make_unique<HostAllocator>("pinned_host"));
    pinned = owned.back().get();
  }
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

Allocator& allocator_for(Device device) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  Allocator* a = r.by_type[size_t(device.type)];
  DS_CHECK(a, "no allocator registered for {}: {}", device.str(), missing_backend_hint(device.type));
  return *a;
}

bool has_allocator(DeviceType type) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return r.by_type[size_t(type)] != nullptr;
}

Allocator& pinned_host_allocator() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  return *r.pinned;
}

void register_allocator(std::unique_ptr<Allocator> allocator) {
  DS_CHECK(allocator, "register_allocator: no allocator");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  Allocator*& slot = r.by_type[size_t(allocator->device())];
  DS_CHECK(!slot, "an allocator for {} memory is already registered ('{}'); '{}' cannot register for it too",
           device_type_name(allocator->device()), slot->name(), allocator->name());
  r.owned.push_back(std::move(allocator));
  slot = r.owned.back().get();
}

void register_pinned_host_allocator(std::unique_ptr<Allocator> allocator) {
  DS_CHECK(allocator, "register_pinned_host_allocator: no allocator");
  DS_CHECK(allocator->device() == DeviceType::CPU, "pinned host allocator '{}' hands out {} memory, not host memory",
           allocator->name(), device_type_name(allocator->device()));
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.owned.push_back(std::move(allocator));
  r.pinned = r.owned.back().get();
}

void unregister_allocator(DeviceType type) {
  DS_CHECK(type != DeviceType::CPU, "the host allocator cannot be unregistered");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.by_type[size_t(type)] = nullptr;
}

}  // namespace dstrain
