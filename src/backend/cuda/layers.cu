// The layer kernels of the CUDA backend: embedding, RMSNorm, rotary embedding and SwiGLU
// (launch functions in layers_kernels.h; the argument checks are the op wrappers' in layers.cpp).
// Each mirrors its CPU kernel (backend/cpu/norm_embed.cpp, elementwise.cpp, rope_yarn.cpp): the
// same arithmetic in fp32, the same sums in double where the CPU sums in double, and every
// reduction in a fixed order, so that results do not change from run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/elem.cuh"
#include "backend/cuda/layers_kernels.h"

namespace dstrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;


// Grid-stride loops over 64-bit counts.
__device__ __forceinline__ int64_t thread_index() { return int64_t(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ __forceinline__ int64_t thread_stride() { return int64_t(gridDim.x) * blockDim.x; }

// The sum of v over the block's kThreads threads, in a fixed tree order, returned to every
// thread. sh: kWarps + 1 doubles of shared memory; the call ends with the block synchronised,
// so sh may be reused at once.
__device__ double block_sum(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  if (warp == 0) {
    double t = lane < kWarps ? sh[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    if (lane == 0) sh[kWarps] = t;
  }
  __syncthreads();
  const double total = sh[kWarps];
  __syncthreads();
  return total;
}

unsigned row_blocks(int64_t rows) { return blocks_for(rows, 1); }

// ---- token ids -------------------------------------------------------------------------------

__global__ void first_bad_id_kernel(const int32_t* ids, int64_t count, int64_t limit, bool allow_ignore,
                                    int32_t ignore_index, unsigned long long* flag) {
  for (int64_t n = thread_index(); n < count; n += thread_stride()) {
    const int32_t id = ids[n];
    const bool ok = (allow_ignore && id == ignore_index) || (id >= 0 && int64_t(id) < limit);
    if (!ok) atomicMin(flag, static_cast<unsigned long long>(n));  // integer: the same answer every run
  }
}

// ---- embedding -------------------------------------------------------------------------------

__global__ void embedding_gather_kernel(void* out, Elem oe, const int32_t* ids, const void* table, Elem te, int64_t N,
                                        int64_t C, int64_t vocab_begin, int64_t Vl) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int64_t r = int64_t(ids[n]) - vocab_begin;
    const bool here = r >= 0 && r < Vl;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
      st(out, oe, n * C + c, here ? ld(table, te, r * C + c) : 0.0f);
    }
  }
}

// Sort keys: the row of the shard's table, or Vl for a token of another shard (sorted last, skipped).
__global__ void embedding_keys_kernel(const int32_t* ids, int64_t N, int64_t vocab_begin, int64_t Vl, uint32_t* keys,
                                      uint32_t* positions) {
  for (int64_t n = thread_index(); n < N; n += thread_stride()) {
    const int64_t r = int64_t(ids[n]) - vocab_begin;
    keys[n] = r >= 0 && r < Vl ? uint32_t(r) : uint32_t(Vl);
    positions[n] = uint32_t(n);
  }
}

// Runs of equal keys, found at their first sorted position: blockIdx.y picks kThreads
// columns, blockIdx.x strides over the sorted positions. Each element of a row starts from
// dtable and adds the run's rows of dout in token order (the sort is stable), as the CPU
// kernel's loop over tokens does; the loads of 8 rows are issued before their in-order sums.
// No two blocks touch the same element.
constexpr int kScatterUnroll = 8;

__global__ void __launch_bounds__(kThreads)
    embedding_scatter_kernel(void* dtable, Elem de, const void* dout, Elem ge, const uint32_t* keys,
                             const uint32_t* positions, int64_t N, int64_t C, uint32_t Vl) {
  const int64_t c = int64_t(blockIdx.y) * kThreads + threadIdx.x;
  if (c >= C) return;
  for (int64_t i = blockIdx.x; i < N; i += gridDim.x) {
    const uint32_t r = keys[i];
    if (r == Vl || (i > 0 && keys[i - 1] == r)) continue;
    int64_t end = i + 1;
    while (end < N && keys[end] == r) ++end;
    float acc = ld(dtable, de, int64_t(r) * C + c);
    int64_t j = i;
    for (; j + kScatterUnroll <= end; j += kScatterUnroll) {
      float v[kScatterUnroll];
#pragma unroll
      for (int u = 0; u < kScatterUnroll; ++u) v[u] = ld(dout, ge, int64_t(positions[j + u]) * C + c);
#pragma unroll
      for (int u = 0; u < kScatterUnroll; ++u) acc += v[u];
    }
    for (; j < end; ++j) acc += ld(dout, ge, int64_t(positions[j]) * C + c);
    st(dtable, de, int64_t(r) * C + c, acc);
  }
}

