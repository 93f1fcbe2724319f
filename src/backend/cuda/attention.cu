// Causal grouped-query attention on the GPU, FlashAttention-2 style: no T x T matrix is ever
// stored. The forward streams key/value tiles past a tile of queries with an online softmax and
// keeps only the output and each row's log-sum-exp; the backward recomputes the probabilities
// from them. The backward is deterministic without atomics: one kernel owns a key tile and sums
// dK and dV over its query heads and query tiles in a fixed order, another owns a query tile and
// sums dQ over the key tiles. Semantics are the CPU kernel's (backend/cpu/attention.cpp).
//
// Two families of kernels: fp32 ones on the CUDA cores for any mix of tensor types (the F32 slot,
// and 16-bit slots with fp32 q/k/v or dout), and tensor-core ones (mma.sync, sm_80+) for 16-bit
// q/k/v (and dout), the mixed-precision training case.
//
// The fp32 kernels run 256 threads as a 16 x 16 grid: a thread owns the tile entries of rows
// ty + 16r and columns tx + 16c (scores), or columns 64c + 4tx + u (outputs over a head dim).
// Tiles are staged in shared memory as fp32 whatever the tensors' types; all math is fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/elem.cuh"

namespace dstrain::cuda::attn {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// The shape of one call, as the kernels use it.
struct Shape {
  int T = 0;
  int64_t W = 0;      // qkv row width
  int H = 0;          // query heads
  int group = 1;      // query heads per kv head
  int Dqk = 0, Dv = 0;
  int64_t q_off = 0, k_off = 0, v_off = 0;
  int kq = 0, kv = 0;  // Dqk, Dv rounded up to 4: the lengths of reductions over a head dim
  int wq = 0, wv = 0;  // Dqk, Dv rounded up to 32: the widths of tiles that are only reduced over
  int kq16 = 0, kv16 = 0;  // Dqk, Dv rounded up to 16: reductions over a head dim on tensor cores
};

struct FwdArgs {
  Shape s;
  const void* qkv;
  Elem qkv_e;
  void* out;
  Elem out_e;
  void* lse;
  Elem lse_e;
  float scale;
  bool qkv_vec8;  // the 16-bit kernels may read q, k and v rows in aligned 8-element pieces
};

struct BwdArgs {
  Shape s;
  const void* qkv;
  Elem qkv_e;
  const void* dout;
  Elem dout_e;
  const void* lse;
  Elem lse_e;
  const float* delta;  // (B, H, T) rowsum(dout * out)
  void* dqkv;
  Elem dqkv_e;
  float scale;
  bool qkv_vec8, dout_vec8;  // as FwdArgs::qkv_vec8, for qkv and dout
};

// Stages rows [0, rows) x columns [0, width) of a tile into shared memory s (row stride lds):
// element (r, c) of global memory g at base + r*ld + c, zero where r >= valid_rows or c >= cols.
// A warp reads along a row: coalesced.
__device__ __forceinline__ void load_tile(float* s, int lds, int rows, int width, const void* g, Elem e,
                                          int64_t base, int64_t ld_g, int valid_rows, int cols) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = warp; r < rows; r += kWarps) {
    float* row = s + r * lds;
    if (r < valid_rows) {
      const int64_t gr = base + r * ld_g;
      for (int c = lane; c < width; c += 32) row[c] = c < cols ? ld(g, e, gr + c) : 0.0f;
    } else {
      for (int c = lane; c < width; c += 32) row[c] = 0.0f;
    }
  }
}

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

__device__ __forceinline__ float comp(const float4& v, int k) { return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w; }

// acc[r][c] += sum over k < K of A(ty + 16r, k) * B(tx + 16c, k): A and B row-major in shared
// memory, rows lda and ldb apart (multiples of 4), K a multiple of 4.
template <int R, int C>
__device__ __forceinline__ void mm_nt(float (&acc)[R][C], const float* A, int lda, const float* B, int ldb, int K) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const float* a0 = A + ty * lda;
  const float* b0 = B + tx * ldb;
  for (int k = 0; k < K; k += 4) {
    float4 a[R], b[C];
#pragma unroll
    for (int r = 0; r < R; ++r) a[r] = ld4(a0 + 16 * r * lda + k);
#pragma unroll
    for (int c = 0; c < C; ++c) b[c] = ld4(b0 + 16 * c * ldb + k);
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
        float v = acc[r][c];
        v = fmaf(a[r].x, b[c].x, v);
        v = fmaf(a[r].y, b[c].y, v);
        v = fmaf(a[r].z, b[c].z, v);
        v = fmaf(a[r].w, b[c].w, v);
        acc[r][c] = v;
      }
    }
  }
}

// acc[r][4c + u] += sum over k < K of A(ty + 16r, k) * B(k, 64c + 4tx + u): A and B row-major
// in shared memory, rows lda and ldb apart (multiples of 4), K a multiple of 4, B 64*C wide.
template <int R, int C>
__device__ __forceinline__ void mm_nn(float (&acc)[R][4 * C], const float* A, int lda, const float* B, int ldb,
                                      int K) {
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  const float* a0 = A + ty * lda;
  const float* b0 = B + 4 * tx;
  for (int k = 0; k < K; k += 4) {
    float4 a[R];
#pragma unroll
    for (int r = 0; r < R; ++r) a[r] = ld4(a0 + 16 * r * lda + k);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      float4 b[C];
#pragma unroll
      for (int c = 0; c < C; ++c) b[c] = ld4(b0 + (k + kk) * ldb + 64 * c);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float av = comp(a[r], kk);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          acc[r][4 * c + 0] = fmaf(av, b[c].x, acc[r][4 * c + 0]);
          acc[r][4 * c + 1] = fmaf(av, b[c].y, acc[r][4 * c + 1]);
          acc[r][4 * c + 2] = fmaf(av, b[c].z, acc[r][4 * c + 2]);
          acc[r][4 * c + 3] = fmaf(av, b[c].w, acc[r][4 * c + 3]);
        }
      }
    }
  }
}

// Max and sum over the 16 threads of a row (lanes tx of one half-warp), in a fixed order.
__device__ __forceinline__ float row_max16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float row_sum16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- shared-memory layouts (in floats), computed alike on the host and in the kernels --------

struct FwdSmem {
  int ldq, ldv, ldp;
  int q, k, v, p, total;
  __host__ __device__ FwdSmem(const Shape& s, int BQ, int BK, int NCV) {
    ldq = s.wq + 4;
    ldv = 64 * NCV + 4;
    ldp = BK + 4;
    q = 0;                 // Q tile (BQ, wq)
    k = q + BQ * ldq;      // K tile (BK, wq)
    v = k + BK * ldq;      // V tile (BK, 64*NCV)
    p = v + BK * ldv;      // probabilities (BQ, BK)
    total = p + BQ * ldp;
  }
};

struct DkdvSmem {
  int ldk, ldv, ldq, ldo, ldp;
  int k, v, q, o, p, lse, delta, total;
  __host__ __device__ DkdvSmem(const Shape& s, int BQ, int BK, int NCQ, int NCV) {
    ldk = s.wq + 4;
    ldv = s.wv + 4;
    ldq = 64 * NCQ + 4;
    ldo = 64 * NCV + 4;
    ldp = BQ + 4;
    k = 0;                 // K tile (BK, wq)
    v = k + BK * ldk;      // V tile (BK, wv)
    q = v + BK * ldv;      // Q tile (BQ, 64*NCQ)
    o = q + BQ * ldq;      // dO tile (BQ, 64*NCV)
    p = o + BQ * ldo;      // P^T, then dS^T (BK, BQ)
    lse = p + BK * ldp;    // (BQ)
    delta = lse + BQ;      // (BQ)
    total = delta + BQ;
  }
};

