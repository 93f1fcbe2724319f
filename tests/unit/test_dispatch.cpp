// The generated ops:: wrappers (backend/backend.cpp): the count of host/device transfers they keep,
// and the lookup of a backend by device type, exercised on the emulated device and its fake backend.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "fake_backend.h"

namespace dstrain {
namespace {

TEST(Dispatch, TransferCountsSeparateTheDirectionsAndSkipSameSideCopies) {
  const Device dev = fake::use_fake_backend();
  Buffer on_device("transfer src", MemCategory::Workspace, DType::F32, 6, dev);
  Buffer other_device("transfer dst", MemCategory::Workspace, DType::F32, 6, dev);
  std::vector<float> host(6, 1.5f), host2(6, 0.0f);
  const Tensor h(host.data(), DType::F32, Shape{6}), h2(host2.data(), DType::F32, Shape{6});
  constexpr int64_t kBytes = 6 * sizeof(float);

  const ops::TransferCounts before = ops::transfer_counts();
  ops::copy(on_device.tensor(), h);  // host -> device
  ops::copy(on_device.tensor(), h);  // host -> device
  ops::copy(other_device.tensor(), on_device.tensor());  // device -> device: not counted
  ops::copy(h2, h);  // host -> host: not counted
  ops::copy(h2, other_device.tensor());  // device -> host
  const ops::TransferCounts after = ops::transfer_counts();

  EXPECT_EQ(after.host_to_device - before.host_to_device, 2);
  EXPECT_EQ(after.host_to_device_bytes - before.host_to_device_bytes, 2 * kBytes);
  EXPECT_EQ(after.device_to_host - before.device_to_host, 1);
  EXPECT_EQ(after.device_to_host_bytes - before.device_to_host_bytes, kBytes);
  EXPECT_EQ(host2, host);  // the copies themselves went through

  // read_scalar is a device-to-host read of one element.
  Buffer scalar("transfer scalar", MemCategory::Workspace, DType::F64, 1, dev);
  ops::sum_squares(scalar.tensor(), on_device.tensor());
  EXPECT_EQ(ops::read_scalar<double>(scalar.tensor()), 6 * 1.5 * 1.5);
  const ops::TransferCounts last = ops::transfer_counts();
  EXPECT_EQ(last.device_to_host - after.device_to_host, 1);
  EXPECT_EQ(last.device_to_host_bytes - after.device_to_host_bytes, int64_t(sizeof(double)));
  EXPECT_EQ(last.host_to_device, after.host_to_device);

  // A refused copy (byte counts differ) moved nothing and counts nothing.
  std::vector<float> short_host(2);
  EXPECT_THROW(ops::copy(Tensor(short_host.data(), DType::F32, Shape{2}), on_device.tensor()), Error);
  EXPECT_EQ(ops::transfer_counts().device_to_host, last.device_to_host);
}

// Lookups take no lock and race with registration: a lookup sees either no backend or a whole one,
// and a backend unregistered under a running lookup stays valid.
TEST(Dispatch, BackendLookupIsByDeviceTypeWhileOthersRegister) {
  // A device type no backend serves in this process (the CUDA backend registers where a GPU is).
  DeviceType type = DeviceType::CUDA;
  if (find_backend(type)) type = DeviceType::Meta;
  if (find_backend(type)) GTEST_SKIP() << "every device type has a backend registered in this process";
  std::atomic<bool> stop{false};
  std::atomic<int64_t> seen{0};
  std::thread reader([&] {
    while (!stop.load()) {
      const Backend* b = find_backend(type);
      if (b) {
        EXPECT_EQ(b->name, "racing");
        EXPECT_NE(b->ops.add[size_t(KernelDType::F32)], nullptr);
        seen.fetch_add(1);
      }
      EXPECT_EQ(find_backend(DeviceType::CPU)->name, "cpu");
    }
  });
  for (int i = 0; i < 50; ++i) {
    auto b = std::make_unique<Backend>();
    b->name = "racing";
    b->device = type;
    cpu::fill_table(b->ops);
    const Backend* registered = &register_backend(std::move(b));
    EXPECT_EQ(find_backend(type), registered);
    unregister_backend(type);
    EXPECT_EQ(find_backend(type), nullptr);
  }
  stop.store(true);
  reader.join();
  EXPECT_EQ(find_backend(type), nullptr);
}

}  // namespace
}  // namespace dstrain
