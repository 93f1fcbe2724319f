#include "train/layout_check.h"

#include <fmt/format.h>

#include <numeric>

#include "core/error.h"
#include "distributed/schedule.h"
#include "model/ctx.h"
#include "train/pipeline.h"

namespace dstrain {

CheckedLayout check_layout(RunConfig& config, int world) {
  CheckedLayout L;
  L.sizes = axis_sizes(config.parallel, world);
  const AxisSizes& a = L.sizes;
  config.train.resolve_batch(a.data, config.source);
  const ModelConfig& mc = config.model;
  const int tp = a.tensor, ep = a.expert, pp = a.pipeline;
  // Tensor parallelism: heads, key/value heads, FFN widths, shared experts and the vocabulary
  // split over the group (the shard of tensor rank 0 stands for every rank's: they split alike).
  L.sequence_parallel = config.parallel.sequence_parallel && tp > 1;
  if (L.sequence_parallel) {
    DS_CHECK(config.train.micro_batch * config.data.seq_len % tp == 0,
             "{}: parallel.sequence_parallel splits each micro-batch's {} x {} token rows over parallel.tensor = {} "
             "ranks, which does not divide them; choose train_micro_batch_size_per_gpu x seq_len divisible by {}",
             config.source, config.train.micro_batch, config.data.seq_len, tp, tp);
  }
  // Expert parallelism: the routed experts split over the expert group (carved out of the
  // data-parallel ranks).
  if (ep > 1) {
    DS_CHECK(mc.n_routed_experts > 0,
             "{}: parallel.expert = {} splits routed experts over ranks, but the model ({}) has none (n_routed_experts "
             "is null: a dense model); set parallel.expert to 1",
             config.source, ep, mc.model_type);
    DS_CHECK(mc.n_routed_experts % ep == 0,
             "{}: parallel.expert = {} does not divide the model's n_routed_experts = {}: each rank of an expert group "
             "holds the same number of experts; choose parallel.expert among {}",
             config.source, ep, mc.n_routed_experts, divisors_text(std::gcd(mc.n_routed_experts, int64_t(a.data))));
  }
  (void)ShardSpec::tensor_parallel(mc, 0, tp, 0, ep, L.sequence_parallel);
  // Pipeline parallelism: the stages, and whether the schedule can run the step's micro-batches.
  const ParallelConfig& par = config.parallel;
  DS_CHECK(pp > 1 || par.partition.empty(), "{}: parallel.partition splits the layers over pipeline stages; it needs "
           "parallel.pipeline > 1", config.source);
  if (pp > 1) {
    const auto schedule = make_schedule(par.schedule, par.schedule == "interleaved" ? int(par.virtual_stages) : 1);
    const int n_micro = int(config.train.grad_accum);
    // Schedules need enough micro-batches (interleaved: a multiple of the pipeline size;
    // DualPipeV: at least twice it).
    const std::string problem = [&]() -> std::string {
      try {
        return validate_schedule(schedule_table(*schedule, pp, n_micro), n_micro, stage_map(*schedule, pp));
      } catch (const Error& e) {
        return e.what();
      }
    }();
    DS_CHECK(problem.empty(),
             "{}: parallel.schedule \"{}\" over parallel.pipeline = {} ranks cannot run {} micro-batches per step "
             "(gradient_accumulation_steps): {}; {}",
             config.source, par.schedule, pp, n_micro, problem,
             par.schedule == "interleaved" ? fmt::format("use a multiple of {}", pp)
             : par.schedule == "dualpipev" ? fmt::format("use at least {}", 2 * pp)
                                           : std::string("use more"));
    const int64_t chunks = schedule->chunks(), layers = mc.num_hidden_layers;
    DS_CHECK(!par.partition.empty() || pp * chunks <= layers,
             "{}: parallel.pipeline = {} with schedule \"{}\" makes {} stages ({} per rank) for a model of {} decoder "
             "layers (num_hidden_layers): each stage needs at least one layer; pipeline sizes that work with this "
             "schedule: 2 to {}",
             config.source, pp, par.schedule, pp * chunks, chunks, layers, layers / chunks);
    L.stages = pipeline_stages(mc, int(pp * chunks), par.partition, config.data.seq_len);
  }
  return L;
}

std::vector<std::string> CheckedLayout::describe(const RunConfig& config) const {
  const AxisSizes& a = sizes;
  const ModelConfig& mc = config.model;
  const TrainConfig& tc = config.train;
  std::vector<std::string> out;
  out.push_back(fmt::format("{} ranks = data {} x tensor {} x pipeline {}{}", a.world, a.data, a.tensor, a.pipeline,
                            a.expert > 1 ? fmt::format(", expert {} within data ({} expert group{})", a.expert,
                                                       a.data / a.expert, a.data / a.expert == 1 ? "" : "s")
                                         : std::string()));
  out.push_back(fmt::format("batch: {} sequences of {} tokens per step = {} data-parallel ranks x {} micro-batches of {}",
                            tc.train_batch_size, config.data.seq_len, a.data, tc.grad_accum, tc.micro_batch));
  if (a.tensor > 1) {
    out.push_back(fmt::format("tensor: {} heads, FFN {} and vocabulary {} split over {} ranks{}", mc.num_attention_heads,
                              mc.intermediate_size, mc.vocab_size, a.tensor,
                              sequence_parallel ? ", with sequence parallelism" : ""));
  }
  if (a.expert > 1) {
    out.push_back(fmt::format("expert: {} routed experts per MoE layer over {} ranks, {} per rank", mc.n_routed_experts,
                              a.expert, mc.n_routed_experts / a.expert));
  }
  if (!stages.empty()) {
    out.push_back(fmt::format("pipeline: {} stages over {} ranks, schedule {}; {}", stages.size(), a.pipeline,
                              config.parallel.schedule,
                              describe_stages(stages, piece_costs(mc, config.data.seq_len))));
  }
  const int64_t stage = tc.zero.stage;
  if (stage > 0) {
    out.push_back(fmt::format("ZeRO stage {}: each rank's dense pieces sharded over the {} data-parallel ranks{}", stage,
                              a.data,
                              mc.n_routed_experts > 0
                                  ? fmt::format(", its routed experts over the {} rank(s) holding the same experts",
                                                a.data / a.expert)
                                  : std::string()));
  }
  return out;
}

double model_state_bytes_per_rank(const RunConfig& config, int64_t dp) {
  // Tensor parallelism splits (nearly) every parameter over the tensor group, except the routed
  // experts, which expert parallelism splits over the expert group; pipeline parallelism splits
  // the layers over the stages (evenly, in this estimate). ZeRO shards the dense parameters over
  // the data axis and the routed experts over the ranks holding the same experts.
  const ModelConfig& mc = config.model;
  double routed = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers + mc.num_nextn_predict_layers; ++l) {
    if (mc.is_moe_layer(l)) routed += 3.0 * double(mc.n_routed_experts * mc.moe_intermediate_size * mc.hidden_size);
  }
  const double tp = double(std::max<int64_t>(config.parallel.tensor, 1));
  const double pp = double(std::max<int64_t>(config.parallel.pipeline, 1));
  const double ep = double(std::max<int64_t>(config.parallel.expert, 1));
  const double dense = (double(mc.num_parameters()) - routed) / tp / pp, experts = routed / ep / pp;
  const double params = dense + experts;
  const double n = double(std::max<int64_t>(dp, 1)), n_experts = std::max(n / ep, 1.0);
  const double sharded = dense / n + experts / n_experts;
  const PrecisionConfig& pc = config.train.precision;
  // Whole weights (4) and their 16-bit compute copy; gradients (4) and a 16-bit all-reduce's
  // wire buffer; fp32 masters and AdamW's two moments (12, the ZeRO paper's K). Stage 0 keeps
  // the weights as the masters (16 bytes in all); ZeRO shards the masters and moments (stage
  // 1), the gradients (2) and the weights (3) over the data-parallel ranks.
  const double compute = pc.compute_dtype() != DType::F32 ? 2 : 0;
  const double wire = pc.communication_dtype() != DType::F32 ? 2 : 0;
  // (Stages 2 and 3 hold 16-bit wire copies only of the gradients being reduced.)
  switch (config.train.zero.stage) {
    case 0: return params * (16 + compute + wire);
    case 1: return params * (4 + compute + 4 + wire) + 12 * sharded;
    case 2: return params * (4 + compute) + 16 * sharded;
    default: return 16 * sharded;
  }
}

}  // namespace dstrain
