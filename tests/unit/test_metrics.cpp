// Metrics arithmetic: model FLOPs per token and MFU against a hand-computed example, and the
// Prometheus text and summary table of a step, MoE routing health included. The peak is
// injected (no timed measurement here): a step above it makes rank 0 measure again, and an
// MFU that stays above 100% is a warning everywhere it shows, never "ok".
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "backend/cpu/gemm16.h"
#include "train/metrics.h"

namespace dstrain {
namespace {

using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;

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
    Metrics m(mc, small(), 32, /*rank=*/0, /*world=*/1, /*local=*/1, dir.string(), 10,
              [] { return Peak{100e9, "measured: injected"}; });
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

// Tensor parallelism: the tensor group's communication reaches metrics.jsonl, the Prometheus
// text and the run summary, apart from the data-parallel communication.
TEST(Metrics, TensorParallelCommunication) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("dstrain_metrics_tp_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  MetricsConfig mc;
  mc.progress = "lines";
  std::string text, table;
  {
    Metrics m(mc, small(), 32, /*rank=*/0, /*world=*/2, /*local=*/2, dir.string(), 10,
              [] { return Peak{100e9, "measured: injected"}; });
    StepMetrics s;
    s.step = 1;
    s.max_steps = 10;
    s.loss = 2.5;
    s.tokens_per_s = 2000;
    s.time = {1.0, 0.1, 0.3, 0.4, 0.05, 0.05, 0.02};
    s.rank_step_s = {1.0, 1.0};
    s.rank_compute_s = {0.9, 0.9};
    s.rank_peak_rss_bytes = {1e8, 1e8};
    s.extra["tensor_parallel"] = {{"size", 2}, {"sequence_parallel", true}, {"comm_s", 0.3}, {"comm_bytes", 4096.0}};
    m.on_step(s);
    text = m.prometheus_text();
    table = m.summary_table();
  }
  EXPECT_NE(text.find("dstrain_tensor_parallel_comm_seconds 0.3"), std::string::npos) << text;
  EXPECT_NE(text.find("dstrain_tensor_parallel_comm_bytes 4096"), std::string::npos) << text;
  EXPECT_THAT(table, ContainsRegex("tensor-parallel communication +30\\.0% +< 25% of a step +CHECK"));
  std::ifstream f(dir / "metrics.jsonl");
  std::string line;
  std::getline(f, line);
  EXPECT_DOUBLE_EQ(json::parse(line)["tensor_parallel"]["comm_bytes"].get<double>(), 4096.0);
  std::filesystem::remove_all(dir);
}

// fp16: the loss scale, the step's overflow and the overflow skips reach metrics.jsonl and the
// Prometheus text, apart from the fault-tolerance skipped-step counter; bf16/fp32 steps
// carry none of them.
TEST(Metrics, LossScaleAndOverflowSkipsOfAnFp16Run) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("dstrain_metrics_fp16_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  MetricsConfig mc;
  mc.progress = "lines";
  std::string text;
  {
    Metrics m(mc, small(), 32, /*rank=*/0, /*world=*/1, /*local=*/1, dir.string(), 10,
              [] { return Peak{100e9, "measured: injected"}; });
    StepMetrics s;
    s.max_steps = 10;
    s.loss = 2.5;
    s.tokens_per_s = 2000;
    s.time = {1.0, 0.1, 0.3, 0.4, 0.05, 0.05, 0.02};
    s.rank_step_s = {1.0};
    s.rank_compute_s = {0.9};
    s.rank_peak_rss_bytes = {1e8};
    s.step = 1;
    EXPECT_FALSE(m.step_record(s).contains("loss_scale")) << "an fp32 step has no loss scale";
    s.loss_scaling = true;
    s.loss_scale = 65536;
    s.overflow = true;
    s.overflow_skipped_total = 1;
    m.on_step(s);
    s.step = 2;
    s.loss_scale = 32768;
    s.overflow = false;
    m.on_step(s);
    text = m.prometheus_text();
  }
  EXPECT_NE(text.find("# TYPE dstrain_loss_scale gauge\ndstrain_loss_scale 32768\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE dstrain_overflow_skipped_steps_total counter\ndstrain_overflow_skipped_steps_total 1\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("dstrain_skipped_steps_total 0\n"), std::string::npos) << text;
  std::ifstream f(dir / "metrics.jsonl");
  std::vector<json> steps;
  for (std::string line; std::getline(f, line);) {
    const json row = json::parse(line);
    if (row.contains("step") && row.contains("loss")) steps.push_back(row);
  }
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0]["loss_scale"], 65536.0);
  EXPECT_EQ(steps[0]["overflow"], true);
  EXPECT_EQ(steps[0]["overflow_skipped_total"], 1);
  EXPECT_EQ(steps[0]["skipped"], false);
  EXPECT_EQ(steps[0]["skipped_total"], 0);
  EXPECT_EQ(steps[1]["loss_scale"], 32768.0);
  EXPECT_EQ(steps[1]["overflow"], false);
  std::filesystem::remove_all(dir);
}

// A step at `flops` model FLOP/s on one rank of the small model.
StepMetrics step_at(int64_t step, double flops) {
  StepMetrics s;
  s.step = step;
  s.max_steps = 100;
  s.loss = 2.5;
  s.tokens_per_s = flops / small().train_flops_per_token(32);
  s.time = {1.0, 0.01, 0.45, 0.45, 0.0, 0.05, 0.0};
  s.rank_step_s = {1.0};
  s.rank_compute_s = {0.9};
  s.rank_peak_rss_bytes = {1e8};
  return s;
}

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string t = (std::filesystem::temp_directory_path() / "dstrain_metrics_XXXXXX").string();
    path = ::mkdtemp(t.data());
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::vector<json> records() const {
    std::vector<json> out;
    std::ifstream f(path / "metrics.jsonl");
    for (std::string line; std::getline(f, line);) out.push_back(json::parse(line));
    return out;
  }
};

// The summary table's row that starts with `metric`.
std::string table_row(const std::string& table, const std::string& metric) {
  const size_t at = table.find(metric);
  return at == std::string::npos ? std::string() : table.substr(at, table.find('\n', at) - at);
}

std::string mfu_row(const std::string& table) { return table_row(table, "MFU"); }

// fp16 overflow skips count in the summary: a few while the scale settles are normal; a run that
// still overflows at its end (a static scale too large, a diverged run) is not.
TEST(Metrics, Fp16OverflowSkipsCountInTheSummary) {
  TempDir dir;
  MetricsConfig mc;
  mc.progress = "lines";
  auto metrics = [&] {
    return std::make_unique<Metrics>(mc, small(), 32, 0, 1, 1, dir.path.string(), 10,
                                     [] { return Peak{100e9, "measured: injected"}; });
  };
  StepMetrics s = step_at(1, 50e9);
  s.loss_scaling = true;
  s.overflow_skipped_total = 1;
  auto settled = metrics();
  settled->on_step(s);
  EXPECT_THAT(table_row(settled->summary_table(), "skipped steps"),
              ::testing::MatchesRegex("skipped steps \\(\\+ fp16 overflows\\) +0 \\+ 1 .* ok"));
  auto overflowing = metrics();
  for (int i = 1; i <= 40; ++i) {
    s = step_at(i, 50e9);
    s.loss_scaling = true;
    s.overflow = true;
    s.overflow_skipped_total = i;
    overflowing->on_step(s);
  }
  EXPECT_THAT(table_row(overflowing->summary_table(), "skipped steps"),
              ::testing::MatchesRegex("skipped steps \\(\\+ fp16 overflows\\) +0 \\+ 40 .* CHECK"));
  // Without loss scaling the row is the faults' alone.
  auto plain = metrics();
  plain->on_step(step_at(1, 50e9));
  EXPECT_THAT(table_row(plain->summary_table(), "skipped steps"), ::testing::MatchesRegex("skipped steps +0 +0 +ok"));
}

// A peak measured low at start (another process busy on the cores) and a step above it: the
// peak is measured again, the higher one kept, and MFU reads below 100%.
TEST(Metrics, AStepAboveAMeasuredPeakMeasuresItAgain) {
  TempDir d;
  MetricsConfig mc;
  mc.progress = "lines";
  int calls = 0;
  std::vector<Peak> peaks = {{55e9, "measured: best of 5 trials at start"}, {330e9, "measured: best of 5 trials later"}};
  {
    Metrics m(mc, small(), 32, 0, 1, 1, d.path.string(), 10, [&] { return peaks[size_t(calls++)]; });
    EXPECT_EQ(m.peak_flops(), 55e9);
    m.on_run_start({{"mpi", "some MPI"}});
    m.on_step(step_at(1, 120e9));  // 218% of the low peak
    EXPECT_EQ(calls, 2);
    EXPECT_EQ(m.peak_flops(), 330e9);
    EXPECT_EQ(m.peak_source(), "re-measured at step 1: best of 5 trials later");
    m.on_step(step_at(2, 120e9));
    EXPECT_EQ(calls, 2) << "measured again only when a step exceeds the peak";
    const std::string table = m.summary_table();
    EXPECT_THAT(mfu_row(table), ContainsRegex("36\\.4% .* ok$")) << table;
    EXPECT_THAT(table, HasSubstr("peak: 330.0 GFLOP/s per rank, re-measured at step 1"));
    EXPECT_THAT(m.prometheus_text(), HasSubstr("dstrain_mfu_above_peak 0"));
  }
  const std::vector<json> r = d.records();
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0]["type"], "environment");
  EXPECT_EQ(r[0]["environment"]["mpi"], "some MPI");
  EXPECT_EQ(r[0]["peak_source"], "measured: best of 5 trials at start");
  EXPECT_EQ(r[1]["type"], "peak");
  EXPECT_EQ(r[1]["peak_flops"], 330e9);
  EXPECT_EQ(r[2]["type"], "train");
  EXPECT_NEAR(r[2]["mfu"].get<double>(), 120.0 / 330.0, 1e-12);
  EXPECT_EQ(r[2]["mfu_above_peak"], false);
}

