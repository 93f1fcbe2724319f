// The performance model (plan/): execution traces of the meta step, the hardware profiles that
// price them, the pipeline's simulation, the fits of calibration and the layout planner.
#include <gtest/gtest.h>
#include <omp.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "core/error.h"
#include "distributed/schedule.h"
#include "plan/calibrate.h"
#include "plan/hardware.h"
#include "plan/perf_model.h"
#include "plan/planner.h"
#include "train/memory_model.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// hidden 32, 4 heads of 8 (2 key/value heads), FFN 48, vocabulary 64, untied.
json dense_model(int layers = 2) {
  return {{"hidden_size", 32},       {"intermediate_size", 48},        {"num_hidden_layers", layers},
          {"num_attention_heads", 4}, {"num_key_value_heads", 2},       {"vocab_size", 64},
          {"max_position_embeddings", 32}, {"rms_norm_eps", 1e-5},      {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},  {"initializer_range", 0.1}};
}

RunConfig run_config(const std::vector<std::string>& sets, int layers = 2, const json& model = json()) {
  const json run = {{"model", model.is_null() ? dense_model(layers) : model},
                    {"train",
                     {{"train_micro_batch_size_per_gpu", 2},
                      {"gradient_accumulation_steps", 2},
                      {"optimizer", {{"type", "AdamW"}, {"params", {{"lr", 1e-3}}}}}}},
                    {"data", {{"train", "unused.bin"}, {"seq_len", 16}}}};
  const fs::path p = fs::temp_directory_path() / fmt::format("dstrain_perf_model_{}.json", ::getpid());
  {
    std::ofstream f(p);
    f << run.dump();
  }
  RunConfig c = RunConfig::load(p.string(), sets);
  fs::remove(p);
  return c;
}

// A GPU-like profile with round numbers.
HardwareProfile profile(double link_bandwidth = 100e9) {
  HardwareProfile hw;
  hw.name = "test";
  hw.file = "test.json";
  hw.ranks_per_node = 8;
  hw.memory_bytes = 80e9;
  hw.memory_bandwidth = 2e12;
  hw.peak_flops = {{"f32", 50e12}, {"bf16", 500e12}};
  hw.kernel_overhead = 2e-6;
  hw.intra_node = {link_bandwidth, 5e-6};
  hw.inter_node = {link_bandwidth / 10, 10e-6};
  return hw;
}

double op_flops(const ExecTrace& t) {
  double f = 0;
  for (const TraceEvent& e : t.events) f += e.kind == TraceEvent::Kind::Op ? e.flops : 0;
  return f;
}

TEST(ExecTrace, RecordsOpsCollectivesAndTheScheduleOfOneStep) {
  RunConfig c = run_config({});
  const std::vector<StageTrace> traced = trace_step(c, 2);  // data 2
  ASSERT_EQ(traced.size(), 1u);
  const ExecTrace& t = traced[0].trace;
  int actions = 0, tails = 0, linear = 0;
  std::map<int, int> issued, waited;
  for (const TraceEvent& e : t.events) {
    if (e.kind == TraceEvent::Kind::Action) ++actions;
    if (e.kind == TraceEvent::Kind::Tail) ++tails;
    if (e.kind == TraceEvent::Kind::Op && std::string(e.name) == "linear_forward") ++linear;
    if (e.kind == TraceEvent::Kind::Issue) {
      EXPECT_EQ(e.group, "data");
      EXPECT_EQ(e.group_size, 2);
      EXPECT_GT(e.bytes, 0);
      ++issued[e.id];
    }
    if (e.kind == TraceEvent::Kind::Wait) ++waited[e.id];
  }
  EXPECT_EQ(actions, 4);  // F0 B0 F1 B1
  EXPECT_EQ(tails, 1);
  EXPECT_GT(linear, 0);
  EXPECT_FALSE(issued.empty());
  for (const auto& [id, n] : issued) EXPECT_EQ(waited[id], 1) << "collective " << id << " issued, never waited";
  // Nothing is recorded without a trace installed.
  EXPECT_EQ(current_trace(), nullptr);
}

