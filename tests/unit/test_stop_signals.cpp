// Stop signals (SIGUSR1, SIGTERM) never interrupt a thread that computes: they are blocked in
// every thread and taken by one thread of their own (train/resilience.h). Each case runs in a
// process of its own (a death test, re-executed), so that, as in dstrain's main(), no thread
// that computes predates block_stop_signals().
#include <gtest/gtest.h>
#include <omp.h>
#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

#include "backend/cpu/sgemm.h"
#include "train/resilience.h"

namespace dstrain {
namespace {

bool blocked_here(int sig) {
  sigset_t now;
  pthread_sigmask(SIG_BLOCK, nullptr, &now);
  return sigismember(&now, sig) == 1;
}

// C = A·B, (128, 176)·(176, 64), on oneDNN's sgemm: a product whose JIT kernel (oneDNN 2.6)
// computes wrong results, and then corrupts the heap, when a signal handler interrupts it.
// That is how a SIGUSR1 during training once ended a run with `corrupted size vs. prev_size`.
// Returns the number of products (of `rounds`) that differ from the first, computed in quiet.
int products_under_a_storm_of_signals(int rounds) {
  constexpr int64_t M = 128, N = 64, K = 176;
  std::vector<float> a(M * K), b(K * N), want(M * N), c(M * N);
  for (size_t i = 0; i < a.size(); ++i) a[i] = float(int64_t(i * 2654435761u % 1000) - 500) / 1000.0f;
  for (size_t i = 0; i < b.size(); ++i) b[i] = float(int64_t(i * 40503u % 1000) - 500) / 1000.0f;
  cpu::set_sgemm_path(cpu::SgemmPath::kOneDnn);
  cpu::sgemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, want.data(), N);
  std::atomic<bool> done{false};
  std::atomic<int64_t> sent{0};
  std::thread sender([&] {
    while (!done.load()) {
      ::kill(::getpid(), SIGUSR1);  // to the process, as kill, scancel and Slurm send it
      sent.fetch_add(1);
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
  });
  int wrong = 0;
  for (int r = 0; r < rounds; ++r) {
    cpu::sgemm(false, false, M, N, K, 1.0f, a.data(), K, b.data(), N, 0.0f, c.data(), N);
    for (int64_t i = 0; i < M * N; ++i) {
      if (c[size_t(i)] != want[size_t(i)]) {
        ++wrong;
        break;
      }
    }
  }
  done.store(true);
  sender.join();
  std::fprintf(stderr, "%lld signals sent during %d products; %d products wrong\n", (long long)sent.load(), rounds,
               wrong);
  return wrong;
}

// The death test's child: 0 when no computing thread could be interrupted.
int child_compute_under_signals() {
  block_stop_signals();
  listen_for_stop_signals(StopSignalMode::kRequestStop);
  clear_stop_signal();
  const bool masked = blocked_here(SIGUSR1) && blocked_here(SIGTERM);
  std::atomic<int> unmasked_workers{0};
#pragma omp parallel num_threads(2)
  if (!blocked_here(SIGUSR1) || !blocked_here(SIGTERM)) unmasked_workers.fetch_add(1);
  const int wrong = products_under_a_storm_of_signals(20000);
  // The signals were taken, by the thread that listens for them.
  for (int i = 0; i < 5000 && stop_signal_received() == 0; ++i) usleep(1000);
  const int got = stop_signal_received();
  std::fprintf(stderr, "main thread masked: %d, OpenMP threads unmasked: %d, signal received: %d\n", int(masked),
               unmasked_workers.load(), got);
  stop_listening_for_stop_signals();
  std::fflush(stderr);
  return masked && unmasked_workers.load() == 0 && wrong == 0 && got == SIGUSR1 ? 0 : 1;
}

TEST(StopSignals, ComputingThreadsAreNeverInterrupted) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(std::_Exit(child_compute_under_signals()), ::testing::ExitedWithCode(0), "");
}

TEST(StopSignals, TerminateModeEndsTheProcessAsTheSignalWould) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        block_stop_signals();
        listen_for_stop_signals(StopSignalMode::kTerminate);
        ::kill(::getpid(), SIGTERM);
        std::this_thread::sleep_for(std::chrono::seconds(10));
        std::_Exit(0);  // not reached
      },
      ::testing::KilledBySignal(SIGTERM), "");
}

TEST(StopSignals, RequestModeSetsTheFlagAndTheListenerStops) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        block_stop_signals();
        listen_for_stop_signals(StopSignalMode::kRequestStop);
        clear_stop_signal();
        ::kill(::getpid(), SIGTERM);
        for (int i = 0; i < 5000 && stop_signal_received() == 0; ++i) usleep(1000);
        const int got = stop_signal_received();
        stop_listening_for_stop_signals();  // joins: must not hang
        std::_Exit(got == SIGTERM ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace dstrain
