// `dstrain plan`: predicts a layout's step time, throughput and memory per rank on a cluster
// before the job is submitted, or ranks every layout of a model (src/plan/).
#include "plan_cmd.h"

#include <mpi.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "cli.h"
#include "core/error.h"
#include "core/log.h"
#include "plan/calibrate.h"
#include "plan/planner.h"
#include "train/layout_check.h"
#include "train/memory_model.h"

namespace dstrain::cli {
namespace {

// A run configuration for a model alone: its config.json, the batch, the sequence length and the
// precision; everything else at dstrain's defaults.
RunConfig config_for_model(const PlanOptions& o, const HardwareProfile& hw) {
  json j;
  j["model"] = std::filesystem::absolute(o.model).string();
  j["device"] = hw.device_type == "cpu" ? "cpu" : "cuda";
  j["train"]["train_batch_size"] = o.global_batch;
  j["train"]["train_micro_batch_size_per_gpu"] = 1;
  if (o.precision == "bf16") j["train"]["bf16"]["enabled"] = true;
  if (o.precision == "fp16") j["train"]["fp16"]["enabled"] = true;
  j["data"]["seq_len"] = o.seq;
  j["data"]["train"] = "(dstrain plan reads no data)";
  const std::filesystem::path tmp =
      std::filesystem::temp_directory_path() / fmt::format("dstrain-plan-{}.json", static_cast<long>(::getpid()));
  {
    std::ofstream f(tmp);
    f << j.dump(2);
  }
  RunConfig c;
  try {
    c = RunConfig::load(tmp.string(), o.overrides);
  } catch (...) {
    std::filesystem::remove(tmp);
    throw;
  }
  std::filesystem::remove(tmp);
  return c;
}

void print_table(const std::vector<Candidate>& all, int64_t top) {
  std::printf("%-4s %-44s %12s %10s %7s %9s %10s\n", "#", "layout", "tokens/s", "step s", "MFU", "bubble", "peak GB");
  int64_t shown = 0;
  for (const Candidate& c : all) {
    if (!c.feasible || shown >= top) continue;
    ++shown;
    const Prediction& p = c.prediction;
    std::printf("%-4lld %-44s %12.4g %10.4g %6.1f%% %8.1f%% %10.2f\n", static_cast<long long>(shown), c.label.c_str(),
                p.tokens_per_second, p.step_seconds, 100 * p.mfu, 100 * p.bubble_fraction,
                double(p.peak_memory) / 1e9);
  }
  size_t infeasible = 0;
  for (const Candidate& c : all) infeasible += !c.feasible;
  std::printf("%zu layouts priced, %zu rejected (--json lists each with its reason); the search traces 2 "
              "micro-batches per pipeline rank, the layouts shown are traced in full\n",
              all.size(), infeasible);
}

int plan_one(const PlanOptions& o, const HardwareProfile& hw) {
  RunConfig c = RunConfig::load(o.config, o.overrides);
  PredictOptions opt;
  opt.price.fp8_gemms = o.fp8_gemms;
  opt.cap_traced_micro_batches = o.short_trace;
  Prediction p;
  try {
    p = predict(c, int(o.ranks), hw, opt);
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s: not a valid layout for %lld ranks: %s\n", o.config.c_str(),
                 static_cast<long long>(o.ranks), e.what());
    return 1;
  }
  if (o.json) {
    std::printf("%s\n", prediction_to_json(p).dump(2).c_str());
    return 0;
  }
  const std::vector<std::string> lines = explain(p);
  if (!o.explain) {
    for (size_t i = 0; i < std::min<size_t>(3, lines.size()); ++i) std::printf("%s\n", lines[i].c_str());
    std::printf("%s\n", lines.back().c_str());
  } else {
    for (const std::string& l : lines) std::printf("%s\n", l.c_str());
  }
  return 0;
}

int plan_all(const PlanOptions& o, const HardwareProfile& hw) {
  const RunConfig base = config_for_model(o, hw);
  PlanSpace space = default_plan_space(base, int(o.ranks), hw.ranks_per_node);
  if (!o.tensor.empty()) space.tensor = o.tensor;
  if (!o.pipeline.empty()) space.pipeline = o.pipeline;
  if (!o.expert.empty()) space.expert = o.expert;
  if (!o.zero.empty()) space.zero = o.zero;
  if (!o.micro_batch.empty()) space.micro_batch = o.micro_batch;
  if (!o.schedules.empty()) space.schedules = o.schedules;
  if (!o.recompute.empty()) space.recompute = o.recompute;
  PredictOptions opt;
  opt.price.fp8_gemms = o.fp8_gemms;
  // The search traces a few micro-batches per layout; the layouts shown are traced in full
  // (their memory, the trainer's limits and MFU's model FLOPs) before they are shown.
  opt.model_flops = false;
  opt.cap_traced_micro_batches = true;
  const bool tty = !o.json;
  std::vector<Candidate> all = plan_layouts(base, int(o.ranks), hw, space, opt, [&](size_t done, size_t total) {
    if (tty && (done % 20 == 0 || done == total)) std::fprintf(stderr, "\rplanned %zu of %zu layouts", done, total);
  });
  if (tty) std::fprintf(stderr, "\n");
  // The shown ones (the first --top, in the table and the JSON alike) traced in full, in order,
  // until enough of them still fit.
  opt.model_flops = true;
  opt.cap_traced_micro_batches = false;
  int64_t shown = 0;
  for (Candidate& c : all) {
    if (!c.feasible || shown >= o.top) continue;
    c.full_trace = true;
    try {
      c.prediction = predict(c.config, int(o.ranks), hw, opt);
      c.feasible = c.prediction.fits;
      if (!c.feasible)
        c.reason = fmt::format("memory: {:.2f} GB per rank at its peak, {:.2f} GB available",
                               double(c.prediction.peak_memory) / 1e9, c.prediction.memory_available / 1e9);
    } catch (const Error& e) {
      c.feasible = false;
      c.reason = e.what();
    }
    shown += c.feasible;
  }
  std::stable_sort(all.begin(), all.end(), [](const Candidate& x, const Candidate& y) {
    if (x.feasible != y.feasible) return x.feasible;
    return x.prediction.tokens_per_second > y.prediction.tokens_per_second;
  });
  if (o.json) {
    json out = json::array();
    for (const Candidate& c : all) {
      json j = c.feasible ? prediction_to_json(c.prediction) : json::object();
      j["label"] = c.label;
      j["feasible"] = c.feasible;
      // "full": traced whole (memory and the trainer's limits checked); "short": the search's
      // trace of 2 micro-batches per pipeline rank.
      j["trace"] = c.full_trace ? "full" : "short";
      if (!c.feasible) j["reason"] = c.reason;
      out.push_back(j);
    }
    std::printf("%s\n", out.dump(1).c_str());
    return 0;
  }
  std::printf("%s on %lld ranks of %s (%s), global batch %lld x %lld tokens, %s\n", o.model.c_str(),
              static_cast<long long>(o.ranks), hw.name.c_str(), hw.calibrated ? "calibrated" : "uncalibrated",
              static_cast<long long>(o.global_batch), static_cast<long long>(o.seq), o.precision.c_str());
  print_table(all, o.top);
  if (o.explain && !all.empty() && all.front().feasible) {
    std::printf("\nthe fastest layout:\n");
    for (const std::string& l : explain(all.front().prediction)) std::printf("  %s\n", l.c_str());
  }
  return all.empty() || !all.front().feasible ? 1 : 0;
}

// --check: the trainer's own checks and the memory model for every rank role of the job.
int plan_check(const PlanOptions& o, const HardwareProfile* hw) {
  RunConfig c = RunConfig::load(o.check, o.overrides);
  CheckedLayout layout;
  try {
    layout = check_layout(c, int(o.ranks));
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s: not a valid layout for %lld ranks: %s\n", o.check.c_str(),
                 static_cast<long long>(o.ranks), e.what());
    return 1;
  }
  std::printf("%s: a valid layout for %lld ranks\n", o.check.c_str(), static_cast<long long>(o.ranks));
  for (const std::string& line : layout.describe(c)) std::printf("  %s\n", line.c_str());
  const MemoryEstimate e = estimate_memory(c, int(o.ranks));
  std::printf("memory per rank role (the memory model: one step of each pipeline stage's rank on the meta device%s):\n",
              layout.sizes.expert > 1 ? fmt::format("; the expert owner run receives {:.2f} x a balanced share",
                                                    c.metrics.expert_imbalance).c_str()
                                      : "");
  for (const std::string& line : describe_memory(e)) std::printf("  %s\n", line.c_str());
  if (!hw) return 0;
  const double available = hw->memory_bytes;
  const RankMemory& top = e.largest();
  const bool fits = double(top.peak_total + top.library_peak) <= available;
  std::printf("peak %.2f GB on rank %d against %.2f GB of %s: %s\n", double(top.peak_total + top.library_peak) / 1e9,
              top.ranks.front(), available / 1e9, hw->name.c_str(), fits ? "fits" : "does not fit");
  return fits ? 0 : 1;
}

}  // namespace

