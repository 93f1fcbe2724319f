// dstrain: train, evaluate and sample DeepSeek-family models.
//   dstrain train    --config F [--init-from HF_DIR|CKPT] [--resume auto|CKPT] [--save-hf DIR] [--max-steps N]
//                    [--set key=value]...
//   dstrain eval     --config F --init-from HF_DIR [--batches N]
//   dstrain generate --config F --init-from HF_DIR --prompt TEXT
//   dstrain validate --config F --ranks N [--set key=value]...
//   dstrain plan     --config F --ranks N --cluster PROFILE [--explain] [--json]
//                    | --model CONFIG.json --ranks N --cluster PROFILE --global-batch B --seq T [--top K]
//                    | --check F --ranks N [--cluster PROFILE]
//   dstrain calibrate --config F --out PROFILE.json   (under mpirun: collectives over its ranks)
//   dstrain status   RUN_DIR [--watch [SECONDS]] [--json]   (a live or finished run, from its output.dir)
// Exit status: 0 done, 1 error, 2 bad command line, 75 stopped on SIGUSR1/SIGTERM after a
// checkpoint (requeue the job), 76 a collective passed its deadline (the watchdog ended the job).
#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>
#include <mpi.h>
#include <omp.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "cli.h"
#include "plan_cmd.h"
#include "status_cmd.h"
#include "comm/watchdog.h"
#include "core/log.h"
#include "core/version.h"
#include "io/hf_weights.h"
#include "train/device_setup.h"
#include "train/layout_check.h"
#include "train/memory_model.h"
#include "train/metrics.h"
#include "train/resilience.h"
#include "train/trainer.h"

namespace {

namespace cli = dstrain::cli;

// --set KEY=VALUE, checked when parsing so a malformed one is a bad command line (status 2).
CLI::Validator set_assignment() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const size_t eq = text.find('=');
        const std::string key = text.substr(0, eq);
        if (eq == std::string::npos || key.empty() || key.front() == '.' || key.back() == '.' ||
            key.find("..") != std::string::npos) {
          return fmt::format("expects KEY=VALUE with a dotted KEY (for example train.optimizer.params.lr=3e-4), "
                             "got '{}'", text);
        }
        return {};
      },
      "KEY=VALUE");
}

struct Options {
  std::string config;
  std::string init_from;
  std::string save_hf;
  std::string resume;
  std::string status_file;
  int64_t max_steps = -1;
  std::vector<std::string> overrides;
  int64_t eval_batches = -1;
  std::string prompt;
  int64_t max_new_tokens = -1;
  double temperature = -1;
  int64_t top_k = -1;
  int64_t seed = -1;
  int64_t ranks = 0;
  bool dry_run = false;
};

dstrain::RunConfig load_config(const Options& o) {
  std::vector<std::string> overrides = o.overrides;
  if (o.max_steps >= 0) overrides.push_back(fmt::format("train.max_steps={}", o.max_steps));
  if (!o.save_hf.empty()) overrides.push_back("output.save_hf=" + dstrain::json(o.save_hf).dump());
  if (o.eval_batches > 0) overrides.push_back(fmt::format("train.eval_batches={}", o.eval_batches));
  if (!o.prompt.empty()) overrides.push_back("generate.prompt=" + dstrain::json(o.prompt).dump());
  if (o.max_new_tokens >= 0) overrides.push_back(fmt::format("generate.max_new_tokens={}", o.max_new_tokens));
  if (o.temperature >= 0) overrides.push_back(fmt::format("generate.temperature={}", o.temperature));
  if (o.top_k >= 0) overrides.push_back(fmt::format("generate.top_k={}", o.top_k));
  if (o.seed >= 0) overrides.push_back(fmt::format("generate.seed={}", o.seed));
  return dstrain::RunConfig::load(o.config, overrides, o.init_from);
}

void print_header(const dstrain::RunConfig& c, const char* command, const dstrain::ProcessGrid& grid) {
  using namespace dstrain;
  log::info("dstrain {} ({}) {}: {}, {} OpenMP threads per rank", DSTRAIN_VERSION, DSTRAIN_GIT_COMMIT, command,
            grid.describe(), omp_get_max_threads());
  log::info("resolved configuration:\n{}", c.to_json().dump(2));
}

