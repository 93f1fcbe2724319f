// The CPU backend's 16-bit GEMMs (backend/cpu/gemm16.h) and bulk conversions
// (backend/cpu/convert16.h).
// - Conversions: every implementation this CPU can run, bit for bit against the scalar
//   conversions of core/dtype.h on all 65536 16-bit patterns and on fp32 edge values (ties,
//   NaNs with payloads, infinities, denormals, f16 overflow), at odd lengths and offsets.
// - linear_forward / linear_backward of the BF16 and F16 slots: every mix of operand dtypes the
//   contract allows (backend/ops.def), accumulate on and off, odd shapes, on every GEMM path this
//   CPU can run, against the fp32 kernel on the same rounded inputs. Tolerance relative to the
//   largest reference value: 16-bit outputs bf16 1e-2 / f16 2e-3; fp32 outputs (from inputs that
//   are exact in fp32) 1e-5, which a 16-bit rounding of dw or of an fp32 output would fail.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/sgemm.h"
#include "backend/ops.h"
#include "core/dtype.h"

namespace dstrain {
namespace {

using cpu::ConvertIsa;

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

std::vector<ConvertIsa> runnable_isas() {
  std::vector<ConvertIsa> v;
  for (ConvertIsa i : {ConvertIsa::kScalar, ConvertIsa::kAvx2, ConvertIsa::kAvx512Bf16}) {
    if (cpu::convert16_isa_supported(i)) v.push_back(i);
  }
  return v;
}

struct IsaScope {  // restores the run-time choice
  explicit IsaScope(ConvertIsa i) { cpu::set_convert16_isa(i); }
  ~IsaScope() { cpu::set_convert16_isa(ConvertIsa::kAuto); }
};

// fp32 inputs that exercise every rounding case of both 16-bit formats.
std::vector<float> edge_floats() {
  std::vector<float> v;
  // Every 16-bit value, its neighbours and the midpoints (ties) to the next one, both formats.
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    for (float x : {bf16_to_f32(uint16_t(h)), f16_to_f32(uint16_t(h))}) {
      const uint32_t u = bits_of(x);
      v.push_back(x);
      v.push_back(from_bits(u + 1));
      v.push_back(from_bits(u - 1));
    }
    const uint32_t b = uint32_t(h) << 16;
    v.push_back(from_bits(b | 0x8000u));  // bf16 tie
    v.push_back(from_bits(b | 0x7fffu));
    v.push_back(from_bits(b | 0x8001u));
    if ((h & 0x7c00u) != 0x7c00u && (h & 0x7fffu) != 0x7bffu) {  // f16 tie between h and h+1
      const double a = f16_to_f32(uint16_t(h)), c = f16_to_f32(uint16_t(h + 1));
      v.push_back(float((a + c) / 2));
    }
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (float x : {0.0f, -0.0f, inf, -inf, std::numeric_limits<float>::max(), -std::numeric_limits<float>::max(),
                  std::numeric_limits<float>::min(), std::numeric_limits<float>::denorm_min(), 65504.0f, 65519.99f,
                  65520.0f, -65520.0f, 65536.0f, 1e10f, std::ldexp(1.0f, -24), std::ldexp(1.0f, -25),
                  std::ldexp(3.0f, -25), std::ldexp(1.0f, -26), std::ldexp(1.0f, -14), std::ldexp(1023.5f, -24)}) {
    v.push_back(x);
  }
  // NaNs: quiet and signalling, both signs, payloads in the bits bf16 / f16 keep and drop.
  for (uint32_t u : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fa00000u, 0x7f810000u, 0x7fbfffffu,
                     0xffffffffu, 0x7fffffffu, 0x7f802000u, 0x7fc0deadu}) {
    v.push_back(from_bits(u));
  }
  // Denormals of every size, and random bit patterns.
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) v.push_back(from_bits(rng() & 0x807fffffu));
  for (int i = 0; i < 600000; ++i) v.push_back(from_bits(rng()));  // over 1M in all: splits over threads
  return v;
}

