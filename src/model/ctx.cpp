#include "model/ctx.h"

#include <algorithm>
#include <mutex>

#include "backend/ops.h"

namespace dstrain {

// ---- ShardSpec ----------------------------------------------------------------------------

Range ShardSpec::split(int64_t count, int rank, int size, const char* what) {
  DS_CHECK(size >= 1 && rank >= 0 && rank < size, "shard {} of {} of {} is not a valid piece", rank, size, what);
  DS_CHECK(count % size == 0,
           "{} = {} does not split into {} equal pieces: choose a tensor/expert parallel size that divides it",
           what, count, size);
  const int64_t piece = count / size;
  return Range{rank * piece, (rank + 1) * piece};
}

ShardSpec ShardSpec::whole(const ModelConfig& c) { return tensor_parallel(c, 0, 1, 0, 1); }

std::string ShardSpec::tensor_parallel_problem(const ModelConfig& c, int64_t tp) {
  if (tp < 1) return fmt::format("a tensor-parallel size of {} is not a size", tp);
  if (tp == 1) return "";
  auto divides = [&](int64_t count) { return count % tp == 0; };
  if (!divides(c.num_attention_heads)) return fmt::format("num_attention_heads = {}", c.num_attention_heads);
  if (!c.mla()) {
    const int64_t kv = c.num_key_value_heads ? c.num_key_value_heads : c.num_attention_heads;
    if (kv > 0 && (kv >= tp ? !divides(kv) : tp % kv != 0)) {
      return fmt::format("num_key_value_heads = {} (split over the ranks, or replicated when fewer than them: then "
                         "the size must be a multiple of it)", kv);
    }
  }
  bool dense_layers = false;
  for (int64_t l = 0; l < c.num_hidden_layers + c.num_nextn_predict_layers; ++l) dense_layers |= !c.is_moe_layer(l);
  if (dense_layers && !divides(c.intermediate_size)) return fmt::format("intermediate_size = {}", c.intermediate_size);
  const int64_t shared = c.moe_intermediate_size * c.n_shared_experts;
  if (shared > 0 && !divides(shared)) {
    return fmt::format("moe_intermediate_size x n_shared_experts = {} (the shared experts' width)", shared);
  }
  if (!divides(c.vocab_size)) return fmt::format("vocab_size = {}", c.vocab_size);
  return "";
}

std::vector<int64_t> ShardSpec::valid_tensor_parallel_sizes(const ModelConfig& c, int64_t limit) {
  std::vector<int64_t> out;
  for (int64_t t = 1; t <= limit; ++t) {
    if (tensor_parallel_problem(c, t).empty()) out.push_back(t);
  }
  return out;
}

ShardSpec ShardSpec::tensor_parallel(const ModelConfig& c, int tp_rank, int tp_size, int ep_rank, int ep_size,
                                     bool sequence_parallel) {
  DS_CHECK(tp_size >= 1 && tp_rank >= 0 && tp_rank < tp_size, "tensor rank {} of {} is not a valid piece", tp_rank,
           tp_size);
  const std::string problem = tensor_parallel_problem(c, tp_size);
  if (!problem.empty()) {
    const std::vector<int64_t> ok = valid_tensor_parallel_sizes(c);
    throw Error(fmt::format("parallel.tensor = {} does not split the model: {} is not divisible by it; tensor-parallel "
                            "sizes that split this model: {}",
                            tp_size, problem, fmt::join(ok, ", ")));
  }
  ShardSpec s;
  s.tp_rank = tp_rank;
  s.tp_size = tp_size;
  s.ep_rank = ep_rank;
  s.ep_size = ep_size;
  s.sequence_parallel = sequence_parallel && tp_size > 1;
  s.heads = split(c.num_attention_heads, tp_rank, tp_size, "num_attention_heads");
  const int64_t kv = c.mla() ? c.num_attention_heads
                             : (c.num_key_value_heads ? c.num_key_value_heads : c.num_attention_heads);
  if (kv >= tp_size || kv == 0) {  // 0: a config without attention (block tests)
    s.kv_heads = split(kv, tp_rank, tp_size, "num_key_value_heads");
  } else if (kv > 0) {
    // Fewer key/value heads than ranks: rank t holds head t * kv / tp, the one its query heads use.
    const int64_t g = int64_t(tp_rank) * kv / tp_size;
    s.kv_heads = Range{g, g + 1};
    s.kv_replicas = tp_size / kv;
  }
  s.ffn = c.intermediate_size % tp_size == 0 ? split(c.intermediate_size, tp_rank, tp_size, "intermediate_size")
                                             : Range{0, c.intermediate_size};  // no dense layer to split
  s.moe_ffn = Range{0, c.moe_intermediate_size};
  s.shared_ffn = split(c.moe_intermediate_size * c.n_shared_experts, tp_rank, tp_size,
                       "moe_intermediate_size x n_shared_experts");
  s.experts = split(c.n_routed_experts, ep_rank, ep_size, "n_routed_experts");
  s.vocab = split(c.vocab_size, tp_rank, tp_size, "vocab_size");
  return s;
}

// ---- ActKey ----------------------------------------------------------------------------------

namespace {
// The process's names of keys and of their roles. Layers are built from several threads in the
// thread-backed tests, so it is locked; only construction reaches it.
struct Interner {
  std::mutex mutex;
  std::unordered_map<std::string, ActKey> keys;
  std::vector<std::string> names;  // key id -> name
  std::unordered_map<std::string, int32_t> roles;
  int64_t calls = 0;
};

Interner& interner() {
  static Interner in;
  return in;
}

// "layers.{digits}.rest" -> "rest"; other names have no role.
std::string_view role_of(std::string_view name) {
  if (!name.starts_with("layers.")) return {};
  size_t i = 7;
  while (i < name.size() && name[i] >= '0' && name[i] <= '9') ++i;
  if (i == 7 || i >= name.size() || name[i] != '.') return {};
  return name.substr(i + 1);
}
}  // namespace

ActKey act_key(std::string_view name) {
  Interner& in = interner();
  const std::lock_guard<std::mutex> lock(in.mutex);
  ++in.calls;
  auto [it, added] = in.keys.try_emplace(std::string(name));
  if (added) {
    it->second.id = int32_t(in.names.size());
    in.names.emplace_back(name);
    const std::string_view role = role_of(name);
    if (!role.empty()) {
      auto r = in.roles.try_emplace(std::string(role), int32_t(in.roles.size())).first;
      it->second.role = r->second;
    }
  }
  return it->second;
}

std::string act_key_name(ActKey key) {
  Interner& in = interner();
  const std::lock_guard<std::mutex> lock(in.mutex);
  if (key.id < 0 || size_t(key.id) >= in.names.size()) return fmt::format("<key {}>", key.id);
  return in.names[size_t(key.id)];
}

int64_t act_key_calls() {
  Interner& in = interner();
  const std::lock_guard<std::mutex> lock(in.mutex);
  return in.calls;
}

std::vector<ActKey> act_keys_with_prefix(std::string_view prefix, const std::vector<std::string>& except) {
  Interner& in = interner();
  const std::lock_guard<std::mutex> lock(in.mutex);
  std::vector<ActKey> out;
  for (const auto& [name, key] : in.keys) {
    const bool excepted =
        std::any_of(except.begin(), except.end(), [&](const std::string& e) { return name.starts_with(e); });
    if (name.starts_with(prefix) && !excepted) out.push_back(key);
  }
  std::sort(out.begin(), out.end(), [](ActKey a, ActKey b) { return a.id < b.id; });
  return out;
}

// ---- ActivationStore ------------------------------------------------------------------------

ActivationStore::Entry& ActivationStore::entry(Slot& slot, ActKey key) {
  DS_CHECK(key.valid(), "an activation key that was never interned (act_key) was used");
  if (size_t(key.id) >= slot.entries.size()) slot.entries.resize(size_t(key.id) + 1);
  Entry& e = slot.entries[size_t(key.id)];
  e.key = key;
  return e;
}

Tensor ActivationStore::put(int mb, ActKey key, Shape shape, DType dtype) {
  Entry& e = entry(slots_[mb], key);
  const size_t need = size_t(shape.numel()) * dtype_size(dtype);
  if (!e.held || e.buffer.nbytes() < need) {
    if (e.held) hand_back(key, e);
    Buffer b = take_pooled(key, need);
    if (!b.allocated()) {
      // Bytes, so one buffer serves any dtype when it comes back from the pool. The label is
      // made once per key: allocations follow the largest shapes, so they stop after warm-up.
      if (size_t(key.id) >= labels_.size()) labels_.resize(size_t(key.id) + 1);
      std::string& label = labels_[size_t(key.id)];
      if (label.empty()) label = std::string(mem_category_name(category_)) + "." + act_key_name(key);
      const int64_t bytes = int64_t(std::max<size_t>(need, 1));
      b = pinned_host_ ? Buffer::pinned_host(label, category_, DType::U8, bytes)
                       : Buffer(label, category_, DType::U8, bytes, device_);
    }
    e.buffer = std::move(b);
    e.held = true;
  }
  e.view = Tensor(e.buffer.data(), dtype, shape, device_);
  return e.view;
}

void ActivationStore::pool(ActKey key, Buffer b) {
  if (size_t(key.id) >= pool_.size()) pool_.resize(size_t(key.id) + 1);
  std::multimap<size_t, Buffer>& p = pool_[size_t(key.id)];
  if (std::find(pooled_keys_.begin(), pooled_keys_.end(), key.id) == pooled_keys_.end()) {
    pooled_keys_.push_back(key.id);
    if (key.role >= 0) {
      if (size_t(key.role) >= roles_.size()) roles_.resize(size_t(key.role) + 1);
      roles_[size_t(key.role)].push_back(key.id);
    }
  }
  p.emplace(b.nbytes(), std::move(b));
}

Buffer ActivationStore::take_pooled(ActKey key, size_t need) {
  auto take = [&](std::multimap<size_t, Buffer>& pool, std::multimap<size_t, Buffer>::iterator p) {
    Buffer b = std::move(p->second);
    pool.erase(p);
    return b;
  };
  if (size_t(key.id) < pool_.size() && !pool_[size_t(key.id)].empty()) {
    std::multimap<size_t, Buffer>& own = pool_[size_t(key.id)];
    auto p = own.lower_bound(need);
    if (p != own.end()) return take(own, p);
    // This key's buffers are all too small: the new one replaces the largest of them.
    own.erase(std::prev(own.end()));
    return Buffer();
  }
  // A key this store has not pooled yet: the best fit among the buffers of the same role in
  // other layers ("layers.3.attn.qkv" for "layers.5.attn.qkv": recomputed layers hand their
  // buffers on to the next, shape for shape), then among all others, else a new buffer that
  // replaces the largest one too small for it.
  std::multimap<size_t, Buffer>* best_pool = nullptr;
  std::multimap<size_t, Buffer>::iterator best, smaller;
  std::multimap<size_t, Buffer>* smaller_pool = nullptr;
  // A buffer more than twice the size asked for is not handed on: a small tensor kept for
  // long (a recomputed layer's routing decisions) would pin a large one.
  auto fits = [&](size_t capacity) { return capacity <= 2 * need + 4096; };
  if (key.role >= 0 && size_t(key.role) < roles_.size()) {
    for (int32_t k : roles_[size_t(key.role)]) {
      std::multimap<size_t, Buffer>& pool = pool_[size_t(k)];
      auto p = pool.lower_bound(need);
      if (p != pool.end() && fits(p->first) && (!best_pool || p->first < best->first)) {
        best_pool = &pool;
        best = p;
      }
    }
    if (best_pool) return take(*best_pool, best);
  }
  for (int32_t k : pooled_keys_) {
    std::multimap<size_t, Buffer>& pool = pool_[size_t(k)];
    auto p = pool.lower_bound(need);
    if (p != pool.end() && fits(p->first) && (!best_pool || p->first < best->first)) {
      best_pool = &pool;
      best = p;
    }
    if (p != pool.begin() && (!smaller_pool || std::prev(p)->first > smaller->first)) {
      smaller_pool = &pool;
      smaller = std::prev(p);
    }
  }
  if (best_pool) return take(*best_pool, best);
  if (smaller_pool) smaller_pool->erase(smaller);
  return Buffer();
}

bool ActivationStore::has(int mb, ActKey key) const {
  auto s = slots_.find(mb);
  if (s == slots_.end() || key.id < 0) return false;
  const std::deque<Entry>& entries = s->second.entries;
  return size_t(key.id) < entries.size() && entries[size_t(key.id)].held;
}

Tensor ActivationStore::get(int mb, ActKey key) const {
  auto s = slots_.find(mb);
  DS_CHECK(s != slots_.end(), "no activations are stored for micro-batch {} (backward '{}' before its forward?)", mb,
           act_key_name(key));
  DS_CHECK(has(mb, key), "micro-batch {} has no stored activation '{}'", mb, act_key_name(key));
  return s->second.entries[size_t(key.id)].view;
}

void ActivationStore::release(int mb) {
  auto s = slots_.find(mb);
  if (s == slots_.end()) return;
  for (Entry& e : s->second.entries) {
    if (e.held) pool(e.key, std::move(e.buffer));
  }
  slots_.erase(s);
}

void ActivationStore::release_keys(int mb, const std::vector<ActKey>& keys) {
  auto s = slots_.find(mb);
  if (s == slots_.end()) return;
  std::deque<Entry>& entries = s->second.entries;
  for (ActKey key : keys) {
    if (key.id >= 0 && size_t(key.id) < entries.size() && entries[size_t(key.id)].held) {
      hand_back(key, entries[size_t(key.id)]);
    }
  }
}

void ActivationStore::release_key(int mb, ActKey key) { release_keys(mb, {key}); }

void ActivationStore::hand_back(ActKey key, Entry& e) {
  e.view = Tensor();
  e.held = false;
  pool(key, std::move(e.buffer));
}

void ActivationStore::clear() {
  slots_.clear();
  pool_.clear();
  pooled_keys_.clear();
  roles_.clear();
}

std::vector<int> ActivationStore::in_flight() const {
  std::vector<int> out;
  for (const auto& [mb, s] : slots_) out.push_back(mb);
  return out;
}

int64_t ActivationStore::bytes_in_use() const {
  int64_t n = 0;
  for (const auto& [mb, s] : slots_)
    for (const Entry& e : s.entries) n += e.held ? int64_t(e.buffer.nbytes()) : 0;
  return n;
}

int64_t ActivationStore::bytes_allocated() const {
  int64_t n = bytes_in_use();
  for (const auto& pool : pool_)
    for (const auto& [cap, b] : pool) n += int64_t(b.nbytes());
  return n;
}

// ---- WeightGradStore ------------------------------------------------------------------------

void WeightGradStore::begin_deferral(int mb) {
  DS_CHECK(mb >= 0, "weight gradients are deferred per micro-batch, got {}", mb);
  deferring_mb_ = mb;
}

void WeightGradStore::end_deferral() { deferring_mb_ = -1; }

void WeightGradStore::linear(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx) {
  if (!deferring() || !dw.defined()) {
    ops::linear_backward(dx, dw, dout, x, w, accumulate_dx);
    return;
  }
  if (dx.defined()) ops::linear_backward(dx, Tensor(), dout, x, w, accumulate_dx);
  // Expert GEMMs queue from several threads: one at a time allocates, copies and queues.
  const std::lock_guard<std::mutex> lock(mutex_);
  Deferred d;
  d.dw = dw;
  d.w = w;
  d.dout_shape = dout.shape();
  d.x_shape = x.shape();
  d.dout = Buffer("weight_grad_store.dout", MemCategory::Activations, dout.dtype(), dout.numel(), device_);
  d.x = Buffer("weight_grad_store.x", MemCategory::Activations, x.dtype(), x.numel(), device_);
  ops::copy(d.dout.tensor(), dout.view(Shape{dout.numel()}));
  ops::copy(d.x.tensor(), x.view(Shape{x.numel()}));
  queues_[deferring_mb_].push_back(std::move(d));
}

void WeightGradStore::run(int mb) {
  auto q = queues_.find(mb);
  if (q == queues_.end()) return;
  for (Deferred& d : q->second) {
    ops::linear_backward(Tensor(), d.dw, d.dout.tensor(0, d.dout_shape), d.x.tensor(0, d.x_shape), d.w);
  }
  queues_.erase(q);
}

int WeightGradStore::pending(int mb) const {
  auto q = queues_.find(mb);
  return q == queues_.end() ? 0 : int(q->second.size());
}

// ---- Scratch, Ctx -----------------------------------------------------------------------

Tensor Scratch::get(ActKey slot, Shape shape, DType dtype) {
  DS_CHECK(slot.valid(), "a scratch slot that was never interned (act_key) was used");
  if (size_t(slot.id) >= buffers_.size()) buffers_.resize(size_t(slot.id) + 1);
  Buffer& b = buffers_[size_t(slot.id)];
  const int64_t bytes = int64_t(shape.numel()) * int64_t(dtype_size(dtype));
  if (b.nbytes() < size_t(bytes)) {
    if (size_t(slot.id) >= labels_.size()) labels_.resize(size_t(slot.id) + 1);
    std::string& label = labels_[size_t(slot.id)];
    if (label.empty()) label = "scratch." + act_key_name(slot);
    b = Buffer(label, MemCategory::Workspace, DType::U8, bytes, device_);
  }
  return Tensor(b.data(), dtype, shape, device_);
}

Range Ctx::token_rows(int64_t n) const {
  if (!sequence_parallel || tp_size() == 1) return Range{0, n};
  const int64_t p = tp_size(), r = tp_rank();
  DS_CHECK(n % p == 0, "sequence parallelism: the micro-batch's {} token rows do not split over {} tensor ranks; "
           "choose micro_batch x seq_len divisible by parallel.tensor", n, p);
  return Range{n * r / p, n * (r + 1) / p};
}

void Ctx::tp_all_reduce(Tensor t) const {
  if (ProcessGroups::size_of(groups.tp) > 1) groups.tp->all_reduce(t);
}

// ---- PhaseTimer -----------------------------------------------------------------------------

namespace {
// Spans after which a round is read between phases even without take() (a loop of forwards
// that is never taken), so that the marks stay bounded. A step has far fewer.
constexpr size_t kFoldAfter = 4096;
}  // namespace

int PhaseTimer::enter(int phase) {
  const int outer = current_;
  if (phase == current_) return outer;
  if (!clock_) clock_ = make_mark_clock(device_);
  const int m = clock_->mark();
  if (current_ >= 0 && opened_ >= 0) spans_.push_back(Span{current_, opened_, m});
  current_ = phase;
  opened_ = m;
  if (current_ < 0 && spans_.size() >= kFoldAfter) fold();
  return outer;
}

void PhaseTimer::fold() {
  if (!clock_) return;
  for (const Span& s : spans_) totals_[s.phase] += clock_->seconds(s.from, s.to);
  spans_.clear();
  clock_->restart();
}

PhaseSeconds PhaseTimer::take() {
  // A phase open across take() counts up to now here and goes on in the next round.
  const int open = current_;
  if (open >= 0) enter(-1);
  fold();
  if (open >= 0) enter(open);
  const PhaseSeconds s{totals_[int(Phase::Forward)], totals_[int(Phase::Backward)], totals_[int(Phase::Optimizer)]};
  for (double& t : totals_) t = 0;
  return s;
}

PhaseTimer::Scope::~Scope() {
  if (!timer_) return;
  try {
    timer_->enter(outer_);
  } catch (...) {
    // A mark that fails here (a device error, which the next op reports) must not end the
    // process from a destructor: the outer phase resumes untimed (no open mark).
    timer_->current_ = outer_;
    timer_->opened_ = -1;
  }
}

}  // namespace dstrain
