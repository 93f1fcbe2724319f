// Element-wise arithmetic, conversions, block copies, reductions and random fills on the GPU
// (launch functions: elementwise_kernels.h). Each kernel does the CPU kernel's arithmetic in the
// same order (backend/cpu/elementwise.cpp, cross_entropy.cpp); the reductions that the CPU sums
// in a fixed order run in a fixed order here too (a block count and tree that depend on the
// element count only), so their results are the same bits from run to run.
#include <cuda_runtime.h>

#include <mutex>

#include "backend/cuda/elementwise_kernels.h"

namespace dstrain::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_kernel(void* out, Elem eo, const void* a, Elem ea, const void* b, Elem eb, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    st(out, eo, i, ld(a, ea, i) + ld(b, eb, i));
  }
}

__global__ void scale_kernel(void* x, Elem e, float s, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    st(x, e, i, ld(x, e, i) * s);
  }
}

__global__ void fill_kernel(void* x, Elem e, float value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    st(x, e, i, value);
  }
}

// fp32 <-> 16-bit is exact one way and rounds once the other; bf16 <-> f16 goes through fp32
// (exact) and rounds once, as the CPU's cast does.
__global__ void cast_kernel(void* dst, Elem ed, const void* src, Elem es, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    st(dst, ed, i, ld(src, es, i));
  }
}

// copy_blocks where no two blocks write the same dst element (dst_step >= width, or one block):
// one thread per (row, block, i).
__global__ void copy_blocks_disjoint(void* dst, Elem ed, int64_t dcols, int64_t dst_offset, int64_t dst_step,
                                     const void* src, Elem es, int64_t scols, int64_t src_offset, int64_t src_step,
                                     int64_t rows, int64_t blocks, int64_t width, bool accumulate) {
  const int64_t n = rows * blocks * width;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = idx % width, rj = idx / width, j = rj % blocks, r = rj / blocks;
    const int64_t d = r * dcols + dst_offset + j * dst_step + i;
    const float v = ld(src, es, r * scols + src_offset + j * src_step + i);
    st(dst, ed, d, accumulate ? ld(dst, ed, d) + v : v);
  }
}

// copy_blocks where blocks overlap in dst (0 <= dst_step < width, several blocks): one thread per
// dst element of the covered span [dst_offset, dst_offset + (blocks-1)*dst_step + width) of a
// row, which visits the blocks covering it in block order: the sum in block order (accumulate,
// in fp32 and rounded once, as the CPU's 16-bit kernel does) or the last block's value (a plain
// copy, as the CPU's sequential loop leaves it).
__global__ void copy_blocks_overlapping(void* dst, Elem ed, int64_t dcols, int64_t dst_offset, int64_t dst_step,
                                        const void* src, Elem es, int64_t scols, int64_t src_offset,
                                        int64_t src_step, int64_t rows, int64_t blocks, int64_t width,
                                        bool accumulate) {
  const int64_t span = (blocks - 1) * dst_step + width, n = rows * span;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = idx % span, r = idx / span;
    // The blocks j with 0 <= c - j*dst_step < width: [lo, hi].
    int64_t lo = 0, hi = blocks - 1;
    if (dst_step > 0) {
      hi = c / dst_step < hi ? c / dst_step : hi;
      lo = c >= width ? (c - width) / dst_step + 1 : 0;
    }
    const int64_t d = r * dcols + dst_offset + c;
    const int64_t s0 = r * scols + src_offset + c;  // src element of block j: s0 + j*(src_step - dst_step)
    if (!accumulate) {
      st(dst, ed, d, ld(src, es, s0 + hi * (src_step - dst_step)));
      continue;
    }
    float v = ld(dst, ed, d);
    for (int64_t j = lo; j <= hi; ++j) v += ld(src, es, s0 + j * (src_step - dst_step));
    st(dst, ed, d, v);
  }
}

// ---- fixed-order reductions ------------------------------------------------------------------
// Pass 1: a grid of reduction_blocks(n) blocks; thread t of block b sums the terms
// b*kThreads + t + k*grid*kThreads in k order, then the block sums its threads as a tree.
// Pass 2: one block sums the block sums the same way. No atomics: the order depends on n only.
constexpr int kMaxReductionBlocks = 512;

unsigned reduction_blocks(int64_t n) {
  const int64_t per_block = int64_t(kThreads) * 8;
  int64_t b = (n + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > kMaxReductionBlocks) b = kMaxReductionBlocks;
  return unsigned(b);
}

struct SumCount {
  double sum, count;
};
__device__ __forceinline__ SumCount operator+(SumCount a, SumCount b) { return {a.sum + b.sum, a.count + b.count}; }

