// Stages: the split of the model into contiguous pieces and parameter ranges, and the
// declared weight ties.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>

#include "model/stage.h"
#include "model/transformer.h"
#include "tiny_models.h"

namespace dstrain {
namespace {

ModelConfig small(bool tied, int64_t layers, int64_t mtp) {
  ModelConfig c = tiny_dense(/*gqa=*/false, tied);
  c.num_hidden_layers = layers;
  c.num_nextn_predict_layers = mtp;
  return c;
}

TEST(Stage, SplitsLayersEvenlyWithEmbeddingFirstAndHeadLast) {
  const auto s = split_stages(small(false, 7, 1), 3);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].str(), "stage 1/3: embedding, layers 0-2");
  EXPECT_EQ(s[1].str(), "stage 2/3: layers 3-4");
  EXPECT_EQ(s[2].str(), "stage 3/3: layers 5-6, head, mtp");
  EXPECT_EQ(split_stages(small(false, 7, 0), 1)[0].str(), "stage 1/1: embedding, layers 0-6, head");
  EXPECT_THROW(split_stages(small(false, 2, 0), 3), Error);
}

TEST(Stage, StagesOwnContiguousRangesThatPartitionTheRegistry) {
  for (bool tied : {false, true}) {
    const ModelConfig c = small(tied, 5, 0);
    Transformer model(c, Device::cpu());
    for (int count : {1, 2, 5}) {
      int next = 0;
      for (const StageSpec& s : split_stages(c, count)) {
        const Range r = stage_param_range(model.params(), s, c);
        EXPECT_EQ(r.begin, next) << s.str();
        for (int id = int(r.begin); id < int(r.end); ++id) {
          const ParamInfo& p = model.params().info(id);
          if (p.layer >= 0) {
            EXPECT_TRUE(p.layer >= s.first_layer && p.layer < s.end_layer) << p.name << " in " << s.str();
          }
        }
        next = int(r.end);
      }
      EXPECT_EQ(next, model.params().size()) << count << " stages";
    }
  }
}

TEST(Stage, TheModelIsOneStageHoldingEveryParameter) {
  const ModelConfig c = small(true, 3, 0);
  Transformer model(c, Device::cpu());
  const auto st = model.stages();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_TRUE(st[0].embedding && st[0].head);
  EXPECT_EQ(model.stage_params(st[0]), (Range{0, model.params().size()}));
}

TEST(Stage, TiesAreDeclared) {
  EXPECT_TRUE(tied_params(small(false, 2, 0)).empty());
  auto t = tied_params(small(true, 2, 0));
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].param, "model.embed_tokens.weight");
  EXPECT_EQ(t[0].uses, std::vector<std::string>{"lm_head"});
  // DeepSeek-V3's MTP modules share the embedding and the output head.
  t = tied_params(small(false, 2, 1));
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[0].uses, std::vector<std::string>{"mtp.embedding"});
  EXPECT_EQ(t[1].param, "lm_head.weight");
  EXPECT_EQ(t[1].uses, std::vector<std::string>{"mtp.head"});
  t = tied_params(small(true, 2, 1));
  ASSERT_EQ(t.size(), 1u);
  EXPECT_EQ(t[0].uses, (std::vector<std::string>{"lm_head", "mtp.embedding", "mtp.head"}));
}

// ---- balanced partitions ----

TEST(StageCost, DenseLayerAndHeadByHand) {
  // C 16, I 24, H 4, Hkv 2, D 4, V 23, T 8.
  const ModelConfig c = tiny_dense(/*gqa=*/true, false);
  const PieceCosts p = piece_costs(c, 8);
  ASSERT_EQ(p.layers.size(), 2u);
  EXPECT_TRUE(p.mtp.empty());
  EXPECT_EQ(p.embedding, 0.0);
  const double qkv = 2.0 * 16 * (4 + 2 * 2) * 4;  // 1024
  const double o = 2.0 * 4 * 4 * 16;               // 512
  const double scores = 2.0 * 4 * (4 + 4) * 4.5;   // QK^T and PV over (T+1)/2 keys: 288
  const double ffn = 3 * 2.0 * 16 * 24;            // 2304
  EXPECT_DOUBLE_EQ(p.layers[0], 3 * (qkv + o + scores + ffn));  // 12384
  EXPECT_DOUBLE_EQ(p.layers[1], p.layers[0]);
  EXPECT_DOUBLE_EQ(p.head, 3 * (2.0 * 16 * 23 + PieceCosts::kCrossEntropyFlopsPerLogit * 23));
  EXPECT_DOUBLE_EQ(p.total(), 2 * p.layers[0] + p.head);
  // Without the cross-entropy the pieces are the model's FLOPs per token.
  EXPECT_DOUBLE_EQ(p.total() - 3 * PieceCosts::kCrossEntropyFlopsPerLogit * 23, c.train_flops_per_token(8));
}

