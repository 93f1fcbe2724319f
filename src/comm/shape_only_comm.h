// A communicator of a given size and rank that moves nothing, for code that runs on the meta
// device (backend/meta.h): its tensors have no values to move, but the code around a
// collective (its buffers, its waits) runs as it would. The one exchange of host values
// dstrain makes whose result shapes the rest, the MoE layers' counts of rows per expert, comes
// back as sent: what balanced loads give every rank. A collective or a send completes only
// when it is waited for, so the buffers that overlapped reductions and messages in flight hold
// stay held as long as they would when the network is slower than the compute (an upper
// bound); a receive completes at once (it is waited for where its message is used,
// train/pipeline.h). With an execution trace installed (core/exec_trace.h), each collective and
// send is recorded where it is issued and where it is waited for.
#pragma once

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/exec_trace.h"

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
  Work all_reduce_async(Tensor t, ReduceOp) override { return pending("all_reduce", t.nbytes()); }
  Work all_gather_async(Tensor out, Tensor) override { return pending("all_gather", out.nbytes()); }
  Work reduce_scatter_async(Tensor, Tensor in, ReduceOp) override { return pending("reduce_scatter", in.nbytes()); }
  Work all_gather_v_async(Tensor out, Tensor, const std::vector<int64_t>&) override {
    return pending("all_gather", out.nbytes());
  }
  Work reduce_scatter_v_async(Tensor, Tensor in, const std::vector<int64_t>&, ReduceOp) override {
    return pending("reduce_scatter", in.nbytes());
  }
  Work broadcast_async(Tensor t, int) override { return pending("broadcast", t.nbytes()); }
  Work all_to_all_async(Tensor out, Tensor in) override {
    if (out.device().is_cpu() && in.device().is_cpu() && out.nbytes() == in.nbytes()) {
      std::memcpy(out.raw(), in.raw(), in.nbytes());
    }
    if (ExecTrace* trace = current_trace(); trace && size_ > 1) {
      const int id = issue(*trace, "all_to_all", in.nbytes());
      waited(*trace, id);
    }
    return Work();
  }
  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>&, Tensor in, const std::vector<int64_t>&) override {
    return pending("all_to_all", std::max(out.nbytes(), in.nbytes()));
  }
  Work send_async(Tensor t, int, int) override { return pending("send", 0, t.nbytes()); }
  Work recv_async(Tensor, int, int) override { return Work(); }
  Work barrier_async() override { return Work(); }
  CommStats stats() const override { return {}; }

 private:
  int issue(ExecTrace& trace, const char* kind, size_t bytes) {
    TraceEvent e;
    e.kind = TraceEvent::Kind::Issue;
    e.name = kind;
    e.bytes = double(bytes);
    e.group = name_;
    e.group_size = size_;
    e.id = trace.new_id();
    const int id = e.id;
    trace.push(std::move(e));
    return id;
  }
  static void waited(ExecTrace& trace, int id) {
    TraceEvent e;
    e.kind = TraceEvent::Kind::Wait;
    e.id = id;
    trace.push(std::move(e));
  }
  // `bytes` held by the communication library while in flight; `traced` bytes the trace
  // records as the payload (a send's message, which holds no library buffer here).
  Work pending(const char* kind, size_t bytes, size_t traced = 0) {
    auto state = std::make_shared<WorkState>();
    auto waited = std::make_shared<bool>(false);
    InFlightBytes* f = in_flight_;
    const auto n = int64_t(bytes);
    if (f && size_ > 1) {
      f->now += n;
      f->peak = std::max(f->peak, f->now);
    }
    const bool counted = f && size_ > 1;
    ExecTrace* trace = size_ > 1 ? current_trace() : nullptr;
    const int id = trace ? issue(*trace, kind, traced ? traced : bytes) : -1;
    state->wait_fn = [waited, f, n, counted, trace, id] {
      if (!*waited && counted) f->now -= n;
      if (!*waited && trace && current_trace() == trace) ShapeOnlyCommunicator::waited(*trace, id);
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
