// Tensor parallelism of the dense blocks over all ranks: a SwiGLU MLP split by columns of its
// intermediate size and grouped-query attention split by heads (column-parallel gate/up and
// q/k/v, row-parallel down and o_proj with an all-reduce) against the unsplit block on every
// rank: the output, the input gradient and each rank's slices of the weight gradients; and a
// dense Transformer over a tensor group (vocabulary-parallel embedding and head) against the whole model, from
// its initial weights to its loss and gradients. On one rank the split is the whole model and
// the results are bitwise the unsplit ones.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "core/philox.h"
#include "model/transformer.h"
#include "run_files.h"

namespace dstrain {
namespace {

ModelConfig config() {
  ModelConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 24;  // 12 or 6 columns per rank at 2 or 4 ranks
  c.num_hidden_layers = 1;
  c.num_attention_heads = 8;  // head dim 4
  c.num_key_value_heads = 4;
  c.vocab_size = 32;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  return c;
}

// One block's registry, stores and Ctx.
struct Rig {
  ParamRegistry reg;
  ActivationStore acts;
  WeightGradStore wgrad;
  Scratch scratch;
  RopeCache rope;
  Ctx ctx;
  explicit Rig(Communicator* tp) {
    ctx.acts = &acts;
    ctx.wgrad = &wgrad;
    ctx.scratch = &scratch;
    ctx.rope = &rope;
    ctx.groups.tp = tp;
  }
};

std::vector<float> host(Tensor t) { return std::vector<float>(t.data<float>(), t.data<float>() + t.numel()); }

// Columns [c0, c0 + width) of every row of t (R, cols).
std::vector<float> columns(Tensor t, int64_t c0, int64_t width) {
  std::vector<float> out;
  const int64_t R = t.size(0), cols = t.size(1);
  for (int64_t r = 0; r < R; ++r) {
    const float* row = t.data<float>() + r * cols + c0;
    out.insert(out.end(), row, row + width);
  }
  return out;
}

// The pieces' partial sums are added over the ranks in the all-reduce, not inside one GEMM:
// fp32 rounding of a different summation order, nothing more. One rank: bitwise.
void expect_close(const std::vector<float>& a, const std::vector<float>& b, int ranks, const std::string& what) {
  if (ranks == 1) {
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what << ": not bitwise equal";
  } else {
    EXPECT_LT(rel_error(a, b), 1e-5) << what;
  }
}

std::vector<float> normal(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

Tensor f32(std::vector<float>& v, Shape s) { return Tensor(v.data(), DType::F32, s); }

// Every weight of the whole block from its Philox stream, then each rank's piece copied out of it:
// rows [r0, r0 + n) of a column-parallel weight, columns of a row-parallel one.
void init_whole(ParamRegistry& reg) {
  for (int id = 0; id < reg.size(); ++id) {
    ops::fill_normal(reg.param(id), 0.3, 7, stream_id(reg.info(id).name), 0);
  }
}
void copy_rows(Tensor dst, Tensor src, int64_t r0) { ops::copy(dst, src.slice(r0, r0 + dst.size(0))); }
void copy_columns(Tensor dst, Tensor src, int64_t c0) { ops::copy_blocks(dst, 0, 0, src, c0, 0, 1, dst.size(1), false); }

class TensorParallel : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "tensor");
    rank = comm->rank();
    ranks = comm->size();
    c = config();
    shard = ShardSpec::tensor_parallel(c, rank, ranks);
  }
  std::unique_ptr<MpiCommunicator> comm;
  int rank = 0, ranks = 1;
  ModelConfig c;
  ShardSpec shard;
  const int64_t B = 2, T = 9;
};

