// NCCL all-reduce bandwidth between this job's GPUs, measured as nccl-tests measures it. One MPI
// rank per GPU (the rank's place on its node picks the GPU); all-reduce of 1 MiB .. 1 GiB in
// fp32 and bf16, out of place, on a stream of its own; warm-up, then each repeat timed by CUDA
// events; the time of a size is the median of the repeats on the slowest rank.
//   algbw = bytes / time
//   busbw = algbw * 2(n-1)/n   (the traffic of each link in a ring all-reduce; nccl-tests' "busbw")
// With one rank nothing crosses a link (factor 0): only algbw is printed, that of a local copy.
//
//   mpirun -np <GPUs> nccl_bandwidth [--min-mib 1] [--max-mib 1024] [--warmup 5] [--iters 20] [--check]
//
// --check first runs every operation of dstrain's NCCL communicator (comm/nccl_comm.h) on the
// job's ranks against values each rank computes for itself, its errors for host tensors, and its
// deadline (an operation held up past it aborts the communicator and says so); the exit status
// is 1 when any check fails on any rank.
#include <cuda_runtime_api.h>
#include <mpi.h>
#include <fmt/format.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "comm/mpi_comm.h"
#include "comm/nccl_comm.h"
#include "core/cuda/runtime.h"
#include "core/dtype.h"
#include "core/tensor.h"

using namespace dstrain;

namespace {

int g_rank = 0, g_size = 1;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "[rank %d] nccl_bandwidth: %s\n", g_rank, message.c_str());
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::exit(1);
}

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")");
}

void nccl_ok(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) die(std::string(what) + ": " + ncclGetErrorString(r) + " " + ncclGetLastError(nullptr));
}

std::string version(int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); }

struct Options {
  int64_t min_mib = 1, max_mib = 1024;
  int warmup = 5, iters = 20;
  bool check = false;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> long {
      if (i + 1 >= argc) die("option " + a + " needs a value");
      return std::strtol(argv[++i], nullptr, 10);
    };
    if (a == "--min-mib") {
      o.min_mib = value();
    } else if (a == "--max-mib") {
      o.max_mib = value();
    } else if (a == "--warmup") {
      o.warmup = int(value());
    } else if (a == "--iters") {
      o.iters = int(value());
    } else if (a == "--check") {
      o.check = true;
    } else {
      die("unknown option " + a + " (options: --min-mib N --max-mib N --warmup N --iters N --check)");
    }
  }
  if (o.min_mib < 1 || o.max_mib < o.min_mib || o.warmup < 0 || o.iters < 1) die("bad sizes or counts");
  return o;
}

// Every rank's line, printed by rank 0 in rank order.
void print_per_rank(const std::string& mine) {
  constexpr int kWidth = 256;
  std::vector<char> line(kWidth, 0), all(size_t(kWidth) * size_t(g_size), 0);
  std::strncpy(line.data(), mine.c_str(), kWidth - 1);
  MPI_Gather(line.data(), kWidth, MPI_CHAR, all.data(), kWidth, MPI_CHAR, 0, MPI_COMM_WORLD);
  if (g_rank == 0) {
    for (int r = 0; r < g_size; ++r) std::printf("  %s\n", all.data() + size_t(r) * kWidth);
  }
}

// ---- --check: dstrain's NCCL communicator against values each rank computes -----------------

