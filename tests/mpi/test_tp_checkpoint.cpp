// Checkpoints and Hugging Face weights of tensor-parallel registries at 1, 2 and 4 ranks, on
// every layout the world allows (tensor = world, and tensor 2 x data 2 at 4 ranks): the global
// tensors gather from the pieces (whole, dim-0 and dim-1 shards, key/value pieces replicated
// over more tensor ranks than there are heads); a checkpoint written at one tensor-parallel
// size reads back at every other (and through the plain whole-model path) with every piece and
// moment in place, with the state replicated over the data ranks or sharded over them by rows
// (ZeRO), and its file holds global tensors whose checksums are those of the whole tensors;
// async saves carry the description; a description that does not write every element once is
// refused; save_hf_weights from the pieces writes the same files as the whole registry's, and
// load_hf_weights fills each rank's pieces.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "comm/grid.h"
#include "core/philox.h"
#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "io/sharded_model_state.h"
#include "run_files.h"
#include "train/checkpointing.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// A dense GQA-like model small enough to check element by element: hidden 8, 4 query heads
// and 2 key/value heads of dim 2, intermediate 12, vocabulary 16, two layers.
constexpr int64_t C = 8, H = 4, Hkv = 2, D = 2, I = 12, V = 16;

// One parameter: its whole form, or piece t of min(tp, max_pieces) along dim (rank t of tp
// holding piece t * count / tp).
void add(ParamRegistry& reg, const std::string& name, Shape global, ParamKind kind, int layer, int dim, int tp_rank,
         int tp, int64_t max_pieces = 1 << 30, bool follow = false) {
  ParamOptions o;
  o.follow_previous = follow;
  Shape local = global;
  const int64_t count = std::min<int64_t>(tp, max_pieces);
  if (dim >= 0 && tp > 1) {
    o.placement.kind = Placement::Kind::Shard;
    o.placement.dim = dim;
    o.placement.axis = "tensor";
    o.placement.count = count;
    o.placement.index = int64_t(tp_rank) * count / tp;
    o.global_shape = global;
    local[dim] = global[dim] / count;
  }
  reg.add(name, local, kind, layer, o);
}

// The registry of tensor rank tp_rank of tp (tp 1: every parameter whole).
std::unique_ptr<ParamRegistry> make_registry(int tp_rank, int tp) {
  auto reg = std::make_unique<ParamRegistry>();
  ParamRegistry& r = *reg;
  add(r, "model.embed_tokens.weight", {V, C}, ParamKind::Embedding, -1, -1, tp_rank, tp);
  for (int l = 0; l < 2; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    add(r, pre + "input_layernorm.weight", {C}, ParamKind::Norm, l, -1, tp_rank, tp);
    add(r, pre + "self_attn.q_proj.weight", {H * D, C}, ParamKind::Linear, l, 0, tp_rank, tp);
    // Fewer key/value heads than tensor ranks at 4: pieces replicated over rank pairs.
    add(r, pre + "self_attn.k_proj.weight", {Hkv * D, C}, ParamKind::Linear, l, 0, tp_rank, tp, Hkv, true);
    add(r, pre + "self_attn.v_proj.weight", {Hkv * D, C}, ParamKind::Linear, l, 0, tp_rank, tp, Hkv, true);
    add(r, pre + "self_attn.o_proj.weight", {C, H * D}, ParamKind::Linear, l, 1, tp_rank, tp);
    add(r, pre + "post_attention_layernorm.weight", {C}, ParamKind::Norm, l, -1, tp_rank, tp);
    add(r, pre + "mlp.gate_proj.weight", {I, C}, ParamKind::Linear, l, 0, tp_rank, tp);
    add(r, pre + "mlp.up_proj.weight", {I, C}, ParamKind::Linear, l, 0, tp_rank, tp, 1 << 30, true);
    add(r, pre + "mlp.down_proj.weight", {C, I}, ParamKind::Linear, l, 1, tp_rank, tp);
  }
  // A replicated dim-1 piece, a whole matrix of 5 rows (uneven row blocks) and a vector of 3
  // (fewer rows than tensor ranks at 4: empty blocks).
  add(r, "model.layers.1.self_attn.kv_mix.weight", {C, 4}, ParamKind::Linear, 1, 1, tp_rank, tp, 2);
  add(r, "model.layers.1.mlp.gate.weight", {5, C}, ParamKind::Linear, 1, -1, tp_rank, tp);
  add(r, "model.layers.1.mlp.gate.e_score_correction_bias", {3}, ParamKind::RouterBias, 1, -1, tp_rank, tp);
  add(r, "model.norm.weight", {C}, ParamKind::Norm, -1, -1, tp_rank, tp);
  // The output head split by vocabulary rows, as a vocabulary-parallel head is.
  add(r, "lm_head.weight", {V, C}, ParamKind::Head, -1, 0, tp_rank, tp);
  r.allocate(Device::cpu());
  return reg;
}

