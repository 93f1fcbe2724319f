// The MoE kernels on the GPU: router scores, top-k routing, the load-balancing loss, the
// dispatch and capacity plans and the permutations between token and expert order. Each
// mirrors its CPU reference (backend/cpu/moe.cpp): the routing choices, the plans and every
// integer output are the CPU's exactly (the same fp32 comparisons and additions, the same
// stable orders); sums run in a fixed order, so results do not change from run to run.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "backend/cuda/elem.cuh"
#include "backend/cuda/moe_kernels.h"

namespace dstrain::cuda::moe {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpRows = 8;       // rows per block of the warp-per-row kernels (256 threads)
constexpr int kRowThreads = 256;   // threads per block of the block-per-row kernels
constexpr int kRouteThreads = 64;  // tokens per block of the thread-per-token routing
constexpr int kScanThreads = 1024;


// std::max(a, b) as the CPU computes it (a < b ? b : a), NaNs included.
__device__ __forceinline__ float max_of(float a, float b) { return a < b ? b : a; }

// Sum over the warp; every lane gets the same value (a + b == b + a at each step).
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024) in a fixed tree
// order; the result is valid in thread 0. `sh` holds 32 values.
template <class T>
__device__ T block_sum(T v, T* sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  v = warp_sum(v);
  __syncthreads();  // sh may still be read by a previous call
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  T total = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < warps; ++w) total += sh[w];
  }
  return total;
}

// The k largest of v(0..n) into idx/val[0..k) (best first; on equal values the lower index
// wins): the CPU's top_k, step for step, with the chosen values kept beside their indices.
template <class V>
__device__ void top_k(const V& v, int n, int k, int* idx, float* val) {
  int filled = 0;
  for (int i = 0; i < n; ++i) {
    const float x = v(i);
    if (filled == k && !(x > val[k - 1])) continue;
    int pos = filled < k ? filled++ : k - 1;
    // Strictly greater moves ahead: an equal earlier index keeps its place.
    while (pos > 0 && x > val[pos - 1]) {
      idx[pos] = idx[pos - 1];
      val[pos] = val[pos - 1];
      --pos;
    }
    idx[pos] = i;
    val[pos] = x;
  }
}

// ---- scores -----------------------------------------------------------------------------

// One warp per row. Every lane reads its elements before the row's reductions and writes them
// after, so scores may alias logits.
__global__ void scores_kernel(void* s, Elem es, const void* l, Elem el, int64_t N, int64_t E, bool sigmoid) {
  const int64_t n = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const int64_t row = n * E;
  if (sigmoid) {
    for (int64_t e = lane; e < E; e += 32) st(s, es, row + e, 1.0f / (1.0f + expf(-ld(l, el, row + e))));
    return;
  }
  float mx = ld(l, el, row);
  for (int64_t e = lane; e < E; e += 32) mx = max_of(mx, ld(l, el, row + e));
  for (int o = 16; o > 0; o >>= 1) mx = max_of(mx, __shfl_xor_sync(kFull, mx, o));
  mx = __shfl_sync(kFull, mx, 0);
  float z = 0;
  for (int64_t e = lane; e < E; e += 32) z += expf(ld(l, el, row + e) - mx);
  z = warp_sum(z);
  const float inv = 1.0f / z;
  for (int64_t e = lane; e < E; e += 32) st(s, es, row + e, expf(ld(l, el, row + e) - mx) * inv);
}

__global__ void scores_backward_kernel(void* dl, Elem edl, const void* ds, Elem eds, const void* s, Elem es, int64_t N,
                                       int64_t E, bool sigmoid) {
  const int64_t n = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const int64_t row = n * E;
  if (sigmoid) {
    for (int64_t e = lane; e < E; e += 32) {
      const float se = ld(s, es, row + e), dse = ld(ds, eds, row + e);
      const float a = dse * se;
      st(dl, edl, row + e, a * (1.0f - se));
    }
    return;
  }
  // softmax: dl = s * (ds - <ds, s>)
  double dot = 0;
  for (int64_t e = lane; e < E; e += 32) dot += double(ld(ds, eds, row + e)) * double(ld(s, es, row + e));
  dot = warp_sum(dot);
  for (int64_t e = lane; e < E; e += 32) {
    const double se = ld(s, es, row + e), dse = ld(ds, eds, row + e);
    st(dl, edl, row + e, float(se * (dse - dot)));
  }
}

