// The global tensors of a model split over the tensor, pipeline and expert axes: assembling
// them from the ranks' pieces, cutting a rank's piece out of them, and staging them for
// checkpoints (ShardedModelCheckpoint), so that files hold global tensors and a run restarts at
// any tensor, pipeline or expert size.
//
// A piece is what ParamInfo::placement says: Whole (replicated over the tensor group), or
// Shard over axis "tensor": piece `index` of `count` equal pieces of the global tensor along
// `dim` (0 for any rank of tensor, 1 for matrices). `count` divides the tensor-parallel size
// tp; where it is smaller (grouped-query attention with fewer key/value heads than tensor
// ranks) tensor rank t holds piece t * count / tp, the same as its neighbours.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/grid.h"
#include "core/buffer.h"
#include "io/checkpoint.h"
#include "state/params.h"

namespace dstrain {

// global (p.global_shape) = p's pieces of every rank of `tp`, on every rank of `tp` (collective
// over it for sharded parameters; a whole one is copied without communication). tp null or
// of size 1: a copy. Host F32 tensors; `local` has p.shape.
void gather_global(const ParamInfo& p, Tensor local, Communicator* tp, Tensor global);

// local (p.shape) = the piece that tensor rank tp_rank of tp_size holds of `global`
// (p.global_shape). No communication; the placement must be the one of that rank.
void extract_local(const ParamInfo& p, Tensor global, int tp_rank, int tp_size, Tensor local);
// The same, for the piece p's placement names (whichever ranks hold it).
void extract_local(const ParamInfo& p, Tensor global, Tensor local);

// Checkpoints of a model split over tensor, pipeline and expert ranks, through global tensors. The
// file holds every global tensor of the model; each pipeline stage holds some of them (a stage's
// copy of the tied embedding is not written: its owner, the first stage, writes it), and under
// expert parallelism each rank of an expert group holds some of a stage's routed experts, so the
// tensors the file lists are every stage's and expert rank's, gathered once at construction
// (file_registry(): the same on every rank, in pipeline-rank order, each layer's experts in
// expert order, as the model held whole lists them). Writing: a tensor's writers are the ranks
// of its stage at data coordinate w, where w = 0 for dense tensors and the owning expert rank e
// for a routed expert (data coordinate e holds expert rank e's experts): tensor rank t writes rows
// block t of tp (RowPiece(global, t, tp)); every other rank writes nothing of it. World rank
// r = (pipeline * data + d) * tp + t, so those ranks are consecutive and their blocks tile the
// tensor in rank order: that is the partition write_checkpoint gets. Reading uses the same
// partition, then rebuilds each rank's pieces and hands them to the replicas (dense tensors over
// the data axis, experts over the ranks holding the same experts).
//
// The checkpoint communicator must rank processes as the grid's world does (CheckpointManager's
// io_comm, a duplicate of the world). Parameters must be Whole, tensor Shards or routed Experts.
// State that is itself sharded over the data-parallel replicas (ZeRO) comes and goes one
// parameter at a time through LocalPieces, never as the whole local layout.
//
//   save:   mgr.save(tpc.file_registry(), tpc.stage(values, m, v), state)        every rank
//   resume: read_checkpoint(path, comm, tpc.file_registry(), tpc.targets(true));
//           tpc.unstage(values, m, v)                                            every rank
//   (or stage(pieces, true) and unstage(pieces, true) for sharded state)
// A rank's whole local pieces of its parameters' state, one parameter at a time, where the state
// is sharded over the parameter's data-parallel replicas (ZeRO's ranges of the local pieces).
// Both calls are collective over those replicas: each of them calls them for the same
// parameters in the same order. State k: 0 the weights, 1 exp_avg, 2 exp_avg_sq.
class LocalPieces {
 public:
  virtual ~LocalPieces() = default;
  // The whole local piece of state k of local parameter id (p.shape elements, host memory).
  virtual void gather(int id, int k, float* out) = 0;
  // The reverse: `piece`, valid on the replicas' first rank, is what each of them keeps its own
  // part of (the others' buffers are overwritten).
  virtual void scatter(int id, int k, float* piece) = 0;
};

class ShardedModelCheckpoint {
 public:
  ShardedModelCheckpoint(const ParamRegistry& reg, ProcessGrid& grid);

