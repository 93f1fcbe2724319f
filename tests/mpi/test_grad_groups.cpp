// Per-group gradient reduction: dense gradients are summed over every data-parallel rank,
// expert gradients only over the ranks that hold the same experts (ProcessGrid::expert_data()),
// with buckets that never mix the two communicators. At 4 ranks the grid is data 4 x expert 2,
// so the two groups' communicators differ (4 and 2 ranks); at 2 ranks expert 2 leaves each
// expert on one rank (nothing to reduce); at 1 rank expert is 1 and the groups share a
// communicator. Without expert parallelism the buckets and bits are those of the reducer
// before groups existed.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "comm/grid.h"
#include "distributed/grad_reducer.h"
#include "distributed/param_groups.h"

namespace dstrain {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kBucket = 20;  // elements: several buckets per run, some parameters bigger than one

ParamOptions in_group(ParamGroup g, bool follow_previous = false) {
  ParamOptions o;
  o.group = g;
  o.follow_previous = follow_previous;
  return o;
}

// Two MoE-shaped layers between an embedding and a head; experts interleave with dense pieces.
// With grouped = false every parameter is dense: the registry as it was before groups.
ParamRegistry moe_registry(bool grouped = true) {
  ParamRegistry reg;
  const auto D = ParamGroup::Dense, E = grouped ? ParamGroup::Expert : ParamGroup::Dense;
  reg.add("embed", Shape{6, 4}, ParamKind::Embedding, -1, in_group(D));
  for (int l = 0; l < 2; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    reg.add(p + "attn", Shape{4, 4}, ParamKind::Linear, l, in_group(D));
    reg.add(p + "router", Shape{2, 4}, ParamKind::Linear, l, in_group(D));
    reg.add(p + "e0.gate", Shape{3, 4}, ParamKind::Linear, l, in_group(E));
    reg.add(p + "e0.up", Shape{3, 4}, ParamKind::Linear, l, in_group(E, true));
    reg.add(p + "e0.down", Shape{4, 3}, ParamKind::Linear, l, in_group(E));
    reg.add(p + "e1.bias", Shape{5}, ParamKind::Linear, l, in_group(E));
    reg.add(p + "norm", Shape{4}, ParamKind::Norm, l, in_group(D));
  }
  reg.add("head", Shape{6, 4}, ParamKind::Head, -1, in_group(D));
  reg.allocate(Device::cpu());
  return reg;
}

// data = all ranks, expert 2 when it divides them.
ParallelConfig expert_layout(int world) {
  ParallelConfig c;
  c.expert = world % 2 == 0 ? 2 : 1;
  return c;
}

// Rank r's gradient at flat element f: small integers, so every sum is exact in fp32.
float grad_value(int rank, int64_t f) { return float((rank + 1) * 1000 + f); }

// Reports every parameter's gradient in backward order (last first), a few at a time.
void run_backward(GradReducer& reducer, int num_params) {
  const GradReadyFn ready = reducer.hook();
  for (int last = num_params - 1; last >= 0; last -= 3) {
    const int first = std::max(0, last - 2);
    if (ready) ready(first, last);
  }
}

TEST(GradGroups, GroupsAreBoundToDataAndExpertData) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, expert_layout(world));
  const ParamGroupComms comms = ParamGroupComms::from_grid(grid);
  const int ep = grid.size(Axis::Expert);
  EXPECT_EQ(&comms.comm(ParamGroup::Dense), &grid.comm(Axis::Data));
  EXPECT_EQ(comms.comm(ParamGroup::Dense).size(), world);
  EXPECT_EQ(comms.comm(ParamGroup::Expert).size(), world / ep);
  if (ep > 1) {
    EXPECT_EQ(&comms.comm(ParamGroup::Expert), &grid.expert_data());
    EXPECT_FALSE(comms.shared());
    EXPECT_EQ(comms.distinct().size(), 2u);
    EXPECT_EQ(comms.describe(), fmt::format("dense over data ({} rank{}), expert over expert_data ({} rank{})", world,
                                            world == 1 ? "" : "s", world / ep, world / ep == 1 ? "" : "s"));
  } else {
    // expert_data() has the data axis's ranks: the groups share the data communicator.
    EXPECT_EQ(grid.expert_data().size(), world);
    EXPECT_EQ(&comms.comm(ParamGroup::Expert), &grid.comm(Axis::Data));
    EXPECT_TRUE(comms.shared());
    EXPECT_EQ(comms.distinct().size(), 1u);
  }
  EXPECT_EQ(ParamGroupComms(grid.comm(Axis::Data)).distinct().size(), 1u);
  ProcessGrid plain(MPI_COMM_WORLD, ParallelConfig{});
  EXPECT_TRUE(ParamGroupComms::from_grid(plain).shared());
}