int cmd_train(const Options& o) {
  using namespace dstrain;
  RunConfig c = load_config(o);
  // Every collective from here on has a deadline.
  Watchdog::instance().start(c.resilience.collective_timeout_s);
  listen_for_stop_signals(StopSignalMode::kRequestStop);
  ProcessGrid grid(MPI_COMM_WORLD, c.parallel);
  Trainer trainer(c, grid, choose_device(c, grid));
  print_header(trainer.config(), "train", grid);
  trainer.claim_output_dirs();
  if (grid.world_rank() == 0) {
    std::filesystem::create_directories(trainer.config().output.dir);
    std::ofstream(std::filesystem::path(trainer.config().output.dir) / "resolved_config.json")
        << trainer.config().to_json().dump(2) << "\n";
  }
  log::info("model: {} parameters, {} layers, hidden {}, heads {} (kv {})", c.model.num_parameters(),
            c.model.num_hidden_layers, c.model.hidden_size, c.model.num_attention_heads, c.model.num_key_value_heads);
  if (o.resume.empty()) {
    // A new run must not mix its checkpoints (and their rotation) with an earlier run's.
    const auto existing = trainer.checkpoints().list();
    DS_CHECK(existing.empty(),
             "{} already holds checkpoints (newest: {}); continue that run with --resume auto, or choose another "
             "output.dir or checkpoint.dir",
             trainer.config().checkpoint.dir, existing.front());
  }
  const bool resumed = !o.resume.empty() && trainer.resume(o.resume);
  if (!resumed) trainer.init_weights(o.init_from);
  const Trainer::Outcome outcome = trainer.train();
  // Batch scripts learn what happened from this file rather than from the launcher's status.
  auto report = [&](const std::string& what) {
    if (!o.status_file.empty() && grid.world_rank() == 0) {
      std::ofstream(o.status_file) << what << " " << trainer.step() << "\n";
    }
  };
  if (outcome == Trainer::Outcome::StoppedOnSignal) {
    report("stopped");
    return kExitStoppedForRequeue;
  }
  if (!trainer.config().generate.prompt.empty()) {
    log::info("sample: {}", trainer.sample(trainer.config().generate.prompt));
  }
  if (!trainer.config().output.save_hf.empty()) trainer.save_hf(trainer.config().output.save_hf);
  report("completed");
  return 0;
}

int cmd_eval(const Options& o) {
  using namespace dstrain;
  RunConfig c = load_config(o);
  ProcessGrid grid(MPI_COMM_WORLD, c.parallel);
  Trainer trainer(c, grid, choose_device(c, grid));
  print_header(trainer.config(), "eval", grid);
  trainer.init_weights(o.init_from);
  const LossSums s = trainer.evaluate(trainer.config().train.eval_batches);
  log::info("eval loss {:.6f}, accuracy {:.2f}% over {} tokens ({} windows of {})", s.mean(), 100 * s.accuracy(),
            s.count, s.count / trainer.config().data.seq_len, trainer.config().data.seq_len);
  return 0;
}

int cmd_generate(const Options& o) {
  using namespace dstrain;
  RunConfig c = load_config(o);
  ProcessGrid grid(MPI_COMM_WORLD, c.parallel);
  Trainer trainer(c, grid, choose_device(c, grid));
  print_header(trainer.config(), "generate", grid);
  trainer.init_weights(o.init_from);
  const std::string text = trainer.sample(trainer.config().generate.prompt);
  log::info("{}{}", trainer.config().generate.prompt, text);
  return 0;
}

// The layout checks of a job of N ranks, without starting it: one process, no model allocated,
// no data read.
int cmd_validate(const Options& o) {
  using namespace dstrain;
  RunConfig c = load_config(o);
  CheckedLayout layout;
  try {
    layout = check_layout(c, int(o.ranks));
  } catch (const Error& e) {
    // The same on every rank: no abort needed.
    if (log::rank() == 0) std::fprintf(stderr, "error: %s: not a valid layout for %lld ranks: %s\n", o.config.c_str(),
                                       static_cast<long long>(o.ranks), e.what());
    return 1;
  }
  if (log::rank() == 0) {
    std::printf("%s: a valid layout for %lld ranks\n", o.config.c_str(), static_cast<long long>(o.ranks));
    std::printf("  model: %s, %.2fB parameters, %lld layers\n", c.model.model_type.c_str(),
                double(c.model.num_parameters()) / 1e9, static_cast<long long>(c.model.num_hidden_layers));
    for (const std::string& line : layout.describe(c)) std::printf("  %s\n", line.c_str());
    const double bytes = model_state_bytes_per_rank(c, layout.sizes.data);
    std::printf("  model state per rank (weights, gradients, AdamW; layers spread evenly over the stages): %.1f GB "
                "at ZeRO stage %lld, %s\n",
                bytes / 1e9, static_cast<long long>(c.train.zero.stage), c.train.precision.name().c_str());
  }
  return 0;
}

