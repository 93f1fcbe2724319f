// Expert parallelism at the model level: DeepSeek-V2 and V3 models (MLA, DeepSeekMoE with 8
// routed experts, a shared expert, V3's MTP module) with their routed experts split over all
// ranks of the job (one expert group), each rank training its own tokens, against the whole
// model on every rank: each rank's losses, routing and dense gradients are those of its own
// tokens through the whole model, and each expert's gradient on its owner is the sum over the
// ranks of the whole model's gradients of that expert. Rows go to the experts' owners and come
// back through all-to-alls; on one rank the split is the whole model. The same holds with an
// expert capacity (token dropping, both drop policies): the pairs are dropped on the token's
// rank before the dispatch, so the split drops the whole model's pairs and sends only the rest.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "model/moe.h"
#include "model/transformer.h"
#include "run_files.h"

namespace dstrain {
namespace {

// A model, "v2" or "v3", and optionally an expert capacity: "v3_capacity_probs" drops by
// routing weight, "..._capacity_position" by token order, at capacity factor 1.
class ExpertParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(ExpertParallel, MatchesTheWholeModelPerRankAndSummedOverRanks) {
  MpiCommunicator ep(MPI_COMM_WORLD, "expert");
  const int rank = ep.rank(), size = ep.size();
  const std::string name = GetParam();
  const json run = name.rfind("v2", 0) == 0 ? v2_model() : v3_model();
  ModelConfig c = ModelConfig::from_hf_json(run["model"], name);
  const bool capacity = name.find("_capacity_") != std::string::npos;
  if (capacity) {
    c.moe_capacity_factor = 1.0;
    c.moe_drop_policy = name.substr(name.rfind('_') + 1);
  }
  const int64_t B = 2, T = 8, D = c.num_nextn_predict_layers;
  // Each rank's own tokens, two micro-batches.
  std::vector<std::vector<int32_t>> tokens, targets;
  for (int m = 0; m < 2; ++m) {
    tokens.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 1000 * unsigned(rank) + unsigned(m)));
    targets.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 2000 * unsigned(rank) + unsigned(m)));
  }
  auto tok = [&](std::vector<int32_t>& v) { return Tensor(v.data(), DType::I32, Shape{B, T}); };
  LossScales scales;
  scales.token = float(1.0 / double(2 * B * T * size));
  scales.sequence = 1.0 / double(2 * B * size);
  scales.micro_batch = 1.0 / double(2 * size);
  for (int64_t k = 0; k < D; ++k) scales.mtp_token.push_back(float(0.3 / double(2 * B * (T - k - 1) * size)));

  Transformer whole(c, Device::cpu());
  whole.init_weights(3);
  ProcessGroups groups;
  groups.ep = &ep;
  Transformer split(c, Device::cpu(), ShardSpec::tensor_parallel(c, 0, 1, rank, size), groups);
  split.init_weights(3);
  EXPECT_LT(split.params().flat_numel(), size > 1 ? whole.params().flat_numel() : whole.params().flat_numel() + 1);
  for (int m = 0; m < 2; ++m) {
    const LossSums a = whole.forward(m, tok(tokens[size_t(m)]), tok(targets[size_t(m)]), scales);
    const LossSums b = split.forward(m, tok(tokens[size_t(m)]), tok(targets[size_t(m)]), scales);
    EXPECT_NEAR(b.sum, a.sum, 1e-5 * std::fabs(a.sum)) << "micro-batch " << m;
    for (int64_t k = 0; k < D; ++k) EXPECT_NEAR(b.mtp_sum[size_t(k)], a.mtp_sum[size_t(k)], 1e-5 * a.mtp_sum[size_t(k)]);
  }
  // Micro-batch 1 with the split backward (input gradients, then the weight parts).
  whole.backward(1);
  whole.backward(0);
  split.backward(1, BackwardPart::Input);
  split.backward_weights(1);
  split.backward(0);

  // Routing: this rank's tokens' loads, and the rows its experts computed (all ranks' tokens).
  auto moe_w = whole.moe_layers(), moe_s = split.moe_layers();
  ASSERT_EQ(moe_w.size(), moe_s.size());
  const int64_t El = c.n_routed_experts / size, rows = 2 * B * T * c.num_experts_per_tok;  // routed, 2 micro-batches
  int64_t dropped = 0;
  for (size_t i = 0; i < moe_w.size(); ++i) {
    const RoutingStats& a = *moe_w[i].second->routing();
    const RoutingStats& b = *moe_s[i].second->routing();
    EXPECT_EQ(b.tokens_per_expert, a.tokens_per_expert) << "layer " << moe_w[i].first;
    EXPECT_EQ(b.dropped_rows, a.dropped_rows) << "layer " << moe_w[i].first;
    dropped += a.dropped_rows;
    if (!capacity) {
      std::vector<int64_t> all = a.tokens_per_expert;
      ep.all_reduce(Tensor(all.data(), DType::I64, Shape{int64_t(all.size())}));
      int64_t mine = 0;
      for (int64_t e = rank * El; e < (rank + 1) * El; ++e) mine += all[size_t(e)];
      EXPECT_EQ(b.received_rows, mine) << "layer " << moe_w[i].first;
    } else {
      // Only kept rows travel: summed over the group, the rows computed are the rows kept, and
      // each expert computes at most capacity rows per micro-batch of each rank.
      std::vector<int64_t> sums = {b.received_rows, rows - a.dropped_rows};
      ep.all_reduce(Tensor(sums.data(), DType::I64, Shape{2}));
      EXPECT_EQ(sums[0], sums[1]) << "layer " << moe_w[i].first;
      const int64_t cap = int64_t(std::ceil(double(rows / 2) / double(c.n_routed_experts) * c.moe_capacity_factor));
      EXPECT_LE(b.received_rows, 2 * size * El * cap) << "layer " << moe_w[i].first;
    }
    EXPECT_NEAR(b.aux_loss, a.aux_loss, 1e-6 * std::fabs(a.aux_loss) + 1e-12);
    if (size > 1) EXPECT_GT(b.a2a_bytes, 0);
  }
  if (capacity) {
    ep.all_reduce(Tensor(&dropped, DType::I64, Shape{1}));
    EXPECT_GT(dropped, 0) << "the case must drop rows";
  }
  // Gradients: dense ones are this rank's tokens'; an expert's is the sum over the ranks'.
  ParamRegistry& wr = whole.params();
  const ParamRegistry& sr = split.params();
  // Every expert's gradient summed over the ranks' tokens (the same tensors on every rank).
  for (int id = 0; id < wr.size(); ++id) {
    if (wr.info(id).group == ParamGroup::Expert) ep.all_reduce(wr.grad(id));
  }
  int experts = 0;
  for (int id = 0; id < sr.size(); ++id) {
    const ParamInfo& p = sr.info(id);
    const int w = wr.find(p.name);
    ASSERT_GE(w, 0) << p.name;
    std::vector<float> want(wr.grad(w).data<float>(), wr.grad(w).data<float>() + wr.grad(w).numel());
    experts += p.group == ParamGroup::Expert;
    Tensor g = sr.grad(id);
    ASSERT_EQ(g.numel(), int64_t(want.size())) << p.name;
    EXPECT_LT(rel_error(g.data<float>(), want.data(), g.numel()), 1e-5) << p.name;
  }
  // Each rank holds E / size experts of each MoE layer (gate, up and down each).
  EXPECT_EQ(experts, int(moe_s.size()) * 3 * int(c.n_routed_experts / size));
}

INSTANTIATE_TEST_SUITE_P(Models, ExpertParallel,
                         ::testing::Values("v2", "v3", "v2_capacity_probs", "v3_capacity_probs",
                                           "v3_capacity_position"));

}  // namespace
}  // namespace dstrain
