// The argument checks of the ops (checks.h), in ops.def order. Their messages are the ones users
// see for a bad call on any device: they name the op and what does not fit.
#include "backend/checks.h"

#include <cstdint>

#include "core/error.h"

namespace dstrain::ops::checks {
namespace {

// The rows of a tensor read as (rows, last dimension); 0 when the last dimension is empty.
int64_t rows(const Tensor& t) { return t.size(-1) > 0 ? t.numel() / t.size(-1) : 0; }

bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }

void need(const Tensor& t, DType dt, const char* op, const char* what) {
  DS_CHECK(t.dtype() == dt, "{}: {} holds {}, expected {}", op, what, dtype_name(t.dtype()), dtype_name(dt));
}

void check_matrix(const Tensor& t, const char* what) {
  DS_CHECK(t.ndim() >= 2, "{}: expected a matrix, got shape {}", what, t.shape().str());
}

// embedding_forward and its vocabulary shards. The ids themselves are data: the kernels check them.
void gather_rows(const char* op, const Tensor& out, const Tensor& tokens, const Tensor& table, int64_t vocab_begin,
                 int64_t vocab_size) {
  check_matrix(table, op);
  const int64_t Vl = table.size(0), C = table.size(1), N = tokens.numel();
  DS_CHECK(out.numel() == N * C, "{}: out {} for {} tokens of width {}", op, out.shape().str(), N, C);
  DS_CHECK(vocab_begin >= 0 && vocab_begin + Vl <= vocab_size,
           "{}: rows [{}, {}) are not within the vocabulary [0, {})", op, vocab_begin, vocab_begin + Vl, vocab_size);
  DS_CHECK(tokens.dtype() == DType::I32, "{}: tokens holds {}, expected I32 ids", op, dtype_name(tokens.dtype()));
}

void scatter_rows(const char* op, const Tensor& dtable, const Tensor& dout, const Tensor& tokens) {
  check_matrix(dtable, op);
  const int64_t C = dtable.size(1), N = tokens.numel();
  DS_CHECK(dout.numel() == N * C, "{}: dout {} for {} tokens", op, dout.shape().str(), N);
  DS_CHECK(tokens.dtype() == DType::I32, "{}: tokens holds {}, expected I32 ids", op, dtype_name(tokens.dtype()));
}

void rope_apply(const Tensor& x, int64_t offset, int n_heads, int head_dim, const Tensor& cos, const Tensor& sin) {
  DS_CHECK(x.ndim() == 3, "rope: expected (B, T, W), got {}", x.shape().str());
  const int64_t T = x.size(1), W = x.size(2), half = head_dim / 2;
  DS_CHECK(cos.ndim() == 2 && sin.shape() == cos.shape() && offset >= 0 && n_heads >= 0 && head_dim >= 0 &&
               offset + int64_t(n_heads) * head_dim <= W && cos.size(0) >= T && cos.size(1) == half,
           "rope: {} heads of {} at column {} do not fit rows of {} / tables {}", n_heads, head_dim, offset, W,
           cos.shape().str());
}

void rope_interleaved(const Tensor& x, int64_t offset, int n_heads, int64_t head_stride, int dim, const Tensor& cos,
                      const Tensor& sin) {
  DS_CHECK(x.ndim() == 3, "rope_interleaved: expected (B, T, W), got {}", x.shape().str());
  const int64_t T = x.size(1), W = x.size(2), half = dim / 2;
  DS_CHECK(dim > 0 && dim % 2 == 0 && n_heads > 0 && (n_heads == 1 || head_stride >= dim),
           "rope_interleaved: {} heads of dim {} with a stride of {} columns", n_heads, dim, head_stride);
  DS_CHECK(offset >= 0 && offset + int64_t(n_heads - 1) * head_stride + dim <= W,
           "rope_interleaved: {} heads of {} at column {} (stride {}) do not fit rows of {}", n_heads, dim, offset,
           head_stride, W);
  DS_CHECK(cos.ndim() == 2 && cos.size(0) >= T && cos.size(1) == half && sin.shape() == cos.shape(),
           "rope_interleaved: tables {} for T = {} and dim {}", cos.shape().str(), T, dim);
}

// The attention dimensions the kernels derive from qkv (B,T,W) and the layout.
struct AttentionDims {
  int64_t B, T, H, Dv;
};
AttentionDims attention_dims(const Tensor& qkv, const AttentionLayout& L) {
  DS_CHECK(qkv.ndim() == 3, "attention: qkv must be (B, T, W), got {}", qkv.shape().str());
  DS_CHECK(L.n_head > 0 && L.n_kv_head > 0 && L.n_head % L.n_kv_head == 0,
           "attention: {} query heads cannot share {} kv heads evenly", L.n_head, L.n_kv_head);
  const int64_t W = qkv.size(2), H = L.n_head, Hkv = L.n_kv_head;
  DS_CHECK(L.row_stride == W, "attention: layout row stride {} but qkv rows have {}", L.row_stride, W);
  DS_CHECK(L.q_offset >= 0 && L.k_offset >= 0 && L.v_offset >= 0, "attention: negative column offsets {}, {}, {}",
           L.q_offset, L.k_offset, L.v_offset);
  DS_CHECK(L.q_offset + H * L.qk_dim <= W && L.k_offset + Hkv * L.qk_dim <= W && L.v_offset + Hkv * L.v_dim <= W,
           "attention: head ranges exceed the qkv row of {}", W);
  return {qkv.size(0), qkv.size(1), H, L.v_dim};
}

void logits_rows(const char* op, const Tensor& logits, const Tensor& targets, int64_t* V, int64_t* N) {
  DS_CHECK(logits.ndim() >= 1 && logits.size(-1) > 0, "{}: logits {} have no vocabulary columns", op,
           logits.shape().str());
  *V = logits.size(-1);
  *N = logits.numel() / *V;
  DS_CHECK(targets.dtype() == DType::I32, "{}: targets hold {}, expected I32 ids", op, dtype_name(targets.dtype()));
}

void backward_rows(const char* op, const Tensor& dlogits, const Tensor& logits, const Tensor& lse,
                   const Tensor& targets) {
  int64_t V = 0, N = 0;
  logits_rows(op, logits, targets, &V, &N);
  DS_CHECK(dlogits.numel() == N * V && lse.numel() == N && targets.numel() == N, "{}: shape mismatch", op);
}

void route(const Tensor& ids, const Tensor& weights, const Tensor& scores, const MoERouteParams& p) {
  const int64_t E = scores.size(-1), N = rows(scores);
  DS_CHECK(p.top_k >= 1 && p.top_k <= E, "moe_route: top_k {} with {} experts", p.top_k, E);
  DS_CHECK(ids.numel() == N * p.top_k && weights.numel() == N * p.top_k,
           "moe_route: ids {} / weights {} for {} tokens and top_k {}", ids.shape().str(), weights.shape().str(), N,
           p.top_k);
  if (p.method != MoETopK::Greedy) {
    DS_CHECK(p.n_group >= 1 && E % p.n_group == 0 && p.topk_group >= 1 && p.topk_group <= p.n_group,
             "moe_route: {} experts in n_group {} keeping topk_group {}", E, p.n_group, p.topk_group);
    DS_CHECK(p.topk_group * (E / p.n_group) >= p.top_k,
             "moe_route: topk_group {} groups of {} experts hold fewer than top_k {}", p.topk_group, E / p.n_group,
             p.top_k);
  }
  if (p.method == MoETopK::NoAuxTC) {
    DS_CHECK(E / p.n_group >= 2, "moe_route: noaux_tc ranks groups by their two best experts; groups of {}",
             E / p.n_group);
  }
}

}  // namespace

