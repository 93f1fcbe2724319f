// The CPU backend's fused 16-bit kernels (backend/cpu/kernels_16bit.cpp, attention_16bit.cpp)
// against their reference, the generic widening kernel of the same op (widen.h), on the same
// inputs: bit for bit for element-wise maps (a NaN may differ only in its payload), within
// summation-order differences for reductions. And against the fp32 kernel on the widened inputs
// within 16-bit rounding (1e-2 of the largest value for bf16, 2e-3 for f16). Every mix of fp32
// and 16-bit tensors that dstrain's mixed precision uses is a case, with odd sizes, grouped-query
// attention, several query blocks, and mixes a kernel hands to the generic kernel.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/kernels_16bit.h"
#include "backend/cpu/widen.h"
#include "backend/ops.h"

namespace dstrain {
namespace {

enum class Kern { Fused, Generic, F32 };

// ops:: picks the CPU backend's 16-bit slot (the fused kernel) from the tensors' dtypes.
#define RUN(k, name, ...)                                     \
  do {                                                        \
    if ((k) == Kern::Fused) {                                 \
      ops::name(__VA_ARGS__);                                 \
    } else if ((k) == Kern::Generic) {                        \
      DS_CPU_WIDENED(name)(__VA_ARGS__);                      \
    } else {                                                  \
      cpu::name(__VA_ARGS__);                                 \
    }                                                         \
  } while (0)

using T = const std::vector<Tensor>&;

// One tensor argument: 'h' the case's 16-bit dtype, 'f' fp32, 'i' int32 (values given).
struct Arg {
  char kind;
  Shape shape;
  std::vector<float> values;  // as fp32 (16-bit args: already representable)
  std::vector<int32_t> ints;
};

struct Case {
  std::string name;
  bool exact = true;  // element-wise: bit for bit against the generic kernel
  std::vector<Arg> args;
  std::function<void(Kern, T)> run;
};

float round16(DType dt, float v) {
  return dt == DType::BF16 ? bf16_to_f32(f32_to_bf16(v)) : f16_to_f32(f32_to_f16(v));
}

// The tensors of one run: 'h' args in `dt` (F32 for the fp32 kernel's run).
struct Tensors {
  std::vector<std::vector<unsigned char>> bytes;
  std::vector<Tensor> t;
  Tensors(const std::vector<Arg>& args, DType dt, bool widen) {
    bytes.resize(args.size());
    for (size_t i = 0; i < args.size(); ++i) {
      const Arg& a = args[i];
      const DType d = a.kind == 'i' ? DType::I32 : (a.kind == 'h' && !widen ? dt : DType::F32);
      bytes[i].resize(size_t(a.shape.numel()) * dtype_size(d));
      Tensor x(bytes[i].data(), d, a.shape);
      if (d == DType::I32) {
        std::memcpy(x.raw(), a.ints.data(), a.ints.size() * 4);
      } else {
        for (int64_t j = 0; j < a.shape.numel(); ++j) cpu::k16::store1(x, j, a.values[size_t(j)]);
      }
      t.push_back(x);
    }
  }
};

class Gen {
 public:
  explicit Gen(DType dt, uint32_t seed) : dt_(dt), rng_(seed) {}
  Arg normal(char kind, Shape s, float scale = 1.0f) {
    Arg a{kind, s, std::vector<float>(size_t(s.numel())), {}};
    std::normal_distribution<float> nd(0.0f, scale);
    for (float& v : a.values) v = kind == 'h' ? round16(dt_, nd(rng_)) : nd(rng_);
    return a;
  }
  static Arg zeros(char kind, Shape s) { return Arg{kind, s, std::vector<float>(size_t(s.numel())), {}}; }
  static Arg of(char kind, Shape s, std::vector<float> v) { return Arg{kind, s, std::move(v), {}}; }
  static Arg ints(Shape s, std::vector<int32_t> v) { return Arg{'i', s, {}, std::move(v)}; }
  std::vector<int32_t> permutation(int64_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), 0);
    std::shuffle(p.begin(), p.end(), rng_);
    return p;
  }
  DType dt() const { return dt_; }

 private:
  DType dt_;
  std::mt19937 rng_;
};

