// `dstrain calibrate`: a hardware profile (plan/hardware.h) measured on the machine it runs on,
// for the shapes of a model.
//
//   ops          the model's step is traced (train/memory_model.h's trace_step) at tensor sizes
//                1, 2, 4 and 8 (those that divide the heads and the job), in each precision
//                asked for; every distinct GEMM and attention shape, and the element-wise ops
//                that can run on any values (norms, SwiGLU, adds, casts, AdamW), run on this
//                machine's backend on rank 0 alone (the others wait), median of repeats.
//   fits         per op class and dtype, least squares (Eigen) of seconds on 1, FLOPs and
//                bytes: what prices a shape that was not measured.
//   collectives  through dstrain's own MPI communicators, over groups of every size that
//                divides the job (contiguous ranks, all groups at once, as the axes run them):
//                all-reduce, all-gather, reduce-scatter, all-to-all and send, 4 KiB up to a
//                limit; alpha-beta fits per kind and group size (Eigen).
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "plan/hardware.h"
#include "train/run_config.h"

namespace dstrain {

struct CalibrationSettings {
  std::vector<std::string> precisions = {"fp32", "bf16"};
  double seconds_per_op = 0.3;  // measuring each op shape
  int64_t max_collective_bytes = int64_t(64) << 20;
};

// Collective over `world`; every rank returns the same profile.
HardwareProfile calibrate(const RunConfig& config, MPI_Comm world, const CalibrationSettings& s);

// Least squares of y on the columns of x (rows: samples) with non-negative coefficients (a
// negative one is dropped and the rest refitted).
std::vector<double> fit_nonnegative(const std::vector<std::vector<double>>& x, const std::vector<double>& y);

}  // namespace dstrain
