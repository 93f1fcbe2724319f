// An execution trace: what one rank's code did, in order, when it ran on the meta device
// (backend/meta.h) with communicators that move nothing (comm/shape_only_comm.h). Each op says
// its work (FLOPs, bytes its tensors span, the dtype of its kernel slot, its tensors' shapes);
// each collective its kind, payload and group, when it was issued and when it was waited for;
// marks say where the schedule's actions and the step's end began. The performance model
// (plan/perf_model.h) prices the events with a hardware profile and replays them on a clock.
//
// Recording is off unless a trace is installed (TraceScope); the code that records pays one
// atomic read per op when it is off.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace dstrain {

struct TraceEvent {
  enum class Kind {
    Op,       // a kernel: name, dtype, flops, bytes, shapes
    Issue,    // a collective started (non-blocking): id, collective, group, group_size, bytes
    Wait,     // the rank waited for collective `id`
    Action,   // a schedule action begins: action_kind (ScheduleAction::Kind), micro_batch, chunk
    Tail,     // the step's gradient reduction and optimizer begin (after the last action)
  };
  Kind kind = Kind::Op;
  const char* name = "";  // op or collective name (static strings)
  DType dtype = DType::F32;
  double flops = 0;
  double bytes = 0;
  std::vector<Shape> shapes;  // the op's tensor arguments in order (undefined ones as empty shapes)
  std::vector<DType> dtypes;  // and their dtypes
  // Op parameters a replay needs (attention: n_head, n_kv_head, qk_dim, v_dim, q_offset,
  // k_offset, v_offset, row_stride).
  std::vector<int64_t> extra;
  std::string group;           // communicator name ("tensor", "data", "expert", "expert_data", "pipeline")
  int group_size = 1;
  int id = -1;
  int action_kind = 0, micro_batch = 0, chunk = 0;
};

class ExecTrace {
 public:
  std::vector<TraceEvent> events;
  int next_id = 0;
  // Appends under a lock: ops run on worker threads too (a MoE layer's experts are spread over
  // OpenMP threads).
  void push(TraceEvent e);
  int new_id();

 private:
  std::shared_ptr<std::mutex> mutex_ = std::make_shared<std::mutex>();  // movable with the trace
};

// The trace being recorded, or nullptr when recording is off. One per process: whichever thread
// runs an op records it (the meta runs that record run one at a time).
ExecTrace* current_trace();

// Installs `trace` for the scope's life (nested scopes restore the outer one).
class TraceScope {
 public:
  explicit TraceScope(ExecTrace* trace);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  ExecTrace* previous_;
};

// Records a mark when a trace is installed.
void trace_action(int action_kind, int micro_batch, int chunk);
void trace_tail();

}  // namespace dstrain
