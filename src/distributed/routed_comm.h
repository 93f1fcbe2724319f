// Collectives for a run on a device: a Communicator that sends host tensors over MPI, as before,
// and device tensors over the device's own communicator (NCCL on GPUs) or, where there is none,
// staged through host copies over MPI. The trainer wraps the process grid's communicators with
// it (ProcessGrid::wrap_communicators), so every caller keeps calling grid.comm(axis): scalars
// and strings stay on MPI, gradients and weights go where their memory is.
//
// Each rank issues the same operations in the same order (the Communicator contract), so each
// underlying communicator sees the same sequence on every rank.
//
// The pipeline axis is the exception to "device tensors over NCCL": its runner posts receives
// ahead and matches them by tag (train/pipeline.h), which NCCL cannot. Its communicator carries
// device tensors over MPI (staged through host memory, or straight from device memory where the
// MPI library is CUDA-aware), and holds NCCL communicators beside it for the runner's in-order
// transport (in_order_channels: activations and gradients, down and up the ranks), which the
// runner uses when the schedule passes the in-order check.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "comm/grid.h"
#include "comm/in_order_channels.h"
#include "comm/mpi_comm.h"

namespace dstrain {

class RoutedCommunicator final : public Communicator {
 public:
  // `device` may be null: device tensors then go over `host`, staged through host memory, or
  // as they are with `host_takes_device` (a CUDA-aware MPI library: only for sends and
  // receives, after the device has finished what was issued before).
  RoutedCommunicator(Communicator& host, std::unique_ptr<Communicator> device, bool host_takes_device = false);

  int rank() const override { return host_.rank(); }
  int size() const override { return host_.size(); }
  std::string name() const override { return host_.name(); }
  // "nccl", "mpi (staged through host memory)" or "mpi (CUDA-aware: device memory for
  // point-to-point)".
  std::string device_transport() const;
  // Communicators over the same ranks whose point-to-point operations carry device tensors and
  // match in issue order (NCCL), one per channel of InOrderChannels: the pipeline runner's
  // in-order transport. `transport` names them ("nccl").
  using Channels = std::array<std::unique_ptr<Communicator>, InOrderChannels::kCount>;
  void set_in_order_channels(Channels channels, std::string transport);
  InOrderChannels in_order_channels() const;

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
  bool host_takes_device_ = false;
  Channels in_order_;
  std::string in_order_transport_;
};

// `c`'s in-order channels when it is a RoutedCommunicator that has them; none otherwise.
InOrderChannels in_order_channels(Communicator& c);

// Whether the MPI library takes device memory (Open MPI's MPIX_Query_cuda_support(), where its
// mpi-ext.h has it); false where it cannot tell.
bool mpi_cuda_aware();

}  // namespace dstrain

namespace dstrain {
class ProcessGrid;
// Makes `grid`'s communicators carry tensors on `device` (ProcessGrid::wrap_communicators with
// RoutedCommunicator): over NCCL for CUDA devices in builds with it, staged through host memory
// otherwise. The pipeline axis keeps MPI for its tagged messages and gets in-order NCCL channels
// (see above). Nothing changes for the host. Collective over the world. Returns the grid.
ProcessGrid& use_device_communicators(ProcessGrid& grid, Device device);
}  // namespace dstrain
