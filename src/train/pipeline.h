// Pipeline parallelism: the model cut into stages over the ranks of the pipeline axis, and one
// rank's part of a step. A schedule (distributed/schedule.h) says in which order the rank runs
// the forwards and backwards of its chunks (one stage per chunk; two or more with interleaved
// and DualPipeV schedules); this runner carries them out and moves the activations (forward) and
// their gradients (backward) between the ranks holding neighbouring stages, with non-blocking
// point-to-point messages through the pipeline communicator:
//
//   Forward(mb, chunk) of stage s:  input  <- stage s-1's output   (recv, or the rank's own chunk)
//                                   output -> stage s+1             (isend, kept until the backward)
//   Backward(mb, chunk) of stage s: dout   <- stage s+1's din       (recv, or the rank's own chunk)
//                                   din    -> stage s-1             (isend)
//
// Shapes are not sent: both ends derive every message's shape from the model config and the
// micro-batch (Transformer::boundary_shape), which the ranks already agree on.
//
// Two transports:
// - Tag-matched (MPI, and the default): receives are posted ahead of the actions that need
//   them, so the transfer overlaps the compute before it; sends complete in the background. The
//   message tag names the direction, the receiving stage and the micro-batch, so no message can
//   be taken for another. On GPUs without CUDA-aware MPI the pipeline communicator stages
//   device tensors through host memory.
// - In schedule order (NCCL on GPUs): NCCL has no tags; it matches the k-th send from A to B
//   with the k-th receive on B from A, and runs a communicator's operations one after another
//   on its stream, a send or receive holding the stream until its peer's matching one is issued.
//   So nothing is posted ahead: each receive is issued right before the action that consumes
//   it, each send right after the action that produces it, in the rank's schedule order, over
//   four channels (comm/in_order_channels.h): activations and gradients, each going down or up
//   the ranks, so that no message waits on one stream behind one going the other way (with a
//   channel per direction only, the interleaved schedule's ring and DualPipeV's two-way traffic
//   deadlock). Whether a schedule can run this way is checked at construction by simulating
//   every rank's plan under those rules (simulate_in_order); a schedule that fails keeps the
//   tag-matched transport. Over MPI the mode uses one tag per channel, so MPI's non-overtaking
//   rule matches messages by order exactly as NCCL does.
//
// Weights used on two stages (the embedding, read on the last stage by a tied head or by the
// MTP modules) live as a copy there (ParamInfo::pipeline_copy): reduce_tied_grads() sums the
// two gradients once per step (Megatron-Core's embedding group), and copy_tied() hands the
// owner's values to the copy after a load.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "comm/in_order_channels.h"
#include "core/buffer.h"
#include "distributed/param_hooks.h"
#include "distributed/schedule.h"
#include "model/stage.h"
#include "model/transformer.h"
#include "train/timeline.h"

namespace dstrain {

// The model stages of a pipeline: `stages` of them, with decoder layers balanced by the
// modelled cost (model/stage.h) or, with `partition`, given by hand. Errors name
// parallel.partition or parallel.pipeline.
std::vector<StageSpec> pipeline_stages(const ModelConfig& c, int stages, const std::vector<int64_t>& partition,
                                       int64_t seq_len);
// The chunks pipeline rank `rank` of `ranks` holds under `schedule`, in chunk order.
std::vector<StageSpec> rank_chunks(const Schedule& schedule, const std::vector<StageSpec>& stages, int rank, int ranks);

// A step's gradients become final for the data-parallel reduction only once every micro-batch
// of every chunk has reported them: this hook forwards a parameter's grad_ready to `inner`
// when it has been reported `n_micro` times in the step (each chunk reports its parameters
// once per micro-batch, whatever the schedule interleaves), so that the reducer sees each
// parameter once, in the step's last micro-step.
class FinalGradHooks final : public ParamHooks {
 public:
  FinalGradHooks(ParamHooks& inner, int num_params) : inner_(inner), counts_(size_t(num_params), 0) {}
  void begin_step(int n_micro);
  void before_use(int first, int last) override { inner_.before_use(first, last); }
  void after_use(int first, int last) override { inner_.after_use(first, last); }
  void grad_ready(int first, int last) override;

