// Reader throughput: samples of the configured training data read as the trainer reads them
// (blended, shuffled, ids checked), single-threaded, in tokens/s.
//   data_reader_bench RUN.json [samples=20000]
#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <chrono>
#include <cstdio>

#include "data/blend.h"
#include "data/data_pipeline.h"
#include "train/run_config.h"

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rc = 0;
  try {
    using namespace dstrain;
    if (argc < 2) throw Error("usage: data_reader_bench RUN.json [samples]");
    const RunConfig c = RunConfig::load(argv[1], {});
    const int64_t n = argc > 2 ? std::atoll(argv[2]) : 20000;
    auto sets = open_datasets(c.data.train, c.data, c.model.vocab_size, c.train.seed, false);
    Blender blend(int(sets.size()), c.data.schedule);
    std::vector<int32_t> sample(static_cast<size_t>(c.data.seq_len + 1));
    const auto t0 = std::chrono::steady_clock::now();
    int64_t done = 0;
    for (int64_t step = 0; done < n; ++step) {
      for (const auto& a : blend.next_batch(step, 64)) {
        sets[size_t(a.dataset)]->read_sample(a.index, sample.data());
        ++done;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("{\"samples\": %lld, \"seconds\": %.4f, \"tokens_per_s\": %.0f}\n", (long long)done, s,
                double(done) * double(c.data.seq_len) / s);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_reader_bench: error: %s\n", e.what());
    rc = 1;
  }
  MPI_Finalize();
  return rc;
}