// Runs `bulk` on slices of `n` at odd offsets and lengths, and once on everything (which splits
// over the threads), comparing each element with `scalar`.
template <class S, class D, class Bulk, class Scalar>
void expect_bulk_matches(const std::vector<S>& in, Bulk bulk, Scalar scalar, const char* what) {
  std::vector<D> out(in.size() + 64);
  for (size_t off : {size_t(0), size_t(1), size_t(7)}) {
    for (size_t len : {size_t(0), size_t(1), size_t(7), size_t(15), size_t(31), size_t(33), size_t(1000),
                       in.size() - off}) {
      std::fill(out.begin(), out.end(), D(0x55));
      bulk(in.data() + off, out.data(), int64_t(len));
      for (size_t i = 0; i < len; ++i) {
        const auto want = scalar(in[off + i]);
        D got = out[i];
        uint64_t gb = 0, wb = 0;
        std::memcpy(&gb, &got, sizeof(D));
        std::memcpy(&wb, &want, sizeof(D));
        ASSERT_EQ(gb, wb) << what << " at " << (off + i) << " (input bits 0x" << std::hex
                          << uint64_t([&] {
                               uint64_t b = 0;
                               std::memcpy(&b, &in[off + i], sizeof(S));
                               return b;
                             }())
                          << ")";
      }
      ASSERT_EQ(out[len], D(0x55)) << what << ": wrote past the end";
    }
  }
}

TEST(Convert16, WideningEverySixteenBitPatternMatchesScalar) {
  std::vector<uint16_t> all(0x10000 * 17);  // 17 times over: long enough to split over threads
  for (size_t i = 0; i < all.size(); ++i) all[i] = uint16_t(i);
  for (ConvertIsa isa : runnable_isas()) {
    IsaScope scope(isa);
    SCOPED_TRACE(std::string(cpu::convert16_isa_name()));
    expect_bulk_matches<uint16_t, float>(all, cpu::bulk_bf16_to_f32, bf16_to_f32, "bf16->f32");
    expect_bulk_matches<uint16_t, float>(all, cpu::bulk_f16_to_f32, f16_to_f32, "f16->f32");
  }
}

TEST(Convert16, NarrowingEdgeValuesMatchesScalar) {
  const std::vector<float> xs = edge_floats();
  ASSERT_GT(xs.size(), size_t(1) << 20);
  for (ConvertIsa isa : runnable_isas()) {
    IsaScope scope(isa);
    SCOPED_TRACE(std::string(cpu::convert16_isa_name()));
    expect_bulk_matches<float, uint16_t>(xs, cpu::bulk_f32_to_bf16, static_cast<uint16_t (*)(float)>(f32_to_bf16),
                                         "f32->bf16");
    expect_bulk_matches<float, uint16_t>(xs, cpu::bulk_f32_to_f16, static_cast<uint16_t (*)(float)>(f32_to_f16),
                                         "f32->f16");
  }
}

// A block of otherwise normal values holding one denormal (the case AVX-512 BF16's conversion
// instruction gets wrong by flushing it) and NaN payloads (F16C keeps them; dtype.h does not).
TEST(Convert16, DenormalsAndNanPayloadsInsideVectorBlocks) {
  std::vector<float> xs(64, 1.5f);
  xs[5] = from_bits(0x00018000u);   // denormal tie: bf16 0x0002
  xs[40] = from_bits(0x807fffffu);  // largest denormal: -FLT_MIN in bf16
  xs[20] = from_bits(0x7fc0deadu);  // NaN with payload
  xs[50] = from_bits(0xff800001u);  // signalling NaN
  for (ConvertIsa isa : runnable_isas()) {
    IsaScope scope(isa);
    SCOPED_TRACE(std::string(cpu::convert16_isa_name()));
    std::vector<uint16_t> b(64), h(64);
    cpu::bulk_f32_to_bf16(xs.data(), b.data(), 64);
    cpu::bulk_f32_to_f16(xs.data(), h.data(), 64);
    EXPECT_EQ(b[5], 0x0002);
    EXPECT_EQ(b[40], 0x8080);
    EXPECT_EQ(b[20], f32_to_bf16(xs[20]));
    EXPECT_EQ(h[20], 0x7e00);
    EXPECT_EQ(h[50], 0xfe00);
    std::vector<float> back(64);
    std::vector<uint16_t> snan(16, 0x3c00);
    snan[3] = 0x7c01;  // f16 signalling NaN: f16_to_f32 keeps the payload without the quiet bit
    cpu::bulk_f16_to_f32(snan.data(), back.data(), 16);
    EXPECT_EQ(bits_of(back[3]), bits_of(f16_to_f32(0x7c01)));
    EXPECT_EQ(back[0], 1.0f);
  }
}

