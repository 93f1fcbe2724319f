// Hugging Face checkpoints <-> the parameter registry. Loading is strict (every parameter
// present with its exact shape, nothing left over); saving writes what transformers reads.
#include "io/hf_weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <numeric>
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
  const auto a = w.raw(name), b = w.raw(*original);
  DS_CHECK(w.dtype(name) == w.dtype(*original) && w.shape(name) == w.shape(*original) && a.size() == b.size() &&
               std::memcmp(a.data(), b.data(), a.size()) == 0,
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

const SafeTensorsFile& HFWeights::file(const std::string& name) const {
  auto it = where_.find(name);
  DS_CHECK(it != where_.end(), "tensor '{}' is not in the Hugging Face weights at '{}'", name, path_);
  return *files_[it->second];
}

const SafeTensorInfo& HFWeights::info(const std::string& name) const { return file(name).info(name); }
void HFWeights::read_f32(const std::string& name, Tensor out) const { file(name).read_f32(name, out); }
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
    if (name.ends_with("rotary_emb.inv_freq")) {  // recomputed from rope_theta
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
    stats.piece_bytes += int64_t(t.nbytes());
    if (!reg.param(id).device().is_cpu()) {
      stats.largest_transient_bytes = std::max(stats.largest_transient_bytes, int64_t(t.nbytes()));
    }
    sample_and_release(w, stats, {name});  // while this tensor's buffers (a device run's host copy) are alive
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
    default: break;
  }
  DS_FAIL("Hugging Face weights are float32, bfloat16 or float16, not {}", dtype_name(dtype));
}

DType dtype_from_torch_name(const std::string& name) {
  if (name == "float32") return DType::F32;
  if (name == "bfloat16") return DType::BF16;
  if (name == "float16") return DType::F16;
  DS_FAIL("torch_dtype \"{}\" is not one dstrain writes (float32, bfloat16, float16)", name);
}

void save_hf_weights(const std::string& dir, const ParamRegistry& reg, const json& config_json,
                     int64_t max_shard_bytes, DType dtype) {
  DS_CHECK(reg.flat_numel() == 0 || reg.values().allocated(),
           "save_hf_weights('{}'): the parameter registry is not allocated", dir);
  for (const ParamInfo& p : reg.all()) check_whole(p, "save_hf_weights");
  // Written from the host: a run on a device copies the weights over first.
  const ops::HostView host(reg.values().tensor());
  save_hf_weights(dir, reg, ShardedState::whole(reg), host.get().data<float>(), config_json, max_shard_bytes, dtype,
                  nullptr);
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
  const bool root = world == nullptr || world->rank() == 0;
  DS_CHECK(max_shard_bytes > 0, "save_hf_weights('{}'): max_shard_bytes must be positive, got {}", dir,
           max_shard_bytes);
  const std::string torch_dtype = torch_dtype_name(dtype);

  std::vector<int> ids(size_t(file.size()));
  std::iota(ids.begin(), ids.end(), 0);
  std::sort(ids.begin(), ids.end(), [&](int a, int b) { return file.info(a).name < file.info(b).name; });
  // Greedy in name order, as transformers does; a tensor above the limit gets its own shard.
  std::vector<std::vector<int>> shards;
  int64_t total = 0, shard_bytes = 0;
  for (int id : ids) {
    const int64_t bytes = file.info(id).global_shape.numel() * int64_t(dtype_size(dtype));
    if (shards.empty() || (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes)) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(id);
    shard_bytes += bytes;
    total += bytes;
  }
  const bool single = total <= max_shard_bytes;  // then the greedy split made one shard
  // Every rank knows every file's layout: where each tensor's bytes go.
  const fs::path d(dir);
  const std::map<std::string, std::string> metadata{{"format", "pt"}};  // transformers checks it
  std::vector<SafeTensorsLayout> layouts;
  std::vector<std::pair<size_t, size_t>> where(size_t(file.size()));  // id -> (file, position)
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string name =
        single ? std::string(kSingleFile) : fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
    std::vector<SafeTensorInfo> infos;
    for (size_t k = 0; k < shards[i].size(); ++k) {
      const ParamInfo& p = file.info(shards[i][k]);
      infos.push_back(SafeTensorInfo{p.name, dtype, p.global_shape, 0, 0});
      where[size_t(shards[i][k])] = {i, k};
    }
    layouts.emplace_back((d / name).string(), std::move(infos), metadata);
  }

  // Rank 0 makes the directory, config.json and every file at its size with its header.
  std::string failure;
  if (root) {
    try {
      std::error_code ec;
      fs::create_directories(d, ec);
      DS_CHECK(!ec, "cannot create the directory '{}': {}", dir, ec.message());
      json config = config_json;
      if (config.is_object() && (config.contains("torch_dtype") || dtype != DType::F32)) config["torch_dtype"] = torch_dtype;
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
  // nearest even).
  if (failure.empty()) {
    try {
      pieces.check(file);
      Buffer converted;
      for (const TensorPiece& t : pieces.pieces) {
        const RowPiece rows = t.written();
        if (rows.rows == 0 || rows.elems() == 0) continue;
        std::vector<PieceRun> runs = piece_runs(t, file.info(t.tensor).global_shape, rows);
        for (PieceRun& r : runs) r.local -= rows.elem_begin();
        const Tensor src(const_cast<float*>(values) + t.at + rows.elem_begin(), DType::F32, Shape{rows.elems()});
        Tensor data = src;
        if (dtype != DType::F32) {
          if (converted.numel() < rows.elems()) {
            converted = Buffer("save_hf." + torch_dtype, MemCategory::Workspace, dtype, rows.elems(), Device::cpu());
          }
          data = converted.tensor(0, {rows.elems()});
          ops::cast(data, src);
        }
        const auto [f, k] = where[size_t(t.tensor)];
        layouts[f].write_runs(k, runs, data.raw());
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
        for (int id : shards[i]) weight_map[file.info(id).name] = name;
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
