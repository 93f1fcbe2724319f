#include "distributed/routed_comm.h"

#include <mpi.h>

#include <mutex>
#if __has_include(<mpi-ext.h>)
#include <mpi-ext.h>  // Open MPI's extensions: MPIX_Query_cuda_support
#endif

#include "backend/cuda_device.h"
#include "backend/ops.h"
#include "comm/nccl_comm.h"
#include "core/error.h"

namespace dstrain {
namespace {

bool on_host(const Tensor& t) { return !t.defined() || t.device().is_cpu(); }

// A device tensor's host copy for an operation staged over MPI.
struct Staged {
  Tensor device, host;
  std::shared_ptr<std::vector<unsigned char>> bytes;
};

Staged stage(Tensor t, bool copy_in) {
  Staged s{t, {}, std::make_shared<std::vector<unsigned char>>(t.nbytes())};
  s.host = Tensor(s.bytes->data(), t.dtype(), t.shape());
  if (copy_in) ops::copy(s.host, t);
  return s;
}

// The operation's Work, extended: once the MPI operation is done, the staged outputs go back to
// the device (once, whoever waits or tests first); inputs stay alive until then.
Work finish(Work mpi, std::vector<Staged> keep, std::vector<Staged> outputs) {
  auto st = std::make_shared<WorkState>();
  if (mpi.state()) {
    st->op = mpi.state()->op;
    st->seq = mpi.state()->seq;
  }
  auto once = std::make_shared<std::once_flag>();
  auto done = [mpi, keep, outputs, once]() mutable {
    std::call_once(*once, [&] {
      mpi.wait();
      for (const Staged& o : outputs) ops::copy(o.device, o.host);
    });
  };
  st->wait_fn = done;
  st->test_fn = [mpi, done]() mutable {
    if (!mpi.test()) return false;
    done();
    return true;
  };
  return Work(st);
}

}  // namespace

bool mpi_cuda_aware() {
#if defined(MPIX_CUDA_AWARE_SUPPORT)
  return MPIX_Query_cuda_support() == 1;
#else
  return false;
#endif
}

RoutedCommunicator::RoutedCommunicator(Communicator& host, std::unique_ptr<Communicator> device,
                                       bool host_takes_device)
    : host_(host), device_(std::move(device)), host_takes_device_(host_takes_device) {
  if (device_) {
    DS_CHECK(device_->size() == host_.size() && device_->rank() == host_.rank(),
             "communicator '{}': the device communicator has rank {} of {}, the MPI one {} of {}", host_.name(),
             device_->rank(), device_->size(), host_.rank(), host_.size());
  }
}

std::string RoutedCommunicator::device_transport() const {
  if (device_) return device_->name();
  return host_takes_device_ ? "mpi (CUDA-aware: device memory for point-to-point)" : "mpi (staged through host memory)";
}

void RoutedCommunicator::set_in_order_channels(Channels channels, std::string transport) {
  for (const auto& c : channels) {
    DS_CHECK(c && c->size() == host_.size() && c->rank() == host_.rank(),
             "communicator '{}': each of the {} in-order channels must span its ranks in the same order", host_.name(),
             InOrderChannels::kCount);
  }
  in_order_ = std::move(channels);
  in_order_transport_ = std::move(transport);
}

InOrderChannels RoutedCommunicator::in_order_channels() const {
  InOrderChannels out;
  if (!in_order_[0]) return out;
  for (size_t i = 0; i < in_order_.size(); ++i) out.channel[i] = in_order_[i].get();
  out.transport = in_order_transport_;
  return out;
}

InOrderChannels in_order_channels(Communicator& c) {
  auto* routed = dynamic_cast<RoutedCommunicator*>(&c);
  return routed ? routed->in_order_channels() : InOrderChannels{};
}

#define DS_ROUTE(host_call, device_call)          \
  if (all_host) return host_.host_call;           \
  if (device_) return device_->device_call;

Work RoutedCommunicator::all_reduce_async(Tensor t, ReduceOp op) {
  const bool all_host = on_host(t);
  DS_ROUTE(all_reduce_async(t, op), all_reduce_async(t, op))
  Staged s = stage(t, true);
  return finish(host_.all_reduce_async(s.host, op), {}, {s});
}

Work RoutedCommunicator::all_gather_async(Tensor out, Tensor in) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(all_gather_async(out, in), all_gather_async(out, in))
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.all_gather_async(o.host, i.host), {i}, {o});
}

Work RoutedCommunicator::reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(reduce_scatter_async(out, in, op), reduce_scatter_async(out, in, op))
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.reduce_scatter_async(o.host, i.host, op), {i}, {o});
}