// ---- routing ----------------------------------------------------------------------------

// One thread per token, the CPU's selection step for step on the same fp32 values.
__global__ void route_kernel(int32_t* ids, void* w, Elem ew, const void* s, Elem es, const void* b, Elem eb, int64_t N,
                             int E, RouteArgs a) {
  const int64_t n = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n >= N) return;
  const int64_t row = n * E;
  const bool noaux = a.method == 2;
  const int k = a.top_k;
  auto choice = [&](int e) {
    const float x = ld(s, es, row + e);
    return noaux ? x + ld(b, eb, e) : x;
  };
  // Without groups every expert is in the one kept "group" [0, E).
  int gs = E;
  unsigned long long keep = ~0ull;
  if (a.grouped) {
    const int G = a.n_group;
    gs = E / G;
    float group_score[kMaxGroups];
    for (int g = 0; g < G; ++g) {
      const int first = g * gs;
      if (a.method == 1) {
        float mx = choice(first);
        for (int i = 1; i < gs; ++i) mx = max_of(mx, choice(first + i));
        group_score[g] = mx;
      } else {
        int two[2];
        float best[2];
        top_k([&](int i) { return choice(first + i); }, gs, 2, two, best);
        group_score[g] = best[0] + best[1];
      }
    }
    int kept[kMaxGroups];
    float kept_score[kMaxGroups];
    top_k([&](int g) { return group_score[g]; }, G, a.topk_group, kept, kept_score);
    keep = 0;
    for (int j = 0; j < a.topk_group; ++j) keep |= 1ull << kept[j];
  }
  // Hugging Face masks the dropped groups with 0.0 (not -inf) before the final top-k.
  int sel[kMaxTopK];
  float sel_choice[kMaxTopK];
  top_k([&](int e) { return (keep >> (e / gs)) & 1ull ? choice(e) : 0.0f; }, E, k, sel, sel_choice);
  float wv[kMaxTopK];
  float sum = 0;
  for (int j = 0; j < k; ++j) {
    ids[n * k + j] = int32_t(sel[j]);
    wv[j] = ld(s, es, row + sel[j]);
    sum += wv[j];
  }
  if (a.normalised) {
    const float denom = sum + 1e-20f;
    for (int j = 0; j < k; ++j) wv[j] /= denom;
    if (noaux)
      for (int j = 0; j < k; ++j) wv[j] *= a.routed_scaling_factor;
  } else {
    for (int j = 0; j < k; ++j) wv[j] *= a.routed_scaling_factor;
  }
  for (int j = 0; j < k; ++j) st(w, ew, n * k + j, wv[j]);
}

// One warp per token: the row is zeroed by the warp, then lane 0 writes the chosen experts'
// gradients in slot order (as the CPU, a repeated id keeps the last slot's).
__global__ void route_backward_kernel(void* ds, Elem eds, const void* dw, Elem edw, const int32_t* ids, const void* s,
                                      Elem es, int64_t N, int64_t E, RouteArgs a) {
  const int64_t n = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const int64_t row = n * E;
  const int k = a.top_k;
  for (int64_t e = lane; e < E; e += 32) st(ds, eds, row + e, 0.0f);
  __syncwarp();
  if (lane != 0) return;
  const int32_t* id = ids + n * k;
  auto valid = [&](int32_t e) { return e >= 0 && e < E; };
  if (!a.normalised) {
    for (int j = 0; j < k; ++j) {
      if (valid(id[j])) st(ds, eds, row + id[j], ld(dw, edw, n * k + j) * a.routed_scaling_factor);
    }
    return;
  }
  // w_j = c * r_j / D with D = sum r + 1e-20: dr_j = c * (dw_j / D - <dw, r> / D^2).
  float sum = 0;
  double dot = 0;
  for (int j = 0; j < k; ++j) {
    const float r = valid(id[j]) ? ld(s, es, row + id[j]) : 0.0f;
    sum += r;
    dot += double(ld(dw, edw, n * k + j)) * double(r);
  }
  const double D = double(sum + 1e-20f), c = a.method == 2 ? double(a.routed_scaling_factor) : 1.0;
  for (int j = 0; j < k; ++j) {
    if (valid(id[j])) st(ds, eds, row + id[j], float(c * (double(ld(dw, edw, n * k + j)) / D - dot / (D * D))));
  }
}

