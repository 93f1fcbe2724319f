// The parameter registry: every parameter has its Hugging Face name, its global shape and
// how the local piece relates to it, and lives at an offset of one flat allocation.
// Gradients and optimizer states mirror the same flat layout, so a bucket of gradients or
// a shard of optimizer state is a contiguous range. Checkpoints and safetensors I/O walk
// this registry: files hold global tensors; each rank reads and writes its pieces.
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"

namespace dstrain {

// What a parameter is, for defaults such as "no weight decay on norms and embeddings".
enum class ParamKind { Embedding, Norm, Linear, Head, RouterBias };
std::string_view param_kind_name(ParamKind k);

// How this rank's piece relates to the global tensor.
struct Placement {
  enum class Kind {
    Whole,      // the rank holds the whole tensor (replicated)
    Shard,      // a slice along `dim`, piece `index` of `count` over grid axis `axis`
    Expert,     // one expert (`index`) of `count`
    FlatRange,  // elements [begin, begin + length) of the flattened tensor
  };
  Kind kind = Kind::Whole;
  int dim = -1;
  std::string axis;
  int64_t index = 0, count = 1;
  int64_t begin = 0, length = 0;
  // The ranks that hold it hold the whole tensor: replicated, or one routed expert (whole on
  // every tensor rank of its owners).
  bool held_whole() const { return kind == Kind::Whole || kind == Kind::Expert; }
};

// The rows of a tensor of global shape `global` that rank `rank` of `n` holds when the tensor
// is split along its first dimension: rows [R * rank / n, R * (rank + 1) / n). Checkpoints
// write and read tensors in these pieces, and ZeRO shards every parameter by them, so that a
// sharded rank writes its own state and nothing else.
struct RowPiece {
  int64_t row_begin = 0, rows = 0, row_elems = 1;
  int64_t elem_begin() const { return row_begin * row_elems; }
  int64_t elems() const { return rows * row_elems; }
};
RowPiece row_piece(const Shape& global, int rank, int n);

// Which data-parallel communicator reduces a parameter's gradient: dense parameters are
// replicated over all data-parallel ranks, routed experts only over the ranks that hold the
// same experts (ProcessGrid::expert_data()).
enum class ParamGroup { Dense, Expert };
std::string_view param_group_name(ParamGroup g);

struct ParamInfo {
  std::string name;    // Hugging Face name, e.g. "model.layers.0.self_attn.q_proj.weight"
  Shape shape;         // local shape
  Shape global_shape;  // shape in a checkpoint
  Placement placement;
  ParamKind kind = ParamKind::Linear;
  int layer = -1;      // decoder layer index, -1 outside the layers
  int64_t offset = 0;  // element offset in the flat buffers
  bool trainable = true;  // false: updated by a rule, not by gradients (e.g. MoE routing biases)
  ParamGroup group = ParamGroup::Dense;
  // Tensor parallelism: the rank's gradient of this (replicated) parameter is a partial sum
  // over the tensor group, to be summed over it once per step before the data-parallel
  // reduction: parameters that see only the rank's heads (MLA's down-projections and latent
  // norms) or, with sequence parallelism, only its share of the tokens (norms, the router,
  // routed experts).
  bool tp_partial_grad = false;
  // Pipeline parallelism: this rank holds a copy of a parameter that an earlier pipeline stage
  // owns (the embedding on the last stage, read by a tied head or the MTP modules). Its
  // gradient is summed with the owner's once per step; the owner alone writes it to files and
  // counts it in norms.
  bool pipeline_copy = false;
  int64_t numel() const { return shape.numel(); }
};

// A run of consecutive parameter ids of one group and the flat elements [begin, end) they
// span (the alignment padding between them included). Where the groups' communicators differ
// (expert parallelism), gradient buckets and, later, ZeRO shards are cut inside runs, so that
// no collective mixes two communicators.
struct ParamRun {
  ParamGroup group = ParamGroup::Dense;
  int first = 0, last = 0;     // parameter ids, inclusive
  int64_t begin = 0, end = 0;  // flat element range
  int64_t numel() const { return end - begin; }
};

// How a parameter is registered beyond its name, local shape and kind.
struct ParamOptions {
  bool follow_previous = false;  // placed right after the previous one (fused matrices)
  bool trainable = true;
  ParamGroup group = ParamGroup::Dense;
  Placement placement;           // Whole by default
  Shape global_shape;            // empty: the local shape (Whole)
  bool tp_partial_grad = false;  // see ParamInfo
  bool pipeline_copy = false;    // see ParamInfo
};

class ParamRegistry {
 public:
  int add(std::string name, Shape shape, ParamKind kind, int layer, const ParamOptions& options);
  // Registers a whole (replicated) parameter. With `follow_previous` it is placed directly
  // after the previous one with no padding, so the two can be used as one fused matrix.
  int add(std::string name, Shape shape, ParamKind kind, int layer, bool follow_previous = false,
          bool trainable = true);
  // Allocates the flat parameter and gradient buffers (zero-filled).
  void allocate(Device device);
  // ZeRO: the whole-model buffers become reserved address space (Buffer::reserved) that holds
  // memory only where a piece is in use: the weights (and their compute copy) at stage 3, the
  // gradients at stages 2 and 3. Their contents are dropped (zeros).
  void reserve_values();
  void reserve_grads();
  bool values_reserved() const { return values_.is_reserved(); }
  // Zeroes every gradient (in reserved gradients, handing their pages back).
  void zero_grads() { grads_.zero(); }

