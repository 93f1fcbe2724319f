// Pipeline parallelism at the model level: the model cut into stages over all ranks of the job
// (one pipeline), run by each schedule (1F1B, interleaved with 2 chunks per rank, DualPipeV with
// its split backward), against the whole model on every rank running the same micro-batches
// one after the other: the loss of every micro-batch (MTP's included) on the rank holding the
// head, and every gradient, the tied embedding's after its copies were summed. Inference
// through the stages (the evaluation loss, generation's last logits) against the whole model.
// On one rank the interleaved and DualPipeV schedules still cut the model in 2 stages, handed
// over inside the rank.
#include <gtest/gtest.h>
#include <mpi.h>

#include <random>
#include <string>
#include <vector>

#include "comm/mpi_comm.h"
#include "distributed/schedule.h"
#include "model/transformer.h"
#include "run_files.h"
#include "train/pipeline.h"

namespace dstrain {
namespace {

ModelConfig dense(bool tied) {
  ModelConfig c;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_hidden_layers = 8;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 64;
  c.max_position_embeddings = 32;
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 10000;
  c.tie_word_embeddings = tied;
  c.initializer_range = 0.1;
  return c;
}

ModelConfig v3() {
  json m = v3_model()["model"];
  m["num_hidden_layers"] = 8;
  return ModelConfig::from_hf_json(m, "v3_model()");
}

struct Case {
  std::string schedule;
  int chunks;
};

class Pipeline : public ::testing::Test {
 protected:
  void SetUp() override {
    comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, "pipeline");
    P = comm->size();
  }

  // Runs one step of n_micro micro-batches of (B, T) through the pipeline of `schedule` and
  // through the whole model, and compares.
  void check(const ModelConfig& c, const std::string& schedule_name, int V, int n_micro) {
    SCOPED_TRACE(fmt::format("schedule {} x {} chunks, {} ranks, {} micro-batches", schedule_name, V, P, n_micro));
    const int64_t B = 2, T = 8;
    const int D = int(c.num_nextn_predict_layers);
    std::vector<std::vector<int32_t>> tokens, targets;
    for (int m = 0; m < n_micro; ++m) {
      tokens.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 100 + unsigned(m)));
      targets.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 200 + unsigned(m)));
    }
    auto tok = [&](std::vector<int32_t>& v) { return Tensor(v.data(), DType::I32, Shape{B, T}); };
    LossScales scales;
    scales.token = float(1.0 / double(n_micro * B * T));
    scales.sequence = 1.0 / double(n_micro * B);
    scales.micro_batch = 1.0 / double(n_micro);
    for (int k = 0; k < D; ++k) scales.mtp_token.push_back(float(0.3 / double(n_micro * B * (T - k - 1))));

    // The whole model, micro-batch after micro-batch.
    Transformer whole(c, Device::cpu());
    whole.init_weights(11);
    std::vector<LossSums> want;
    for (int m = 0; m < n_micro; ++m) {
      want.push_back(whole.forward(m, tok(tokens[size_t(m)]), tok(targets[size_t(m)]), scales));
      whole.backward(m);
    }

    // The pipeline.
    std::unique_ptr<Schedule> schedule = make_schedule(schedule_name, V);
    const std::vector<StageSpec> stages = pipeline_stages(c, P * schedule->chunks(), {}, T);
    Transformer piece(c, Device::cpu(), ShardSpec::whole(c), {}, rank_chunks(*schedule, stages, comm->rank(), P));
    piece.init_weights(11);
    PipelineRunner runner(piece, *comm, *schedule, stages);
    std::vector<PipelineRunner::MicroBatch> micro;
    for (int m = 0; m < n_micro; ++m) micro.push_back({tok(tokens[size_t(m)]), tok(targets[size_t(m)])});
    const std::vector<LossSums> got = runner.run_step(micro, scales, nullptr, 1);
    runner.reduce_tied_grads();
    EXPECT_TRUE(piece.activations().in_flight().empty()) << "activations left in flight";

    if (runner.holds_loss()) {
      for (int m = 0; m < n_micro; ++m) {
        EXPECT_NEAR(got[size_t(m)].sum, want[size_t(m)].sum, 1e-4 * std::fabs(want[size_t(m)].sum)) << "mb " << m;
        EXPECT_EQ(got[size_t(m)].count, want[size_t(m)].count);
        ASSERT_EQ(got[size_t(m)].mtp_sum.size(), size_t(D));
        for (int k = 0; k < D; ++k) {
          EXPECT_NEAR(got[size_t(m)].mtp_sum[size_t(k)], want[size_t(m)].mtp_sum[size_t(k)],
                      1e-4 * std::fabs(want[size_t(m)].mtp_sum[size_t(k)]));
        }
      }
    }
    // Every parameter this rank holds (copies included) against the whole model's gradient.
    const ParamRegistry& reg = piece.params();
    int compared = 0;
    for (int id = 0; id < reg.size(); ++id) {
      const ParamInfo& p = reg.info(id);
      const int w = whole.params().find(p.name);
      ASSERT_GE(w, 0) << p.name;
      Tensor g = reg.grad(id), ref = whole.params().grad(w);
      ASSERT_EQ(g.numel(), ref.numel()) << p.name;
      EXPECT_LT(rel_error(g.data<float>(), ref.data<float>(), g.numel()), 1e-5) << p.name;
      ++compared;
    }
    // Every parameter of the model is held somewhere (copies once more).
    const int total = comm->all_reduce_value<int32_t>(compared);
    const int copies = comm->all_reduce_value<int32_t>(runner.has_tie() && reg.info(runner.tied_param()).pipeline_copy);
    EXPECT_EQ(total - copies, whole.params().size());

    // Inference through the stages.
    const LossSums e = runner.forward_loss(tok(tokens[0]), tok(targets[0]));
    const LossSums we = whole.forward_loss(tok(tokens[0]), tok(targets[0]));
    EXPECT_NEAR(e.sum, we.sum, 1e-4 * std::fabs(we.sum));
    EXPECT_EQ(e.count, we.count);
    std::vector<float> logits(size_t(B * c.vocab_size)), wl(logits.size());
    runner.last_logits(tok(tokens.back()), Tensor(logits.data(), DType::F32, Shape{B, c.vocab_size}));
    whole.last_logits(tok(tokens.back()), Tensor(wl.data(), DType::F32, Shape{B, c.vocab_size}));
    EXPECT_LT(rel_error(logits.data(), wl.data(), int64_t(wl.size())), 1e-5);
  }

  std::unique_ptr<MpiCommunicator> comm;
  int P = 1;
};