struct DqSmem {
  int ldq, ldo, ldk, ldv, ldp;
  int q, o, k, v, p, lse, delta, total;
  __host__ __device__ DqSmem(const Shape& s, int BQ, int BK, int NCQ) {
    ldq = s.wq + 4;
    ldo = s.wv + 4;
    ldk = 64 * NCQ + 4;
    ldv = s.wv + 4;
    ldp = BK + 4;
    q = 0;                 // Q tile (BQ, wq)
    o = q + BQ * ldq;      // dO tile (BQ, wv)
    k = o + BQ * ldo;      // K tile (BK, 64*NCQ)
    v = k + BK * ldk;      // V tile (BK, wv)
    p = v + BK * ldv;      // dS (BQ, BK)
    lse = p + BQ * ldp;    // (BQ)
    delta = lse + BQ;      // (BQ)
    total = delta + BQ;
  }
};

// ---- forward ---------------------------------------------------------------------------------

// One block per (query tile, query head, batch); the last query tiles (the most key tiles) first.
template <int BQ, int BK, int NCV>
__global__ void __launch_bounds__(kThreads) forward_kernel(const FwdArgs a) {
  constexpr int R = BQ / 16, C = BK / 16;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Shape& s = a.s;
  const FwdSmem L(s, BQ, BK, NCV);
  float* Qs = smem + L.q;
  float* Ks = smem + L.k;
  float* Vs = smem + L.v;
  float* Ps = smem + L.p;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  const int qt = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int g = h / s.group;
  const int i0 = qt * BQ;
  const int64_t row0 = int64_t(b) * s.T;  // batch b's first row of qkv
  load_tile(Qs, L.ldq, BQ, s.wq, a.qkv, a.qkv_e, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
            min(BQ, s.T - i0), s.Dqk);

  float m[R], l[R], o[R][4 * NCV];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int x = 0; x < 4 * NCV; ++x) o[r][x] = 0.0f;
  }

  // Keys [0, i_last] are visible to some query of the tile.
  const int i_last = min(i0 + BQ, s.T) - 1;
  const int n_kt = i_last / BK + 1;
  for (int kt = 0; kt < n_kt; ++kt) {
    const int j0 = kt * BK;
    __syncthreads();  // the previous tile's K, V and P are no longer read
    load_tile(Ks, L.ldq, BK, s.wq, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
              min(BK, s.T - j0), s.Dqk);
    load_tile(Vs, L.ldv, BK, 64 * NCV, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
              min(BK, s.T - j0), s.Dv);
    __syncthreads();

    float sc[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < C; ++c) sc[r][c] = 0.0f;
    }
    mm_nt<R, C>(sc, Qs, L.ldq, Ks, L.ldq, s.kq);

#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int i = i0 + ty + 16 * r;
      float mx = -INFINITY;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int j = j0 + tx + 16 * c;
        sc[r][c] = (j <= i && j < s.T) ? sc[r][c] * a.scale : -INFINITY;
        mx = fmaxf(mx, sc[r][c]);
      }
      // Key 0 is in the first tile and visible to every row: from there on m_new is finite.
      const float m_new = fmaxf(m[r], row_max16(mx));
      const float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        sc[r][c] = sc[r][c] == -INFINITY ? 0.0f : expf(sc[r][c] - m_new);
        sum += sc[r][c];
      }
      l[r] = l[r] * alpha + row_sum16(sum);
      m[r] = m_new;
#pragma unroll
      for (int x = 0; x < 4 * NCV; ++x) o[r][x] *= alpha;
#pragma unroll
      for (int c = 0; c < C; ++c) Ps[(ty + 16 * r) * L.ldp + tx + 16 * c] = sc[r][c];
    }
    __syncthreads();
    mm_nn<R, NCV>(o, Ps, L.ldp, Vs, L.ldv, BK);
  }

  const int64_t ldo = int64_t(s.H) * s.Dv;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = i0 + ty + 16 * r;
    if (i >= s.T) continue;
    const float inv = 1.0f / l[r];
    const int64_t orow = (row0 + i) * ldo + int64_t(h) * s.Dv;
#pragma unroll
    for (int c = 0; c < NCV; ++c) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = 64 * c + 4 * tx + u;
        if (e < s.Dv) st(a.out, a.out_e, orow + e, o[r][4 * c + u] * inv);
      }
    }
    if (tx == 0) st(a.lse, a.lse_e, (int64_t(b) * s.H + h) * s.T + i, m[r] + logf(l[r]));
  }
}

// ---- backward --------------------------------------------------------------------------------

// delta (B, H, T) = rowsum(dout * out): one warp per row of (B, T, H) rows of Dv.
__global__ void __launch_bounds__(kThreads) delta_kernel(float* delta, const void* dout, Elem dout_e, const void* out,
                                                         Elem out_e, int64_t rows, int T, int H, int Dv) {
  const int64_t row = int64_t(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (row >= rows) return;  // a whole warp leaves together
  const int lane = threadIdx.x & 31;
  float acc = 0.0f;
  for (int e = lane; e < Dv; e += 32) acc = fmaf(ld(dout, dout_e, row * Dv + e), ld(out, out_e, row * Dv + e), acc);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) {
    const int64_t h = row % H, t = (row / H) % T, b = row / (int64_t(H) * T);
    delta[(b * H + h) * T + t] = acc;
  }
}

// Stages lse and delta of query rows [i0, i0 + BQ) of head h (rows past T: 0, never used).
template <int BQ>
__device__ __forceinline__ void load_row_stats(float* lse_s, float* delta_s, const BwdArgs& a, int b, int h, int i0) {
  const int64_t base = (int64_t(b) * a.s.H + h) * a.s.T;
  for (int x = threadIdx.x; x < BQ; x += kThreads) {
    const int i = i0 + x;
    lse_s[x] = i < a.s.T ? ld(a.lse, a.lse_e, base + i) : 0.0f;
    delta_s[x] = i < a.s.T ? a.delta[base + i] : 0.0f;
  }
}

