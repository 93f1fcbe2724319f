#include "model/stage.h"

#include <fmt/format.h>

namespace dstrain {

std::string StageSpec::str() const {
  std::string s = fmt::format("stage {}/{}:", index + 1, count);
  if (embedding) s += " embedding,";
  if (num_layers() > 0) s += fmt::format(" layers {}-{},", first_layer, end_layer - 1);
  if (head) s += " head,";
  if (mtp) s += " mtp,";
  s.pop_back();
  return s;
}

std::vector<StageSpec> split_stages(const ModelConfig& c, int count) {
  const int L = int(c.num_hidden_layers);
  DS_CHECK(count >= 1 && count <= L,
           "{} pipeline stages for {} decoder layers (num_hidden_layers): every stage needs at least one layer", count, L);
  std::vector<StageSpec> out;
  int first = 0;
  for (int i = 0; i < count; ++i) {
    StageSpec s;
    s.index = i;
    s.count = count;
    s.first_layer = first;
    s.end_layer = first + L / count + (i < L % count ? 1 : 0);
    s.embedding = i == 0;
    s.head = i == count - 1;
    s.mtp = s.head && c.num_nextn_predict_layers > 0;
    first = s.end_layer;
    out.push_back(s);
  }
  return out;
}

std::vector<TiedParam> tied_params(const ModelConfig& c) {
  const bool tie = c.tie_word_embeddings, mtp = c.num_nextn_predict_layers > 0;
  std::vector<TiedParam> out;
  TiedParam embed{"model.embed_tokens.weight", {}};
  if (tie) embed.uses.push_back("lm_head");
  if (mtp) embed.uses.push_back("mtp.embedding");
  if (mtp && tie) embed.uses.push_back("mtp.head");
  if (!embed.uses.empty()) out.push_back(embed);
  if (mtp && !tie) out.push_back({"lm_head.weight", {"mtp.head"}});
  return out;
}

Range stage_param_range(const ParamRegistry& reg, const StageSpec& s, const ModelConfig& c) {
  const int L = int(c.num_hidden_layers);
  auto in_stage = [&](const ParamInfo& p) {
    if (p.layer >= L) return s.mtp;  // MTP modules are numbered after the main layers
    if (p.layer >= 0) return p.layer >= s.first_layer && p.layer < s.end_layer;
    if (p.kind == ParamKind::Embedding) return s.embedding;
    return s.head;  // model.norm, lm_head
  };
  int first = -1, last = -2;
  for (int id = 0; id < reg.size(); ++id) {
    if (!in_stage(reg.info(id))) continue;
    if (first < 0) first = id;
    DS_CHECK(last < 0 || last == id - 1, "{}: parameter '{}' is not contiguous with the stage's others", s.str(),
             reg.info(id).name);
    last = id;
  }
  DS_CHECK(first >= 0, "{} holds no parameters", s.str());
  return Range{first, last + 1};
}

}  // namespace dstrain