// A MoE layer spreads its experts' GEMMs over OpenMP threads: every one of them is in the trace,
// whichever thread ran it (a trace that only its installing thread recorded lost the others').
TEST(ExecTrace, RecordsOpsRunOnWorkerThreads) {
  const json v3 = (fs::path(DSTRAIN_SOURCE_DIR) / "inputs" / "models" / "deepseek-v3-tiny.json").string();
  RunConfig c = run_config({}, 2, v3);  // 32 routed experts: spread over the threads
  auto linear_ops = [&](int threads) {
    const int before = omp_get_max_threads();
    omp_set_num_threads(threads);
    const std::vector<StageTrace> traced = trace_step(c, 1);
    omp_set_num_threads(before);
    int n = 0;
    double flops = 0;
    for (const TraceEvent& e : traced[0].trace.events) {
      if (e.kind == TraceEvent::Kind::Op && std::string(e.name).rfind("linear_", 0) == 0) {
        ++n;
        flops += e.flops;
      }
    }
    return std::pair{n, flops};
  };
  const auto one = linear_ops(1);
  EXPECT_GT(one.first, 0);
  EXPECT_EQ(linear_ops(4), one);
}

// Every linear layer's GEMMs (forward, input and weight gradients: 3 x 2 FLOPs per weight per
// token) and causal attention's (QK^T and PV forward; QK^T again, dO V^T, dV, dQ, dK backward).
TEST(PerfModel, AStepsFlopsAreItsLayersGemmsAndAttention) {
  RunConfig c = run_config({});
  const int64_t h = 32, hd = 8, heads = 4, kv = 2, ffn = 48, V = 64, L = 2, B = 2, T = 16, micro = 2;
  const double per_layer = double(h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * ffn);
  const double tokens = double(B * T * micro);
  const double linear = 6.0 * (L * per_layer + V * h) * tokens;
  const double pairs = double(B * heads) * T * (T + 1) / 2 * micro * L;
  const double attention = 2 * pairs * (2 * hd) + 2 * pairs * (3 * hd + 2 * hd);
  const Prediction p = predict(c, 1, profile());
  EXPECT_DOUBLE_EQ(p.hardware_flops_per_step, linear + attention);
  EXPECT_DOUBLE_EQ(p.model_flops_per_step, p.hardware_flops_per_step);

  // Full recomputation runs every layer's forward again but the last one's (its backward follows
  // the head's at once: model/transformer.cpp, recompute_group); the model FLOPs stay.
  RunConfig full = run_config({"train.activation_checkpointing={\"granularity\": \"full\"}"});
  const Prediction f = predict(full, 1, profile());
  const double layer_forward = (2.0 * L * per_layer * tokens + 2 * pairs * (2 * hd)) * (L - 1) / L;
  EXPECT_DOUBLE_EQ(f.hardware_flops_per_step, p.hardware_flops_per_step + layer_forward);
  EXPECT_DOUBLE_EQ(f.model_flops_per_step, p.model_flops_per_step);
  EXPECT_GT(f.step_seconds, p.step_seconds);
}

TEST(PerfModel, OneRanksStepIsItsOpsPricedByTheProfile) {
  RunConfig c = run_config({});
  const HardwareProfile hw = profile();
  const std::vector<StageTrace> traced = trace_step(c, 1);
  double seconds = 0;
  for (const TraceEvent& e : traced[0].trace.events)
    if (e.kind == TraceEvent::Kind::Op) seconds += op_seconds(hw, e);
  const Prediction p = predict(c, 1, hw);
  EXPECT_NEAR(p.step_seconds, seconds, 1e-12 + 1e-9 * seconds);
  EXPECT_NEAR(p.mfu, p.model_flops_per_step / (p.step_seconds * 50e12), 1e-12);
  EXPECT_DOUBLE_EQ(p.tokens_per_second, 2.0 * 2 * 16 / p.step_seconds);
}

// The data-parallel buckets are issued during the backward and waited for at its end: on a fast
// link they hide behind the compute, on a slow one the step waits for them.
TEST(PerfModel, DataParallelReductionsOverlapTheBackwardUntilWaitedFor) {
  RunConfig c = run_config({"parallel.data=2"});
  const Prediction fast = predict(c, 2, profile(1e12));
  const Prediction slow = predict(c, 2, profile(1e6));
  const StagePrediction& f = fast.stages.at(0);
  const StagePrediction& s = slow.stages.at(0);
  ASSERT_GT(f.comm_total.at("data"), 0);
  EXPECT_LE(f.comm_exposed.at("data"), f.comm_total.at("data"));
  EXPECT_GT(s.comm_exposed.at("data"), 100 * f.comm_exposed.at("data"));
  EXPECT_NEAR(slow.step_seconds - fast.step_seconds, s.exposed_comm - f.exposed_comm, 1e-9 * slow.step_seconds);
}

