// The distributed optimizer: AdamW over the parameter registry's flat buffers, with its
// gradients reduced and its state sharded as DeepSpeed's zero_optimization block says (ZeRO:
// Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
// 2020). Every stage is one type behind the model's parameter hooks: stage 0 is the shard of
// one (each rank holds and steps its whole local pieces), stages 1-3 shard more.
//
// Partition. Every parameter's local piece (what this rank holds after the tensor, pipeline and
// expert splits: the whole tensor without them) is split by rows over the data-parallel ranks of
// its group (RowPiece: rank r of N holds rows [R r/N, R (r+1)/N)): dense parameters over the data
// axis, routed experts over the ranks holding the same experts (ParamGroupComms; Megatron-Core's
// distributed optimizer shards the same way). A rank's shard is its pieces of every parameter,
// in id order, end to end: its fp32 master weights, its AdamW moments and (stages 2 and 3) its
// reduced gradients live there, 1/N of the local model each. The same layout serves every
// stage. A checkpoint describes each rank's rows of its pieces (piece() and shard_offset())
// and writes and reads them in place (io/sharded_state.h).
//
// Stages (the paper's baseline, P_os, P_os+g, P_os+g+p):
//   0  nothing is sharded: the pieces are the whole local tensors, the registry's fp32 weights
//      are the masters (no copy) and the moments mirror its layout; the gradients are
//      all-reduced (a GradReducer, overlapped with the backward) and every rank steps them all;
//   1  the whole gradients are all-reduced the same way; each rank steps its pieces and the
//      whole weights are all-gathered from the pieces;
//   2  the gradients are reduce-scattered instead, per parameter as the backward finishes it,
//      into the gradient shard; the whole-model gradient buffer is reserved address space
//      whose pages are handed back as soon as a parameter's reduction is done, so only the
//      gradients of buckets not yet reduced hold memory (reduce_bucket_size bounds them while
//      the backward runs; DeepSpeed's default of 5e8 elements is one bucket for a small model);
//   3  the whole weights are reserved address space as well: a parameter is all-gathered by the
//      model's before_use hook (and the next ones prefetched, in the order recorded in the first
//      step), and handed back by after_use once no use is left. Parameters under
//      stage3_param_persistence_threshold elements stay whole (gathered again after each step).
// With gradient accumulation, stages 2 and 3 reduce every micro-step (the gradients of one
// micro-step are not kept whole until the next), adding the shard's running sum into this
// rank's own rows before the reduction: the communication volume grows with the micro-steps,
// as in DeepSpeed.
//
// Offload (offload_optimizer.device = "cpu"): the masters, the moments and a host copy of the
// gradient shard live in pinned host memory and AdamW runs on the host: gradient pieces go
// device -> host, updated weights host -> device. In a CPU-only build the "device" is the host
// as well: the same buffers and copies run, costing two memory passes over the shard per step.
// offload_param.device = "cpu" (stage 3) keeps the parameters at rest in that host memory too
// (the masters): a gather first copies the piece to a device buffer.
#pragma once

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "core/buffer.h"
#include "distributed/grad_reducer.h"
#include "distributed/param_groups.h"
#include "model/ctx.h"
#include "optim/adamw.h"
#include "state/params.h"

