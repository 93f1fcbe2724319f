// Measures the sgemm throughput this machine reaches with the fp32 GEMM dstrain uses
// (backend/cpu/sgemm.h): the ceiling against which dstrain's achieved FLOP/s are judged
// (validation/bench_vs_torch.py).
//   sgemm_ceiling [n=2048] [repeats=5]   prints the median GFLOP/s of an n x n x n product, and
//                                         on a second line the library's name
#include "backend/cpu/sgemm.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 2048;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  std::vector<float> a(size_t(n) * n, 0.5f), b(size_t(n) * n, 0.25f), c(size_t(n) * n);
  auto run = [&] {
    dstrain::cpu::sgemm(false, true, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  };
  run();  // warm up
  std::vector<double> gflops;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    run();
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    gflops.push_back(2.0 * n * double(n) * n / s / 1e9);
  }
  std::sort(gflops.begin(), gflops.end());
  std::printf("%.1f\n%s\n", gflops[gflops.size() / 2], dstrain::cpu::sgemm_path_name().c_str());
  return 0;
}
