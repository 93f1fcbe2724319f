// The generated ops:: wrappers (backend/backend.cpp): the argument checks they run before any
// kernel, the count of host/device transfers they keep, and the lookup of a backend by device
// type, exercised on a recording backend and on the emulated device with its fake backend.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "backend/backend.h"
#include "core/buffer.h"
#include "fake_backend.h"

namespace dstrain {
namespace {

// A device type no backend serves in this process (the CUDA backend registers where a GPU is,
// the meta one when the memory model runs); CPU when every type is taken.
DeviceType free_device_type() {
  for (DeviceType t : {DeviceType::CUDA, DeviceType::Meta})
    if (!find_backend(t)) return t;
  return DeviceType::CPU;
}

// A backend whose every kernel only counts its calls and checks nothing, as the CUDA kernels
// check nothing: a bad call reaches it only if the ops:: wrapper lets it through.
std::atomic<int64_t> g_kernel_calls{0};
using ops::AdamWStep;
using ops::AttentionLayout;
using ops::MoEDropPolicy;
using ops::MoERouteParams;
using ops::MoEScoring;
using ops::YarnParams;
#define DS_OP(name, params, args) \
  void recorded_##name params { g_kernel_calls.fetch_add(1); }
#include "backend/ops.def"
#undef DS_OP

std::unique_ptr<Backend> make_recording_backend(DeviceType type) {
  auto b = std::make_unique<Backend>();
  b->name = "recording";
  b->device = type;
#define DS_OP(name, params, args) b->ops.name.fill(&recorded_##name);
#include "backend/ops.def"
#undef DS_OP
  return b;
}

// Host memory tagged with another device: the recording kernels never read it.
struct Tagged {
  Device device;
  std::vector<double> memory = std::vector<double>(4096);
  Tensor t(Shape s, DType dt = DType::F32) { return Tensor(memory.data(), dt, s, device); }
};

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

// Every op's argument checks run in the wrapper, before the kernel: a backend whose kernels check
// nothing never sees a bad call, and the caller gets the message the CPU kernels used to give.
TEST(Dispatch, BadCallsAreRefusedByTheWrapperBeforeAnyKernel) {
  const DeviceType type = free_device_type();
  if (type == DeviceType::CPU) GTEST_SKIP() << "every device type has a backend registered in this process";
  register_backend(make_recording_backend(type));
  struct Unregister {
    DeviceType type;
    ~Unregister() { unregister_backend(type); }
  } unregister{type};
  Tagged d{Device{type, 0}};

  // A good call reaches the kernel.
  const int64_t before_good = g_kernel_calls.load();
  ops::add(d.t({4}), d.t({4}), d.t({4}));
  EXPECT_EQ(g_kernel_calls.load(), before_good + 1);

  ops::AttentionLayout uneven;  // 3 query heads over 2 kv heads
  uneven.n_head = 3;
  uneven.n_kv_head = 2;
  uneven.qk_dim = uneven.v_dim = 2;
  uneven.row_stride = 16;
  ops::MoERouteParams too_many;
  too_many.top_k = 5;
  const std::vector<std::pair<std::string, std::function<void()>>> bad = {
      {"add: sizes 4 4 3", [&] { ops::add(d.t({4}), d.t({4}), d.t({3})); }},
      {"add: sizes 4 4 2", [&] { ops::add_inplace(d.t({4}), d.t({2})); }},
      {"copy: 12 bytes into 16", [&] { ops::copy(d.t({4}), d.t({3})); }},
      {"cast: I32 -> F32: only F32, BF16 and F16 convert", [&] { ops::cast(d.t({4}), d.t({4}, DType::I32)); }},
      {"linear_forward: x (2, 3) · w (4, 5)^T", [&] { ops::linear_forward(d.t({2, 4}), d.t({2, 3}), d.t({4, 5})); }},
      {"linear weight: expected a matrix", [&] { ops::linear_forward(d.t({2, 4}), d.t({2, 3}), d.t({12})); }},
      {"linear_backward: dx", [&] { ops::linear_backward(d.t({5}), Tensor(), d.t({2, 4}), d.t({2, 3}), d.t({4, 3})); }},
      {"rmsnorm_forward: x (2, 8) weight (7,)",
       [&] { ops::rmsnorm_forward(d.t({2, 8}), d.t({2}), d.t({2, 8}), d.t({7}), 1e-6f); }},
      {"rope: 2 heads of 8 at column 4 do not fit rows of 16",
       [&] { ops::rope_forward(d.t({1, 3, 16}), 4, 2, 8, d.t({3, 4}), d.t({3, 4})); }},
      {"attention: 3 query heads cannot share 2 kv heads evenly",
       [&] { ops::attention_forward(d.t({1, 2, 6}), d.t({1, 3, 2}), d.t({1, 2, 16}), uneven, 1.0f); }},
      {"swiglu_forward: gate_up (2, 6) for out (2, 4)", [&] { ops::swiglu_forward(d.t({2, 4}), d.t({2, 6})); }},
      {"cross_entropy_forward: logits (3, 5) targets (2,)",
       [&] { ops::cross_entropy_forward(d.t({3}), d.t({3}), d.t({3, 5}), d.t({2}, DType::I32)); }},
      {"embedding_forward: tokens holds F32, expected I32 ids",
       [&] { ops::embedding_forward(d.t({2, 4}), d.t({2}), d.t({10, 4})); }},
      {"copy_blocks: 1 blocks of 2 at 5+j*0 (dst 6 columns)",
       [&] { ops::copy_blocks(d.t({2, 6}), 5, 0, d.t({2, 4}), 0, 0, 1, 2, false); }},
      {"shift_tokens: negative shift -1",
       [&] { ops::shift_tokens(d.t({2, 3}, DType::I32), d.t({2, 3}, DType::I32), -1, 0, 0); }},
      {"sum_squares: out is F32, expected f64", [&] { ops::sum_squares(d.t({1}), d.t({4})); }},
      {"adamw_update: size mismatch",
       [&] { ops::adamw_update(d.t({4}), d.t({4}), d.t({3}), d.t({4}), Tensor(), ops::AdamWStep{}); }},
      {"moe_route: top_k 5 with 4 experts",
       [&] { ops::moe_route(d.t({2, 5}, DType::I32), d.t({2, 5}), d.t({2, 4}), Tensor(), too_many); }},
      {"moe_permute: xg (3, 4) from x (2, 4) with 3 rows",
       [&] { ops::moe_permute(d.t({3, 4}), d.t({2, 4}), d.t({3}, DType::I32), 1); }},
      {"moe_dispatch_plan: ids holds F32, expected I32",
       [&] { ops::moe_dispatch_plan(d.t({5}, DType::I64), d.t({4}, DType::I32), d.t({4}, DType::I32), d.t({4})); }},
  };
  const int64_t before = g_kernel_calls.load();
  for (const auto& [message, call] : bad) {
    EXPECT_NE(error_of(call).find(message), std::string::npos) << "expected '" << message << "', got: "
                                                               << error_of(call);
  }
  EXPECT_EQ(g_kernel_calls.load(), before) << "a kernel received arguments its op's checks refuse";
}

// On the emulated device, whose fake backend runs the CPU kernels (which no longer check their
// arguments), a bad call is refused with the CPU kernel's message and leaves memory untouched.
TEST(Dispatch, TheFakeBackendGetsCheckedArgumentsOnly) {
  const Device dev = fake::use_fake_backend();
  Buffer a("check a", MemCategory::Workspace, DType::F32, 4, dev);
  Buffer b("check b", MemCategory::Workspace, DType::F32, 3, dev);
  EXPECT_NE(error_of([&] { ops::add_inplace(a.tensor(), b.tensor()); }).find("add: sizes 4 4 3"), std::string::npos);
  Buffer x("check x", MemCategory::Workspace, DType::F32, 6, dev), w("check w", MemCategory::Workspace, DType::F32, 8,
                                                                        dev);
  Buffer out("check out", MemCategory::Workspace, DType::F32, 8, dev);
  const std::string msg = error_of([&] {
    ops::linear_forward(out.tensor().view(Shape{2, 4}), x.tensor().view(Shape{2, 3}), w.tensor().view(Shape{4, 2}));
  });
  EXPECT_NE(msg.find("linear_forward: x (2, 3) · w (4, 2)^T -> out (2, 4)"), std::string::npos) << msg;
  // The same call on the host gets the same message: one check, wherever the tensors live.
  std::vector<float> hx(6), hw(8), ho(8);
  const std::string host_msg = error_of([&] {
    ops::linear_forward(Tensor(ho.data(), DType::F32, Shape{2, 4}), Tensor(hx.data(), DType::F32, Shape{2, 3}),
                        Tensor(hw.data(), DType::F32, Shape{4, 2}));
  });
  EXPECT_EQ(host_msg, msg);
}

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
