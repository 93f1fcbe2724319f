#include "optim/distributed_optimizer.h"

#include <algorithm>
#include <cmath>

#include "backend/ops.h"
#include "core/clock.h"
#include "core/error.h"
#include "core/log.h"

namespace dstrain {
namespace {

constexpr int64_t kShardAlign = 16;  // elements: each piece starts 64-byte aligned in the shard
// Parameters of at least this many elements are reduced and gathered alone, in place: their
// collectives are bandwidth-bound, and packing them would only copy them and hold them twice.
// Smaller ones (a small model's matrices, MoE experts) share one collective per bucket.
constexpr int64_t kSoloElements = int64_t(1) << 20;
// A packed collective holds at most this many elements (4 MiB in fp32: past the latency-bound
// sizes), so that its buffers, kept for reuse, stay small.
constexpr int64_t kPackElements = int64_t(1) << 20;

int64_t align_up(int64_t n) { return (n + kShardAlign - 1) / kShardAlign * kShardAlign; }

// On the device, or offloaded to the host: page-locked (pin_memory, DeepSpeed's key: faster
// copies to and from a GPU, memory the OS cannot page out) or ordinary host memory.
Buffer shard_buffer(const std::string& label, MemCategory category, int64_t n, bool host, bool pinned, Device device) {
  // (The memory model's meta device counts offloaded state with the rest: no host memory.)
  if (!host || device.type == DeviceType::Meta) return Buffer(label, category, DType::F32, n, device);
  return pinned ? Buffer::pinned_host(label, category, DType::F32, n)
                : Buffer(label, category, DType::F32, n, Device::cpu());
}

}  // namespace

DistributedOptimizer::DistributedOptimizer(const ZeroConfig& config, const AdamWConfig& adamw, ParamRegistry& params,
                             const ParamGroupComms& comms, DType comm_dtype)
    : config_(config), adamw_(adamw), params_(params), comms_(comms), comm_dtype_(comm_dtype) {
  DS_CHECK(comm_dtype_ == DType::F32 || comm_dtype_ == DType::BF16 || comm_dtype_ == DType::F16,
           "ZeRO communicates gradients in fp32, bf16 or fp16, not {}", dtype_name(comm_dtype_));
  DS_CHECK(config_.stage >= 0 && config_.stage <= 3, "ZeRO stage {} (the optimizer handles stages 0 to 3)",
           config_.stage);
  DS_CHECK(config_.stage >= 1 || !config_.offloads_optimizer(),
           "zero_optimization.offload_optimizer needs stage 1 or above (stage 0 keeps no shard to offload)");
  DS_CHECK(!config_.offloads_params() || (config_.stage == 3 && config_.offloads_optimizer()),
           "zero_optimization.offload_param needs stage 3 and offload_optimizer on the cpu");
  const int n = params_.size();
  pieces_.resize(size_t(n));
  shard_offsets_.resize(size_t(n));
  persistent_.assign(size_t(n), 0);
  comm_of_.resize(size_t(n));
  for (int id = 0; id < n; ++id) {
    const ParamInfo& p = params_.info(id);
    DS_CHECK(p.placement.kind != Placement::Kind::FlatRange,
             "ZeRO shards a rank's local pieces by rows; '{}' is already a flat range", p.name);
    Communicator& c = comms_.comm(p.group);
    comm_of_[size_t(id)] = &c;
    if (config_.stage == 0) {
      // The shard of one: the whole local tensor, where the registry keeps it.
      pieces_[size_t(id)] = row_piece(p.shape, 0, 1);
      shard_offsets_[size_t(id)] = p.offset;
    } else {
      pieces_[size_t(id)] = row_piece(p.shape, c.rank(), c.size());
      shard_offsets_[size_t(id)] = shard_numel_;
      shard_numel_ += align_up(pieces_[size_t(id)].elems());
    }
    persistent_[size_t(id)] =
        config_.stage == 3 && (p.numel() < config_.stage3_param_persistence_threshold || !p.trainable);
  }
  const Device device = params_.device();
  const bool host = config_.offloads_optimizer(), pinned = config_.pins_host_memory();
  if (config_.stage <= 1) {
    reducer_ = std::make_unique<GradReducer>(params_, comms_, config_.reduce_bucket_size, config_.overlap_comm,
                                             comm_dtype_);
  }
  if (config_.stage == 0) {
    // The moments in the registry's layout; the registry's weights are the masters.
    shard_numel_ = params_.values().numel();
    exp_avg_ = Buffer("optimizer.exp_avg", MemCategory::OptimizerState, DType::F32, shard_numel_, device);
    exp_avg_sq_ = Buffer("optimizer.exp_avg_sq", MemCategory::OptimizerState, DType::F32, shard_numel_, device);
  } else {
    master_ = shard_buffer("zero.master_weights", MemCategory::Parameters, shard_numel_, host, pinned, device);
    exp_avg_ = shard_buffer("zero.exp_avg", MemCategory::OptimizerState, shard_numel_, host, pinned, device);
    exp_avg_sq_ = shard_buffer("zero.exp_avg_sq", MemCategory::OptimizerState, shard_numel_, host, pinned, device);
  }
  if (host) host_grads_ = shard_buffer("zero.gradient_shard (host)", MemCategory::Gradients, shard_numel_, true, pinned, device);
  if (config_.stage >= 2) {
    grad_shard_ = Buffer("zero.gradient_shard", MemCategory::Gradients, DType::F32, shard_numel_, device);
    params_.reserve_grads();
  }
  if (config_.stage == 3) {
    if (host && !config_.offloads_params()) {
      device_shard_ = Buffer("zero.parameter_shard", MemCategory::Parameters, DType::F32, shard_numel_, device);
    }
    params_.reserve_values();
  }
  state_.assign(size_t(n), config_.stage == 3 ? State::Released : State::Resident);
  uses_.assign(size_t(n), 0);
  gathers_.resize(size_t(n));
  group_of_.resize(size_t(n));
  reduced_once_.assign(size_t(n), 0);
}

DistributedOptimizer::~DistributedOptimizer() {
  // Nothing may still write into the buffers about to go.
  for (Work& w : gathers_) {
    if (!w.valid()) continue;
    try {
      w.wait();
    } catch (...) {
    }
  }
  for (auto& g : group_of_) {
    if (!g || !g->work.valid()) continue;
    try {
      g->work.wait();
    } catch (...) {
    }
  }
  for (Pending& p : reductions_) {
    try {
      p.work.wait();
    } catch (...) {
    }
  }
  // The whole weights and transient gradients still counted go with the optimizer's buffers: the
  // device's accounting must not keep them (a later model on the device would start above zero).
  if (gathered_bytes_ != 0) memory_account(params_.device().type, MemCategory::GatheredParameters, -gathered_bytes_);
  if (transient_bytes_ != 0) memory_account(params_.device().type, MemCategory::Gradients, -transient_bytes_);
}

std::string DistributedOptimizer::describe() const {
  if (config_.stage == 0) {
    std::string s = fmt::format("optimizer: AdamW on every rank's whole local weights (ZeRO stage 0, {})",
                                comms_.describe());
    if (max_group_size() > 1) {
      s += fmt::format(", gradients all-reduced in {} in {} bucket(s)", dtype_name(comm_dtype_), reducer_->num_buckets());
    }
    return s;
  }
  int64_t persistent = 0;
  for (int id = 0; id < params_.size(); ++id) persistent += persistent_[size_t(id)] ? params_.info(id).numel() : 0;
  std::string s = fmt::format("ZeRO stage {} ({}): {} of {} local elements per rank", stage(), comms_.describe(),
                              shard_numel_, params_.flat_numel());
  if (config_.offloads_optimizer()) {
    s += config_.pins_host_memory() ? ", optimizer offloaded to the host (pinned memory)"
                                    : ", optimizer offloaded to the host (pageable memory: pin_memory false)";
  }
  if (config_.offloads_params()) s += ", parameters at rest on the host";
  if (config_.stage >= 2 && max_group_size() > 1) s += fmt::format(", gradients reduce-scattered in {}", dtype_name(comm_dtype_));
  if (stage() == 3) s += fmt::format(", {} elements persistent", persistent);
  return s;
}

std::vector<int64_t> DistributedOptimizer::counts(int id) const {
  const int n = comm_of(id).size();
  std::vector<int64_t> c(static_cast<size_t>(n));
  const Shape& shape = params_.info(id).shape;
  for (int r = 0; r < n; ++r) c[size_t(r)] = row_piece(shape, r, n).elems();
  return c;
}

Tensor DistributedOptimizer::master_piece(int id) const {
  const Buffer& b = config_.stage == 0 ? params_.values() : master_;
  return b.tensor(shard_offsets_[size_t(id)], {pieces_[size_t(id)].elems()});
}

Tensor DistributedOptimizer::grad_piece(int id) const {
  if (config_.stage == 0) {
    // Every rank of the group holds the reduced whole gradient: its rows over the group.
    const Communicator& c = comm_of(id);
    const RowPiece pc = row_piece(params_.info(id).shape, c.rank(), c.size());
    return params_.grads().tensor(params_.info(id).offset + pc.elem_begin(), {pc.elems()});
  }
  const RowPiece& pc = pieces_[size_t(id)];
  if (config_.stage == 1) return params_.grads().tensor(params_.info(id).offset + pc.elem_begin(), {pc.elems()});
  return grad_shard_.tensor(shard_offsets_[size_t(id)], {pc.elems()});
}

Tensor DistributedOptimizer::update_grad(int id) const {
  if (config_.stage == 0) return params_.grads().tensor(params_.info(id).offset, {params_.info(id).numel()});
  return grad_piece(id);
}

Tensor DistributedOptimizer::counted_part(const Buffer& shard, int id) const {
  const int64_t off = shard_offsets_[size_t(id)];
  if (config_.stage == 0) {
    const Communicator& c = comm_of(id);
    const RowPiece pc = row_piece(params_.info(id).shape, c.rank(), c.size());
    return shard.tensor(off + pc.elem_begin(), {pc.elems()});
  }
  return shard.tensor(off, {pieces_[size_t(id)].elems()});
}

int64_t DistributedOptimizer::gathered_bytes(int id) const {
  // The fp32 weight and, in mixed precision, its compute copy.
  const int64_t per = 4 + (params_.has_compute_copy() ? int64_t(dtype_size(params_.compute_dtype())) : 0);
  return params_.info(id).numel() * per;
}

void DistributedOptimizer::account_gathered(int64_t delta) {
  gathered_bytes_ += delta;
  gathered_peak_ = std::max(gathered_peak_, gathered_bytes_);
  memory_account(params_.device().type, MemCategory::GatheredParameters, delta);
}

void DistributedOptimizer::account_transient(int64_t delta) {
  transient_bytes_ += delta;
  transient_peak_ = std::max(transient_peak_, transient_bytes_);
  memory_account(params_.device().type, MemCategory::Gradients, delta);
}

// ---- whole weights ----------------------------------------------------------------------

void DistributedOptimizer::adopt_weights() {
  if (config_.stage == 0) return;  // the weights are the masters
  for (int id = 0; id < params_.size(); ++id) {
    const RowPiece& pc = pieces_[size_t(id)];
    if (pc.elems() == 0) continue;
    ops::copy(master_piece(id), params_.values().tensor(params_.info(id).offset + pc.elem_begin(), {pc.elems()}));
  }
  publish_weights();
}

void DistributedOptimizer::publish_weights() {
  if (config_.stage == 0) {
    params_.refresh_compute();
    return;
  }
  if (config_.stage < 3) {
    gather_whole(/*persistent_only=*/false);
    return;
  }
  // Stage 3: the parameters at rest on the device follow the masters; then only the persistent
  // ones are whole.
  for (int id = 0; id < params_.size(); ++id) {
    DS_CHECK(uses_[size_t(id)] == 0, "ZeRO-3: '{}' is in use while the weights are replaced", params_.info(id).name);
    if (state_[size_t(id)] != State::Released) release_param(id);  // waits for a gather in flight
  }
  if (device_shard_.allocated()) ops::copy(device_shard_.tensor(), master_.tensor());
  gather_whole(/*persistent_only=*/true);
}

void DistributedOptimizer::gather_whole(bool persistent_only) {
  // In groups of up to kPackElements (and allgather_bucket_size) elements: the small parameters
  // of a group that share a communicator in one packed collective, the large ones alone and in
  // place (launch_gathers). Two groups are in flight at a time: the next is packed and launched
  // while the one before is transferred, and the packing buffers stay two groups' worth.
  const int64_t limit = std::min(kPackElements, config_.allgather_bucket_size);
  std::vector<int> previous, current;
  int64_t current_elems = 0;
  auto launch = [&] {
    if (current.empty()) return;
    launch_gathers(current);
    for (int id : previous) wait_gather(id);
    previous = std::move(current);
    current.clear();
    current_elems = 0;
  };
  for (int id = 0; id < params_.size(); ++id) {
    if (persistent_only && !persistent_[size_t(id)]) continue;
    if (config_.stage == 3 && state_[size_t(id)] != State::Released) continue;  // already whole
    const int64_t numel = params_.info(id).numel();
    if (!current.empty() && current_elems + numel > limit) launch();
    current.push_back(id);
    current_elems += numel;
  }
  launch();
  for (int id : previous) wait_gather(id);
  if (config_.stage < 3) params_.refresh_compute();
}

void DistributedOptimizer::launch_gather_in_place(int id) {
  // This rank's piece goes to its place in the whole weights first (from the masters, or the
  // pieces at rest on the device) and the whole tensor is gathered in place.
  const ParamInfo& p = params_.info(id);
  const RowPiece& pc = pieces_[size_t(id)];
  Tensor whole = params_.values().tensor(p.offset, {p.numel()});
  Tensor mine = whole.slice(pc.elem_begin(), pc.elem_begin() + pc.elems());
  if (pc.elems()) {
    ops::copy(mine, device_shard_.allocated() ? device_shard_.tensor(shard_offsets_[size_t(id)], {pc.elems()})
                                              : master_piece(id));
  }
  gathers_[size_t(id)] = comm_of(id).all_gather_v_async(whole, mine, counts(id));
  if (config_.stage == 3) {
    state_[size_t(id)] = State::InFlight;
    account_gathered(gathered_bytes(id));
    live_elems_ += p.numel();
  }
}

Buffer DistributedOptimizer::take_buffer(const char* label, DType dtype, int64_t numel) {
  numel = std::max<int64_t>(numel, 1);
  // The smallest free one that holds numel elements of dtype.
  size_t best = free_buffers_.size();
  for (size_t i = 0; i < free_buffers_.size(); ++i) {
    const Buffer& b = free_buffers_[i];
    if (b.dtype() == dtype && b.numel() >= numel && (best == free_buffers_.size() || b.numel() < free_buffers_[best].numel())) {
      best = i;
    }
  }
  if (best == free_buffers_.size()) return Buffer(label, MemCategory::CommBuffers, dtype, numel, params_.device());
  Buffer b = std::move(free_buffers_[best]);
  free_buffers_.erase(free_buffers_.begin() + std::ptrdiff_t(best));
  return b;
}

void DistributedOptimizer::give_back(Buffer&& b) {
  if (b.allocated()) free_buffers_.push_back(std::move(b));
}

void DistributedOptimizer::launch_gathers(const std::vector<int>& ids) {
  // One collective per run of small parameters that share a communicator; a large one (or one
  // alone) in place.
  size_t from = 0;
  while (from < ids.size()) {
    if (params_.info(ids[from]).numel() >= kSoloElements) {
      launch_gather_in_place(ids[from++]);
      continue;
    }
    size_t to = from + 1;
    int64_t packed = params_.info(ids[from]).numel();
    while (to < ids.size() && &comm_of(ids[to]) == &comm_of(ids[from]) &&
           params_.info(ids[to]).numel() < kSoloElements && packed + params_.info(ids[to]).numel() <= kPackElements) {
      packed += params_.info(ids[to]).numel();
      ++to;
    }
    if (to == from + 1) {
      launch_gather_in_place(ids[from++]);
      continue;
    }
    Communicator& comm = comm_of(ids[from]);
    const int n = comm.size(), me = comm.rank();
    auto g = std::make_shared<GatherGroup>();
    g->ids.assign(ids.begin() + std::ptrdiff_t(from), ids.begin() + std::ptrdiff_t(to));
    std::vector<int64_t> per_rank(size_t(n), 0);
    for (int id : g->ids) {
      const std::vector<int64_t> c = counts(id);
      for (int r = 0; r < n; ++r) per_rank[size_t(r)] += c[size_t(r)];
      g->total += params_.info(id).numel();
    }
    g->mine = take_buffer("zero.gather_pieces", DType::F32, per_rank[size_t(me)]);
    g->packed = take_buffer("zero.gather_bucket", DType::F32, g->total);
    // This rank's pieces: at rest on the device (offload without offload_param), or the masters
    // (on the device, or on the host with offload_param: copied over here).
    int64_t at = 0;
    for (int id : g->ids) {
      const int64_t e = pieces_[size_t(id)].elems();
      if (e > 0) {
        const Tensor src = device_shard_.allocated() ? device_shard_.tensor(shard_offsets_[size_t(id)], {e})
                                                     : master_piece(id);
        ops::copy(g->mine.tensor(at, {e}), src);
      }
      at += e;
    }
    g->work = comm.all_gather_v_async(g->packed.tensor(0, {g->total}), g->mine.tensor(0, {per_rank[size_t(me)]}), per_rank);
    for (int id : g->ids) {
      group_of_[size_t(id)] = g;
      if (config_.stage < 3) continue;  // stages 1 and 2 hold every whole weight anyway
      state_[size_t(id)] = State::InFlight;
      account_gathered(gathered_bytes(id));
      live_elems_ += params_.info(id).numel();
    }
    from = to;
  }
}

void DistributedOptimizer::unpack(GatherGroup& g) {
  // The packed buffer holds rank 0's pieces of every parameter, then rank 1's, ...: each goes
  // to its rows of the whole weights.
  Communicator& comm = comm_of(g.ids.front());
  const int n = comm.size();
  int64_t at = 0;
  for (int q = 0; q < n; ++q) {
    for (int id : g.ids) {
      const ParamInfo& p = params_.info(id);
      const RowPiece pc = row_piece(p.shape, q, n);
      if (pc.elems() == 0) continue;
      ops::copy(params_.values().tensor(p.offset + pc.elem_begin(), {pc.elems()}), g.packed.tensor(at, {pc.elems()}));
      at += pc.elems();
    }
  }
}

void DistributedOptimizer::wait_gather(int id) {
  if (gathers_[size_t(id)].valid()) {
    const auto t0 = Clock::now();
    gathers_[size_t(id)].wait();
    gathers_[size_t(id)] = Work();
    exposed_seconds_ += seconds_since(t0);
    if (config_.stage == 3 && state_[size_t(id)] == State::InFlight) {
      params_.refresh_compute(id, id);
      state_[size_t(id)] = State::Resident;
    }
  }
  if (const std::shared_ptr<GatherGroup> g = group_of_[size_t(id)]) {
    const auto t0 = Clock::now();
    g->work.wait();
    exposed_seconds_ += seconds_since(t0);
    unpack(*g);
    give_back(std::move(g->mine));
    give_back(std::move(g->packed));
    for (int x : g->ids) {
      if (config_.stage == 3) params_.refresh_compute(x, x);  // stages 1 and 2: all at once after
      state_[size_t(x)] = State::Resident;
      group_of_[size_t(x)].reset();
    }
  }
}

void DistributedOptimizer::release_param(int id) {
  wait_gather(id);
  const ParamInfo& p = params_.info(id);
  params_.values().release_range(p.offset, p.numel());
  if (params_.has_compute_copy()) params_.compute_values().release_range(p.offset, p.numel());
  state_[size_t(id)] = State::Released;
  account_gathered(-gathered_bytes(id));
  live_elems_ -= p.numel();
}

void DistributedOptimizer::gather_all() {
  if (config_.stage < 3) return;
  // In groups of up to allgather_bucket_size elements, each waited before the next starts.
  std::vector<int> group;
  int64_t elems = 0;
  auto flush = [&] {
    if (group.empty()) return;
    launch_gathers(group);
    for (int id : group) wait_gather(id);
    group.clear();
    elems = 0;
  };
  for (int id = 0; id < params_.size(); ++id) {
    if (state_[size_t(id)] != State::Released) continue;
    const int64_t numel = params_.info(id).numel();
    if (!group.empty() && elems + numel > config_.allgather_bucket_size) flush();
    group.push_back(id);
    elems += numel;
  }
  flush();
  for (int id = 0; id < params_.size(); ++id) wait_gather(id);
}

void DistributedOptimizer::release_unused() {
  if (config_.stage < 3) return;
  for (int id = 0; id < params_.size(); ++id) {
    if (!persistent_[size_t(id)] && uses_[size_t(id)] == 0 && state_[size_t(id)] != State::Released) release_param(id);
  }
}

// ---- stage 3: the model's uses -----------------------------------------------------------

void DistributedOptimizer::before_use(int first, int last) {
  if (config_.stage < 3) return;
  bool prefetch = false;
  if (in_step_) {
    if (recording_) {
      trace_.emplace_back(first, last);
    } else {
      // The next use in the recorded order, or (a use out of order) the next one that matches.
      for (size_t j = trace_pos_; j < trace_.size(); ++j) {
        if (trace_[j] == std::pair(first, last)) {
          trace_pos_ = j + 1;
          prefetch = true;
          break;
        }
      }
    }
  }
  std::vector<int> released;
  for (int id = first; id <= last; ++id) {
    ++uses_[size_t(id)];
    if (state_[size_t(id)] == State::Released) released.push_back(id);
  }
  if (!released.empty()) launch_gathers(released);
  for (int id = first; id <= last; ++id) wait_gather(id);
  if (prefetch) prefetch_after(trace_pos_);
}

void DistributedOptimizer::prefetch_after(size_t pos) {
  // The parameters the next uses need, in order, until stage3_prefetch_bucket_size elements are
  // gathered ahead: those a previous prefetch already brought count against it, so the window
  // ahead stays bounded however many uses there are.
  // Each use's parameters go in one gather.
  int64_t ahead = 0, live = live_elems_;
  std::vector<int> todo;
  auto launch = [&] {
    if (!todo.empty()) launch_gathers(todo);
    todo.clear();
  };
  for (size_t j = pos; j < trace_.size(); ++j) {
    for (int id = trace_[j].first; id <= trace_[j].second; ++id) {
      if (persistent_[size_t(id)] || uses_[size_t(id)] > 0) continue;
      const int64_t numel = params_.info(id).numel();
      if (ahead + numel > config_.stage3_prefetch_bucket_size) return launch();
      ahead += numel;
      if (state_[size_t(id)] != State::Released) continue;
      if (std::find(todo.begin(), todo.end(), id) != todo.end()) continue;
      if (live + numel > config_.stage3_max_live_parameters) return launch();
      live += numel;
      todo.push_back(id);
    }
    launch();
  }
}

void DistributedOptimizer::after_use(int first, int last) {
  if (config_.stage < 3) return;
  for (int id = first; id <= last; ++id) {
    DS_CHECK(uses_[size_t(id)] > 0, "ZeRO-3: '{}' released more often than it was used", params_.info(id).name);
    if (--uses_[size_t(id)] == 0 && !persistent_[size_t(id)]) release_param(id);
  }
}

// ---- gradients ----------------------------------------------------------------------------

void DistributedOptimizer::begin_step() {
  in_step_ = true;
  trace_pos_ = 0;
  first_micro_ = true;
  first_forward_ = true;
  std::fill(reduced_once_.begin(), reduced_once_.end(), 0);
  buckets_ = 0;
  exposed_seconds_ = 0;
  stats_before_.clear();
  for (Communicator* c : comms_.distinct()) stats_before_.push_back(c->stats());
  reset_peaks();
  if (config_.stage <= 1) {
    params_.zero_grads();
  } else {
    // Whole gradients are handed back as they are reduced; the shard restarts from zero.
    params_.zero_grads();
    grad_shard_.zero();
  }
}

void DistributedOptimizer::begin_forward() {
  if (config_.stage < 2) return;
  if (!first_forward_) {
    flush_pending_grads();
    retire_reductions(/*wait_all=*/true);
  }
  first_forward_ = false;
}

void DistributedOptimizer::begin_micro_step(bool last) {
  if (reducer_) reducer_->begin_micro_step(last);
  if (config_.stage < 2) return;
  if (!first_micro_) {
    // The gradients reduced so far must be done (and their memory handed back) before this
    // backward writes the whole-gradient buffer again: a reduction still in flight would see
    // part of this micro-step, and its release would then drop that part.
    flush_pending_grads();
    retire_reductions(/*wait_all=*/true);
  }
  first_micro_ = false;
}

void DistributedOptimizer::grad_ready(int first, int last) {
  if (reducer_) reducer_->grad_ready(first, last);
  if (config_.stage < 2) return;
  for (int id = first; id <= last; ++id) {
    const ParamInfo& p = params_.info(id);
    if (!p.trainable) continue;  // updated by a rule, never by its gradient
    pending_grads_.push_back(id);
    pending_elems_ += p.numel();
    account_transient(p.numel() * 4);
  }
  if (config_.overlap_comm && pending_elems_ >= config_.reduce_bucket_size) flush_pending_grads();
}

void DistributedOptimizer::flush_pending_grads() {
  if (pending_grads_.empty()) return;
  // One collective per run of parameters that share a communicator, in the order they came.
  std::vector<int> bucket;
  for (int id : pending_grads_) {
    if (params_.info(id).numel() >= kSoloElements) {
      launch_reduce({id});
      continue;
    }
    if (!bucket.empty() && &comm_of(bucket.front()) != &comm_of(id)) {
      launch_reduce(bucket);
      bucket.clear();
    }
    bucket.push_back(id);
  }
  if (!bucket.empty()) launch_reduce(bucket);
  pending_grads_.clear();
  pending_elems_ = 0;
  retire_reductions(/*wait_all=*/false);
}

void DistributedOptimizer::launch_reduce(const std::vector<int>& ids) {
  Communicator& comm = comm_of(ids.front());
  const int n = comm.size(), me = comm.rank();
  // Rank-major packing: rank r's pieces of every parameter of the bucket, in bucket order.
  std::vector<int64_t> per_rank(size_t(n), 0);
  int64_t total = 0;
  for (int id : ids) {
    const std::vector<int64_t> c = counts(id);
    for (int r = 0; r < n; ++r) per_rank[size_t(r)] += c[size_t(r)];
    total += params_.info(id).numel();
  }
  // 16-bit communication: this micro-step's gradients go in that type (half the bytes on the
  // wire) and the reduced pieces are added to the fp32 shard. In fp32 the shard's running sum
  // of earlier micro-steps goes into this rank's own rows first, so the reduction is the total.
  const bool wire16 = comm_dtype_ != DType::F32 && n > 1;
  const DType dt = wire16 ? comm_dtype_ : DType::F32;
  Pending r;
  r.ids = ids;
  if (ids.size() == 1 && !wire16) {
    // One parameter in fp32: its pieces are already rank-major; reduced in place into the shard.
    const int id = ids.front();
    const ParamInfo& p = params_.info(id);
    const RowPiece& pc = pieces_[size_t(id)];
    const Tensor whole = params_.grads().tensor(p.offset, {p.numel()});
    if (reduced_once_[size_t(id)] && pc.elems()) {
      ops::add_inplace(whole.slice(pc.elem_begin(), pc.elem_begin() + pc.elems()), grad_piece(id));
    }
    reduced_once_[size_t(id)] = 1;
    r.work = comm.reduce_scatter_v_async(grad_piece(id), whole, per_rank);
    reductions_.push_back(std::move(r));
    ++buckets_;
    return;
  }
  r.packed = take_buffer("zero.reduce_bucket", dt, total);
  r.mine = take_buffer("zero.reduce_bucket_piece", dt, per_rank[size_t(me)]);
  std::vector<int64_t> at(size_t(n), 0);  // where each rank's next piece goes in `packed`
  for (int q = 1; q < n; ++q) at[size_t(q)] = at[size_t(q - 1)] + per_rank[size_t(q - 1)];
  for (int id : ids) {
    const ParamInfo& p = params_.info(id);
    const Tensor whole = params_.grads().tensor(p.offset, {p.numel()});
    for (int q = 0; q < n; ++q) {
      const RowPiece pc = row_piece(p.shape, q, n);
      if (pc.elems() == 0) continue;
      const Tensor src = whole.slice(pc.elem_begin(), pc.elem_begin() + pc.elems());
      const Tensor dst = r.packed.tensor(at[size_t(q)], {pc.elems()});
      if (wire16) {
        ops::cast(dst, src);
      } else {
        ops::copy(dst, src);
        if (q == me && reduced_once_[size_t(id)]) ops::add_inplace(dst, grad_piece(id));
      }
      at[size_t(q)] += pc.elems();
    }
    reduced_once_[size_t(id)] = 1;
  }
  r.work = comm.reduce_scatter_v_async(r.mine.tensor(0, {per_rank[size_t(me)]}), r.packed.tensor(0, {total}), per_rank);
  reductions_.push_back(std::move(r));
  ++buckets_;
}

void DistributedOptimizer::retire_reductions(bool wait_all) {
  const auto t0 = Clock::now();
  size_t kept = 0;
  for (size_t i = 0; i < reductions_.size(); ++i) {
    Pending& r = reductions_[i];
    const bool done = wait_all ? (r.work.wait(), true) : r.work.test();
    if (!done) {
      if (kept != i) reductions_[kept] = std::move(r);  // never onto itself: that would free its buffers
      ++kept;
      continue;
    }
    // This rank's reduced pieces into the shard (added in 16 bits: the shard holds the running
    // sum), and the whole gradients handed back.
    const bool wire16 = r.mine.dtype() != DType::F32, in_place = !r.mine.allocated();
    int64_t at = 0;
    for (int id : r.ids) {
      const ParamInfo& p = params_.info(id);
      const int64_t e = pieces_[size_t(id)].elems();
      if (e > 0 && !in_place) {
        const Tensor got = r.mine.tensor(at, {e});
        wire16 ? ops::add_inplace(grad_piece(id), got) : ops::copy(grad_piece(id), got);
      }
      at += e;
      params_.grads().release_range(p.offset, p.numel());
      account_transient(-p.numel() * 4);
    }
    give_back(std::move(r.packed));
    give_back(std::move(r.mine));
  }
  reductions_.resize(kept);
  if (wait_all) exposed_seconds_ += seconds_since(t0);
}

ReduceTimings DistributedOptimizer::finish() {
  ReduceTimings t;
  if (config_.stage <= 1) {
    // The whole gradients, all-reduced by the GradReducer.
    recording_ = false;
    in_step_ = false;
    exposed_seconds_ = 0;
    return reducer_->finish();
  }
  if (config_.stage >= 2) {
    flush_pending_grads();
    retire_reductions(/*wait_all=*/true);
  }
  if (config_.stage == 3) {
    // Prefetches the step did not use, and anything a failed micro-step left in use.
    std::fill(uses_.begin(), uses_.end(), 0);
    release_unused();
  }
  recording_ = recording_ && !in_step_;
  in_step_ = false;
  const std::vector<Communicator*> comms = comms_.distinct();
  for (size_t i = 0; i < comms.size() && i < stats_before_.size(); ++i) {
    t.comm_seconds += comms[i]->stats().busy_seconds - stats_before_[i].busy_seconds;
  }
  t.exposed_seconds = exposed_seconds_;
  exposed_seconds_ = 0;
  t.buckets = buckets_;
  return t;
}

double DistributedOptimizer::local_grad_sum_squares(const std::vector<char>& counted) const {
  double local = 0;
  for (const Tensor& run : grad_norm_runs(counted)) local += ops::read_sum_squares(run);
  return local;
}

std::vector<Tensor> DistributedOptimizer::grad_norm_runs(const std::vector<char>& counted) const {
  if (config_.stage >= 2 && counted.empty()) return {grad_shard_.tensor()};  // the padding between pieces is zero
  // One run per stretch of counted pieces that lie end to end (stage 0 on one rank: the whole
  // gradient buffer in one), not one per parameter: on a device each read waits for it.
  const Buffer& buf = config_.stage >= 2 ? grad_shard_ : params_.grads();
  std::vector<Tensor> runs;
  int64_t run_begin = 0, run_end = 0;
  auto flush = [&] {
    if (run_end > run_begin) runs.push_back(buf.tensor(run_begin, {run_end - run_begin}));
    run_begin = run_end = 0;
  };
  for (int id = 0; id < params_.size(); ++id) {
    if (!counted.empty() && !counted[size_t(id)]) continue;
    const Tensor g = grad_piece(id);
    if (g.numel() == 0) continue;
    const int64_t begin = (static_cast<const float*>(g.raw()) - static_cast<const float*>(buf.tensor().raw()));
    const int64_t end = begin + g.numel();
    if (begin != run_end) flush(), run_begin = begin;
    run_end = end;
  }
  flush();
  return runs;
}

double DistributedOptimizer::grad_norm() {
  DS_CHECK(comms_.shared(), "ZeRO: the gradient norm of groups sharded over different communicators needs the "
           "caller's count (local_grad_sum_squares)");
  return std::sqrt(comms_.comm(ParamGroup::Dense).all_reduce_value(local_grad_sum_squares({})));
}

// ---- the update ---------------------------------------------------------------------------

void DistributedOptimizer::step(double lr, double grad_scale) {
  ops::AdamWStep s = adamw_.step_params(++step_, lr, grad_scale);
  if (config_.stage == 0) {
    // The whole local weights from the whole reduced gradients, as the one-process AdamW.
    adamw_update_whole(params_, exp_avg_, exp_avg_sq_, s, adamw_);
    return;
  }
  const bool host = config_.offloads_optimizer();
  for (int id = 0; id < params_.size(); ++id) {
    const ParamInfo& p = params_.info(id);
    const int64_t n = pieces_[size_t(id)].elems();
    if (!p.trainable || n == 0) continue;
    const int64_t off = shard_offsets_[size_t(id)];
    Tensor grad = grad_piece(id);
    if (host) {
      // device -> host
      Tensor hg = host_grads_.tensor(off, {n});
      ops::copy(hg, grad);
      grad = hg;
    }
    s.weight_decay = float(adamw_.weight_decay_of(p));
    ops::adamw_update(master_.tensor(off, {n}), grad, exp_avg_.tensor(off, {n}), exp_avg_sq_.tensor(off, {n}), Tensor(),
                      s);
  }
  if (config_.stage < 3) {
    gather_whole(/*persistent_only=*/false);
    return;
  }
  // host -> device: the pieces at rest on the device follow the updated masters.
  if (device_shard_.allocated()) ops::copy(device_shard_.tensor(), master_.tensor());
  for (int id = 0; id < params_.size(); ++id) {
    if (persistent_[size_t(id)] && state_[size_t(id)] != State::Released) release_param(id);
  }
  gather_whole(/*persistent_only=*/true);
}

void DistributedOptimizer::take_rule_update(int id) {
  if (config_.stage == 0) return;  // the rule wrote the masters themselves
  const RowPiece& pc = pieces_[size_t(id)];
  if (pc.elems() == 0) return;
  DS_CHECK(state_[size_t(id)] != State::Released, "ZeRO: '{}' was updated by a rule while not whole",
           params_.info(id).name);
  Tensor whole = params_.values().tensor(params_.info(id).offset + pc.elem_begin(), {pc.elems()});
  ops::copy(master_piece(id), whole);
  if (device_shard_.allocated()) ops::copy(device_shard_.tensor(shard_offsets_[size_t(id)], {pc.elems()}), whole);
}

int64_t DistributedOptimizer::count_non_finite() {
  return ops::read_count_non_finite(master().tensor()) + ops::read_count_non_finite(exp_avg_.tensor()) +
         ops::read_count_non_finite(exp_avg_sq_.tensor());
}

void DistributedOptimizer::gather_piece(int id, int k, Tensor out) {
  DS_CHECK(k >= 0 && k < 3, "gather_piece: state {} (0 weights, 1 exp_avg, 2 exp_avg_sq)", k);
  const ParamInfo& p = params_.info(id);
  DS_CHECK(out.numel() == p.numel(), "gather_piece('{}'): {} elements for {}", p.name, out.numel(), p.numel());
  const Buffer& shard = k == 0 ? master() : k == 1 ? exp_avg_ : exp_avg_sq_;
  const Tensor mine = shard.tensor(shard_offsets_[size_t(id)], {pieces_[size_t(id)].elems()});
  if (config_.stage == 0) {
    ops::copy(out.view(Shape{p.numel()}), mine);  // every rank holds it whole
    return;
  }
  comm_of(id).all_gather_v_async(out.view(Shape{p.numel()}), mine, counts(id)).wait();
}

void DistributedOptimizer::scatter_piece(int id, int k, Tensor whole) {
  DS_CHECK(k >= 0 && k < 3, "scatter_piece: state {} (0 weights, 1 exp_avg, 2 exp_avg_sq)", k);
  const ParamInfo& p = params_.info(id);
  DS_CHECK(whole.numel() == p.numel(), "scatter_piece('{}'): {} elements for {}", p.name, whole.numel(), p.numel());
  const Tensor flat = whole.view(Shape{p.numel()});
  if (comm_of(id).size() > 1) comm_of(id).broadcast(flat, 0);
  const RowPiece& pc = pieces_[size_t(id)];
  if (pc.elems() == 0) return;
  Buffer& shard = k == 0 ? master() : k == 1 ? exp_avg_ : exp_avg_sq_;
  ops::copy(shard.tensor(shard_offsets_[size_t(id)], {pc.elems()}), flat.slice(pc.elem_begin(), pc.elem_begin() + pc.elems()));
}

ZeroMemory DistributedOptimizer::memory() const {
  ZeroMemory m;
  m.master = int64_t(master_.nbytes() + device_shard_.nbytes());
  m.optimizer = int64_t(exp_avg_.nbytes() + exp_avg_sq_.nbytes());
  m.grad_shard = int64_t(grad_shard_.nbytes() + host_grads_.nbytes());
  if (config_.stage < 3) {
    m.gathered = m.gathered_peak = int64_t(params_.values().nbytes() + params_.compute_values().nbytes());
  } else {
    m.gathered = gathered_bytes_;
    m.gathered_peak = gathered_peak_;
  }
  if (config_.stage < 2) {
    m.transient_grads = m.transient_grads_peak = int64_t(params_.grads().nbytes());
  } else {
    m.transient_grads = transient_bytes_;
    m.transient_grads_peak = transient_peak_;
  }
  m.comm_buffers = 0;  // the gathers' and reductions' buffers, in flight or kept for reuse
  for (const Buffer& b : free_buffers_) m.comm_buffers += int64_t(b.nbytes());
  return m;
}

void DistributedOptimizer::reset_peaks() {
  gathered_peak_ = gathered_bytes_;
  transient_peak_ = transient_bytes_;
}

}  // namespace dstrain
