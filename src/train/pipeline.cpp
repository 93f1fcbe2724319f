#include "train/pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <deque>
#include <optional>

#include "backend/ops.h"
#include "core/clock.h"
#include "core/exec_trace.h"

namespace dstrain {

std::vector<StageSpec> pipeline_stages(const ModelConfig& c, int stages, const std::vector<int64_t>& partition,
                                       int64_t seq_len) {
  DS_CHECK(stages >= 1, "a pipeline needs at least one stage, got {}", stages);
  if (!partition.empty()) return split_stages_manual(c, stages, partition);
  if (stages > c.num_hidden_layers) {
    throw Error(fmt::format("parallel.pipeline: {} pipeline stages for a model of {} decoder layers (num_hidden_layers): "
                            "each stage needs at least one layer; lower parallel.pipeline or parallel.virtual_stages",
                            stages, c.num_hidden_layers));
  }
  return split_stages_balanced(c, stages, seq_len);
}

std::vector<StageSpec> rank_chunks(const Schedule& schedule, const std::vector<StageSpec>& stages, int rank,
                                   int ranks) {
  DS_CHECK(int(stages.size()) == ranks * schedule.chunks(), "{} stages for {} ranks of {} chunks", stages.size(),
           ranks, schedule.chunks());
  std::vector<StageSpec> out;
  for (int c = 0; c < schedule.chunks(); ++c) out.push_back(stages[size_t(schedule.model_stage(rank, c, ranks))]);
  return out;
}

// ---------------------------------------------------------------------------------------
void FinalGradHooks::begin_step(int n_micro) {
  n_micro_ = n_micro;
  std::fill(counts_.begin(), counts_.end(), 0);
}

void FinalGradHooks::grad_ready(int first, int last) {
  // Forwards the runs of parameters whose count reached n_micro with this report.
  int run = -1;
  for (int id = first; id <= last + 1; ++id) {
    const bool final = id <= last && ++counts_[size_t(id)] == n_micro_;
    if (final && run < 0) run = id;
    if (!final && run >= 0) {
      inner_.grad_ready(run, id - 1);
      run = -1;
    }
  }
}

// ---------------------------------------------------------------------------------------
std::string to_string(const InOrderOp& op) {
  const std::string what = fmt::format("{}{}.{}", op.gradient ? 'G' : 'A', op.stage, op.micro_batch);
  switch (op.kind) {
    case InOrderOp::Kind::Send:
      return fmt::format("send {} to {} on {}", what, op.peer, op.channel);
    case InOrderOp::Kind::Recv:
      return fmt::format("recv {} from {} on {}", what, op.peer, op.channel);
    case InOrderOp::Kind::Wait:
      break;
  }
  return fmt::format("wait {}", op.op);
}

int in_order_channel(bool gradient, bool up, int channels) {
  if (channels == 1) return 0;
  const int dir = gradient ? 1 : 0;
  return channels == 2 ? dir : 2 * dir + (up ? 1 : 0);
}

std::vector<std::vector<InOrderOp>> in_order_programs(const Schedule& schedule, int ranks, int n_micro,
                                                      int channels) {
  DS_CHECK(channels == 1 || channels == 2 || channels == 4, "the in-order transport has 1, 2 or 4 channels, not {}",
           channels);
  const int P = ranks, V = schedule.chunks(), S = P * V;
  std::vector<int> holder(size_t(S), -1);
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c < V; ++c) holder[size_t(schedule.model_stage(r, c, P))] = r;
  }
  std::vector<std::vector<InOrderOp>> out(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::vector<InOrderOp>& prog = out[size_t(r)];
    std::map<std::pair<int, int>, int> activation_sends;  // (stage, micro-batch) -> index of its send
    std::vector<int> sends;
    auto issue = [&](InOrderOp::Kind kind, int peer, bool gradient, int stage, int mb) {
      InOrderOp op;
      op.kind = kind;
      op.peer = peer;
      // The message's link: down the ranks (sender below receiver) or up.
      const bool up = kind == InOrderOp::Kind::Send ? peer < r : r < peer;
      op.channel = in_order_channel(gradient, up, channels);
      op.gradient = gradient;
      op.stage = stage;
      op.micro_batch = mb;
      prog.push_back(op);
      const int index = int(prog.size()) - 1;
      if (kind == InOrderOp::Kind::Send) sends.push_back(index);
      return index;
    };
    auto wait = [&](int index) {
      InOrderOp op;
      op.kind = InOrderOp::Kind::Wait;
      op.op = index;
      prog.push_back(op);
    };
    for (const ScheduleAction& a : schedule.actions(r, P, n_micro)) {
      const int s = schedule.model_stage(r, a.chunk, P), mb = a.micro_batch;
      if (a.kind == ScheduleAction::Kind::Forward) {
        if (s > 0 && holder[size_t(s - 1)] != r) {
          wait(issue(InOrderOp::Kind::Recv, holder[size_t(s - 1)], false, s, mb));
        }
        if (s < S - 1 && holder[size_t(s + 1)] != r) {
          activation_sends[{s + 1, mb}] = issue(InOrderOp::Kind::Send, holder[size_t(s + 1)], false, s + 1, mb);
        }
      } else if (a.kind != ScheduleAction::Kind::BackwardWeight) {
        if (s < S - 1 && holder[size_t(s + 1)] != r) {
          // The backward hands the forward's output back to the activation store: its send first.
          auto it = activation_sends.find({s + 1, mb});
          if (it != activation_sends.end()) wait(it->second);
          wait(issue(InOrderOp::Kind::Recv, holder[size_t(s + 1)], true, s, mb));
        }
        if (s > 0 && holder[size_t(s - 1)] != r) issue(InOrderOp::Kind::Send, holder[size_t(s - 1)], true, s - 1, mb);
      }
    }
    for (int index : sends) wait(index);
  }
  return out;
}

