/* A stand-in for NVML (libnvidia-ml.so.1) with one GPU, for test_gpu_monitor.cpp: the entry
   points GpuMonitor loads, with fixed answers. FAKE_NVML_INIT_FAILS=1 makes nvmlInit_v2 fail as
   it does without the driver. Built as a shared library of its own (tests/CMakeLists.txt). */
#include <stdlib.h>
#include <string.h>

typedef struct {
  unsigned int gpu, memory;
} FakeUtilization;

typedef struct {
  unsigned long long total, free, used;
} FakeMemory;

static int the_gpu;

int nvmlInit_v2(void) {
  const char* fail = getenv("FAKE_NVML_INIT_FAILS");
  return fail && fail[0] == '1' ? 9 /* NVML_ERROR_DRIVER_NOT_LOADED */ : 0;
}

int nvmlShutdown(void) { return 0; }

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void** device) {
  if (index != 0) return 2; /* NVML_ERROR_INVALID_ARGUMENT */
  *device = &the_gpu;
  return 0;
}

int nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, void** device) {
  if (strcmp(bus_id, "00000000:3B:00.0") != 0) return 6; /* NVML_ERROR_NOT_FOUND */
  *device = &the_gpu;
  return 0;
}

int nvmlDeviceGetUtilizationRates(void* device, FakeUtilization* u) {
  if (device != &the_gpu) return 2;
  u->gpu = 42;
  u->memory = 17;
  return 0;
}

int nvmlDeviceGetMemoryInfo(void* device, FakeMemory* m) {
  if (device != &the_gpu) return 2;
  m->total = 80ull << 30;
  m->used = 10ull << 30;
  m->free = m->total - m->used;
  return 0;
}

int nvmlSystemGetDriverVersion(char* version, unsigned int length) {
  const char* v = "555.42.06";
  if (length < strlen(v) + 1) return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
  strcpy(version, v);
  return 0;
}

const char* nvmlErrorString(int result) {
  switch (result) {
    case 2: return "Invalid Argument";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 9: return "Driver Not Loaded";
    default: return "Unknown Error";
  }
}
