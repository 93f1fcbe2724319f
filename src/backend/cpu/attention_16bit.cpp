// Causal grouped-query attention for the 16-bit slots, two ways:
// - bf16 tensors on a CPU with AVX-512 BF16 (and the GEMM path on hardware bf16): the same tasks
//   and softmax as the fp32 kernel, with the block products on bf16 hardware (block_products.h:
//   bf16 operands, fp32 sums, on the task's thread). q, k, v and dout are packed per task into
//   pair matrices; the probabilities P and their gradient dS are computed in fp32 and rounded
//   to bf16 to enter the products, as PyTorch's flash attention for CPUs does in bf16. Scores,
//   lse, the softmax and the dQ, dK and dV sums stay fp32; each output is rounded once.
// - otherwise: the fp32 kernel of attention.cpp (same tasks, threads, sgemm calls and softmax)
//   on fp32 tiles read from 16-bit rows. A task converts the rows of q, k and v it needs into
//   per-thread tiles, computes in fp32 exactly as the fp32 kernel does, and rounds its output
//   rows once into the 16-bit tensor: no whole-tensor temporaries. fp32 tensors are used in place
//   (a mix of fp32 and 16-bit is fine); lse is fp32.
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <vector>

#include "backend/cpu/attention_common.h"
#include "backend/cpu/block_products.h"
#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/kernels_16bit.h"
#include "backend/cpu/sgemm.h"
#include "backend/cpu/vec_exp.h"
#include "backend/cpu/widen.h"

namespace dstrain::cpu {
namespace {

using k16::at;
using namespace attn;

// A (rows, cols) block of a tensor whose rows are `ld` elements apart, starting at element
// `offset`, as an fp32 matrix: the tensor's memory when it is fp32, else converted into `tile`.
struct Mat {
  float* p;
  int64_t ld;
};
Mat read_block(const Tensor& t, int64_t offset, int64_t ld, int64_t rows, int64_t cols, std::vector<float>& tile) {
  if (t.dtype() == DType::F32) return {static_cast<float*>(t.raw()) + offset, ld};
  tile.resize(size_t(rows * cols));
  k16::load_tile(tile.data(), cols, at(t.raw(), t.dtype(), offset), t.dtype(), ld, rows, cols);
  return {tile.data(), cols};
}
// Where to compute a block of an output: in place (fp32) or a tile to round into it afterwards.
Mat write_block(const Tensor& t, int64_t offset, int64_t ld, int64_t rows, int64_t cols, std::vector<float>& tile) {
  if (t.dtype() == DType::F32) return {static_cast<float*>(t.raw()) + offset, ld};
  tile.resize(size_t(rows * cols));
  return {tile.data(), cols};
}
void finish_block(const Tensor& t, int64_t offset, int64_t ld, int64_t rows, int64_t cols, const Mat& m) {
  if (t.dtype() != DType::F32) k16::store_tile(at(t.raw(), t.dtype(), offset), t.dtype(), ld, m.p, m.ld, rows, cols);
}

bool floats(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->defined() || !k16::is_float(t->dtype())) return false;
  }
  return true;
}

bool all_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->dtype() != DType::BF16) return false;
  }
  return true;
}

// The bf16 element at `offset` of a BF16 tensor.
uint16_t* bf(const Tensor& t, int64_t offset) { return static_cast<uint16_t*>(t.raw()) + offset; }

// Whether bf16 tensors take the bf16 products: the GEMM path is hardware bf16 (not forced to
// fp32 by set_gemm16_path) and the CPU has AVX-512 BF16.
bool bf16_products_on() { return gemm16_bf16_hardware() && bf16x::available(); }

// Per-thread buffers of the bf16 path, reused across calls.
template <class T>
T* grow(std::vector<T>& v, int64_t n) {
  if (v.size() < size_t(n)) v.resize(size_t(n));
  return v.data();
}

int64_t pairs(int64_t n) { return (n + 1) / 2; }

// Row-major bf16 rows (leading dimension ld; an odd count of values with a zero after it) as an A.
bf16x::PairA rows_a(const uint16_t* p, int64_t ld) { return {p, ld, 2}; }
// A row-pair pack (pack_row_pairs, row stride ld) read as A: the transpose of what was packed.
bf16x::PairA transposed_a(const uint32_t* pack, int64_t ld) {
  return {reinterpret_cast<const uint16_t*>(pack), 2, 2 * ld};
}