// ---- dense layers ---------------------------------------------------------------------------

void linear_forward(Tensor out, Tensor x, Tensor w, bool) {
  check_matrix(w, "linear weight");
  DS_CHECK(x.ndim() >= 1 && out.ndim() >= 1, "linear_forward: x {} and out {} must have a feature dimension",
           x.shape().str(), out.shape().str());
  const int64_t M = rows(x), K = x.size(-1), N = w.size(0);
  DS_CHECK(w.size(1) == K && rows(out) == M && out.size(-1) == N, "linear_forward: x {} · w {}^T -> out {}",
           x.shape().str(), w.shape().str(), out.shape().str());
}

void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool) {
  check_matrix(w, "linear weight");
  const int64_t M = rows(dout), N = dout.size(-1), K = w.size(1);
  DS_CHECK(w.size(0) == N && rows(x) == M && x.size(-1) == K, "linear_backward: dout {} x {} w {}",
           dout.shape().str(), x.shape().str(), w.shape().str());
  DS_CHECK(!dx.defined() || dx.numel() == M * K, "linear_backward: dx {} for x {}", dx.shape().str(), x.shape().str());
  DS_CHECK(!dw.defined() || dw.numel() == N * K, "linear_backward: dw {} for w {}", dw.shape().str(), w.shape().str());
}

