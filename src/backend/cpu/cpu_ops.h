// The CPU backend (OpenMP, GEMMs through sgemm.h): one kernel per op of backend/ops.def, same signatures.
// Its fp32 kernels are the reference every other backend and dtype is tested against. They assume
// arguments the ops:: wrapper has checked (backend/checks.h) and check only the data they read.
#pragma once

#include "backend/ops.h"

namespace dstrain::ops {
struct OpTable;
}

namespace dstrain::cpu {

using ops::AdamWStep;
using ops::AttentionLayout;
using ops::MoERouteParams;
using ops::MoEDropPolicy;
using ops::MoEScoring;
using ops::YarnParams;

#define DS_OP(name, params, args) void name params;
#include "backend/ops.def"
#undef DS_OP

// Shared by rope_forward/rope_backward and their interleaved forms.
void rope_apply(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin, bool inverse);
void rope_apply_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos, Tensor sin,
                            bool inverse);

// One row of SwiGLU (gate g, up u, both I long) and of its backward (d: the output's gradient),
// shared by the fp32 and 16-bit kernels so that both compute the same bits.
void swiglu_forward_row(const float* g, const float* u, float* o, int64_t I);
void swiglu_backward_row(const float* g, const float* u, const float* d, float* dg, float* du, int64_t I);

// Register the fused 16-bit kernels over the generic ones of widen.h: the GEMMs (linear.cpp)
// and the element-wise kernels (kernels_16bit.cpp).
void fill_gemm_16bit(ops::OpTable& table);
void adamw_update_16bit(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor param_copy,
                        const ops::AdamWStep& s);
void fill_elementwise_16bit(ops::OpTable& table);

}  // namespace dstrain::cpu
