#include "core/buffer.h"

#include <algorithm>
#include <mutex>

namespace dstrain {
namespace {
std::mutex g_stats_mutex;
MemoryStats g_stats;                                // every device
std::array<MemoryStats, kDeviceTypes> g_device_stats;  // per device type

void add(MemoryStats& s, MemCategory c, int64_t delta) {
  auto i = size_t(c);
  s.bytes[i] += delta;
  if (s.bytes[i] > s.peak[i]) s.peak[i] = s.bytes[i];
  if (delta > 0) s.peak_total = std::max(s.peak_total, s.total());
}

void account(DeviceType d, MemCategory c, int64_t delta) {
  std::lock_guard lock(g_stats_mutex);
  add(g_stats, c, delta);
  add(g_device_stats[size_t(d)], c, delta);
}
}  // namespace

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::OptimizerState: return "optimizer_state";
    case MemCategory::GatheredParameters: return "gathered_parameters";
    case MemCategory::CommBuffers: return "comm_buffers";
    case MemCategory::Activations: return "activations";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::Data: return "data";
    case MemCategory::Checkpoint: return "checkpoint";
    case MemCategory::OffloadedActivations: return "offloaded_activations";
    case MemCategory::kCount: break;
  }
  return "?";
}

int64_t MemoryStats::total() const {
  int64_t t = 0;
  for (int64_t b : bytes) t += b;
  return t;
}

MemoryStats memory_stats() {
  std::lock_guard lock(g_stats_mutex);
  return g_stats;
}

MemoryStats memory_stats(DeviceType device) {
  std::lock_guard lock(g_stats_mutex);
  return g_device_stats[size_t(device)];
}

void reset_memory_peaks(DeviceType device) {
  std::lock_guard lock(g_stats_mutex);
  MemoryStats& s = g_device_stats[size_t(device)];
  s.peak = s.bytes;
  s.peak_total = s.total();
}

Buffer::Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device)
    : Buffer(std::move(label), category, dtype, numel, device, allocator_for(device)) {}

Buffer Buffer::pinned_host(std::string label, MemCategory category, DType dtype, int64_t numel) {
  return Buffer(std::move(label), category, dtype, numel, Device::cpu(), pinned_host_allocator());
}

Buffer Buffer::reserved(std::string label, MemCategory category, DType dtype, int64_t numel, Device device) {
  return Buffer(std::move(label), category, dtype, numel, device, allocator_for(device), /*reserve=*/true);
}

void memory_account(DeviceType device, MemCategory category, int64_t delta) { account(device, category, delta); }

Buffer::Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device,
               Allocator& allocator, bool reserve)
    : label_(std::move(label)), dtype_(dtype), numel_(numel), device_(device), category_(category), reserved_(reserve) {
  DS_CHECK(numel >= 0, "buffer '{}': negative size {}", label_, numel);
  DS_CHECK(allocator.device() == device.type, "buffer '{}': the {} allocator hands out {} memory, not memory on {}",
           label_, allocator.name(), device_type_name(allocator.device()), device.str());
  const size_t bytes = size_t(numel) * dtype_size(dtype);
  try {
    data_ = reserve ? allocator.reserve(device, bytes, label_) : allocator.allocate(device, bytes, label_);
  } catch (const OutOfMemory& e) {
    throw OutOfMemory(fmt::format("could not allocate {:.3f} GiB on {} for '{}' ({}): {}", double(bytes) / (1 << 30),
                                  device.str(), label_, mem_category_name(category), e.what()));
  }
  allocator_ = &allocator;
  if (!reserved_) account(device_.type, category_, int64_t(bytes));
}

Buffer::Buffer(Buffer&& o) noexcept
    : data_(o.data_),
      allocator_(o.allocator_),
      label_(std::move(o.label_)),
      dtype_(o.dtype_),
      numel_(o.numel_),
      device_(o.device_),
      category_(o.category_),
      reserved_(o.reserved_) {
  o.data_ = nullptr;
  o.allocator_ = nullptr;
  o.numel_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    allocator_ = o.allocator_;
    label_ = std::move(o.label_);
    dtype_ = o.dtype_;
    numel_ = o.numel_;
    device_ = o.device_;
    category_ = o.category_;
    reserved_ = o.reserved_;
    o.data_ = nullptr;
    o.allocator_ = nullptr;
    o.numel_ = 0;
  }
  return *this;
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
  if (allocator_ && reserved_) {
    allocator_->unreserve(device_, data_, nbytes());
  } else if (allocator_) {
    allocator_->free(device_, data_, nbytes());
    account(device_.type, category_, -int64_t(nbytes()));
  }
  reserved_ = false;
  data_ = nullptr;
  allocator_ = nullptr;
  numel_ = 0;
}

void Buffer::release_range(int64_t offset, int64_t numel) {
  DS_CHECK(offset >= 0 && numel >= 0 && offset + numel <= numel_, "buffer '{}': release of [{}, {}) outside its {} elements",
           label_, offset, offset + numel, numel_);
  if (numel == 0 || !allocator_) return;
  void* p = static_cast<unsigned char*>(data_) + size_t(offset) * dtype_size(dtype_);
  const size_t bytes = size_t(numel) * dtype_size(dtype_);
  if (reserved_) {
    allocator_->release_pages(device_, p, bytes);
  } else {
    allocator_->zero(device_, p, bytes);
  }
}

Tensor Buffer::tensor(int64_t offset, Shape shape) const {
  DS_CHECK(offset >= 0 && offset + shape.numel() <= numel_, "buffer '{}': [{}, {}) is outside its {} elements",
           label(), offset, offset + shape.numel(), numel_);
  return Tensor(static_cast<unsigned char*>(data_) + size_t(offset) * dtype_size(dtype_), dtype_, shape, device_);
}

void Buffer::zero() {
  if (!allocator_) return;
  if (reserved_) {
    allocator_->release_pages(device_, data_, nbytes());
  } else {
    allocator_->zero(device_, data_, nbytes());
  }
}

}  // namespace dstrain
