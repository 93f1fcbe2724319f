// The MPI communicator: every collective against values each rank can compute for itself,
// asynchronous handles, issue order, and the errors of malformed calls.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "comm/grid.h"
#include "comm/mpi_comm.h"

namespace dstrain {
namespace {

class Collectives : public ::testing::Test {
 protected:
  MpiCommunicator impl{MPI_COMM_WORLD, "test"};
  Communicator& comm = impl;  // used through the interface, as the trainer does
  int r = comm.rank(), n = comm.size();
};

TEST_F(Collectives, AllReduceSumMaxMinOverDtypes) {
  std::vector<float> f = {float(r), 1.0f, -float(r)};
  comm.all_reduce(Tensor(f.data(), DType::F32, Shape{3}));
  EXPECT_EQ(f[0], float(n * (n - 1) / 2));
  EXPECT_EQ(f[1], float(n));
  std::vector<double> d = {double(r)};
  comm.all_reduce(Tensor(d.data(), DType::F64, Shape{1}), ReduceOp::Max);
  EXPECT_EQ(d[0], double(n - 1));
  std::vector<int64_t> i = {int64_t(r) + 5};
  comm.all_reduce(Tensor(i.data(), DType::I64, Shape{1}), ReduceOp::Min);
  EXPECT_EQ(i[0], 5);
  EXPECT_EQ(comm.all_reduce_value<int32_t>(2), 2 * n);
}

TEST_F(Collectives, AllGatherReduceScatterBroadcast) {
  std::vector<int32_t> in = {r, 10 * r};
  std::vector<int32_t> out(static_cast<size_t>(2 * n));
  comm.all_gather(Tensor(out.data(), DType::I32, Shape{2 * n}), Tensor(in.data(), DType::I32, Shape{2}));
  for (int k = 0; k < n; ++k) {
    EXPECT_EQ(out[size_t(2 * k)], k);
    EXPECT_EQ(out[size_t(2 * k + 1)], 10 * k);
  }
  // reduce_scatter: piece k of every rank's input is k + r; rank r receives sum over ranks of (r + q).
  std::vector<float> rs_in(static_cast<size_t>(n)), rs_out(1);
  for (int k = 0; k < n; ++k) rs_in[size_t(k)] = float(k + r);
  comm.reduce_scatter(Tensor(rs_out.data(), DType::F32, Shape{1}), Tensor(rs_in.data(), DType::F32, Shape{n}));
  EXPECT_EQ(rs_out[0], float(n * r + n * (n - 1) / 2));
  std::vector<uint16_t> b = {uint16_t(r == n - 1 ? 777 : 0)};
  comm.broadcast(Tensor(b.data(), DType::BF16, Shape{1}), n - 1);
  EXPECT_EQ(b[0], 777);
}

TEST_F(Collectives, AllToAllAndVariableCounts) {
  std::vector<int32_t> in(static_cast<size_t>(n)), out(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) in[size_t(k)] = 100 * r + k;  // piece k goes to rank k
  comm.all_to_all(Tensor(out.data(), DType::I32, Shape{n}), Tensor(in.data(), DType::I32, Shape{n}));
  for (int k = 0; k < n; ++k) EXPECT_EQ(out[size_t(k)], 100 * k + r);
  // Rank r sends k+1 copies of r to rank k, so it receives r+1 copies of every k.
  std::vector<int64_t> sc(static_cast<size_t>(n)), rc(static_cast<size_t>(n), r + 1);
  std::vector<int32_t> vin, vout(static_cast<size_t>(n * (r + 1)));
  for (int k = 0; k < n; ++k) {
    sc[size_t(k)] = k + 1;
    vin.insert(vin.end(), size_t(k + 1), r);
  }
  comm.all_to_all_v(Tensor(vout.data(), DType::I32, Shape{int64_t(vout.size())}), rc,
                    Tensor(vin.data(), DType::I32, Shape{int64_t(vin.size())}), sc);
  for (int k = 0; k < n; ++k)
    for (int c = 0; c <= r; ++c) EXPECT_EQ(vout[size_t(k * (r + 1) + c)], k);
}

TEST_F(Collectives, GatherAndReduceScatterOfUnevenPieces) {
  // Rank k's piece has k elements (rank 0's none), as ZeRO's row pieces can be uneven.
  std::vector<int64_t> counts(static_cast<size_t>(n));
  int64_t total = 0, offset = 0;
  for (int k = 0; k < n; ++k) {
    counts[size_t(k)] = k;
    if (k < r) offset += k;
    total += k;
  }
  std::vector<float> mine(static_cast<size_t>(r), float(r)), all(static_cast<size_t>(total), -1.0f);
  comm.all_gather_v_async(Tensor(all.data(), DType::F32, Shape{total}), Tensor(mine.data(), DType::F32, Shape{r}), counts)
      .wait();
  for (int k = 0, i = 0; k < n; ++k)
    for (int c = 0; c < k; ++c) EXPECT_EQ(all[size_t(i++)], float(k));
  // In place: this rank's piece already at its place in out.
  std::vector<float> inplace(static_cast<size_t>(total), 0.0f);
  for (int c = 0; c < r; ++c) inplace[size_t(offset + c)] = float(10 + r);
  Tensor whole(inplace.data(), DType::F32, Shape{total});
  comm.all_gather_v_async(whole, whole.slice(offset, offset + r), counts).wait();
  for (int k = 0, i = 0; k < n; ++k)
    for (int c = 0; c < k; ++c) EXPECT_EQ(inplace[size_t(i++)], float(10 + k));
  // reduce_scatter_v: element i of every rank's input is i + rank; rank r gets its piece summed.
  std::vector<float> in(static_cast<size_t>(total)), out(static_cast<size_t>(std::max(r, 1)), -1.0f);
  for (int64_t i = 0; i < total; ++i) in[size_t(i)] = float(i + r);
  comm.reduce_scatter_v_async(Tensor(out.data(), DType::F32, Shape{r}), Tensor(in.data(), DType::F32, Shape{total}),
                              counts)
      .wait();
  for (int c = 0; c < r; ++c) EXPECT_EQ(out[size_t(c)], float(n * (offset + c) + n * (n - 1) / 2));
  // Counts that do not add up to the tensor are an error.
  std::vector<int64_t> bad = counts;
  bad[0] += 1;
  EXPECT_THROW(comm.all_gather_v_async(Tensor(all.data(), DType::F32, Shape{total}),
                                       Tensor(mine.data(), DType::F32, Shape{r}), bad),
               Error);
}

TEST_F(Collectives, SendRecvRingDoesNotDeadlock) {
  // Everyone sends first and receives second: point-to-point starts at once, not queued.
  std::vector<float> send(1 << 16, float(r)), recv(1 << 16, -1.0f);
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  Work s = comm.send_async(Tensor(send.data(), DType::F32, Shape{int64_t(send.size())}), next, 3);
  Work q = comm.recv_async(Tensor(recv.data(), DType::F32, Shape{int64_t(recv.size())}), prev, 3);
  q.wait();
  s.wait();
  EXPECT_EQ(recv.front(), float(prev));
  EXPECT_EQ(recv.back(), float(prev));
}

TEST_F(Collectives, AsynchronousOperationsCompleteInIssueOrder) {
  constexpr int kOps = 16;
  std::vector<std::vector<float>> bufs(kOps, std::vector<float>(1000));
  std::vector<Work> work;
  for (int i = 0; i < kOps; ++i) {
    std::fill(bufs[size_t(i)].begin(), bufs[size_t(i)].end(), float(i + r));
    work.push_back(comm.all_reduce_async(Tensor(bufs[size_t(i)].data(), DType::F32, Shape{1000})));
  }
  work.back().wait();
  // FIFO: the last one done means all earlier ones are done.
  for (auto& w : work) EXPECT_TRUE(w.test());
  for (int i = 0; i < kOps; ++i) EXPECT_EQ(bufs[size_t(i)][999], float(n * i + n * (n - 1) / 2));
  uint64_t prev = 0;
  for (size_t i = 0; i < work.size(); ++i) {
    if (i) {
      EXPECT_GT(work[i].state()->seq, prev);
      EXPECT_GE(work[i].state()->started, work[i - 1].state()->finished);
    }
    prev = work[i].state()->seq;
  }
  EXPECT_GE(comm.stats().ops, uint64_t(kOps));
}

TEST_F(Collectives, MalformedCallsAreErrorsOnEveryRank) {
  std::vector<float> a(4), b(3);
  EXPECT_THROW(comm.all_gather(Tensor(b.data(), DType::F32, Shape{3}), Tensor(a.data(), DType::F32, Shape{4})),
               Error);
  std::vector<uint16_t> h(2);
  EXPECT_THROW(comm.all_reduce(Tensor(h.data(), DType::BF16, Shape{2}), ReduceOp::Max), Error);  // 16-bit: sums only
  EXPECT_THROW(comm.broadcast(Tensor(a.data(), DType::F32, Shape{4}), n), Error);
  comm.barrier();  // still usable afterwards
}

// 16-bit sums: each addition in fp32, rounded to the type; exact for values that need few bits.
TEST_F(Collectives, SixteenBitTensorsAreSummed) {
  for (DType dt : {DType::BF16, DType::F16}) {
    const auto to16 = [&](float x) { return dt == DType::BF16 ? f32_to_bf16(x) : f32_to_f16(x); };
    const auto to32 = [&](uint16_t x) { return dt == DType::BF16 ? bf16_to_f32(x) : f16_to_f32(x); };
    std::vector<uint16_t> h = {to16(0.5f * float(comm.rank() + 1)), to16(-2.0f), to16(comm.rank() == 0 ? 3.0f : 0.0f)};
    comm.all_reduce(Tensor(h.data(), dt, Shape{3}));
    EXPECT_EQ(to32(h[0]), 0.25f * float(n * (n + 1))) << dtype_name(dt);
    EXPECT_EQ(to32(h[1]), -2.0f * float(n)) << dtype_name(dt);
    EXPECT_EQ(to32(h[2]), 3.0f) << dtype_name(dt);
  }
}

TEST(ProcessGrid, DataAxisIsInferredAndAxesHaveCommunicators) {
  ProcessGrid g(MPI_COMM_WORLD, ParallelConfig{});
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  EXPECT_EQ(g.size(Axis::Data), n);
  EXPECT_EQ(g.comm(Axis::Data).size(), n);
  EXPECT_EQ(g.comm(Axis::Tensor).size(), 1);
  EXPECT_EQ(g.coord(Axis::Data), g.world_rank());
  // One node here: every rank is on it.
  EXPECT_EQ(g.num_nodes(), 1);
  EXPECT_EQ(g.local_size(), n);
  EXPECT_EQ(g.local_rank(), g.world_rank());
  EXPECT_NE(g.describe().find("data " + std::to_string(n)), std::string::npos);
}

TEST(ProcessGrid, LayoutErrorsAreRaisedOnEveryRank) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  ParallelConfig wrong;
  wrong.data = n + 1;
  try {
    ProcessGrid g(MPI_COMM_WORLD, wrong);
    ADD_FAILURE() << "a layout of " << n + 1 << " ranks was accepted for " << n;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("but the job has " + std::to_string(n) + " ranks"), std::string::npos)
        << e.what();
  }
  // Tensor, pipeline and expert parallelism: valid layouts where the sizes divide.
  ParallelConfig tp;
  tp.tensor = 2;
  tp.data = 0;
  try {
    ProcessGrid g(MPI_COMM_WORLD, tp);
    EXPECT_EQ(n % 2, 0) << "tensor 2 was accepted on " << n << " ranks";
    EXPECT_EQ(g.size(Axis::Tensor), 2);
    ParallelConfig pp;
    pp.pipeline = 2;
    ProcessGrid gp(MPI_COMM_WORLD, pp);
    EXPECT_EQ(gp.size(Axis::Pipeline), 2);
    ParallelConfig ex;
    ex.expert = 2;
    ProcessGrid ge(MPI_COMM_WORLD, ex);
    EXPECT_EQ(ge.size(Axis::Expert), 2);
    EXPECT_EQ(ge.comm(Axis::Expert).size(), 2);
    EXPECT_EQ(ge.expert_data().size(), n / 2);
  } catch (const Error& e) {
    EXPECT_EQ(n % 2, 1) << e.what();
    EXPECT_NE(std::string(e.what()).find("does not divide"), std::string::npos) << e.what();
  }
  // An expert size that does not divide the data-parallel ranks.
  ParallelConfig ep;
  ep.expert = n + 1;
  try {
    ProcessGrid g(MPI_COMM_WORLD, ep);
    ADD_FAILURE() << "expert " << n + 1 << " was accepted for " << n << " data-parallel ranks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("carved out of the data-parallel ones"), std::string::npos) << e.what();
  }
}

