// Device-neutral memory: buffers take their bytes from the allocator registered for their
// device, are accounted per category and device, and host code cannot read device memory.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <string>

#include "core/allocator.h"
#include "core/buffer.h"
#include "fake_backend.h"

namespace dstrain {
namespace {

// The message of the Error `f` throws; fails the test when it throws none.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error thrown";
  return "";
}

constexpr size_t kActivations = size_t(MemCategory::Activations);
constexpr size_t kWorkspace = size_t(MemCategory::Workspace);

TEST(Memory, HostBuffersComeZeroedFromTheHostAllocatorAndAreAccounted) {
  const MemoryStats cpu0 = memory_stats(DeviceType::CPU), all0 = memory_stats();
  {
    Buffer b("test.host", MemCategory::Activations, DType::F32, 3000);
    ASSERT_NE(b.allocator(), nullptr);
    EXPECT_EQ(b.allocator()->name(), "host");
    EXPECT_EQ(b.label(), "test.host");
    const float* p = b.data<float>();
    for (int64_t i = 0; i < b.numel(); ++i) ASSERT_EQ(p[i], 0.0f) << i;
    EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[kActivations] - cpu0.bytes[kActivations], 12000);
    EXPECT_EQ(memory_stats().bytes[kActivations] - all0.bytes[kActivations], 12000);
    b.data<float>()[5] = 2.0f;
    b.zero();
    EXPECT_EQ(p[5], 0.0f);
  }
  EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[kActivations], cpu0.bytes[kActivations]);
  EXPECT_EQ(memory_stats().bytes[kActivations], all0.bytes[kActivations]);
}

// Resident set size of this process, from /proc/self/statm (pages).
int64_t resident_bytes() {
  long pages = 0, resident = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return -1;
  const int got = std::fscanf(f, "%ld %ld", &pages, &resident);
  std::fclose(f);
  return got == 2 ? int64_t(resident) * int64_t(sysconf(_SC_PAGESIZE)) : -1;
}

TEST(Memory, ReservedBuffersHoldMemoryOnlyWhereWrittenAndHandItBack) {
  const MemoryStats before = memory_stats(DeviceType::CPU);
  const int64_t n = int64_t(64) << 20;  // 256 MB of address space
  Buffer b = Buffer::reserved("test.reserved", MemCategory::GatheredParameters, DType::F32, n);
  EXPECT_TRUE(b.is_reserved());
  // The buffer accounts nothing itself: its owner accounts what it uses.
  EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[size_t(MemCategory::GatheredParameters)],
            before.bytes[size_t(MemCategory::GatheredParameters)]);
  const int64_t rss0 = resident_bytes();
  float* p = b.data<float>();
  EXPECT_EQ(p[n / 2], 0.0f) << "unwritten memory reads as zeros";
  // Write 32 MB in the middle, with an unaligned start and end.
  const int64_t begin = 1000003, len = int64_t(8) << 20;
  for (int64_t i = begin; i < begin + len; ++i) p[i] = 1.5f;
  p[begin - 1] = 7.0f;  // neighbours on the partial pages at both ends
  p[begin + len] = 9.0f;
  const int64_t rss1 = resident_bytes();
  EXPECT_GT(rss1 - rss0, len * 4 * 9 / 10) << "written pages are committed";
  EXPECT_LT(rss1 - rss0, len * 4 * 2) << "and only those";
  b.release_range(begin, len);
  const int64_t rss2 = resident_bytes();
  EXPECT_LT(rss2, rss1 - len * 4 * 9 / 10) << "released pages go back to the system";
  for (int64_t i = begin; i < begin + len; i += 4099) ASSERT_EQ(p[i], 0.0f) << i;
  EXPECT_EQ(p[begin], 0.0f);
  EXPECT_EQ(p[begin + len - 1], 0.0f);
  EXPECT_EQ(p[begin - 1], 7.0f) << "the partial page before keeps its other values";
  EXPECT_EQ(p[begin + len], 9.0f) << "and so does the one after";
  // Written again after the release: committed again, and zero() hands everything back.
  p[begin + 5] = 3.0f;
  EXPECT_EQ(p[begin + 5], 3.0f);
  b.zero();
  EXPECT_EQ(p[begin + 5], 0.0f);
  EXPECT_EQ(p[begin - 1], 0.0f);
  EXPECT_THROW(b.release_range(n - 10, 20), Error);
}