template <class Acc>
__device__ Acc block_sum(Acc v, Acc* shared) {
  shared[threadIdx.x] = v;
  __syncthreads();
  for (int w = kThreads / 2; w > 0; w >>= 1) {
    if (int(threadIdx.x) < w) shared[threadIdx.x] = shared[threadIdx.x] + shared[threadIdx.x + w];
    __syncthreads();
  }
  return shared[0];
}

template <class Acc, class Term>
__global__ void __launch_bounds__(kThreads) reduce_partials(Acc* partial, int64_t n, Term term) {
  __shared__ Acc shared[kThreads];
  Acc s{};
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < n; i += int64_t(gridDim.x) * kThreads) {
    s = s + term(i);
  }
  const Acc total = block_sum(s, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

template <class Acc, class Finish>
__global__ void __launch_bounds__(kThreads) reduce_final(const Acc* partial, int parts, Finish finish) {
  __shared__ Acc shared[kThreads];
  Acc s{};
  for (int i = threadIdx.x; i < parts; i += kThreads) s = s + partial[i];
  const Acc total = block_sum(s, shared);
  if (threadIdx.x == 0) finish(total);
}

// The block sums of pass 1: one small device array per GPU, kept for the process (reductions on
// one stream run one after another, so one array serves them all).
void* partials() {
  static std::mutex mutex;
  static void* per_device[64] = {};
  int dev = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  std::lock_guard lock(mutex);
  void*& p = per_device[dev & 63];
  if (!p) DS_CUDA_CHECK(cudaMalloc(&p, kMaxReductionBlocks * sizeof(SumCount)));
  return p;
}

template <class Acc, class Term, class Finish>
void reduce(int64_t n, Term term, Finish finish) {
  Acc* part = static_cast<Acc*>(partials());
  const unsigned grid = reduction_blocks(n);
  reduce_partials<Acc><<<grid, kThreads, 0, stream()>>>(part, n, term);
  DS_CUDA_LAUNCHED("reduce_partials");
  reduce_final<Acc><<<1, kThreads, 0, stream()>>>(part, int(grid), finish);
  DS_CUDA_LAUNCHED("reduce_final");
}

struct SquareTerm {
  const void* x;
  Elem e;
  __device__ double operator()(int64_t i) const {
    const double v = ld(x, e, i);
    return v * v;
  }
};
struct NonFiniteTerm {
  const void* x;
  Elem e;
  __device__ long long operator()(int64_t i) const { return isfinite(ld(x, e, i)) ? 0 : 1; }
};
struct LossTerm {
  const void* losses;
  Elem e;
  const int32_t* targets;
  int32_t ignore_index;
  __device__ SumCount operator()(int64_t i) const {
    if (targets[i] == ignore_index) return {0.0, 0.0};
    return {double(ld(losses, e, i)), 1.0};
  }
};
struct StoreDouble {
  double* out;
  __device__ void operator()(double v) const { out[0] = v; }
};
struct StoreCount {
  int64_t* out;
  __device__ void operator()(long long v) const { out[0] = int64_t(v); }
};
struct AddSumCount {
  double* out;
  __device__ void operator()(SumCount v) const {
    out[0] += v.sum;
    out[1] += v.count;
  }
};

// ---- Philox4x32-10 and the Box-Muller normal of core/philox.cpp -------------------------------

struct Block4 {
  uint32_t v[4];
};

__device__ __forceinline__ Block4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                             uint32_t k1) {
  constexpr uint64_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = kM0 * c0, p1 = kM1 * c2;
    const uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1), n2 = uint32_t(p0 >> 32) ^ c3 ^ k1,
                   n3 = uint32_t(p0);
    c0 = n0;
    c1 = n1;
    c2 = n2;
    c3 = n3;
    k0 += kW0;
    k1 += kW1;
  }
  return {{c0, c1, c2, c3}};
}

__device__ __forceinline__ double to_unit(uint32_t hi, uint32_t lo) {
  return double(((uint64_t(hi) << 32) | lo) >> 11) * 0x1.0p-53;
}

__device__ double philox_normal(uint64_t seed, uint64_t stream, uint64_t i) {
  constexpr double kPi = 3.141592653589793238462643383279502884;  // std::numbers::pi
  const uint64_t n = i / 2;
  const Block4 r = philox4x32(uint32_t(n), uint32_t(n >> 32), uint32_t(stream), uint32_t(stream >> 32),
                              uint32_t(seed), uint32_t(seed >> 32));
  const double u1 = 1.0 - to_unit(r.v[0], r.v[1]);  // (0, 1]
  const double u2 = to_unit(r.v[2], r.v[3]);
  const double radius = sqrt(-2.0 * log(u1));
  const double angle = 2.0 * kPi * u2;
  return i % 2 == 0 ? radius * cos(angle) : radius * sin(angle);
}

