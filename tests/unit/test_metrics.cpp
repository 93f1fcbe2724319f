// Metrics arithmetic: model FLOPs per token and MFU against a hand-computed example, and the
// Prometheus text and summary table of a step, MoE routing health included.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "train/metrics.h"

namespace dstrain {
namespace {

using ::testing::ContainsRegex;

ModelConfig small() {
  ModelConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 128;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 100;
  return c;
}

TEST(Metrics, ModelFlopsAndMfuAgainstAHandComputedExample) {
  // Per layer: q and o 64x64 each, k and v 64x32 each, gate/up/down 3x64x128 = 36864 matmul
  // parameters; 2 layers plus the 100x64 head = 80128. 6 x 80128 = 480768. Attention at T=32:
  // 3 (fwd+bwd) x 2 FLOP x 2 layers x 4 heads x (16 + 16) dims x 33/2 keys = 25344.
  const ModelConfig c = small();
  EXPECT_DOUBLE_EQ(c.train_flops_per_token(32), 480768.0 + 25344.0);
  // 1000 tokens/s over 2 ranks against a peak of 1 GFLOP/s per rank: 253.056 MFLOP/s per rank.
  const Utilisation u = utilisation(1000.0, c.train_flops_per_token(32), 2, 1e9);
  EXPECT_DOUBLE_EQ(u.model_flops_per_s, 253056000.0);
  EXPECT_DOUBLE_EQ(u.mfu, 0.253056);
  EXPECT_EQ(utilisation(1000.0, 1.0, 1, 0.0).mfu, 0.0) << "no peak, no MFU";
}

TEST(Metrics, StepRecordAndPrometheusTextOfAStep) {
  MetricsConfig mc;
  mc.peak_tflops = 1.0;
  mc.progress = "lines";
  Metrics m(mc, small(), 32, /*rank=*/1, /*world=*/2, /*local=*/2, "/nonexistent", 10);  // rank 1: writes nothing
  StepMetrics s;
  s.step = 3;
  s.max_steps = 10;
  s.loss = 2.5;
  s.tokens_per_s = 2000;
  s.time = {1.0, 0.1, 0.3, 0.4, 0.05, 0.05, 0.02};
  s.rank_step_s = {1.0, 1.2};
  s.rank_compute_s = {0.9, 0.95};
  s.rank_peak_rss_bytes = {1e8, 2e8};
  const json r = m.step_record(s);
  EXPECT_EQ(r["slowest_rank"], 1);
  EXPECT_DOUBLE_EQ(r["step_time_max_s"].get<double>(), 1.2);
  EXPECT_DOUBLE_EQ(r["peak_rss_bytes"].get<double>(), 2e8);
  EXPECT_NEAR(r["time_s"]["other"].get<double>(), 0.08, 1e-12);
  EXPECT_DOUBLE_EQ(r["mfu"].get<double>(), 2000.0 * small().train_flops_per_token(32) / 2 / 1e12);
  const std::string text = m.prometheus_text();
  EXPECT_NE(text.find("# TYPE dstrain_memory_bytes gauge"), std::string::npos);
  EXPECT_NE(text.find("dstrain_peak_flops 1000000000000"), std::string::npos) << text;
}

// Routing health of a MoE model reaches the metrics file and the Prometheus text, per layer.
TEST(Metrics, RoutingHealthPerMoELayer) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("dstrain_metrics_moe_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  MetricsConfig mc;
  mc.progress = "lines";
  std::string text;
  {
    Metrics m(mc, small(), 32, /*rank=*/0, /*world=*/1, /*local=*/1, dir.string(), 10);
    StepMetrics s;
    s.step = 1;
    s.max_steps = 10;
    s.loss = 2.5;
    s.tokens_per_s = 2000;
    s.time = {1.0, 0.1, 0.3, 0.4, 0.05, 0.05, 0.02};
    s.rank_step_s = {1.0};
    s.rank_compute_s = {0.9};
    s.rank_peak_rss_bytes = {1e8};
    s.extra["moe_route_s"] = 0.03;
    s.extra["moe_permute_s"] = 0.02;
    s.extra["moe"] = {{"1", {{"max_over_mean_load", 3.5}, {"dead_experts", 2}, {"aux_loss", 0.01}}},
                      {"3", {{"max_over_mean_load", 1.25}, {"dead_experts", 0}, {"aux_loss", 0.02}}}};
    m.on_step(s);
    text = m.prometheus_text();
    const std::string table = m.summary_table();
    EXPECT_THAT(table, ContainsRegex("expert load \\(busiest over mean, worst layer\\) +3\\.50x +< 2x the mean +CHECK"));
    EXPECT_THAT(table, ContainsRegex("dead experts \\(last step, all layers\\) +2 +0 +CHECK"));
    EXPECT_THAT(table, ContainsRegex("MoE routing \\+ permutation +5\\.0% +< 10% of a step +ok"));
  }
  EXPECT_NE(text.find("dstrain_moe_load_max_over_mean{layer=\"1\"} 3.5"), std::string::npos) << text;
  EXPECT_NE(text.find("dstrain_moe_load_max_over_mean{layer=\"3\"} 1.25"), std::string::npos) << text;
  EXPECT_NE(text.find("dstrain_moe_dead_experts{layer=\"1\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("dstrain_moe_aux_loss{layer=\"3\"} 0.02"), std::string::npos) << text;
  EXPECT_NE(text.find("dstrain_moe_duration_seconds{part=\"routing\"} 0.03"), std::string::npos) << text;
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  std::getline(f, line);
  const json row = json::parse(line);
  EXPECT_EQ(row["moe"]["1"]["dead_experts"], 2);
  EXPECT_DOUBLE_EQ(row["moe_permute_s"].get<double>(), 0.02);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace dstrain
