// Matrix products with 16-bit (BF16 / F16) and fp32 operands in any mix, accumulated in fp32:
// the GEMMs of the CPU backend's 16-bit linear kernels.
//
// Two paths, chosen at run time from CPUID (see gemm16.cpp for why):
// - CPUs with hardware bf16 (AVX-512 BF16 or AMX-BF16): oneDNN's bf16 matmul (fp32 accumulation)
//   for products of two bf16 operands. A product with an fp32 operand (the router's fp32 gate)
//   and F16 products take the next path, so fp32 values are never rounded to 16 bits.
// - otherwise: the 16-bit operands are widened to fp32 (exactly) into reused per-thread scratch and
//   the fp32 sgemm (sgemm.h) runs; 16-bit outputs are computed in row blocks and rounded once.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/tensor.h"

namespace dstrain::cpu {

// A row-major matrix operand of dtype F32, BF16 or F16 (contiguous: leading dimension = columns).
struct GemmOperand {
  const void* data;
  DType dtype;
};

// Which dimension of a product counts tokens (a linear layer's rows: m of its forward and dX, k
// of its dW). An expert's token count changes every step; the oneDNN path makes one kernel per
// shape, so it cuts a token dimension into pieces of 64 x 2^j rows plus one remainder under 64:
// a bounded set of shapes, whatever the counts. kNone: every dimension is fixed.
enum class TokenDim { kNone, kRows, kSum };

// C (m,n) = op(A) (m,k) · op(B) (k,n), or C += when accumulate; op(A) = A^T when ta (A stored
// (k,m)), likewise B (stored (n,k) when tb). C is F32, BF16 or F16 and is rounded once.
void gemm_mixed(bool ta, bool tb, int64_t m, int64_t n, int64_t k, GemmOperand a, GemmOperand b, bool accumulate,
                void* c, DType c_dtype, TokenDim tokens = TokenDim::kNone);

// How many oneDNN products (shapes) the bf16 path has made so far in this process.
int64_t gemm16_product_shapes();

// The linear ops of the BF16 and F16 slots (linear.cpp), same arguments as ops::linear_*.
void linear_forward_16bit(Tensor out, Tensor x, Tensor w, bool accumulate);
void linear_backward_16bit(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx);

// For an operand used by two products (linear_backward's dout): whether the products of 16-bit
// type `half` run on fp32 (then widening the operand once saves a pass), and the operand widened
// into a per-thread scratch of its own, valid until the next call of this function on the thread.
bool gemm16_computes_in_f32(DType half);
const float* gemm16_widen_shared(GemmOperand op, int64_t n);

// Whether products of two bf16 operands run on hardware bf16 (oneDNN's bf16 matmul) in the
// current path.
bool gemm16_bf16_hardware();

enum class Gemm16Path {
  kAuto,           // the run-time choice
  kConvertSgemm,   // widen to fp32 + sgemm (sgemm.h)
  kOneDnnBf16,     // oneDNN bf16 matmul (needs hardware bf16)
  kOneDnnF32,      // oneDNN's code path with fp32 compute: lets tests check it on any CPU
};
// Forces a path (tests and validation/gemm_ceiling); kAuto restores the run-time choice.
void set_gemm16_path(Gemm16Path path);
// Whether this CPU has hardware bf16 (avx512_bf16 or amx_bf16).
bool cpu_has_hardware_bf16();
// One line for the log: the path in use and why.
std::string gemm16_path_description();

}  // namespace dstrain::cpu