__global__ void fill_normal_kernel(void* x, Elem e, int64_t n, double std, uint64_t seed, uint64_t stream,
                                   uint64_t first) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    st(x, e, i, float(std * philox_normal(seed, stream, first + uint64_t(i))));
  }
}

__global__ void shift_tokens_kernel(int32_t* out, const int32_t* src, int64_t B, int64_t T, int64_t shift,
                                    int32_t fill, int32_t ignore_as, int32_t ignore_index) {
  const int64_t n = B * T;
  for (int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; idx < n;
       idx += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = idx % T;
    int32_t v = fill;
    if (t + shift < T) {
      v = src[idx + shift];
      if (v == ignore_index) v = ignore_as;
    }
    out[idx] = v;
  }
}

}  // namespace

void launch_add(void* out, Elem eo, const void* a, Elem ea, const void* b, Elem eb, int64_t n) {
  if (n <= 0) return;
  add_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(out, eo, a, ea, b, eb, n);
  DS_CUDA_LAUNCHED("add_kernel");
}

void launch_scale(void* x, Elem e, float s, int64_t n) {
  if (n <= 0) return;
  scale_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x, e, s, n);
  DS_CUDA_LAUNCHED("scale_kernel");
}

void launch_fill(void* x, Elem e, float value, int64_t n) {
  if (n <= 0) return;
  fill_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x, e, value, n);
  DS_CUDA_LAUNCHED("fill_kernel");
}

void launch_cast(void* dst, Elem ed, const void* src, Elem es, int64_t n) {
  if (n <= 0) return;
  if (ed == es) {
    const size_t bytes = size_t(n) * (ed == Elem::F32 ? 4 : 2);
    DS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream()));
    return;
  }
  cast_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(dst, ed, src, es, n);
  DS_CUDA_LAUNCHED("cast_kernel");
}

void launch_copy_blocks(void* dst, Elem ed, int64_t dcols, int64_t dst_offset, int64_t dst_step, const void* src,
                        Elem es, int64_t scols, int64_t src_offset, int64_t src_step, int64_t rows, int64_t blocks,
                        int64_t width, bool accumulate) {
  if (rows <= 0 || blocks <= 0 || width <= 0) return;
  if (blocks == 1 || dst_step >= width) {
    const int64_t n = rows * blocks * width;
    copy_blocks_disjoint<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(
        dst, ed, dcols, dst_offset, dst_step, src, es, scols, src_offset, src_step, rows, blocks, width, accumulate);
    DS_CUDA_LAUNCHED("copy_blocks_disjoint");
  } else {
    const int64_t n = rows * ((blocks - 1) * dst_step + width);
    copy_blocks_overlapping<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(
        dst, ed, dcols, dst_offset, dst_step, src, es, scols, src_offset, src_step, rows, blocks, width, accumulate);
    DS_CUDA_LAUNCHED("copy_blocks_overlapping");
  }
}

void launch_sum_squares(double* out, const void* x, Elem e, int64_t n) {
  reduce<double>(n < 0 ? 0 : n, SquareTerm{x, e}, StoreDouble{out});
}

void launch_count_non_finite(int64_t* out, const void* x, Elem e, int64_t n) {
  reduce<long long>(n < 0 ? 0 : n, NonFiniteTerm{x, e}, StoreCount{out});
}

void launch_fill_normal(void* x, Elem e, int64_t n, double std, uint64_t seed, uint64_t stream_id, uint64_t first) {
  if (n <= 0) return;
  fill_normal_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(x, e, n, std, seed, stream_id, first);
  DS_CUDA_LAUNCHED("fill_normal_kernel");
}

void launch_shift_tokens(int32_t* out, const int32_t* src, int64_t B, int64_t T, int64_t shift, int32_t fill,
                         int32_t ignore_as, int32_t ignore_index) {
  const int64_t n = B * T;
  if (n <= 0) return;
  shift_tokens_kernel<<<grid_for(n, kThreads), kThreads, 0, stream()>>>(out, src, B, T, shift, fill, ignore_as,
                                                                         ignore_index);
  DS_CUDA_LAUNCHED("shift_tokens_kernel");
}

void launch_loss_sums(double* out, const void* losses, Elem e, const int32_t* targets, int64_t n,
                      int32_t ignore_index) {
  reduce<SumCount>(n < 0 ? 0 : n, LossTerm{losses, e, targets, ignore_index}, AddSumCount{out});
}

}  // namespace dstrain::cuda
