// `dstrain status RUN_DIR`: a live or finished run seen from its output.dir (metrics.jsonl, the
// lock file, the checkpoints), on a terminal or as JSON. It reads only: no lock, no file written.
#pragma once

#include <CLI/CLI.hpp>

#include <string>
#include <vector>

namespace dstrain::cli {

struct StatusOptions {
  std::string run_dir;             // the run's output.dir
  std::vector<std::string> watch;  // --watch [SECONDS]: given without a value, 2 s
  bool json = false;
};

CLI::App* add_status_command(CLI::App& app, StatusOptions& o);
// One process (rank 0 of a job, where one is started under mpirun) reads and prints.
int cmd_status(const StatusOptions& o);

}  // namespace dstrain::cli