// Asynchronous aggregation: on a slow link the synchronous step waits for its reduction and the
// plan says which aggregation pays off; a DiLoCo run's step is its replica's traced step plus the
// outer all-reduce every H steps; on a fast link nothing is gained.
TEST(PerfModel, GradientSyncIsPricedAndThePlanSaysWhenItPaysOff) {
  const HardwareProfile slow = profile(1e6);
  HardwareProfile fast = profile(1e13);
  fast.intra_node = {1e13, 1e-10};
  fast.inter_node = {1e12, 1e-10};
  const RunConfig sync = run_config({"parallel.data=16"});
  const Prediction s = predict(sync, 16, slow);
  ASSERT_EQ(s.sync_alternatives.size(), 4u);
  EXPECT_GT(s.data_exposed_seconds, 0.5 * s.step_seconds) << "the slow link dominates the synchronous step";
  const GradientSyncPrice& h32 = s.sync_alternatives[2];
  EXPECT_EQ(h32.every, 32);
  EXPECT_LT(h32.step_seconds, s.step_seconds / 4);
  EXPECT_NEAR(h32.exposed_seconds * 32, h32.outer_seconds, 1e-12);
  std::string text;
  for (const std::string& line : explain(s)) text += line + "\n";
  EXPECT_NE(text.find("pays off"), std::string::npos) << text;
  // The DiLoCo run itself: its replicas (one data rank each) reduce nothing inside; the outer
  // all-reduce every 32 steps is its only traffic between replicas.
  const RunConfig diloco = run_config({"parallel.data=16", R"(train.gradient_sync={"mode": "diloco", "every": 32})"});
  const Prediction d = predict(diloco, 16, slow);
  EXPECT_EQ(d.replicas, 16);
  EXPECT_NEAR(d.gradient_sync.exposed_seconds, d.gradient_sync.outer_seconds / 32, 1e-12);
  EXPECT_NEAR(d.step_seconds, h32.step_seconds, 0.1 * h32.step_seconds);
  const RunConfig bf16 = run_config({"parallel.data=16", R"(train.gradient_sync={"mode": "diloco", "every": 32, "outer_dtype": "bf16"})"});
  EXPECT_LT(predict(bf16, 16, slow).gradient_sync.outer_seconds, 0.6 * d.gradient_sync.outer_seconds);
  // Delayed hides the all-reduce behind the next step as far as the step lasts.
  const RunConfig delayed = run_config({"parallel.data=16", R"(train.gradient_sync={"mode": "delayed"})"});
  const Prediction dl = predict(delayed, 16, slow);
  EXPECT_NEAR(dl.gradient_sync.exposed_seconds, std::max(0.0, dl.gradient_sync.outer_seconds - (dl.step_seconds - dl.gradient_sync.exposed_seconds)), 1e-9);
  std::string quick;
  for (const std::string& line : explain(predict(sync, 16, fast))) quick += line + "\n";
  EXPECT_NE(quick.find("keep it"), std::string::npos) << quick;
}

// A pipeline's step comes from the schedule's own simulation of the traced actions.
TEST(PerfModel, PipelineStepsComeFromTheSchedulesSimulation) {
  RunConfig c = run_config({"parallel.pipeline=2", "train.gradient_accumulation_steps=8"}, 4);
  const Prediction p = predict(c, 2, profile());
  ASSERT_EQ(p.stages.size(), 2u);
  EXPECT_GT(p.bubble_fraction, 0);
  EXPECT_GT(p.p2p_seconds, 0);
  // Each stage is busy for less than the step; the step is at least the slowest stage's work.
  for (const StagePrediction& s : p.stages) {
    EXPECT_LT(s.busy, p.step_seconds);
    EXPECT_LE(s.finish + s.tail, p.step_seconds * (1 + 1e-12));
  }
  // Tracing 4 of the 8 micro-batches prices the step as tracing all of them does.
  PredictOptions capped;
  capped.cap_traced_micro_batches = true;
  const Prediction q = predict(c, 2, profile(), capped);
  EXPECT_NEAR(p.step_seconds, q.step_seconds, 0.02 * q.step_seconds);
  EXPECT_NEAR(p.hardware_flops_per_step, q.hardware_flops_per_step, 1e-9 * q.hardware_flops_per_step);
}