// `dstrain train --dry-run`: the memory model's per-rank estimate (train/memory_model.h) for a
// job of --ranks ranks (default: the ranks it runs on), checked against the memory budget,
// without allocating the model or reading data. One process does it all.
int cmd_dry_run(const Options& o) {
  using namespace dstrain;
  RunConfig c = load_config(o);
  int world = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  const int ranks = o.ranks > 0 ? int(o.ranks) : world;
  if (log::rank() != 0) return 0;
  MemoryEstimate e;
  try {
    check_layout(c, ranks);  // resolves the batch for the header below
    e = estimate_memory(c, ranks);
  } catch (const Error& err) {
    std::fprintf(stderr, "error: %s: not a valid layout for %d ranks: %s\n", o.config.c_str(), ranks, err.what());
    return 1;
  }
  const double budget = c.metrics.memory_budget_gb > 0 ? c.metrics.memory_budget_gb * 1e9 : node_memory_bytes();
  const ActivationCheckpointingConfig& ac = c.train.activation_checkpointing;
  std::printf("%s: memory per rank for %d ranks, %s, ZeRO stage %lld, activation recomputation %s, micro-batch %lld "
              "x %lld tokens, %lld accumulation steps (one step of each pipeline stage's rank run on the meta device)\n",
              o.config.c_str(), ranks, c.train.precision.name().c_str(), static_cast<long long>(c.train.zero.stage),
              ac.granularity.c_str(), static_cast<long long>(c.train.micro_batch),
              static_cast<long long>(c.data.seq_len), static_cast<long long>(c.train.grad_accum));
  for (const std::string& line : describe_memory(e)) std::printf("  %s\n", line.c_str());
  const RankMemory& top = e.largest();
  if (c.parallel.expert > 1) {
    std::printf("  expert parallelism %lld: the rank run receives %.2f x a balanced share of the routed rows in every "
                "MoE layer (metrics.expert_imbalance; a run reports what each layer meets as "
                "moe.<layer>.received_max_over_mean)\n",
                static_cast<long long>(c.parallel.expert), c.metrics.expert_imbalance);
  }
  std::printf("  beside the peak: up to %.1f MB of collectives in flight (the communication library's temporaries, "
              "\"library\"), and this process itself (code, libraries, MPI, the GEMM library's buffers after one GEMM of the model's widths) holds %.1f MB resident\n",
              double(top.library_peak) / 1e6, double(process_resident_bytes(c)) / 1e6);
  const bool fits = double(top.peak_total) < budget;
  std::printf("  peak %.1f MB on rank %d (pipeline stage %d) against %.1f MB %s: %s\n", double(top.peak_total) / 1e6,
              top.ranks.front(), top.pipeline, budget / 1e6,
              c.metrics.memory_budget_gb > 0 ? "of metrics.memory_budget_gb" : "of this node's memory",
              fits ? "fits"
                   : ac.full() ? "does not fit; raise ZeRO's stage, add data-parallel ranks or lower the micro-batch"
                               : "does not fit; try train.activation_checkpointing.granularity \"full\" (about a "
                                 "third more compute), a higher ZeRO stage or a smaller micro-batch");
  return fits ? 0 : 1;
}

