// The global tensors of a model split over the tensor, pipeline and expert axes: assembling
// them from the ranks' pieces, cutting a rank's piece out of them, and describing what each rank
// holds of them (ShardedModelCheckpoint), so that files hold global tensors and a run restarts at
// any layout.
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
#include "distributed/param_groups.h"
#include "io/checkpoint.h"
#include "io/sharded_state.h"
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

// What a rank of a model split over tensor, pipeline and expert ranks (and ZeRO's data-parallel
// shards) holds of the model's global tensors, as the one description (io/sharded_state.h) that
// checkpoints and the Hugging Face export go through. The file's tensors are every stage's and
// expert rank's, gathered once at construction (file_registry(): the same on every rank, in
// pipeline-rank order, each layer's experts in expert order, as the model held whole lists
// them; a stage's copy of the tied embedding is not among them: its owner, the first stage,
// holds it). A rank's piece of a file tensor is the block its placement gives (the whole tensor,
// tensor piece `index` along `dim`, or a routed expert's own tensor), cut to the rows the
// optimizer's shard holds. Replicas of a block (the tensor ranks holding the same piece; the
// data-parallel ranks of the parameter's group when the state is not sharded over them) write
// it in row blocks, each its own.
//
//   save:   mgr.save(smc.file_registry(), {values, m, v, smc.describe(shard)}, state)   every rank
//   resume: read_checkpoint(path, comm, smc.file_registry(), {values, m, v, smc.describe(shard)})
class ShardedModelCheckpoint {
 public:
  ShardedModelCheckpoint(const ParamRegistry& reg, ProcessGrid& grid);

  // The file's tensors: names, global shapes and kinds of every stage's parameters. Not
  // allocated.
  ParamRegistry& file_registry() { return file_; }
  const ParamRegistry& file_registry() const { return file_; }
  // The pipeline rank that owns file tensor `id`, and its id in this rank's registry (-1: held
  // by another stage or expert rank).
  int owner(int id) const { return owner_[size_t(id)]; }
  int local_id(int id) const { return local_[size_t(id)]; }
  // File id of this rank's parameter `id` (-1: a stage's copy of a tensor another stage owns).
  int file_id(int id) const { return file_of_[size_t(id)]; }

  // Where a rank's state lies in its flat buffers: the rows of each local piece it holds (ZeRO's
  // range; all of them without ZeRO) and where they start, the buffers' size, and whether the
  // data-parallel ranks of each parameter's group hold the same rows (stage 0) or each its own.
  struct Shard {
    std::function<RowPiece(int id)> rows;
    std::function<int64_t(int id)> at;
    int64_t numel = 0;
    bool replicated_over_data = true;
    // The data-parallel groups the rows are over (null: the data axis and expert_data()): a
    // replica's under asynchronous aggregation (train.gradient_sync).
    const ParamGroupComms* groups = nullptr;
  };
  std::shared_ptr<const ShardedState> describe(const Shard& shard) const;
  // The registry's own buffers: every local piece whole at its offset, replicated over the data
  // axis (weights loaded before the optimizer shards them, the Hugging Face export).
  std::shared_ptr<const ShardedState> describe_registry() const;

 private:
  struct GroupRank {
    int rank = 0, size = 1;
  };
  const ParamRegistry& reg_;
  ParamRegistry file_;        // every stage's parameters, global shapes
  std::vector<int> owner_;    // file id -> pipeline rank
  std::vector<int> local_;    // file id -> this rank's id (-1: another stage's or expert rank's)
  std::vector<int> file_of_;  // this rank's id -> file id (-1: a copy another stage owns)
  int tp_size_ = 1, tp_rank_ = 0;
  GroupRank data_[2];  // this rank in the data-parallel group of dense parameters and of experts
};

}  // namespace dstrain