TEST(GradGroups, BucketsNeverMixCommunicatorsAndCoverEveryParameterOnce) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, expert_layout(world));
  ParamRegistry reg = moe_registry();
  const ParamGroupComms comms = ParamGroupComms::from_grid(grid);
  GradReducer reducer(reg, comms, kBucket, /*overlap=*/true);
  std::vector<int> seen(size_t(reg.size()), 0);
  int next_last = reg.size() - 1;  // buckets run from the last parameter to the first
  int expert_buckets = 0;
  for (int i = 0; i < reducer.num_buckets(); ++i) {
    const GradReducer::BucketInfo& b = reducer.bucket(i);
    SCOPED_TRACE(fmt::format("bucket {}: parameters {}..{}", i, b.first, b.last));
    EXPECT_EQ(b.last, next_last);
    next_last = b.first - 1;
    int64_t elems = 0;
    for (int id = b.first; id <= b.last; ++id) {
      EXPECT_EQ(&comms.comm(reg.info(id).group), b.comm) << reg.info(id).name;
      ++seen[size_t(id)];
      elems += reg.info(id).numel();
    }
    EXPECT_TRUE(elems <= kBucket || b.first == b.last) << elems << " elements";
    EXPECT_EQ(b.begin, reg.info(b.first).offset);
    EXPECT_EQ(b.end, reg.info(b.last).offset + reg.info(b.last).numel());
    expert_buckets += reg.info(b.first).group == ParamGroup::Expert;
  }
  EXPECT_EQ(next_last, -1);
  for (int id = 0; id < reg.size(); ++id) EXPECT_EQ(seen[size_t(id)], 1) << reg.info(id).name;
  if (!comms.shared()) {
    // Per layer, filled from the end: {down (12), bias (5)}, then up and gate (12 each) alone.
    EXPECT_EQ(expert_buckets, 2 * 3);
    for (int i = 0; i < reducer.num_buckets(); ++i) {
      const auto& b = reducer.bucket(i);
      EXPECT_EQ(reg.info(b.first).group, reg.info(b.last).group) << "bucket " << i << " holds both groups";
    }
  }
}

class GradGroupsReduce : public ::testing::TestWithParam<bool> {};

