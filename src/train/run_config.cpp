#include "train/run_config.h"

#include <cmath>
#include <filesystem>

#include "core/error.h"

namespace dstrain {
namespace {

ModelConfig read_model(const JsonReader& top, const std::string& init_from) {
  if (!top.has("model")) {
    if (init_from.empty()) {
      top.error("model", "is missing: give an HF config.json path (\"model\": \"path/config.json\"), the fields "
                         "inline, or --init-from a Hugging Face directory");
    }
    const std::string path = (std::filesystem::path(init_from) / "config.json").string();
    DS_CHECK(std::filesystem::exists(path), "--init-from {}: no config.json there to take the architecture from",
             init_from);
    return load_hf_config(path);
  }
  const json& m = top.raw("model");
  if (m.is_string()) return load_hf_config(m.get<std::string>());
  if (!m.is_object()) top.error("model", "must be a path to an HF config.json or an object");
  if (!m.contains("hf_config")) return ModelConfig::from_hf_json(m, top.source() + " (model)");
  // {"hf_config": path, field: value, ...}: the file's fields with inline overrides.
  if (!m.at("hf_config").is_string()) top.error("model", "'hf_config' must be a path string");
  const std::string path = m.at("hf_config").get<std::string>();
  json merged = read_json_file(path);
  for (const auto& [k, v] : m.items()) {
    if (k != "hf_config") merged[k] = v;
  }
  return ModelConfig::from_hf_json(merged, path + " with overrides from " + top.source());
}

std::set<ParamKind> read_no_decay(const JsonReader& r, const std::string& key) {
  std::set<ParamKind> kinds;
  for (const std::string& name : r.get<std::vector<std::string>>(key)) {
    if (name == "norm") {
      kinds.insert(ParamKind::Norm);
    } else if (name == "embedding") {
      kinds.insert(ParamKind::Embedding);
    } else if (name == "lm_head") {
      kinds.insert(ParamKind::Head);
    } else if (name == "linear") {
      kinds.insert(ParamKind::Linear);
    } else {
      r.error(key, fmt::format("has \"{}\"; the kinds are norm, embedding, lm_head, linear", name));
    }
  }
  return kinds;
}

// DeepSpeed's names: "bf16": {"enabled"}, "fp16": {"enabled", "loss_scale", ...} (defaults as
// deepspeed/runtime/precision_config.py), "communication_data_type": "fp32" | "fp16" | "bf16"
// (unset: the compute dtype, as DeepSpeedEngine.communication_data_type).
PrecisionConfig read_precision(const JsonReader& r) {
  PrecisionConfig p;
  if (r.has("bf16") && !r.is_null("bf16")) {
    JsonReader b = r.child("bf16");
    p.bf16 = b.get<bool>("enabled", false);
    b.done();
  }
  if (r.has("fp16") && !r.is_null("fp16")) {
    JsonReader f = r.child("fp16");
    LossScalerConfig& s = p.fp16_scaler;
    p.fp16 = f.get<bool>("enabled", false);
    s.loss_scale = f.get<double>("loss_scale", s.loss_scale);
    s.initial_scale_power = f.get<int64_t>("initial_scale_power", s.initial_scale_power);
    s.loss_scale_window = f.get<int64_t>("loss_scale_window", s.loss_scale_window);
    s.hysteresis = f.get<int64_t>("hysteresis", s.hysteresis);
    s.consecutive_hysteresis = f.get<bool>("consecutive_hysteresis", s.consecutive_hysteresis);
    s.min_loss_scale = f.get<double>("min_loss_scale", s.min_loss_scale);
    if (!(s.loss_scale >= 0) || !std::isfinite(s.loss_scale)) {
      f.error("loss_scale", fmt::format("is {}; it must be 0 (dynamic loss scaling) or a positive static scale",
                                        s.loss_scale));
    }
    // The same bound as a dynamic scale's start: the scaled loss and its fp32 gradient seeds must
    // stay finite (fp32's maximum is 3.4e38), or every step overflows.
    if (s.loss_scale > std::ldexp(1.0, 100)) {
      f.error("loss_scale", fmt::format("is {:g}, above 2^100 ({:g}): every step's scaled gradients would overflow; "
                                        "use a scale of at most 2^100, or 0 for dynamic loss scaling",
                                        s.loss_scale, std::ldexp(1.0, 100)));
    }
    // The scale multiplies fp32 gradient seeds: 2^power must stay well inside fp32's range.
    if (s.initial_scale_power < 0 || s.initial_scale_power > 100) {
      f.error("initial_scale_power", fmt::format("is {}; the first scale is 2^power with power in [0, 100] (DeepSpeed's "
                                                 "default is 16)",
                                                 s.initial_scale_power));
    }
    if (s.loss_scale_window <= 0) f.error("loss_scale_window", "must be a positive number of steps");
    if (s.hysteresis <= 0) f.error("hysteresis", "must be >= 1 (overflows it takes to lower the scale)");
    if (!(s.min_loss_scale > 0) || !std::isfinite(s.min_loss_scale)) {
      f.error("min_loss_scale", fmt::format("is {}; it must be a positive number", s.min_loss_scale));
    }
    if (s.dynamic() && std::ldexp(1.0, int(s.initial_scale_power)) < s.min_loss_scale) {
      f.error("initial_scale_power", fmt::format("gives a first scale of 2^{} below min_loss_scale {}",
                                                 s.initial_scale_power, s.min_loss_scale));
    }
    f.done();
  }
  if (p.bf16 && p.fp16) {
    r.error("fp16", "and train.bf16 are both enabled; enable one of them (bf16 needs no loss scaling)");
  }
  p.communication_data_type = p.name();
  if (r.has("communication_data_type") && !r.is_null("communication_data_type")) {
    p.communication_data_type = r.get<std::string>("communication_data_type");
    if (p.communication_data_type != "fp32" && p.communication_data_type != "fp16" &&
        p.communication_data_type != "bf16") {
      r.error("communication_data_type", fmt::format("is \"{}\"; it must be \"fp32\", \"fp16\" or \"bf16\" (unset: "
                                                     "the compute precision)",
                                                     p.communication_data_type));
    }
  }
  return p;
}

ActivationCheckpointingConfig read_activation_checkpointing(const JsonReader& r) {
  ActivationCheckpointingConfig a;
  a.granularity = r.get<std::string>("granularity", a.granularity);
  if (a.granularity != "none" && a.granularity != "full" && a.granularity != "selective") {
    r.error("granularity", fmt::format("is \"{}\"; it must be \"none\", \"selective\" or \"full\"", a.granularity));
  }
  a.method = r.get<std::string>("method", a.method);
  if (a.method != "uniform" && a.method != "block") {
    r.error("method", fmt::format("is \"{}\"; it must be \"uniform\" (groups of num_layers layers, each recomputed "
                                  "as a unit) or \"block\" (the first num_layers layers of each pipeline chunk)",
                                  a.method));
  }
  a.num_layers = r.get<int64_t>("num_layers", a.num_layers);
  if (a.num_layers < 1) r.error("num_layers", fmt::format("is {}; it must be at least 1", a.num_layers));
  if (r.has("selective")) {
    if (a.granularity != "selective") {
      r.error("selective", fmt::format("names the parts of granularity \"selective\", but granularity is \"{}\"",
                                       a.granularity));
    }
    a.selective = r.get<std::vector<std::string>>("selective", a.selective);
    for (const std::string& part : a.selective) {
      if (part == "core_attn" || part == "layernorm" || part == "moe_act" || part == "mla_up_proj") continue;
      if (part == "mlp" || part == "moe" || part == "shared_experts") {
        r.error("selective", fmt::format("\"{}\" is not implemented yet; the parts are \"core_attn\", "
                                         "\"layernorm\", \"moe_act\" and \"mla_up_proj\"",
                                         part));
      }
      r.error("selective", fmt::format("\"{}\" is not a part; the parts are \"core_attn\", \"layernorm\", "
                                       "\"moe_act\" and \"mla_up_proj\" (Megatron-Core's recompute_modules names)",
                                       part));
    }
  }
  a.cpu_checkpointing = r.get<bool>("cpu_checkpointing", a.cpu_checkpointing);
  if (a.cpu_checkpointing && !a.full()) {
    r.error("cpu_checkpointing", fmt::format("keeps the inputs of recomputed layers in host memory, so it needs "
                                             "granularity \"full\", but granularity is \"{}\"",
                                             a.granularity));
  }
  r.done();
  return a;
}

ZeroConfig read_zero(const JsonReader& z) {
  ZeroConfig c;
  c.stage = z.get<int64_t>("stage", c.stage);
  if (c.stage < 0 || c.stage > 3) {
    z.error("stage", fmt::format("is {}; ZeRO stages are 0 (nothing sharded), 1 (optimizer state), 2 (and gradients) "
                                 "and 3 (and parameters)",
                                 c.stage));
  }
  auto positive = [&](const char* key, int64_t& v) {
    v = z.get<int64_t>(key, v);
    if (v <= 0) z.error(key, "must be positive (elements)");
  };
  positive("reduce_bucket_size", c.reduce_bucket_size);
  positive("allgather_bucket_size", c.allgather_bucket_size);
  positive("stage3_prefetch_bucket_size", c.stage3_prefetch_bucket_size);
  positive("stage3_max_live_parameters", c.stage3_max_live_parameters);
  c.stage3_param_persistence_threshold =
      z.get<int64_t>("stage3_param_persistence_threshold", c.stage3_param_persistence_threshold);
  if (c.stage3_param_persistence_threshold < 0) z.error("stage3_param_persistence_threshold", "must be >= 0 (elements)");
  c.overlap_comm = z.get<bool>("overlap_comm", c.overlap_comm);
  c.contiguous_gradients = z.get<bool>("contiguous_gradients", c.contiguous_gradients);
  auto offload = [&](const char* key, std::string& device, bool& pin) {
    if (!z.has(key) || z.is_null(key)) return;
    JsonReader o = z.child(key);
    device = o.get<std::string>("device", device);
    if (device != "none" && device != "cpu") {
      o.error("device", fmt::format("is \"{}\"; it must be \"none\" or \"cpu\" (NVMe offload is not implemented)",
                                    device));
    }
    pin = o.get<bool>("pin_memory", pin);
    o.done();
  };
  offload("offload_optimizer", c.offload_optimizer, c.offload_optimizer_pin_memory);
  offload("offload_param", c.offload_param, c.offload_param_pin_memory);
  if (c.offloads_optimizer() && c.stage == 0) {
    z.error("offload_optimizer", "needs a sharded optimizer: set zero_optimization.stage to 1, 2 or 3");
  }
  if (c.offloads_params() && c.stage != 3) {
    z.error("offload_param", fmt::format("needs stage 3 (parameters sharded at rest), not stage {}", c.stage));
  }
  if (c.offloads_params() && !c.offloads_optimizer()) {
    z.error("offload_param", "needs offload_optimizer.device \"cpu\" as well: the host masters are the parameters "
                             "at rest");
  }
  z.done();
  return c;
}

TrainConfig read_train(const JsonReader& r) {
  TrainConfig t;
  // 0 stands for "derive from the other two" inside TrainConfig only: a 0 or a negative number
  // written in the file is a mistake, and taking it as unset would train with another batch.
  auto batch_key = [&](const char* key) -> int64_t {
    if (r.is_null(key)) return 0;
    const int64_t v = r.get<int64_t>(key);
    if (v <= 0) {
      r.error(key, fmt::format("is {}; it must be a positive integer (leave it out, or set it to null, to derive it "
                               "from the other batch keys)",
                               v));
    }
    return v;
  };
  t.micro_batch = batch_key("train_micro_batch_size_per_gpu");
  t.grad_accum = batch_key("gradient_accumulation_steps");
  t.train_batch_size = batch_key("train_batch_size");
  if (t.micro_batch <= 0 && t.train_batch_size <= 0) {
    r.error("train_micro_batch_size_per_gpu", "or train_batch_size must be set to a positive number");
  }
  t.gradient_clipping = r.get<double>("gradient_clipping", 0.0);
  if (t.gradient_clipping < 0) r.error("gradient_clipping", "must be >= 0 (0 disables clipping)");
  if (r.has("optimizer")) {
    JsonReader o = r.child("optimizer");
    t.optimizer_type = o.get<std::string>("type");
    if (t.optimizer_type != "AdamW" && t.optimizer_type != "Adam") {
      o.error("type", fmt::format("is \"{}\"; dstrain implements AdamW (\"AdamW\", or \"Adam\" with adam_w_mode)",
                                  t.optimizer_type));
    }
    if (o.has("params")) {
      JsonReader p = o.child("params");
      t.adamw.lr = p.get<double>("lr", t.adamw.lr);
      if (p.has("betas")) {
        auto betas = p.get<std::vector<double>>("betas");
        if (betas.size() != 2) p.error("betas", "must hold two numbers [beta1, beta2]");
        t.adamw.beta1 = betas[0];
        t.adamw.beta2 = betas[1];
      }
      t.adamw.eps = p.get<double>("eps", t.adamw.eps);
      t.adamw.weight_decay = p.get<double>("weight_decay", t.adamw.weight_decay);
      if (!p.get<bool>("adam_w_mode", true)) {
        p.error("adam_w_mode", "false (L2-coupled Adam) is not implemented; use decoupled weight decay");
      }
      if (t.adamw.lr < 0) p.error("lr", "must be >= 0");
      if (t.adamw.beta1 < 0 || t.adamw.beta1 >= 1 || t.adamw.beta2 < 0 || t.adamw.beta2 >= 1) {
        p.error("betas", "must lie in [0, 1)");
      }
      if (t.adamw.eps <= 0) p.error("eps", "must be positive");
      p.done();
    }
    o.done();
  }
  if (r.has("no_weight_decay")) t.adamw.no_decay = read_no_decay(r, "no_weight_decay");
  if (r.has("scheduler")) t.schedule = LrSchedule::from_json(r.child("scheduler"));
  t.steps_per_print = r.get<int64_t>("steps_per_print", t.steps_per_print);
  if (t.steps_per_print <= 0) r.error("steps_per_print", "must be positive");
  t.max_steps = r.get<int64_t>("max_steps", t.max_steps);
  if (t.max_steps < 0) r.error("max_steps", "must be >= 0");
  t.epochs = r.get<double>("epochs", t.epochs);
  if (!(t.epochs >= 0) || !std::isfinite(t.epochs) || t.epochs > 1e6) {
    r.error("epochs", fmt::format("is {}; it must be a number of passes over the training data in [0, 1e6] (0: "
                                  "train.max_steps decides)",
                                  t.epochs));
  }
  const int64_t seed = r.get<int64_t>("seed", int64_t(t.seed));
  if (seed < 0) r.error("seed", "must be >= 0");
  t.seed = uint64_t(seed);
  t.mtp_loss_weight = r.get<double>("mtp_loss_weight", t.mtp_loss_weight);
  t.router_bias_update_rate = r.get<double>("router_bias_update_rate", t.router_bias_update_rate);
  if (t.mtp_loss_weight < 0) r.error("mtp_loss_weight", "must be >= 0");
  if (t.router_bias_update_rate < 0) r.error("router_bias_update_rate", "must be >= 0");
  t.micro_batch_schedule = r.get<std::string>("micro_batch_schedule", t.micro_batch_schedule);
  if (t.micro_batch_schedule != "grad_accumulation" && t.micro_batch_schedule != "all_forward_all_backward") {
    r.error("micro_batch_schedule", "must be \"grad_accumulation\" or \"all_forward_all_backward\" (pipeline schedules need "
            "pipeline stages)");
  }
  if (r.has("zero_optimization")) t.zero = read_zero(r.child("zero_optimization"));
  if (r.has("activation_checkpointing") && !r.is_null("activation_checkpointing")) {
    t.activation_checkpointing = read_activation_checkpointing(r.child("activation_checkpointing"));
  }
  t.precision = read_precision(r);
  if (r.has("gradient_sync") && !r.is_null("gradient_sync")) {
    t.gradient_sync = GradientSyncConfig::from_json(r.child("gradient_sync"));
    if (t.gradient_sync.async() && t.precision.fp16) {
      r.child("gradient_sync").error("mode", fmt::format("\"{}\" is not implemented with fp16 loss scaling (a replica's "
                                                         "overflow would have to stop every replica's step); use bf16",
                                                         t.gradient_sync.mode));
    }
  }
  t.eval_interval = r.get<int64_t>("eval_interval", t.eval_interval);
  t.eval_batches = r.get<int64_t>("eval_batches", t.eval_batches);
  if (t.eval_interval < 0) r.error("eval_interval", "must be >= 0");
  if (t.eval_batches <= 0) r.error("eval_batches", "must be positive");
  r.done();
  return t;
}

std::string hf_dtype_of(const PrecisionConfig& p) {
  return p.bf16 ? "bfloat16" : p.fp16 ? "float16" : "float32";
}

OutputConfig read_output(const JsonReader& r, const PrecisionConfig& precision) {
  OutputConfig o;
  o.dir = r.get<std::string>("dir", o.dir);
  o.save_hf = r.get<std::string>("save_hf", o.save_hf);
  o.save_hf_dtype = hf_dtype_of(precision);
  o.save_hf_shard_bytes = r.get<int64_t>("save_hf_shard_bytes", o.save_hf_shard_bytes);
  if (o.save_hf_shard_bytes < 1) r.error("save_hf_shard_bytes", "must be a positive number of bytes (default 5 GiB)");
  // hf_dtype is save_hf_dtype by a shorter name.
  if (r.has("hf_dtype") && r.has("save_hf_dtype")) {
    r.error("hf_dtype", "and save_hf_dtype are the same setting; give one of them");
  }
  const char* dtype_key = r.has("hf_dtype") ? "hf_dtype" : "save_hf_dtype";
  if (r.has(dtype_key) && !r.is_null(dtype_key)) {
    o.save_hf_dtype = r.get<std::string>(dtype_key);
    if (o.save_hf_dtype != "float32" && o.save_hf_dtype != "bfloat16" && o.save_hf_dtype != "float16" &&
        o.save_hf_dtype != "fp8") {
      r.error(dtype_key, fmt::format("is \"{}\"; it must be \"float32\", \"bfloat16\", \"float16\" or \"fp8\" "
                                     "(DeepSeek's block-scaled FP8; unset: the run's precision)",
                                     o.save_hf_dtype));
    }
  }
  o.hf_layout = r.get<std::string>("hf_layout", o.hf_layout);
  if (o.hf_layout != "standard" && o.hf_layout != "released") {
    r.error("hf_layout", fmt::format("is \"{}\"; it must be \"standard\" (transformers' layout) or \"released\" "
                                     "(DeepSeek's: MTP modules with their own embedding and head copies)",
                                     o.hf_layout));
  }
  if (r.has("hf_fp8_block")) {
    const json& b = r.raw("hf_fp8_block");
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1) {
      r.error("hf_fp8_block", fmt::format("is {}; it must be [rows, columns] of positive integers (default [128, "
                                          "128], DeepSeek-V3's)", b.dump()));
    }
    o.hf_fp8_block = {b[0].get<int64_t>(), b[1].get<int64_t>()};
  }
  r.done();
  return o;
}

GenerateConfig read_generate(const JsonReader& r) {
  GenerateConfig g;
  g.prompt = r.get<std::string>("prompt", g.prompt);
  g.max_new_tokens = r.get<int64_t>("max_new_tokens", g.max_new_tokens);
  g.temperature = r.get<double>("temperature", g.temperature);
  g.top_k = r.get<int64_t>("top_k", g.top_k);
  const int64_t seed = r.get<int64_t>("seed", 0);
  g.interval = r.get<int64_t>("interval", g.interval);
  if (g.max_new_tokens <= 0) r.error("max_new_tokens", fmt::format("is {}; it must be positive", g.max_new_tokens));
  // !(x >= 0) also catches nan, and a literal like 1e999 parses to inf.
  if (!(g.temperature >= 0) || !std::isfinite(g.temperature)) {
    r.error("temperature", fmt::format("is {}; it must be a finite number >= 0 (0 is greedy)", g.temperature));
  }
  if (g.top_k < 0) r.error("top_k", "must be >= 0 (0 is the whole vocabulary)");
  if (seed < 0) r.error("seed", "must be >= 0");
  if (g.interval < 0) r.error("interval", "must be >= 0");
  g.seed = uint64_t(seed);
  r.done();
  return g;
}

// Optional token dropping of the MoE layers (Megatron-Core's moe_expert_capacity_factor and
// moe_token_drop_policy): "capacity_factor" > 0, or null / absent for none (DeepSeek's
// default); "drop_policy" "probs" (default) or "position". Onto the model's runtime fields.
void read_moe(const JsonReader& r, ModelConfig& model) {
  if (!r.is_null("capacity_factor")) {
    const double f = r.get<double>("capacity_factor");
    if (!(f > 0) || !std::isfinite(f)) {
      r.error("capacity_factor", fmt::format("is {}; it must be a positive number (null or absent: no capacity, no "
                                             "token dropped)",
                                             f));
    }
    if (model.n_routed_experts <= 0) {
      r.error("capacity_factor", "is set, but the model has no routed experts (n_routed_experts)");
    }
    // An expert receives at most every token once, so from E / top-k on nothing can be dropped.
    if (f > double(model.n_routed_experts)) {
      r.error("capacity_factor", fmt::format("is {:g}, above n_routed_experts ({}): from n_routed_experts / "
                                             "num_experts_per_tok ({:g}) on no token can be dropped; use a factor in "
                                             "(0, {}], or null for no capacity",
                                             f, model.n_routed_experts,
                                             double(model.n_routed_experts) / double(std::max<int64_t>(1, model.num_experts_per_tok)),
                                             model.n_routed_experts));
    }
    model.moe_capacity_factor = f;
  }
  if (!r.is_null("drop_policy")) model.moe_drop_policy = r.get<std::string>("drop_policy");
  if (model.moe_drop_policy != "probs" && model.moe_drop_policy != "position") {
    r.error("drop_policy", fmt::format("is \"{}\"; it must be \"probs\" (keep each expert's largest routing "
                                       "weights) or \"position\" (keep its earliest tokens)",
                                       model.moe_drop_policy));
  }
  r.done();
}

}  // namespace