TEST(Memory, PinnedHostBuffersAreHostMemoryUnderTheirOwnAllocator) {
  const MemoryStats cpu0 = memory_stats(DeviceType::CPU);
  Buffer b = Buffer::pinned_host("test.pinned", MemCategory::Workspace, DType::I32, 10);
  // Activations kept off the device have a category of their own, named in the metrics.
  EXPECT_EQ(mem_category_name(MemCategory::OffloadedActivations), "offloaded_activations");
  const int64_t before = memory_stats(DeviceType::CPU).bytes[size_t(MemCategory::OffloadedActivations)];
  {
    Buffer held = Buffer::pinned_host("test.offloaded", MemCategory::OffloadedActivations, DType::F32, 6);
    EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[size_t(MemCategory::OffloadedActivations)] - before, 24);
  }
  EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[size_t(MemCategory::OffloadedActivations)], before);
  EXPECT_EQ(b.allocator()->name(), "pinned_host");
  EXPECT_EQ(b.allocator()->name(), pinned_host_allocator().name());
  EXPECT_TRUE(b.device().is_cpu());
  b.data<int32_t>()[9] = 7;  // host code may read and write it
  EXPECT_EQ(b.tensor().data<int32_t>()[9], 7);
  EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[kWorkspace] - cpu0.bytes[kWorkspace], 40);
}

TEST(Memory, ADeviceWithoutAnAllocatorIsAClearError) {
  if (!has_allocator(DeviceType::CUDA)) {
    const std::string msg =
        error_of([] { Buffer b("test.gpu", MemCategory::Parameters, DType::F32, 4, Device::cuda(0)); });
    EXPECT_NE(msg.find("no allocator registered for cuda:0: this build has no CUDA backend"), std::string::npos)
        << msg;
  }
  fake::use_emulated_device();
  unregister_allocator(DeviceType::Emulated);
  EXPECT_FALSE(has_allocator(DeviceType::Emulated));
  const std::string msg =
      error_of([] { Buffer b("test.emu", MemCategory::Parameters, DType::F32, 4, Device::emulated(1)); });
  EXPECT_NE(msg.find("no allocator registered for emulated:1"), std::string::npos) << msg;
  fake::use_emulated_device();  // registers it again for the tests that follow
  EXPECT_TRUE(has_allocator(DeviceType::Emulated));
}

TEST(Memory, RegistrationRefusesASecondAllocatorAndTheHostOnesStay) {
  fake::use_emulated_device();
  struct Dummy final : Allocator {
    DeviceType type;
    explicit Dummy(DeviceType t) : type(t) {}
    std::string_view name() const override { return "dummy"; }
    DeviceType device() const override { return type; }
    void* allocate(Device, size_t, const std::string&) override { return nullptr; }
    void free(Device, void*, size_t) override {}
    void zero(Device, void*, size_t) override {}
  };
  std::string msg = error_of([&] { register_allocator(std::make_unique<Dummy>(DeviceType::Emulated)); });
  EXPECT_NE(msg.find("already registered ('emulated')"), std::string::npos) << msg;
  msg = error_of([&] { register_allocator(std::make_unique<Dummy>(DeviceType::CPU)); });
  EXPECT_NE(msg.find("already registered ('host')"), std::string::npos) << msg;
  msg = error_of([&] { unregister_allocator(DeviceType::CPU); });
  EXPECT_NE(msg.find("cannot be unregistered"), std::string::npos) << msg;
  msg = error_of([&] { register_pinned_host_allocator(std::make_unique<Dummy>(DeviceType::Emulated)); });
  EXPECT_NE(msg.find("not host memory"), std::string::npos) << msg;
  EXPECT_EQ(allocator_for(Device::cpu()).name(), "host");
  EXPECT_EQ(pinned_host_allocator().name(), "pinned_host");
}