TEST(Schedule, SimulateStepAddsTheTransferOfEveryStageBoundaryOnTheCriticalPath) {
  OneFOneBSchedule s;
  const int P = 4, m = 8;
  const auto table = schedule_table(s, P, m);
  const auto stages = stage_map(s, P);
  auto cost = [&](int r, size_t i) { return table[size_t(r)][i].kind == ScheduleAction::Kind::Forward ? 1.0 : 2.0; };
  const std::vector<double> none = simulate_step(table, stages, cost, 0);
  const double makespan = *std::max_element(none.begin(), none.end());
  EXPECT_DOUBLE_EQ(makespan, (m + P - 1) * 3.0);  // 1F1B with F = 1, B = 2
  const std::vector<double> slow = simulate_step(table, stages, cost, 0.5);
  EXPECT_GE(*std::max_element(slow.begin(), slow.end()), makespan + 2 * (P - 1) * 0.5);
}

TEST(Hardware, CollectivesFollowTheRingOverTheSlowestLinkCrossed) {
  HardwareProfile hw = profile(100e9);
  const double b = 1e9;
  EXPECT_DOUBLE_EQ(collective_seconds(hw, "all_reduce", b, 4, false), 2 * 3 * 5e-6 + 2 * 0.75 * b / 100e9);
  EXPECT_DOUBLE_EQ(collective_seconds(hw, "all_gather", b, 4, true), 3 * 10e-6 + 0.75 * b / 10e9);
  EXPECT_DOUBLE_EQ(collective_seconds(hw, "send", b, 2, false), 5e-6 + b / 100e9);
  EXPECT_EQ(collective_seconds(hw, "all_reduce", b, 1, false), 0);
  // Calibrated sizes are used as measured; another size scales the nearest one's ring terms.
  hw.collectives["all_reduce"][2] = CollectiveFit{1e-5, 1e-9, 4};
  EXPECT_DOUBLE_EQ(collective_seconds(hw, "all_reduce", b, 2, true), 1e-5 + 1.0);
  EXPECT_DOUBLE_EQ(collective_seconds(hw, "all_reduce", b, 4, true), 1e-5 * 3 + 1.0 * (0.75 / 0.5));
  // Groups of the layout: data over 2 tensor ranks x 8 data ranks spans two 8-rank nodes.
  AxisSizes a;
  a.tensor = 2;
  a.data = 8;
  EXPECT_FALSE(group_spans_nodes("tensor", a, 8));
  EXPECT_TRUE(group_spans_nodes("data", a, 8));
}

TEST(Hardware, ShippedProfilesLoadAndCiteTheirSources) {
  int n = 0;
  for (const auto& entry : fs::directory_iterator(fs::path(DSTRAIN_SOURCE_DIR) / "inputs" / "clusters")) {
    const HardwareProfile hw = load_profile(entry.path().string());
    ++n;
    EXPECT_FALSE(hw.calibrated) << entry.path();
    EXPECT_EQ(hw.ranks_per_node, 8) << entry.path();
    EXPECT_GT(peak_flops(hw, "bf16"), 1e14) << entry.path();
    EXPECT_GT(hw.inter_node.bandwidth, 0) << entry.path();
    EXPECT_LT(hw.inter_node.bandwidth, hw.intra_node.bandwidth) << entry.path();
    for (const char* key : {"device.peak_flops_source", "device.memory_bandwidth_source", "links.intra_node.source",
                            "links.inter_node.source"}) {
      EXPECT_TRUE(hw.sources.contains(key) && !hw.sources[key].get<std::string>().empty())
          << entry.path() << " cites no source for " << key;
    }
    // What is written reads back the same.
    const fs::path copy = fs::temp_directory_path() / fmt::format("dstrain_profile_{}.json", ::getpid());
    {
      std::ofstream f(copy);
      f << profile_to_json(hw).dump(2);
    }
    const HardwareProfile again = load_profile(copy.string());
    fs::remove(copy);
    EXPECT_EQ(again.peak_flops, hw.peak_flops);
    EXPECT_EQ(again.sources, hw.sources);
  }
  EXPECT_GE(n, 4);
}