// ---- load-balancing loss ----------------------------------------------------------------

// affinity[t] = 1 / (sum_e scores[t,e] + 1e-20), one warp per token.
__global__ void affinity_kernel(double* affinity, const void* s, Elem es, int64_t N, int64_t E) {
  const int64_t n = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  double sum = 0;
  for (int64_t e = lane; e < E; e += 32) sum += ld(s, es, n * E + e);
  sum = warp_sum(sum);
  if (lane == 0) affinity[n] = 1.0 / (sum + 1e-20);
}

// counts (G,E): how often each expert is among each group's ids (integers: any order).
__global__ void aux_count_kernel(int32_t* counts, const int32_t* ids, int64_t N, int64_t E, int64_t Tg, int64_t k) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= N * k) return;
  const int32_t e = ids[i];
  if (e >= 0 && e < E) atomicAdd(&counts[(i / k / Tg) * E + e], 1);
}

// partial (G, chunks, E): one block per chunk of kAuxChunk tokens of a group, a thread per
// expert summing a[t] * scores[t,e] over the chunk's tokens in order.
__global__ void aux_partial_kernel(double* partial, const void* s, Elem es, const double* affinity, int64_t E,
                                   int64_t Tg, int64_t chunks) {
  const int64_t g = blockIdx.x / chunks, c = blockIdx.x % chunks;
  const int64_t t0 = g * Tg + c * kAuxChunk;
  const int64_t t1 = t0 + kAuxChunk < (g + 1) * Tg ? t0 + kAuxChunk : (g + 1) * Tg;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    double P = 0;
    for (int64_t t = t0; t < t1; ++t) {
      const double a = affinity ? affinity[t] : 1.0;
      P += a * double(ld(s, es, t * E + e));
    }
    partial[blockIdx.x * E + e] = P;
  }
}

// One block per group: P over the chunks in order, coef, and the group's term of the loss
// (sum over experts in a fixed tree order) into part[g].
__global__ void aux_group_kernel(double* part, void* coef, Elem ec, const double* partial, const int32_t* counts,
                                 int64_t E, int64_t Tg, int64_t k, int64_t chunks) {
  __shared__ double sh[32];
  const int64_t g = blockIdx.x;
  double aux = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    double P = 0;
    for (int64_t c = 0; c < chunks; ++c) P += partial[(g * chunks + c) * E + e];
    const double ce = double(counts[g * E + e]) * double(E) / double(Tg * k);
    aux += ce * P / double(Tg);
    st(coef, ec, g * E + e, float(ce / double(Tg)));
  }
  aux = block_sum(aux, sh);
  if (threadIdx.x == 0) part[g] = aux;
}

__global__ void aux_total_kernel(double* aux, const double* part, int64_t G) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  double total = 0;
  for (int64_t g = 0; g < G; ++g) total += part[g];
  *aux = total;
}

// One warp per token.
__global__ void aux_backward_kernel(void* d, Elem ed, const void* coef, Elem ec, const void* s, Elem es, int64_t N,
                                    int64_t E, int64_t Tg, bool sigmoid, float scale) {
  const int64_t n = int64_t(blockIdx.x) * kWarpRows + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (n >= N) return;
  const int64_t row = n * E, crow = (n / Tg) * E;
  if (!sigmoid) {
    for (int64_t e = lane; e < E; e += 32) st(d, ed, row + e, ld(d, ed, row + e) + scale * ld(coef, ec, crow + e));
    return;
  }
  // a_e = s_e / S: d aux / d s_i = (c_i - sum_e c_e a_e) / S, the sum through S.
  double sum = 0;
  for (int64_t e = lane; e < E; e += 32) sum += ld(s, es, row + e);
  const double inv = 1.0 / (warp_sum(sum) + 1e-20);
  double ca = 0;
  for (int64_t e = lane; e < E; e += 32) ca += double(ld(coef, ec, crow + e)) * double(ld(s, es, row + e)) * inv;
  ca = warp_sum(ca);
  for (int64_t e = lane; e < E; e += 32) {
    const float v = float(double(scale) * (double(ld(coef, ec, crow + e)) - ca) * inv);
    st(d, ed, row + e, ld(d, ed, row + e) + v);
  }
}

