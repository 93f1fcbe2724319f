// The CPU backend's fused 16-bit element-wise kernels (BF16 and F16 storage, fp32 math).
//
// Each kernel reads 16-bit values as it goes (a row, or a chunk of a few thousand elements, into
// a per-thread fp32 scratch that stays in L1/L2), runs the fp32 kernel's arithmetic on them, in
// the same order and with the same expressions, and rounds once when it stores a 16-bit value.
// So element-wise results are bit for bit those of the generic widening kernel (widen.h), which
// is their reference, and reductions differ at most by the summation order of a vector loop;
// but there is no whole-tensor temporary, no allocation and no separate conversion pass.
//
// Every kernel takes any mix of F32 and the slot's 16-bit type for the tensors it handles
// directly; whatever else it is given (a 16-bit rstd, lse, norm weight...) goes to the generic
// kernel, DS_CPU_WIDENED(name), so no call ever fails here that would not fail there.
#include "backend/cpu/kernels_16bit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/vec_exp.h"
#include "backend/cpu/widen.h"

namespace dstrain::cpu {
namespace k16 {

// ---- conversion primitives ----------------------------------------------------------------

namespace {
// Rows convert with convert16.h's bulk conversions (AVX-512 BF16 or AVX2/F16C, as the CPU has,
// the same bits as the scalar rules) unless a test has switched them off to check the portable
// loops over BF16E/F16E below.
bool vector_on = true;

void load_row_vector(float* d, const uint16_t* s, DType t, int64_t n) {
  if (t == DType::BF16) {
    bulk_bf16_to_f32(s, d, n);
  } else {
    bulk_f16_to_f32(s, d, n);
  }
}
void store_row_vector(uint16_t* d, DType t, const float* s, int64_t n) {
  if (t == DType::BF16) {
    bulk_f32_to_bf16(s, d, n);
  } else {
    bulk_f32_to_f16(s, d, n);
  }
}
}  // namespace

bool set_x86_conversions(bool on) {
  const bool was = vector_on;
  vector_on = on;
  return was;
}

DS_CPU_CLONES void load_tile(float* dst, int64_t ldd, const void* src, DType st, int64_t lds, int64_t rows,
                             int64_t cols) {
  with_elem(st, [&](auto e) DS_CPU_INLINE_LAMBDA {
    using E = decltype(e);
    const typename E::S* s = static_cast<const typename E::S*>(src);
    for (int64_t r = 0; r < rows; ++r) {
      const typename E::S* sr = s + r * lds;
      float* dr = dst + r * ldd;
      if constexpr (!std::is_same_v<E, F32E>) {
        if (vector_on) {
          load_row_vector(dr, sr, st, cols);
          continue;
        }
      }
      for (int64_t c = 0; c < cols; ++c) dr[c] = E::ld(sr[c]);
    }
  });
}

DS_CPU_CLONES void store_tile(void* dst, DType dt, int64_t ldd, const float* src, int64_t lds, int64_t rows,
                              int64_t cols) {
  with_elem(dt, [&](auto e) DS_CPU_INLINE_LAMBDA {
    using E = decltype(e);
    typename E::S* d = static_cast<typename E::S*>(dst);
    for (int64_t r = 0; r < rows; ++r) {
      const float* sr = src + r * lds;
      typename E::S* dr = d + r * ldd;
      if constexpr (!std::is_same_v<E, F32E>) {
        if (vector_on) {
          store_row_vector(dr, dt, sr, cols);
          continue;
        }
      }
      if constexpr (std::is_same_v<E, F16E>) {
        constexpr int64_t kBlock = 64;
        uint32_t wide[kBlock];
        for (int64_t c0 = 0; c0 < cols; c0 += kBlock) {
          const int64_t m = std::min(kBlock, cols - c0);
          for (int64_t c = 0; c < m; ++c) wide[c] = E::st32(sr[c0 + c]);
          for (int64_t c = 0; c < m; ++c) dr[c0 + c] = uint16_t(wide[c]);
        }
      } else {
        for (int64_t c = 0; c < cols; ++c) dr[c] = E::st(sr[c]);
      }
    }
  });
}

namespace {

// Per-thread fp32 scratch rows; slot s is a separate buffer.
float* scratch(int slot, int64_t n) {
  thread_local std::vector<float> bufs[6];
  std::vector<float>& b = bufs[slot];
  if (b.size() < size_t(n)) b.resize(size_t(n));
  return b.data();
}

// A row of n values at element `offset` of t as fp32: the tensor's own memory when it is fp32,
// otherwise the values converted into scratch slot `slot`.
const float* in_row(const Tensor& t, int64_t offset, int64_t n, int slot) {
  if (t.dtype() == DType::F32) return static_cast<const float*>(t.raw()) + offset;
  float* s = scratch(slot, n);
  load_row(s, at(t.raw(), t.dtype(), offset), t.dtype(), n);
  return s;
}
// Where to compute an output row: the tensor's memory (fp32) or scratch, and (if `read`) with
// its current values. out_done stores a scratch row back.
float* out_row(const Tensor& t, int64_t offset, int64_t n, int slot, bool read) {
  if (t.dtype() == DType::F32) return static_cast<float*>(t.raw()) + offset;
  float* s = scratch(slot, n);
  if (read) load_row(s, at(t.raw(), t.dtype(), offset), t.dtype(), n);
  return s;
}
void out_done(const Tensor& t, int64_t offset, int64_t n, const float* row) {
  if (t.dtype() != DType::F32) store_row(at(t.raw(), t.dtype(), offset), t.dtype(), row, n);
}

bool floats(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (!t->defined() || !is_float(t->dtype())) return false;
  }
  return true;
}
bool f32(const Tensor& t) { return t.dtype() == DType::F32; }

constexpr int64_t kChunk = 1024;  // elements per chunk of the flat element-wise maps (3 chunks fit L1)

// ---- fp32 row arithmetic (the fp32 kernels' loops, per ISA) --------------------------------

DS_CPU_CLONES float rmsnorm_row(float* o, const float* x, const float* w, int64_t C, float eps) {
  double ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t c = 0; c < C; ++c) ss += double(x[c]) * double(x[c]);
  const float r = float(1.0 / std::sqrt(ss / double(C) + double(eps)));
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) o[c] = w[c] * (x[c] * r);
  return r;
}

