#include "train/gpu_monitor.h"

#include <dlfcn.h>
#include <fmt/format.h>

namespace dstrain {
namespace {

// NVML's ABI as far as dstrain uses it (nvml.h): calls return an int, 0 on success; a device is
// an opaque pointer; the structs are NVML's version-1 layouts.
using nvmlReturn_t = int;
constexpr nvmlReturn_t kNvmlSuccess = 0;
constexpr nvmlReturn_t kNvmlNotSupported = 3;
using nvmlDevice_t = void*;
struct nvmlUtilization_t {
  unsigned int gpu, memory;  // percent
};
struct nvmlMemory_t {
  unsigned long long total, free, used;  // bytes
};
constexpr unsigned kDriverVersionSize = 80;  // NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE

}  // namespace

// The loaded library, its entry points, and NVML initialised (shut down and unloaded on
// destruction).
struct GpuMonitor::Library {
  void* handle = nullptr;
  bool initialised = false;
  nvmlReturn_t (*init)() = nullptr;  // nvmlInit_v2
  nvmlReturn_t (*shutdown)() = nullptr;
  nvmlReturn_t (*by_index)(unsigned, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*by_pci_bus_id)(const char*, nvmlDevice_t*) = nullptr;  // optional
  nvmlReturn_t (*utilization)(nvmlDevice_t, nvmlUtilization_t*) = nullptr;
  nvmlReturn_t (*memory)(nvmlDevice_t, nvmlMemory_t*) = nullptr;
  nvmlReturn_t (*driver_version)(char*, unsigned) = nullptr;
  const char* (*error_string)(nvmlReturn_t) = nullptr;  // optional

  ~Library() {
    if (initialised) shutdown();
    if (handle) dlclose(handle);
  }

  template <class F>
  bool load(const char* symbol, F& f) {
    void* p = dlsym(handle, symbol);
    f = reinterpret_cast<F>(p);
    return p != nullptr;
  }

  std::string error(nvmlReturn_t r) const {
    const char* text = error_string ? error_string(r) : nullptr;
    return text ? fmt::format("{} (NVML error {})", text, r) : fmt::format("NVML error {}", r);
  }
};

GpuMonitor::GpuMonitor(GpuMonitor&&) noexcept = default;
GpuMonitor& GpuMonitor::operator=(GpuMonitor&&) noexcept = default;
GpuMonitor::~GpuMonitor() = default;

GpuMonitor GpuMonitor::open(const std::string& library, const std::string& what,
                            const std::function<int(const Library&, void** device)>& find) {
  GpuMonitor m;
  m.what_ = what;
  auto lib = std::make_unique<Library>();
  lib->handle = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib->handle) {
    const char* why = dlerror();
    m.reason_ = fmt::format("NVML not available: cannot load {} ({})", library, why ? why : "no reason given");
    return m;
  }
  const char* missing = nullptr;
  auto need = [&](const char* symbol, auto& entry) {
    if (!lib->load(symbol, entry) && !missing) missing = symbol;
  };
  need("nvmlInit_v2", lib->init);
  need("nvmlShutdown", lib->shutdown);
  need("nvmlDeviceGetHandleByIndex_v2", lib->by_index);
  need("nvmlDeviceGetUtilizationRates", lib->utilization);
  need("nvmlDeviceGetMemoryInfo", lib->memory);
  need("nvmlSystemGetDriverVersion", lib->driver_version);
  if (missing) {
    m.reason_ = fmt::format("NVML not available: {} has no {} (not an NVML, or one older than dstrain needs)",
                            library, missing);
    return m;
  }
  lib->load("nvmlDeviceGetHandleByPciBusId_v2", lib->by_pci_bus_id);
  lib->load("nvmlErrorString", lib->error_string);
  const nvmlReturn_t r = lib->init();
  if (r != kNvmlSuccess) {
    m.reason_ = fmt::format("NVML not available: nvmlInit_v2 failed: {}", lib->error(r));
    return m;
  }
  lib->initialised = true;
  void* device = nullptr;
  const nvmlReturn_t f = find(*lib, &device);
  if (f != kNvmlSuccess) {
    m.reason_ = fmt::format("NVML not available: no {}: {}", what, lib->error(f));
    return m;
  }
  m.lib_ = std::move(lib);
  m.device_ = device;
  return m;
}

GpuMonitor GpuMonitor::by_index(int index, const std::string& library) {
  return open(library, fmt::format("GPU {}", index), [index](const Library& lib, void** device) {
    return index < 0 ? 2 /* NVML_ERROR_INVALID_ARGUMENT */ : lib.by_index(unsigned(index), device);
  });
}

GpuMonitor GpuMonitor::by_pci_bus_id(const std::string& bus_id, const std::string& library) {
  return open(library, fmt::format("GPU {}", bus_id), [bus_id](const Library& lib, void** device) {
    return lib.by_pci_bus_id ? lib.by_pci_bus_id(bus_id.c_str(), device) : 3 /* NVML_ERROR_NOT_SUPPORTED */;
  });
}

bool GpuMonitor::available() const { return lib_ != nullptr; }

std::string GpuMonitor::driver_version() const {
  if (!lib_) return "";
  char version[kDriverVersionSize] = {};
  if (lib_->driver_version(version, kDriverVersionSize) != kNvmlSuccess) return "";
  return std::string(version);
}

std::string GpuMonitor::describe() const {
  if (!lib_) return reason_;
  return fmt::format("NVML, driver {}, {}", driver_version(), what_);
}

std::optional<GpuSample> GpuMonitor::sample() {
  if (!lib_) {
    last_error_ = reason_;
    return std::nullopt;
  }
  GpuSample s;
  nvmlUtilization_t u{};
  const nvmlReturn_t ru = lib_->utilization(device_, &u);
  if (ru == kNvmlSuccess) {
    s.utilization_percent = double(u.gpu);
  } else if (ru == kNvmlNotSupported) {
    s.utilization_percent = -1;
  } else {
    last_error_ = fmt::format("nvmlDeviceGetUtilizationRates on {}: {}", what_, lib_->error(ru));
    return std::nullopt;
  }
  nvmlMemory_t mem{};
  const nvmlReturn_t rm = lib_->memory(device_, &mem);
  if (rm != kNvmlSuccess) {
    last_error_ = fmt::format("nvmlDeviceGetMemoryInfo on {}: {}", what_, lib_->error(rm));
    return std::nullopt;
  }
  s.memory_used_bytes = double(mem.used);
  s.memory_total_bytes = double(mem.total);
  last_error_.clear();
  return s;
}

}  // namespace dstrain