std::vector<float> rounded(DType dt, std::vector<float> v) {
  for (float& x : v) x = round16(dt, x);
  return v;
}

std::vector<Case> cases(DType dt) {
  std::vector<Case> cs;
  Gen g(dt, dt == DType::BF16 ? 7u : 11u);
  auto add = [&](std::string name, bool exact, std::vector<Arg> args, std::function<void(Kern, T)> run) {
    cs.push_back(Case{std::move(name), exact, std::move(args), std::move(run)});
  };

  // ---- attention: GQA over two query blocks, MHA short; out 16 or fp32; lse 16 falls back.
  struct A {
    const char* what;
    ops::AttentionLayout L;
    int64_t B, Tn;
  };
  for (const A& a : {A{"GQA 4/2 qk 6 v 4 T=70", {4, 2, 6, 4, 0, 24, 36, 45}, 2, 70},
                     A{"MHA 2x4 T=7", {2, 2, 4, 4, 0, 8, 16, 24}, 1, 7},
                     A{"GQA 8/2 qk 16 v 16 T=131", {8, 2, 16, 16, 0, 128, 160, 192}, 1, 131}}) {
    const ops::AttentionLayout L = a.L;
    const float scale = 1.0f / std::sqrt(float(L.qk_dim));
    const int64_t width = int64_t(L.n_head) * L.v_dim;
    const Shape qs{a.B, a.Tn, L.row_stride}, os{a.B, a.Tn, width}, ls{a.B, L.n_head, a.Tn};
    const Arg qkv = g.normal('h', qs);
    auto fwd = [L, scale](Kern k, T t) { RUN(k, attention_forward, t[0], t[1], t[2], L, scale); };
    add(std::string("attention_forward out16 ") + a.what, false, {Gen::zeros('h', os), Gen::zeros('f', ls), qkv}, fwd);
    add(std::string("attention_forward out32 ") + a.what, false, {Gen::zeros('f', os), Gen::zeros('f', ls), qkv}, fwd);
    add(std::string("attention_forward lse16 (generic) ") + a.what, false,
        {Gen::zeros('h', os), Gen::zeros('h', ls), qkv}, fwd);
    // Saved tensors from the fp32 forward on the rounded qkv.
    std::vector<float> out(size_t(os.numel())), lse(size_t(ls.numel()));
    std::vector<float> qv = qkv.values;
    cpu::attention_forward(Tensor(out.data(), DType::F32, os), Tensor(lse.data(), DType::F32, ls),
                           Tensor(qv.data(), DType::F32, qs), L, scale);
    auto bwd = [L, scale](Kern k, T t) { RUN(k, attention_backward, t[0], t[1], t[2], t[3], t[4], L, scale); };
    const Arg dout = g.normal('h', os);
    add(std::string("attention_backward dqkv16 ") + a.what, false,
        {g.normal('h', qs), dout, qkv, Gen::of('h', os, rounded(dt, out)), Gen::of('f', ls, lse)}, bwd);
    add(std::string("attention_backward dqkv32 ") + a.what, false,
        {g.normal('f', qs), dout, qkv, Gen::of('h', os, rounded(dt, out)), Gen::of('f', ls, lse)}, bwd);
  }

  // ---- RMSNorm: x fp32 (residual) or 16-bit; out 16-bit; rstd/weight fp32 (16-bit: generic).
  for (auto [N, C] : {std::pair<int64_t, int64_t>{13, 37}, {9, 130}}) {
    const std::string sz = " N=" + std::to_string(N) + " C=" + std::to_string(C);
    auto fwd = [](Kern k, T t) { RUN(k, rmsnorm_forward, t[0], t[1], t[2], t[3], 1e-6f); };
    const Arg w = g.normal('f', {C}), wh = g.normal('h', {C});
    add("rmsnorm_forward x32" + sz, false, {Gen::zeros('h', {N, C}), Gen::zeros('f', {N}), g.normal('f', {N, C}), w}, fwd);
    add("rmsnorm_forward x16" + sz, false, {Gen::zeros('h', {N, C}), Gen::zeros('f', {N}), g.normal('h', {N, C}), w}, fwd);
    add("rmsnorm_forward all16 (generic)" + sz, false,
        {Gen::zeros('h', {N, C}), Gen::zeros('h', {N}), g.normal('h', {N, C}), wh}, fwd);
    // Backward with a consistent rstd.
    const Arg x = g.normal('h', {N, C});
    std::vector<float> o(size_t(N * C)), r(static_cast<size_t>(N)), xv = x.values, wv = w.values;
    cpu::rmsnorm_forward(Tensor(o.data(), DType::F32, {N, C}), Tensor(r.data(), DType::F32, {N}),
                         Tensor(xv.data(), DType::F32, {N, C}), Tensor(wv.data(), DType::F32, {C}), 1e-6f);
    const Arg rstd = Gen::of('f', {N}, r);
    auto bwd = [](Kern k, T t) { RUN(k, rmsnorm_backward, t[0], t[1], t[2], t[3], t[4], t[5]); };
    add("rmsnorm_backward dx32 (+=) x32" + sz, false,
        {g.normal('f', {N, C}), g.normal('f', {C}), g.normal('h', {N, C}), Gen::of('f', {N, C}, x.values), w, rstd}, bwd);
    add("rmsnorm_backward dx16 x16" + sz, false,
        {g.normal('h', {N, C}), g.normal('f', {C}), g.normal('h', {N, C}), x, w, rstd}, bwd);
    add("rmsnorm_backward rstd16 (generic)" + sz, false,
        {g.normal('h', {N, C}), g.normal('f', {C}), g.normal('h', {N, C}), x, w, Gen::of('h', {N}, rounded(dt, r))}, bwd);
  }

  // ---- SwiGLU.
  for (auto [N, I] : {std::pair<int64_t, int64_t>{6, 9}, {5, 67}}) {
    const std::string sz = " N=" + std::to_string(N) + " I=" + std::to_string(I);
    auto fwd = [](Kern k, T t) { RUN(k, swiglu_forward, t[0], t[1]); };
    add("swiglu_forward all16" + sz, true, {Gen::zeros('h', {N, I}), g.normal('h', {N, 2 * I}, 2.0f)}, fwd);
    add("swiglu_forward out32" + sz, true, {Gen::zeros('f', {N, I}), g.normal('h', {N, 2 * I}, 2.0f)}, fwd);
    // Outputs in the subnormal range (about 5e-39), which the rounding must take as the scalar one does.
    add("swiglu_forward all16 subnormal outputs" + sz, true,
        {Gen::zeros('h', {N, I}), g.normal('h', {N, 2 * I}, 1e-19f)}, fwd);
    auto bwd = [](Kern k, T t) { RUN(k, swiglu_backward, t[0], t[1], t[2]); };
    add("swiglu_backward all16" + sz, true,
        {Gen::zeros('h', {N, 2 * I}), g.normal('h', {N, I}), g.normal('h', {N, 2 * I}, 2.0f)}, bwd);
    add("swiglu_backward dgu32 gu32" + sz, true,
        {Gen::zeros('f', {N, 2 * I}), g.normal('h', {N, I}), g.normal('f', {N, 2 * I}, 2.0f)}, bwd);
  }

  // ---- rotary embeddings: x 16-bit in place, tables fp32 (16-bit tables: generic).
  {
    std::vector<float> c(7 * 5), s(7 * 5);
    cpu::rope_tables(Tensor(c.data(), DType::F32, {7, 5}), Tensor(s.data(), DType::F32, {7, 5}), 10, 10000.0);
    const Arg cos = Gen::of('f', {7, 5}, c), sin = Gen::of('f', {7, 5}, s);
    for (bool fwd : {true, false}) {
      const std::string n = fwd ? "rope_forward" : "rope_backward";
      auto r = [fwd](Kern k, T t) {
        if (fwd) {
          RUN(k, rope_forward, t[0], 3, 3, 10, t[1], t[2]);
        } else {
          RUN(k, rope_backward, t[0], 3, 3, 10, t[1], t[2]);
        }
      };
      add(n + " x16 (2,7,40) 3 heads of 10 at 3", true, {g.normal('h', {2, 7, 40}), cos, sin}, r);
      add(n + " tables16 (generic)", true,
          {g.normal('h', {2, 7, 40}), Gen::of('h', {7, 5}, rounded(dt, c)), Gen::of('h', {7, 5}, rounded(dt, s))}, r);
      auto ri = [fwd](Kern k, T t) {
        if (fwd) {
          RUN(k, rope_forward_interleaved, t[0], 2, 2, 14, 10, t[1], t[2]);
        } else {
          RUN(k, rope_backward_interleaved, t[0], 2, 2, 14, 10, t[1], t[2]);
        }
      };
      add(n + "_interleaved x16 (2,5,50) 2 heads of 10 at 2 stride 14", true, {g.normal('h', {2, 5, 50}), cos, sin},
          ri);
    }
  }

  // ---- element-wise arithmetic (sizes across the 1024-element chunks).
  for (int64_t n : {37, 2500}) {
    const std::string sz = " n=" + std::to_string(n);
    auto a3 = [](Kern k, T t) { RUN(k, add, t[0], t[1], t[2]); };
    add("add out32 a32 b16" + sz, true, {Gen::zeros('f', {n}), g.normal('f', {n}), g.normal('h', {n})}, a3);
    add("add all16" + sz, true, {Gen::zeros('h', {n}), g.normal('h', {n}), g.normal('h', {n})}, a3);
    add("add all16, out is b" + sz, true, {g.normal('h', {n}), g.normal('h', {n})},
        [](Kern k, T t) { RUN(k, add, t[0], t[1], t[0]); });
    auto ai = [](Kern k, T t) { RUN(k, add_inplace, t[0], t[1]); };
    add("add_inplace out32 a16" + sz, true, {g.normal('f', {n}), g.normal('h', {n})}, ai);
    add("add_inplace all16" + sz, true, {g.normal('h', {n}), g.normal('h', {n})}, ai);
    add("scale_inplace x16" + sz, true, {g.normal('h', {n})}, [](Kern k, T t) { RUN(k, scale_inplace, t[0], 0.37f); });
    add("fill x16" + sz, true, {g.normal('h', {n})}, [](Kern k, T t) { RUN(k, fill, t[0], 2.3f); });
  }
  struct B {
    const char* what;
    int64_t dst_offset, dst_step, src_offset, src_step, blocks, width;
    bool acc;
  };
  for (B b : {B{"3 blocks of 4, strided", 1, 6, 0, 4, 3, 4, false}, B{"3 blocks of 4, strided (+=)", 1, 6, 0, 4, 3, 4, true},
              B{"broadcast src (step 0)", 2, 5, 3, 0, 3, 5, false},
              B{"sum into one place (dst step 0, +=)", 4, 0, 0, 4, 3, 4, true}}) {
    auto r = [b](Kern k, T t) {
      RUN(k, copy_blocks, t[0], b.dst_offset, b.dst_step, t[1], b.src_offset, b.src_step, b.blocks, b.width, b.acc);
    };
    add(std::string("copy_blocks 16<-16 ") + b.what, true, {g.normal('h', {3, 20}), g.normal('h', {3, 12})}, r);
    add(std::string("copy_blocks 32<-16 ") + b.what, true, {g.normal('f', {3, 20}), g.normal('h', {3, 12})}, r);
    add(std::string("copy_blocks 16<-32 ") + b.what, true, {g.normal('h', {3, 20}), g.normal('f', {3, 12})}, r);
  }

  // ---- MoE permutation: N tokens, k slots, C columns (odd).
  {
    const int64_t N = 9, k = 2, M = N * k, C = 13;
    std::vector<int32_t> sorted = g.permutation(M), position(static_cast<size_t>(M));
    for (int64_t p = 0; p < M; ++p) position[size_t(sorted[size_t(p)])] = int32_t(p);
    const Arg srt = Gen::ints({M}, sorted), pos = Gen::ints({M}, position);
    auto perm = [](Kern kk, T t) { RUN(kk, moe_permute, t[0], t[1], t[2], 2); };
    add("moe_permute xg16 x16", true, {Gen::zeros('h', {M, C}), g.normal('h', {N, C}), srt}, perm);
    add("moe_permute xg16 x32", true, {Gen::zeros('h', {M, C}), g.normal('f', {N, C}), srt}, perm);
    for (bool acc : {false, true}) {
      auto pb = [acc](Kern kk, T t) { RUN(kk, moe_permute_backward, t[0], t[1], t[2], acc); };
      const std::string a = acc ? " (+=)" : "";
      add("moe_permute_backward dx16 dxg16" + a, true, {g.normal('h', {N, C}), g.normal('h', {M, C}), pos}, pb);
      add("moe_permute_backward dx32 dxg16" + a, true, {g.normal('f', {N, C}), g.normal('h', {M, C}), pos}, pb);
    }
    auto up = [](Kern kk, T t) { RUN(kk, moe_unpermute, t[0], t[1], t[2], t[3]); };
    add("moe_unpermute out32 (+=) yg16", true, {g.normal('f', {N, C}), g.normal('h', {M, C}), g.normal('f', {N, k}), pos},
        up);
    add("moe_unpermute all16", true, {g.normal('h', {N, C}), g.normal('h', {M, C}), g.normal('h', {N, k}), pos}, up);
    auto ub = [](Kern kk, T t) { RUN(kk, moe_unpermute_backward, t[0], t[1], t[2], t[3], t[4], t[5]); };
    add("moe_unpermute_backward dyg16 yg16", false,
        {Gen::zeros('h', {M, C}), Gen::zeros('f', {N, k}), g.normal('f', {N, C}), g.normal('h', {M, C}),
         g.normal('f', {N, k}), srt},
        ub);
  }
  return cs;
}

