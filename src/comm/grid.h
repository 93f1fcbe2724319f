// The process grid: MPI_COMM_WORLD arranged along named axes (data, tensor, pipeline), one
// communicator per axis, created once, passed to whoever needs them, freed by RAII. World rank
// r has coordinates with tensor fastest:
//   r = (pipeline * data_size + data) * tensor_size + tensor.
// Expert-parallel ranks are carved out of the data-parallel ones, as in Megatron-Core and
// DeepSeek-V3: the expert axis does not multiply the world. Consecutive data coordinates form
// one expert group, expert = data % expert_size; the ranks of a group hold different experts
// but read different tokens, like any data-parallel ranks. Dense gradients are reduced over the
// data axis; expert gradients over the ranks that hold the same experts (expert_data()).
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "core/json_reader.h"

namespace dstrain {

enum class Axis { Data = 0, Tensor = 1, Pipeline = 2, Expert = 3 };
constexpr int kNumAxes = 4;
std::string_view axis_name(Axis a);

// The "parallel" part of the run configuration. data = 0 means "what is left".
struct ParallelConfig {
  int64_t data = 0, tensor = 1, pipeline = 1, expert = 1;
  // Megatron's sequence parallelism over the tensor group (no effect with tensor = 1).
  bool sequence_parallel = false;
  // Pipeline parallelism: the schedule ("1f1b", "interleaved" or "dualpipev"), the model
  // chunks per rank of the interleaved one (DualPipeV always has 2), and the decoder layers
  // of each stage when given by hand (empty: balanced by modelled cost).
  std::string schedule = "1f1b";
  int64_t virtual_stages = 1;
  std::vector<int64_t> partition;
  static ParallelConfig from_json(const JsonReader& r);
  json to_json() const;
};

// The axis sizes of a job of `world` ranks under `config` (data "auto" takes what tensor x
// pipeline leave), checked: their product is the rank count and expert divides data. Errors
// name the key and the sizes that would work. No MPI: ProcessGrid and `dstrain validate` both
// use it.
struct AxisSizes {
  int world = 1, data = 1, tensor = 1, pipeline = 1, expert = 1;
};
AxisSizes axis_sizes(const ParallelConfig& config, int world);
// "1, 2, 4": the divisors of n (sizes that split n ways evenly, for error messages).
std::string divisors_text(int64_t n);

class ProcessGrid {
 public:
  // Validates the layout against the world size (errors are raised on every rank alike).
  ProcessGrid(MPI_Comm world, const ParallelConfig& config);

  int world_rank() const { return world_->rank(); }
  int world_size() const { return world_->size(); }
  int size(Axis a) const { return sizes_[size_t(a)]; }
  int coord(Axis a) const { return coords_[size_t(a)]; }
  Communicator& world() { return wrapped_world_ ? *wrapped_world_ : *world_; }
  MPI_Comm mpi_world() const { return world_->mpi_comm(); }  // for libraries that take a communicator (MPI-IO)
  Communicator& comm(Axis a) {
    return wrapped_axes_[size_t(a)] ? *wrapped_axes_[size_t(a)] : *axes_[size_t(a)];
  }
  // The data-parallel ranks that hold the same experts (same expert coordinate): size
  // data / expert. With expert = 1 it spans the data axis.
  Communicator& expert_data() { return wrapped_expert_data_ ? *wrapped_expert_data_ : *expert_data_; }

  // For a run on a device: world(), comm() and expert_data() return from now on what `wrap`
  // makes of each MPI communicator (e.g. one that also carries device tensors). Collective:
  // every rank calls it, and `wrap` is called in the same order on every rank (world, data,
  // tensor, pipeline, expert, expert_data), as NCCL's communicator creation requires. `key`
  // names the wrapping: wrapping again with the same key does nothing; another key replaces it.
  using Wrap = std::function<std::unique_ptr<Communicator>(MpiCommunicator& mpi)>;
  void wrap_communicators(const std::string& key, const Wrap& wrap);
  const std::string& wrapped_by() const { return wrap_key_; }

