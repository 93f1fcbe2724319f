// DeepSeek-V2/V3 models under MPI at 1, 2 and 4 ranks: data-parallel training matches one
// rank (losses, weights and routing biases), ranks stay bitwise identical, and stopping and
// resuming from a checkpoint is bitwise exact, routing biases included.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "resume_check.h"
#include "run_files.h"
#include "train/trainer.h"

namespace dstrain {
namespace {

TEST(MoEDataParallel, MatchesOneRankIncludingRoutingBiases) {
  RunFiles files(6, v3_model());
  ProcessGrid solo(MPI_COMM_SELF, {});
  Trainer one(files.config({"checkpoint.save_final=false"}), solo);
  one.init_weights("");
  one.train();

  ProcessGrid grid(MPI_COMM_WORLD, {});
  Trainer dist(files.config({"checkpoint.save_final=false"}), grid);
  const int n = grid.world_size();
  dist.on_step = [&](const StepRecord&) {
    const Buffer& p = dist.model().params().values();
    uint64_t mine = checksum(p.data(), p.nbytes());
    std::vector<uint64_t> all(static_cast<size_t>(n));
    MPI_Allgather(&mine, 1, MPI_UINT64_T, all.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    for (int r = 0; r < n; ++r) EXPECT_EQ(all[size_t(r)], all[0]) << "weights of rank " << r;
  };
  dist.init_weights("");
  dist.train();
  ASSERT_EQ(dist.history().size(), one.history().size());
  for (size_t i = 0; i < one.history().size(); ++i) {
    const StepRecord &a = dist.history()[i], &b = one.history()[i];
    EXPECT_NEAR(a.loss, b.loss, 1e-5 * b.loss) << "step " << i + 1;
    EXPECT_NEAR(a.aux_loss, b.aux_loss, 1e-5 * std::fabs(b.aux_loss) + 1e-9) << "aux loss of step " << i + 1;
    EXPECT_NEAR(a.mtp_loss, b.mtp_loss, 1e-5 * b.mtp_loss) << "MTP loss of step " << i + 1;
    ASSERT_EQ(a.moe.size(), b.moe.size());
    for (size_t l = 0; l < a.moe.size(); ++l) EXPECT_EQ(a.moe[l].tokens, b.moe[l].tokens) << "expert loads";
  }
  const ParamRegistry& pd = dist.model().params();
  const ParamRegistry& po = one.model().params();
  int biases = 0;
  for (int id = 0; id < pd.size(); ++id) {
    const ParamInfo& p = pd.info(id);
    const double e = rel_error(pd.param(id).data<float>(), po.param(id).data<float>(), p.numel());
    EXPECT_LE(e, 1e-5) << p.name;
    if (p.kind == ParamKind::RouterBias) {
      ++biases;
      double moved = 0;
      for (int64_t i = 0; i < p.numel(); ++i) moved += std::fabs(pd.param(id).data<float>()[i]);
      EXPECT_GT(moved, 0) << p.name << " never moved";
    }
  }
  EXPECT_EQ(biases, 2) << "one MoE layer and the MTP module's";
}

TEST(MoEDataParallel, ResumeIsBitwiseExactWithRoutingBiases) {
  RunFiles files(6, v3_model());
  ProcessGrid grid(MPI_COMM_WORLD, {});
  expect_resume_is_bitwise(files, grid, 3);
}

// A checkpoint written at every rank continues at one rank, and one written at one rank
// continues at every rank: the same losses and routing biases as the uninterrupted run.
TEST(MoEDataParallel, RestartsOnAnotherRankCountWithRoutingBiases) {
  RunFiles files(6, v3_model());
  ProcessGrid solo(MPI_COMM_SELF, {});
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const auto dir_of = [&](const std::string& name) {
    return "checkpoint.dir=" + json((files.dir() / name).string()).dump();
  };
  Trainer full(files.config({dir_of("full_" + std::to_string(rank))}), solo);
  full.init_weights("");
  full.train();

  for (const auto& [writers, readers] : {std::pair{n, 1}, std::pair{1, n}}) {
    const std::string dir = dir_of(fmt::format("written_by_{}_for_{}", writers, readers));
    if (MPI_Comm w = first_ranks(writers); w != MPI_COMM_NULL) {
      ProcessGrid g(w, {});
      Trainer a(files.config({"train.max_steps=3", "checkpoint.save_final=true", dir}), g);
      a.init_weights("");
      a.train();
      MPI_Comm_free(&w);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (MPI_Comm r = first_ranks(readers); r != MPI_COMM_NULL) {
      ProcessGrid g(r, {});
      Trainer b(files.config({dir}), g);
      ASSERT_TRUE(b.resume("auto"));
      b.train();
      ASSERT_EQ(b.history().size(), 3u);
      for (size_t i = 0; i < 3; ++i) {
        const double want = full.history()[i + 3].loss;
        EXPECT_NEAR(b.history()[i].loss, want, 1e-5 * want)
            << "step " << i + 4 << ": written at " << writers << " rank(s), resumed at " << readers;
      }
      const ParamRegistry& pb = b.model().params();
      const ParamRegistry& pf = full.model().params();
      for (int id = 0; id < pb.size(); ++id) {
        if (pb.info(id).kind != ParamKind::RouterBias) continue;
        const float *x = pb.param(id).data<float>(), *y = pf.param(id).data<float>();
        for (int64_t e = 0; e < pb.info(id).numel(); ++e) {
          EXPECT_NEAR(x[e], y[e], 1e-6) << pb.info(id).name << "[" << e << "]: written at " << writers
                                        << " rank(s), resumed at " << readers;
        }
      }
      MPI_Comm_free(&r);
    }
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

}  // namespace
}  // namespace dstrain
