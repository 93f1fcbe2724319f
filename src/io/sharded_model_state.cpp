// Global tensors from the pieces of a model split over the tensor, pipeline and expert axes, and
// back, and the staging that lets its checkpoints hold global tensors (see sharded_model_state.h).
#include "io/sharded_model_state.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "core/json_reader.h"

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

// Whether the rows tensor rank t stages (block t of tp) are its own piece: a dim-0 piece with
// one piece per rank.
bool block_is_own_piece(const ParamInfo& p, int tp_size) {
  return !is_whole(p) && p.placement.dim == 0 && p.placement.count == tp_size;
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

ShardedModelCheckpoint::ShardedModelCheckpoint(const ParamRegistry& reg, ProcessGrid& grid)
    : reg_(reg), tensor_(grid.comm(Axis::Tensor)), data_(grid.comm(Axis::Data)), expert_data_(grid.expert_data()) {
  tp_size_ = grid.size(Axis::Tensor);
  tp_rank_ = grid.coord(Axis::Tensor);
  data_rank_ = grid.coord(Axis::Data);
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
      writer_.push_back(std::max(e[6].get<int>(), 0));
      local_.push_back(int(stage) == me ? reg.find(name) : -1);
    }
  }
  file_of_.assign(size_t(reg.size()), -1);
  for (int fid = 0; fid < file_.size(); ++fid) {
    if (local_[size_t(fid)] >= 0) file_of_[size_t(local_[size_t(fid)])] = fid;
  }
  auto globals = std::make_shared<std::vector<Shape>>();
  auto offsets = std::make_shared<std::vector<int64_t>>();
  auto owners = std::make_shared<std::vector<int>>(owner_);
  auto writers = std::make_shared<std::vector<int>>(writer_);
  int64_t n = 0;
  for (int id = 0; id < file_.size(); ++id) {
    const ParamInfo& p = file_.info(id);
    globals->push_back(p.global_shape);
    offsets->push_back(n);
    io_rank_ = io_rank_ || writes(id);
    if (writes(id)) n += row_piece(p.global_shape, tp_rank_, tp_size_).elems();
  }
  offsets_ = std::move(offsets);
  numel_ = std::max<int64_t>(n, 1);
  // World rank r = (pipeline * data + d) * tp + t: the ranks of a stage and data coordinate are
  // consecutive, and their blocks 0..tp-1 tile every tensor of that stage in rank order.
  const int tp = tp_size_, dp = grid.size(Axis::Data), world = grid.world_size();
  partition_ = [globals, owners, writers, tp, dp, world](int id, int rank) {
    DS_CHECK(rank >= 0 && rank < world,
             "checkpoint of a model-parallel model: rank {} of the checkpoint communicator is outside the grid's {} "
             "ranks; use a communicator ranked as the grid's world",
             rank, world);
    const Shape& g = globals->at(size_t(id));
    const int t = rank % tp, d = (rank / tp) % dp, pipeline = rank / (tp * dp);
    if (d == writers->at(size_t(id)) && pipeline == owners->at(size_t(id))) return row_piece(g, t, tp);
    RowPiece none = row_piece(g, 0, 1);
    none.rows = 0;
    return none;
  };
}

void ShardedModelCheckpoint::allocate(int groups) {
  static constexpr const char* kLabels[3] = {"checkpoint.tensor_parallel.values", "checkpoint.tensor_parallel.exp_avg",
                                             "checkpoint.tensor_parallel.exp_avg_sq"};
  for (int g = 0; g < groups; ++g) {
    if (staged_[g].numel() != numel_) staged_[g] = Buffer(kLabels[g], MemCategory::Checkpoint, DType::F32, numel_);
  }
}

void ShardedModelCheckpoint::release() {
  for (Buffer& b : staged_) b = Buffer();
  read_groups_ = 0;
}

CheckpointBuffers ShardedModelCheckpoint::stage(const float* values, const float* exp_avg, const float* exp_avg_sq) {
  DS_CHECK(values != nullptr, "ShardedModelCheckpoint::stage: no values to stage");
  DS_CHECK((exp_avg == nullptr) == (exp_avg_sq == nullptr),
           "ShardedModelCheckpoint::stage: give both AdamW moments or neither");
  const int groups = exp_avg ? 3 : 1;
  const float* src[3] = {values, exp_avg, exp_avg_sq};
  stage_groups(groups, [&](int id, int g) { return src[g] + reg_.info(id).offset; });
  return staged_buffers(groups);
}