std::string simulate_in_order(const std::vector<std::vector<InOrderOp>>& programs) {
  const int P = int(programs.size());
  int channels = 1;
  for (int r = 0; r < P; ++r) {
    const std::vector<InOrderOp>& prog = programs[size_t(r)];
    for (size_t i = 0; i < prog.size(); ++i) {
      const InOrderOp& op = prog[i];
      if (op.kind == InOrderOp::Kind::Wait) {
        if (op.op < 0 || size_t(op.op) >= i || prog[size_t(op.op)].kind == InOrderOp::Kind::Wait) {
          return fmt::format("rank {}, operation {}: waits for {}, which is not an earlier send or receive", r, i,
                             op.op);
        }
        continue;
      }
      if (op.peer < 0 || op.peer >= P || op.peer == r || op.channel < 0) {
        return fmt::format("rank {}, operation {} ({}): the peer must be another of the {} ranks", r, i, to_string(op),
                           P);
      }
      channels = std::max(channels, op.channel + 1);
    }
  }
  std::vector<size_t> pc(static_cast<size_t>(P), 0);
  std::vector<std::vector<char>> complete(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) complete[size_t(r)].assign(programs[size_t(r)].size(), 0);
  // [rank][channel]: the issued, not yet completed sends and receives, in issue order.
  using Streams = std::vector<std::deque<int>>;
  std::vector<Streams> stream(static_cast<size_t>(P), Streams(static_cast<size_t>(channels)));
  for (bool progress = true; progress;) {
    progress = false;
    // Each host issues until it reaches a wait that cannot pass.
    for (int r = 0; r < P; ++r) {
      const std::vector<InOrderOp>& prog = programs[size_t(r)];
      for (size_t& i = pc[size_t(r)]; i < prog.size(); ++i, progress = true) {
        const InOrderOp& op = prog[i];
        if (op.kind == InOrderOp::Kind::Wait) {
          if (!complete[size_t(r)][size_t(op.op)]) break;
        } else {
          stream[size_t(r)][size_t(op.channel)].push_back(int(i));
        }
      }
    }
    // Each stream head whose peer's head on the channel is its match completes with it.
    for (int r = 0; r < P; ++r) {
      for (int c = 0; c < channels; ++c) {
        std::deque<int>& mine = stream[size_t(r)][size_t(c)];
        if (mine.empty()) continue;
        const InOrderOp& a = programs[size_t(r)][size_t(mine.front())];
        std::deque<int>& theirs = stream[size_t(a.peer)][size_t(c)];
        if (theirs.empty()) continue;
        const InOrderOp& b = programs[size_t(a.peer)][size_t(theirs.front())];
        if (b.peer != r || b.kind == a.kind) continue;  // each waits for someone else, or both send/receive
        if (a.gradient != b.gradient || a.stage != b.stage || a.micro_batch != b.micro_batch) {
          const InOrderOp& send = a.kind == InOrderOp::Kind::Send ? a : b;
          const InOrderOp& recv = a.kind == InOrderOp::Kind::Send ? b : a;
          const int from = a.kind == InOrderOp::Kind::Send ? r : a.peer;
          return fmt::format("on channel {}, rank {}'s {} would be taken by rank {}'s {}: messages between two ranks "
                             "must be sent in the order they are received",
                             c, from, to_string(send), send.peer, to_string(recv));
        }
        complete[size_t(r)][size_t(mine.front())] = 1;
        complete[size_t(a.peer)][size_t(theirs.front())] = 1;
        mine.pop_front();
        theirs.pop_front();
        progress = true;
      }
    }
  }
  std::vector<std::string> stuck;
  for (int r = 0; r < P; ++r) {
    const std::vector<InOrderOp>& prog = programs[size_t(r)];
    if (pc[size_t(r)] == prog.size()) continue;
    std::string heads;
    for (int c = 0; c < channels; ++c) {
      const std::deque<int>& q = stream[size_t(r)][size_t(c)];
      if (!q.empty()) heads += fmt::format("{}{}", heads.empty() ? "" : ", ", to_string(prog[size_t(q.front())]));
    }
    stuck.push_back(fmt::format("rank {} waits for its {} (stream heads: {})", r,
                                to_string(prog[size_t(prog[pc[size_t(r)]].op)]), heads));
  }
  if (stuck.empty()) return "";
  return fmt::format("deadlock: {}", fmt::join(stuck, "; "));
}