int sort_bits(int64_t Vl) {  // keys are in [0, Vl]
  int bits = 1;
  while (bits < 32 && (int64_t(1) << bits) <= Vl) ++bits;
  return bits;
}

constexpr size_t kAlign = 256;
size_t aligned(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

size_t sort_temp_bytes(int64_t N, int64_t Vl) {
  size_t bytes = 0;
  DS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), static_cast<const uint32_t*>(nullptr),
                                                static_cast<uint32_t*>(nullptr), int(N), 0, sort_bits(Vl), stream()));
  return bytes;
}

// ---- RMSNorm ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(void* out, Elem oe, void* rstd, Elem re, const void* x, Elem xe, const void* weight, Elem we,
                           int64_t N, int64_t C, float eps) {
  __shared__ double sh[kWarps + 1];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    double ss = 0;
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      const double v = double(ld(x, xe, n * C + c));
      ss += v * v;
    }
    ss = block_sum(ss, sh);
    const float r = float(1.0 / sqrt(ss / double(C) + double(eps)));
    if (threadIdx.x == 0) st(rstd, re, n, r);
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      st(out, oe, n * C + c, ld(weight, we, c) * (ld(x, xe, n * C + c) * r));
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    rmsnorm_dx_kernel(void* dx, Elem dxe, const void* dout, Elem ge, const void* x, Elem xe, const void* weight,
                      Elem we, const void* rstd, Elem re, int64_t N, int64_t C) {
  __shared__ double sh[kWarps + 1];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float r = ld(rstd, re, n);
    double dot = 0;  // sum_c w*g*x
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      dot += double(ld(weight, we, c)) * double(ld(dout, ge, n * C + c)) * double(ld(x, xe, n * C + c));
    }
    dot = block_sum(dot, sh);
    const float k = float(dot / double(C)) * r * r * r;
    for (int64_t c = threadIdx.x; c < C; c += kThreads) {
      const int64_t i = n * C + c;
      const float g = ld(dout, ge, i), xv = ld(x, xe, i);
      st(dx, dxe, i, ld(dx, dxe, i) + (ld(weight, we, c) * g * r - xv * k));
    }
  }
}

// dweight's partial sums: block (32, 8) sums the rows [chunk * rows_per_chunk, ...) of 32
// channels, each thread every 8th row in order, then the 8 in order: partials[chunk, c].
constexpr int kDwCols = 32, kDwRows = 8;
constexpr int64_t kDwMaxChunks = 256, kDwMinRowsPerChunk = 64;

int64_t dw_rows_per_chunk(int64_t N) {
  const int64_t wanted = (N + kDwMinRowsPerChunk - 1) / kDwMinRowsPerChunk;
  const int64_t chunks = std::min(kDwMaxChunks, std::max<int64_t>(1, wanted));
  return std::max<int64_t>(1, (N + chunks - 1) / chunks);
}
int64_t dw_chunks(int64_t N) {
  const int64_t per = dw_rows_per_chunk(N);
  return (N + per - 1) / per;
}

__global__ void __launch_bounds__(kDwCols * kDwRows)
    rmsnorm_dweight_partial_kernel(float* partials, const void* dout, Elem ge, const void* x, Elem xe,
                                   const void* rstd, Elem re, int64_t N, int64_t C, int64_t rows_per_chunk) {
  __shared__ float sh[kDwRows][kDwCols + 1];
  const int64_t c = int64_t(blockIdx.x) * kDwCols + threadIdx.x;
  const int64_t chunk = blockIdx.y;
  const int64_t n0 = chunk * rows_per_chunk, n1 = std::min(N, n0 + rows_per_chunk);
  float acc = 0;
  if (c < C) {
    for (int64_t n = n0 + threadIdx.y; n < n1; n += kDwRows) {
      acc += ld(dout, ge, n * C + c) * ld(x, xe, n * C + c) * ld(rstd, re, n);
    }
  }
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float s = sh[0][threadIdx.x];
    for (int k = 1; k < kDwRows; ++k) s += sh[k][threadIdx.x];
    partials[chunk * C + c] = s;
  }
}

// dweight[c] += the chunks' partial sums, in chunk order.
__global__ void rmsnorm_dweight_final_kernel(void* dweight, Elem dwe, const float* partials, int64_t chunks,
                                             int64_t C) {
  for (int64_t c = thread_index(); c < C; c += thread_stride()) {
    double s = 0;
    for (int64_t k = 0; k < chunks; ++k) s += double(partials[k * C + c]);
    st(dweight, dwe, c, ld(dweight, dwe, c) + float(s));
  }
}

