// A backend is a table of the ops of ops.def that one kind of device fills in. The CPU backend
// registers itself (its fp32 kernels are the reference); a CUDA backend registers beside it, and
// tests register fakes, all through register_backend. ops:: calls look up the table of their
// tensors' device and call the slot of their dtype: there is no per-op branch on the device.
// The ops:: wrapper runs each op's argument checks once, before it calls the slot
// (backend/checks.h); a kernel assumes checked arguments and checks only what depends on the data
// or on its own limits. Looking up a backend takes no lock (find_backend).
#pragma once

#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "backend/ops.h"
#include "core/device.h"

namespace dstrain {

class MarkClock;  // backend/timing.h

// The floating-point types a kernel may be written for. An op's slot is chosen by the first
// of its tensor arguments whose dtype is one of these (F32 when it has none, e.g. integer-only
// ops). The F32 kernels are required; BF16 and F16 ones are optional per op.
enum class KernelDType { F32, BF16, F16 };
constexpr int kKernelDTypes = 3;
std::string_view kernel_dtype_name(KernelDType k);

namespace ops {
// One slot per op and kernel dtype; a null slot has no kernel.
struct OpTable {
#define DS_OP(name, params, args) std::array<void(*) params, kKernelDTypes> name{};
#include "backend/ops.def"
#undef DS_OP
};
}  // namespace ops
using ops::OpTable;

// Every op's name, in ops.def order.
const std::vector<std::string>& op_names();
// Whether a table has a kernel for `op` in slot `dtype`; false for an unknown op.
bool has_kernel(const OpTable& table, std::string_view op, KernelDType dtype);

struct Backend {
  std::string name;  // "cpu", "cuda", ...
  DeviceType device = DeviceType::CPU;
  OpTable ops;
  // Timing marks on the device's queue of work (backend/timing.h); null: the host clock, right
  // for devices whose ops run as they are called.
  std::unique_ptr<MarkClock> (*make_mark_clock)(Device device) = nullptr;
};

// Registers the backend for its device type; a second backend for the same type is an error.
// Returns the registered backend.
Backend& register_backend(std::unique_ptr<Backend> backend);
// The backend for a device type, or null when none is registered (the CPU one always is). Takes
// no lock: every op call looks up its backend, in front of each kernel launch on a GPU.
const Backend* find_backend(DeviceType type);
// Every registered backend, the CPU reference first.
std::vector<const Backend*> registered_backends();
// Removes a registered backend other than the CPU one (tests that register a fake).
void unregister_backend(DeviceType type);

namespace cpu {
// Fills the CPU backend's table with the kernels of backend/cpu/.
void fill_table(OpTable& table);
}  // namespace cpu

}  // namespace dstrain
