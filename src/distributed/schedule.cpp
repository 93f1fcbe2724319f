#include "distributed/schedule.h"

#include <algorithm>
#include <functional>
#include <set>

#include <fmt/format.h>

#include "core/error.h"

namespace dstrain {
namespace {

using Kind = ScheduleAction::Kind;

ScheduleAction F(int mb, int chunk = 0) { return {Kind::Forward, mb, chunk}; }
ScheduleAction B(int mb, int chunk = 0) { return {Kind::Backward, mb, chunk}; }

void check_args(int stage, int n_stages, int n_micro) {
  DS_CHECK(n_stages >= 1 && stage >= 0 && stage < n_stages && n_micro >= 1,
           "schedule: stage {} of {} with {} micro-batches is not a valid step", stage, n_stages, n_micro);
}

bool is_backward_input(Kind k) { return k == Kind::Backward || k == Kind::BackwardInput; }
bool is_backward_weight(Kind k) { return k == Kind::Backward || k == Kind::BackwardWeight; }

}  // namespace

std::string to_string(const ScheduleAction& a) {
  const char* k = a.kind == Kind::Forward ? "F" : a.kind == Kind::Backward ? "B" : a.kind == Kind::BackwardInput ? "BI" : "BW";
  if (a.chunk == 0) return fmt::format("{}{}", k, a.micro_batch);
  return fmt::format("{}{}.{}", k, a.micro_batch, a.chunk);
}

std::vector<ScheduleAction> GradAccumulationSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  DS_CHECK(n_stages == 1, "the gradient-accumulation schedule runs one stage; with {} pipeline stages use 1f1b",
           n_stages);
  std::vector<ScheduleAction> out;
  for (int m = 0; m < n_micro; ++m) {
    out.push_back(F(m));
    out.push_back(B(m));
  }
  return out;
}

std::vector<ScheduleAction> AllForwardAllBackwardSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  std::vector<ScheduleAction> out;
  for (int m = 0; m < n_micro; ++m) out.push_back(F(m));
  for (int m = 0; m < n_micro; ++m) out.push_back(B(m));
  return out;
}

std::vector<ScheduleAction> OneFOneBSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  const int warmup = std::min(n_stages - stage - 1, n_micro);
  std::vector<ScheduleAction> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(F(f));
  while (f < n_micro) {
    out.push_back(F(f++));
    out.push_back(B(b++));
  }
  while (b < n_micro) out.push_back(B(b++));
  return out;
}

InterleavedOneFOneBSchedule::InterleavedOneFOneBSchedule(int virtual_stages) : v_(virtual_stages) {
  DS_CHECK(v_ >= 2, "the interleaved schedule needs at least 2 virtual stages (model chunks) per rank, got {}; with one "
           "chunk use 1f1b", v_);
}

