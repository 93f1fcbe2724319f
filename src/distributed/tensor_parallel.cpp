#include "distributed/tensor_parallel.h"

#include <algorithm>

#include "backend/ops.h"
#include "core/clock.h"

namespace dstrain {
namespace {
bool replicated_piece(const ParamInfo& p, int tp_size) {
  return p.placement.kind == Placement::Kind::Shard && p.placement.count < tp_size;
}
}  // namespace

TensorParallelGradSync::TensorParallelGradSync(ParamRegistry& params, Communicator* tp)
    : params_(params), tp_(ProcessGroups::size_of(tp) > 1 ? tp : nullptr) {
  is_partial_.assign(size_t(params.size()), 0);
  summed_.assign(size_t(params.size()), 0);
  if (!tp_) return;
  for (int id = 0; id < params.size(); ++id) {
    const ParamInfo& p = params.info(id);
    if (!p.trainable) continue;
    if (p.tp_partial_grad || replicated_piece(p, tp_->size())) {
      partial_.push_back(id);
      is_partial_[size_t(id)] = 1;
    }
  }
}

void TensorParallelGradSync::grad_ready(int first, int last) {
  if (!tp_ || !communicates_) return;
  const auto t0 = Clock::now();
  for (int id = first; id <= last; ++id) {
    if (is_partial_[size_t(id)] && !summed_[size_t(id)]) {
      sum(id);
      summed_[size_t(id)] = 1;
    }
  }
  seconds_ += seconds_since(t0);
}

void TensorParallelGradSync::finish() {
  if (every_micro_step_) {
    // Every partial gradient was summed as it was reported (ZeRO has reduced and handed back
    // the whole gradients since).
    std::fill(summed_.begin(), summed_.end(), 0);
    return;
  }
  if (!tp_ || !communicates_) return;
  const auto t0 = Clock::now();
  for (int id : partial_) {
    if (!summed_[size_t(id)]) sum(id);
  }
  std::fill(summed_.begin(), summed_.end(), 0);
  // Until the next step's last micro-step: the next forwards' gradients are partial again.
  communicates_ = false;
  seconds_ += seconds_since(t0);
}

void TensorParallelGradSync::sum(int id) {
  const ParamInfo& p = params_.info(id);
  Tensor g = params_.grad(id);
  if (!replicated_piece(p, tp_->size())) {
    tp_->all_reduce(g);
    return;
  }
  // Ranks holding other pieces add zeros: one all-reduce of the whole tensor (small: fewer
  // key/value heads than ranks) sums each piece over its holders.
  DS_CHECK(p.placement.dim == 0, "{}: a replicated piece split along dimension {} is not supported", p.name,
           p.placement.dim);
  const int64_t n = p.global_shape.numel(), piece = g.numel();
  if (staging_.numel() < n) staging_ = Buffer("tensor_parallel.grad_staging", MemCategory::CommBuffers, DType::F32, n,
                                              params_.device());
  Tensor whole = staging_.tensor(0, Shape{n});
  ops::fill(whole, 0.0f);
  Tensor mine = whole.slice(p.placement.index * piece, (p.placement.index + 1) * piece);
  ops::copy(mine, g.view(Shape{piece}));
  tp_->all_reduce(whole);
  ops::copy(g.view(Shape{piece}), mine);
}

double TensorParallelGradSync::take_seconds() {
  const double s = seconds_;
  seconds_ = 0;
  return s;
}

bool counts_piece(const ParamInfo& p, int tp_rank, int tp_size) {
  if (tp_size <= 1) return true;
  // Whole parameters and routed experts (whole on every tensor rank) count on tensor rank 0.
  if (p.placement.held_whole()) return tp_rank == 0;
  if (p.placement.kind == Placement::Kind::Shard && p.placement.count < tp_size) {
    // Rank t holds piece t * count / tp: the first of its holders is the lowest such t.
    const int64_t first = (p.placement.index * tp_size + p.placement.count - 1) / p.placement.count;
    return tp_rank == first;
  }
  return true;
}

}  // namespace dstrain
