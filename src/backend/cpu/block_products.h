// Small matrix products on AVX-512 for kernels that tile their own work on one thread: the block
// products of attention (attention.cpp, attention_16bit.cpp), a few thousand of 64 x (64..T) x
// head_dim per layer and step, where a library call's fixed cost was as large as the arithmetic.
// Two kinds: bf16 (namespace bf16x: vdpbf16ps, pairs of bf16 products summed into fp32, on CPUs
// with AVX-512 BF16) and fp32 (namespace f32x: FMA, on CPUs with AVX-512F).
//
// ---- bf16x ----
// Operands are "pair matrices": two bf16 values adjacent along the sum (k) dimension form one
// 32-bit pair, the first in its low half, as vdpbf16ps reads them.
//   A (m rows, kp pairs): bf16 memory, pair (r, p) starting at element a[r * row_stride +
//     p * pair_stride]. Row-major bf16 rows of leading dimension ld are A with strides
//     (ld, 2); a B operand built by pack_row_pairs (ldb) is its transpose, A with strides (2, 2 ldb).
//   B (kp pairs, n columns): pair (p, j) at b[p * ldb + j], built by the pack_* functions.
// When k is odd, the last pair of each row of A and of B holds a zero in its high half (the
// packs write it; row-major A must have it in memory), so it sums one product.
//
// Each output is the fp32 sum over p = 0, 1, ... in that order of vdpbf16ps steps (products of
// bf16 values are exact in fp32; the hardware adds the pair's two products to the running sum
// with round-to-nearest-even, treating fp32 denormals as zero), the same bits on every call
// and thread.
#pragma once

#include <cstdint>

namespace dstrain::cpu::bf16x {

// Whether this CPU has AVX-512 BF16 (with AVX-512 F, BW and VL): the only CPUs these run on.
bool available();

struct PairA {
  const uint16_t* p;
  int64_t row_stride, pair_stride;  // in bf16 elements
};

// C (m, n; leading dimension ldc, fp32) = alpha * A B, plus C first when accumulate.
void product(int64_t m, int64_t n, int64_t kp, PairA a, const uint32_t* b, int64_t ldb, float alpha, bool accumulate,
             float* c, int64_t ldc);

// Pairs of rows: dst ((rows + 1) / 2, cols; row stride ldd) with dst[p][c] = (src[2p][c],
// src[2p + 1][c]) from bf16 rows src (leading dimension lds). The B operand of a sum over src's
// rows (C = X src), or read as A with strides (2, 2 ldd), the A operand src^T (C = src^T Y).
void pack_row_pairs(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols);
// Transposed: dst ((cols + 1) / 2, rows; row stride ldd) with dst[p][r] = (src[r][2p],
// src[r][2p + 1]). The B operand of a sum over src's columns: C = X src^T.
void pack_transposed(uint32_t* dst, int64_t ldd, const uint16_t* src, int64_t lds, int64_t rows, int64_t cols);

}  // namespace dstrain::cpu::bf16x

// ---- f32x ----
// fp32 operands: A (m, k) element (r, p) at a[r * row_stride + p * col_stride] (row-major, or a
// row-major matrix read as its transpose with strides (1, ld)); B (k, n) element (p, j) at
// b[p * ldb + j] (row-major rows of a tensor, or pack_transposed's). Each output is one fp32 FMA
// chain over p = 0, 1, ... in order, then alpha times it, plus C when accumulating: the same bits
// on every call and thread.
namespace dstrain::cpu::f32x {

// Whether this CPU has AVX-512F (the only CPUs these run on) and they are not switched off.
bool available();
// Switches the kernel off (or back on) for the fp32 attention, which then runs the sgemm calls
// that CPUs without AVX-512 run, so that tests cover that path on every CPU. Returns the
// previous setting.
bool set_enabled(bool on);

struct MatA {
  const float* p;
  int64_t row_stride, col_stride;
};

// C (m, n; leading dimension ldc) = alpha * A B, plus C first when accumulate.
void product(int64_t m, int64_t n, int64_t k, MatA a, const float* b, int64_t ldb, float alpha, bool accumulate,
             float* c, int64_t ldc);

// dst (cols, rows; row stride ldd) = src^T for src (rows, cols; leading dimension lds): the B
// operand of C = X src^T.
void pack_transposed(float* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows, int64_t cols);

}  // namespace dstrain::cpu::f32x
