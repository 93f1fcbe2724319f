// A communicator of a given size and rank that moves nothing, for code that runs on the meta
// device (backend/meta.h): its tensors have no values to move, but the code around a
// collective (its buffers, its waits) runs as it would. The one exchange of host values
// dstrain makes whose result shapes the rest, the MoE layers' counts of rows per expert, comes
// back as sent: what balanced loads give every rank. A collective or a send completes only
// when it is waited for, so the buffers that overlapped reductions and messages in flight hold
// stay held as long as they would when the network is slower than the compute (an upper
// bound); a receive completes at once (it is waited for where its message is used,
// train/pipeline.h).
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace dstrain {

// Bytes of the collectives in flight, now and at their peak: the payloads the communication
// library holds temporaries for (MPI's reductions allocate one of the message's size; NCCL has
// buffers of its own), outside dstrain's allocator.
struct InFlightBytes {
  int64_t now = 0, peak = 0;
};

class ShapeOnlyCommunicator final : public Communicator {
 public:
  ShapeOnlyCommunicator(std::string name, int rank, int size, InFlightBytes* in_flight = nullptr)
      : name_(std::move(name)), rank_(rank), size_(size), in_flight_(in_flight) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  Work all_reduce_async(Tensor t, ReduceOp) override { return pending(t.nbytes()); }
  Work all_gather_async(Tensor out, Tensor) override { return pending(out.nbytes()); }
  Work reduce_scatter_async(Tensor, Tensor in, ReduceOp) override { return pending(in.nbytes()); }
  Work all_gather_v_async(Tensor out, Tensor, const std::vector<int64_t>&) override { return pending(out.nbytes()); }
  Work reduce_scatter_v_async(Tensor, Tensor in, const std::vector<int64_t>&, ReduceOp) override {
    return pending(in.nbytes());
  }
  Work broadcast_async(Tensor t, int) override { return pending(t.nbytes()); }
  Work all_to_all_async(Tensor out, Tensor in) override {
    if (out.device().is_cpu() && in.device().is_cpu() && out.nbytes() == in.nbytes()) {
      std::memcpy(out.raw(), in.raw(), in.nbytes());
    }
    return Work();
  }
  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>&, Tensor in, const std::vector<int64_t>&) override {
    return pending(std::max(out.nbytes(), in.nbytes()));
  }
  Work send_async(Tensor, int, int) override { return pending(0); }
  Work recv_async(Tensor, int, int) override { return Work(); }
  Work barrier_async() override { return Work(); }
  CommStats stats() const override { return {}; }

 private:
  Work pending(size_t bytes) {
    auto state = std::make_shared<WorkState>();
    auto waited = std::make_shared<bool>(false);
    InFlightBytes* f = in_flight_;
    const auto n = int64_t(bytes);
    if (f && size_ > 1) {
      f->now += n;
      f->peak = std::max(f->peak, f->now);
    }
    const bool counted = f && size_ > 1;
    state->wait_fn = [waited, f, n, counted] {
      if (!*waited && counted) f->now -= n;
      *waited = true;
    };
    state->test_fn = [waited] { return *waited; };
    return Work(state);
  }
  std::string name_;
  int rank_, size_;
  InFlightBytes* in_flight_;
};

}  // namespace dstrain