  // Replicas for asynchronous gradient aggregation (optim/gradient_sync.h): the data axis cut
  // into blocks of `data_per_replica` consecutive data coordinates. Inside a replica the data
  // ranks (and the expert-data ranks) reduce synchronously; between replicas, the ranks with
  // the same place in their replica hold the same pieces. Collective over the world; every
  // rank gives the same size, which divides the data axis and is a multiple of the expert
  // axis. Splitting again with the same size does nothing. Without a split, a replica is the
  // whole data axis.
  void split_replicas(int data_per_replica);
  int data_per_replica() const { return replica_size_ ? replica_size_ : size(Axis::Data); }
  int replicas() const { return size(Axis::Data) / data_per_replica(); }
  int replica() const { return coord(Axis::Data) / data_per_replica(); }
  // The data ranks of this replica (the data axis without a split), its expert-data ranks
  // (expert_data() without one), every rank of this replica (the world without one), and the
  // ranks of the other replicas in this rank's place (null without a split).
  Communicator& replica_data() { return pick(replica_comms_[0], wrapped_replica_[0], comm(Axis::Data)); }
  Communicator& replica_expert_data() { return pick(replica_comms_[1], wrapped_replica_[1], expert_data()); }
  Communicator& replica_world() { return pick(replica_comms_[2], wrapped_replica_[2], world()); }
  Communicator* across_replicas() {
    return replica_comms_[3] ? &pick(replica_comms_[3], wrapped_replica_[3], world()) : nullptr;
  }
  // The same ranks on a communicator of their own, for the aggregation's large transfers: a
  // transfer in flight over a step (delayed aggregation) does not hold up the step's small
  // collectives queued behind it on the other.
  Communicator* across_replicas_bulk() {
    return replica_comms_[4] ? &pick(replica_comms_[4], wrapped_replica_[4], world()) : nullptr;
  }
  // The node of each world rank, as gradient_sync.over "nodes" sees it: `ranks_per_node`
  // consecutive world ranks (a test's stand-in for nodes), or with 0 the ranks that share
  // memory (MPI_COMM_TYPE_SHARED), numbered by their lowest world rank. Collective.
  std::vector<int> node_of_ranks(int ranks_per_node);

  // Placement on nodes, from MPI_COMM_TYPE_SHARED: for choosing a GPU per rank.
  int local_rank() const { return local_rank_; }
  int local_size() const { return local_size_; }
  int num_nodes() const { return num_nodes_; }

  std::string describe() const;  // "4 ranks on 1 node (4 per node): data 4 x tensor 1 x pipeline 1, expert 1 within data"

 private:
  std::unique_ptr<MpiCommunicator> world_;
  std::array<std::unique_ptr<MpiCommunicator>, kNumAxes> axes_;
  std::unique_ptr<MpiCommunicator> expert_data_;
  std::string wrap_key_;
  std::unique_ptr<Communicator> wrapped_world_, wrapped_expert_data_;
  std::array<std::unique_ptr<Communicator>, kNumAxes> wrapped_axes_;
  std::array<int, kNumAxes> sizes_{}, coords_{};
  // The ranks of the world that agree on `color`, ordered by `key`.
  std::unique_ptr<MpiCommunicator> split(int color, int key, std::string_view name) const;
  static Communicator& pick(const std::unique_ptr<MpiCommunicator>& raw, const std::unique_ptr<Communicator>& wrapped,
                            Communicator& fallback) {
    return wrapped ? *wrapped : raw ? *raw : fallback;
  }
  int replica_size_ = 0;
  std::array<std::unique_ptr<MpiCommunicator>, 5> replica_comms_;
  std::array<std::unique_ptr<Communicator>, 5> wrapped_replica_;
  Wrap wrap_;
  int local_rank_ = 0, local_size_ = 1, num_nodes_ = 1;
};

}  // namespace dstrain
