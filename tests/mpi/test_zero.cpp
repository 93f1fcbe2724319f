// ZeRO stages 1, 2 and 3 (with and without CPU offload) at 1, 2 and 4 ranks: the same losses
// and weights as one process at stage 0 (the whole model on every rank alone) within 1e-5 on the dense, DeepSeek-V2 and DeepSeek-V3 models; a
// stage-3 resume is bitwise exact; a sharded checkpoint restarts at another stage and rank
// count with the same losses and exports the same Hugging Face weights; the sharded parts of
// the memory fall as 1/N; and the memory check refuses at stage 0 what fits at stage 3.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "resume_check.h"
#include "run_files.h"
#include "train/memory_model.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

constexpr int kSteps = 4;

// Small buckets, prefetches and persistence threshold, so that the tiny models exercise many
// buckets, prefetches and sharded (not persistent) parameters.
std::vector<std::string> zero_overrides(int stage, std::vector<std::string> more = {}) {
  std::vector<std::string> o = {"train.zero_optimization.stage=" + std::to_string(stage),
                                "train.zero_optimization.reduce_bucket_size=1500",
                                "train.zero_optimization.allgather_bucket_size=2000",
                                "train.zero_optimization.stage3_prefetch_bucket_size=1200",
                                "train.zero_optimization.stage3_param_persistence_threshold=40"};
  o.insert(o.end(), more.begin(), more.end());
  return o;
}

json model_of(const std::string& name) {
  if (name == "v2") return v2_model();
  if (name == "v3") return v3_model();
  return json::object();  // RunFiles' dense GQA model
}

// The whole weights of a trainer, whatever its stage (stage 3 gathers them for the look).
std::vector<float> whole_weights(Trainer& t) {
  t.optimizer().gather_all();
  const Buffer& v = t.model().params().values();
  std::vector<float> out(v.data<float>(), v.data<float>() + v.numel());
  t.optimizer().release_unused();
  return out;
}

void expect_same_training(Trainer& ref, Trainer& z, const std::string& what) {
  ASSERT_EQ(ref.history().size(), z.history().size());
  for (size_t i = 0; i < ref.history().size(); ++i) {
    const double a = z.history()[i].loss, b = ref.history()[i].loss;
    EXPECT_NEAR(a, b, 1e-5 * std::fabs(b)) << what << ": loss of step " << i + 1;
    EXPECT_NEAR(z.history()[i].grad_norm, ref.history()[i].grad_norm, 1e-5 * ref.history()[i].grad_norm)
        << what << ": gradient norm of step " << i + 1;
  }
  const std::vector<float> wr = whole_weights(ref), wz = whole_weights(z);
  const ParamRegistry& reg = ref.model().params();
  double worst = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    const double e = rel_error(wz.data() + p.offset, wr.data() + p.offset, p.numel());
    EXPECT_LE(e, 1e-5) << what << ": " << p.name << " after " << ref.history().size() << " steps";
    worst = std::max(worst, e);
  }
  if (world_rank() == 0) {
    std::printf("[ %d ranks ] %s: loss %.6f vs %.6f (stage 0), worst weight error %.2e\n", world_size(), what.c_str(),
                z.history().back().loss, ref.history().back().loss, worst);
  }
}

class ZeroMatchesStageZero : public ::testing::TestWithParam<std::string> {};

TEST_P(ZeroMatchesStageZero, InLossesAndWeights) {
  RunFiles files(kSteps, model_of(GetParam()));
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  for (int stage : {1, 2, 3}) {
    Trainer z(files.config(zero_overrides(stage)), grid);
    ASSERT_GE(z.optimizer().stage(), 1);
    // Every rank's weights stay the same bits (each rank steps its pieces; the gathers
    // hand every rank the same result).
    z.on_step = [&](const StepRecord&) {
      const std::vector<float> w = whole_weights(z);
      uint64_t mine = checksum(w.data(), w.size() * sizeof(float));
      std::vector<uint64_t> all(static_cast<size_t>(world_size()));
      MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
      for (size_t r = 0; r < all.size(); ++r) EXPECT_EQ(all[r], all[0]) << "weights of rank " << r;
    };
    z.init_weights("");
    z.train();
    expect_same_training(ref, z, GetParam() + " stage " + std::to_string(stage));
  }
}

