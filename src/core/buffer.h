// Owning memory. Host memory is a Kokkos View; each buffer has a label and a category so
// memory can be accounted (parameters, gradients, optimizer state, activations, ...).
#pragma once

#include <Kokkos_Core.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor.h"

namespace dstrain {

enum class MemCategory { Parameters, Gradients, OptimizerState, Activations, Workspace, Data, Checkpoint, kCount };
std::string_view mem_category_name(MemCategory c);

// Bytes currently held per category by live Buffers of this process.
struct MemoryStats {
  std::array<int64_t, size_t(MemCategory::kCount)> bytes{};
  std::array<int64_t, size_t(MemCategory::kCount)> peak{};
  int64_t total() const;
};
MemoryStats memory_stats();

using HostBytes = Kokkos::View<unsigned char*, Kokkos::HostSpace>;

class Buffer {
 public:
  Buffer() = default;
  // Zero-filled (in parallel, so pages land near the threads that use them).
  Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device = Device::cpu());
  Buffer(Buffer&&) noexcept;
  Buffer& operator=(Buffer&&) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  bool allocated() const { return numel_ > 0 || view_.data() != nullptr; }
  void* data() const { return view_.data(); }
  template <class T>
  T* data() const { return tensor().data<T>(); }
  DType dtype() const { return dtype_; }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return size_t(numel_) * dtype_size(dtype_); }
  Device device() const { return device_; }
  MemCategory category() const { return category_; }
  std::string label() const { return view_.label(); }

  // The whole buffer as a 1-D tensor, or a piece of it with a shape.
  Tensor tensor() const { return Tensor(view_.data(), dtype_, Shape{numel_}, device_); }
  Tensor tensor(int64_t offset, Shape shape) const;
  void zero();

 private:
  void release();
  HostBytes view_;
  DType dtype_ = DType::F32;
  int64_t numel_ = 0;
  Device device_;
  MemCategory category_ = MemCategory::Workspace;
};

}  // namespace dstrain
