// Hugging Face checkpoints <-> the parameter registry. Loading is strict (every parameter
// present with its exact shape, nothing left over); saving writes what transformers reads.
#include "io/hf_weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
#include <limits>
#include <regex>
#include <set>

#include "backend/ops.h"
#include "comm/comm.h"
#include "core/log.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";
constexpr const char* kEmbed = "model.embed_tokens.weight";
constexpr const char* kHead = "lm_head.weight";
constexpr size_t kMaxListed = 10;

// "'a', 'b', 'c' and 7 more": long lists would bury the message.
std::string list_names(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size() && i < kMaxListed; ++i) s += (i ? ", '" : "'") + names[i] + "'";
  if (names.size() > kMaxListed) s += fmt::format(" and {} more", names.size() - kMaxListed);
  return s;
}

// Weight files that save_hf_weights writes, so that an earlier save's can be removed.
bool is_weight_file(const std::string& name) {
  static const std::regex shard(R"(model-\d+-of-\d+\.safetensors)");
  return name == kSingleFile || name == kIndexFile || std::regex_match(name, shard);
}

void remove_if_present(const fs::path& p) {
  std::error_code ec;
  fs::remove(p, ec);
  DS_CHECK(!ec, "cannot remove '{}' left by an earlier save: {}", p.string(), ec.message());
}

// A tied model has no lm_head parameter; a file may still carry one (transformers writes it
// for some tied models). Dropping it is right only when it is the embedding itself.
void check_tied_head(const HFWeights& w) {
  const auto head = w.raw(kHead), embed = w.raw(kEmbed);
  const bool same = w.dtype(kHead) == w.dtype(kEmbed) && w.shape(kHead) == w.shape(kEmbed) &&
                    head.size() == embed.size() && std::memcmp(head.data(), embed.data(), head.size()) == 0;
  DS_CHECK(same,
           "the model config says tie_word_embeddings=true (the output head is the embedding), but '{}' holds an "
           "lm_head.weight ({} {}) that differs from model.embed_tokens.weight ({} {}); if this checkpoint has its "
           "own head, set tie_word_embeddings=false in config.json",
           w.file_of(kHead), dtype_name(w.dtype(kHead)), w.shape(kHead).str(), dtype_name(w.dtype(kEmbed)),
           w.shape(kEmbed).str());
}

// DeepSeek-V3's checkpoints store, with each multi-token-prediction module
// (model.layers.{N}.*, N >= num_hidden_layers), copies of the embedding and the output head
// it shares with the main model. dstrain shares them: a copy is accepted when it is the same.
bool is_shared_copy(const HFWeights& w, const ParamRegistry& reg, const std::string& name, std::string* original) {
  if (!name.starts_with("model.layers.")) return false;
  if (name.ends_with(".embed_tokens.weight")) {
    *original = kEmbed;
  } else if (name.ends_with(".shared_head.head.weight")) {
    *original = reg.find(kHead) >= 0 ? kHead : kEmbed;
  } else {
    return false;
  }
  if (!w.has(*original)) return false;
  auto same_bytes = [&](const std::string& x, const std::string& y) {
    const auto a = w.raw(x), b = w.raw(y);
    return w.dtype(x) == w.dtype(y) && w.shape(x) == w.shape(y) && a.size() == b.size() &&
           std::memcmp(a.data(), b.data(), a.size()) == 0;
  };
  // An FP8 copy is the same when its scales are too.
  DS_CHECK(same_bytes(name, *original) && w.block_scaled(name) == w.block_scaled(*original) &&
               (!w.block_scaled(name) || same_bytes(fp8_scale_name(name), fp8_scale_name(*original))),
           "'{}' holds {} ({} {}), which dstrain shares with {} but which differs from it ({} {}); this checkpoint's "
           "multi-token-prediction module has its own copy",
           w.file_of(name), name, dtype_name(w.dtype(name)), w.shape(name).str(), *original,
           dtype_name(w.dtype(*original)), w.shape(*original).str());
  return true;
}

void check_whole(const ParamInfo& p, const char* what) {
  DS_CHECK(p.shape == p.global_shape,
           "{} handles whole tensors, but this process holds parameter '{}' as a piece {} of the global {}; "
           "gather or scatter it through the parallel layer", what, p.name, p.shape.str(), p.global_shape.str());
}

// A tensor-parallel piece: filled from, or gathered into, its global tensor.
bool is_tensor_piece(const ParamInfo& p) {
  return p.placement.kind == Placement::Kind::Shard && p.placement.axis == "tensor";
}

// This process's resident memory from /proc/self/status (zeros where there is none):
// anonymous pages (the heap, the allocator's buffers) and file-backed ones (mapped files).
struct Resident {
  int64_t anon = 0, file = 0;
};

Resident resident_now() {
  Resident r;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return r;
  char line[256];
  long long kb = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::sscanf(line, "RssAnon: %lld kB", &kb) == 1) r.anon = int64_t(kb) * 1024;
    if (std::sscanf(line, "RssFile: %lld kB", &kb) == 1) r.file = int64_t(kb) * 1024;
  }
  std::fclose(f);
  return r;
}