// A peak that stays too low: MFU above 100% is a warning in the progress line, the metrics file,
// the Prometheus text and the summary, never "ok"; re-measurements stop after a few.
TEST(Metrics, AnMfuAbove100PercentIsAWarningNeverOk) {
  TempDir d;
  MetricsConfig mc;
  mc.progress = "lines";
  int calls = 0;
  Metrics m(mc, small(), 32, 0, 1, 1, d.path.string(), 10, [&] {
    ++calls;
    return Peak{55e9, "measured: busy"};
  });
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  for (int64_t step = 1; step <= 30; ++step) m.on_step(step_at(step, 120e9));
  const std::string out = ::testing::internal::GetCapturedStdout(), err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(calls, 1 + 3) << "at most three re-measurements";
  EXPECT_THAT(out, HasSubstr("MFU 218.2% (above 100%: peak too low)"));
  EXPECT_THAT(err, HasSubstr("MFU reads 218%, above 100%: the peak of 55.0 GFLOP/s per rank"));
  const std::string table = m.summary_table();
  EXPECT_THAT(mfu_row(table), HasSubstr("CHECK: 30 step(s) above 100%, the peak is too low")) << table;
  EXPECT_THAT(mfu_row(table), Not(ContainsRegex(" ok$")));
  EXPECT_THAT(m.prometheus_text(), HasSubstr("dstrain_mfu_above_peak 1"));
  const std::vector<json> r = d.records();
  int warnings = 0;
  for (const json& x : r) {
    if (x["type"] == "train") {
      EXPECT_EQ(x["mfu_above_peak"], true);
    } else if (x["type"] == "warning" && x["what"] == "mfu_above_peak") {
      ++warnings;
    }
  }
  EXPECT_EQ(warnings, 3) << "once per print interval of 10 steps";
}