// ---------------------------------------------------------------------------------------
PipelineRunner::PipelineRunner(Transformer& model, Communicator& pp, const Schedule& schedule,
                               std::vector<StageSpec> stages, InOrderChannels channels, int n_micro)
    : model_(model), pp_(pp), schedule_(schedule), stages_(std::move(stages)), channels_(std::move(channels)) {
  const int P = pp_.size(), V = schedule_.chunks(), S = num_stages();
  DS_CHECK(S == P * V, "{} stages for {} pipeline ranks of {} chunks", S, P, V);
  holder_.assign(size_t(S), {-1, -1});
  for (int r = 0; r < P; ++r) {
    for (int c = 0; c < V; ++c) holder_[size_t(schedule_.model_stage(r, c, P))] = {r, c};
  }
  for (int c = 0; c < V; ++c) stage_of_chunk_.push_back(schedule_.model_stage(pp_.rank(), c, P));
  DS_CHECK(model_.num_chunks() == V, "the model holds {} chunks, the schedule runs {}", model_.num_chunks(), V);
  for (int c = 0; c < V; ++c) {
    const StageSpec& want = stages_[size_t(stage_of_chunk_[size_t(c)])];
    const StageSpec& have = model_.chunks()[size_t(c)];
    DS_CHECK(want.first_layer == have.first_layer && want.end_layer == have.end_layer && want.head == have.head &&
                 want.embedding == have.embedding,
             "chunk {} of pipeline rank {}: the model holds {}, the schedule runs {}", c, pp_.rank(), have.str(),
             want.str());
  }
  // The tie: the embedding owner (stage 0's rank) and the last stage's rank, when they differ
  // and the last stage reads the embedding.
  const int first = holder(0).first, last = holder(S - 1).first;
  const ModelConfig& mc = model_.config();
  const bool last_reads_embedding = mc.tie_word_embeddings || mc.num_nextn_predict_layers > 0;
  if (last_reads_embedding && first != last && (pp_.rank() == first || pp_.rank() == last)) {
    tie_peer_ = pp_.rank() == first ? last : first;
    tie_param_ = model_.params().find("model.embed_tokens.weight");
    DS_CHECK(tie_param_ >= 0, "pipeline rank {} shares the embedding but does not hold it", pp_.rank());
    DS_CHECK(model_.params().info(tie_param_).pipeline_copy == (pp_.rank() == last),
             "pipeline rank {}: the embedding's copy is on the wrong stage", pp_.rank());
  }
  if (channels_.any()) {
    DS_CHECK(channels_.present(), "the pipeline's in-order transport needs all {} channels (InOrderChannels)",
             InOrderChannels::kCount);
    for (Communicator* c : channels_.channel) {
      DS_CHECK(c->size() == pp_.size() && c->rank() == pp_.rank(),
               "the pipeline's in-order channel '{}' has rank {} of {}, the pipeline communicator {} of {}", c->name(),
               c->rank(), c->size(), pp_.rank(), pp_.size());
    }
  }
  if (n_micro > 0) in_order(n_micro);
}

