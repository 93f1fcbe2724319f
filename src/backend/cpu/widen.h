// The CPU backend's generic 16-bit kernels: any op of ops.def run on BF16 or F16 tensors (or a
// mix of one of them with F32) by its fp32 kernel. Every 16-bit tensor argument is widened to an
// fp32 temporary, the fp32 kernel runs, and the temporaries are rounded back (to nearest even)
// into the 16-bit tensors, so outputs, in-place updates and accumulations ("+=") all come out as
// the fp32 kernel would give them on the rounded inputs, rounded once. Arguments that are the same
// tensor share one temporary, so aliasing (dlogits == logits) is kept.
//
// This makes every op usable in mixed precision and is the semantic reference of the fused
// 16-bit kernels, which replace it op by op where speed matters: it costs a pass over each
// 16-bit argument in and out.
#pragma once

#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "core/buffer.h"

namespace dstrain::cpu {

class Widener {
 public:
  Widener() = default;
  Widener(const Widener&) = delete;
  Widener& operator=(const Widener&) = delete;

  Tensor wrap(const Tensor& t) {
    if (!t.defined() || (t.dtype() != DType::BF16 && t.dtype() != DType::F16)) return t;
    for (const Entry& e : entries_) {
      if (e.narrow.raw() == t.raw() && e.narrow.numel() == t.numel() && e.narrow.dtype() == t.dtype()) {
        return e.wide.view(t.shape());
      }
    }
    Entry e{t, Buffer("widened 16-bit argument", MemCategory::Workspace, DType::F32, t.numel(), t.device()), {}};
    e.wide = e.buffer.tensor().view(t.shape());
    cpu::cast(e.wide, t);
    entries_.push_back(std::move(e));
    return entries_.back().wide;
  }
  template <class T>
  const T& wrap(const T& v) {
    return v;
  }
  // Rounds every temporary back into its 16-bit tensor.
  void finish() {
    for (const Entry& e : entries_) cpu::cast(e.narrow, e.wide);
  }

 private:
  struct Entry {
    Tensor narrow;
    Buffer buffer;
    Tensor wide;
  };
  std::vector<Entry> entries_;
};

template <class F>
struct Widen;
template <class... A>
struct Widen<void (*)(A...)> {
  template <void (*Fn)(A...)>
  static void call(A... args) {
    Widener w;
    Fn(w.wrap(args)...);
    w.finish();
  }
};

// The generic 16-bit kernel of cpu::name.
#define DS_CPU_WIDENED(name) (&::dstrain::cpu::Widen<decltype(&::dstrain::cpu::name)>::template call<&::dstrain::cpu::name>)

}  // namespace dstrain::cpu
