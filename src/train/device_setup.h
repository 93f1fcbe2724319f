// Which device a rank trains on, from the run configuration's "device": the host, or one GPU
// per rank chosen by the node-local rank (CUDA_VISIBLE_DEVICES applies: a rank that sees one GPU
// uses it). Prints the GPU and the versions under it, and checks them across ranks.
#pragma once

#include "comm/grid.h"
#include "core/device.h"
#include "train/run_config.h"

namespace dstrain {

// Collective over the world. Errors, on every rank, name the key and the fix: "cuda" in a build
// without CUDA, a node with more ranks than visible GPUs, ranks on different CUDA or NCCL versions.
Device choose_device(const RunConfig& config, ProcessGrid& grid);

}  // namespace dstrain