DS_CPU_CLONES void rmsnorm_backward_row(float* dr, const float* gr, const float* xr, const float* wp, float r,
                                        int64_t C) {
  double dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < C; ++c) dot += double(wp[c]) * double(gr[c]) * double(xr[c]);
  const float k = float(dot / double(C)) * r * r * r;
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) dr[c] += wp[c] * gr[c] * r - xr[c] * k;
}

// part[c] += g[c] * x[c] * r: one row's terms of the norm weight's gradient.
DS_CPU_CLONES void rmsnorm_dweight_row(float* part, const float* g, const float* x, float r, int64_t C) {
#pragma omp simd
  for (int64_t c = 0; c < C; ++c) part[c] += g[c] * x[c] * r;
}

// SwiGLU's rows are the fp32 kernel's (the same exp, the same bits).
inline void swiglu_row(float* o, const float* g, const float* u, int64_t I) { swiglu_forward_row(g, u, o, I); }

inline void swiglu_backward_row(float* dg, float* du, const float* g, const float* u, const float* d, int64_t I) {
  cpu::swiglu_backward_row(g, u, d, dg, du, I);
}

DS_CPU_CLONES void rope_row(float* v, const float* c, const float* s, float sign, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = v[i], x2 = v[i + half];
    const float si = sign * s[i];
    v[i] = x1 * c[i] - x2 * si;
    v[i + half] = x2 * c[i] + x1 * si;
  }
}