// ---- embedding ------------------------------------------------------------------------------

void embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  check_matrix(table, "embedding_forward");
  gather_rows("embedding_forward", out, tokens, table, 0, table.size(0));
}

void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) {
  scatter_rows("embedding_backward", dtable, dout, tokens);
}

void embedding_shard_forward(Tensor out, Tensor tokens, Tensor table, int64_t vocab_begin, int64_t vocab_size) {
  gather_rows("embedding_shard_forward", out, tokens, table, vocab_begin, vocab_size);
}

void embedding_shard_backward(Tensor dtable, Tensor dout, Tensor tokens, int64_t) {
  scatter_rows("embedding_shard_backward", dtable, dout, tokens);
}

// ---- RMSNorm --------------------------------------------------------------------------------

void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float) {
  const int64_t C = x.size(-1), N = rows(x);
  DS_CHECK(C > 0 && out.numel() == x.numel() && rstd.numel() == N && weight.numel() == C,
           "rmsnorm_forward: x {} weight {} out {} rstd {}", x.shape().str(), weight.shape().str(),
           out.shape().str(), rstd.shape().str());
}

void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd) {
  const int64_t C = x.size(-1), N = rows(x);
  DS_CHECK(C > 0 && dx.numel() == x.numel() && dout.numel() == x.numel() && dweight.numel() == C &&
               weight.numel() == C && rstd.numel() == N,
           "rmsnorm_backward: shape mismatch");
}

// ---- rotary position embedding --------------------------------------------------------------

void rope_tables(Tensor cos, Tensor sin, int head_dim, double) {
  DS_CHECK(head_dim > 0 && head_dim % 2 == 0 && cos.ndim() == 2 && cos.size(1) == head_dim / 2 &&
               sin.numel() == cos.numel(),
           "rope_tables: head_dim {} with table {}", head_dim, cos.shape().str());
}

void rope_forward(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply(x, offset, n_heads, head_dim, cos, sin);
}

void rope_backward(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  rope_apply(dx, offset, n_heads, head_dim, cos, sin);
}

void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double, const YarnParams&) {
  DS_CHECK(dim > 0 && dim % 2 == 0 && cos.ndim() == 2 && cos.size(1) == dim / 2 && sin.shape() == cos.shape(),
           "rope_tables_yarn: dim {} with tables {} and {}", dim, cos.shape().str(), sin.shape().str());
}

void rope_forward_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                              Tensor sin) {
  rope_interleaved(x, offset, n_heads, head_stride, dim, cos, sin);
}

void rope_backward_interleaved(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                               Tensor sin) {
  rope_interleaved(dx, offset, n_heads, head_stride, dim, cos, sin);
}

// ---- attention ------------------------------------------------------------------------------

