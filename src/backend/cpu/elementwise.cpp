// Rotary embedding, SwiGLU, elementwise arithmetic, reductions and AdamW on the CPU.
#include <cmath>
#include <cstring>
#include <vector>

#include "backend/cpu/cpu_ops.h"

namespace dstrain::cpu {

void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta) {
  const int64_t T = cos.size(0), half = head_dim / 2;
  DS_CHECK(head_dim % 2 == 0 && cos.size(1) == half && sin.numel() == cos.numel(),
           "rope_tables: head_dim {} with table {}", head_dim, cos.shape().str());
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
  DS_CHECK(x.ndim() == 3, "rope: expected (B, T, W), got {}", x.shape().str());
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), half = head_dim / 2;
  DS_CHECK(offset + int64_t(n_heads) * head_dim <= W && cos.size(0) >= T && cos.size(1) == half,
           "rope: {} heads of {} at column {} do not fit rows of {} / tables {}", n_heads, head_dim, offset, W,
           cos.shape().str());
  float* xp = x.data<float>();
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  const float sign = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static)
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

void swiglu_forward(Tensor out, Tensor gate_up) {
  const int64_t I = out.size(-1), N = out.numel() / I;
  DS_CHECK(gate_up.numel() == 2 * N * I, "swiglu_forward: gate_up {} for out {}", gate_up.shape().str(),
           out.shape().str());
  const float* gu = gate_up.data<float>();
  float* op = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * I;
    const float* u = g + I;
    float* o = op + n * I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  const int64_t I = dout.size(-1), N = dout.numel() / I;
  DS_CHECK(gate_up.numel() == 2 * N * I && dgate_up.numel() == 2 * N * I, "swiglu_backward: shape mismatch");
  const float* gu = gate_up.data<float>();
  const float* dp = dout.data<float>();
  float* dgu = dgate_up.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = gu + n * 2 * I;
    const float* u = g + I;
    const float* d = dp + n * I;
    float* dg = dgu + n * 2 * I;
    float* du = dg + I;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float sig = 1.0f / (1.0f + std::exp(-g[i]));
      const float silu = g[i] * sig;
      du[i] = d[i] * silu;
      dg[i] = d[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
    }
  }
}

void add(Tensor out, Tensor a, Tensor b) {
  const int64_t n = out.numel();
  DS_CHECK(a.numel() == n && b.numel() == n, "add: sizes {} {} {}", out.numel(), a.numel(), b.numel());
  float* o = out.data<float>();
  const float* x = a.data<float>();
  const float* y = b.data<float>();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

void add_inplace(Tensor out, Tensor a) { add(out, out, a); }

void scale_inplace(Tensor x, float s) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

void fill(Tensor x, float value) {
  float* p = x.data<float>();
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = value;
}

void copy(Tensor dst, Tensor src) {
  DS_CHECK(dst.nbytes() == src.nbytes(), "copy: {} bytes into {}", src.nbytes(), dst.nbytes());
  std::memcpy(dst.raw(), src.raw(), src.nbytes());
}

int64_t count_non_finite(Tensor x) {
  DS_CHECK(x.dtype() == DType::F32, "count_non_finite: {} tensor, expected f32", dtype_name(x.dtype()));
  const float* p = x.data<float>();
  const int64_t n = x.numel();
  int64_t bad = 0;
#pragma omp parallel for reduction(+ : bad) schedule(static)
  for (int64_t i = 0; i < n; ++i) bad += std::isfinite(p[i]) ? 0 : 1;
  return bad;
}

double sum_squares(Tensor x) {
  // Fixed chunks summed in double, then the chunk sums in order: the same bits for any
  // number of threads.
  constexpr int64_t kChunk = 1 << 14;
  const float* p = x.data<float>();
  const int64_t n = x.numel(), nchunks = (n + kChunk - 1) / kChunk;
  std::vector<double> partial(static_cast<size_t>(nchunks));
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t b = c * kChunk, e = std::min(n, b + kChunk);
    double s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t i = b; i < e; ++i) s += double(p[i]) * double(p[i]);
    partial[size_t(c)] = s;
  }
  double total = 0;
  for (double s : partial) total += s;
  return total;
}

void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const ops::AdamWStep& s) {
  const int64_t n = param.numel();
  DS_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n, "adamw_update: size mismatch");
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* m = exp_avg.data<float>();
  float* v = exp_avg_sq.data<float>();
  // Same order of operations as torch.optim.AdamW (single-tensor path).
  const float decay = 1.0f - s.lr * s.weight_decay;
  const double bc1 = 1.0 - std::pow(double(s.beta1), double(s.step));
  const double bc2 = 1.0 - std::pow(double(s.beta2), double(s.step));
  const float step_size = float(double(s.lr) / bc1);
  const float bc2_sqrt = float(std::sqrt(bc2));
  const float b1 = s.beta1, b2 = s.beta2, eps = s.eps;
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    p[i] *= decay;
    m[i] = m[i] * b1 + g[i] * (1.0f - b1);
    v[i] = v[i] * b2 + g[i] * g[i] * (1.0f - b2);
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    p[i] -= step_size * (m[i] / denom);
  }
}

}  // namespace dstrain::cpu