// One head of DeepSeek's interleaved rotary embedding, in place (u: dim floats of scratch).
DS_CPU_INLINE void rope_interleaved_head(float* v, float* u, const float* c, const float* s, int64_t half,
                                         bool inverse) {
  if (!inverse) {
    for (int64_t i = 0; i < half; ++i) {
      u[i] = v[2 * i];
      u[half + i] = v[2 * i + 1];
    }
    for (int64_t i = 0; i < half; ++i) {
      const float u1 = u[i], u2 = u[half + i];
      v[i] = u1 * c[i] - u2 * s[i];
      v[half + i] = u2 * c[i] + u1 * s[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float g1 = v[i], g2 = v[half + i];
      u[2 * i] = g1 * c[i] + g2 * s[i];
      u[2 * i + 1] = g2 * c[i] - g1 * s[i];
    }
    std::copy(u, u + 2 * half, v);
  }
}

// Every head of one row (x: its first head, element type dt), each read into v, rotated and
// rounded back: one call per row, as the heads are short (DeepSeek's rope dim is 64 or less).
DS_CPU_CLONES void rope_interleaved_row(void* x, DType dt, int n_heads, int64_t head_stride, int64_t half,
                                        const float* c, const float* s, bool inverse, float* v, float* u) {
  with_elem(dt, [&](auto e) DS_CPU_INLINE_LAMBDA {
    using E = decltype(e);
    for (int h = 0; h < n_heads; ++h) {
      typename E::S* xh = static_cast<typename E::S*>(x) + int64_t(h) * head_stride;
      if constexpr (!std::is_same_v<E, F32E>) {
        if (vector_on) {
          load_row_vector(v, xh, dt, 2 * half);
          rope_interleaved_head(v, u, c, s, half, inverse);
          store_row_vector(xh, dt, v, 2 * half);
          continue;
        }
      }
      for (int64_t i = 0; i < 2 * half; ++i) v[i] = E::ld(xh[i]);
      rope_interleaved_head(v, u, c, s, half, inverse);
      for (int64_t i = 0; i < 2 * half; ++i) xh[i] = E::st(v[i]);
    }
  });
}

DS_CPU_CLONES void add_row(float* o, const float* x, const float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) o[i] = x[i] + y[i];
}

DS_CPU_CLONES void scale_row(float* p, float s, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) p[i] *= s;
}

// d[c] += src[c] (element type st), for c < n.
DS_CPU_CLONES void accumulate_row(float* d, const void* src, DType st, int64_t n) {
  with_elem(st, [&](auto e) DS_CPU_INLINE_LAMBDA {
    using E = decltype(e);
    const typename E::S* g = static_cast<const typename E::S*>(src);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) d[c] += E::ld(g[c]);
  });
}

// a[c] += w * y[c] (element type yt).
DS_CPU_CLONES void axpy_row(float* a, float w, const void* y, DType yt, int64_t n) {
  with_elem(yt, [&](auto e) DS_CPU_INLINE_LAMBDA {
    using E = decltype(e);
    const typename E::S* yp = static_cast<const typename E::S*>(y);
#pragma omp simd
    for (int64_t c = 0; c < n; ++c) a[c] += w * E::ld(yp[c]);
  });
}

// dy[c] = w * d[c]; returns the sum of d[c] * y[c] (the fp32 kernel's loop).
DS_CPU_CLONES float scale_dot_row(float* dy, float w, const float* d, const float* y, int64_t C) {
  float dot = 0;
#pragma omp simd reduction(+ : dot)
  for (int64_t c = 0; c < C; ++c) {
    dy[c] = w * d[c];
    dot += d[c] * y[c];
  }
  return dot;
}

// dst = src between any two of the float types; same type: a byte copy.
void convert_row(void* dst, DType dt, const void* src, DType st, int64_t n) {
  if (dt == st) {
    std::memcpy(dst, src, size_t(n) * dtype_size(dt));
  } else if (st == DType::F32) {
    store_row(dst, dt, static_cast<const float*>(src), n);
  } else if (dt == DType::F32) {
    load_row(static_cast<float*>(dst), src, st, n);
  } else {
    for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
      const int64_t m = std::min(kChunk, n - i0);
      float* s = scratch(5, m);
      load_row(s, at(src, st, i0), st, m);
      store_row(at(dst, dt, i0), dt, s, m);
    }
  }
}

}  // namespace
}  // namespace k16

using namespace k16;

// ---- RMSNorm ------------------------------------------------------------------------------

void rmsnorm_forward_16bit(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps) {
  if (!floats({&out, &x}) || !f32(rstd) || !f32(weight)) {
    return DS_CPU_WIDENED(rmsnorm_forward)(out, rstd, x, weight, eps);
  }
  const int64_t C = x.size(-1), N = x.numel() / C;
  const float* wp = weight.data<float>();
  float* rp = rstd.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = in_row(x, n * C, C, 0);
    float* o = out_row(out, n * C, C, 1, false);
    rp[n] = rmsnorm_row(o, xr, wp, C, eps);
    out_done(out, n * C, C, o);
  }
}