INSTANTIATE_TEST_SUITE_P(Models, ZeroMatchesStageZero, ::testing::Values("dense", "v2", "v3"));

TEST(Zero, OffloadMatchesStageZero) {
  RunFiles files(kSteps, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  // pin_memory (DeepSpeed's key, default false) puts the host state in page-locked memory.
  const std::vector<std::pair<std::vector<std::string>, const char*>> cases = {
      {zero_overrides(1, {"train.zero_optimization.offload_optimizer.device=cpu"}), "host"},
      {zero_overrides(2, {R"(train.zero_optimization.offload_optimizer={"device": "cpu", "pin_memory": true})"}),
       "pinned_host"},
      {zero_overrides(3, {"train.zero_optimization.offload_optimizer.device=cpu"}), "host"},
      {zero_overrides(3, {"train.zero_optimization.offload_optimizer.device=cpu",
                          R"(train.zero_optimization.offload_param={"device": "cpu", "pin_memory": true})"}),
       "pinned_host"}};
  for (size_t c = 0; c < cases.size(); ++c) {
    Trainer z(files.config(cases[c].first), grid);
    // The optimizer state lives in the host allocator's memory, page-locked with pin_memory.
    ASSERT_STREQ(std::string(z.optimizer().master().allocator()->name()).c_str(), cases[c].second) << "case " << c;
    z.init_weights("");
    z.train();
    expect_same_training(ref, z, "offload case " + std::to_string(c));
  }
}

TEST(Zero, Stage3WithoutOverlapOrPrefetchMatches) {
  RunFiles files(kSteps);
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config(), solo);
  ref.init_weights("");
  ref.train();
  Trainer z(files.config(zero_overrides(3, {"train.zero_optimization.overlap_comm=false",
                                            "train.zero_optimization.stage3_prefetch_bucket_size=1",
                                            "train.zero_optimization.stage3_param_persistence_threshold=0"})),
            grid);
  z.init_weights("");
  z.train();
  expect_same_training(ref, z, "stage 3, blocking, no prefetch, nothing persistent");
}

