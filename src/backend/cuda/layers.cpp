// The layer ops of the CUDA backend: embedding (4), RMSNorm (2), rotary embedding (6) and
// SwiGLU (2). Each wrapper launches the kernels of layers.cu on arguments the ops:: wrapper has
// checked (backend/checks.cpp); it checks only the token ids (data) and its kernels' limits. One
// wrapper serves the F32, BF16 and F16 slots: every floating-point tensor is passed with its own
// element type.
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/layers_kernels.h"
#include "core/buffer.h"
#include "core/error.h"

namespace dstrain::cuda {
namespace {

// Token ids are int32 (the ops:: wrapper checked the dtype).
const int32_t* ids_of(const Tensor& t) { return static_cast<const int32_t*>(t.raw()); }

// ---- embedding -----------------------------------------------------------------------------

// embedding_forward and its vocabulary shards (the CPU's gather_rows).
void gather_rows(const char* op, Tensor out, Tensor tokens, Tensor table, int64_t vocab_begin, int64_t vocab_size) {
  const int64_t Vl = table.size(0), C = table.size(1), N = tokens.numel();
  const int32_t* tp = ids_of(tokens);
  const Elem oe = elem_of(out, op), te = elem_of(table, op);
  Buffer flag("embedding id check", MemCategory::Workspace, DType::I64, 1, tokens.device());
  int32_t bad = 0;
  const int64_t n = first_bad_id(tp, N, vocab_size, false, ops::kIgnoreIndex,
                                 static_cast<unsigned long long*>(flag.data()), &bad);
  if (n >= 0) DS_FAIL("token id {} at position {} is outside the vocabulary [0, {})", bad, n, vocab_size);
  launch_embedding_gather(out.raw(), oe, tp, table.raw(), te, N, C, vocab_begin, Vl);
}

// embedding_backward and its vocabulary shards (the CPU's scatter_rows): rows of dout whose
// token is outside [vocab_begin, vocab_begin + Vl) are skipped.
void scatter_rows(const char* op, Tensor dtable, Tensor dout, Tensor tokens, int64_t vocab_begin) {
  const int64_t Vl = dtable.size(0), C = dtable.size(1), N = tokens.numel();
  const int32_t* tp = ids_of(tokens);
  const Elem de = elem_of(dtable, op), ge = elem_of(dout, op);
  if (N == 0 || C == 0 || Vl == 0) return;
  DS_CHECK(N <= INT_MAX && Vl < INT_MAX && C <= 65535 * 256,
           "{}: {} tokens into {} rows of {} exceed the CUDA kernel's range (2^31 tokens and rows, 2^24 columns)", op,
           N, Vl, C);
  const size_t bytes = embedding_scatter_workspace(N, Vl);
  Buffer ws("embedding_backward token sort", MemCategory::Workspace, DType::U8, int64_t(bytes), dtable.device());
  launch_embedding_scatter(dtable.raw(), de, dout.raw(), ge, tp, N, C, vocab_begin, Vl, ws.data(), bytes);
}

void embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  gather_rows("embedding_forward", out, tokens, table, 0, table.size(0));
}

void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) {
  scatter_rows("embedding_backward", dtable, dout, tokens, 0);
}

void embedding_shard_forward(Tensor out, Tensor tokens, Tensor table, int64_t vocab_begin, int64_t vocab_size) {
  gather_rows("embedding_shard_forward", out, tokens, table, vocab_begin, vocab_size);
}

void embedding_shard_backward(Tensor dtable, Tensor dout, Tensor tokens, int64_t vocab_begin) {
  scatter_rows("embedding_shard_backward", dtable, dout, tokens, vocab_begin);
}

// ---- RMSNorm -------------------------------------------------------------------------------

void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  const char* op = "rmsnorm_forward";
  launch_rmsnorm_forward(out.raw(), elem_of(out, op), rstd.raw(), elem_of(rstd, op), x.raw(), elem_of(x, op),
                         weight.raw(), elem_of(weight, op), N, C, eps);
}

void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  const char* op = "rmsnorm_backward";
  const Elem dxe = elem_of(dx, op), dwe = elem_of(dweight, op), ge = elem_of(dout, op), xe = elem_of(x, op),
             we = elem_of(weight, op), re = elem_of(rstd, op);
  const int64_t partials = rmsnorm_dweight_partials(N, C);
  if (partials == 0) return;
  Buffer ws("rmsnorm_backward dweight partials", MemCategory::Workspace, DType::F32, partials, x.device());
  launch_rmsnorm_backward(dx.raw(), dxe, dweight.raw(), dwe, dout.raw(), ge, x.raw(), xe, weight.raw(), we, rstd.raw(),
                          re, N, C, static_cast<float*>(ws.data()));
}

// ---- rotary embedding ----------------------------------------------------------------------

