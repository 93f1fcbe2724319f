// Several ParamHooks behind the one pointer a Ctx holds: ZeRO-3's gathers (before_use) and the
// gradient buckets (grad_ready) are separate hooks of the same model. Every call goes to each
// hook in the order the hooks were added, for before_use and grad_ready alike, so a hook added
// later sees what the earlier ones did (gathered weights, cast gradients).
#pragma once

#include <vector>

#include "model/ctx.h"

namespace dstrain {

class ParamHookChain final : public ParamHooks {
 public:
  ParamHookChain() = default;
  ParamHookChain(const ParamHookChain&) = delete;
  ParamHookChain& operator=(const ParamHookChain&) = delete;

  // Not owned: the hook must outlive the chain's use. A hook is added once.
  void add(ParamHooks& hook);
  int size() const { return int(hooks_.size()); }

  void before_use(int first, int last) override;
  void after_use(int first, int last) override;
  void grad_ready(int first, int last) override;

 private:
  std::vector<ParamHooks*> hooks_;
};

}  // namespace dstrain
