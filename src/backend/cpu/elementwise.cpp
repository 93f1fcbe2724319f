// Rotary embedding, SwiGLU, elementwise arithmetic, reductions and AdamW on the CPU.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/parallel.h"
#include "backend/cpu/vec_exp.h"
#include "backend/cpu/widen.h"
#include "core/philox.h"

namespace dstrain::cpu {

void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta) {
  const int64_t T = cos.size(0), half = head_dim / 2;
  float* cp = cos.data<float>();
  float* sp = sin.data<float>();
  // Hugging Face computes inv_freq = 1 / theta^(2i/d), the angles t * inv_freq and their
  // cosines all in fp32; doing the same keeps positions far from 0 bit-compatible.
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[size_t(i)] = 1.0f / std::pow(float(theta), float(2 * i) / float(head_dim));
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = float(t) * inv_freq[size_t(i)];
      cp[t * half + i] = std::cos(angle);
      sp[t * half + i] = std::sin(angle);
    }
  }
}

// x' = x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; the inverse (used by the
// backward, since the rotation is orthogonal) flips the sign of sin.
void rope_apply(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin, bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), half = head_dim / 2;
  float* xp = x.data<float>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(dynamic, 32) if (B * T * n_heads * head_dim >= kParallelMinWork)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    const float* c = cp + t * half;
    const float* s = sp + t * half;
    for (int h = 0; h < n_heads; ++h) {
      float* v = xp + bt * W + offset + int64_t(h) * head_dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = v[i], x2 = v[i + half];
        const float si = sign * s[i];
        v[i] = x1 * c[i] - x2 * si;
        v[i + half] = x2 * c[i] + x1 * si;
      }
    }
  }
}

namespace {
// silu(g) * u and its gradients, row by row. sigmoid(g) = 1 / (1 + exp(-g)) as PyTorch's silu
// computes it; exp is vec_exp.h's (the same bits in the vector loop and its scalar tail).
inline void swiglu_forward_scalar(const float* g, const float* u, float* o, int64_t i0, int64_t I) {
  for (int64_t i = i0; i < I; ++i) o[i] = g[i] / (1.0f + exp1(-g[i])) * u[i];
}
inline void swiglu_backward_scalar(const float* g, const float* u, const float* d, float* dg, float* du, int64_t i0,
                                   int64_t I) {
  for (int64_t i = i0; i < I; ++i) {
    const float sig = 1.0f / (1.0f + exp1(-g[i]));
    const float silu = g[i] * sig;
    du[i] = d[i] * silu;
    dg[i] = d[i] * u[i] * sig * std::fma(g[i], 1.0f - sig, 1.0f);
  }
}
DS_TARGET_AVX2 void swiglu_forward_avx2(const float* g, const float* u, float* o, int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    const __m256 e = exp8(_mm256_xor_ps(gv, sign));
    _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
  }
  swiglu_forward_scalar(g, u, o, i, I);
}
DS_TARGET_AVX2 void swiglu_backward_avx2(const float* g, const float* u, const float* d, float* dg, float* du,
                                         int64_t I) {
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i), dv = _mm256_loadu_ps(d + i);
    const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_xor_ps(gv, sign))));
    _mm256_storeu_ps(du + i, _mm256_mul_ps(dv, _mm256_mul_ps(gv, sig)));
    // d * u * sig * (1 + g * (1 - sig)), in the scalar form's order
    const __m256 t = _mm256_fmadd_ps(gv, _mm256_sub_ps(one, sig), one);
    _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(dv, _mm256_loadu_ps(u + i)), sig), t));
  }
  swiglu_backward_scalar(g, u, d, dg, du, i, I);
}
}  // namespace

void swiglu_forward_row(const float* g, const float* u, float* o, int64_t I) {
  if (cpu_has_avx2()) {
    swiglu_forward_avx2(g, u, o, I);
  } else {
    swiglu_forward_scalar(g, u, o, 0, I);
  }
}
void swiglu_backward_row(const float* g, const float* u, const float* d, float* dg, float* du, int64_t I) {
  if (cpu_has_avx2()) {
    swiglu_backward_avx2(g, u, d, dg, du, I);
  } else {
    swiglu_backward_scalar(g, u, d, dg, du, 0, I);
  }
}

void swiglu_forward(Tensor out, Tensor gate_up) {
  const int64_t I = out.size(-1), N = out.numel() / I;
  const float* gu = gate_up.data<float>();
  float* op = out.data<float>();
  const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(dynamic, 16) if (N * I >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * I;
    if (avx2) {
      swiglu_forward_avx2(g, g + I, op + n * I, I);
    } else {
      swiglu_forward_scalar(g, g + I, op + n * I, 0, I);
    }
  }
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  const int64_t I = dout.size(-1), N = dout.numel() / I;
  const float* gu = gate_up.data<float>();
  const float* dp = dout.data<float>();
  float* dgu = dgate_up.data<float>();
  const bool avx2 = cpu_has_avx2();
#pragma omp parallel for schedule(dynamic, 16) if (N * I >= kParallelMinWork)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * I;
    float* dg = dgu + n * 2 * I;
    if (avx2) {
      swiglu_backward_avx2(g, g + I, dp + n * I, dg, dg + I, I);
    } else {
      swiglu_backward_scalar(g, g + I, dp + n * I, dg, dg + I, 0, I);
    }
  }
}