void rmsnorm_backward_16bit(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd) {
  if (!floats({&dx, &dout, &x}) || !f32(dweight) || !f32(weight) || !f32(rstd)) {
    return DS_CPU_WIDENED(rmsnorm_backward)(dx, dweight, dout, x, weight, rstd);
  }
  const int64_t C = x.size(-1), N = x.numel() / C;
  const float* wp = weight.data<float>();
  const float* rp = rstd.data<float>();
  // dweight in the same pass as dx, while the rows are in cache: a partial sum per chunk of
  // kRows rows (rows in order), then the chunks' sums in order. Fixed chunks: the result does not
  // depend on the thread count.
  constexpr int64_t kRows = 64;
  const int64_t chunks = (N + kRows - 1) / kRows;
  thread_local std::vector<float> partial_buf;
  if (partial_buf.size() < size_t(chunks * C)) partial_buf.resize(size_t(chunks * C));
  float* partial = partial_buf.data();
#pragma omp parallel for schedule(static)
  for (int64_t ch = 0; ch < chunks; ++ch) {
    float* part = partial + ch * C;
    std::fill_n(part, C, 0.0f);
    for (int64_t n = ch * kRows; n < std::min(N, (ch + 1) * kRows); ++n) {
      const float* xr = in_row(x, n * C, C, 0);
      const float* gr = in_row(dout, n * C, C, 1);
      float* dr = out_row(dx, n * C, C, 2, true);
      rmsnorm_backward_row(dr, gr, xr, wp, rp[n], C);
      out_done(dx, n * C, C, dr);
      rmsnorm_dweight_row(part, gr, xr, rp[n], C);
    }
  }
  float* dwp = dweight.data<float>();
  for (int64_t ch = 1; ch < chunks; ++ch) add_row(partial, partial, partial + ch * C, C);
  add_row(dwp, dwp, partial, C);
}

// ---- rotary embedding -----------------------------------------------------------------------

namespace {
void rope_16bit(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin, bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), half = head_dim / 2;
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
  const float sign = inverse ? -1.0f : 1.0f;
  const int64_t width = int64_t(n_heads) * head_dim;
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    float* v = out_row(x, bt * W + offset, width, 0, true);
    for (int h = 0; h < n_heads; ++h) rope_row(v + int64_t(h) * head_dim, cp + t * half, sp + t * half, sign, half);
    out_done(x, bt * W + offset, width, v);
  }
}

void rope_interleaved_16bit(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                            Tensor sin, bool inverse) {
  const int64_t B = x.size(0), T = x.size(1), W = x.size(2), half = dim / 2;
  const float* cp = cos.data<float>();
  const float* sp = sin.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t t = bt % T;
    rope_interleaved_row(at(x.raw(), x.dtype(), bt * W + offset), x.dtype(), n_heads, head_stride, half,
                         cp + t * half, sp + t * half, inverse, scratch(0, dim), scratch(1, dim));
  }
}

bool rope_tables_f32(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  return x.defined() && is_float(x.dtype()) && f32(cos) && f32(sin);
}
}  // namespace

void rope_forward_16bit(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  if (!rope_tables_f32(x, cos, sin)) return DS_CPU_WIDENED(rope_forward)(x, offset, n_heads, head_dim, cos, sin);
  rope_16bit(x, offset, n_heads, head_dim, cos, sin, false);
}
void rope_backward_16bit(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  if (!rope_tables_f32(dx, cos, sin)) return DS_CPU_WIDENED(rope_backward)(dx, offset, n_heads, head_dim, cos, sin);
  rope_16bit(dx, offset, n_heads, head_dim, cos, sin, true);
}
void rope_forward_interleaved_16bit(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                                    Tensor sin) {
  if (!rope_tables_f32(x, cos, sin)) {
    return DS_CPU_WIDENED(rope_forward_interleaved)(x, offset, n_heads, head_stride, dim, cos, sin);
  }
  rope_interleaved_16bit(x, offset, n_heads, head_stride, dim, cos, sin, false);
}
void rope_backward_interleaved_16bit(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                                     Tensor sin) {
  if (!rope_tables_f32(dx, cos, sin)) {
    return DS_CPU_WIDENED(rope_backward_interleaved)(dx, offset, n_heads, head_stride, dim, cos, sin);
  }
  rope_interleaved_16bit(dx, offset, n_heads, head_stride, dim, cos, sin, true);
}