// ---- dispatch plan: a stable counting sort by expert ------------------------------------

// counts (chunks, E): each chunk's count per expert; the first id out of range into *bad.
__global__ void plan_count_kernel(int32_t* counts, unsigned long long* bad, const int32_t* ids, int64_t M, int64_t E) {
  const int64_t i = int64_t(blockIdx.x) * kPlanChunk + threadIdx.x;
  if (i >= M) return;
  const int32_t e = ids[i];
  if (e < 0 || e >= E) {
    atomicMin(bad, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(e));
    return;
  }
  atomicAdd(&counts[blockIdx.x * E + e], 1);
}

// One block: offsets (E+1) = the exclusive prefix sum of the experts' totals, and each chunk's
// first row for each expert (offsets[e] + the counts of the chunks before it) in place of its
// count. Thread t owns a contiguous run of experts.
__global__ void plan_scan_kernel(int64_t* offsets, int32_t* counts, int64_t chunks, int64_t E) {
  __shared__ long long sums[kScanThreads];
  const int64_t per = (E + kScanThreads - 1) / kScanThreads;
  const int64_t lo = threadIdx.x * per < E ? threadIdx.x * per : E;
  const int64_t hi = lo + per < E ? lo + per : E;
  long long mine = 0;
  for (int64_t e = lo; e < hi; ++e)
    for (int64_t c = 0; c < chunks; ++c) mine += counts[c * E + e];
  sums[threadIdx.x] = mine;
  __syncthreads();
  for (int o = 1; o < kScanThreads; o <<= 1) {  // inclusive scan (Hillis-Steele)
    const long long v = threadIdx.x >= o ? sums[threadIdx.x - o] : 0;
    __syncthreads();
    sums[threadIdx.x] += v;
    __syncthreads();
  }
  long long run = sums[threadIdx.x] - mine;
  for (int64_t e = lo; e < hi; ++e) {
    offsets[e] = run;
    for (int64_t c = 0; c < chunks; ++c) {
      const int32_t n = counts[c * E + e];
      counts[c * E + e] = int32_t(run);
      run += n;
    }
  }
  if (threadIdx.x == 0) offsets[E] = sums[kScanThreads - 1];
}

// One warp per chunk, 32 ids at a time in order: lanes with the same expert take consecutive
// rows in lane order from the chunk's cursor of that expert, which the lowest of them advances.
// Within an expert the rows thus follow the pair order n*k + slot: the CPU's stable order.
__global__ void plan_scatter_kernel(int32_t* sorted, int32_t* position, int32_t* cursors, const int32_t* ids,
                                    int64_t M, int64_t E) {
  volatile int32_t* cur = cursors + blockIdx.x * E;
  const int lane = threadIdx.x;
  const unsigned below = (1u << lane) - 1;
  const int64_t first = int64_t(blockIdx.x) * kPlanChunk;
  const int64_t last = first + kPlanChunk < M ? first + kPlanChunk : M;
  for (int64_t base = first; base < last; base += 32) {
    const int64_t i = base + lane;
    const bool valid = i < last;
    const int32_t e = valid ? ids[i] : -1;
    const unsigned same = __match_any_sync(kFull, e);
    int32_t p = 0;
    if (valid) {
      p = cur[e] + __popc(same & below);
      sorted[p] = int32_t(i);
      position[i] = p;
    }
    __syncwarp();
    if (valid && (same & below) == 0) cur[e] = cur[e] + __popc(same);
    __syncwarp();
  }
}

// ---- capacity plan ----------------------------------------------------------------------

