// What the GEMM libraries dstrain can link reach on this CPU for its linear layers, fp32 and
// 16-bit, beside dstrain's own linear ops. Prints one table row per
// (shape, layout, threads); GFLOP/s, median of the repeats ("-" = refused on this CPU).
//
//   gemm_ceiling [--threads 1,2] [--repeats 3] [--shapes square,d256,d1024] [--no-ops]
//
// Layouts of a linear layer with x (M,K), w (N,K), dout (M,N):
//   fwd  out = x · w^T     (M x N x K)
//   dx   dx = dout · w     (M x K x N)
//   dw   dw += dout^T · x  (N x K x M)
// Columns:
//   openblas     OpenBLAS cblas_sgemm with its own threads, fp32 operands
//   onednn       oneDNN dnnl_sgemm with its own threads, fp32 operands
//   cvt+sgemm    bf16 operands converted to fp32 (cpu::bf16_to_f32 bulk), then cpu::sgemm; fp32 out
//   dnnl-f32     oneDNN matmul, fp32 in and out (how oneDNN compares with OpenBLAS here)
//   dnnl-bf16    oneDNN matmul, bf16 in, fp32 out (fp32 accumulation)
//   dnnl-bf16o   oneDNN matmul, bf16 in, bf16 out
//   xsmm-bf16    libxsmm bf16 kernels (bf16 in, fp32 out), tiled 64x64 over OpenMP, fwd only
//   op-f32       linear_forward / linear_backward of the F32 slot, fp32 tensors (cpu::sgemm's
//                path: by default dstrain's split of each product over the threads)
//   op-bf16      the same ops' BF16-slot kernels on bf16 x, w, dout (bf16 out / dx; dw fp32)
//   bf16/f32     op-bf16 / op-f32, from runs of the two alternated (2 * repeats + 1 each)
// The model shapes are those of inputs/models/deepseek-llm-tiny.json (d=256) and
// deepseek-llm-cpu-d1024.json (d=1024) at M = 2048 tokens.
#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <dnnl.hpp>
#ifdef DSTRAIN_HAVE_LIBXSMM
#include <libxsmm.h>
#endif

#include "backend/cpu/convert16.h"
#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/gemm16.h"
#include "backend/cpu/sgemm.h"
#include "backend/ops.h"
#include "core/dtype.h"

using namespace dstrain;