// ops::cast between fp32 and each 16-bit type (the weights' compute copy refresh) gives the
// scalar conversions' bits.
TEST(Convert16, CastUsesExactConversions) {
  const std::vector<float> xs = edge_floats();
  const auto n = int64_t(xs.size());
  for (DType dt : {DType::BF16, DType::F16}) {
    std::vector<uint16_t> half(xs.size());
    std::vector<float> back(xs.size());
    cpu::cast(Tensor(half.data(), dt, Shape{n}), Tensor(const_cast<float*>(xs.data()), DType::F32, Shape{n}));
    cpu::cast(Tensor(back.data(), DType::F32, Shape{n}), Tensor(half.data(), dt, Shape{n}));
    for (int64_t i = 0; i < n; ++i) {
      const float x = xs[size_t(i)];
      const uint16_t want = dt == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x);
      ASSERT_EQ(half[size_t(i)], want) << dtype_name(dt) << " element " << i;
      const float wb = dt == DType::BF16 ? bf16_to_f32(want) : f16_to_f32(want);
      ASSERT_EQ(bits_of(back[size_t(i)]), bits_of(wb)) << dtype_name(dt) << " element " << i;
    }
  }
}

// ---- GEMMs ---------------------------------------------------------------------------------

// A matrix with values exact in `half` (uniform in [-1, 1], rounded), stored as `dt`.
struct Mat {
  DType dt;
  Shape shape;
  std::vector<float> f;      // the values (fp32 reference copy)
  std::vector<uint16_t> h;  // the 16-bit storage when dt is 16-bit
  std::vector<float> store; // the fp32 storage when dt is F32

  Mat(DType d, DType half, Shape s, std::mt19937& rng) : dt(d), shape(s), f(size_t(s.numel())) {
    uint64_t state = rng() | (uint64_t(rng()) << 32);
    for (float& x : f) {  // uniform in [-1, 1), from a cheap generator seeded by rng
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      x = round16(half, float(int32_t(state >> 32)) * (1.0f / 2147483648.0f));
    }
    if (dt == DType::F32) {
      store = f;
    } else {
      h.resize(f.size());
      for (size_t i = 0; i < f.size(); ++i) h[i] = dt == DType::BF16 ? f32_to_bf16(f[i]) : f32_to_f16(f[i]);
    }
  }
  static float round16(DType half, float x) {
    return half == DType::BF16 ? bf16_to_f32(f32_to_bf16(x)) : f16_to_f32(f32_to_f16(x));
  }
  Tensor t() { return dt == DType::F32 ? Tensor(store.data(), dt, shape) : Tensor(h.data(), dt, shape); }
  Tensor ref() { return Tensor(f.data(), DType::F32, shape); }  // for the fp32 kernel
  float at(size_t i) const {
    if (dt == DType::F32) return store[i];
    return dt == DType::BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
  }
};

