#include "core/exec_trace.h"

#include <atomic>

namespace dstrain {
namespace {
std::atomic<ExecTrace*> g_trace{nullptr};
}  // namespace

void ExecTrace::push(TraceEvent e) {
  std::lock_guard<std::mutex> lock(*mutex_);
  events.push_back(std::move(e));
}

int ExecTrace::new_id() {
  std::lock_guard<std::mutex> lock(*mutex_);
  return next_id++;
}

ExecTrace* current_trace() { return g_trace.load(std::memory_order_acquire); }

TraceScope::TraceScope(ExecTrace* trace) : previous_(g_trace.exchange(trace)) {}
TraceScope::~TraceScope() { g_trace.store(previous_); }

void trace_action(int action_kind, int micro_batch, int chunk) {
  ExecTrace* t = current_trace();
  if (!t) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Action;
  e.action_kind = action_kind;
  e.micro_batch = micro_batch;
  e.chunk = chunk;
  t->push(std::move(e));
}

void trace_tail() {
  ExecTrace* t = current_trace();
  if (!t) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Tail;
  t->push(std::move(e));
}

}  // namespace dstrain