// dK and dV of one key tile of kv head g: one block per (key tile, kv head, batch), summing over
// the query heads of the group in order and over the query tiles at or after the key tile.
template <int BQ, int BK, int NCQ, int NCV>
__global__ void __launch_bounds__(kThreads) dkdv_kernel(const BwdArgs a) {
  constexpr int RK = BK / 16, CQ = BQ / 16;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Shape& s = a.s;
  const DkdvSmem L(s, BQ, BK, NCQ, NCV);
  float* Ks = smem + L.k;
  float* Vs = smem + L.v;
  float* Qs = smem + L.q;
  float* Os = smem + L.o;  // dO
  float* Ps = smem + L.p;  // P^T, then dS^T
  float* lse_s = smem + L.lse;
  float* delta_s = smem + L.delta;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  const int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int j0 = kt * BK;
  const int64_t row0 = int64_t(b) * s.T;
  const int64_t ldo = int64_t(s.H) * s.Dv;
  load_tile(Ks, L.ldk, BK, s.wq, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
            min(BK, s.T - j0), s.Dqk);
  load_tile(Vs, L.ldv, BK, s.wv, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
            min(BK, s.T - j0), s.Dv);

  float dk[RK][4 * NCQ], dv[RK][4 * NCV];
#pragma unroll
  for (int r = 0; r < RK; ++r) {
#pragma unroll
    for (int x = 0; x < 4 * NCQ; ++x) dk[r][x] = 0.0f;
#pragma unroll
    for (int x = 0; x < 4 * NCV; ++x) dv[r][x] = 0.0f;
  }

  const int n_qt = (s.T + BQ - 1) / BQ;
  for (int h = g * s.group; h < (g + 1) * s.group; ++h) {
    for (int qt = j0 / BQ; qt < n_qt; ++qt) {
      const int i0 = qt * BQ;
      __syncthreads();  // the previous tile's Q, dO and P are no longer read
      load_tile(Qs, L.ldq, BQ, 64 * NCQ, a.qkv, a.qkv_e, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
                min(BQ, s.T - i0), s.Dqk);
      load_tile(Os, L.ldo, BQ, 64 * NCV, a.dout, a.dout_e, (row0 + i0) * ldo + int64_t(h) * s.Dv, ldo,
                min(BQ, s.T - i0), s.Dv);
      load_row_stats<BQ>(lse_s, delta_s, a, b, h, i0);
      __syncthreads();

      // Transposed scores: rows are keys j, columns queries i.
      float pt[RK][CQ], dst[RK][CQ];
#pragma unroll
      for (int r = 0; r < RK; ++r) {
#pragma unroll
        for (int c = 0; c < CQ; ++c) pt[r][c] = dst[r][c] = 0.0f;
      }
      mm_nt<RK, CQ>(pt, Ks, L.ldk, Qs, L.ldq, s.kq);   // (Q K^T)^T
      mm_nt<RK, CQ>(dst, Vs, L.ldv, Os, L.ldo, s.kv);  // dP^T = (dO V^T)^T
#pragma unroll
      for (int r = 0; r < RK; ++r) {
        const int j = j0 + ty + 16 * r;
#pragma unroll
        for (int c = 0; c < CQ; ++c) {
          const int x = tx + 16 * c, i = i0 + x;
          // P = softmax(scale Q K^T) from the saved log-sum-exp; dS = P (dP - delta).
          const float p = (j <= i && i < s.T) ? expf(pt[r][c] * a.scale - lse_s[x]) : 0.0f;
          dst[r][c] = p * (dst[r][c] - delta_s[x]);
          Ps[(ty + 16 * r) * L.ldp + x] = p;
        }
      }
      __syncthreads();
      mm_nn<RK, NCV>(dv, Ps, L.ldp, Os, L.ldo, BQ);  // dV += P^T dO
      __syncthreads();
#pragma unroll
      for (int r = 0; r < RK; ++r) {
#pragma unroll
        for (int c = 0; c < CQ; ++c) Ps[(ty + 16 * r) * L.ldp + tx + 16 * c] = dst[r][c];
      }
      __syncthreads();
      mm_nn<RK, NCQ>(dk, Ps, L.ldp, Qs, L.ldq, BQ);  // dK += dS^T Q (times scale below)
    }
  }

#pragma unroll
  for (int r = 0; r < RK; ++r) {
    const int j = j0 + ty + 16 * r;
    if (j >= s.T) continue;
    const int64_t krow = (row0 + j) * s.W + s.k_off + int64_t(g) * s.Dqk;
    const int64_t vrow = (row0 + j) * s.W + s.v_off + int64_t(g) * s.Dv;
#pragma unroll
    for (int c = 0; c < NCQ; ++c) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int d = 64 * c + 4 * tx + u;
        if (d < s.Dqk) st(a.dqkv, a.dqkv_e, krow + d, dk[r][4 * c + u] * a.scale);
      }
    }
#pragma unroll
    for (int c = 0; c < NCV; ++c) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = 64 * c + 4 * tx + u;
        if (e < s.Dv) st(a.dqkv, a.dqkv_e, vrow + e, dv[r][4 * c + u]);
      }
    }
  }
}

// dQ of one query tile of head h: one block per (query tile, query head, batch), summing over
// the key tiles up to the diagonal in order; the last query tiles (the most key tiles) first.
template <int BQ, int BK, int NCQ>
__global__ void __launch_bounds__(kThreads) dq_kernel(const BwdArgs a) {
  constexpr int R = BQ / 16, C = BK / 16;
  extern __shared__ float4 smem4[];
  float* smem = reinterpret_cast<float*>(smem4);
  const Shape& s = a.s;
  const DqSmem L(s, BQ, BK, NCQ);
  float* Qs = smem + L.q;
  float* Os = smem + L.o;  // dO
  float* Ks = smem + L.k;
  float* Vs = smem + L.v;
  float* Ps = smem + L.p;  // dS
  float* lse_s = smem + L.lse;
  float* delta_s = smem + L.delta;
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;

  const int qt = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int g = h / s.group;
  const int i0 = qt * BQ;
  const int64_t row0 = int64_t(b) * s.T;
  const int64_t ldo = int64_t(s.H) * s.Dv;
  load_tile(Qs, L.ldq, BQ, s.wq, a.qkv, a.qkv_e, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
            min(BQ, s.T - i0), s.Dqk);
  load_tile(Os, L.ldo, BQ, s.wv, a.dout, a.dout_e, (row0 + i0) * ldo + int64_t(h) * s.Dv, ldo, min(BQ, s.T - i0),
            s.Dv);
  load_row_stats<BQ>(lse_s, delta_s, a, b, h, i0);

  float dq[R][4 * NCQ];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int x = 0; x < 4 * NCQ; ++x) dq[r][x] = 0.0f;
  }

  const int i_last = min(i0 + BQ, s.T) - 1;
  const int n_kt = i_last / BK + 1;
  for (int kt = 0; kt < n_kt; ++kt) {
    const int j0 = kt * BK;
    __syncthreads();  // the previous tile's K, V and dS are no longer read
    load_tile(Ks, L.ldk, BK, 64 * NCQ, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
              min(BK, s.T - j0), s.Dqk);
    load_tile(Vs, L.ldv, BK, s.wv, a.qkv, a.qkv_e, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
              min(BK, s.T - j0), s.Dv);
    __syncthreads();

    float sc[R][C], dp[R][C];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int c = 0; c < C; ++c) sc[r][c] = dp[r][c] = 0.0f;
    }
    mm_nt<R, C>(sc, Qs, L.ldq, Ks, L.ldk, s.kq);  // Q K^T
    mm_nt<R, C>(dp, Os, L.ldo, Vs, L.ldv, s.kv);  // dP = dO V^T
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int y = ty + 16 * r, i = i0 + y;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int j = j0 + tx + 16 * c;
        const float p = (j <= i && i < s.T) ? expf(sc[r][c] * a.scale - lse_s[y]) : 0.0f;
        Ps[y * L.ldp + tx + 16 * c] = p * (dp[r][c] - delta_s[y]);
      }
    }
    __syncthreads();
    mm_nn<R, NCQ>(dq, Ps, L.ldp, Ks, L.ldk, BK);  // dQ += dS K (times scale below)
  }

#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = i0 + ty + 16 * r;
    if (i >= s.T) continue;
    const int64_t qrow = (row0 + i) * s.W + s.q_off + int64_t(h) * s.Dqk;
#pragma unroll
    for (int c = 0; c < NCQ; ++c) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int d = 64 * c + 4 * tx + u;
        if (d < s.Dqk) st(a.dqkv, a.dqkv_e, qrow + d, dq[r][4 * c + u] * a.scale);
      }
    }
  }
}

