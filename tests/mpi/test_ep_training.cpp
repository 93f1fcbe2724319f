// Expert parallelism end to end, through the trainer, at 2 and 4 ranks: DeepSeek-V2 (softmax,
// group-limited greedy routing, auxiliary loss) and DeepSeek-V3 (sigmoid noaux_tc routing with the
// routing-bias updates, MTP) with their 8 routed experts split over the expert group
// (parallel.expert = the world size, and at 4 ranks expert 2 x 2 expert groups) equal the same
// data-parallel run with every expert on every rank (expert = 1) within 1e-5 in every step's
// losses and gradient norm, every weight, the routing biases and the expert loads; checkpoints
// written at one expert size resume at another (W -> 1 -> 2) with the uninterrupted run's losses
// and hold every expert under its Hugging Face name; --save-hf writes every expert and loads
// back at any expert size; the metrics count the received rows; and layouts that cannot work are
// errors naming the key.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <set>

#include "io/checkpoint.h"
#include "io/hf_weights.h"
#include "io/sharded_model_state.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 3;

json model_of(const std::string& name) {
  json run = name == "v2" ? v2_model() : v3_model();
  run["model"]["num_hidden_layers"] = 3;  // two MoE layers after the dense first one
  return run;
}

// Every step's losses, gradient norm and expert loads, and every weight this rank holds (its
// experts and the replicated rest) against the run with every expert everywhere; the expert
// group holds every expert once.
void expect_same_training(Trainer& ref, Trainer& ep, ProcessGrid& grid, const std::string& what) {
  expect_same_steps(ref, ep, what);
  for (size_t i = 0; i < ep.history().size(); ++i) {
    const StepRecord& a = ep.history()[i];
    for (size_t l = 0; l < a.moe.size(); ++l) {
      // Each assignment is computed once, by its expert's owner.
      int64_t assigned = 0, received = 0;
      for (int64_t t : a.moe[l].tokens) assigned += t;
      for (int64_t r : a.moe[l].received) received += r;
      EXPECT_EQ(received + a.moe[l].dropped, assigned) << what << ": rows received over the ranks, layer " << a.moe[l].layer;
    }
  }
  const ParamRegistry& reg = ep.model().params();
  const ParamRegistry& whole = ref.model().params();
  double worst = 0, worst_bias = 0;
  int experts = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    const int w = whole.find(p.name);
    ASSERT_GE(w, 0) << p.name;
    const std::vector<float> mine = values(reg.param(id)), want = values(whole.param(w));
    if (p.kind == ParamKind::RouterBias) {
      // Moved by +-gamma from the global loads: equal loads give equal biases.
      for (size_t e = 0; e < mine.size(); ++e) {
        worst_bias = std::max(worst_bias, double(std::fabs(mine[e] - want[e])));
      }
      continue;
    }
    const double e = rel_error(mine, want);
    EXPECT_LE(e, kLayoutWeightTolerance) << what << ": " << p.name;
    worst = std::max(worst, e);
    experts += p.placement.kind == Placement::Kind::Expert;
  }
  EXPECT_LE(worst_bias, 1e-6) << what << ": routing biases";
  // Two MoE layers (and V3's MTP module), 8 experts of 3 matrices each, over the group.
  const int ep_size = grid.size(Axis::Expert);
  const int moe_layers = int(ep.model().moe_layers().size());
  EXPECT_EQ(grid.comm(Axis::Expert).all_reduce_value<int32_t>(experts), moe_layers * 8 * 3) << what;
  EXPECT_EQ(experts, moe_layers * 3 * 8 / ep_size) << what;
  worst = grid.world().all_reduce_value<double>(worst, ReduceOp::Max);
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.6f vs %.6f (expert 1), worst weight error %.2e, routing bias %.1e\n",
                world_size(), what.c_str(), ep.history().back().loss, ref.history().back().loss, worst, worst_bias);
  }
}

