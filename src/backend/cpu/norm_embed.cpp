// RMSNorm and token embedding on the CPU.
#include <algorithm>
#include <cmath>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/parallel.h"

namespace dstrain::cpu {

void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  const float* xp = x.data<float>();
  const float* wp = weight.data<float>();
  float* op = out.data<float>();
  float* rp = rstd.data<float>();
#pragma omp parallel for schedule(dynamic, 32) if (N * C >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * C;
    double ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t c = 0; c < C; ++c) ss += double(xr[c]) * double(xr[c]);
    const float r = float(1.0 / std::sqrt(ss / double(C) + double(eps)));
    rp[n] = r;
    float* orow = op + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) orow[c] = wp[c] * (xr[c] * r);
  }
}

void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  const float* xp = x.data<float>();
  const float* wp = weight.data<float>();
  const float* gp = dout.data<float>();
  const float* rp = rstd.data<float>();
  float* dxp = dx.data<float>();
  float* dwp = dweight.data<float>();

  // dx: rows are independent.
#pragma omp parallel for schedule(dynamic, 32) if (N * C >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = xp + n * C;
    const float* gr = gp + n * C;
    const float r = rp[n];
    double dot = 0;  // sum_c w*g*x
#pragma omp simd reduction(+ : dot)
    for (int64_t c = 0; c < C; ++c) dot += double(wp[c]) * double(gr[c]) * double(xr[c]);
    const float k = float(dot / double(C)) * r * r * r;
    float* dr = dxp + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; ++c) dr[c] += wp[c] * gr[c] * r - xr[c] * k;
  }
  // dweight: each thread owns a range of channels and sums rows in order, so the result
  // does not depend on the thread count.
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1) if (N * C >= kParallelMinWork)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    float acc[kBlock] = {};
    for (int64_t n = 0; n < N; ++n) {
      const float* xr = xp + n * C;
      const float* gr = gp + n * C;
      const float r = rp[n];
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) acc[c - c0] += gr[c] * xr[c] * r;
    }
    for (int64_t c = c0; c < c1; ++c) dwp[c] += acc[c - c0];
  }
}

namespace {

// The rows of embedding_forward and of its vocabulary shards: table (Vl,C) holds rows
// [vocab_begin, vocab_begin + Vl) of a vocabulary of vocab_size; tokens of other shards get zeros.
void gather_rows(Tensor out, Tensor tokens, Tensor table, int64_t vocab_begin, int64_t vocab_size) {
  const int64_t Vl = table.size(0), C = table.size(1), N = tokens.numel();
  const int32_t* tp = tokens.data<int32_t>();
  const float* wp = table.data<float>();
  float* outp = out.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    DS_CHECK(tp[n] >= 0 && tp[n] < vocab_size, "token id {} at position {} is outside the vocabulary [0, {})", tp[n],
             n, vocab_size);
  }
#pragma omp parallel for schedule(dynamic, 64) if (N * C >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = int64_t(tp[n]) - vocab_begin;
    if (r >= 0 && r < Vl) {
      std::copy_n(wp + r * C, C, outp + n * C);
    } else {
      std::fill_n(outp + n * C, C, 0.0f);
    }
  }
}

// The scatter of embedding_backward and of its vocabulary shards: rows of dout whose token is
// outside [vocab_begin, vocab_begin + Vl) are skipped.
void scatter_rows(Tensor dtable, Tensor dout, Tensor tokens, int64_t vocab_begin) {
  const int64_t Vl = dtable.size(0), C = dtable.size(1), N = tokens.numel();
  const int32_t* tp = tokens.data<int32_t>();
  const float* gp = dout.data<float>();
  float* dp = dtable.data<float>();
  // Threads own channel ranges: no two threads touch the same element, and every element
  // accumulates its rows in token order (deterministic).
  constexpr int64_t kBlock = 64;
  const int64_t nblocks = (C + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(dynamic, 1) if (N * C >= kParallelMinWork)
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t c0 = b * kBlock, c1 = std::min(C, c0 + kBlock);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t r = int64_t(tp[n]) - vocab_begin;
      if (r < 0 || r >= Vl) continue;
      float* dr = dp + r * C;
      const float* gr = gp + n * C;
#pragma omp simd
      for (int64_t c = c0; c < c1; ++c) dr[c] += gr[c];
    }
  }
}

}  // namespace

void embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  gather_rows(out, tokens, table, 0, table.size(0));
}

void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) {
  scatter_rows(dtable, dout, tokens, 0);
}

void embedding_shard_forward(Tensor out, Tensor tokens, Tensor table, int64_t vocab_begin, int64_t vocab_size) {
  gather_rows(out, tokens, table, vocab_begin, vocab_size);
}

void embedding_shard_backward(Tensor dtable, Tensor dout, Tensor tokens, int64_t vocab_begin) {
  scatter_rows(dtable, dout, tokens, vocab_begin);
}

}  // namespace dstrain::cpu
