// The MPI implementation of Communicator. Each communicator owns a duplicate of the MPI
// communicator it was made from (freed by RAII) and one worker thread that executes its
// operations in issue order with blocking MPI calls, so asynchronous operations progress
// while the issuing thread computes. Requires MPI_THREAD_MULTIPLE.
#pragma once

#include <mpi.h>

#include <deque>
#include <functional>
#include <thread>

#include "comm/comm.h"

namespace dstrain {

// Checks an MPI return code: the message names the call, file, line and the MPI error text.
void mpi_check(int code, const char* call, const char* file, int line);
#define DS_MPI_CHECK(call) ::dstrain::mpi_check((call), #call, __FILE__, __LINE__)

MPI_Datatype mpi_datatype(DType t);

// An owned MPI communicator: MPI_Comm_dup on construction, MPI_Comm_free on destruction.
class MpiCommHandle {
 public:
  MpiCommHandle() = default;
  explicit MpiCommHandle(MPI_Comm parent);  // duplicates parent
  static MpiCommHandle adopt(MPI_Comm owned);  // takes ownership of a fresh communicator
  MpiCommHandle(MpiCommHandle&& o) noexcept : comm_(o.comm_) { o.comm_ = MPI_COMM_NULL; }
  MpiCommHandle& operator=(MpiCommHandle&& o) noexcept;
  MpiCommHandle(const MpiCommHandle&) = delete;
  MpiCommHandle& operator=(const MpiCommHandle&) = delete;
  ~MpiCommHandle();
  MPI_Comm get() const { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

class MpiCommunicator final : public Communicator {
 public:
  // Duplicates `parent`; `name` labels the communicator in messages ("data", "world").
  MpiCommunicator(MPI_Comm parent, std::string name);
  static std::unique_ptr<MpiCommunicator> adopt(MpiCommHandle owned, std::string name);
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }
  MPI_Comm mpi_comm() const { return comm_.get(); }

  Work all_reduce_async(Tensor t, ReduceOp op) override;
  Work all_gather_async(Tensor out, Tensor in) override;
  Work reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) override;
  Work broadcast_async(Tensor t, int root) override;
  Work all_to_all_async(Tensor out, Tensor in) override;
  Work all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) override;
  Work reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts, ReduceOp op) override;
  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                          const std::vector<int64_t>& in_counts) override;
  Work send_async(Tensor t, int peer, int tag) override;
  Work recv_async(Tensor t, int peer, int tag) override;
  Work barrier_async() override;
  CommStats stats() const override;

 private:
  MpiCommunicator(MpiCommHandle comm, std::string name, int);
  Work enqueue(std::string op, double bytes, std::function<void()> body);
  void worker_loop();

  MpiCommHandle comm_;
  std::string name_;
  int rank_ = 0, size_ = 1;

  struct Task {
    std::shared_ptr<WorkState> state;
    double bytes;
    std::function<void()> body;
  };
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Task> queue_;
  bool stopping_ = false;
  uint64_t next_seq_ = 0;
  CommStats stats_;
  std::thread worker_;
};

}  // namespace dstrain
