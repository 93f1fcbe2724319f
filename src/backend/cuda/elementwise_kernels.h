// Launch functions of the element-wise, copy and reduction kernels (elementwise.cu), over raw
// device pointers: a plain header that both nvcc and the g++-compiled op wrappers
// (elementwise.cpp, linear.cpp) read. Every kernel runs on cuda::stream(); sizes are element
// counts; each floating-point tensor comes with its Elem, loaded as fp32 and stored rounded once
// to nearest even, so one kernel serves the F32, BF16 and F16 slots and any mix of them.
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

#if defined(__CUDACC__)
#include "backend/cuda/elem.cuh"  // ld, st
#endif

namespace dstrain::cuda {

// out[i] = a[i] + b[i], i < n (out may alias a or b: each element is read before it is written).
void launch_add(void* out, Elem eo, const void* a, Elem ea, const void* b, Elem eb, int64_t n);
// x[i] *= s.
void launch_scale(void* x, Elem e, float s, int64_t n);
// x[i] = value.
void launch_fill(void* x, Elem e, float value, int64_t n);
// dst[i] = src[i] converted (dst and src of different Elem; same Elem is a plain memcpy).
void launch_cast(void* dst, Elem ed, const void* src, Elem es, int64_t n);
// ops::copy_blocks on (rows, dcols) dst and (rows, scols) src, arguments already checked.
void launch_copy_blocks(void* dst, Elem ed, int64_t dcols, int64_t dst_offset, int64_t dst_step, const void* src,
                        Elem es, int64_t scols, int64_t src_offset, int64_t src_step, int64_t rows, int64_t blocks,
                        int64_t width, bool accumulate);
// out[0] = sum of x[i]^2 in double, in a fixed order that depends on n only.
void launch_sum_squares(double* out, const void* x, Elem e, int64_t n);
// out[0] = how many x[i] are NaN or infinite.
void launch_count_non_finite(int64_t* out, const void* x, Elem e, int64_t n);
// x[i] = float(std * philox_normal(seed, stream, first + i)) (core/philox.h), rounded to e.
void launch_fill_normal(void* x, Elem e, int64_t n, double std, uint64_t seed, uint64_t stream, uint64_t first);
// ops::shift_tokens on (B, T) int32 tensors; ignore_index is ops::kIgnoreIndex.
void launch_shift_tokens(int32_t* out, const int32_t* src, int64_t B, int64_t T, int64_t shift, int32_t fill,
                         int32_t ignore_as, int32_t ignore_index);
// out[0] += sum of losses[i] over i with targets[i] != ignore_index, out[1] += their count;
// summed in double in a fixed order that depends on n only.
void launch_loss_sums(double* out, const void* losses, Elem e, const int32_t* targets, int64_t n,
                      int32_t ignore_index);

#if defined(__CUDACC__)

// Grid of a grid-stride loop over n elements: enough blocks to fill the GPU, no more than a
// launch allows.
inline unsigned grid_for(int64_t n, int threads) {
  const unsigned b = blocks_for(n, threads);
  return b < 65536u ? b : 65536u;
}
#endif

}  // namespace dstrain::cuda