void sample_resident(HFLoadStats& s) {
  const Resident now = resident_now();
  s.anon_peak = std::max(s.anon_peak, now.anon);
  s.mapped_file_peak = std::max(s.mapped_file_peak, now.file);
}

// Once tensors have been read or compared through the mapping: the memory sample (their
// buffers and pages still there), then their pages are unmapped, so that the process maps
// one tensor's pages at a time (two while comparing), not the files'.
void sample_and_release(const HFWeights& w, HFLoadStats& s, std::initializer_list<std::string> names) {
  sample_resident(s);
  for (const std::string& name : names) w.release(name);
}

// World rank 0 logs what every rank held while loading, the most first: the claim that a rank
// holds its own pieces and no more is checked on each run, not only in tests.
void log_load_memory(const HFLoadStats& s, const ParamRegistry& all, Communicator& world) {
  const std::string mine = fmt::format("{} {} {} {}", s.piece_bytes, s.anon_beyond_pieces(), s.largest_transient_bytes,
                                       s.mapped_file_peak - s.mapped_file_start);
  const std::vector<std::string> texts = all_gather_strings(world, mine);
  if (log::rank() != 0) return;
  struct Row {
    int rank = 0;
    long long pieces = 0, beyond = 0, counted = 0, file = 0;
  };
  std::vector<Row> rows(texts.size());
  for (size_t r = 0; r < texts.size(); ++r) {
    rows[r].rank = int(r);
    std::sscanf(texts[r].c_str(), "%lld %lld %lld %lld", &rows[r].pieces, &rows[r].beyond, &rows[r].counted,
                &rows[r].file);
  }
  // The most first; to the 0.1 MB shown, so that equal ranks keep their order.
  std::stable_sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    return (a.pieces + a.beyond) / 100'000 > (b.pieces + b.beyond) / 100'000;
  });
  int64_t whole = 0;
  for (const ParamInfo& p : all.all()) whole += p.global_shape.numel() * int64_t(sizeof(float));
  constexpr double MB = 1e6;
  std::string lines;
  for (size_t i = 0; i < rows.size() && i < kMaxListed; ++i) {
    const Row& r = rows[i];
    lines += fmt::format("\n  rank {}: {:.1f} + {:.1f} [{:.1f}]; {:.1f}", r.rank, r.pieces / MB, r.beyond / MB,
                         r.counted / MB, r.file / MB);
  }
  if (rows.size() > kMaxListed) lines += fmt::format("\n  and {} more ranks", rows.size() - kMaxListed);
  log::info("--init-from memory per rank while loading, MB (the whole model: {:.1f} in fp32): its pieces + the "
            "anonymous memory it added beyond them, measured [buffers it held beside them, counted]; the most "
            "safetensors pages it had mapped (page cache, shared by the ranks that read them){}",
            whole / MB, lines);
}

}  // namespace

std::string fp8_scale_name(const std::string& name) { return name + "_scale_inv"; }

HFWeights::HFWeights(const std::string& path) : path_(path) {
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  DS_CHECK(fs::exists(st), "Hugging Face weights '{}' do not exist; pass a model directory or a .safetensors file",
           path);
  if (!fs::is_directory(st)) {
    if (path.ends_with(".json")) {
      open_index(path);
    } else {
      open_single(path);
    }
    check_fp8((fs::path(path).parent_path() / "config.json").string());  // the model directory's
    return;
  }
  const fs::path single = fs::path(path) / kSingleFile, index = fs::path(path) / kIndexFile;
  const bool has_single = fs::exists(single), has_index = fs::exists(index);
  DS_CHECK(!(has_single && has_index),
           "'{}' holds both {} and {}, which come from two different saves; remove the stale one", path, kSingleFile,
           kIndexFile);
  if (has_single) {
    open_single(single.string());
  } else if (has_index) {
    open_index(index.string());
  } else {
    const bool has_bin =
        fs::exists(fs::path(path) / "pytorch_model.bin") || fs::exists(fs::path(path) / "pytorch_model.bin.index.json");
    DS_FAIL("no Hugging Face weights in '{}': looked for '{}' and '{}'{}", path, single.string(), index.string(),
            has_bin ? "; it holds PyTorch .bin weights, which dstrain does not read: convert them to safetensors "
                      "(save_pretrained(..., safe_serialization=True))"
                    : "");
  }
  check_fp8((fs::path(path) / "config.json").string());
}

void HFWeights::open_single(const std::string& file) {
  files_.push_back(std::make_unique<SafeTensorsFile>(file));
  for (const SafeTensorInfo& t : files_.back()->tensors()) where_[t.name] = 0;
}

