#include "distributed/grad_reducer.h"

#include <chrono>

#include "backend/ops.h"

namespace dstrain {

GradReducer::GradReducer(ParamRegistry& params, const ParamGroupComms& comms, int64_t bucket_elements, bool overlap,
                         DType comm_dtype)
    : params_(params), comms_(comms), overlap_(overlap), comm_dtype_(comm_dtype), bucket_of_(size_t(params.size()), -1) {
  DS_CHECK(bucket_elements > 0, "reduce_bucket_size must be positive, got {}", bucket_elements);
  DS_CHECK(comm_dtype == DType::F32 || comm_dtype == DType::BF16 || comm_dtype == DType::F16,
           "gradients are communicated in fp32, bf16 or fp16, not {}", dtype_name(comm_dtype));
  for (Communicator* c : comms_.distinct()) any_remote_ = any_remote_ || c->size() > 1;
  if (comm_dtype_ != DType::F32 && any_remote_) {
    wire_ = Buffer("grad_reducer.wire", MemCategory::Workspace, comm_dtype_, params.grads().numel(), params.device());
  }
  // Parameters finish in reverse registration order, so buckets are filled from the end. A
  // bucket closes where the next parameter's group is reduced over another communicator.
  auto comm_of = [&](int id) { return &comms_.comm(params.info(id).group); };
  for (int id = params.size() - 1; id >= 0;) {
    Bucket b;
    b.info.comm = comm_of(id);
    b.info.last = id;
    int64_t elems = 0;
    while (id >= 0 && comm_of(id) == b.info.comm &&
           (elems == 0 || elems + params.info(id).numel() <= bucket_elements)) {
      elems += params.info(id).numel();
      bucket_of_[size_t(id)] = int(buckets_.size());
      --id;
    }
    b.info.first = id + 1;
    b.info.begin = params.info(b.info.first).offset;
    b.info.end = params.info(b.info.last).offset + params.info(b.info.last).numel();
    b.pending = b.info.last - b.info.first + 1;
    buckets_.push_back(b);
  }
}

void GradReducer::begin_micro_step(bool communicates) {
  communicates_ = communicates && any_remote_;
  next_launch_ = 0;
  launched_ = 0;
  if (communicates_) {
    stats_before_.clear();
    for (Communicator* c : comms_.distinct()) stats_before_.push_back(c->stats());
  }
  for (Bucket& b : buckets_) {
    b.pending = b.info.last - b.info.first + 1;
    b.work = Work();
  }
}

GradReadyFn GradReducer::hook() {
  if (!communicates_ || !overlap_) return {};
  return [this](int first, int last) { grad_ready(first, last); };
}

void GradReducer::grad_ready(int first, int last) {
  if (!communicates_ || !overlap_) return;
  DS_CHECK(0 <= first && first <= last && last < params_.size(),
           "gradients reported ready for parameters {}..{}, outside the {} registered", first, last, params_.size());
  for (int id = first; id <= last; ++id) {
    Bucket& b = buckets_[size_t(bucket_of_[size_t(id)])];
    DS_CHECK(b.pending > 0,
             "the gradient of '{}' was reported ready twice in one micro-step; its bucket would be reduced before "
             "it is final (a layer calls grad_ready twice, or two hooks forward to the same reducer)",
             params_.info(id).name);
    --b.pending;
  }
  // Collectives must be issued in the same order on every rank, whatever order a layer's
  // gradients complete in and whichever path (hook or finish) issues them.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(buckets_[next_launch_++]);
}

void GradReducer::launch(Bucket& b) {
  if (b.info.comm->size() == 1) return;  // gradients held by this rank alone: nothing to add
  const Shape n{b.info.end - b.info.begin};
  Tensor grads = params_.grads().tensor(b.info.begin, n);
  if (comm_dtype_ != DType::F32) {
    Tensor wire = wire_.tensor(b.info.begin, n);
    ops::cast(wire, grads);
    grads = wire;
  }
  b.work = b.info.comm->all_reduce_async(grads, ReduceOp::Sum);
  ++launched_;
}

ReduceTimings GradReducer::finish() {
  ReduceTimings t;
  if (!communicates_) return t;
  const auto t0 = std::chrono::steady_clock::now();
  // Buckets the hook did not launch (blocking mode) go now, in bucket order on every rank.
  while (next_launch_ < buckets_.size()) {
    Bucket& b = buckets_[next_launch_++];
    launch(b);
    if (!overlap_) b.work.wait();
  }
  for (Bucket& b : buckets_) b.work.wait();
  if (comm_dtype_ != DType::F32) {
    for (Bucket& b : buckets_) {
      if (!b.work.valid()) continue;
      const Shape n{b.info.end - b.info.begin};
      ops::cast(params_.grads().tensor(b.info.begin, n), wire_.tensor(b.info.begin, n));
    }
  }
  t.exposed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::vector<Communicator*> comms = comms_.distinct();
  for (size_t i = 0; i < comms.size(); ++i) {
    t.comm_seconds += comms[i]->stats().busy_seconds - stats_before_[i].busy_seconds;
  }
  t.buckets = launched_;
  communicates_ = false;
  return t;
}

}  // namespace dstrain