TEST_P(GradGroupsReduce, ExpertGradientsAreSummedOverExpertDataRanksOnly) {
  const bool overlap = GetParam();
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, expert_layout(world));
  const int rank = grid.world_rank(), ep = grid.size(Axis::Expert);
  ASSERT_EQ(grid.coord(Axis::Data), rank);  // tensor = pipeline = 1: the data coordinate is the rank
  ParamRegistry reg = moe_registry();
  float* g = reg.grads().data<float>();
  const int64_t n = reg.grads().numel();
  for (int64_t f = 0; f < n; ++f) g[f] = grad_value(rank, f);
  GradReducer reducer(reg, ParamGroupComms::from_grid(grid), kBucket, overlap);

  // An accumulation micro-step that does not communicate: the hook and finish do nothing.
  reducer.begin_micro_step(/*communicates=*/false);
  EXPECT_FALSE(reducer.hook());
  reducer.grad_ready(0, reg.size() - 1);
  EXPECT_EQ(reducer.finish().buckets, 0);
  for (int64_t f = 0; f < n; ++f) ASSERT_EQ(g[f], grad_value(rank, f)) << "element " << f << " changed";

  reducer.begin_micro_step(/*communicates=*/true);
  EXPECT_EQ(bool(reducer.hook()), overlap && world > 1);
  run_backward(reducer, reg.size());
  const ReduceTimings t = reducer.finish();

  // By hand: dense sums over every rank r'; experts over the ranks r' with r' % ep == rank % ep
  // (the grid's expert coordinate is data % expert).
  std::vector<char> in_param(size_t(n), 0);
  int64_t checked_expert = 0;
  for (int id = 0; id < reg.size(); ++id) {
    const ParamInfo& p = reg.info(id);
    for (int64_t f = p.offset; f < p.offset + p.numel(); ++f) {
      in_param[size_t(f)] = 1;
      float want = 0;
      for (int r = 0; r < world; ++r) {
        if (p.group == ParamGroup::Dense || r % ep == rank % ep) want += grad_value(r, f);
      }
      ASSERT_EQ(g[f], want) << p.name << " (" << param_group_name(p.group) << ") element " << f - p.offset
                            << " on rank " << rank << " of " << world << ", expert " << ep;
      checked_expert += p.group == ParamGroup::Expert;
    }
  }
  EXPECT_EQ(checked_expert, reg.group_numel(ParamGroup::Expert));
  if (world == 4) {
    // data 4 x expert 2: expert_data is {0, 2} or {1, 3}. Element 0 of layers.0.e0.gate:
    const ParamInfo& e = reg.info(reg.find("layers.0.e0.gate"));
    const int64_t f = e.offset;
    EXPECT_EQ(g[f], rank % 2 == 0 ? float(1000 + f + 3000 + f) : float(2000 + f + 4000 + f));
    EXPECT_EQ(g[0], float(1000 + 2000 + 3000 + 4000));  // embed, dense
  }
  // Padding outside every parameter belongs to no bucket of another group's communicator.
  for (int64_t f = 0; f < n; ++f) {
    bool in_bucket = false;
    for (int i = 0; i < reducer.num_buckets(); ++i) in_bucket |= reducer.bucket(i).begin <= f && f < reducer.bucket(i).end;
    if (!in_bucket) {
      ASSERT_EQ(g[f], grad_value(rank, f)) << "element " << f << " outside every bucket was changed";
    }
  }
  // Buckets of a group held by one rank are not communicated.
  int want_buckets = 0;
  for (int i = 0; i < reducer.num_buckets(); ++i) {
    want_buckets += (reg.info(reducer.bucket(i).first).group == ParamGroup::Dense ? world : world / ep) > 1;
  }
  EXPECT_EQ(t.buckets, want_buckets);
}

INSTANTIATE_TEST_SUITE_P(Modes, GradGroupsReduce, ::testing::Values(false, true),
                         [](const ::testing::TestParamInfo<bool>& p) { return p.param ? "overlapped" : "blocking"; });