// ---- rotary embedding ------------------------------------------------------------------------

// The angles t * inv_freq[i] are fp32 products as in Hugging Face (and the CPU kernel); the
// explicit roundings keep the compiler from fusing anything into them.
__global__ void rope_tables_kernel(void* cos, Elem ce, void* sin, Elem se, const float* inv_freq, int64_t T,
                                   int64_t half, float m) {
  const int64_t total = T * half;
  for (int64_t idx = thread_index(); idx < total; idx += thread_stride()) {
    const int64_t t = idx / half, i = idx - t * half;
    const float angle = __fmul_rn(float(t), inv_freq[i]);
    st(cos, ce, idx, __fmul_rn(cosf(angle), m));
    st(sin, se, idx, __fmul_rn(sinf(angle), m));
  }
}

// x' = x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]; sign -1 for the inverse. One
// thread per pair (x1, x2) = (v[i], v[i + half]).
__global__ void rope_kernel(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se, int64_t B, int64_t T,
                            int64_t W, int64_t offset, int n_heads, int head_dim, float sign) {
  const int64_t half = head_dim / 2;
  const int64_t total = B * T * n_heads * half;
  for (int64_t idx = thread_index(); idx < total; idx += thread_stride()) {
    const int64_t i = idx % half, rest = idx / half;
    const int64_t h = rest % n_heads, bt = rest / n_heads, t = bt % T;
    const int64_t base = bt * W + offset + h * head_dim;
    const float x1 = ld(x, xe, base + i), x2 = ld(x, xe, base + i + half);
    const float c = ld(cos, ce, t * half + i);
    const float si = sign * ld(sin, se, t * half + i);
    st(x, xe, base + i, x1 * c - x2 * si);
    st(x, xe, base + i + half, x2 * c + x1 * si);
  }
}

// DeepSeek's pairing, a block per `per_block` heads: the heads are read into shared memory
// first (the rotation permutes elements within a head, in place), then each output element is
// computed from them. Forward: u = [x0, x2, ... | x1, x3, ...], out = [u1*c - u2*s | u2*c + u1*s];
// inverse: the transpose, back to the interleaved layout.
__global__ void rope_interleaved_kernel(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se,
                                        int64_t heads, int64_t T, int64_t W, int64_t offset, int n_heads,
                                        int64_t head_stride, int dim, int per_block, bool inverse) {
  extern __shared__ float sh[];
  const int half = dim / 2;
  for (int64_t h0 = int64_t(blockIdx.x) * per_block; h0 < heads; h0 += int64_t(gridDim.x) * per_block) {
    const int nh = int(std::min<int64_t>(per_block, heads - h0));
    const int count = nh * dim;
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
      const int hh = e / dim, j = e - hh * dim;
      const int64_t head = h0 + hh, bt = head / n_heads, h = head - bt * n_heads;
      sh[e] = ld(x, xe, bt * W + offset + h * head_stride + j);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < count; e += blockDim.x) {
      const int hh = e / dim, j = e - hh * dim;
      const int64_t head = h0 + hh, bt = head / n_heads, h = head - bt * n_heads, t = bt % T;
      const float* u = sh + hh * dim;
      float v;
      if (!inverse) {
        const int i = j < half ? j : j - half;
        const float u1 = u[2 * i], u2 = u[2 * i + 1];
        const float c = ld(cos, ce, t * half + i), s = ld(sin, se, t * half + i);
        v = j < half ? u1 * c - u2 * s : u2 * c + u1 * s;
      } else {
        const int i = j >> 1;
        const float g1 = u[i], g2 = u[half + i];
        const float c = ld(cos, ce, t * half + i), s = ld(sin, se, t * half + i);
        v = (j & 1) == 0 ? g1 * c + g2 * s : g2 * c - g1 * s;
      }
      st(x, xe, bt * W + offset + h * head_stride + j, v);
    }
    __syncthreads();
  }
}

// ---- SwiGLU ----------------------------------------------------------------------------------

// silu(g) * u with sigmoid(g) = 1 / (1 + exp(-g)), as PyTorch's silu and the CPU kernel compute it.
__global__ void swiglu_forward_kernel(void* out, Elem oe, const void* gate_up, Elem ge, int64_t N, int64_t I) {
  const int64_t total = N * I;
  for (int64_t idx = thread_index(); idx < total; idx += thread_stride()) {
    const int64_t n = idx / I, i = idx - n * I;
    const float g = ld(gate_up, ge, n * 2 * I + i), u = ld(gate_up, ge, n * 2 * I + I + i);
    st(out, oe, idx, g / (1.0f + expf(-g)) * u);
  }
}