TEST(Zero, AllForwardsFirstScheduleMatches) {
  // Every forward (which already writes the head's gradients) before any backward.
  RunFiles files(kSteps, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  Trainer ref(files.solo_config({"train.micro_batch_schedule=all_forward_all_backward"}), solo);
  ref.init_weights("");
  ref.train();
  for (int stage : {2, 3}) {
    Trainer z(files.config(zero_overrides(stage, {"train.micro_batch_schedule=all_forward_all_backward"})), grid);
    z.init_weights("");
    z.train();
    expect_same_training(ref, z, "all forwards first, stage " + std::to_string(stage));
  }
}

TEST(Zero, FP16OverflowsSkipTheStepOnEveryRankAsAtStageZero) {
  // A loss scale of 2^22 overflows fp16 at once: the shards' norm must see it on every rank,
  // and the skipped steps and the lowered scale must be those of stage 0.
  RunFiles files(10);
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  const std::vector<std::string> fp16 = {"train.fp16={\"enabled\": true, \"initial_scale_power\": 22, "
                                         "\"hysteresis\": 1}",
                                         "train.communication_data_type=fp32"};
  Trainer ref(files.solo_config(fp16), solo);
  ref.init_weights("");
  ref.train();
  for (int stage : {2, 3}) {
    Trainer z(files.config(zero_overrides(stage, fp16)), grid);
    z.init_weights("");
    z.train();
    ASSERT_EQ(z.history().size(), ref.history().size());
    int overflows = 0;
    for (size_t i = 0; i < ref.history().size(); ++i) {
      EXPECT_EQ(z.history()[i].overflow, ref.history()[i].overflow) << "stage " << stage << ", step " << i + 1;
      EXPECT_EQ(z.history()[i].loss_scale, ref.history()[i].loss_scale) << "stage " << stage << ", step " << i + 1;
      EXPECT_NEAR(z.history()[i].loss, ref.history()[i].loss, 1e-4 * std::fabs(ref.history()[i].loss));
      overflows += ref.history()[i].overflow;
    }
    EXPECT_GT(overflows, 0) << "the scale was meant to overflow";
    EXPECT_LT(overflows, int(ref.history().size())) << "and then to train";
    EXPECT_EQ(z.optimizer_steps(), ref.optimizer_steps());
  }
}

TEST(Zero, BF16Stage3MatchesBF16StageZero) {
  RunFiles files(kSteps, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {}), solo(MPI_COMM_SELF, {});
  // Gradients communicated in fp32, and in bf16 (DeepSpeed's default for a bf16 run): one
  // process at stage 0 sums in its own order, stage 3 reduce-scatters each micro-step (in bf16:
  // rounding each partial sum).
  for (const char* comm : {"fp32", "bf16"}) {
    const std::vector<std::string> bf16 = {"train.bf16.enabled=true", std::string("train.communication_data_type=") + comm};
    Trainer ref(files.solo_config(bf16), solo);
    ref.init_weights("");
    ref.train();
    Trainer z(files.config(zero_overrides(3, bf16)), grid);
    z.init_weights("");
    z.train();
    ASSERT_EQ(ref.history().size(), z.history().size());
    const bool fp32_comm = std::string(comm) == "fp32";
    const double tol = fp32_comm ? 1e-3 : 5e-3;
    for (size_t i = 0; i < ref.history().size(); ++i) {
      // The compute copy is rounded from the same masters; only the order (and, in bf16, the
      // rounding) of the gradient sums differs, and bf16 activations pass those last bits on.
      EXPECT_NEAR(z.history()[i].loss, ref.history()[i].loss, tol * std::fabs(ref.history()[i].loss))
          << "bf16 loss of step " << i + 1 << ", gradients communicated in " << comm;
    }
    // The fp32 masters, not only the losses: a stage 3 that dropped or misplaced an update would
    // still start from the same weights and give near losses for a few steps. Compared as the
    // update each tensor received (masters after minus before), by cosine and relative norm.
    Trainer init(files.solo_config(bf16), solo);
    init.init_weights("");
    const std::vector<float> w0 = whole_weights(init), wr = whole_weights(ref), wz = whole_weights(z);
    const ParamRegistry& reg = ref.model().params();
    double worst_cos = 1, worst_norm = 0, all_dot = 0, all_r = 0, all_z = 0, all_d = 0;
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      double dot = 0, nr = 0, nz = 0, nd = 0;
      for (int64_t k = p.offset; k < p.offset + p.numel(); ++k) {
        const double ur = double(wr[size_t(k)]) - w0[size_t(k)], uz = double(wz[size_t(k)]) - w0[size_t(k)];
        dot += ur * uz;
        nr += ur * ur;
        nz += uz * uz;
        nd += (ur - uz) * (ur - uz);
      }
      all_dot += dot, all_r += nr, all_z += nz, all_d += nd;
      if (nr == 0 && nz == 0) continue;  // not updated by either (an unused expert)
      const double cos = dot / std::sqrt(nr * nz), rel = std::sqrt(nd / nr);
      // fp32 communication: only the order of the sums differs. bf16: each micro-step's partial
      // sums are rounded to bf16 (one process rounds none), and AdamW's first steps move a
      // weight by about +-lr whatever its gradient's size, so a tiny gradient whose sign the
      // rounding flips moves it the other way (measured per tensor: cosine 0.96 at worst). A lost
      // or misplaced update reads cosine near 0.
      EXPECT_GE(cos, fp32_comm ? 0.99999 : 0.9) << p.name << ": update direction, gradients in " << comm;
      if (fp32_comm) EXPECT_LE(rel, 1e-4) << p.name << ": update size, gradients in " << comm;
      worst_cos = std::min(worst_cos, cos);
      worst_norm = std::max(worst_norm, rel);
    }
    // Over the whole model.
    const double model_cos = all_dot / std::sqrt(all_r * all_z), model_rel = std::sqrt(all_d / all_r);
    EXPECT_GE(model_cos, fp32_comm ? 0.99999 : 0.99) << "the model's update, gradients in " << comm;
    EXPECT_LE(model_rel, fp32_comm ? 1e-4 : 0.15) << "the model's update, gradients in " << comm;
    if (world_rank() == 0) {
      std::printf("[ %d ranks ] bf16, %s communication: stage 3 loss %.6f vs %.6f at stage 0 alone; master updates: "
                  "the model's cosine %.6f and relative difference %.2e, a tensor's worst %.6f and %.2e\n",
                  world_size(), comm, z.history().back().loss, ref.history().back().loss, model_cos, model_rel, worst_cos,
                  worst_norm);
    }
  }
}