bool PipelineRunner::in_order(int n_micro) {
  if (!channels_.present()) return false;
  auto it = in_order_verdict_.find(n_micro);
  if (it == in_order_verdict_.end()) {
    const std::string why = simulate_in_order(in_order_programs(schedule_, pp_.size(), n_micro));
    it = in_order_verdict_.emplace(n_micro, why).first;
  }
  return it->second.empty();
}

std::string PipelineRunner::transport(int n_micro) {
  const std::string tagged = "point-to-point over the pipeline communicator, receives posted ahead, matched by tag";
  if (!channels_.present()) {
    return tagged + " (no in-order channels: they are made for CUDA devices in builds with NCCL)";
  }
  if (in_order(n_micro)) {
    return fmt::format("point-to-point over {} in schedule order (activations and gradients, down and up the ranks, "
                       "on a channel each)",
                       channels_.transport);
  }
  return fmt::format("{}: {} micro-batches of schedule {} cannot run in order over {}: {}", tagged, n_micro,
                     schedule_.name(), channels_.transport, in_order_verdict_.at(n_micro));
}

int PipelineRunner::channel(const Message& m) const {
  const bool up = holder(m.stage).first < sender(m);
  return in_order_channel(m.dir == kBackward, up, InOrderChannels::kCount);
}

Communicator& PipelineRunner::wire(const Message& m) const {
  return step_in_order_ ? *channels_.channel[size_t(channel(m))] : pp_;
}

int PipelineRunner::wire_tag(const Message& m) const {
  // In order, one tag per channel: MPI then matches the channel's messages by order alone.
  return step_in_order_ ? channel(m) : tag(m.dir, m.stage, m.mb);
}

void PipelineRunner::record(const char* what, const Message& m) {
  if (record_) issued_.push_back(fmt::format("{} {}{}.{}", what, m.dir == kForward ? 'A' : 'G', m.stage, m.mb));
}

int PipelineRunner::tag(Dir dir, int s, int mb) const {
  const int64_t t = (int64_t(dir) * num_stages() + s) * int64_t(n_micro_) + mb;
  // MPI guarantees tags up to 32767 (the tied weights' own).
  DS_CHECK(t < kTiedTag, "pipeline message tag {} for {} stages and {} micro-batches exceeds MPI's guaranteed 32767", t,
           num_stages(), n_micro_);
  return int(t);
}

Buffer PipelineRunner::make_buffer(Shape shape) {
  const int64_t n = shape.numel();
  for (size_t i = 0; i < free_.size(); ++i) {
    if (free_[i].numel() >= n) {
      Buffer b = std::move(free_[i]);
      free_.erase(free_.begin() + std::ptrdiff_t(i));
      return b;
    }
  }
  return Buffer("pipeline.message", MemCategory::CommBuffers, DType::F32, n, model_.params().device());
}