TEST_F(TensorParallel, SwiGLUSplitByColumnsMatchesTheWholeMLP) {
  const int64_t C = c.hidden_size, I = c.intermediate_size, N = B * T, Il = shard.ffn.size();
  Rig whole(nullptr), piece(comm.get());
  SwiGLUMLP ref(c, ShardSpec::whole(c), whole.reg, 0);
  SwiGLUMLP mlp(c, shard, piece.reg, 0);
  whole.reg.allocate(Device::cpu());
  piece.reg.allocate(Device::cpu());
  init_whole(whole.reg);
  auto id = [](const ParamRegistry& r, const char* rest) { return r.find(layer_name(0, rest)); };
  for (const char* w : {"mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
    copy_rows(piece.reg.param(id(piece.reg, w)), whole.reg.param(id(whole.reg, w)), shard.ffn.begin);
  }
  copy_columns(piece.reg.param(id(piece.reg, "mlp.down_proj.weight")),
               whole.reg.param(id(whole.reg, "mlp.down_proj.weight")), shard.ffn.begin);

  std::vector<float> x = normal(size_t(N * C), 1), base = normal(size_t(N * C), 2), dout = normal(size_t(N * C), 3);
  std::vector<float> out_ref = base, out = base, dx_ref(size_t(N * C)), dx(size_t(N * C), 9.0f);
  ref.forward(whole.ctx, 0, f32(x, {B, T, C}), f32(out_ref, {B, T, C}));
  mlp.forward(piece.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  expect_close(out, out_ref, ranks, "output (added to the residual)");
  ref.backward(whole.ctx, 0, f32(x, {B, T, C}), f32(dout, {B, T, C}), f32(dx_ref, {B, T, C}));
  mlp.backward(piece.ctx, 0, f32(x, {B, T, C}), f32(dout, {B, T, C}), f32(dx, {B, T, C}));
  expect_close(dx, dx_ref, ranks, "input gradient");

  // Each rank's weight gradients are its slices of the whole MLP's.
  for (const char* w : {"mlp.gate_proj.weight", "mlp.up_proj.weight"}) {
    Tensor g = whole.reg.grad(id(whole.reg, w));
    expect_close(host(piece.reg.grad(id(piece.reg, w))),
                 host(g.slice(shard.ffn.begin, shard.ffn.end)), ranks, std::string(w) + " gradient rows");
  }
  expect_close(host(piece.reg.grad(id(piece.reg, "mlp.down_proj.weight"))),
               columns(whole.reg.grad(id(whole.reg, "mlp.down_proj.weight")), shard.ffn.begin, Il), ranks,
               "down_proj gradient columns");
  EXPECT_EQ(Il * ranks, I);
}

TEST_F(TensorParallel, GQASplitByHeadsMatchesTheWholeAttention) {
  const int64_t C = c.hidden_size, N = B * T, D = c.head_dim();
  Rig whole(nullptr), piece(comm.get());
  GQAttention ref(c, ShardSpec::whole(c), whole.reg, 0);
  GQAttention attn(c, shard, piece.reg, 0);
  whole.reg.allocate(Device::cpu());
  piece.reg.allocate(Device::cpu());
  init_whole(whole.reg);
  whole.rope.ensure(T, c);
  piece.rope.ensure(T, c);
  auto id = [](const ParamRegistry& r, const char* rest) { return r.find(layer_name(0, rest)); };
  // Query heads [h0, h1) read key/value heads [h0, h1) / (H / Hkv): this rank's kv heads.
  copy_rows(piece.reg.param(id(piece.reg, "self_attn.q_proj.weight")),
            whole.reg.param(id(whole.reg, "self_attn.q_proj.weight")), shard.heads.begin * D);
  for (const char* w : {"self_attn.k_proj.weight", "self_attn.v_proj.weight"}) {
    copy_rows(piece.reg.param(id(piece.reg, w)), whole.reg.param(id(whole.reg, w)), shard.kv_heads.begin * D);
  }
  copy_columns(piece.reg.param(id(piece.reg, "self_attn.o_proj.weight")),
               whole.reg.param(id(whole.reg, "self_attn.o_proj.weight")), shard.heads.begin * D);

  std::vector<float> x = normal(size_t(N * C), 4), base = normal(size_t(N * C), 5), dout = normal(size_t(N * C), 6);
  std::vector<float> out_ref = base, out = base, dx_ref(size_t(N * C)), dx(size_t(N * C), 9.0f);
  ref.forward(whole.ctx, 0, f32(x, {B, T, C}), f32(out_ref, {B, T, C}));
  attn.forward(piece.ctx, 0, f32(x, {B, T, C}), f32(out, {B, T, C}));
  expect_close(out, out_ref, ranks, "output (added to the residual)");
  ref.backward(whole.ctx, 0, f32(x, {B, T, C}), f32(dout, {B, T, C}), f32(dx_ref, {B, T, C}));
  attn.backward(piece.ctx, 0, f32(x, {B, T, C}), f32(dout, {B, T, C}), f32(dx, {B, T, C}));
  expect_close(dx, dx_ref, ranks, "input gradient");

  expect_close(host(piece.reg.grad(id(piece.reg, "self_attn.q_proj.weight"))),
               host(whole.reg.grad(id(whole.reg, "self_attn.q_proj.weight"))
                        .slice(shard.heads.begin * D, shard.heads.end * D)),
               ranks, "q_proj gradient rows");
  for (const char* w : {"self_attn.k_proj.weight", "self_attn.v_proj.weight"}) {
    expect_close(host(piece.reg.grad(id(piece.reg, w))),
                 host(whole.reg.grad(id(whole.reg, w)).slice(shard.kv_heads.begin * D, shard.kv_heads.end * D)),
                 ranks, std::string(w) + " gradient rows");
  }
  expect_close(host(piece.reg.grad(id(piece.reg, "self_attn.o_proj.weight"))),
               columns(whole.reg.grad(id(whole.reg, "self_attn.o_proj.weight")), shard.heads.begin * D,
                       shard.heads.size() * D),
               ranks, "o_proj gradient columns");
}

// This rank's piece of a global tensor, as its placement says.
std::vector<float> piece_of(Tensor global, const ParamInfo& p) {
  if (p.placement.kind == Placement::Kind::Whole) return host(global);
  const int64_t rows = p.shape[0], cols = p.shape[1];
  if (p.placement.dim == 0) return host(global.slice(p.placement.index * rows, (p.placement.index + 1) * rows));
  return columns(global, p.placement.index * cols, cols);
}

TEST_F(TensorParallel, DenseTransformerMatchesTheWholeModel) {
  c.num_hidden_layers = 2;
  const ShardSpec s = ShardSpec::tensor_parallel(c, rank, ranks);
  Transformer whole(c, Device::cpu());
  ProcessGroups groups;
  groups.tp = comm.get();
  Transformer tp(c, Device::cpu(), s, groups);
  whole.init_weights(11);
  tp.init_weights(11);
  ASSERT_EQ(whole.params().size(), tp.params().size());
  // A sharded model starts from the slices of the whole one's weights.
  for (int id = 0; id < tp.params().size(); ++id) {
    const ParamInfo& p = tp.params().info(id);
    ASSERT_EQ(p.name, whole.params().info(id).name);
    const std::vector<float> mine = host(tp.params().param(id)), expect = piece_of(whole.params().param(id), p);
    EXPECT_EQ(0, std::memcmp(mine.data(), expect.data(), mine.size() * sizeof(float))) << p.name << " initial values";
  }

  std::mt19937 rng(3);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  const Tensor tok(tokens.data(), DType::I32, Shape{B, T}), tgt(targets.data(), DType::I32, Shape{B, T});
  const LossSums a = whole.forward_backward(tok, tgt, float(1.0 / double(B * T)));
  const LossSums b = tp.forward_backward(tok, tgt, float(1.0 / double(B * T)));
  EXPECT_EQ(a.count, b.count);
  expect_close({float(b.sum)}, {float(a.sum)}, ranks, "loss");
  for (int id = 0; id < tp.params().size(); ++id) {
    const ParamInfo& p = tp.params().info(id);
    expect_close(host(tp.params().grad(id)), piece_of(whole.params().grad(id), p), ranks, p.name + " gradient");
  }
}

// In bf16 (16-bit projections and their gradients, fp32 residual): a column-parallel input
// gradient is summed over the group in fp32 (MPI reduces fp32 only) and rounded once, so the
// split model follows the whole one up to bf16 roundings of a different fp32 summation order.
// One rank: bitwise.
TEST_F(TensorParallel, DenseTransformerInBf16MatchesTheWholeModel) {
  c.num_hidden_layers = 2;
  const ShardSpec s = ShardSpec::tensor_parallel(c, rank, ranks);
  Transformer whole(c, Device::cpu());
  ProcessGroups groups;
  groups.tp = comm.get();
  Transformer tp(c, Device::cpu(), s, groups);
  for (Transformer* m : {&whole, &tp}) {
    m->init_weights(11);
    m->set_compute_dtype(DType::BF16);
  }
  std::mt19937 rng(3);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  const Tensor tok(tokens.data(), DType::I32, Shape{B, T}), tgt(targets.data(), DType::I32, Shape{B, T});
  const LossSums a = whole.forward_backward(tok, tgt, float(1.0 / double(B * T)));
  const LossSums b = tp.forward_backward(tok, tgt, float(1.0 / double(B * T)));
  EXPECT_EQ(a.count, b.count);
  EXPECT_NEAR(b.sum, a.sum, 1e-3 * std::fabs(a.sum));
  for (int id = 0; id < tp.params().size(); ++id) {
    const ParamInfo& p = tp.params().info(id);
    const std::vector<float> got = host(tp.params().grad(id)), want = piece_of(whole.params().grad(id), p);
    if (ranks == 1) {
      EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float))) << p.name << ": not bitwise";
      continue;
    }
    double dot = 0, ng = 0, nw = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      dot += double(got[i]) * want[i];
      ng += double(got[i]) * got[i];
      nw += double(want[i]) * want[i];
    }
    EXPECT_GT(dot / std::sqrt(ng * nw), 0.9999) << p.name << " gradient";
  }
}

}  // namespace
}  // namespace dstrain

