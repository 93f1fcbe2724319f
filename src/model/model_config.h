// The architecture of a DeepSeek-family model, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json_reader.h"

namespace dstrain {

// YaRN rotary scaling as DeepSeek-V2/V3 use it (rope_scaling.type "yarn").
struct RopeScaling {
  std::string type;  // "" (none) or "yarn"
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;
  double beta_fast = 32, beta_slow = 1;
  double mscale = 1, mscale_all_dim = 0;
  bool yarn() const { return type == "yarn"; }
};

struct ModelConfig {
  // "llama" (DeepSeek-LLM 7B/67B ship as LlamaForCausalLM), "deepseek_v2" or "deepseek_v3".
  std::string model_type = "llama";
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // defaults to num_attention_heads (no grouping)
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  int64_t bos_token_id = 1;
  std::vector<int64_t> eos_token_ids{2};

  // ---- DeepSeek-V2/V3: Multi-head Latent Attention ----
  int64_t q_lora_rank = 0;  // 0: null in config.json (queries through q_proj)
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0, qk_rope_head_dim = 0, v_head_dim = 0;
  RopeScaling rope_scaling;
  // ---- DeepSeekMoE ----
  int64_t n_routed_experts = 0;  // 0: null (every layer dense)
  int64_t n_shared_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t first_k_dense_replace = 0;
  int64_t moe_layer_freq = 1;
  double routed_scaling_factor = 1.0;
  std::string scoring_func = "softmax";  // "softmax" (V2) or "sigmoid" (V3)
  std::string topk_method = "greedy";    // "greedy", "group_limited_greedy", "noaux_tc"
  int64_t n_group = 1, topk_group = 1;
  bool norm_topk_prob = false;
  double aux_loss_alpha = 0.0;
  bool seq_aux = true;
  // Training-time choices of the run configuration ("moe" block), not of the architecture:
  // neither read from nor written to config.json. Expert capacity factor (0: none, no token is
  // dropped, as DeepSeek) and Megatron-Core's drop policy, "probs" or "position" (moe.h).
  double moe_capacity_factor = 0;
  std::string moe_drop_policy = "probs";
  // ---- multi-token prediction (V3) ----
  int64_t num_nextn_predict_layers = 0;

  bool mla() const { return model_type == "deepseek_v2" || model_type == "deepseek_v3"; }
  // Layer `layer` (0-based) is a DeepSeekMoE layer.
  bool is_moe_layer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
  }
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  // 1/sqrt(qk head dim) (head_dim for llama), times mscale^2 under YaRN with mscale_all_dim.
  double softmax_scale() const;
  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t num_parameters() const;
  // Model FLOPs of one training token (forward + backward) at sequence length T:
  // 6 x non-embedding-lookup parameters plus the causal attention term.
  double train_flops_per_token(int64_t T) const;

  // Reads a config.json object strictly; `source` names the file for error messages.
  static ModelConfig from_hf_json(const json& j, const std::string& source);
  // The config.json Hugging Face loads (LlamaForCausalLM, DeepseekV2/V3ForCausalLM).
  json to_hf_json() const;
};

// Reads a config.json file.
ModelConfig load_hf_config(const std::string& path);

}  // namespace dstrain
