#include "distributed/param_hooks.h"

#include <algorithm>

#include "core/error.h"

namespace dstrain {

void ParamHookChain::add(ParamHooks& hook) {
  DS_CHECK(&hook != this, "a parameter hook chain cannot contain itself");
  DS_CHECK(std::find(hooks_.begin(), hooks_.end(), &hook) == hooks_.end(),
           "parameter hook added twice to one chain: each of its calls would run twice");
  hooks_.push_back(&hook);
}

void ParamHookChain::before_use(int first, int last) {
  for (ParamHooks* h : hooks_) h->before_use(first, last);
}

void ParamHookChain::after_use(int first, int last) {
  for (ParamHooks* h : hooks_) h->after_use(first, last);
}

void ParamHookChain::grad_ready(int first, int last) {
  for (ParamHooks* h : hooks_) h->grad_ready(first, last);
}

}  // namespace dstrain