TEST(Hardware, ABadProfileNamesItsFileAndKey) {
  const fs::path p = fs::temp_directory_path() / fmt::format("dstrain_bad_profile_{}.json", ::getpid());
  json j = profile_to_json(profile());
  j["links"]["intra_node"]["bandwidth"] = -1;
  {
    std::ofstream f(p);
    f << j.dump();
  }
  try {
    load_profile(p.string());
    ADD_FAILURE() << "a negative bandwidth was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(p.string()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("links.intra_node.bandwidth"), std::string::npos) << e.what();
  }
  j = profile_to_json(profile());
  j["device"]["peak_flops"]["fp4"] = 1e15;
  {
    std::ofstream f(p);
    f << j.dump();
  }
  EXPECT_THROW(load_profile(p.string()), Error);
  fs::remove(p);
}

TEST(Calibrate, FitsRecoverKnownCoefficientsAndDropNegativeOnes) {
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (double f : {1e6, 4e6, 1.6e7, 6.4e7}) {
    x.push_back({1.0, f, 2 * f});
    y.push_back(3e-6 + 2e-11 * f);  // the bytes term is 0
  }
  std::vector<double> c = fit_nonnegative(x, y);
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(c[0] + c[1] * x[i][1] + c[2] * x[i][2], y[i], 1e-3 * y[i]);
  // A fit whose unconstrained solution has a negative constant refits without it.
  x = {{1.0, 1.0}, {1.0, 2.0}, {1.0, 4.0}};
  y = {0.5, 1.5, 3.5};  // 1 x - 0.5
  c = fit_nonnegative(x, y);
  EXPECT_EQ(c[0], 0);
  EXPECT_GT(c[1], 0);
}

TEST(Planner, RanksFeasibleLayoutsByThroughputAndSaysWhyOthersFail) {
  RunConfig base = run_config({"train.train_batch_size=16", "train.gradient_accumulation_steps=null"}, 4);
  PlanSpace space = default_plan_space(base, 4, 8);
  space.tensor.push_back(3);  // does not divide 4 ranks: never enumerated
  space.zero = {0, 3};
  space.micro_batch = {1, 2};
  space.recompute = {"none"};
  std::vector<Candidate> all = plan_layouts(base, 4, profile(), space, PredictOptions{});
  ASSERT_FALSE(all.empty());
  bool infeasible_seen = false;
  for (size_t i = 0; i < all.size(); ++i) {
    if (!all[i].feasible) {
      infeasible_seen = true;
      EXPECT_FALSE(all[i].reason.empty()) << all[i].label;
      continue;
    }
    EXPECT_FALSE(infeasible_seen) << "a feasible layout after an infeasible one: " << all[i].label;
    if (i > 0 && all[i - 1].feasible)
      EXPECT_GE(all[i - 1].prediction.tokens_per_second, all[i].prediction.tokens_per_second);
  }
  // A micro-batch of 3 does not divide the global batch of 16: the trainer's own check refuses it.
  const auto mb3 = plan_layouts(base, 4, profile(), [&] {
    PlanSpace one = space;
    one.micro_batch = {3};
    return one;
  }(), PredictOptions{});
  ASSERT_FALSE(mb3.empty());
  for (const Candidate& c : mb3) {
    EXPECT_FALSE(c.feasible) << c.label;
    EXPECT_NE(c.reason.find("train_batch_size"), std::string::npos) << c.reason;
  }
  // A device too small for any layout: every one is rejected for its memory.
  HardwareProfile small = profile();
  small.memory_bytes = 1e3;
  std::set<std::string> refused;  // by the layout check, whatever the device
  for (const Candidate& c : all)
    if (!c.feasible) refused.insert(c.label);
  EXPECT_FALSE(refused.empty());  // DualPipeV on 4 pipeline ranks needs 8 layers
  for (const Candidate& c : plan_layouts(base, 4, small, space, PredictOptions{})) {
    EXPECT_FALSE(c.feasible) << c.label;
    if (!refused.count(c.label)) EXPECT_NE(c.reason.find("memory"), std::string::npos) << c.reason;
  }
}

}  // namespace
}  // namespace dstrain
