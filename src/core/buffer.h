// Owning memory, on any device: each buffer takes its bytes from the allocator registered for
// its device (core/allocator.h) and has a label and a category so that memory can be accounted
// (parameters, gradients, optimizer state, activations, ...) per device.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "core/allocator.h"
#include "core/tensor.h"

namespace dstrain {

// GatheredParameters: ZeRO-3's whole weights while a layer uses them; CommBuffers: memory that
// only carries data between ranks; OffloadedActivations: activations kept in host memory
// instead of the device's (cpu_checkpointing: the inputs of recomputed layers).
enum class MemCategory {
  Parameters,
  Gradients,
  OptimizerState,
  GatheredParameters,
  CommBuffers,
  Activations,
  Workspace,
  Data,
  Checkpoint,
  OffloadedActivations,
  kCount
};
std::string_view mem_category_name(MemCategory c);

// Bytes currently held per category by live Buffers of this process: on every device
// together, or on one type of device (pinned host memory counts as CPU).
struct MemoryStats {
  std::array<int64_t, size_t(MemCategory::kCount)> bytes{};
  std::array<int64_t, size_t(MemCategory::kCount)> peak{};  // each category's own peak
  int64_t peak_total = 0;  // the peak of all categories together (not the sum of their peaks)
  int64_t total() const;
};
MemoryStats memory_stats();
MemoryStats memory_stats(DeviceType device);
// Starts the peaks of one device type again from what it holds now.
void reset_memory_peaks(DeviceType device);
// Accounts memory that Buffers cannot see for themselves: the pages of a reserved buffer that
// are in use (its owner knows which). delta may be negative.
void memory_account(DeviceType device, MemCategory category, int64_t delta);

class Buffer {
 public:
  Buffer() = default;
  // Zero-filled, from the allocator registered for `device`.
  Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device = Device::cpu());
  // Zero-filled page-locked host memory (for transfers to and from a device).
  static Buffer pinned_host(std::string label, MemCategory category, DType dtype, int64_t numel);
  // Reserved address space for numel elements (Allocator::reserve): memory is committed where
  // it is written and handed back by release_range. It reads as zeros. The buffer accounts no
  // bytes itself; its owner accounts the parts in use (memory_account).
  static Buffer reserved(std::string label, MemCategory category, DType dtype, int64_t numel,
                         Device device = Device::cpu());
  bool is_reserved() const { return reserved_; }
  // Zeroes elements [offset, offset + numel); in a reserved buffer the whole pages inside are
  // handed back as well.
  void release_range(int64_t offset, int64_t numel);
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  bool allocated() const { return numel_ > 0 || data_ != nullptr; }
  void* data() const { return data_; }
  template <class T>
  T* data() const { return tensor().data<T>(); }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return size_t(numel_) * dtype_size(dtype_); }
  Device device() const { return device_; }
  MemCategory category() const { return category_; }
  const std::string& label() const { return label_; }
  // The allocator it came from ("host", "pinned_host", "cuda", ...); null when unallocated.
  const Allocator* allocator() const { return allocator_; }

  // The whole buffer as a 1-D tensor, or a piece of it with a shape.
  Tensor tensor() const { return Tensor(data_, dtype_, Shape{numel_}, device_); }
  Tensor tensor(int64_t offset, Shape shape) const;
  void zero();

 private:
  Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device, Allocator& allocator,
         bool reserve = false);
  void release();
  void* data_ = nullptr;
  Allocator* allocator_ = nullptr;
  std::string label_;
  DType dtype_ = DType::F32;
  int64_t numel_ = 0;
  Device device_;
  MemCategory category_ = MemCategory::Workspace;
  bool reserved_ = false;
};

}  // namespace dstrain
