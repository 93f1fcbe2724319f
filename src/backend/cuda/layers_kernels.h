// Launch functions of the layer kernels (layers.cu): embedding, RMSNorm, rotary embedding and
// SwiGLU. A plain header over raw device pointers, sizes and element types, so that both nvcc
// (layers.cu) and g++ (the op wrappers of layers.cpp, which check the arguments first) read it.
// Every launch runs on cuda::stream(); a floating-point tensor is passed as its pointer and its
// Elem (F32, BF16 or F16): kernels load through fp32 and round once when they store 16 bits.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda {

// ---- token ids -----------------------------------------------------------------------------

// The first position n < count whose id is outside [0, limit) (ignore_index is accepted where
// allow_ignore), or -1 when there is none; *bad_id gets that id. flag: 8 bytes of device
// scratch. Synchronises the stream: the ops whose contract makes a bad id a host-visible error
// call it.
int64_t first_bad_id(const int32_t* ids, int64_t count, int64_t limit, bool allow_ignore, int32_t ignore_index,
                     unsigned long long* flag, int32_t* bad_id);

// ---- embedding -----------------------------------------------------------------------------

// out (N,C) row n = table (Vl,C) row ids[n] - vocab_begin where that is in [0, Vl), else zeros.
void launch_embedding_gather(void* out, Elem oe, const int32_t* ids, const void* table, Elem te, int64_t N, int64_t C,
                             int64_t vocab_begin, int64_t Vl);

// dtable (Vl,C) += the rows of dout (N,C) by ids - vocab_begin (rows outside [0, Vl) skipped),
// each element summing its rows in token order (a stable sort of the ids, then one pass per
// distinct id): deterministic, and the CPU kernel's fp32 sums. The workspace holds the sort.
size_t embedding_scatter_workspace(int64_t N, int64_t Vl);
void launch_embedding_scatter(void* dtable, Elem de, const void* dout, Elem ge, const int32_t* ids, int64_t N,
                              int64_t C, int64_t vocab_begin, int64_t Vl, void* workspace, size_t workspace_bytes);

// ---- RMSNorm -------------------------------------------------------------------------------

void launch_rmsnorm_forward(void* out, Elem oe, void* rstd, Elem re, const void* x, Elem xe, const void* weight,
                            Elem we, int64_t N, int64_t C, float eps);
// dx (+=) row by row; dweight (+=) through per-chunk partial sums (workspace: the floats that
// rmsnorm_dweight_partials names) reduced in chunk order: deterministic.
int64_t rmsnorm_dweight_partials(int64_t N, int64_t C);
void launch_rmsnorm_backward(void* dx, Elem dxe, void* dweight, Elem dwe, const void* dout, Elem ge, const void* x,
                             Elem xe, const void* weight, Elem we, const void* rstd, Elem re, int64_t N, int64_t C,
                             float* partials);

// ---- rotary embedding ----------------------------------------------------------------------

// cos, sin (T, half): cos(t * inv_freq[i]) * m and sin(...) * m, inv_freq (half floats, device).
void launch_rope_tables(void* cos, Elem ce, void* sin, Elem se, const float* inv_freq, int64_t T, int64_t half,
                        float m);
// x (B,T,W) in place: n_heads heads of head_dim at column offset, rotate_half convention;
// inverse flips the sign of sin.
void launch_rope(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se, int64_t B, int64_t T, int64_t W,
                 int64_t offset, int n_heads, int head_dim, bool inverse);
// DeepSeek's interleaved pairing (rope_forward_interleaved / rope_backward_interleaved).
// The largest head dim the kernel takes (a head is staged in shared memory).
constexpr int kRopeInterleavedMaxDim = 8192;
void launch_rope_interleaved(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se, int64_t B, int64_t T,
                             int64_t W, int64_t offset, int n_heads, int64_t head_stride, int dim, bool inverse);

// ---- SwiGLU --------------------------------------------------------------------------------

void launch_swiglu_forward(void* out, Elem oe, const void* gate_up, Elem ge, int64_t N, int64_t I);
void launch_swiglu_backward(void* dgate_up, Elem de, const void* dout, Elem ge, const void* gate_up, Elem ue, int64_t N,
                            int64_t I);

}  // namespace dstrain::cuda