__global__ void swiglu_backward_kernel(void* dgate_up, Elem de, const void* dout, Elem ge, const void* gate_up, Elem ue,
                                       int64_t N, int64_t I) {
  const int64_t total = N * I;
  for (int64_t idx = thread_index(); idx < total; idx += thread_stride()) {
    const int64_t n = idx / I, i = idx - n * I;
    const float g = ld(gate_up, ue, n * 2 * I + i), u = ld(gate_up, ue, n * 2 * I + I + i);
    const float d = ld(dout, ge, idx);
    const float sig = 1.0f / (1.0f + expf(-g));
    const float silu = g * sig;
    st(dgate_up, de, n * 2 * I + I + i, d * silu);
    st(dgate_up, de, n * 2 * I + i, d * u * sig * fmaf(g, 1.0f - sig, 1.0f));
  }
}

}  // namespace

// ---- launch functions ------------------------------------------------------------------------

int64_t first_bad_id(const int32_t* ids, int64_t count, int64_t limit, bool allow_ignore, int32_t ignore_index,
                     unsigned long long* flag, int32_t* bad_id) {
  if (count <= 0) return -1;
  DS_CUDA_CHECK(cudaMemsetAsync(flag, 0xff, sizeof(unsigned long long), stream()));  // "none": the largest value
  first_bad_id_kernel<<<blocks_for(count, kThreads), kThreads, 0, stream()>>>(ids, count, limit, allow_ignore,
                                                                              ignore_index, flag);
  DS_CUDA_LAUNCHED("first_bad_id");
  unsigned long long first = 0;
  DS_CUDA_CHECK(cudaMemcpyAsync(&first, flag, sizeof first, cudaMemcpyDeviceToHost, stream()));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (first >= static_cast<unsigned long long>(count)) return -1;
  DS_CUDA_CHECK(cudaMemcpyAsync(bad_id, ids + first, sizeof(int32_t), cudaMemcpyDeviceToHost, stream()));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream()));
  return int64_t(first);
}

void launch_embedding_gather(void* out, Elem oe, const int32_t* ids, const void* table, Elem te, int64_t N, int64_t C,
                             int64_t vocab_begin, int64_t Vl) {
  if (N <= 0 || C <= 0) return;
  embedding_gather_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(out, oe, ids, table, te, N, C, vocab_begin, Vl);
  DS_CUDA_LAUNCHED("embedding_gather");
}

size_t embedding_scatter_workspace(int64_t N, int64_t Vl) {
  if (N <= 0) return 0;
  return 4 * aligned(size_t(N) * sizeof(uint32_t)) + aligned(sort_temp_bytes(N, Vl));
}

void launch_embedding_scatter(void* dtable, Elem de, const void* dout, Elem ge, const int32_t* ids, int64_t N,
                              int64_t C, int64_t vocab_begin, int64_t Vl, void* workspace, size_t workspace_bytes) {
  if (N <= 0 || C <= 0 || Vl <= 0) return;
  const size_t array = aligned(size_t(N) * sizeof(uint32_t));
  char* w = static_cast<char*>(workspace);
  auto* keys_in = reinterpret_cast<uint32_t*>(w);
  auto* keys = reinterpret_cast<uint32_t*>(w + array);
  auto* positions_in = reinterpret_cast<uint32_t*>(w + 2 * array);
  auto* positions = reinterpret_cast<uint32_t*>(w + 3 * array);
  void* temp = w + 4 * array;
  size_t temp_bytes = workspace_bytes - 4 * array;

  embedding_keys_kernel<<<blocks_for(N, kThreads), kThreads, 0, stream()>>>(ids, N, vocab_begin, Vl, keys_in,
                                                                            positions_in);
  DS_CUDA_LAUNCHED("embedding_keys");
  DS_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp, temp_bytes, keys_in, keys, positions_in, positions, int(N), 0,
                                                sort_bits(Vl), stream()));
  // Enough blocks to fill the GPU, each checking a few sorted positions for the start of a run.
  const dim3 grid(unsigned(std::min<int64_t>(N, 2048)), blocks_for(C, kThreads));
  embedding_scatter_kernel<<<grid, kThreads, 0, stream()>>>(dtable, de, dout, ge, keys, positions, N, C, uint32_t(Vl));
  DS_CUDA_LAUNCHED("embedding_scatter");
}

