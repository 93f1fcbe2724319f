// How gradients are aggregated between the replicas of the model (seed 1's synchronous and
// asynchronous aggregation). The data-parallel ranks are split into replicas: consecutive data
// coordinates, `over` "data" (each replica one expert group: every rank without expert
// parallelism) or "nodes" (the data-parallel ranks of one node). Inside a replica, training is
// synchronous every step: the distributed optimizer reduces (and ZeRO shards) over the replica's
// data ranks, with tensor, pipeline and expert parallelism as configured. Between replicas:
//
//   sync       every step, the same reduction over every data-parallel rank (no replicas);
//   delayed    step t's averaged gradient is all-reduced over the replicas while step t+1
//              computes, and applied at step t+1: every update uses a gradient one step stale
//              (step 1 applies none). The k-th update uses the learning rate of the k-th
//              entry of the schedule, as synchronous training does: with a delay of one step
//              no change of the step size is needed for convergence (Stich & Karimireddy, "The
//              Error-Feedback Framework: Better Rates for SGD with Delayed Gradients and
//              Compressed Communication", JMLR 2020, arXiv 1909.05350, Theorem 3.2 with
//              tau = 1: step sizes up to 1/(10 L tau)); the replicas stay identical;
//   local_sgd  each replica trains alone for `every` (H) steps with its own AdamW, then the
//              replicas' parameters are averaged (Stich, "Local SGD Converges Fast and
//              Communicates Little", ICLR 2019; Lin et al., "Don't Use Large Mini-Batches, Use
//              Local SGD", ICLR 2020); the inner AdamW state stays each replica's own;
//   diloco     DiLoCo (Douillard et al., arXiv 2311.08105, Algorithm 1): the same inner
//              phase, then the outer gradient Delta = theta_outer - mean over replicas of
//              theta_replica, and the outer optimizer (SGD, or Nesterov momentum as
//              torch.optim.SGD(nesterov=True): b = mu b + Delta, theta_outer -= lr (Delta + mu
//              b)) moves theta_outer, which every replica then takes. With `fragments` P > 1
//              (Streaming DiLoCo, arXiv 2501.18512, section 2.2) the parameters are cut into P
//              fragments of consecutive parameters, each synchronised every H steps at its own
//              offset ((p + 1) H / P), so that a sync moves 1/P of the model. local_sgd is
//              diloco with outer SGD at lr 1.
//
// The outer state (theta_outer and the momentum, fp32) lies in the distributed optimizer's
// shard layout: each rank holds the outer state of its master pieces, so ZeRO shards it like
// the rest; routed experts' outer state is that of the ranks holding the same experts. The
// outer reductions run over the ranks of the other replicas that hold the same pieces, in
// `outer_dtype` (bf16: the delta rounded before the sum, summed in fp32 per addition).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/buffer.h"
#include "core/json_reader.h"
#include "optim/distributed_optimizer.h"

namespace dstrain {

struct GradientSyncConfig {
  std::string mode = "sync";  // "sync" | "delayed" | "local_sgd" | "diloco"
  int64_t every = 1;          // H: inner steps between outer steps
  std::string over = "data";  // "data" | "nodes"
  // Test override of what a node is: this many consecutive world ranks (0: the ranks sharing
  // memory, MPI_COMM_TYPE_SHARED).
  int64_t ranks_per_node = 0;
  // The data-parallel ranks of a replica, once known (the trainer resolves it from the ranks'
  // placement; 0: unknown, and the memory and performance models assume over "data"'s: the
  // expert axis). Not a key of the file.
  int64_t data_per_replica = 0;
  std::string outer_type = "nesterov";  // diloco: "sgd" | "nesterov"
  double outer_lr = 0.7, outer_momentum = 0.9;  // DiLoCo's published setting
  std::string outer_dtype = "fp32";             // "fp32" | "bf16"
  int64_t fragments = 1;                        // diloco: Streaming DiLoCo's fragments
  // Test-only: the communicator between replicas (the data axis under "sync") made slow: each
  // collective takes latency + its ring traffic over this bandwidth (comm/slow_link.h).
  double test_link_latency_ms = 0, test_link_gbit_per_s = 0;