namespace {

struct Shape3 {
  std::string name;
  int M, N, K;  // linear layer: x (M,K), w (N,K)
};

struct Gemm {  // row-major C (m,n) (+)= op(A) (m,k) · op(B) (k,n)
  bool ta, tb;
  int m, n, k;
  bool accumulate;
  int lda() const { return ta ? m : k; }
  int ldb() const { return tb ? k : n; }
};

Gemm layout(const Shape3& s, const std::string& l) {
  if (l == "fwd") return {false, true, s.M, s.N, s.K, false};
  if (l == "dx") return {false, false, s.M, s.K, s.N, false};
  return {true, false, s.N, s.K, s.M, true};  // dw
}

double seconds_of(const std::function<void()>& f) {
  auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median GFLOP/s of `repeats` runs after one warm-up; fewer runs when one takes over a second.
double gflops(const std::function<void()>& f, double flop, int repeats) {
  const double warm = seconds_of(f);
  if (warm > 1.0) repeats = 1;
  std::vector<double> r;
  for (int i = 0; i < repeats; ++i) r.push_back(flop / seconds_of(f) / 1e9);
  std::sort(r.begin(), r.end());
  return r[r.size() / 2];
}

// The same for two functions run alternately (f, g, f, g, ...), so that a change in the load of a
// shared machine hits both alike: their ratio is what the comparison needs.
std::pair<double, double> gflops_pair(const std::function<void()>& f, const std::function<void()>& g, double flop,
                                      int repeats) {
  const double warm = seconds_of(f) + seconds_of(g);
  if (warm > 2.0) repeats = 1;
  std::vector<double> a, b;
  for (int i = 0; i < repeats; ++i) {
    a.push_back(flop / seconds_of(f) / 1e9);
    b.push_back(flop / seconds_of(g) / 1e9);
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return {a[a.size() / 2], b[b.size() / 2]};
}

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(u(rng));
  return v;
}

dnnl::memory::desc md(int rows, int cols, bool transposed, dnnl::memory::data_type dt) {
  // (rows, cols) stored row-major, or as the transpose of a row-major (cols, rows) matrix.
  return dnnl::memory::desc({rows, cols}, dt, transposed ? dnnl::memory::dims{1, rows} : dnnl::memory::dims{cols, 1});
}

struct DnnlGemm {
  dnnl::matmul prim;
  dnnl::memory a, b, c;
  dnnl::stream strm;
  std::string impl;
  bool ok = false;
};

// A oneDNN matmul for `g` over the given buffers; ok = false when oneDNN refuses it here.
DnnlGemm make_dnnl(dnnl::engine& eng, const Gemm& g, dnnl::memory::data_type in, dnnl::memory::data_type out, void* A,
                   void* B, void* C) {
  DnnlGemm d;
  try {
    auto amd = md(g.m, g.k, g.ta, in), bmd = md(g.k, g.n, g.tb, in), cmd = md(g.m, g.n, false, out);
    dnnl::primitive_attr attr;
    if (g.accumulate) {
      dnnl::post_ops po;
      po.append_sum(1.0f);
      attr.set_post_ops(po);
    }
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(amd, bmd, cmd), attr, eng);
    d.impl = pd.impl_info_str();
    d.prim = dnnl::matmul(pd);
    d.a = dnnl::memory(amd, eng, A);
    d.b = dnnl::memory(bmd, eng, B);
    d.c = dnnl::memory(cmd, eng, C);
    d.strm = dnnl::stream(eng);
    d.ok = true;
  } catch (const dnnl::error&) {
  }
  return d;
}

void run_dnnl(DnnlGemm& d) {
  d.prim.execute(d.strm, {{DNNL_ARG_SRC, d.a}, {DNNL_ARG_WEIGHTS, d.b}, {DNNL_ARG_DST, d.c}});
  d.strm.wait();
}

void print_cell(double v) {
  if (v < 0) {
    std::printf(" %10s", "-");
  } else {
    std::printf(" %10.1f", v);
  }
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> v;
  size_t p = 0;
  while (p < s.size()) {
    size_t q = s.find(',', p);
    if (q == std::string::npos) q = s.size();
    v.push_back(std::atoi(s.substr(p, q - p).c_str()));
    p = q + 1;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads = {1, 2};
  int repeats = 3;
  std::string shapes = "square,d256,d1024";
  bool with_ops = true;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) {
      threads = parse_ints(argv[++i]);
    } else if (a == "--repeats" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
    } else if (a == "--shapes" && i + 1 < argc) {
      shapes = argv[++i];
    } else if (a == "--no-ops") {
      with_ops = false;
    } else {
      std::fprintf(stderr, "usage: gemm_ceiling [--threads 1,2] [--repeats 3] [--shapes square,d256,d1024] [--no-ops]\n");
      return 2;
    }
  }

  std::vector<Shape3> list;
  const int T = 2048;
  if (shapes.find("square") != std::string::npos) list.push_back({"square2048", 2048, 2048, 2048});
  if (shapes.find("d256") != std::string::npos) {
    // deepseek-llm-tiny: hidden 256, 4 heads of 64 (2 kv heads), intermediate 704, vocab 512
    list.push_back({"d256.qkv", T, 512, 256});
    list.push_back({"d256.o", T, 256, 256});
    list.push_back({"d256.gate_up", T, 1408, 256});
    list.push_back({"d256.down", T, 256, 704});
    list.push_back({"d256.head", T, 512, 256});
  }
  if (shapes.find("d1024") != std::string::npos) {
    // deepseek-llm-cpu-d1024: hidden 1024, 16 heads of 64 (4 kv heads), intermediate 2816
    list.push_back({"d1024.qkv", T, 1536, 1024});
    list.push_back({"d1024.o", T, 1024, 1024});
    list.push_back({"d1024.gate_up", T, 5632, 1024});
    list.push_back({"d1024.down", T, 1024, 2816});
  }

  dnnl::engine eng(dnnl::engine::kind::cpu, 0);
#ifdef DSTRAIN_HAVE_LIBXSMM
  libxsmm_init();
  std::printf("libxsmm %s: target %s\n", LIBXSMM_VERSION, libxsmm_get_target_arch());
#else
  std::printf("libxsmm: not built in\n");
#endif
  {
    const dnnl_version_t* v = dnnl_version();
    std::printf("oneDNN %d.%d.%d: effective ISA %d (avx2 = %d, avx512_core = %d, avx512_core_bf16 = %d, amx = %d)\n",
                v->major, v->minor, v->patch, int(dnnl::get_effective_cpu_isa()), int(dnnl::cpu_isa::avx2),
                int(dnnl::cpu_isa::avx512_core), int(dnnl::cpu_isa::avx512_core_bf16),
                int(dnnl::cpu_isa::avx512_core_amx));
  }
  std::printf("dstrain 16-bit GEMM path: %s\n", cpu::gemm16_path_description().c_str());
  std::printf("GFLOP/s, median of %d runs\n", repeats);
  std::printf("%-14s %-4s %5s %5s %5s %3s", "shape", "lay", "m", "n", "k", "thr");
  std::printf("dstrain fp32 GEMM: %s\n", cpu::sgemm_path_name().c_str());
  for (const char* c : {"openblas", "onednn", "cvt+sgemm", "dnnl-f32", "dnnl-bf16", "dnnl-bf16o", "xsmm-bf16", "op-f32", "op-bf16",
                        "bf16/f32"}) {
    std::printf(" %10s", c);
  }
  std::printf("\n");