void HFWeights::open_index(const std::string& index_path) {
  // Written by a program, and megabytes for a model of many tensors: the data limit.
  const json index = read_json_file(index_path, kDataJson);
  DS_CHECK(index.is_object() && index.contains("weight_map") && index["weight_map"].is_object(),
           "'{}' has no \"weight_map\" object; it is not a Hugging Face safetensors index", index_path);
  const json& weight_map = index["weight_map"];
  const fs::path dir = fs::path(index_path).parent_path();

  // Each shard is opened once; the first tensor mapped to it names it in errors.
  std::map<std::string, std::string> shards;  // shard file -> a tensor the index puts there
  for (const auto& [tensor, shard] : weight_map.items()) {
    DS_CHECK(shard.is_string(), "'{}': weight_map[\"{}\"] is {}, expected a shard file name", index_path, tensor,
             shard.dump());
    shards.emplace(shard.get<std::string>(), tensor);
  }
  std::map<std::string, size_t> file_index;  // shard file -> index into files_
  for (const auto& [shard, example] : shards) {
    const fs::path p = dir / shard;
    DS_CHECK(fs::is_regular_file(p),
             "'{}' maps tensors such as '{}' to shard '{}', but '{}' does not exist; the download or save is "
             "incomplete", index_path, example, shard, p.string());
    file_index[shard] = files_.size();
    files_.push_back(std::make_unique<SafeTensorsFile>(p.string()));
    for (const SafeTensorInfo& t : files_.back()->tensors()) {
      auto [it, inserted] = where_.emplace(t.name, files_.size() - 1);
      DS_CHECK(inserted,
               "tensor '{}' appears in two shards, '{}' and '{}' (index '{}'); the checkpoint is inconsistent", t.name,
               files_[it->second]->path(), p.string(), index_path);
    }
  }
  // The index must describe the shards it names, or a loader would trust a wrong map.
  for (const auto& [tensor, shard] : weight_map.items()) {
    auto it = where_.find(tensor);
    const size_t expected = file_index.at(shard.get<std::string>());
    DS_CHECK(it != where_.end() && it->second == expected, "'{}' maps tensor '{}' to '{}', but {}", index_path, tensor,
             shard.get<std::string>(),
             it == where_.end() ? std::string("none of the shards the index names holds it")
                                : "it is in '" + files_[it->second]->path() + "'");
  }
}

// Every F8_E4M3 tensor must be a weight matrix with its scales, and every scale tensor the
// scales of one: a checkpoint whose FP8 weights cannot be dequantised is refused before any read.
void HFWeights::check_fp8(const std::string& config_path) {
  std::vector<std::string> fp8;
  for (const auto& [name, f] : where_) {
    if (info(name).dtype == DType::F8_E4M3) fp8.push_back(name);
  }
  if (fp8.empty()) return;
  // The block size: config.json's quantization_config.weight_block_size, when there is one.
  std::string block_from = "the default of DeepSeek-V3's release (no config.json beside the weights)";
  if (fs::exists(config_path)) {
    const json config = read_json_file(config_path, kDataJson);
    const json q = config.is_object() ? config.value("quantization_config", json()) : json();
    block_from = fmt::format("the default of DeepSeek-V3's release ('{}' has no quantization_config)", config_path);
    if (q.is_object()) {
      const std::string where = fmt::format("'{}': quantization_config", config_path);
      const std::string method = q.value("quant_method", std::string("fp8"));
      DS_CHECK(method == "fp8", "{}.quant_method is \"{}\"; dstrain reads \"fp8\" (DeepSeek's block-scaled F8_E4M3)",
               where, method);
      const std::string fmt_name = q.value("fmt", std::string("e4m3"));
      DS_CHECK(fmt_name == "e4m3", "{}.fmt is \"{}\"; dstrain reads \"e4m3\" weights", where, fmt_name);
      if (q.contains("weight_block_size")) {
        const json& b = q["weight_block_size"];
        DS_CHECK(b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer() &&
                     b[0].get<int64_t>() > 0 && b[1].get<int64_t>() > 0,
                 "{}.weight_block_size is {}; expected [rows, columns] of positive integers, such as [128, 128]",
                 where, b.dump());
        block_ = FP8Block{b[0].get<int64_t>(), b[1].get<int64_t>()};
        block_from = fmt::format("'{}' quantization_config.weight_block_size", config_path);
      }
    }
  }
  for (const std::string& name : fp8) {
    const Shape shape = info(name).shape;
    DS_CHECK(shape.ndim() == 2,
             "FP8 tensor '{}' in '{}' has shape {}; block-scaled FP8 weights are matrices (2 dimensions)", name,
             file_of(name), shape.str());
    const std::string scale = fp8_scale_name(name);
    DS_CHECK(has(scale),
             "FP8 tensor '{}' in '{}' has no '{}' beside it: its values cannot be dequantised; the checkpoint is "
             "incomplete, or not DeepSeek's block-scaled FP8 (dequantise it to BF16 with the tool that made it)",
             name, file_of(name), scale);
    const Shape want = block_.grid(shape);
    DS_CHECK(info(scale).dtype == DType::F32 || info(scale).dtype == DType::BF16,
             "'{}' in '{}' is {}; block scales are F32 (or BF16)", scale, file_of(scale), dtype_name(info(scale).dtype));
    DS_CHECK(info(scale).shape == want,
             "'{}' in '{}' has shape {}, but FP8 weight '{}' {} in blocks of {} x {} (from {}) needs {}; set "
             "quantization_config.weight_block_size in config.json to the block size the checkpoint was made with",
             scale, file_of(scale), info(scale).shape.str(), name, shape.str(), block_.rows, block_.cols, block_from,
             want.str());
    fp8_.insert(name);
    scales_.insert(scale);
  }
  for (const auto& [name, f] : where_) {
    if (!name.ends_with("_scale_inv") || scales_.count(name)) continue;
    const std::string weight = name.substr(0, name.size() - std::string("_scale_inv").size());
    DS_FAIL("'{}' in '{}' is the block scales of '{}', which {}; the checkpoint is inconsistent", name, file_of(name),
            weight, has(weight) ? fmt::format("is {}, not F8_E4M3", dtype_name(info(weight).dtype))
                                : std::string("is not in the checkpoint"));
  }
}

