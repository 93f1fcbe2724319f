#include "comm/mpi_comm.h"

#include <climits>
#include <mutex>

#include "comm/watchdog.h"
#include "core/log.h"

namespace dstrain {

void mpi_check(int code, const char* call, const char* file, int line) {
  if (code == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(code, text, &len);
  const char* base = std::strrchr(file, '/');
  throw Error(fmt::format("MPI call failed: {}\n  {}\n  (at {}:{}; check that every rank runs the same program "
                          "and configuration)",
                          call, std::string(text, size_t(len)), base ? base + 1 : file, line));
}

MPI_Datatype mpi_datatype(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I64: return MPI_INT64_T;
    case DType::I32: return MPI_INT32_T;
    case DType::U32: return MPI_UINT32_T;
    case DType::U16: case DType::BF16: case DType::F16: return MPI_UINT16_T;  // reduced by sum_16bit below
    case DType::U8: case DType::F8_E4M3: return MPI_UINT8_T;  // FP8: moved, never reduced
  }
  DS_FAIL("no MPI datatype for {}", dtype_name(t));
}

namespace {

// Sums of 16-bit floats, which MPI has no type for: each pair of elements is added in fp32 and
// rounded once to the 16-bit type (to nearest even). IEEE addition is commutative, so every
// rank's result is the same whatever order the algorithm combines the ranks in.
template <float (*to_f32)(uint16_t), uint16_t (*from_f32)(float)>
void sum_16bit(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const uint16_t*>(in);
  auto* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = from_f32(to_f32(a[i]) + to_f32(b[i]));
}

MPI_Op sum_op_16bit(DType t) {
  static std::once_flag once;
  static MPI_Op bf16_sum = MPI_OP_NULL, f16_sum = MPI_OP_NULL;
  std::call_once(once, [] {
    DS_MPI_CHECK(MPI_Op_create(&sum_16bit<bf16_to_f32, f32_to_bf16>, /*commute=*/1, &bf16_sum));
    DS_MPI_CHECK(MPI_Op_create(&sum_16bit<f16_to_f32, f32_to_f16>, /*commute=*/1, &f16_sum));
  });
  return t == DType::BF16 ? bf16_sum : f16_sum;
}

MPI_Op mpi_op(ReduceOp op, DType t = DType::F32) {
  if (t == DType::BF16 || t == DType::F16) return sum_op_16bit(t);
  switch (op) {
    case ReduceOp::Sum: return MPI_SUM;
    case ReduceOp::Max: return MPI_MAX;
    case ReduceOp::Min: return MPI_MIN;
  }
  return MPI_SUM;
}

void check_reducible(const Tensor& t, const char* op, ReduceOp rop) {
  DS_CHECK((t.dtype() != DType::BF16 && t.dtype() != DType::F16) || rop == ReduceOp::Sum,
           "{}: MPI reduces {} tensors by summing only; reduce in fp32", op, dtype_name(t.dtype()));
  DS_CHECK(t.device().is_cpu(), "{}: MPI collectives take host tensors, this one is on {} (use NCCL)", op,
           t.device().str());
}

int as_count(int64_t n, const char* op) {
  DS_CHECK(n <= INT_MAX, "{}: {} elements exceed one MPI call; split the tensor", op, n);
  return int(n);
}

// Large buffers go in pieces that fit MPI's int counts.
constexpr int64_t kMaxChunk = int64_t(1) << 30;

}  // namespace

MpiCommHandle::MpiCommHandle(MPI_Comm parent) {
  DS_MPI_CHECK(MPI_Comm_dup(parent, &comm_));
  DS_MPI_CHECK(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN));
}

MpiCommHandle MpiCommHandle::adopt(MPI_Comm owned) {
  MpiCommHandle h;
  h.comm_ = owned;
  if (owned != MPI_COMM_NULL) DS_MPI_CHECK(MPI_Comm_set_errhandler(owned, MPI_ERRORS_RETURN));
  return h;
}

MpiCommHandle& MpiCommHandle::operator=(MpiCommHandle&& o) noexcept {
  if (this != &o) {
    if (comm_ != MPI_COMM_NULL) MPI_Comm_free(&comm_);
    comm_ = o.comm_;
    o.comm_ = MPI_COMM_NULL;
  }
  return *this;
}

