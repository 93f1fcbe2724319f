#include "model/stage.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace dstrain {

namespace {
// Stages of the given layer counts: the first holds the embedding, the last the head and the
// MTP modules.
std::vector<StageSpec> make_stages(const std::vector<int>& layers_per_stage, bool mtp) {
  const int count = int(layers_per_stage.size());
  std::vector<StageSpec> out;
  int first = 0;
  for (int i = 0; i < count; ++i) {
    StageSpec s;
    s.index = i;
    s.count = count;
    s.first_layer = first;
    s.end_layer = first + layers_per_stage[size_t(i)];
    s.embedding = i == 0;
    s.head = i == count - 1;
    s.mtp = s.head && mtp;
    first = s.end_layer;
    out.push_back(s);
  }
  return out;
}

// Forward FLOPs per token of decoder layer `layer`'s attention at sequence length T.
double attention_flops(const ModelConfig& c, int64_t T) {
  const double C = double(c.hidden_size), H = double(c.num_attention_heads);
  const double keys = (double(T) + 1) / 2;  // a causal query's average number of keys
  if (!c.mla()) {
    const double D = double(c.head_dim()), Hkv = double(c.num_key_value_heads);
    return 2 * C * (H + 2 * Hkv) * D + 2 * H * D * C + 2 * H * (D + D) * keys;
  }
  const double qk = double(c.qk_head_dim()), v = double(c.v_head_dim), rq = double(c.q_lora_rank);
  const double rkv = double(c.kv_lora_rank), nope = double(c.qk_nope_head_dim), rope = double(c.qk_rope_head_dim);
  const double q = c.q_lora_rank > 0 ? 2 * C * rq + 2 * rq * H * qk : 2 * C * H * qk;
  const double kv_a = 2 * C * (rkv + rope), kv_b = 2 * rkv * H * (nope + v), o = 2 * H * v * C;
  return q + kv_a + kv_b + o + 2 * H * (qk + v) * keys;
}

// Forward FLOPs per token of decoder layer `layer`'s feed-forward part.
double ffn_flops(const ModelConfig& c, int64_t layer) {
  const double C = double(c.hidden_size);
  if (!c.is_moe_layer(layer)) return 3 * 2 * C * double(c.intermediate_size);
  const double expert = 3 * 2 * C * double(c.moe_intermediate_size);
  return double(c.num_experts_per_tok) * expert + double(c.n_shared_experts) * expert +
         2 * C * double(c.n_routed_experts);
}
}  // namespace

double PieceCosts::total() const {
  return embedding + std::accumulate(layers.begin(), layers.end(), 0.0) + head +
         std::accumulate(mtp.begin(), mtp.end(), 0.0);
}

PieceCosts piece_costs(const ModelConfig& c, int64_t seq_len) {
  DS_CHECK(seq_len >= 1, "piece_costs: sequence length {} must be >= 1", seq_len);
  constexpr double kTrain = 3;  // forward + backward
  const double C = double(c.hidden_size), V = double(c.vocab_size);
  const int64_t L = c.num_hidden_layers;
  auto layer = [&](int64_t l) { return attention_flops(c, seq_len) + ffn_flops(c, l); };
  const double head = 2 * C * V + PieceCosts::kCrossEntropyFlopsPerLogit * V;
  PieceCosts out;
  out.embedding = 0;
  for (int64_t l = 0; l < L; ++l) out.layers.push_back(kTrain * layer(l));
  out.head = kTrain * head;
  for (int64_t k = 0; k < c.num_nextn_predict_layers; ++k) {
    out.mtp.push_back(kTrain * (2 * 2 * C * C + layer(L + k) + head));
  }
  return out;
}

double stage_cost(const PieceCosts& costs, const StageSpec& s) {
  DS_CHECK(s.first_layer >= 0 && s.first_layer <= s.end_layer && s.end_layer <= int(costs.layers.size()),
           "{}: layers outside the {} costed", s.str(), costs.layers.size());
  double sum = std::accumulate(costs.layers.begin() + s.first_layer, costs.layers.begin() + s.end_layer, 0.0);
  if (s.embedding) sum += costs.embedding;
  if (s.head) sum += costs.head;
  if (s.mtp) sum += std::accumulate(costs.mtp.begin(), costs.mtp.end(), 0.0);
  return sum;
}