namespace dstrain {
namespace {

// The DeepSeek-V2 and V3 models of the MPI tests (MLA, MoE with shared experts, V3's q LoRA,
// YaRN, sigmoid routing and MTP) over the tensor group, sequence parallelism off and on,
// against the whole model on every rank: the loss terms and every gradient (the partial ones
// summed over the group, as the trainer does once per step).
class DeepSeekTensorParallel : public ::testing::TestWithParam<std::tuple<std::string, bool>> {};

TEST_P(DeepSeekTensorParallel, LossAndEveryGradientMatchTheWholeModel) {
  const auto [name, sp] = GetParam();
  const json model = (name == "v2" ? v2_model() : v3_model())["model"];
  const ModelConfig c = ModelConfig::from_hf_json(model, name);
  MpiCommunicator comm(MPI_COMM_WORLD, "tensor");
  const int rank = comm.rank(), ranks = comm.size();
  Transformer whole(c, Device::cpu());
  ProcessGroups groups;
  groups.tp = &comm;
  Transformer tp(c, Device::cpu(), ShardSpec::tensor_parallel(c, rank, ranks, 0, 1, sp), groups);
  whole.init_weights(5);
  tp.init_weights(5);
  const int64_t B = 2, T = 16, D = c.num_nextn_predict_layers;
  std::mt19937 rng(9);
  std::vector<int32_t> tokens(size_t(B * T)), targets(size_t(B * T));
  for (auto& t : tokens) t = int32_t(rng() % uint32_t(c.vocab_size));
  for (auto& t : targets) t = int32_t(rng() % uint32_t(c.vocab_size));
  targets[3] = ops::kIgnoreIndex;
  const Tensor tok(tokens.data(), DType::I32, Shape{B, T}), tgt(targets.data(), DType::I32, Shape{B, T});
  LossScales scales;
  scales.token = 1.0f / float(B * T);
  scales.sequence = 1.0 / double(B);
  scales.micro_batch = 1.0;
  for (int64_t k = 0; k < D; ++k) scales.mtp_token.push_back(0.3f / float(B * T));
  const LossSums a = whole.forward(0, tok, tgt, scales);
  whole.backward(0);
  const LossSums b = tp.forward(0, tok, tgt, scales);
  tp.backward(0);
  EXPECT_NEAR(b.sum, a.sum, 1e-5 * std::fabs(a.sum));
  for (size_t k = 0; k < a.mtp_sum.size(); ++k) EXPECT_NEAR(b.mtp_sum[k], a.mtp_sum[k], 1e-5 * std::fabs(a.mtp_sum[k]));
  double worst = 0;
  for (int id = 0; id < tp.params().size(); ++id) {
    const ParamInfo& p = tp.params().info(id);
    ASSERT_EQ(p.name, whole.params().info(id).name);
    if (!p.trainable) continue;
    std::vector<float> got = host(tp.params().grad(id));
    if (p.tp_partial_grad) comm.all_reduce(Tensor(got.data(), DType::F32, Shape{int64_t(got.size())}));
    if (p.placement.kind == Placement::Kind::Shard && p.placement.count < ranks) {
      ADD_FAILURE() << p.name << ": replicated piece in a model with as many heads as ranks";
    }
    const std::vector<float> want = piece_of(whole.params().grad(id), p);
    const double e = rel_error(got, want);
    EXPECT_LT(e, 2e-5) << name << (sp ? " sequence-parallel: " : ": ") << p.name << " gradient";
    worst = std::max(worst, e);
  }
  if (rank == 0) std::printf("[ %d ranks ] %s%s: worst gradient error %.2e\n", ranks, name.c_str(), sp ? " SP" : "", worst);
  // Inference (evaluation, generation): the whole vocabulary's logits, gathered; with sequence
  // parallelism also for row counts that do not split over the group (7 rows).
  for (int64_t rows : {int64_t(7), int64_t(8)}) {
    const int64_t V = c.vocab_size;
    const Tensor t(tokens.data(), DType::I32, Shape{1, rows});
    std::vector<float> lw(static_cast<size_t>(rows * V)), lt(lw.size()), last_w(static_cast<size_t>(V)), last_t(last_w.size());
    whole.forward_logits(t, Tensor(lw.data(), DType::F32, Shape{1, rows, V}));
    tp.forward_logits(t, Tensor(lt.data(), DType::F32, Shape{1, rows, V}));
    EXPECT_LT(rel_error(lt, lw), 1e-5) << name << ": logits of " << rows << " rows";
    whole.last_logits(t, Tensor(last_w.data(), DType::F32, Shape{1, V}));
    tp.last_logits(t, Tensor(last_t.data(), DType::F32, Shape{1, V}));
    EXPECT_LT(rel_error(last_t, last_w), 1e-5) << name << ": last logits of " << rows << " rows";
    const LossSums ew = whole.forward_loss(t, Tensor(targets.data(), DType::I32, Shape{1, rows}));
    const LossSums et = tp.forward_loss(t, Tensor(targets.data(), DType::I32, Shape{1, rows}));
    EXPECT_NEAR(et.sum, ew.sum, 1e-5 * std::fabs(ew.sum)) << name << ": evaluation loss of " << rows << " rows";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, DeepSeekTensorParallel,
                         ::testing::Combine(::testing::Values("v2", "v3"), ::testing::Bool()));

}  // namespace
}  // namespace dstrain