// ---- tensor-core kernels (q, k, v and dout in bf16 or f16) -------------------------------------
//
// The same algorithms on mma.sync.m16n8k16 (16-bit inputs, fp32 accumulation): a warp owns 16
// rows of a score tile and holds scores, probabilities and outputs in the mma accumulator layout
// (lane = 4*gid + tig: rows gid and gid + 8, columns 2*tig and 2*tig + 1 of each 8-column tile).
// Probabilities and dS are rounded to the 16-bit type as mma inputs, as FlashAttention does;
// softmax statistics, sums and outputs stay fp32. Tiles are staged in shared memory as the raw
// 16-bit values, rows padded by 8 elements so that the 8 rows of an ldmatrix fall on distinct banks.

using u16 = unsigned short;

template <class T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  uint32_t r;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}

// The Elem of a 16-bit element type, for elem.cuh's loads and stores.
template <class T>
constexpr Elem kElem16 = std::is_same_v<T, __nv_bfloat16> ? Elem::BF16 : Elem::F16;

// d += A B for a 16x16 A (row-major fragment) and a 16x8 B (column-major fragment).
template <class T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix): lane l gives the address
// of row l % 8 of matrix l / 8 (16-byte aligned); r[q] receives matrix q's elements (row gid,
// columns 2tig and 2tig + 1), or with Trans its transpose's (rows 2tig and 2tig + 1, column gid).
template <bool Trans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const u16* row) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
}

// A fragment: rows [m0, m0 + 16) x columns [k0, k0 + 16) of a row-major matrix (row stride ld):
// a[0] = (gid, 2tig..), a[1] = (gid + 8, 2tig..), a[2] = (gid, 2tig + 8..), a[3] = (gid + 8, 2tig + 8..).
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const u16* s, int ld, int m0, int k0) {
  const int lane = threadIdx.x & 31, q = lane >> 3, r = lane & 7;
  ldsm_x4<false>(a, s + (m0 + r + 8 * (q & 1)) * ld + k0 + 8 * (q >> 1));
}

// B fragments B(k, n), k in [k0, k0 + 16), of the column tiles n in [n0, n0 + 8) (b[0]) and
// [n0 + 8, n0 + 16) (b[1]), of a matrix stored as (n, k) rows: b[t][0] = (k = 2tig.., n = gid),
// b[t][1] = (k = 2tig + 8.., n = gid).
__device__ __forceinline__ void frag_b_nk(uint32_t (&b)[2][2], const u16* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31, q = lane >> 3, r = lane & 7;
  uint32_t m[4];
  ldsm_x4<false>(m, s + (n0 + r + 8 * (q >> 1)) * ld + k0 + 8 * (q & 1));
  b[0][0] = m[0];
  b[0][1] = m[1];
  b[1][0] = m[2];
  b[1][1] = m[3];
}

// The same fragments of a matrix stored as (k, n) rows (transposed on the way).
__device__ __forceinline__ void frag_b_kn(uint32_t (&b)[2][2], const u16* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31, q = lane >> 3, r = lane & 7;
  uint32_t m[4];
  ldsm_x4<true>(m, s + (k0 + r + 8 * (q & 1)) * ld + n0 + 8 * (q >> 1));
  b[0][0] = m[0];
  b[0][1] = m[1];
  b[1][0] = m[2];
  b[1][1] = m[3];
}

// The A fragment (16 rows x 16 columns) of accumulator tiles c0 (columns 0-7) and c1 (8-15).
template <class T>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
  a[0] = pack2<T>(c0[0], c0[1]);
  a[1] = pack2<T>(c0[2], c0[3]);
  a[2] = pack2<T>(c1[0], c1[1]);
  a[3] = pack2<T>(c1[2], c1[3]);
}

// Max and sum over the 4 lanes of a row (one quad), in a fixed order.
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Stages rows [0, rows) x columns [0, width) of a 16-bit tile into shared memory s (row stride
// lds): element (r, c) of g at base + r*ld + c, zero where r >= valid_rows or c >= cols. With
// vec8 (g 16-byte aligned; base, ld and cols multiples of 8) in 16-byte pieces.
__device__ __forceinline__ void load_tile16(u16* s, int lds, int rows, int width, const u16* g, int64_t base,
                                            int64_t ld_g, int valid_rows, int cols, bool vec8) {
  if (vec8) {
    const int per_row = width / 8;
    for (int x = threadIdx.x; x < rows * per_row; x += blockDim.x) {
      const int r = x / per_row, c = (x - r * per_row) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < valid_rows && c < cols) v = *reinterpret_cast<const uint4*>(g + base + r * ld_g + c);
      *reinterpret_cast<uint4*>(s + r * lds + c) = v;
    }
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  for (int r = warp; r < rows; r += warps) {
    u16* row = s + r * lds;
    if (r < valid_rows) {
      const int64_t gr = base + r * ld_g;
      for (int c = lane; c < width; c += 32) row[c] = c < cols ? g[gr + c] : u16(0);
    } else {
      for (int c = lane; c < width; c += 32) row[c] = 0;
    }
  }
}

// Shared-memory layouts of the tensor-core kernels: fp32 row statistics first, then 16-bit tiles
// (offsets and row strides in 16-bit elements, multiples of 8).
struct FwdTcSmem {
  int ldq, ldv, q, k, v, bytes;
  __host__ __device__ FwdTcSmem(const Shape& s, int NCV) {
    ldq = s.kq16 + 8;
    ldv = 64 * NCV + 8;
    q = 0;              // Q tile (64, kq16)
    k = q + 64 * ldq;   // K tile (64, kq16)
    v = k + 64 * ldq;   // V tile (64, 64*NCV)
    bytes = (v + 64 * ldv) * 2;
  }
};

struct DqTcSmem {
  int ldq, ldo, ldk, ldv, q, o, k, v, bytes;
  __host__ __device__ DqTcSmem(const Shape& s, int NCQ) {
    ldq = s.kq16 + 8;
    ldo = s.kv16 + 8;
    ldk = 64 * NCQ + 8;
    ldv = s.kv16 + 8;
    q = 0;              // Q tile (64, kq16)
    o = q + 64 * ldq;   // dO tile (64, kv16)
    k = o + 64 * ldo;   // K tile (64, 64*NCQ)
    v = k + 64 * ldk;   // V tile (64, kv16)
    bytes = 2 * 64 * 4 + (v + 64 * ldv) * 2;  // lse and delta, then the tiles
  }
};

struct DkdvTcSmem {
  int ldk, ldv, ldq, ldo, ldp, k, v, q, o, p, ds, bytes;
  __host__ __device__ DkdvTcSmem(const Shape& s, int NCQ, int NCV) {
    ldk = s.kq16 + 8;
    ldv = s.kv16 + 8;
    ldq = 64 * NCQ + 8;
    ldo = 64 * NCV + 8;
    ldp = 64 + 8;
    k = 0;              // K tile (64, kq16)
    v = k + 64 * ldk;   // V tile (64, kv16)
    q = v + 64 * ldv;   // Q tile (64, 64*NCQ)
    o = q + 64 * ldq;   // dO tile (64, 64*NCV)
    p = o + 64 * ldo;   // P^T (64 keys, 64 queries)
    ds = p + 64 * ldp;  // dS^T (64, 64)
    bytes = 2 * 64 * 4 + (ds + 64 * ldp) * 2;
  }
};

constexpr int kTcThreads = 128;      // forward and dQ: 4 warps of 16 query rows
constexpr int kTcDkdvThreads = 256;  // dK/dV: 8 warps, 4 of 16 keys x 2 halves

// One block per (64-query tile, query head, batch), the last tiles first; warp w owns query rows
// 16w .. 16w + 15 of the tile and streams 64-key tiles up to the diagonal.
template <class T, int NCV>
__global__ void __launch_bounds__(kTcThreads) forward_tc_kernel(const FwdArgs a) {
  constexpr int BQ = 64, BK = 64, NO = 8 * NCV;
  extern __shared__ float4 smem4[];
  u16* sm = reinterpret_cast<u16*>(smem4);
  const Shape& s = a.s;
  const FwdTcSmem L(s, NCV);
  u16* Qs = sm + L.q;
  u16* Ks = sm + L.k;
  u16* Vs = sm + L.v;
  const u16* qkv = static_cast<const u16*>(a.qkv);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;

  const int qt = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int g = h / s.group;
  const int i0 = qt * BQ;
  const int64_t row0 = int64_t(b) * s.T;
  load_tile16(Qs, L.ldq, BQ, s.kq16, qkv, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
              min(BQ, s.T - i0), s.Dqk, a.qkv_vec8);

  const int r0 = i0 + 16 * warp + gid;  // this thread's rows: r0 and r0 + 8
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[NO][4];
#pragma unroll
  for (int n = 0; n < NO; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;

  const int n_kt = (min(i0 + BQ, s.T) - 1) / BK + 1;
  for (int kt = 0; kt < n_kt; ++kt) {
    const int j0 = kt * BK;
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile16(Ks, L.ldq, BK, s.kq16, qkv, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
                min(BK, s.T - j0), s.Dqk, a.qkv_vec8);
    load_tile16(Vs, L.ldv, BK, 64 * NCV, qkv, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
                min(BK, s.T - j0), s.Dv, a.qkv_vec8);
    __syncthreads();

    float sc[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
    for (int k0 = 0; k0 < s.kq16; k0 += 16) {
      uint32_t af[4];
      frag_a(af, Qs, L.ldq, 16 * warp, k0);
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t bf[2][2];
        frag_b_nk(bf, Ks, L.ldq, 8 * n, k0);
        mma_16816<T>(sc[n], af, bf[0]);
        mma_16816<T>(sc[n + 1], af, bf[1]);
      }
    }

    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = r0 + 8 * (u >> 1), j = j0 + 8 * n + 2 * tig + (u & 1);
        sc[n][u] = (j <= i && j < s.T) ? sc[n][u] * a.scale : -INFINITY;
        mx[u >> 1] = fmaxf(mx[u >> 1], sc[n][u]);
      }
    }
    float alpha[2], sum[2] = {0.0f, 0.0f};
#pragma unroll
    for (int x = 0; x < 2; ++x) {
      // Key 0 is in the first tile and visible to every row: from there on m is finite.
      const float m_new = fmaxf(m[x], quad_max(mx[x]));
      alpha[x] = m[x] == -INFINITY ? 0.0f : expf(m[x] - m_new);
      m[x] = m_new;
    }
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        sc[n][u] = sc[n][u] == -INFINITY ? 0.0f : expf(sc[n][u] - m[u >> 1]);
        sum[u >> 1] += sc[n][u];
      }
    }
