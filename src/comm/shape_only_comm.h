// A communicator of a given size and rank that moves nothing, for code that runs on the meta
// device (backend/meta.h): its tensors have no values to move, but the code around a
// collective (its buffers, its waits) runs as it would. The one exchange of host values
// dstrain makes whose result shapes the rest, the MoE layers' counts of rows per expert, comes
// back as sent: what balanced loads give every rank. A collective completes only when it is
// waited for, so the buffers that overlapped reductions hold stay held as long as they would
// when the network is slower than the compute; a point-to-point message completes at once
// (its receive is posted ahead, train/pipeline.h).
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"

namespace dstrain {

class ShapeOnlyCommunicator final : public Communicator {
 public:
  ShapeOnlyCommunicator(std::string name, int rank, int size) : name_(std::move(name)), rank_(rank), size_(size) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  Work all_reduce_async(Tensor, ReduceOp) override { return pending(); }
  Work all_gather_async(Tensor, Tensor) override { return pending(); }
  Work reduce_scatter_async(Tensor, Tensor, ReduceOp) override { return pending(); }
  Work all_gather_v_async(Tensor, Tensor, const std::vector<int64_t>&) override { return pending(); }
  Work reduce_scatter_v_async(Tensor, Tensor, const std::vector<int64_t>&, ReduceOp) override { return pending(); }
  Work broadcast_async(Tensor, int) override { return pending(); }
  Work all_to_all_async(Tensor out, Tensor in) override {
    if (out.device().is_cpu() && in.device().is_cpu() && out.nbytes() == in.nbytes()) {
      std::memcpy(out.raw(), in.raw(), in.nbytes());
    }
    return Work();
  }
  Work all_to_all_v_async(Tensor, const std::vector<int64_t>&, Tensor, const std::vector<int64_t>&) override {
    return pending();
  }
  Work send_async(Tensor, int, int) override { return Work(); }
  Work recv_async(Tensor, int, int) override { return Work(); }
  Work barrier_async() override { return Work(); }
  CommStats stats() const override { return {}; }

 private:
  static Work pending() {
    auto state = std::make_shared<WorkState>();
    auto waited = std::make_shared<bool>(false);
    state->wait_fn = [waited] { *waited = true; };
    state->test_fn = [waited] { return *waited; };
    return Work(state);
  }
  std::string name_;
  int rank_, size_;
};

}  // namespace dstrain