__device__ __forceinline__ float weight_of(const int32_t* from_sorted, int64_t r, const void* w, Elem ew, int64_t M) {
  const int32_t pair = from_sorted[r];
  return pair >= 0 && pair < M ? ld(w, ew, pair) : 0.0f;
}

// Probs policy: keep[row] = whether the row's place in its expert's rows stably sorted by
// descending weight (equal weights: the earlier row first, as std::stable_sort leaves them) is
// below capacity. Block (e, tile): 256 rows of expert e against all of its rows.
__global__ void capacity_rank_kernel(uint8_t* keep, const int32_t* from_sorted, const int64_t* offsets, const void* w,
                                     Elem ew, int64_t M, int64_t capacity) {
  __shared__ float tile[kRowThreads];
  const int64_t begin = offsets[blockIdx.x], n = offsets[blockIdx.x + 1] - begin;
  if (n <= capacity) return;
  for (int64_t t0 = int64_t(blockIdx.y) * kRowThreads; t0 < n; t0 += int64_t(gridDim.y) * kRowThreads) {
    const int64_t i = t0 + threadIdx.x;
    const float wi = i < n ? weight_of(from_sorted, begin + i, w, ew, M) : 0.0f;
    int64_t rank = 0;
    for (int64_t j0 = 0; j0 < n; j0 += kRowThreads) {
      const int64_t j = j0 + threadIdx.x;
      tile[threadIdx.x] = j < n ? weight_of(from_sorted, begin + j, w, ew, M) : 0.0f;
      __syncthreads();
      const int m = n - j0 < kRowThreads ? int(n - j0) : kRowThreads;
      for (int jj = 0; jj < m; ++jj) {
        const float wj = tile[jj];
        rank += (wj > wi || (wj == wi && j0 + jj < i)) ? 1 : 0;
      }
      __syncthreads();
    }
    if (i < n) keep[begin + i] = rank < capacity ? 1 : 0;
  }
}

// One block per expert: its kept rows, in row (token) order, close up from kept[e]; a dropped
// pair's position becomes -1.
__global__ void capacity_compact_kernel(int32_t* sorted, int32_t* position, const int32_t* from_sorted,
                                        const uint8_t* keep, const int64_t* kept, const int64_t* offsets, int64_t M,
                                        int64_t capacity, bool probs) {
  __shared__ int warp_count[kRowThreads / 32];
  const int64_t begin = offsets[blockIdx.x], n = offsets[blockIdx.x + 1] - begin;
  const bool over = n > capacity;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int64_t at = kept[blockIdx.x];
  for (int64_t t0 = 0; t0 < n; t0 += kRowThreads) {
    const int64_t i = t0 + threadIdx.x;
    const bool in = i < n;
    const bool k = in && (!over || (probs ? keep[begin + i] != 0 : i < capacity));
    const unsigned ballot = __ballot_sync(kFull, k);
    if (lane == 0) warp_count[warp] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & ((1u << lane) - 1)), total = 0;
    for (int w = 0; w < kRowThreads / 32; ++w) {
      if (w < warp) before += warp_count[w];
      total += warp_count[w];
    }
    if (in) {
      const int32_t pair = from_sorted[begin + i];
      const bool ok = pair >= 0 && pair < M;
      if (k) {
        const int64_t p = at + before;
        sorted[p] = pair;
        if (ok) position[pair] = int32_t(p);
      } else if (ok) {
        position[pair] = -1;
      }
    }
    at += total;
    __syncthreads();  // warp_count is rewritten by the next tile
  }
}

// ---- permutations -----------------------------------------------------------------------

// One block per grouped row.
__global__ void permute_kernel(void* xg, Elem eg, const void* x, Elem ex, const int32_t* sorted, int64_t N, int64_t C,
                               int top_k) {
  const int64_t p = blockIdx.x;
  const int64_t src = sorted[p] / top_k;
  if (src < 0 || src >= N) return;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) st(xg, eg, p * C + c, ld(x, ex, src * C + c));
}

// The same for rows of one element type whose size is a multiple of 16 bytes: a copy.
__global__ void permute_copy_kernel(uint4* xg, const uint4* x, const int32_t* sorted, int64_t N, int64_t W, int top_k) {
  const int64_t p = blockIdx.x;
  const int64_t src = sorted[p] / top_k;
  if (src < 0 || src >= N) return;
  for (int64_t c = threadIdx.x; c < W; c += blockDim.x) xg[p * W + c] = x[src * W + c];
}