void HFWeights::read_f32_range(const std::string& name, int64_t begin, int64_t n, float* dst) const {
  file(name).read_f32_range(name, begin, n, dst);  // FP8: the stored values, unscaled
  apply_scales(name, begin, n, dst);
}

void HFWeights::read_f32(const std::string& name, Tensor out) const {
  file(name).read_f32(name, out);
  apply_scales(name, 0, out.numel(), static_cast<float*>(out.raw()));
}

void HFWeights::apply_scales(const std::string& name, int64_t begin, int64_t n, float* dst) const {
  if (n == 0 || !block_scaled(name)) return;
  // Each row of the range times the scales of its blocks: one row of the scale matrix read per
  // block row the range touches.
  const int64_t cols = shape(name)[1], scale_cols = block_.grid(shape(name))[1];
  const std::string scale = fp8_scale_name(name);
  std::vector<float> scales(static_cast<size_t>(scale_cols));
  int64_t scale_row = -1;
  for (int64_t i = begin; i < begin + n;) {
    const int64_t r = i / cols, c0 = i % cols, c1 = std::min(cols, c0 + (begin + n - i));
    if (r / block_.rows != scale_row) {
      scale_row = r / block_.rows;
      file(scale).read_f32_range(scale, scale_row * scale_cols, scale_cols, scales.data());
    }
    float* out = dst + (i - begin);
    for (int64_t c = c0; c < c1; ++c) out[c - c0] *= scales[size_t(c / block_.cols)];
    i += c1 - c0;
  }
}

const SafeTensorsFile& HFWeights::file(const std::string& name) const {
  auto it = where_.find(name);
  DS_CHECK(it != where_.end(), "tensor '{}' is not in the Hugging Face weights at '{}'", name, path_);
  return *files_[it->second];
}

const SafeTensorInfo& HFWeights::info(const std::string& name) const { return file(name).info(name); }
std::span<const std::byte> HFWeights::raw(const std::string& name) const { return file(name).raw(name); }
const std::string& HFWeights::file_of(const std::string& name) const { return file(name).path(); }

std::vector<std::string> HFWeights::names() const {
  std::vector<std::string> out;
  out.reserve(where_.size());
  for (const auto& [name, f] : where_) out.push_back(name);
  return out;
}