// Rows (cols values each, leading dimension lds) of a bf16 tensor as the A of a product: in
// place when cols is even, else copied into buf with the zero pad after each row.
bf16x::PairA rows_a(const uint16_t* src, int64_t lds, int64_t rows, int64_t cols, std::vector<uint16_t>& buf) {
  if (cols % 2 == 0) return rows_a(src, lds);
  const int64_t ld = cols + 1;
  uint16_t* dst = grow(buf, rows * ld);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * ld, src + r * lds, size_t(cols) * sizeof(uint16_t));
    dst[r * ld + cols] = 0;
  }
  return rows_a(dst, ld);
}

// ---- softmax rows into bf16 (AVX-512 BF16) ---------------------------------------------------
// The row loops of the bf16 path, sixteen lanes at a time: exp16 (vec_exp.h, exp8's arithmetic),
// and each value rounded to bf16 as it is made (vcvtneps2bf16: nearest even; it turns fp32
// denormals into zeros, which the products' vdpbf16ps would read as zeros anyway). Row i of the
// bf16 output has leading dimension ldh (even) and zeros from the masked keys to its end.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define DS_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")))

// The lanes [j, j + 16) below `end`.
DS_AVX512BF16 inline __mmask16 lanes_below(int64_t j, int64_t end) {
  return end - j >= 16 ? __mmask16(0xffff) : end <= j ? __mmask16(0) : __mmask16((1u << (end - j)) - 1u);
}

// Rounds x to bf16 into the lanes m of d, and returns the rounded values as fp32.
DS_AVX512BF16 inline __m512 round_store(uint16_t* d, __m512 x, __mmask16 m) {
  const __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
  _mm256_mask_storeu_epi16(d, m, h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Forward: the probabilities of scores s (nq, nk; row i sees keys <= t0 + i), their log-sum-exp
// into lse_out, and P rounded to bf16 into hi with the remainders P - hi rounded into lo.
DS_AVX512BF16 void softmax_rows_bf16(float* s, int64_t nq, int64_t nk, int64_t t0, float* lse_out, uint16_t* hi,
                                     uint16_t* lo, int64_t ldh) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1;
    __m512 m = neg_inf;
    for (int64_t j = 0; j < valid; j += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(neg_inf, lanes_below(j, valid), row + j));
    const float mx = _mm512_reduce_max_ps(m);
    const __m512 mx16 = _mm512_set1_ps(mx);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < valid; j += 16) {
      const __mmask16 k = lanes_below(j, valid);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), mx16)));
      _mm512_mask_storeu_ps(row + j, k, e);
      acc = _mm512_add_ps(acc, e);
    }
    const float sum = _mm512_reduce_add_ps(acc);
    const __m512 inv = _mm512_set1_ps(1.0f / sum);
    uint16_t* h = hi + i * ldh;
    uint16_t* l = lo + i * ldh;
    for (int64_t j = 0; j < ldh; j += 16) {
      const __mmask16 cols = lanes_below(j, ldh);
      const __m512 p = _mm512_maskz_mul_ps(lanes_below(j, valid), _mm512_maskz_loadu_ps(lanes_below(j, valid), row + j), inv);
      const __m512 ph = round_store(h + j, p, cols);
      round_store(l + j, _mm512_sub_ps(p, ph), cols);
    }
    lse_out[i] = mx + std::log(sum);
  }
}

// Backward: s (nq, nk) = exp(s - lse) below the diagonal, 0 above, in fp32 (for dS) and rounded
// to bf16 into p.
DS_AVX512BF16 void probabilities_bf16(float* s, int64_t nq, int64_t nk, int64_t t0, const float* lse, uint16_t* p,
                                      int64_t ldp) {
  for (int64_t i = 0; i < nq; ++i) {
    float* row = s + i * nk;
    const int64_t valid = t0 + i + 1;
    const __m512 l = _mm512_set1_ps(lse[i]);
    for (int64_t j = 0; j < ldp; j += 16) {
      const __mmask16 k = lanes_below(j, valid);
      const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, row + j), l)));
      _mm512_mask_storeu_ps(row + j, lanes_below(j, nk), e);
      round_store(p + i * ldp + j, e, lanes_below(j, ldp));
    }
  }
}