// The layouts at this world size: expert = world, and at 4 ranks expert 2 over 2 expert groups.
std::vector<int> expert_sizes() {
  std::vector<int> s = {world_size()};
  if (world_size() == 4) s.push_back(2);
  return s;
}

class ExpertTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpertTraining, MatchesEveryExpertOnEveryRank) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(kSteps, model_of(GetParam()));
  // The reference: one process holding every expert, on the same global batches.
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  for (int ep : expert_sizes()) {
    const RunConfig cfg = files.config({"parallel.expert=" + std::to_string(ep)});
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    ASSERT_EQ(grid.size(Axis::Expert), ep);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    expect_same_training(ref, t, grid, GetParam() + " expert " + std::to_string(ep) + " x " +
                                           std::to_string(world_size() / ep) + " expert groups");
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ExpertTraining, ::testing::Values("v2", "v3"));

// An evaluation of fewer micro-batches than data ranks (1), or of a count the ranks do not share
// evenly (3), under expert parallelism: the ranks without a batch of their own still take part in
// every all-to-all (before, the evaluation waited for them forever), and the result is the
// whole model's on one rank.
TEST(ExpertParallel, EvaluationWithFewerBatchesThanDataRanksMatchesOneRank) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(1, model_of("v3"));
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  const RunConfig cfg = files.config({"parallel.expert=" + std::to_string(world_size())});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  for (int64_t batches : {1, 3}) {
    const LossSums want = ref.evaluate(batches), got = t.evaluate(batches);
    EXPECT_EQ(got.count, want.count) << batches << " batches";
    EXPECT_NEAR(got.mean(), want.mean(), 1e-5 * want.mean()) << batches << " batches";
    EXPECT_EQ(got.correct, want.correct) << batches << " batches";
  }
}

// Token dropping (moe.capacity_factor 1) is decided on the token's rank before the dispatch: the
// expert-parallel run drops the same pairs and trains the same model; the metrics report them.
// Dropped by position: with drop_policy "probs" an expert keeps its largest routing weights, and
// a freshly initialised sigmoid router gives every weight nearly 0.5, so two layouts whose expert
// GEMMs group rows differently (last-bit differences, 1e-7) can keep different ones of two
// near-equal weights; the model-level test (test_expert_parallel) checks "probs" exactly.
TEST(ExpertParallel, TokenDroppingIsTheSameAtEveryExpertSize) {
  DSTRAIN_REQUIRE_RANKS(world_size() >= 2, "2 or 4");
  RunFiles files(kSteps, model_of("v3"));
  const std::vector<std::string> capacity = {"moe.capacity_factor=1.0", "moe.drop_policy=\"position\"",
                                             "train.steps_per_print=1"};
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(capacity), solo);
  ref.init_weights("");
  ref.train();
  std::vector<std::string> o = capacity;
  o.push_back("parallel.expert=" + std::to_string(world_size()));
  const RunConfig cfg = files.config(o);
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  expect_same_training(ref, t, grid, "v3 capacity 1.0 expert " + std::to_string(world_size()));
  int64_t dropped = 0;
  for (size_t i = 0; i < t.history().size(); ++i) {
    for (size_t l = 0; l < t.history()[i].moe.size(); ++l) {
      const MoeLayerStats &a = t.history()[i].moe[l], &b = ref.history()[i].moe[l];
      EXPECT_EQ(a.dropped, b.dropped) << "step " << i + 1 << " layer " << a.layer;
      // The rows computed are the kept ones.
      int64_t assigned = 0, received = 0;
      for (int64_t x : a.tokens) assigned += x;
      for (int64_t x : a.received) received += x;
      EXPECT_EQ(received + a.dropped, assigned) << "step " << i + 1 << " layer " << a.layer;
      dropped += a.dropped;
    }
  }
  EXPECT_GT(dropped, 0) << "capacity 1.0 dropped nothing: the test does not exercise dropping";
  if (world_rank() == 0) {
    ASSERT_NE(t.metrics(), nullptr);
    EXPECT_NE(t.metrics()->prometheus_text().find("dstrain_moe_dropped_rows"), std::string::npos);
  }
}