// Expert-parallel ranks are carved out of the data-parallel ones: the world is data x tensor x
// pipeline, every data rank has its own data coordinate (its own tokens), consecutive data ranks
// form an expert group, and expert gradients are reduced over the ranks of one expert coordinate.
TEST(ProcessGrid, ExpertRanksAreCarvedOutOfTheDataRanks) {
  int n = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  for (int ep = 1; ep <= n; ++ep) {
    if (n % ep != 0) continue;
    ParallelConfig c;
    c.expert = ep;
    ProcessGrid g(MPI_COMM_WORLD, c);
    EXPECT_EQ(g.size(Axis::Data), n) << "expert " << ep << " must not shrink the data axis";
    EXPECT_EQ(g.coord(Axis::Data), g.world_rank());
    EXPECT_EQ(g.coord(Axis::Expert), g.world_rank() % ep);
    EXPECT_EQ(g.comm(Axis::Data).size(), n);
    EXPECT_EQ(g.comm(Axis::Expert).size(), ep);
    EXPECT_EQ(g.comm(Axis::Expert).rank(), g.coord(Axis::Expert));
    EXPECT_EQ(g.expert_data().size(), n / ep);
    // Every data coordinate appears once over the world: no two ranks read the same tokens.
    int coord = g.coord(Axis::Data);
    std::vector<int> coords(size_t(n), -1);
    MPI_Allgather(&coord, 1, MPI_INT, coords.data(), 1, MPI_INT, MPI_COMM_WORLD);
    std::sort(coords.begin(), coords.end());
    for (int r = 0; r < n; ++r) EXPECT_EQ(coords[size_t(r)], r);
    // The expert group holds each expert coordinate once; the expert-data group holds one.
    const int e = g.coord(Axis::Expert);
    EXPECT_EQ(g.comm(Axis::Expert).all_reduce_value(e), ep * (ep - 1) / 2);
    EXPECT_EQ(g.expert_data().all_reduce_value(e), e * (n / ep));
    EXPECT_NE(g.describe().find("expert " + std::to_string(ep) + " within data"), std::string::npos) << g.describe();
  }
}

}  // namespace
}  // namespace dstrain
