// The execution context a layer runs in, and the pieces it is made of:
//   Ctx              device (and so the backend that runs the ops), compute dtype, stream,
//                    the process groups a layer may call collectives on, the activation store,
//                    the weight-gradient store, the backward scratch and the parameter hooks.
//   ShardSpec        which piece of the model this rank's layers hold: heads, FFN columns,
//                    experts, vocabulary rows. Layers size themselves from it, not the config.
//   ActKey           the names of what layers keep and of backward temporaries, interned to
//                    small integers when a layer is built, so no op builds or hashes a string.
//   ActivationStore  what a micro-batch's forward keeps for its backward, keyed by micro-batch,
//                    so several micro-batches can be in flight (1F1B, DualPipe).
//   WeightGradStore  the weight-gradient half of a backward that was split into an input-
//                    gradient part and a weight-gradient part (DualPipe's zero-bubble split).
//   PhaseTimer       the forward / backward / optimizer split of training steps, in the
//                    device's own time.
#pragma once

#include <any>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "backend/timing.h"
#include "comm/comm.h"
#include "core/buffer.h"
#include "core/device.h"
#include "model/model_config.h"

namespace dstrain {

struct RopeCache;  // model/layers.h

// A half-open range [begin, end) of a global count (heads, columns, experts, rows).
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool operator==(const Range&) const = default;
};

// This rank's piece of every sharded dimension of the model. whole() is the unsharded model;
// tensor_parallel() splits, as Megatron-Core does, over the tensor group: attention heads
// (column-parallel q/k/v, MLA's q_b_proj/q_proj and kv_b_proj, row-parallel o_proj), the
// columns of dense and shared-expert MLPs (column-parallel gate/up, row-parallel down) and the
// vocabulary (embedding and head); routed experts stay whole under tensor parallelism (their
// axis is the expert group). Key/value heads are split when there are at least as many as
// tensor ranks, otherwise each is replicated on tp / num_key_value_heads ranks.
struct ShardSpec {
  int tp_rank = 0, tp_size = 1;
  int ep_rank = 0, ep_size = 1;
  // Sequence parallelism: between the blocks (norms, residuals, routed experts) each tensor
  // rank holds rows [N*r/tp, N*(r+1)/tp) of the micro-batch's N = B*T token rows.
  bool sequence_parallel = false;
  Range heads, kv_heads;  // attention heads (query, key/value)
  int64_t kv_replicas = 1;  // tensor ranks that hold the same key/value heads
  Range ffn;              // columns of intermediate_size (dense MLP)
  Range moe_ffn;          // columns of moe_intermediate_size (routed experts: whole)
  Range shared_ffn;       // columns of the shared experts' fused intermediate size
  Range experts;          // routed experts held here
  Range vocab;            // vocabulary rows of the embedding and head

  static ShardSpec whole(const ModelConfig& c);
  // A piece of `count` split into `size` equal parts; a count that does not divide is an error
  // naming `what` (e.g. "num_attention_heads").
  static Range split(int64_t count, int rank, int size, const char* what);
  // A tensor-parallel size that does not divide the heads, the key/value heads (or is not a
  // multiple of them), the FFN widths or the vocabulary is an error naming which, with the
  // sizes that work for the model.
  static ShardSpec tensor_parallel(const ModelConfig& c, int tp_rank, int tp_size, int ep_rank = 0, int ep_size = 1,
                                   bool sequence_parallel = false);
  // "" when tp_size splits the model; otherwise why not.
  static std::string tensor_parallel_problem(const ModelConfig& c, int64_t tp_size);
  // The tensor-parallel sizes up to `limit` that split the model.
  static std::vector<int64_t> valid_tensor_parallel_sizes(const ModelConfig& c, int64_t limit = 64);
  bool is_whole() const { return tp_size == 1 && ep_size == 1; }
};

// The communicators a layer may use. Null means a group of one rank: no collective is issued.
struct ProcessGroups {
  Communicator* tp = nullptr;  // tensor parallel: heads, FFN columns, vocabulary
  Communicator* sp = nullptr;  // sequence parallel (the tensor group's sequence split)
  Communicator* ep = nullptr;  // expert parallel: token all-to-all between expert owners
  Communicator* dp = nullptr;  // data parallel of dense parameters
  Communicator* expert_dp = nullptr;  // data parallel of expert parameters
  static int size_of(const Communicator* c) { return c ? c->size() : 1; }
};