// A device array of T with its host mirror.
template <class T>
struct DeviceArray {
  std::vector<T> host;
  void* device = nullptr;
  int dev;
  DeviceArray(std::vector<T> values, int gpu) : host(std::move(values)), dev(gpu) {
    cuda_ok(cudaMalloc(&device, std::max<size_t>(1, host.size() * sizeof(T))), "cudaMalloc");
    upload();
  }
  explicit DeviceArray(size_t n, int gpu) : DeviceArray(std::vector<T>(n), gpu) {}
  ~DeviceArray() { cudaFree(device); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  void upload() { cuda_ok(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "upload"); }
  std::vector<T>& download() {
    cuda_ok(cudaMemcpy(host.data(), device, host.size() * sizeof(T), cudaMemcpyDeviceToHost), "download");
    return host;
  }
  Tensor tensor(DType t) const { return Tensor(device, t, Shape{int64_t(host.size())}, Device::cuda(dev)); }
  Tensor tensor() const { return tensor(dtype_of<T>()); }
  // Elements [begin, begin + n) as a tensor.
  Tensor piece(int64_t begin, int64_t n) const {
    return Tensor(static_cast<T*>(device) + begin, dtype_of<T>(), Shape{n}, Device::cuda(dev));
  }
};

int g_failures = 0, g_reported = 0;

// Rank 0 prints the failures of every rank since the last report.
void report(const char* what) {
  int failures = 0, mine = g_failures - g_reported;
  g_reported = g_failures;
  MPI_Allreduce(&mine, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0) {
    std::printf("%s on %d rank%s: %s\n", what, g_size, g_size == 1 ? "" : "s",
                failures ? (std::to_string(failures) + " failure(s); see the messages above").c_str() : "passed");
    std::fflush(stdout);
  }
}

template <class T>
void expect(const char* check, const std::vector<T>& got, const std::vector<T>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    if (!(got[i] == want[i])) {
      std::fprintf(stderr, "[rank %d] FAILED %s: element %zu is %g, expected %g\n", g_rank, check, i, double(got[i]),
                   double(want[i]));
      ++g_failures;
      return;
    }
  }
}

void expect_true(const char* check, bool ok, const std::string& detail = "") {
  if (!ok) {
    std::fprintf(stderr, "[rank %d] FAILED %s %s\n", g_rank, check, detail.c_str());
    ++g_failures;
  }
}

// Runs `body`, expecting an error that contains `part`.
template <class F>
void expect_error(const char* check, const std::string& part, F&& body) {
  try {
    body();
    expect_true(check, false, "(no error)");
  } catch (const std::exception& e) {
    const std::string what = e.what();
    expect_true(check, what.find(part) != std::string::npos, "(error was: " + what + ")");
  }
}

