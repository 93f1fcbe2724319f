// Launch functions of the CUDA attention kernels (attention.cu), over raw device pointers: the
// op wrappers of attention.cpp check the tensors and call these. A plain header (nvcc reads it).
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda::attn {

// The largest q/k and v head dims the kernels take.
constexpr int kMaxHeadDim = 256;

// qkv (B, T, W): query head h at columns q_offset + h*Dqk, kv head g of k at k_offset + g*Dqk
// and of v at v_offset + g*Dv (ops::AttentionLayout); query head h reads kv head h / (H / Hkv).
struct Dims {
  int64_t B = 0, T = 0, W = 0;
  int H = 0, Hkv = 0, Dqk = 0, Dv = 0;
  int64_t q_offset = 0, k_offset = 0, v_offset = 0;
};

// A floating-point tensor in device memory and its element type.
struct Ptr {
  const void* p = nullptr;
  Elem e = Elem::F32;
};
struct MutPtr {
  void* p = nullptr;
  Elem e = Elem::F32;
};

// The launches return false when no tile size fits the device's shared memory (never on sm_80
// or sm_90 for head dims up to kMaxHeadDim).

// out (B, T, H*Dv); lse (B, H, T) the log-sum-exp of each softmax row.
bool forward(MutPtr out, MutPtr lse, Ptr qkv, const Dims& d, float scale);

// Floats of scratch the backward needs: delta = rowsum(dout * out), (B, H, T).
int64_t backward_workspace(const Dims& d);
// dqkv (B, T, W): the q, k and v column ranges are overwritten, other columns left alone.
// workspace: backward_workspace(d) floats of device memory.
bool backward(MutPtr dqkv, Ptr dout, Ptr qkv, Ptr out, Ptr lse, float* workspace, const Dims& d, float scale);

}  // namespace dstrain::cuda::attn