// A configured peak is never replaced by a measurement; when a step beats it, the warning
// names the key to correct.
TEST(Metrics, AConfiguredPeakIsUsedAndATooLowOneIsAWarning) {
  TempDir d;
  MetricsConfig mc;
  mc.progress = "lines";
  mc.peak_tflops = 0.1;
  Metrics m(mc, small(), 32, 0, 1, 1, d.path.string(), 10, [] {
    ADD_FAILURE() << "measured although metrics.peak_tflops is set";
    return Peak{};
  });
  EXPECT_EQ(m.peak_source(), "from config metrics.peak_tflops");
  ::testing::internal::CaptureStderr();
  m.on_step(step_at(1, 150e9));
  EXPECT_THAT(::testing::internal::GetCapturedStderr(), HasSubstr("correct metrics.peak_tflops"));
  EXPECT_EQ(m.peak_flops(), 100e9);
  EXPECT_THAT(mfu_row(m.summary_table()), HasSubstr("CHECK: 1 step(s) above 100%"));
}

MetricsConfig parse(const json& j) { return MetricsConfig::from_json(JsonReader(j, "metrics", "run.json")); }
// The error a metrics section gives ("no error" when it reads).
std::string error_of(const json& j) {
  try {
    parse(j);
  } catch (const Error& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

TEST(Metrics, PeakTflopsKeyIsValidatedStrictly) {
  EXPECT_DOUBLE_EQ(parse({{"peak_tflops", 2.5}}).peak_tflops, 2.5);
  EXPECT_DOUBLE_EQ(parse({{"peak_tflops", 3}}).peak_tflops, 3.0);
  EXPECT_EQ(parse(json::object()).peak_tflops, 0) << "absent: measured";
  EXPECT_EQ(parse({{"peak_tflops", nullptr}}).peak_tflops, 0) << "null (the resolved configuration's): measured";
  EXPECT_THAT(error_of({{"peak_tflops", "fast"}}), HasSubstr("'metrics.peak_tflops' must be a number"));
  EXPECT_THAT(error_of({{"peak_tflops", 0}}), HasSubstr("metrics.peak_tflops"));
  EXPECT_THAT(error_of({{"peak_tflops", -1.5}}), HasSubstr("must be a positive number"));
  EXPECT_THAT(error_of({{"peak_tflops", true}}), HasSubstr("metrics.peak_tflops"));
  // What the resolved configuration writes reads back.
  MetricsConfig measured;
  EXPECT_EQ(parse(measured.to_json()).peak_tflops, 0);
  measured.peak_tflops = 1.25;
  EXPECT_EQ(parse(measured.to_json()).peak_tflops, 1.25);
}

TEST(Metrics, ExpertImbalanceKeyIsARatioOfAtLeastOne) {
  EXPECT_EQ(parse(json::object()).expert_imbalance, 1.0) << "absent: balanced";
  EXPECT_EQ(parse({{"expert_imbalance", 1.4}}).expert_imbalance, 1.4);
  EXPECT_THAT(error_of({{"expert_imbalance", 0.8}}), HasSubstr("metrics.expert_imbalance"));
  EXPECT_THAT(error_of({{"expert_imbalance", 0.8}}), HasSubstr("must be a ratio >= 1"));
  EXPECT_THAT(error_of({{"expert_imbalance", "high"}}), HasSubstr("metrics.expert_imbalance"));
  MetricsConfig c;
  c.expert_imbalance = 1.25;
  EXPECT_EQ(parse(c.to_json()).expert_imbalance, 1.25) << "the resolved configuration reads back";
}

}  // namespace
}  // namespace dstrain

namespace dstrain {
namespace {
// A bf16 run's MFU is against the GEMM its layers run on: with hardware bf16 the bf16 product,
// about twice the fp32 peak (against the fp32 one a bf16 run read 120% MFU and warned); without
// it the 16-bit products widen to fp32, so the sgemm is the peak. (Which is faster is for the
// benchmarks: here only which GEMM was measured.)
TEST(Metrics, ABf16RunsPeakIsTheBf16GemmWhereTheCpuHasIt) {
  const Peak f32 = measure_peak_flops(3, 0.02, DType::F32);
  const Peak bf16 = measure_peak_flops(3, 0.02, DType::BF16);
  EXPECT_GT(f32.flops, 0);
  EXPECT_THAT(f32.source, ::testing::HasSubstr("sgemm 1024x1024x1024"));
  if (cpu::gemm16_bf16_hardware()) {
    EXPECT_THAT(bf16.source, ::testing::HasSubstr("bf16 GEMM 1024x1024x1024"));
    EXPECT_GT(bf16.flops, 0);
  } else {
    EXPECT_THAT(bf16.source, ::testing::HasSubstr("sgemm 1024x1024x1024"));
  }
}
}  // namespace
}  // namespace dstrain
