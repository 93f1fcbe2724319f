// Tensor (and sequence) parallelism of the DeepSeek-V2/V3 blocks over all ranks, against the
// unsplit block on every rank: Multi-head Latent Attention split by heads (column-parallel
// q_proj / q_b_proj and kv_b_proj, row-parallel o_proj, replicated down-projections with
// partial gradients) and DeepSeekMoE (replicated router, whole routed experts, shared experts
// split by columns). Each case runs without and with sequence parallelism and compares this
// rank's rows of the output and input gradient, every weight gradient (the local piece's slice
// of the whole block's; a partial one summed over the group), and for MoE the routing, the
// auxiliary loss and the expert loads. fp32: 1e-5 relative (another summation order); one
// rank: bitwise. bf16: bitwise at one rank, close otherwise.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "core/philox.h"
#include "model/mla.h"
#include "model/moe.h"

namespace dstrain {
namespace {

constexpr int64_t kB = 3, kT = 8;  // N = 24 rows: at 2 and 4 ranks some rank's rows straddle two sequences

// Relative to the largest reference element. fp32: measured at most 8.3e-7 (the router's
// gradient summed over 4 ranks). bf16: the pieces round their own fp32 sums once, so an element
// may differ by a bf16 rounding step (2^-7 of the largest: measured 8.0e-3).
constexpr double kF32Tol = 1e-5, kBf16Tol = 2e-2;

ModelConfig mla_config(bool q_lora) {
  ModelConfig c;
  c.model_type = "deepseek_v2";
  c.hidden_size = 16;
  c.intermediate_size = 32;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;  // 2 or 1 per rank at 2 or 4 ranks
  c.num_key_value_heads = 4;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 8;
  c.v_head_dim = 6;
  c.kv_lora_rank = 8;
  c.q_lora_rank = q_lora ? 12 : 0;
  c.vocab_size = 32;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000;
  c.max_position_embeddings = 512;
  c.rope_scaling.type = "yarn";
  c.rope_scaling.factor = 4;
  c.rope_scaling.original_max_position_embeddings = 4096;
  c.rope_scaling.beta_fast = 32;
  c.rope_scaling.beta_slow = 1;
  c.rope_scaling.mscale = 1.0;
  c.rope_scaling.mscale_all_dim = 0.8;
  return c;
}

// DeepSeek-V2: softmax scores, greedy or group-limited top-k, a sequence-wise aux loss, two
// shared experts (fused width 12: 6 or 3 columns per rank).
ModelConfig moe_v2_config(const std::string& method) {
  ModelConfig c = mla_config(false);
  c.n_routed_experts = 8;
  c.n_shared_experts = 2;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.scoring_func = "softmax";
  c.topk_method = method;
  c.n_group = method == "greedy" ? 1 : 4;
  c.topk_group = method == "greedy" ? 1 : 2;
  c.routed_scaling_factor = 1.0;
  c.aux_loss_alpha = 0.3;  // large, so the aux gradient is visible next to the main one
  c.seq_aux = true;
  return c;
}

// DeepSeek-V3: sigmoid scores, noaux_tc with a routing bias, normalised top-k weights scaled
// by 2.5, one shared expert of width 8, and a sequence-wise aux loss on top.
ModelConfig moe_v3_config() {
  ModelConfig c = mla_config(true);
  c.model_type = "deepseek_v3";
  c.n_routed_experts = 8;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 8;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.n_group = 4;
  c.topk_group = 2;
  c.norm_topk_prob = true;
  c.routed_scaling_factor = 2.5;
  c.aux_loss_alpha = 0.3;
  c.seq_aux = true;
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
  Rig(Communicator* tp, bool sequence_parallel) {
    ctx.acts = &acts;
    ctx.wgrad = &wgrad;
    ctx.scratch = &scratch;
    ctx.rope = &rope;
    ctx.groups.tp = tp;
    ctx.sequence_parallel = sequence_parallel;
  }
};

std::vector<float> host(Tensor t) {
  std::vector<float> v(size_t(t.numel()));
  ops::cast(Tensor(v.data(), DType::F32, t.shape()), t);
  return v;
}

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

// This rank's piece of a global tensor, as its placement says.
std::vector<float> piece_of(Tensor global, const ParamInfo& p) {
  if (p.placement.kind == Placement::Kind::Whole) return host(global);
  const int64_t rows = p.shape[0], cols = p.shape[1];
  if (p.placement.dim == 0) return host(global.slice(p.placement.index * rows, (p.placement.index + 1) * rows));
  return columns(global, p.placement.index * cols, cols);
}

// Largest |a - b| relative to the largest |b|.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff = std::max(diff, std::fabs(double(a[i]) - double(b[i])));
    scale = std::max(scale, std::fabs(double(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

void expect_close(const std::vector<float>& a, const std::vector<float>& b, int ranks, double tol,
                  const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  if (ranks == 1) {
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what << ": not bitwise equal";
  } else {
    EXPECT_LT(rel_error(a, b), tol) << what;
  }
}

std::vector<float> normal(size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Rows [r0, r1) of a (rows, C) host array.
std::vector<float> rows_of(const std::vector<float>& v, int64_t C, Range r) {
  return std::vector<float>(v.begin() + r.begin * C, v.begin() + r.end * C);
}

// The whole block's weights from (seed, name): the router with a wide spread (so that a
// rounding does not flip a choice), norms about 1, a nonzero routing bias.
void init_whole(ParamRegistry& reg) {
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    Tensor w = reg.param(id);
    float* v = w.data<float>();
    if (p.kind == ParamKind::RouterBias) {
      for (int64_t e = 0; e < p.numel(); ++e) v[e] = 0.15f * float(std::sin(3.0 * double(e) + 1.0));
      continue;
    }
    const bool router = p.name.find("mlp.gate.weight") != std::string::npos;
    ops::fill_normal(w, router ? 1.0 : 0.3, 7, stream_id(p.name), 0);
    if (p.kind == ParamKind::Norm) {
      for (int64_t i = 0; i < p.numel(); ++i) v[i] = 1.0f + v[i];
    }
  }
}

// Each of the split block's parameters is its piece of the whole block's, by its placement.
void copy_pieces(ParamRegistry& piece, const ParamRegistry& whole) {
  ASSERT_EQ(piece.size(), whole.size());
  for (int id = 0; id < piece.size(); ++id) {
    const ParamInfo& p = piece.info(id);
    ASSERT_EQ(p.name, whole.info(id).name);
    EXPECT_TRUE(p.global_shape == whole.info(id).shape)
        << p.name << ": global shape " << p.global_shape.str() << ", whole " << whole.info(id).shape.str();
    const std::vector<float> v = piece_of(whole.param(id), p);
    ASSERT_EQ(int64_t(v.size()), p.numel()) << p.name;
    std::copy(v.begin(), v.end(), piece.param(id).data<float>());
  }
}

// One block, whole or split, with its inputs: x (B,T,C) all rows in the compute dtype, out
// (this rank's rows, fp32) starting from `base`, dout (the same rows, fp32), dx (the same rows,
// compute dtype) filled with garbage: the backward must overwrite it.
struct Run {
  Buffer x, out, dout, dx;
  Range rows;
  Run(const Ctx& ctx, const std::vector<float>& xs, const std::vector<float>& base, const std::vector<float>& douts,
      int64_t C) {
    const int64_t N = int64_t(xs.size()) / C;
    rows = ctx.token_rows(N);
    const int64_t n = rows.size();
    const DType cd = ctx.compute_dtype;
    x = Buffer("x", MemCategory::Workspace, cd, N * C);
    out = Buffer("out", MemCategory::Workspace, DType::F32, n * C);
    dout = Buffer("dout", MemCategory::Workspace, DType::F32, n * C);
    dx = Buffer("dx", MemCategory::Workspace, cd, n * C);
    std::vector<float> xv = xs, ov = rows_of(base, C, rows), dv = rows_of(douts, C, rows);
    ops::cast(x.tensor(), Tensor(xv.data(), DType::F32, Shape{N * C}));
    ops::copy(out.tensor(), Tensor(ov.data(), DType::F32, Shape{n * C}));
    ops::copy(dout.tensor(), Tensor(dv.data(), DType::F32, Shape{n * C}));
    ops::fill(dx.tensor(), 9.0f);
  }
  Tensor xt(int64_t B, int64_t T, int64_t C) const { return x.tensor(0, {B, T, C}); }
  // (B,T,C) without sequence parallelism, as the dense layers get them; (n,C) with it.
  Tensor rows_t(const Buffer& b, int64_t B, int64_t T, int64_t C, int64_t N) const {
    return rows.size() == N ? b.tensor(0, {B, T, C}) : b.tensor(0, {rows.size(), C});
  }
  template <class Block>
  void forward(Block& blk, const Ctx& ctx, int64_t B, int64_t T, int64_t C) {
    blk.forward(ctx, 0, xt(B, T, C), rows_t(out, B, T, C, B * T));
  }
  template <class Block>
  void backward(Block& blk, const Ctx& ctx, int64_t B, int64_t T, int64_t C) {
    blk.backward(ctx, 0, xt(B, T, C), rows_t(dout, B, T, C, B * T), rows_t(dx, B, T, C, B * T));
  }
};

// Every gradient of the split block against the whole block's: the piece's slice, or for a
// replicated parameter whose gradient is partial (tp_partial_grad, and under sequence
// parallelism every replicated one, which the model marks) the sum over the tensor group.
void expect_gradients(const ParamRegistry& piece, const ParamRegistry& whole, MpiCommunicator& comm, bool sp,
                      double tol) {
  for (int id = 0; id < piece.size(); ++id) {
    const ParamInfo& p = piece.info(id);
    std::vector<float> got = host(piece.grad(id));
    const bool partial = p.tp_partial_grad || (sp && p.placement.kind == Placement::Kind::Whole);
    if (partial && comm.size() > 1) comm.all_reduce(Tensor(got.data(), DType::F32, Shape{int64_t(got.size())}));
    expect_close(got, piece_of(whole.grad(id), p), comm.size(), tol,
                 p.name + (partial ? " gradient (summed over the tensor group)" : " gradient"));
  }
}

struct Param {
  bool sp;
  bool bf16;
};
void PrintTo(const Param& p, std::ostream* os) {
  *os << (p.sp ? "sequence parallel" : "tensor parallel") << (p.bf16 ? ", bf16" : ", fp32");
}
std::string param_name(const ::testing::TestParamInfo<Param>& i) {
  return std::string(i.param.sp ? "SequenceParallel" : "TensorParallel") + (i.param.bf16 ? "Bf16" : "F32");
}

class TpBlocks : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "tensor"); }
  std::unique_ptr<MpiCommunicator> comm;
};

// Both rigs in the case's compute dtype (bf16 compute copies of the weights just set).
void set_dtype(Rig& whole, Rig& piece, const Param& param) {
  if (!param.bf16) return;
  for (Rig* r : {&whole, &piece}) {
    r->reg.allocate_compute(DType::BF16);
    r->ctx.compute_dtype = DType::BF16;
  }
}

// ---- Multi-head Latent Attention ---------------------------------------------------------
void mla_case(MpiCommunicator& comm, bool q_lora, const Param& param) {
  const bool sp = param.sp;
  const double tol = param.bf16 ? kBf16Tol : kF32Tol;
  const ModelConfig c = mla_config(q_lora);
  const int ranks = comm.size(), rank = comm.rank();
  const int64_t C = c.hidden_size, N = kB * kT;
  const ShardSpec shard = ShardSpec::tensor_parallel(c, rank, ranks, 0, 1, sp);
  Rig whole(nullptr, false), piece(&comm, sp);
  MLAttention ref(c, ShardSpec::whole(c), whole.reg, 0);
  MLAttention attn(c, shard, piece.reg, 0);
  whole.reg.allocate(Device::cpu());
  piece.reg.allocate(Device::cpu());
  init_whole(whole.reg);
  copy_pieces(piece.reg, whole.reg);
  set_dtype(whole, piece, param);
  whole.rope.ensure(kT, c);
  piece.rope.ensure(kT, c);

  // The replicated down-projections and latent norms have partial gradients when split.
  const std::set<std::string> latent = {"self_attn.q_a_proj.weight", "self_attn.q_a_layernorm.weight",
                                        "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_layernorm.weight"};
  for (int id = 0; id < piece.reg.size(); ++id) {
    const ParamInfo& p = piece.reg.info(id);
    const bool is_latent = latent.count(p.name.substr(layer_name(0, "").size())) > 0;
    EXPECT_EQ(p.tp_partial_grad, is_latent && ranks > 1) << p.name;
    EXPECT_EQ(p.placement.kind == Placement::Kind::Whole, is_latent || ranks == 1) << p.name;
  }

  const std::vector<float> x = normal(size_t(N * C), 4), base = normal(size_t(N * C), 5),
                           dout = normal(size_t(N * C), 6);
  Run w(whole.ctx, x, base, dout, C), p(piece.ctx, x, base, dout, C);
  w.forward(ref, whole.ctx, kB, kT, C);
  p.forward(attn, piece.ctx, kB, kT, C);
  expect_close(host(p.out.tensor()), rows_of(host(w.out.tensor()), C, p.rows), ranks, tol,
               "output (added to this rank's rows of the residual)");
  w.backward(ref, whole.ctx, kB, kT, C);
  p.backward(attn, piece.ctx, kB, kT, C);
  expect_close(host(p.dx.tensor()), rows_of(host(w.dx.tensor()), C, p.rows), ranks, tol,
               "input gradient (this rank's rows)");
  expect_gradients(piece.reg, whole.reg, comm, sp, tol);
}

TEST_P(TpBlocks, MlaWithoutQueryLoraSplitByHeadsMatchesTheWholeBlock) {
  mla_case(*comm, false, GetParam());
}

TEST_P(TpBlocks, MlaWithQueryLoraSplitByHeadsMatchesTheWholeBlock) {
  mla_case(*comm, true, GetParam());
}

// ---- DeepSeekMoE -------------------------------------------------------------------------
void moe_case(MpiCommunicator& comm, const ModelConfig& c, const Param& param) {
  const bool sp = param.sp;
  const double tol = param.bf16 ? kBf16Tol : kF32Tol;
  const int ranks = comm.size(), rank = comm.rank();
  const int64_t C = c.hidden_size, N = kB * kT, E = c.n_routed_experts, k = c.num_experts_per_tok;
  const ShardSpec shard = ShardSpec::tensor_parallel(c, rank, ranks, 0, 1, sp);
  Rig whole(nullptr, false), piece(&comm, sp);
  MoEBlock ref(c, ShardSpec::whole(c), whole.reg, 0);
  MoEBlock moe(c, shard, piece.reg, 0);
  whole.reg.allocate(Device::cpu());
  piece.reg.allocate(Device::cpu());
  init_whole(whole.reg);
  copy_pieces(piece.reg, whole.reg);
  set_dtype(whole, piece, param);
  LossScales scales;
  scales.sequence = 1.0 / double(kB);
  scales.micro_batch = 1.0;
  ref.set_loss_scales(scales);
  moe.set_loss_scales(scales);

  // Only the shared experts are split; nothing is marked partial by the block itself.
  for (int id = 0; id < piece.reg.size(); ++id) {
    const ParamInfo& p = piece.reg.info(id);
    const bool shared = p.name.find("shared_experts") != std::string::npos;
    EXPECT_EQ(p.placement.kind == Placement::Kind::Whole, !shared || ranks == 1) << p.name;
    EXPECT_FALSE(p.tp_partial_grad) << p.name;
  }

  const std::vector<float> x = normal(size_t(N * C), 7), base = normal(size_t(N * C), 8),
                           dout = normal(size_t(N * C), 9);
  Run w(whole.ctx, x, base, dout, C), p(piece.ctx, x, base, dout, C);
  const int64_t n = p.rows.size();
  w.forward(ref, whole.ctx, kB, kT, C);
  p.forward(moe, piece.ctx, kB, kT, C);
  expect_close(host(p.out.tensor()), rows_of(host(w.out.tensor()), C, p.rows), ranks, tol,
               "output (added to this rank's rows of the residual)");

  // Routing: this rank's rows chose what the whole block chose, and every rank agrees.
  Tensor ids = moe.ids(piece.acts, 0), ids_ref = ref.ids(whole.acts, 0);
  ASSERT_EQ(ids.numel(), n * k);
  const std::vector<int32_t> mine(ids.data<int32_t>(), ids.data<int32_t>() + n * k);
  const std::vector<int32_t> want(ids_ref.data<int32_t>() + p.rows.begin * k, ids_ref.data<int32_t>() + p.rows.end * k);
  EXPECT_EQ(mine, want) << "expert choices of rows [" << p.rows.begin << ", " << p.rows.end << ")";
  std::vector<int32_t> all(size_t(ranks * n * k));
  comm.all_gather(Tensor(all.data(), DType::I32, Shape{int64_t(all.size())}),
                  Tensor(const_cast<int32_t*>(mine.data()), DType::I32, Shape{n * k}));
  for (int r = 0; r < ranks; ++r) {
    const std::vector<int32_t> theirs(all.begin() + r * n * k, all.begin() + (r + 1) * n * k);
    if (sp) {  // rank r routed rows [r n, (r+1) n): together, the whole block's routing
      const std::vector<int32_t> whole_rows(ids_ref.data<int32_t>() + r * n * k,
                                            ids_ref.data<int32_t>() + (r + 1) * n * k);
      EXPECT_EQ(theirs, whole_rows) << "rank " << r << "'s expert choices";
    } else {
      EXPECT_EQ(theirs, mine) << "rank " << r << " routed the same rows differently";
    }
  }
  expect_close(host(moe.weights(piece.acts, 0)),
               rows_of(host(ref.weights(whole.acts, 0)), k, p.rows), ranks, kF32Tol, "routing weights (fp32)");

  // Loads: this rank's rows (summed over the group with sequence parallelism); the aux loss:
  // the whole micro-batch's, the same on every rank.
  RoutingStats* got = moe.routing();
  RoutingStats* expect = ref.routing();
  std::vector<int64_t> load = got->tokens_per_expert;
  if (sp && ranks > 1) comm.all_reduce(Tensor(load.data(), DType::I64, Shape{E}));
  EXPECT_EQ(load, expect->tokens_per_expert) << "tokens per expert";
  EXPECT_GT(expect->aux_loss, 0.0);
  EXPECT_NEAR(got->aux_loss, expect->aux_loss, 1e-6 * expect->aux_loss) << "aux loss";
  const double lo = comm.all_reduce_value(got->aux_loss, ReduceOp::Min);
  const double hi = comm.all_reduce_value(got->aux_loss, ReduceOp::Max);
  EXPECT_EQ(lo, hi) << "the tensor ranks' aux losses differ";

  w.backward(ref, whole.ctx, kB, kT, C);
  p.backward(moe, piece.ctx, kB, kT, C);
  expect_close(host(p.dx.tensor()), rows_of(host(w.dx.tensor()), C, p.rows), ranks, tol,
               "input gradient (this rank's rows)");
  expect_gradients(piece.reg, whole.reg, comm, sp, tol);
}

TEST_P(TpBlocks, MoeV2GreedyMatchesTheWholeBlock) {
  moe_case(*comm, moe_v2_config("greedy"), GetParam());
}

TEST_P(TpBlocks, MoeV2GroupLimitedGreedyMatchesTheWholeBlock) {
  moe_case(*comm, moe_v2_config("group_limited_greedy"), GetParam());
}

TEST_P(TpBlocks, MoeV3NoauxTcMatchesTheWholeBlock) {
  moe_case(*comm, moe_v3_config(), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Split, TpBlocks,
                         ::testing::Values(Param{false, false}, Param{true, false}, Param{false, true},
                                           Param{true, true}),
                         param_name);

}  // namespace
}  // namespace dstrain
