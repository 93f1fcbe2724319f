#include "model/model_config.h"

#include <cmath>

#include "core/error.h"

namespace dstrain {

ModelConfig ModelConfig::from_hf_json(const json& j, const std::string& source) {
  JsonReader r(j, "", source);
  ModelConfig c;
  c.model_type = r.get<std::string>("model_type", c.model_type);
  if (c.model_type != "llama" && c.model_type != "deepseek_v2" && c.model_type != "deepseek_v3") {
    r.error("model_type", fmt::format("is \"{}\"; dstrain trains \"llama\" (DeepSeek-LLM), \"deepseek_v2\" and "
                                      "\"deepseek_v3\"",
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

  if (c.mla()) {
    c.q_lora_rank = r.is_null("q_lora_rank") ? 0 : r.get<int64_t>("q_lora_rank");
    c.kv_lora_rank = r.get<int64_t>("kv_lora_rank");
    c.qk_nope_head_dim = r.get<int64_t>("qk_nope_head_dim");
    c.qk_rope_head_dim = r.get<int64_t>("qk_rope_head_dim");
    c.v_head_dim = r.get<int64_t>("v_head_dim");
    if (!r.is_null("rope_scaling")) {
      JsonReader y = r.child("rope_scaling");
      c.rope_scaling.type = y.get<std::string>("type", "");
      if (c.rope_scaling.type.empty()) c.rope_scaling.type = y.get<std::string>("rope_type", "");
      y.allow({"rope_type", "type"});
      if (c.rope_scaling.type != "yarn") y.error("type", "must be \"yarn\" (the scaling DeepSeek-V2/V3 use)");
      c.rope_scaling.factor = y.get<double>("factor");
      c.rope_scaling.original_max_position_embeddings = y.get<int64_t>("original_max_position_embeddings");
      c.rope_scaling.beta_fast = y.get<double>("beta_fast", c.rope_scaling.beta_fast);
      c.rope_scaling.beta_slow = y.get<double>("beta_slow", c.rope_scaling.beta_slow);
      c.rope_scaling.mscale = y.get<double>("mscale", c.rope_scaling.mscale);
      c.rope_scaling.mscale_all_dim = y.get<double>("mscale_all_dim", c.rope_scaling.mscale_all_dim);
      if (c.rope_scaling.factor <= 0) y.error("factor", "must be positive");
      if (c.rope_scaling.original_max_position_embeddings <= 0) {
        y.error("original_max_position_embeddings", "must be positive");
      }
      y.done();
    }
    c.n_routed_experts = r.is_null("n_routed_experts") ? 0 : r.get<int64_t>("n_routed_experts");
    if (c.n_routed_experts > 0) {
      c.n_shared_experts = r.is_null("n_shared_experts") ? 0 : r.get<int64_t>("n_shared_experts");
      c.num_experts_per_tok = r.get<int64_t>("num_experts_per_tok");
      c.moe_intermediate_size = r.get<int64_t>("moe_intermediate_size");
      c.first_k_dense_replace = r.get<int64_t>("first_k_dense_replace", 0);
      c.moe_layer_freq = r.get<int64_t>("moe_layer_freq", 1);
      c.routed_scaling_factor = r.get<double>("routed_scaling_factor", 1.0);
      c.scoring_func = r.get<std::string>("scoring_func", c.model_type == "deepseek_v3" ? "sigmoid" : "softmax");
      c.topk_method = r.get<std::string>("topk_method", c.model_type == "deepseek_v3" ? "noaux_tc" : "greedy");
      if (c.topk_method == "gready") c.topk_method = "greedy";  // the spelling some DeepSeek configs ship
      c.n_group = r.is_null("n_group") ? 1 : r.get<int64_t>("n_group");
      c.topk_group = r.is_null("topk_group") ? 1 : r.get<int64_t>("topk_group");
      c.norm_topk_prob = r.get<bool>("norm_topk_prob", false);
      c.aux_loss_alpha = r.get<double>("aux_loss_alpha", 0.0);
      c.seq_aux = r.get<bool>("seq_aux", true);
      if (c.scoring_func != "softmax" && c.scoring_func != "sigmoid") {
        r.error("scoring_func", "must be \"softmax\" (V2) or \"sigmoid\" (V3)");
      }
      if (c.topk_method != "greedy" && c.topk_method != "group_limited_greedy" && c.topk_method != "noaux_tc") {
        r.error("topk_method", "must be \"greedy\" (or \"gready\"), \"group_limited_greedy\" or \"noaux_tc\"");
      }
      if (c.num_experts_per_tok < 1 || c.num_experts_per_tok > c.n_routed_experts) {
        r.error("num_experts_per_tok", fmt::format("must lie in [1, n_routed_experts = {}]", c.n_routed_experts));
      }
      if (c.moe_intermediate_size <= 0) r.error("moe_intermediate_size", "must be positive");
      if (c.moe_layer_freq < 1) r.error("moe_layer_freq", "must be >= 1");
      if (c.n_shared_experts < 0) r.error("n_shared_experts", "must be >= 0");
      if (c.n_group < 1 || c.n_routed_experts % c.n_group != 0) {
        r.error("n_group", fmt::format("must divide n_routed_experts = {}", c.n_routed_experts));
      }
      if (c.topk_group < 1 || c.topk_group > c.n_group) r.error("topk_group", "must lie in [1, n_group]");
      if (c.topk_method == "noaux_tc" && c.n_routed_experts / c.n_group < 2) {
        r.error("n_group", "leaves fewer than 2 experts per group; noaux_tc scores a group by its top 2");
      }
      if (c.topk_method != "greedy" && c.num_experts_per_tok > c.topk_group * (c.n_routed_experts / c.n_group)) {
        r.error("num_experts_per_tok", "exceeds the experts of the topk_group groups kept");
      }
    } else {
      r.allow({"n_shared_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
               "moe_layer_freq", "routed_scaling_factor", "scoring_func", "topk_method", "n_group", "topk_group",
               "norm_topk_prob", "aux_loss_alpha", "seq_aux"});
    }
    c.num_nextn_predict_layers = r.get<int64_t>("num_nextn_predict_layers", 0);
    if (c.num_nextn_predict_layers < 0) r.error("num_nextn_predict_layers", "must be >= 0");
    if (c.kv_lora_rank <= 0 || c.qk_rope_head_dim <= 0 || c.qk_rope_head_dim % 2 || c.v_head_dim <= 0 ||
        c.qk_nope_head_dim < 0) {
      r.error("kv_lora_rank", "and qk_nope_head_dim, qk_rope_head_dim (even), v_head_dim must be positive");
    }
    // Parallelism and storage settings of DeepSeek's own code: no effect on the computation.
    r.allow({"ep_size", "quantization_config"});
  }

  // Fields that would change the computation: only the values DeepSeek-LLM uses are accepted.
  if (r.get<std::string>("hidden_act", "silu") != "silu") r.error("hidden_act", "must be \"silu\" (SwiGLU MLP)");
  if (r.get<bool>("attention_bias", false)) r.error("attention_bias", "must be false: projections have no bias");
  if (r.get<bool>("mlp_bias", false)) r.error("mlp_bias", "must be false: projections have no bias");
  if (r.get<double>("attention_dropout", 0.0) != 0.0) r.error("attention_dropout", "must be 0 (no dropout)");
  if (!c.mla() && !r.is_null("rope_scaling")) {
    r.error("rope_scaling", "must be null for the DeepSeek-LLM architecture");
  }
  if (!c.mla() && r.has("head_dim") && !r.is_null("head_dim") && r.get<int64_t>("head_dim") != c.head_dim()) {
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
  if (!c.mla() && c.hidden_size % c.num_attention_heads != 0) {
    r.error("num_attention_heads", fmt::format("must divide hidden_size {}", c.hidden_size));
  }
  if (!c.mla() && c.head_dim() % 2 != 0) {
    r.error("num_attention_heads", "must leave an even head_dim for rotary embeddings");
  }
  if (c.mla() && c.num_key_value_heads != c.num_attention_heads) {
    r.error("num_key_value_heads", "must equal num_attention_heads: MLA gives every head its own keys");
  }
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
  j["architectures"] = json::array({model_type == "deepseek_v2"   ? "DeepseekV2ForCausalLM"
                                    : model_type == "deepseek_v3" ? "DeepseekV3ForCausalLM"
                                                                  : "LlamaForCausalLM"});
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
  if (mla()) {
    j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
    j["kv_lora_rank"] = kv_lora_rank;
    j["qk_nope_head_dim"] = qk_nope_head_dim;
    j["qk_rope_head_dim"] = qk_rope_head_dim;
    j["v_head_dim"] = v_head_dim;
    if (rope_scaling.yarn()) {
      j["rope_scaling"] = {{"type", "yarn"},
                           {"factor", rope_scaling.factor},
                           {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings},
                           {"beta_fast", rope_scaling.beta_fast},
                           {"beta_slow", rope_scaling.beta_slow},
                           {"mscale", rope_scaling.mscale},
                           {"mscale_all_dim", rope_scaling.mscale_all_dim}};
    }
    j["n_routed_experts"] = n_routed_experts > 0 ? json(n_routed_experts) : json(nullptr);
    if (n_routed_experts > 0) {
      j["n_shared_experts"] = n_shared_experts > 0 ? json(n_shared_experts) : json(nullptr);
      j["num_experts_per_tok"] = num_experts_per_tok;
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["first_k_dense_replace"] = first_k_dense_replace;
      j["moe_layer_freq"] = moe_layer_freq;
      j["routed_scaling_factor"] = routed_scaling_factor;
      j["scoring_func"] = scoring_func;
      j["topk_method"] = topk_method;
      j["n_group"] = n_group;
      j["topk_group"] = topk_group;
      j["norm_topk_prob"] = norm_topk_prob;
      j["aux_loss_alpha"] = aux_loss_alpha;
      j["seq_aux"] = seq_aux;
    }
    j["num_nextn_predict_layers"] = num_nextn_predict_layers;
  }
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

namespace {
// Parameters of one decoder layer's attention (matrices and norms).
int64_t attention_params(const ModelConfig& c) {
  const int64_t C = c.hidden_size, H = c.num_attention_heads;
  if (!c.mla()) {
    const int64_t D = c.head_dim();
    return C * H * D * 2 + C * c.num_key_value_heads * D * 2;
  }
  const int64_t q = c.q_lora_rank > 0 ? C * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * H * c.qk_head_dim()
                                      : C * H * c.qk_head_dim();
  const int64_t kv = C * (c.kv_lora_rank + c.qk_rope_head_dim) + c.kv_lora_rank +
                     c.kv_lora_rank * H * (c.qk_nope_head_dim + c.v_head_dim);
  return q + kv + H * c.v_head_dim * C;
}
// Parameters of layer `l`'s feed-forward part, all experts, and those one token uses.
std::pair<int64_t, int64_t> ffn_params(const ModelConfig& c, int64_t l) {
  const int64_t C = c.hidden_size;
  if (!c.is_moe_layer(l)) return {3 * C * c.intermediate_size, 3 * C * c.intermediate_size};
  const int64_t expert = 3 * C * c.moe_intermediate_size;
  const int64_t shared = c.n_shared_experts * expert, gate = c.n_routed_experts * C;
  const int64_t bias = c.topk_method == "noaux_tc" ? c.n_routed_experts : 0;
  return {c.n_routed_experts * expert + shared + gate + bias,
          c.num_experts_per_tok * expert + shared + gate};
}
}  // namespace

double ModelConfig::softmax_scale() const {
  if (!mla()) return 1.0 / std::sqrt(double(head_dim()));
  double s = 1.0 / std::sqrt(double(qk_head_dim()));
  if (rope_scaling.yarn() && rope_scaling.mscale_all_dim != 0 && rope_scaling.factor > 1) {
    const double m = 0.1 * rope_scaling.mscale_all_dim * std::log(rope_scaling.factor) + 1.0;
    s *= m * m;
  }
  return s;
}

int64_t ModelConfig::num_parameters() const {
  const int64_t C = hidden_size;
  const int64_t embed = vocab_size * C;
  int64_t total = embed + C + (tie_word_embeddings ? 0 : embed);
  // The main layers, then the multi-token prediction modules (each a layer plus its norms and
  // projection; embedding and head are shared).
  for (int64_t l = 0; l < num_hidden_layers + num_nextn_predict_layers; ++l) {
    total += attention_params(*this) + ffn_params(*this, l).first + 2 * C;
    if (l >= num_hidden_layers) total += 2 * C * C + 3 * C;
  }
  return total;
}

double ModelConfig::train_flops_per_token(int64_t T) const {
  // Matmul parameters a token passes through: everything but the embedding lookup and norms
  // (the head counts, tied or not), routed experts only as many as a token is sent to.
  const double C = double(hidden_size);
  double matmul = double(vocab_size) * C;
  const int64_t layers = num_hidden_layers + num_nextn_predict_layers;
  for (int64_t l = 0; l < layers; ++l) {
    matmul += double(attention_params(*this) + ffn_params(*this, l).second);
    if (l >= num_hidden_layers) matmul += 2 * C * C + double(vocab_size) * C;  // eh_proj and the shared head
  }
  // Causal attention: QK^T and PV, 2 FLOPs per multiply-add, over (T+1)/2 keys on average,
  // times 3 for forward and backward.
  const double qk = double(mla() ? qk_head_dim() : head_dim()), v = double(mla() ? v_head_dim : head_dim());
  const double attention = 3.0 * 2.0 * double(layers) * double(num_attention_heads) * (qk + v) * (double(T) + 1) / 2.0;
  return 6.0 * matmul + attention;
}

ModelConfig load_hf_config(const std::string& path) { return ModelConfig::from_hf_json(read_json_file(path), path); }

}  // namespace dstrain
