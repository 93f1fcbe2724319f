// Causal grouped-query attention on the CPU, FlashAttention-style in memory: for a block of
// queries the scores against all earlier keys are formed (block_products.h's fp32 tile on
// AVX-512 CPUs, sgemm elsewhere) in a per-thread scratch of (block, T) floats, softmaxed, and
// multiplied by V. Only the output and the
// row log-sum-exp are kept; the backward recomputes the probabilities from them. Memory
// therefore grows with T, never with T^2 per head.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/attention_common.h"
#include "backend/cpu/block_products.h"
#include "backend/cpu/sgemm.h"
#include "backend/cpu/vec_exp.h"

namespace dstrain::cpu {
namespace {

// Turns scores s (nq, nk; row i may see keys <= t0 + i) into probabilities with the stored
// or computed log-sum-exp. Masked entries become 0. exp is vec_exp.h's, the same bits in the
// vector loops and their scalar tails; sums run in eight lanes, then across them in a fixed order.
DS_TARGET_AVX2 void causal_softmax_rows_avx2(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out) {
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1, v8 = valid & ~int64_t(7);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < v8; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(row + j));
    float mx = hmax8(m);
    for (int64_t j = v8; j < valid; ++j) mx = std::max(mx, row[j]);
    const __m256 mx8 = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < v8; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), mx8));
      _mm256_storeu_ps(row + j, e);
      acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (int64_t j = v8; j < valid; ++j) {
      row[j] = exp1(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    const __m256 inv8 = _mm256_set1_ps(inv);
    for (int64_t j = 0; j < v8; j += 8) _mm256_storeu_ps(row + j, _mm256_mul_ps(_mm256_loadu_ps(row + j), inv8));
    for (int64_t j = v8; j < valid; ++j) row[j] *= inv;
    for (int64_t j = valid; j < nk; ++j) row[j] = 0.0f;
    lse_out[i] = mx + std::log(sum);
  }
}

// The same arithmetic one lane at a time (CPUs without AVX2): eight partial sums, combined as
// hsum8 combines them.
void causal_softmax_rows_scalar(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out) {
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1, v8 = valid & ~int64_t(7);
    float mx = -INFINITY;
    for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, row[j]);
    float lane[8] = {};
    for (int64_t j = 0; j < v8; ++j) {
      row[j] = exp1(row[j] - mx);
      lane[j % 8] += row[j];
    }
    float sum = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
    for (int64_t j = v8; j < valid; ++j) {
      row[j] = exp1(row[j] - mx);
      sum += row[j];
    }
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < valid; ++j) row[j] *= inv;
    for (int64_t j = valid; j < nk; ++j) row[j] = 0.0f;
    lse_out[i] = mx + std::log(sum);
  }
}

void causal_softmax_rows_impl(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out) {
  if (cpu_has_avx2()) {
    causal_softmax_rows_avx2(s, nq, nk, t0, lse_out);
  } else {
    causal_softmax_rows_scalar(s, nq, nk, t0, lse_out);
  }
}

DS_TARGET_AVX2 void probabilities_from_lse_avx2(float* s, int64_t nq, int64_t nk, int64_t t0, const float* lse) {
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1, v8 = valid & ~int64_t(7);
    const float l = lse[i];
    const __m256 l8 = _mm256_set1_ps(l);
    for (int64_t j = 0; j < v8; j += 8) _mm256_storeu_ps(row + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), l8)));
    for (int64_t j = v8; j < valid; ++j) row[j] = exp1(row[j] - l);
    for (int64_t j = valid; j < nk; ++j) row[j] = 0.0f;
  }
}

void probabilities_from_lse_impl(float* s, int64_t nq, int64_t nk, int64_t t0, const float* lse) {
  if (cpu_has_avx2()) {
    probabilities_from_lse_avx2(s, nq, nk, t0, lse);
    return;
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1;
    const float l = lse[i];
    for (int64_t j = 0; j < valid; ++j) row[j] = exp1(row[j] - l);
    for (int64_t j = valid; j < nk; ++j) row[j] = 0.0f;
  }
}

}  // namespace