// One block per token.
__global__ void permute_backward_kernel(void* dx, Elem edx, const void* dxg, Elem eg, const int32_t* position,
                                        int64_t k, int64_t R, int64_t C, bool accumulate) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float d = accumulate ? ld(dx, edx, n * C + c) : 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = position[n * k + j];
      if (p < 0 || p >= R) continue;  // dropped
      d += ld(dxg, eg, p * C + c);
    }
    st(dx, edx, n * C + c, d);
  }
}

// One block per token: the routed sum first, then onto out (the order Hugging Face adds them in).
__global__ void unpermute_kernel(void* out, Elem eo, const void* yg, Elem ey, const void* w, Elem ew,
                                 const int32_t* position, int64_t k, int64_t R, int64_t C) {
  const int64_t n = blockIdx.x;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    float a = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t p = position[n * k + j];
      if (p < 0 || p >= R) continue;  // dropped
      a += ld(w, ew, n * k + j) * ld(yg, ey, p * C + c);
    }
    st(out, eo, n * C + c, ld(out, eo, n * C + c) + a);
  }
}

// One block per grouped row: dyg = w * dout row, dweights[pair] = <dout row, yg row>.
__global__ void unpermute_backward_kernel(void* dyg, Elem edy, void* dw, Elem edw, const void* dout, Elem edo,
                                          const void* yg, Elem ey, const void* w, Elem ew, const int32_t* sorted,
                                          int64_t k, int64_t M, int64_t C) {
  __shared__ float sh[32];
  const int64_t p = blockIdx.x;
  const int64_t pair = sorted[p];
  if (pair < 0 || pair >= M) return;
  const int64_t drow = (pair / k) * C;
  const float wp = ld(w, ew, pair);
  float dot = 0;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = ld(dout, edo, drow + c);
    st(dyg, edy, p * C + c, wp * d);
    dot += d * ld(yg, ey, p * C + c);
  }
  dot = block_sum(dot, sh);
  if (threadIdx.x == 0) st(dw, edw, pair, dot);
}

// ---- bias update ------------------------------------------------------------------------

__global__ void bias_update_kernel(void* b, Elem eb, const int64_t* counts, int64_t E, float gamma) {
  __shared__ long long sh[32];
  __shared__ long long total_sh;
  long long mine = 0;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) mine += counts[e];
  mine = block_sum(mine, sh);
  if (threadIdx.x == 0) total_sh = mine;
  __syncthreads();
  const long long total = total_sh;
  for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
    // counts[e] against mean = total / E, compared exactly in integers.
    const long long lhs = counts[e] * E;
    if (lhs < total) st(b, eb, e, ld(b, eb, e) + gamma);
    if (lhs > total) st(b, eb, e, ld(b, eb, e) - gamma);
  }
}

unsigned warp_row_blocks(int64_t rows) { return blocks_for(rows, kWarpRows); }

}  // namespace

// ---- launches ---------------------------------------------------------------------------

void scores(void* s, Elem es, const void* logits, Elem el, int64_t N, int64_t E, bool sigmoid) {
  if (N == 0) return;
  scores_kernel<<<warp_row_blocks(N), kWarpRows * 32, 0, stream()>>>(s, es, logits, el, N, E, sigmoid);
  DS_CUDA_LAUNCHED("moe_scores");
}

void scores_backward(void* dlogits, Elem edl, const void* dscores, Elem eds, const void* s, Elem es, int64_t N,
                     int64_t E, bool sigmoid) {
  if (N == 0) return;
  scores_backward_kernel<<<warp_row_blocks(N), kWarpRows * 32, 0, stream()>>>(dlogits, edl, dscores, eds, s, es, N, E,
                                                                              sigmoid);
  DS_CUDA_LAUNCHED("moe_scores_backward");
}

