// The CUDA device: its allocators, the backend's registration and what the run prints about
// the GPU (backend/cuda_device.h).
#include <cublasLt.h>
#include <nccl.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda_device.h"
#include "backend/timing.h"
#include "core/allocator.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// Device memory, stream-ordered (cudaMallocAsync's pool): allocations and frees are cheap and
// ordered with the kernels that use them. Zero-filled as core/allocator.h requires.
class DeviceAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "cuda"; }
  DeviceType device() const override { return DeviceType::CUDA; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.type == DeviceType::CUDA, "the cuda allocator hands out GPU memory, not memory on {}",
             device.str());
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t e = cudaMallocAsync(&p, bytes, stream());
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      (void)cudaMemGetInfo(&free_b, &total_b);
      throw OutOfMemory(fmt::format("out of GPU memory on {}: {} needs {:.1f} MiB, {:.1f} of {:.1f} MiB free",
                                    device.str(), label, bytes / 1048576.0, free_b / 1048576.0,
                                    total_b / 1048576.0));
    }
    DS_CUDA_CHECK(e);
    DS_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
    return p;
  }
  void free(Device, void* p, size_t) override {
    if (p) DS_CUDA_CHECK(cudaFreeAsync(p, stream()));
  }
  void zero(Device, void* p, size_t bytes) override {
    if (p && bytes) DS_CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, stream()));
  }
  // The device's free memory and what cudaMallocAsync's pool holds without handing it out.
  int64_t available_bytes(Device device) const override {
    size_t free_b = 0, total_b = 0;
    DS_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    cudaMemPool_t pool = nullptr;
    DS_CUDA_CHECK(cudaDeviceGetMemPool(&pool, device.index));
    uint64_t reserved = 0, used = 0;  // the attributes are cuuint64_t, a 64-bit unsigned integer
    DS_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved));
    DS_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    return int64_t(free_b) + int64_t(reserved > used ? reserved - used : 0);
  }
};

// Page-locked host memory: transfers to and from the GPU run at full speed and asynchronously.
class PinnedAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "pinned_host"; }
  DeviceType device() const override { return DeviceType::CPU; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.is_cpu(), "the pinned_host allocator hands out host memory, not memory on {}", device.str());
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    const cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocPortable);
    if (e == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();
      throw OutOfMemory(fmt::format("cannot pin {:.1f} MiB of host memory for {}", bytes / 1048576.0, label));
    }
    DS_CUDA_CHECK(e);
    std::memset(p, 0, bytes);
    return p;
  }
  void free(Device, void* p, size_t) override {
    if (p) DS_CUDA_CHECK(cudaFreeHost(p));
  }
  void zero(Device, void* p, size_t bytes) override { std::memset(p, 0, bytes); }
};

// Timing marks as events recorded on dstrain's stream, from a pool that every round reuses: a
// mark costs an event record, and the round's times are read after one wait, for its last event
// (the stream reaches the events in order).
class EventMarkClock final : public MarkClock {
 public:
  ~EventMarkClock() override {
    for (cudaEvent_t e : events_) (void)cudaEventDestroy(e);  // at exit the runtime may be gone
  }
  int mark() override {
    if (used_ == events_.size()) {
      cudaEvent_t e = nullptr;
      DS_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
    DS_CUDA_CHECK(cudaEventRecord(events_[used_], stream()));
    waited_ = false;
    return int(used_++);
  }
  double seconds(int from, int to) override {
    DS_CHECK(0 <= from && from <= to && size_t(to) < used_, "timing marks {} to {} of a round of {}", from, to,
             used_);
    if (!waited_) {
      DS_CUDA_CHECK(cudaEventSynchronize(events_[used_ - 1]));
      waited_ = true;
    }
    float ms = 0;
    DS_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[size_t(from)], events_[size_t(to)]));
    return double(ms) * 1e-3;
  }
  void restart() override {
    used_ = 0;
    waited_ = false;
  }

 private:
  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
  bool waited_ = false;
};

std::unique_ptr<MarkClock> make_event_clock(Device) { return std::make_unique<EventMarkClock>(); }

