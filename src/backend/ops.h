// The ops dstrain's models are built from: explicit forward and backward, one signature per
// op for every device and precision. The signatures are listed once, in backend/ops.def; each
// ops:: call goes through the table of the backend registered for its tensors' device
// (backend/backend.h), in the slot of its floating-point dtype. The CPU fp32 kernels
// (backend/cpu/) are the reference every other backend and dtype is tested against.
//
// Conventions: tensors are contiguous row-major fp32 unless noted; "(+=)" marks outputs
// that are accumulated into (gradients), all others are overwritten.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace dstrain::ops {

constexpr int32_t kIgnoreIndex = -100;  // target id that contributes no loss (Hugging Face's)

// Rotary embedding of DeepSeek-V2/V3 (rope_tables_yarn): YaRN parameters of rope_scaling.
struct YarnParams {
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1, mscale = 1, mscale_all_dim = 0;
};

// Causal self-attention with grouped-query heads: q, k and v are column ranges of one fused
// activation qkv (B,T,row_stride): head h of q at q_offset + h*qk_dim, kv head g of k at
// k_offset + g*qk_dim and of v at v_offset + g*v_dim. Query head h reads kv head
// h / (n_head / n_kv_head).
struct AttentionLayout {
  int n_head = 0;
  int n_kv_head = 0;
  int qk_dim = 0;
  int v_dim = 0;
  int64_t q_offset = 0, k_offset = 0, v_offset = 0, row_stride = 0;
};

struct AdamWStep {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  int64_t step = 1;  // 1-based, for bias correction
  float grad_scale = 1;  // multiplies every gradient as it is read
};

// ---- mixture of experts ----------------------------------------------------------------
// DeepSeekMoE routing and token permutation (modeling_deepseek.py's MoEGate and moe_infer),
// split so that expert parallelism can later put an all-to-all between the permutation and
// the expert GEMMs:
//   scores  = moe_scores(x · gate^T)                    (N,E)   router probabilities
//   ids, w  = moe_route(scores, bias)                    (N,k)   top-k experts and weights
//   plan    = moe_dispatch_plan(ids)                     per-expert row ranges
//   [plan   = moe_capacity_plan(plan, w)                 optional: at most capacity rows per expert]
//   xg      = moe_permute(x, plan)                       (N*k,C) rows grouped by expert
//   [all-to-all of xg by expert owner would go here]
//   yg[e]   = expert_e(xg[e])                            one GEMM per expert
//   out    += moe_unpermute(yg, w, plan)                 weighted combine per token
// N tokens, E routed experts, k = num_experts_per_tok, M = N*k dispatched rows; with a capacity,
// R <= M kept rows, and a dropped (token, slot) pair has no grouped row (position -1).
enum class MoEScoring { Softmax, Sigmoid };
// greedy: top-k of the scores. group_limited_greedy (V2): keep the topk_group groups with the
// largest max score. noaux_tc (V3): choose on scores + bias, groups ranked by the sum of
// their two largest, weights from the unbiased scores.
enum class MoETopK { Greedy, GroupLimitedGreedy, NoAuxTC };
// Which rows an expert over its capacity keeps (Megatron-Core's moe_token_drop_policy): those of
// the largest routing weights, or the earliest tokens.
enum class MoEDropPolicy { Probs, Position };
struct MoERouteParams {
  MoETopK method = MoETopK::Greedy;
  int top_k = 1;
  int n_group = 1, topk_group = 1;  // E splits into n_group contiguous groups
  bool norm_topk_prob = false;
  float routed_scaling_factor = 1.0f;
};


// One function per op of ops.def.
#define DS_OP(name, params, args) void name params;
#include "backend/ops.def"
#undef DS_OP

// Defaults of the dense layers' flags (a redeclaration may add them).
void linear_forward(Tensor out, Tensor x, Tensor w, bool accumulate = false);
void linear_backward(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx = false);

// What the transfer ops (DS_TRANSFER_OP of ops.def: copy) have moved between the host and a
// device since the process started: calls and bytes, by direction. Host to host and device to
// device transfers count nothing. Each device-to-host read is a point where the host waits for
// the device, so a training step should do a constant number of them.
struct TransferCounts {
  int64_t device_to_host = 0, device_to_host_bytes = 0;
  int64_t host_to_device = 0, host_to_device_bytes = 0;
};
TransferCounts transfer_counts();

// The value of a one-element tensor, copied to the host: the explicit synchronisation point
// where a device result (a norm, a count, a loss) is read.
template <class T>
T read_scalar(Tensor t) {
  DS_CHECK(t.numel() == 1 && t.dtype() == dtype_of<T>(), "read_scalar: expected one {} element, got {} {}",
           dtype_name(dtype_of<T>()), dtype_name(t.dtype()), t.shape().str());
  T v{};
  copy(Tensor(&v, t.dtype(), Shape{1}), t.view(Shape{1}));
  return v;
}

// Reductions read back to the host, for host-side checks (load validation, the divergence
// guard, the gradient norm): the op into a one-element tensor on x's device, then read_scalar.
double read_sum_squares(Tensor x);
int64_t read_count_non_finite(Tensor x);

// DeepSeek's YaRN rotary embedding as Hugging Face computes it (DeepseekV2YarnRotaryEmbedding):
// the inverse frequencies (dim/2, fp32; double where Hugging Face has Python floats, fp32 where
// it has fp32 tensors) and the mscale factor of the tables; plain frequencies and 1 without
// scaling (factor 1). Every backend's rope_tables_yarn builds its tables from these.
std::vector<float> yarn_inv_freq(int dim, double theta, const YarnParams& yarn, float* mscale);

// A tensor's contents where host code can read them: the tensor itself when it lives on the host,
// else a host copy (ops::copy; the explicit transfer). Writes to a copy stay on the host until
// write_back() sends them to the device tensor. For host-side consumers of device state:
// checkpoint files, weight hashes, Hugging Face exports.
class HostView {
 public:
  explicit HostView(Tensor t);
  // The host tensor (same dtype and shape).
  const Tensor& get() const { return host_; }
  template <class T>
  T* data() const {
    return host_.data<T>();
  }
  // Copies the host contents back to the device tensor (nothing to do on the host).
  void write_back() const;

 private:
  Tensor source_, host_;
  std::vector<unsigned char> storage_;
};

}  // namespace dstrain::ops
