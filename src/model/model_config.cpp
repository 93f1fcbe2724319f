#include "model/model_config.h"

#include "core/error.h"

namespace dstrain {

ModelConfig ModelConfig::from_hf_json(const json& j, const std::string& source) {
  JsonReader r(j, "", source);
  ModelConfig c;
  c.model_type = r.get<std::string>("model_type", c.model_type);
  if (c.model_type != "llama") {
    r.error("model_type", fmt::format("is \"{}\"; this build trains the DeepSeek-LLM architecture (\"llama\")",
                                      c.model_type));
  }
  c.hidden_size = r.get<int64_t>("hidden_size");
  c.intermediate_size = r.get<int64_t>("intermediate_size");
  c.num_hidden_layers = r.get<int64_t>("num_hidden_layers");
  c.num_attention_heads = r.get<int64_t>("num_attention_heads");
  c.num_key_value_heads = r.is_null("num_key_value_heads") ? c.num_attention_heads
                                                            : r.get<int64_t>("num_key_value_heads");
  c.vocab_size = r.get<int64_t>("vocab_size");
  c.max_position_embeddings = r.get<int64_t>("max_position_embeddings", c.max_position_embeddings);
  c.rms_norm_eps = r.get<double>("rms_norm_eps", c.rms_norm_eps);
  c.rope_theta = r.get<double>("rope_theta", c.rope_theta);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", c.tie_word_embeddings);
  c.initializer_range = r.get<double>("initializer_range", c.initializer_range);
  c.bos_token_id = r.has("bos_token_id") && r.is_null("bos_token_id") ? -1 : r.get<int64_t>("bos_token_id", c.bos_token_id);
  if (r.has("eos_token_id") && r.is_null("eos_token_id")) {
    c.eos_token_ids.clear();
  } else if (r.has("eos_token_id")) {
    const json& e = r.raw("eos_token_id");
    c.eos_token_ids.clear();
    if (e.is_array()) {
      for (const auto& v : e) {
        if (!v.is_number_integer()) r.error("eos_token_id", "must be an integer or a list of integers");
        c.eos_token_ids.push_back(v.get<int64_t>());
      }
    } else if (e.is_number_integer()) {
      c.eos_token_ids.push_back(e.get<int64_t>());
    } else {
      r.error("eos_token_id", "must be an integer or a list of integers");
    }
  }

  // Fields that would change the computation: only the values DeepSeek-LLM uses are accepted.
  if (r.get<std::string>("hidden_act", "silu") != "silu") r.error("hidden_act", "must be \"silu\" (SwiGLU MLP)");
  if (r.get<bool>("attention_bias", false)) r.error("attention_bias", "must be false: projections have no bias");
  if (r.get<bool>("mlp_bias", false)) r.error("mlp_bias", "must be false: projections have no bias");
  if (r.get<double>("attention_dropout", 0.0) != 0.0) r.error("attention_dropout", "must be 0 (no dropout)");
  if (!r.is_null("rope_scaling")) r.error("rope_scaling", "must be null for the DeepSeek-LLM architecture");
  if (r.has("head_dim") && !r.is_null("head_dim") && r.get<int64_t>("head_dim") != c.head_dim()) {
    r.error("head_dim", fmt::format("must equal hidden_size / num_attention_heads = {}", c.head_dim()));
  }
  r.get<int64_t>("pretraining_tp", 1);  // only reorders a sum in Hugging Face; same math
  // Metadata without effect on training.
  r.allow({"architectures", "torch_dtype", "transformers_version", "use_cache", "_name_or_path", "pad_token_id",
           "auto_map", "tokenizer_class", "bos_token", "eos_token"});
  r.done();

  auto positive = [&](const char* key, int64_t v) {
    if (v <= 0) r.error(key, fmt::format("must be positive, got {}", v));
  };
  positive("hidden_size", c.hidden_size);
  positive("intermediate_size", c.intermediate_size);
  positive("num_hidden_layers", c.num_hidden_layers);
  positive("num_attention_heads", c.num_attention_heads);
  positive("num_key_value_heads", c.num_key_value_heads);
  positive("vocab_size", c.vocab_size);
  positive("max_position_embeddings", c.max_position_embeddings);
  if (c.hidden_size % c.num_attention_heads != 0) {
    r.error("num_attention_heads", fmt::format("must divide hidden_size {}", c.hidden_size));
  }
  if (c.head_dim() % 2 != 0) r.error("num_attention_heads", "must leave an even head_dim for rotary embeddings");
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    r.error("num_key_value_heads", fmt::format("must divide num_attention_heads {}", c.num_attention_heads));
  }
  if (c.rms_norm_eps <= 0) r.error("rms_norm_eps", "must be positive");
  if (c.rope_theta <= 0) r.error("rope_theta", "must be positive");
  if (c.initializer_range <= 0) r.error("initializer_range", "must be positive");
  return c;
}

json ModelConfig::to_hf_json() const {
  json j;
  j["architectures"] = json::array({"LlamaForCausalLM"});
  j["model_type"] = model_type;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["vocab_size"] = vocab_size;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = initializer_range;
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else {
    j["eos_token_id"] = eos_token_ids;
  }
  j["torch_dtype"] = "float32";
  return j;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t C = hidden_size, D = head_dim();
  const int64_t attn = C * num_attention_heads * D * 2 + C * num_key_value_heads * D * 2;
  const int64_t mlp = 3 * C * intermediate_size;
  const int64_t layer = attn + mlp + 2 * C;
  const int64_t embed = vocab_size * C;
  return embed + num_hidden_layers * layer + C + (tie_word_embeddings ? 0 : embed);
}

double ModelConfig::train_flops_per_token(int64_t T) const {
  // Matmul parameters: everything but the embedding lookup and norms (the head counts,
  // tied or not, since it is a matmul).
  const double C = double(hidden_size), D = double(head_dim());
  const double per_layer = C * double(num_attention_heads) * D * 2 + C * double(num_key_value_heads) * D * 2 +
                           3 * C * double(intermediate_size);
  const double matmul_params = double(num_hidden_layers) * per_layer + double(vocab_size) * C;
  // Causal attention: QK^T and PV, 2 FLOPs per multiply-add, averaged over positions
  // (T/2 keys on average), times 3 for forward + backward.
  const double attention = 3.0 * 2.0 * 2.0 * double(num_hidden_layers) * double(num_attention_heads) * D *
                           (double(T) + 1) / 2.0;
  return 6.0 * matmul_params + attention;
}

ModelConfig load_hf_config(const std::string& path) { return ModelConfig::from_hf_json(read_json_file(path), path); }

}  // namespace dstrain