// The value of element `g` (flattened global index) of tensor `name` in state group `group`
// (0 weights, 1 exp_avg, 2 exp_avg_sq): exact in fp32, distinct across tensors and groups.
float expected(const std::string& name, int64_t g, int group) {
  return float(stream_id(name) % 1000) + 0.25f * float(g) + 2000.0f * float(group);
}

// The flattened global index of element i of p's local piece.
int64_t global_index(const ParamInfo& p, int64_t i) {
  if (p.placement.kind == Placement::Kind::Whole) return i;
  const int64_t L = p.shape.numel();
  if (p.placement.dim == 0) return p.placement.index * L + i;
  const int64_t w = p.shape[1], r = i / w, c = i % w;
  return r * p.global_shape[1] + p.placement.index * w + c;
}

// Flat buffers (registry layout) of one state group.
void fill(const ParamRegistry& reg, float* flat, int group) {
  for (const ParamInfo& p : reg.all()) {
    for (int64_t i = 0; i < p.numel(); ++i) flat[p.offset + i] = expected(p.name, global_index(p, i), group);
  }
}

// Mismatches of a flat buffer against `expected` (the first few reported).
int64_t check(const ParamRegistry& reg, const float* flat, int group, const std::string& what) {
  int64_t bad = 0;
  for (const ParamInfo& p : reg.all()) {
    for (int64_t i = 0; i < p.numel(); ++i) {
      const float want = expected(p.name, global_index(p, i), group);
      if (flat[p.offset + i] != want && bad++ < 5) {
        ADD_FAILURE() << what << ": " << p.name << " local element " << i << " (global " << global_index(p, i)
                      << ") is " << flat[p.offset + i] << ", expected " << want;
      }
    }
  }
  return bad;
}

// One layout of the world: tensor tp x data world/tp, its registry and flat state.
struct Layout {
  std::unique_ptr<ProcessGrid> grid;
  std::unique_ptr<ParamRegistry> reg;
  std::vector<float> m, v;
  explicit Layout(int tp) {
    ParallelConfig pc;
    pc.tensor = tp;
    pc.data = world_size() / tp;
    grid = std::make_unique<ProcessGrid>(MPI_COMM_WORLD, pc);
    reg = make_registry(grid->coord(Axis::Tensor), tp);
    m.assign(size_t(reg->flat_numel()), 0.0f);
    v.assign(size_t(reg->flat_numel()), 0.0f);
  }
  float* values() { return reg->values().data<float>(); }
  void fill_state() {
    fill(*reg, values(), 0);
    fill(*reg, m.data(), 1);
    fill(*reg, v.data(), 2);
  }
  void poison() {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    std::fill(values(), values() + reg->flat_numel(), nan);
    std::fill(m.begin(), m.end(), nan);
    std::fill(v.begin(), v.end(), nan);
  }
  bool data0() const { return grid->coord(Axis::Data) == 0; }
};

// The tensor-parallel sizes of this world: every divisor of it (1, 2, 4).
std::vector<int> sizes() {
  std::vector<int> out;
  for (int tp = 1; tp <= world_size(); ++tp) {
    if (world_size() % tp == 0) out.push_back(tp);
  }
  return out;
}

