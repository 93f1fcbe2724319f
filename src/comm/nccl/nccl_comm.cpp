// The NCCL communicator (comm/nccl_comm.h), CUDA builds only. One NcclCore per communicator
// owns the NCCL communicator, its communication stream and the bookkeeping of issued
// operations; every Work shares it, so a Work may outlive its communicator. NCCL calls on one
// communicator are not thread-safe: they run under the core's mutex. The communicator is
// non-blocking (ncclConfig_t::blocking = 0): NCCL calls return at once, possibly "in
// progress", and this file polls them with the deadline, so a missing rank never hangs the
// host where the deadline cannot end it.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include "comm/nccl_comm.h"
#include "comm/watchdog.h"
#include "core/cuda/runtime.h"
#include "core/error.h"
#include "core/log.h"

namespace dstrain {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

const char* base_name(const char* file) {
  const char* slash = std::strrchr(file, '/');
  return slash ? slash + 1 : file;
}

// Makes `device` current for a scope and restores the caller's: streams, events and NCCL
// calls belong to one GPU, and the caller's thread may have another current.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    DS_CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != device) DS_CUDA_CHECK(cudaSetDevice(device));
    changed_ = saved_ != device;
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool changed_ = false;
};

class Event {
 public:
  explicit Event(bool timing) {
    DS_CUDA_CHECK(cudaEventCreateWithFlags(&event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (event_) (void)cudaEventDestroy(event_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

// Whether `e` has been reached: true, false (not yet), or an error.
bool reached(cudaEvent_t e) {
  const cudaError_t q = cudaEventQuery(e);
  if (q == cudaSuccess) return true;
  if (q == cudaErrorNotReady) {
    (void)cudaGetLastError();  // "not ready" is an answer, not an error for the next launch check
    return false;
  }
  cuda::fail(q, "cudaEventQuery", __FILE__, __LINE__);
}

// An operation's launch on the communication stream: its GPU time and what it moved, counted
// in stats() once it has completed.
struct Span {
  Event start{true}, done{true};
  double bytes = 0;
};

// One issued operation, behind one Work.
struct Op {
  std::string name;  // "all_reduce", "send to rank 3"
  uint64_t seq = 0;
  Clock::time_point issued;
  std::shared_ptr<Span> span;  // its launch
  bool complete = false;       // observed complete by wait() or test()
  std::exception_ptr error;    // raised again by every later wait() or test()
};

// How a dtype goes over the wire: an NCCL type and elements of it per tensor element. Types
// NCCL has no name for (U16) move as bytes; they cannot be reduced.
struct Wire {
  ncclDataType_t type;
  size_t scale;
  bool reducible;
};

Wire wire(DType t) {
  switch (t) {
    case DType::F32: return {ncclFloat32, 1, true};
    case DType::BF16: return {ncclBfloat16, 1, true};
    case DType::F16: return {ncclFloat16, 1, true};
    case DType::F64: return {ncclFloat64, 1, true};
    case DType::I64: return {ncclInt64, 1, true};
    case DType::I32: return {ncclInt32, 1, true};
    case DType::U32: return {ncclUint32, 1, true};
    case DType::U8: return {ncclUint8, 1, true};
    case DType::U16: return {ncclUint8, 2, false};
    case DType::F8_E4M3: return {ncclUint8, 1, false};
  }
  DS_FAIL("no NCCL datatype for {}", dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum: return ncclSum;
    case ReduceOp::Max: return ncclMax;
    case ReduceOp::Min: return ncclMin;
  }
  return ncclSum;
}

// Element offsets of pieces of `counts` elements laid end to end (the checks and messages of
// the MPI communicator's).
std::vector<int64_t> displacements(const std::vector<int64_t>& counts, int size, int64_t total,
                                   const std::string& comm, const char* op) {
  DS_CHECK(int(counts.size()) == size, "{} on '{}': {} counts for {} ranks", op, comm, counts.size(), size);
  std::vector<int64_t> d(counts.size());
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    DS_CHECK(counts[i] >= 0, "{} on '{}': negative count {} for rank {}", op, comm, counts[i], i);
    d[i] = off;
    off += counts[i];
  }
  DS_CHECK(off == total, "{} on '{}': the counts add up to {} but the tensor holds {}", op, comm, off, total);
  return d;
}

bool all_equal(const std::vector<int64_t>& v) {
  return std::all_of(v.begin(), v.end(), [&](int64_t x) { return x == v.front(); });
}

// Element `i` of a tensor, as NCCL takes buffers.
char* at(const Tensor& t, int64_t i) { return static_cast<char*>(t.raw()) + size_t(i) * dtype_size(t.dtype()); }

class NcclCore;

// Checks the result of an NCCL call on a communicator: an error (or a call still in progress
// past the deadline) aborts the communicator and raises an error naming the call, the
// operation, the communicator, the rank, the file and the line.
#define DS_NCCL_CHECK(core, op, call) (core).check_locked((call), #call, __FILE__, __LINE__, (op))

class NcclCore : public std::enable_shared_from_this<NcclCore> {
 public:
  NcclCore(std::string name, int rank, int size, int device, double deadline_seconds)
      : name_(std::move(name)), rank_(rank), size_(size), device_(device), deadline_s_(deadline_seconds) {
    DeviceGuard dev(device_);
    int least = 0, greatest = 0;
    DS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    // High priority: communication overlapping compute gets its few SMs first.
    DS_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, greatest));
    ready_ = std::make_unique<Event>(false);
    DS_CUDA_CHECK(cudaMalloc(&scratch_, sizeof(float)));
    DS_CUDA_CHECK(cudaMemset(scratch_, 0, sizeof(float)));
  }

  ~NcclCore() {
    try {
      DeviceGuard dev(device_);
      spans_.clear();
      ready_.reset();
      if (scratch_) (void)cudaFree(scratch_);
      if (stream_) (void)cudaStreamDestroy(stream_);
    } catch (...) {
      // Process teardown: the CUDA runtime may be gone already.
    }
  }

  NcclCore(const NcclCore&) = delete;
  NcclCore& operator=(const NcclCore&) = delete;

  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  int device() const { return device_; }
  ncclComm_t comm() const { return comm_; }
  cudaStream_t stream() const { return stream_; }
  void* scratch() const { return scratch_; }

  // Joins the NCCL communicator (every rank of it, collectively).
  void init(const ncclUniqueId& id) {
    std::lock_guard lock(mutex_);
    DeviceGuard dev(device_);
    Op op;
    op.name = "creation (ncclCommInitRankConfig)";
    op.issued = Clock::now();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    config.commName = name_.c_str();
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, size_, id, rank_, &config);
    comm_ = c;  // also while in progress: polled and, past the deadline, aborted
    check_locked(r, "ncclCommInitRankConfig", __FILE__, __LINE__, op);
  }

  // Waits for the communicator's operations within the deadline and frees it
  // (ncclCommFinalize, ncclCommDestroy). Errors are reported, not raised: this runs in a
  // destructor.
  void close() noexcept {
    std::lock_guard lock(mutex_);
    try {
      DeviceGuard dev(device_);
      if (comm_ && !aborted_) {
        Op op;
        op.name = "close (ncclCommFinalize)";
        op.issued = Clock::now();
        DS_NCCL_CHECK(*this, op, ncclCommFinalize(comm_));
        const ncclResult_t r = ncclCommDestroy(comm_);  // frees in the background when in progress
        comm_ = nullptr;
        if (r != ncclSuccess && r != ncclInProgress) {
          log::warn("NCCL communicator '{}': ncclCommDestroy: {}", name_, ncclGetErrorString(r));
        }
      }
    } catch (const std::exception& e) {
      log::warn_line(fmt::format("closing NCCL communicator '{}': {}", name_, e.what()));
    }
    comm_ = nullptr;
    closed_ = true;
  }

  // An operation: ordered after the compute stream, launched by `body` (NCCL calls through
  // DS_NCCL_CHECK or a Group) on the communication stream.
  Work issue(const std::string& name, double bytes, const std::function<void(NcclCore&, const Op&)>& body) {
    std::lock_guard lock(mutex_);
    DeviceGuard dev(device_);
    throw_if_unusable_locked(name);
    auto op = new_op_locked(name);
    auto span = std::make_shared<Span>();
    span->bytes = bytes;
    DS_CUDA_CHECK(cudaEventRecord(ready_->get(), cuda::stream()));
    DS_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_->get(), 0));
    DS_CUDA_CHECK(cudaEventRecord(span->start.get(), stream_));
    body(*this, *op);
    DS_CUDA_CHECK(cudaEventRecord(span->done.get(), stream_));
    op->span = span;
    spans_.push_back(std::move(span));
    sweep_locked();
    return make_work(op);
  }

  void wait(Op& op) {
    std::shared_ptr<Span> span;
    {
      std::lock_guard lock(mutex_);
      if (op.error) std::rethrow_exception(op.error);
      if (op.complete) return;
      span = op.span;
    }
    try {
      DeviceGuard dev(device_);
      await(op, span->done.get());
      // Later kernels of the compute stream see the result (the host has seen it already).
      DS_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(), span->done.get(), 0));
    } catch (...) {
      std::lock_guard lock(mutex_);
      op.error = std::current_exception();
      throw;
    }
    std::lock_guard lock(mutex_);
    op.complete = true;
  }

  bool test(Op& op) {
    std::lock_guard lock(mutex_);
    if (op.error) std::rethrow_exception(op.error);
    if (op.complete) return true;
    try {
      DeviceGuard dev(device_);
      if (reached(op.span->done.get())) {
        throw_if_aborted_locked(op.name);
        DS_CUDA_CHECK(cudaStreamWaitEvent(cuda::stream(), op.span->done.get(), 0));
        op.complete = true;
        return true;
      }
      check_health_locked(op);
      return false;
    } catch (...) {
      op.error = std::current_exception();
      throw;
    }
  }

  CommStats stats() {
    std::lock_guard lock(mutex_);
    try {
      DeviceGuard dev(device_);
      sweep_locked();
    } catch (const std::exception&) {
      // Counters are best effort; the operations themselves report errors.
    }
    return stats_;
  }

  // The result of an NCCL call of operation `op` (the mutex held).
  void check_locked(ncclResult_t r, const char* call, const char* file, int line, const Op& op) {
    if (r == ncclInProgress) r = settle_locked(op);
    if (r == ncclSuccess) return;
    const char* last = comm_ ? ncclGetLastError(comm_) : nullptr;
    abort_locked(fmt::format("{} failed in {} #{} on NCCL communicator '{}' ({}): {}{}{}\n  (at {}:{}; run with "
                             "NCCL_DEBUG=WARN for NCCL's account)",
                             call, op.name, op.seq, name_, who(), ncclGetErrorString(r), last && *last ? ": " : "",
                             last ? last : "", base_name(file), line));
  }

 private:
  std::string who() const { return fmt::format("rank {} of {}, world rank {}", rank_, size_, log::rank()); }

  double deadline() const { return deadline_s_ > 0 ? deadline_s_ : Watchdog::instance().deadline(); }

  std::shared_ptr<Op> new_op_locked(std::string name) {
    auto op = std::make_shared<Op>();
    op->name = std::move(name);
    op->seq = next_seq_++;
    op->issued = Clock::now();
    return op;
  }

  Work make_work(const std::shared_ptr<Op>& op) {
    auto state = std::make_shared<WorkState>();
    state->op = op->name;
    state->seq = op->seq;
    state->issued = state->started = op->issued;
    std::shared_ptr<NcclCore> self = shared_from_this();
    state->wait_fn = [self, op] { self->wait(*op); };
    state->test_fn = [self, op] { return self->test(*op); };
    return Work(state);
  }

 public:
  // The NCCL calls of one group. Errors of the calls inside are kept until ncclGroupEnd, which
  // runs whatever happened: an open group would take in the next operation.
  class Group {
   public:
    Group(NcclCore& core, const Op& op) : core_(core), op_(op) { DS_NCCL_CHECK(core_, op_, ncclGroupStart()); }
    ~Group() {
      if (open_) (void)ncclGroupEnd();
    }
    Group(const Group&) = delete;
    Group& operator=(const Group&) = delete;
    void operator()(ncclResult_t r, const char* call, int line) {
      if (r != ncclSuccess && r != ncclInProgress && failed_ == ncclSuccess) {
        failed_ = r;
        call_ = call;
        line_ = line;
      }
    }
    void end() {
      open_ = false;
      const ncclResult_t r = ncclGroupEnd();
      if (failed_ != ncclSuccess) core_.check_locked(failed_, call_, __FILE__, line_, op_);
      core_.check_locked(r, "ncclGroupEnd()", __FILE__, __LINE__, op_);
    }

   private:
    NcclCore& core_;
    const Op& op_;
    bool open_ = true;
    ncclResult_t failed_ = ncclSuccess;
    const char* call_ = "";
    int line_ = 0;
  };

 private:
  // Polls a call that returned "in progress" until it settles, within the deadline.
  ncclResult_t settle_locked(const Op& op) {
    const double limit = deadline();
    for (int spin = 0;; ++spin) {
      if (!comm_) return ncclInternalError;
      ncclResult_t state = ncclInProgress;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
      if (q != ncclSuccess) return q;
      if (state != ncclInProgress) return state;
      const double elapsed = seconds_between(op.issued, Clock::now());
      if (elapsed > limit) abort_locked(timeout_message(op, elapsed, limit));
      if (spin < 1000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  // Blocks until `done`: checks the communicator's health and the deadline every millisecond.
  void await(const Op& op, cudaEvent_t done) {
    auto next_check = Clock::now();
    for (int spin = 0;; ++spin) {
      if (reached(done)) break;
      const auto now = Clock::now();
      if (now >= next_check) {
        std::lock_guard lock(mutex_);
        check_health_locked(op);
        next_check = now + std::chrono::milliseconds(1);
      }
      if (spin < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    std::lock_guard lock(mutex_);
    throw_if_aborted_locked(op.name);  // an abort also ends the kernels, with results unfinished
  }

  // Raises the error of an aborted communicator, an asynchronous NCCL error or a missed
  // deadline of `op` (aborting the communicator for the last two).
  void check_health_locked(const Op& op) {
    throw_if_aborted_locked(op.name);
    if (comm_) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t q = ncclCommGetAsyncError(comm_, &state);
      if (q != ncclSuccess) state = q;
      if (state != ncclSuccess && state != ncclInProgress) {
        const char* last = ncclGetLastError(comm_);
        abort_locked(fmt::format("{} #{} on NCCL communicator '{}' ({}) failed: {}{}{} (another rank may have "
                                 "failed; run with NCCL_DEBUG=WARN for NCCL's account)",
                                 op.name, op.seq, name_, who(), ncclGetErrorString(state), last && *last ? ": " : "",
                                 last ? last : ""));
      }
    }
    const double elapsed = seconds_between(op.issued, Clock::now());
    const double limit = deadline();
    if (elapsed > limit) abort_locked(timeout_message(op, elapsed, limit));
  }

  std::string timeout_message(const Op& op, double elapsed, double limit) const {
    return fmt::format(
        "watchdog: {} #{} on NCCL communicator '{}' ({}) has run for {:.1f} s, past its deadline of {:.0f} s. Another "
        "rank is not taking part (it crashed, hung or runs something else); the communicator is aborted. Raise "
        "resilience.collective_timeout_s if this operation is legitimately slow.",
        op.name, op.seq, name_, who(), elapsed, limit);
  }

  [[noreturn]] void abort_locked(const std::string& message) {
    if (!aborted_) {
      aborted_ = true;
      abort_message_ = message;
      if (comm_) (void)ncclCommAbort(comm_);  // the kernels quit; the handle is gone
      comm_ = nullptr;
    }
    throw Error(message);
  }

  void throw_if_aborted_locked(const std::string& op) const {
    if (aborted_) {
      throw Error(fmt::format("{} on NCCL communicator '{}' ({}): the communicator was aborted earlier: {}", op, name_,
                              who(), abort_message_));
    }
  }

  void throw_if_unusable_locked(const std::string& op) const {
    throw_if_aborted_locked(op);
    DS_CHECK(!closed_, "{} on NCCL communicator '{}': the communicator is closed", op, name_);
  }

  // Counts the launches that have completed, in order (the stream runs them in order).
  void sweep_locked() {
    while (!spans_.empty()) {
      const cudaError_t q = cudaEventQuery(spans_.front()->done.get());
      if (q != cudaSuccess) {
        (void)cudaGetLastError();  // not yet (or a failure, which the operation's wait reports)
        return;
      }
      const Span& s = *spans_.front();
      float ms = 0;
      if (cudaEventElapsedTime(&ms, s.start.get(), s.done.get()) == cudaSuccess) stats_.busy_seconds += ms / 1e3;
      stats_.ops += 1;
      stats_.bytes += s.bytes;
      spans_.pop_front();
    }
  }

  const std::string name_;
  const int rank_, size_, device_;
  const double deadline_s_;  // 0: the watchdog's

  std::mutex mutex_;  // everything below, and every NCCL call on comm_
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<Event> ready_;  // the compute stream at an operation's issue
  void* scratch_ = nullptr;       // one float: the barrier's all-reduce
  bool aborted_ = false, closed_ = false;
  std::string abort_message_;
  uint64_t next_seq_ = 0;
  std::deque<std::shared_ptr<Span>> spans_;  // launched, not yet counted
  CommStats stats_;
};

class NcclCommunicator final : public Communicator {
 public:
  explicit NcclCommunicator(std::shared_ptr<NcclCore> core) : core_(std::move(core)) {}
  ~NcclCommunicator() override { core_->close(); }

  int rank() const override { return core_->rank(); }
  int size() const override { return core_->size(); }
  std::string name() const override { return core_->name(); }
  CommStats stats() const override { return core_->stats(); }

  Work all_reduce_async(Tensor t, ReduceOp op) override {
    const Wire w = reducible(t, "all_reduce");
    return core_->issue("all_reduce", double(t.nbytes()), [=](NcclCore& c, const Op& o) {
      if (t.numel() == 0) return;
      DS_NCCL_CHECK(c, o,
                    ncclAllReduce(t.raw(), t.raw(), size_t(t.numel()), w.type, nccl_op(op), c.comm(), c.stream()));
    });
  }

  Work all_gather_async(Tensor out, Tensor in) override {
    on_gpu(out, "all_gather", "out");
    on_gpu(in, "all_gather", "in");
    DS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() * size(),
             "all_gather on '{}': out holds {} elements of {}, expected {} x {} of {}", name(), out.numel(),
             dtype_name(out.dtype()), size(), in.numel(), dtype_name(in.dtype()));
    const Wire w = wire(in.dtype());
    return core_->issue("all_gather", double(out.nbytes()), [=](NcclCore& c, const Op& o) {
      const size_t n = size_t(in.numel()) * w.scale;
      if (n == 0) return;
      DS_NCCL_CHECK(c, o, ncclAllGather(in.raw(), out.raw(), n, w.type, c.comm(), c.stream()));
    });
  }

  Work reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) override {
    const Wire w = reducible(in, "reduce_scatter", "in");
    on_gpu(out, "reduce_scatter", "out");
    DS_CHECK(out.dtype() == in.dtype() && in.numel() == out.numel() * size(),
             "reduce_scatter on '{}': in holds {} elements, expected {} x {}", name(), in.numel(), size(), out.numel());
    return core_->issue("reduce_scatter", double(in.nbytes()), [=](NcclCore& c, const Op& o) {
      if (out.numel() == 0) return;
      DS_NCCL_CHECK(c, o, ncclReduceScatter(in.raw(), out.raw(), size_t(out.numel()), w.type, nccl_op(op), c.comm(),
                                            c.stream()));
    });
  }

  // Equal pieces: one all-gather; otherwise one broadcast per rank's piece, in one group.
  Work all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) override {
    on_gpu(out, "all_gather_v", "out");
    on_gpu(in, "all_gather_v", "in");
    const std::vector<int64_t> d = displacements(counts, size(), out.numel(), name(), "all_gather_v");
    const int me = rank();
    DS_CHECK(out.dtype() == in.dtype() && in.numel() == counts[size_t(me)],
             "all_gather_v on '{}': this rank sends {} elements of {}, its count is {} of {}", name(), in.numel(),
             dtype_name(in.dtype()), counts[size_t(me)], dtype_name(out.dtype()));
    const Wire w = wire(in.dtype());
    return core_->issue("all_gather_v", double(out.nbytes()), [=](NcclCore& c, const Op& o) {
      if (all_equal(counts)) {
        if (counts[0] == 0) return;
        DS_NCCL_CHECK(c, o, ncclAllGather(in.raw(), out.raw(), size_t(counts[0]) * w.scale, w.type, c.comm(),
                                          c.stream()));
        return;
      }
      NcclCore::Group group(c, o);
      for (int r = 0; r < int(counts.size()); ++r) {
        if (counts[size_t(r)] == 0) continue;
        char* piece = at(out, d[size_t(r)]);
        const void* send = r == me ? in.raw() : piece;  // in place when `in` is this rank's piece of out
        group(ncclBroadcast(send, piece, size_t(counts[size_t(r)]) * w.scale, w.type, r, c.comm(), c.stream()),
              "ncclBroadcast", __LINE__);
      }
      group.end();
    });
  }

  // Equal pieces: one reduce-scatter; otherwise one reduce to each rank of its piece, in one group.
  Work reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts, ReduceOp op) override {
    const Wire w = reducible(in, "reduce_scatter_v", "in");
    on_gpu(out, "reduce_scatter_v", "out");
    const std::vector<int64_t> d = displacements(counts, size(), in.numel(), name(), "reduce_scatter_v");
    const int me = rank();
    DS_CHECK(out.dtype() == in.dtype() && out.numel() == counts[size_t(me)],
             "reduce_scatter_v on '{}': out holds {} elements, this rank's count is {}", name(), out.numel(),
             counts[size_t(me)]);
    return core_->issue("reduce_scatter_v", double(in.nbytes()), [=](NcclCore& c, const Op& o) {
      if (all_equal(counts)) {
        if (counts[0] == 0) return;
        DS_NCCL_CHECK(c, o, ncclReduceScatter(in.raw(), out.raw(), size_t(counts[0]), w.type, nccl_op(op), c.comm(),
                                              c.stream()));
        return;
      }
      NcclCore::Group group(c, o);
      for (int r = 0; r < int(counts.size()); ++r) {
        if (counts[size_t(r)] == 0) continue;
        const char* piece = at(in, d[size_t(r)]);
        // Only the root's receive buffer is written; the others pass their piece, unused.
        void* recv = r == me ? out.raw() : const_cast<char*>(piece);
        group(ncclReduce(piece, recv, size_t(counts[size_t(r)]), w.type, nccl_op(op), r, c.comm(), c.stream()),
              "ncclReduce", __LINE__);
      }
      group.end();
    });
  }

  Work broadcast_async(Tensor t, int root) override {
    on_gpu(t, "broadcast", "the tensor");
    DS_CHECK(root >= 0 && root < size(), "broadcast on '{}': root {} outside [0, {})", name(), root, size());
    const Wire w = wire(t.dtype());
    return core_->issue("broadcast", double(t.nbytes()), [=](NcclCore& c, const Op& o) {
      const size_t n = size_t(t.numel()) * w.scale;
      if (n == 0) return;
      DS_NCCL_CHECK(c, o, ncclBroadcast(t.raw(), t.raw(), n, w.type, root, c.comm(), c.stream()));
    });
  }

  Work all_to_all_async(Tensor out, Tensor in) override {
    on_gpu(out, "all_to_all", "out");
    on_gpu(in, "all_to_all", "in");
    DS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() && in.numel() % size() == 0,
             "all_to_all on '{}': in ({}) and out ({}) must hold the same multiple of {} elements", name(), in.numel(),
             out.numel(), size());
    const Wire w = wire(in.dtype());
    return core_->issue("all_to_all", double(in.nbytes()), [=](NcclCore& c, const Op& o) {
      const int64_t n = in.numel() / c.size();
      if (n == 0) return;
      NcclCore::Group group(c, o);
      for (int j = 0; j < c.size(); ++j) {
        group(ncclSend(at(in, j * n), size_t(n) * w.scale, w.type, j, c.comm(), c.stream()), "ncclSend", __LINE__);
        group(ncclRecv(at(out, j * n), size_t(n) * w.scale, w.type, j, c.comm(), c.stream()), "ncclRecv", __LINE__);
      }
      group.end();
    });
  }

  Work all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                          const std::vector<int64_t>& in_counts) override {
    on_gpu(out, "all_to_all_v", "out");
    on_gpu(in, "all_to_all_v", "in");
    DS_CHECK(int(out_counts.size()) == size() && int(in_counts.size()) == size() && out.dtype() == in.dtype(),
             "all_to_all_v on '{}': {} ranks need {} counts each way", name(), size(), size());
    auto offsets = [](const std::vector<int64_t>& counts, int64_t total, const char* what) {
      std::vector<int64_t> d(counts.size());
      int64_t off = 0;
      for (size_t i = 0; i < counts.size(); ++i) {
        DS_CHECK(counts[i] >= 0, "all_to_all_v: negative {} count", what);
        d[i] = off;
        off += counts[i];
      }
      DS_CHECK(off <= total, "all_to_all_v: {} counts add up to {} but the tensor holds {}", what, off, total);
      return d;
    };
    const std::vector<int64_t> sd = offsets(in_counts, in.numel(), "send");
    const std::vector<int64_t> rd = offsets(out_counts, out.numel(), "receive");
    const Wire w = wire(in.dtype());
    return core_->issue("all_to_all_v", double(in.nbytes()), [=](NcclCore& c, const Op& o) {
      NcclCore::Group group(c, o);
      for (int j = 0; j < c.size(); ++j) {
        const size_t send = size_t(in_counts[size_t(j)]), recv = size_t(out_counts[size_t(j)]);
        if (send > 0) {
          group(ncclSend(at(in, sd[size_t(j)]), send * w.scale, w.type, j, c.comm(), c.stream()), "ncclSend",
                __LINE__);
        }
        if (recv > 0) {
          group(ncclRecv(at(out, rd[size_t(j)]), recv * w.scale, w.type, j, c.comm(), c.stream()), "ncclRecv",
                __LINE__);
        }
      }
      group.end();
    });
  }

  Work send_async(Tensor t, int peer, int) override {
    on_gpu(t, "send", "the tensor");
    DS_CHECK(peer >= 0 && peer < size(), "send on '{}': peer {} outside [0, {})", name(), peer, size());
    // NCCL pairs a rank's send to itself with its receive only inside one group: alone, it waits forever.
    DS_CHECK(peer != rank(), "send on '{}': rank {} sends to itself, which an NCCL communicator cannot do; "
             "copy the tensor instead", name(), peer);
    const Wire w = wire(t.dtype());
    return core_->issue(fmt::format("send to rank {}", peer), double(t.nbytes()), [=](NcclCore& c, const Op& o) {
      const size_t n = size_t(t.numel()) * w.scale;
      if (n == 0) return;  // the peer's receive is empty too
      DS_NCCL_CHECK(c, o, ncclSend(t.raw(), n, w.type, peer, c.comm(), c.stream()));
    });
  }

  Work recv_async(Tensor t, int peer, int) override {
    on_gpu(t, "recv", "the tensor");
    DS_CHECK(peer >= 0 && peer < size(), "recv on '{}': peer {} outside [0, {})", name(), peer, size());
    // NCCL pairs a rank's send to itself with its receive only inside one group: alone, it waits forever.
    DS_CHECK(peer != rank(), "recv on '{}': rank {} receives from itself, which an NCCL communicator cannot do; "
             "copy the tensor instead", name(), peer);
    const Wire w = wire(t.dtype());
    return core_->issue(fmt::format("recv from rank {}", peer), double(t.nbytes()), [=](NcclCore& c, const Op& o) {
      const size_t n = size_t(t.numel()) * w.scale;
      if (n == 0) return;
      DS_NCCL_CHECK(c, o, ncclRecv(t.raw(), n, w.type, peer, c.comm(), c.stream()));
    });
  }

  Work barrier_async() override {
    return core_->issue("barrier", 0, [](NcclCore& c, const Op& o) {
      DS_NCCL_CHECK(c, o, ncclAllReduce(c.scratch(), c.scratch(), 1, ncclFloat32, ncclSum, c.comm(), c.stream()));
    });
  }

 private:
  void on_gpu(const Tensor& t, const char* op, const char* what) const {
    DS_CHECK(t.device().type == DeviceType::CUDA,
             "{} on '{}': NCCL communicators take GPU tensors; {} is on {} (send host tensors over MPI)",
             op, name(), what, t.device().str());
    DS_CHECK(t.device().index == core_->device(), "{} on '{}': {} is on {} but this communicator's GPU is cuda:{}", op,
             name(), what, t.device().str(), core_->device());
  }

  Wire reducible(const Tensor& t, const char* op, const char* what = "the tensor") const {
    on_gpu(t, op, what);
    const Wire w = wire(t.dtype());
    DS_CHECK(w.reducible, "{} on '{}': NCCL cannot reduce {} tensors", op, name(), dtype_name(t.dtype()));
    return w;
  }

  std::shared_ptr<NcclCore> core_;
};

}  // namespace