// A queue of work on one device. The CPU runs ops synchronously; a CUDA stream handle goes here.
struct Stream {
  Device device;
  void* handle = nullptr;
};

// The name of something a micro-batch's forward keeps ("layers.3.attn.qkv") or of a backward
// temporary ("attn.datt"), turned into a small dense integer once, when the layer or model that
// uses it is built. The stores index vectors with it, so the forward and backward of a
// micro-batch build, format and hash no strings: on a GPU that host work sits between kernel
// launches. The name stays with the interner, for messages and for the key's role.
struct ActKey {
  int32_t id = -1;    // dense from 0, one per distinct name in the process
  int32_t role = -1;  // the interned part after "layers.{l}." (its role in every layer); -1: none
  bool valid() const { return id >= 0; }
  bool operator==(const ActKey& o) const { return id == o.id; }
};
// The key of `name`: the same key for the same name, a new one for a new name, in every thread.
// It takes a lock and hashes the name: call it when a layer or model is constructed, not per op.
ActKey act_key(std::string_view name);
// The name a key was interned from (messages).
std::string act_key_name(ActKey key);
// How many times act_key() has run in this process. A forward or backward adds none: the tests
// count them to keep it so.
int64_t act_key_calls();
// The keys interned so far whose names start with `prefix` but with none of `except`, in id
// order: everything a layer keeps, once its blocks have interned their keys (activation
// recomputation hands these back without looking at a name).
std::vector<ActKey> act_keys_with_prefix(std::string_view prefix, const std::vector<std::string>& except = {});

// What a micro-batch's forward keeps for its backward. Buffers are keyed by (micro-batch,
// key); keys name the layer and the tensor ("layers.3.attn.qkv"), interned (act_key) when the
// layer is built. release() returns a micro-batch's buffers to a pool that later micro-batches
// reuse, so memory grows only with the number of micro-batches in flight, not with how many ran.
class ActivationStore {
 public:
  explicit ActivationStore(Device device = Device::cpu()) : device_(device) {}
  // Buffers of `category` in page-locked host memory instead of the device's: what a forward
  // keeps off the device until its backward copies it back (cpu_checkpointing). Its tensors
  // are on the host, or for a model on the meta device (backend/meta.h) on the meta device,
  // where they are counted and hold nothing.
  ActivationStore(MemCategory category, bool pinned_host, Device model_device = Device::cpu())
      : device_(model_device.type == DeviceType::Meta ? model_device : Device::cpu()),
        category_(category),
        pinned_host_(pinned_host && model_device.type != DeviceType::Meta) {}
  ActivationStore(const ActivationStore&) = delete;
  ActivationStore& operator=(const ActivationStore&) = delete;

  // The buffer for `key` of micro-batch mb, viewed at `shape` (contents unspecified when new).
  // Reuses, in this order: the micro-batch's buffer of that key; a pooled buffer of that key
  // that fits; when the pool has none of that key, the smallest pooled one that fits (first
  // among the buffers of the same role in other layers). Else it allocates and frees a pooled
  // buffer too small for it (of that key when there is one), as a buffer that grows in place
  // would: memory follows the largest shapes seen, not all of them.
  Tensor put(int mb, ActKey key, Shape shape, DType dtype = DType::F32);
  // What put() stored; an error when the micro-batch has no such tensor (a backward without
  // its forward).
  Tensor get(int mb, ActKey key) const;
  bool has(int mb, ActKey key) const;
  // Small host-side values of a micro-batch (sizes, saved views, routing decisions).
  template <class T>
  T& meta(int mb, ActKey key) {
    std::any& a = entry(slots_[mb], key).meta;
    if (!a.has_value()) a = T{};
    return std::any_cast<T&>(a);
  }
  // Returns the micro-batch's buffers to the pool.
  void release(int mb);
  // Returns the micro-batch's buffers of `keys` to the pool (those it holds): a layer's
  // activations, listed when the layer was built (activation recomputation). Host-side values
  // (meta) stay.
  void release_keys(int mb, const std::vector<ActKey>& keys);
  // The same for the one buffer of `key`.
  void release_key(int mb, ActKey key);
  // Frees every buffer, pooled or in use.
  void clear();

