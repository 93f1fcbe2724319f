// The element-wise, copy and reduction ops of the CUDA backend: a launch of elementwise.cu on
// arguments the ops:: wrapper has checked (backend/checks.cpp). The
// floating-point ops take any of F32, BF16 and F16 for each floating-point tensor and serve all
// three slots, as the CPU's fp32 kernels and their widened 16-bit forms do together.
#include <cstring>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/elementwise_kernels.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

void add(Tensor out, Tensor a, Tensor b) {
  const int64_t n = out.numel();
  launch_add(out.raw(), elem_of(out, "add: out"), a.raw(), elem_of(a, "add: a"), b.raw(), elem_of(b, "add: b"), n);
}

void add_inplace(Tensor out, Tensor a) {
  const int64_t n = out.numel();
  const Elem e = elem_of(out, "add_inplace: out");
  launch_add(out.raw(), e, out.raw(), e, a.raw(), elem_of(a, "add_inplace: a"), n);
}

void scale_inplace(Tensor x, float s) { launch_scale(x.raw(), elem_of(x, "scale_inplace: x"), s, x.numel()); }

void fill(Tensor x, float value) { launch_fill(x.raw(), elem_of(x, "fill: x"), value, x.numel()); }

// A transfer op: dst and src may be on the host and on the GPU. A transfer that involves host
// memory is complete when copy returns (the caller reads or reuses the host memory next);
// device-to-device copies stay asynchronous on the stream.
void copy(Tensor dst, Tensor src) {
  const size_t bytes = src.nbytes();
  if (bytes == 0) return;
  const bool dst_host = dst.device().is_cpu(), src_host = src.device().is_cpu();
  if (dst_host && src_host) {
    std::memcpy(dst.raw(), src.raw(), bytes);
    return;
  }
  const cudaMemcpyKind kind = dst_host ? cudaMemcpyDeviceToHost
                              : src_host ? cudaMemcpyHostToDevice
                                         : cudaMemcpyDeviceToDevice;
  DS_CUDA_CHECK(cudaMemcpyAsync(dst.raw(), src.raw(), bytes, kind, stream()));
  if (dst_host || src_host) DS_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

void cast(Tensor dst, Tensor src) {
  launch_cast(dst.raw(), elem_of(dst, "cast: dst"), src.raw(), elem_of(src, "cast: src"), src.numel());
}

void copy_blocks(Tensor dst, int64_t dst_offset, int64_t dst_step, Tensor src, int64_t src_offset, int64_t src_step,
                 int64_t blocks, int64_t width, bool accumulate) {
  const int64_t dcols = dst.size(-1), scols = src.size(-1);
  const int64_t rows = dcols > 0 ? dst.numel() / dcols : 0;
  if (blocks == 0 || width == 0 || rows == 0) return;  // nothing to copy
  launch_copy_blocks(dst.raw(), elem_of(dst, "copy_blocks: dst"), dcols, dst_offset, dst_step, src.raw(),
                     elem_of(src, "copy_blocks: src"), scols, src_offset, src_step, rows, blocks, width, accumulate);
}

void sum_squares(Tensor out, Tensor x) {
  launch_sum_squares(static_cast<double*>(out.raw()), x.raw(), elem_of(x, "sum_squares: x"), x.numel());
}

void count_non_finite(Tensor out, Tensor x) {
  launch_count_non_finite(static_cast<int64_t*>(out.raw()), x.raw(), elem_of(x, "count_non_finite: x"), x.numel());
}

void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index) {
  launch_fill_normal(x.raw(), elem_of(x, "fill_normal: x"), x.numel(), std, seed, stream, first_index);
}

void shift_tokens(Tensor out, Tensor src, int64_t shift, int32_t fill, int32_t ignore_as) {
  launch_shift_tokens(static_cast<int32_t*>(out.raw()), static_cast<const int32_t*>(src.raw()), out.size(0),
                      out.size(1), shift, fill, ignore_as, ops::kIgnoreIndex);
}

void loss_sums(Tensor out, Tensor losses, Tensor targets) {
  launch_loss_sums(static_cast<double*>(out.raw()), losses.raw(), elem_of(losses, "loss_sums: losses"),
                   static_cast<const int32_t*>(targets.raw()), losses.numel(), ops::kIgnoreIndex);
}

}  // namespace

void fill_elementwise(ops::OpTable& t) {
  for (KernelDType k : {KernelDType::F32, KernelDType::BF16, KernelDType::F16}) {
    const size_t s = size_t(k);
    t.copy[s] = &copy;
    t.cast[s] = &cast;
    t.add[s] = &add;
    t.add_inplace[s] = &add_inplace;
    t.scale_inplace[s] = &scale_inplace;
    t.fill[s] = &fill;
    t.copy_blocks[s] = &copy_blocks;
    t.sum_squares[s] = &sum_squares;
    t.count_non_finite[s] = &count_non_finite;
    t.fill_normal[s] = &fill_normal;
    t.loss_sums[s] = &loss_sums;
  }
  // Integer tokens only: the F32 slot serves every call.
  t.shift_tokens[size_t(KernelDType::F32)] = &shift_tokens;
}

}  // namespace dstrain::cuda
