// Pieces of global tensors (see sharded_state.h).
#include "io/sharded_state.h"

#include <algorithm>

#include "core/error.h"

namespace dstrain {

ShardedState ShardedState::whole(const ParamRegistry& reg, int replica, int replicas) {
  DS_CHECK(replicas >= 1 && replica >= 0 && replica < replicas, "ShardedState::whole: replica {} of {}", replica,
           replicas);
  ShardedState s;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    DS_CHECK(p.shape == p.global_shape,
             "'{}' is held as a piece {} of the global {}: describe its pieces through the parallel layout "
             "(ShardedModelCheckpoint::describe)",
             p.name, p.shape.str(), p.global_shape.str());
    TensorPiece t;
    t.tensor = id;
    t.offset.assign(size_t(p.global_shape.ndim()), 0);
    t.shape = p.global_shape;
    t.at = p.offset;
    t.replica = replica;
    t.replicas = replicas;
    s.pieces.push_back(std::move(t));
  }
  s.numel = reg.flat_numel();
  return s;
}

TensorPiece placement_block(const ParamInfo& p) {
  TensorPiece t;
  t.tensor = -1;
  t.offset.assign(size_t(p.global_shape.ndim()), 0);
  t.shape = p.shape;
  t.at = p.offset;
  if (p.placement.kind == Placement::Kind::Shard && !p.placement.held_whole()) {
    const int dim = int(p.placement.dim);
    DS_CHECK(dim >= 0 && dim < p.global_shape.ndim() && p.shape.ndim() == p.global_shape.ndim(),
             "'{}' {} is split along dimension {} of {}", p.name, p.shape.str(), dim, p.global_shape.str());
    t.offset[size_t(dim)] = p.placement.index * p.shape[dim];
  } else {
    DS_CHECK(p.shape == p.global_shape, "'{}' is placed whole but holds {} of the global {}", p.name, p.shape.str(),
             p.global_shape.str());
  }
  return t;
}

void ShardedState::check(const ParamRegistry& file) const {
  std::vector<char> seen(size_t(file.size()), 0);
  for (const TensorPiece& t : pieces) {
    DS_CHECK(t.tensor >= 0 && t.tensor < file.size(), "a piece names tensor {} of a file of {} tensors", t.tensor,
             file.size());
    const ParamInfo& p = file.info(t.tensor);
    const Shape& g = p.global_shape;
    DS_CHECK(!seen[size_t(t.tensor)], "'{}' has two pieces on one rank", p.name);
    seen[size_t(t.tensor)] = 1;
    bool fits = t.shape.ndim() == g.ndim() && int(t.offset.size()) == g.ndim();
    for (int d = 0; fits && d < g.ndim(); ++d) {
      fits = t.offset[size_t(d)] >= 0 && t.shape[d] >= 0 && t.offset[size_t(d)] + t.shape[d] <= g[d];
    }
    std::string at;
    for (int64_t o : t.offset) at += (at.empty() ? "" : ", ") + std::to_string(o);
    DS_CHECK(fits, "the piece {} at [{}] of '{}' lies outside its global shape {}", t.shape.str(), at, p.name, g.str());
    DS_CHECK(t.replicas >= 1 && t.replica >= 0 && t.replica < t.replicas, "the piece of '{}' is replica {} of {}",
             p.name, t.replica, t.replicas);
    DS_CHECK(t.at >= 0 && t.at + t.numel() <= numel,
             "the piece of '{}' lies at [{}, {}) of buffers of {} elements", p.name, t.at, t.at + t.numel(), numel);
  }
}

std::vector<PieceRun> piece_runs(const TensorPiece& piece, const Shape& global, const RowPiece& rows) {
  std::vector<PieceRun> runs;
  const int nd = global.ndim();
  if (nd == 0) {
    if (rows.rows > 0) runs.push_back({0, 0, 1});
    return runs;
  }
  if (rows.rows <= 0 || piece.numel() == 0) return runs;
  std::vector<int64_t> stride(size_t(nd), 1);
  for (int d = nd - 2; d >= 0; --d) stride[size_t(d)] = stride[size_t(d) + 1] * global[d + 1];
  // k: the outermost dimension from which on the block spans every trailing element.
  int k = nd - 1;
  while (k > 0 && piece.offset[size_t(k)] == 0 && piece.shape[k] == global[k]) --k;
  // Dimensions after k are whole; k itself is partial unless k = 0.
  const int64_t run = piece.shape[k] * stride[size_t(k)];
  if (k == 0) {
    runs.push_back({(piece.offset[0] + rows.row_begin) * stride[0], rows.row_begin * rows.row_elems,
                    rows.rows * rows.row_elems});
    return runs;
  }
  // One run per index of dimensions 0..k-1, dimension 0 restricted to the rows.
  std::vector<int64_t> idx(size_t(k), 0);
  idx[0] = rows.row_begin;
  int64_t local = rows.row_begin * rows.row_elems;
  for (;;) {
    int64_t g = piece.offset[size_t(k)] * stride[size_t(k)];
    for (int d = 0; d < k; ++d) g += (piece.offset[size_t(d)] + idx[size_t(d)]) * stride[size_t(d)];
    runs.push_back({g, local, run});
    local += run;
    int d = k - 1;
    for (; d >= 1; --d) {
      if (++idx[size_t(d)] < piece.shape[d]) break;
      idx[size_t(d)] = 0;
    }
    if (d == 0 && ++idx[0] >= rows.row_begin + rows.rows) break;
  }
  return runs;
}

}  // namespace dstrain