std::vector<PipelineRunner::Message> PipelineRunner::needed_receives(const std::vector<ScheduleAction>& plan) const {
  std::vector<Message> out;
  const int S = num_stages(), me = pp_.rank();
  for (const ScheduleAction& a : plan) {
    const int s = stage_of_chunk_[size_t(a.chunk)];
    if (a.kind == ScheduleAction::Kind::Forward && s > 0 && holder(s - 1).first != me) {
      out.push_back({kForward, s, a.micro_batch});
    }
    const bool backward = a.kind == ScheduleAction::Kind::Backward || a.kind == ScheduleAction::Kind::BackwardInput;
    if (backward && s < S - 1 && holder(s + 1).first != me) out.push_back({kBackward, s, a.micro_batch});
  }
  return out;
}

int PipelineRunner::sender(const Message& m) const {
  return holder(m.dir == kForward ? m.stage - 1 : m.stage + 1).first;
}

void PipelineRunner::post_receive(const Message& m, Shape shape) {
  const int peer = sender(m);
  Pending p;
  p.buffer = make_buffer(shape);
  p.view = p.buffer.tensor(0, shape);
  record("recv", m);
  p.work = wire(m).recv_async(p.view, peer, wire_tag(m));
  receives_[m] = std::move(p);
}

Tensor PipelineRunner::take(const Message& m, Timeline* timeline, int64_t step) {
  auto it = receives_.find(m);
  DS_CHECK(it != receives_.end(), "pipeline rank {}: no {} message for stage {} micro-batch {} was posted", pp_.rank(),
           m.dir == kForward ? "activation" : "gradient", m.stage, m.mb);
  Pending& p = it->second;
  if (p.work.valid()) {
    const int peer = sender(m);
    const auto w0 = Clock::now();
    int64_t id = -1;
    if (timeline && timeline->recording(step)) id = timeline->begin("recv", step, m.mb, 0, peer);
    p.work.wait();
    if (id >= 0) timeline->end(id);
    traffic_.recv_wait_seconds += seconds_since(w0);
    traffic_.bytes_received += double(p.view.numel()) * double(dtype_size(p.view.dtype()));
    ++traffic_.messages;
    p.work = Work();
  }
  return p.view;
}

void PipelineRunner::send(const Message& m, Tensor t, Buffer buffer, Timeline* timeline, int64_t step) {
  const int peer = holder(m.stage).first;
  Pending p;
  p.buffer = std::move(buffer);
  p.view = t;
  record("send", m);
  p.work = wire(m).send_async(t, peer, wire_tag(m));
  if (timeline && timeline->recording(step)) {
    p.timeline = timeline;
    p.timeline_id = timeline->begin("send", step, m.mb, 0, peer);
  }
  traffic_.bytes_sent += double(t.numel()) * double(dtype_size(t.dtype()));
  ++traffic_.messages;
  sends_[m] = std::move(p);
}

void PipelineRunner::release_receive(const Message& m) {
  auto it = receives_.find(m);
  DS_CHECK(it != receives_.end(), "pipeline rank {}: releasing a message for stage {} micro-batch {} that it does not hold",
           pp_.rank(), m.stage, m.mb);
  if (it->second.buffer.numel() > 0) free_.push_back(std::move(it->second.buffer));
  receives_.erase(it);
}

std::map<PipelineRunner::Message, PipelineRunner::Pending>::iterator PipelineRunner::finish_send(
    std::map<Message, Pending>::iterator it) {
  Pending& p = it->second;
  p.work.wait();
  // The send ends when this rank sees it complete (at the next action boundary).
  if (p.timeline_id >= 0) p.timeline->end(p.timeline_id);
  if (p.buffer.numel() > 0) free_.push_back(std::move(p.buffer));
  return sends_.erase(it);
}

void PipelineRunner::complete_sends(bool wait) {
  for (auto it = sends_.begin(); it != sends_.end();) {
    it = wait || it->second.work.test() ? finish_send(it) : std::next(it);
  }
}

