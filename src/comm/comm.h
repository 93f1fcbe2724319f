// Collectives behind one interface per communicator. Element counts and datatypes come from
// the tensors, never from the caller. Every operation exists blocking and asynchronous; an
// asynchronous one returns a Work handle to wait on or test. Operations on one communicator
// run in the order they were issued, as every rank must issue them in the same order.
// MPI implements this now (comm/mpi_comm.h); NCCL implements it for device tensors.
#pragma once

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace dstrain {

enum class ReduceOp { Sum, Max, Min };

// The shared state of one issued operation.
struct WorkState {
  std::string op;       // "all_reduce", ...
  uint64_t seq = 0;     // per-communicator sequence number
  std::chrono::steady_clock::time_point issued, started, finished;
  std::mutex mutex;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
  // Operations that complete outside a worker (point-to-point) supply these instead.
  std::function<void()> wait_fn;
  std::function<bool()> test_fn;
};

class Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<WorkState> s) : state_(std::move(s)) {}
  // Blocks until the operation completed; rethrows its error.
  void wait();
  // True when completed (rethrows its error then).
  bool test();
  bool valid() const { return state_ != nullptr; }
  const WorkState* state() const { return state_.get(); }

 private:
  std::shared_ptr<WorkState> state_;
};

// Cumulative counters of a communicator, for metrics (time is spent inside the operations).
struct CommStats {
  uint64_t ops = 0;
  double busy_seconds = 0;
  double bytes = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // e.g. "data"

  // In place over all ranks. BF16 and F16 tensors can be summed (only): each addition is done
  // in fp32 and rounded once to the tensor's type, and every rank gets the same bits.
  virtual Work all_reduce_async(Tensor t, ReduceOp op = ReduceOp::Sum) = 0;
  // out (size * n) = concatenation of every rank's in (n), in rank order.
  virtual Work all_gather_async(Tensor out, Tensor in) = 0;
  // out (n) = reduction of piece `rank` of every rank's in (size * n).
  virtual Work reduce_scatter_async(Tensor out, Tensor in, ReduceOp op = ReduceOp::Sum) = 0;
  // Pieces of varying sizes (ZeRO's row pieces): out (the sum of counts) = every rank's in
  // (counts[rank] elements) in rank order. `in` may be this rank's own piece of out.
  virtual Work all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) = 0;
  // out (counts[rank] elements) = the reduction of piece `rank` of every rank's in (the sum of
  // counts, pieces in rank order).
  virtual Work reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts,
                                      ReduceOp op = ReduceOp::Sum) = 0;
  virtual Work broadcast_async(Tensor t, int root) = 0;
  // in and out hold size equal pieces; piece j of in goes to rank j, piece i of out came from rank i.
  virtual Work all_to_all_async(Tensor out, Tensor in) = 0;
  // Pieces of varying element counts, in units of the tensors' elements.
  virtual Work all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                                  const std::vector<int64_t>& in_counts) = 0;
  virtual Work send_async(Tensor t, int peer, int tag = 0) = 0;
  virtual Work recv_async(Tensor t, int peer, int tag = 0) = 0;
  virtual Work barrier_async() = 0;

  virtual CommStats stats() const = 0;

  void all_reduce(Tensor t, ReduceOp op = ReduceOp::Sum) { all_reduce_async(t, op).wait(); }
  void all_gather(Tensor out, Tensor in) { all_gather_async(out, in).wait(); }
  void reduce_scatter(Tensor out, Tensor in, ReduceOp op = ReduceOp::Sum) { reduce_scatter_async(out, in, op).wait(); }
  void broadcast(Tensor t, int root) { broadcast_async(t, root).wait(); }
  void all_to_all(Tensor out, Tensor in) { all_to_all_async(out, in).wait(); }
  void all_to_all_v(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                    const std::vector<int64_t>& in_counts) {
    all_to_all_v_async(out, out_counts, in, in_counts).wait();
  }
  void send(Tensor t, int peer, int tag = 0) { send_async(t, peer, tag).wait(); }
  void recv(Tensor t, int peer, int tag = 0) { recv_async(t, peer, tag).wait(); }
  void barrier() { barrier_async().wait(); }

  // Small host values: a convenience over all_reduce for scalars.
  template <class T>
  T all_reduce_value(T v, ReduceOp op = ReduceOp::Sum) {
    all_reduce(Tensor(&v, dtype_of<T>(), Shape{1}), op);
    return v;
  }
};

// Every rank's string, in rank order (collective over `comm`: lengths, then the padded texts).
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

}  // namespace dstrain