#pragma unroll
    for (int x = 0; x < 2; ++x) l[x] = l[x] * alpha[x] + quad_sum(sum[x]);
#pragma unroll
    for (int n = 0; n < NO; ++n) {
      o[n][0] *= alpha[0];
      o[n][1] *= alpha[0];
      o[n][2] *= alpha[1];
      o[n][3] *= alpha[1];
    }

    // O += P V, 16 keys at a time.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t pa[4];
      acc_to_a<T>(pa, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < NO; n += 2) {
        uint32_t bf[2][2];
        frag_b_kn(bf, Vs, L.ldv, 8 * n, 16 * kk);
        mma_16816<T>(o[n], pa, bf[0]);
        mma_16816<T>(o[n + 1], pa, bf[1]);
      }
    }
  }

  const int64_t ldo = int64_t(s.H) * s.Dv;
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int i = r0 + 8 * x;
    if (i >= s.T) continue;
    const float inv = 1.0f / l[x];
    const int64_t orow = (row0 + i) * ldo + int64_t(h) * s.Dv;
#pragma unroll
    for (int n = 0; n < NO; ++n) {
#pragma unroll
      for (int y = 0; y < 2; ++y) {
        const int e = 8 * n + 2 * tig + y;
        if (e < s.Dv) st(a.out, a.out_e, orow + e, o[n][2 * x + y] * inv);
      }
    }
    if (tig == 0) st(a.lse, a.lse_e, (int64_t(b) * s.H + h) * s.T + i, m[x] + logf(l[x]));
  }
}

// Stages lse and delta of query rows [i0, i0 + 64) of head h (rows past T: 0, never used).
__device__ __forceinline__ void load_row_stats64(float* lse_s, float* delta_s, const BwdArgs& a, int b, int h,
                                                 int i0) {
  const int64_t base = (int64_t(b) * a.s.H + h) * a.s.T;
  for (int x = threadIdx.x; x < 64; x += blockDim.x) {
    const int i = i0 + x;
    lse_s[x] = i < a.s.T ? ld(a.lse, a.lse_e, base + i) : 0.0f;
    delta_s[x] = i < a.s.T ? a.delta[base + i] : 0.0f;
  }
}

