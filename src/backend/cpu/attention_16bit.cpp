// Causal grouped-query attention for the 16-bit slots, two ways:
// - bf16 tensors on a CPU with hardware bf16 (gemm16_bf16_hardware): the same tasks and softmax
//   as the fp32 kernel, with the block products on bf16 hardware (gemm_bf16_block: bf16 operands,
//   fp32 accumulation). q, k, v, out and dout are read in place; the probabilities P and their
//   gradient dS are computed in fp32 and rounded to bf16 to enter the products, as PyTorch's
//   flash attention for CPUs does in bf16. Scores, lse, the softmax and dK / dV sums stay fp32.
// - otherwise: the fp32 kernel of attention.cpp (same tasks, threads, sgemm calls and softmax)
//   on fp32 tiles read from 16-bit rows. A task converts the rows of q, k and v it needs into
//   per-thread tiles, computes in fp32 exactly as the fp32 kernel does, and rounds its output
//   rows once into the 16-bit tensor: no whole-tensor temporaries. fp32 tensors are used in place
//   (a mix of fp32 and 16-bit is fine); lse is fp32.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "backend/cpu/attention_common.h"
#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/kernels_16bit.h"
#include "backend/cpu/sgemm.h"
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

// Rounds the n fp32 values of s to bf16 into hi (convert16.h's bulk rounding) and, when lo is
// given, their remainders s - hi into lo, overwriting s: hi + lo holds s to about 16 bits.
void round_bf16(float* s, uint16_t* hi, uint16_t* lo, int64_t n) {
  bulk_f32_to_bf16(s, hi, n);
  if (lo == nullptr) return;
  for (int64_t i = 0; i < n; ++i) s[i] -= bf16_to_f32(hi[i]);
  bulk_f32_to_bf16(s, lo, n);
}