TEST(Memory, DeviceBuffersComeFromTheirDevicesAllocatorAndAreAccountedThere) {
  const Device emu = fake::use_emulated_device();
  const fake::EmulatedMemory m0 = fake::emulated_memory();
  const MemoryStats emu0 = memory_stats(DeviceType::Emulated), cpu0 = memory_stats(DeviceType::CPU);
  {
    Buffer a("test.emu.a", MemCategory::Activations, DType::BF16, 100, emu);
    EXPECT_EQ(a.allocator()->name(), "emulated");
    EXPECT_EQ(a.device(), emu);
    EXPECT_EQ(a.tensor().device(), emu);
    EXPECT_EQ(a.tensor(10, Shape{3, 5}).device(), emu);
    EXPECT_EQ(fake::emulated_memory().live_allocations - m0.live_allocations, 1);
    EXPECT_EQ(fake::emulated_memory().live_bytes - m0.live_bytes, 200);
    EXPECT_EQ(memory_stats(DeviceType::Emulated).bytes[kActivations] - emu0.bytes[kActivations], 200);
    EXPECT_EQ(memory_stats(DeviceType::CPU).bytes[kActivations], cpu0.bytes[kActivations]);
    a.zero();  // through the device's allocator, not a host memset
    EXPECT_EQ(fake::emulated_memory().zero_calls - m0.zero_calls, 1);

    Buffer b = std::move(a);  // ownership moves; freed once
    EXPECT_FALSE(a.allocated());
    EXPECT_EQ(b.label(), "test.emu.a");
    Buffer c("test.emu.c", MemCategory::Activations, DType::F32, 8, emu);
    c = std::move(b);  // frees c's memory, takes b's
    EXPECT_EQ(fake::emulated_memory().live_allocations - m0.live_allocations, 1);
    EXPECT_EQ(memory_stats(DeviceType::Emulated).bytes[kActivations] - emu0.bytes[kActivations], 200);
  }
  EXPECT_EQ(fake::emulated_memory().live_allocations, m0.live_allocations);
  EXPECT_EQ(fake::emulated_memory().live_bytes, m0.live_bytes);
  EXPECT_EQ(memory_stats(DeviceType::Emulated).bytes[kActivations], emu0.bytes[kActivations]);
  EXPECT_GE(memory_stats(DeviceType::Emulated).peak[kActivations], emu0.bytes[kActivations] + 200);
}

TEST(Memory, HostCodeCannotReadATensorOnADevice) {
  const Device emu = fake::use_emulated_device();
  Buffer b("test.emu.read", MemCategory::Activations, DType::F32, 12, emu);
  for (const std::string& msg : {error_of([&] { (void)b.data<float>(); }),
                                 error_of([&] { (void)b.tensor(0, Shape{3, 4}).row(1).data<float>(); })}) {
    EXPECT_NE(msg.find("on emulated:0"), std::string::npos) << msg;
    EXPECT_NE(msg.find("copy it to host with ops::copy first"), std::string::npos) << msg;
  }
  // Views keep the device; the raw pointer is for backends and transfers.
  EXPECT_EQ(b.tensor().view(Shape{2, 6}).slice(1, 2).device(), emu);
  EXPECT_NE(b.tensor().raw(), nullptr);
}

TEST(Memory, AnAllocationThatDoesNotFitNamesTheBufferAndDevice) {
  const Device emu = fake::use_emulated_device();
  const int64_t huge = int64_t(1) << 50;  // 4 PiB of fp32
  for (Device d : {Device::cpu(), emu}) {
    try {
      Buffer b("test.huge", MemCategory::OptimizerState, DType::F32, huge, d);
      ADD_FAILURE() << "allocated 4 PiB on " << d.str();
    } catch (const OutOfMemory& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("on " + d.str() + " for 'test.huge' (optimizer_state)"), std::string::npos) << msg;
    }
  }
}

}  // namespace
}  // namespace dstrain
