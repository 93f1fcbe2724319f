// GoogleTest main for tests run under mpirun at several rank counts. A test fails on every
// rank when it fails on any rank (ranks must never disagree silently), rank 0 prints the
// report, and other ranks print only their own failures, prefixed with their rank.
#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

#include "comm/watchdog.h"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) {
      std::fprintf(stderr, "[rank %d] %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
    }
  }

 private:
  int rank_;
};

// After each test, every rank learns whether any rank failed it.
class AgreeOnFailure : public ::testing::EmptyTestEventListener {
 public:
  void OnTestEnd(const ::testing::TestInfo& info) override {
    int mine = info.result()->Failed() ? 1 : 0, any = 0;
    MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (any && !mine) {
      // Recorded against the test that just ended; GoogleTest counts it as failed.
      ::testing::internal::AssertHelper(::testing::TestPartResult::kNonFatalFailure, __FILE__, __LINE__,
                                        "this test failed on another rank") = ::testing::Message();
    }
  }
};

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  listeners.Append(new AgreeOnFailure);
  int rc = 0;
  {
    Kokkos::ScopeGuard kokkos(argc, argv);
    // A test whose ranks stop agreeing ends with the watchdog's report, not a silent hang.
    dstrain::Watchdog::instance().start(120);
    rc = RUN_ALL_TESTS();
    dstrain::Watchdog::instance().stop();
  }
  // The job's exit status is failure if any rank failed.
  int any = 0;
  MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return any;
}