// ---- SwiGLU ---------------------------------------------------------------------------------

namespace {
#if defined(__x86_64__)
// All-bf16 SwiGLU on AVX-512 (F, BW, VL): bf16 widened and rounded in registers, sixteen lanes at
// a time with a masked tail, and between them the AVX2 kernels' arithmetic (elementwise.cpp)
// instruction for instruction, exp16 for exp8: the same bits as the row path through fp32 scratch.
// GCC 12 warns inside its own AVX-512 headers (_mm512_undefined_*: GCC bug 105593).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define DS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))

DS_AVX512 inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1u);
}
DS_AVX512 inline __m512 load_bf16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// BF16E::st on sixteen lanes: nearest even, NaN quiet (denormals rounded too, unlike vcvtneps2bf16).
DS_AVX512 inline void store_bf16(uint16_t* p, __m512 x, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1))));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

DS_AVX512 void swiglu_forward_bf16_row(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = tail_mask(I - i);
    const __m512 gv = load_bf16(g + i, m);
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign)));
    store_bf16(o + i, _mm512_mul_ps(_mm512_div_ps(gv, _mm512_add_ps(one, e)), load_bf16(u + i, m)), m);
  }
}

DS_AVX512 void swiglu_backward_bf16_row(const uint16_t* g, const uint16_t* u, const uint16_t* d, uint16_t* dg,
                                        uint16_t* du, int64_t I) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512i sign = _mm512_set1_epi32(int(0x80000000u));
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 m = tail_mask(I - i);
    const __m512 gv = load_bf16(g + i, m), dv = load_bf16(d + i, m);
    const __m512 e = exp16(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gv), sign)));
    const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, e));
    store_bf16(du + i, _mm512_mul_ps(dv, _mm512_mul_ps(gv, sig)), m);
    const __m512 t = _mm512_fmadd_ps(gv, _mm512_sub_ps(one, sig), one);
    store_bf16(dg + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dv, load_bf16(u + i, m)), sig), t), m);
  }
}
#undef DS_AVX512
#pragma GCC diagnostic pop

// Whether the all-bf16 rows above run: AVX-512 F/BW/VL on this CPU, the AVX2 kernels they
// mirror on (vec_exp.h), and the vector conversions not switched off by a test.
bool bf16_rows_avx512() {
  static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl");
  return cpu && cpu_has_avx2() && vector_on;
}
#else
bool bf16_rows_avx512() { return false; }
#endif

uint16_t* bf16_at(const Tensor& t, int64_t offset) { return static_cast<uint16_t*>(t.raw()) + offset; }
bool all_bf16(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->dtype() != DType::BF16) return false;
  }
  return true;
}
}  // namespace

void swiglu_forward_16bit(Tensor out, Tensor gate_up) {
  if (!floats({&out, &gate_up})) return DS_CPU_WIDENED(swiglu_forward)(out, gate_up);
  const int64_t I = out.size(-1), N = out.numel() / I;
#if defined(__x86_64__)
  if (all_bf16({&out, &gate_up}) && bf16_rows_avx512()) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* g = bf16_at(gate_up, n * 2 * I);
      swiglu_forward_bf16_row(g, g + I, bf16_at(out, n * I), I);
    }
    return;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = in_row(gate_up, n * 2 * I, 2 * I, 0);
    float* o = out_row(out, n * I, I, 1, false);
    swiglu_row(o, g, g + I, I);
    out_done(out, n * I, I, o);
  }
}

void swiglu_backward_16bit(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  if (!floats({&dgate_up, &dout, &gate_up})) return DS_CPU_WIDENED(swiglu_backward)(dgate_up, dout, gate_up);
  const int64_t I = dout.size(-1), N = dout.numel() / I;
#if defined(__x86_64__)
  if (all_bf16({&dgate_up, &dout, &gate_up}) && bf16_rows_avx512()) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      const uint16_t* g = bf16_at(gate_up, n * 2 * I);
      uint16_t* dg = bf16_at(dgate_up, n * 2 * I);
      swiglu_backward_bf16_row(g, g + I, bf16_at(dout, n * I), dg, dg + I, I);
    }
    return;
  }