// Expert parallelism with tensor parallelism and sequence parallelism (expert 2 within data 2,
// tensor 2), and with pipeline stages (expert 2 within data 2, pipeline 2), at 4 ranks.
TEST(ExpertParallelFourRanks, ComposesWithTensorAndPipelineParallelism) {
  DSTRAIN_REQUIRE_RANKS(world_size() == 4, "4");
  json run = model_of("v3");
  run["train"]["train_batch_size"] = 16;  // 4 micro-batches of 2 per data-parallel rank
  RunFiles files(kSteps, run);
  for (const std::string other : {"tensor", "pipeline"}) {
    std::vector<std::string> layout = {"parallel.data=2", "parallel." + other + "=2"};
    if (other == "tensor") layout.push_back("parallel.sequence_parallel=true");
    // The reference: one process with every expert, on the same global batches.
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer ref(files.solo_config(), solo);
    ref.init_weights("");
    ref.train();
    layout.push_back("parallel.expert=2");
    const RunConfig cfg = files.config(layout);
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    Trainer t(cfg, grid);
    t.init_weights("");
    t.train();
    ASSERT_EQ(t.history().size(), ref.history().size());
    for (size_t i = 0; i < t.history().size(); ++i) {
      const double want = ref.history()[i].loss;
      EXPECT_NEAR(t.history()[i].loss, want, 1e-5 * std::fabs(want)) << other << ": step " << i + 1;
      EXPECT_NEAR(t.history()[i].grad_norm, ref.history()[i].grad_norm, 1e-5 * ref.history()[i].grad_norm) << other;
      for (size_t l = 0; l < t.history()[i].moe.size(); ++l) {
        EXPECT_EQ(t.history()[i].moe[l].tokens, ref.history()[i].moe[l].tokens) << other << ": loads";
      }
    }
    // This rank's pieces equal the same pieces cut from the reference's whole tensors.
    const ParamRegistry& reg = t.model().params();
    const ParamRegistry& rr = ref.model().params();
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      const int w = rr.find(p.name);
      ASSERT_GE(w, 0) << p.name;
      std::vector<float> piece(size_t(p.numel()));
      extract_local(p, rr.param(w), Tensor(piece.data(), DType::F32, p.shape));
      EXPECT_LE(rel_error(values(reg.param(id)), piece), kLayoutWeightTolerance) << other << ": " << p.name;
    }
  }
}