// Buffers and targets: whole tensors in the registry's layout (null pieces), or the pieces a
// description gives.
CheckpointBuffers buffers(const float* values, const float* exp_avg = nullptr, const float* exp_avg_sq = nullptr,
                          std::shared_ptr<const ShardedState> pieces = nullptr) {
  CheckpointBuffers b;
  b.values = values;
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  b.pieces = std::move(pieces);
  return b;
}
CheckpointTargets targets(float* values, float* exp_avg, float* exp_avg_sq, std::shared_ptr<const ShardedState> pieces) {
  CheckpointTargets t;
  t.values = values;
  t.exp_avg = exp_avg;
  t.exp_avg_sq = exp_avg_sq;
  t.pieces = std::move(pieces);
  return t;
}

TrainState state_at(int64_t step) {
  TrainState st;
  st.step = step;
  st.consumed_samples = 8 * step;
  st.optimizer_steps = step;
  st.config = json::object();
  st.layout = {{"test", "tp_checkpoint"}};
  return st;
}

// A directory every rank agrees on, removed at the end.
class TempDir {
 public:
  TempDir() {
    int pid = ::getpid();
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    static int instance = 0;
    dir_ = fs::temp_directory_path() / ("dstrain_tpckpt_" + std::to_string(pid) + "_" + std::to_string(instance++));
    if (world_rank() == 0) fs::create_directories(dir_);
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~TempDir() {
    MPI_Barrier(MPI_COMM_WORLD);
    if (world_rank() == 0) fs::remove_all(dir_);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

 private:
  fs::path dir_;
};

// What rank 0 reads of a file: every tensor passes its checksum and has its global shape.
void expect_global_file(const std::string& path, const ParamRegistry& whole, bool moments) {
  if (world_rank() != 0) return;
  const CheckpointInfo info = inspect_checkpoint(path, /*verify=*/true);
  EXPECT_TRUE(info.metadata_problems.empty()) << path;
  EXPECT_EQ(info.tensors.size(), size_t(whole.size()) * (moments ? 3 : 1)) << path;
  for (const CheckpointTensorInfo& t : info.tensors) {
    EXPECT_TRUE(t.ok()) << path << ": " << t.group << "/" << t.name << " fails its checksum";
    const int id = whole.find(t.name);
    ASSERT_GE(id, 0) << t.name;
    EXPECT_EQ(t.shape, whole.info(id).global_shape) << t.name;
  }
}

// ---- gather_global / extract_local -----------------------------------------------------

TEST(TensorParallelState, GatherGlobalAssemblesEveryLayout) {
  for (int tp : sizes()) {
    Layout lay(tp);
    lay.fill_state();
    Communicator& tc = lay.grid->comm(Axis::Tensor);
    for (int id = 0; id < lay.reg->size(); ++id) {
      const ParamInfo& p = lay.reg->info(id);
      std::vector<float> global(size_t(p.global_shape.numel()), -1.0f);
      const Tensor g(global.data(), DType::F32, p.global_shape);
      gather_global(p, lay.reg->param(id), &tc, g);
      for (size_t e = 0; e < global.size(); ++e) {
        ASSERT_EQ(global[e], expected(p.name, int64_t(e), 0)) << "tp " << tp << ": " << p.name << " element " << e;
      }
      // And back: each rank's piece, by its tensor rank and by its placement alone.
      std::vector<float> local(size_t(p.numel()), -1.0f);
      extract_local(p, g, lay.grid->coord(Axis::Tensor), tp, Tensor(local.data(), DType::F32, p.shape));
      EXPECT_EQ(0, std::memcmp(local.data(), lay.reg->param(id).data<float>(), local.size() * sizeof(float)))
          << "tp " << tp << ": " << p.name;
    }
  }
}

TEST(TensorParallelState, WrongPlacementsAreRefused) {
  ParamRegistry reg;
  ParamOptions o;
  o.placement.kind = Placement::Kind::Shard;
  o.placement.axis = "tensor";
  o.placement.dim = 0;
  o.placement.count = 3;  // three pieces cannot spread over 2 or 4 ranks
  o.global_shape = {6, 4};
  reg.add("w", {2, 4}, ParamKind::Linear, 0, o);
  reg.allocate(Device::cpu());
  std::vector<float> global(24);
  const Tensor g(global.data(), DType::F32, {6, 4});
  EXPECT_THROW(extract_local(reg.info(0), g, 0, 2, reg.param(0)), Error);
  EXPECT_THROW(extract_local(reg.info(0), g, 1, 3, reg.param(0)), Error);  // rank 1 holds piece 1, not 0
  EXPECT_NO_THROW(extract_local(reg.info(0), g, 0, 3, reg.param(0)));
  EXPECT_THROW(gather_global(reg.info(0), reg.param(0), nullptr, g), Error);  // 3 pieces, one rank
}

// ---- checkpoints -----------------------------------------------------------------------

// ZeRO's layout of a Layout's state: each data rank holds rows row_piece(local shape, d, dp) of
// every local piece, end to end in a shard buffer (what DistributedOptimizer does).
struct ZeroShard {
  std::vector<int64_t> at;
  std::vector<RowPiece> rows;
  int64_t numel = 0;
  std::vector<float> values, m, v;
  ZeroShard(const ParamRegistry& reg, int d, int dp) {
    for (const ParamInfo& p : reg.all()) {
      rows.push_back(row_piece(p.shape, d, dp));
      at.push_back(numel);
      numel += rows.back().elems();
    }
    values.assign(size_t(std::max<int64_t>(numel, 1)), 0.0f);
    m = values;
    v = values;
  }
  ShardedModelCheckpoint::Shard shard() const {
    ShardedModelCheckpoint::Shard s;
    s.rows = [this](int id) { return rows[size_t(id)]; };
    s.at = [this](int id) { return at[size_t(id)]; };
    s.numel = numel;
    s.replicated_over_data = false;
    return s;
  }
  // Between the registry's layout (whole local pieces) and the shard.
  void copy(const ParamRegistry& reg, float* flat[3], bool into_shard) {
    float* mine[3] = {values.data(), m.data(), v.data()};
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      const RowPiece& r = rows[size_t(id)];
      for (int g = 0; g < 3; ++g) {
        float* a = flat[g] + p.offset + r.elem_begin();
        float* b = mine[g] + at[size_t(id)];
        std::memcpy(into_shard ? b : a, into_shard ? a : b, size_t(r.elems()) * sizeof(float));
      }
    }
  }
};

// Written at tensor-parallel size a, read at b, for every pair of sizes the world allows, and
// with the state replicated over the data ranks or sharded over them by rows (ZeRO) on either
// side: every rank's pieces and moments come back exactly, and the file holds the global tensors.
TEST(ShardedModelCheckpoint, RestartsAtEveryTensorParallelSizeAndSharding) {
  TempDir dir;
  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  for (int a : sizes()) {
    for (bool zero_a : {false, true}) {
      const std::string path = dir.path("tp" + std::to_string(a) + (zero_a ? "_zero" : "") + ".h5");
      {
        Layout w(a);
        w.fill_state();
        ShardedModelCheckpoint smc(*w.reg, *w.grid);
        EXPECT_EQ(smc.file_registry().size(), whole->size());
        if (zero_a) {
          ZeroShard z(*w.reg, w.grid->coord(Axis::Data), w.grid->size(Axis::Data));
          float* flat[3] = {w.values(), w.m.data(), w.v.data()};
          z.copy(*w.reg, flat, true);
          write_checkpoint(path, w.grid->mpi_world(), smc.file_registry(),
                           buffers(z.values.data(), z.m.data(), z.v.data(), smc.describe(z.shard())), state_at(3));
        } else {
          write_checkpoint(path, w.grid->mpi_world(), smc.file_registry(),
                           buffers(w.values(), w.m.data(), w.v.data(), smc.describe_registry()), state_at(3));
        }
      }
      expect_global_file(path, *whole, true);
      for (int b : sizes()) {
        for (bool zero_b : {false, true}) {
          SCOPED_TRACE(fmt::format("written at tensor {}{}, read at tensor {}{}", a, zero_a ? " (ZeRO)" : "", b,
                                   zero_b ? " (ZeRO)" : ""));
          Layout r(b);
          r.poison();  // every value must come from the file
          ShardedModelCheckpoint smc(*r.reg, *r.grid);
          if (zero_b) {
            ZeroShard z(*r.reg, r.grid->coord(Axis::Data), r.grid->size(Axis::Data));
            const float nan = std::numeric_limits<float>::quiet_NaN();
            std::fill(z.values.begin(), z.values.end(), nan);
            const TrainState st = read_checkpoint(path, r.grid->mpi_world(), smc.file_registry(),
                                                  targets(z.values.data(), z.m.data(), z.v.data(), smc.describe(z.shard())));
            EXPECT_EQ(st.step, 3);
            // Each rank's rows of its pieces; the rest of the registry stays NaN.
            std::vector<float> got(size_t(r.reg->flat_numel()), 0.0f);
            for (int id = 0; id < r.reg->size(); ++id) {
              const ParamInfo& p = r.reg->info(id);
              for (int64_t i = 0; i < z.rows[size_t(id)].elems(); ++i) {
                const int64_t local = z.rows[size_t(id)].elem_begin() + i;
                const float want = expected(p.name, global_index(p, local), 0);
                ASSERT_EQ(z.values[size_t(z.at[size_t(id)] + i)], want) << p.name << " local " << local;
                ASSERT_EQ(z.v[size_t(z.at[size_t(id)] + i)], expected(p.name, global_index(p, local), 2)) << p.name;
              }
            }
          } else {
            const TrainState st = read_checkpoint(path, r.grid->mpi_world(), smc.file_registry(),
                                                  targets(r.values(), r.m.data(), r.v.data(), smc.describe_registry()));
            EXPECT_EQ(st.step, 3);
            EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0);
            EXPECT_EQ(check(*r.reg, r.m.data(), 1, "exp_avg"), 0);
            EXPECT_EQ(check(*r.reg, r.v.data(), 2, "exp_avg_sq"), 0);
          }
        }
      }
      // The plain path reads it as a whole model on every rank.
      std::vector<float> wm(size_t(whole->flat_numel())), wv(wm.size());
      std::fill(whole->values().data<float>(), whole->values().data<float>() + whole->flat_numel(), -1.0f);
      read_checkpoint(path, MPI_COMM_WORLD, *whole, wm.data(), wv.data());
      EXPECT_EQ(check(*whole, whole->values().data<float>(), 0, "whole weights"), 0);
      EXPECT_EQ(check(*whole, wm.data(), 1, "whole exp_avg"), 0);
      EXPECT_EQ(check(*whole, wv.data(), 2, "whole exp_avg_sq"), 0);
    }
  }
}

