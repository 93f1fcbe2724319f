// A communicator whose link is slow on purpose (tests and benchmarks of asynchronous gradient
// aggregation, train.gradient_sync.test_slow_link): every collective runs on the wrapped
// communicator, and its completion is held back until latency + the bytes this rank sends by
// the ring algorithm (all-reduce: 2 (n-1)/n of the payload; gathers, scatters, all-to-all:
// (n-1)/n) at `gbit_per_s` have passed since the link was free. Operations queue on the link
// one after another, as on a real one. Waiting for an operation that completed in the
// background, while the caller computed, costs nothing: what overlaps is hidden.
#pragma once

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/comm.h"

namespace dstrain {

class SlowLinkCommunicator final : public Communicator {
 public:
  using Clock = std::chrono::steady_clock;
  SlowLinkCommunicator(Communicator& inner, double latency_ms, double gbit_per_s)
      : inner_(inner), latency_s_(latency_ms * 1e-3), bytes_per_s_(gbit_per_s > 0 ? gbit_per_s * 1e9 / 8 : 0) {}

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string name() const override { return inner_.name() + " (slowed)"; }
  CommStats stats() const override { return inner_.stats(); }
  // The link's time for an operation sending `bytes` from this rank.
  double link_seconds(double bytes) const { return latency_s_ + (bytes_per_s_ > 0 ? bytes / bytes_per_s_ : 0); }

  Work all_reduce_async(Tensor t, ReduceOp op) override {
    return hold(inner_.all_reduce_async(t, op), ring(2, double(t.nbytes())));
  }
  Work all_gather_async(Tensor out, Tensor in) override {
    return hold(inner_.all_gather_async(out, in), ring(1, double(out.nbytes())));
  }
  Work reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) override {
    return hold(inner_.reduce_scatter_async(out, in, op), ring(1, double(in.nbytes())));
  }
  Work all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) override {
    return hold(inner_.all_gather_v_async(out, in, counts), ring(1, double(out.nbytes())));
  }
  Work reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts, ReduceOp op) override {
    return hold(inner_.reduce_scatter_v_async(out, in, counts, op), ring(1, double(in.nbytes())));
  }
  Work broadcast_async(Tensor t, int root) override {
    return hold(inner_.broadcast_async(t, root), double(t.nbytes()));
  }
  Work all_to_all_async(Tensor out, Tensor in) override {
    return hold(inner_.all_to_all_async(out, in), ring(1, double(in.nbytes())));
  }
  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                          const std::vector<int64_t>& in_counts) override {
    return hold(inner_.all_to_all_v_async(out, out_counts, in, in_counts), ring(1, double(in.nbytes())));
  }
  Work send_async(Tensor t, int peer, int tag) override { return hold(inner_.send_async(t, peer, tag), double(t.nbytes())); }
  Work recv_async(Tensor t, int peer, int tag) override { return hold(inner_.recv_async(t, peer, tag), 0); }
  Work barrier_async() override { return hold(inner_.barrier_async(), 0); }

 private:
  double ring(int passes, double bytes) const {
    const int n = inner_.size();
    return n > 1 ? passes * bytes * double(n - 1) / double(n) : 0;
  }
  Work hold(Work inner, double bytes) {
    if (inner_.size() == 1) return inner;
    Clock::time_point done;
    {
      std::lock_guard lock(mutex_);
      const Clock::time_point start = std::max(Clock::now(), link_free_);
      done = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(link_seconds(bytes)));
      link_free_ = done;
    }
    auto state = std::make_shared<WorkState>();
    state->op = "slowed";
    auto w = std::make_shared<Work>(std::move(inner));
    state->wait_fn = [w, done] {
      w->wait();
      std::this_thread::sleep_until(done);
    };
    state->test_fn = [w, done] { return Clock::now() >= done && w->test(); };
    return Work(state);
  }

  Communicator& inner_;
  double latency_s_, bytes_per_s_;
  std::mutex mutex_;
  Clock::time_point link_free_{};
};

}  // namespace dstrain
