#include "distributed/grad_reducer.h"

#include <chrono>

namespace dstrain {

GradReducer::GradReducer(ParamRegistry& params, Communicator& dp, int64_t bucket_elements, bool overlap)
    : params_(params), dp_(dp), overlap_(overlap), bucket_of_(size_t(params.size()), -1) {
  DS_CHECK(bucket_elements > 0, "reduce_bucket_size must be positive, got {}", bucket_elements);
  // Parameters finish in reverse registration order, so buckets are filled from the end.
  for (int id = params.size() - 1; id >= 0;) {
    Bucket b;
    b.last = id;
    int64_t elems = 0;
    while (id >= 0 && (elems == 0 || elems + params.info(id).numel() <= bucket_elements)) {
      elems += params.info(id).numel();
      bucket_of_[size_t(id)] = int(buckets_.size());
      --id;
    }
    b.first = id + 1;
    b.begin = params.info(b.first).offset;
    b.end = params.info(b.last).offset + params.info(b.last).numel();
    b.pending = b.last - b.first + 1;
    buckets_.push_back(b);
  }
}

void GradReducer::begin_micro_step(bool communicates) {
  communicates_ = communicates && dp_.size() > 1;
  next_launch_ = 0;
  if (communicates_) stats_before_ = dp_.stats();
  for (Bucket& b : buckets_) {
    b.pending = b.last - b.first + 1;
    b.work = Work();
  }
}

GradReadyFn GradReducer::hook() {
  if (!communicates_ || !overlap_) return {};
  return [this](int first, int last) { on_ready(first, last); };
}

void GradReducer::on_ready(int first, int last) {
  for (int id = first; id <= last; ++id) --buckets_[size_t(bucket_of_[size_t(id)])].pending;
  // Collectives must be issued in the same order on every rank, whatever order a layer's
  // gradients complete in and whichever path (hook or finish) issues them.
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) launch(buckets_[next_launch_++]);
}

void GradReducer::launch(Bucket& b) {
  b.work = dp_.all_reduce_async(params_.grads().tensor(b.begin, Shape{b.end - b.begin}), ReduceOp::Sum);
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
  t.exposed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  t.comm_seconds = dp_.stats().busy_seconds - stats_before_.busy_seconds;
  t.buckets = int(buckets_.size());
  communicates_ = false;
  return t;
}

}  // namespace dstrain