// Backward: dS = P * (dP - rowsum(P * dP)) from fp32 P (s) and dP, rounded to bf16 into ds; each
// row's sum is the one of this P, so that each row of dS sums to 0 in fp32 before rounding.
DS_AVX512BF16 void score_grads_bf16(const float* s, const float* dp, int64_t nq, int64_t nk, int64_t t0, uint16_t* ds,
                                    int64_t ldp) {
  for (int64_t i = 0; i < nq; ++i) {
    const float* srow = s + i * nk;
    const float* dprow = dp + i * nk;
    const int64_t valid = t0 + i + 1;
    __m512 acc = _mm512_setzero_ps();
    for (int64_t j = 0; j < valid; j += 16) {
      const __mmask16 k = lanes_below(j, valid);
      acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, srow + j), _mm512_maskz_loadu_ps(k, dprow + j), acc);
    }
    const __m512 delta = _mm512_set1_ps(_mm512_reduce_add_ps(acc));
    for (int64_t j = 0; j < ldp; j += 16) {
      const __mmask16 k = lanes_below(j, valid);
      const __m512 g = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, srow + j),
                                     _mm512_sub_ps(_mm512_maskz_loadu_ps(k, dprow + j), delta));
      round_store(ds + i * ldp + j, _mm512_maskz_mov_ps(k, g), lanes_below(j, ldp));
    }
  }
}
#undef DS_AVX512BF16
#pragma GCC diagnostic pop

// ---- causal products (attention_common.h's strips) ------------------------------------------
bf16x::PairA rows_from(bf16x::PairA a, int64_t row, int64_t pair) {
  return {a.p + row * a.row_stride + pair * a.pair_stride, a.row_stride, a.pair_stride};
}

// C (nq, nk) = alpha A B, a product over keys.
void causal_keys(int64_t nq, int64_t nk, int64_t t0, int64_t kp, bf16x::PairA a, const uint32_t* b, int64_t ldb,
                 float alpha, float* c, int64_t ldc) {
  query_strips(nq, nk, t0, [&](int64_t i0, int64_t r, int64_t keys) {
    bf16x::product(r, keys, kp, rows_from(a, i0, 0), b, ldb, alpha, false, c + i0 * ldc, ldc);
  });
}

// C (nq, n) (+)= alpha A B, a sum over keys (A's pairs, B's rows of key pairs).
void causal_key_sum(int64_t nq, int64_t n, int64_t nk, int64_t t0, bf16x::PairA a, const uint32_t* b, int64_t ldb,
                    float alpha, bool accumulate, float* c, int64_t ldc) {
  query_strips(nq, nk, t0, [&](int64_t i0, int64_t r, int64_t keys) {
    bf16x::product(r, n, pairs(keys), rows_from(a, i0, 0), b, ldb, alpha, accumulate, c + i0 * ldc, ldc);
  });
}

// C (nk, n) += alpha A B, a sum over the block's nq queries for each key row (A's pairs, B's rows
// of query pairs; strips start at even queries, so at whole pairs).
void causal_query_sum(int64_t nk, int64_t n, int64_t nq, int64_t t0, bf16x::PairA a, const uint32_t* b, int64_t ldb,
                      float alpha, float* c, int64_t ldc) {
  key_strips(nk, t0, [&](int64_t j, int64_t r, int64_t q0) {
    const int64_t p0 = q0 / 2;
    bf16x::product(r, n, pairs(nq) - p0, rows_from(a, j, p0), b + p0 * ldb, ldb, alpha, true, c + j * ldc, ldc);
  });
}

