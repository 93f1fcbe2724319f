#include "core/exec_trace.h"

namespace dstrain {
namespace {
thread_local ExecTrace* g_trace = nullptr;
}  // namespace

ExecTrace* current_trace() { return g_trace; }

TraceScope::TraceScope(ExecTrace* trace) : previous_(g_trace) { g_trace = trace; }
TraceScope::~TraceScope() { g_trace = previous_; }

void trace_action(int action_kind, int micro_batch, int chunk) {
  if (!g_trace) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Action;
  e.action_kind = action_kind;
  e.micro_batch = micro_batch;
  e.chunk = chunk;
  g_trace->events.push_back(std::move(e));
}

void trace_tail() {
  if (!g_trace) return;
  TraceEvent e;
  e.kind = TraceEvent::Kind::Tail;
  g_trace->events.push_back(std::move(e));
}

}  // namespace dstrain