#endif
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* g = in_row(gate_up, n * 2 * I, 2 * I, 0);
    const float* d = in_row(dout, n * I, I, 1);
    float* dg = out_row(dgate_up, n * 2 * I, 2 * I, 2, false);
    swiglu_backward_row(dg, dg + I, g, g + I, d, I);
    out_done(dgate_up, n * 2 * I, 2 * I, dg);
  }
}

// ---- element-wise arithmetic, fills and copies ----------------------------------------------

void add_16bit(Tensor out, Tensor a, Tensor b) {
  if (!floats({&out, &a, &b})) return DS_CPU_WIDENED(add)(out, a, b);
  const int64_t n = out.numel();
  // Chunks are read before they are written: out may alias a or b.
#pragma omp parallel for schedule(static)
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    const float* x = in_row(a, i0, m, 0);
    const float* y = in_row(b, i0, m, 1);
    float* o = out_row(out, i0, m, 2, false);
    add_row(o, x, y, m);
    out_done(out, i0, m, o);
  }
}

void add_inplace_16bit(Tensor out, Tensor a) { add_16bit(out, out, a); }

void scale_inplace_16bit(Tensor x, float s) {
  if (!floats({&x})) return DS_CPU_WIDENED(scale_inplace)(x, s);
  const int64_t n = x.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i0 = 0; i0 < n; i0 += kChunk) {
    const int64_t m = std::min(kChunk, n - i0);
    float* p = out_row(x, i0, m, 0, true);
    scale_row(p, s, m);
    out_done(x, i0, m, p);
  }
}

void fill_16bit(Tensor x, float value) {
  if (!floats({&x}) || f32(x)) return DS_CPU_WIDENED(fill)(x, value);
  const uint16_t bits = x.dtype() == DType::BF16 ? BF16E::st(value) : F16E::st(value);
  uint16_t* p = static_cast<uint16_t*>(x.raw());
  const int64_t n = x.numel();
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) p[i] = bits;
}

void copy_blocks_16bit(Tensor dst, int64_t dst_offset, int64_t dst_step, Tensor src, int64_t src_offset,
                       int64_t src_step, int64_t blocks, int64_t width, bool accumulate) {
  if (!floats({&dst, &src})) {
    return DS_CPU_WIDENED(copy_blocks)(dst, dst_offset, dst_step, src, src_offset, src_step, blocks, width,
                                       accumulate);
  }
  const int64_t dcols = dst.size(-1), scols = src.size(-1);
  const int64_t rows = dcols > 0 ? dst.numel() / dcols : 0;
  if (blocks == 0 || width == 0 || rows == 0) return;
  const DType dt = dst.dtype(), st = src.dtype();
  // The dst columns the blocks cover, [lo, hi): accumulation runs over them in fp32 and rounds
  // once, also when several blocks sum into one place.
  const int64_t lo = dst_offset, hi = dst_offset + (blocks - 1) * dst_step + width;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows; ++r) {
    if (!accumulate) {
      for (int64_t j = 0; j < blocks; ++j) {
        convert_row(at(dst.raw(), dt, r * dcols + dst_offset + j * dst_step), dt,
                    at(src.raw(), st, r * scols + src_offset + j * src_step), st, width);
      }
      continue;
    }
    float* d = out_row(dst, r * dcols + lo, hi - lo, 0, true);
    for (int64_t j = 0; j < blocks; ++j) {
      accumulate_row(d + j * dst_step, at(src.raw(), st, r * scols + src_offset + j * src_step), st, width);
    }
    if (!f32(dst)) {
      for (int64_t j = 0; j < blocks; ++j) {
        store_row(at(dst.raw(), dt, r * dcols + lo + j * dst_step), dt, d + j * dst_step, width);
      }
    }
  }
}

// ---- mixture of experts: permutation to expert order and back ------------------------------

namespace {
int64_t rows_of(const Tensor& t) { return t.numel() / t.size(-1); }
}  // namespace

void moe_permute_16bit(Tensor xg, Tensor x, Tensor sorted, int top_k) {
  if (!floats({&xg, &x})) return DS_CPU_WIDENED(moe_permute)(xg, x, sorted, top_k);
  const int64_t C = x.size(-1), M = sorted.numel();
  const int32_t* sp = sorted.data<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < M; ++p) {
    convert_row(at(xg.raw(), xg.dtype(), p * C), xg.dtype(), at(x.raw(), x.dtype(), int64_t(sp[p] / top_k) * C),
                x.dtype(), C);
  }
}

