// Where Buffers get their bytes: one Allocator per device type, found by registration. Host
// memory is always there; pinned host memory (for transfers) has its own slot, the host
// allocator under its own name until a CUDA backend registers cudaHostAlloc there; a backend
// for another device type registers its allocator beside its op table. core/ never names a
// device's API.
#pragma once

#include <cstddef>
#include <memory>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/device.h"

namespace dstrain {

class Allocator {
 public:
  virtual ~Allocator() = default;
  // What logs and errors call it: "host", "pinned_host", "cuda", ...
  virtual std::string_view name() const = 0;
  // The type of device whose memory it hands out (CPU for pinned host memory).
  virtual DeviceType device() const = 0;
  // `bytes` of zero-filled memory on `device` (of this allocator's type); `label` names the
  // allocation for memory tools. Throws OutOfMemory when it does not fit. May return null for
  // 0 bytes.
  virtual void* allocate(Device device, size_t bytes, const std::string& label) = 0;
  // Returns memory from allocate (same device and size); null is ignored.
  virtual void free(Device device, void* p, size_t bytes) = 0;
  // Sets `bytes` bytes at p (memory from allocate) to zero.
  virtual void zero(Device device, void* p, size_t bytes) = 0;

  // Address space whose memory is committed page by page as it is first written, and handed
  // back by release_pages: ZeRO's gathered parameters and transient gradients live at their
  // offsets of a whole-model range while only the pieces in use hold memory. Reads of a page
  // never written, or released, give zeros. An allocator without such address space (the
  // default) commits everything at once: release_pages then only zeroes.
  virtual void* reserve(Device device, size_t bytes, const std::string& label) { return allocate(device, bytes, label); }
  virtual void unreserve(Device device, void* p, size_t bytes) { free(device, p, bytes); }
  // Zeroes [p, p + bytes) of reserved memory and returns the whole pages inside it.
  virtual void release_pages(Device device, void* p, size_t bytes) { zero(device, p, bytes); }

  // Bytes the device could still hand out now, to every process that shares it (the host: the
  // kernel's MemAvailable; a GPU: its free memory and what the allocator's pool holds unused);
  // -1 where unknown.
  virtual int64_t available_bytes(Device) const { return -1; }
};

// The allocator for memory on `device`. A device type with none registered is an error that
// names the device ("no allocator registered for cuda:0: this build has no CUDA backend").
Allocator& allocator_for(Device device);
bool has_allocator(DeviceType type);
// Page-locked host memory for transfers to and from a device.
Allocator& pinned_host_allocator();

// Registration, at start-up, by the backend of a device type. A second allocator for a type
// that has one is an error; the host allocator (CPU) cannot be replaced. Registering the
// pinned host allocator replaces the default one.
void register_allocator(std::unique_ptr<Allocator> allocator);
void register_pinned_host_allocator(std::unique_ptr<Allocator> allocator);
// Removes the allocator of a device type other than CPU (tests that register a fake device).
// Buffers it allocated stay valid and are returned to it when they are destroyed.
void unregister_allocator(DeviceType type);

}  // namespace dstrain