TEST(StageCost, MlaMoeAndMtpByHand) {
  // C 32, H 2, q_lora 12, kv_lora 8, nope 4, rope 4, v 4; I 24; 8 experts of 6, 2 per token, 1
  // shared; the first layer dense; V 40; T 8.
  const ModelConfig c = tiny_v3(/*mtp_depth=*/1);
  const PieceCosts p = piece_costs(c, 8);
  ASSERT_EQ(p.layers.size(), 2u);
  ASSERT_EQ(p.mtp.size(), 1u);
  const double q = 2.0 * 32 * 12 + 2.0 * 12 * 2 * 8;  // q_a, q_b
  const double kv = 2.0 * 32 * (8 + 4) + 2.0 * 8 * 2 * (4 + 4);  // kv_a, kv_b
  const double o = 2.0 * 2 * 4 * 32;
  const double scores = 2.0 * 2 * (8 + 4) * 4.5;
  const double attention = q + kv + o + scores;
  const double dense = 3 * 2.0 * 32 * 24;
  const double moe = 2 * (3 * 2.0 * 32 * 6) + 1 * (3 * 2.0 * 32 * 6) + 2.0 * 32 * 8;  // routed, shared, gate
  const double head = 2.0 * 32 * 40 + PieceCosts::kCrossEntropyFlopsPerLogit * 40;
  EXPECT_DOUBLE_EQ(p.layers[0], 3 * (attention + dense));
  EXPECT_DOUBLE_EQ(p.layers[1], 3 * (attention + moe));
  EXPECT_DOUBLE_EQ(p.head, 3 * head);
  EXPECT_DOUBLE_EQ(p.mtp[0], 3 * (2 * 2.0 * 32 * 32 + attention + moe + head));  // eh_proj, MoE layer, head
  // train_flops_per_token also counts MLA's two norm vectors as matmul parameters.
  EXPECT_NEAR(p.total() - 2 * 3 * PieceCosts::kCrossEntropyFlopsPerLogit * 40, c.train_flops_per_token(8),
              3 * 6.0 * (12 + 8));
}

// A DeepSeek-V3-shaped model, small: MLA, one dense layer then MoE layers, a large vocabulary,
// one MTP module.
ModelConfig v3_like(int64_t layers) {
  ModelConfig c = tiny_v3(1);
  c.hidden_size = 512;
  c.intermediate_size = 1536;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 8;
  c.q_lora_rank = 192;
  c.kv_lora_rank = 64;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.n_routed_experts = 32;
  c.num_experts_per_tok = 4;
  c.n_shared_experts = 1;
  c.moe_intermediate_size = 512;
  c.vocab_size = 32000;
  c.num_hidden_layers = layers;
  return c;
}

double max_stage_cost(const std::vector<StageSpec>& stages, const PieceCosts& p) {
  double m = 0;
  for (const StageSpec& s : stages) m = std::max(m, stage_cost(p, s));
  return m;
}

