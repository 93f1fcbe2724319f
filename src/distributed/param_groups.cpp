#include "distributed/param_groups.h"

#include <fmt/format.h>

#include <algorithm>

namespace dstrain {

std::vector<Communicator*> ParamGroupComms::distinct() const {
  std::vector<Communicator*> out;
  for (Communicator* c : comms_) {
    if (std::find(out.begin(), out.end(), c) == out.end()) out.push_back(c);
  }
  return out;
}

std::string ParamGroupComms::describe() const {
  std::string s;
  for (ParamGroup g : {ParamGroup::Dense, ParamGroup::Expert}) {
    const Communicator& c = comm(g);
    s += fmt::format("{}{} over {} ({} rank{})", s.empty() ? "" : ", ", param_group_name(g), c.name(), c.size(),
                     c.size() == 1 ? "" : "s");
  }
  return s;
}

}  // namespace dstrain
