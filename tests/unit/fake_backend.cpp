#include "fake_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "core/allocator.h"
#include "core/error.h"

namespace dstrain::fake {
namespace {

std::mutex g_mutex;
EmulatedMemory g_memory;

// Plain aligned host memory, apart from the host allocator's, with counts of what is live so
// that tests see every buffer come back to the allocator it came from.
class EmulatedAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "emulated"; }
  DeviceType device() const override { return DeviceType::Emulated; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.type == DeviceType::Emulated, "the emulated allocator got a request for {}", device.str());
    if (bytes == 0) return nullptr;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) throw OutOfMemory(fmt::format("emulated device: no memory for {} bytes ('{}')", bytes, label));
    std::memset(p, 0, bytes);
    std::lock_guard lock(g_mutex);
    g_memory.live_allocations++;
    g_memory.live_bytes += int64_t(bytes);
    return p;
  }
  void free(Device, void* p, size_t bytes) override {
    if (!p) return;
    std::free(p);
    std::lock_guard lock(g_mutex);
    g_memory.live_allocations--;
    g_memory.live_bytes -= int64_t(bytes);
  }
  void zero(Device, void* p, size_t bytes) override {
    if (bytes) std::memset(p, 0, bytes);
    std::lock_guard lock(g_mutex);
    g_memory.zero_calls++;
  }
};

// ---- the op table ---------------------------------------------------------------------------

std::mutex g_perturb_mutex;
std::string g_perturbed_op;

bool perturbed(const char* op) {
  std::lock_guard lock(g_perturb_mutex);
  return g_perturbed_op == op;
}

// A tensor on the emulated device described as the host memory it really is, for the CPU kernels.
Tensor as_host(const Tensor& t) {
  if (!t.defined() || t.device().is_cpu()) return t;
  DS_CHECK(t.device().type == DeviceType::Emulated, "the fake backend got a tensor on {}", t.device().str());
  return Tensor(t.raw(), t.dtype(), t.shape(), Device::cpu());
}
template <class T>
const T& as_host(const T& v) {
  return v;
}

// Moves element 0 of a tensor (of any dtype the ops write) by more than the tensor's largest
// magnitude, so that no tolerance can hide it.
void corrupt(const Tensor& device_tensor) {
  const Tensor t = as_host(device_tensor);
  auto bump = [&](auto read, auto write) {
    double largest = 0;
    for (int64_t i = 0; i < t.numel(); ++i) {
      const double v = read(i);
      if (std::isfinite(v)) largest = std::max(largest, std::fabs(v));
    }
    write(read(0) + largest + 1.0);
  };
  auto* u16 = static_cast<uint16_t*>(t.raw());
  switch (t.dtype()) {
    case DType::F32: {
      float* p = t.data<float>();
      return bump([&](int64_t i) { return double(p[i]); }, [&](double v) { p[0] = float(v); });
    }
    case DType::F64: {
      double* p = t.data<double>();
      return bump([&](int64_t i) { return p[i]; }, [&](double v) { p[0] = v; });
    }
    case DType::BF16:
      return bump([&](int64_t i) { return double(bf16_to_f32(u16[i])); },
                  [&](double v) { u16[0] = f32_to_bf16(float(v)); });
    case DType::F16:
      return bump([&](int64_t i) { return double(f16_to_f32(u16[i])); },
                  [&](double v) { u16[0] = f32_to_f16(float(v)); });
    case DType::I64: t.data<int64_t>()[0] += 1; return;
    case DType::I32: t.data<int32_t>()[0] += 1; return;
    default: DS_FAIL("fake backend: cannot corrupt a {} tensor", dtype_name(t.dtype()));
  }
}
bool corrupt_first() { return false; }
template <class A, class... R>
bool corrupt_first(const A& a, const R&... rest) {
  if constexpr (std::is_same_v<A, Tensor>) {
    if (a.defined()) {
      corrupt(a);
      return true;
    }
  }
  return corrupt_first(rest...);
}

const OpTable& cpu_table() {
  const Backend* cpu = find_backend(DeviceType::CPU);
  DS_CHECK(cpu, "the fake backend runs the CPU backend's kernels, but none is registered");
  return cpu->ops;
}

// The fake's kernel for a slot the CPU backend has: the CPU kernel on the same memory.
template <class Fn, class... A>
void run_on_host(const char* op, Fn fn, const A&... a) {
  fn(as_host(a)...);
  if (perturbed(op)) corrupt_first(a...);
}