CLI::App* add_plan_command(CLI::App& app, PlanOptions& o) {
  CLI::App* plan = app.add_subcommand(
      "plan", "predict step time, tokens/s, MFU and memory per rank of a layout on a cluster, or rank every layout");
  plan->add_option("--config", o.config, "a run configuration: price its layout")->check(CLI::ExistingFile);
  plan->add_option("--model", o.model, "a model's config.json: rank every layout")->check(CLI::ExistingFile);
  plan->add_option("--check", o.check, "a run configuration: the trainer's checks and memory of each rank role")
      ->check(CLI::ExistingFile);
  plan->add_option("--cluster", o.cluster, "hardware profile (inputs/clusters/*.json, or dstrain calibrate's)")
      ->check(CLI::ExistingFile);
  plan->add_option("--ranks", o.ranks, "ranks (GPUs) of the job")->required()->check(integer_in(1));
  plan->add_option("--global-batch", o.global_batch, "with --model: sequences per step")->check(integer_in(1));
  plan->add_option("--seq", o.seq, "with --model: tokens per sequence")->check(integer_in(1));
  plan->add_option("--precision", o.precision, "with --model: fp32, bf16 or fp16")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  plan->add_option("--top", o.top, "layouts shown, each traced in full (the rest keep the search's short trace)")
      ->check(integer_in(1));
  plan->add_flag("--explain", o.explain, "the step's breakdown: compute, communication, bubble, memory");
  plan->add_flag("--json", o.json, "print JSON (every layout, with the reasons of the rejected ones)");
  plan->add_flag("--fp8-gemms", o.fp8_gemms, "price the linear layers' GEMMs at the profile's fp8 peak");
  plan->add_flag("--short-trace", o.short_trace,
                 "with --config: trace 2 micro-batches per pipeline rank (the step's time as a full trace "
                 "prices it; its memory and the trainer's limits on a whole step unchecked)");
  plan->add_option("--set", o.overrides, "override a configuration key")->take_all();
  plan->add_option("--tensor", o.tensor, "with --model: tensor sizes to try")->delimiter(',');
  plan->add_option("--pipeline", o.pipeline, "with --model: pipeline sizes to try")->delimiter(',');
  plan->add_option("--expert", o.expert, "with --model: expert sizes to try")->delimiter(',');
  plan->add_option("--zero", o.zero, "with --model: ZeRO stages to try")->delimiter(',');
  plan->add_option("--micro-batch", o.micro_batch, "with --model: micro-batches to try")->delimiter(',');
  plan->add_option("--schedules", o.schedules, "with --model: 1f1b, interleaved, dualpipev")->delimiter(',');
  plan->add_option("--recompute", o.recompute, "with --model: none, selective, full")->delimiter(',');
  return plan;
}