// The frequencies go to the device; the kernel takes the angles and their cosines there.
void tables_from(const char* op, Tensor cos, Tensor sin, const std::vector<float>& inv_freq, int64_t T, float m) {
  const int64_t half = int64_t(inv_freq.size());
  const Elem ce = elem_of(cos, op), se = elem_of(sin, op);
  if (T <= 0 || half <= 0) return;
  Buffer f("rope inverse frequencies", MemCategory::Workspace, DType::F32, half, cos.device());
  DS_CUDA_CHECK(cudaMemcpyAsync(f.data(), inv_freq.data(), size_t(half) * sizeof(float), cudaMemcpyHostToDevice,
                                stream()));
  launch_rope_tables(cos.raw(), ce, sin.raw(), se, static_cast<const float*>(f.data()), T, half, m);
}

void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta) {
  const int64_t T = cos.size(0), half = head_dim / 2;
  // Hugging Face computes inv_freq = 1 / theta^(2i/d), the angles t * inv_freq and their
  // cosines all in fp32; the frequencies are the CPU kernel's (the same host pow), the angles
  // the same fp32 products on the device.
  std::vector<float> inv_freq(static_cast<size_t>(std::max<int64_t>(half, 0)));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[size_t(i)] = 1.0f / std::pow(float(theta), float(2 * i) / float(head_dim));
  }
  tables_from("rope_tables", cos, sin, inv_freq, T, 1.0f);
}

void rope_apply(const char* op, Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin,
                bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2);
  launch_rope(x.raw(), elem_of(x, op), cos.raw(), elem_of(cos, op), sin.raw(), elem_of(sin, op), B, T, W, offset,
              n_heads, head_dim, inverse);
}

void rope_forward(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply("rope_forward", x, offset, n_heads, head_dim, cos, sin, /*inverse=*/false);
}

void rope_backward(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply("rope_backward", dx, offset, n_heads, head_dim, cos, sin, /*inverse=*/true);
}

// The frequencies and mscale factor on the host (ops::yarn_inv_freq, as the CPU kernel); the
// tables on the device.
void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double theta, const ops::YarnParams& yarn) {
  const int64_t T = cos.size(0);
  float m = 1;
  const std::vector<float> inv_freq = ops::yarn_inv_freq(dim, theta, yarn, &m);
  tables_from("rope_tables_yarn", cos, sin, inv_freq, T, m);
}

// The kernel's limit on a head's size (the op's argument checks ran in the ops:: wrapper).
void rope_interleaved(const char* op, Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                      Tensor sin, bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2);
  DS_CHECK(dim <= kRopeInterleavedMaxDim, "{}: a rotary dim of {} is more than the CUDA kernel's {}", op, dim,
           kRopeInterleavedMaxDim);
  launch_rope_interleaved(x.raw(), elem_of(x, op), cos.raw(), elem_of(cos, op), sin.raw(), elem_of(sin, op), B, T, W,
                          offset, n_heads, head_stride, dim, inverse);
}

void rope_forward_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                              Tensor sin) {
  rope_interleaved("rope_forward_interleaved", x, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/false);
}

void rope_backward_interleaved(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                               Tensor sin) {
  rope_interleaved("rope_backward_interleaved", dx, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/true);
}

// ---- SwiGLU --------------------------------------------------------------------------------

void swiglu_forward(Tensor out, Tensor gate_up) {
  const int64_t I = out.size(-1), N = out.numel() / I;
  const char* op = "swiglu_forward";
  launch_swiglu_forward(out.raw(), elem_of(out, op), gate_up.raw(), elem_of(gate_up, op), N, I);
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  const int64_t I = dout.size(-1), N = dout.numel() / I;
  const char* op = "swiglu_backward";
  launch_swiglu_backward(dgate_up.raw(), elem_of(dgate_up, op), dout.raw(), elem_of(dout, op), gate_up.raw(),
                         elem_of(gate_up, op), N, I);
}

}  // namespace

void fill_layers(ops::OpTable& t) {
  for (size_t s = 0; s < size_t(kKernelDTypes); ++s) {
    t.embedding_forward[s] = &embedding_forward;
    t.embedding_backward[s] = &embedding_backward;
    t.embedding_shard_forward[s] = &embedding_shard_forward;
    t.embedding_shard_backward[s] = &embedding_shard_backward;
    t.rmsnorm_forward[s] = &rmsnorm_forward;
    t.rmsnorm_backward[s] = &rmsnorm_backward;
    t.rope_tables[s] = &rope_tables;
    t.rope_forward[s] = &rope_forward;
    t.rope_backward[s] = &rope_backward;
    t.rope_tables_yarn[s] = &rope_tables_yarn;
    t.rope_forward_interleaved[s] = &rope_forward_interleaved;
    t.rope_backward_interleaved[s] = &rope_backward_interleaved;
    t.swiglu_forward[s] = &swiglu_forward;
    t.swiglu_backward[s] = &swiglu_backward;
  }
}

}  // namespace dstrain::cuda