// dQ of one 64-query tile of head h, over the key tiles up to the diagonal in order; the last
// tiles first. Warp w owns query rows 16w .. 16w + 15.
template <class T, int NCQ>
__global__ void __launch_bounds__(kTcThreads) dq_tc_kernel(const BwdArgs a) {
  constexpr int BQ = 64, BK = 64, NQ = 8 * NCQ;
  extern __shared__ float4 smem4[];
  float* lse_s = reinterpret_cast<float*>(smem4);
  float* delta_s = lse_s + 64;
  u16* sm = reinterpret_cast<u16*>(delta_s + 64);
  const Shape& s = a.s;
  const DqTcSmem L(s, NCQ);
  u16* Qs = sm + L.q;
  u16* Os = sm + L.o;  // dO
  u16* Ks = sm + L.k;
  u16* Vs = sm + L.v;
  const u16* qkv = static_cast<const u16*>(a.qkv);
  const u16* dout = static_cast<const u16*>(a.dout);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;

  const int qt = int(gridDim.x) - 1 - int(blockIdx.x), h = blockIdx.y, b = blockIdx.z;
  const int g = h / s.group;
  const int i0 = qt * BQ;
  const int64_t row0 = int64_t(b) * s.T;
  const int64_t ldo = int64_t(s.H) * s.Dv;
  load_tile16(Qs, L.ldq, BQ, s.kq16, qkv, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
              min(BQ, s.T - i0), s.Dqk, a.qkv_vec8);
  load_tile16(Os, L.ldo, BQ, s.kv16, dout, (row0 + i0) * ldo + int64_t(h) * s.Dv, ldo, min(BQ, s.T - i0), s.Dv,
              a.dout_vec8);
  load_row_stats64(lse_s, delta_s, a, b, h, i0);

  const int y0 = 16 * warp + gid;  // this thread's rows in the tile: y0 and y0 + 8
  float dq[NQ][4];
#pragma unroll
  for (int n = 0; n < NQ; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;

  const int n_kt = (min(i0 + BQ, s.T) - 1) / BK + 1;
  for (int kt = 0; kt < n_kt; ++kt) {
    const int j0 = kt * BK;
    __syncthreads();  // the previous tile's K and V are no longer read
    load_tile16(Ks, L.ldk, BK, 64 * NCQ, qkv, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
                min(BK, s.T - j0), s.Dqk, a.qkv_vec8);
    load_tile16(Vs, L.ldv, BK, s.kv16, qkv, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
                min(BK, s.T - j0), s.Dv, a.qkv_vec8);
    __syncthreads();

    float sc[8][4], dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
      dp[n][0] = dp[n][1] = dp[n][2] = dp[n][3] = 0.0f;
    }
    for (int k0 = 0; k0 < s.kq16; k0 += 16) {  // S = Q K^T
      uint32_t af[4];
      frag_a(af, Qs, L.ldq, 16 * warp, k0);
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t bf[2][2];
        frag_b_nk(bf, Ks, L.ldk, 8 * n, k0);
        mma_16816<T>(sc[n], af, bf[0]);
        mma_16816<T>(sc[n + 1], af, bf[1]);
      }
    }
    for (int k0 = 0; k0 < s.kv16; k0 += 16) {  // dP = dO V^T
      uint32_t af[4];
      frag_a(af, Os, L.ldo, 16 * warp, k0);
#pragma unroll
      for (int n = 0; n < 8; n += 2) {
        uint32_t bf[2][2];
        frag_b_nk(bf, Vs, L.ldv, 8 * n, k0);
        mma_16816<T>(dp[n], af, bf[0]);
        mma_16816<T>(dp[n + 1], af, bf[1]);
      }
    }
    // dS = P (dP - delta), P from the saved log-sum-exp; kept in sc.
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int y = y0 + 8 * (u >> 1), i = i0 + y, j = j0 + 8 * n + 2 * tig + (u & 1);
        const float p = (j <= i && i < s.T) ? expf(sc[n][u] * a.scale - lse_s[y]) : 0.0f;
        sc[n][u] = p * (dp[n][u] - delta_s[y]);
      }
    }
    // dQ += dS K (times scale below), 16 keys at a time.
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      uint32_t da[4];
      acc_to_a<T>(da, sc[2 * kk], sc[2 * kk + 1]);
#pragma unroll
      for (int n = 0; n < NQ; n += 2) {
        uint32_t bf[2][2];
        frag_b_kn(bf, Ks, L.ldk, 8 * n, 16 * kk);
        mma_16816<T>(dq[n], da, bf[0]);
        mma_16816<T>(dq[n + 1], da, bf[1]);
      }
    }
  }

#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int i = i0 + y0 + 8 * x;
    if (i >= s.T) continue;
    const int64_t qrow = (row0 + i) * s.W + s.q_off + int64_t(h) * s.Dqk;
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
#pragma unroll
      for (int z = 0; z < 2; ++z) {
        const int d = 8 * n + 2 * tig + z;
        if (d < s.Dqk) st(a.dqkv, a.dqkv_e, qrow + d, dq[n][2 * x + z] * a.scale);
      }
    }
  }
}

// dK and dV of one 64-key tile of kv head g, over the group's query heads in order and the
// 64-query tiles at or after the key tile. Warp w = 4*wn + wm computes the scores of keys
// 16wm .. 16wm + 15 against queries 32wn .. 32wn + 31 of a query tile; P^T and dS^T go through
// shared memory, and the warp sums dK and dV of its 16 keys over columns half wn.
template <class T, int NCQ, int NCV>
__global__ void __launch_bounds__(kTcDkdvThreads) dkdv_tc_kernel(const BwdArgs a) {
  constexpr int BQ = 64, BK = 64, NQ = 4 * NCQ, NV = 4 * NCV;  // column tiles of 8 per half
  extern __shared__ float4 smem4[];
  float* lse_s = reinterpret_cast<float*>(smem4);
  float* delta_s = lse_s + 64;
  u16* sm = reinterpret_cast<u16*>(delta_s + 64);
  const Shape& s = a.s;
  const DkdvTcSmem L(s, NCQ, NCV);
  u16* Ks = sm + L.k;
  u16* Vs = sm + L.v;
  u16* Qs = sm + L.q;
  u16* Os = sm + L.o;  // dO
  u16* Ps = sm + L.p;  // P^T (keys, queries)
  u16* Ds = sm + L.ds;  // dS^T (keys, queries)
  const u16* qkv = static_cast<const u16*>(a.qkv);
  const u16* dout = static_cast<const u16*>(a.dout);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
  const int wm = warp & 3, wn = warp >> 2;

  const int kt = blockIdx.x, g = blockIdx.y, b = blockIdx.z;
  const int j0 = kt * BK;
  const int64_t row0 = int64_t(b) * s.T;
  const int64_t ldo = int64_t(s.H) * s.Dv;
  load_tile16(Ks, L.ldk, BK, s.kq16, qkv, (row0 + j0) * s.W + s.k_off + int64_t(g) * s.Dqk, s.W,
              min(BK, s.T - j0), s.Dqk, a.qkv_vec8);
  load_tile16(Vs, L.ldv, BK, s.kv16, qkv, (row0 + j0) * s.W + s.v_off + int64_t(g) * s.Dv, s.W,
              min(BK, s.T - j0), s.Dv, a.qkv_vec8);

  float dk[NQ][4], dv[NV][4];
#pragma unroll
  for (int n = 0; n < NQ; ++n) dk[n][0] = dk[n][1] = dk[n][2] = dk[n][3] = 0.0f;
#pragma unroll
  for (int n = 0; n < NV; ++n) dv[n][0] = dv[n][1] = dv[n][2] = dv[n][3] = 0.0f;

  const int n_qt = (s.T + BQ - 1) / BQ;
  for (int h = g * s.group; h < (g + 1) * s.group; ++h) {
    for (int qt = j0 / BQ; qt < n_qt; ++qt) {
      const int i0 = qt * BQ;
      __syncthreads();  // the previous tile's Q, dO, P^T and dS^T are no longer read
      load_tile16(Qs, L.ldq, BQ, 64 * NCQ, qkv, (row0 + i0) * s.W + s.q_off + int64_t(h) * s.Dqk, s.W,
                  min(BQ, s.T - i0), s.Dqk, a.qkv_vec8);
      load_tile16(Os, L.ldo, BQ, 64 * NCV, dout, (row0 + i0) * ldo + int64_t(h) * s.Dv, ldo, min(BQ, s.T - i0),
                  s.Dv, a.dout_vec8);
      load_row_stats64(lse_s, delta_s, a, b, h, i0);
      __syncthreads();

      // Transposed scores: rows keys 16wm.., columns queries 32wn + 8n ...
      float sct[4][4], dpt[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        sct[n][0] = sct[n][1] = sct[n][2] = sct[n][3] = 0.0f;
        dpt[n][0] = dpt[n][1] = dpt[n][2] = dpt[n][3] = 0.0f;
      }
      for (int k0 = 0; k0 < s.kq16; k0 += 16) {  // (Q K^T)^T = K Q^T
        uint32_t af[4];
        frag_a(af, Ks, L.ldk, 16 * wm, k0);
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
          uint32_t bf[2][2];
          frag_b_nk(bf, Qs, L.ldq, 32 * wn + 8 * n, k0);
          mma_16816<T>(sct[n], af, bf[0]);
          mma_16816<T>(sct[n + 1], af, bf[1]);
        }
      }
      for (int k0 = 0; k0 < s.kv16; k0 += 16) {  // dP^T = V dO^T
        uint32_t af[4];
        frag_a(af, Vs, L.ldv, 16 * wm, k0);
#pragma unroll
        for (int n = 0; n < 4; n += 2) {
          uint32_t bf[2][2];
          frag_b_nk(bf, Os, L.ldo, 32 * wn + 8 * n, k0);
          mma_16816<T>(dpt[n], af, bf[0]);
          mma_16816<T>(dpt[n + 1], af, bf[1]);
        }
      }
#pragma unroll
      for (int n = 0; n < 4; ++n) {
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int y = 16 * wm + gid + 8 * (u >> 1), j = j0 + y;
          const int x = 32 * wn + 8 * n + 2 * tig + (u & 1), i = i0 + x;
          const float p = (j <= i && i < s.T) ? expf(sct[n][u] * a.scale - lse_s[x]) : 0.0f;
          st(Ps, kElem16<T>, y * L.ldp + x, p);
          st(Ds, kElem16<T>, y * L.ldp + x, p * (dpt[n][u] - delta_s[x]));
        }
      }
      __syncthreads();
      // dV += P^T dO and dK += dS^T Q (times scale below), 16 queries at a time.
#pragma unroll
      for (int kk = 0; kk < BQ / 16; ++kk) {
        uint32_t pa[4], da[4];
        frag_a(pa, Ps, L.ldp, 16 * wm, 16 * kk);
        frag_a(da, Ds, L.ldp, 16 * wm, 16 * kk);
#pragma unroll
        for (int n = 0; n < NV; n += 2) {
          uint32_t bf[2][2];
          frag_b_kn(bf, Os, L.ldo, wn * 32 * NCV + 8 * n, 16 * kk);
          mma_16816<T>(dv[n], pa, bf[0]);
          mma_16816<T>(dv[n + 1], pa, bf[1]);
        }
#pragma unroll
        for (int n = 0; n < NQ; n += 2) {
          uint32_t bf[2][2];
          frag_b_kn(bf, Qs, L.ldq, wn * 32 * NCQ + 8 * n, 16 * kk);
          mma_16816<T>(dk[n], da, bf[0]);
          mma_16816<T>(dk[n + 1], da, bf[1]);
        }
      }
    }
  }