int cmd_plan(const PlanOptions& o) {
  if (log::rank() != 0) return 0;
  const int modes = int(!o.config.empty()) + int(!o.model.empty()) + int(!o.check.empty());
  if (modes != 1) {
    std::fprintf(stderr, "dstrain plan: give exactly one of --config RUN.json (price a layout), --model "
                         "config.json (rank every layout) or --check RUN.json (checks and memory per rank role)\n");
    return kExitBadCommandLine;
  }
  std::unique_ptr<HardwareProfile> hw;
  if (!o.cluster.empty()) hw = std::make_unique<HardwareProfile>(load_profile(o.cluster));
  if (!o.check.empty()) return plan_check(o, hw.get());
  if (!hw) {
    std::fprintf(stderr, "dstrain plan: --cluster PROFILE.json is required (inputs/clusters/ holds A100, H100, H200 "
                         "and H800 nodes; dstrain calibrate writes one for this machine)\n");
    return kExitBadCommandLine;
  }
  if (!o.model.empty() && (o.global_batch <= 0 || o.seq <= 0)) {
    std::fprintf(stderr, "dstrain plan: --model needs --global-batch N (sequences per step) and --seq T\n");
    return kExitBadCommandLine;
  }
  return o.config.empty() ? plan_all(o, *hw) : plan_one(o, *hw);
}

CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& o) {
  CLI::App* cal = app.add_subcommand(
      "calibrate", "measure this machine's op rates and collectives for the model's shapes; write a hardware profile");
  cal->add_option("--config", o.config, "run configuration whose model and batch give the shapes measured")
      ->required()
      ->check(CLI::ExistingFile);
  cal->add_option("--out", o.out, "the profile written (JSON)")->required();
  cal->add_option("--set", o.overrides, "override a configuration key")->take_all();
  cal->add_option("--precisions", o.precisions, "compute precisions measured: fp32, bf16, fp16")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  cal->add_option("--seconds-per-op", o.seconds_per_op, "time spent measuring each op shape")
      ->check(finite_at_least(0.001));
  cal->add_option("--max-collective-bytes", o.max_collective_bytes, "largest collective measured")
      ->check(integer_in(1024));
  return cal;
}

int cmd_calibrate(const CalibrateOptions& o) {
  RunConfig c = RunConfig::load(o.config, o.overrides);
  CalibrationSettings s;
  s.precisions = o.precisions;
  s.seconds_per_op = o.seconds_per_op;
  s.max_collective_bytes = o.max_collective_bytes;
  const HardwareProfile p = calibrate(c, MPI_COMM_WORLD, s);
  if (log::rank() == 0) {
    std::ofstream f(o.out);
    if (!f) DS_FAIL("calibrate: cannot write {}", o.out);
    f << profile_to_json(p).dump(2) << "\n";
    std::printf("wrote %s: %zu op shapes measured, %zu fits, collectives of %zu kinds\n", o.out.c_str(),
                p.op_seconds.size(), p.op_fits.size(), p.collectives.size());
  }
  return 0;
}

}  // namespace dstrain::cli
