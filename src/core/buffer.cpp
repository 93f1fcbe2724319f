#include "core/buffer.h"

#include <cstring>
#include <mutex>

namespace dstrain {
namespace {
std::mutex g_stats_mutex;
MemoryStats g_stats;

void account(MemCategory c, int64_t delta) {
  std::lock_guard lock(g_stats_mutex);
  auto i = size_t(c);
  g_stats.bytes[i] += delta;
  if (g_stats.bytes[i] > g_stats.peak[i]) g_stats.peak[i] = g_stats.bytes[i];
}

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
}  // namespace

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::Parameters: return "parameters";
    case MemCategory::Gradients: return "gradients";
    case MemCategory::OptimizerState: return "optimizer_state";
    case MemCategory::Activations: return "activations";
    case MemCategory::Workspace: return "workspace";
    case MemCategory::Data: return "data";
    case MemCategory::Checkpoint: return "checkpoint";
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

Buffer::Buffer(std::string label, MemCategory category, DType dtype, int64_t numel, Device device)
    : dtype_(dtype), numel_(numel), device_(device), category_(category) {
  DS_CHECK(device.is_cpu(), "buffer '{}': host buffers only; device memory comes from the CUDA backend", label);
  DS_CHECK(numel >= 0, "buffer '{}': negative size {}", label, numel);
  const size_t bytes = size_t(numel) * dtype_size(dtype);
  try {
    view_ = HostBytes(Kokkos::view_alloc(Kokkos::WithoutInitializing, label), bytes);
  } catch (const std::exception& e) {
    throw OutOfMemory(fmt::format("could not allocate {:.3f} GiB for '{}' ({}): {}", double(bytes) / (1 << 30), label,
                                  mem_category_name(category), e.what()));
  }
  parallel_zero(view_.data(), bytes);
  account(category_, int64_t(bytes));
}

Buffer::Buffer(Buffer&& o) noexcept
    : view_(std::move(o.view_)), dtype_(o.dtype_), numel_(o.numel_), device_(o.device_), category_(o.category_) {
  o.view_ = HostBytes();
  o.numel_ = 0;
}

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    view_ = std::move(o.view_);
    dtype_ = o.dtype_;
    numel_ = o.numel_;
    device_ = o.device_;
    category_ = o.category_;
    o.view_ = HostBytes();
    o.numel_ = 0;
  }
  return *this;
}

Buffer::~Buffer() { release(); }

void Buffer::release() {
  if (view_.data() != nullptr || numel_ > 0) account(category_, -int64_t(nbytes()));
  view_ = HostBytes();
  numel_ = 0;
}

Tensor Buffer::tensor(int64_t offset, Shape shape) const {
  DS_CHECK(offset >= 0 && offset + shape.numel() <= numel_, "buffer '{}': [{}, {}) is outside its {} elements",
           label(), offset, offset + shape.numel(), numel_);
  return Tensor(static_cast<unsigned char*>(view_.data()) + size_t(offset) * dtype_size(dtype_), dtype_, shape,
                device_);
}

void Buffer::zero() { parallel_zero(view_.data(), nbytes()); }

}  // namespace dstrain