TEST(Zero, Stage3ResumeIsBitwiseExact) {
  RunFiles files(5, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {});
  expect_resume_is_bitwise(files, grid, 2, zero_overrides(3));
}

TEST(Zero, Stage2OffloadResumeIsBitwiseExact) {
  RunFiles files(5);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  expect_resume_is_bitwise(files, grid, 3, zero_overrides(2, {"train.zero_optimization.offload_optimizer.device=cpu"}));
}

// A stage-3 checkpoint of every rank resumes at stage 0 on one rank and at stage 2 on two,
// with the losses of the uninterrupted run, and exports the same Hugging Face weights.
TEST(Zero, Stage3CheckpointRestartsAtOtherStagesAndRankCounts) {
  RunFiles files(6);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const int rank = world_rank();
  const auto dir_of = [&](const std::string& name) {
    return "checkpoint.dir=" + json((files.dir() / name).string()).dump();
  };
  Trainer full(files.config({dir_of("full")}), grid);
  full.init_weights("");
  full.train();
  {
    Trainer a(files.config(zero_overrides(3, {"train.max_steps=3", "checkpoint.save_final=true", dir_of("z3")})), grid);
    a.init_weights("");
    a.train();
    a.save_hf((files.dir() / "hf_stage3").string());
  }
  const std::string ckpt = (files.dir() / "z3" / "step_00000003.h5").string();
  ASSERT_TRUE(std::filesystem::exists(ckpt)) << ckpt;

  auto expect_continues = [&](Trainer& b, const std::string& what) {
    ASSERT_EQ(b.step(), 3);
    b.train();
    ASSERT_EQ(b.history().size(), 3u);
    for (size_t i = 0; i < 3; ++i) {
      const double x = b.history()[i].loss, y = full.history()[3 + i].loss;
      EXPECT_NEAR(x, y, 1e-5 * std::fabs(y)) << what << ": loss of step " << 4 + i;
    }
  };
  {
    // Stage 0 on one rank (every rank alone, reading the same file).
    ProcessGrid solo(MPI_COMM_SELF, {});
    Trainer b(files.config({dir_of("solo_" + std::to_string(rank))}), solo);
    ASSERT_TRUE(b.resume(ckpt));
    if (rank == 0) b.save_hf((files.dir() / "hf_stage0").string());
    expect_continues(b, "stage 0 on 1 rank");
  }
  MPI_Comm two = first_ranks(2);
  if (two != MPI_COMM_NULL) {
    ProcessGrid g2(two, {});
    Trainer b(files.config(zero_overrides(2, {dir_of("two")})), g2);
    ASSERT_TRUE(b.resume(ckpt));
    expect_continues(b, "stage 2 on " + std::to_string(g2.world_size()) + " rank(s)");
    MPI_Comm_free(&two);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    for (const char* f : {"model.safetensors", "config.json"}) {
      std::ifstream x(files.dir() / "hf_stage3" / f, std::ios::binary), y(files.dir() / "hf_stage0" / f, std::ios::binary);
      const std::string a((std::istreambuf_iterator<char>(x)), {}), b((std::istreambuf_iterator<char>(y)), {});
      EXPECT_FALSE(a.empty()) << f;
      EXPECT_TRUE(a == b) << f << " exported at stage 3 differs from the export of its checkpoint at stage 0";
    }
  }
}