// The checksum of a tensor written in pieces (dim-1 pieces: one run per row, from every tensor
// rank in turn) is the checksum of the tensor written whole by one process.
TEST(ShardedModelCheckpoint, PiecesGiveTheWholeTensorsChecksums) {
  TempDir dir;
  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  std::vector<float> wm(size_t(whole->flat_numel())), wv(wm.size());
  fill(*whole, whole->values().data<float>(), 0);
  fill(*whole, wm.data(), 1);
  fill(*whole, wv.data(), 2);
  const std::string plain = dir.path("plain.h5");
  if (world_rank() == 0) {
    write_checkpoint(plain, MPI_COMM_SELF, *whole, buffers(whole->values().data<float>(), wm.data(), wv.data()),
                     state_at(2));
  }
  Layout w(world_size());
  w.fill_state();
  ShardedModelCheckpoint smc(*w.reg, *w.grid);
  const std::string pieces = dir.path("pieces.h5");
  write_checkpoint(pieces, w.grid->mpi_world(), smc.file_registry(),
                   buffers(w.values(), w.m.data(), w.v.data(), smc.describe_registry()), state_at(2));
  if (world_rank() == 0) {
    const CheckpointInfo a = inspect_checkpoint(plain), b = inspect_checkpoint(pieces);
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
      EXPECT_EQ(a.tensors[i].stored_crc, b.tensors[i].stored_crc) << a.tensors[i].group << "/" << a.tensors[i].name;
      EXPECT_TRUE(b.tensors[i].ok());
    }
  }
  // A file of the plain path resumes tensor-parallel.
  Layout r(world_size());
  r.poison();
  ShardedModelCheckpoint rs(*r.reg, *r.grid);
  MPI_Barrier(MPI_COMM_WORLD);
  read_checkpoint(plain, r.grid->mpi_world(), rs.file_registry(),
                  targets(r.values(), r.m.data(), r.v.data(), rs.describe_registry()));
  EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0);
  EXPECT_EQ(check(*r.reg, r.m.data(), 1, "exp_avg"), 0);
}

