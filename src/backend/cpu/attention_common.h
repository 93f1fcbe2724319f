// What the fp32 attention kernel (attention.cpp) and its 16-bit form (attention_16bit.cpp) share:
// the layout checks, the task loop and the softmax rows, so that both compute the same bits.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu::attn {

constexpr int64_t kQueryBlock = 64;

struct Dims {
  int64_t B, T, W, H, Hkv, Dqk, Dv, group;
};

inline Dims dims_of(const Tensor& qkv, const ops::AttentionLayout& L) {
  Dims d{qkv.size(0), qkv.size(1), qkv.size(2), L.n_head, L.n_kv_head, L.qk_dim, L.v_dim, L.n_head / L.n_kv_head};
  return d;
}

// Runs body(task) for task in [0, n): across threads when there are enough tasks, otherwise
// one after another so that each sgemm inside can use every thread.
template <class F>
inline void for_tasks(int64_t n, F&& body) {
  if (n >= omp_get_max_threads()) {
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

// The causal structure of a query block's products (query rows [t0, t0 + nq) against keys
// [0, nk), row i seeing keys <= t0 + i), in strips of the block products' register tile
// (block_products.h), so that the products leave out what the mask makes zero and nothing else.
constexpr int64_t kStrip = 6;
// Products over keys: f(i0, rows, keys) for query strips [i0, i0 + rows), which need the keys
// below `keys` only.
template <class F>
inline void query_strips(int64_t nq, int64_t nk, int64_t t0, F&& f) {
  for (int64_t i0 = 0; i0 < nq; i0 += kStrip) {
    const int64_t r = std::min(kStrip, nq - i0);
    f(i0, r, std::min(nk, t0 + i0 + r));
  }
}
// Products over the block's queries, one row per key: f(j, rows, first_query) for key rows
// [j, j + rows), which need the queries from first_query on (keys before t0 need them all).
template <class F>
inline void key_strips(int64_t nk, int64_t t0, F&& f) {
  f(0, t0, 0);
  for (int64_t j0 = 0; t0 + j0 < nk; j0 += kStrip) f(t0 + j0, std::min(kStrip, nk - t0 - j0), j0);
}

// Turns scores s (nq, nk; row i may see keys <= t0 + i) into probabilities, computing the
// log-sum-exp of each row into lse_out, or from the stored one. Masked entries become 0.
void causal_softmax_rows(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out);
void probabilities_from_lse(float* s, int64_t nq, int64_t nk, int64_t t0, const float* lse);
// Turns probabilities s (nq, nk) into dS = P * (dP - rowsum(dO * O)) in place, from dP (nq, nk)
// and the block's rows of dO (leading dimension ldd) and O (ldo), each dv wide; masked entries
// stay as they are (0).
void score_grads_rows(float* s, const float* dp, int64_t nq, int64_t nk, int64_t t0, const float* dO, int64_t ldd,
                      const float* o, int64_t ldo, int64_t dv);

}  // namespace dstrain::cpu::attn