// ---- bf16 products (AVX-512 BF16) ----------------------------------------------------------
// Every product is a bf16x::product on the calling thread (block_products.h): its operands are
// packed into per-thread pair matrices, the sums are fp32 in a fixed order.
void forward_bf16_products(Tensor out, float* lp, Tensor qkv, const ops::AttentionLayout& L, const Dims& d,
                           float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  const int64_t kq = pairs(d.Dqk), kt = pairs(d.T);
  // Per (batch, kv head), for all T keys: K^T in pairs along the head dimension (the B of
  // Q K^T) and V in pairs of rows (the B of P V).
  thread_local std::vector<uint32_t> k_packs, v_packs;
  const int64_t k_size = kq * d.T, v_size = kt * d.Dv;
  uint32_t* kp_all = grow(k_packs, d.B * d.Hkv * k_size);
  uint32_t* vp_all = grow(v_packs, d.B * d.Hkv * v_size);
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    bf16x::pack_transposed(kp_all + task * k_size, d.T, bf(qkv, b * d.T * d.W + L.k_offset + g * d.Dqk), d.W, d.T,
                           d.Dqk);
    bf16x::pack_row_pairs(vp_all + task * v_size, d.Dv, bf(qkv, b * d.T * d.W + L.v_offset + g * d.Dv), d.W, d.T,
                          d.Dv);
  });
  for_tasks(d.B * d.H * nblocks, [&](int64_t task) {
    thread_local std::vector<float> s_buf, o_buf;
    thread_local std::vector<uint16_t> q_buf, hi_buf, lo_buf;
    const int64_t qb = task % nblocks, h = (task / nblocks) % d.H, b = task / (nblocks * d.H);
    const int64_t g = h / d.group;
    const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
    const int64_t ldp = 2 * pairs(nk);
    float* s = grow(s_buf, nq * nk);
    float* o = grow(o_buf, nq * d.Dv);
    uint16_t* hi = grow(hi_buf, nq * ldp);
    uint16_t* lo = grow(lo_buf, nq * ldp);
    const uint32_t* kp = kp_all + (b * d.Hkv + g) * k_size;
    const uint32_t* vp = vp_all + (b * d.Hkv + g) * v_size;
    const bf16x::PairA q = rows_a(bf(qkv, (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk), d.W, nq, d.Dqk, q_buf);
    causal_keys(nq, nk, t0, kq, q, kp, d.T, scale, s, nk);
    // O = P V with P as two bf16 parts: P rounded once to bf16 moved the small models' loss by
    // 1e-3 relative and their gradients to cosines of 0.994 against fp32 (0.9992 with both).
    softmax_rows_bf16(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0, hi, lo, ldp);
    causal_key_sum(nq, d.Dv, nk, t0, rows_a(hi, ldp), vp, d.Dv, 1.0f, false, o, d.Dv);
    causal_key_sum(nq, d.Dv, nk, t0, rows_a(lo, ldp), vp, d.Dv, 1.0f, true, o, d.Dv);
    k16::store_tile(bf(out, (b * d.T + t0) * ldo + h * d.Dv), DType::BF16, ldo, o, d.Dv, nq, d.Dv);
  });
}