std::vector<StageSpec> split_stages_balanced(const PieceCosts& costs, int count) {
  const int L = int(costs.layers.size());
  DS_CHECK(count >= 1 && count <= L,
           "a pipeline of {} stages for {} decoder layers: every stage needs at least one decoder layer", count, L);
  auto nonnegative = [](double x) { return x >= 0 && std::isfinite(x); };
  DS_CHECK(nonnegative(costs.embedding) && nonnegative(costs.head), "piece costs must be finite and >= 0");
  for (double x : costs.layers) DS_CHECK(nonnegative(x), "piece costs must be finite and >= 0");
  for (double x : costs.mtp) DS_CHECK(nonnegative(x), "piece costs must be finite and >= 0");

  std::vector<double> prefix(size_t(L) + 1, 0.0);
  for (int l = 0; l < L; ++l) prefix[size_t(l) + 1] = prefix[size_t(l)] + costs.layers[size_t(l)];
  const double last_extra = costs.head + std::accumulate(costs.mtp.begin(), costs.mtp.end(), 0.0);
  // Cost of stage i holding layers [k, j).
  auto cost = [&](int i, int k, int j) {
    double x = prefix[size_t(j)] - prefix[size_t(k)];
    if (i == 0) x += costs.embedding;
    if (i == count - 1) x += last_extra;
    return x;
  };
  // value[i][j]: the best over splits of layers [0, j) into stages 0..i-1, each non-empty;
  // from[i][j]: where stage i-1 starts in it.
  constexpr double kInf = std::numeric_limits<double>::infinity();
  using Table = std::vector<std::vector<double>>;
  auto solve = [&](auto&& combine, Table& value, std::vector<std::vector<int>>& from) {
    value.assign(size_t(count) + 1, std::vector<double>(size_t(L) + 1, kInf));
    from.assign(size_t(count) + 1, std::vector<int>(size_t(L) + 1, -1));
    value[0][0] = 0;
    for (int i = 1; i <= count; ++i) {
      for (int j = i; j <= L - (count - i); ++j) {
        for (int k = i - 1; k < j; ++k) {
          if (value[size_t(i) - 1][size_t(k)] == kInf) continue;
          const double v = combine(value[size_t(i) - 1][size_t(k)], cost(i - 1, k, j));
          if (v < value[size_t(i)][size_t(j)]) {
            value[size_t(i)][size_t(j)] = v;
            from[size_t(i)][size_t(j)] = k;
          }
        }
      }
    }
  };
  Table value;
  std::vector<std::vector<int>> from;
  // First the least possible cost of the most expensive stage, then, among the splits within
  // it, the least sum of squared stage costs.
  solve([](double prev, double c) { return std::max(prev, c); }, value, from);
  const double bound = value[size_t(count)][size_t(L)] * (1 + 1e-12);
  solve([&](double prev, double c) { return c <= bound ? prev + c * c : kInf; }, value, from);
  DS_CHECK(value[size_t(count)][size_t(L)] < kInf, "balanced pipeline split: no split within the optimum");

  std::vector<int> layers_per_stage(static_cast<size_t>(count));
  for (int i = count, j = L; i > 0; --i) {
    const int k = from[size_t(i)][size_t(j)];
    layers_per_stage[size_t(i) - 1] = j - k;
    j = k;
  }
  return make_stages(layers_per_stage, !costs.mtp.empty());
}

std::vector<StageSpec> split_stages_balanced(const ModelConfig& c, int count, int64_t seq_len) {
  DS_CHECK(count >= 1 && count <= c.num_hidden_layers,
           "a pipeline of {} stages (parallel.pipeline) for {} decoder layers (num_hidden_layers): every stage "
           "needs at least one decoder layer",
           count, c.num_hidden_layers);
  return split_stages_balanced(piece_costs(c, seq_len), count);
}

std::vector<StageSpec> split_stages_manual(const ModelConfig& c, int count,
                                           const std::vector<int64_t>& layers_per_stage) {
  DS_CHECK(int64_t(layers_per_stage.size()) == count,
           "parallel.partition has {} entries, but the pipeline has {} stages (parallel.pipeline)",
           layers_per_stage.size(), count);
  std::vector<int> layers;
  int64_t sum = 0;
  for (size_t i = 0; i < layers_per_stage.size(); ++i) {
    DS_CHECK(layers_per_stage[i] >= 1, "parallel.partition[{}] is {}: every stage needs at least one decoder layer",
             i, layers_per_stage[i]);
    sum += layers_per_stage[i];
    layers.push_back(int(layers_per_stage[i]));
  }
  DS_CHECK(sum == c.num_hidden_layers,
           "parallel.partition {} adds up to {} decoder layers, but the model has {} (num_hidden_layers)",
           fmt::join(layers_per_stage, ","), sum, c.num_hidden_layers);
  return make_stages(layers, c.num_nextn_predict_layers > 0);
}

std::string describe_stages(const std::vector<StageSpec>& stages, const PieceCosts& costs) {
  const double total = costs.total();
  std::string out;
  for (const StageSpec& s : stages) {
    std::vector<std::string> parts;
    if (s.embedding) parts.push_back("embedding");
    if (s.num_layers() == 1) parts.push_back(fmt::format("layer {}", s.first_layer));
    if (s.num_layers() > 1) parts.push_back(fmt::format("layers {}-{}", s.first_layer, s.end_layer - 1));
    if (s.head) parts.push_back("head");
    if (s.mtp) parts.push_back("mtp");
    const double share = total > 0 ? 100 * stage_cost(costs, s) / total : 0;
    if (!out.empty()) out += ", ";
    out += fmt::format("stage {}: {} ({:.1f}%)", s.index, fmt::join(parts, " + "), share);
  }
  return out;
}

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
  std::vector<int> layers;
  for (int i = 0; i < count; ++i) layers.push_back(L / count + (i < L % count ? 1 : 0));
  return make_stages(layers, c.num_nextn_predict_layers > 0);
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
