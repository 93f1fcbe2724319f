// Hugging Face model weights on disk: model.safetensors or a sharded set with
// model.safetensors.index.json, read into and written from the parameter registry.
#pragma once

#include <functional>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "core/json_reader.h"
#include "io/safetensors.h"
#include "io/sharded_state.h"
#include "state/params.h"

namespace dstrain {

class Communicator;  // comm/comm.h

// The block of DeepSeek's block-scaled FP8 weights: rows x columns of a weight matrix that share
// one scale (config.json's quantization_config.weight_block_size; DeepSeek-V3: 128 x 128).
struct FP8Block {
  int64_t rows = 128, cols = 128;
  bool operator==(const FP8Block&) const = default;
  // The blocks of a matrix of shape `s` (partial ones at the edges): the scales' shape.
  Shape grid(const Shape& s) const { return Shape{(s[0] + rows - 1) / rows, (s[1] + cols - 1) / cols}; }
};

// The name of the scales of FP8 weight `name` ("...weight" -> "...weight_scale_inv").
std::string fp8_scale_name(const std::string& name);

// All tensors of one Hugging Face checkpoint, whichever files they are spread over.
//
// DeepSeek's released FP8 weights are read dequantised: a 2-D F8_E4M3 tensor W comes with
// W_scale_inv (F32 or BF16, shape [ceil(rows / block.rows), ceil(cols / block.cols)]), and
// element (r, c) reads as fp32(W[r][c]) * W_scale_inv[r / block.rows][c / block.cols], in fp32:
// weight_dequant of DeepSeek-V3's inference/kernel.py (the product it stores in the default
// dtype; here fp32, the precision of dstrain's master weights). The block size is that of the
// config.json beside the weights (quantization_config.weight_block_size), 128 x 128 without one.
class HFWeights {
 public:
  // `path`: a model directory (model.safetensors, or model.safetensors.index.json and its
  // shards), a single .safetensors file, or an index .json file.
  explicit HFWeights(const std::string& path);

  const std::string& path() const { return path_; }
  bool has(const std::string& name) const { return where_.count(name) != 0; }
  Shape shape(const std::string& name) const { return info(name).shape; }
  DType dtype(const std::string& name) const { return info(name).dtype; }
  // Reads `name` into `out` (host F32, same element count), converting from BF16/F16/F64 and
  // dequantising block-scaled FP8.
  void read_f32(const std::string& name, Tensor out) const;
  // Elements [begin, begin + n) of `name` (flattened), converted to fp32: only their bytes (and
  // for FP8, the scales of their blocks' rows).
  void read_f32_range(const std::string& name, int64_t begin, int64_t n, float* dst) const;
  // FP8: `name` is an F8_E4M3 weight read with its block scales; `name` is such a weight's scales.
  bool block_scaled(const std::string& name) const { return fp8_.count(name) != 0; }
  bool is_block_scale(const std::string& name) const { return scales_.count(name) != 0; }
  const FP8Block& block() const { return block_; }
  // The stored bytes of `name`, valid while this object lives.
  std::span<const std::byte> raw(const std::string& name) const;
  // The file that holds `name`.
  const std::string& file_of(const std::string& name) const;
  // Unmaps `name`'s pages from this process (SafeTensorsFile::release).
  void release(const std::string& name) const { file(name).release(name); }
  // Every tensor name, sorted.
  std::vector<std::string> names() const;

 private:
  const SafeTensorInfo& info(const std::string& name) const;
  const SafeTensorsFile& file(const std::string& name) const;
  void open_single(const std::string& file);
  void open_index(const std::string& index_path);
  void check_fp8(const std::string& config_path);
  // Multiplies elements [begin, begin + n) of FP8 weight `name`, read unscaled into dst, by
  // their blocks' scales.
  void apply_scales(const std::string& name, int64_t begin, int64_t n, float* dst) const;