// Compares what the 16-bit kernel wrote into `got` with the fp32 reference `want` (rounded to
// got's dtype when that is 16-bit, as the kernel rounds once).
void expect_close(const Mat& got, const std::vector<float>& want, const std::string& what) {
  double scale = 0;
  for (float w : want) scale = std::max(scale, double(std::fabs(w)));
  const double tol = got.dt == DType::BF16 ? 1e-2 : got.dt == DType::F16 ? 2e-3 : 1e-5;
  double worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double w = got.dt == DType::F32 ? want[i] : Mat::round16(got.dt, want[i]);
    const double e = std::fabs(double(got.at(i)) - w);
    ASSERT_TRUE(std::isfinite(got.at(i))) << what << " element " << i;
    if (e > worst) worst = e, worst_i = i;
  }
  EXPECT_LE(worst, tol * std::max(scale, 1e-30)) << what << ": element " << worst_i << " off by " << worst
                                                 << " (largest reference value " << scale << ")";
}

struct Dims {
  int64_t M, N, K;
};
const std::vector<Dims> kShapes = {{1, 1, 1}, {1, 17, 33}, {5, 3, 7}, {37, 29, 19}, {64, 48, 40}, {130, 65, 257}};
// Large enough for a 16-bit output (out, dx) to be computed in several row blocks.
const Dims kForwardBlocks{600, 4096, 9}, kBackwardBlocks{600, 9, 4096};

// The run-time choice, and each path forced (the convert path is the run-time choice on a CPU
// without hardware bf16).
std::vector<cpu::Gemm16Path> runnable_paths() {
  std::vector<cpu::Gemm16Path> v = {cpu::Gemm16Path::kAuto, cpu::Gemm16Path::kOneDnnF32};
  if (cpu::cpu_has_hardware_bf16()) v.push_back(cpu::Gemm16Path::kConvertSgemm);
  try {
    cpu::set_gemm16_path(cpu::Gemm16Path::kOneDnnBf16);
    v.push_back(cpu::Gemm16Path::kOneDnnBf16);
  } catch (const std::exception&) {
  }
  cpu::set_gemm16_path(cpu::Gemm16Path::kAuto);
  return v;
}
const char* path_name(cpu::Gemm16Path p) {
  switch (p) {
    case cpu::Gemm16Path::kAuto: return "auto";
    case cpu::Gemm16Path::kConvertSgemm: return "convert+sgemm";
    case cpu::Gemm16Path::kOneDnnF32: return "onednn-f32";
    case cpu::Gemm16Path::kOneDnnBf16: return "onednn-bf16";
  }
  return "?";
}
struct PathScope {
  explicit PathScope(cpu::Gemm16Path p) { cpu::set_gemm16_path(p); }
  ~PathScope() { cpu::set_gemm16_path(cpu::Gemm16Path::kAuto); }
};

// Every dtype mix of x, w, out (fp32 or `half`), accumulate on and off.
void check_forward(DType half) {
  std::mt19937 rng(11);
  for (cpu::Gemm16Path path : runnable_paths()) {
    PathScope scope(path);
    std::vector<Dims> shapes = kShapes;
    shapes.push_back(kForwardBlocks);
    for (const Dims& d : shapes) {
      for (int mix = 0; mix < 8; ++mix) {
        if (d.N == kForwardBlocks.N && mix != 7 && mix != 5) continue;  // blocks: 16-bit out only
        for (bool acc : {false, true}) {
          auto dt = [&](int bit) { return (mix >> bit) & 1 ? half : DType::F32; };
          Mat x(dt(0), half, Shape{d.M, d.K}, rng), w(dt(1), half, Shape{d.N, d.K}, rng),
              out(dt(2), half, Shape{d.M, d.N}, rng);
          std::vector<float> want = out.f;
          cpu::linear_forward(Tensor(want.data(), DType::F32, out.shape), x.ref(), w.ref(), acc);
          cpu::linear_forward_16bit(out.t(), x.t(), w.t(), acc);
          expect_close(out, want,
                       fmt::format("{} {} forward {}x{}x{} x {} w {} out {} accumulate {}", path_name(path),
                                   dtype_name(half), d.M, d.N, d.K, dtype_name(x.dt), dtype_name(w.dt),
                                   dtype_name(out.dt), acc));
        }
      }
    }
  }
}