TEST(StageBalance, MovesLayersOffTheLastStageOfAV3LikeModel) {
  const ModelConfig c = v3_like(16);
  const PieceCosts p = piece_costs(c, 1024);
  EXPECT_LT(p.layers[0], p.layers[1]) << "the MoE layers are the heavier here";
  for (int count : {2, 4, 8}) {
    const auto even = split_stages(c, count), balanced = split_stages_balanced(c, count, 1024);
    ASSERT_EQ(balanced.size(), size_t(count));
    EXPECT_LT(balanced.back().num_layers(), even.back().num_layers()) << describe_stages(balanced, p);
    EXPECT_LT(max_stage_cost(balanced, p), max_stage_cost(even, p)) << describe_stages(balanced, p);
    EXPECT_TRUE(balanced.front().embedding && balanced.back().head && balanced.back().mtp);
    int next = 0;
    for (const StageSpec& s : balanced) {
      EXPECT_EQ(s.first_layer, next);
      EXPECT_GE(s.num_layers(), 1);
      next = s.end_layer;
    }
    EXPECT_EQ(next, 16);
  }
  // With two stages the head and MTP module push the first's share past half the layers.
  const auto two = split_stages_balanced(c, 2, 1024);
  EXPECT_GT(two[0].num_layers(), 8) << describe_stages(two, p);
}

// Every split of layers [0, L) into `count` non-empty contiguous stages.
void for_each_split(int L, int count, bool mtp, const std::function<void(const std::vector<StageSpec>&)>& fn) {
  std::vector<int64_t> sizes;
  ModelConfig c;
  c.num_hidden_layers = L;
  c.num_nextn_predict_layers = mtp ? 1 : 0;
  std::function<void(int)> rec = [&](int left) {
    if (int(sizes.size()) == count - 1) {
      sizes.push_back(left);
      fn(split_stages_manual(c, count, sizes));
      sizes.pop_back();
      return;
    }
    for (int n = 1; n <= left - (count - 1 - int(sizes.size())); ++n) {
      sizes.push_back(n);
      rec(left - n);
      sizes.pop_back();
    }
  };
  rec(L);
}

TEST(StageBalance, IsOptimalAgainstBruteForce) {
  uint64_t state = 12345;
  auto next = [&] {  // a small deterministic generator of costs in [1, 100]
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return double(1 + (state >> 33) % 100);
  };
  for (int L = 1; L <= 9; ++L) {
    for (int trial = 0; trial < 4; ++trial) {
      PieceCosts p;
      p.embedding = trial % 2 ? next() : 0;
      for (int l = 0; l < L; ++l) p.layers.push_back(next());
      p.head = next() * (trial + 1);
      if (trial >= 2) p.mtp = {next() * 3};
      for (int count = 1; count <= L; ++count) {
        const auto balanced = split_stages_balanced(p, count);
        const double got = max_stage_cost(balanced, p);
        double best = std::numeric_limits<double>::infinity();
        for_each_split(L, count, !p.mtp.empty(),
                       [&](const std::vector<StageSpec>& s) { best = std::min(best, max_stage_cost(s, p)); });
        // Among the optimal splits, none is more even (sum of squared stage costs).
        auto squares = [&](const std::vector<StageSpec>& s) {
          double sum = 0;
          for (const StageSpec& x : s) sum += stage_cost(p, x) * stage_cost(p, x);
          return sum;
        };
        double best_squares = std::numeric_limits<double>::infinity();
        for_each_split(L, count, !p.mtp.empty(), [&](const std::vector<StageSpec>& s) {
          if (max_stage_cost(s, p) <= best) best_squares = std::min(best_squares, squares(s));
        });
        EXPECT_EQ(got, best) << "L " << L << ", " << count << " stages: " << describe_stages(balanced, p);
        EXPECT_EQ(squares(balanced), best_squares) << "L " << L << ", " << count << " stages";
        EXPECT_EQ(balanced.back().mtp, !p.mtp.empty());
      }
    }
  }
  // Also on a model's costs, where the numbers are not small integers.
  const ModelConfig c = v3_like(7);
  const PieceCosts p = piece_costs(c, 4096);
  for (int count = 1; count <= 7; ++count) {
    double best = std::numeric_limits<double>::infinity();
    for_each_split(7, count, true,
                   [&](const std::vector<StageSpec>& s) { best = std::min(best, max_stage_cost(s, p)); });
    EXPECT_NEAR(max_stage_cost(split_stages_balanced(c, count, 4096), p), best, best * 1e-12) << count << " stages";
  }
}