// Bits of element i as stored (fp32 or 16-bit), and whether it is a NaN.
uint32_t bits_at(const Tensor& t, int64_t i) {
  if (t.dtype() == DType::F32) {
    uint32_t u;
    std::memcpy(&u, static_cast<const float*>(t.raw()) + i, 4);
    return u;
  }
  if (t.dtype() == DType::I32) return uint32_t(static_cast<const int32_t*>(t.raw())[i]);
  return static_cast<const uint16_t*>(t.raw())[i];
}

float ulp_rel(DType dt) { return dt == DType::BF16 ? 1.0f / 128 : dt == DType::F16 ? 1.0f / 1024 : 0.0f; }

void expect_same(const Case& c, size_t arg, const Tensor& got, const Tensor& want) {
  ASSERT_EQ(got.dtype(), want.dtype());
  float mx = 0;
  if (got.dtype() != DType::I32) {
    for (int64_t i = 0; i < want.numel(); ++i) mx = std::max(mx, std::abs(cpu::k16::load1(want, i)));
  }
  int bad = 0;
  for (int64_t i = 0; i < want.numel() && bad < 5; ++i) {
    if (bits_at(got, i) == bits_at(want, i)) continue;
    if (got.dtype() == DType::I32) {
      ++bad;
      ADD_FAILURE() << c.name << ": int argument " << arg << " element " << i << " changed";
      continue;
    }
    const float a = cpu::k16::load1(got, i), b = cpu::k16::load1(want, i);
    if (std::isnan(a) && std::isnan(b)) continue;
    if (!c.exact && std::abs(a - b) <= 1e-6f * mx + ulp_rel(got.dtype()) * std::abs(b)) continue;
    ++bad;
    ADD_FAILURE() << c.name << ": argument " << arg << " element " << i << ": fused " << a << " generic " << b
                  << (c.exact ? " (must be bit-identical)" : "");
  }
}

