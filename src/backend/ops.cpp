// Device dispatch for backend/ops.h: every op runs where its tensors live. This build has
// the CPU kernels; the CUDA backend adds its branch here behind the same signatures.
#include "backend/ops.h"

#include "backend/cpu/cpu_ops.h"

namespace dstrain::ops {
namespace {

// All tensors of one call must share a device; returns it.
template <class... Ts>
Device common_device(const char* op, const Tensor& first, const Ts&... rest) {
  const Device dev = first.device();
  auto same = [&](const Tensor& t) {
    DS_CHECK(!t.defined() || t.device() == dev, "{}: tensors on {} and {}", op, dev.str(), t.device().str());
  };
  (same(rest), ...);
  (void)same;
  DS_CHECK(dev.is_cpu(), "{}: tensors are on {}, but this build of dstrain has no kernels for that device", op,
           dev.str());
  return dev;
}

}  // namespace

void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate) {
  common_device("linear_forward", out, x, w);
  cpu::linear_forward(out, x, w, accumulate);
}
void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  common_device("linear_backward", dout, dx, dw, x, w);
  cpu::linear_backward(dx, dw, dout, x, w, accumulate_dx);
}
void embedding_forward(Tensor out, Tensor tokens, Tensor table) {
  common_device("embedding_forward", out, tokens, table);
  cpu::embedding_forward(out, tokens, table);
}
void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens) {
  common_device("embedding_backward", dtable, dout, tokens);
  cpu::embedding_backward(dtable, dout, tokens);
}
void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps) {
  common_device("rmsnorm_forward", out, rstd, x, weight);
  cpu::rmsnorm_forward(out, rstd, x, weight, eps);
}
void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd) {
  common_device("rmsnorm_backward", dx, dweight, dout, x, weight, rstd);
  cpu::rmsnorm_backward(dx, dweight, dout, x, weight, rstd);
}
void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta) {
  common_device("rope_tables", cos, sin);
  cpu::rope_tables(cos, sin, head_dim, theta);
}
void rope_forward(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  common_device("rope_forward", x, cos, sin);
  cpu::rope_apply(x, offset, n_heads, head_dim, cos, sin, /*inverse=*/false);
}
void rope_backward(Tensor dx, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin) {
  common_device("rope_backward", dx, cos, sin);
  cpu::rope_apply(dx, offset, n_heads, head_dim, cos, sin, /*inverse=*/true);
}
void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double theta, const YarnParams& yarn) {
  common_device("rope_tables_yarn", cos, sin);
  cpu::rope_tables_yarn(cos, sin, dim, theta, yarn);
}
void rope_forward_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                              Tensor sin) {
  common_device("rope_forward_interleaved", x, cos, sin);
  cpu::rope_apply_interleaved(x, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/false);
}
void rope_backward_interleaved(Tensor dx, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos,
                               Tensor sin) {
  common_device("rope_backward_interleaved", dx, cos, sin);
  cpu::rope_apply_interleaved(dx, offset, n_heads, head_stride, dim, cos, sin, /*inverse=*/true);
}
void attention_forward(Tensor out, Tensor lse, Tensor qkv, const AttentionLayout& layout, float scale) {
  common_device("attention_forward", out, lse, qkv);
  cpu::attention_forward(out, lse, qkv, layout, scale);
}
void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse, const AttentionLayout& layout,
                        float scale) {
  common_device("attention_backward", dqkv, dout, qkv, out, lse);
  cpu::attention_backward(dqkv, dout, qkv, out, lse, layout, scale);
}
void swiglu_forward(Tensor out, Tensor gate_up) {
  common_device("swiglu_forward", out, gate_up);
  cpu::swiglu_forward(out, gate_up);
}
void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up) {
  common_device("swiglu_backward", dgate_up, dout, gate_up);
  cpu::swiglu_backward(dgate_up, dout, gate_up);
}
void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets) {
  common_device("cross_entropy_forward", losses, lse, logits, targets);
  cpu::cross_entropy_forward(losses, lse, logits, targets);
}
void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale) {
  common_device("cross_entropy_backward", dlogits, logits, lse, targets);
  cpu::cross_entropy_backward(dlogits, logits, lse, targets, scale);
}
void add(Tensor out, Tensor a, Tensor b) {
  common_device("add", out, a, b);
  cpu::add(out, a, b);
}
void add_inplace(Tensor out, Tensor a) {
  common_device("add_inplace", out, a);
  cpu::add_inplace(out, a);
}
void scale_inplace(Tensor x, float s) {
  common_device("scale_inplace", x);
  cpu::scale_inplace(x, s);
}
void fill(Tensor x, float value) {
  common_device("fill", x);
  cpu::fill(x, value);
}
void copy(Tensor dst, Tensor src) {
  common_device("copy", dst, src);
  cpu::copy(dst, src);
}
double sum_squares(Tensor x) {
  common_device("sum_squares", x);
  return cpu::sum_squares(x);
}
int64_t count_non_finite(Tensor x) {
  common_device("count_non_finite", x);
  return cpu::count_non_finite(x);
}
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const AdamWStep& s) {
  common_device("adamw_update", param, grad, exp_avg, exp_avg_sq);
  cpu::adamw_update(param, grad, exp_avg, exp_avg_sq, s);
}

// ---- mixture of experts ----
void moe_scores(Tensor scores, Tensor logits, MoEScoring scoring) {
  common_device("moe_scores", scores, logits);
  cpu::moe_scores(scores, logits, scoring);
}
void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, MoEScoring scoring) {
  common_device("moe_scores_backward", dlogits, dscores, scores);
  cpu::moe_scores_backward(dlogits, dscores, scores, scoring);
}
void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const MoERouteParams& p) {
  common_device("moe_route", ids, weights, scores, bias);
  cpu::moe_route(ids, weights, scores, bias, p);
}
void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const MoERouteParams& p) {
  common_device("moe_route_backward", dscores, dweights, ids, scores);
  cpu::moe_route_backward(dscores, dweights, ids, scores, p);
}
double moe_aux_loss(Tensor coef, Tensor scores, Tensor ids, MoEScoring scoring) {
  common_device("moe_aux_loss", coef, scores, ids);
  return cpu::moe_aux_loss(coef, scores, ids, scoring);
}
void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, MoEScoring scoring, float scale) {
  common_device("moe_aux_loss_backward", dscores, coef, scores);
  cpu::moe_aux_loss_backward(dscores, coef, scores, scoring, scale);
}
void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids) {
  common_device("moe_dispatch_plan", offsets, sorted, position, ids);
  cpu::moe_dispatch_plan(offsets, sorted, position, ids);
}
void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k) {
  common_device("moe_permute", xg, x, sorted);
  cpu::moe_permute(xg, x, sorted, top_k);
}
void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool accumulate) {
  common_device("moe_permute_backward", dx, dxg, position);
  cpu::moe_permute_backward(dx, dxg, position, accumulate);
}
void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position) {
  common_device("moe_unpermute", out, yg, weights, position);
  cpu::moe_unpermute(out, yg, weights, position);
}
void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted) {
  common_device("moe_unpermute_backward", dyg, dweights, dout, yg, weights, sorted);
  cpu::moe_unpermute_backward(dyg, dweights, dout, yg, weights, sorted);
}

}  // namespace dstrain::ops