std::vector<LossSums> PipelineRunner::run_step(const std::vector<MicroBatch>& micro, const LossScales& scales,
                                               Timeline* timeline, int64_t step) {
  n_micro_ = int(micro.size());
  DS_CHECK(n_micro_ >= 1, "a step needs at least one micro-batch");
  const int S = num_stages(), me = pp_.rank();
  const int64_t B = micro[0].tokens.size(0), T = micro[0].tokens.size(1);
  const Shape shape = model_.boundary_shape(B, T);
  const std::vector<ScheduleAction> plan = schedule_.actions(me, pp_.size(), n_micro_);
  const std::vector<Message> needed = needed_receives(plan);
  step_in_order_ = in_order(n_micro_);
  issued_.clear();
  // Receives are posted this many messages ahead of the action that needs them; in schedule
  // order, none: each right before the action that consumes it.
  const size_t kLookahead = step_in_order_ ? 0 : 2;
  size_t posted = 0;
  auto post_ahead = [&](size_t upto) {
    for (; posted < needed.size() && posted < upto; ++posted) post_receive(needed[posted], shape);
  };
  post_ahead(kLookahead);
  size_t consumed = 0;
  auto receive = [&](const Message& m) {
    post_ahead(consumed + 1);
    DS_CHECK(receives_.count(m), "pipeline rank {}: the {} for stage {} micro-batch {} is not the next receive",
             me, m.dir == kForward ? "activation" : "gradient", m.stage, m.mb);
    Tensor t = take(m, timeline, step);
    ++consumed;
    post_ahead(consumed + kLookahead);
    return t;
  };
  std::vector<LossSums> sums(static_cast<size_t>(n_micro_));
  std::optional<Timeline::Scope> recorded;
  // The action's own time starts once its input is here (a wait is recorded as "recv").
  auto started = [&](const ScheduleAction& a) {
    if (record_) issued_.push_back(to_string(a));
    recorded.emplace(timeline, step, a);
  };
  for (const ScheduleAction& a : plan) {
    const int s = stage_of_chunk_[size_t(a.chunk)], mb = a.micro_batch;
    const MicroBatch& data = micro[size_t(mb)];
    trace_action(int(a.kind), mb, a.chunk);
    switch (a.kind) {
      case ScheduleAction::Kind::Forward: {
        Tensor in;
        if (s > 0) {
          const Message m{kForward, s, mb};
          if (holder(s - 1).first == me) {
            in = model_.chunk_output(mb, holder(s - 1).second);
          } else {
            in = receive(m);
          }
        }
        started(a);
        const LossSums ls = model_.forward_chunk(mb, a.chunk, data.tokens, data.targets, scales, in);
        // The copy in the activation store is the chunk's input now: the buffer is free.
        if (s > 0 && holder(s - 1).first != me) release_receive(Message{kForward, s, mb});
        if (s == S - 1) {
          sums[size_t(mb)] = ls;
        } else if (holder(s + 1).first != me) {
          send(Message{kForward, s + 1, mb}, model_.chunk_output(mb, a.chunk), Buffer(), timeline, step);
        }
        break;
      }
      case ScheduleAction::Kind::Backward:
      case ScheduleAction::Kind::BackwardInput: {
        Tensor dout;
        if (s < S - 1) {
          // The forward's output may still be on its way out: it is the activation store's, which
          // this backward hands back.
          auto out = sends_.find(Message{kForward, s + 1, mb});
          if (out != sends_.end()) finish_send(out);
          const Message m{kBackward, s, mb};
          dout = holder(s + 1).first == me ? take(m, timeline, step) : receive(m);
        }
        Buffer din;
        if (s > 0) din = make_buffer(shape);
        started(a);
        const BackwardPart part =
            a.kind == ScheduleAction::Kind::Backward ? BackwardPart::Full : BackwardPart::Input;
        model_.backward_chunk(mb, a.chunk, dout, s > 0 ? din.tensor(0, shape) : Tensor(), part);
        if (s < S - 1) release_receive(Message{kBackward, s, mb});
        if (s > 0) {
          const Message m{kBackward, s - 1, mb};
          Tensor t = din.tensor(0, shape);
          if (holder(s - 1).first == me) {
            Pending p;
            p.buffer = std::move(din);
            p.view = t;
            receives_[m] = std::move(p);
          } else {
            send(m, t, std::move(din), timeline, step);
          }
        }
        break;
      }
      case ScheduleAction::Kind::BackwardWeight:
        started(a);
        model_.backward_weights_chunk(mb, a.chunk);
        break;
    }
    complete_sends(/*wait=*/false);
    recorded.reset();
  }
  complete_sends(/*wait=*/true);
  DS_CHECK(receives_.empty(), "pipeline rank {}: {} messages of the step were not used", me, receives_.size());
  return sums;
}

