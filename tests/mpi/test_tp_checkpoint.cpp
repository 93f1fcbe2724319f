// Checkpoints and Hugging Face weights of tensor-parallel registries at 1, 2 and 4 ranks, on
// every layout the world allows (tensor = world, and tensor 2 x data 2 at 4 ranks): the global
// tensors gather from the pieces (whole, dim-0 and dim-1 shards, key/value pieces replicated
// over more tensor ranks than there are heads); a checkpoint written at one tensor-parallel
// size reads back at every other (and through the plain whole-model path) with every piece and
// moment in place, and its file holds global tensors that pass their checksums; async saves
// carry the partition; save_hf_weights of a tensor-parallel registry writes the same files as
// the whole registry's, and load_hf_weights fills each rank's pieces.
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

// Whole buffers of the plain path.
CheckpointBuffers whole_buffers(const float* values, const float* exp_avg = nullptr, const float* exp_avg_sq = nullptr) {
  CheckpointBuffers b;
  b.values = values;
  b.exp_avg = exp_avg;
  b.exp_avg_sq = exp_avg_sq;
  return b;
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

// Written at tensor-parallel size a, read at b, for every pair of sizes the world allows:
// every rank's pieces and moments come back exactly, and the file holds the global tensors.
TEST(ShardedModelCheckpoint, RestartsAtEveryTensorParallelSize) {
  TempDir dir;
  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  for (int a : sizes()) {
    const std::string path = dir.path("tp" + std::to_string(a) + ".h5");
    {
      Layout w(a);
      w.fill_state();
      ShardedModelCheckpoint tpc(*w.reg, *w.grid);
      EXPECT_EQ(tpc.io_rank(), w.data0());
      write_checkpoint(path, w.grid->mpi_world(), *w.reg, tpc.stage(w.values(), w.m.data(), w.v.data()), state_at(3));
    }
    expect_global_file(path, *whole, true);
    for (int b : sizes()) {
      SCOPED_TRACE("written at tensor " + std::to_string(a) + ", read at tensor " + std::to_string(b));
      Layout r(b);
      r.poison();  // every value must come from the file: the replicas' by the broadcast
      ShardedModelCheckpoint tpc(*r.reg, *r.grid);
      const TrainState st = read_checkpoint(path, r.grid->mpi_world(), *r.reg, tpc.targets(true));
      EXPECT_EQ(st.step, 3);
      tpc.unstage(r.values(), r.m.data(), r.v.data());
      EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0);
      EXPECT_EQ(check(*r.reg, r.m.data(), 1, "exp_avg"), 0);
      EXPECT_EQ(check(*r.reg, r.v.data(), 2, "exp_avg_sq"), 0);
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

// A file of the plain whole-model path resumes tensor-parallel, and staging at tensor 1 writes
// the same tensors as the plain path (the same checksums).
TEST(ShardedModelCheckpoint, MatchesThePlainPath) {
  TempDir dir;
  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  std::vector<float> wm(size_t(whole->flat_numel())), wv(wm.size());
  fill(*whole, whole->values().data<float>(), 0);
  fill(*whole, wm.data(), 1);
  fill(*whole, wv.data(), 2);
  const std::string plain = dir.path("plain.h5");
  write_checkpoint(plain, MPI_COMM_WORLD, *whole, whole_buffers(whole->values().data<float>(), wm.data(), wv.data()),
                   state_at(2));
  const int tp = world_size();
  Layout r(tp);
  r.poison();
  ShardedModelCheckpoint tpc(*r.reg, *r.grid);
  read_checkpoint(plain, r.grid->mpi_world(), *r.reg, tpc.targets(true));
  tpc.unstage(r.values(), r.m.data(), r.v.data());
  EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0);
  EXPECT_EQ(check(*r.reg, r.m.data(), 1, "exp_avg"), 0);

  Layout one(1);  // tensor 1 x data world
  one.fill_state();
  ShardedModelCheckpoint staged(*one.reg, *one.grid);
  const std::string via_staging = dir.path("staged.h5");
  write_checkpoint(via_staging, one.grid->mpi_world(), *one.reg, staged.stage(one.values(), one.m.data(), one.v.data()),
                   state_at(2));
  if (world_rank() == 0) {
    const CheckpointInfo a = inspect_checkpoint(plain), b = inspect_checkpoint(via_staging);
    ASSERT_EQ(a.tensors.size(), b.tensors.size());
    for (size_t i = 0; i < a.tensors.size(); ++i) {
      EXPECT_EQ(a.tensors[i].name, b.tensors[i].name);
      EXPECT_EQ(a.tensors[i].stored_crc, b.tensors[i].stored_crc) << a.tensors[i].group << "/" << a.tensors[i].name;
      EXPECT_TRUE(b.tensors[i].ok());
    }
  }
}

// The model alone (no moments), written through CheckpointManager's async snapshot: the
// partition travels with the snapshot, and the staging can change while the writer runs. With
// data-parallel replicas (tensor world/2), the partition differs from RowPiece over all ranks.
TEST(ShardedModelCheckpoint, AsyncSaveOfTheModelAlone) {
  TempDir dir;
  const int tp = std::max(1, world_size() / 2);
  Layout w(tp);
  w.fill_state();
  CheckpointConfig cc;
  cc.dir = dir.path("ckpts");
  cc.async = true;
  CheckpointManager mgr(cc, *w.grid);
  ShardedModelCheckpoint tpc(*w.reg, *w.grid);
  const CheckpointBuffers staged = tpc.stage(w.values(), nullptr, nullptr);
  // Sized by the global tensors, not by this rank's pieces.
  CheckpointBuffers whole_pieces;
  whole_pieces.piece_offsets = staged.piece_offsets;
  EXPECT_EQ(mgr.size_on_disk(*w.reg, staged, state_at(4)),
            checkpoint_size_bound(*make_registry(0, 1), whole_pieces, state_at(4)));
  mgr.save(*w.reg, staged, state_at(4));
  std::fill(w.values(), w.values() + w.reg->flat_numel(), -7.0f);
  tpc.stage(w.values(), nullptr, nullptr);  // overwrites the staging under the writer
  mgr.wait();
  const std::string path = mgr.path_for(4);
  expect_global_file(path, *make_registry(0, 1), false);
  for (int b : sizes()) {
    Layout r(b);
    r.poison();
    ShardedModelCheckpoint rt(*r.reg, *r.grid);
    read_checkpoint(path, r.grid->mpi_world(), *r.reg, rt.targets(false));
    rt.unstage(r.values(), nullptr, nullptr);
    EXPECT_EQ(check(*r.reg, r.values(), 0, "weights"), 0) << "read at tensor " << b;
    // The file has no moments to unstage.
    EXPECT_THROW(rt.unstage(r.values(), r.m.data(), r.v.data()), Error);
  }
}

// Pieces are never mistaken for whole tensors, and a partition must tile the rows.
TEST(ShardedModelCheckpoint, PiecesOutsideStagingAreRefused) {
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
    write_checkpoint(dir.path("refused.h5"), MPI_COMM_WORLD, reg, whole_buffers(reg.values().data<float>()),
                     state_at(1));
    ADD_FAILURE() << "a piece was written as a whole tensor";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is not held whole on this rank"), std::string::npos) << e.what();
  }

  const std::unique_ptr<ParamRegistry> whole = make_registry(0, 1);
  CheckpointBuffers bad = whole_buffers(whole->values().data<float>());
  bad.piece_offsets = std::make_shared<const std::vector<int64_t>>(size_t(whole->size()), 0);
  bad.numel = whole->flat_numel();
  bad.partition = [&](int id, int rank) {  // rank 0 starts at row 1
    RowPiece p = row_piece(whole->info(id).global_shape, rank, world_size());
    if (rank == 0) p.row_begin += 1, p.rows -= 1;
    return p;
  };
  try {
    write_checkpoint(dir.path("bad.h5"), MPI_COMM_WORLD, *whole, bad, state_at(1));
    ADD_FAILURE() << "a partition that leaves row 0 out was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("the partition"), std::string::npos) << e.what();
  }
  // Reading into whole buffers refuses pieces too.
  const std::string good = dir.path("good.h5");
  fill(*whole, whole->values().data<float>(), 0);
  write_checkpoint(good, MPI_COMM_WORLD, *whole, whole_buffers(whole->values().data<float>()), state_at(1));
  Layout r(world_size());
  if (world_size() > 1) {
    EXPECT_THROW(read_checkpoint(good, MPI_COMM_WORLD, *r.reg, nullptr, nullptr), Error);
  }
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
      // The data-0 tensor group exports; the replicas take no part.
      if (lay.data0()) save_hf_weights(out, *lay.reg, config, shard, dtype, &lay.grid->comm(Axis::Tensor));
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