std::vector<ScheduleAction> InterleavedOneFOneBSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  const int P = n_stages, V = v_, r = stage;
  DS_CHECK(n_micro % P == 0,
           "interleaved needs gradient_accumulation_steps divisible by the pipeline size P (micro-batches go through "
           "the chunks in groups of P, as in Megatron-Core): {} micro-batches with P = {}; use a multiple of {} or 1f1b",
           n_micro, P, P);
  // Virtual micro-batch k (0 .. V*m-1) in Megatron's order: groups of P micro-batches, each
  // group through chunk 0, then chunk 1, ...; backwards visit the chunks in reverse.
  const int total = V * n_micro;
  auto at = [&](int k, bool forward) {
    const int c = (k % (P * V)) / P;
    const int mb = (k / (P * V)) * P + k % P;
    return ScheduleAction{forward ? Kind::Forward : Kind::Backward, mb, forward ? c : V - 1 - c};
  };
  const int warmup = n_micro == P ? total : std::min((P - r - 1) * 2 + (V - 1) * P, total);
  std::vector<ScheduleAction> out;
  for (int k = 0; k < warmup; ++k) out.push_back(at(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(at(k + warmup, true));
    out.push_back(at(k, false));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(at(k, false));
  return out;
}

std::vector<ScheduleAction> DualPipeVSchedule::actions(int stage, int n_stages, int n_micro) const {
  check_args(stage, n_stages, n_micro);
  const int P = n_stages, r = stage;
  DS_CHECK(n_micro >= 2 * P,
           "dualpipev needs gradient_accumulation_steps of at least twice the pipeline size P: {} micro-batches with "
           "P = {}; use at least {} or 1f1b",
           n_micro, P, 2 * P);
  std::vector<ScheduleAction> out;
  int fwd[2] = {0, 0}, bwd[2] = {0, 0};
  std::vector<ScheduleAction> weights;  // queued weight-gradient parts, oldest first
  size_t next_weight = 0;
  auto f = [&](int c) { out.push_back(F(fwd[c]++, c)); };
  // Whole backward, or (zero bubble) its input part now and its weight part queued.
  auto b = [&](int c, bool split) {
    const int mb = bwd[c]++;
    if (!split) {
      out.push_back(B(mb, c));
      return;
    }
    out.push_back({Kind::BackwardInput, mb, c});
    weights.push_back({Kind::BackwardWeight, mb, c});
  };
  auto w = [&]() { out.push_back(weights[next_weight++]); };

  for (int i = 0; i < (P - r - 1) * 2; ++i) f(0);  // 1: forwards of chunk 0
  for (int i = 0; i < r + 1; ++i) {                // 2: forwards of both chunks
    f(0);
    f(1);
  }
  for (int i = 0; i < P - r - 1; ++i) {  // 3: B1 W F1
    b(1, true);
    w();
    f(1);
  }
  for (int i = 0; i < n_micro - 2 * P + r + 1; ++i) {  // 4: steady state, F0 with B1 and F1 with B0
    f(0);
    b(1, false);
    f(1);
    b(0, false);
  }
  for (int i = 0; i < P - r - 1; ++i) {  // 5: B1, F1 with B0
    b(1, false);
    f(1);
    b(0, false);
  }
  // 6: B1 B0, the second half split so their weight parts fill the cool-down.
  bool split = false;
  for (int i = 0; i < r + 1; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) split = true;
    b(1, split);
    if (i == (r + 1) / 2 && r % 2 == 0) split = true;
    b(0, split);
  }
  for (int i = 0; i < P - r - 1; ++i) {  // 7: W B0
    w();
    b(0, true);
  }
  while (next_weight < weights.size()) w();  // 8: the remaining weight parts (r + 1 of them)
  DS_CHECK(fwd[0] == n_micro && fwd[1] == n_micro && bwd[0] == n_micro && bwd[1] == n_micro,
           "dualpipev: rank {} of {} scheduled {}/{} forwards and {}/{} backwards of {} micro-batches", r, P, fwd[0],
           fwd[1], bwd[0], bwd[1], n_micro);
  return out;
}

std::unique_ptr<Schedule> make_schedule(const std::string& name, int virtual_stages) {
  if (name == "grad_accumulation") return std::make_unique<GradAccumulationSchedule>();
  if (name == "all_forward_all_backward") return std::make_unique<AllForwardAllBackwardSchedule>();
  if (name == "1f1b") return std::make_unique<OneFOneBSchedule>();
  if (name == "interleaved") return std::make_unique<InterleavedOneFOneBSchedule>(virtual_stages);
  if (name == "dualpipev") return std::make_unique<DualPipeVSchedule>();
  DS_FAIL("unknown pipeline schedule '{}': use grad_accumulation, all_forward_all_backward, 1f1b, interleaved (with "
          "virtual stages >= 2) or dualpipev", name);
}

std::unique_ptr<Schedule> make_schedule(const std::string& name) { return make_schedule(name, 1); }

std::vector<std::vector<int>> stage_map(const Schedule& s, int n_ranks) {
  std::vector<std::vector<int>> out{size_t(n_ranks)};
  for (int r = 0; r < n_ranks; ++r)
    for (int c = 0; c < s.chunks(); ++c) out[size_t(r)].push_back(s.model_stage(r, c, n_ranks));
  return out;
}

std::vector<std::vector<ScheduleAction>> schedule_table(const Schedule& s, int n_ranks, int n_micro) {
  std::vector<std::vector<ScheduleAction>> out;
  for (int r = 0; r < n_ranks; ++r) out.push_back(s.actions(r, n_ranks, n_micro));
  return out;
}

int peak_in_flight(const std::vector<ScheduleAction>& actions) {
  std::set<std::pair<int, int>> live;  // (chunk, micro-batch)
  size_t peak = 0;
  for (const ScheduleAction& a : actions) {
    if (a.kind == Kind::Forward) live.insert({a.chunk, a.micro_batch});
    if (is_backward_input(a.kind)) live.erase({a.chunk, a.micro_batch});
    peak = std::max(peak, live.size());
  }
  return int(peak);
}