  int size() const { return int(params_.size()); }
  const ParamInfo& info(int id) const { return params_[size_t(id)]; }
  const std::vector<ParamInfo>& all() const { return params_; }
  int find(const std::string& name) const;  // -1 when absent
  // Marks a parameter's gradient as a partial sum over the tensor group (ParamInfo).
  void set_tp_partial_grad(int id, bool partial) { params_[size_t(id)].tp_partial_grad = partial; }
  int64_t flat_numel() const { return flat_numel_; }
  // Elements of the global tensors (what a checkpoint holds), whatever pieces this rank has.
  int64_t global_numel() const;

  // Every maximal run of consecutive parameters of the same group, in id order: dense and
  // expert parameters interleave layer by layer, so a group is in general several runs.
  std::vector<ParamRun> runs() const;
  // The runs of group g, in id order.
  std::vector<ParamRun> group_ranges(ParamGroup g) const;
  // Elements of group g's parameters (padding not counted).
  int64_t group_numel(ParamGroup g) const;
  // The run's elements of the flat gradient buffer, as one 1-D tensor (numel).
  Tensor grad_range(const ParamRun& run) const;

  Tensor param(int id) const;
  Tensor grad(int id) const;
  // Parameters first..last (registered consecutively with follow_previous) as one matrix
  // of their stacked rows.
  Tensor param_rows(int first, int last) const;
  Tensor grad_rows(int first, int last) const;

  // Mixed precision: a copy of the (fp32 master) weights in the compute dtype, in the same flat
  // layout, for the GEMMs to read. allocate_compute(BF16 or F16) makes it from the masters;
  // allocate_compute(F32) drops it. The optimizer refreshes it in its update; whatever else
  // writes the masters (initialisation, a checkpoint, --init-from) calls refresh_compute().
  void allocate_compute(DType dtype);
  bool has_compute_copy() const { return compute_.numel() > 0; }
  DType compute_dtype() const { return has_compute_copy() ? compute_.dtype() : DType::F32; }
  void refresh_compute();
  // The compute copy of parameters first..last only (ZeRO-3 after gathering them).
  void refresh_compute(int first, int last);
  // The weights as the compute reads them: the copy's, or the fp32 master's without one.
  Tensor compute(int id) const;
  Tensor compute_rows(int first, int last) const;
  const Buffer& compute_values() const { return compute_; }
  Buffer& compute_values() { return compute_; }

  Buffer& values() { return values_; }
  Buffer& grads() { return grads_; }
  const Buffer& values() const { return values_; }
  const Buffer& grads() const { return grads_; }
  Device device() const { return values_.device(); }

 private:
  Tensor rows(const Buffer& buf, int first, int last) const;
  std::vector<ParamInfo> params_;
  std::unordered_map<std::string, int> by_name_;
  int64_t flat_numel_ = 0;
  Buffer values_, grads_;
  Buffer compute_;  // empty without mixed precision
};

}  // namespace dstrain
