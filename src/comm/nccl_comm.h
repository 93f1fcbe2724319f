// NCCL communicators: the Communicator interface for GPU tensors, in every build. A CPU-only
// build (the default) answers "no NCCL" with the reason (comm/nccl_none.cpp); a build with
// -DDSTRAIN_CUDA=ON has the implementation (comm/nccl/nccl_comm.cpp).
//
// How an NCCL communicator runs its operations:
// - Each has its own communication stream. An operation is ordered after everything issued so
//   far on the compute stream (cuda::stream()) by an event, runs on the communication stream,
//   and completes at an event there. Work::wait() blocks the host until that event (within the
//   deadline below) and makes the compute stream wait on it, so later kernels see the result;
//   Work::test() asks whether it has completed. The buffers belong to the operation from issue
//   until wait() or a true test(): the caller must neither write them nor free them before.
// - Only GPU tensors on the communicator's device: host values go over the MPI communicators.
// - Operations run one after another on the communication stream, point-to-point ones (send,
//   recv) included, which match in issue order between two ranks (the tag is not used). So a
//   receive holds up everything issued after it on this communicator until its send arrives:
//   two ranks that both receive first deadlock, and so may two that both send large tensors
//   first (exchange with all_to_all_v, or let one send first and the other receive first).
//   Receives posted ahead and matched by tag, as the pipeline runner does over MPI, do not work
//   over NCCL; nor does a rank's send to itself.
// - A deadline for every operation, from its issue (the process watchdog's,
//   resilience.collective_timeout_s, unless given): an operation that has not completed by
//   then, or an asynchronous NCCL error, aborts the communicator (ncclCommAbort) and raises an
//   error naming the rank, the operation, its sequence number and the communicator; every later
//   use of the communicator raises it again.
// - Reductions: Sum, Max and Min of F32, F64, BF16, F16, I64, I32, U32 and U8 (each addition of
//   16-bit floats is rounded once to their type, as over MPI). Data movement takes any dtype.
// - stats(): operations, bytes and GPU time of the operations that have completed.
#pragma once

#include <memory>

#include "comm/comm.h"
#include "comm/mpi_comm.h"
#include "core/device.h"

namespace dstrain {

// Whether this build has NCCL communicators.
bool nccl_built();

// An NCCL communicator over the ranks of `over`, in the same rank order, named like it, on GPU
// `device` (the device of this rank's tensors). Collective over `over`: rank 0 makes the NCCL
// unique id, `over` broadcasts it, every rank joins with the device set. `deadline_seconds`: the
// deadline of each operation (and of the creation); 0 takes the process watchdog's at the time
// of each operation (Watchdog::instance().deadline()), as the MPI communicators do.
std::unique_ptr<Communicator> make_nccl_communicator(MpiCommunicator& over, Device device,
                                                     double deadline_seconds = 0);

}  // namespace dstrain
