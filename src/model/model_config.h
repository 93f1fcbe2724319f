// The architecture of a DeepSeek-family model, read from a Hugging Face config.json.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/json_reader.h"

namespace dstrain {

struct ModelConfig {
  std::string model_type = "llama";  // DeepSeek-LLM 7B/67B ship as LlamaForCausalLM
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

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t num_parameters() const;
  // Model FLOPs of one training token (forward + backward) at sequence length T:
  // 6 x non-embedding-lookup parameters plus the causal attention term.
  double train_flops_per_token(int64_t T) const;

  // Reads a config.json object strictly; `source` names the file for error messages.
  static ModelConfig from_hf_json(const json& j, const std::string& source);
  // The config.json Hugging Face's LlamaForCausalLM loads.
  json to_hf_json() const;
};

// Reads a config.json file.
ModelConfig load_hf_config(const std::string& path);

}  // namespace dstrain