namespace attn {
void causal_softmax_rows(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out) {
  causal_softmax_rows_impl(s, nq, nk, t0, lse_out);
}
void probabilities_from_lse(float* s, int64_t nq, int64_t nk, int64_t t0, const float* lse) {
  probabilities_from_lse_impl(s, nq, nk, t0, lse);
}
void score_grads_rows(float* s, const float* dp, int64_t nq, int64_t nk, int64_t t0, const float* dO, int64_t ldd,
                      const float* o, int64_t ldo, int64_t dv) {
  for (int64_t i = 0; i < nq; ++i) {
    float delta = 0;
    for (int64_t e = 0; e < dv; ++e) delta += dO[i * ldd + e] * o[i * ldo + e];
    float* srow = s + i * nk;
    const float* dprow = dp + i * nk;
    const int64_t valid = t0 + i + 1;
#pragma omp simd
    for (int64_t j = 0; j < valid; ++j) srow[j] = srow[j] * (dprow[j] - delta);
  }
}
}  // namespace attn
using namespace attn;

namespace {
// ---- block products (AVX-512F) -----------------------------------------------------------------
// On CPUs with AVX-512 the block products run on block_products.h's fp32 kernel on the task's
// thread instead of sgemm calls (a few thousand per layer and step, each as costly to set up as
// its arithmetic), skipping what the causal mask zeroes (attention_common.h's strips). The tasks,
// the softmax and the order of the work are the same; each output is one fp32 FMA chain in k order.
f32x::MatA rows_at(const float* p, int64_t ld) { return {p, ld, 1}; }
// A row-major (rows, cols) matrix read as its transpose.
f32x::MatA transposed(const float* p, int64_t ld) { return {p, 1, ld}; }
f32x::MatA shifted(f32x::MatA a, int64_t row, int64_t col) {
  return {a.p + row * a.row_stride + col * a.col_stride, a.row_stride, a.col_stride};
}

// C (nq, nk) = alpha A B over keys (B: kdim rows of the keys' values).
void causal_keys(int64_t nq, int64_t nk, int64_t t0, int64_t kdim, f32x::MatA a, const float* b, int64_t ldb,
                 float alpha, float* c, int64_t ldc) {
  query_strips(nq, nk, t0, [&](int64_t i0, int64_t r, int64_t keys) {
    f32x::product(r, keys, kdim, shifted(a, i0, 0), b, ldb, alpha, false, c + i0 * ldc, ldc);
  });
}
// C (nq, n) = alpha A B, a sum over keys.
void causal_key_sum(int64_t nq, int64_t n, int64_t nk, int64_t t0, f32x::MatA a, const float* b, int64_t ldb,
                    float alpha, float* c, int64_t ldc) {
  query_strips(nq, nk, t0, [&](int64_t i0, int64_t r, int64_t keys) {
    f32x::product(r, n, keys, shifted(a, i0, 0), b, ldb, alpha, false, c + i0 * ldc, ldc);
  });
}
// C (nk, n) += alpha A B, a sum over the block's nq queries for each key row.
void causal_query_sum(int64_t nk, int64_t n, int64_t nq, int64_t t0, f32x::MatA a, const float* b, int64_t ldb,
                      float alpha, float* c, int64_t ldc) {
  key_strips(nk, t0, [&](int64_t j, int64_t r, int64_t q0) {
    f32x::product(r, n, nq - q0, shifted(a, j, q0), b + q0 * ldb, ldb, alpha, true, c + j * ldc, ldc);
  });
}

void forward_block_products(float* op, float* lp, const float* base, const ops::AttentionLayout& L, const Dims& d,
                            float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  // K^T of every (batch, kv head): the B of Q K^T.
  thread_local std::vector<float> k_packs;
  const int64_t k_size = d.Dqk * d.T;
  if (k_packs.size() < size_t(d.B * d.Hkv * k_size)) k_packs.resize(size_t(d.B * d.Hkv * k_size));
  float* kt_all = k_packs.data();
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    f32x::pack_transposed(kt_all + task * k_size, d.T, base + b * d.T * d.W + L.k_offset + g * d.Dqk, d.W, d.T, d.Dqk);
  });
  for_tasks(d.B * d.H * nblocks, [&](int64_t task) {
    thread_local std::vector<float> scratch;
    const int64_t qb = task % nblocks, h = (task / nblocks) % d.H, b = task / (nblocks * d.H);
    const int64_t g = h / d.group;
    const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
    if (scratch.size() < size_t(nq * nk)) scratch.resize(size_t(nq * nk));
    const float* q = base + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
    const float* v = base + b * d.T * d.W + L.v_offset + g * d.Dv;
    float* s = scratch.data();
    causal_keys(nq, nk, t0, d.Dqk, rows_at(q, d.W), kt_all + (b * d.Hkv + g) * k_size, d.T, scale, s, nk);
    causal_softmax_rows(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
    causal_key_sum(nq, d.Dv, nk, t0, rows_at(s, nk), v, d.W, 1.0f, op + (b * d.T + t0) * ldo + h * d.Dv, ldo);
  });
}