void backward_bf16_products(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, const float* lp,
                            const ops::AttentionLayout& L, const Dims& d, float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  const int64_t kq = pairs(d.Dqk), kv = pairs(d.Dv), kt = pairs(d.T);
  // One task per (batch, kv head), as the fp32 kernel: it owns dK and dV of that head and dQ of
  // the query heads that read it. dK and dV are summed in fp32 tiles and rounded at the end.
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    thread_local std::vector<float> s_buf, dp_buf, dq_buf, dkt, dvt;
    thread_local std::vector<uint32_t> kt_buf, vt_buf, kr_buf, qr_buf, dor_buf, pr_buf;
    thread_local std::vector<uint16_t> q_buf, do_buf, p_buf;
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    const int64_t k_off = b * d.T * d.W + L.k_offset + g * d.Dqk;
    const int64_t v_off = b * d.T * d.W + L.v_offset + g * d.Dv;
    // K^T and V^T in pairs along the head dimension (the B of Q K^T and of dO V^T), K in pairs of
    // rows (the B of dS K).
    uint32_t* k_t = grow(kt_buf, kq * d.T);
    uint32_t* v_t = grow(vt_buf, kv * d.T);
    uint32_t* k_r = grow(kr_buf, kt * d.Dqk);
    bf16x::pack_transposed(k_t, d.T, bf(qkv, k_off), d.W, d.T, d.Dqk);
    bf16x::pack_transposed(v_t, d.T, bf(qkv, v_off), d.W, d.T, d.Dv);
    bf16x::pack_row_pairs(k_r, d.Dqk, bf(qkv, k_off), d.W, d.T, d.Dqk);
    float* dk = grow(dkt, d.T * d.Dqk);
    float* dv = grow(dvt, d.T * d.Dv);
    std::fill_n(dk, d.T * d.Dqk, 0.0f);
    std::fill_n(dv, d.T * d.Dv, 0.0f);
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t qb = 0; qb < nblocks; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
        const int64_t ldp = 2 * pairs(nk), nqp = pairs(nq);
        float* s = grow(s_buf, nq * nk);
        float* dp = grow(dp_buf, nq * nk);
        float* dq = grow(dq_buf, nq * d.Dqk);
        uint16_t* p = grow(p_buf, nq * ldp);
        uint32_t* q_r = grow(qr_buf, nqp * d.Dqk);
        uint32_t* do_r = grow(dor_buf, nqp * d.Dv);
        uint32_t* p_r = grow(pr_buf, nqp * nk);
        const int64_t q_off = (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        const int64_t o_off = (b * d.T + t0) * ldo + h * d.Dv;
        const bf16x::PairA q = rows_a(bf(qkv, q_off), d.W, nq, d.Dqk, q_buf);
        const bf16x::PairA dO = rows_a(bf(dout, o_off), ldo, nq, d.Dv, do_buf);
        bf16x::pack_row_pairs(q_r, d.Dqk, bf(qkv, q_off), d.W, nq, d.Dqk);
        bf16x::pack_row_pairs(do_r, d.Dv, bf(dout, o_off), ldo, nq, d.Dv);
        // P = softmax(scale * Q K^T), recomputed from the saved log-sum-exp; bf16 for the products.
        causal_keys(nq, nk, t0, kq, q, k_t, d.T, scale, s, nk);
        probabilities_bf16(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0, p, ldp);
        bf16x::pack_row_pairs(p_r, nk, p, ldp, nq, nk);
        // dV += P^T dO
        causal_query_sum(nk, d.Dv, nq, t0, transposed_a(p_r, nk), do_r, d.Dv, 1.0f, dv, d.Dv);
        // dP = dO V^T;  dS = P * (dP - rowsum(P * dP)), rowsum(P * dP) being rowsum(dO * O) for
        // the P of this backward, so that each row of dS sums to 0 in fp32.
        causal_keys(nq, nk, t0, kv, dO, v_t, d.T, 1.0f, dp, nk);
        score_grads_bf16(s, dp, nq, nk, t0, p, ldp);  // dS, masked entries 0
        bf16x::pack_row_pairs(p_r, nk, p, ldp, nq, nk);
        // dQ = scale * dS K (rounded once into dqkv);  dK += scale * dS^T Q
        causal_key_sum(nq, d.Dqk, nk, t0, rows_a(p, ldp), k_r, d.Dqk, scale, false, dq, d.Dqk);
        k16::store_tile(bf(dqkv, q_off), DType::BF16, d.W, dq, d.Dqk, nq, d.Dqk);
        causal_query_sum(nk, d.Dqk, nq, t0, transposed_a(p_r, nk), q_r, d.Dqk, scale, dk, d.Dqk);
      }
    }
    k16::store_tile(bf(dqkv, k_off), DType::BF16, d.W, dk, d.Dqk, d.T, d.Dqk);
    k16::store_tile(bf(dqkv, v_off), DType::BF16, d.W, dv, d.Dv, d.T, d.Dv);
  });
}

}  // namespace