// Without expert parallelism, a registry with expert parameters is reduced in the buckets and
// over the communicator of the same registry with every parameter dense (the reducer before
// groups existed), so the sums are the same bits. (Splitting buckets at group boundaries here
// changes the last bits of some sums at 3 ranks and large buckets.)
TEST(GradGroups, WithoutExpertParallelismBucketsAndBitsAreThoseBeforeGroups) {
  ProcessGrid grid(MPI_COMM_WORLD, ParallelConfig{});
  ParamRegistry grouped = moe_registry(true), before = moe_registry(false);
  std::mt19937 rng(1234u + unsigned(grid.world_rank()));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t bucket : {kBucket, int64_t(500'000'000)}) {
    for (bool overlap : {false, true}) {
      for (int64_t f = 0; f < grouped.grads().numel(); ++f) {
        grouped.grads().data<float>()[f] = before.grads().data<float>()[f] = normal(rng) * 1e-3f;
      }
      GradReducer a(grouped, ParamGroupComms::from_grid(grid), bucket, overlap);
      GradReducer b(before, ParamGroupComms(grid.comm(Axis::Data)), bucket, overlap);
      ASSERT_EQ(a.num_buckets(), b.num_buckets()) << bucket << "-element buckets";
      for (int i = 0; i < a.num_buckets(); ++i) {
        EXPECT_EQ(a.bucket(i).first, b.bucket(i).first) << "bucket " << i;
        EXPECT_EQ(a.bucket(i).last, b.bucket(i).last) << "bucket " << i;
        EXPECT_EQ(a.bucket(i).comm, b.bucket(i).comm) << "bucket " << i;
      }
      for (GradReducer* r : {&a, &b}) {
        r->begin_micro_step(true);
        run_backward(*r, grouped.size());
        r->finish();
      }
      EXPECT_EQ(std::memcmp(grouped.grads().data(), before.grads().data(), grouped.grads().nbytes()), 0)
          << bucket << "-element buckets, " << (overlap ? "overlapped" : "blocking");
    }
  }
}

TEST(GradGroups, AGradientReportedTwiceIsAnError) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, ParallelConfig{});
  ParamRegistry reg = moe_registry();
  GradReducer reducer(reg, ParamGroupComms::from_grid(grid), kBucket, /*overlap=*/true);
  reducer.begin_micro_step(true);
  reducer.grad_ready(0, 0);  // the embedding: the last bucket, so nothing is launched yet
  if (world == 1) {
    reducer.grad_ready(0, 0);  // nothing is communicated at one rank: no bookkeeping to upset
  } else {
    try {
      reducer.grad_ready(0, 0);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("the gradient of 'embed' was reported ready twice"));
    }
  }
  reducer.finish();  // every bucket, in order on every rank
}

// communication_data_type bf16 / fp16: the 16-bit all-reduce of every bucket against the fp32
// reduction of the same gradients. Each of the (world - 1) additions rounds once to the 16-bit
// type, and the cast to it rounds every addend: the error of an element is at most
// world x half an ulp of the largest partial sum, bounded here by world x eps x sum |g_r|.
class GradGroupsCommDtype : public ::testing::TestWithParam<DType> {};

float varied_grad(int rank, int64_t f) {
  return float(std::sin(0.37 * double(f) + 1.3 * rank) * std::ldexp(1.0, int(f % 7) - 3));
}

