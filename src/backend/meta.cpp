#include "backend/meta.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>

#include "backend/backend.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/exec_trace.h"

namespace dstrain::meta {
namespace {

// Address space without access rights and without backing (PROT_NONE, MAP_NORESERVE): distinct
// pointers for distinct buffers, no memory used, and a fault at the first touch.
class MetaAllocator final : public Allocator {
 public:
  std::string_view name() const override { return "meta"; }
  DeviceType device() const override { return DeviceType::Meta; }
  void* allocate(Device device, size_t bytes, const std::string& label) override {
    DS_CHECK(device.type == DeviceType::Meta, "the meta allocator got a request for {}", device.str());
    if (bytes == 0) return nullptr;
    void* p = ::mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw OutOfMemory(fmt::format("meta device: reserving {} bytes of address space for '{}' failed: {}", bytes,
                                    label, std::strerror(errno)));
    }
    return p;
  }
  void free(Device, void* p, size_t bytes) override {
    if (p) ::munmap(p, bytes);
  }
  void zero(Device, void*, size_t) override {}
  void release_pages(Device, void*, size_t) override {}
};

using ops::AttentionLayout;

// ---- what each op would do, for an execution trace (core/exec_trace.h) ----------------
// Its tensors' bytes and shapes, its kernel slot's dtype (the 16-bit type among its tensors,
// else F32: ops.def), and the FLOPs of the ops whose arithmetic is not bounded by memory.
void add_arg(TraceEvent& e, const Tensor& t) {
  e.shapes.push_back(t.defined() ? t.shape() : Shape());
  e.dtypes.push_back(t.dtype());
  if (!t.defined()) return;
  e.bytes += double(t.nbytes());
  if (t.dtype() == DType::BF16 || t.dtype() == DType::F16) e.dtype = t.dtype();
}
template <class T>
void add_arg(TraceEvent&, const T&) {}

// Causal attention: query row t attends to t + 1 keys, (T (T + 1) / 2) pairs per head.
double causal_pairs(const Tensor& qkv, const AttentionLayout& l) {
  const double B = double(qkv.size(0)), T = double(qkv.size(1));
  return B * double(l.n_head) * T * (T + 1) / 2;
}

template <class Tag, class... A>
double op_flops(Tag, const A&...) {
  return 0;
}
#define DS_OP(name, params, args) struct Tag_##name {};
#include "backend/ops.def"
#undef DS_OP
double op_flops(Tag_linear_forward, const Tensor& out, const Tensor&, const Tensor& w, const bool&) {
  return 2.0 * double(out.numel()) * double(w.size(1));
}
double op_flops(Tag_linear_backward, const Tensor& dx, const Tensor& dw, const Tensor& dout, const Tensor&,
                const Tensor& w, const bool&) {
  const double mnk = double(dout.numel()) * double(w.size(1));
  return (dx.defined() ? 2.0 * mnk : 0.0) + (dw.defined() ? 2.0 * mnk : 0.0);
}
// QK^T and PV.
double op_flops(Tag_attention_forward, const Tensor&, const Tensor&, const Tensor& qkv, const AttentionLayout& l,
                const float&) {
  return 2.0 * causal_pairs(qkv, l) * double(l.qk_dim + l.v_dim);
}
// QK^T again, dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q.
double op_flops(Tag_attention_backward, const Tensor&, const Tensor&, const Tensor& qkv, const Tensor&, const Tensor&,
                const AttentionLayout& l, const float&) {
  return 2.0 * causal_pairs(qkv, l) * double(3 * l.qk_dim + 2 * l.v_dim);
}

template <class... A>
void extras(TraceEvent&, const A&...) {}
void extras(TraceEvent& e, const AttentionLayout& l) {
  e.extra = {l.n_head, l.n_kv_head, l.qk_dim, l.v_dim, l.q_offset, l.k_offset, l.v_offset, l.row_stride};
}

template <class Tag>
struct Record {
  const char* name;
  template <class... A>
  void operator()(const A&... a) const {
    ExecTrace* trace = current_trace();
    if (!trace) return;
    TraceEvent e;
    e.kind = TraceEvent::Kind::Op;
    e.name = name;
    (add_arg(e, a), ...);
    (extras_of(e, a), ...);
    e.flops = op_flops(Tag{}, a...);
    trace->push(std::move(e));
  }
  template <class T>
  static void extras_of(TraceEvent& e, const T& v) {
    if constexpr (std::is_same_v<T, AttentionLayout>) extras(e, v);
  }
};

// Every op of ops.def, in every kernel slot, computes nothing; with a trace installed it says
// what it would have done.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
void fill_table(OpTable& t) {
  using namespace ops;
#define DS_OP(name, params, args) t.name.fill([] params { Record<Tag_##name>{#name} args; });
#include "backend/ops.def"
#undef DS_OP
}
#pragma GCC diagnostic pop

}  // namespace

void ensure_registered() {
  static std::once_flag once;
  std::call_once(once, [] {
    register_allocator(std::make_unique<MetaAllocator>());
    auto b = std::make_unique<Backend>();
    b->name = "meta";
    b->device = DeviceType::Meta;
    fill_table(b->ops);
    register_backend(std::move(b));
  });
}

}  // namespace dstrain::meta
