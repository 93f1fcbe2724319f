// The schedule's timeline: for the steps asked (metrics.timeline_steps), every rank records the
// start and end of each forward, backward and weight-gradient chunk, each send and receive and
// the gradient reduction's finish, and writes them to timeline.rank{r}.jsonl in the run's output
// directory; validation/plot_pipeline.py draws them per rank (a Gantt chart and a Chrome trace)
// and measures the pipeline bubble against the analytic 1F1B figure.
#pragma once

#include <cstdint>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

#include "core/clock.h"
#include "core/json_reader.h"
#include "distributed/schedule.h"

namespace dstrain {

// Which optimizer steps are recorded (metrics.timeline_steps): an integer N, the N steps after
// the first step this process trains (that first one warms caches and allocators up), or a
// list of step numbers (1-based, as in metrics.jsonl). 0 or []: off.
struct TimelineSteps {
  int64_t first_n = 0;
  std::vector<int64_t> steps;
  bool enabled() const { return first_n > 0 || !steps.empty(); }
  // Whether `step` is recorded by a process whose first trained step is `first_step`.
  bool contains(int64_t step, int64_t first_step) const;
  // Reads r[key]; a wrong type or a step below 1 is an error naming the key.
  static TimelineSteps from_json(const JsonReader& r, const std::string& key);
  json to_json() const;  // N, or the list when one was given
};

struct TimelineEvent {
  std::string kind;      // "F", "B", "BI", "BW", "send", "recv", "reduce"
  int64_t step = 0;      // the optimizer step (1-based)
  int micro_batch = -1;  // -1: not about one micro-batch (the reduction)
  int chunk = 0;         // the model chunk (virtual stage) of interleaved schedules; 0 otherwise
  int peer = -1;         // send/recv: the other rank; -1 otherwise
  double start = 0;      // seconds since the timeline's origin
  double end = -1;       // < 0 while the event is open
};

// One rank's recorder. The origin is the run's start, taken by every rank right after a
// common barrier (Trainer::train): the ranks' steady clocks are aligned by that barrier, to
// within its exit skew (microseconds on one node), not by MPI_Wtime offsets.
//
// File format (JSON lines): the first line is the header object given to the constructor with
// "type": "timeline" and "version": 1 added (the trainer writes rank, world, stage, stages,
// micro_batches, schedule, clock); then one object per event, {"kind", "step",
// "micro_batch", "chunk", "peer", "start", "end"}, times in seconds since the origin, in
// order of start within each step, written and flushed when the step ends.
class Timeline {
 public:
  Timeline(TimelineSteps steps, int64_t first_step, const std::string& path, json header,
           Clock::time_point origin);

  bool recording(int64_t step) const { return steps_.contains(step, first_step_); }
  const std::string& path() const { return path_; }
  double now() const;  // seconds since the origin

  // Opens an event (started now) and returns its id for end(); events may nest or overlap.
  // Thread-safe, as are end() and end_step() (a communication thread may record).
  int64_t begin(const std::string& kind, int64_t step, int micro_batch, int chunk = 0, int peer = -1);
  void end(int64_t id);
  // Writes the step's closed events in order of start and flushes the file; an event still
  // open (an asynchronous send) is written when a later step ends after it closed.
  void end_step(int64_t step);
  // Drops the step's events (a step run again with a smaller micro-batch).
  void discard_step(int64_t step);

  // Records one event from construction to destruction; inert when `timeline` is null or the
  // step is not recorded.
  class Scope {
   public:
    Scope(Timeline* timeline, const std::string& kind, int64_t step, int micro_batch, int chunk = 0, int peer = -1);
    // A schedule action: kind "F", "B", "BI" or "BW", its micro-batch and chunk.
    Scope(Timeline* timeline, int64_t step, const ScheduleAction& action);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Timeline* timeline_ = nullptr;
    int64_t id_ = -1;
  };

 private:
  struct Open {
    int64_t id;
    TimelineEvent event;
  };
  TimelineSteps steps_;
  int64_t first_step_;
  std::string path_;
  Clock::time_point origin_;
  std::ofstream out_;
  std::mutex mutex_;
  int64_t next_id_ = 0;
  std::vector<Open> events_;  // not yet written, in order of begin (and so of start)
};

// "F", "B", "BI" or "BW".
const char* timeline_kind(ScheduleAction::Kind kind);
// The action's chunk when ScheduleAction has one (interleaved schedules), 0 otherwise.
template <class A>
int chunk_of(const A& a) {
  if constexpr (requires { a.chunk; }) {
    return int(a.chunk);
  } else {
    return 0;
  }
}

}  // namespace dstrain