void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionLayout& layout, float) {
  const AttentionDims d = attention_dims(qkv, layout);
  DS_CHECK(out.numel() == d.B * d.T * d.H * d.Dv && lse.numel() == d.B * d.H * d.T,
           "attention_forward: out {} lse {}", out.shape().str(), lse.shape().str());
}

void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const AttentionLayout& layout,
                        float) {
  const AttentionDims d = attention_dims(qkv, layout);
  DS_CHECK(dqkv.numel() == qkv.numel() && dout.numel() == out.numel() && out.numel() == d.B * d.T * d.H * d.Dv,
           "attention_backward: shape mismatch");
  DS_CHECK(lse.numel() == d.B * d.H * d.T, "attention_backward: lse {} for (B, n_head, T) = ({}, {}, {})",
           lse.shape().str(), d.B, d.H, d.T);
}

// ---- SwiGLU ---------------------------------------------------------------------------------

void swiglu_forward(Tensor out, Tensor gate_up) {
  const int64_t I = out.size(-1), N = rows(out);
  DS_CHECK(gate_up.numel() == 2 * N * I, "swiglu_forward: gate_up {} for out {}", gate_up.shape().str(),
           out.shape().str());
}

void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  const int64_t I = dout.size(-1), N = rows(dout);
  DS_CHECK(gate_up.numel() == 2 * N * I && dgate_up.numel() == 2 * N * I, "swiglu_backward: shape mismatch");
}

// ---- cross-entropy --------------------------------------------------------------------------

void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  int64_t V = 0, N = 0;
  logits_rows("cross_entropy_forward", logits, targets, &V, &N);
  DS_CHECK(losses.numel() == N && lse.numel() == N && targets.numel() == N,
           "cross_entropy_forward: logits {} targets {}", logits.shape().str(), targets.shape().str());
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float) {
  backward_rows("cross_entropy_backward", dlogits, logits, lse, targets);
}

void cross_entropy_shard_forward(Tensor stats, Tensor logits, Tensor targets, int64_t vocab_begin, int64_t vocab_size) {
  int64_t V = 0, N = 0;
  logits_rows("cross_entropy_shard_forward", logits, targets, &V, &N);
  DS_CHECK(stats.numel() == 2 * N && targets.numel() == N, "cross_entropy_shard_forward: stats {} logits {} targets {}",
           stats.shape().str(), logits.shape().str(), targets.shape().str());
  DS_CHECK(vocab_begin >= 0 && vocab_begin + V <= vocab_size,
           "cross_entropy_shard_forward: columns [{}, {}) are not within the vocabulary [0, {})", vocab_begin,
           vocab_begin + V, vocab_size);
}

void cross_entropy_combine(Tensor losses, Tensor lse, Tensor shard_stats, Tensor targets) {
  const int64_t N = targets.numel(), P = shard_stats.ndim() > 0 ? shard_stats.size(0) : 0;
  DS_CHECK(P >= 1 && shard_stats.numel() == P * N * 2 && losses.numel() == N && lse.numel() == N,
           "cross_entropy_combine: shard_stats {} (want (P,{},2)) losses {} lse {} targets {}",
           shard_stats.shape().str(), N, losses.shape().str(), lse.shape().str(), targets.shape().str());
  DS_CHECK(targets.dtype() == DType::I32, "cross_entropy_combine: targets hold {}, expected I32 ids",
           dtype_name(targets.dtype()));
}

void cross_entropy_shard_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float, int64_t) {
  backward_rows("cross_entropy_shard_backward", dlogits, logits, lse, targets);
}

void logit_max_and_target(Tensor out, Tensor logits, Tensor targets, int64_t) {
  DS_CHECK(logits.ndim() >= 1 && logits.size(-1) > 0, "logit_max_and_target: logits {} have no vocabulary columns",
           logits.shape().str());
  const int64_t V = logits.size(-1), N = logits.numel() / V;
  // out is fp32 or the slot's 16-bit type, like every floating-point tensor of a 16-bit slot.
  DS_CHECK(out.numel() == 2 * N && targets.numel() == N && is_float(out.dtype()) && targets.dtype() == DType::I32,
           "logit_max_and_target: out {} ({}) logits {} targets {} ({}); expected out (N,2) f32, targets (N) i32",
           out.shape().str(), dtype_name(out.dtype()), logits.shape().str(), targets.shape().str(),
           dtype_name(targets.dtype()));
}