  bool async() const { return mode != "sync"; }
  bool local() const { return mode == "local_sgd" || mode == "diloco"; }
  bool slow_link() const { return test_link_latency_ms > 0 || test_link_gbit_per_s > 0; }
  // The outer optimizer in force: local SGD is DiLoCo with SGD at lr 1.
  double lr() const { return mode == "local_sgd" ? 1.0 : outer_lr; }
  double momentum() const { return mode == "local_sgd" || outer_type == "sgd" ? 0.0 : outer_momentum; }
  static GradientSyncConfig from_json(const JsonReader& r);
  json to_json() const;
  std::string describe() const;  // "DiLoCo every 32 steps, outer nesterov lr 0.7 momentum 0.9, fp32"
};

// What the gradient sync did in a step (this rank's).
struct GradientSyncStep {
  double wait_seconds = 0;   // waiting for the collectives between replicas
  int64_t outer_steps = 0;   // fragments synchronised this step
  double drift = -1;         // sqrt(mean over replicas |theta_r - mean theta|^2) before the sync (-1: none)
  double outer_delta_norm = -1;  // |Delta|, the outer gradient's norm (-1: none)
};

class GradientSync {
 public:
  // `across`: the ranks of the other replicas holding the same pieces (null: one replica);
  // `replica_world`: every rank of this replica (for norms); `counted[id]`: whether this rank
  // counts parameter id in a norm over its replica (tensor and pipeline copies once).
  GradientSync(const GradientSyncConfig& config, DistributedOptimizer& opt, Communicator* across,
               Communicator& replica_world, std::vector<char> counted);
  ~GradientSync();

  const GradientSyncConfig& config() const { return config_; }
  int replicas() const { return across_ ? across_->size() : 1; }

  // delayed: after this step's gradients are reduced inside the replica: launches their average
  // over the replicas and puts the previous step's average where the optimizer reads (see
  // DistributedOptimizer::update_grad). False when there is none (the first step).
  bool exchange_gradients();
  // local_sgd / diloco: after step `step` (1-based, skipped steps included: every replica
  // counts alike): the outer steps of the fragments due at it.
  void after_step(int64_t step);
  GradientSyncStep take_step_stats();
  // local_sgd / diloco, at the end of a run after step `step`: the outer steps of the fragments
  // not synchronised at it, so that the replicas agree; how many.
  int finish(int64_t step);

  // ---- checkpoint state (fp32, in master()'s layout) ---------------------------------------
  // delayed: the averaged gradient not applied yet (waited for first); none before step 1.
  bool has_pending_gradient();
  Buffer& pending_gradient();
  void set_pending_gradient(bool present) { ready_ = present; }
  // diloco / local_sgd: theta_outer and the momentum (allocated when the mode has them).
  Buffer& outer_params() { return outer_; }
  Buffer& outer_momentum() { return momentum_; }
  bool has_momentum() const { return momentum_.allocated(); }
  // Parameters [first, last) of fragment p (ids), the same on every rank.
  std::pair<int, int> fragment(int p) const { return fragments_[size_t(p)]; }
  // The step at which fragment p is synchronised, counting from 1: steps s with s % H == phase.
  int64_t phase(int p) const;
  // The weights became new (initialisation, a checkpoint without outer state): theta_outer
  // takes the masters.
  void reset_outer();

 private:
  void outer_step(int p, GradientSyncStep& st);
  int64_t fragment_elems(int p) const;
  void wait_inflight();

  GradientSyncConfig config_;
  DistributedOptimizer& opt_;
  Communicator* across_;
  Communicator& replica_world_;
  std::vector<char> counted_;
  std::vector<std::pair<int, int>> fragments_;
  DType wire_ = DType::F32;
  // delayed: the sum in flight and the average ready to apply
  Buffer inflight_buf_, spare_buf_, ready_buf_;
  Work inflight_;
  bool have_inflight_ = false, ready_ = false;
  // local modes
  Buffer outer_, momentum_, delta_, wire_buf_, mean_;
  GradientSyncStep step_stats_;
};

}  // namespace dstrain