  std::vector<std::string> impl_notes;
  auto note = [&](const std::string& s) {
    if (std::find(impl_notes.begin(), impl_notes.end(), s) == impl_notes.end()) impl_notes.push_back(s);
  };

  for (const Shape3& s : list) {
    const size_t nx = size_t(s.M) * s.K, nw = size_t(s.N) * s.K, no = size_t(s.M) * s.N;
    // bf16 operands and their exact fp32 images.
    std::vector<uint16_t> xb = random_bf16(nx, 1), wb = random_bf16(nw, 2), db = random_bf16(no, 3);
    std::vector<float> xf(nx), wf(nw), df(no);
    cpu::bulk_bf16_to_f32(xb.data(), xf.data(), int64_t(nx));
    cpu::bulk_bf16_to_f32(wb.data(), wf.data(), int64_t(nw));
    cpu::bulk_bf16_to_f32(db.data(), df.data(), int64_t(no));
    std::vector<float> cf(std::max({nx, nw, no})), af(std::max({nx, nw, no})), bf(std::max({nx, nw, no}));
    std::vector<uint16_t> cb(cf.size());
    for (const char* lay : {"fwd", "dx", "dw"}) {
      const Gemm g = layout(s, lay);
      const std::string L = lay;
      // Operands of this layout.
      const uint16_t* Ab = L == "fwd" ? xb.data() : db.data();
      const uint16_t* Bb = L == "dw" ? xb.data() : wb.data();
      const float* Af = L == "fwd" ? xf.data() : df.data();
      const float* Bf = L == "dw" ? xf.data() : wf.data();
      const size_t na = size_t(g.m) * g.k, nb = size_t(g.k) * g.n;
      const double flop = 2.0 * g.m * double(g.n) * g.k;
      for (int t : threads) {
        omp_set_num_threads(t);
        std::vector<double> row;
        const float c_beta = g.accumulate ? 1.0f : 0.0f;
        row.push_back(gflops(
            [&] {
              cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans, g.tb ? CblasTrans : CblasNoTrans, g.m, g.n,
                          g.k, 1.0f, Af, g.lda(), Bf, g.ldb(), c_beta, cf.data(), g.n);
            },
            flop, repeats));
        row.push_back(gflops(
            [&] {
              dnnl_sgemm(g.ta ? 'T' : 'N', g.tb ? 'T' : 'N', g.m, g.n, g.k, 1.0f, Af, g.lda(), Bf, g.ldb(), c_beta,
                         cf.data(), g.n);
            },
            flop, repeats));
        auto sgemm = [&](const float* A, const float* B) {
          cpu::sgemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, A, g.lda(), B, g.ldb(), c_beta, cf.data(), g.n);
        };
        row.push_back(gflops(
            [&] {
              cpu::bulk_bf16_to_f32(Ab, af.data(), int64_t(na));
              cpu::bulk_bf16_to_f32(Bb, bf.data(), int64_t(nb));
              sgemm(af.data(), bf.data());
            },
            flop, repeats));
        using dt = dnnl::memory::data_type;
        for (auto [in, out] : {std::pair{dt::f32, dt::f32}, std::pair{dt::bf16, dt::f32}, std::pair{dt::bf16, dt::bf16}}) {
          void* A = in == dt::f32 ? (void*)Af : (void*)Ab;
          void* B = in == dt::f32 ? (void*)Bf : (void*)Bb;
          void* C = out == dt::f32 ? (void*)cf.data() : (void*)cb.data();
          DnnlGemm d = make_dnnl(eng, g, in, out, A, B, C);
          if (d.ok) {
            note(std::string("oneDNN ") + (in == dt::f32 ? "f32" : "bf16") + "->" + (out == dt::f32 ? "f32" : "bf16") +
                 ": " + d.impl);
            row.push_back(gflops([&] { run_dnnl(d); }, flop, repeats));
          } else {
            note(std::string("oneDNN ") + (in == dt::f32 ? "f32" : "bf16") + "->" + (out == dt::f32 ? "f32" : "bf16") +
                 ": refused (could not create a primitive descriptor)");
            row.push_back(-1);
          }
        }
        double xs = -1;
#ifdef DSTRAIN_HAVE_LIBXSMM
        {
          // Column-major view: C^T (n,m) = B^T (n,k) · A^T (k,m); 64 x 64 blocks of C^T, full k.
          const libxsmm_blasint bm = std::min(64, g.n), bn = std::min(64, g.m), kk = g.k;
          const libxsmm_blasint lda = g.n, ldb = g.k, ldc = g.n;
          const float alpha = 1.0f, beta = 0.0f;
          const int flags = LIBXSMM_GEMM_FLAG_VNNI_A;
          libxsmm_bsmmfunction f =
              libxsmm_bsmmdispatch(bm, bn, kk, &lda, &ldb, &ldc, &alpha, &beta, &flags, nullptr);
          if (!f) {
            const int plain = 0;
            f = libxsmm_bsmmdispatch(bm, bn, kk, &lda, &ldb, &ldc, &alpha, &beta, &plain, nullptr);
          }
          if (f && L == "fwd" && g.n % bm == 0 && g.m % bn == 0) {
            note("libxsmm bf16: JIT kernel (timing only: operands taken as already in its layout)");
            // B of fwd is w (N,K) row-major = w^T (K,N) column-major... taken as packed: timing only.
            const auto* A = reinterpret_cast<const libxsmm_bfloat16*>(Bb);
            const auto* B = reinterpret_cast<const libxsmm_bfloat16*>(Ab);
            xs = gflops(
                [&] {
#pragma omp parallel for collapse(2) schedule(static)
                  for (int j = 0; j < g.m; j += int(bn)) {
                    for (int i = 0; i < g.n; i += int(bm)) f(A + i, B + size_t(j) * g.k, cf.data() + size_t(j) * g.n + i);
                  }
                },
                flop, repeats);
          } else if (!f) {
            note("libxsmm bf16: no kernel (libxsmm_bsmmdispatch returns NULL: bf16 JIT needs AVX-512)");
          }
        }
#endif
        row.push_back(xs);
        double opf = -1, opb = -1;
        if (with_ops) {
          // dstrain's ops on the layer's tensors (the three layouts are three calls).
          // Host memory the tensors view (no allocator needed).
          std::vector<float> x32 = xf, w32 = wf, d32 = df, o32(std::max(no, nx)), g32(nw);
          std::vector<uint16_t> x16 = xb, w16 = wb, d16 = db, o16(std::max(no, nx));
          auto mk = [](auto& v, int r, int c) {
            using V = typename std::decay_t<decltype(v)>::value_type;
            return Tensor(v.data(), std::is_same_v<V, float> ? DType::F32 : DType::BF16, Shape{r, c});
          };
          auto call = [&](auto& x, auto& w, auto& d, auto& o) {
            // The kernels of the F32 and BF16 slots (what ops::linear_* dispatches to).
            const bool half = !std::is_same_v<typename std::decay_t<decltype(x)>::value_type, float>;
            auto fwd = half ? &cpu::linear_forward_16bit : &cpu::linear_forward;
            auto bwd = half ? &cpu::linear_backward_16bit : &cpu::linear_backward;
            if (L == "fwd") {
              fwd(mk(o, s.M, s.N), mk(x, s.M, s.K), mk(w, s.N, s.K), false);
            } else if (L == "dx") {
              bwd(mk(o, s.M, s.K), Tensor(), mk(d, s.M, s.N), mk(x, s.M, s.K), mk(w, s.N, s.K), false);
            } else {
              bwd(Tensor(), mk(g32, s.N, s.K), mk(d, s.M, s.N), mk(x, s.M, s.K), mk(w, s.N, s.K), false);
            }
          };
          std::tie(opf, opb) = gflops_pair([&] { call(x32, w32, d32, o32); }, [&] { call(x16, w16, d16, o16); }, flop,
                                           2 * repeats + 1);
        }
        row.push_back(opf);
        row.push_back(opb);
        std::printf("%-14s %-4s %5d %5d %5d %3d", s.name.c_str(), lay, g.m, g.n, g.k, t);
        for (double v : row) print_cell(v);
        if (opf > 0) {
          std::printf(" %10.2f", opb / opf);
        } else {
          std::printf(" %10s", "-");
        }
        std::printf("\n");
        std::fflush(stdout);
      }
    }
  }
  for (const std::string& n : impl_notes) std::printf("note: %s\n", n.c_str());
  return 0;
}
