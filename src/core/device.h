// Where a tensor's memory lives. Ops dispatch on this; buffers allocate with it.
#pragma once

#include <string>
#include <string_view>

namespace dstrain {

// CPU: host memory, the only memory host code may read (Tensor::data).
// CUDA: a GPU's memory, handed out by the CUDA backend's allocator.
// Emulated: host memory that dstrain treats as device memory. A test backend registers for it
// and runs the CPU kernels there, so that any code reading device tensors on the host fails.
enum class DeviceType { CPU, CUDA, Emulated };
constexpr int kDeviceTypes = 3;

constexpr std::string_view device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU: return "cpu";
    case DeviceType::CUDA: return "cuda";
    case DeviceType::Emulated: return "emulated";
  }
  return "?";
}

struct Device {
  DeviceType type = DeviceType::CPU;
  int index = 0;

  static Device cpu() { return {DeviceType::CPU, 0}; }
  static Device cuda(int i) { return {DeviceType::CUDA, i}; }
  static Device emulated(int i = 0) { return {DeviceType::Emulated, i}; }
  bool is_cpu() const { return type == DeviceType::CPU; }
  bool operator==(const Device&) const = default;
  // "cpu", "cuda:1", "emulated:0"
  std::string str() const {
    return is_cpu() ? "cpu" : std::string(device_type_name(type)) + ":" + std::to_string(index);
  }
};

}  // namespace dstrain