bool nccl_built() { return true; }

std::unique_ptr<Communicator> make_nccl_communicator(MpiCommunicator& over, Device device, double deadline_seconds) {
  DS_CHECK(device.type == DeviceType::CUDA, "NCCL communicator over '{}': {} is not a GPU", over.name(), device.str());
  DS_CHECK(deadline_seconds >= 0, "NCCL communicator over '{}': negative deadline {} s", over.name(),
           deadline_seconds);
  auto core = std::make_shared<NcclCore>(over.name(), over.rank(), over.size(), device.index, deadline_seconds);
  // Rank 0 makes the id; the byte after it says whether it could, so that a failure there is
  // every rank's error rather than a hang.
  std::array<uint8_t, sizeof(ncclUniqueId) + 1> message{};
  std::string why;
  if (over.rank() == 0) {
    ncclUniqueId id;
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r == ncclSuccess) {
      std::memcpy(message.data(), &id, sizeof id);
      message.back() = 1;
    } else {
      why = fmt::format(": {} ({})", ncclGetErrorString(r), ncclGetLastError(nullptr));
    }
  }
  over.broadcast(Tensor(message.data(), DType::U8, Shape{int64_t(message.size())}), 0);
  DS_CHECK(message.back() == 1,
           "NCCL communicator over '{}': its rank 0 could not make an NCCL unique id{} (run with NCCL_DEBUG=WARN)",
           over.name(), why);
  ncclUniqueId id;
  std::memcpy(&id, message.data(), sizeof id);
  core->init(id);
  return std::make_unique<NcclCommunicator>(std::move(core));
}

}  // namespace dstrain