#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const int j = j0 + 16 * wm + gid + 8 * x;
    if (j >= s.T) continue;
    const int64_t krow = (row0 + j) * s.W + s.k_off + int64_t(g) * s.Dqk;
    const int64_t vrow = (row0 + j) * s.W + s.v_off + int64_t(g) * s.Dv;
#pragma unroll
    for (int n = 0; n < NQ; ++n) {
#pragma unroll
      for (int z = 0; z < 2; ++z) {
        const int d = wn * 32 * NCQ + 8 * n + 2 * tig + z;
        if (d < s.Dqk) st(a.dqkv, a.dqkv_e, krow + d, dk[n][2 * x + z] * a.scale);
      }
    }
#pragma unroll
    for (int n = 0; n < NV; ++n) {
#pragma unroll
      for (int z = 0; z < 2; ++z) {
        const int e = wn * 32 * NCV + 8 * n + 2 * tig + z;
        if (e < s.Dv) st(a.dqkv, a.dqkv_e, vrow + e, dv[n][2 * x + z]);
      }
    }
  }
}

// ---- launches --------------------------------------------------------------------------------

int round_up(int x, int m) { return (x + m - 1) / m * m; }

Shape shape_of(const Dims& d) {
  Shape s;
  s.T = int(d.T);
  s.W = d.W;
  s.H = d.H;
  s.group = d.H / d.Hkv;
  s.Dqk = d.Dqk;
  s.Dv = d.Dv;
  s.q_off = d.q_offset;
  s.k_off = d.k_offset;
  s.v_off = d.v_offset;
  s.kq = round_up(d.Dqk, 4);
  s.kv = round_up(d.Dv, 4);
  s.wq = round_up(d.Dqk, 32);
  s.wv = round_up(d.Dv, 32);
  s.kq16 = round_up(d.Dqk, 16);
  s.kv16 = round_up(d.Dv, 16);
  return s;
}

// The shared memory one block of the current device may have (opt-in maximum).
int max_smem_bytes() {
  int dev = 0, bytes = 0;
  DS_CUDA_CHECK(cudaGetDevice(&dev));
  DS_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
  return bytes;
}

template <class Kernel>
void allow_smem(Kernel kernel, size_t bytes) {
  DS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
}

// Head-dim widths in units of 64 columns (1..4).
int chunks(int dim) { return (dim + 63) / 64; }

template <int BQ, int BK, int NCV>
bool try_forward(const FwdArgs& a, int B, int limit) {
  const size_t bytes = size_t(FwdSmem(a.s, BQ, BK, NCV).total) * sizeof(float);
  if (bytes > size_t(limit)) return false;
  auto kernel = forward_kernel<BQ, BK, NCV>;
  allow_smem(kernel, bytes);
  const dim3 grid(unsigned((a.s.T + BQ - 1) / BQ), unsigned(a.s.H), unsigned(B));
  kernel<<<grid, kThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention forward");
  return true;
}

template <int NCV>
bool forward_nc(const FwdArgs& a, int B, int limit) {
  return try_forward<64, 64, NCV>(a, B, limit) || try_forward<64, 32, NCV>(a, B, limit);
}

template <int BQ, int BK, int NCQ>
bool try_dq(const BwdArgs& a, int B, int limit) {
  const size_t bytes = size_t(DqSmem(a.s, BQ, BK, NCQ).total) * sizeof(float);
  if (bytes > size_t(limit)) return false;
  auto kernel = dq_kernel<BQ, BK, NCQ>;
  allow_smem(kernel, bytes);
  const dim3 grid(unsigned((a.s.T + BQ - 1) / BQ), unsigned(a.s.H), unsigned(B));
  kernel<<<grid, kThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention backward (dq)");
  return true;
}

template <int NCQ>
bool dq_nc(const BwdArgs& a, int B, int limit) {
  return try_dq<64, 64, NCQ>(a, B, limit) || try_dq<64, 32, NCQ>(a, B, limit) || try_dq<32, 32, NCQ>(a, B, limit);
}

template <int BQ, int BK, int NCQ, int NCV>
bool try_dkdv(const BwdArgs& a, int B, int Hkv, int limit) {
  const size_t bytes = size_t(DkdvSmem(a.s, BQ, BK, NCQ, NCV).total) * sizeof(float);
  if (bytes > size_t(limit)) return false;
  auto kernel = dkdv_kernel<BQ, BK, NCQ, NCV>;
  allow_smem(kernel, bytes);
  const dim3 grid(unsigned((a.s.T + BK - 1) / BK), unsigned(Hkv), unsigned(B));
  kernel<<<grid, kThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention backward (dk, dv)");
  return true;
}

// The dK/dV kernels exist for a few (q/k, v) width pairs: (1,1), (2,2), (3,2) (DeepSeek's MLA:
// 192 and 128), (3,3), (4,4); other pairs run in the next wider one (the extra columns are zero).
bool dkdv(const BwdArgs& a, int B, int Hkv, int limit) {
  const int ncq = chunks(a.s.Dqk), ncv = chunks(a.s.Dv);
  const int n = std::max(ncq, ncv);
  if (n == 1) return try_dkdv<64, 64, 1, 1>(a, B, Hkv, limit);
  if (n == 2) return try_dkdv<64, 64, 2, 2>(a, B, Hkv, limit) || try_dkdv<32, 64, 2, 2>(a, B, Hkv, limit);
  if (n == 3 && ncv <= 2) {
    return try_dkdv<64, 64, 3, 2>(a, B, Hkv, limit) || try_dkdv<32, 64, 3, 2>(a, B, Hkv, limit);
  }
  if (n == 3) return try_dkdv<64, 64, 3, 3>(a, B, Hkv, limit) || try_dkdv<32, 64, 3, 3>(a, B, Hkv, limit);
  return try_dkdv<32, 32, 4, 4>(a, B, Hkv, limit);
}

