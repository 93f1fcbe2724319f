// The CUDA backend's op table, filled group by group. Each group is a .cpp of op wrappers
// (compiled by g++; the op's argument checks ran in the ops:: wrapper, backend/checks.cpp, and a
// wrapper checks only the data its kernels depend on and the kernels' own limits) over a .cu of kernels (compiled by nvcc, with a plain
// header of launch functions: nvcc never parses dstrain's own headers). Every kernel runs on
// cuda::stream() (core/cuda/runtime.h).
//
// Semantics are backend/ops.def's: an fp32 kernel for every op; a bf16 kernel (slot BF16) for
// the ops mixed precision runs in 16 bits, taking any mix of fp32 and bf16 for its floating-point
// tensors, computing in fp32 and rounding once to nearest even. The op suite
// (tests/unit/test_backend_ops.cpp) checks every slot against the CPU fp32 reference.
#pragma once

#include "backend/backend.h"
#include "core/cuda/runtime.h"
#include "core/tensor.h"

namespace dstrain::cuda {

// copy, cast, add, add_inplace, scale_inplace, fill, copy_blocks, sum_squares, count_non_finite,
// fill_normal, shift_tokens, loss_sums (elementwise.cpp/.cu).
void fill_elementwise(ops::OpTable& t);
// linear_forward, linear_backward through cuBLASLt (linear.cpp).
void fill_linear(ops::OpTable& t);
// adamw_update (optim.cpp/.cu).
void fill_optim(ops::OpTable& t);
// embedding (4 ops), rmsnorm (2), rope (6), swiglu (2) (layers.cpp/.cu).
void fill_layers(ops::OpTable& t);
// cross_entropy_forward/backward, the vocabulary-parallel three (cross_entropy.cpp/.cu).
void fill_cross_entropy(ops::OpTable& t);
// attention_forward/backward: tiled, online softmax (attention.cpp/.cu).
void fill_attention(ops::OpTable& t);
// the MoE ops: scores, routing, aux loss, dispatch and capacity plans, permutations, bias (moe.cpp/.cu).
void fill_moe(ops::OpTable& t);

// The kernel element type of a floating-point tensor (F32, BF16 or F16); an error otherwise.
Elem elem_of(const Tensor& t, const char* what);

}  // namespace dstrain::cuda
