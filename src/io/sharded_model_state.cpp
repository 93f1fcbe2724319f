// Global tensors from the pieces of a model split over the tensor, pipeline and expert axes, and
// back, and the description of a rank's pieces that its checkpoints and exports go through (see
// sharded_model_state.h).
#include "io/sharded_model_state.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/json_reader.h"
#include "distributed/param_groups.h"

namespace dstrain {

namespace {

bool is_whole(const ParamInfo& p) { return p.placement.held_whole(); }

// The placements this file handles, checked against the shapes, so that a registration that
// does not describe its piece fails here rather than copying the wrong elements.
void check_piece(const ParamInfo& p) {
  const Placement& pl = p.placement;
  if (is_whole(p)) {
    DS_CHECK(p.shape == p.global_shape, "'{}' is placed whole but holds {} of the global {}", p.name, p.shape.str(),
             p.global_shape.str());
    return;
  }
  DS_CHECK(pl.kind == Placement::Kind::Shard && pl.axis == "tensor",
           "'{}' is placed as a {} over axis '{}': global tensors are assembled only from whole parameters and "
           "tensor-parallel shards",
           p.name, pl.kind == Placement::Kind::Shard ? "shard" : pl.kind == Placement::Kind::Expert ? "expert" : "flat range",
           pl.axis);
  const int nd = p.global_shape.ndim();
  DS_CHECK((pl.dim == 0 && nd >= 1) || (pl.dim == 1 && nd == 2),
           "'{}' {} is split along dimension {}: tensor-parallel pieces are split along dimension 0, or 1 of a matrix",
           p.name, p.global_shape.str(), pl.dim);
  DS_CHECK(pl.count >= 1 && pl.index >= 0 && pl.index < pl.count, "'{}' is piece {} of {}", p.name, pl.index, pl.count);
  bool fits = p.shape.ndim() == nd;
  for (int d = 0; fits && d < nd; ++d) fits = p.global_shape[d] == (d == pl.dim ? pl.count : 1) * p.shape[d];
  DS_CHECK(fits, "'{}' holds {} as piece {} of {} along dimension {} of the global {}: the pieces must be equal", p.name,
           p.shape.str(), pl.index, pl.count, pl.dim, p.global_shape.str());
}

// A Shard's count must divide the tensor-parallel size; tensor rank t then holds piece
// t * count / tp.
void check_rank(const ParamInfo& p, int tp_rank, int tp_size) {
  const int64_t c = p.placement.count;
  DS_CHECK(tp_size % c == 0,
           "'{}' is split into {} pieces over {} tensor-parallel ranks: the number of pieces must divide the ranks",
           p.name, c, tp_size);
  DS_CHECK(p.placement.index == int64_t(tp_rank) * c / tp_size,
           "'{}' is piece {} of {} on tensor rank {} of {}, which holds piece {}", p.name, p.placement.index, c, tp_rank,
           tp_size, int64_t(tp_rank) * c / tp_size);
}

void check_tensors(const ParamInfo& p, Tensor local, Tensor global) {
  DS_CHECK(local.dtype() == DType::F32 && global.dtype() == DType::F32 && local.device().is_cpu() &&
               global.device().is_cpu(),
           "'{}': global tensors are assembled from host F32 pieces", p.name);
  DS_CHECK(local.numel() == p.shape.numel() && global.numel() == p.global_shape.numel(),
           "'{}': a piece of {} elements and a global tensor of {} for shapes {} and {}", p.name, local.numel(),
           global.numel(), p.shape.str(), p.global_shape.str());
}

// Copies between piece i of a sharded parameter's global tensor and a contiguous piece.
void copy_piece(const ParamInfo& p, int64_t i, float* global, float* piece, bool into_global) {
  const int64_t L = p.shape.numel();
  if (p.placement.dim == 0) {
    float* g = global + i * L;
    std::memcpy(into_global ? g : piece, into_global ? piece : g, size_t(L) * sizeof(float));
    return;
  }
  const int64_t rows = p.shape[0], width = p.shape[1], stride = p.global_shape[1];
  for (int64_t r = 0; r < rows; ++r) {
    float* g = global + r * stride + i * width;
    float* l = piece + r * width;
    std::memcpy(into_global ? g : l, into_global ? l : g, size_t(width) * sizeof(float));
  }
}

}  // namespace

void gather_global(const ParamInfo& p, Tensor local, Communicator* tp, Tensor global) {
  check_piece(p);
  check_tensors(p, local, global);
  float* src = local.data<float>();
  float* dst = global.data<float>();
  const int T = tp ? tp->size() : 1;
  if (is_whole(p)) {
    std::memcpy(dst, src, global.nbytes());
    return;
  }
  const int t = tp ? tp->rank() : 0;
  check_rank(p, t, T);
  const int64_t c = p.placement.count, L = local.numel();
  if (T == 1) {  // count 1: the piece is the tensor
    copy_piece(p, 0, dst, src, /*into_global=*/true);
    return;
  }
  const Tensor piece = local.view(Shape{L});
  if (c == T && p.placement.dim == 0) {  // rank order is row order
    tp->all_gather(global.view(Shape{int64_t(T) * L}), piece);
    return;
  }
  Buffer all("tensor_parallel.gather", MemCategory::CommBuffers, DType::F32, int64_t(T) * L);
  tp->all_gather(all.tensor(), piece);
  // Ranks i*T/c .. (i+1)*T/c - 1 hold piece i: the first one's copy is taken.
  for (int64_t i = 0; i < c; ++i) copy_piece(p, i, dst, all.data<float>() + (i * T / c) * L, /*into_global=*/true);
}

void extract_local(const ParamInfo& p, Tensor global, Tensor local) {
  check_piece(p);
  check_tensors(p, local, global);
  if (is_whole(p)) {
    std::memcpy(local.data<float>(), global.data<float>(), global.nbytes());
    return;
  }
  copy_piece(p, p.placement.index, global.data<float>(), local.data<float>(), /*into_global=*/false);
}

void extract_local(const ParamInfo& p, Tensor global, int tp_rank, int tp_size, Tensor local) {
  check_piece(p);
  if (!is_whole(p)) check_rank(p, tp_rank, tp_size);
  extract_local(p, global, local);
}

// ---- ShardedModelCheckpoint ----------------------------------------------------------

ShardedModelCheckpoint::ShardedModelCheckpoint(const ParamRegistry& reg, ProcessGrid& grid) : reg_(reg) {
  tp_size_ = grid.size(Axis::Tensor);
  tp_rank_ = grid.coord(Axis::Tensor);
  const ParamGroupComms groups = ParamGroupComms::from_grid(grid);
  for (ParamGroup g : {ParamGroup::Dense, ParamGroup::Expert}) {
    data_[g == ParamGroup::Expert ? 1 : 0] = {groups.comm(g).rank(), groups.comm(g).size()};
  }
  const int me = grid.coord(Axis::Pipeline), ep = grid.size(Axis::Expert);
  // The file's tensors: each stage's own parameters (not its copies of another stage's), in
  // pipeline-rank order, from one exchange of their names, shapes and kinds. Under expert
  // parallelism a stage's ranks hold different routed experts: the expert group's lists are
  // merged first, each layer's experts in expert-rank order where expert rank 0's stand (the
  // order of the model held whole). Entries: name, dims, kind, layer, trainable, group, the
  // expert rank holding it (-1: every rank).
  json mine = json::array();
  for (const ParamInfo& p : reg.all()) {
    check_piece(p);
    if (p.placement.kind == Placement::Kind::Shard) check_rank(p, tp_rank_, tp_size_);
    if (p.pipeline_copy) continue;
    std::vector<int64_t> dims;
    for (int d = 0; d < p.global_shape.ndim(); ++d) dims.push_back(p.global_shape[d]);
    const bool expert = p.placement.kind == Placement::Kind::Expert;
    mine.push_back({p.name, dims, int(p.kind), p.layer, p.trainable, int(p.group), expert ? grid.coord(Axis::Expert) : -1});
  }
  if (ep > 1) {
    std::vector<json> lists;
    for (const std::string& l : all_gather_strings(grid.comm(Axis::Expert), mine.dump())) lists.push_back(json::parse(l));
    json merged = json::array();
    std::set<int> layers_done;
    for (const json& e : lists[0]) {
      if (e[6].get<int>() < 0) {
        merged.push_back(e);
      } else if (layers_done.insert(e[3].get<int>()).second) {
        for (const json& list : lists) {
          for (const json& x : list) {
            if (x[6].get<int>() >= 0 && x[3] == e[3]) merged.push_back(x);
          }
        }
      }
    }
    mine = std::move(merged);
  }
  const std::vector<std::string> stages =
      grid.size(Axis::Pipeline) > 1 ? all_gather_strings(grid.comm(Axis::Pipeline), mine.dump())
                                    : std::vector<std::string>{mine.dump()};
  for (size_t stage = 0; stage < stages.size(); ++stage) {
    for (const json& e : json::parse(stages[stage])) {
      const std::vector<int64_t> dims = e[1].get<std::vector<int64_t>>();
      const Shape shape = Shape::from(dims.begin(), dims.end());
      ParamOptions o;
      o.trainable = e[4].get<bool>();
      o.group = ParamGroup(e[5].get<int>());
      const std::string name = e[0].get<std::string>();
      DS_CHECK(file_.find(name) < 0, "'{}' is owned by two pipeline stages", name);
      file_.add(name, shape, ParamKind(e[2].get<int>()), e[3].get<int>(), o);
      owner_.push_back(int(stage));
      local_.push_back(int(stage) == me ? reg.find(name) : -1);
    }
  }
  file_of_.assign(size_t(reg.size()), -1);
  for (int fid = 0; fid < file_.size(); ++fid) {
    if (local_[size_t(fid)] >= 0) file_of_[size_t(local_[size_t(fid)])] = fid;
  }
}

std::shared_ptr<const ShardedState> ShardedModelCheckpoint::describe(const Shard& shard) const {
  auto out = std::make_shared<ShardedState>();
  out->numel = shard.numel;
  for (int id = 0; id < reg_.size(); ++id) {
    const int fid = file_of_[size_t(id)];
    if (fid < 0) continue;  // a stage's copy of a tensor another stage owns
    const ParamInfo& p = reg_.info(id);
    TensorPiece t = placement_block(p);
    t.tensor = fid;
    // The ranks of the tensor group holding the same block.
    int tensor_replica = tp_rank_, tensor_replicas = tp_size_;
    if (!is_whole(p)) {
      tensor_replicas = int(tp_size_ / p.placement.count);
      tensor_replica = int(tp_rank_ - p.placement.index * tensor_replicas);
    }
    // ZeRO's rows of the local piece (all of them without ZeRO).
    const RowPiece rows = shard.rows(id);
    DS_CHECK(rows.row_begin >= 0 && rows.rows >= 0 && rows.row_begin + rows.rows <= (p.shape.ndim() ? p.shape[0] : 1),
             "'{}': rows [{}, {}) of its local piece {}", p.name, rows.row_begin, rows.row_begin + rows.rows,
             p.shape.str());
    if (p.shape.ndim() > 0) {
      t.offset[0] += rows.row_begin;
      t.shape[0] = rows.rows;
    }
    t.at = shard.at(id);
    const GroupRank data =
        shard.groups ? GroupRank{shard.groups->comm(p.group).rank(), shard.groups->comm(p.group).size()}
                     : data_[p.group == ParamGroup::Expert ? 1 : 0];
    const int data_replica = shard.replicated_over_data ? data.rank : 0;
    const int data_replicas = shard.replicated_over_data ? data.size : 1;
    t.replicas = data_replicas * tensor_replicas;
    t.replica = data_replica * tensor_replicas + tensor_replica;
    out->pieces.push_back(std::move(t));
  }
  return out;
}

std::shared_ptr<const ShardedState> ShardedModelCheckpoint::describe_registry() const {
  Shard s;
  s.rows = [this](int id) { return row_piece(reg_.info(id).shape, 0, 1); };
  s.at = [this](int id) { return reg_.info(id).offset; };
  s.numel = reg_.flat_numel();
  s.replicated_over_data = true;
  return describe(s);
}

}  // namespace dstrain