MpiCommHandle::~MpiCommHandle() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (comm_ != MPI_COMM_NULL && !finalized) MPI_Comm_free(&comm_);
}

MpiCommunicator::MpiCommunicator(MPI_Comm parent, std::string name)
    : MpiCommunicator(MpiCommHandle(parent), std::move(name), 0) {}

std::unique_ptr<MpiCommunicator> MpiCommunicator::adopt(MpiCommHandle owned, std::string name) {
  return std::unique_ptr<MpiCommunicator>(new MpiCommunicator(std::move(owned), std::move(name), 0));
}

MpiCommunicator::MpiCommunicator(MpiCommHandle comm, std::string name, int) : comm_(std::move(comm)), name_(std::move(name)) {
  int provided = 0;
  DS_MPI_CHECK(MPI_Query_thread(&provided));
  DS_CHECK(provided == MPI_THREAD_MULTIPLE,
           "communicator '{}': MPI was initialised without MPI_THREAD_MULTIPLE, which dstrain's asynchronous "
           "collectives need; use an MPI library built with thread support",
           name_);
  DS_MPI_CHECK(MPI_Comm_rank(comm_.get(), &rank_));
  DS_MPI_CHECK(MPI_Comm_size(comm_.get(), &size_));
  worker_ = std::thread([this] { worker_loop(); });
}

MpiCommunicator::~MpiCommunicator() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

Work MpiCommunicator::enqueue(std::string op, double bytes, std::function<void()> body) {
  auto state = std::make_shared<WorkState>();
  state->op = std::move(op);
  state->issued = std::chrono::steady_clock::now();
  {
    std::lock_guard lock(mutex_);
    state->seq = next_seq_++;
    queue_.push_back(Task{state, bytes, std::move(body)});
  }
  cv_.notify_one();
  return Work(state);
}

void MpiCommunicator::worker_loop() {
  while (true) {
    Task task;
    {
      std::unique_lock lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left to run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    WorkState& s = *task.state;
    s.started = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      WatchScope watch(name_, s.op, s.seq);
      task.body();
    } catch (...) {
      error = std::current_exception();
    }
    const auto finished = std::chrono::steady_clock::now();
    {
      std::lock_guard lock(mutex_);
      stats_.ops += 1;
      stats_.busy_seconds += std::chrono::duration<double>(finished - s.started).count();
      stats_.bytes += task.bytes;
    }
    {
      std::lock_guard lock(s.mutex);
      s.finished = finished;
      s.error = error;
      s.done = true;
    }
    s.cv.notify_all();
  }
}

CommStats MpiCommunicator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

Work MpiCommunicator::all_reduce_async(Tensor t, ReduceOp op) {
  check_reducible(t, "all_reduce", op);
  return enqueue("all_reduce", double(t.nbytes()), [this, t, op] {
    auto* p = static_cast<char*>(t.raw());
    const size_t esize = dtype_size(t.dtype());
    for (int64_t b = 0; b < t.numel(); b += kMaxChunk) {
      const int64_t n = std::min(kMaxChunk, t.numel() - b);
      DS_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p + size_t(b) * esize, int(n), mpi_datatype(t.dtype()), mpi_op(op, t.dtype()),
                                 comm_.get()));
    }
  });
}

Work MpiCommunicator::all_gather_async(Tensor out, Tensor in) {
  DS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() * size_,
           "all_gather on '{}': out holds {} elements of {}, expected {} x {} of {}", name_, out.numel(),
           dtype_name(out.dtype()), size_, in.numel(), dtype_name(in.dtype()));
  return enqueue("all_gather", double(out.nbytes()), [this, out, in] {
    const MPI_Datatype type = mpi_datatype(in.dtype());
    const int n = as_count(in.numel(), "all_gather");
    DS_MPI_CHECK(MPI_Allgather(in.raw(), n, type, out.raw(), n, type, comm_.get()));
  });
}

