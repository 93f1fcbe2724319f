// Collectives for a run on a device: a Communicator that sends host tensors over MPI, as before,
// and device tensors over the device's own communicator (NCCL on GPUs) or, where there is none,
// staged through host copies over MPI. The trainer wraps the process grid's communicators with
// it (ProcessGrid::wrap_communicators), so every caller keeps calling grid.comm(axis): scalars
// and strings stay on MPI, gradients and weights go where their memory is.
//
// Each rank issues the same operations in the same order (the Communicator contract), so each
// underlying communicator sees the same sequence on every rank.
#pragma once

#include <memory>

#include "comm/grid.h"
#include "comm/mpi_comm.h"

namespace dstrain {

class RoutedCommunicator final : public Communicator {
 public:
  // `device` may be null: device tensors are then staged through host memory over `host`.
  RoutedCommunicator(Communicator& host, std::unique_ptr<Communicator> device);

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  std::string name() const override { return host_.name(); }
  // "nccl", or "mpi (staged through host memory)".
  std::string device_transport() const;

  Work all_reduce_async(Tensor t, ReduceOp op) override;
  Work all_gather_async(Tensor out, Tensor in) override;
  Work reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) override;
  Work all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) override;
  Work reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts, ReduceOp op) override;
  Work broadcast_async(Tensor t, int root) override;
  Work all_to_all_async(Tensor out, Tensor in) override;
  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                          const std::vector<int64_t>& in_counts) override;
  Work send_async(Tensor t, int peer, int tag) override;
  Work recv_async(Tensor t, int peer, int tag) override;
  Work barrier_async() override;
  CommStats stats() const override;

 private:
  Communicator& host_;
  std::unique_ptr<Communicator> device_;
};

}  // namespace dstrain

namespace dstrain {
class ProcessGrid;
// Makes `grid`'s communicators carry tensors on `device` (ProcessGrid::wrap_communicators with
// RoutedCommunicator): over NCCL for CUDA devices in builds with it, staged through host memory
// otherwise. Nothing changes for the host. Collective over the world. Returns the grid.
ProcessGrid& use_device_communicators(ProcessGrid& grid, Device device);
}  // namespace dstrain