DType PrecisionConfig::communication_dtype() const {
  return communication_data_type == "bf16" ? DType::BF16 : communication_data_type == "fp16" ? DType::F16 : DType::F32;
}

void TrainConfig::resolve_batch(int64_t dp, const std::string& source) {
  auto fail = [&](const std::string& what) {
    throw Error(fmt::format("config error in {}: {} (train_batch_size = train_micro_batch_size_per_gpu x "
                            "gradient_accumulation_steps x {} data-parallel ranks)",
                            source, what, dp));
  };
  const bool has_mb = micro_batch > 0, has_ga = grad_accum > 0, has_tbs = train_batch_size > 0;
  if (has_tbs && has_mb && !has_ga) {
    if (train_batch_size % (micro_batch * dp)) fail(fmt::format("train_batch_size {} is not divisible by {} x {}",
                                                                train_batch_size, micro_batch, dp));
    grad_accum = train_batch_size / (micro_batch * dp);
  } else if (has_tbs && has_ga && !has_mb) {
    if (train_batch_size % (grad_accum * dp)) fail(fmt::format("train_batch_size {} is not divisible by {} x {}",
                                                               train_batch_size, grad_accum, dp));
    micro_batch = train_batch_size / (grad_accum * dp);
  } else if (has_tbs && !has_mb && !has_ga) {
    grad_accum = 1;
    if (train_batch_size % dp) fail(fmt::format("train_batch_size {} is not divisible by {}", train_batch_size, dp));
    micro_batch = train_batch_size / dp;
  } else if (!has_tbs) {
    if (!has_ga) grad_accum = 1;
  }
  const int64_t product = micro_batch * grad_accum * dp;
  if (has_tbs && has_mb && has_ga && product != train_batch_size) {
    fail(fmt::format("train_batch_size {} != {} x {} x {}", train_batch_size, micro_batch, grad_accum, dp));
  }
  if (micro_batch <= 0 || grad_accum <= 0) fail("the batch sizes must be positive");
  train_batch_size = product;
}