// Every dtype mix of dout, x, w (fp32 or `half`), dx (fp32, `half` or none), dw (fp32, `half`
// or none), accumulate_dx on and off; dw is always added to.
void check_backward(DType half) {
  std::mt19937 rng(12);
  for (cpu::Gemm16Path path : runnable_paths()) {
    PathScope scope(path);
    std::vector<Dims> shapes = kShapes;
    shapes.push_back(kBackwardBlocks);
    for (const Dims& d : shapes) {
      const bool blocks = d.K == kBackwardBlocks.K;
      for (int mix = 0; mix < 8; ++mix) {
        if (blocks && mix != 7 && mix != 6) continue;  // blocks: 16-bit dx from 16-bit or fp32 dout
        for (int dx_kind = 0; dx_kind < 3; ++dx_kind) {
          for (int dw_kind = 0; dw_kind < 3; ++dw_kind) {
            if (dx_kind == 2 && dw_kind == 2) continue;
            if (blocks && (dx_kind != 1 || dw_kind == 1)) continue;
            for (bool acc : {false, true}) {
              auto dt = [&](int bit) { return (mix >> bit) & 1 ? half : DType::F32; };
              Mat dout(dt(0), half, Shape{d.M, d.N}, rng), x(dt(1), half, Shape{d.M, d.K}, rng),
                  w(dt(2), half, Shape{d.N, d.K}, rng);
              Mat dx(dx_kind == 1 ? half : DType::F32, half, Shape{d.M, d.K}, rng);
              Mat dw(dw_kind == 1 ? half : DType::F32, half, Shape{d.N, d.K}, rng);
              std::vector<float> want_dx = dx.f, want_dw = dw.f;
              const bool has_dx = dx_kind != 2, has_dw = dw_kind != 2;
              cpu::linear_backward(has_dx ? Tensor(want_dx.data(), DType::F32, dx.shape) : Tensor(),
                                   has_dw ? Tensor(want_dw.data(), DType::F32, dw.shape) : Tensor(), dout.ref(),
                                   x.ref(), w.ref(), acc);
              cpu::linear_backward_16bit(has_dx ? dx.t() : Tensor(), has_dw ? dw.t() : Tensor(), dout.t(), x.t(),
                                         w.t(), acc);
              const std::string what =
                  fmt::format("{} {} backward {}x{}x{} dout {} x {} w {} accumulate_dx {}", path_name(path),
                              dtype_name(half), d.M, d.N, d.K, dtype_name(dout.dt), dtype_name(x.dt),
                              dtype_name(w.dt), acc);
              if (has_dx) expect_close(dx, want_dx, what + " dx " + std::string(dtype_name(dx.dt)));
              if (has_dw) expect_close(dw, want_dw, what + " dw " + std::string(dtype_name(dw.dt)));
              if (::testing::Test::HasFailure()) return;
            }
          }
        }
      }
    }
  }
}

TEST(Gemm16, LinearForwardBF16EveryDtypeMix) { check_forward(DType::BF16); }
TEST(Gemm16, LinearForwardF16EveryDtypeMix) { check_forward(DType::F16); }
TEST(Gemm16, LinearBackwardBF16EveryDtypeMix) { check_backward(DType::BF16); }
TEST(Gemm16, LinearBackwardF16EveryDtypeMix) { check_backward(DType::F16); }

// The fp32 master gradient is added to in fp32: a contribution far below a bf16 ulp of dw
// survives (a 16-bit rounding of dw, or of the product before the add, would lose it).
TEST(Gemm16, WeightGradientAccumulatesInFp32) {
  for (DType half : {DType::BF16, DType::F16}) {
    const int64_t M = 4, N = 3, K = 5;
    std::vector<uint16_t> dout(size_t(M * N)), x(size_t(M * K)), w(size_t(N * K));
    const uint16_t tiny = half == DType::BF16 ? f32_to_bf16(1.0f / 1024) : f32_to_f16(1.0f / 1024);
    const uint16_t one = half == DType::BF16 ? f32_to_bf16(1.0f) : f32_to_f16(1.0f);
    std::fill(dout.begin(), dout.end(), tiny);
    std::fill(x.begin(), x.end(), one);
    std::fill(w.begin(), w.end(), one);
    std::vector<float> dw(size_t(N * K), 1.0f);
    cpu::linear_backward_16bit(Tensor(), Tensor(dw.data(), DType::F32, Shape{N, K}), Tensor(dout.data(), half, Shape{M, N}),
                               Tensor(x.data(), half, Shape{M, K}), Tensor(w.data(), half, Shape{N, K}), false);
    for (float v : dw) EXPECT_EQ(v, 1.0f + 4.0f / 1024) << dtype_name(half);  // bf16 would round to 1
  }
}