CheckpointBuffers ShardedModelCheckpoint::staged_buffers(int groups) {
  CheckpointBuffers b;
  b.values = staged_[0].data<float>();
  b.exp_avg = groups == 3 ? staged_[1].data<float>() : nullptr;
  b.exp_avg_sq = groups == 3 ? staged_[2].data<float>() : nullptr;
  b.piece_offsets = offsets_;
  b.numel = numel_;
  b.partition = partition_;
  return b;
}

namespace {

// One parameter's local piece, the largest of the registry's.
Buffer piece_buffer(const ParamRegistry& reg) {
  int64_t largest = 1;
  for (const ParamInfo& p : reg.all()) largest = std::max(largest, p.shape.numel());
  return Buffer("checkpoint.local_piece", MemCategory::Checkpoint, DType::F32, largest);
}

}  // namespace

CheckpointBuffers ShardedModelCheckpoint::stage(LocalPieces& pieces, bool with_moments) {
  Buffer piece = piece_buffer(reg_);
  // Every replica gathers each piece of the file's tensors with the others; the writers stage it.
  stage_groups(with_moments ? 3 : 1, [&](int id, int g) -> const float* {
    if (file_of_[size_t(id)] < 0) return nullptr;  // a copy of a tensor another stage writes
    pieces.gather(id, g, piece.data<float>());
    return piece.data<float>();
  });
  return staged_buffers(with_moments ? 3 : 1);
}

void ShardedModelCheckpoint::stage_groups(int groups, const LocalOf& local_of) {
  allocate(groups);
  // Row blocks of a dim-0 piece lie inside the piece (count divides tp); whole parameters are
  // here whole; only dim-1 pieces are gathered, one global tensor at a time.
  int64_t gathered = 0;
  for (const ParamInfo& p : reg_.all()) {
    if (io_rank_ && !is_whole(p) && p.placement.dim == 1) gathered = std::max(gathered, p.global_shape.numel());
  }
  Buffer global;
  if (gathered > 0) global = Buffer("checkpoint.tensor_parallel.global", MemCategory::Checkpoint, DType::F32, gathered);
  for (int g = 0; g < groups; ++g) {
    float* staged = staged_[g].data<float>();
    for (int id = 0; id < reg_.size(); ++id) {
      const float* local = local_of(id, g);  // on every rank: it may be collective over the replicas
      const int fid = file_of_[size_t(id)];
      if (fid < 0 || !writes(fid)) continue;  // another stage's, or written by other replicas
      const ParamInfo& p = reg_.info(id);
      const RowPiece block = row_piece(p.global_shape, tp_rank_, tp_size_);
      float* dst = staged + (*offsets_)[size_t(fid)];
      const float* from = nullptr;
      if (is_whole(p)) {
        from = local + block.elem_begin();
      } else if (p.placement.dim == 0) {
        from = local + (block.elem_begin() - p.placement.index * p.shape.numel());
      } else {
        const Tensor whole = global.tensor(0, p.global_shape);
        gather_global(p, Tensor(const_cast<float*>(local), DType::F32, p.shape), &tensor_, whole);
        from = whole.data<float>() + block.elem_begin();
      }
      std::memcpy(dst, from, size_t(block.elems()) * sizeof(float));
    }
  }
}

CheckpointTargets ShardedModelCheckpoint::targets(bool with_moments) {
  read_groups_ = with_moments ? 3 : 1;
  allocate(read_groups_);
  CheckpointTargets t;
  t.values = staged_[0].data<float>();
  t.exp_avg = with_moments ? staged_[1].data<float>() : nullptr;
  t.exp_avg_sq = with_moments ? staged_[2].data<float>() : nullptr;
  t.piece_offsets = offsets_;
  t.partition = partition_;
  return t;
}