Work MpiCommunicator::reduce_scatter_async(Tensor out, Tensor in, ReduceOp op) {
  check_reducible(in, "reduce_scatter", op);
  DS_CHECK(out.dtype() == in.dtype() && in.numel() == out.numel() * size_,
           "reduce_scatter on '{}': in holds {} elements, expected {} x {}", name_, in.numel(), size_, out.numel());
  return enqueue("reduce_scatter", double(in.nbytes()), [this, out, in, op] {
    DS_MPI_CHECK(MPI_Reduce_scatter_block(in.raw(), out.raw(), as_count(out.numel(), "reduce_scatter"),
                                          mpi_datatype(in.dtype()), mpi_op(op, in.dtype()), comm_.get()));
  });
}

namespace {
// MPI's int counts and displacements of pieces of `counts` elements laid end to end.
std::pair<std::vector<int>, std::vector<int>> counts_and_displs(const std::vector<int64_t>& counts, int size,
                                                                 int64_t total, const std::string& comm,
                                                                 const char* op) {
  DS_CHECK(int(counts.size()) == size, "{} on '{}': {} counts for {} ranks", op, comm, counts.size(), size);
  std::vector<int> c(counts.size()), d(counts.size());
  int64_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    DS_CHECK(counts[i] >= 0, "{} on '{}': negative count {} for rank {}", op, comm, counts[i], i);
    c[i] = as_count(counts[i], op);
    d[i] = as_count(off, op);
    off += counts[i];
  }
  DS_CHECK(off == total, "{} on '{}': the counts add up to {} but the tensor holds {}", op, comm, off, total);
  return {c, d};
}
}  // namespace

Work MpiCommunicator::all_gather_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts) {
  auto [c, d] = counts_and_displs(counts, size_, out.numel(), name_, "all_gather_v");
  DS_CHECK(out.dtype() == in.dtype() && in.numel() == counts[size_t(rank_)],
           "all_gather_v on '{}': this rank sends {} elements of {}, its count is {} of {}", name_, in.numel(),
           dtype_name(in.dtype()), counts[size_t(rank_)], dtype_name(out.dtype()));
  const bool in_place =
      static_cast<const char*>(in.raw()) == static_cast<const char*>(out.raw()) + size_t(d[size_t(rank_)]) * dtype_size(out.dtype());
  return enqueue("all_gather_v", double(out.nbytes()), [this, out, in, c, d, in_place] {
    const MPI_Datatype type = mpi_datatype(in.dtype());
    DS_MPI_CHECK(MPI_Allgatherv(in_place ? MPI_IN_PLACE : in.raw(), c[size_t(rank_)], type, out.raw(), c.data(),
                                d.data(), type, comm_.get()));
  });
}

Work MpiCommunicator::reduce_scatter_v_async(Tensor out, Tensor in, const std::vector<int64_t>& counts, ReduceOp op) {
  check_reducible(in, "reduce_scatter_v", op);
  auto [c, d] = counts_and_displs(counts, size_, in.numel(), name_, "reduce_scatter_v");
  DS_CHECK(out.dtype() == in.dtype() && out.numel() == counts[size_t(rank_)],
           "reduce_scatter_v on '{}': out holds {} elements, this rank's count is {}", name_, out.numel(),
           counts[size_t(rank_)]);
  return enqueue("reduce_scatter_v", double(in.nbytes()), [this, out, in, op, c = c] {
    DS_MPI_CHECK(MPI_Reduce_scatter(in.raw(), out.raw(), c.data(), mpi_datatype(in.dtype()), mpi_op(op, in.dtype()),
                                    comm_.get()));
  });
}

Work MpiCommunicator::broadcast_async(Tensor t, int root) {
  DS_CHECK(root >= 0 && root < size_, "broadcast on '{}': root {} outside [0, {})", name_, root, size_);
  return enqueue("broadcast", double(t.nbytes()), [this, t, root] {
    auto* p = static_cast<char*>(t.raw());
    const size_t esize = dtype_size(t.dtype());
    for (int64_t b = 0; b < t.numel(); b += kMaxChunk) {
      const int64_t n = std::min(kMaxChunk, t.numel() - b);
      DS_MPI_CHECK(MPI_Bcast(p + size_t(b) * esize, int(n), mpi_datatype(t.dtype()), root, comm_.get()));
    }
  });
}

