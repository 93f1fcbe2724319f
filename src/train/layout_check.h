// The start-up checks of a job's layout against its model and training configuration: the axis
// sizes for a number of ranks, each axis against what it splits (tensor: heads, FFN widths and
// vocabulary; expert: the routed experts; pipeline: the layers and the schedule's micro-batches;
// sequence parallelism: the token rows), and the batch over the data axis. No MPI and no
// allocation: the trainer runs them on every rank before it builds anything, and
// `dstrain validate --ranks N` runs them for a job of N ranks without starting it (a 2,048-GPU
// layout checked on a laptop). Errors name the configuration key and the sizes that would work.
#pragma once

#include <string>
#include <vector>

#include "comm/grid.h"
#include "model/stage.h"
#include "train/run_config.h"

namespace dstrain {

struct CheckedLayout {
  AxisSizes sizes;
  bool sequence_parallel = false;
  std::vector<StageSpec> stages;  // every model stage of the pipeline (empty: pipeline 1)
  // What each axis does to the model and the batch, one line each: what `dstrain validate`
  // prints.
  std::vector<std::string> describe(const RunConfig& config) const;
};

// Resolves parallel.data ("auto") and config.train's batch (micro-batches per data-parallel
// rank) for a job of `world` ranks, then checks every axis. Throws Error on the first problem.
CheckedLayout check_layout(RunConfig& config, int world);

// Bytes per rank of the weights, gradients and AdamW state at the configured precision and
// ZeRO stage over `dp` data-parallel ranks (the ZeRO paper's (2 + 2 + K)Psi and its sharded
// forms, with dstrain's fp32 weights and gradients), with the model split over the tensor,
// pipeline (evenly) and expert axes: what the run checks against the memory budget before it
// allocates anything, and what `dstrain validate` reports.
double model_state_bytes_per_rank(const RunConfig& config, int64_t dp);

}  // namespace dstrain