TEST_P(GradGroupsCommDtype, SixteenBitReductionMatchesFp32WithinItsRoundingOnEveryRank) {
  const DType dt = GetParam();
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, expert_layout(world));
  const int rank = grid.world_rank();
  ParamRegistry r32 = moe_registry(), r16 = moe_registry();
  const int64_t n = r32.grads().numel();
  for (int64_t f = 0; f < n; ++f) r32.grads().data<float>()[f] = r16.grads().data<float>()[f] = varied_grad(rank, f);
  GradReducer g32(r32, ParamGroupComms::from_grid(grid), kBucket, true);
  GradReducer g16(r16, ParamGroupComms::from_grid(grid), kBucket, true, dt);
  EXPECT_EQ(g16.comm_dtype(), dt);
  for (GradReducer* g : {&g32, &g16}) {
    g->begin_micro_step(true);
    run_backward(*g, r32.size());
    g->finish();
  }
  const double eps = dt == DType::BF16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const ParamGroupComms comms = ParamGroupComms::from_grid(grid);
  int64_t differ = 0, communicated = 0;
  for (int id = 0; id < r32.size(); ++id) {
    const ParamInfo& p = r32.info(id);
    const int ranks = comms.comm(p.group).size();
    for (int64_t f = p.offset; f < p.offset + p.numel(); ++f) {
      double abs_sum = 0;
      for (int r = 0; r < world; ++r) abs_sum += std::fabs(varied_grad(r, f));
      const float a = r32.grads().data<float>()[f], b = r16.grads().data<float>()[f];
      if (ranks == 1) {
        ASSERT_EQ(a, b) << p.name << ": a group of one rank is not communicated, nor cast";
        continue;
      }
      ++communicated;
      ASSERT_LE(std::fabs(double(a) - double(b)), (world + 1) * eps * abs_sum) << p.name << " element " << f << " on rank " << rank;
      // Every communicated result is a 16-bit value.
      const float rounded = dt == DType::BF16 ? bf16_to_f32(f32_to_bf16(b)) : f16_to_f32(f32_to_f16(b));
      ASSERT_EQ(b, rounded) << p.name << " element " << f;
      differ += a != b;
    }
  }
  if (world > 1) {
    EXPECT_GT(communicated, 0);
    EXPECT_GT(differ, 0) << "the reduction was not done in " << dtype_name(dt);
  }
  // Every rank holds the same bits (ranks of one expert group, for experts; all, for dense).
  std::vector<uint32_t> mine(static_cast<size_t>(n)), all(static_cast<size_t>(n * world));
  std::memcpy(mine.data(), r16.grads().data<float>(), size_t(n) * 4);
  grid.world().all_gather(Tensor(all.data(), DType::U32, Shape{n * world}), Tensor(mine.data(), DType::U32, Shape{n}));
  const int ep = grid.size(Axis::Expert);
  for (int r = 0; r < world; ++r) {
    for (int id = 0; id < r16.size(); ++id) {
      const ParamInfo& p = r16.info(id);
      if (p.group == ParamGroup::Expert && r % ep != rank % ep) continue;
      for (int64_t f = p.offset; f < p.offset + p.numel(); ++f) {
        ASSERT_EQ(all[size_t(r) * size_t(n) + size_t(f)], mine[size_t(f)]) << p.name << " rank " << r << " vs " << rank;
      }
    }
  }
}

TEST_P(GradGroupsCommDtype, ANonFiniteOrOutOfRangeGradientOnOneRankReachesEveryRank) {
  const DType dt = GetParam();
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  ProcessGrid grid(MPI_COMM_WORLD, ParallelConfig{});
  const int rank = grid.world_rank();
  ParamRegistry reg = moe_registry(/*grouped=*/false);
  float* g = reg.grads().data<float>();
  for (int64_t f = 0; f < reg.grads().numel(); ++f) g[f] = varied_grad(rank, f);
  const int64_t inf_at = reg.info(reg.find("layers.1.attn")).offset + 3;
  const int64_t nan_at = reg.info(reg.find("embed")).offset + 1;
  const int64_t big_at = reg.info(reg.find("head")).offset + 5;
  if (rank == world - 1) {
    g[inf_at] = INFINITY;
    g[nan_at] = NAN;
    g[big_at] = 1e6f;  // beyond fp16's 65504, inside bf16's range
  }
  GradReducer reducer(reg, ParamGroupComms::from_grid(grid), kBucket, /*overlap=*/false, dt);
  reducer.begin_micro_step(true);
  run_backward(reducer, reg.size());
  reducer.finish();
  EXPECT_TRUE(std::isinf(g[inf_at]) && g[inf_at] > 0) << g[inf_at] << " on rank " << rank;
  EXPECT_TRUE(std::isnan(g[nan_at])) << g[nan_at] << " on rank " << rank;
  if (world > 1 && dt == DType::F16) {
    EXPECT_TRUE(std::isinf(g[big_at])) << "a gradient beyond fp16's range overflows in an fp16 reduction";
  } else {
    EXPECT_TRUE(std::isfinite(g[big_at]));
  }
  // Nothing else turned non-finite.
  int64_t bad = 0;
  for (int64_t f = 0; f < reg.grads().numel(); ++f) bad += !std::isfinite(g[f]);
  EXPECT_EQ(bad, (world > 1 && dt == DType::F16) ? 3 : 2);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GradGroupsCommDtype, ::testing::Values(DType::BF16, DType::F16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace dstrain