RunConfig RunConfig::load(const std::string& path, const std::vector<std::string>& overrides,
                          const std::string& init_from) {
  json root = read_json_file(path);
  for (const std::string& o : overrides) apply_override(root, o);
  const std::string source = overrides.empty() ? path : path + " (with --set overrides)";
  JsonReader top(root, "", source);
  RunConfig c;
  c.source = source;
  c.model = read_model(top, init_from);
  if (top.has("parallel")) c.parallel = ParallelConfig::from_json(top.child("parallel"));
  if (top.has("moe") && !top.is_null("moe")) read_moe(top.child("moe"), c.model);
  c.train = read_train(top.child("train"));
  // A part that has nothing to recompute in this model is refused, as Megatron-Core does: the
  // user asked for memory it cannot save.
  if (c.train.activation_checkpointing.selects("mla_up_proj") && !c.model.mla()) {
    top.child("train").child("activation_checkpointing").error(
        "selective", fmt::format("\"mla_up_proj\" forms Multi-head Latent Attention's heads again, but model_type "
                                 "\"{}\" has no MLA (deepseek_v2 and deepseek_v3 have it)",
                                 c.model.model_type));
  }
  c.data = DataConfig::from_json(top.child("data"));
  c.output.save_hf_dtype = hf_dtype_of(c.train.precision);
  if (top.has("output")) c.output = read_output(top.child("output"), c.train.precision);
  if (top.has("checkpoint")) c.checkpoint = CheckpointConfig::from_json(top.child("checkpoint"));
  if (c.checkpoint.dir.empty()) c.checkpoint.dir = (std::filesystem::path(c.output.dir) / "checkpoints").string();
  if (top.has("resilience")) c.resilience = ResilienceConfig::from_json(top.child("resilience"));
  if (top.has("metrics")) c.metrics = MetricsConfig::from_json(top.child("metrics"));
  if (top.has("generate")) c.generate = read_generate(top.child("generate"));
  if (top.has("device")) c.device = top.get<std::string>("device");
  if (c.device != "cpu" && c.device != "cuda") {
    top.error("device", fmt::format("is \"{}\"; it must be \"cpu\" or \"cuda\" (one GPU per rank)", c.device));
  }
  top.done();
  if (c.data.seq_len > c.model.max_position_embeddings) {
    throw Error(fmt::format("config error in {}: data.seq_len {} exceeds the model's max_position_embeddings {}",
                            source, c.data.seq_len, c.model.max_position_embeddings));
  }
  return c;
}