 private:
  ParamHooks& inner_;
  std::vector<int> counts_;
  int n_micro_ = 1;
};

// The in-order transport's plan and its check. A rank's host issues, for one step in schedule
// order: before an action whose input comes from another rank, the receive and a wait for it;
// before a backward, a wait for its forward's output send; after an action whose output goes to
// another rank, the send; at the end, a wait for every send. Compute is not modelled (it only
// delays), nor are hand-overs inside a rank.
struct InOrderOp {
  enum class Kind { Send, Recv, Wait };
  Kind kind = Kind::Send;
  int peer = -1;                   // Send, Recv: the other pipeline rank
  int channel = 0;                 // Send, Recv: in_order_channel(...)
  bool gradient = false;           // Send, Recv: the message: a gradient (else an activation)
  int stage = 0, micro_batch = 0;  // ... into this model stage, of this micro-batch
  int op = -1;                     // Wait: the index in the rank's list of the Send or Recv waited for
};
// "send G3.1 to 2 on 1", "recv A2.0 from 0 on 0", "wait 4".
std::string to_string(const InOrderOp& op);

// The channel of a message, a gradient or an activation, whose link goes up the ranks (to a
// lower rank) or down, with `channels` channels: 4 (InOrderChannels: 2 * gradient + up, what
// the runner uses), 2 (one per direction: gradient) or 1 (all on one: 0).
int in_order_channel(bool gradient, bool up, int channels);
// What every pipeline rank of `ranks` issues for a step of `n_micro` micro-batches of
// `schedule` (stages held as Schedule::model_stage says), on `channels` channels.
std::vector<std::vector<InOrderOp>> in_order_programs(const Schedule& schedule, int ranks, int n_micro,
                                                      int channels = InOrderChannels::kCount);

// Runs the ranks' lists under NCCL's point-to-point semantics, conservatively: each (rank,
// channel) is a stream that runs its sends and receives one after another in issue order; the
// one at the head of rank A's stream completes only together with its match at the head of the
// peer's stream on the same channel (rendezvous: no send completes on its own, however small);
// a rank's host issues its sends and receives without blocking and stops at a wait until the
// operation has completed. Returns an empty string when every rank completes and every
// matched pair is the same message (the k-th send from A to B on a channel is the k-th
// receive on B from A there); otherwise what goes wrong: the first mismatched pair, or the
// deadlock (what each unfinished rank waits for and the heads of its streams).
std::string simulate_in_order(const std::vector<std::vector<InOrderOp>>& programs);

class PipelineRunner {
 public:
  // The model holds this rank's chunks of `schedule` over the `pp` ranks (rank_chunks); the
  // pipeline has `stages` in all. With in-order `channels`, steps whose schedule passes the
  // in-order check run their messages over them in schedule order; the others, and every step
  // without channels, post receives ahead over `pp` with tags. `n_micro`: the micro-batches of
  // the run's steps, checked now (0: at the first step); a step of another count is checked
  // when it comes. Every pipeline rank reaches the same verdict (the check is deterministic).
  PipelineRunner(Transformer& model, Communicator& pp, const Schedule& schedule, std::vector<StageSpec> stages,
                 InOrderChannels channels = {}, int n_micro = 0);

  int num_stages() const { return int(stages_.size()); }
  const std::vector<StageSpec>& stages() const { return stages_; }
  // The pipeline rank and chunk that hold model stage s.
  std::pair<int, int> holder(int s) const { return holder_[size_t(s)]; }
  // Whether this rank holds the last stage (the head and the loss).
  bool holds_loss() const { return holder(num_stages() - 1).first == pp_.rank(); }
  int loss_rank() const { return holder(num_stages() - 1).first; }

  struct MicroBatch {
    Tensor tokens, targets;  // (B, T) int32, the same on every pipeline rank
  };
  // One step: this rank's schedule over the micro-batches. Returns, on the rank holding the
  // loss, the loss sums of every micro-batch (in order); empty sums elsewhere. The timeline
  // (null: none) records each action, receive wait and send of `step`.
  std::vector<LossSums> run_step(const std::vector<MicroBatch>& micro, const LossScales& scales, Timeline* timeline,
                                 int64_t step);

  // Inference through the stages, the result on every pipeline rank: the loss sums of tokens
  // against targets, and the last position's logits (B, V) of each sequence.
  LossSums forward_loss(Tensor tokens, Tensor targets);
  void last_logits(Tensor tokens, Tensor logits);

  // Tied weights. Whether this rank holds the owner (the first stage's embedding) or a copy
  // of a weight used on two ranks.
  bool has_tie() const { return tie_peer_ >= 0; }
  // Sums the gradients of the owner and its copy (a sendrecv between the two ranks; a + b on
  // one, b + a on the other: the same bits).
  void reduce_tied_grads();
  // The same for a piece of them (ZeRO stages 2 and 3: both ranks' identical pieces of the
  // reduced gradient).
  void reduce_tied_grads(Tensor g);
  // Sends the owner's tensors of the tied parameter to the copy, which receives them in place:
  // its values after a load, and on resume the optimizer's moments; the same tensors, in the
  // same order, on both ranks.
  void copy_tied(const std::vector<Tensor>& tensors);
  // The tied parameter's registry id on this rank (-1 without a tie).
  int tied_param() const { return tie_param_; }

