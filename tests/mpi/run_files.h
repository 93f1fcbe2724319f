// Shared by the MPI tests: a directory every rank agrees on, holding a token shard and a run
// configuration of a tiny model, and small helpers to compare runs.
#pragma once

#include <gtest/gtest.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "data/token_shard.h"
#include "train/run_config.h"
#include "train/trainer.h"

namespace dstrain {

class RunFiles {
 public:
  explicit RunFiles(int max_steps, const json& extra = json::object()) {
    int pid = ::getpid();
    MPI_Bcast(&pid, 1, MPI_INT, 0, MPI_COMM_WORLD);
    static int instance = 0;
    dir_ = std::filesystem::temp_directory_path() /
           ("dstrain_mpi_" + std::to_string(pid) + "_" + std::to_string(instance++));
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) {
      std::filesystem::create_directories(dir_);
      std::mt19937 rng(5);
      std::vector<uint32_t> tokens(4000);
      for (auto& t : tokens) t = rng() % 60;
      write_token_shard((dir_ / "train.bin").string(), tokens, 1);
      json model = {{"hidden_size", 32},         {"intermediate_size", 48},        {"num_hidden_layers", 2},
                    {"num_attention_heads", 4},  {"num_key_value_heads", 2},       {"vocab_size", 64},
                    {"max_position_embeddings", 32}, {"rms_norm_eps", 1e-5},       {"rope_theta", 10000.0},
                    {"tie_word_embeddings", false},  {"initializer_range", 0.1}};
      json run = {
          {"model", model},
          {"train",
           {{"train_batch_size", 8},
            {"train_micro_batch_size_per_gpu", 2},
            {"gradient_clipping", 1.0},
            {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 3e-3}, {"betas", {0.9, 0.95}}, {"weight_decay", 0.1}}}}},
            {"scheduler",
             {{"type", "WarmupCosineLR"},
              // Warm-up from 0.1 of the rate, not 0: a first step at lr 0 would move nothing, and
              // "3 steps" would test 2 updates.
              {"params",
               {{"total_num_steps", 20}, {"warmup_num_steps", 3}, {"warmup_type", "linear"}, {"warmup_min_ratio", 0.1}}}}},
            {"max_steps", max_steps},
            {"seed", 17},
            {"zero_optimization", {{"reduce_bucket_size", 3000}, {"overlap_comm", true}}}}},
          {"data", {{"train", (dir_ / "train.bin").string()}, {"seq_len", 16}, {"shuffle", true}}},
          {"output", {{"dir", (dir_ / "out").string()}}},
          {"checkpoint", {{"save_final", false}}}};
      run.merge_patch(extra);
      std::ofstream(dir_ / "run.json") << run.dump(2);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
  ~RunFiles() {
    MPI_Barrier(MPI_COMM_WORLD);
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    if (rank == 0) std::filesystem::remove_all(dir_);
  }
  RunConfig config(std::vector<std::string> overrides = {}) const {
    return RunConfig::load((dir_ / "run.json").string(), overrides);
  }
  // The configuration of a single-process reference (a ProcessGrid over MPI_COMM_SELF: every
  // rank trains the whole model alone, on the same global batches), in an output directory of
  // its rank's own.
  RunConfig solo_config(std::vector<std::string> overrides = {}) const {
    int rank = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    overrides.push_back("output.dir=" + json((dir_ / ("solo_rank" + std::to_string(rank))).string()).dump());
    return config(overrides);
  }
  std::filesystem::path dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
};

inline int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
inline int world_size() {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}
// A test that needs more ranks than some registrations give (tests/CMakeLists.txt leaves
// *MultiRank* suites out below 2 ranks, *FourRanks* ones except at 4 and *EightRanks* ones
// except at 8) asserts it: run
// elsewhere by hand, it fails instead of passing without testing anything.
#define DSTRAIN_REQUIRE_RANKS(condition, what) \
  ASSERT_TRUE(condition) << "this test needs " << (what) << " ranks; it runs at " << world_size()

// A path as a JSON string, for --set style overrides.
inline std::string quoted(const std::filesystem::path& p) { return json(p.string()).dump(); }

// The first k ranks of the world, or MPI_COMM_NULL on the others (collective over the world).
inline MPI_Comm first_ranks(int k) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm c;
  MPI_Comm_split(MPI_COMM_WORLD, rank < k ? 0 : MPI_UNDEFINED, rank, &c);
  return c;
}