void route(int32_t* ids, void* weights, Elem ew, const void* s, Elem es, const void* bias, Elem eb, int64_t N, int E,
           const RouteArgs& a) {
  if (N == 0) return;
  route_kernel<<<blocks_for(N, kRouteThreads), kRouteThreads, 0, stream()>>>(ids, weights, ew, s, es, bias, eb, N, E,
                                                                             a);
  DS_CUDA_LAUNCHED("moe_route");
}

void route_backward(void* dscores, Elem eds, const void* dweights, Elem edw, const int32_t* ids, const void* s,
                    Elem es, int64_t N, int64_t E, const RouteArgs& a) {
  if (N == 0) return;
  route_backward_kernel<<<warp_row_blocks(N), kWarpRows * 32, 0, stream()>>>(dscores, eds, dweights, edw, ids, s, es,
                                                                             N, E, a);
  DS_CUDA_LAUNCHED("moe_route_backward");
}

void aux_loss(double* aux, void* coef, Elem ec, const void* s, Elem es, const int32_t* ids, int64_t N, int64_t E,
              int64_t G, int64_t k, bool sigmoid, const AuxScratch& scratch) {
  const int64_t Tg = N / G, chunks = aux_chunks(Tg);
  if (sigmoid && N > 0) {
    affinity_kernel<<<warp_row_blocks(N), kWarpRows * 32, 0, stream()>>>(scratch.affinity, s, es, N, E);
    DS_CUDA_LAUNCHED("moe_aux_loss");
  }
  if (N * k > 0) {
    aux_count_kernel<<<blocks_for(N * k, kRowThreads), kRowThreads, 0, stream()>>>(scratch.counts, ids, N, E, Tg, k);
    DS_CUDA_LAUNCHED("moe_aux_loss");
  }
  if (G * chunks > 0) {
    aux_partial_kernel<<<blocks_for(G * chunks, 1), kRowThreads, 0, stream()>>>(
        scratch.partial, s, es, sigmoid ? scratch.affinity : nullptr, E, Tg, chunks);
    DS_CUDA_LAUNCHED("moe_aux_loss");
  }
  aux_group_kernel<<<blocks_for(G, 1), kRowThreads, 0, stream()>>>(scratch.part, coef, ec, scratch.partial,
                                                                   scratch.counts, E, Tg, k, chunks);
  DS_CUDA_LAUNCHED("moe_aux_loss");
  aux_total_kernel<<<1, 32, 0, stream()>>>(aux, scratch.part, G);
  DS_CUDA_LAUNCHED("moe_aux_loss");
}

void aux_loss_backward(void* dscores, Elem ed, const void* coef, Elem ec, const void* s, Elem es, int64_t N, int64_t E,
                       int64_t G, bool sigmoid, float scale) {
  if (N == 0) return;
  aux_backward_kernel<<<warp_row_blocks(N), kWarpRows * 32, 0, stream()>>>(dscores, ed, coef, ec, s, es, N, E, N / G,
                                                                           sigmoid, scale);
  DS_CUDA_LAUNCHED("moe_aux_loss_backward");
}

void plan_count(int32_t* counts, unsigned long long* bad, const int32_t* ids, int64_t M, int64_t E) {
  if (M == 0) return;
  plan_count_kernel<<<blocks_for(plan_chunks(M), 1), kPlanChunk, 0, stream()>>>(counts, bad, ids, M, E);
  DS_CUDA_LAUNCHED("moe_dispatch_plan");
}

void plan_place(int64_t* offsets, int32_t* sorted, int32_t* position, int32_t* counts, const int32_t* ids, int64_t M,
                int64_t E) {
  const int64_t chunks = plan_chunks(M);
  plan_scan_kernel<<<1, kScanThreads, 0, stream()>>>(offsets, counts, chunks, E);
  DS_CUDA_LAUNCHED("moe_dispatch_plan");
  if (chunks == 0) return;
  plan_scatter_kernel<<<blocks_for(chunks, 1), 32, 0, stream()>>>(sorted, position, counts, ids, M, E);
  DS_CUDA_LAUNCHED("moe_dispatch_plan");
}

