#include "train/timeline.h"

#include <algorithm>

#include "core/error.h"

namespace dstrain {

bool TimelineSteps::contains(int64_t step, int64_t first_step) const {
  if (first_n > 0 && step > first_step && step <= first_step + first_n) return true;
  return std::find(steps.begin(), steps.end(), step) != steps.end();
}

TimelineSteps TimelineSteps::from_json(const JsonReader& r, const std::string& key) {
  TimelineSteps t;
  if (!r.has(key)) return t;
  const json& v = r.raw(key);
  const std::string expected =
      "must be an integer N (the N steps after the first step of the run) or a list of step numbers (1-based); "
      "0 or [] turns the timeline off";
  if (v.is_number_integer()) {
    if (v.get<int64_t>() < 0) r.error(key, fmt::format("{}, got {}", expected, v.dump()));
    t.first_n = v.get<int64_t>();
  } else if (v.is_array()) {
    for (const json& s : v) {
      if (!s.is_number_integer() || s.get<int64_t>() < 1) {
        r.error(key, fmt::format("{}, got {} in the list", expected, s.dump()));
      }
      t.steps.push_back(s.get<int64_t>());
    }
    std::sort(t.steps.begin(), t.steps.end());
    t.steps.erase(std::unique(t.steps.begin(), t.steps.end()), t.steps.end());
  } else {
    r.error(key, fmt::format("{}, got {}", expected, v.dump()));
  }
  return t;
}

json TimelineSteps::to_json() const { return steps.empty() ? json(first_n) : json(steps); }

Timeline::Timeline(TimelineSteps steps, int64_t first_step, const std::string& path, json header,
                   Clock::time_point origin)
    : steps_(std::move(steps)), first_step_(first_step), path_(path), origin_(origin), out_(path, std::ios::trunc) {
  DS_CHECK(out_, "cannot write the timeline {}: check that the output directory is writable", path);
  header["type"] = "timeline";
  header["version"] = 1;
  out_ << header.dump() << '\n';
  out_.flush();
}

double Timeline::now() const { return std::chrono::duration<double>(Clock::now() - origin_).count(); }

int64_t Timeline::begin(const std::string& kind, int64_t step, int micro_batch, int chunk, int peer) {
  const double t = now();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = next_id_++;
  events_.push_back({id, TimelineEvent{kind, step, micro_batch, chunk, peer, t, -1}});
  return id;
}

void Timeline::end(int64_t id) {
  const double t = now();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto it = events_.rbegin(); it != events_.rend(); ++it) {
    if (it->id == id) {
      it->event.end = t;
      return;
    }
  }
}

void Timeline::end_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Open> kept;
  std::vector<const TimelineEvent*> done;
  for (const Open& o : events_) {
    if (o.event.end >= 0 && o.event.step <= step) done.push_back(&o.event);
  }
  // begin() appends in order of start already; a stable sort keeps it for events whose start
  // times tie.
  std::stable_sort(done.begin(), done.end(),
                   [](const TimelineEvent* a, const TimelineEvent* b) { return a->start < b->start; });
  for (const TimelineEvent* e : done) {
    out_ << json{{"kind", e->kind},   {"step", e->step}, {"micro_batch", e->micro_batch}, {"chunk", e->chunk},
                 {"peer", e->peer},   {"start", e->start}, {"end", e->end}}
                .dump()
         << '\n';
  }
  out_.flush();
  DS_CHECK(out_, "writing the timeline {} failed (disk full?)", path_);
  for (Open& o : events_) {
    if (!(o.event.end >= 0 && o.event.step <= step)) kept.push_back(std::move(o));
  }
  events_ = std::move(kept);
}

void Timeline::discard_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(events_, [&](const Open& o) { return o.event.step == step; });
}

Timeline::Scope::Scope(Timeline* timeline, const std::string& kind, int64_t step, int micro_batch, int chunk,
                       int peer) {
  if (timeline && timeline->recording(step)) {
    timeline_ = timeline;
    id_ = timeline->begin(kind, step, micro_batch, chunk, peer);
  }
}

Timeline::Scope::Scope(Timeline* timeline, int64_t step, const ScheduleAction& action)
    : Scope(timeline, timeline_kind(action.kind), step, action.micro_batch, chunk_of(action)) {}

Timeline::Scope::~Scope() {
  if (timeline_) timeline_->end(id_);
}

const char* timeline_kind(ScheduleAction::Kind kind) {
  switch (kind) {
    case ScheduleAction::Kind::Forward:
      return "F";
    case ScheduleAction::Kind::Backward:
      return "B";
    case ScheduleAction::Kind::BackwardInput:
      return "BI";
    case ScheduleAction::Kind::BackwardWeight:
      return "BW";
  }
  return "?";
}

}  // namespace dstrain