Work MpiCommunicator::all_to_all_async(Tensor out, Tensor in) {
  DS_CHECK(out.dtype() == in.dtype() && out.numel() == in.numel() && in.numel() % size_ == 0,
           "all_to_all on '{}': in ({}) and out ({}) must hold the same multiple of {} elements", name_, in.numel(),
           out.numel(), size_);
  return enqueue("all_to_all", double(in.nbytes()), [this, out, in] {
    const MPI_Datatype type = mpi_datatype(in.dtype());
    const int n = as_count(in.numel() / size_, "all_to_all");
    DS_MPI_CHECK(MPI_Alltoall(in.raw(), n, type, out.raw(), n, type, comm_.get()));
  });
}

Work MpiCommunicator::all_to_all_v_async(Tensor out, const std::vector<int64_t>& out_counts, Tensor in,
                                         const std::vector<int64_t>& in_counts) {
  DS_CHECK(int(out_counts.size()) == size_ && int(in_counts.size()) == size_ && out.dtype() == in.dtype(),
           "all_to_all_v on '{}': {} ranks need {} counts each way", name_, size_, size_);
  auto displs = [](const std::vector<int64_t>& counts, int64_t total, const char* what) {
    std::vector<int> c(counts.size()), d(counts.size());
    int64_t off = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      DS_CHECK(counts[i] >= 0, "all_to_all_v: negative {} count", what);
      c[i] = as_count(counts[i], "all_to_all_v");
      d[i] = as_count(off, "all_to_all_v");
      off += counts[i];
    }
    DS_CHECK(off <= total, "all_to_all_v: {} counts add up to {} but the tensor holds {}", what, off, total);
    return std::pair(c, d);
  };
  auto [sc, sd] = displs(in_counts, in.numel(), "send");
  auto [rc, rd] = displs(out_counts, out.numel(), "receive");
  return enqueue("all_to_all_v", double(in.nbytes()), [this, out, in, sc, sd, rc, rd] {
    const MPI_Datatype type = mpi_datatype(in.dtype());
    DS_MPI_CHECK(MPI_Alltoallv(in.raw(), sc.data(), sd.data(), type, out.raw(), rc.data(), rd.data(), type,
                               comm_.get()));
  });
}

namespace {
// Point-to-point operations are matched by peer and tag, not by issue order, so they start
// at once (nonblocking) instead of queueing behind collectives.
Work p2p_work(const std::string& comm, const char* op, int peer, MPI_Request request) {
  auto state = std::make_shared<WorkState>();
  state->op = op;
  state->issued = state->started = std::chrono::steady_clock::now();
  auto req = std::make_shared<MPI_Request>(request);
  auto mutex = std::make_shared<std::mutex>();
  state->wait_fn = [req, mutex, comm, op, peer] {
    std::lock_guard lock(*mutex);
    WatchScope watch(comm, fmt::format("{} with rank {}", op, peer), 0);
    DS_MPI_CHECK(MPI_Wait(req.get(), MPI_STATUS_IGNORE));
  };
  state->test_fn = [req, mutex] {
    std::lock_guard lock(*mutex);
    int flag = 0;
    DS_MPI_CHECK(MPI_Test(req.get(), &flag, MPI_STATUS_IGNORE));
    return flag != 0;
  };
  return Work(state);
}
}  // namespace

Work MpiCommunicator::send_async(Tensor t, int peer, int tag) {
  DS_CHECK(peer >= 0 && peer < size_, "send on '{}': peer {} outside [0, {})", name_, peer, size_);
  MPI_Request r;
  DS_MPI_CHECK(MPI_Isend(t.raw(), as_count(t.numel(), "send"), mpi_datatype(t.dtype()), peer, tag, comm_.get(), &r));
  return p2p_work(name_, "send", peer, r);
}

Work MpiCommunicator::recv_async(Tensor t, int peer, int tag) {
  DS_CHECK(peer >= 0 && peer < size_, "recv on '{}': peer {} outside [0, {})", name_, peer, size_);
  MPI_Request r;
  DS_MPI_CHECK(MPI_Irecv(t.raw(), as_count(t.numel(), "recv"), mpi_datatype(t.dtype()), peer, tag, comm_.get(), &r));
  return p2p_work(name_, "recv", peer, r);
}

Work MpiCommunicator::barrier_async() {
  return enqueue("barrier", 0, [this] { DS_MPI_CHECK(MPI_Barrier(comm_.get())); });
}

}  // namespace dstrain
