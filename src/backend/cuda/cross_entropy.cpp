// Softmax cross-entropy ops of the CUDA backend: the whole-vocabulary pair and the three
// vocabulary-parallel ones, on arguments the ops:: wrapper has checked (backend/checks.cpp). The
// targets are data and checked here: a target out of range is the same
// host-visible error as on the CPU (the ids are checked on the device and the answer read back,
// the one synchronisation of these ops). One wrapper serves the F32, BF16 and F16 slots.
#include "backend/cuda/cross_entropy_kernels.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/layers_kernels.h"
#include "core/buffer.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// Targets are int32 (the ops:: wrapper checked the dtype).
const int32_t* targets_of(const Tensor& t) { return static_cast<const int32_t*>(t.raw()); }

// "target id ... is outside the vocabulary [0, vocab_size)" for the first target that is neither
// kIgnoreIndex nor in range, as the CPU kernels word it.
void check_targets(const Tensor& targets, const int32_t* tp, int64_t N, int64_t vocab_size) {
  Buffer flag("cross_entropy target check", MemCategory::Workspace, DType::I64, 1, targets.device());
  int32_t bad = 0;
  const int64_t n = first_bad_id(tp, N, vocab_size, true, ops::kIgnoreIndex,
                                 static_cast<unsigned long long*>(flag.data()), &bad);
  if (n >= 0) DS_FAIL("target id {} at position {} is outside the vocabulary [0, {})", bad, n, vocab_size);
}

void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const char* op = "cross_entropy_forward";
  const Elem le = elem_of(losses, op), se = elem_of(lse, op), ge = elem_of(logits, op);
  const int32_t* tp = targets_of(targets);
  check_targets(targets, tp, N, V);
  launch_cross_entropy_forward(losses.raw(), le, lse.raw(), se, logits.raw(), ge, tp, N, V, ops::kIgnoreIndex);
}

// cross_entropy_backward and its vocabulary shards (the CPU's backward_rows).
void backward_rows(const char* op, Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale,
                   int64_t vocab_begin) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const Elem de = elem_of(dlogits, op), ge = elem_of(logits, op), se = elem_of(lse, op);
  const int32_t* tp = targets_of(targets);
  launch_cross_entropy_backward(dlogits.raw(), de, logits.raw(), ge, lse.raw(), se, tp, N, V, scale, vocab_begin,
                                ops::kIgnoreIndex);
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale) {
  backward_rows("cross_entropy_backward", dlogits, logits, lse, targets, scale, 0);
}

void cross_entropy_shard_forward(Tensor stats, Tensor logits, Tensor targets, int64_t vocab_begin,
                                 int64_t vocab_size) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const char* op = "cross_entropy_shard_forward";
  const Elem se = elem_of(stats, op), ge = elem_of(logits, op);
  const int32_t* tp = targets_of(targets);
  check_targets(targets, tp, N, vocab_size);
  launch_cross_entropy_shard_forward(stats.raw(), se, logits.raw(), ge, tp, N, V, vocab_begin, ops::kIgnoreIndex);
}

void logit_max_and_target(Tensor out, Tensor logits, Tensor targets, int64_t vocab_begin) {
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  const char* op = "logit_max_and_target";
  // The kernel's own limit: it writes fp32 (the op also takes a 16-bit out, which the CPU
  // backend's 16-bit slots round into).
  DS_CHECK(out.dtype() == DType::F32, "logit_max_and_target: out is {}; the CUDA kernel writes f32 (pass an F32 out)",
           dtype_name(out.dtype()));
  launch_logit_max_and_target(static_cast<float*>(out.raw()), logits.raw(), elem_of(logits, op),
                              targets_of(targets), N, V, vocab_begin, ops::kIgnoreIndex);
}

void cross_entropy_combine(Tensor losses, Tensor lse, Tensor shard_stats, Tensor targets) {
  const int64_t N = targets.numel(), P = shard_stats.ndim() > 0 ? shard_stats.size(0) : 0;
  const char* op = "cross_entropy_combine";
  const Elem le = elem_of(losses, op), se = elem_of(lse, op), ste = elem_of(shard_stats, op);
  const int32_t* tp = targets_of(targets);
  launch_cross_entropy_combine(losses.raw(), le, lse.raw(), se, shard_stats.raw(), ste, tp, P, N, ops::kIgnoreIndex);
}

void cross_entropy_shard_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale,
                                  int64_t vocab_begin) {
  backward_rows("cross_entropy_shard_backward", dlogits, logits, lse, targets, scale, vocab_begin);
}

}  // namespace

void fill_cross_entropy(ops::OpTable& t) {
  for (size_t s = 0; s < size_t(kKernelDTypes); ++s) {
    t.cross_entropy_forward[s] = &cross_entropy_forward;
    t.cross_entropy_backward[s] = &cross_entropy_backward;
    t.cross_entropy_shard_forward[s] = &cross_entropy_shard_forward;
    t.cross_entropy_combine[s] = &cross_entropy_combine;
    t.cross_entropy_shard_backward[s] = &cross_entropy_shard_backward;
    t.logit_max_and_target[s] = &logit_max_and_target;
  }
}

}  // namespace dstrain::cuda
