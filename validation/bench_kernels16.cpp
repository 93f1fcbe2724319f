// The CPU backend's fused 16-bit kernels against the generic widening kernels (widen.h) they
// replace and against the fp32 kernels, at the shapes of dstrain's d=256 models (T=256,
// micro-batch 8: 2048 tokens; deepseek-llm-tiny: 4 query / 2 kv heads of 64, SwiGLU 704;
// deepseek-v3-tiny: interleaved rope of 16 in heads of 48, 4 of 32 experts per token).
//   bench_kernels16 [bf16|f16] [min_ms_per_sample=150] [only ops whose name contains this] [fp32|generic|fused]
// Prints, per op and mix: ms of CPU time per call (best of 5 samples) of the fp32 kernel (all-fp32 tensors), the generic
// 16-bit kernel and the fused one, and the ratios generic/fused and fused/fp32. Threads: OMP_NUM_THREADS.
#include <Kokkos_Core.hpp>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/kernels_16bit.h"
#include "backend/cpu/widen.h"
#include "backend/ops.h"

using namespace dstrain;

namespace {

enum class Kern { Fused, Generic, F32 };
#define RUN(k, name, ...)              \
  do {                                 \
    if ((k) == Kern::Fused) {          \
      ops::name(__VA_ARGS__);          \
    } else if ((k) == Kern::Generic) { \
      DS_CPU_WIDENED(name)(__VA_ARGS__); \
    } else {                           \
      cpu::name(__VA_ARGS__);          \
    }                                  \
  } while (0)

std::mt19937 rng(1);

// A tensor with random contents: kind 'h' = the 16-bit dtype (fp32 for the fp32 run), 'f' fp32.
struct Store {
  std::vector<std::vector<unsigned char>> bufs;
  Tensor make(DType dt, Shape s, float scale) {
    bufs.emplace_back(size_t(s.numel()) * dtype_size(dt));
    Tensor t(bufs.back().data(), dt, s);
    std::normal_distribution<float> nd(0.0f, scale);
    for (int64_t i = 0; i < s.numel(); ++i) cpu::k16::store1(t, i, nd(rng));
    return t;
  }
  Tensor ints(std::vector<int32_t> v) {
    bufs.emplace_back(v.size() * 4);
    std::memcpy(bufs.back().data(), v.data(), v.size() * 4);
    return Tensor(bufs.back().data(), DType::I32, {int64_t(v.size())});
  }
};

// This process's CPU time in ms: on a shared machine, time spent descheduled does not count.
// With OMP_NUM_THREADS=1 that is the kernel's own time; with more threads it adds them up.
double cpu_ms() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) * 1e3 + double(ts.tv_nsec) * 1e-6;
}

// Calls per sample of f so that a sample takes at least min_ms / 5.
int calibrate(const std::function<void()>& f, double min_ms) {
  f();  // warm up (scratch, pages)
  int reps = 1;
  for (;;) {
    const double t0 = cpu_ms();
    for (int i = 0; i < reps; ++i) f();
    if (cpu_ms() - t0 >= min_ms / 5 || reps > (1 << 20)) return reps;
    reps *= 2;
  }
}

// The fastest of 5 samples of each function, in ms per call; the samples take turns, so that a
// slow spell of a shared machine does not fall on one kernel only.
std::vector<double> best_ms(const std::vector<std::function<void()>>& fs, double min_ms) {
  std::vector<int> reps;
  for (const auto& f : fs) reps.push_back(calibrate(f, min_ms));
  std::vector<double> best(fs.size(), 1e300);
  for (int s = 0; s < 5; ++s) {
    for (size_t k = 0; k < fs.size(); ++k) {
      const double t0 = cpu_ms();
      for (int i = 0; i < reps[k]; ++i) fs[k]();
      best[k] = std::min(best[k], (cpu_ms() - t0) / reps[k]);
    }
  }
  return best;
}
double best_ms(const std::function<void()>& f, double min_ms) { return best_ms(std::vector{f}, min_ms)[0]; }