  std::vector<int> in_flight() const;        // micro-batches with stored activations
  int64_t bytes_in_use() const;              // held by micro-batches in flight
  int64_t bytes_allocated() const;           // in use + pooled
  Device device() const { return device_; }

 private:
  // What a micro-batch holds of one key.
  struct Entry {
    ActKey key;
    bool held = false;  // buffer and view are the micro-batch's
    Buffer buffer;
    Tensor view;
    std::any meta;
  };
  // Indexed by key id. A deque, so that growing it for a new key leaves in place the values
  // that meta() handed out (a MoE layer holds its routing metadata across its puts).
  struct Slot {
    std::deque<Entry> entries;
  };
  static Entry& entry(Slot& slot, ActKey key);
  // A pooled buffer for `key` of at least `need` bytes, or an empty one to replace by a new
  // allocation (see put).
  Buffer take_pooled(ActKey key, size_t need);
  void pool(ActKey key, Buffer b);
  // Moves an entry's buffer (and drops its view) to the pool.
  void hand_back(ActKey key, Entry& e);
  Device device_;
  MemCategory category_ = MemCategory::Activations;
  bool pinned_host_ = false;
  std::map<int, Slot> slots_;
  // Released buffers by the key they were last used for (indexed by key id), then by capacity
  // in bytes; the keys with a pool entry, in the order they were first pooled.
  std::vector<std::multimap<size_t, Buffer>> pool_;
  std::vector<int32_t> pooled_keys_;
  std::vector<std::vector<int32_t>> roles_;  // role id -> pooled key ids of that role
  std::vector<std::string> labels_;          // key id -> its buffers' label, made at the first allocation
};

// The split backward of zero-bubble schedules: with deferral on, linear() computes the input
// gradient now and queues the weight gradient (keeping copies of dout and x) for run(mb).
class WeightGradStore {
 public:
  explicit WeightGradStore(Device device = Device::cpu()) : device_(device) {}
  // While deferring, weight gradients of micro-batch mb are queued instead of computed.
  void begin_deferral(int mb);
  void end_deferral();
  bool deferring() const { return deferring_mb_ >= 0; }
  // dx (M,K) = dout · w (added when accumulate_dx); dw (N,K) += dout^T · x now or at run().
  void linear(Tensor dx, Tensor dw, Tensor dout, Tensor x, Tensor w, bool accumulate_dx = false);
  // Computes the queued weight gradients of mb in the order they were queued.
  void run(int mb);
  int pending(int mb) const;
  void clear() { queues_.clear(); }

 private:
  struct Deferred {
    Tensor dw, w;
    Buffer dout, x;
    Shape dout_shape, x_shape;
  };
  Device device_;
  int deferring_mb_ = -1;
  std::mutex mutex_;  // expert GEMMs queue from several threads
  std::map<int, std::vector<Deferred>> queues_;
};

// Where ZeRO-3 gathers and gradient buckets plug into the model: before_use before a range of
// parameters is read by a forward or backward, after_use once that use is over (each
// before_use has its after_use; uses nest, as an MTP module's use of the embedding inside its
// own), grad_ready once their gradients of this micro-batch are final. Ranges are inclusive
// parameter ids.
class ParamHooks {
 public:
  virtual ~ParamHooks() = default;
  virtual void before_use(int first, int last) {}
  virtual void after_use(int first, int last) {}
  virtual void grad_ready(int first, int last) {}
};

// Temporaries for the backward pass, grown on demand and shared by every layer (not kept
// between calls). Slots are interned names (act_key("attn.datt")), like the activations' keys.
class Scratch {
 public:
  explicit Scratch(Device device = Device::cpu()) : device_(device) {}
  Tensor get(ActKey slot, Shape shape, DType dtype = DType::F32);
  void release() { buffers_.clear(); }

 private:
  Device device_;
  std::vector<Buffer> buffers_;      // by key id
  std::vector<std::string> labels_;  // by key id, made at the first allocation
};

// The phases of a training step that its time split reports apart.
enum class Phase { Forward, Backward, Optimizer };
constexpr int kPhases = 3;

// Seconds of each phase, in the device's own time.
struct PhaseSeconds {
  double forward = 0, backward = 0, optimizer = 0;
};