namespace {

// Runs the ranks' lists against each other: an action starts when its rank has finished the
// previous one and its dependency (forward of model stage k-1, or input gradient of stage k+1,
// of the same micro-batch) has finished. Ranks are visited round-robin until nothing moves;
// the start times do not depend on the visiting order. Returns "" or the deadlock, and the
// rank's busy time and the makespan.
struct Simulation {
  std::string error;
  std::vector<double> busy;  // per rank
  double makespan = 0;
};

Simulation simulate(const std::vector<std::vector<ScheduleAction>>& per_rank, int n_micro,
                    const std::vector<std::vector<int>>& stage_of, const std::function<double(int, size_t)>& cost_of,
                    double transfer, std::vector<double>* finish = nullptr) {
  const int R = int(per_rank.size());
  int S = 0;
  for (const auto& chunks : stage_of) S += int(chunks.size());
  std::vector<int> rank_of(size_t(S), 0);
  for (int r = 0; r < R; ++r)
    for (int k : stage_of[size_t(r)])
      if (k >= 0 && k < S) rank_of[size_t(k)] = r;
  // Finish times of each (model stage, micro-batch)'s forward and input gradient; < 0: not yet.
  std::vector<double> fwd_done(size_t(S) * size_t(n_micro), -1), bin_done(size_t(S) * size_t(n_micro), -1);
  auto slot = [&](int stage, int mb) { return size_t(stage) * size_t(n_micro) + size_t(mb); };
  Simulation sim;
  sim.busy.assign(size_t(R), 0);
  std::vector<double> clock(size_t(R), 0);
  std::vector<size_t> pc(size_t(R), 0);
  bool moved = true;
  while (moved) {
    moved = false;
    for (int r = 0; r < R; ++r) {
      const auto& list = per_rank[size_t(r)];
      while (pc[size_t(r)] < list.size()) {
        const ScheduleAction& a = list[pc[size_t(r)]];
        const int k = stage_of[size_t(r)][size_t(a.chunk)];
        double ready = 0;
        if (a.kind == Kind::Forward) {
          if (k > 0 && (ready = fwd_done[slot(k - 1, a.micro_batch)]) < 0) break;
          if (k > 0 && rank_of[size_t(k - 1)] != r) ready += transfer;
        } else if (is_backward_input(a.kind)) {
          if (k + 1 < S && (ready = bin_done[slot(k + 1, a.micro_batch)]) < 0) break;
          if (k + 1 < S && rank_of[size_t(k + 1)] != r) ready += transfer;
        }
        const double cost = cost_of(r, pc[size_t(r)]);
        const double end = std::max(clock[size_t(r)], ready) + cost;
        clock[size_t(r)] = end;
        sim.busy[size_t(r)] += cost;
        if (a.kind == Kind::Forward) fwd_done[slot(k, a.micro_batch)] = end;
        if (is_backward_input(a.kind)) bin_done[slot(k, a.micro_batch)] = end;
        ++pc[size_t(r)];
        moved = true;
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const auto& list = per_rank[size_t(r)];
    if (pc[size_t(r)] < list.size()) {
      sim.error = fmt::format("deadlock: rank {} waits at {} (action {} of {})", r, to_string(list[pc[size_t(r)]]),
                              pc[size_t(r)] + 1, list.size());
      return sim;
    }
    sim.makespan = std::max(sim.makespan, clock[size_t(r)]);
  }
  if (finish) *finish = clock;
  return sim;
}

Simulation simulate(const std::vector<std::vector<ScheduleAction>>& per_rank, int n_micro,
                    const std::vector<std::vector<int>>& stage_of, const ActionCosts& costs) {
  auto cost_of = [&](int r, size_t i) {
    switch (per_rank[size_t(r)][i].kind) {
      case Kind::Forward: return costs.forward;
      case Kind::Backward: return costs.backward;
      case Kind::BackwardInput: return costs.backward_input;
      case Kind::BackwardWeight: return costs.backward_weight;
    }
    return 0.0;
  };
  return simulate(per_rank, n_micro, stage_of, cost_of, 0.0);
}

// The stage map is a permutation of 0 .. S-1 with one row per rank.
std::string check_stage_map(const std::vector<std::vector<int>>& stage_of, int n_ranks) {
  if (int(stage_of.size()) != n_ranks)
    return fmt::format("the stage map has {} ranks, the schedule {}", stage_of.size(), n_ranks);
  int S = 0;
  for (const auto& chunks : stage_of) S += int(chunks.size());
  std::vector<int> seen(size_t(S), 0);
  for (int r = 0; r < n_ranks; ++r) {
    for (int k : stage_of[size_t(r)]) {
      if (k < 0 || k >= S || seen[size_t(k)]++)
        return fmt::format("stage map: rank {} holds model stage {}, outside 0..{} or held twice", r, k, S - 1);
    }
  }
  return "";
}

}  // namespace

std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_rank, int n_micro,
                              const std::vector<std::vector<int>>& stage_of) {
  const int R = int(per_rank.size());
  if (R == 0) return "no stages";
  if (std::string e = check_stage_map(stage_of, R); !e.empty()) return e;
  // Per rank: each (chunk, micro-batch) forwarded once, then its input and weight gradients
  // once each.
  for (int r = 0; r < R; ++r) {
    const int C = int(stage_of[size_t(r)].size());
    const size_t n = size_t(C) * size_t(n_micro);
    std::vector<int> fwd(n, 0), bin(n, 0), bw(n, 0);
    for (const ScheduleAction& a : per_rank[size_t(r)]) {
      const int m = a.micro_batch;
      if (m < 0 || m >= n_micro) return fmt::format("stage {}: {} is outside the {} micro-batches", r, to_string(a), n_micro);
      if (a.chunk < 0 || a.chunk >= C) return fmt::format("stage {}: {} is outside its {} chunks", r, to_string(a), C);
      const size_t i = size_t(a.chunk) * size_t(n_micro) + size_t(m);
      if (a.kind == Kind::Forward) {
        if (fwd[i]++) return fmt::format("stage {}: {} runs twice", r, to_string(a));
        continue;
      }
      if (!fwd[i]) return fmt::format("stage {}: {} before its forward", r, to_string(a));
      if (is_backward_input(a.kind) && bin[i]++) return fmt::format("stage {}: {} repeats an input gradient", r, to_string(a));
      if (a.kind == Kind::BackwardWeight && !bin[i])
        return fmt::format("stage {}: {} before the input-gradient part", r, to_string(a));
      if (is_backward_weight(a.kind) && bw[i]++) return fmt::format("stage {}: {} repeats a weight gradient", r, to_string(a));
    }
    for (int c = 0; c < C; ++c) {
      for (int m = 0; m < n_micro; ++m) {
        const size_t i = size_t(c) * size_t(n_micro) + size_t(m);
        if (!fwd[i] || !bin[i] || !bw[i])
          return fmt::format("stage {}: micro-batch {}{} does not run its forward and whole backward", r, m,
                             c == 0 ? std::string() : fmt::format(" of chunk {}", c));
      }
    }
  }
  return simulate(per_rank, n_micro, stage_of, ActionCosts{}).error;
}

std::string validate_schedule(const std::vector<std::vector<ScheduleAction>>& per_stage, int n_micro) {
  std::vector<std::vector<int>> identity;
  for (int s = 0; s < int(per_stage.size()); ++s) identity.push_back({s});
  return validate_schedule(per_stage, n_micro, identity);
}

double bubble_fraction(const std::vector<std::vector<ScheduleAction>>& per_rank,
                       const std::vector<std::vector<int>>& stage_of, const ActionCosts& costs) {
  int n_micro = 0;
  for (const auto& list : per_rank)
    for (const ScheduleAction& a : list) n_micro = std::max(n_micro, a.micro_batch + 1);
  const std::string invalid = validate_schedule(per_rank, n_micro, stage_of);
  DS_CHECK(invalid.empty(), "bubble_fraction: the schedule is not valid: {}", invalid);
  const Simulation sim = simulate(per_rank, n_micro, stage_of, costs);
  if (sim.makespan <= 0) return 0;
  double idle = 0;
  for (double b : sim.busy) idle += sim.makespan - b;
  return idle / (double(per_rank.size()) * sim.makespan);
}

std::vector<double> simulate_step(const std::vector<std::vector<ScheduleAction>>& per_rank,
                                  const std::vector<std::vector<int>>& stage_of,
                                  const std::function<double(int rank, size_t index)>& seconds, double transfer) {
  int n_micro = 0;
  for (const auto& list : per_rank)
    for (const ScheduleAction& a : list) n_micro = std::max(n_micro, a.micro_batch + 1);
  std::vector<double> finish;
  const Simulation sim = simulate(per_rank, n_micro, stage_of, seconds, transfer, &finish);
  DS_CHECK(sim.error.empty(), "simulate_step: the schedule is not valid: {}", sim.error);
  return finish;
}

}  // namespace dstrain
