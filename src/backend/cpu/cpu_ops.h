// CPU (OpenMP + OpenBLAS) implementations of backend/ops.h, same signatures.
#pragma once

#include "backend/ops.h"

namespace dstrain::cpu {

void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate);
void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx);
void embedding_forward(Tensor out, Tensor tokens, Tensor table);
void embedding_backward(Tensor dtable, Tensor dout, Tensor tokens);
void rmsnorm_forward(Tensor out, Tensor rstd, Tensor x, Tensor weight, float eps);
void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dout, Tensor x, Tensor weight, Tensor rstd);
void rope_tables(Tensor cos, Tensor sin, int head_dim, double theta);
void rope_apply(Tensor x, int64_t offset, int n_heads, int head_dim, Tensor cos, Tensor sin, bool inverse);
void rope_tables_yarn(Tensor cos, Tensor sin, int dim, double theta, const ops::YarnParams& yarn);
void rope_apply_interleaved(Tensor x, int64_t offset, int n_heads, int64_t head_stride, int dim, Tensor cos, Tensor sin,
                            bool inverse);
void attention_forward(Tensor out, Tensor lse, Tensor qkv, const ops::AttentionLayout& layout, float scale);
void attention_backward(Tensor dqkv, Tensor dout, Tensor qkv, Tensor out, Tensor lse,
                        const ops::AttentionLayout& layout, float scale);
void swiglu_forward(Tensor out, Tensor gate_up);
void swiglu_backward(Tensor dgate_up, Tensor dout, Tensor gate_up);
void cross_entropy_forward(Tensor losses, Tensor lse, Tensor logits, Tensor targets);
void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, float scale);
void add(Tensor out, Tensor a, Tensor b);
void add_inplace(Tensor out, Tensor a);
void scale_inplace(Tensor x, float s);
void fill(Tensor x, float value);
void copy(Tensor dst, Tensor src);
double sum_squares(Tensor x);
int64_t count_non_finite(Tensor x);
void adamw_update(Tensor param, Tensor grad, Tensor exp_avg, Tensor exp_avg_sq, const ops::AdamWStep& s);

// ---- mixture of experts ----
void moe_scores(Tensor scores, Tensor logits, ops::MoEScoring scoring);
void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, ops::MoEScoring scoring);
void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const ops::MoERouteParams& p);
void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const ops::MoERouteParams& p);
double moe_aux_loss(Tensor coef, Tensor scores, Tensor ids, ops::MoEScoring scoring);
void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, ops::MoEScoring scoring, float scale);
void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids);
void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k);
void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool accumulate);
void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position);
void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted);

}  // namespace dstrain::cpu