void run_checks(int gpu) {
  MpiCommunicator mpi(MPI_COMM_WORLD, "world");
  std::unique_ptr<Communicator> owned = make_nccl_communicator(mpi, Device::cuda(gpu));
  Communicator& c = *owned;
  const int r = c.rank(), n = c.size();
  auto seq = [](size_t len, auto f) {
    using T = decltype(f(size_t(0)));
    std::vector<T> v(len);
    for (size_t i = 0; i < len; ++i) v[i] = f(i);
    return v;
  };

  {  // all_reduce: sums, max and min over dtypes
    DeviceArray<float> f(seq(1000, [&](size_t i) { return float(r) + float(i % 7); }), gpu);
    c.all_reduce(f.tensor());
    expect("all_reduce F32 sum", f.download(),
           seq(1000, [&](size_t i) { return float(n * (n - 1) / 2) + float(n) * float(i % 7); }));
    DeviceArray<double> d({double(r), -double(r)}, gpu);
    c.all_reduce(d.tensor(), ReduceOp::Max);
    expect("all_reduce F64 max", d.download(), {double(n - 1), 0.0});
    DeviceArray<int64_t> l({int64_t(r) + 5, int64_t(1) << 40}, gpu);
    c.all_reduce(l.tensor(), ReduceOp::Min);
    expect("all_reduce I64 min", l.download(), {int64_t(5), int64_t(1) << 40});
    DeviceArray<int32_t> i32({r, 1}, gpu);
    c.all_reduce(i32.tensor());
    expect("all_reduce I32 sum", i32.download(), {n * (n - 1) / 2, n});
    // 16-bit floats: small integers add exactly.
    DeviceArray<uint16_t> b(seq(64, [&](size_t i) { return f32_to_bf16(float(r + 1) * float(i % 4)); }), gpu);
    c.all_reduce(b.tensor(DType::BF16));
    expect("all_reduce BF16 sum", b.download(),
           seq(64, [&](size_t i) { return f32_to_bf16(float(n * (n + 1) / 2) * float(i % 4)); }));
    DeviceArray<uint16_t> h(seq(64, [&](size_t i) { return f32_to_f16(float(r + 1) * float(i % 4)); }), gpu);
    c.all_reduce(h.tensor(DType::F16));
    expect("all_reduce F16 sum", h.download(),
           seq(64, [&](size_t i) { return f32_to_f16(float(n * (n + 1) / 2) * float(i % 4)); }));
    DeviceArray<uint16_t> bm({f32_to_bf16(float(r)), f32_to_bf16(-float(r))}, gpu);
    c.all_reduce(bm.tensor(DType::BF16), ReduceOp::Max);
    expect("all_reduce BF16 max", bm.download(), {f32_to_bf16(float(n - 1)), f32_to_bf16(0.0f)});
  }
  {  // all_gather, reduce_scatter, broadcast of a dtype NCCL has no name for
    DeviceArray<int32_t> in({r, 10 * r}, gpu), out(size_t(2 * n), gpu);
    c.all_gather(out.tensor(), in.tensor());
    expect("all_gather I32", out.download(), seq(size_t(2 * n), [](size_t i) { return int32_t(i % 2 ? 10 * (i / 2) : i / 2); }));
    DeviceArray<float> rs_in(seq(size_t(3 * n), [&](size_t i) { return float(int(i / 3) + r); }), gpu), rs_out(3, gpu);
    c.reduce_scatter(rs_out.tensor(), rs_in.tensor());
    const float want = float(n * r + n * (n - 1) / 2);
    expect("reduce_scatter F32 sum", rs_out.download(), {want, want, want});
    DeviceArray<uint16_t> bc({uint16_t(r == n - 1 ? 777 : 0), uint16_t(r == n - 1 ? 65535 : 1)}, gpu);
    c.broadcast(bc.tensor(DType::U16), n - 1);
    expect("broadcast U16", bc.download(), {uint16_t(777), uint16_t(65535)});
  }
  {  // pieces of varying sizes (rank k holds k + 1 elements), and of equal sizes
    std::vector<int64_t> counts(static_cast<size_t>(n)), equal(static_cast<size_t>(n), 3);
    int64_t total = 0;
    for (int k = 0; k < n; ++k) total += counts[size_t(k)] = k + 1;
    std::vector<int64_t> first(static_cast<size_t>(n), 0);
    for (int k = 1; k < n; ++k) first[size_t(k)] = first[size_t(k - 1)] + counts[size_t(k - 1)];
    auto gathered = seq(size_t(total), [&](size_t i) {
      int k = 0;
      while (k + 1 < n && first[size_t(k + 1)] <= int64_t(i)) ++k;
      return float(100 * k) + float(int64_t(i) - first[size_t(k)]);
    });
    DeviceArray<float> mine(seq(size_t(r + 1), [&](size_t i) { return float(100 * r) + float(i); }), gpu);
    DeviceArray<float> out(size_t(total), gpu);
    c.all_gather_v_async(out.tensor(), mine.tensor(), counts).wait();
    expect("all_gather_v F32", out.download(), gathered);
    // In place: this rank's piece of out is its input.
    DeviceArray<float> inplace(size_t(total), gpu);
    for (int64_t i = 0; i <= r; ++i) inplace.host[size_t(first[size_t(r)] + i)] = float(100 * r) + float(i);
    inplace.upload();
    c.all_gather_v_async(inplace.tensor(), inplace.piece(first[size_t(r)], r + 1), counts).wait();
    expect("all_gather_v F32 in place", inplace.download(), gathered);
    DeviceArray<float> eq_in({float(r), float(r), float(r)}, gpu), eq_out(size_t(3 * n), gpu);
    c.all_gather_v_async(eq_out.tensor(), eq_in.tensor(), equal).wait();
    expect("all_gather_v F32 equal pieces", eq_out.download(), seq(size_t(3 * n), [](size_t i) { return float(i / 3); }));

    DeviceArray<float> rs_in(seq(size_t(total), [&](size_t i) { return float(i) + float(r); }), gpu);
    DeviceArray<float> rs_out(size_t(r + 1), gpu);
    c.reduce_scatter_v_async(rs_out.tensor(), rs_in.tensor(), counts).wait();
    expect("reduce_scatter_v F32 sum", rs_out.download(), seq(size_t(r + 1), [&](size_t i) {
             return float(n) * float(first[size_t(r)] + int64_t(i)) + float(n * (n - 1) / 2);
           }));
    DeviceArray<int32_t> rse_in(seq(size_t(3 * n), [&](size_t i) { return int32_t(i) * (r + 1); }), gpu), rse_out(3, gpu);
    c.reduce_scatter_v_async(rse_out.tensor(), rse_in.tensor(), equal, ReduceOp::Max).wait();
    expect("reduce_scatter_v I32 max, equal pieces", rse_out.download(),
           seq(3, [&](size_t i) { return int32_t(3 * r + int(i)) * n; }));
  }
  {  // all_to_all, all_to_all_v
    DeviceArray<int32_t> in(seq(size_t(2 * n), [&](size_t i) { return int32_t(100 * r + int(i)); }), gpu);
    DeviceArray<int32_t> out(size_t(2 * n), gpu);
    c.all_to_all(out.tensor(), in.tensor());
    expect("all_to_all I32", out.download(),
           seq(size_t(2 * n), [&](size_t i) { return int32_t(100 * int(i / 2) + 2 * r + int(i % 2)); }));
    // Rank r sends k + 1 copies of r to rank k, so it receives r + 1 copies of every k.
    std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n), r + 1);
    std::vector<int64_t> sends;
    for (int k = 0; k < n; ++k) {
      sc[size_t(k)] = k + 1;
      for (int j = 0; j <= k; ++j) sends.push_back(r);
    }
    std::vector<int64_t> want;
    for (int k = 0; k < n; ++k)
      for (int j = 0; j <= r; ++j) want.push_back(k);
    DeviceArray<int64_t> vin(sends, gpu), vout(want.size(), gpu);
    c.all_to_all_v(vout.tensor(), rc, vin.tensor(), sc);
    expect("all_to_all_v I64", vout.download(), want);
  }
  if (n > 1) {  // send and recv around a ring: even ranks send first, odd ranks receive first
    DeviceArray<float> msg(seq(4096, [&](size_t i) { return float(r) + float(i) / 4096; }), gpu), got(4096, gpu);
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    if (r % 2 == 0) {
      c.send(msg.tensor(), next);
      c.recv(got.tensor(), prev);
    } else {
      Work w = c.recv_async(got.tensor(), prev);
      c.send(msg.tensor(), next);
      w.wait();
      expect_true("recv Work::test after wait", w.test());
    }
    expect("send/recv ring", got.download(), seq(4096, [&](size_t i) { return float(prev) + float(i) / 4096; }));
  }
  {  // asynchronous handles, barrier, counters
    DeviceArray<float> a(1 << 20, gpu);
    Work w = c.all_reduce_async(a.tensor());
    while (!w.test()) std::this_thread::yield();
    w.wait();
    c.barrier();
    const CommStats s = c.stats();
    expect_true("stats", s.ops >= 19 && s.bytes > 4e6 && s.busy_seconds > 0,
                "(ops " + std::to_string(s.ops) + ", bytes " + std::to_string(s.bytes) + ", busy " +
                    std::to_string(s.busy_seconds) + " s)");
  }
  {  // errors: host tensors, a send to itself, a dtype NCCL cannot reduce
    std::vector<float> host(4);
    expect_error("host tensor", "NCCL communicators take GPU tensors", [&] {
      c.all_reduce(Tensor(host.data(), DType::F32, Shape{4}));
    });
    DeviceArray<float> t(4, gpu);
    expect_error("send to itself", "itself", [&] { c.send(t.tensor(), r); });
    DeviceArray<uint16_t> u(4, gpu);
    expect_error("U16 sum", "NCCL cannot reduce U16", [&] { c.all_reduce(u.tensor(DType::U16)); });
  }
  report("check of dstrain's NCCL communicator");
}