TEST_F(Pipeline, OneFOneBMatchesTheWholeModel) {
  check(dense(false), "1f1b", 1, 5);
  check(dense(true), "1f1b", 1, 2 * P);
  check(v3(), "1f1b", 1, 3);
}

TEST_F(Pipeline, InterleavedMatchesTheWholeModel) {
  check(dense(false), "interleaved", 2, 2 * P);
  check(dense(true), "interleaved", 2, P);
  check(v3(), "interleaved", 2, 2 * P);
}

TEST_F(Pipeline, DualPipeVMatchesTheWholeModel) {
  check(dense(false), "dualpipev", 2, 2 * P);
  check(dense(true), "dualpipev", 2, 2 * P + 2);
  check(v3(), "dualpipev", 2, 2 * P);
}

TEST_F(Pipeline, FinalGradHooksReportEachParameterOnceAfterEveryMicroBatch) {
  struct Recorder : ParamHooks {
    std::vector<std::pair<int, int>> ready;
    void grad_ready(int first, int last) override { ready.emplace_back(first, last); }
  } inner;
  FinalGradHooks hooks(inner, 6);
  hooks.begin_step(2);
  hooks.grad_ready(3, 5);
  hooks.grad_ready(0, 2);
  EXPECT_TRUE(inner.ready.empty());
  hooks.grad_ready(4, 5);
  hooks.grad_ready(3, 3);
  hooks.grad_ready(0, 2);
  const std::vector<std::pair<int, int>> want = {{4, 5}, {3, 3}, {0, 2}};
  EXPECT_EQ(inner.ready, want);
}

}  // namespace
}  // namespace dstrain
