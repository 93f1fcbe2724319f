// The vocabulary-parallel ops (embedding_shard_*, cross_entropy_shard_*, cross_entropy_combine)
// against the unsharded ones: the vocabulary split into P = 1, 2, 3 and 4 shards as tensor
// parallelism splits it, each shard's results put together as the collectives would.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/vec_exp.h"
#include "backend/ops.h"

namespace dstrain {
namespace {

using Floats = std::vector<float>;
using Ints = std::vector<int32_t>;

Tensor f32(Floats& v, Shape s) { return Tensor(v.data(), DType::F32, s); }
Tensor i32(Ints& v, Shape s) { return Tensor(v.data(), DType::I32, s); }

Floats normal(size_t n, std::mt19937& rng, float scale) {
  Floats v(n);
  std::normal_distribution<float> nd(0.0f, scale);
  for (float& x : v) x = nd(rng);
  return v;
}

// Columns [c0, c0 + w) of a row-major (rows, width) matrix, contiguous (rows, w).
Floats columns(const Floats& m, int64_t rows, int64_t width, int64_t c0, int64_t w) {
  Floats out(size_t(rows * w));
  for (int64_t r = 0; r < rows; ++r) std::copy_n(m.begin() + r * width + c0, w, out.begin() + r * w);
  return out;
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Ids in every shard for every P of {1,2,3,4} (each shard boundary from both sides) and random
// ones, ignore_at positions set to kIgnoreIndex.
Ints ids(int64_t n, int64_t V, std::mt19937& rng, std::initializer_list<int64_t> ignore_at) {
  Ints out(static_cast<size_t>(n));
  std::uniform_int_distribution<int32_t> ud(0, int32_t(V) - 1);
  for (int32_t& t : out) t = ud(rng);
  const int64_t edges[] = {0, V / 4 - 1, V / 4, V / 3 - 1, V / 3, V / 2 - 1, V / 2, 2 * V / 3, 3 * V / 4, V - 1};
  for (size_t i = 0; i < std::size(edges); ++i) out[2 * i + 1] = int32_t(edges[i]);
  for (int64_t i : ignore_at) out[size_t(i)] = ops::kIgnoreIndex;
  return out;
}

// The combined loss and lse against cross_entropy_forward's, relative to max(1, |value|): each
// shard's lse is rounded to fp32 once before the shards are combined (measured: 1.8e-7).
constexpr double kCombineTol = 1e-6;

void expect_error(const std::function<void()>& f, const std::string& text) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one saying: " << text;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
  }
}

TEST(VocabParallel, CrossEntropyShardsMatchTheUnshardedOps) {
  // V = 360 splits into shards of 360, 180, 120 and 90 columns: vector loops with and without a
  // tail. N * V is above the threads' threshold for the unsharded ops.
  constexpr int64_t N = 67, V = 360;
  constexpr float scale = 1.0f / 57;
  std::mt19937 rng(11);
  Floats logits = normal(size_t(N * V), rng, 3.0f);
  Ints targets = ids(N, V, rng, {4, 40});
  for (bool avx2 : {true, false}) {
    cpu::use_avx2_kernels(avx2);
    SCOPED_TRACE(avx2 ? "AVX2 kernels" : "scalar kernels");
    Floats losses(N), lse(N), dref(size_t(N * V));
    ops::cross_entropy_forward(f32(losses, {N}), f32(lse, {N}), f32(logits, {N, V}), i32(targets, {N}));
    ops::cross_entropy_backward(f32(dref, {N, V}), f32(logits, {N, V}), f32(lse, {N}), i32(targets, {N}), scale);

    for (int64_t P = 1; P <= 4; ++P) {
      SCOPED_TRACE("P = " + std::to_string(P));
      const int64_t Vl = V / P;
      Floats stats(size_t(P * N * 2));
      double worst = 0;
      for (int64_t p = 0; p < P; ++p) {
        Floats shard = columns(logits, N, V, p * Vl, Vl);
        ops::cross_entropy_shard_forward(f32(stats, {P, N, 2}).row(p), f32(shard, {N, Vl}), i32(targets, {N}), p * Vl,
                                         V);
        int in_shard = 0;
        for (int64_t n = 0; n < N; ++n) {
          const int64_t t = int64_t(targets[size_t(n)]) - p * Vl;
          const bool here = targets[size_t(n)] != ops::kIgnoreIndex && t >= 0 && t < Vl;
          in_shard += here;
          const float want = here ? shard[size_t(n * Vl + t)] : 0.0f;
          EXPECT_TRUE(same_bits(stats[size_t(2 * (p * N + n) + 1)], want)) << "shard " << p << " row " << n;
        }
        EXPECT_GT(in_shard, 0) << "no target in shard " << p << ": the test would not check its one-hot";

        // The backward with the unsharded lse: this shard's columns of cross_entropy_backward.
        Floats d(size_t(N * Vl), 7.0f), inplace = shard;
        ops::cross_entropy_shard_backward(f32(d, {N, Vl}), f32(shard, {N, Vl}), f32(lse, {N}), i32(targets, {N}),
                                          scale, p * Vl);
        ops::cross_entropy_shard_backward(f32(inplace, {N, Vl}), f32(inplace, {N, Vl}), f32(lse, {N}),
                                          i32(targets, {N}), scale, p * Vl);
        for (int64_t n = 0; n < N; ++n) {
          for (int64_t v = 0; v < Vl; ++v) {
            const float want = dref[size_t(n * V + p * Vl + v)];
            ASSERT_TRUE(same_bits(d[size_t(n * Vl + v)], want))
                << "dlogits row " << n << " column " << p * Vl + v << ": " << d[size_t(n * Vl + v)] << " want "
                << want;
            ASSERT_TRUE(same_bits(inplace[size_t(n * Vl + v)], want)) << "in place, row " << n << " column " << v;
          }
        }
      }

      Floats closs(N, 7.0f), clse(N, 7.0f);
      ops::cross_entropy_combine(f32(closs, {N}), f32(clse, {N}), f32(stats, {P, N, 2}), i32(targets, {N}));
      for (int64_t n = 0; n < N; ++n) {
        const size_t i = size_t(n);
        if (P == 1) {
          EXPECT_TRUE(same_bits(clse[i], lse[i])) << "row " << n << ": " << clse[i] << " want " << lse[i];
          EXPECT_TRUE(same_bits(closs[i], losses[i])) << "row " << n << ": " << closs[i] << " want " << losses[i];
          continue;
        }
        EXPECT_NEAR(clse[i], lse[i], kCombineTol * std::max(1.0f, std::fabs(lse[i]))) << "lse row " << n;
        EXPECT_NEAR(closs[i], losses[i], kCombineTol * std::max(1.0f, std::fabs(losses[i]))) << "loss row " << n;
        worst = std::max(worst, double(std::fabs(clse[i] - lse[i])) / std::max(1.0f, std::fabs(lse[i])));
        worst = std::max(worst, double(std::fabs(closs[i] - losses[i])) / std::max(1.0f, std::fabs(losses[i])));
      }
      EXPECT_EQ(closs[4], 0.0f);
      EXPECT_EQ(closs[40], 0.0f);
      std::printf("[ vocab TP  ] cross-entropy %s P=%lld: combined loss/lse max rel err %.1e\n",
                  avx2 ? "avx2  " : "scalar", static_cast<long long>(P), worst);
    }
  }
  cpu::use_avx2_kernels(true);
}

TEST(VocabParallel, EmbeddingShardsMatchTheUnshardedOps) {
  // C = 37: one full channel block of the backward and a partial one. N * C is above the threads'
  // threshold, and N >> V repeats every id.
  constexpr int64_t N = 700, V = 60, C = 37;
  std::mt19937 rng(12);
  Floats table = normal(size_t(V * C), rng, 1.0f), dout = normal(size_t(N * C), rng, 1.0f);
  Floats dtable0 = normal(size_t(V * C), rng, 1.0f);  // the gradient accumulated so far
  Ints tokens = ids(N, V, rng, {});
  Floats out(size_t(N * C)), dref = dtable0;
  ops::embedding_forward(f32(out, {N, C}), i32(tokens, {N}), f32(table, {V, C}));
  ops::embedding_backward(f32(dref, {V, C}), f32(dout, {N, C}), i32(tokens, {N}));

  for (int64_t P = 1; P <= 4; ++P) {
    SCOPED_TRACE("P = " + std::to_string(P));
    const int64_t Vl = V / P;
    Floats sum(size_t(N * C), 0.0f);
    for (int64_t p = 0; p < P; ++p) {
      Floats shard(table.begin() + p * Vl * C, table.begin() + (p + 1) * Vl * C);
      Floats o(size_t(N * C), 7.0f);
      ops::embedding_shard_forward(f32(o, {N, C}), i32(tokens, {N}), f32(shard, {Vl, C}), p * Vl, V);
      for (int64_t n = 0; n < N; ++n) {
        const int64_t r = tokens[size_t(n)] - p * Vl;
        for (int64_t c = 0; c < C; ++c) {
          const float want = r >= 0 && r < Vl ? shard[size_t(r * C + c)] : 0.0f;
          ASSERT_TRUE(same_bits(o[size_t(n * C + c)], want)) << "shard " << p << " token " << n << " channel " << c;
        }
      }
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += o[i];

      Floats dshard(dtable0.begin() + p * Vl * C, dtable0.begin() + (p + 1) * Vl * C);
      ops::embedding_shard_backward(f32(dshard, {Vl, C}), f32(dout, {N, C}), i32(tokens, {N}), p * Vl);
      for (int64_t i = 0; i < Vl * C; ++i) {
        ASSERT_TRUE(same_bits(dshard[size_t(i)], dref[size_t(p * Vl * C + i)]))
            << "dtable row " << p * Vl + i / C << " channel " << i % C;
      }
    }
    for (size_t i = 0; i < sum.size(); ++i) ASSERT_TRUE(same_bits(sum[i], out[i])) << "element " << i;
  }
}

// Token accuracy: each row's largest logit and its target's, whole or over shards whose outputs
// combine by maximum, count the targets ranked first, as an argmax of the whole row does.
TEST(VocabParallel, TargetsRankedFirstAlikeWholeAndSharded) {
  constexpr int64_t N = 7, V = 12, P = 3, Vl = V / P;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  Floats logits(size_t(N * V));
  for (float& x : logits) x = normal(rng);
  Ints targets = {3, 11, ops::kIgnoreIndex, 0, 7, 5, 9};
  // Rows 0 and 3 rank their target first by construction.
  logits[size_t(0 * V + 3)] = 100.0f;
  logits[size_t(3 * V + 0)] = 100.0f;
  int64_t want = 0;
  for (int64_t n = 0; n < N; ++n) {
    if (targets[size_t(n)] == ops::kIgnoreIndex) continue;
    const auto row = logits.begin() + n * V;
    want += std::max_element(row, row + V) - row == targets[size_t(n)];
  }
  ASSERT_GE(want, 2);
  Floats whole(size_t(2 * N));
  ops::logit_max_and_target(f32(whole, {N, 2}), f32(logits, {N, V}), i32(targets, {N}), 0);
  Floats combined(size_t(2 * N), -INFINITY);
  for (int64_t p = 0; p < P; ++p) {
    Floats shard(size_t(N * Vl)), out(size_t(2 * N));
    for (int64_t n = 0; n < N; ++n) std::copy_n(logits.begin() + n * V + p * Vl, Vl, shard.begin() + n * Vl);
    ops::logit_max_and_target(f32(out, {N, 2}), f32(shard, {N, Vl}), i32(targets, {N}), p * Vl);
    for (size_t i = 0; i < out.size(); ++i) combined[i] = std::max(combined[i], out[i]);
  }
  for (const Floats* top : {&whole, &combined}) {
    int64_t hits = 0;
    for (int64_t n = 0; n < N; ++n) hits += (*top)[size_t(2 * n + 1)] >= (*top)[size_t(2 * n)];
    EXPECT_EQ(hits, want);
    EXPECT_EQ((*top)[size_t(2 * 2 + 1)], -INFINITY) << "an ignored row's target logit";
  }
  EXPECT_EQ(whole, combined);
}

TEST(VocabParallel, IdsOutsideTheVocabularyAreErrors) {
  constexpr int64_t N = 5, V = 60, C = 4, Vl = 15;
  Floats table(size_t(Vl * C), 1.0f), out(size_t(N * C)), logits(size_t(N * Vl)), stats(size_t(N * 2));
  Ints ok = {0, 20, 59, 16, 3};
  auto embed = [&](Ints& tokens, int64_t begin, int64_t vocab) {
    return [&, begin, vocab] {
      ops::embedding_shard_forward(f32(out, {N, C}), i32(tokens, {N}), f32(table, {Vl, C}), begin, vocab);
    };
  };
  auto shard_ce = [&](Ints& targets, int64_t begin, int64_t vocab) {
    return [&, begin, vocab] {
      ops::cross_entropy_shard_forward(f32(stats, {N, 2}), f32(logits, {N, Vl}), i32(targets, {N}), begin, vocab);
    };
  };
  EXPECT_NO_THROW(embed(ok, 15, V)());
  EXPECT_NO_THROW(shard_ce(ok, 15, V)());

  // An id is checked against the whole vocabulary, whichever shard holds it.
  for (int32_t bad : {int32_t(V), -1, ops::kIgnoreIndex}) {
    Ints tokens = ok;
    tokens[3] = bad;
    expect_error(embed(tokens, 15, V),
                 fmt::format("token id {} at position 3 is outside the vocabulary [0, {})", bad, V));
  }
  for (int32_t bad : {int32_t(V), -1}) {
    Ints targets = ok;
    targets[3] = bad;
    expect_error(shard_ce(targets, 15, V),
                 fmt::format("target id {} at position 3 is outside the vocabulary [0, {})", bad, V));
  }
  Ints ignored = ok;
  ignored[1] = ops::kIgnoreIndex;
  EXPECT_NO_THROW(shard_ce(ignored, 15, V)());

  // A shard that does not fit in the vocabulary.
  expect_error(embed(ok, 50, V), "embedding_shard_forward: rows [50, 65) are not within the vocabulary [0, 60)");
  expect_error(shard_ce(ok, -1, V), "cross_entropy_shard_forward: columns [-1, 14) are not within the vocabulary");
  Floats losses(N), lse(N), bad_stats(size_t(2 * (N + 1) * 2));
  expect_error([&] { ops::cross_entropy_combine(f32(losses, {N}), f32(lse, {N}), f32(bad_stats, {2, N + 1, 2}),
                                                i32(ok, {N})); },
               "cross_entropy_combine: shard_stats (2, 6, 2) (want (P,5,2))");
}

// Mixed precision: a bf16 embedding shard through the op table (the generic 16-bit kernel)
// copies its rows' bits and writes bf16 zeros for the other shards' tokens.
TEST(VocabParallel, EmbeddingShardOfABf16Table) {
  constexpr int64_t N = 6, V = 12, C = 5, Vl = 4, begin = 8;
  std::mt19937 rng(13);
  Floats wide = normal(size_t(Vl * C), rng, 1.0f);
  std::vector<bf16> table(size_t(Vl * C)), out(size_t(N * C));
  for (size_t i = 0; i < table.size(); ++i) table[i].bits = f32_to_bf16(wide[i]);
  for (bf16& o : out) o.bits = f32_to_bf16(7.0f);
  Ints tokens = {8, 3, 11, 9, 0, 8};
  ops::embedding_shard_forward(Tensor(out.data(), DType::BF16, {N, C}), i32(tokens, {N}),
                               Tensor(table.data(), DType::BF16, {Vl, C}), begin, V);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t r = tokens[size_t(n)] - begin;
    for (int64_t c = 0; c < C; ++c) {
      const uint16_t want = r >= 0 && r < Vl ? table[size_t(r * C + c)].bits : uint16_t(0);
      EXPECT_EQ(out[size_t(n * C + c)].bits, want) << "token " << n << " channel " << c;
    }
  }
}

}  // namespace
}  // namespace dstrain