// A small DeepSeek-V3-style model: MLA with q LoRA and YaRN, sigmoid/noaux_tc routing over
// groups, a shared expert, a dense first layer and one MTP module.
inline json v3_model() {
  return {{"model",
           {{"model_type", "deepseek_v3"},
            {"hidden_size", 32},
            {"intermediate_size", 48},
            {"num_hidden_layers", 2},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 4},
            {"vocab_size", 64},
            {"max_position_embeddings", 64},
            {"q_lora_rank", 16},
            {"kv_lora_rank", 16},
            {"qk_nope_head_dim", 8},
            {"qk_rope_head_dim", 8},
            {"v_head_dim", 8},
            {"rope_scaling",
             {{"type", "yarn"}, {"factor", 2.0}, {"original_max_position_embeddings", 16}, {"mscale", 1.0},
              {"mscale_all_dim", 1.0}, {"beta_fast", 32}, {"beta_slow", 1}}},
            {"n_routed_experts", 8},
            {"n_shared_experts", 1},
            {"num_experts_per_tok", 2},
            {"moe_intermediate_size", 16},
            {"first_k_dense_replace", 1},
            {"n_group", 2},
            {"topk_group", 1},
            {"topk_method", "noaux_tc"},
            {"scoring_func", "sigmoid"},
            {"norm_topk_prob", true},
            {"routed_scaling_factor", 2.5},
            {"aux_loss_alpha", 0.01},
            {"seq_aux", true},
            {"num_nextn_predict_layers", 1},
            {"initializer_range", 0.1}}},
          {"train", {{"router_bias_update_rate", 0.01}, {"mtp_loss_weight", 0.3}}}};
}

// v3_model() made DeepSeek-V2: MLA without q LoRA or YaRN, softmax routing with group-limited
// greedy top-k, no MTP; no "train" part.
inline json v2_model() {
  json run = v3_model();
  run["model"].merge_patch({{"model_type", "deepseek_v2"},
                            {"rope_scaling", nullptr},
                            {"topk_method", "group_limited_greedy"},
                            {"scoring_func", "softmax"},
                            {"norm_topk_prob", false},
                            {"routed_scaling_factor", 1.0},
                            {"num_nextn_predict_layers", nullptr}});
  run["model"]["q_lora_rank"] = nullptr;  // merge_patch removes null keys; V2 states it
  run.erase("train");
  return run;
}

// n token ids in [0, vocab), uniformly from a seeded generator.
inline std::vector<int32_t> random_tokens(size_t n, int vocab, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> d(0, vocab - 1);
  std::vector<int32_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// The largest difference between a and b relative to b's largest magnitude.
// The largest weight difference (over the largest weight) two layouts of one run may show after a
// few steps: their sums go in other orders, and AdamW passes the last bits on. One step of the
// test configuration's learning rate moves a weight by about 1e-2 of the largest, so a lost or
// doubled update is 200 times this.
inline constexpr double kLayoutWeightTolerance = 5e-5;

inline double rel_error(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// The same for whole vectors; infinite when their sizes differ.
inline double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() ? rel_error(a.data(), b.data(), int64_t(a.size())) : INFINITY;
}

// Every step of `t` against the reference run's: the loss, its CE, MTP and auxiliary parts and
// the gradient norm within 1e-5, and the expert loads equal.
inline void expect_same_steps(const Trainer& ref, const Trainer& t, const std::string& what) {
  ASSERT_EQ(ref.history().size(), t.history().size()) << what;
  for (size_t i = 0; i < ref.history().size(); ++i) {
    const StepRecord &a = t.history()[i], &b = ref.history()[i];
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * std::fabs(b.loss)) << what << ": loss of step " << i + 1;
    EXPECT_NEAR(a.ce_loss, b.ce_loss, 1e-5 * std::fabs(b.ce_loss)) << what << ": CE loss of step " << i + 1;
    EXPECT_NEAR(a.mtp_loss, b.mtp_loss, 1e-5 * std::fabs(b.mtp_loss)) << what << ": MTP loss of step " << i + 1;
    EXPECT_NEAR(a.aux_loss, b.aux_loss, 1e-5 * std::fabs(b.aux_loss) + 1e-12) << what << ": aux loss";
    EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-5 * b.grad_norm) << what << ": gradient norm of step " << i + 1;
    ASSERT_EQ(a.moe.size(), b.moe.size()) << what;
    for (size_t l = 0; l < a.moe.size(); ++l) {
      EXPECT_EQ(a.moe[l].tokens, b.moe[l].tokens) << what << ": expert loads of layer " << a.moe[l].layer;
    }
  }
}

// A host F32 tensor's values.
inline std::vector<float> values(Tensor t) { return std::vector<float>(t.data<float>(), t.data<float>() + t.numel()); }

// The `block` object ("pipeline", "tensor_parallel", ...) of the last line of a run's
// metrics.jsonl that has one, at the top level or under "extra"; null when no line has it.
inline json last_metrics_block(const std::filesystem::path& metrics_jsonl, const std::string& block) {
  std::ifstream in(metrics_jsonl);
  std::string line, last;
  while (std::getline(in, line)) {
    if (line.find("\"" + block + "\"") != std::string::npos) last = line;
  }
  if (last.empty()) return nullptr;
  const json j = json::parse(last);
  return j.contains(block) ? j[block] : j["extra"][block];
}

inline uint64_t checksum(const void* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

}  // namespace dstrain