void attention_forward_16bit(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale) {
  if (!floats({&out, &qkv}) || lse.dtype() != DType::F32) {
    return DS_CPU_WIDENED(attention_forward)(out, lse, qkv, L, scale);
  }
  const Dims d = dims_of(qkv, L);
  float* lp = lse.data<float>();
  if (all_bf16({&out, &qkv}) && bf16_products_on()) return forward_bf16_products(out, lp, qkv, L, d, scale);
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;

  for_tasks(d.B * d.H * nblocks, [&](int64_t task) {
    thread_local std::vector<float> scratch, qt, kt, vt, ot;
    const int64_t qb = task % nblocks, h = (task / nblocks) % d.H, b = task / (nblocks * d.H);
    const int64_t g = h / d.group;
    const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
    scratch.resize(size_t(nq * nk));
    const Mat q = read_block(qkv, (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk, d.W, nq, d.Dqk, qt);
    const Mat k = read_block(qkv, b * d.T * d.W + L.k_offset + g * d.Dqk, d.W, nk, d.Dqk, kt);
    const Mat v = read_block(qkv, b * d.T * d.W + L.v_offset + g * d.Dv, d.W, nk, d.Dv, vt);
    const int64_t o_off = (b * d.T + t0) * ldo + h * d.Dv;
    const Mat o = write_block(out, o_off, ldo, nq, d.Dv, ot);
    float* s = scratch.data();
    sgemm(false, true, nq, nk, d.Dqk, scale, q.p, q.ld, k.p, k.ld, 0.0f, s, nk);
    causal_softmax_rows(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
    sgemm(false, false, nq, d.Dv, nk, 1.0f, s, nk, v.p, v.ld, 0.0f, o.p, o.ld);
    finish_block(out, o_off, ldo, nq, d.Dv, o);
  });
}

void attention_backward_16bit(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                              const ops::AttentionLayout& L, float scale) {
  if (!floats({&dqkv, &dout, &qkv, &out}) || lse.dtype() != DType::F32) {
    return DS_CPU_WIDENED(attention_backward)(dqkv, dout, qkv, out, lse, L, scale);
  }
  const Dims d = dims_of(qkv, L);
  const float* lp = lse.data<float>();
  if (all_bf16({&dqkv, &dout, &qkv, &out}) && bf16_products_on()) {
    return backward_bf16_products(dqkv, dout, qkv, out, lp, L, d, scale);
  }
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;

  // One task per (batch, kv head), as the fp32 kernel: it owns dK and dV of that head and dQ of
  // the query heads that read it. dK and dV are summed in fp32 tiles and rounded at the end.
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    thread_local std::vector<float> s_buf, dp_buf, kt, vt, dkt, dvt, qt, ot, dot, dqt;
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    const int64_t k_off = b * d.T * d.W + L.k_offset + g * d.Dqk;
    const int64_t v_off = b * d.T * d.W + L.v_offset + g * d.Dv;
    const Mat k = read_block(qkv, k_off, d.W, d.T, d.Dqk, kt);
    const Mat v = read_block(qkv, v_off, d.W, d.T, d.Dv, vt);
    const Mat dk = write_block(dqkv, k_off, d.W, d.T, d.Dqk, dkt);
    const Mat dv = write_block(dqkv, v_off, d.W, d.T, d.Dv, dvt);
    for (int64_t t = 0; t < d.T; ++t) {
      std::fill_n(dk.p + t * dk.ld, d.Dqk, 0.0f);
      std::fill_n(dv.p + t * dv.ld, d.Dv, 0.0f);
    }
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t qb = 0; qb < nblocks; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
        s_buf.resize(size_t(nq * nk));
        dp_buf.resize(size_t(nq * nk));
        float* s = s_buf.data();
        float* dp = dp_buf.data();
        const int64_t q_off = (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        const int64_t o_off = (b * d.T + t0) * ldo + h * d.Dv;
        const Mat q = read_block(qkv, q_off, d.W, nq, d.Dqk, qt);
        const Mat dq = write_block(dqkv, q_off, d.W, nq, d.Dqk, dqt);
        const Mat o = read_block(out, o_off, ldo, nq, d.Dv, ot);
        const Mat dO = read_block(dout, o_off, ldo, nq, d.Dv, dot);
        // P = softmax(scale * Q K^T), recomputed from the saved log-sum-exp.
        sgemm(false, true, nq, nk, d.Dqk, scale, q.p, q.ld, k.p, k.ld, 0.0f, s, nk);
        probabilities_from_lse(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
        // dV += P^T dO
        sgemm(true, false, nk, d.Dv, nq, 1.0f, s, nk, dO.p, dO.ld, 1.0f, dv.p, dv.ld);
        // dP = dO V^T;  dS = P * (dP - rowsum(dO * O))
        sgemm(false, true, nq, nk, d.Dv, 1.0f, dO.p, dO.ld, v.p, v.ld, 0.0f, dp, nk);
        score_grads_rows(s, dp, nq, nk, t0, dO.p, dO.ld, o.p, o.ld, d.Dv);
        // dQ = scale * dS K;  dK += scale * dS^T Q
        sgemm(false, false, nq, d.Dqk, nk, scale, s, nk, k.p, k.ld, 0.0f, dq.p, dq.ld);
        finish_block(dqkv, q_off, d.W, nq, d.Dqk, dq);
        sgemm(true, false, nk, d.Dqk, nq, scale, s, nk, q.p, q.ld, 1.0f, dk.p, dk.ld);
      }
    }
    finish_block(dqkv, k_off, d.W, d.T, d.Dqk, dk);
    finish_block(dqkv, v_off, d.W, d.T, d.Dv, dv);
  });
}

}  // namespace dstrain::cpu