// The model alone (no moments), written through CheckpointManager's async snapshot: the
// description travels with the snapshot, and the buffers can change while the writer runs.
TEST(ShardedModelCheckpoint, AsyncSaveOfTheModelAlone) {
  TempDir dir;
  const int tp = std::max(1, world_size() / 2);
  Layout w(tp);
  w.fill_state();
  CheckpointConfig cc;
  cc.dir = dir.path("ckpts");
  cc.async = true;
  CheckpointManager mgr(cc, *w.grid);
  ShardedModelCheckpoint smc(*w.reg, *w.grid);
  const CheckpointBuffers live = buffers(w.values(), nullptr, nullptr, smc.describe_registry());
  // Sized by the global tensors, not by this rank's pieces.
  EXPECT_EQ(mgr.size_on_disk(smc.file_registry(), live, state_at(4)),
            checkpoint_size_bound(*make_registry(0, 1), buffers(nullptr), state_at(4)));
  mgr.save(smc.file_registry(), live, state_at(4));
  std::fill(w.values(), w.values() + w.reg->flat_numel(), -7.0f);  // under the writer
  mgr.wait();
  const std::string path = mgr.path_for(4);
  expect_global_file(path, *make_registry(0, 1), false);
  for (int b : sizes()) {
    Layout r(b);
    r.poison();
    ShardedModelCheckpoint rs(*r.reg, *r.grid);
    read_checkpoint(path, r.grid->mpi_world(), rs.file_registry(), targets(r.values(), nullptr, nullptr, rs.describe_registry()));
    EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0) << "read at tensor " << b;
    // The file has no moments.
    EXPECT_THROW(read_checkpoint(path, r.grid->mpi_world(), rs.file_registry(),
                                 targets(r.values(), r.m.data(), r.v.data(), rs.describe_registry())),
                 Error);
  }
}