void loss_sums(Tensor out, Tensor losses, Tensor targets) {
  DS_CHECK(out.numel() == 2 && losses.numel() == targets.numel(), "loss_sums: out {} losses {} targets {}",
           out.shape().str(), losses.shape().str(), targets.shape().str());
  DS_CHECK(out.dtype() == DType::F64 && targets.dtype() == DType::I32, "loss_sums: out {} and targets {}, expected "
           "f64 and i32", dtype_name(out.dtype()), dtype_name(targets.dtype()));
}

// ---- tokens ---------------------------------------------------------------------------------

void shift_tokens(Tensor out, Tensor src, int64_t shift, int32_t, int32_t) {
  DS_CHECK(out.ndim() == 2 && out.shape() == src.shape(), "shift_tokens: out {} and src {} must both be (B, T)",
           out.shape().str(), src.shape().str());
  DS_CHECK(shift >= 0, "shift_tokens: negative shift {}", shift);
  DS_CHECK(out.dtype() == DType::I32 && src.dtype() == DType::I32, "shift_tokens: out {} and src {}, expected i32",
           dtype_name(out.dtype()), dtype_name(src.dtype()));
}

// ---- elementwise, copies and reductions -----------------------------------------------------

void add(Tensor out, Tensor a, Tensor b) {
  const int64_t n = out.numel();
  DS_CHECK(a.numel() == n && b.numel() == n, "add: sizes {} {} {}", out.numel(), a.numel(), b.numel());
}

void add_inplace(Tensor out, Tensor a) {
  DS_CHECK(a.numel() == out.numel(), "add: sizes {} {} {}", out.numel(), out.numel(), a.numel());
}

void scale_inplace(Tensor, float) {}

void fill(Tensor, float) {}

void copy(Tensor dst, Tensor src) {
  DS_CHECK(dst.nbytes() == src.nbytes(), "copy: {} bytes into {}", src.nbytes(), dst.nbytes());
}

void cast(Tensor dst, Tensor src) {
  DS_CHECK(dst.numel() == src.numel(), "cast: {} elements into {}", src.numel(), dst.numel());
  DS_CHECK(is_float(dst.dtype()) && is_float(src.dtype()), "cast: {} -> {}: only F32, BF16 and F16 convert",
           dtype_name(src.dtype()), dtype_name(dst.dtype()));
}

void copy_blocks(Tensor dst, int64_t dst_offset, int64_t dst_step, Tensor src, int64_t src_offset, int64_t src_step,
                 int64_t blocks, int64_t width, bool) {
  DS_CHECK(dst.ndim() >= 1 && src.ndim() >= 1, "copy_blocks: scalar tensors");
  const int64_t dcols = dst.size(-1), scols = src.size(-1);
  const int64_t drows = rows(dst), srows = rows(src);
  DS_CHECK(srows == drows, "copy_blocks: {} rows from {} rows", drows, srows);
  DS_CHECK(blocks >= 0 && width >= 0 && dst_offset >= 0 && src_offset >= 0 && dst_step >= 0 && src_step >= 0,
           "copy_blocks: negative offset, step or size");
  if (blocks == 0 || width == 0 || drows == 0) return;  // nothing to copy: any offsets do
  DS_CHECK(dst_offset + (blocks - 1) * dst_step + width <= dcols && src_offset + (blocks - 1) * src_step + width <= scols,
           "copy_blocks: {} blocks of {} at {}+j*{} (dst {} columns) from {}+j*{} (src {} columns) run past a row",
           blocks, width, dst_offset, dst_step, dcols, src_offset, src_step, scols);
}

