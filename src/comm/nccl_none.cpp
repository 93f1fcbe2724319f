// comm/nccl_comm.h in a CPU-only build (the default): no NCCL, and why.
#include "comm/nccl_comm.h"

#include "core/error.h"

namespace dstrain {

bool nccl_built() { return false; }

std::unique_ptr<Communicator> make_nccl_communicator(MpiCommunicator& over, Device device, double) {
  DS_FAIL("cannot make an NCCL communicator over '{}' on {}: this build has no NCCL (configure with -DDSTRAIN_CUDA=ON)",
          over.name(), device.str());
}

}  // namespace dstrain