// An fp32 operand enters a mixed product as it is (the contract of ops.def, and the router's fp32
// gate): here w's values are 1 + 2^-12 and friends, which bf16 rounds to 1, so a path that
// rounded w to bf16 would be off by about K * 2^-12 against a tolerance of 1e-5.
TEST(Gemm16, AnFp32OperandEntersTheProductUnrounded) {
  const int64_t M = 48, N = 40, K = 64;
  std::vector<uint16_t> x(size_t(M * K));
  std::vector<float> xf(x.size()), w(size_t(N * K));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = f32_to_bf16(0.25f + float(i % 5) * 0.125f);
    xf[i] = bf16_to_f32(x[i]);
  }
  for (size_t i = 0; i < w.size(); ++i) w[i] = 1.0f + std::ldexp(float(1 + i % 7), -12);
  for (cpu::Gemm16Path path : runnable_paths()) {
    PathScope scope(path);
    std::vector<float> out(size_t(M * N));
    cpu::linear_forward_16bit(Tensor(out.data(), DType::F32, Shape{M, N}), Tensor(x.data(), DType::BF16, Shape{M, K}),
                              Tensor(w.data(), DType::F32, Shape{N, K}), false);
    double worst = 0;
    for (int64_t i = 0; i < M; ++i) {
      for (int64_t j = 0; j < N; ++j) {
        double want = 0;
        for (int64_t k = 0; k < K; ++k) want += double(xf[size_t(i * K + k)]) * w[size_t(j * K + k)];
        worst = std::max(worst, std::fabs(out[size_t(i * N + j)] - want) / std::fabs(want));
      }
    }
    EXPECT_LT(worst, 1e-5) << path_name(path) << ": the fp32 operand was rounded";
  }
}

// A product's bits do not depend on where it runs: whole, as blocks of rows, or from several
// threads at once inside a parallel region (the experts spread over threads). oneDNN plans a
// primitive for the threads it sees and lets no two threads share one's library scratchpad; a
// product planned for two threads, or run concurrently on a shared scratchpad, fails this.
TEST(Gemm16, SameBitsWhereverTheProductRuns) {
  const int64_t M = 256, N = 192, K = 160;  // large enough to be split over the threads
  std::mt19937 rng(21);
  for (cpu::Gemm16Path path : runnable_paths()) {
    PathScope scope(path);
    SCOPED_TRACE(path_name(path));
    for (bool tb : {false, true}) {  // forward (x w^T) and dx (dout w) layouts
      Mat a(DType::BF16, DType::BF16, Shape{M, K}, rng), b(DType::BF16, DType::BF16, Shape{K, N}, rng);
      auto product = [&](int64_t r0, int64_t r1, float* c) {
        cpu::gemm_mixed(false, tb, r1 - r0, N, K, {a.h.data() + r0 * K, DType::BF16}, {b.h.data(), DType::BF16},
                        false, c + r0 * N, DType::F32);
      };
      std::vector<float> whole(size_t(M * N)), blocks(whole.size());
      product(0, M, whole.data());
      product(0, 37, blocks.data());
      product(37, 200, blocks.data());
      product(200, M, blocks.data());
      EXPECT_EQ(std::memcmp(whole.data(), blocks.data(), whole.size() * 4), 0) << "tb " << tb << ": row blocks";
      const int threads = 4;
      std::vector<std::vector<float>> each(threads, std::vector<float>(whole.size()));
      for (int round = 0; round < 3; ++round) {
#pragma omp parallel for num_threads(threads) schedule(static, 1)
        for (int t = 0; t < threads; ++t) product(0, M, each[size_t(t)].data());
        for (int t = 0; t < threads; ++t) {
          EXPECT_EQ(std::memcmp(whole.data(), each[size_t(t)].data(), whole.size() * 4), 0)
              << "tb " << tb << ": inside a parallel region, thread " << t << ", round " << round;
        }
      }
    }
  }
}

