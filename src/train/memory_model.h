// The memory model: what each rank of a job holds, by allocator category, at its peak in a
// training step, for any configuration and layout, without allocating the model.
//
// It is not a formula beside the code. For each distinct rank it builds the rank's piece of
// the model (its tensor piece, experts and pipeline chunks), the distributed optimizer (its
// ZeRO stage and offload) and the parallel axes' hooks on the meta device (backend/meta.h),
// then runs one step of the rank's schedule through them: the forwards and backwards of the
// step's micro-batches in the schedule's order (through the pipeline runner on a pipeline),
// with the recompute policy, the gradient reduction and the optimizer step. Every buffer that
// the run would allocate is allocated on the meta device and counted by the allocator's
// accounting; the model reads that accounting. Activations therefore come from the layers'
// own saves, and the micro-batches in flight from the schedule itself.
//
// The collectives run over communicators of the right sizes that move nothing. The MoE layers
// route nothing: every token rank sends each expert its share of the routed rows, and under
// expert parallelism the rank run is the hot one, whose experts receive
// metrics.expert_imbalance x that share in every MoE layer (1: balanced; a run reports what
// each layer met as moe.<layer>.received_max_over_mean). Ranks that differ
// only by their tensor, expert or data coordinate hold the same shapes (up to a row of a ZeRO
// shard), so one rank per pipeline stage is run and stands for the others.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/buffer.h"
#include "core/exec_trace.h"
#include "model/transformer.h"
#include "train/run_config.h"

namespace dstrain {

// The recompute policy train.activation_checkpointing asks for.
RecomputePolicy recompute_policy(const ActivationCheckpointingConfig& ac);

// One pipeline stage's ranks and what each of them holds.
struct RankMemory {
  int pipeline = 0;             // pipeline coordinate
  std::vector<int> ranks;       // the world ranks it stands for
  std::string chunks;           // "layers 0-3 + head", ...
  int micro_batches_in_flight = 0;  // the most forwards whose backward had not run, over its chunks
  // Bytes per category (core/buffer.h) at that category's own peak during the step, and the
  // peak of all of them together (what the device must have).
  std::array<int64_t, size_t(MemCategory::kCount)> peak{};
  int64_t peak_total = 0;
  // Bytes held between steps (weights, gradients, optimizer state, pooled buffers).
  int64_t held_after_step = 0;
  // Outside dstrain's allocator: the most bytes of collectives in flight at once, for which the
  // communication library holds temporaries (an MPI reduction allocates one of the message's
  // size); what a host's RSS adds to peak_total, beside the process itself.
  int64_t library_peak = 0;
};

struct MemoryEstimate {
  std::vector<RankMemory> stages;  // one per pipeline coordinate
  int world = 1;
  // The largest peak_total of any rank, and which stage has it.
  int64_t peak_total() const;
  const RankMemory& largest() const;
  // The stage of world rank r.
  const RankMemory& of_rank(int r) const;
};

// The model's estimate for `config` (its batch and layout resolved by check_layout) on a job of
// `world` ranks. Throws what the layout check throws.
MemoryEstimate estimate_memory(const RunConfig& config, int world);
// The same for the stage of world rank `rank` only (what one rank of a running job needs).
RankMemory estimate_rank_memory(const RunConfig& config, int world, int rank);

// One step of each pipeline stage's rank as estimate_memory runs it, with the execution trace
// of that rank's steady-state step (core/exec_trace.h): its ops, collectives and the schedule's
// actions, in order. What the performance model (plan/perf_model.h) prices.
struct StageTrace {
  RankMemory memory;
  ExecTrace trace;
};
std::vector<StageTrace> trace_step(const RunConfig& config, int world);

// What this process holds resident outside dstrain's allocator once the compute library has
// worked (code, libraries, MPI, the GEMM library's packing buffers, warmed by one host GEMM of
// the model's widths): the part of a training process's RSS the estimate leaves out, beside
// RankMemory::library_peak. Measured, so only meaningful in a process like the run's.
int64_t process_resident_bytes(const RunConfig& config);

// The table `dstrain train --dry-run` prints: per stage, each category's peak, the peak in all,
// what is held between steps, in MB.
std::vector<std::string> describe_memory(const MemoryEstimate& e);

}  // namespace dstrain