std::unique_ptr<Backend> make_backend() {
  auto b = std::make_unique<Backend>();
  b->name = "cuda";
  b->device = DeviceType::CUDA;
  b->make_mark_clock = &make_event_clock;
  fill_elementwise(b->ops);
  fill_linear(b->ops);
  fill_optim(b->ops);
  fill_layers(b->ops);
  fill_cross_entropy(b->ops);
  fill_attention(b->ops);
  fill_moe(b->ops);
  return b;
}

std::string version_string(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

}  // namespace

bool built() { return true; }

int device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

std::string unavailable_reason() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    (void)cudaGetLastError();
    if (e == cudaErrorInsufficientDriver || e == cudaErrorStubLibrary)
      return fmt::format("no usable CUDA driver ({}: {})", cudaGetErrorName(e), cudaGetErrorString(e));
    return fmt::format("no GPU ({}: {})", cudaGetErrorName(e), cudaGetErrorString(e));
  }
  if (n == 0) return "no GPU is visible (check CUDA_VISIBLE_DEVICES)";
  return "";
}

Device use_device(int index) {
  const std::string why = unavailable_reason();
  DS_CHECK(why.empty(), "cannot use GPU {}: {}", index, why);
  const int n = device_count();
  DS_CHECK(index >= 0 && index < n,
           "GPU {} does not exist: this process sees {} GPU(s) (CUDA_VISIBLE_DEVICES={}); run one rank per GPU",
           index, n, std::getenv("CUDA_VISIBLE_DEVICES") ? std::getenv("CUDA_VISIBLE_DEVICES") : "unset");
  DS_CUDA_CHECK(cudaSetDevice(index));
  static std::mutex once;
  std::lock_guard lock(once);
  if (!has_allocator(DeviceType::CUDA)) {
    register_allocator(std::make_unique<DeviceAllocator>());
    register_pinned_host_allocator(std::make_unique<PinnedAllocator>());
  }
  if (!find_backend(DeviceType::CUDA)) register_backend(make_backend());
  return Device::cuda(index);
}

std::string describe(int index) {
  cudaDeviceProp p{};
  DS_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  int driver = 0, runtime = 0, nccl = 0;
  DS_CUDA_CHECK(cudaDriverGetVersion(&driver));
  DS_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
  (void)ncclGetVersion(&nccl);
  const size_t lt = cublasLtGetVersion();
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB), driver {}, CUDA runtime {}, cuBLASLt {}.{}.{}, NCCL {}.{}.{}",
                     p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem / 1073741824.0,
                     version_string(driver), version_string(runtime), lt / 10000, (lt / 100) % 100, lt % 100,
                     nccl / 10000, (nccl / 100) % 100, nccl % 100);
}

void synchronize() { DS_CUDA_CHECK(cudaStreamSynchronize(stream())); }

std::string pci_bus_id(int index) {
  char id[64] = {};
  DS_CUDA_CHECK(cudaDeviceGetPCIBusId(id, int(sizeof(id)), index));
  return id;
}

double bf16_peak_flops(int index, std::string* source) {
  cudaDeviceProp p{};
  DS_CUDA_CHECK(cudaGetDeviceProperties(&p, index));
  const std::string name = p.name;
  // Dense (no sparsity) bf16 tensor-core TFLOP/s, NVIDIA's datasheets.
  struct Entry {
    const char* match;
    double tflops;
  };
  static const Entry table[] = {{"H200", 989.4}, {"H100 PCIe", 756.0}, {"H100 NVL", 835.0}, {"H100", 989.4},
                                {"H800", 989.4}, {"GH200", 989.4},    {"A100", 312.0},     {"A800", 312.0},
                                {"L40S", 362.05}, {"L4", 121.0},      {"A10", 125.0}};
  for (const Entry& e : table) {
    if (name.find(e.match) != std::string::npos) {
      if (source) *source = fmt::format("{}: {:.0f} TFLOP/s dense bf16 (datasheet)", name, e.tflops);
      return e.tflops * 1e12;
    }
  }
  if (source) *source = fmt::format("{}: not in dstrain's table of bf16 peaks; set metrics.peak_tflops", name);
  return 0;
}

Elem elem_of(const Tensor& t, const char* what) {
  switch (t.dtype()) {
    case DType::F32: return Elem::F32;
    case DType::BF16: return Elem::BF16;
    case DType::F16: return Elem::F16;
    default: DS_FAIL("{}: expected an F32, BF16 or F16 tensor, got {}", what, dtype_name(t.dtype()));
  }
}

}  // namespace dstrain::cuda