json RunConfig::to_json() const {
  json j;
  j["model"] = model.to_hf_json();
  json t;
  t["train_micro_batch_size_per_gpu"] = train.micro_batch;
  t["gradient_accumulation_steps"] = train.grad_accum;
  t["train_batch_size"] = train.train_batch_size;
  t["gradient_clipping"] = train.gradient_clipping;
  t["optimizer"] = {{"type", train.optimizer_type},
                    {"params",
                     {{"lr", train.adamw.lr},
                      {"betas", {train.adamw.beta1, train.adamw.beta2}},
                      {"eps", train.adamw.eps},
                      {"weight_decay", train.adamw.weight_decay}}}};
  json nd = json::array();
  for (ParamKind k : train.adamw.no_decay) nd.push_back(std::string(param_kind_name(k)));
  t["no_weight_decay"] = nd;
  t["scheduler"] = train.schedule.to_json();
  t["steps_per_print"] = train.steps_per_print;
  t["max_steps"] = train.max_steps;
  t["epochs"] = train.epochs;
  t["seed"] = train.seed;
  t["eval_interval"] = train.eval_interval;
  t["eval_batches"] = train.eval_batches;
  t["mtp_loss_weight"] = train.mtp_loss_weight;
  t["router_bias_update_rate"] = train.router_bias_update_rate;
  t["micro_batch_schedule"] = train.micro_batch_schedule;
  const ActivationCheckpointingConfig& ac = train.activation_checkpointing;
  t["activation_checkpointing"] = {{"granularity", ac.granularity},
                                    {"method", ac.method},
                                    {"num_layers", ac.num_layers},
                                    {"cpu_checkpointing", ac.cpu_checkpointing}};
  // The parts are only a key of granularity "selective" (the reader refuses them otherwise).
  if (ac.granularity == "selective") t["activation_checkpointing"]["selective"] = ac.selective;
  const ZeroConfig& z = train.zero;
  t["zero_optimization"] = {{"stage", z.stage},
                            {"reduce_bucket_size", z.reduce_bucket_size},
                            {"allgather_bucket_size", z.allgather_bucket_size},
                            {"overlap_comm", z.overlap_comm},
                            {"contiguous_gradients", z.contiguous_gradients},
                            {"offload_optimizer", {{"device", z.offload_optimizer}, {"pin_memory", z.offload_optimizer_pin_memory}}},
                            {"offload_param", {{"device", z.offload_param}, {"pin_memory", z.offload_param_pin_memory}}},
                            {"stage3_prefetch_bucket_size", z.stage3_prefetch_bucket_size},
                            {"stage3_param_persistence_threshold", z.stage3_param_persistence_threshold},
                            {"stage3_max_live_parameters", z.stage3_max_live_parameters}};
  const PrecisionConfig& p = train.precision;
  t["bf16"] = {{"enabled", p.bf16}};
  const LossScalerConfig& s = p.fp16_scaler;
  t["fp16"] = {{"enabled", p.fp16},
               {"loss_scale", s.loss_scale},
               {"initial_scale_power", s.initial_scale_power},
               {"loss_scale_window", s.loss_scale_window},
               {"hysteresis", s.hysteresis},
               {"consecutive_hysteresis", s.consecutive_hysteresis},
               {"min_loss_scale", s.min_loss_scale}};
  t["communication_data_type"] = p.communication_data_type;
  t["gradient_sync"] = train.gradient_sync.to_json();
  j["train"] = t;
  j["parallel"] = parallel.to_json();
  j["moe"] = {{"capacity_factor", model.moe_capacity_factor > 0 ? json(model.moe_capacity_factor) : json(nullptr)},
              {"drop_policy", model.moe_drop_policy}};
  j["data"] = data.to_json();
  j["output"] = {{"dir", output.dir}, {"save_hf", output.save_hf}, {"save_hf_dtype", output.save_hf_dtype},
                 {"save_hf_shard_bytes", output.save_hf_shard_bytes}, {"hf_layout", output.hf_layout},
                 {"hf_fp8_block", output.hf_fp8_block}};
  j["checkpoint"] = checkpoint.to_json();
  j["resilience"] = resilience.to_json();
  j["metrics"] = metrics.to_json();
  j["device"] = device;
  j["generate"] = {{"prompt", generate.prompt},           {"max_new_tokens", generate.max_new_tokens},
                   {"temperature", generate.temperature}, {"top_k", generate.top_k},
                   {"seed", generate.seed},               {"interval", generate.interval}};
  return j;
}

}  // namespace dstrain
