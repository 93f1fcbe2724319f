// Stages: the split of the model into contiguous pieces and parameter ranges, and the
// declared weight ties.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dstrain