void add(Tensor out, Tensor a, Tensor b) {
  const int64_t n = out.numel();
  float* o = out.data<float>();
  const float* x = a.data<float>();
  const float* y = b.data<float>();
#pragma omp parallel for simd schedule(dynamic, 8192) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

void add_inplace(Tensor out, Tensor a) { add(out, out, a); }

void scale_inplace(Tensor x, float s) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(dynamic, 8192) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

void fill(Tensor x, float value) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(dynamic, 8192) if (n >= kParallelMinWork)
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

void copy(Tensor dst, Tensor src) {
  // Large copies (a layer's fp32 residual stream is 2 MiB at d=256, T=256, batch 8) in 256 KiB
  // pieces over the threads: one thread alone does not reach the memory bandwidth.
  constexpr int64_t kPiece = int64_t(1) << 18;
  const int64_t n = int64_t(src.nbytes()), pieces = (n + kPiece - 1) / kPiece;
  auto* d = static_cast<char*>(dst.raw());
  const auto* s = static_cast<const char*>(src.raw());
#pragma omp parallel for schedule(static) if (pieces >= 4)
  for (int64_t i = 0; i < pieces; ++i) {
    std::memcpy(d + i * kPiece, s + i * kPiece, size_t(std::min(kPiece, n - i * kPiece)));
  }
}

void count_non_finite(Tensor out, Tensor x) {
  const float* p = x.data<float>();
  const int64_t n = x.numel();
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) bad += std::isfinite(p[i]) ? 0 : 1;
  *out.data<int64_t>() = bad;
}

void sum_squares(Tensor out, Tensor x) {
  // Fixed chunks summed in double, then the chunk sums in order: the same bits for any
  // number of threads.
  constexpr int64_t kChunk = 1 << 14;
  const float* p = x.data<float>();
  const int64_t n = x.numel(), nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(nchunks));
#pragma omp parallel for schedule(dynamic, 1) if (nchunks > 1)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b = c * kChunk, e = std::min(n, b + kChunk);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b; i < e; ++i) s += double(p[i]) * double(p[i]);
    partial[size_t(c)] = s;
  }
  double total = 0;
  for (double s : partial) total += s;
  *out.data<double>() = total;
}

namespace {
// The update of elements [0, n) in chunks of kAdamWChunk, each chunk's updated parameters then
// written to the compute copy by `store(begin, count)` while they are still in cache (nothing
// when there is no copy). The update itself is one vector loop for every kind of copy: a 16-bit
// rounding inside it kept the compiler from vectorising it. Same order of operations as
// torch.optim.AdamW (single-tensor path); the gradient is multiplied by grad_scale as it is read
// (exact when it is 1).
constexpr int64_t kAdamWChunk = 8192;

template <class Store>
void adamw_loop(float* p, const float* g, float* m, float* v, int64_t n, const ops::AdamWStep& s, Store store) {
  const float decay = 1.0f - s.lr * s.weight_decay;
  const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  const float step_size = float(double(s.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float b1 = s.beta1, b2 = s.beta2, eps = s.eps, gs = s.grad_scale;
  const int64_t chunks = (n + kAdamWChunk - 1) / kAdamWChunk;
#pragma omp parallel for schedule(dynamic, 1) if (n >= kParallelMinWork)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t begin = c * kAdamWChunk, end = std::min(n, begin + kAdamWChunk);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const float gi = g[i] * gs;
      p[i] *= decay;
      m[i] = m[i] * b1 + gi * (1.0f - b1);
      v[i] = v[i] * b2 + gi * gi * (1.0f - b2);
      const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
      p[i] -= step_size * (m[i] / denom);
    }
    store(begin, end - begin);
  }
}
}  // namespace

// Serves every kernel slot: param, grad and the moments are fp32 (master state); the copy may be
// F32, BF16 or F16 (written chunk by chunk as the update leaves it, with no second pass over memory).
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor param_copy,
                  const ops::AdamWStep& s) {
  const int64_t n = param.numel();
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  if (!param_copy.defined()) {
    adamw_loop(p, g, m, v, n, s, [](int64_t, int64_t) {});
  } else if (param_copy.dtype() == DType::BF16) {
    // convert16's conversions: the bits of f32_to_bf16 / f32_to_f16, on the calling thread
    // inside a parallel region.
    uint16_t* c = static_cast<uint16_t*>(param_copy.raw());
    adamw_loop(p, g, m, v, n, s, [p, c](int64_t b, int64_t k) { bulk_f32_to_bf16(p + b, c + b, k); });
  } else if (param_copy.dtype() == DType::F16) {
    uint16_t* c = static_cast<uint16_t*>(param_copy.raw());
    adamw_loop(p, g, m, v, n, s, [p, c](int64_t b, int64_t k) { bulk_f32_to_f16(p + b, c + b, k); });
  } else {
    float* c = param_copy.data<float>();
    adamw_loop(p, g, m, v, n, s,
               [p, c](int64_t b, int64_t k) { std::memcpy(c + b, p + b, size_t(k) * sizeof(float)); });
  }
}