  // Point-to-point traffic of this runner since the last call: bytes sent and received, and
  // the seconds spent waiting for receives.
  struct Traffic {
    double bytes_sent = 0, bytes_received = 0, recv_wait_seconds = 0;
    int64_t messages = 0;
  };
  Traffic take_traffic();

  // Whether steps of n_micro micro-batches run in schedule order over the in-order channels
  // (checked on first use, then remembered).
  bool in_order(int n_micro);
  // The transport of steps of n_micro micro-batches and why, for the log: "point-to-point over
  // nccl in schedule order (...)", or "... posted ahead, matched by tag: <why>".
  std::string transport(int n_micro);

  // With `on`, run_step records what this rank issues, in order:
  // to_string(action) for each action, "recv A3.1" / "recv G2.1" for each receive (an
  // activation into stage 3, a gradient into stage 2, of micro-batch 1) and "send A3.1" for each
  // send. Cleared by each step.
  void record_issue_order(bool on) { record_ = on; }
  const std::vector<std::string>& issue_order() const { return issued_; }

 private:
  enum Dir { kForward = 0, kBackward = 1 };
  // A message into stage s of micro-batch mb: its tag on the pipeline communicator.
  int tag(Dir dir, int s, int mb) const;
  struct Message {
    Dir dir;
    int stage, mb;  // the receiving stage
    bool operator<(const Message& o) const { return std::tie(dir, stage, mb) < std::tie(o.dir, o.stage, o.mb); }
  };
  struct Pending {
    Buffer buffer;
    Tensor view;  // the message, shaped, in `buffer` (or in the activation store)
    Work work;
    Timeline* timeline = nullptr;  // where the send is recorded (null: nowhere)
    int64_t timeline_id = -1;
  };
  // Tied weights' messages; the step's tags stay below it.
  static constexpr int kTiedTag = 32767;
  // The receives this rank's actions need, in the order they need them.
  std::vector<Message> needed_receives(const std::vector<ScheduleAction>& plan) const;
  void post_receive(const Message& m, Shape shape);
  // Where message m goes: the pipeline communicator with its tag, or (in order) its channel
  // with that channel's tag.
  int channel(const Message& m) const;
  Communicator& wire(const Message& m) const;
  int wire_tag(const Message& m) const;
  void record(const char* what, const Message& m);
  // The received (or locally handed over) tensor of a message, waited for.
  Tensor take(const Message& m, Timeline* timeline, int64_t step);
  // The rank that sends message m.
  int sender(const Message& m) const;
  // A received (or handed over) message is used up: its buffer goes back to the pool.
  void release_receive(const Message& m);
  void send(const Message& m, Tensor t, Buffer buffer, Timeline* timeline, int64_t step);
  // Waits for a send, closes its timeline event, pools its buffer; returns the next send.
  std::map<Message, Pending>::iterator finish_send(std::map<Message, Pending>::iterator it);
  // Finishes the sends that have completed (all of them, waiting, with `wait`).
  void complete_sends(bool wait);
  // Inference: tokens through this rank's stages in order, from and to the neighbouring ranks;
  // `last_stage(in)` runs the last stage's part on the rank holding it.
  void forward_through(Tensor tokens, const std::function<void(Tensor in)>& last_stage);
  Buffer make_buffer(Shape shape);

  Transformer& model_;
  Communicator& pp_;
  const Schedule& schedule_;
  std::vector<StageSpec> stages_;
  std::vector<std::pair<int, int>> holder_;  // stage -> (pipeline rank, chunk)
  std::vector<int> stage_of_chunk_;           // this rank's chunk -> stage
  int n_micro_ = 1;
  InOrderChannels channels_;
  std::map<int, std::string> in_order_verdict_;  // n_micro -> "" (in order) or why not
  bool step_in_order_ = false;                   // the current step's (or inference's) transport
  bool record_ = false;
  std::vector<std::string> issued_;
  std::map<Message, Pending> receives_;  // posted receives and local hand-overs, by message
  std::map<Message, Pending> sends_;     // sends in flight
  std::vector<Buffer> free_;             // message buffers to reuse
  int tie_peer_ = -1, tie_param_ = -1;
  Traffic traffic_;
};

}  // namespace dstrain