// The forward / backward / optimizer split of training steps, from timing marks on the model's
// device (backend/timing.h) at the phase boundaries: the host clock on the host; on a GPU,
// events on dstrain's stream, read once per step by take(), so no phase waits for the device
// at its end. Phases nest: the loss gradient the head forms inside the forward, or the MTP
// modules' backward, is marked as backward and the forward resumes after it.
class PhaseTimer {
 public:
  // The marks of `device` (its backend's, made at the first mark).
  explicit PhaseTimer(Device device = Device::cpu()) : device_(device) {}
  // Marks from `clock` (tests).
  explicit PhaseTimer(std::unique_ptr<MarkClock> clock) : clock_(std::move(clock)) {}
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // Counts the time from its construction to its end as `phase` (a mark at each end), then
  // the phase it interrupted resumes. A null timer times nothing.
  class Scope {
   public:
    Scope(PhaseTimer* timer, Phase phase) : timer_(timer) {
      if (timer_) outer_ = timer_->enter(int(phase));
    }
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    PhaseTimer* timer_;
    int outer_ = -1;
  };

  // Each phase's seconds since the previous take(), read from this round's marks (on a GPU,
  // after waiting for the last of them: the one synchronisation of a step); then a new round.
  PhaseSeconds take();

 private:
  // Makes `phase` (-1: none) the current one, with a mark when it changes; returns the one it replaces.
  int enter(int phase);
  // Adds the spans of this round to the totals and restarts the marks.
  void fold();

  struct Span {
    int phase, from, to;
  };
  Device device_;
  std::unique_ptr<MarkClock> clock_;
  int current_ = -1, opened_ = -1;  // the current phase and the mark it began at
  std::vector<Span> spans_;
  double totals_[kPhases] = {};
};

struct Ctx {
  Device device;                  // ops dispatch to the backend registered for it
  // F32, or BF16/F16 for mixed precision (README, "Mixed precision"): the dtype of the activations that
  // only feed GEMMs (norm outputs, projections, attention, expert rows) and of their
  // gradients. The residual stream, rstd, lse, logits, the loss and the router stay fp32.
  DType compute_dtype = DType::F32;
  Stream stream;
  ProcessGroups groups;
  ActivationStore* acts = nullptr;
  WeightGradStore* wgrad = nullptr;
  Scratch* scratch = nullptr;
  ParamHooks* hooks = nullptr;    // null: none
  RopeCache* rope = nullptr;      // rotary tables for the positions of the current batch
  PhaseTimer* phases = nullptr;   // marks the step's phases (null: untimed)
  // With a tensor group of more than one rank: the activations between blocks hold this rank's
  // rows only (ShardSpec::sequence_parallel).
  bool sequence_parallel = false;
  // A forward run again before its backward (activation recomputation): the layers make the
  // same activations with the same ops, and a MoE layer takes the routing decisions of the
  // first forward instead of routing again, counting no loads and no auxiliary loss twice.
  bool replay = false;
  // Selective recomputation (Megatron-Core's recompute_modules): "layernorm" keeps the norms'
  // outputs out of the store and forms them again from the residual in the backward;
  // "moe_act" does the same with the routed experts' SwiGLU output (from their gate|up);
  // "mla_up_proj" with MLA's per-head q|k|v (from the normed latents and k_pe).
  bool recompute_layernorm = false;
  bool recompute_moe_act = false;
  bool recompute_mla_up_proj = false;
  // The meta device only (the memory model): the rows this rank's experts receive under expert
  // parallelism, over a balanced share (metrics.expert_imbalance; 1: balanced).
  double expert_imbalance = 1;

  int tp_size() const { return ProcessGroups::size_of(groups.tp); }
  int tp_rank() const { return groups.tp ? groups.tp->rank() : 0; }
  // This rank's token rows [begin, end) of a micro-batch of n rows (all of them without
  // sequence parallelism).
  Range token_rows(int64_t n) const;

  // All-reduce (sum) over the tensor group of a row-parallel output; nothing when the group
  // has one rank.
  void tp_all_reduce(Tensor t) const;
  void before_use(int first, int last) const {
    if (hooks) hooks->before_use(first, last);
  }
  void after_use(int first, int last) const {
    if (hooks) hooks->after_use(first, last);
  }
  void grad_ready(int first, int last) const {
    if (hooks) hooks->grad_ready(first, last);
  }
};

}  // namespace dstrain
