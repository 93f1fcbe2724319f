// Data-parallel gradient reduction. Gradients are grouped into buckets, contiguous ranges of
// the flat gradient buffer, in the order the backward finishes them (last layer first). With
// overlap, a bucket is all-reduced asynchronously as soon as its last gradient is final, while
// the backward continues; finish() waits for what is still in flight. Without overlap every
// bucket is reduced after the backward (the blocking mode to compare against). With gradient
// accumulation only the last micro-step communicates.
//
// Each parameter group is reduced over its own communicator (ParamGroupComms): dense
// parameters over every data-parallel rank, routed experts over the ranks holding the same
// experts. A bucket never mixes communicators: with expert parallelism a bucket holds one
// group; without, both groups share the data communicator and fill its buckets together,
// exactly as before groups existed. A communicator of one rank is not called at all.
//
// Gradients are summed over the group's ranks: each rank's backward is already scaled by
// 1 / (target tokens of the global batch), so the sum is the gradient of the global mean
// loss, the average of the ranks' contributions. (An expert's gradient already holds the
// tokens the expert-parallel all-to-all brought from the other ranks of its expert group.)
//
// Communication dtype (DeepSpeed's communication_data_type): with BF16 or F16 a bucket is cast
// to that dtype as it launches (half the bytes on the wire), summed in fp32 per addition and
// rounded to it (MpiCommunicator's 16-bit sum), and cast back into the fp32 gradients when
// finish() has it. A NaN or Inf on any rank reaches every rank's sum, as in fp32; so does a
// value beyond fp16's range, which becomes Inf (the loss scaler's overflow).
#pragma once

#include <vector>

#include "comm/comm.h"
#include "distributed/param_groups.h"
#include "model/ctx.h"
#include "model/transformer.h"
#include "state/params.h"

namespace dstrain {

struct ReduceTimings {
  double comm_seconds = 0;     // time the communicators spent in this step's reductions (summed)
  double exposed_seconds = 0;  // time the training thread waited for them
  int buckets = 0;             // buckets reduced
};

class GradReducer final : public ParamHooks {
 public:
  // bucket_elements: DeepSpeed's reduce_bucket_size (elements per bucket).
  GradReducer(ParamRegistry& params, const ParamGroupComms& comms, int64_t bucket_elements, bool overlap,
              DType comm_dtype = DType::F32);
  DType comm_dtype() const { return comm_dtype_; }

  // Call before each micro-step's backward; `communicates` is true for the last one.
  void begin_micro_step(bool communicates);
  // ParamHooks: the gradients of parameters first..last are final for this micro-step. With
  // overlap, buckets whose gradients are all final start reducing. Each parameter is reported
  // once per micro-step.
  void grad_ready(int first, int last) override;
  // grad_ready as the GradReadyFn the backward takes; empty when nothing needs to be done.
  GradReadyFn hook();
  // Completes the reduction of every bucket.
  ReduceTimings finish();

  // A contiguous range of gradients reduced by one collective.
  struct BucketInfo {
    int first = 0, last = 0;         // parameter ids, inclusive
    int64_t begin = 0, end = 0;      // flat element range
    Communicator* comm = nullptr;    // the communicator of every parameter's group in it
  };
  int num_buckets() const { return int(buckets_.size()); }
  // Bucket i; buckets are numbered in the order they are reduced (last parameters first).
  const BucketInfo& bucket(int i) const { return buckets_[size_t(i)].info; }
  const ParamGroupComms& comms() const { return comms_; }
  // Buckets handed to a communicator so far in this step (with overlap, during the backward).
  int launched() const { return launched_; }

 private:
  struct Bucket {
    BucketInfo info;
    int pending = 0;
    Work work;
  };
  void launch(Bucket& b);

  ParamRegistry& params_;
  ParamGroupComms comms_;
  bool overlap_;
  DType comm_dtype_;
  Buffer wire_;  // the gradients in comm_dtype_ while they are reduced (16-bit only)
  bool any_remote_ = false;    // some group's communicator has more than one rank
  bool communicates_ = false;
  size_t next_launch_ = 0;  // buckets start strictly in index order, the same on every rank
  int launched_ = 0;        // buckets handed to a communicator this step
  std::vector<CommStats> stats_before_;  // per comms_.distinct()
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // parameter id -> bucket
};

}  // namespace dstrain