// The 16-bit slots: fp32 master state (the mixed-precision case) goes straight to the fused
// update; 16-bit state through the generic widening kernel.
void adamw_update_16bit(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor param_copy,
                        const ops::AdamWStep& s) {
  const auto f32 = [](const Tensor& t) { return t.dtype() == DType::F32; };
  if (f32(param) && f32(grad) && f32(exp_avg) && f32(exp_avg_sq)) {
    cpu::adamw_update(param, grad, exp_avg, exp_avg_sq, param_copy, s);
  } else {
    DS_CPU_WIDENED(adamw_update)(param, grad, exp_avg, exp_avg_sq, param_copy, s);
  }
}

}  // namespace dstrain::cpu

namespace dstrain::cpu {

void rope_forward(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply(x, offset, n_heads, head_dim, cos, sin, /*inverse=*/false);
}
void rope_backward(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply(dx, offset, n_heads, head_dim, cos, sin, /*inverse=*/true);
}
void rope_forward_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                              Tensor sin) {
  rope_apply_interleaved(x, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/false);
}
void rope_backward_interleaved(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                               Tensor sin) {
  rope_apply_interleaved(dx, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/true);
}

namespace {
// Element i of a floating-point tensor as fp32, and the other way.
float load(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return static_cast<const float*>(t.raw())[i];
    case DType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(t.raw())[i]);
    case DType::F16: return f16_to_f32(static_cast<const uint16_t*>(t.raw())[i]);
    default: DS_FAIL("cast: {} is not a floating-point type (F32, BF16, F16)", dtype_name(t.dtype()));
  }
}
void store(const Tensor& t, int64_t i, float v) {
  switch (t.dtype()) {
    case DType::F32: static_cast<float*>(t.raw())[i] = v; return;
    case DType::BF16: static_cast<uint16_t*>(t.raw())[i] = f32_to_bf16(v); return;
    case DType::F16: static_cast<uint16_t*>(t.raw())[i] = f32_to_f16(v); return;
    default: DS_FAIL("cast: {} is not a floating-point type (F32, BF16, F16)", dtype_name(t.dtype()));
  }
}
}  // namespace

void cast(Tensor dst, Tensor src) {
  const int64_t n = src.numel();
  if (dst.dtype() == src.dtype()) return copy(dst, src);
  // fp32 <-> 16-bit: the vectorised bulk conversions (bit for bit those of core/dtype.h).
  const DType s = src.dtype(), d = dst.dtype();
  const auto* s16 = static_cast<const uint16_t*>(src.raw());
  auto* d16 = static_cast<uint16_t*>(dst.raw());
  if (s == DType::BF16 && d == DType::F32) return bulk_bf16_to_f32(s16, dst.data<float>(), n);
  if (s == DType::F16 && d == DType::F32) return bulk_f16_to_f32(s16, dst.data<float>(), n);
  if (s == DType::F32 && d == DType::BF16) return bulk_f32_to_bf16(src.data<float>(), d16, n);
  if (s == DType::F32 && d == DType::F16) return bulk_f32_to_f16(src.data<float>(), d16, n);
  // BF16 <-> F16 (not used by dstrain's mixed precision): through fp32, element by element.
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store(dst, i, load(src, i));
}

void copy_blocks(Tensor dst, int64_t dst_offset, int64_t dst_step, Tensor src, int64_t src_offset, int64_t src_step,
                 int64_t blocks, int64_t width, bool accumulate) {
  const int64_t dcols = dst.size(-1), scols = src.size(-1);
  const int64_t rows = dcols > 0 ? dst.numel() / dcols : 0;
  if (blocks == 0 || width == 0 || rows == 0) return;
  const float* sp = src.data<float>();
  float* dp = dst.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < blocks; ++j) {
      const float* s = sp + r * scols + src_offset + j * src_step;
      float* d = dp + r * dcols + dst_offset + j * dst_step;
      if (accumulate) {
        for (int64_t i = 0; i < width; ++i) d[i] += s[i];
      } else {
        std::copy_n(s, width, d);
      }
    }
  }
}

void fill_normal(Tensor x, double std, uint64_t seed, uint64_t stream, uint64_t first_index) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = float(std * philox_normal(seed, stream, first_index + uint64_t(i)));
}

void shift_tokens(Tensor out, Tensor src, int64_t shift, int32_t fill, int32_t ignore_as) {
  const int64_t B = out.size(0), T = out.size(1);
  const int32_t* s = src.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      int32_t v = fill;
      if (t + shift < T) {
        v = s[b * T + t + shift];
        if (v == ops::kIgnoreIndex) v = ignore_as;
      }
      o[b * T + t] = v;
    }
  }
}

}  // namespace dstrain::cpu