void sum_squares(Tensor out, Tensor x) {
  DS_CHECK(out.numel() == 1, "sum_squares: out has {} elements, expected 1", out.numel());
  DS_CHECK(out.dtype() == DType::F64, "sum_squares: out is {}, expected f64", dtype_name(out.dtype()));
  DS_CHECK(is_float(x.dtype()), "sum_squares: x is {}, expected f32, bf16 or f16", dtype_name(x.dtype()));
}

void count_non_finite(Tensor out, Tensor x) {
  DS_CHECK(is_float(x.dtype()), "count_non_finite: {} tensor, expected f32 (or bf16, f16)", dtype_name(x.dtype()));
  DS_CHECK(out.numel() == 1, "count_non_finite: out has {} elements, expected 1", out.numel());
  DS_CHECK(out.dtype() == DType::I64, "count_non_finite: out is {}, expected i64", dtype_name(out.dtype()));
}

void fill_normal(Tensor, double, uint64_t, uint64_t, uint64_t) {}

// ---- optimizer ------------------------------------------------------------------------------

void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, Tensor param_copy, const AdamWStep&) {
  const int64_t n = param.numel();
  DS_CHECK(grad.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n &&
               (!param_copy.defined() || param_copy.numel() == n),
           "adamw_update: size mismatch");
}

// ---- mixture of experts ---------------------------------------------------------------------

void moe_scores(Tensor scores, Tensor logits, MoEScoring) {
  const int64_t E = logits.size(-1), N = rows(logits);
  DS_CHECK(scores.numel() == N * E, "moe_scores: scores {} for logits {}", scores.shape().str(),
           logits.shape().str());
}

void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, MoEScoring) {
  const int64_t E = scores.size(-1), N = rows(scores);
  DS_CHECK(dscores.numel() == N * E && dlogits.numel() == N * E, "moe_scores_backward: shape mismatch");
}

void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const MoERouteParams& p) {
  route(ids, weights, scores, p);
  const int64_t E = scores.size(-1);
  DS_CHECK(p.method != MoETopK::NoAuxTC || (bias.defined() && bias.numel() == E),
           "moe_route: noaux_tc needs a bias of {} experts", E);
  need(ids, DType::I32, "moe_route", "ids");
}

void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const MoERouteParams& p) {
  const int64_t E = scores.size(-1), N = rows(scores);
  const int k = p.top_k;
  DS_CHECK(dscores.numel() == N * E && dweights.numel() == N * k && ids.numel() == N * k,
           "moe_route_backward: dscores {} dweights {} ids {} for scores {}", dscores.shape().str(),
           dweights.shape().str(), ids.shape().str(), scores.shape().str());
  need(ids, DType::I32, "moe_route_backward", "ids");
}

void moe_aux_loss(Tensor aux, Tensor coef, Tensor scores, Tensor ids, MoEScoring) {
  DS_CHECK(aux.numel() == 1, "moe_aux_loss: aux has {} elements, expected 1", aux.numel());
  const int64_t E = scores.size(-1), N = rows(scores), G = E > 0 ? coef.numel() / E : 0;
  DS_CHECK(N >= 1, "moe_aux_loss: scores {} hold no token", scores.shape().str());
  const int64_t k = ids.numel() / N;
  DS_CHECK(coef.numel() == G * E && G >= 1 && N % G == 0 && ids.numel() == N * k,
           "moe_aux_loss: coef {} ids {} for scores {}", coef.shape().str(), ids.shape().str(), scores.shape().str());
  need(aux, DType::F64, "moe_aux_loss", "aux");
  need(ids, DType::I32, "moe_aux_loss", "ids");
}

void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, MoEScoring, float) {
  const int64_t E = dscores.size(-1), N = rows(dscores), G = E > 0 ? coef.numel() / E : 0;
  DS_CHECK(coef.numel() == G * E && G >= 1 && N % G == 0 && scores.numel() == N * E,
           "moe_aux_loss_backward: coef {} scores {} for dscores {}", coef.shape().str(), scores.shape().str(),
           dscores.shape().str());
}