// Pieces are never mistaken for whole tensors, and a description must write every element of
// every tensor exactly once: one that leaves some out or has two ranks write them fails alike
// on every rank, naming the tensor, before anything is written.
TEST(ShardedModelCheckpoint, DescriptionsThatDoNotTileAreRefused) {
  TempDir dir;
  ParamRegistry reg;
  ParamOptions o;
  o.placement.kind = Placement::Kind::Shard;
  o.placement.axis = "tensor";
  o.placement.dim = 0;
  o.placement.count = 2;
  o.global_shape = {4, 4};
  reg.add("w", {2, 4}, ParamKind::Linear, 0, o);
  reg.allocate(Device::cpu());
  try {
    write_checkpoint(dir.path("refused.h5"), MPI_COMM_WORLD, reg, buffers(reg.values().data<float>()), state_at(1));
    ADD_FAILURE() << "a piece was written as a whole tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is held as a piece"), std::string::npos) << e.what();
  }

  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  fill(*whole, whole->values().data<float>(), 0);
  const int n = world_size(), me = world_rank();
  // Every rank its row block, but rank 0's starts one row late: row 0 of every tensor is lost.
  auto gap = std::make_shared<ShardedState>(ShardedState::whole(*whole, me, n));
  for (TensorPiece& t : gap->pieces) {
    const RowPiece r = t.written();
    t.offset[0] = r.row_begin;
    t.shape[0] = r.rows;
    t.at += r.elem_begin();
    t.replica = 0;
    t.replicas = 1;
    if (me == 0 && t.shape[0] > 0) t.offset[0] += 1, t.shape[0] -= 1, t.at += r.row_elems;
  }
  try {
    write_checkpoint(dir.path("gap.h5"), MPI_COMM_WORLD, *whole,
                     buffers(whole->values().data<float>(), nullptr, nullptr, gap), state_at(1));
    ADD_FAILURE() << "a description that leaves row 0 out was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no rank holds elements [0, "), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("/model/"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(dir.path("gap.h5")));
  if (n > 1) {
    // Whole tensors on every rank, each claiming to be their only writer.
    auto twice = std::make_shared<ShardedState>(ShardedState::whole(*whole, 0, 1));
    try {
      write_checkpoint(dir.path("twice.h5"), MPI_COMM_WORLD, *whole,
                       buffers(whole->values().data<float>(), nullptr, nullptr, twice), state_at(1));
      ADD_FAILURE() << "a description where every rank writes every element was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("two ranks write element 0 of"), std::string::npos) << e.what();
    }
  }
  // A piece outside its tensor.
  auto outside = std::make_shared<ShardedState>(ShardedState::whole(*whole, me, n));
  if (me == n - 1) outside->pieces[0].offset[1] = 1;
  try {
    write_checkpoint(dir.path("outside.h5"), MPI_COMM_WORLD, *whole,
                     buffers(whole->values().data<float>(), nullptr, nullptr, outside), state_at(1));
    ADD_FAILURE() << "a piece outside its tensor was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("lies outside its global shape"), std::string::npos) << e.what();
  }
  // Reading into whole buffers refuses pieces too.
  const std::string good = dir.path("good.h5");
  write_checkpoint(good, MPI_COMM_WORLD, *whole, buffers(whole->values().data<float>()), state_at(1));
  Layout r(world_size());
  if (world_size() > 1) {
    EXPECT_THROW(read_checkpoint(good, MPI_COMM_WORLD, *r.reg, nullptr, nullptr), Error);
  }
}

