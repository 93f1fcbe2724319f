// What a rank runs: dstrain's build, the libraries it is linked with and the CPU it runs on.
// Ranks compare theirs at start, so a job that mixes builds or library versions stops before
// it trains, and one that mixes CPUs or thread counts says so; the job's environment is
// recorded in checkpoints and at the head of metrics.jsonl.
#pragma once

#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/json_reader.h"

namespace dstrain {

struct Environment {
  std::string host;
  // The build and the libraries: ranks that differ here are an error.
  std::string dstrain_version, commit;
  std::string compiler;  // "GCC 12.2.0"
  std::string mpi;       // MPI_Get_library_version
  std::string hdf5;      // H5get_libversion
  std::string blas;      // openblas_get_config without the CPU-dependent core name
  std::string gemm;      // the fp32 GEMM's library: "oneDNN 2.6.3, DSTRAIN_CPU_SGEMM unset"
  // The machine: ranks that differ here are a warning.
  int64_t omp_threads = 0;
  std::string cpu_model;
  std::vector<std::string> cpu_features;  // the kernel-relevant ones present: avx2, avx512f, amx_bf16, sve...
  std::string blas_kernels;               // the kernel set OpenBLAS chose for this CPU ("Haswell", "SkylakeX")

  json to_json() const;
  static Environment from_json(const json& j);
};

// This process's environment.
Environment local_environment();

// The outcome of the comparison over the job.
struct JobEnvironment {
  json record;                        // rank 0's environment, the world size, the hosts and the warnings
  std::vector<std::string> warnings;  // CPUs or thread counts that differ, BLAS kernels below the CPU
};

// Gathers every rank's environment over `world` (collective). A different dstrain build or
// library version throws the same Error on every rank, naming the ranks and their hosts; a
// different CPU or thread count comes back as a warning. `mine` is normally
// local_environment(); tests pass a doctored one.
JobEnvironment check_same_environment(Communicator& world, const Environment& mine);

// This machine's host name, as ranks name themselves in messages and lock files.
std::string host_name();

}  // namespace dstrain
