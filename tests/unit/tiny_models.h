// The tiny model configurations the unit tests share: a dense DeepSeek-LLM (LLaMA-style) one
// and a DeepSeek-V3 one (MLA with a query LoRA, a dense first layer, sigmoid/noaux_tc MoE with
// a shared expert and the aux loss, MTP at the given depth).
#pragma once

#include "model/model_config.h"

namespace dstrain {

inline ModelConfig tiny_dense(bool gqa, bool tied) {
  ModelConfig c;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = gqa ? 2 : 4;
  c.vocab_size = 23;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.3;
  return c;
}

inline ModelConfig tiny_v3(int64_t mtp_depth) {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.hidden_size = 32;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.vocab_size = 40;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-6;
  c.initializer_range = 0.3;
  c.q_lora_rank = 12;
  c.kv_lora_rank = 8;
  c.qk_nope_head_dim = 4;
  c.qk_rope_head_dim = 4;
  c.v_head_dim = 4;
  c.n_routed_experts = 8;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 2;
  c.moe_intermediate_size = 6;
  c.first_k_dense_replace = 1;
  c.routed_scaling_factor = 2.5;
  c.scoring_func = "sigmoid";
  c.topk_method = "noaux_tc";
  c.n_group = 2;
  c.topk_group = 1;
  c.norm_topk_prob = true;
  c.aux_loss_alpha = 0.1;  // large, so the aux gradient is visible next to the CE's
  c.seq_aux = true;
  c.num_nextn_predict_layers = mtp_depth;
  return c;
}

}  // namespace dstrain
