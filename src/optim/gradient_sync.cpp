#include "optim/gradient_sync.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "backend/ops.h"
#include "core/clock.h"
#include "core/error.h"

namespace dstrain {
namespace {

// d = x - d, elementwise (the ops have no subtraction: a negation, exact, then one rounding).
void subtract_from(Tensor d, Tensor x) {
  ops::scale_inplace(d, -1.0f);
  ops::add_inplace(d, x);
}

}  // namespace

GradientSyncConfig GradientSyncConfig::from_json(const JsonReader& r) {
  GradientSyncConfig c;
  c.mode = r.get<std::string>("mode", c.mode);
  if (c.mode != "sync" && c.mode != "delayed" && c.mode != "local_sgd" && c.mode != "diloco") {
    r.error("mode", fmt::format("is \"{}\"; it must be \"sync\" (every step, every data-parallel rank), \"delayed\" "
                                "(the average applied one step later), \"local_sgd\" or \"diloco\"",
                                c.mode));
  }
  c.every = r.get<int64_t>("every", c.local() ? 32 : 1);
  if (c.every < 1) r.error("every", fmt::format("is {}; it must be at least 1 (steps between outer steps)", c.every));
  if (!c.local() && r.has("every") && c.every != 1) {
    r.error("every", fmt::format("is {}, but mode \"{}\" aggregates every step; every is the inner steps of "
                                 "\"local_sgd\" and \"diloco\"",
                                 c.every, c.mode));
  }
  c.over = r.get<std::string>("over", c.over);
  if (c.over != "data" && c.over != "nodes") {
    r.error("over", fmt::format("is \"{}\"; it must be \"data\" (every data-parallel replica) or \"nodes\" "
                                "(synchronous inside a node, asynchronous between nodes)",
                                c.over));
  }
  c.ranks_per_node = r.get<int64_t>("ranks_per_node", c.ranks_per_node);
  if (c.ranks_per_node < 0) r.error("ranks_per_node", "must be >= 0 (0: the ranks that share a node's memory)");
  if (r.has("outer_optimizer")) {
    if (c.mode != "diloco") {
      r.error("outer_optimizer", fmt::format("is DiLoCo's; mode \"{}\" has none{}", c.mode,
                                             c.mode == "local_sgd" ? " (local SGD averages the parameters: "
                                                                     "DiLoCo with outer SGD at lr 1)"
                                                                   : ""));
    }
    JsonReader o = r.child("outer_optimizer");
    c.outer_type = o.get<std::string>("type", c.outer_type);
    if (c.outer_type != "sgd" && c.outer_type != "nesterov") {
      o.error("type", fmt::format("is \"{}\"; it must be \"sgd\" or \"nesterov\"", c.outer_type));
    }
    c.outer_lr = o.get<double>("lr", c.outer_lr);
    if (!(c.outer_lr > 0) || !std::isfinite(c.outer_lr)) o.error("lr", "must be a positive number");
    c.outer_momentum = o.get<double>("momentum", c.outer_type == "sgd" ? 0.0 : c.outer_momentum);
    if (!(c.outer_momentum >= 0 && c.outer_momentum < 1)) o.error("momentum", "must lie in [0, 1)");
    if (c.outer_type == "nesterov" && c.outer_momentum == 0) {
      o.error("momentum", "is 0, but Nesterov needs a momentum (type \"sgd\" has none)");
    }
    o.done();
  }
  c.outer_dtype = r.get<std::string>("outer_dtype", c.outer_dtype);
  if (c.outer_dtype != "fp32" && c.outer_dtype != "bf16") {
    r.error("outer_dtype", fmt::format("is \"{}\"; it must be \"fp32\" or \"bf16\"", c.outer_dtype));
  }
  if (!c.async() && r.has("outer_dtype") && c.outer_dtype != "fp32") {
    r.error("outer_dtype", "applies to the asynchronous modes (sync reduces in train.communication_data_type)");
  }
  c.fragments = r.get<int64_t>("fragments", c.fragments);
  if (c.fragments < 1) r.error("fragments", "must be at least 1");
  if (c.fragments > 1 && c.mode != "diloco") {
    r.error("fragments", fmt::format("is {}: fragments are Streaming DiLoCo's (mode \"diloco\"), not mode \"{}\"'s",
                                     c.fragments, c.mode));
  }
  if (c.fragments > 1 && c.every % c.fragments != 0) {
    r.error("fragments", fmt::format("is {}; it must divide every ({}) so that each fragment syncs at its own step",
                                     c.fragments, c.every));
  }
  if (r.has("test_slow_link")) {
    JsonReader s = r.child("test_slow_link");
    c.test_link_latency_ms = s.get<double>("latency_ms", 0.0);
    c.test_link_gbit_per_s = s.get<double>("gbit_per_s", 0.0);
    if (!(c.test_link_latency_ms >= 0)) s.error("latency_ms", "must be >= 0");
    if (!(c.test_link_gbit_per_s >= 0)) s.error("gbit_per_s", "must be >= 0 (0: no bandwidth cap)");
    s.done();
  }
  r.done();
  return c;
}

json GradientSyncConfig::to_json() const {
  json j = {{"mode", mode}, {"every", every}, {"over", over}, {"ranks_per_node", ranks_per_node},
            {"outer_dtype", outer_dtype}, {"fragments", fragments}};
  if (mode == "diloco") j["outer_optimizer"] = {{"type", outer_type}, {"lr", outer_lr}, {"momentum", outer_momentum}};
  if (slow_link()) j["test_slow_link"] = {{"latency_ms", test_link_latency_ms}, {"gbit_per_s", test_link_gbit_per_s}};
  return j;
}

std::string GradientSyncConfig::describe() const {
  if (mode == "sync") return "synchronous: every step over every data-parallel rank";
  if (mode == "delayed") return fmt::format("delayed: each step's average applied at the next step, in {}", outer_dtype);
  if (mode == "local_sgd") return fmt::format("local SGD: the parameters averaged every {} steps, in {}", every, outer_dtype);
  return fmt::format("DiLoCo: outer step every {} steps{}, outer {} lr {} momentum {}, in {}", every,
                     fragments > 1 ? fmt::format(" ({} fragments in turn)", fragments) : std::string(), outer_type,
                     outer_lr, momentum(), outer_dtype);
}

GradientSync::GradientSync(const GradientSyncConfig& config, DistributedOptimizer& opt, Communicator* across,
                           Communicator& replica_world, std::vector<char> counted)
    : config_(config), opt_(opt), across_(across), replica_world_(replica_world), counted_(std::move(counted)) {
  DS_CHECK(config_.async(), "GradientSync: mode \"sync\" needs none");
  wire_ = config_.outer_dtype == "bf16" ? DType::BF16 : DType::F32;
  const ParamRegistry& reg = opt_.params();
  // Fragments: consecutive parameters of about equal size (the same on every rank holding the
  // same registry, which are the ranks that reduce together).
  int64_t total = 0;
  for (int id = 0; id < reg.size(); ++id) total += reg.info(id).numel();
  const int P = int(config_.fragments);
  std::vector<int> frag_of(size_t(reg.size()), 0);
  int64_t before = 0;
  for (int id = 0; id < reg.size(); ++id) {
    frag_of[size_t(id)] = total > 0 ? std::min(P - 1, int(before * P / total)) : 0;
    before += reg.info(id).numel();
  }
  for (int p = 0; p < P; ++p) {
    int first = 0, last = 0;
    while (first < reg.size() && frag_of[size_t(first)] < p) ++first;
    last = first;
    while (last < reg.size() && frag_of[size_t(last)] == p) ++last;
    fragments_.push_back({first, last});
  }
  const Buffer& master = opt_.master();
  const int64_t n = master.numel();
  if (config_.mode == "delayed") {
    const Device gdev = reg.grads().device();
    inflight_buf_ = Buffer("gradient_sync.inflight", MemCategory::CommBuffers, wire_, n, gdev);
    spare_buf_ = Buffer("gradient_sync.inflight", MemCategory::CommBuffers, wire_, n, gdev);
    ready_buf_ = Buffer("gradient_sync.pending", MemCategory::Gradients, DType::F32, n, gdev);
  } else {
    outer_ = Buffer("gradient_sync.outer_params", MemCategory::OptimizerState, DType::F32, n, master.device());
    if (config_.momentum() > 0) {
      momentum_ = Buffer("gradient_sync.outer_momentum", MemCategory::OptimizerState, DType::F32, n, master.device());
    }
    // The outer step's buffers for the largest fragment, held for the run (and so counted by the
    // memory model).
    int64_t len = 0;
    for (int p = 0; p < int(fragments_.size()); ++p) len = std::max(len, fragment_elems(p));
    delta_ = Buffer("gradient_sync.delta", MemCategory::CommBuffers, DType::F32, len, master.device());
    mean_ = Buffer("gradient_sync.mean_delta", MemCategory::CommBuffers, DType::F32, len, master.device());
    wire_buf_ = Buffer("gradient_sync.wire", MemCategory::CommBuffers, wire_, len, master.device());
    reset_outer();
  }
}

GradientSync::~GradientSync() {
  // A reduction still in flight writes into buffers about to go.
  try {
    wait_inflight();
  } catch (...) {
  }
}

int64_t GradientSync::fragment_elems(int p) const {
  int64_t len = 0;
  for (int id = fragments_[size_t(p)].first; id < fragments_[size_t(p)].second; ++id) len += opt_.piece(id).elems();
  return len;
}

int64_t GradientSync::phase(int p) const {
  const int64_t H = config_.every, P = config_.fragments;
  return (int64_t(p + 1) * H / P) % H;
}

void GradientSync::reset_outer() {
  if (outer_.allocated()) ops::copy(outer_.tensor(), opt_.master().tensor());
  if (momentum_.allocated()) momentum_.zero();
}

void GradientSync::wait_inflight() {
  if (!have_inflight_) return;
  const auto t0 = Clock::now();
  inflight_.wait();
  step_stats_.wait_seconds += seconds_since(t0);
  have_inflight_ = false;
  // The average, in fp32, where it waits to be applied.
  ops::cast(ready_buf_.tensor(), inflight_buf_.tensor());
  ops::scale_inplace(ready_buf_.tensor(), float(1.0 / double(replicas())));
  ready_ = true;
}

bool GradientSync::has_pending_gradient() {
  wait_inflight();
  return ready_;
}

Buffer& GradientSync::pending_gradient() {
  wait_inflight();
  return ready_buf_;
}

bool GradientSync::exchange_gradients() {
  DS_CHECK(config_.mode == "delayed", "exchange_gradients: mode \"{}\"", config_.mode);
  const ParamRegistry& reg = opt_.params();
  // This step's gradients (reduced inside the replica) go out in the spare buffer.
  for (int id = 0; id < reg.size(); ++id) {
    if (!reg.info(id).trainable) continue;
    const Tensor g = opt_.update_grad(id);
    if (g.numel() == 0) continue;
    ops::cast(spare_buf_.tensor(opt_.shard_offset(id), {g.numel()}), g);
  }
  // The previous step's sum, launched a step ago, becomes the average to apply now.
  wait_inflight();
  std::swap(inflight_buf_, spare_buf_);
  inflight_ = across_ ? across_->all_reduce_async(inflight_buf_.tensor()) : Work();
  have_inflight_ = true;
  if (!ready_) return false;
  for (int id = 0; id < reg.size(); ++id) {
    if (!reg.info(id).trainable) continue;
    const Tensor g = opt_.update_grad(id);
    if (g.numel() == 0) continue;
    ops::copy(g, ready_buf_.tensor(opt_.shard_offset(id), {g.numel()}));
  }
  ready_ = false;
  return true;
}

void GradientSync::after_step(int64_t step) {
  if (!config_.local()) return;
  for (int p = 0; p < int(fragments_.size()); ++p) {
    if (step % config_.every == phase(p)) outer_step(p, step_stats_);
  }
}

void GradientSync::outer_step(int p, GradientSyncStep& st) {
  const auto [first, last] = fragments_[size_t(p)];
  Buffer& master = opt_.master();
  // This fragment's pieces end to end: Delta_r = theta_outer - theta_r, packed in wire dtype.
  const int64_t len = fragment_elems(p);
  DS_CHECK(delta_.numel() >= len, "gradient sync: fragment {} holds {} elements, its buffers {}", p, len, delta_.numel());
  // Local SGD averages the parameters themselves (exactly theta on one replica); DiLoCo the
  // outer gradients Delta_r = theta_outer - theta_r.
  const bool average_params = config_.mode == "local_sgd";
  int64_t at = 0;
  for (int id = first; id < last; ++id) {
    const int64_t n = opt_.piece(id).elems();
    if (n == 0) continue;
    const int64_t off = opt_.shard_offset(id);
    Tensor d = delta_.tensor(at, {n});
    ops::copy(d, master.tensor(off, {n}));
    if (!average_params) subtract_from(d, outer_.tensor(off, {n}));
    at += n;
  }
  Tensor wire = wire_buf_.tensor(0, {len});
  ops::cast(wire, delta_.tensor(0, {len}));
  const auto t0 = Clock::now();
  if (across_ && len > 0) across_->all_reduce(wire);
  st.wait_seconds += seconds_since(t0);
  Tensor mean = mean_.tensor(0, {len});
  ops::cast(mean, wire);
  if (replicas() > 1) ops::scale_inplace(mean, float(1.0 / double(replicas())));
  // Norms over the replica: the outer gradient's, and each replica's distance from the mean
  // (the drift): |mean Delta - Delta_r| = |theta_r - mean theta|.
  double sums[2] = {0, 0};
  at = 0;
  for (int id = first; id < last; ++id) {
    const int64_t n = opt_.piece(id).elems();
    if (n == 0) continue;
    if (counted_[size_t(id)]) {
      // The counted part's place inside the piece (stage 0: this rank's rows over its group).
      const Tensor part = opt_.counted_part(master, id);
      const int64_t skip = (static_cast<const float*>(part.raw()) - master.data<float>()) - opt_.shard_offset(id);
      const Tensor m = mean_.tensor(at + skip, {part.numel()});
      Tensor d = delta_.tensor(at + skip, {part.numel()});
      subtract_from(d, m);
      sums[1] += ops::read_sum_squares(d);
      if (average_params) {
        // |theta_outer - mean theta|
        ops::copy(d, m);
        subtract_from(d, outer_.tensor(opt_.shard_offset(id) + skip, {part.numel()}));
        sums[0] += ops::read_sum_squares(d);
      } else {
        sums[0] += ops::read_sum_squares(m);
      }
    }
    at += n;
  }
  replica_world_.all_reduce(Tensor(sums, DType::F64, Shape{2}));
  double spread = sums[1];
  if (across_) spread = across_->all_reduce_value<double>(spread);
  st.outer_delta_norm = std::sqrt(sums[0]);
  st.drift = std::sqrt(spread / double(replicas()));
  // The outer optimizer on theta_outer, which every replica then takes.
  const float lr = float(config_.lr()), mu = float(config_.momentum());
  const bool nesterov = config_.mode == "diloco" && config_.outer_type == "nesterov";
  at = 0;
  for (int id = first; id < last; ++id) {
    const int64_t n = opt_.piece(id).elems();
    if (n == 0) continue;
    const int64_t off = opt_.shard_offset(id);
    Tensor g = mean_.tensor(at, {n});
    Tensor o = outer_.tensor(off, {n});
    at += n;
    if (average_params) {
      ops::copy(o, g);
      ops::copy(master.tensor(off, {n}), g);
      continue;
    }
    if (mu > 0) {
      // torch.optim.SGD (dampening 0): b = mu b + g; nesterov: g + mu b, else b.
      Tensor b = momentum_.tensor(off, {n});
      ops::scale_inplace(b, mu);
      ops::add_inplace(b, g);
      Tensor u = delta_.tensor(at - n, {n});
      ops::copy(u, b);
      if (nesterov) {
        ops::scale_inplace(u, mu);
        ops::add_inplace(u, g);
      }
      g = u;
    }
    ops::scale_inplace(g, -lr);
    ops::add_inplace(o, g);
    ops::copy(master.tensor(off, {n}), o);
  }
  ++st.outer_steps;
  opt_.publish_weights();
}

int GradientSync::finish(int64_t step) {
  if (!config_.local()) return 0;
  int n = 0;
  GradientSyncStep st;
  for (int p = 0; p < int(fragments_.size()); ++p) {
    if (step % config_.every != phase(p)) {
      outer_step(p, st);
      ++n;
    }
  }
  return n;
}

GradientSyncStep GradientSync::take_step_stats() {
  GradientSyncStep s = step_stats_;
  step_stats_ = GradientSyncStep{};
  return s;
}

}  // namespace dstrain
