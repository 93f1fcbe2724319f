// Data-parallel gradient reduction. Gradients are grouped into buckets, contiguous ranges of
// the flat gradient buffer, in the order the backward finishes them (last layer first). With
// overlap, a bucket is all-reduced asynchronously as soon as its last gradient is final, while
// the backward continues; finish() waits for what is still in flight. Without overlap every
// bucket is reduced after the backward (the blocking mode to compare against). With gradient
// accumulation only the last micro-step communicates.
//
// Gradients are summed over the data-parallel ranks: each rank's backward is already scaled
// by 1 / (target tokens of the global batch), so the sum is the gradient of the global mean
// loss, the average of the ranks' contributions.
#pragma once

#include <vector>

#include "comm/comm.h"
#include "state/params.h"
#include "model/transformer.h"

namespace dstrain {

struct ReduceTimings {
  double comm_seconds = 0;     // time the communicator spent in this step's reductions
  double exposed_seconds = 0;  // time the training thread waited for them
  int buckets = 0;
};

class GradReducer {
 public:
  // bucket_elements: DeepSpeed's reduce_bucket_size (elements per bucket).
  GradReducer(ParamRegistry& params, Communicator& dp, int64_t bucket_elements, bool overlap);

  // Call before each micro-step's backward; `communicates` is true for the last one.
  void begin_micro_step(bool communicates);
  // The hook the backward calls (GradReadyFn); empty when nothing needs to be done.
  GradReadyFn hook();
  // Completes the reduction of every bucket.
  ReduceTimings finish();

  int num_buckets() const { return int(buckets_.size()); }

 private:
  struct Bucket {
    int first = 0, last = 0;     // parameter ids
    int64_t begin = 0, end = 0;  // flat element range
    int pending = 0;
    Work work;
  };
  void on_ready(int first, int last);
  void launch(Bucket& b);

  ParamRegistry& params_;
  Communicator& dp_;
  bool overlap_;
  bool communicates_ = false;
  size_t next_launch_ = 0;  // buckets start strictly in index order, the same on every rank
  CommStats stats_before_;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // parameter id -> bucket
};

}  // namespace dstrain