  // The file's tensors: names, global shapes and kinds of every stage's parameters (their
  // pieces and local layout are this object's business). Not allocated.
  ParamRegistry& file_registry() { return file_; }
  // The pipeline rank that owns file tensor `id`, the data coordinate whose ranks write it (0,
  // or a routed expert's expert rank), and its id in this rank's registry (-1: held by another
  // stage or expert rank).
  int owner(int id) const { return owner_[size_t(id)]; }
  int writer(int id) const { return writer_[size_t(id)]; }
  int local_id(int id) const { return local_[size_t(id)]; }
  // Whether this rank writes (and reads) rows of file tensor `id`.
  bool writes(int id) const { return local_[size_t(id)] >= 0 && data_rank_ == writer_[size_t(id)]; }

  // Copies this rank's row blocks of every global tensor into the staging buffers (the data-0
  // tensor group gathers each global tensor in turn: one global tensor of transient memory;
  // the other ranks stage nothing). Collective over each tensor group. The flat buffers are
  // in the registry's layout (local pieces); exp_avg and exp_avg_sq may be null together.
  // The result points into this object: valid until its next stage() or targets().
  CheckpointBuffers stage(const float* values, const float* exp_avg, const float* exp_avg_sq);
  // The same from state sharded over the replicas: each parameter's local piece gathered from
  // them in turn (every rank takes part; one parameter of transient memory), the moments too
  // when with_moments.
  CheckpointBuffers stage(LocalPieces& pieces, bool with_moments);

  // Where read_checkpoint puts this rank's row blocks (the same partition as stage's).
  CheckpointTargets targets(bool with_moments);

  // After read_checkpoint into targets(): each rank's local pieces, in the registry's layout,
  // on every rank (the data-0 tensor group assembles each global tensor from the blocks and
  // keeps its pieces; data coordinate 0 broadcasts them over the data axis). exp_avg and
  // exp_avg_sq are filled when given (and read).
  void unstage(float* values, float* exp_avg, float* exp_avg_sq);
  // The same into state sharded over the replicas: each parameter's local piece assembled by the
  // first replica and scattered to the others in turn. Parameters the file does not hold (a
  // stage's copy of the tied embedding) are left to the caller.
  void unstage(LocalPieces& pieces, bool with_moments);

  // Whether this rank writes and reads rows of any tensor.
  bool io_rank() const { return io_rank_; }
  // Elements of each staging buffer (at least 1, so that a rank without rows still passes
  // non-null buffers).
  int64_t staged_numel() const { return numel_; }
  // Frees the staging buffers (they are made again on the next use).
  void release();

 private:
  void allocate(int groups);
  CheckpointBuffers staged_buffers(int groups);  // what stage() returns
  // stage() and unstage(): `local(id, g)` gives the local piece of state g of parameter id (null:
  // this rank does not need it); `done(id, g, piece)` takes an unstaged piece.
  using LocalOf = std::function<const float*(int id, int g)>;
  void stage_groups(int groups, const LocalOf& local);
  void unstage_groups(int groups, const std::function<float*(int id, int g)>& local,
                      const std::function<void(int id, int g, float* piece)>& done);

  const ParamRegistry& reg_;
  ParamRegistry file_;        // every stage's parameters, global shapes
  std::vector<int> owner_;    // file id -> pipeline rank
  std::vector<int> writer_;   // file id -> data coordinate of its writers
  std::vector<int> local_;    // file id -> this rank's id (-1: another stage's or expert rank's)
  std::vector<int> file_of_;  // this rank's id -> file id (-1: a copy another stage owns)
  Communicator& tensor_;
  Communicator& data_;
  Communicator& expert_data_;
  int tp_size_ = 1, tp_rank_ = 0, data_rank_ = 0;
  bool io_rank_ = false;
  std::shared_ptr<const std::vector<int64_t>> offsets_;  // per file tensor, into the staging buffers
  int64_t numel_ = 1;
  CheckpointPartition partition_;
  Buffer staged_[3];  // values, exp_avg, exp_avg_sq: this rank's row blocks
  int read_groups_ = 0;  // groups that targets() asked read_checkpoint to fill
};

}  // namespace dstrain