void capacity_plan(int32_t* sorted, int32_t* position, const int32_t* from_sorted, uint8_t* keep,
                   const int64_t* kept, const int64_t* offsets, const void* weights, Elem ew, int64_t M, int64_t E,
                   int64_t capacity, bool prob_rank, int64_t max_rows) {
  if (prob_rank) {
    const int64_t tiles = (max_rows + kRowThreads - 1) / kRowThreads;
    const dim3 grid(unsigned(E), unsigned(tiles < 65535 ? tiles : 65535));
    capacity_rank_kernel<<<grid, kRowThreads, 0, stream()>>>(keep, from_sorted, offsets, weights, ew, M, capacity);
    DS_CUDA_LAUNCHED("moe_capacity_plan");
  }
  capacity_compact_kernel<<<unsigned(E), kRowThreads, 0, stream()>>>(sorted, position, from_sorted, keep, kept, offsets,
                                                                     M, capacity, prob_rank);
  DS_CUDA_LAUNCHED("moe_capacity_plan");
}

void permute(void* xg, Elem eg, const void* x, Elem ex, const int32_t* sorted, int64_t R, int64_t N, int64_t C,
             int top_k) {
  if (R == 0 || C == 0) return;
  const int64_t bytes = C * (ex == Elem::F32 ? 4 : 2);
  const bool aligned = (reinterpret_cast<uintptr_t>(xg) | reinterpret_cast<uintptr_t>(x)) % 16 == 0;
  if (eg == ex && bytes % 16 == 0 && aligned) {
    const int64_t W = bytes / 16;
    permute_copy_kernel<<<unsigned(R), W < kRowThreads ? 32 * unsigned((W + 31) / 32) : kRowThreads, 0, stream()>>>(
        static_cast<uint4*>(xg), static_cast<const uint4*>(x), sorted, N, W, top_k);
  } else {
    permute_kernel<<<unsigned(R), kRowThreads, 0, stream()>>>(xg, eg, x, ex, sorted, N, C, top_k);
  }
  DS_CUDA_LAUNCHED("moe_permute");
}

void permute_backward(void* dx, Elem edx, const void* dxg, Elem eg, const int32_t* position, int64_t N, int64_t k,
                      int64_t R, int64_t C, bool accumulate) {
  if (N == 0 || C == 0) return;
  permute_backward_kernel<<<unsigned(N), kRowThreads, 0, stream()>>>(dx, edx, dxg, eg, position, k, R, C, accumulate);
  DS_CUDA_LAUNCHED("moe_permute_backward");
}

void unpermute(void* out, Elem eo, const void* yg, Elem ey, const void* weights, Elem ew, const int32_t* position,
               int64_t N, int64_t k, int64_t R, int64_t C) {
  if (N == 0 || C == 0) return;
  unpermute_kernel<<<unsigned(N), kRowThreads, 0, stream()>>>(out, eo, yg, ey, weights, ew, position, k, R, C);
  DS_CUDA_LAUNCHED("moe_unpermute");
}

void unpermute_backward(void* dyg, Elem edy, void* dweights, Elem edw, const void* dout, Elem edo, const void* yg,
                        Elem ey, const void* weights, Elem ew, const int32_t* sorted, int64_t N, int64_t k, int64_t R,
                        int64_t C) {
  const int64_t M = N * k;
  // The dropped pairs' weights had no effect; zero bits are 0.0 in every element type.
  if (R < M) DS_CUDA_CHECK(cudaMemsetAsync(dweights, 0, size_t(M) * (edw == Elem::F32 ? 4 : 2), stream()));
  if (R == 0) return;
  unpermute_backward_kernel<<<unsigned(R), kRowThreads, 0, stream()>>>(dyg, edy, dweights, edw, dout, edo, yg, ey,
                                                                       weights, ew, sorted, k, M, C);
  DS_CUDA_LAUNCHED("moe_unpermute_backward");
}

void bias_update(void* bias, Elem eb, const int64_t* tokens_per_expert, int64_t E, float gamma) {
  if (E == 0) return;
  bias_update_kernel<<<1, kRowThreads, 0, stream()>>>(bias, eb, tokens_per_expert, E, gamma);
  DS_CUDA_LAUNCHED("moe_bias_update");
}

}  // namespace dstrain::cuda::moe