void launch_rmsnorm_forward(void* out, Elem oe, void* rstd, Elem re, const void* x, Elem xe, const void* weight,
                            Elem we, int64_t N, int64_t C, float eps) {
  if (N <= 0) return;
  rmsnorm_forward_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(out, oe, rstd, re, x, xe, weight, we, N, C, eps);
  DS_CUDA_LAUNCHED("rmsnorm_forward");
}

int64_t rmsnorm_dweight_partials(int64_t N, int64_t C) {
  if (N <= 0 || C <= 0) return 0;
  return dw_chunks(N) * C;
}

void launch_rmsnorm_backward(void* dx, Elem dxe, void* dweight, Elem dwe, const void* dout, Elem ge, const void* x,
                             Elem xe, const void* weight, Elem we, const void* rstd, Elem re, int64_t N, int64_t C,
                             float* partials) {
  if (N <= 0 || C <= 0) return;
  rmsnorm_dx_kernel<<<row_blocks(N), kThreads, 0, stream()>>>(dx, dxe, dout, ge, x, xe, weight, we, rstd, re, N, C);
  DS_CUDA_LAUNCHED("rmsnorm_dx");
  const int64_t per = dw_rows_per_chunk(N), chunks = dw_chunks(N);
  const dim3 grid(blocks_for(C, kDwCols), unsigned(chunks));
  rmsnorm_dweight_partial_kernel<<<grid, dim3(kDwCols, kDwRows), 0, stream()>>>(partials, dout, ge, x, xe, rstd, re,
                                                                                 N, C, per);
  DS_CUDA_LAUNCHED("rmsnorm_dweight_partial");
  rmsnorm_dweight_final_kernel<<<blocks_for(C, kThreads), kThreads, 0, stream()>>>(dweight, dwe, partials, chunks, C);
  DS_CUDA_LAUNCHED("rmsnorm_dweight_final");
}

void launch_rope_tables(void* cos, Elem ce, void* sin, Elem se, const float* inv_freq, int64_t T, int64_t half,
                        float m) {
  if (T <= 0 || half <= 0) return;
  rope_tables_kernel<<<blocks_for(T * half, kThreads), kThreads, 0, stream()>>>(cos, ce, sin, se, inv_freq, T, half,
                                                                                m);
  DS_CUDA_LAUNCHED("rope_tables");
}

void launch_rope(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se, int64_t B, int64_t T, int64_t W,
                 int64_t offset, int n_heads, int head_dim, bool inverse) {
  const int64_t total = B * T * int64_t(n_heads) * (head_dim / 2);
  if (total <= 0) return;
  rope_kernel<<<blocks_for(total, kThreads), kThreads, 0, stream()>>>(x, xe, cos, ce, sin, se, B, T, W, offset, n_heads,
                                                                      head_dim, inverse ? -1.0f : 1.0f);
  DS_CUDA_LAUNCHED("rope");
}

void launch_rope_interleaved(void* x, Elem xe, const void* cos, Elem ce, const void* sin, Elem se, int64_t B, int64_t T,
                             int64_t W, int64_t offset, int n_heads, int64_t head_stride, int dim, bool inverse) {
  const int64_t heads = B * T * int64_t(n_heads);
  if (heads <= 0 || dim <= 0) return;
  const int per_block = std::max(1, 2048 / dim);
  const size_t shared = size_t(per_block) * size_t(dim) * sizeof(float);
  rope_interleaved_kernel<<<blocks_for(heads, per_block), 128, shared, stream()>>>(
      x, xe, cos, ce, sin, se, heads, T, W, offset, n_heads, head_stride, dim, per_block, inverse);
  DS_CUDA_LAUNCHED("rope_interleaved");
}

void launch_swiglu_forward(void* out, Elem oe, const void* gate_up, Elem ge, int64_t N, int64_t I) {
  if (N * I <= 0) return;
  swiglu_forward_kernel<<<blocks_for(N * I, kThreads), kThreads, 0, stream()>>>(out, oe, gate_up, ge, N, I);
  DS_CUDA_LAUNCHED("swiglu_forward");
}

void launch_swiglu_backward(void* dgate_up, Elem de, const void* dout, Elem ge, const void* gate_up, Elem ue, int64_t N,
                            int64_t I) {
  if (N * I <= 0) return;
  swiglu_backward_kernel<<<blocks_for(N * I, kThreads), kThreads, 0, stream()>>>(dgate_up, de, dout, ge, gate_up, ue, N,
                                                                                 I);
  DS_CUDA_LAUNCHED("swiglu_backward");
}

}  // namespace dstrain::cuda