void ShardedModelCheckpoint::unstage(float* values, float* exp_avg, float* exp_avg_sq) {
  DS_CHECK(values != nullptr, "ShardedModelCheckpoint::unstage: no values to fill");
  DS_CHECK((exp_avg == nullptr) == (exp_avg_sq == nullptr),
           "ShardedModelCheckpoint::unstage: give both AdamW moments or neither");
  const int groups = exp_avg ? 3 : 1;
  float* dst[3] = {values, exp_avg, exp_avg_sq};
  unstage_groups(groups, [&](int id, int g) { return dst[g] + reg_.info(id).offset; }, nullptr);
  // The data-parallel replicas hold the same pieces: the dense parameters data coordinate 0's,
  // the routed experts those of the expert group 0's owner (rank 0 of expert_data), each
  // broadcast over the ranks holding it, one run of consecutive parameters of a group at a time.
  constexpr int64_t kChunk = int64_t(1) << 28;  // elements per broadcast, well inside one MPI call
  for (int run = 0; run < reg_.size();) {
    const bool expert = reg_.info(run).placement.kind == Placement::Kind::Expert;
    int end = run + 1;
    while (end < reg_.size() && (reg_.info(end).placement.kind == Placement::Kind::Expert) == expert) ++end;
    Communicator& replicas = expert ? expert_data_ : data_;
    if (replicas.size() > 1) {
      const int64_t b0 = reg_.info(run).offset;
      const ParamInfo& last = reg_.info(end - 1);
      const int64_t b1 = last.offset + last.shape.numel();
      for (int g = 0; g < groups; ++g) {
        for (int64_t b = b0; b < b1; b += kChunk) {
          replicas.broadcast(Tensor(dst[g] + b, DType::F32, Shape{std::min(kChunk, b1 - b)}), 0);
        }
      }
    }
    run = end;
  }
}

void ShardedModelCheckpoint::unstage(LocalPieces& pieces, bool with_moments) {
  Buffer piece = piece_buffer(reg_);
  // The first replica assembles each piece of the file's tensors; every replica takes its part.
  unstage_groups(
      with_moments ? 3 : 1, [&](int, int) { return piece.data<float>(); },
      [&](int id, int g, float* assembled) {
        if (file_of_[size_t(id)] >= 0) pieces.scatter(id, g, assembled);
      });
}

void ShardedModelCheckpoint::unstage_groups(int groups, const std::function<float*(int id, int g)>& local_of,
                                            const std::function<void(int id, int g, float* piece)>& done) {
  DS_CHECK(read_groups_ >= groups,
           "ShardedModelCheckpoint::unstage: {} read into targets({}); call targets(true) before reading "
           "the optimizer state",
           read_groups_ == 0 ? "nothing was" : "only the model was", read_groups_ == 3);
  int64_t gathered = 0;
  for (const ParamInfo& p : reg_.all()) {
    if (io_rank_ && !is_whole(p) && !block_is_own_piece(p, tp_size_)) {
      gathered = std::max(gathered, p.global_shape.numel());
    }
  }
  Buffer global;
  if (gathered > 0) global = Buffer("checkpoint.tensor_parallel.global", MemCategory::Checkpoint, DType::F32, gathered);
  std::vector<int64_t> counts(static_cast<size_t>(tp_size_));
  for (int g = 0; g < groups; ++g) {
    float* staged = staged_[g].data<float>();
    for (int id = 0; id < reg_.size(); ++id) {
      float* local = local_of(id, g);
      const int fid = file_of_[size_t(id)];
      if (fid >= 0 && writes(fid)) {  // otherwise another stage's, or read by other replicas
        const ParamInfo& p = reg_.info(id);
        const RowPiece block = row_piece(p.global_shape, tp_rank_, tp_size_);
        float* blocks = staged + (*offsets_)[size_t(fid)];
        if (block_is_own_piece(p, tp_size_)) {
          std::memcpy(local, blocks, size_t(block.elems()) * sizeof(float));
        } else {
          for (int r = 0; r < tp_size_; ++r) counts[size_t(r)] = row_piece(p.global_shape, r, tp_size_).elems();
          const Tensor mine(blocks, DType::F32, Shape{block.elems()});
          const int64_t G = p.global_shape.numel();
          if (is_whole(p)) {
            tensor_.all_gather_v_async(Tensor(local, DType::F32, Shape{G}), mine, counts).wait();
          } else {
            const Tensor whole = global.tensor(0, p.global_shape);
            tensor_.all_gather_v_async(whole.view(Shape{G}), mine, counts).wait();
            extract_local(p, whole, tp_rank_, tp_size_, Tensor(local, DType::F32, p.shape));
          }
        }
      }
      if (done) done(id, g, local);
    }
  }
}

}  // namespace dstrain