HFLoadStats load_hf_weights(const std::string& path, ParamRegistry& reg, const ParamRegistry* model,
                            Communicator* world) {
  const ParamRegistry& all = model ? *model : reg;
  DS_CHECK(reg.flat_numel() == 0 || reg.values().allocated(),
           "load_hf_weights('{}'): allocate the parameter registry before loading into it", path);
  HFLoadStats stats;
  const Resident start = resident_now();
  stats.anon_start = stats.anon_peak = start.anon;
  stats.mapped_file_start = stats.mapped_file_peak = start.file;
  stats.pieces_committed_by_load = reg.values_reserved() && reg.device().is_cpu();
  const HFWeights w(path);

  // Names first, so that a config that does not fit the checkpoint shows every mismatch.
  std::vector<std::string> missing, unexpected;
  for (const ParamInfo& p : reg.all()) {
    if (!is_tensor_piece(p)) check_whole(p, "load_hf_weights");
  }
  for (const ParamInfo& p : all.all()) {
    if (!w.has(p.name)) missing.push_back(p.name);
  }
  const bool tied = all.find(kHead) < 0 && all.find(kEmbed) >= 0;
  for (const std::string& name : w.names()) {
    if (all.find(name) >= 0) continue;
    if (w.is_block_scale(name)) {  // read with its FP8 weight
      continue;
    } else if (name.ends_with("rotary_emb.inv_freq")) {  // recomputed from rope_theta
      ++stats.skipped_inv_freq;
    } else if (name == kHead && tied && w.has(kEmbed)) {
      check_tied_head(w);
      stats.tied_lm_head_checked = true;
      sample_and_release(w, stats, {kHead, kEmbed});
    } else if (std::string original; is_shared_copy(w, all, name, &original)) {
      ++stats.shared_copies;
      sample_and_release(w, stats, {name, original});
    } else {
      unexpected.push_back(name);
    }
  }
  if (!missing.empty() || !unexpected.empty()) {
    std::string msg = fmt::format("the Hugging Face weights at '{}' do not match the model:", w.path());
    if (!missing.empty()) {
      msg += fmt::format("\n  {} parameter(s) missing from the files: {}", missing.size(), list_names(missing));
    }
    if (!unexpected.empty()) {
      msg += fmt::format("\n  {} tensor(s) in the files that the model does not have: {}", unexpected.size(),
                         list_names(unexpected));
    }
    DS_FAIL("{}\n  check that config.json (num_hidden_layers, tie_word_embeddings, architecture) describes this "
            "checkpoint", msg);
  }
  sample_resident(stats);  // the headers parsed

  for (const ParamInfo& p : reg.all()) {
    const Shape file_shape = w.shape(p.name);
    DS_CHECK(file_shape == p.global_shape,
             "tensor '{}' in '{}' has shape {} but the model expects {}; check that config.json (hidden_size, "
             "intermediate_size, vocab_size, num_attention_heads, num_key_value_heads) matches the checkpoint",
             p.name, w.file_of(p.name), file_shape.str(), p.global_shape.str());
  }
  // A tensor-parallel piece is read straight from its bytes in the file (rows of a dim-0 piece,
  // a column range of every row of a dim-1 one): no rank reads or holds a whole tensor it
  // holds a piece of. The files are memory-mapped, so the pages read are the piece's, and
  // they are unmapped once the tensor is read.
  // A NaN or Inf would make every training step non-finite; caught here, it names its file.
  std::vector<std::string> non_finite;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    const std::string& name = p.name;
    // Read on the host; a run on a device gets the values sent there.
    const ops::HostView local(reg.param(id));
    Tensor t = local.get();
    if (is_tensor_piece(p)) {
      // The block's runs (io/sharded_state.h): one for a dim-0 piece, one per row of a dim-1 one.
      const TensorPiece block = placement_block(p);
      for (const PieceRun& r : piece_runs(block, p.global_shape, row_piece(block.shape, 0, 1))) {
        w.read_f32_range(name, r.global, r.elems, t.data<float>() + r.local);
      }
    } else {
      w.read_f32(name, t);
    }
    local.write_back();
    ++stats.loaded;
    if (w.block_scaled(name)) ++stats.fp8_dequantised;
    stats.piece_bytes += int64_t(t.nbytes());
    if (!reg.param(id).device().is_cpu()) {
      stats.largest_transient_bytes = std::max(stats.largest_transient_bytes, int64_t(t.nbytes()));
    }
    // While this tensor's buffers (a device run's host copy) are alive.
    if (w.block_scaled(name)) {
      sample_and_release(w, stats, {name, fp8_scale_name(name)});
    } else {
      sample_and_release(w, stats, {name});
    }
    const int64_t n = ops::read_count_non_finite(t);
    if (n > 0) {
      non_finite.push_back(fmt::format("'{}' in '{}': {} of {} values{} are NaN or Inf", name, w.file_of(name), n,
                                       t.numel(), is_tensor_piece(p) ? " of this rank's piece" : ""));
    }
  }
  // Every rank reaches the same verdict: the ranks' findings are pooled (each rank reads only
  // its pieces).
  if (world && world->size() > 1) {
    std::string mine;
    for (const std::string& line : non_finite) mine += line + "\n";
    std::set<std::string> pooled;
    for (const std::string& text : all_gather_strings(*world, mine)) {
      size_t at = 0;
      for (size_t nl; (nl = text.find('\n', at)) != std::string::npos; at = nl + 1) pooled.insert(text.substr(at, nl - at));
    }
    non_finite.assign(pooled.begin(), pooled.end());
  }
  if (!non_finite.empty()) {
    std::string list;
    for (size_t i = 0; i < non_finite.size() && i < kMaxListed; ++i) list += "\n  " + non_finite[i];
    if (non_finite.size() > kMaxListed) list += fmt::format("\n  and {} more", non_finite.size() - kMaxListed);
    DS_FAIL("the Hugging Face weights at '{}' hold non-finite values in {} tensor(s):{}\n  training or evaluating "
            "them gives NaN losses; use weights saved before the model diverged",
            w.path(), non_finite.size(), list);
  }
  if (world) log_load_memory(stats, all, *world);
  return stats;
}

std::string torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::F8_E4M3: return "bfloat16";  // the tensors that are not FP8
    default: break;
  }
  DS_FAIL("Hugging Face weights are float32, bfloat16, float16 or FP8, not {}", dtype_name(dtype));
}

DType hf_export_dtype(const std::string& name) {
  return name == "fp8" ? DType::F8_E4M3 : dtype_from_torch_name(name);
}

DType dtype_from_torch_name(const std::string& name) {
  if (name == "float32") return DType::F32;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  DS_FAIL("torch_dtype \"{}\" is not one dstrain writes (float32, bfloat16, float16)", name);
}

void save_hf_weights(const std::string& dir, const ParamRegistry& reg, const json& config_json,
                     int64_t max_shard_bytes, DType dtype) {
  HFSaveOptions options;
  options.max_shard_bytes = max_shard_bytes;
  options.dtype = dtype;
  save_hf_weights(dir, reg, config_json, options);
}

