// Where a tensor's memory lives. Ops dispatch on this; buffers allocate with it.
#pragma once

#include <string>
#include <string_view>

namespace dstrain {

// CPU: host memory, the only memory host code may read (Tensor::data).
// CUDA: a GPU's memory, handed out by the CUDA backend's allocator.
// Emulated: host memory that dstrain treats as device memory. A test backend registers for it
// and runs the CPU kernels there, so that any code reading device tensors on the host fails.
// Meta: tensors with a shape and no memory (PyTorch's meta device). Its backend runs no op and
// its allocator hands out address space that is never committed, while the allocator's
// accounting counts every byte: the memory model (train/memory_model.h) runs the layers, the
// optimizer and the schedule on it to see what they would hold (backend/meta.h).
enum class DeviceType { CPU, CUDA, Emulated, Meta };
constexpr int kDeviceTypes = 4;

constexpr std::string_view device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::CUDA: return "cuda";
    case DeviceType::Emulated: return "emulated";
    case DeviceType::Meta: return "meta";
  }
  return "?";
}

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i) { return {DeviceType::CUDA, i}; }
  static Device emulated(int i = 0) { return {DeviceType::Emulated, i}; }
  static Device meta() { return {DeviceType::Meta, 0}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool operator==(const Device&) const = default;
  // "cpu", "cuda:1", "emulated:0"
  std::string str() const {
    return is_cpu() ? "cpu" : std::string(device_type_name(type)) + ":" + std::to_string(index);
  }
};

}  // namespace dstrain