// A checkpoint written at one expert size resumes at another: W -> 1 -> 2 (4 -> 1 -> 2 at 4
// ranks). The steps after each resume have the uninterrupted run's losses and routing, and the
// file holds every expert of every MoE layer under its Hugging Face name.
TEST(ExpertParallel, CheckpointsReshardBetweenExpertSizes) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  for (const std::string model : {"v2", "v3"}) {
    RunFiles files(4, model_of(model));
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer full(files.solo_config(), solo);
    full.init_weights("");
    full.train();
    const std::string dir = "checkpoint.dir=" + quoted(files.dir() / ("ckpt_" + model));
    // (expert size, the step it trains to): written at W after 2 steps, at 1 after 3, read at 2.
    const std::vector<std::pair<int, int>> legs = {{W, 2}, {1, 3}, {2, 4}};
    for (size_t leg = 0; leg < legs.size(); ++leg) {
      const auto [ep, until] = legs[leg];
      const RunConfig cfg = files.config({"parallel.expert=" + std::to_string(ep), "train.max_steps=" + std::to_string(until),
                                          "checkpoint.save_final=true", dir});
      ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
      Trainer t(cfg, grid);
      if (leg == 0) {
        t.init_weights("");
      } else {
        ASSERT_TRUE(t.resume("auto"));
        EXPECT_EQ(t.step(), legs[leg - 1].second);
      }
      t.train();
      for (const StepRecord& r : t.history()) {
        const StepRecord& want = full.history()[size_t(r.step - 1)];
        EXPECT_NEAR(r.loss, want.loss, 1e-5 * std::fabs(want.loss)) << model << ": expert " << ep << ", step " << r.step;
        for (size_t l = 0; l < r.moe.size(); ++l) EXPECT_EQ(r.moe[l].tokens, want.moe[l].tokens) << model << ": loads";
      }
      if (leg + 1 == legs.size()) {
        const ParamRegistry& reg = t.model().params();
        const ParamRegistry& fr = full.model().params();
        for (int id = 0; id < reg.size(); ++id) {
          const ParamInfo& p = reg.info(id);
          const double tol = p.kind == ParamKind::RouterBias ? 1e-4 : 1e-5;  // bias: +-gamma steps, compared relative
          EXPECT_LE(rel_error(values(reg.param(id)), values(fr.param(fr.find(p.name)))), tol) << model << ": " << p.name;
        }
      }
    }
    if (world_rank() == 0) {
      const std::filesystem::path ckpt = files.dir() / ("ckpt_" + model);
      std::ifstream latest(ckpt / "latest");
      std::string name;
      std::getline(latest, name);
      const CheckpointInfo info = inspect_checkpoint((ckpt / name).string());
      std::set<std::string> names;
      for (const CheckpointTensorInfo& t : info.tensors) {
        if (t.group == "model") names.insert(t.name);
        EXPECT_TRUE(t.ok()) << t.group << "/" << t.name;
      }
      const ParamRegistry& fr = full.model().params();
      EXPECT_EQ(names.size(), size_t(fr.size())) << model;
      for (const ParamInfo& p : fr.all()) EXPECT_TRUE(names.count(p.name)) << model << ": " << p.name;
      EXPECT_TRUE(names.count("model.layers.2.mlp.experts.7.down_proj.weight")) << model;
    }
  }
}

// --save-hf of an expert-parallel run: one process writes every expert, equal to the run with
// every expert everywhere; loading the export at another expert size gives each rank its experts.
TEST(ExpertParallel, HuggingFaceExportHoldsEveryExpert) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(2, model_of("v3"));
  // The reference: one process holding every expert, on the same global batches.
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  const RunConfig cfg = files.config({"parallel.expert=" + std::to_string(W)});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  const std::string dir = (files.dir() / "hf").string();
  t.save_hf(dir);
  const ParamRegistry& rr = ref.model().params();
  if (world_rank() == 0) {
    Transformer loaded(ref.model().config(), Device::cpu());
    const auto counts = load_hf_weights(dir, loaded.params());
    EXPECT_EQ(counts.loaded, int64_t(loaded.params().size()));
    for (int id = 0; id < loaded.params().size(); ++id) {
      const std::string& name = loaded.params().info(id).name;
      EXPECT_LE(rel_error(values(loaded.params().param(id)), values(rr.param(rr.find(name)))), 1e-5) << name;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
  // Loaded at expert size 2: each rank's experts and the replicated rest come from the files.
  const RunConfig c2 = files.config({"parallel.expert=2"});
  ProcessGrid g2(MPI_COMM_WORLD, c2.parallel);
  Trainer back(c2, g2);
  back.init_weights(dir);
  const ParamRegistry& reg = back.model().params();
  int experts = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    experts += p.placement.kind == Placement::Kind::Expert;
    EXPECT_LE(rel_error(values(reg.param(id)), values(rr.param(rr.find(p.name)))), 1e-5) << p.name;
  }
  EXPECT_EQ(experts, int(back.model().moe_layers().size()) * 3 * 4);
}

