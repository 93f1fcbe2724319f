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

#include <algorithm>
#include <cstring>
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

// The in-order transport (what NCCL needs on GPUs) over MPI, one tag per channel, against the
// tag-matched one: a few steps of training (gradient accumulation over the step's micro-batches,
// then a plain SGD update) give the same bits, losses, gradients and weights; and each rank
// issues its receives right before the actions that consume them and its sends right after the
// actions that produce them, in schedule order, never ahead.
class PipelineInOrder : public Pipeline {
 protected:
  // What the in-order transport must issue on this rank: the schedule's actions, each receive
  // right before its action, each send right after it.
  std::vector<std::string> expected_issue_order(const Schedule& schedule, int S, int n_micro) {
    const int me = comm->rank();
    std::vector<int> holder(static_cast<size_t>(S));
    for (int r = 0; r < P; ++r) {
      for (int c = 0; c < schedule.chunks(); ++c) holder[size_t(schedule.model_stage(r, c, P))] = r;
    }
    std::vector<std::string> out;
    for (const ScheduleAction& a : schedule.actions(me, P, n_micro)) {
      const int s = schedule.model_stage(me, a.chunk, P), mb = a.micro_batch;
      if (a.kind == ScheduleAction::Kind::Forward) {
        if (s > 0 && holder[size_t(s - 1)] != me) out.push_back(fmt::format("recv A{}.{}", s, mb));
        out.push_back(to_string(a));
        if (s < S - 1 && holder[size_t(s + 1)] != me) out.push_back(fmt::format("send A{}.{}", s + 1, mb));
      } else if (a.kind == ScheduleAction::Kind::BackwardWeight) {
        out.push_back(to_string(a));
      } else {
        if (s < S - 1 && holder[size_t(s + 1)] != me) out.push_back(fmt::format("recv G{}.{}", s, mb));
        out.push_back(to_string(a));
        if (s > 0 && holder[size_t(s - 1)] != me) out.push_back(fmt::format("send G{}.{}", s - 1, mb));
      }
    }
    return out;
  }

  // Returns whether the in-order transport ran (the schedule passed its check).
  bool compare(const ModelConfig& c, const std::string& schedule_name, int V, int n_micro, int steps = 3) {
    return compare(c, *make_schedule(schedule_name, V), n_micro, steps);
  }
  bool compare(const ModelConfig& c, const Schedule& sched, int n_micro, int steps = 3) {
    SCOPED_TRACE(fmt::format("schedule {} x {} chunks, {} ranks, {} micro-batches", sched.name(), sched.chunks(), P,
                             n_micro));
    const int64_t B = 2, T = 8;
    const Schedule* schedule = &sched;
    const int S = P * schedule->chunks();
    const std::vector<StageSpec> stages = pipeline_stages(c, S, {}, T);
    const std::vector<StageSpec> mine = rank_chunks(*schedule, stages, comm->rank(), P);
    Transformer tagged_model(c, Device::cpu(), ShardSpec::whole(c), {}, mine);
    Transformer ordered_model(c, Device::cpu(), ShardSpec::whole(c), {}, mine);
    tagged_model.init_weights(7);
    ordered_model.init_weights(7);
    // Two MPI communicators for the four channels: messages keep their channel's tag, so each
    // channel still matches by order alone.
    MpiCommunicator activations(MPI_COMM_WORLD, "pipeline.activations");
    MpiCommunicator gradients(MPI_COMM_WORLD, "pipeline.gradients");
    InOrderChannels channels;
    channels.channel = {&activations, &activations, &gradients, &gradients};
    channels.transport = "mpi";
    PipelineRunner tagged(tagged_model, *comm, *schedule, stages);
    PipelineRunner ordered(ordered_model, *comm, *schedule, stages, channels, n_micro);
    EXPECT_FALSE(tagged.in_order(n_micro));
    const bool in_order = ordered.in_order(n_micro);
    const std::string transport = ordered.transport(n_micro);
    EXPECT_EQ(transport.find("matched by tag") != std::string::npos, !in_order) << transport;
    // Refused: the log line says why, with the pair of messages that would be confused.
    if (!in_order) {
      EXPECT_NE(transport.find("would be taken by"), std::string::npos) << transport;
    }
    tagged.record_issue_order(true);
    ordered.record_issue_order(true);
    const std::vector<std::string> want_order = expected_issue_order(*schedule, S, n_micro);
    const int receives = int(std::count_if(want_order.begin(), want_order.end(),
                                           [](const std::string& e) { return e.rfind("recv", 0) == 0; }));

    LossScales scales;
    scales.token = float(1.0 / double(n_micro * B * T));
    scales.sequence = 1.0 / double(n_micro * B);
    scales.micro_batch = 1.0 / double(n_micro);
    for (int step = 0; step < steps; ++step) {
      std::vector<std::vector<int32_t>> tokens, targets;
      std::vector<PipelineRunner::MicroBatch> micro;
      for (int m = 0; m < n_micro; ++m) {
        tokens.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 1000 * unsigned(step) + unsigned(m)));
        targets.push_back(random_tokens(size_t(B * T), int(c.vocab_size), 5000 + 1000 * unsigned(step) + unsigned(m)));
      }
      for (int m = 0; m < n_micro; ++m) {
        micro.push_back({Tensor(tokens[size_t(m)].data(), DType::I32, Shape{B, T}),
                         Tensor(targets[size_t(m)].data(), DType::I32, Shape{B, T})});
      }
      tagged_model.params().zero_grads();
      ordered_model.params().zero_grads();
      const std::vector<LossSums> a = tagged.run_step(micro, scales, nullptr, step + 1);
      const std::vector<LossSums> b = ordered.run_step(micro, scales, nullptr, step + 1);
      tagged.reduce_tied_grads();
      ordered.reduce_tied_grads();
      EXPECT_TRUE(ordered_model.activations().in_flight().empty()) << "activations left in flight";
      if (a.size() != b.size()) {
        ADD_FAILURE() << "loss sums of " << a.size() << " and " << b.size() << " micro-batches";
        return in_order;
      }
      for (size_t m = 0; m < a.size(); ++m) {
        EXPECT_EQ(a[m].sum, b[m].sum) << "step " << step << " micro-batch " << m;  // the same bits
        EXPECT_EQ(a[m].count, b[m].count);
      }
      if (in_order) {
        EXPECT_EQ(ordered.issue_order(), want_order) << "step " << step;
        // The tag-matched transport posts receives ahead: the check above tells them apart.
        if (receives >= 2) {
          EXPECT_NE(tagged.issue_order(), want_order);
        }
      }
      // Gradients, then a plain SGD update, bit for bit.
      const ParamRegistry& ra = tagged_model.params();
      const ParamRegistry& rb = ordered_model.params();
      for (int id = 0; id < ra.size(); ++id) {
        Tensor ga = ra.grad(id), gb = rb.grad(id), wa = ra.param(id), wb = rb.param(id);
        if (ga.numel() != gb.numel()) {
          ADD_FAILURE() << ra.info(id).name << ": gradients of " << ga.numel() << " and " << gb.numel() << " elements";
          return in_order;
        }
        EXPECT_EQ(std::memcmp(ga.raw(), gb.raw(), size_t(ga.nbytes())), 0) << ra.info(id).name << " step " << step;
        float* pa = wa.data<float>();
        float* pb = wb.data<float>();
        const float* da = ga.data<float>();
        const float* db = gb.data<float>();
        for (int64_t i = 0; i < wa.numel(); ++i) {
          pa[i] -= 0.05f * da[i];
          pb[i] -= 0.05f * db[i];
        }
      }
      if (tagged.has_tie()) {
        // The copy of the tied embedding follows its owner, as after the optimizer's update.
        tagged.copy_tied({ra.param(tagged.tied_param())});
        ordered.copy_tied({rb.param(ordered.tied_param())});
      }
    }
    const ParamRegistry& ra = tagged_model.params();
    const ParamRegistry& rb = ordered_model.params();
    for (int id = 0; id < ra.size(); ++id) {
      Tensor wa = ra.param(id), wb = rb.param(id);
      EXPECT_EQ(std::memcmp(wa.raw(), wb.raw(), size_t(wa.nbytes())), 0) << ra.info(id).name;
    }
    // Inference through the in-order channels.
    std::vector<int32_t> tok = random_tokens(size_t(B * T), int(c.vocab_size), 77);
    const Tensor t(tok.data(), DType::I32, Shape{B, T});
    const LossSums ea = tagged.forward_loss(t, t), eb = ordered.forward_loss(t, t);
    EXPECT_EQ(ea.sum, eb.sum);
    EXPECT_EQ(ea.count, eb.count);
    return in_order;
  }
};