// The sharded parts hold 1/N of the model per rank, and the whole weights (stage 3) and whole
// gradients (stages 2 and 3) are only held while they are in use.
TEST(Zero, ShardedMemoryFallsWithRanks) {
  RunFiles files(2, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const int n = world_size();
  for (int stage : {1, 2, 3}) {
    Trainer z(files.config(zero_overrides(stage)), grid);
    const ParamRegistry& reg = z.model().params();
    int64_t params = 0, bound = 0;
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      params += p.numel();
      const int64_t rows = p.shape[0];
      bound += ((rows + n - 1) / n) * (p.numel() / rows) + 16;  // a piece of at most ceil(R/N) rows, aligned
    }
    const DistributedOptimizer& zo = z.optimizer();
    EXPECT_LE(zo.shard_numel(), bound) << "stage " << stage;
    EXPECT_LE(double(zo.shard_numel()), double(params) / n * 1.25 + 16.0 * reg.size()) << "stage " << stage;
    int64_t total = 0, mine = zo.shard_numel();
    MPI_Allreduce(&mine, &total, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
    EXPECT_GE(total, params) << "the shards cover every element";
    z.init_weights("");
    int64_t peak_gathered = 0, peak_grads = 0;
    z.on_step = [&](const StepRecord&) {
      const ZeroMemory m = z.optimizer().memory();
      peak_gathered = std::max(peak_gathered, m.gathered_peak);
      peak_grads = std::max(peak_grads, m.transient_grads_peak);
      EXPECT_EQ(m.optimizer, 2 * m.master) << "two moments per master element";
      EXPECT_EQ(m.master, zo.shard_numel() * 4);
      if (stage == 3) {
        // Between steps only the persistent parameters are whole.
        int64_t persistent = 0;
        for (int id = 0; id < reg.size(); ++id) persistent += zo.persistent(id) ? reg.info(id).numel() * 4 : 0;
        EXPECT_EQ(m.gathered, persistent);
      }
    };
    z.train();
    const int64_t whole = int64_t(reg.values().numel()) * 4;
    if (stage == 3) {
      EXPECT_GT(peak_gathered, 0);
      EXPECT_LT(peak_gathered, whole) << "stage 3 never holds every weight at once";
    }
    if (stage >= 2) {
      EXPECT_GT(peak_grads, 0);
      EXPECT_LT(peak_grads, whole) << "stage " << stage << " never holds every gradient at once";
    }
    // The memory categories of metrics see the same.
    const MemoryStats ms = memory_stats();
    EXPECT_GE(ms.bytes[size_t(MemCategory::OptimizerState)], 2 * zo.shard_numel() * 4);
  }
}

// Stage 3 holds the layers in use and at most stage3_prefetch_bucket_size elements gathered
// ahead of their use, however many layers there are.
TEST(Zero, Stage3PrefetchStaysWithinItsBucket) {
  RunFiles files(2, {{"model", {{"num_hidden_layers", 6}}}});
  ProcessGrid grid(MPI_COMM_WORLD, {});
  int64_t layer = 0;  // non-persistent elements of one decoder layer
  {
    Trainer probe(files.config(zero_overrides(3)), grid);
    const ParamRegistry& reg = probe.model().params();
    for (int id = 0; id < reg.size(); ++id) {
      if (reg.info(id).layer == 0 && !probe.optimizer().persistent(id)) layer += reg.info(id).numel();
    }
  }
  ASSERT_GT(layer, 0);
  Trainer z(files.config(zero_overrides(3, {"train.zero_optimization.stage3_prefetch_bucket_size=" +
                                            std::to_string(layer)})),
            grid);
  const ParamRegistry& reg = z.model().params();
  int64_t persistent = 0, outside = 0, whole = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const int64_t n = reg.info(id).numel();
    whole += n;
    if (z.optimizer().persistent(id)) {
      persistent += n;
    } else if (reg.info(id).layer < 0) {
      outside += n;  // embedding, head
    }
  }
  z.init_weights("");
  int64_t peak = 0;
  z.on_step = [&](const StepRecord&) { peak = std::max(peak, z.optimizer().memory().gathered_peak / 4); };
  z.train();
  // In use: a layer, or the embedding or head; ahead: one bucket; always: the persistent ones.
  const int64_t bound = persistent + std::max(layer, outside) + layer;
  EXPECT_LE(peak, bound) << "gathered at once, of " << whole << " elements in all";
  EXPECT_LT(bound, whole * 3 / 4) << "the bound must say something";
}

