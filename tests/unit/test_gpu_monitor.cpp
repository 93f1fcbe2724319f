// The GPU monitor needs no NVML to build or run: without the library or the GPU it says why and
// samples nothing; with an NVML (here a stand-in, unit/fake_nvml.c) it reads utilisation and
// memory.
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "train/gpu_monitor.h"

namespace dstrain {
namespace {

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

TEST(GpuMonitor, SaysWhyWithoutTheLibrary) {
  GpuMonitor m = GpuMonitor::by_index(0, "libnvidia-ml-absent.so.1");
  EXPECT_FALSE(m.available());
  EXPECT_TRUE(contains(m.unavailable_reason(), "NVML not available: cannot load libnvidia-ml-absent.so.1"))
      << m.unavailable_reason();
  EXPECT_EQ(m.describe(), m.unavailable_reason());
  EXPECT_EQ(m.driver_version(), "");
  EXPECT_FALSE(m.sample().has_value());
  EXPECT_EQ(m.last_error(), m.unavailable_reason());
}

// The driver's NVML where there is one (GPU machines), its absence reported where not.
TEST(GpuMonitor, TheMachinesNvmlAnswersEitherWay) {
  GpuMonitor m = GpuMonitor::by_index(0);
  if (!m.available()) {
    EXPECT_EQ(m.unavailable_reason().rfind("NVML not available: ", 0), 0u) << m.unavailable_reason();
    EXPECT_FALSE(m.sample().has_value());
    return;
  }
  const auto s = m.sample();
  ASSERT_TRUE(s.has_value()) << m.last_error();
  EXPECT_GE(s->utilization_percent, -1);
  EXPECT_LE(s->utilization_percent, 100);
  EXPECT_GT(s->memory_total_bytes, 0);
  EXPECT_LE(s->memory_used_bytes, s->memory_total_bytes);
  EXPECT_FALSE(m.driver_version().empty());
}

TEST(GpuMonitor, ReadsUtilisationAndMemory) {
  GpuMonitor m = GpuMonitor::by_index(0, DSTRAIN_FAKE_NVML);
  ASSERT_TRUE(m.available()) << m.unavailable_reason();
  EXPECT_EQ(m.unavailable_reason(), "");
  EXPECT_EQ(m.driver_version(), "555.42.06");
  EXPECT_EQ(m.describe(), "NVML, driver 555.42.06, GPU 0");
  const auto s = m.sample();
  ASSERT_TRUE(s.has_value()) << m.last_error();
  EXPECT_EQ(s->utilization_percent, 42);
  EXPECT_EQ(s->memory_used_bytes, 10.0 * (1 << 30));
  EXPECT_EQ(s->memory_total_bytes, 80.0 * (1 << 30));
  GpuMonitor moved = std::move(m);  // owns NVML and the library now; shut down once
  EXPECT_TRUE(moved.sample().has_value());
}

TEST(GpuMonitor, NamesAGpuThatIsNotThere) {
  GpuMonitor m = GpuMonitor::by_index(3, DSTRAIN_FAKE_NVML);
  EXPECT_FALSE(m.available());
  EXPECT_EQ(m.unavailable_reason(), "NVML not available: no GPU 3: Invalid Argument (NVML error 2)");
  EXPECT_FALSE(m.sample().has_value());
}

TEST(GpuMonitor, FindsTheGpuByPciBusId) {
  EXPECT_TRUE(GpuMonitor::by_pci_bus_id("00000000:3B:00.0", DSTRAIN_FAKE_NVML).available());
  GpuMonitor other = GpuMonitor::by_pci_bus_id("00000000:AF:00.0", DSTRAIN_FAKE_NVML);
  EXPECT_EQ(other.unavailable_reason(), "NVML not available: no GPU 00000000:AF:00.0: Not Found (NVML error 6)");
}

TEST(GpuMonitor, SaysWhenTheDriverIsNotLoaded) {
  setenv("FAKE_NVML_INIT_FAILS", "1", 1);
  GpuMonitor m = GpuMonitor::by_index(0, DSTRAIN_FAKE_NVML);
  unsetenv("FAKE_NVML_INIT_FAILS");
  EXPECT_FALSE(m.available());
  EXPECT_EQ(m.unavailable_reason(), "NVML not available: nvmlInit_v2 failed: Driver Not Loaded (NVML error 9)");
}

TEST(GpuMonitor, SaysWhenTheLibraryIsNotNvml) {
  // Any shared library without NVML's entry points: the C library.
  GpuMonitor m = GpuMonitor::by_index(0, "libc.so.6");
  EXPECT_FALSE(m.available());
  EXPECT_EQ(m.unavailable_reason(),
            "NVML not available: libc.so.6 has no nvmlInit_v2 (not an NVML, or one older than dstrain needs)");
}

}  // namespace
}  // namespace dstrain
