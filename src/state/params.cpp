#include "state/params.h"

#include <algorithm>

#include "backend/ops.h"

namespace dstrain {

namespace {
constexpr int64_t kAlign = 16;  // elements: 64-byte alignment for every separate parameter
}

std::string_view param_kind_name(ParamKind k) {
  switch (k) {
    case ParamKind::Embedding: return "embedding";
    case ParamKind::Norm: return "norm";
    case ParamKind::Linear: return "linear";
    case ParamKind::Head: return "lm_head";
    case ParamKind::RouterBias: return "router_bias";
  }
  return "?";
}

std::string_view param_group_name(ParamGroup g) { return g == ParamGroup::Expert ? "expert" : "dense"; }

int64_t ParamRegistry::global_numel() const {
  int64_t n = 0;
  for (const ParamInfo& p : params_) n += p.global_shape.numel();
  return n;
}

int ParamRegistry::add(std::string name, Shape shape, ParamKind kind, int layer, bool follow_previous,
                       bool trainable) {
  ParamOptions o;
  o.follow_previous = follow_previous;
  o.trainable = trainable;
  return add(std::move(name), shape, kind, layer, o);
}

int ParamRegistry::add(std::string name, Shape shape, ParamKind kind, int layer, const ParamOptions& options) {
  const bool follow_previous = options.follow_previous;
  DS_CHECK(!values_.allocated(), "parameter '{}' registered after allocation", name);
  DS_CHECK(!by_name_.count(name), "parameter '{}' registered twice", name);
  DS_CHECK(!follow_previous || !params_.empty(), "parameter '{}' cannot follow: it is the first", name);
  DS_CHECK(!follow_previous || params_.back().group == options.group,
           "parameter '{}' ({}) cannot follow '{}' ({}) as one fused matrix: fused parameters must be in the same "
           "group, as each group's gradients are reduced over its own communicator",
           name, param_group_name(options.group), params_.back().name, param_group_name(params_.back().group));
  ParamInfo p;
  p.name = std::move(name);
  p.shape = shape;
  p.global_shape = options.global_shape.ndim() ? options.global_shape : shape;
  DS_CHECK(p.global_shape.ndim() == shape.ndim(), "parameter '{}': local shape {} and global shape {} differ in rank",
           p.name, shape.str(), p.global_shape.str());
  p.placement = options.placement;
  p.kind = kind;
  p.layer = layer;
  p.trainable = options.trainable;
  p.group = options.group;
  p.tp_partial_grad = options.tp_partial_grad;
  p.pipeline_copy = options.pipeline_copy;
  p.offset = follow_previous ? flat_numel_ : (flat_numel_ + kAlign - 1) / kAlign * kAlign;
  flat_numel_ = p.offset + shape.numel();
  by_name_[p.name] = int(params_.size());
  params_.push_back(std::move(p));
  return int(params_.size()) - 1;
}

void ParamRegistry::allocate(Device device) {
  const int64_t n = (flat_numel_ + kAlign - 1) / kAlign * kAlign;
  values_ = Buffer("parameters", MemCategory::Parameters, DType::F32, n, device);
  grads_ = Buffer("gradients", MemCategory::Gradients, DType::F32, n, device);
}

void ParamRegistry::reserve_values() {
  const int64_t n = values_.numel();
  values_ = Buffer::reserved("parameters (gathered)", MemCategory::GatheredParameters, DType::F32, n, values_.device());
  if (has_compute_copy()) {
    compute_ = Buffer::reserved("parameters (gathered compute copy)", MemCategory::GatheredParameters,
                                compute_.dtype(), n, values_.device());
  }
}

void ParamRegistry::reserve_grads() {
  grads_ = Buffer::reserved("gradients (transient)", MemCategory::Gradients, DType::F32, grads_.numel(),
                            grads_.device());
}

RowPiece row_piece(const Shape& global, int rank, int n) {
  RowPiece p;
  const int64_t R = global.ndim() ? global[0] : 1;
  p.row_elems = global.ndim() ? global.numel() / std::max<int64_t>(R, 1) : 1;
  p.row_begin = R * rank / n;
  p.rows = R * (rank + 1) / n - p.row_begin;
  return p;
}

int ParamRegistry::find(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? -1 : it->second;
}

Tensor ParamRegistry::param(int id) const { return values_.tensor(info(id).offset, info(id).shape); }
Tensor ParamRegistry::grad(int id) const { return grads_.tensor(info(id).offset, info(id).shape); }

Tensor ParamRegistry::rows(const Buffer& buf, int first, int last) const {
  const int64_t cols = info(first).shape[info(first).shape.ndim() - 1];
  int64_t total_rows = 0;
  for (int id = first; id <= last; ++id) {
    const ParamInfo& p = info(id);
    DS_CHECK(p.shape.ndim() == 2 && p.shape[1] == cols, "'{}' {} cannot be stacked with '{}'", p.name,
             p.shape.str(), info(first).name);
    DS_CHECK(id == first || p.offset == info(id - 1).offset + info(id - 1).numel(),
             "'{}' is not contiguous with '{}'", p.name, info(id - 1).name);
    total_rows += p.shape[0];
  }
  return buf.tensor(info(first).offset, Shape{total_rows, cols});
}

std::vector<ParamRun> ParamRegistry::runs() const {
  std::vector<ParamRun> out;
  for (int id = 0; id < size(); ++id) {
    const ParamInfo& p = info(id);
    if (out.empty() || out.back().group != p.group) {
      out.push_back(ParamRun{p.group, id, id, p.offset, p.offset + p.numel()});
    } else {
      out.back().last = id;
      out.back().end = p.offset + p.numel();
    }
  }
  return out;
}

std::vector<ParamRun> ParamRegistry::group_ranges(ParamGroup g) const {
  std::vector<ParamRun> out;
  for (const ParamRun& r : runs()) {
    if (r.group == g) out.push_back(r);
  }
  return out;
}

int64_t ParamRegistry::group_numel(ParamGroup g) const {
  int64_t n = 0;
  for (const ParamInfo& p : params_) {
    if (p.group == g) n += p.numel();
  }
  return n;
}

Tensor ParamRegistry::grad_range(const ParamRun& run) const {
  DS_CHECK(run.begin >= 0 && run.begin <= run.end && run.end <= flat_numel_,
           "gradient range [{}, {}) lies outside the {} registered elements", run.begin, run.end, flat_numel_);
  return grads_.tensor(run.begin, Shape{run.numel()});
}

Tensor ParamRegistry::param_rows(int first, int last) const { return rows(values_, first, last); }

void ParamRegistry::allocate_compute(DType dtype) {
  DS_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16,
           "the compute dtype of the weights must be F32, BF16 or F16, not {}", dtype_name(dtype));
  DS_CHECK(values_.numel() > 0, "the compute copy of the weights needs the weights allocated first");
  if (dtype == DType::F32) {
    compute_ = Buffer();
    return;
  }
  if (!has_compute_copy() || compute_.dtype() != dtype) {
    compute_ = values_.is_reserved()
                   ? Buffer::reserved("parameters (gathered compute copy)", MemCategory::GatheredParameters, dtype,
                                      values_.numel(), values_.device())
                   : Buffer("parameters (compute copy)", MemCategory::Parameters, dtype, values_.numel(),
                            values_.device());
  }
  refresh_compute();
}

void ParamRegistry::refresh_compute() {
  // Reserved weights hold only what ZeRO-3 gathered, and it refreshes what it gathers.
  if (has_compute_copy() && !values_.is_reserved()) ops::cast(compute_.tensor(), values_.tensor());
}

void ParamRegistry::refresh_compute(int first, int last) {
  if (!has_compute_copy()) return;
  const int64_t b = info(first).offset, e = info(last).offset + info(last).numel();
  ops::cast(compute_.tensor(b, {e - b}), values_.tensor(b, {e - b}));
}

Tensor ParamRegistry::compute(int id) const {
  return has_compute_copy() ? compute_.tensor(info(id).offset, info(id).shape) : param(id);
}
Tensor ParamRegistry::compute_rows(int first, int last) const {
  return has_compute_copy() ? rows(compute_, first, last) : param_rows(first, last);
}
Tensor ParamRegistry::grad_rows(int first, int last) const { return rows(grads_, first, last); }

}  // namespace dstrain
