#include "train/device_setup.h"

#include <cstdlib>

#include "backend/cuda_device.h"
#include "core/error.h"
#include "core/log.h"

namespace dstrain {
namespace {

// The same verdict on every rank: a message from any rank is raised by all.
void raise_if_any(Communicator& world, const std::string& mine) {
  const std::vector<std::string> all = all_gather_strings(world, mine);
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].empty()) throw Error(fmt::format("rank {}: {}", r, all[r]));
  }
}

}  // namespace

Device choose_device(const RunConfig& config, ProcessGrid& grid) {
  Communicator& world = grid.world();
  if (config.device == "cpu") {
    const int gpus = cuda::device_count();
    if (gpus > 0 && grid.world_rank() == 0) {
      log::info("device: the host ({} GPU(s) visible on this node: set \"device\": \"cuda\" to train on them)", gpus);
    }
    return Device::cpu();
  }
  // "cuda": one GPU per rank.
  std::string problem;
  int index = 0;
  const int gpus = cuda::device_count();
  if (gpus == 0) {
    problem = fmt::format("\"device\": \"cuda\" in {}, but {}; set \"device\": \"cpu\" or run where GPUs are",
                          config.source, cuda::unavailable_reason());
  } else if (gpus == 1) {
    index = 0;  // a rank restricted to its own GPU (Slurm's --gpus-per-task, CUDA_VISIBLE_DEVICES)
  } else if (grid.local_rank() < gpus) {
    index = grid.local_rank();
  } else {
    const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
    problem = fmt::format("{} ranks run on this node but it shows {} GPUs (CUDA_VISIBLE_DEVICES={}): dstrain runs one "
                          "rank per GPU; start at most {} ranks per node (e.g. srun --ntasks-per-node={})",
                          grid.local_size(), gpus, visible ? visible : "unset", gpus, gpus);
  }
  raise_if_any(world, problem);
  Device d;
  try {
    d = cuda::use_device(index);
  } catch (const Error& e) {
    problem = e.what();
  }
  raise_if_any(world, problem);
  // What each rank runs on; ranks must agree on the software (NCCL refuses mixed versions, and
  // mixed GPUs make the slowest set the pace).
  const std::string mine = cuda::describe(index);
  const std::vector<std::string> all = all_gather_strings(world, mine);
  const auto software = [](const std::string& s) {
    const size_t p = s.find("), ");
    return p == std::string::npos ? s : s.substr(p + 3);
  };
  bool same_software = true, same_gpu = true;
  for (const std::string& s : all) {
    same_software = same_software && software(s) == software(all[0]);
    same_gpu = same_gpu && s == all[0];
  }
  if (!same_software) {
    std::string lines;
    for (size_t r = 0; r < all.size(); ++r) lines += fmt::format("\n  rank {}: {}", r, all[r]);
    throw Error(fmt::format("ranks run different CUDA/NCCL software:{}\n  every node must have the same driver, CUDA "
                            "runtime and NCCL (rebuild dstrain against one toolkit and load the same modules)",
                            lines));
  }
  if (grid.world_rank() == 0) {
    log::info("device: GPU {} on each of {} rank(s): {}", index, grid.world_size(), all[0]);
    if (!same_gpu) {
      std::string lines;
      for (size_t r = 0; r < all.size(); ++r) lines += fmt::format("\n  rank {}: {}", r, all[r]);
      log::warn("ranks run on different GPUs; the slowest sets the pace:{}", lines);
    }
  }
  return d;
}

}  // namespace dstrain
