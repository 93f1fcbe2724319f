// Launch functions of the cross-entropy kernels (cross_entropy.cu). A plain header over raw
// device pointers, sizes and element types, read by nvcc and by the op wrappers of
// cross_entropy.cpp (which check the arguments, targets included, first). Every launch runs on
// cuda::stream(); a floating-point tensor is passed as its pointer and its Elem.
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda {

// One block per row of logits (N,V), one pass over the row (online maximum and sum of
// exponentials, combined across threads in a fixed order): lse (N) and losses (N), 0 for rows
// whose target is ignore_index.
void launch_cross_entropy_forward(void* losses, Elem le, void* lse, Elem se, const void* logits, Elem ge,
                                  const int32_t* targets, int64_t N, int64_t V, int32_t ignore_index);
// The same pass over a vocabulary shard's columns: stats (N,2) = {lse of the row, the target's
// logit where target - vocab_begin is in [0, V), else 0 (also for ignored rows)}.
void launch_cross_entropy_shard_forward(void* stats, Elem se, const void* logits, Elem ge, const int32_t* targets,
                                        int64_t N, int64_t V, int64_t vocab_begin, int32_t ignore_index);
// One block per row: out (N,2) = {the row's largest logit, the target's logit where
// target - vocab_begin is in [0, V), else -inf (also for ignored rows)}.
void launch_logit_max_and_target(float* out, const void* logits, Elem ge, const int32_t* targets, int64_t N, int64_t V,
                                 int64_t vocab_begin, int32_t ignore_index);
// lse (N) and losses (N) from the P shards' stats (P,N,2), in double in shard order.
void launch_cross_entropy_combine(void* losses, Elem le, void* lse, Elem se, const void* shard_stats, Elem ste,
                                  const int32_t* targets, int64_t P, int64_t N, int32_t ignore_index);
// dlogits (N,V) = scale * (exp(logits - lse) - onehot(target - vocab_begin)), zero rows for
// ignored targets; dlogits may be logits (each element is read, then written, by one thread).
void launch_cross_entropy_backward(void* dlogits, Elem de, const void* logits, Elem ge, const void* lse, Elem se,
                                   const int32_t* targets, int64_t N, int64_t V, float scale, int64_t vocab_begin,
                                   int32_t ignore_index);

}  // namespace dstrain::cuda