// piece_runs: a block split along dimension 1 is one run per row; rows cut from it keep their
// places; a block of whole rows is one run.
TEST(ShardedState, RunsOfABlock) {
  TensorPiece t;
  t.offset = {2, 3};
  t.shape = Shape{3, 2};
  const Shape g{6, 8};
  const std::vector<PieceRun> all = piece_runs(t, g, row_piece(t.shape, 0, 1));
  ASSERT_EQ(all.size(), 3u);
  for (int64_t r = 0; r < 3; ++r) {
    EXPECT_EQ(all[size_t(r)].global, (2 + r) * 8 + 3);
    EXPECT_EQ(all[size_t(r)].local, r * 2);
    EXPECT_EQ(all[size_t(r)].elems, 2);
  }
  const std::vector<PieceRun> last = piece_runs(t, g, row_piece(t.shape, 1, 2));  // rows [1, 3)
  ASSERT_EQ(last.size(), 2u);
  EXPECT_EQ(last[0].global, 3 * 8 + 3);
  EXPECT_EQ(last[0].local, 2);
  t.offset = {2, 0};
  t.shape = Shape{3, 8};
  const std::vector<PieceRun> rows = piece_runs(t, g, row_piece(t.shape, 1, 2));
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].global, 3 * 8);
  EXPECT_EQ(rows[0].local, 8);
  EXPECT_EQ(rows[0].elems, 16);
  // Three dimensions, split along the last: one run per (i, j).
  t.offset = {0, 1, 2};
  t.shape = Shape{2, 2, 3};
  const std::vector<PieceRun> cube = piece_runs(t, Shape{2, 4, 5}, row_piece(t.shape, 0, 1));
  ASSERT_EQ(cube.size(), 4u);
  EXPECT_EQ(cube[3].global, 1 * 20 + 2 * 5 + 2);
  EXPECT_EQ(cube[3].local, 9);
}

