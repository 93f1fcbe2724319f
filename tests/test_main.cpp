// GoogleTest main for dstrain's single-process tests: MPI (a one-rank job when not started
// by mpirun) and Kokkos live for the whole test program, initialised in that order.
#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  ::testing::InitGoogleTest(&argc, argv);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    rc = RUN_ALL_TESTS();
  }
  MPI_Finalize();
  return rc;
}