// Run last: an aborted communicator is the end of that communicator, and NCCL frees it in the
// background.
void run_deadline_check(int gpu) {
  MpiCommunicator mpi(MPI_COMM_WORLD, "world");
  // A collective held up past a deadline of 1 s (the compute stream, which it follows, sleeps
  // 3 s in a host function) aborts its communicator; later operations say so.
  std::unique_ptr<Communicator> late = make_nccl_communicator(mpi, Device::cuda(gpu), 1.0);
  DeviceArray<float> t(16, gpu);
  late->all_reduce(t.tensor());  // connected and working
  cuda_ok(cudaLaunchHostFunc(
              cuda::stream(), [](void*) { std::this_thread::sleep_for(std::chrono::seconds(3)); }, nullptr),
          "cudaLaunchHostFunc");
  expect_error("deadline", "watchdog: all_reduce #1 on NCCL communicator 'world'", [&] {
    late->all_reduce(t.tensor());
  });
  expect_error("after the abort", "was aborted earlier", [&] { late->all_reduce(t.tensor()); });
  cuda_ok(cudaStreamSynchronize(cuda::stream()), "cudaStreamSynchronize");
  report("check of the NCCL communicator's deadline");
}

// ---- bandwidth ------------------------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

void run_bandwidth(const Options& o, int gpu) {
  ncclUniqueId id;
  if (g_rank == 0) nccl_ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
  ncclComm_t comm;
  nccl_ok(ncclCommInitRank(&comm, g_size, id, g_rank), "ncclCommInitRank");
  cudaStream_t stream;
  cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  const size_t max_bytes = size_t(o.max_mib) << 20;
  void *send = nullptr, *recv = nullptr;
  cuda_ok(cudaMalloc(&send, max_bytes), "cudaMalloc");
  cuda_ok(cudaMalloc(&recv, max_bytes), "cudaMalloc");
  cuda_ok(cudaMemset(send, 0, max_bytes), "cudaMemset");  // zeros: any sum is finite
  std::vector<cudaEvent_t> start(size_t(o.iters)), stop(size_t(o.iters));
  for (int i = 0; i < o.iters; ++i) {
    cuda_ok(cudaEventCreate(&start[size_t(i)]), "cudaEventCreate");
    cuda_ok(cudaEventCreate(&stop[size_t(i)]), "cudaEventCreate");
  }
  const double factor = 2.0 * (g_size - 1) / g_size;
  if (g_rank == 0) {
    std::printf("\nall-reduce (sum, out of place), %d rank%s; median of %d repeats after %d warm-up, slowest rank\n",
                g_size, g_size == 1 ? "" : "s", o.iters, o.warmup);
    if (g_size == 1) {
      std::printf("one rank: nothing crosses a link (bus bandwidth factor 2(n-1)/n = 0); algbw is a local copy\n");
    }
    std::printf("%12s %6s %12s %12s %12s %12s\n", "bytes", "dtype", "elements", "time (us)", "algbw GB/s",
                "busbw GB/s");
  }
  const struct {
    const char* name;
    ncclDataType_t type;
    size_t size;
  } types[] = {{"fp32", ncclFloat32, 4}, {"bf16", ncclBfloat16, 2}};
  for (const auto& t : types) {
    for (size_t bytes = size_t(o.min_mib) << 20; bytes <= max_bytes; bytes *= 2) {
      const size_t count = bytes / t.size;
      for (int i = 0; i < o.warmup; ++i) {
        nccl_ok(ncclAllReduce(send, recv, count, t.type, ncclSum, comm, stream), "ncclAllReduce");
      }
      cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      MPI_Barrier(MPI_COMM_WORLD);
      for (int i = 0; i < o.iters; ++i) {
        cuda_ok(cudaEventRecord(start[size_t(i)], stream), "cudaEventRecord");
        nccl_ok(ncclAllReduce(send, recv, count, t.type, ncclSum, comm, stream), "ncclAllReduce");
        cuda_ok(cudaEventRecord(stop[size_t(i)], stream), "cudaEventRecord");
      }
      cuda_ok(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
      std::vector<double> seconds(size_t(o.iters));
      for (int i = 0; i < o.iters; ++i) {
        float ms = 0;
        cuda_ok(cudaEventElapsedTime(&ms, start[size_t(i)], stop[size_t(i)]), "cudaEventElapsedTime");
        seconds[size_t(i)] = ms / 1e3;
      }
      double mine = median(seconds), slowest = 0;
      MPI_Allreduce(&mine, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
      const double algbw = double(bytes) / slowest / 1e9;
      if (g_rank == 0) {
        char busbw[32];
        if (g_size > 1) {
          std::snprintf(busbw, sizeof busbw, "%12.2f", algbw * factor);
        } else {
          std::snprintf(busbw, sizeof busbw, "%12s", "-");
        }
        std::printf("%12zu %6s %12zu %12.1f %12.2f %s\n", bytes, t.name, count, slowest * 1e6, algbw, busbw);
        std::fflush(stdout);
      }
    }
  }
  for (int i = 0; i < o.iters; ++i) {
    cudaEventDestroy(start[size_t(i)]);
    cudaEventDestroy(stop[size_t(i)]);
  }
  cudaFree(send);
  cudaFree(recv);
  cudaStreamDestroy(stream);
  nccl_ok(ncclCommDestroy(comm), "ncclCommDestroy");
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  // dstrain's communicators need it (--check)
  MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &g_size);
  const Options o = parse(argc, argv);

  // One rank per GPU: the rank's place on its node (MPI_COMM_TYPE_SHARED) picks the GPU.
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &node);
  int local_rank = 0, local_size = 1;
  MPI_Comm_rank(node, &local_rank);
  MPI_Comm_size(node, &local_size);
  MPI_Comm_free(&node);
  int gpus = 0;
  const cudaError_t e = cudaGetDeviceCount(&gpus);
  if (e != cudaSuccess || gpus == 0) {
    die(std::string("no GPU to use (") + (e != cudaSuccess ? cudaGetErrorString(e) : "none visible") + ")");
  }
  if (local_size > gpus) {
    die(std::to_string(local_size) + " ranks on this node but " + std::to_string(gpus) +
        " GPU(s) visible: run one rank per GPU");
  }
  const int gpu = local_rank;
  cuda_ok(cudaSetDevice(gpu), "cudaSetDevice");

  int driver = 0, runtime = 0, nccl = 0;
  cuda_ok(cudaDriverGetVersion(&driver), "cudaDriverGetVersion");
  cuda_ok(cudaRuntimeGetVersion(&runtime), "cudaRuntimeGetVersion");
  nccl_ok(ncclGetVersion(&nccl), "ncclGetVersion");
  if (g_rank == 0) {
    std::printf("NCCL %d.%d.%d (built against %d.%d.%d), CUDA driver %s, runtime %s, %d rank%s\n", nccl / 10000,
                (nccl / 100) % 100, nccl % 100, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, version(driver).c_str(),
                version(runtime).c_str(), g_size, g_size == 1 ? "" : "s");
  }
  cudaDeviceProp p{};
  cuda_ok(cudaGetDeviceProperties(&p, gpu), "cudaGetDeviceProperties");
  char bus[32] = {};
  cuda_ok(cudaDeviceGetPCIBusId(bus, sizeof bus, gpu), "cudaDeviceGetPCIBusId");
  char host[64] = {};
  gethostname(host, sizeof host - 1);
  const std::string line =
      fmt::format("rank {}: {} GPU {} {} (sm_{}{}, {} SMs, {:.1f} GiB, {})", g_rank, host, gpu, p.name, p.major,
                  p.minor, p.multiProcessorCount, double(p.totalGlobalMem) / 1073741824.0, bus);
  print_per_rank(line);

  if (o.check) {
    try {
      run_checks(gpu);
    } catch (const std::exception& ex) {
      die(std::string("check: ") + ex.what());
    }
  }
  run_bandwidth(o, gpu);
  if (o.check) {
    try {
      run_deadline_check(gpu);
    } catch (const std::exception& ex) {
      die(std::string("check: ") + ex.what());
    }
  }
  int failures = 0;
  MPI_Allreduce(&g_failures, &failures, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  MPI_Finalize();
  return failures ? 1 : 0;
}