class Kernels16 : public ::testing::TestWithParam<DType> {};

// With the AVX2/F16C row conversions (where this CPU has them) and with the portable loops.
// On the widening GEMM path: with hardware bf16 the bf16 attention rounds its probabilities and
// their gradients to bf16 for its products (attention_16bit.cpp), which the comparison with the
// fp32 kernel below checks at bf16 tolerance.
TEST_P(Kernels16, FusedMatchesGenericWideningKernel) {
  const DType dt = GetParam();
  cpu::set_gemm16_path(cpu::Gemm16Path::kConvertSgemm);
  struct Restore {
    ~Restore() { cpu::set_gemm16_path(cpu::Gemm16Path::kAuto); }
  } restore;
  for (bool x86 : {true, false}) {
    const bool was = cpu::k16::set_x86_conversions(x86);
    for (const Case& c : cases(dt)) {
      SCOPED_TRACE(c.name + (x86 ? "" : " (portable conversions)"));
      Tensors fused(c.args, dt, false), generic(c.args, dt, false);
      c.run(Kern::Fused, fused.t);
      c.run(Kern::Generic, generic.t);
      for (size_t i = 0; i < c.args.size(); ++i) expect_same(c, i, fused.t[i], generic.t[i]);
    }
    cpu::k16::set_x86_conversions(was);
  }
}

