// The memory model (train/memory_model.h): one step of each pipeline stage's rank on the meta
// device, read from the allocator's accounting.
#include "train/memory_model.h"

#include <algorithm>
#include <memory>

#include "backend/meta.h"
#include "backend/ops.h"
#include "comm/shape_only_comm.h"
#include "core/error.h"
#include "core/exec_trace.h"
#include "distributed/param_groups.h"
#include "distributed/param_hooks.h"
#include "distributed/schedule.h"
#include "optim/distributed_optimizer.h"
#include "train/layout_check.h"
#include "train/metrics.h"
#include "train/parallel_axes.h"
#include "train/pipeline.h"

namespace dstrain {
namespace {

std::string describe_chunks(const std::vector<StageSpec>& chunks, const ModelConfig& mc) {
  if (chunks.empty()) return fmt::format("layers 0-{}, embedding, head{}", mc.num_hidden_layers - 1,
                                         mc.num_nextn_predict_layers > 0 ? ", mtp" : "");
  std::string out;
  for (const StageSpec& s : chunks) {
    std::string parts;
    if (s.embedding) parts += ", embedding";
    if (s.head) parts += ", head";
    if (s.mtp) parts += ", mtp";
    out += fmt::format("{}layers {}-{}{}", out.empty() ? "" : " + ", s.first_layer, s.end_layer - 1, parts);
  }
  return out;
}

// The most micro-batches whose forward ran and whose backward (its weight part, when split)
// had not, over the rank's chunks.
int in_flight(const std::vector<ScheduleAction>& plan) {
  int now = 0, most = 0;
  for (const ScheduleAction& a : plan) {
    if (a.kind == ScheduleAction::Kind::Forward) most = std::max(most, ++now);
    if (a.kind == ScheduleAction::Kind::Backward || a.kind == ScheduleAction::Kind::BackwardWeight) --now;
  }
  return most;
}

// One step of the rank at pipeline coordinate `pp_rank` (tensor, expert and data coordinate 0).
RankMemory run_rank(const RunConfig& config, const CheckedLayout& layout, int pp_rank, ExecTrace* trace = nullptr) {
  const AxisSizes& a = layout.sizes;
  const ModelConfig& mc = config.model;
  const TrainConfig& tc = config.train;
  InFlightBytes library;
  // Under asynchronous aggregation the optimizer reduces and shards over a replica's data ranks.
  const GradientSyncConfig& gs = config.train.gradient_sync;
  const int data = gs.async() ? int(gs.data_per_replica > 0 ? gs.data_per_replica : a.expert) : a.data;
  ShapeOnlyCommunicator tp("tensor", 0, a.tensor, &library), ep("expert", 0, a.expert, &library),
      pp("pipeline", pp_rank, a.pipeline, &library), dp("data", 0, data, &library),
      expert_dp("expert_data", 0, data / a.expert, &library), replica("replica", 0, a.tensor * a.pipeline * data, &library);
  ProcessGroups groups;
  groups.tp = a.tensor > 1 ? &tp : nullptr;
  groups.ep = a.expert > 1 ? &ep : nullptr;
  const ParallelConfig& par = config.parallel;
  std::unique_ptr<Schedule> schedule;
  std::vector<StageSpec> chunks;
  if (a.pipeline > 1) {
    schedule = make_schedule(par.schedule, par.schedule == "interleaved" ? int(par.virtual_stages) : 1);
    chunks = rank_chunks(*schedule, layout.stages, pp_rank, a.pipeline);
  } else {
    schedule = make_schedule(tc.micro_batch_schedule);
  }
  RankMemory r;
  r.pipeline = pp_rank;
  r.chunks = describe_chunks(chunks, mc);
  reset_memory_peaks(DeviceType::Meta);
  {
    Transformer model(mc, Device::meta(),
                      ShardSpec::tensor_parallel(mc, 0, a.tensor, 0, a.expert, layout.sequence_parallel), groups,
                      chunks);
    const DType compute = tc.precision.compute_dtype();
    if (compute != DType::F32) model.set_compute_dtype(compute);
    model.set_recompute(recompute_policy(tc.activation_checkpointing));
    if (a.expert > 1) model.set_expert_imbalance(config.metrics.expert_imbalance);
    DistributedOptimizer optimizer(tc.zero, tc.adamw, model.params(),
                                   a.expert > 1 ? ParamGroupComms(dp, expert_dp) : ParamGroupComms(dp),
                                   tc.precision.communication_dtype());
    // As the trainer's start: each rank keeps its pieces of the weights (the gathers' buffers
    // stay pooled for the run).
    optimizer.adopt_weights();
    // The aggregation's state between replicas: the outer parameters and momentum and the outer
    // step's buffers, or the delayed gradient's.
    std::unique_ptr<GradientSync> sync;
    if (gs.async()) {
      sync = std::make_unique<GradientSync>(gs, optimizer, nullptr, replica,
                                            std::vector<char>(size_t(model.params().size()), 1));
    }
    // The trainer's axes, in its order; the expert axis holds no memory and the pipeline's tied
    // weights a transient of the embedding's gradient, left out.
    std::vector<std::unique_ptr<ParallelAxis>> axes;
    if (a.tensor > 1) axes.push_back(std::make_unique<TensorAxis>(model, tp, optimizer.reduces_into_shard()));
    axes.push_back(std::make_unique<DataAxis>(optimizer));
    ParamHookChain hooks;
    for (auto& axis : axes) {
      if (ParamHooks* h = axis->hooks()) hooks.add(*h);
    }
    std::unique_ptr<FinalGradHooks> final_hooks;
    std::unique_ptr<PipelineRunner> runner;
    if (a.pipeline > 1) {
      final_hooks = std::make_unique<FinalGradHooks>(hooks, model.params().size());
      model.set_hooks(final_hooks.get());
      runner = std::make_unique<PipelineRunner>(model, pp, *schedule, layout.stages);
    } else {
      model.set_hooks(&hooks);
    }
    const int64_t B = tc.micro_batch, T = config.data.seq_len;
    const int n_micro = int(tc.grad_accum);
    std::vector<int32_t> tokens(size_t(B * T), 0);
    LossScales scales;
    scales.token = 1.0f;
    scales.sequence = 1.0;
    scales.micro_batch = 1.0;
    scales.mtp_token.assign(size_t(mc.num_nextn_predict_layers), 1.0f);
    const Tensor tok(tokens.data(), DType::I32, Shape{B, T});
    const std::vector<ScheduleAction> plan = schedule->actions(a.pipeline > 1 ? pp_rank : 0, a.pipeline, n_micro);
    r.micro_batches_in_flight = in_flight(plan);
    // One step as the trainer runs it (Trainer::train_step, forward_backward).
    auto step = [&] {
      for (auto& axis : axes) axis->begin_step();
      if (runner) {
        final_hooks->begin_step(n_micro);
        for (auto& axis : axes) axis->begin_micro_step(true);
        std::vector<PipelineRunner::MicroBatch> micro(size_t(n_micro), {tok, tok});
        runner->run_step(micro, scales, nullptr, 1);
      } else {
        size_t last_backward = 0;
        for (size_t i = 0; i < plan.size(); ++i) {
          if (plan[i].kind != ScheduleAction::Kind::Forward) last_backward = i;
        }
        for (size_t i = 0; i < plan.size(); ++i) {
          const ScheduleAction& act = plan[i];
          trace_action(int(act.kind), act.micro_batch, act.chunk);
          if (act.kind == ScheduleAction::Kind::Forward) {
            for (auto& axis : axes) axis->begin_forward();
            model.forward(act.micro_batch, tok, tok, scales);
            continue;
          }
          for (auto& axis : axes) axis->begin_micro_step(i == last_backward);
          if (act.kind == ScheduleAction::Kind::BackwardWeight) {
            model.backward_weights(act.micro_batch);
          } else {
            model.backward(act.micro_batch,
                           act.kind == ScheduleAction::Kind::Backward ? BackwardPart::Full : BackwardPart::Input);
          }
        }
      }
      trace_tail();
      ReduceTimings rt;
      for (auto& axis : axes) axis->finish_gradients(rt);
      optimizer.step(tc.adamw.lr, 1.0);
    };
    // Two steps: the second starts with what the first left pooled (message and bucket buffers,
    // the activation store's pool), as every step of a run but the first does.
    step();
    {
      // The second step is the steady state every step of a run but the first is: the one traced.
      TraceScope scope(trace);
      step();
    }
    const MemoryStats m = memory_stats(DeviceType::Meta);
    r.peak = m.peak;
    r.peak_total = m.peak_total;
    r.held_after_step = m.total();
    r.library_peak = library.peak;
  }
  return r;
}

std::string mb(int64_t bytes) { return fmt::format("{:.1f}", double(bytes) / 1e6); }

}  // namespace

RecomputePolicy recompute_policy(const ActivationCheckpointingConfig& ac) {
  RecomputePolicy policy;
  policy.full = ac.full();
  policy.method = ac.method == "block" ? RecomputePolicy::Method::Block : RecomputePolicy::Method::Uniform;
  policy.num_layers = ac.num_layers;
  policy.layernorm = ac.selects("layernorm");
  policy.moe_act = ac.selects("moe_act");
  policy.mla_up_proj = ac.selects("mla_up_proj");
  policy.cpu_checkpointing = ac.cpu_checkpointing;
  return policy;
}

int64_t MemoryEstimate::peak_total() const { return largest().peak_total; }

const RankMemory& MemoryEstimate::largest() const {
  DS_CHECK(!stages.empty(), "an empty memory estimate");
  return *std::max_element(stages.begin(), stages.end(),
                           [](const RankMemory& x, const RankMemory& y) { return x.peak_total < y.peak_total; });
}

const RankMemory& MemoryEstimate::of_rank(int r) const {
  for (const RankMemory& s : stages) {
    if (std::find(s.ranks.begin(), s.ranks.end(), r) != s.ranks.end()) return s;
  }
  DS_FAIL("rank {} is not in the memory estimate of {} ranks", r, world);
}

namespace {
// The world ranks of pipeline stage p: world rank = (pipeline * data + data) * tensor + tensor
// (comm/grid.h).
std::vector<int> stage_ranks(const AxisSizes& a, int world, int p) {
  std::vector<int> ranks;
  for (int w = 0; w < world; ++w) {
    if (w / (a.data * a.tensor) == p) ranks.push_back(w);
  }
  return ranks;
}
}  // namespace

MemoryEstimate estimate_memory(const RunConfig& config, int world) {
  meta::ensure_registered();
  RunConfig c = config;
  const CheckedLayout layout = check_layout(c, world);
  const AxisSizes& a = layout.sizes;
  MemoryEstimate e;
  e.world = world;
  for (int p = 0; p < a.pipeline; ++p) {
    RankMemory r = run_rank(c, layout, p);
    r.ranks = stage_ranks(a, world, p);
    e.stages.push_back(std::move(r));
  }
  return e;
}

RankMemory estimate_rank_memory(const RunConfig& config, int world, int rank) {
  meta::ensure_registered();
  RunConfig c = config;
  const CheckedLayout layout = check_layout(c, world);
  const AxisSizes& a = layout.sizes;
  DS_CHECK(rank >= 0 && rank < world, "rank {} is not in a job of {} ranks", rank, world);
  const int p = rank / int(a.data * a.tensor);
  RankMemory r = run_rank(c, layout, p);
  r.ranks = stage_ranks(a, world, p);
  return r;
}

std::vector<StageTrace> trace_step(const RunConfig& config, int world) {
  meta::ensure_registered();
  RunConfig c = config;
  const CheckedLayout layout = check_layout(c, world);
  const AxisSizes& a = layout.sizes;
  std::vector<StageTrace> out(size_t(a.pipeline));
  for (int p = 0; p < a.pipeline; ++p) {
    StageTrace& st = out[size_t(p)];
    st.memory = run_rank(c, layout, p, &st.trace);
    st.memory.ranks = stage_ranks(a, world, p);
  }
  return out;
}

int64_t process_resident_bytes(const RunConfig& config) {
  // The largest layer GEMMs' shapes (capped: the packing buffers stop growing long before),
  // forward and backward, on the host through the same library as the run's.
  const ModelConfig& mc = config.model;
  const int64_t K = std::min<int64_t>(mc.hidden_size, 8192);
  const int64_t N = std::min<int64_t>(std::max({mc.intermediate_size, mc.moe_intermediate_size, mc.vocab_size}), 8192);
  const int64_t M = std::min<int64_t>(config.train.micro_batch * config.data.seq_len, 1024);
  {
    std::vector<float> x(size_t(M * K), 0.5f), w(size_t(N * K), 0.25f), y(size_t(M * N)), dx(size_t(M * K)),
        dw(size_t(N * K));
    const Tensor tx(x.data(), DType::F32, Shape{M, K}), tw(w.data(), DType::F32, Shape{N, K}),
        ty(y.data(), DType::F32, Shape{M, N});
    ops::linear_forward(ty, tx, tw);
    ops::linear_backward(Tensor(dx.data(), DType::F32, Shape{M, K}), Tensor(dw.data(), DType::F32, Shape{N, K}), ty,
                         tx, tw);
  }
  return int64_t(current_rss_bytes());
}

std::vector<std::string> describe_memory(const MemoryEstimate& e) {
  std::vector<std::string> out;
  constexpr MemCategory kShown[] = {MemCategory::Parameters,     MemCategory::Gradients,   MemCategory::OptimizerState,
                                    MemCategory::GatheredParameters, MemCategory::Activations, MemCategory::CommBuffers,
                                    MemCategory::Workspace, MemCategory::OffloadedActivations};
  std::string head = fmt::format("{:<14}", "ranks");
  for (MemCategory c : kShown) head += fmt::format(" {:>12}", mem_category_name(c).substr(0, 12));
  head += fmt::format(" {:>10} {:>10} {:>10}", "peak", "held", "library");
  out.push_back(head + "   (MB per rank; each category at its own peak)");
  for (const RankMemory& s : e.stages) {
    const std::string ranks = s.ranks.size() == 1 ? std::to_string(s.ranks.front())
                                                  : fmt::format("{}-{}", s.ranks.front(), s.ranks.back());
    std::string line = fmt::format("{:<14}", ranks);
    for (MemCategory c : kShown) line += fmt::format(" {:>12}", mb(s.peak[size_t(c)]));
    line += fmt::format(" {:>10} {:>10} {:>10}", mb(s.peak_total), mb(s.held_after_step), mb(s.library_peak));
    out.push_back(line + fmt::format("   {} micro-batch(es) in flight; {}", s.micro_batches_in_flight, s.chunks));
  }
  return out;
}

}  // namespace dstrain