// A model whose state does not fit metrics.memory_budget_gb at stage 0 trains at stage 3 when
// the ranks' shards do.
TEST(Zero, MemoryBudgetRefusesStageZeroAndAdmitsStage3) {
  RunFiles files(1);
  ProcessGrid grid(MPI_COMM_WORLD, {});
  const int n = world_size();
  const RunConfig base = files.config();
  const double params = double(base.model.num_parameters());
  EXPECT_DOUBLE_EQ(model_state_bytes_per_rank(base, n), 16 * params);
  RunConfig z3 = files.config(zero_overrides(3));
  EXPECT_DOUBLE_EQ(model_state_bytes_per_rank(z3, n), 16 * params / n);
  // Split over tensor 2 x pipeline 2 a rank holds a quarter of the dense model (the estimate
  // spreads the layers evenly over the stages), and ZeRO shards that quarter.
  const RunConfig split = files.config({"parallel.tensor=2", "parallel.pipeline=2"});
  EXPECT_DOUBLE_EQ(model_state_bytes_per_rank(split, 1), 16 * params / 4);
  std::vector<std::string> split3 = zero_overrides(3);
  split3.insert(split3.end(), {"parallel.tensor=2", "parallel.pipeline=2"});
  EXPECT_DOUBLE_EQ(model_state_bytes_per_rank(files.config(split3), 2), 16 * params / 4 / 2);
  // A budget between the two: 60% of stage 0's need. Stage 0 is refused before anything is
  // allocated; stage 3's shards fit it. The whole step at stage 3 (the gathered layers, the
  // activations, and the whole weights made before the optimizer shards them) is the memory
  // model's to fit (tests/mpi/test_memory_model.cpp): the run that admits stage 3 gets a budget
  // above the model's peak.
  const std::vector<std::string> wide = {"model.hidden_size=256", "model.intermediate_size=512"};
  const double wide_params = double(files.config(wide).model.num_parameters());
  const double refused_bytes = 16 * wide_params * 0.6;
  EXPECT_LT(model_state_bytes_per_rank(files.config(zero_overrides(3, wide)), std::max(n, 2)), refused_bytes);
  double admitted_bytes = refused_bytes;
  if (n >= 2) {
    RunConfig wide3 = files.config(zero_overrides(3, wide));
    check_layout(wide3, n);
    admitted_bytes = std::max(refused_bytes, 1.05 * double(estimate_memory(wide3, n).peak_total()));
  }
  std::vector<std::string> wide_budget = wide;
  wide_budget.push_back(fmt::format("metrics.memory_budget_gb={:.9f}", refused_bytes / 1e9));
  try {
    Trainer t(files.config(wide_budget), grid);
    FAIL() << "stage 0 fitted a budget below its need";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("metrics.memory_budget_gb"), std::string::npos) << msg;
    EXPECT_NE(msg.find("zero_optimization.stage"), std::string::npos) << msg;
  }
  if (n >= 2) {
    std::vector<std::string> admitted = wide;
    admitted.push_back(fmt::format("metrics.memory_budget_gb={:.9f}", admitted_bytes / 1e9));
    Trainer t(files.config(zero_overrides(3, admitted)), grid);
    t.init_weights("");
    t.train();
    EXPECT_EQ(t.history().size(), 1u);
    EXPECT_TRUE(std::isfinite(t.history().back().loss));
  } else {
    EXPECT_THROW(Trainer(files.config(zero_overrides(3, wide_budget)), grid), Error) << "one rank shards nothing";
  }
}

}  // namespace
}  // namespace dstrain
