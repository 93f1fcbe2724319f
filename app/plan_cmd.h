// `dstrain plan` and `dstrain calibrate`: the performance model's commands (src/plan/).
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace dstrain::cli {

struct PlanOptions {
  std::string config;   // --config: one run configuration (its layout is priced)
  std::string model;    // --model: a config.json; every layout is enumerated
  std::string cluster;  // --cluster: a hardware profile
  std::string check;    // --check RUN.json: the trainer's checks and memory per rank role
  int64_t ranks = 0;
  int64_t global_batch = 0;
  int64_t seq = 0;
  int64_t top = 10;
  std::string precision = "bf16";
  bool explain = false;
  bool json = false;
  bool fp8_gemms = false;
  bool short_trace = false;
  std::vector<std::string> overrides;
  std::vector<int> tensor, pipeline, expert, zero, micro_batch;
  std::vector<std::string> schedules, recompute;
};

CLI::App* add_plan_command(CLI::App& app, PlanOptions& o);
int cmd_plan(const PlanOptions& o);

struct CalibrateOptions {
  std::string config;
  std::string out;
  std::vector<std::string> overrides;
  std::vector<std::string> precisions = {"fp32", "bf16"};
  double seconds_per_op = 0.3;
  int64_t max_collective_bytes = int64_t(64) << 20;
};

CLI::App* add_calibrate_command(CLI::App& app, CalibrateOptions& o);
// Collective: every rank of the job takes part (the collectives are measured across them).
int cmd_calibrate(const CalibrateOptions& o);

}  // namespace dstrain::cli
