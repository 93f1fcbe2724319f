// Softmax cross-entropy kernels of the CUDA backend (launch functions in cross_entropy_kernels.h;
// the argument and target checks are the op wrappers' in cross_entropy.cpp). They mirror the CPU
// kernels of backend/cpu/cross_entropy.cpp: the log-sum-exp of a row is its maximum plus the log
// of the sum of exp(x - max) taken in double; every reduction runs in a fixed order, so that
// results do not change from run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/elem.cuh"
#include "backend/cuda/cross_entropy_kernels.h"

namespace dstrain::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;


// A partial log-sum-exp: the maximum m of the elements seen and s = sum of exp(x - m), in
// double. The CPU's sum of exp(x - max) has the same special cases: an element of -inf adds 0
// (NaN when the whole row is -inf, see row_lse), a NaN makes the sum NaN, and so does an
// element of +inf (exp(inf - inf)).
struct Lse {
  float m;
  double s;
};

__device__ __forceinline__ void add(Lse& a, float x) {
  if (x > a.m) {
    // The new maximum's own term exp(x - x): 1, or NaN for +inf (the CPU's exp(inf - inf)).
    a.s = a.s * double(expf(a.m - x)) + (x == INFINITY ? double(NAN) : 1.0);
    a.m = x;
  } else if (x != -INFINITY) {
    a.s += double(expf(x - a.m));  // NaN stays NaN
  }
}

// Symmetric in a and b (IEEE sums and products commute), so both lanes of a butterfly get the
// same bits.
__device__ __forceinline__ Lse combine(Lse a, Lse b) {
  const float m = a.m > b.m ? a.m : b.m;
  if (m == -INFINITY) return {m, a.s + b.s};
  return {m, a.s * double(expf(a.m - m)) + b.s * double(expf(b.m - m))};
}

__device__ __forceinline__ Lse warp_combine(Lse v) {
  for (int o = 16; o > 0; o >>= 1) {
    const Lse other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.s, o)};
    v = combine(v, other);
  }
  return v;
}

// The log-sum-exp of row (V elements), computed by the whole block (blockDim.x == kThreads) in
// a fixed order; returned to every thread. sh: kWarps + 1 entries of shared memory, reusable
// when the call returns.
__device__ float row_lse(const void* logits, Elem ge, int64_t row0, int64_t V, Lse* sh) {
  // Each thread takes the row's elements threadIdx.x + k * kThreads in order, four loads in flight.
  Lse a{-INFINITY, 0.0};
  int64_t v = threadIdx.x;
  for (; v + 3 * kThreads < V; v += 4 * kThreads) {
    const float x0 = ld(logits, ge, row0 + v), x1 = ld(logits, ge, row0 + v + kThreads);
    const float x2 = ld(logits, ge, row0 + v + 2 * kThreads), x3 = ld(logits, ge, row0 + v + 3 * kThreads);
    add(a, x0);
    add(a, x1);
    add(a, x2);
    add(a, x3);
  }
  for (; v < V; v += kThreads) add(a, ld(logits, ge, row0 + v));
  a = warp_combine(a);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) sh[warp] = a;
  __syncthreads();
  if (warp == 0) {
    Lse b = lane < kWarps ? sh[lane] : Lse{-INFINITY, 0.0};
    b = warp_combine(b);
    if (lane == 0) sh[kWarps] = b;
  }
  __syncthreads();
  const Lse total = sh[kWarps];
  __syncthreads();
  // A row of -inf only: the CPU's exp(-inf - -inf) makes it NaN.
  if (total.m == -INFINITY) return NAN;
  return total.m + float(log(total.s));
}

__global__ void __launch_bounds__(kThreads)
    cross_entropy_forward_kernel(void* losses, Elem le, void* lse, Elem se, const void* logits, Elem ge,
                                 const int32_t* targets, int64_t N, int64_t V, int32_t ignore_index) {
  __shared__ Lse sh[kWarps + 1];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float l = row_lse(logits, ge, n * V, V, sh);
    if (threadIdx.x == 0) {
      const int32_t t = targets[n];
      st(lse, se, n, l);
      // Targets were checked to be ignore_index or in [0, V) before the launch.
      st(losses, le, n, t == ignore_index || t < 0 || t >= V ? 0.0f : l - ld(logits, ge, n * V + t));
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    cross_entropy_shard_forward_kernel(void* stats, Elem se, const void* logits, Elem ge, const int32_t* targets,
                                       int64_t N, int64_t V, int64_t vocab_begin, int32_t ignore_index) {
  __shared__ Lse sh[kWarps + 1];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float l = row_lse(logits, ge, n * V, V, sh);
    if (threadIdx.x == 0) {
      const int64_t t = int64_t(targets[n]) - vocab_begin;
      st(stats, se, 2 * n, l);
      st(stats, se, 2 * n + 1,
         targets[n] != ignore_index && t >= 0 && t < V ? ld(logits, ge, n * V + t) : 0.0f);
    }
  }
}

// The row's largest logit (a maximum: the same whatever the order) and the target's logit.
__global__ void __launch_bounds__(kThreads)
    logit_max_and_target_kernel(float* out, const void* logits, Elem ge, const int32_t* targets, int64_t N, int64_t V,
                                int64_t vocab_begin, int32_t ignore_index) {
  __shared__ float sh[kWarps];
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    float m = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      const float x = ld(logits, ge, n * V + v);
      m = x > m ? x : m;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, m, o);
      m = other > m ? other : m;
    }
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) sh[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < kWarps; ++w) m = sh[w] > m ? sh[w] : m;
      const int64_t t = int64_t(targets[n]) - vocab_begin;
      out[2 * n] = m;
      out[2 * n + 1] = targets[n] != ignore_index && t >= 0 && t < V ? ld(logits, ge, n * V + t) : -INFINITY;
    }
    __syncthreads();
  }
}