int run(int argc, char** argv) {
  CLI::App app{"dstrain: train DeepSeek-family language models on CPUs and GPUs with MPI"};
  app.require_subcommand(1);
  Options o;
  auto common = [&](CLI::App* sub, bool need_init) {
    sub->add_option("--config", o.config, "run configuration (JSON)")->required()->check(CLI::ExistingFile);
    auto* init = sub->add_option("--init-from", o.init_from,
                                 "initial weights: a Hugging Face directory (safetensors) or a .safetensors file");
    if (need_init) init->required();
    sub->add_option("--set", o.overrides, "override a configuration key, e.g. train.optimizer.params.lr=3e-4")
        ->take_all()
        ->check(set_assignment());
  };
  CLI::App* train = app.add_subcommand("train", "train a model");
  common(train, false);
  train->add_option("--save-hf", o.save_hf, "write Hugging Face weights (safetensors + config.json) here at the end");
  train->add_option("--max-steps", o.max_steps, "optimizer steps to run (overrides train.max_steps)")
      ->check(cli::integer_in(0));
  train->add_option("--status-file", o.status_file,
                    "rank 0 writes 'completed STEP' or 'stopped STEP' here when training ends (for batch scripts)");
  train->add_flag("--dry-run", o.dry_run,
                  "print each rank's memory by category (the memory model) and whether it fits, without training");
  train->add_option("--ranks", o.ranks, "with --dry-run: ranks of the job (default: the ranks it runs on)")
      ->check(cli::integer_in(1));
  train->add_option("--resume", o.resume,
                    "continue from a checkpoint: 'auto' (the newest valid one in checkpoint.dir) or a file");
  CLI::App* eval = app.add_subcommand("eval", "mean loss over the first windows of the evaluation data");
  common(eval, true);
  eval->add_option("--batches", o.eval_batches, "micro-batches to evaluate (overrides train.eval_batches)")
      ->check(cli::integer_in(1));
  CLI::App* gen = app.add_subcommand("generate", "continue a prompt");
  common(gen, true);
  gen->add_option("--prompt", o.prompt, "text to continue")->required();
  gen->add_option("--max-new-tokens", o.max_new_tokens, "tokens to generate")->check(cli::integer_in(1));
  gen->add_option("--temperature", o.temperature, "0 for greedy decoding")->check(cli::finite_at_least(0));
  gen->add_option("--top-k", o.top_k, "sample among the k most likely tokens (0: all)")->check(cli::integer_in(0));
  gen->add_option("--seed", o.seed, "sampling seed")->check(cli::integer_in(0));
  CLI::App* validate = app.add_subcommand("validate", "check a run configuration's layout for a job of N ranks "
                                                      "without starting it");
  validate->add_option("--config", o.config, "run configuration (JSON)")->required()->check(CLI::ExistingFile);
  validate->add_option("--ranks", o.ranks, "ranks of the job (GPUs, or CPU processes)")
      ->required()
      ->check(cli::integer_in(1));
  validate->add_option("--set", o.overrides, "override a configuration key, e.g. parallel.pipeline=16")
      ->take_all()
      ->check(set_assignment());

  cli::PlanOptions plan_options;
  CLI::App* plan = cli::add_plan_command(app, plan_options);
  cli::CalibrateOptions calibrate_options;
  CLI::App* calibrate = cli::add_calibrate_command(app, calibrate_options);
  cli::StatusOptions status_options;
  CLI::App* status = cli::add_status_command(app, status_options);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // Usage messages once per job, not once per rank; every rank ends with the same status.
    const bool quiet = dstrain::log::rank() != 0;
    for (const CLI::App* sub : {train, eval, gen, validate, plan, calibrate, status}) {
      if (sub->parsed()) return cli::report(app, e, "dstrain", "dstrain " + sub->get_name(), quiet);
    }
    if (argc < 2) {
      return cli::report("dstrain", "no command given; the commands are train, eval, generate, validate, plan, calibrate and status", "dstrain", quiet);
    }
    if (argv[1][0] == '-' || e.get_exit_code() == 0) return cli::report(app, e, "dstrain", "dstrain", quiet);
    return cli::report(
        "dstrain", fmt::format("unknown command '{}'; the commands are train, eval, generate, validate, plan, calibrate and status", argv[1]), "dstrain",
        quiet);
  }
  if (train->parsed()) return o.dry_run ? cmd_dry_run(o) : cmd_train(o);
  if (eval->parsed()) return cmd_eval(o);
  if (validate->parsed()) return cmd_validate(o);
  if (plan->parsed()) return cli::cmd_plan(plan_options);
  if (calibrate->parsed()) return cli::cmd_calibrate(calibrate_options);
  if (status->parsed()) return cli::cmd_status(status_options);
  return cmd_generate(o);
}

}  // namespace

int main(int argc, char** argv) {
  // Before any thread exists, so that none is interrupted by a stop signal: one thread of its
  // own takes them (train/resilience.h).
  dstrain::block_stop_signals();
  dstrain::listen_for_stop_signals(dstrain::StopSignalMode::kTerminate);
  // MPI first, then Kokkos; torn down in reverse.
  // Communicators run their collectives on worker threads: MPI must allow every thread.
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  dstrain::log::set_rank(rank, world);
  Kokkos::initialize(argc, argv);
  int rc = 0;
  try {
    rc = run(argc, argv);
  } catch (const std::exception& e) {
    dstrain::log::error_line(e.what());
    std::fflush(stdout);
    // Ends every rank of the job: no rank is left waiting in a collective.
    MPI_Abort(MPI_COMM_WORLD, 1);
    rc = 1;
  }
  dstrain::Watchdog::instance().stop();
  dstrain::stop_listening_for_stop_signals();
  Kokkos::finalize();
  MPI_Finalize();
  return rc;
}