TEST_F(PipelineInOrder, OneFOneBMatchesTagMatchedBitForBit) {
  EXPECT_TRUE(compare(dense(false), "1f1b", 1, 4));
  EXPECT_TRUE(compare(dense(true), "1f1b", 1, 2 * P + 1));
  EXPECT_TRUE(compare(v3(), "1f1b", 1, 3, 2));
}

TEST_F(PipelineInOrder, InterleavedMatchesTagMatchedBitForBit) {
  EXPECT_TRUE(compare(dense(false), "interleaved", 2, 2 * P));
  EXPECT_TRUE(compare(dense(true), "interleaved", 2, P));
}

TEST_F(PipelineInOrder, DualPipeVMatchesTagMatchedBitForBit) {
  EXPECT_TRUE(compare(dense(false), "dualpipev", 2, 2 * P));
  EXPECT_TRUE(compare(dense(true), "dualpipev", 2, 2 * P + 2));
  EXPECT_TRUE(compare(v3(), "dualpipev", 2, 2 * P, 2));
}

// Valid with tags, refused in order: the last rank takes the micro-batches in reverse, so the
// k-th activation its predecessor sends is not the k-th it receives. The others run every
// forward, then the backwards in reverse (the order their gradients come back in).
class ReversedLastStage final : public Schedule {
 public:
  std::string name() const override { return "reversed_last_stage"; }
  std::vector<ScheduleAction> actions(int stage, int n_stages, int n_micro) const override {
    std::vector<ScheduleAction> out;
    if (stage == n_stages - 1) {
      for (int mb = n_micro - 1; mb >= 0; --mb) {
        out.push_back({ScheduleAction::Kind::Forward, mb, 0});
        out.push_back({ScheduleAction::Kind::Backward, mb, 0});
      }
      return out;
    }
    for (int mb = 0; mb < n_micro; ++mb) out.push_back({ScheduleAction::Kind::Forward, mb, 0});
    for (int mb = n_micro - 1; mb >= 0; --mb) out.push_back({ScheduleAction::Kind::Backward, mb, 0});
    return out;
  }
};

TEST_F(PipelineInOrder, AScheduleThatFailsTheCheckKeepsTags) {
  ReversedLastStage schedule;
  // One rank sends nothing: in order trivially. On more, the runner keeps the tag-matched
  // transport (compare() checks that transport() says why) with the same results.
  EXPECT_EQ(compare(dense(false), schedule, 3), P == 1);
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