namespace dstrain {

// DeepSpeed's zero_optimization block.
struct ZeroConfig {
  int64_t stage = 0;
  int64_t reduce_bucket_size = 500'000'000;     // elements per gradient bucket
  int64_t allgather_bucket_size = 500'000'000;  // elements gathered after a step before waiting
  bool overlap_comm = true;                     // reduce buckets during the backward
  bool contiguous_gradients = true;             // dstrain's gradients are always one flat buffer
  std::string offload_optimizer = "none";       // "none" | "cpu"
  bool offload_optimizer_pin_memory = false;
  std::string offload_param = "none";  // "none" | "cpu" (stage 3)
  bool offload_param_pin_memory = false;
  int64_t stage3_prefetch_bucket_size = 50'000'000;        // elements gathered ahead of their use
  int64_t stage3_param_persistence_threshold = 100'000;    // parameters under it stay whole
  int64_t stage3_max_live_parameters = 1'000'000'000;      // gathered elements, in use or prefetched
  bool offloads_optimizer() const { return offload_optimizer == "cpu"; }
  bool offloads_params() const { return offload_param == "cpu"; }
  // Offloaded state in page-locked host memory: either offload's pin_memory (they share the
  // host masters). DeepSpeed's default is false: ordinary, pageable memory.
  bool pins_host_memory() const {
    return offloads_optimizer() && (offload_optimizer_pin_memory || (offloads_params() && offload_param_pin_memory));
  }
};

// Bytes this rank holds for ZeRO's parts, now and at their peak since the last reset.
struct ZeroMemory {
  int64_t master = 0;     // fp32 master pieces
  int64_t optimizer = 0;  // AdamW moments
  int64_t grad_shard = 0;
  int64_t gathered = 0, gathered_peak = 0;    // whole weights held (stage 3; stages 1/2: all)
  int64_t transient_grads = 0, transient_grads_peak = 0;  // whole gradients held (stages 2/3)
  int64_t comm_buffers = 0;
};

class DistributedOptimizer final : public ParamHooks {
 public:
  // `params` is allocated (whole, as the model made it). `comms` names the data-parallel
  // communicator over which each parameter group is reduced and sharded. comm_dtype
  // (DeepSpeed's communication_data_type): at stages 2 and 3, BF16 or F16 reduce-scatters each
  // gradient in that type (summed in fp32 per addition and rounded, as MpiCommunicator's 16-bit
  // sum does) and adds the result to the fp32 shard; at stages 0 and 1 the GradReducer's
  // all-reduce runs in it.
  DistributedOptimizer(const ZeroConfig& config, const AdamWConfig& adamw, ParamRegistry& params,
                const ParamGroupComms& comms, DType comm_dtype = DType::F32);
  ~DistributedOptimizer() override;
  DistributedOptimizer(const DistributedOptimizer&) = delete;
  DistributedOptimizer& operator=(const DistributedOptimizer&) = delete;

  int stage() const { return int(config_.stage); }
  const ParamRegistry& params() const { return params_; }
  const ZeroConfig& config() const { return config_; }
  const AdamWConfig& adamw() const { return adamw_; }
  // Whether the gradients end reduced into the shard (stages 2 and 3) rather than whole.
  bool reduces_into_shard() const { return config_.stage >= 2; }
  // This rank's piece of parameter id, and where it starts in the shard buffers (stage 0: the
  // whole local tensor, at its offset in the registry).
  const RowPiece& piece(int id) const { return pieces_[size_t(id)]; }
  int64_t shard_offset(int id) const { return shard_offsets_[size_t(id)]; }
  const std::vector<int64_t>& shard_offsets() const { return shard_offsets_; }
  int64_t shard_numel() const { return shard_numel_; }
  // Stage 3: stays whole (small, or updated by a rule on every rank rather than by AdamW).
  bool persistent(int id) const { return persistent_[size_t(id)]; }
  std::string describe() const;

  // The registry's whole weights (from initialisation, --init-from or a checkpoint's model
  // tensors) become the masters: each rank keeps its pieces; at stage 3 the whole weights are
  // then handed back but for the persistent ones.
  void adopt_weights();
  // After the shards were written directly (a checkpoint): the whole weights are gathered from
  // them (stages 1 and 2) or the persistent ones (stage 3).
  void publish_weights();
  // Stage 3: every whole weight gathered (export, evaluation of the weights as a whole), and
  // handed back again. Other stages hold them whole anyway.
  void gather_all();
  void release_unused();