  std::string path_;
  FP8Block block_;
  std::set<std::string> fp8_, scales_;  // FP8 weights read with their scales; those scales
  std::vector<std::unique_ptr<SafeTensorsFile>> files_;
  std::map<std::string, size_t> where_;  // tensor name -> index into files_
};

struct HFLoadStats {
  int loaded = 0;                // registry parameters read from the files
  int skipped_inv_freq = 0;      // "*rotary_emb.inv_freq" buffers: derived, recomputed by the model
  bool tied_lm_head_checked = false;  // a tied model's file held an lm_head.weight equal to the embedding
  int shared_copies = 0;  // MTP modules' copies of the shared embedding/head, checked equal and skipped
  int fp8_dequantised = 0;  // block-scaled FP8 weights read (dequantised) into this rank's parameters

  // Memory while loading, in bytes. piece_bytes: what this rank read into its parameters (fp32
  // pieces). largest_transient_bytes: the most it held beside them at once, counted: a run on a
  // device reads each piece into a host copy; on the host pieces go straight into the
  // parameters, and it is 0.
  int64_t piece_bytes = 0, largest_transient_bytes = 0;
  // The process's resident memory (/proc/self/status; 0 where there is none), sampled at the
  // start and after each tensor's read while that tensor's buffers are alive: anonymous memory
  // (the rank's own) and mapped file pages (the safetensors bytes read through the mapping,
  // each tensor's released once read: page cache, shared with every process reading the
  // files, which RSS counts all the same).
  int64_t anon_start = 0, anon_peak = 0, mapped_file_start = 0, mapped_file_peak = 0;
  // Parameters whose memory is committed as it is written (ZeRO-3's reserved registry) gain
  // their pieces during the load; others hold them, zero-filled, before it starts.
  bool pieces_committed_by_load = false;
  // Anonymous memory the load added beyond the pieces: measured, what largest_transient_bytes
  // counts.
  int64_t anon_beyond_pieces() const {
    return anon_peak - anon_start - (pieces_committed_by_load ? piece_bytes : 0);
  }
};

// Reads every registry parameter from the Hugging Face weights at `path` (see HFWeights).
// Each must be present with exactly its global shape; tensors the registry does not have
// are an error, except rotary inv_freq buffers and, for tied embeddings, an lm_head.weight
// bitwise equal to model.embed_tokens.weight. Parameters must be in host memory, whole or
// tensor-parallel pieces (placement Shard over "tensor"): a piece's bytes are read from the
// memory-mapped file and nothing else (no whole tensor is read or held), so every rank of any
// layout loads the same files, each its own pieces, with no transient memory beyond them.
// `model`, when given, lists every tensor of the model (other pipeline stages' and expert
// ranks' too): the files' tensors are checked against it, and this rank loads the ones `reg`
// holds. With `world`, the ranks' findings of non-finite values are pooled (collective), so
// that every rank raises the same error, and world rank 0 logs every rank's memory figures
// (HFLoadStats).
HFLoadStats load_hf_weights(const std::string& path, ParamRegistry& reg, const ParamRegistry* model = nullptr,
                            Communicator* world = nullptr);

// How save_hf_weights writes a checkpoint.
struct HFSaveOptions {
  // Tensor data per file: shards of at most this many bytes (a larger tensor gets its own).
  int64_t max_shard_bytes = int64_t(5) << 30;
  // F32, BF16 or F16: every tensor so, the fp32 masters rounded to nearest even. F8_E4M3:
  // DeepSeek's released FP8, the weight matrices of the decoder layers' attention and MLPs
  // (is_fp8_weight) block-scaled with their `_scale_inv` beside them, the rest BF16, and
  // config.json's quantization_config saying so.
  DType dtype = DType::F32;
  FP8Block block;  // FP8: the blocks that share a scale
  // DeepSeek's released layout: each multi-token-prediction module model.layers.{L + k}
  // (L = num_hidden_layers) carries its own copies of the embedding and the output head
  // (embed_tokens.weight, shared_head.head.weight), as DeepSeek-V3's checkpoints do; dstrain
  // shares them and writes them twice. With it (and with FP8), the routing biases
  // (e_score_correction_bias) are F32, as in the release.
  bool released_layout = false;
};

// The tensors an FP8 export stores block-scaled: the projection matrices of the decoder layers'
// (and the MTP modules') attention and MLPs, routed and shared experts included
// (model.layers.N.self_attn.*_proj.weight, model.layers.N.mlp.**_proj.weight), as in
// DeepSeek-V3's release. Embeddings, heads, norms, router gates and the MTP modules' eh_proj stay
// BF16.
bool is_fp8_weight(const std::string& name);

// DeepSeek's block quantisation of one weight matrix, as dstrain writes it: per block, the scale
// s = amax / 448 and the elements fp8(x / s) (weight_quant of DeepSeek-V3's inference/kernel.py,
// rounding to nearest even). One refinement keeps a round trip exact: where a block's values are
// exactly fp8(q) * s for a scale s next to amax / 448 (one fp32 step either way, or the power of
// two 2^ceil(log2(amax / 448)) of DeepSeek's UE8M0 scales), that s is written, so that FP8 weights
// read in and written out untrained come back bit for bit. A block of zeros gets scale 0 and
// zeros (weight_quant would divide by zero).
struct FP8BlockScales {
  static constexpr int kCandidates = 4;
  // The candidates for a block whose largest magnitude is `amax` (> 0), in order of preference.
  static std::array<float, kCandidates> candidates(float amax);
  // Whether x reads back exactly from its FP8 code under scale s.
  static bool exact(float x, float s);
  // The scale a block takes, given its amax and which candidates every element is exact under.
  static float choose(float amax, const uint8_t* exact_under);
};

// Writes `reg` as a Hugging Face checkpoint in `dir`: config.json, then model.safetensors,
// or model-0000i-of-0000N.safetensors shards of at most max_shard_bytes of tensor data
// (a larger tensor gets a shard of its own) plus model.safetensors.index.json. Tensors are
// written in `dtype` (F32, BF16 or F16: the fp32 masters rounded to nearest even), sorted by
// name, and config.json's torch_dtype says so. Weight files of an earlier save with another
// sharding are removed.
//
// The caller is one process with whole parameters (a run on a device copies them to the host).
void save_hf_weights(const std::string& dir, const ParamRegistry& reg, const json& config_json,
                     int64_t max_shard_bytes = int64_t(5) << 30, DType dtype = DType::F32);
void save_hf_weights(const std::string& dir, const ParamRegistry& reg, const json& config_json,
                     const HFSaveOptions& options);

// The same, for a model whose tensors are spread over ranks: `file` names every tensor of the
// model with its global shape (not allocated), `pieces` says what this rank holds of them and
// where in `values` (host F32: its flat buffer), and every rank of `world` calls this with the
// same file (null `world`: one process). World rank 0 lays out the files and writes their
// headers; every rank converts the rows of its pieces it is the writing replica of and puts
// them in place (so the directory must be on a filesystem every rank sees, as checkpoints
// need). Nobody assembles a tensor: a rank holds its pieces and one piece's converted rows. A
// failure on any rank is raised on every rank, naming it.
void save_hf_weights(const std::string& dir, const ParamRegistry& file, const ShardedState& pieces,
                     const float* values, const json& config_json, int64_t max_shard_bytes, DType dtype,
                     Communicator* world);
// The same with every option (HFSaveOptions). FP8: the blocks' largest magnitudes, and which
// scales read each block back exactly, are reduced over `world` (a block may span ranks' pieces),
// so that every rank quantises its rows with the same scales; world rank 0 writes the scales.
void save_hf_weights(const std::string& dir, const ParamRegistry& file, const ShardedState& pieces,
                     const float* values, const json& config_json, const HFSaveOptions& options,
                     Communicator* world);

// Hugging Face's torch_dtype names: "float32", "bfloat16", "float16" (and for F8_E4M3, whose
// checkpoints keep their other tensors in BF16, "bfloat16").
std::string torch_dtype_name(DType dtype);
DType dtype_from_torch_name(const std::string& name);
// The dtype of an export by dstrain's name for it (output.save_hf_dtype, dstrain-ckpt export
// --dtype): a torch_dtype name, or "fp8" for DeepSeek's block-scaled F8_E4M3.
DType hf_export_dtype(const std::string& name);

}  // namespace dstrain