TEST_P(Kernels16, FusedMatchesFp32KernelWithin16BitRounding) {
  const DType dt = GetParam();
  const float tol = dt == DType::BF16 ? 1e-2f : 2e-3f;
  for (const Case& c : cases(dt)) {
    SCOPED_TRACE(c.name);
    Tensors fused(c.args, dt, false), wide(c.args, dt, true);
    c.run(Kern::Fused, fused.t);
    c.run(Kern::F32, wide.t);
    for (size_t a = 0; a < c.args.size(); ++a) {
      if (c.args[a].kind == 'i') continue;
      const Tensor& got = fused.t[a];
      const Tensor& want = wide.t[a];
      float mx = 0, worst = 0;
      int64_t at = 0;
      for (int64_t i = 0; i < want.numel(); ++i) mx = std::max(mx, std::abs(cpu::k16::load1(want, i)));
      for (int64_t i = 0; i < want.numel(); ++i) {
        const float d = std::abs(cpu::k16::load1(got, i) - cpu::k16::load1(want, i));
        if (!(d <= worst)) {
          worst = d;
          at = i;
        }
      }
      EXPECT_LE(worst, tol * mx) << c.name << ": argument " << a << " element " << at;
    }
  }
}

// A NaN or infinity in a 16-bit input comes out where the fp32 arithmetic puts it, as in the
// generic kernel.
TEST_P(Kernels16, NaNAndInfinityPropagate) {
  const DType dt = GetParam();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const Case& c : cases(dt)) {
    if (c.name.rfind("attention", 0) == 0 || c.name.find("generic") != std::string::npos) continue;
    SCOPED_TRACE(c.name);
    Case k = c;
    // The first 16-bit argument the op reads: inputs come after the outputs except in place.
    size_t target = 0;
    for (size_t i = 0; i < k.args.size(); ++i) {
      if (k.args[i].kind == 'h') target = i;
    }
    Arg& a = k.args[target];
    if (a.values.size() < 8) continue;
    a.values[3] = nan;
    a.values[5] = -inf;
    Tensors fused(k.args, dt, false), generic(k.args, dt, false);
    k.run(Kern::Fused, fused.t);
    k.run(Kern::Generic, generic.t);
    for (size_t i = 0; i < k.args.size(); ++i) expect_same(k, i, fused.t[i], generic.t[i]);
  }
  // And directly: NaN in, NaN out.
  std::vector<uint16_t> x(20), y(20);
  for (int i = 0; i < 20; ++i) x[size_t(i)] = y[size_t(i)] = dt == DType::BF16 ? f32_to_bf16(1.5f) : f32_to_f16(1.5f);
  x[7] = dt == DType::BF16 ? f32_to_bf16(nan) : f32_to_f16(nan);
  ops::add(Tensor(y.data(), dt, {20}), Tensor(x.data(), dt, {20}), Tensor(y.data(), dt, {20}));
  const Tensor yt(y.data(), dt, {20});
  EXPECT_TRUE(std::isnan(cpu::k16::load1(yt, 7)));
  EXPECT_EQ(cpu::k16::load1(yt, 6), 3.0f);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Kernels16, ::testing::Values(DType::BF16, DType::F16),
                         [](const ::testing::TestParamInfo<DType>& p) { return std::string(dtype_name(p.param)); });