void moe_permute_backward_16bit(Tensor dx, Tensor dxg, Tensor position, bool accumulate) {
  if (!floats({&dx, &dxg})) return DS_CPU_WIDENED(moe_permute_backward)(dx, dxg, position, accumulate);
  const int64_t C = dx.size(-1), N = rows_of(dx), M = position.numel(), k = M / N;
  const int32_t* pp = position.data<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float* d = out_row(dx, n * C, C, 0, accumulate);
    if (!accumulate) std::fill(d, d + C, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (pp[n * k + j] < 0) continue;  // dropped
      accumulate_row(d, at(dxg.raw(), dxg.dtype(), int64_t(pp[n * k + j]) * C), dxg.dtype(), C);
    }
    out_done(dx, n * C, C, d);
  }
}

void moe_unpermute_16bit(Tensor out, Tensor yg, Tensor weights, Tensor position) {
  if (!floats({&out, &yg, &weights})) return DS_CPU_WIDENED(moe_unpermute)(out, yg, weights, position);
  const int64_t C = out.size(-1), N = rows_of(out), M = position.numel(), k = M / N;
  const int32_t* pp = position.data<int32_t>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    // The routed sum first, then onto out: the order Hugging Face adds them in.
    float* a = scratch(0, C);
    std::fill(a, a + C, 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      if (pp[n * k + j] < 0) continue;  // dropped
      axpy_row(a, load1(weights, n * k + j), at(yg.raw(), yg.dtype(), int64_t(pp[n * k + j]) * C), yg.dtype(), C);
    }
    float* o = out_row(out, n * C, C, 1, true);
    add_row(o, o, a, C);
    out_done(out, n * C, C, o);
  }
}

void moe_unpermute_backward_16bit(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted) {
  if (!floats({&dyg, &dweights, &dout, &yg, &weights})) {
    return DS_CPU_WIDENED(moe_unpermute_backward)(dyg, dweights, dout, yg, weights, sorted);
  }
  const int64_t C = dout.size(-1), N = rows_of(dout), M = weights.numel(), k = M / N, R = sorted.numel();
  const int32_t* sp = sorted.data<int32_t>();
  if (R < M) {
    for (int64_t i = 0; i < M; ++i) store1(dweights, i, 0.0f);  // the dropped pairs' weights had no effect
  }
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < R; ++p) {
    const int64_t pair = sp[p];
    const float* d = in_row(dout, (pair / k) * C, C, 0);
    const float* y = in_row(yg, p * C, C, 1);
    float* dy = out_row(dyg, p * C, C, 2, false);
    store1(dweights, pair, scale_dot_row(dy, load1(weights, pair), d, y, C));
    out_done(dyg, p * C, C, dy);
  }
}

// ---- registration ---------------------------------------------------------------------------

void fill_elementwise_16bit(OpTable& t) {
  for (KernelDType k : {KernelDType::BF16, KernelDType::F16}) {
    const size_t s = size_t(k);
    t.attention_forward[s] = &attention_forward_16bit;
    t.attention_backward[s] = &attention_backward_16bit;
    t.rmsnorm_forward[s] = &rmsnorm_forward_16bit;
    t.rmsnorm_backward[s] = &rmsnorm_backward_16bit;
    t.swiglu_forward[s] = &swiglu_forward_16bit;
    t.swiglu_backward[s] = &swiglu_backward_16bit;
    t.rope_forward[s] = &rope_forward_16bit;
    t.rope_backward[s] = &rope_backward_16bit;
    t.rope_forward_interleaved[s] = &rope_forward_interleaved_16bit;
    t.rope_backward_interleaved[s] = &rope_backward_interleaved_16bit;
    t.moe_permute[s] = &moe_permute_16bit;
    t.moe_permute_backward[s] = &moe_permute_backward_16bit;
    t.moe_unpermute[s] = &moe_unpermute_16bit;
    t.moe_unpermute_backward[s] = &moe_unpermute_backward_16bit;
    t.add[s] = &add_16bit;
    t.add_inplace[s] = &add_inplace_16bit;
    t.scale_inplace[s] = &scale_inplace_16bit;
    t.fill[s] = &fill_16bit;
    t.copy_blocks[s] = &copy_blocks_16bit;
  }
}

}  // namespace dstrain::cpu