  // ---- one step -----------------------------------------------------------------------
  // Zeroes the gradients and starts the step's hook bookkeeping.
  void begin_step();
  // Before each micro-batch's forward: the forward already writes gradients (the head's and
  // the MTP modules' are formed as soon as their losses are), so every reduction of the
  // micro-steps before is completed (and its gradients zeroed) first.
  void begin_forward();
  // Before each micro-step's backward; `last` is true for the step's last one (stages 0 and 1
  // communicate only then).
  void begin_micro_step(bool last);
  // Stages 0 and 1: the all-reduce of the whole gradients (its buckets); null at stages 2-3.
  const GradReducer* reducer() const { return reducer_.get(); }
  void before_use(int first, int last) override;
  void after_use(int first, int last) override;
  void grad_ready(int first, int last) override;
  // Every gradient reduced into the shard (stage 1: the all-reduced whole gradients are read
  // in place); prefetches no longer needed are handed back.
  ReduceTimings finish();
  // The L2 norm of the whole gradient, from the shards (collective over dp: every parameter
  // sharded over one communicator, no other split).
  double grad_norm();
  // The sum of squares of this rank's reduced gradient pieces of the parameters marked in
  // `counted` (by id; empty: all): under other splits the caller counts each global element on
  // one rank (not a pipeline copy, one tensor rank of a replicated parameter) and sums over the
  // world. Not collective.
  double local_grad_sum_squares(const std::vector<char>& counted) const;
  // The tensors whose sums of squares, added in order, make local_grad_sum_squares(counted):
  // runs of counted pieces that lie end to end (one for stage 0 on one rank, or the shard of
  // stages 2 and 3), so that a caller can fold their reads into one (Trainer: the step's one
  // read of its device scalars).
  std::vector<Tensor> grad_norm_runs(const std::vector<char>& counted) const;
  // This rank's reduced gradient piece of parameter id: its rows over the group's communicator
  // (stages 0 and 1: in the whole gradients, which every rank of the group holds alike).
  Tensor grad_piece(int id) const;
  // The gradient step() reads for parameter id: stage 0 the whole local tensor's, stages 1-3
  // this rank's piece of the reduced ones. Asynchronous aggregation (optim/gradient_sync.h)
  // replaces it with the replicas' average before the step.
  Tensor update_grad(int id) const;
  // This rank's master piece of parameter id (stage 0: the whole local tensor), a view into
  // master() at shard_offset(id).
  Tensor master_piece(int id) const;
  // The part of parameter id's piece in `shard` (a buffer in master()'s layout) that this rank
  // counts in a sum over its group, each element on one rank: stage 0 its rows over the group
  // (every rank holds the whole), stages 1-3 its piece.
  Tensor counted_part(const Buffer& shard, int id) const;
  // The communicator parameter id is sharded over.
  Communicator& comm_of(int id) const { return *comm_of_[size_t(id)]; }
  // The largest group's data-parallel size.
  int max_group_size() const {
    int n = 1;
    for (Communicator* c : comms_.distinct()) n = std::max(n, c->size());
    return n;
  }
  // AdamW on this rank's pieces with learning rate lr, each gradient multiplied by grad_scale
  // as it is read; then the whole weights (stage 3: the persistent ones) are gathered again.
  void step(double lr, double grad_scale = 1.0);
  // A parameter a rule updated identically on every rank (routing biases): its master piece
  // follows the whole weights.
  void take_rule_update(int id);
  // Time spent waiting for collectives outside finish() (the weights' gathers after a step),
  // since the last call.
  double take_exposed_seconds() {
    const double s = exposed_seconds_;
    exposed_seconds_ = 0;
    return s;
  }
  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t s) { step_ = s; }

  // The shard buffers, in the layout of shard_offset(): what checkpoints write and read (stage
  // 0: the registry's weights are the masters).
  Buffer& master() { return config_.stage == 0 ? params_.values() : master_; }
  Buffer& exp_avg() { return exp_avg_; }
  Buffer& exp_avg_sq() { return exp_avg_sq_; }
  // Non-finite values in this rank's masters and moments (the caller reduces over ranks).
  int64_t count_non_finite();

  // One parameter's state k (0: the master weights, 1: exp_avg, 2: exp_avg_sq) whole (its local
  // shape, on the masters' device), all-gathered from the pieces over its group: what a
  // checkpoint of the tensor, pipeline and expert pieces stages one parameter at a time.
  // Collective over comm_of(id).
  void gather_piece(int id, int k, Tensor out);
  // The reverse: `whole`, valid on the group's rank 0, broadcast over the group (the others'
  // contents are overwritten) and each rank's piece taken from it. Collective over comm_of(id).
  void scatter_piece(int id, int k, Tensor whole);
  ZeroMemory memory() const;
  void reset_peaks();