template <class T, int NCV>
bool try_forward_tc(const FwdArgs& a, int B, int limit) {
  const int bytes = FwdTcSmem(a.s, NCV).bytes;
  if (bytes > limit) return false;
  auto kernel = forward_tc_kernel<T, NCV>;
  allow_smem(kernel, size_t(bytes));
  const dim3 grid(unsigned((a.s.T + 63) / 64), unsigned(a.s.H), unsigned(B));
  kernel<<<grid, kTcThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention forward (tensor cores)");
  return true;
}

template <class T>
bool forward_tc(const FwdArgs& a, int B, int limit) {
  switch (chunks(a.s.Dv)) {
    case 1: return try_forward_tc<T, 1>(a, B, limit);
    case 2: return try_forward_tc<T, 2>(a, B, limit);
    case 3: return try_forward_tc<T, 3>(a, B, limit);
    default: return try_forward_tc<T, 4>(a, B, limit);
  }
}

template <class T, int NCQ>
bool try_dq_tc(const BwdArgs& a, int B, int limit) {
  const int bytes = DqTcSmem(a.s, NCQ).bytes;
  if (bytes > limit) return false;
  auto kernel = dq_tc_kernel<T, NCQ>;
  allow_smem(kernel, size_t(bytes));
  const dim3 grid(unsigned((a.s.T + 63) / 64), unsigned(a.s.H), unsigned(B));
  kernel<<<grid, kTcThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention backward (dq, tensor cores)");
  return true;
}

template <class T>
bool dq_tc(const BwdArgs& a, int B, int limit) {
  switch (chunks(a.s.Dqk)) {
    case 1: return try_dq_tc<T, 1>(a, B, limit);
    case 2: return try_dq_tc<T, 2>(a, B, limit);
    case 3: return try_dq_tc<T, 3>(a, B, limit);
    default: return try_dq_tc<T, 4>(a, B, limit);
  }
}

template <class T, int NCQ, int NCV>
bool try_dkdv_tc(const BwdArgs& a, int B, int Hkv, int limit) {
  const int bytes = DkdvTcSmem(a.s, NCQ, NCV).bytes;
  if (bytes > limit) return false;
  auto kernel = dkdv_tc_kernel<T, NCQ, NCV>;
  allow_smem(kernel, size_t(bytes));
  const dim3 grid(unsigned((a.s.T + 63) / 64), unsigned(Hkv), unsigned(B));
  kernel<<<grid, kTcDkdvThreads, bytes, stream()>>>(a);
  DS_CUDA_LAUNCHED("attention backward (dk, dv, tensor cores)");
  return true;
}

// The (q/k, v) width pairs of dkdv().
template <class T>
bool dkdv_tc(const BwdArgs& a, int B, int Hkv, int limit) {
  const int ncq = chunks(a.s.Dqk), ncv = chunks(a.s.Dv);
  const int n = std::max(ncq, ncv);
  if (n == 1) return try_dkdv_tc<T, 1, 1>(a, B, Hkv, limit);
  if (n == 2) return try_dkdv_tc<T, 2, 2>(a, B, Hkv, limit);
  if (n == 3 && ncv <= 2) return try_dkdv_tc<T, 3, 2>(a, B, Hkv, limit);
  if (n == 3) return try_dkdv_tc<T, 3, 3>(a, B, Hkv, limit);
  return try_dkdv_tc<T, 4, 4>(a, B, Hkv, limit);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether the 16-bit kernels may read q, k and v rows of qkv in 16-byte pieces.
bool qkv_vec8(const Dims& d, const void* p) {
  return aligned16(p) && d.W % 8 == 0 && d.q_offset % 8 == 0 && d.k_offset % 8 == 0 && d.v_offset % 8 == 0 &&
         d.Dqk % 8 == 0 && d.Dv % 8 == 0;
}

}  // namespace

bool forward(MutPtr out, MutPtr lse, Ptr qkv, const Dims& d, float scale) {
  if (d.B == 0 || d.T == 0) return true;
  FwdArgs a{shape_of(d), qkv.p, qkv.e, out.p, out.e, lse.p, lse.e, scale, qkv_vec8(d, qkv.p)};
  const int limit = max_smem_bytes();
  const int B = int(d.B);
  // 16-bit q, k and v run on tensor cores.
  if (qkv.e == Elem::BF16 && forward_tc<__nv_bfloat16>(a, B, limit)) return true;
  if (qkv.e == Elem::F16 && forward_tc<__half>(a, B, limit)) return true;
  switch (chunks(d.Dv)) {
    case 1: return forward_nc<1>(a, B, limit);
    case 2: return forward_nc<2>(a, B, limit);
    case 3: return forward_nc<3>(a, B, limit);
    default: return forward_nc<4>(a, B, limit);
  }
}

int64_t backward_workspace(const Dims& d) { return d.B * d.H * d.T; }

bool backward(MutPtr dqkv, Ptr dout, Ptr qkv, Ptr out, Ptr lse, float* workspace, const Dims& d, float scale) {
  if (d.B == 0 || d.T == 0) return true;
  const int64_t rows = d.B * d.T * d.H;
  delta_kernel<<<blocks_for(rows, kWarps), kThreads, 0, stream()>>>(workspace, dout.p, dout.e, out.p, out.e, rows,
                                                                      int(d.T), d.H, d.Dv);
  DS_CUDA_LAUNCHED("attention backward (delta)");

  const bool dout_vec8 = aligned16(dout.p) && (int64_t(d.H) * d.Dv) % 8 == 0 && d.Dv % 8 == 0;
  BwdArgs a{shape_of(d), qkv.p, qkv.e, dout.p, dout.e, lse.p, lse.e, workspace, dqkv.p, dqkv.e, scale,
            qkv_vec8(d, qkv.p), dout_vec8};
  const int limit = max_smem_bytes();
  const int B = int(d.B);
  // 16-bit q, k, v and dout (of one type) run on tensor cores.
  const bool bf16 = qkv.e == Elem::BF16 && dout.e == Elem::BF16, f16 = qkv.e == Elem::F16 && dout.e == Elem::F16;
  const bool dkdv_done = (bf16 && dkdv_tc<__nv_bfloat16>(a, B, d.Hkv, limit)) ||
                         (f16 && dkdv_tc<__half>(a, B, d.Hkv, limit)) || dkdv(a, B, d.Hkv, limit);
  if (!dkdv_done) return false;
  if (bf16 && dq_tc<__nv_bfloat16>(a, B, limit)) return true;
  if (f16 && dq_tc<__half>(a, B, limit)) return true;
  switch (chunks(d.Dqk)) {
    case 1: return dq_nc<1>(a, B, limit);
    case 2: return dq_nc<2>(a, B, limit);
    case 3: return dq_nc<3>(a, B, limit);
    default: return dq_nc<4>(a, B, limit);
  }
}

}  // namespace dstrain::cuda::attn