void backward_block_products(float* dbase, const float* dop, const float* op, const float* base, const float* lp,
                             const ops::AttentionLayout& L, const Dims& d, float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    thread_local std::vector<float> s_buf, dp_buf, kt_buf, vt_buf;
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    const float* k = base + b * d.T * d.W + L.k_offset + g * d.Dqk;
    const float* v = base + b * d.T * d.W + L.v_offset + g * d.Dv;
    float* dk = dbase + b * d.T * d.W + L.k_offset + g * d.Dqk;
    float* dv = dbase + b * d.T * d.W + L.v_offset + g * d.Dv;
    // K^T and V^T: the B of Q K^T and of dO V^T.
    if (kt_buf.size() < size_t(d.Dqk * d.T)) kt_buf.resize(size_t(d.Dqk * d.T));
    if (vt_buf.size() < size_t(d.Dv * d.T)) vt_buf.resize(size_t(d.Dv * d.T));
    f32x::pack_transposed(kt_buf.data(), d.T, k, d.W, d.T, d.Dqk);
    f32x::pack_transposed(vt_buf.data(), d.T, v, d.W, d.T, d.Dv);
    for (int64_t t = 0; t < d.T; ++t) {
      std::fill_n(dk + t * d.W, d.Dqk, 0.0f);
      std::fill_n(dv + t * d.W, d.Dv, 0.0f);
    }
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t qb = 0; qb < nblocks; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
        if (s_buf.size() < size_t(nq * nk)) s_buf.resize(size_t(nq * nk));
        if (dp_buf.size() < size_t(nq * nk)) dp_buf.resize(size_t(nq * nk));
        float* s = s_buf.data();
        float* dp = dp_buf.data();
        const float* q = base + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        float* dq = dbase + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        const float* o = op + (b * d.T + t0) * ldo + h * d.Dv;
        const float* dO = dop + (b * d.T + t0) * ldo + h * d.Dv;
        // P = softmax(scale * Q K^T), recomputed from the saved log-sum-exp.
        causal_keys(nq, nk, t0, d.Dqk, rows_at(q, d.W), kt_buf.data(), d.T, scale, s, nk);
        probabilities_from_lse(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
        // dV += P^T dO
        causal_query_sum(nk, d.Dv, nq, t0, transposed(s, nk), dO, ldo, 1.0f, dv, d.W);
        // dP = dO V^T;  dS = P * (dP - rowsum(dO * O))
        causal_keys(nq, nk, t0, d.Dv, rows_at(dO, ldo), vt_buf.data(), d.T, 1.0f, dp, nk);
        score_grads_rows(s, dp, nq, nk, t0, dO, ldo, o, ldo, d.Dv);
        // dQ = scale * dS K;  dK += scale * dS^T Q
        causal_key_sum(nq, d.Dqk, nk, t0, rows_at(s, nk), k, d.W, scale, dq, d.W);
        causal_query_sum(nk, d.Dqk, nq, t0, transposed(s, nk), q, d.W, scale, dk, d.W);
      }
    }
  });
}
}  // namespace

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale) {
  const Dims d = dims_of(qkv, L);
  const float* base = qkv.data<float>();
  float* op = out.data<float>();
  float* lp = lse.data<float>();
  if (f32x::available()) return forward_block_products(op, lp, base, L, d, scale);
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;

  for_tasks(d.B * d.H * nblocks, [&](int64_t task) {
    thread_local std::vector<float> scratch;
    const int64_t qb = task % nblocks, h = (task / nblocks) % d.H, b = task / (nblocks * d.H);
    const int64_t g = h / d.group;
    const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
    scratch.resize(size_t(nq * nk));
    const float* q = base + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
    const float* k = base + b * d.T * d.W + L.k_offset + g * d.Dqk;
    const float* v = base + b * d.T * d.W + L.v_offset + g * d.Dv;
    float* s = scratch.data();
    sgemm(false, true, nq, nk, d.Dqk, scale, q, d.W, k, d.W, 0.0f, s, nk);
    causal_softmax_rows(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
    sgemm(false, false, nq, d.Dv, nk, 1.0f, s, nk, v, d.W, 0.0f, op + (b * d.T + t0) * ldo + h * d.Dv, ldo);
  });
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const ops::AttentionLayout& L,
                        float scale) {
  const Dims d = dims_of(qkv, L);
  const float* base = qkv.data<float>();
  const float* dop = dout.data<float>();
  const float* op = out.data<float>();
  const float* lp = lse.data<float>();
  float* dbase = dqkv.data<float>();
  if (f32x::available()) return backward_block_products(dbase, dop, op, base, lp, L, d, scale);
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;

  // One task per (batch, kv head): it owns dK and dV of that head and dQ of the query heads
  // that read it, so no two tasks write the same memory and sums run in a fixed order.
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    thread_local std::vector<float> s_buf, dp_buf;
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    const float* k = base + b * d.T * d.W + L.k_offset + g * d.Dqk;
    const float* v = base + b * d.T * d.W + L.v_offset + g * d.Dv;
    float* dk = dbase + b * d.T * d.W + L.k_offset + g * d.Dqk;
    float* dv = dbase + b * d.T * d.W + L.v_offset + g * d.Dv;
    for (int64_t t = 0; t < d.T; ++t) {
      std::fill_n(dk + t * d.W, d.Dqk, 0.0f);
      std::fill_n(dv + t * d.W, d.Dv, 0.0f);
    }
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t qb = 0; qb < nblocks; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
        s_buf.resize(size_t(nq * nk));
        dp_buf.resize(size_t(nq * nk));
        float* s = s_buf.data();
        float* dp = dp_buf.data();
        const float* q = base + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        float* dq = dbase + (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        const float* o = op + (b * d.T + t0) * ldo + h * d.Dv;
        const float* dO = dop + (b * d.T + t0) * ldo + h * d.Dv;
        // P = softmax(scale * Q K^T), recomputed from the saved log-sum-exp.
        sgemm(false, true, nq, nk, d.Dqk, scale, q, d.W, k, d.W, 0.0f, s, nk);
        probabilities_from_lse(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
        // dV += P^T dO
        sgemm(true, false, nk, d.Dv, nq, 1.0f, s, nk, dO, ldo, 1.0f, dv, d.W);
        // dP = dO V^T;  dS = P * (dP - rowsum(dO * O))
        sgemm(false, true, nq, nk, d.Dv, 1.0f, dO, ldo, v, d.W, 0.0f, dp, nk);
        score_grads_rows(s, dp, nq, nk, t0, dO, ldo, o, ldo, d.Dv);
        // dQ = scale * dS K;  dK += scale * dS^T Q
        sgemm(false, false, nq, d.Dqk, nk, scale, s, nk, k, d.W, 0.0f, dq, d.W);
        sgemm(true, false, nk, d.Dqk, nq, scale, s, nk, q, d.W, 1.0f, dk, d.W);
      }
    }
  });
}

}  // namespace dstrain::cpu