// The vectorised conversions give core/dtype.h's bits: every 16-bit value widened, and fp32
// values across every rounding case (ties, subnormals, overflow, infinities, NaNs) narrowed.
TEST(Kernels16Conversions, MatchScalarConversionsBitForBit) {
  std::vector<uint16_t> all(65536);
  std::iota(all.begin(), all.end(), uint16_t(0));
  std::vector<float> wide(all.size());
  for (bool x86 : {true, false}) {
    const bool was = cpu::k16::set_x86_conversions(x86);
    for (DType dt : {DType::BF16, DType::F16}) {
      cpu::k16::load_row(wide.data(), all.data(), dt, int64_t(all.size()));
      for (size_t i = 0; i < all.size(); ++i) {
        const float want = dt == DType::BF16 ? bf16_to_f32(all[i]) : f16_to_f32(all[i]);
        uint32_t a, b;
        std::memcpy(&a, &wide[i], 4);
        std::memcpy(&b, &want, 4);
        ASSERT_EQ(a, b) << dtype_name(dt) << " bits " << std::hex << all[i] << " x86 " << x86;
      }
    }
    cpu::k16::set_x86_conversions(was);
  }
  // fp32 inputs: every 16-bit value, the midpoints between neighbours and one fp32 ulp either
  // side of them, and random bit patterns.
  std::vector<float> in;
  for (uint32_t h = 0; h < 65536; ++h) {
    for (int shift : {16, 13}) {
      const uint32_t base = shift == 16 ? h << 16 : ((h & 0x8000u) << 16) | ((h & 0x7fffu) << 13);
      for (uint32_t u : {base, base + (1u << (shift - 1)), base + (1u << (shift - 1)) - 1, base + (1u << (shift - 1)) + 1}) {
        float f;
        std::memcpy(&f, &u, 4);
        in.push_back(f);
      }
    }
  }
  std::mt19937 rng(5);
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    in.push_back(f);
  }
  std::vector<uint16_t> out(in.size());
  // Through the AVX2/F16C code (where this CPU has it) and the portable loops.
  for (bool x86 : {true, false}) {
    const bool was = cpu::k16::set_x86_conversions(x86);
    for (DType dt : {DType::BF16, DType::F16}) {
      cpu::k16::store_row(out.data(), dt, in.data(), int64_t(in.size()));
      for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t want = dt == DType::BF16 ? f32_to_bf16(in[i]) : f32_to_f16(in[i]);
        uint32_t u;
        std::memcpy(&u, &in[i], 4);
        ASSERT_EQ(out[i], want) << dtype_name(dt) << " from fp32 bits " << std::hex << u << " x86 " << x86;
      }
    }
    cpu::k16::set_x86_conversions(was);
  }
}

