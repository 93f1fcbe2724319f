// Ranks compare what they run at start: a different build or library version on one rank is
// the same error on every rank, naming that rank and its host; a different CPU or thread
// count is only a warning.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "comm/environment.h"
#include "comm/mpi_comm.h"
#include "core/error.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;

class SameEnvironment : public ::testing::Test {
 protected:
  MpiCommunicator impl{MPI_COMM_WORLD, "test"};
  Communicator& comm = impl;
  int r = comm.rank(), n = comm.size();
  Environment mine = local_environment();
  int odd = n - 1;  // the rank that pretends to differ

  // An AVX2 CPU with matching OpenBLAS kernels, whatever this machine is.
  void set_avx2_cpu() {
    mine.cpu_model = "Test CPU";
    mine.cpu_features = {"avx", "avx2", "fma"};
    mine.blas_kernels = "Haswell";
  }
};

TEST_F(SameEnvironment, LocalEnvironmentNamesTheBuildAndLibraries) {
  EXPECT_FALSE(mine.host.empty());
  EXPECT_FALSE(mine.dstrain_version.empty());
  EXPECT_THAT(mine.mpi, HasSubstr("MPI"));
  EXPECT_THAT(mine.hdf5, ::testing::MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
  EXPECT_THAT(mine.blas, HasSubstr("OpenBLAS"));
  EXPECT_THAT(mine.gemm, HasSubstr("oneDNN"));
  EXPECT_GT(mine.omp_threads, 0);
  EXPECT_FALSE(mine.cpu_model.empty());
  set_avx2_cpu();
  const JobEnvironment job = check_same_environment(comm, mine);
  EXPECT_TRUE(job.warnings.empty());
  EXPECT_EQ(job.record["world_size"], n);
  EXPECT_EQ(job.record["mpi"], mine.mpi);
  EXPECT_EQ(job.record["hdf5"], mine.hdf5);
  EXPECT_EQ(job.record["blas"], mine.blas);
  EXPECT_EQ(job.record["warnings"], "");
}

TEST_F(SameEnvironment, ALibraryVersionOnOneRankIsAnErrorOnEveryRank) {
  if (r == odd) mine.mpi = "Other MPI v9.9";
  if (n == 1) {
    EXPECT_NO_THROW(check_same_environment(comm, mine)) << "one rank agrees with itself";
    return;
  }
  try {
    check_same_environment(comm, mine);
    ADD_FAILURE() << "no error for a different MPI library on rank " << odd;
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_THAT(what, HasSubstr("MPI library"));
    EXPECT_THAT(what, HasSubstr(fmt::format("\"Other MPI v9.9\" on rank {} ({})", odd, mine.host)));
    EXPECT_THAT(what, HasSubstr(fmt::format("rank 0 ({})", mine.host)));
    EXPECT_THAT(what, ::testing::Not(HasSubstr("HDF5 library")));
  }
  // The job goes on after the error on every rank: nobody is left in a collective.
  comm.barrier();
}

// DSTRAIN_CPU_SGEMM changes which library multiplies, so the bits of every step.
TEST_F(SameEnvironment, AnotherGemmLibraryIsAnError) {
  if (n == 1) return;  // one rank agrees with itself
  if (r == odd) mine.gemm = "oneDNN 2.6.3, DSTRAIN_CPU_SGEMM 'openblas'";
  std::string what;
  try {
    check_same_environment(comm, mine);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_THAT(what, HasSubstr("GEMM library"));
  EXPECT_THAT(what, HasSubstr(fmt::format("DSTRAIN_CPU_SGEMM 'openblas'\" on rank {}", odd)));
  comm.barrier();
}

TEST_F(SameEnvironment, AnotherBuildIsAnError) {
  if (n == 1) return;  // one rank agrees with itself
  if (r == odd) mine.commit = "0123abc";
  std::string what;
  try {
    check_same_environment(comm, mine);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_THAT(what, HasSubstr("dstrain commit"));
  EXPECT_THAT(what, HasSubstr(fmt::format("\"0123abc\" on rank {} ({})", odd, mine.host)));
}

TEST_F(SameEnvironment, ACpuFeatureOrThreadCountDifferenceIsOnlyAWarning) {
  set_avx2_cpu();
  if (r == odd) {
    mine.cpu_features.push_back("amx_bf16");
    mine.blas_kernels = "SapphireRapids";
    mine.omp_threads += 3;
  }
  JobEnvironment job;
  ASSERT_NO_THROW(job = check_same_environment(comm, mine));
  if (n == 1) {
    EXPECT_TRUE(job.warnings.empty());
    return;
  }
  ASSERT_EQ(job.warnings.size(), 2u);
  EXPECT_THAT(job.warnings[0], HasSubstr("different CPUs or CPU features"));
  EXPECT_THAT(job.warnings[0],
              HasSubstr("amx_bf16; OpenBLAS kernels SapphireRapids)\" on rank " + std::to_string(odd)));
  EXPECT_THAT(job.warnings[1], HasSubstr("OpenMP thread counts"));
  EXPECT_THAT(job.record["warnings"].get<std::string>(), HasSubstr("amx_bf16"));
}

// OpenBLAS falling back to SSE kernels on an AVX2 CPU (an unrecognised CPU model) is named,
// with the setting that fixes it.
TEST_F(SameEnvironment, SseKernelsOnAnAvx2CpuAreAWarning) {
  set_avx2_cpu();
  mine.cpu_features.push_back("avx512f");
  if (r == odd) mine.blas_kernels = "Prescott";
  const JobEnvironment job = check_same_environment(comm, mine);
  ASSERT_FALSE(job.warnings.empty());
  const std::string& w = job.warnings.back();
  EXPECT_THAT(w, HasSubstr("OpenBLAS runs Prescott kernels, without AVX2, on a CPU with avx2 and fma and avx512f"));
  EXPECT_THAT(w, HasSubstr(n == 1 ? "(every rank)" : fmt::format("(rank {} ({}))", odd, mine.host)));
  EXPECT_THAT(w, HasSubstr("OPENBLAS_CORETYPE=SkylakeX"));
}

}  // namespace
}  // namespace dstrain
