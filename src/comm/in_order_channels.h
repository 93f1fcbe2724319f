// Communicators for a pipeline's in-order transport (train/pipeline.h), over the pipeline ranks
// in the same order, whose sends and receives match in issue order (NCCL's rule; MPI's too with
// one tag per channel). One per kind of message and link, so that no message waits behind
// another on one stream: activations going down the ranks (to a higher rank), activations going
// up, gradients going down, gradients going up. Why four: the pipeline runner's simulation shows
// that with two, one per direction, the interleaved ring and DualPipeV's two-way traffic
// deadlock under rendezvous.
#pragma once

#include <array>
#include <string>

#include "comm/comm.h"

namespace dstrain {

struct InOrderChannels {
  static constexpr int kCount = 4;
  // [2 * gradient + up]: see in_order_channel (train/pipeline.h). Entries may share a
  // communicator where messages keep their channel's tag (MPI).
  std::array<Communicator*, kCount> channel{};
  std::string transport;  // names them in the log: "nccl", "mpi"
  bool present() const {
    for (Communicator* c : channel) {
      if (!c) return false;
    }
    return true;
  }
  bool any() const {
    for (Communicator* c : channel) {
      if (c) return true;
    }
    return false;
  }
};

}  // namespace dstrain