struct Bench {
  std::string op, mix;
  // Builds the tensors ('h' args in dt) and returns the call.
  std::function<std::function<void(Kern)>(Store&, DType dt)> setup;
};

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);  // the generic kernels' temporaries are Kokkos allocations
  const DType h = argc > 1 && std::string(argv[1]) == "f16" ? DType::F16 : DType::BF16;
  const double min_ms = argc > 2 ? std::atof(argv[2]) : 150.0;
  const DType f = DType::F32;
  constexpr int64_t B = 8, T = 256, N = B * T, C = 256, I = 704, H = 4, Hkv = 2, D = 64, W = (H + 2 * Hkv) * D;
  constexpr int64_t K = 4, M = N * K;
  const ops::AttentionLayout L{int(H), int(Hkv), int(D), int(D), 0, H * D, (H + Hkv) * D, W};
  const float scale = 1.0f / std::sqrt(float(D));
  std::vector<int32_t> sorted(static_cast<size_t>(M)), position(static_cast<size_t>(M));
  std::iota(sorted.begin(), sorted.end(), 0);
  std::shuffle(sorted.begin(), sorted.end(), rng);
  for (int64_t p = 0; p < M; ++p) position[size_t(sorted[size_t(p)])] = int32_t(p);

  std::vector<Bench> benches;
  auto add = [&](std::string op, std::string mix, decltype(Bench::setup) s) { benches.push_back({op, mix, s}); };
  add("attention_forward", "out16 lse32 qkv16", [&](Store& s, DType d) {
    Tensor out = s.make(d, {B, T, H * D}, 1), lse = s.make(f, {B, H, T}, 1), qkv = s.make(d, {B, T, W}, 1);
    return [=](Kern k) { RUN(k, attention_forward, out, lse, qkv, L, scale); };
  });
  add("attention_backward", "dqkv16 dout16 qkv16 out16 lse32", [&](Store& s, DType d) {
    Tensor dqkv = s.make(d, {B, T, W}, 1), dout = s.make(d, {B, T, H * D}, 1), qkv = s.make(d, {B, T, W}, 1);
    Tensor out = s.make(d, {B, T, H * D}, 1), lse = s.make(f, {B, H, T}, 1);
    // consistent saved tensors: the forward on these inputs
    ops::attention_forward(out, lse, qkv, L, scale);
    return [=](Kern k) { RUN(k, attention_backward, dqkv, dout, qkv, out, lse, L, scale); };
  });
  add("rmsnorm_forward", "out16 rstd32 x32 w32", [&](Store& s, DType d) {
    Tensor out = s.make(d, {N, C}, 1), rstd = s.make(f, {N}, 1), x = s.make(f, {N, C}, 1), w = s.make(f, {C}, 1);
    return [=](Kern k) { RUN(k, rmsnorm_forward, out, rstd, x, w, 1e-6f); };
  });
  add("rmsnorm_backward", "dx32(+=) dw32 dout16 x32 w32 rstd32", [&](Store& s, DType d) {
    Tensor dx = s.make(f, {N, C}, 1), dw = s.make(f, {C}, 1), dout = s.make(d, {N, C}, 1), x = s.make(f, {N, C}, 1);
    Tensor w = s.make(f, {C}, 1), rstd = s.make(f, {N}, 1);
    return [=](Kern k) { RUN(k, rmsnorm_backward, dx, dw, dout, x, w, rstd); };
  });
  add("swiglu_forward", "all16", [&](Store& s, DType d) {
    Tensor out = s.make(d, {N, I}, 1), gu = s.make(d, {N, 2 * I}, 2);
    return [=](Kern k) { RUN(k, swiglu_forward, out, gu); };
  });
  add("swiglu_backward", "all16", [&](Store& s, DType d) {
    Tensor dgu = s.make(d, {N, 2 * I}, 1), dout = s.make(d, {N, I}, 1), gu = s.make(d, {N, 2 * I}, 2);
    return [=](Kern k) { RUN(k, swiglu_backward, dgu, dout, gu); };
  });
  for (bool fwd : {true, false}) {
    add(fwd ? "rope_forward" : "rope_backward", "x16 (q+k: 6 heads of 64)", [&, fwd](Store& s, DType d) {
      // Real tables (a rotation keeps the values in range however often it runs).
      Tensor x = s.make(d, {B, T, W}, 1), cs = s.make(f, {T, D / 2}, 1), sn = s.make(f, {T, D / 2}, 1);
      cpu::rope_tables(cs, sn, int(D), 10000.0);
      return [=](Kern k) {
        if (fwd) {
          RUN(k, rope_forward, x, 0, int(H + Hkv), int(D), cs, sn);
        } else {
          RUN(k, rope_backward, x, 0, int(H + Hkv), int(D), cs, sn);
        }
      };
    });
    add(fwd ? "rope_forward_interleaved" : "rope_backward_interleaved", "x16 (8 heads, 16 of 48)",
        [&, fwd](Store& s, DType d) {
          Tensor x = s.make(d, {B, T, 8 * 48}, 1), cs = s.make(f, {T, 8}, 1), sn = s.make(f, {T, 8}, 1);
          cpu::rope_tables(cs, sn, 16, 10000.0);
          return [=](Kern k) {
            if (fwd) {
              RUN(k, rope_forward_interleaved, x, 32, 8, 48, 16, cs, sn);
            } else {
              RUN(k, rope_backward_interleaved, x, 32, 8, 48, 16, cs, sn);
            }
          };
        });
  }
  add("add", "out32 a32 b16", [&](Store& s, DType d) {
    Tensor o = s.make(f, {N, C}, 1), a = s.make(f, {N, C}, 1), b = s.make(d, {N, C}, 1);
    return [=](Kern k) { RUN(k, add, o, a, b); };
  });
  add("add", "all16", [&](Store& s, DType d) {
    Tensor o = s.make(d, {N, C}, 1), a = s.make(d, {N, C}, 1), b = s.make(d, {N, C}, 1);
    return [=](Kern k) { RUN(k, add, o, a, b); };
  });
  add("add_inplace", "out32 a16", [&](Store& s, DType d) {
    Tensor o = s.make(f, {N, C}, 1), a = s.make(d, {N, C}, 1);
    return [=](Kern k) { RUN(k, add_inplace, o, a); };
  });
  add("scale_inplace", "x16 (N x 2I)", [&](Store& s, DType d) {
    Tensor x = s.make(d, {N, 2 * I}, 1);
    return [=](Kern k) { RUN(k, scale_inplace, x, 1.0f); };
  });
  add("fill", "x16 (N x 2I)", [&](Store& s, DType d) {
    Tensor x = s.make(d, {N, 2 * I}, 1);
    return [=](Kern k) { RUN(k, fill, x, 0.5f); };
  });
  add("copy_blocks", "16<-16, k|v heads out of qkv", [&](Store& s, DType d) {
    Tensor dst = s.make(d, {N, 2 * Hkv * D}, 1), src = s.make(d, {N, W}, 1);
    return [=](Kern k) { RUN(k, copy_blocks, dst, 0, D, src, H * D, D, 2 * Hkv, D, false); };
  });
  add("moe_permute", "xg16 x16 (top-4)", [&](Store& s, DType d) {
    Tensor xg = s.make(d, {M, C}, 1), x = s.make(d, {N, C}, 1), st = s.ints(sorted);
    return [=](Kern k) { RUN(k, moe_permute, xg, x, st, int(K)); };
  });
  add("moe_permute_backward", "dx16 dxg16", [&](Store& s, DType d) {
    Tensor dx = s.make(d, {N, C}, 1), dxg = s.make(d, {M, C}, 1), pos = s.ints(position);
    return [=](Kern k) { RUN(k, moe_permute_backward, dx, dxg, pos, false); };
  });
  add("moe_unpermute", "out32(+=) yg16 w32", [&](Store& s, DType d) {
    Tensor out = s.make(f, {N, C}, 1), yg = s.make(d, {M, C}, 1), w = s.make(f, {N, K}, 1), pos = s.ints(position);
    return [=](Kern k) { RUN(k, moe_unpermute, out, yg, w, pos); };
  });
  add("moe_unpermute_backward", "dyg16 dw32 dout32 yg16 w32", [&](Store& s, DType d) {
    Tensor dyg = s.make(d, {M, C}, 1), dw = s.make(f, {N, K}, 1), dout = s.make(f, {N, C}, 1);
    Tensor yg = s.make(d, {M, C}, 1), w = s.make(f, {N, K}, 1), st = s.ints(sorted);
    return [=](Kern k) { RUN(k, moe_unpermute_backward, dyg, dw, dout, yg, w, st); };
  });

  const std::string only = argc > 3 ? argv[3] : "";
  // The conversions every fused kernel is built on, alone (rows of 384 and one row of 2.9M).
  for (DType d : {DType::BF16, DType::F16}) {
    if (!only.empty() && only != "convert") break;
    std::vector<float> wide(size_t(N * 2 * I));
    std::vector<uint16_t> narrow(wide.size());
    std::normal_distribution<float> nd;
    for (float& v : wide) v = nd(rng);
    for (int64_t n : {int64_t(384), int64_t(wide.size())}) {
      const int64_t reps = int64_t(wide.size()) / n;
      const double ts = best_ms([&] {
        for (int64_t r = 0; r < reps; ++r) cpu::k16::store_row(narrow.data(), d, wide.data(), n);
      }, min_ms);
      const double tl = best_ms([&] {
        for (int64_t r = 0; r < reps; ++r) cpu::k16::load_row(wide.data(), narrow.data(), d, n);
      }, min_ms);
      std::printf("# %s conversion, one thread, rows of %ld: fp32->16 %.3f ns/element, 16->fp32 %.3f ns/element\n",
                  std::string(dtype_name(d)).c_str(), long(n), ts * 1e6 / double(n * reps),
                  tl * 1e6 / double(n * reps));
    }
  }
  std::printf("# %s, %d threads, 2048 tokens (B=8 T=256), d=256; best-of-5 CPU ms per call\n", std::string(dtype_name(h)).c_str(),
              omp_get_max_threads());
  std::printf("%-26s %-34s %9s %9s %9s %12s %10s\n", "op", "mix", "fp32", "generic", "fused", "generic/fused",
              "fused/fp32");
  for (const Bench& b : benches) {
    if (!only.empty() && b.op.find(only) == std::string::npos) continue;
    Store s32, s16;
    auto call32 = b.setup(s32, DType::F32);
    auto call16 = b.setup(s16, h);
    // A 4th argument runs one kernel only (for a profiler): fp32, generic or fused.
    const std::string which = argc > 4 ? argv[4] : "";
    std::vector<std::function<void()>> fns;
    std::vector<int> slot;
    const std::function<void()> all[3] = {[&] { call32(Kern::F32); }, [&] { call16(Kern::Generic); },
                                          [&] { call16(Kern::Fused); }};
    const char* names[3] = {"fp32", "generic", "fused"};
    for (int k = 0; k < 3; ++k) {
      if (which.empty() || which == names[k]) {
        fns.push_back(all[k]);
        slot.push_back(k);
      }
    }
    const std::vector<double> ms = best_ms(fns, min_ms);
    double t[3] = {0, 0, 0};
    for (size_t i = 0; i < ms.size(); ++i) t[slot[i]] = ms[i];
    const double t32 = t[0], tg = t[1], tf = t[2];
    std::printf("%-26s %-34s %9.3f %9.3f %9.3f %12.2f %10.2f\n", b.op.c_str(), b.mix.c_str(), t32, tg, tf, tg / tf,
                tf / t32);
    std::fflush(stdout);
  }
  return 0;
}
