// The run configuration: one JSON file with "model", "train", "data", "output" and
// "generate" parts ("moe", token dropping, goes onto the model's runtime fields). "train" uses
// DeepSpeed's ds_config key names wherever a feature maps.
// Every key is validated; unknown keys are errors; command-line --set overrides any key.
#pragma once

#include <algorithm>

#include <optional>
#include <string>
#include <vector>

#include "comm/grid.h"
#include "core/json_reader.h"
#include "data/data_pipeline.h"
#include "model/model_config.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "optim/distributed_optimizer.h"
#include "optim/gradient_sync.h"
#include "optim/lr_schedule.h"
#include "train/checkpointing.h"
#include "train/metrics.h"
#include "train/resilience.h"

namespace dstrain {

// Mixed precision (DeepSpeed's "bf16", "fp16" and "communication_data_type" keys of the
// train section): fp32 master weights, gradients and optimizer state always; the forward and
// backward compute in bf16 or fp16 when enabled.
struct PrecisionConfig {
  bool bf16 = false;
  bool fp16 = false;
  LossScalerConfig fp16_scaler;  // the rest of the "fp16" block
  // The dtype of the data-parallel gradient all-reduce: "fp32", "fp16" or "bf16". Unset in the
  // file: DeepSpeed's default, the compute dtype.
  std::string communication_data_type = "fp32";

  DType compute_dtype() const { return bf16 ? DType::BF16 : fp16 ? DType::F16 : DType::F32; }
  DType communication_dtype() const;
  std::string name() const { return bf16 ? "bf16" : fp16 ? "fp16" : "fp32"; }
};

// train.activation_checkpointing: DeepSpeed's section name with Megatron-Core's choices.
// granularity "full" recomputes whole decoder layers (model/transformer.h, RecomputePolicy):
// method "uniform" in groups of num_layers, "block" the first num_layers of each pipeline chunk.
// granularity "selective" recomputes the parts `selective` names (Megatron-Core's
// recompute_modules): "core_attn" (kept by no path: the fused attention forms its scores again
// anyway), "layernorm", "moe_act", "mla_up_proj" (MLA models only: an error otherwise).
// cpu_checkpointing (DeepSpeed's key; granularity "full" only) keeps the recomputed layers'
// inputs in host memory until their replay.
struct ActivationCheckpointingConfig {
  std::string granularity = "none";  // "none", "selective" or "full"
  std::string method = "uniform";    // "uniform" or "block"
  int64_t num_layers = 1;
  std::vector<std::string> selective = {"core_attn"};
  bool cpu_checkpointing = false;
  bool full() const { return granularity == "full"; }
  // Full recomputation of every layer on its own (what the out-of-memory fallback turns on).
  void set_full() {
    granularity = "full";
    method = "uniform";
    num_layers = 1;
  }
  bool selects(const std::string& part) const {
    return granularity == "selective" && std::find(selective.begin(), selective.end(), part) != selective.end();
  }
};

struct TrainConfig {
  // DeepSpeed: train_batch_size = micro_batch * gradient_accumulation_steps * data-parallel
  // ranks; any two determine the third (resolved once the rank count is known).
  int64_t micro_batch = 0;          // train_micro_batch_size_per_gpu
  int64_t grad_accum = 0;           // gradient_accumulation_steps
  int64_t train_batch_size = 0;     // train_batch_size
  double gradient_clipping = 0.0;   // 0: no clipping
  std::string optimizer_type = "AdamW";
  AdamWConfig adamw;
  LrSchedule schedule;
  int64_t steps_per_print = 10;
  int64_t max_steps = 0;
  // Passes over the training data (Hugging Face Trainer's num_train_epochs), when max_steps is
  // 0: the trainer sets max_steps to ceil(epochs x the training datasets' samples per epoch /
  // train_batch_size). A max_steps (or --max-steps) given too decides, as in the HF Trainer.
  double epochs = 0;
  uint64_t seed = 1234;
  int64_t eval_interval = 0;        // steps between evaluations, 0: none during training
  int64_t eval_batches = 8;         // micro-batches of validation windows per evaluation
  double mtp_loss_weight = 0.3;          // lambda of the multi-token prediction loss (DeepSeek-V3)
  double router_bias_update_rate = 0.001;  // gamma of the auxiliary-loss-free balancing (noaux_tc)
  // The order of the micro-batches' forwards and backwards (distributed/schedule.h):
  // "grad_accumulation" (F0 B0 F1 B1 ...) or "all_forward_all_backward" (every forward first).
  std::string micro_batch_schedule = "grad_accumulation";
  // DeepSpeed's zero_optimization block (distributed/zero.h); stage 0 replicates everything.
  ZeroConfig zero;
  // Aggregation between replicas: synchronous, delayed, local SGD, DiLoCo (optim/gradient_sync.h).
  GradientSyncConfig gradient_sync;
  ActivationCheckpointingConfig activation_checkpointing;
  PrecisionConfig precision;

  // Fills micro_batch / grad_accum / train_batch_size for `dp` data-parallel ranks.
  void resolve_batch(int64_t dp, const std::string& source);
};

struct OutputConfig {
  std::string dir = "runs/default";
  std::string save_hf;  // Hugging Face directory written at the end ("" = none)
  // The dtype of the Hugging Face tensors: "float32", "bfloat16" or "float16" (torch_dtype's
  // spelling), or "fp8": DeepSeek's block-scaled FP8 (io/hf_weights.h HFSaveOptions). Unset in
  // the file: the run's precision. `hf_dtype` in the file is the same key.
  std::string save_hf_dtype = "float32";
  // Tensor bytes per safetensors file of the export (transformers' max_shard_size; 5 GB).
  int64_t save_hf_shard_bytes = int64_t(5) << 30;
  // "standard": transformers' layout; "released": DeepSeek's, whose MTP modules carry copies of
  // the embedding and the output head.
  std::string hf_layout = "standard";
  std::vector<int64_t> hf_fp8_block = {128, 128};  // FP8: rows x columns sharing a scale
};

struct GenerateConfig {
  std::string prompt = "";
  int64_t max_new_tokens = 64;
  double temperature = 1.0;  // 0: greedy
  int64_t top_k = 0;         // 0: whole vocabulary
  uint64_t seed = 0;
  int64_t interval = 0;      // steps between samples during training, 0: none
};

struct RunConfig {
  ModelConfig model;
  ParallelConfig parallel;
  TrainConfig train;
  DataConfig data;
  OutputConfig output;
  CheckpointConfig checkpoint;  // its dir defaults to output.dir/checkpoints
  ResilienceConfig resilience;
  MetricsConfig metrics;
  GenerateConfig generate;
  // Where the model trains: "cpu" (the default) or "cuda" (one GPU per rank, chosen by the
  // node-local rank; builds with -DDSTRAIN_CUDA=ON).
  std::string device = "cpu";
  std::string source;  // the file it came from

  // Reads `path`, applies "key=value" overrides, validates everything. When the file has
  // no "model" part, the architecture comes from `init_from`/config.json.
  static RunConfig load(const std::string& path, const std::vector<std::string>& overrides,
                        const std::string& init_from = "");
  json to_json() const;  // the resolved configuration, printed at start
};

}  // namespace dstrain