// ---- Hugging Face weights --------------------------------------------------------------

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Rank 0: the two directories hold the same files with the same tensors, byte for byte.
void expect_same_hf(const std::string& a, const std::string& b) {
  if (world_rank() != 0) return;
  std::vector<std::string> fa, fb;
  for (const auto& e : fs::directory_iterator(a)) fa.push_back(e.path().filename().string());
  for (const auto& e : fs::directory_iterator(b)) fb.push_back(e.path().filename().string());
  std::sort(fa.begin(), fa.end());
  std::sort(fb.begin(), fb.end());
  EXPECT_EQ(fa, fb);
  for (const std::string& f : fa) {
    if (f.ends_with(".json")) {
      EXPECT_EQ(read_text(fs::path(a) / f), read_text(fs::path(b) / f)) << f;
    }
  }
  const HFWeights wa(a), wb(b);
  ASSERT_EQ(wa.names(), wb.names());
  for (const std::string& n : wa.names()) {
    EXPECT_EQ(fs::path(wa.file_of(n)).filename(), fs::path(wb.file_of(n)).filename()) << n;
    EXPECT_EQ(wa.dtype(n), wb.dtype(n)) << n;
    EXPECT_EQ(wa.shape(n), wb.shape(n)) << n;
    const auto ra = wa.raw(n), rb = wb.raw(n);
    ASSERT_EQ(ra.size(), rb.size()) << n;
    EXPECT_EQ(0, std::memcmp(ra.data(), rb.data(), ra.size())) << n << " differs";
  }
}

TEST(TensorParallelHF, ExportEqualsTheWholeModelsAndImportFillsThePieces) {
  TempDir dir;
  const json config = {{"architectures", {"LlamaForCausalLM"}}, {"hidden_size", C}, {"torch_dtype", "float32"}};
  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  fill(*whole, whole->values().data<float>(), 0);
  // One file in fp32; bf16 in shards of at most 150 bytes (several tensors per shard, and
  // tensors larger than a shard in shards of their own).
  const std::pair<DType, int64_t> saves[] = {{DType::F32, int64_t(5) << 30}, {DType::BF16, 150}};
  for (const auto& [dtype, shard] : saves) {
    const std::string suffix = std::string(dtype_name(dtype)) + "_" + std::to_string(shard);
    const std::string ref = dir.path("whole_" + suffix);
    if (world_rank() == 0) save_hf_weights(ref, *whole, config, shard, dtype);
    MPI_Barrier(MPI_COMM_WORLD);
    for (int tp : sizes()) {
      SCOPED_TRACE("tensor " + std::to_string(tp) + ", " + suffix);
      Layout lay(tp);
      lay.fill_state();
      const std::string out = dir.path("tp" + std::to_string(tp) + "_" + suffix);
      // Every rank writes its rows of its pieces; nobody assembles a tensor.
      ShardedModelCheckpoint smc(*lay.reg, *lay.grid);
      save_hf_weights(out, smc.file_registry(), *smc.describe_registry(), lay.values(), config, shard, dtype,
                      &lay.grid->world());
      MPI_Barrier(MPI_COMM_WORLD);
      expect_same_hf(ref, out);
    }
  }
  // Importing: every rank of every layout its own pieces.
  const std::string ref = dir.path("whole_" + std::string(dtype_name(DType::F32)) + "_" + std::to_string(int64_t(5) << 30));
  for (int tp : sizes()) {
    Layout lay(tp);
    lay.poison();
    const HFLoadStats stats = load_hf_weights(ref, *lay.reg);
    EXPECT_EQ(stats.loaded, lay.reg->size());
    EXPECT_EQ(check(*lay.reg, lay.values(), 0, "loaded weights at tensor " + std::to_string(tp)), 0);
  }
}

}  // namespace
}  // namespace dstrain