// A bf16 or f16 kernel made from the CPU fp32 one: 16-bit tensors are widened to fp32 copies
// (one per distinct memory, so aliased arguments stay aliased), the fp32 kernel runs on them, and
// every copy is rounded back into its tensor.
class Widened {
 public:
  Tensor operator()(const Tensor& t) {
    const Tensor h = as_host(t);
    if (!h.defined() || (h.dtype() != DType::BF16 && h.dtype() != DType::F16)) return h;
    for (auto& [orig, wide] : copies_)
      if (orig.raw() == h.raw() && orig.dtype() == h.dtype() && orig.numel() == h.numel())
        return Tensor(wide.data(), DType::F32, h.shape());
    auto& [orig, wide] = copies_.emplace_back(h, std::vector<float>(size_t(h.numel())));
    const auto* bits = static_cast<const uint16_t*>(orig.raw());
    for (int64_t i = 0; i < orig.numel(); ++i)
      wide[size_t(i)] = orig.dtype() == DType::BF16 ? bf16_to_f32(bits[i]) : f16_to_f32(bits[i]);
    return Tensor(wide.data(), DType::F32, h.shape());
  }
  template <class T>
  const T& operator()(const T& v) {
    return v;
  }
  void round_back() {
    for (auto& [orig, wide] : copies_) {
      auto* bits = static_cast<uint16_t*>(orig.raw());
      for (int64_t i = 0; i < orig.numel(); ++i)
        bits[i] = orig.dtype() == DType::BF16 ? f32_to_bf16(wide[size_t(i)]) : f32_to_f16(wide[size_t(i)]);
    }
  }

 private:
  std::deque<std::pair<Tensor, std::vector<float>>> copies_;
};

template <class Fn, class... A>
void run_widened(const char* op, Fn fn, const A&... a) {
  Widened w;
  fn(w(a)...);
  w.round_back();
  if (perturbed(op)) corrupt_first(a...);
}

using ops::AdamWStep;
using ops::AttentionLayout;
using ops::MoERouteParams;
using ops::MoEDropPolicy;
using ops::MoEScoring;
using ops::YarnParams;

#define DS_UNPACK(...) __VA_ARGS__
#define DS_OP(name, params, args)                                                  \
  template <size_t K>                                                              \
  void fake_##name params {                                                        \
    run_on_host(#name, cpu_table().name[K], DS_UNPACK args);                       \
  }                                                                                \
  template <size_t K>                                                              \
  void fake16_##name params {                                                      \
    run_widened(#name, cpu_table().name[size_t(KernelDType::F32)], DS_UNPACK args); \
  }
#include "backend/ops.def"
#undef DS_OP

std::unique_ptr<Backend> make_fake_backend() {
  auto b = std::make_unique<Backend>();
  b->name = "fake";
  b->device = DeviceType::Emulated;
  const OpTable& cpu = cpu_table();
  // Every slot the CPU backend fills, with the CPU kernel.
  static_assert(kKernelDTypes == 3, "one line per kernel dtype below");
#define DS_OP(name, params, args)                                                    \
  if (cpu.name[0]) b->ops.name[0] = &fake_##name<0>;                                 \
  if (cpu.name[1]) b->ops.name[1] = &fake_##name<1>;                                 \
  if (cpu.name[2]) b->ops.name[2] = &fake_##name<2>;
#include "backend/ops.def"
#undef DS_OP
  // 16-bit kernels the CPU backend does not have, as a GPU backend would add them per op.
  b->ops.add[size_t(KernelDType::BF16)] = &fake16_add<size_t(KernelDType::BF16)>;
  b->ops.swiglu_forward[size_t(KernelDType::BF16)] = &fake16_swiglu_forward<size_t(KernelDType::BF16)>;
  b->ops.scale_inplace[size_t(KernelDType::F16)] = &fake16_scale_inplace<size_t(KernelDType::F16)>;
  return b;
}

}  // namespace

void perturb_op(std::string_view op) {
  std::lock_guard lock(g_perturb_mutex);
  g_perturbed_op = std::string(op);
}

Device use_fake_backend() {
  const Device d = use_emulated_device();
  static std::mutex once;
  std::lock_guard lock(once);
  if (!find_backend(DeviceType::Emulated)) register_backend(make_fake_backend());
  return d;
}

Device use_emulated_device() {
  static std::mutex once;
  std::lock_guard lock(once);
  if (!has_allocator(DeviceType::Emulated)) register_allocator(std::make_unique<EmulatedAllocator>());
  return Device::emulated(0);
}

EmulatedMemory emulated_memory() {
  std::lock_guard lock(g_mutex);
  return g_memory;
}

}  // namespace dstrain::fake