// The 16-bit slots of these ops hold the fused kernels, not the generic ones.
TEST(Kernels16Registration, FusedKernelsFillTheSixteenBitSlots) {
  const OpTable& t = find_backend(DeviceType::CPU)->ops;
  for (KernelDType k : {KernelDType::BF16, KernelDType::F16}) {
    const size_t s = size_t(k);
#define DS_EXPECT_FUSED(name) EXPECT_NE(t.name[s], DS_CPU_WIDENED(name)) << #name;
    DS_EXPECT_FUSED(attention_forward)
    DS_EXPECT_FUSED(attention_backward)
    DS_EXPECT_FUSED(rmsnorm_forward)
    DS_EXPECT_FUSED(rmsnorm_backward)
    DS_EXPECT_FUSED(swiglu_forward)
    DS_EXPECT_FUSED(swiglu_backward)
    DS_EXPECT_FUSED(rope_forward)
    DS_EXPECT_FUSED(rope_backward)
    DS_EXPECT_FUSED(rope_forward_interleaved)
    DS_EXPECT_FUSED(rope_backward_interleaved)
    DS_EXPECT_FUSED(add)
    DS_EXPECT_FUSED(add_inplace)
    DS_EXPECT_FUSED(scale_inplace)
    DS_EXPECT_FUSED(fill)
    DS_EXPECT_FUSED(copy_blocks)
    DS_EXPECT_FUSED(moe_permute)
    DS_EXPECT_FUSED(moe_permute_backward)
    DS_EXPECT_FUSED(moe_unpermute)
    DS_EXPECT_FUSED(moe_unpermute_backward)
#undef DS_EXPECT_FUSED
  }
}

}  // namespace
}  // namespace dstrain