void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids) {
  const int64_t E = offsets.numel() - 1, M = ids.numel();
  DS_CHECK(E >= 1 && sorted.numel() == M && position.numel() == M, "moe_dispatch_plan: offsets {} sorted {} for {} ids",
           offsets.shape().str(), sorted.shape().str(), M);
  DS_CHECK(M <= INT32_MAX, "moe_dispatch_plan: {} pairs overflow the int32 plan", M);
  need(offsets, DType::I64, "moe_dispatch_plan", "offsets");
  need(sorted, DType::I32, "moe_dispatch_plan", "sorted");
  need(position, DType::I32, "moe_dispatch_plan", "position");
  need(ids, DType::I32, "moe_dispatch_plan", "ids");
}

void moe_capacity_plan(Tensor kept, Tensor sorted, Tensor position, Tensor offsets, Tensor weights, int64_t capacity,
                       MoEDropPolicy) {
  const int64_t E = offsets.numel() - 1, M = sorted.numel();
  DS_CHECK(E >= 1 && kept.numel() == E + 1 && position.numel() == M && weights.numel() == M && capacity >= 0,
           "moe_capacity_plan: kept {} offsets {} sorted {} position {} weights {} capacity {}", kept.shape().str(),
           offsets.shape().str(), sorted.shape().str(), position.shape().str(), weights.shape().str(), capacity);
  need(kept, DType::I64, "moe_capacity_plan", "kept");
  need(sorted, DType::I32, "moe_capacity_plan", "sorted");
  need(position, DType::I32, "moe_capacity_plan", "position");
  need(offsets, DType::I64, "moe_capacity_plan", "offsets");
}

void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k) {
  const int64_t C = x.size(-1), M = sorted.numel(), N = rows(x);
  DS_CHECK(xg.numel() == M * C && M <= N * top_k, "moe_permute: xg {} from x {} with {} rows", xg.shape().str(),
           x.shape().str(), M);
  need(sorted, DType::I32, "moe_permute", "sorted");
}

void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool) {
  const int64_t C = dx.size(-1), N = rows(dx), M = position.numel(), k = N > 0 ? M / N : 0;
  DS_CHECK(M == N * k && C > 0 && dxg.numel() % C == 0 && dxg.numel() <= M * C,
           "moe_permute_backward: dxg {} for dx {} and {} pairs", dxg.shape().str(), dx.shape().str(), M);
  need(position, DType::I32, "moe_permute_backward", "position");
}

void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position) {
  const int64_t C = out.size(-1), N = rows(out), M = position.numel(), k = N > 0 ? M / N : 0;
  DS_CHECK(M == N * k && C > 0 && yg.numel() % C == 0 && yg.numel() <= M * C && weights.numel() == M,
           "moe_unpermute: yg {} weights {} for out {}", yg.shape().str(), weights.shape().str(), out.shape().str());
  need(position, DType::I32, "moe_unpermute", "position");
}

void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted) {
  const int64_t C = dout.size(-1), N = rows(dout), M = weights.numel(), k = N > 0 ? M / N : 0, R = sorted.numel();
  DS_CHECK(M == N * k && R <= M && dyg.numel() == R * C && yg.numel() == R * C && dweights.numel() == M,
           "moe_unpermute_backward: dyg {} yg {} weights {} sorted {} for dout {}", dyg.shape().str(),
           yg.shape().str(), weights.shape().str(), sorted.shape().str(), dout.shape().str());
  need(sorted, DType::I32, "moe_unpermute_backward", "sorted");
}

void moe_bias_update(Tensor bias, Tensor tokens_per_expert, float) {
  const int64_t E = bias.numel();
  DS_CHECK(tokens_per_expert.numel() == E, "moe_bias_update: {} counts for {} experts", tokens_per_expert.numel(), E);
  need(tokens_per_expert, DType::I64, "moe_bias_update", "tokens_per_expert");
}

}  // namespace dstrain::ops::checks