// ---------------------------------------------------------------------------------------
void PipelineRunner::forward_through(Tensor tokens, const std::function<void(Tensor in)>& last_stage) {
  const int S = num_stages(), me = pp_.rank();
  const Shape shape = model_.boundary_shape(tokens.size(0), tokens.size(1), /*inference=*/true);
  n_micro_ = 1;
  // A chain, stage after stage: safe in order on any schedule.
  step_in_order_ = channels_.present();
  Buffer in_buf = make_buffer(shape), out_buf = make_buffer(shape);
  for (int s = 0; s < S; ++s) {
    const auto [rank, chunk] = holder(s);
    if (rank != me) continue;
    Tensor in;
    if (s > 0) {
      in = in_buf.tensor(0, shape);
      const Message m{kForward, s, 0};
      if (holder(s - 1).first != me) wire(m).recv(in, holder(s - 1).first, wire_tag(m));
    }
    if (s == S - 1) {
      last_stage(in);
      break;
    }
    Tensor out = out_buf.tensor(0, shape);
    model_.forward_hidden(chunk, tokens, in, out);
    if (holder(s + 1).first != me) {
      const Message m{kForward, s + 1, 0};
      wire(m).send(out, holder(s + 1).first, wire_tag(m));
    } else {
      std::swap(in_buf, out_buf);  // the next stage is this rank's: its input is this output
    }
  }
  free_.push_back(std::move(in_buf));
  free_.push_back(std::move(out_buf));
}

LossSums PipelineRunner::forward_loss(Tensor tokens, Tensor targets) {
  double result[3] = {0, 0, 0};
  forward_through(tokens, [&](Tensor in) {
    const LossSums ls = model_.forward_loss(tokens, targets, in);
    result[0] = ls.sum;
    result[1] = double(ls.count);
    result[2] = double(ls.correct);
  });
  pp_.broadcast(Tensor(result, DType::F64, Shape{3}), loss_rank());
  LossSums out;
  out.sum = result[0];
  out.count = int64_t(result[1]);
  out.correct = int64_t(result[2]);
  return out;
}

void PipelineRunner::last_logits(Tensor tokens, Tensor logits) {
  forward_through(tokens, [&](Tensor in) { model_.last_logits(tokens, logits, in); });
  pp_.broadcast(logits, loss_rank());
}

// ---------------------------------------------------------------------------------------
void PipelineRunner::reduce_tied_grads() {
  if (!has_tie()) return;
  reduce_tied_grads(model_.params().grad(tie_param_));
}

void PipelineRunner::reduce_tied_grads(Tensor g) {
  if (!has_tie() || g.numel() == 0) return;
  Buffer theirs("pipeline.tied_grad", MemCategory::CommBuffers, DType::F32, g.numel(), g.device());
  Tensor t = theirs.tensor(0, g.shape());
  Work r = pp_.recv_async(t, tie_peer_, kTiedTag);
  pp_.send_async(g, tie_peer_, kTiedTag).wait();
  r.wait();
  traffic_.bytes_sent += double(g.numel()) * 4;
  traffic_.bytes_received += double(g.numel()) * 4;
  ops::add(g, g, t);
}

void PipelineRunner::copy_tied(const std::vector<Tensor>& tensors) {
  if (!has_tie()) return;
  const bool owner = !model_.params().info(tie_param_).pipeline_copy;
  for (const Tensor& t : tensors) {
    if (owner) {
      pp_.send(t, tie_peer_, kTiedTag);
    } else {
      pp_.recv(t, tie_peer_, kTiedTag);
    }
  }
}

PipelineRunner::Traffic PipelineRunner::take_traffic() {
  const Traffic t = traffic_;
  traffic_ = Traffic{};
  return t;
}

}  // namespace dstrain