void save_hf_weights(const std::string& dir, const ParamRegistry& reg, const json& config_json,
                     const HFSaveOptions& options) {
  DS_CHECK(reg.flat_numel() == 0 || reg.values().allocated(),
           "save_hf_weights('{}'): the parameter registry is not allocated", dir);
  for (const ParamInfo& p : reg.all()) check_whole(p, "save_hf_weights");
  // Written from the host: a run on a device copies the weights over first.
  const ops::HostView host(reg.values().tensor());
  save_hf_weights(dir, reg, ShardedState::whole(reg), host.get().data<float>(), config_json, options, nullptr);
}

namespace {

// Raises on every rank of `world` the failures some ranks had (each rank's first one).
void raise_failures(Communicator* world, const std::string& mine) {
  if (!world) {
    if (!mine.empty()) throw Error(mine);
    return;
  }
  const std::vector<std::string> all = all_gather_strings(*world, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r].empty()) continue;
    throw Error(world->size() > 1 ? fmt::format("{} (on rank {} of {})", all[r], r, world->name()) : all[r]);
  }
}

}  // namespace

void save_hf_weights(const std::string& dir, const ParamRegistry& file, const ShardedState& pieces,
                     const float* values, const json& config_json, int64_t max_shard_bytes, DType dtype,
                     Communicator* world) {
  HFSaveOptions options;
  options.max_shard_bytes = max_shard_bytes;
  options.dtype = dtype;
  save_hf_weights(dir, file, pieces, values, config_json, options, world);
}

bool is_fp8_weight(const std::string& name) {
  static const std::regex fp8(R"(model\.layers\.\d+\.(self_attn|mlp)\.([A-Za-z0-9_]+\.)*[A-Za-z0-9_]*_proj\.weight)");
  return std::regex_match(name, fp8);
}

std::array<float, FP8BlockScales::kCandidates> FP8BlockScales::candidates(float amax) {
  const float s = amax / 448.0f;  // weight_quant's scale
  int e = 0;
  const float m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  const float pow2 = std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
  return {s, std::nextafter(s, std::numeric_limits<float>::infinity()), std::nextafter(s, 0.0f), pow2};
}

bool FP8BlockScales::exact(float x, float s) { return f8e4m3_to_f32(f32_to_f8e4m3(x / s)) * s == x; }

float FP8BlockScales::choose(float amax, const uint8_t* exact_under) {
  if (amax == 0) return 0;
  const auto c = candidates(amax);
  for (int k = 0; k < kCandidates; ++k) {
    if (exact_under[k] && c[size_t(k)] > 0 && std::isfinite(c[size_t(k)])) return c[size_t(k)];
  }
  return c[0];
}

namespace {

// One tensor of the files being written: a registry tensor's values in the file's dtype, a
// block-scaled FP8 weight or its scales, or (released layout) an MTP module's copy of one.
struct OutTensor {
  enum class Kind { Values, FP8, Scales } kind = Kind::Values;
  std::string name;
  int tensor = 0;  // the registry tensor it comes from
  DType dtype = DType::F32;
  Shape shape;
};

// The blocks of every FP8 tensor in one array: tensor id -> its first block.
struct FP8Grid {
  FP8Block block;
  std::map<int, int64_t> first;
  int64_t blocks = 0;
  // Calls f(block index, local element index) for every element of `runs` of tensor `id`.
  template <class F>
  void each(int id, const Shape& s, const std::vector<PieceRun>& runs, F f) const {
    const int64_t base = first.at(id), gc = block.grid(s)[1], cols = s[1];
    for (const PieceRun& r : runs) {
      for (int64_t i = 0; i < r.elems; ++i) {
        const int64_t g = r.global + i;
        f(base + (g / cols / block.rows) * gc + (g % cols) / block.cols, r.local + i);
      }
    }
  }
};

}  // namespace

