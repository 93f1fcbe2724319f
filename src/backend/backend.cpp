#include "backend/backend.h"

#include "backend/checks.h"

#include <atomic>
#include <mutex>

namespace dstrain {
namespace {

// Registration and unregistration take the mutex; find_backend, which every op call runs, takes
// none: it reads one atomic pointer of `by_type`, so that on a GPU no lock sits in front of each
// kernel launch. A backend is never freed once a lookup may have returned it: unregistering moves
// it to `retired` (only tests unregister, a handful of times), so a call that looked it up just
// before still runs on live memory.
struct Registry {
  std::mutex mutex;
  std::vector<std::unique_ptr<Backend>> backends;  // the CPU backend first
  std::vector<std::unique_ptr<Backend>> retired;
  std::array<std::atomic<const Backend*>, kDeviceTypes> by_type{};
  Registry() {
    auto cpu = std::make_unique<Backend>();
    cpu->name = "cpu";
    cpu->device = DeviceType::CPU;
    cpu::fill_table(cpu->ops);
    by_type[size_t(DeviceType::CPU)].store(cpu.get(), std::memory_order_release);
    backends.push_back(std::move(cpu));
  }
};

// The process-wide transfer counts (ops::transfer_counts): relaxed atomics, one add per transfer.
struct TransferCounters {
  std::atomic<int64_t> device_to_host{0}, device_to_host_bytes{0}, host_to_device{0}, host_to_device_bytes{0};
};
TransferCounters g_transfers;

Registry& registry() {
  static Registry r;
  return r;
}

// The device and kernel slot of one call: all defined tensors share a device (a transfer op may
// also have host tensors). The slot is the 16-bit floating-point type among the tensors (BF16 or
// F16; a mixed-precision call mixes one of them with F32), else F32.
struct Dispatch {
  Device device;
  bool have_device = false;
  KernelDType dtype = KernelDType::F32;
};

void note(Dispatch& d, const char* op, bool transfer, const Tensor& t) {
  if (!t.defined()) return;
  KernelDType narrow = KernelDType::F32;
  if (t.dtype() == DType::BF16) narrow = KernelDType::BF16;
  if (t.dtype() == DType::F16) narrow = KernelDType::F16;
  if (narrow != KernelDType::F32) {
    // cast converts between any two of them; its kernel serves every slot.
    DS_CHECK(d.dtype == KernelDType::F32 || d.dtype == narrow || transfer || std::string_view(op) == "cast",
             "{}: tensors of both bf16 and f16; an op mixes fp32 with at most one 16-bit type (convert with "
             "ops::cast)", op);
    if (d.dtype == KernelDType::F32) d.dtype = narrow;
  }
  const Device dev = t.device();
  if (!d.have_device) {
    d.device = dev;
    d.have_device = true;
  } else if (!(dev == d.device)) {
    // A transfer runs on the backend of its non-host side.
    DS_CHECK(transfer && (dev.is_cpu() || d.device.is_cpu()), "{}: tensors on {} and {}; ops take tensors on one "
             "device (copy between the host and a device with ops::copy)", op, d.device.str(), dev.str());
    if (d.device.is_cpu()) d.device = dev;
  }
}
template <class T>
void note(Dispatch&, const char*, bool, const T&) {}

// A transfer op's first tensor is its destination and the others its sources (ops.def). Counts
// one transfer per call between the host and a device, by direction, with the destination's bytes;
// host to host and device to device count nothing.
struct TransferEnds {
  bool have_dst = false, dst_host = false, src_host = false, src_device = false;
  size_t bytes = 0;
};
void note_end(TransferEnds& e, const Tensor& t) {
  if (!t.defined()) return;
  if (!e.have_dst) {
    e.have_dst = true;
    e.dst_host = t.device().is_cpu();
    e.bytes = t.nbytes();
  } else if (t.device().is_cpu()) {
    e.src_host = true;
  } else {
    e.src_device = true;
  }
}
template <class T>
void note_end(TransferEnds&, const T&) {}

template <class... A>
void count_transfer(const A&... args) {
  TransferEnds e;
  (note_end(e, args), ...);
  const auto bytes = int64_t(e.bytes);
  if (e.dst_host && e.src_device) {
    g_transfers.device_to_host.fetch_add(1, std::memory_order_relaxed);
    g_transfers.device_to_host_bytes.fetch_add(bytes, std::memory_order_relaxed);
  } else if (!e.dst_host && e.src_host) {
    g_transfers.host_to_device.fetch_add(1, std::memory_order_relaxed);
    g_transfers.host_to_device_bytes.fetch_add(bytes, std::memory_order_relaxed);
  }
}

template <class... A>
const Backend& locate(Dispatch& d, const char* op, bool transfer, const A&... args) {
  (note(d, op, transfer, args), ...);
  const DeviceType type = d.have_device ? d.device.type : DeviceType::CPU;
  const Backend* b = find_backend(type);
  DS_CHECK(b, "{}: tensors are on {}, but no backend is registered for that device in this build of dstrain", op,
           d.device.str());
  return *b;
}

[[noreturn]] void missing(const Backend& b, const char* op, KernelDType dtype) {
  DS_FAIL("{}: the {} backend has no {} kernel (the fp32 kernel is the reference; convert with ops::cast)", op,
          b.name, kernel_dtype_name(dtype));
}

}  // namespace

std::string_view kernel_dtype_name(KernelDType k) {
  switch (k) {
    case KernelDType::F32: return "f32";
    case KernelDType::BF16: return "bf16";
    case KernelDType::F16: return "f16";
  }
  return "?";
}

const std::vector<std::string>& op_names() {
  static const std::vector<std::string> names = {
#define DS_OP(name, params, args) #name,
#include "backend/ops.def"
#undef DS_OP
  };
  return names;
}

bool has_kernel(const OpTable& table, std::string_view op, KernelDType dtype) {
#define DS_OP(name, params, args) \
  if (op == #name) return table.name[size_t(dtype)] != nullptr;
#include "backend/ops.def"
#undef DS_OP
  return false;
}

ops::TransferCounts ops::transfer_counts() {
  TransferCounts c;
  c.device_to_host = g_transfers.device_to_host.load(std::memory_order_relaxed);
  c.device_to_host_bytes = g_transfers.device_to_host_bytes.load(std::memory_order_relaxed);
  c.host_to_device = g_transfers.host_to_device.load(std::memory_order_relaxed);
  c.host_to_device_bytes = g_transfers.host_to_device_bytes.load(std::memory_order_relaxed);
  return c;
}

Backend& register_backend(std::unique_ptr<Backend> backend) {
  DS_CHECK(backend, "register_backend: no backend");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  for (const auto& b : r.backends) {
    DS_CHECK(b->device != backend->device, "a backend for this device type is already registered ('{}'); '{}' "
             "cannot register for it too", b->name, backend->name);
  }
#define DS_OP(op, params, args) \
  DS_CHECK(backend->ops.op[size_t(KernelDType::F32)], "backend '{}' has no fp32 kernel for {}", backend->name, #op);
#include "backend/ops.def"
#undef DS_OP
  r.backends.push_back(std::move(backend));
  const Backend* registered = r.backends.back().get();
  // Published last, with release order: a lookup that sees the pointer sees the whole table.
  r.by_type[size_t(registered->device)].store(registered, std::memory_order_release);
  return *r.backends.back();
}

const Backend* find_backend(DeviceType type) {
  const size_t i = size_t(type);
  if (i >= size_t(kDeviceTypes)) return nullptr;
  return registry().by_type[i].load(std::memory_order_acquire);
}

std::vector<const Backend*> registered_backends() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<const Backend*> out;
  for (const auto& b : r.backends) out.push_back(b.get());
  return out;
}

void unregister_backend(DeviceType type) {
  DS_CHECK(type != DeviceType::CPU, "the CPU backend is the reference and cannot be unregistered");
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.by_type[size_t(type)].store(nullptr, std::memory_order_release);
  for (auto it = r.backends.begin(); it != r.backends.end();) {
    if ((*it)->device == type) {
      r.retired.push_back(std::move(*it));
      it = r.backends.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- the ops:: entry points, one per line of ops.def -----------------------------------------
// Each finds the backend and slot of its tensors, runs the op's argument checks (checks.h: the
// only place they run, so a bad call gets one message on every device and the kernels, which
// assume checked arguments, check nothing again), calls the slot, and counts a transfer op's
// host/device copies.

#define DS_UNPACK(...) __VA_ARGS__
#define DS_WRAPPER(name, params, args, transfer)                                        \
  void ops::name params {                                                               \
    Dispatch dispatch_;                                                                 \
    const Backend& backend_ = locate(dispatch_, #name, transfer, DS_UNPACK args);       \
    ops::checks::name args;                                                             \
    const auto fn = backend_.ops.name[size_t(dispatch_.dtype)];                         \
    if (!fn) missing(backend_, #name, dispatch_.dtype);                                 \
    fn args;                                                                            \
    if constexpr (transfer) count_transfer(DS_UNPACK args);                             \
  }
#define DS_OP(name, params, args) DS_WRAPPER(name, params, args, false)
#define DS_TRANSFER_OP(name, params, args) DS_WRAPPER(name, params, args, true)
#include "backend/ops.def"
#undef DS_OP
#undef DS_TRANSFER_OP

}  // namespace dstrain