TEST(ExpertParallel, MetricsReportReceivedRowsAndAllToAllTraffic) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  RunFiles files(2, model_of("v2"));
  const RunConfig cfg = files.config({"parallel.expert=" + std::to_string(W), "train.steps_per_print=1"});
  ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
  Trainer t(cfg, grid);
  t.init_weights("");
  t.train();
  // Per step and MoE layer the ranks route 8 sequences of 16 tokens, 2 experts each.
  const int64_t rows_per_layer = 8 * 16 * 2;
  const int me = grid.coord(Axis::Data);
  for (const StepRecord& r : t.history()) {
    int64_t total = 0;
    for (int64_t x : r.ep.received_rows) total += x;
    EXPECT_EQ(total, int64_t(r.moe.size()) * rows_per_layer) << "step " << r.step;
    ASSERT_EQ(r.ep.received_rows.size(), size_t(W));
    // Dispatch and combine, forward and backward, 32 fp32 values a row: at most this rank's
    // routed rows out and the rows its experts received back, twice.
    const double own = double(r.moe.size()) * double(rows_per_layer / W);
    const double bound = 2.0 * (own + double(r.ep.received_rows[size_t(me)])) * 32 * 4;
    EXPECT_GT(r.ep.a2a_bytes, 0) << "step " << r.step;
    EXPECT_LE(r.ep.a2a_bytes, bound) << "step " << r.step;
    EXPECT_GT(r.ep.expert_seconds, 0);
  }
  if (world_rank() == 0) {
    const json ep = last_metrics_block(files.dir() / "out" / "metrics.jsonl", "expert_parallel");
    ASSERT_FALSE(ep.is_null()) << "metrics.jsonl has no expert_parallel block";
    EXPECT_EQ(ep["size"].get<int>(), W);
    EXPECT_EQ(ep["received_rows"].size(), size_t(W));
    EXPECT_GE(ep["received_max_over_mean"].get<double>(), 1.0);
    for (const char* key : {"a2a_bytes", "a2a_s", "dispatch_s", "expert_s", "combine_s", "imbalanced"}) {
      EXPECT_TRUE(ep.contains(key)) << key;
    }
    ASSERT_NE(t.metrics(), nullptr);
    const std::string prom = t.metrics()->prometheus_text();
    for (const char* name : {"dstrain_expert_parallel_received_max_over_mean", "dstrain_expert_parallel_a2a_bytes",
                             "dstrain_expert_parallel_a2a_seconds", "dstrain_expert_parallel_duration_seconds"}) {
      EXPECT_NE(prom.find(name), std::string::npos) << name;
    }
  }
}

// Layouts that cannot work are errors naming the key, on every rank.
TEST(ExpertParallel, LayoutsThatCannotWorkAreErrorsNamingTheKey) {
  const int W = world_size();
  DSTRAIN_REQUIRE_RANKS(W >= 2, "2 or 4");
  auto error_of = [](const RunConfig& cfg) -> std::string {
    ProcessGrid grid(MPI_COMM_WORLD, cfg.parallel);
    try {
      Trainer t(cfg, grid);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  {  // a dense model has no experts to split
    RunFiles files(1);
    const std::string e = error_of(files.config({"parallel.expert=2"}));
    EXPECT_NE(e.find("parallel.expert"), std::string::npos) << e;
    EXPECT_NE(e.find("dense"), std::string::npos) << e;
  }
  if (W == 4) {  // 6 experts do not split over 4 ranks
    json run = model_of("v2");
    run["model"]["n_routed_experts"] = 6;
    RunFiles files(1, run);
    const std::string e = error_of(files.config({"parallel.expert=4"}));
    EXPECT_NE(e.find("n_routed_experts = 6"), std::string::npos) << e;
    EXPECT_NE(e.find("parallel.expert"), std::string::npos) << e;
    EXPECT_NE(e.find("1, 2"), std::string::npos) << e;  // the sizes that work
  }
}

}  // namespace
}  // namespace dstrain