TEST(StageBalance, DescribesTheSplitWithCostShares) {
  PieceCosts p;
  p.layers = {1, 1, 1, 1};
  p.head = 2;
  const auto s = split_stages_balanced(p, 2);
  EXPECT_EQ(describe_stages(s, p), "stage 0: embedding + layers 0-2 (50.0%), stage 1: layer 3 + head (50.0%)");
  p.layers = {10, 1, 1, 1};  // measured: a slow first layer stands alone
  EXPECT_EQ(describe_stages(split_stages_balanced(p, 2), p),
            "stage 0: embedding + layer 0 (66.7%), stage 1: layers 1-3 + head (33.3%)");
  EXPECT_EQ(describe_stages(split_stages(v3_like(3), 1), piece_costs(v3_like(3), 16)),
            "stage 0: embedding + layers 0-2 + head + mtp (100.0%)");
}

TEST(StageBalance, NeedsALayerPerStage) {
  const ModelConfig c = v3_like(3);
  EXPECT_EQ(split_stages_balanced(c, 3, 128).size(), 3u);
  try {
    split_stages_balanced(c, 4, 128);
    FAIL() << "4 stages for 3 layers";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("num_hidden_layers"), std::string::npos) << what;
    EXPECT_NE(what.find("parallel.pipeline"), std::string::npos) << what;
  }
  EXPECT_THROW(split_stages_balanced(c, 0, 128), Error);
  EXPECT_THROW(split_stages_balanced(c, 2, 0), Error);
}

TEST(StagePartition, ManualSplitsFollowTheListAndCheckIt) {
  const ModelConfig c = small(false, 7, 1);
  const auto s = split_stages_manual(c, 3, {2, 4, 1});
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].str(), "stage 1/3: embedding, layers 0-1");
  EXPECT_EQ(s[1].str(), "stage 2/3: layers 2-5");
  EXPECT_EQ(s[2].str(), "stage 3/3: layers 6-6, head, mtp");
  auto error = [&](int count, const std::vector<int64_t>& parts) {
    try {
      split_stages_manual(c, count, parts);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const std::string& what :
       {error(2, {2, 4, 1}), error(3, {3, 4, 0}), error(3, {3, 4, -1}), error(3, {2, 4, 2})}) {
    EXPECT_NE(what.find("parallel.partition"), std::string::npos) << what;
  }
  EXPECT_NE(error(2, {2, 4, 1}).find("pipeline has 2 stages"), std::string::npos);
  EXPECT_NE(error(3, {3, 4, 0}).find("at least one decoder layer"), std::string::npos);
  EXPECT_NE(error(3, {2, 4, 2}).find("num_hidden_layers"), std::string::npos);
}

TEST(StageBalance, BalancedStagesOwnContiguousRangesThatPartitionTheRegistry) {
  ModelConfig v3 = tiny_v3(1);
  v3.num_hidden_layers = 5;
  for (const ModelConfig& c : {small(true, 5, 0), v3}) {
    Transformer model(c, Device::cpu());
    for (int count = 1; count <= 5; ++count) {
      std::vector<int> owner(size_t(model.params().size()), -1);
      int next = 0;
      for (const StageSpec& s : split_stages_balanced(c, count, 8)) {
        const Range r = stage_param_range(model.params(), s, c);
        EXPECT_EQ(r.begin, next) << s.str();
        for (int id = int(r.begin); id < int(r.end); ++id) {
          EXPECT_EQ(owner[size_t(id)], -1) << model.params().info(id).name;
          owner[size_t(id)] = s.index;
          const ParamInfo& p = model.params().info(id);
          if (p.layer >= 0 && p.layer < c.num_hidden_layers) {
            EXPECT_TRUE(p.layer >= s.first_layer && p.layer < s.end_layer) << p.name << " in " << s.str();
          }
          if (p.layer >= c.num_hidden_layers) {
            EXPECT_TRUE(s.mtp) << p.name << " in " << s.str();
          }
        }
        next = int(r.end);
      }
      EXPECT_EQ(next, model.params().size()) << count << " stages";
      EXPECT_EQ(std::count(owner.begin(), owner.end(), -1), 0);
    }
  }
}

}  // namespace
}  // namespace dstrain