 private:
  enum class State { Released, InFlight, Resident };
  // One bucket's reduce-scatter: its parameters' gradients packed rank by rank (every rank's
  // pieces of each parameter in turn) so that one collective reduces them all, and this rank's
  // reduced pieces, in the same order, to unpack into the shard.
  struct Pending {
    std::vector<int> ids;
    Work work;
    Buffer packed, mine;
  };
  std::vector<int64_t> counts(int id) const;
  // One all-gather of several parameters of one communicator (stage 3: the uses of a layer, a
  // prefetch; every stage: the whole weights after a step), their pieces packed end to end and
  // the gathered ones unpacked by the first wait_gather of any of them.
  struct GatherGroup {
    std::vector<int> ids;
    Work work;
    Buffer mine, packed;
    int64_t total = 0;
  };
  void launch_gathers(const std::vector<int>& ids);
  // Communication buffers, reused: fresh ones every bucket fragment the heap (the process's
  // resident memory grew by a quarter on V3-tiny) and cost a zero-fill each.
  Buffer take_buffer(const char* label, DType dtype, int64_t numel);
  void give_back(Buffer&& b);
  void unpack(GatherGroup& g);
  // One parameter gathered into its whole weights (stage 3: and marked in flight).
  void launch_gather_in_place(int id);
  void wait_gather(int id);
  void release_param(int id);
  void prefetch_after(size_t trace_pos);
  // Stages 2 and 3: one reduce-scatter of a bucket's gradients (parameters of one group).
  void launch_reduce(const std::vector<int>& ids);
  void retire_reductions(bool wait_all);
  void flush_pending_grads();
  // Stages 1 and 2: the whole weights of every parameter from the pieces.
  void gather_whole(bool persistent_only);
  int64_t gathered_bytes(int id) const;  // of parameter id while whole
  void account_gathered(int64_t delta);
  void account_transient(int64_t delta);

  ZeroConfig config_;
  AdamWConfig adamw_;
  ParamRegistry& params_;
  ParamGroupComms comms_;
  std::vector<Communicator*> comm_of_;  // per parameter: its group's communicator
  DType comm_dtype_ = DType::F32;
  std::vector<RowPiece> pieces_;
  std::vector<int64_t> shard_offsets_;
  std::vector<char> persistent_;
  int64_t shard_numel_ = 0;
  Buffer master_, exp_avg_, exp_avg_sq_;  // master_: stages 1-3
  std::unique_ptr<GradReducer> reducer_;  // stages 0 and 1
  Buffer grad_shard_;     // stages 2 and 3 (on the device)
  Buffer host_grads_;     // offload: the gradient pieces on the host
  Buffer device_shard_;   // offload at stage 3 without offload_param: the pieces at rest on the device
  int64_t step_ = 0;

  // Stage 3 state per parameter.
  std::vector<State> state_;
  std::vector<int> uses_;
  std::vector<Work> gathers_;                           // stages 1 and 2: in-place gathers
  std::vector<std::shared_ptr<GatherGroup>> group_of_;  // stage 3: the gather a parameter is in
  std::vector<Buffer> free_buffers_;
  int64_t live_elems_ = 0;
  // The order of before_use calls of a training step, recorded in the first one.
  std::vector<std::pair<int, int>> trace_;
  bool recording_ = true;
  bool in_step_ = false;
  size_t trace_pos_ = 0;

  // Stages 2 and 3: gradients handed over, waiting to fill a bucket, and reductions in flight.
  std::vector<int> pending_grads_;
  int64_t pending_elems_ = 0;
  std::vector<Pending> reductions_;
  bool first_micro_ = true;  // the step's first backward has not begun
  bool first_forward_ = true;
  std::vector<char> reduced_once_;  // per parameter: reduced in an earlier micro-step of this step
  std::vector<CommStats> stats_before_;  // per comms_.distinct()
  double exposed_seconds_ = 0;
  int buckets_ = 0;

  int64_t gathered_bytes_ = 0, gathered_peak_ = 0, transient_bytes_ = 0, transient_peak_ = 0;
};

}  // namespace dstrain