// An expert layer's token count changes every step, and the oneDNN paths make one kernel per
// product shape. The linear ops cut the token dimension into a bounded set of sizes, so 400
// different counts through the forward, dX and dW products add a bounded number of kernels; one
// kernel per count and product (1200 and more here) grew a DeepSeek-V3 bf16 run by 8 MiB a step.
TEST(Gemm16, TokenCountsShareABoundedSetOfKernels) {
  const int64_t N = 48, K = 40, kMaxM = 700;
  std::mt19937 rng(5);
  for (cpu::Gemm16Path path : runnable_paths()) {
    if (path != cpu::Gemm16Path::kOneDnnF32 && path != cpu::Gemm16Path::kOneDnnBf16) continue;
    PathScope scope(path);
    SCOPED_TRACE(path_name(path));
    Mat x(DType::BF16, DType::BF16, Shape{kMaxM, K}, rng), w(DType::BF16, DType::BF16, Shape{N, K}, rng);
    Mat dout(DType::BF16, DType::BF16, Shape{kMaxM, N}, rng);
    std::vector<uint16_t> out(size_t(kMaxM * N)), dx(size_t(kMaxM * K));
    std::vector<float> dw(size_t(N * K), 0.0f);
    const int64_t before = cpu::gemm16_product_shapes();
    for (int64_t M = kMaxM - 399; M <= kMaxM; ++M) {
      const Tensor xt(x.h.data(), DType::BF16, Shape{M, K});
      ops::linear_forward(Tensor(out.data(), DType::BF16, Shape{M, N}), xt, w.t(), false);
      ops::linear_backward(Tensor(dx.data(), DType::BF16, Shape{M, K}), Tensor(dw.data(), DType::F32, Shape{N, K}),
                           Tensor(dout.h.data(), DType::BF16, Shape{M, N}), xt, w.t(), false);
    }
    const int64_t made = cpu::gemm16_product_shapes() - before;
    EXPECT_GT(made, 0) << "the products did not run on oneDNN";
    EXPECT_LE(made, 300) << "oneDNN kernels made for 400 token counts";
  }
}

// The backend's BF16 and F16 slots of the linear ops are these kernels.
TEST(Gemm16, RegisteredInTheCpuBackend) {
  const Backend* cpu_backend = find_backend(DeviceType::CPU);
  ASSERT_NE(cpu_backend, nullptr);
  for (KernelDType k : {KernelDType::BF16, KernelDType::F16}) {
    EXPECT_EQ(cpu_backend->ops.linear_forward[size_t(k)], &cpu::linear_forward_16bit);
    EXPECT_EQ(cpu_backend->ops.linear_backward[size_t(k)], &cpu::linear_backward_16bit);
  }
}

// The log line says whether the CPU has hardware bf16 and what the GEMMs do about it.
TEST(Gemm16, PathDescriptionSaysWhetherTheCpuHasHardwareBf16) {
  const std::string d = cpu::gemm16_path_description();
  if (cpu::cpu_has_hardware_bf16()) {
    EXPECT_NE(d.find("hardware bf16 on this CPU"), std::string::npos) << d;
  } else {
    EXPECT_NE(d.find("no hardware bf16 on this CPU"), std::string::npos) << d;
    EXPECT_NE(d.find(cpu::sgemm_path_name()), std::string::npos) << d;
  }
}

}  // namespace
}  // namespace dstrain