// ---- bf16 products (hardware bf16) -----------------------------------------------------------
void forward_bf16_products(Tensor out, float* lp, Tensor qkv, const ops::AttentionLayout& L, const Dims& d,
                           float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  for_tasks(d.B * d.H * nblocks, [&](int64_t task) {
    thread_local std::vector<float> s_buf, o_buf;
    thread_local std::vector<uint16_t> hi_buf, lo_buf;
    const int64_t qb = task % nblocks, h = (task / nblocks) % d.H, b = task / (nblocks * d.H);
    const int64_t g = h / d.group;
    const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
    s_buf.resize(size_t(nq * nk));
    hi_buf.resize(size_t(nq * nk));
    lo_buf.resize(size_t(nq * nk));
    o_buf.resize(size_t(nq * d.Dv));
    float* s = s_buf.data();
    float* o = o_buf.data();
    const uint16_t* q = bf(qkv, (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk);
    const uint16_t* k = bf(qkv, b * d.T * d.W + L.k_offset + g * d.Dqk);
    const uint16_t* v = bf(qkv, b * d.T * d.W + L.v_offset + g * d.Dv);
    gemm_bf16_block(false, true, nq, nk, d.Dqk, scale, q, d.W, k, d.W, false, s, DType::F32, nk);
    causal_softmax_rows(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
    // O = P V with P as two bf16 parts: P rounded once to bf16 moved the small models' loss by
    // 1e-3 relative and their gradients to cosines of 0.994 against fp32 (0.9992 with both).
    round_bf16(s, hi_buf.data(), lo_buf.data(), nq * nk);
    gemm_bf16_block(false, false, nq, d.Dv, nk, 1.0f, hi_buf.data(), nk, v, d.W, false, o, DType::F32, d.Dv);
    gemm_bf16_block(false, false, nq, d.Dv, nk, 1.0f, lo_buf.data(), nk, v, d.W, true, o, DType::F32, d.Dv);
    k16::store_tile(bf(out, (b * d.T + t0) * ldo + h * d.Dv), DType::BF16, ldo, o, d.Dv, nq, d.Dv);
  });
}

void backward_bf16_products(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, const float* lp,
                            const ops::AttentionLayout& L, const Dims& d, float scale) {
  const int64_t nblocks = (d.T + kQueryBlock - 1) / kQueryBlock;
  const int64_t ldo = d.H * d.Dv;
  // One task per (batch, kv head), as the fp32 kernel: it owns dK and dV of that head and dQ of
  // the query heads that read it. dK and dV are summed in fp32 tiles and rounded at the end.
  for_tasks(d.B * d.Hkv, [&](int64_t task) {
    thread_local std::vector<float> s_buf, dp_buf, dkt, dvt;
    thread_local std::vector<uint16_t> p_buf;
    const int64_t g = task % d.Hkv, b = task / d.Hkv;
    const int64_t k_off = b * d.T * d.W + L.k_offset + g * d.Dqk;
    const int64_t v_off = b * d.T * d.W + L.v_offset + g * d.Dv;
    const uint16_t* k = bf(qkv, k_off);
    const uint16_t* v = bf(qkv, v_off);
    dkt.assign(size_t(d.T * d.Dqk), 0.0f);
    dvt.assign(size_t(d.T * d.Dv), 0.0f);
    for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
      for (int64_t qb = 0; qb < nblocks; ++qb) {
        const int64_t t0 = qb * kQueryBlock, nq = std::min(kQueryBlock, d.T - t0), nk = t0 + nq;
        s_buf.resize(size_t(nq * nk));
        dp_buf.resize(size_t(nq * nk));
        p_buf.resize(size_t(nq * nk));
        float* s = s_buf.data();
        float* dp = dp_buf.data();
        uint16_t* p = p_buf.data();
        const int64_t q_off = (b * d.T + t0) * d.W + L.q_offset + h * d.Dqk;
        const int64_t o_off = (b * d.T + t0) * ldo + h * d.Dv;
        const uint16_t* q = bf(qkv, q_off);
        const uint16_t* dO = bf(dout, o_off);
        // P = softmax(scale * Q K^T), recomputed from the saved log-sum-exp; bf16 for the products.
        gemm_bf16_block(false, true, nq, nk, d.Dqk, scale, q, d.W, k, d.W, false, s, DType::F32, nk);
        probabilities_from_lse(s, nq, nk, t0, lp + (b * d.H + h) * d.T + t0);
        round_bf16(s, p, nullptr, nq * nk);
        // dV += P^T dO
        gemm_bf16_block(true, false, nk, d.Dv, nq, 1.0f, p, nk, dO, ldo, true, dvt.data(), DType::F32, d.Dv);
        // dP = dO V^T;  dS = P * (dP - rowsum(P * dP)), rowsum(P * dP) being rowsum(dO * O) for
        // the P of this backward, so that each row of dS sums to 0 in fp32.
        gemm_bf16_block(false, true, nq, nk, d.Dv, 1.0f, dO, ldo, v, d.W, false, dp, DType::F32, nk);
        for (int64_t i = 0; i < nq; ++i) {
          float* srow = s + i * nk;
          const float* dprow = dp + i * nk;
          const int64_t valid = t0 + i + 1;
          float delta = 0;
#pragma omp simd reduction(+ : delta)
          for (int64_t j = 0; j < valid; ++j) delta += srow[j] * dprow[j];
#pragma omp simd
          for (int64_t j = 0; j < valid; ++j) srow[j] = srow[j] * (dprow[j] - delta);
        }
        round_bf16(s, p, nullptr, nq * nk);  // dS, masked entries 0
        // dQ = scale * dS K (rounded once into dqkv);  dK += scale * dS^T Q
        gemm_bf16_block(false, false, nq, d.Dqk, nk, scale, p, nk, k, d.W, false, bf(dqkv, q_off), DType::BF16, d.W);
        gemm_bf16_block(true, false, nk, d.Dqk, nq, scale, p, nk, q, d.W, true, dkt.data(), DType::F32, d.Dqk);
      }
    }
    k16::store_tile(bf(dqkv, k_off), DType::BF16, d.W, dkt.data(), d.Dqk, d.T, d.Dqk);
    k16::store_tile(bf(dqkv, v_off), DType::BF16, d.W, dvt.data(), d.Dv, d.T, d.Dv);
  });
}

}  // namespace

void attention_forward_16bit(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& L, float scale) {
  if (!floats({&out, &qkv}) || lse.dtype() != DType::F32) {
    return DS_CPU_WIDENED(attention_forward)(out, lse, qkv, L, scale);
  }
  const Dims d = dims_of(qkv, L);
  DS_CHECK(out.numel() == d.B * d.T * d.H * d.Dv && lse.numel() == d.B * d.H * d.T,
           "attention_forward: out {} lse {}", out.shape().str(), lse.shape().str());
  float* lp = lse.data<float>();
  if (all_bf16({&out, &qkv}) && gemm16_bf16_hardware()) return forward_bf16_products(out, lp, qkv, L, d, scale);
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
  DS_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel() && out.numel() == d.B * d.T * d.H * d.Dv,
           "attention_backward: shape mismatch");
  const float* lp = lse.data<float>();
  if (all_bf16({&dqkv, &dout, &qkv, &out}) && gemm16_bf16_hardware()) {
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
        for (int64_t i = 0; i < nq; ++i) {
          float delta = 0;
          for (int64_t e = 0; e < d.Dv; ++e) delta += dO.p[i * dO.ld + e] * o.p[i * o.ld + e];
          float* srow = s + i * nk;
          const float* dprow = dp + i * nk;
          const int64_t valid = t0 + i + 1;
#pragma omp simd
          for (int64_t j = 0; j < valid; ++j) srow[j] = srow[j] * (dprow[j] - delta);
        }
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