Work RoutedCommunicator::all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(all_gather_v_async(out, in, counts), all_gather_v_async(out, in, counts))
  // `in` may be this rank's own piece of `out`: the staged copies are separate memory.
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.all_gather_v_async(o.host, i.host, counts), {i}, {o});
}

Work RoutedCommunicator::reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts,
                                                ReduceOp op) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(reduce_scatter_v_async(out, in, counts, op), reduce_scatter_v_async(out, in, counts, op))
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.reduce_scatter_v_async(o.host, i.host, counts, op), {i}, {o});
}

Work RoutedCommunicator::broadcast_async(Tensor t, int root) {
  const bool all_host = on_host(t);
  DS_ROUTE(broadcast_async(t, root), broadcast_async(t, root))
  Staged s = stage(t, host_.rank() == root);
  return finish(host_.broadcast_async(s.host, root), {}, {s});
}

Work RoutedCommunicator::all_to_all_async(Tensor out, Tensor in) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(all_to_all_async(out, in), all_to_all_async(out, in))
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.all_to_all_async(o.host, i.host), {i}, {o});
}

Work RoutedCommunicator::all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                                            const std::vector<int64_t>& in_counts) {
  const bool all_host = on_host(out) && on_host(in);
  DS_ROUTE(all_to_all_v_async(out, out_counts, in, in_counts), all_to_all_v_async(out, out_counts, in, in_counts))
  Staged i = stage(in, true), o = stage(out, false);
  return finish(host_.all_to_all_v_async(o.host, out_counts, i.host, in_counts), {i}, {o});
}

Work RoutedCommunicator::send_async(Tensor t, int peer, int tag) {
  const bool all_host = on_host(t);
  DS_ROUTE(send_async(t, peer, tag), send_async(t, peer, tag))
  if (host_takes_device_) {
    // MPI reads the device memory itself, outside the device's streams: the kernels that write
    // it must have finished.
    cuda::synchronize();
    return host_.send_async(t, peer, tag);
  }
  Staged s = stage(t, true);
  return finish(host_.send_async(s.host, peer, tag), {s}, {});
}

Work RoutedCommunicator::recv_async(Tensor t, int peer, int tag) {
  const bool all_host = on_host(t);
  DS_ROUTE(recv_async(t, peer, tag), recv_async(t, peer, tag))
  if (host_takes_device_) {
    // Kernels issued before may still read the buffer MPI is about to write; the kernels after
    // the wait are issued once the data is there.
    cuda::synchronize();
    return host_.recv_async(t, peer, tag);
  }
  Staged s = stage(t, false);
  return finish(host_.recv_async(s.host, peer, tag), {}, {s});
}

#undef DS_ROUTE

Work RoutedCommunicator::barrier_async() { return host_.barrier_async(); }

CommStats RoutedCommunicator::stats() const {
  CommStats s = host_.stats();
  if (device_) {
    const CommStats d = device_->stats();
    s.ops += d.ops;
    s.busy_seconds += d.busy_seconds;
    s.bytes += d.bytes;
  }
  return s;
}

}  // namespace dstrain

namespace dstrain {

ProcessGrid& use_device_communicators(ProcessGrid& grid, Device device) {
  if (device.is_cpu()) return grid;
  const bool nccl = device.type == DeviceType::CUDA && nccl_built();
  const bool cuda_aware = device.type == DeviceType::CUDA && mpi_cuda_aware();
  grid.wrap_communicators(device.str(), [=](MpiCommunicator& mpi) -> std::unique_ptr<Communicator> {
    if (mpi.name() != axis_name(Axis::Pipeline)) {
      std::unique_ptr<Communicator> direct;
      if (nccl) direct = make_nccl_communicator(mpi, device);
      return std::make_unique<RoutedCommunicator>(mpi, std::move(direct));
    }
    // The pipeline runner's tagged messages (receives posted ahead, the tied weights' exchange)
    // stay on MPI, which NCCL cannot replace (comm/nccl_comm.h); its in-order transport runs
    // over NCCL communicators of the same ranks, one per kind of message and link, so that no
    // message waits for its peer on a stream behind one going the other way.
    auto routed = std::make_unique<RoutedCommunicator>(mpi, nullptr, cuda_aware);
    if (nccl && mpi.size() > 1) {
      RoutedCommunicator::Channels channels;
      for (auto& c : channels) c = make_nccl_communicator(mpi, device);
      routed->set_in_order_channels(std::move(channels), "nccl");
    }
    return routed;
  });
  return grid;
}

}  // namespace dstrain