void save_hf_weights(const std::string& dir, const ParamRegistry& file, const ShardedState& pieces,
                     const float* values, const json& config_json, const HFSaveOptions& options,
                     Communicator* world) {
  const bool root = world == nullptr || world->rank() == 0;
  const int64_t max_shard_bytes = options.max_shard_bytes;
  DS_CHECK(max_shard_bytes > 0, "save_hf_weights('{}'): max_shard_bytes must be positive, got {}", dir,
           max_shard_bytes);
  const bool fp8 = options.dtype == DType::F8_E4M3;
  const DType dtype = fp8 ? DType::BF16 : options.dtype;  // of the tensors that are not FP8
  const std::string torch_dtype = torch_dtype_name(options.dtype);
  DS_CHECK(options.block.rows > 0 && options.block.cols > 0, "save_hf_weights('{}'): FP8 block {} x {} is not positive",
           dir, options.block.rows, options.block.cols);

  // What the files hold, by name.
  std::vector<OutTensor> out;
  FP8Grid grid{options.block, {}, 0};
  for (int id = 0; id < file.size(); ++id) {
    const ParamInfo& p = file.info(id);
    if (fp8 && p.global_shape.ndim() == 2 && is_fp8_weight(p.name)) {
      const Shape scales = options.block.grid(p.global_shape);
      out.push_back({OutTensor::Kind::FP8, p.name, id, DType::F8_E4M3, p.global_shape});
      out.push_back({OutTensor::Kind::Scales, fp8_scale_name(p.name), id, DType::F32, scales});
      grid.first[id] = grid.blocks;
      grid.blocks += scales.numel();
    } else {
      // DeepSeek-V3's routing biases are F32 in its release (and must stay so: a BF16 bias moves
      // which experts win near-ties).
      const bool bias = (fp8 || options.released_layout) && p.name.ends_with(".e_score_correction_bias");
      out.push_back({OutTensor::Kind::Values, p.name, id, bias ? DType::F32 : dtype, p.global_shape});
    }
  }
  if (options.released_layout && config_json.is_object()) {
    const int64_t layers = config_json.value("num_hidden_layers", int64_t(0));
    const int64_t mtp = config_json.value("num_nextn_predict_layers", int64_t(0));
    const int embed = file.find(kEmbed), head = file.find(kHead) >= 0 ? file.find(kHead) : embed;
    for (int64_t k = 0; k < mtp && embed >= 0; ++k) {
      const std::string prefix = fmt::format("model.layers.{}.", layers + k);
      for (const auto& [name, id] : {std::pair{prefix + "embed_tokens.weight", embed},
                                     std::pair{prefix + "shared_head.head.weight", head}}) {
        if (file.find(name) < 0) out.push_back({OutTensor::Kind::Values, name, id, dtype, file.info(id).global_shape});
      }
    }
  }
  std::sort(out.begin(), out.end(), [](const OutTensor& a, const OutTensor& b) { return a.name < b.name; });

  // Greedy in name order, as transformers does; a tensor above the limit gets its own shard.
  std::vector<std::vector<size_t>> shards;
  int64_t total = 0, shard_bytes = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t bytes = out[i].shape.numel() * int64_t(dtype_size(out[i].dtype));
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += bytes;
    total += bytes;
  }
  const bool single = total <= max_shard_bytes;  // then the greedy split made one shard
  // Every rank knows every file's layout: where each tensor's bytes go.
  const fs::path d(dir);
  const std::map<std::string, std::string> metadata{{"format", "pt"}};  // transformers checks it
  std::vector<SafeTensorsLayout> layouts;
  std::vector<std::pair<size_t, size_t>> where(out.size());  // out index -> (file, position)
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name =
        single ? std::string(kSingleFile) : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    std::vector<SafeTensorInfo> infos;
    for (size_t k = 0; k < shards[i].size(); ++k) {
      const OutTensor& o = out[shards[i][k]];
      infos.push_back(SafeTensorInfo{o.name, o.dtype, o.shape, 0, 0});
      where[shards[i][k]] = {i, k};
    }
    layouts.emplace_back((d / name).string(), std::move(infos), metadata);
  }
  // Registry tensor -> the entries its values go to (itself, its copies).
  std::map<int, std::vector<size_t>> targets;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].kind != OutTensor::Kind::Scales) targets[out[i].tensor].push_back(i);
  }

  // FP8: each block's largest magnitude, then which candidate scales read all of its elements
  // back exactly, over every rank's pieces (a rank's whole pieces: replicas agree, and max and
  // min do not mind counting an element twice).
  std::string failure;
  std::vector<float> amax(size_t(grid.blocks), 0.0f), scale(size_t(grid.blocks), 0.0f);
  if (fp8) {
    try {
      pieces.check(file);
      for (const TensorPiece& t : pieces.pieces) {
        if (!grid.first.count(t.tensor) || t.numel() == 0) continue;
        const Shape& s = file.info(t.tensor).global_shape;
        int64_t bad = 0;
        grid.each(t.tensor, s, piece_runs(t, s, row_piece(t.shape, 0, 1)), [&](int64_t b, int64_t local) {
          const float v = std::fabs(values[t.at + local]);
          if (!std::isfinite(v)) ++bad;
          amax[size_t(b)] = std::max(amax[size_t(b)], v);
        });
        DS_CHECK(bad == 0, "'{}' holds {} non-finite values, which FP8 cannot store; export from weights saved before "
                 "the model diverged", file.info(t.tensor).name, bad);
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
    raise_failures(world, failure);
    if (world && world->size() > 1 && grid.blocks > 0) {
      world->all_reduce(Tensor(amax.data(), DType::F32, Shape{grid.blocks}), ReduceOp::Max);
    }
    constexpr int K = FP8BlockScales::kCandidates;
    std::vector<uint8_t> exact(size_t(grid.blocks * K), 1);
    for (const TensorPiece& t : pieces.pieces) {
      if (!grid.first.count(t.tensor) || t.numel() == 0) continue;
      const Shape& s = file.info(t.tensor).global_shape;
      grid.each(t.tensor, s, piece_runs(t, s, row_piece(t.shape, 0, 1)), [&](int64_t b, int64_t local) {
        uint8_t* flags = exact.data() + b * K;
        if (amax[size_t(b)] == 0) return;
        const auto c = FP8BlockScales::candidates(amax[size_t(b)]);
        for (int k = 0; k < K; ++k) {
          if (flags[k] && !FP8BlockScales::exact(values[t.at + local], c[size_t(k)])) flags[k] = 0;
        }
      });
    }
    if (world && world->size() > 1 && grid.blocks > 0) {
      world->all_reduce(Tensor(exact.data(), DType::U8, Shape{grid.blocks * K}), ReduceOp::Min);
    }
    for (int64_t b = 0; b < grid.blocks; ++b) scale[size_t(b)] = FP8BlockScales::choose(amax[size_t(b)], &exact[size_t(b * K)]);
  }

  // Rank 0 makes the directory, config.json and every file at its size with its header.
  if (root) {
    try {
      std::error_code ec;
      fs::create_directories(d, ec);
      DS_CHECK(!ec, "cannot create the directory '{}': {}", dir, ec.message());
      json config = config_json;
      if (config.is_object()) {
        if (config.contains("torch_dtype") || options.dtype != DType::F32) config["torch_dtype"] = torch_dtype;
        config.erase("quantization_config");
        if (fp8) {
          // As DeepSeek-V3's config.json has it; transformers reads FP8 checkpoints by it.
          config["quantization_config"] = {{"activation_scheme", "dynamic"},
                                           {"fmt", "e4m3"},
                                           {"quant_method", "fp8"},
                                           {"weight_block_size", {options.block.rows, options.block.cols}}};
        }
      }
      write_text_file_atomically((d / "config.json").string(), config.dump(2) + "\n");
      // Readers find shards through the index: without it an interrupted save fails to load
      // instead of loading a mix of two saves.
      remove_if_present(d / kIndexFile);
      for (const SafeTensorsLayout& l : layouts) l.create();
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  raise_failures(world, failure);

  // Every rank puts the rows it writes of its pieces in place, converted (ops::cast rounds to
  // nearest even; FP8 with its blocks' scales), into every entry they go to.
  if (failure.empty()) {
    try {
      pieces.check(file);
      Buffer converted;
      std::vector<uint8_t> codes;
      for (const TensorPiece& t : pieces.pieces) {
        const RowPiece rows = t.written();
        if (rows.rows == 0 || rows.elems() == 0) continue;
        const Shape& s = file.info(t.tensor).global_shape;
        std::vector<PieceRun> runs = piece_runs(t, s, rows);
        if (grid.first.count(t.tensor)) {
          codes.assign(size_t(rows.elems()), 0);
          grid.each(t.tensor, s, runs, [&](int64_t b, int64_t local) {
            const float x = values[t.at + local], sb = scale[size_t(b)];
            codes[size_t(local - rows.elem_begin())] = f32_to_f8e4m3(sb > 0 ? x / sb : x);
          });
          for (PieceRun& r : runs) r.local -= rows.elem_begin();
          for (size_t i : targets.at(t.tensor)) layouts[where[i].first].write_runs(where[i].second, runs, codes.data());
          continue;
        }
        for (PieceRun& r : runs) r.local -= rows.elem_begin();
        const Tensor src(const_cast<float*>(values) + t.at + rows.elem_begin(), DType::F32, Shape{rows.elems()});
        Tensor data = src;
        const DType want = out[targets.at(t.tensor).front()].dtype;  // a tensor and its copies share it
        if (want != DType::F32) {
          if (converted.numel() < rows.elems() || converted.dtype() != want) {
            converted = Buffer("save_hf." + torch_dtype, MemCategory::Workspace, want, rows.elems(), Device::cpu());
          }
          data = converted.tensor(0, {rows.elems()});
          ops::cast(data, src);
        }
        for (size_t i : targets.at(t.tensor)) layouts[where[i].first].write_runs(where[i].second, runs, data.raw());
      }
      // The scales: world rank 0 holds every block's.
      if (root) {
        for (size_t i = 0; i < out.size(); ++i) {
          if (out[i].kind != OutTensor::Kind::Scales) continue;
          float* first = scale.data() + grid.first.at(out[i].tensor);
          layouts[where[i].first].write(where[i].second, Tensor(first, DType::F32, out[i].shape));
        }
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  raise_failures(world, failure);

  // Rank 0 names the complete files, writes the index and removes what an earlier save with
  // another sharding (or an interrupted one) left behind.
  if (root) {
    try {
      std::set<std::string> written;
      json weight_map = json::object();
      for (size_t i = 0; i < layouts.size(); ++i) {
        layouts[i].commit();
        const std::string name = fs::path(layouts[i].path()).filename().string();
        written.insert(name);
        for (size_t k : shards[i]) weight_map[out[k].name] = name;
      }
      if (!single) {
        const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
        write_text_file_atomically((d / kIndexFile).string(), index.dump(2) + "\n");
        written.insert(kIndexFile);
      }
      std::error_code ec;
      std::vector<fs::path> stale;
      fs::directory_iterator entries(d, ec);
      DS_CHECK(!ec, "cannot list '{}' to remove an earlier save's files: {}", dir, ec.message());
      for (const fs::directory_entry& e : entries) {
        std::string name = e.path().filename().string();
        const bool tmp = name.ends_with(".tmp");
        if (tmp) name.resize(name.size() - 4);
        if (is_weight_file(name) && (tmp || !written.count(name))) stale.push_back(e.path());
      }
      for (const fs::path& p : stale) remove_if_present(p);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  }
  raise_failures(world, failure);
}

}  // namespace dstrain