// One thread per row: the shards' lse max-shifted and summed in double in shard order, as the
// CPU kernel does (with one shard the sum is exactly 1: the forward's bits).
__global__ void cross_entropy_combine_kernel(void* losses, Elem le, void* lse, Elem se, const void* stats, Elem ste,
                                             const int32_t* targets, int64_t P, int64_t N, int32_t ignore_index) {
  for (int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
    double mx = -INFINITY;
    for (int64_t p = 0; p < P; ++p) {
      const double v = double(ld(stats, ste, 2 * (p * N + n)));
      mx = mx < v ? v : mx;  // std::max(mx, v)
    }
    double sum = 0, target_logit = 0;
    for (int64_t p = 0; p < P; ++p) {
      sum += exp(double(ld(stats, ste, 2 * (p * N + n))) - mx);
      target_logit += double(ld(stats, ste, 2 * (p * N + n) + 1));
    }
    const float l = float(mx + log(sum));
    st(lse, se, n, l);
    st(losses, le, n, targets[n] == ignore_index ? 0.0f : l - float(target_logit));
  }
}

// One block per row; each element is read and then written by the same thread, so dlogits may
// be logits. The one-hot is subtracted from the scaled probability in fp32 before the store
// (one rounding), as the CPU kernel's drow[t] -= scale does.
__global__ void __launch_bounds__(kThreads)
    cross_entropy_backward_kernel(void* dlogits, Elem de, const void* logits, Elem ge, const void* lse, Elem se,
                                  const int32_t* targets, int64_t N, int64_t V, float scale, int64_t vocab_begin,
                                  int32_t ignore_index) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const int32_t target = targets[n];
    if (target == ignore_index) {
      for (int64_t v = threadIdx.x; v < V; v += kThreads) st(dlogits, de, n * V + v, 0.0f);
      continue;
    }
    const float l = ld(lse, se, n);
    const int64_t t = int64_t(target) - vocab_begin;
#pragma unroll 4
    for (int64_t v = threadIdx.x; v < V; v += kThreads) {
      float d = scale * expf(ld(logits, ge, n * V + v) - l);
      if (v == t) d -= scale;
      st(dlogits, de, n * V + v, d);
    }
  }
}

}  // namespace

void launch_cross_entropy_forward(void* losses, Elem le, void* lse, Elem se, const void* logits, Elem ge,
                                  const int32_t* targets, int64_t N, int64_t V, int32_t ignore_index) {
  if (N <= 0) return;
  cross_entropy_forward_kernel<<<blocks_for(N, 1), kThreads, 0, stream()>>>(losses, le, lse, se, logits, ge, targets,
                                                                            N, V, ignore_index);
  DS_CUDA_LAUNCHED("cross_entropy_forward");
}

void launch_cross_entropy_shard_forward(void* stats, Elem se, const void* logits, Elem ge, const int32_t* targets,
                                        int64_t N, int64_t V, int64_t vocab_begin, int32_t ignore_index) {
  if (N <= 0) return;
  cross_entropy_shard_forward_kernel<<<blocks_for(N, 1), kThreads, 0, stream()>>>(stats, se, logits, ge, targets, N, V,
                                                                                  vocab_begin, ignore_index);
  DS_CUDA_LAUNCHED("cross_entropy_shard_forward");
}

void launch_logit_max_and_target(float* out, const void* logits, Elem ge, const int32_t* targets, int64_t N, int64_t V,
                                 int64_t vocab_begin, int32_t ignore_index) {
  if (N <= 0 || V <= 0) return;
  logit_max_and_target_kernel<<<blocks_for(N, 1), kThreads, 0, stream()>>>(out, logits, ge, targets, N, V, vocab_begin,
                                                                           ignore_index);
  DS_CUDA_LAUNCHED("logit_max_and_target");
}

void launch_cross_entropy_combine(void* losses, Elem le, void* lse, Elem se, const void* shard_stats, Elem ste,
                                  const int32_t* targets, int64_t P, int64_t N, int32_t ignore_index) {
  if (N <= 0) return;
  cross_entropy_combine_kernel<<<blocks_for(N, kThreads), kThreads, 0, stream()>>>(losses, le, lse, se, shard_stats,
                                                                                   ste, targets, P, N, ignore_index);
  DS_CUDA_LAUNCHED("cross_entropy_combine");
}

void launch_cross_entropy_backward(void* dlogits, Elem de, const void* logits, Elem ge, const void* lse, Elem se,
                                   const int32_t* targets, int64_t N, int64_t V, float scale, int64_t vocab_begin,
                                   int32_t ignore_index) {
  if (N <= 0 || V <= 0) return;
  cross_entropy_backward_kernel<<<blocks_for(N, 1), kThreads, 0, stream()>>>(dlogits, de, logits, ge, lse, se, targets,
                                                                             N, V, scale, vocab_begin, ignore_index);
  DS_CUDA_LAUNCHED("cross_entropy_backward");
}

}  // namespace dstrain::cuda
