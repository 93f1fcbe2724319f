// GPU utilisation and memory for metrics, through NVML loaded at run time (dlopen of
// libnvidia-ml.so.1, which ships with the NVIDIA driver): dstrain needs no NVML to build, and
// where there is none (no driver, no GPU, a CPU-only machine) the monitor says why and samples
// nothing instead of failing.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace dstrain {

struct GpuSample {
  // Share of NVML's last sample period (1/6 s to 1 s) in which a kernel ran; -1 where the GPU
  // does not report it (a MIG instance).
  double utilization_percent = 0;
  double memory_used_bytes = 0;    // on the whole GPU, every process's
  double memory_total_bytes = 0;
};

class GpuMonitor {
 public:
  static constexpr const char* kDefaultLibrary = "libnvidia-ml.so.1";

  // The GPU of NVML index `index`. NVML numbers every GPU of the machine and ignores
  // CUDA_VISIBLE_DEVICES: for the GPU a rank uses, prefer by_pci_bus_id (cudaDeviceGetPCIBusId).
  // `library`: the NVML to load (a path, or a name the dynamic loader searches for).
  static GpuMonitor by_index(int index, const std::string& library = kDefaultLibrary);
  // The GPU of PCI bus id `bus_id` ("0000:3b:00.0").
  static GpuMonitor by_pci_bus_id(const std::string& bus_id, const std::string& library = kDefaultLibrary);

  GpuMonitor(GpuMonitor&&) noexcept;
  GpuMonitor& operator=(GpuMonitor&&) noexcept;
  ~GpuMonitor();  // nvmlShutdown, dlclose

  bool available() const;
  // "NVML not available: <why>" when not available, else empty.
  const std::string& unavailable_reason() const { return reason_; }
  // "NVML, driver 550.54.15, GPU 0" or the reason it is not available.
  std::string describe() const;
  std::string driver_version() const;  // empty when not available

  // Utilisation and memory now; nullopt when not available or a query failed (last_error()).
  std::optional<GpuSample> sample();
  const std::string& last_error() const { return last_error_; }

 private:
  struct Library;
  GpuMonitor() = default;
  static GpuMonitor open(const std::string& library, const std::string& what,
                         const std::function<int(const Library&, void** device)>& find);

  std::unique_ptr<Library> lib_;
  void* device_ = nullptr;  // nvmlDevice_t
  std::string what_;        // "GPU 0", "GPU 0000:3b:00.0"
  std::string reason_, last_error_;
};

}  // namespace dstrain
