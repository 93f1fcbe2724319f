// Which data-parallel communicator each parameter group's gradients are reduced (and, later,
// its ZeRO shards spread) over. Dense parameters are replicated on every data-parallel rank;
// routed experts only on the ranks that hold the same experts (ProcessGrid::expert_data()).
// The binding is made once, from the grid, and passed to whoever reduces or shards.
#pragma once

#include <array>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/grid.h"
#include "state/params.h"

namespace dstrain {

// Holds the communicators, not owns them: the grid's outlive every user of the binding.
class ParamGroupComms {
 public:
  // Every group over one communicator (no expert parallelism, or a test).
  explicit ParamGroupComms(Communicator& all) : ParamGroupComms(all, all) {}
  ParamGroupComms(Communicator& dense, Communicator& expert) : comms_{&dense, &expert} {}
  // Dense over the data axis, expert over the ranks holding the same experts. Without expert
  // parallelism expert_data() holds the data axis's ranks in the same order, and both groups
  // share the data communicator: their gradients then go in the buckets of one communicator,
  // as before groups existed (other bucket boundaries would change the all-reduce sizes, with
  // them MPI's reduction algorithm, and so the last bits of the sums).
  static ParamGroupComms from_grid(ProcessGrid& grid) {
    if (grid.size(Axis::Expert) == 1) return ParamGroupComms(grid.comm(Axis::Data));
    return {grid.comm(Axis::Data), grid.expert_data()};
  }

  Communicator& comm(ParamGroup g) const { return *comms_[index(g)]; }
  // Both groups over one communicator.
  bool shared() const { return comms_[0] == comms_[1]; }
  // The distinct communicators, each once, in group order.
  std::vector<Communicator*> distinct() const;
  // "dense over data (4 ranks), expert over expert_data (2 ranks)"
  std::string describe() const;

 private:
  static size_t index(ParamGroup g) { return g == ParamGroup::Expert ? 1 : 0; }
  std::array<Communicator*, 2> comms_;
};

}  // namespace dstrain
