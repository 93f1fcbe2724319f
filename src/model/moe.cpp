// DeepSeekMoE layer: router, expert-grouped SwiGLU experts and shared experts, forward and
// backward (see moe.h for the data flow).
#include "model/moe.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <exception>

#include "core/clock.h"

namespace dstrain {
namespace {


ops::MoETopK topk_method(const std::string& m) {
  if (m == "greedy") return ops::MoETopK::Greedy;
  if (m == "group_limited_greedy") return ops::MoETopK::GroupLimitedGreedy;
  DS_CHECK(m == "noaux_tc", "topk_method '{}': expected greedy, group_limited_greedy or noaux_tc", m);
  return ops::MoETopK::NoAuxTC;
}

ops::MoEDropPolicy drop_policy(const std::string& p) {
  if (p == "probs") return ops::MoEDropPolicy::Probs;
  DS_CHECK(p == "position", "moe drop_policy '{}': expected probs or position", p);
  return ops::MoEDropPolicy::Position;
}

ops::MoEScoring scoring_func(const std::string& s) {
  if (s == "softmax") return ops::MoEScoring::Softmax;
  DS_CHECK(s == "sigmoid", "scoring_func '{}': expected softmax or sigmoid", s);
  return ops::MoEScoring::Sigmoid;
}

// Offsets (E + 1) of M routed rows spread evenly over E experts, each cut to `capacity` rows
// when there is one (>= 0).
std::vector<int64_t> balanced_plan(int64_t M, int64_t E, int64_t capacity) {
  std::vector<int64_t> plan(size_t(E + 1), 0);
  for (int64_t e = 0; e < E; ++e) {
    int64_t rows = M * (e + 1) / E - M * e / E;
    if (capacity >= 0) rows = std::min(rows, capacity);
    plan[size_t(e + 1)] = plan[size_t(e)] + rows;
  }
  return plan;
}

}  // namespace

// Runs fn(e, first_row, last_row) for every expert with rows. With many experts (at least
// two per thread) they are spread over the threads, largest first, each GEMM on one thread
// (the CPU backend's sgemm runs single-threaded inside a parallel region): small per-expert
// GEMMs scale better that way than with threads inside each. With few experts they run one after
// another with threaded GEMMs. The routing and the order of every sum of dstrain's own are the
// same either way; whether the GEMMs' bits are depends on the library (OpenBLAS's are on most
// cores, oneDNN's sgemm rounds differently by thread count), so runs are bitwise at the same
// thread count.
template <class Fn>
void MoEBlock::for_each_expert(const Meta& m, Fn&& fn) const {
  const int64_t* off = m.offsets.data();
  const int64_t n = int64_t(m.active.size());
  if (n < 2 * int64_t(omp_get_max_threads())) {
    for (int64_t e : m.active) fn(e, off[e], off[e + 1]);
    return;
  }
  std::exception_ptr error;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const int64_t e = m.active[size_t(i)];
    try {
      fn(e, off[e], off[e + 1]);
    } catch (...) {
#pragma omp critical(moe_expert_error)
      if (!error) error = std::current_exception();
    }
  }
  if (error) std::rethrow_exception(error);
}

MoEBlock::MoEBlock(const ModelConfig& c, const ShardSpec& shard, ParamRegistry& reg, int layer)
    : reg_(reg),
      key_(fmt::format("layers.{}.mlp.", layer)),
      n_experts_(c.n_routed_experts),
      n_local_(shard.experts.size()),
      first_(shard.experts.begin),
      ep_(shard.ep_size),
      inter_(shard.moe_ffn.size()),
      shared_inter_(shard.shared_ffn.size()),
      scoring_(scoring_func(c.scoring_func)),
      aux_alpha_(c.aux_loss_alpha),
      capacity_factor_(c.moe_capacity_factor),
      drop_policy_(drop_policy(c.moe_drop_policy)),
      seq_aux_(c.seq_aux),
      sharded_(shard.tp_size > 1) {
  auto key = [&](const char* name) { return act_key(key_ + name); };
  meta_key_ = key("meta");
  gate_scores_key_ = key("gate.scores"), gate_weights_key_ = key("gate.weights"), gate_ids_key_ = key("gate.ids");
  gate_scores_all_key_ = key("gate.scores_all"), gate_aux_coef_key_ = key("gate.aux_coef");
  plan_offsets_key_ = key("plan.offsets"), plan_sorted_key_ = key("plan.sorted"), plan_position_key_ = key("plan.position");
  experts_grouped_key_ = key("experts.grouped"), experts_local_in_key_ = key("experts.local_in");
  experts_gate_up_key_ = key("experts.gate_up"), experts_h_key_ = key("experts.h");
  shared_experts_gate_up_key_ = key("shared_experts.gate_up"), shared_experts_h_key_ = key("shared_experts.h");
  DS_CHECK(n_local_ * ep_ == c.n_routed_experts, "layer {}: {} experts held of {} over {} expert-parallel ranks",
           layer, n_local_, c.n_routed_experts, ep_);
  const int64_t C = c.hidden_size, E = n_experts_, I = inter_;
  route_.method = topk_method(c.topk_method);
  route_.top_k = int(c.num_experts_per_tok);
  route_.n_group = int(c.n_group);
  route_.topk_group = int(c.topk_group);
  route_.norm_topk_prob = c.norm_topk_prob;
  route_.routed_scaling_factor = float(c.routed_scaling_factor);
  DS_CHECK(E >= 1 && I >= 1 && c.n_shared_experts >= 0, "layer {}: MoE needs n_routed_experts ({}) and "
           "moe_intermediate_size ({})", layer, E, I);
  DS_CHECK(route_.top_k >= 1 && route_.top_k <= E, "layer {}: num_experts_per_tok {} with {} routed experts", layer,
           route_.top_k, E);
  if (route_.method != ops::MoETopK::Greedy) {
    DS_CHECK(route_.n_group >= 1 && E % route_.n_group == 0 && route_.topk_group >= 1 &&
                 route_.topk_group <= route_.n_group && route_.topk_group * (E / route_.n_group) >= route_.top_k,
             "layer {}: {} experts in n_group {} with topk_group {} cannot supply top-{}", layer, E, route_.n_group,
             route_.topk_group, route_.top_k);
  }
  DS_CHECK(route_.method != ops::MoETopK::NoAuxTC || E / route_.n_group >= 2,
           "layer {}: noaux_tc needs at least 2 experts per group", layer);
  DS_CHECK(capacity_factor_ >= 0 && std::isfinite(capacity_factor_),
           "layer {}: moe capacity_factor {} (0: no capacity, else > 0)", layer, capacity_factor_);

  gate_ = reg.add(layer_name(layer, "mlp.gate.weight"), {E, C}, ParamKind::Linear, layer);
  if (route_.method == ops::MoETopK::NoAuxTC) {
    bias_ = reg.add(layer_name(layer, "mlp.gate.e_score_correction_bias"), {E}, ParamKind::RouterBias, layer,
                    /*follow_previous=*/false, /*trainable=*/false);
  }
  // Routed experts are reduced over the ranks that hold the same experts (ParamGroup::Expert);
  // with expert parallelism this rank holds experts [first_, first_ + El) of E.
  for (int64_t j = 0; j < n_local_; ++j) {
    ParamOptions expert;
    expert.group = ParamGroup::Expert;
    if (ep_ > 1) {
      expert.placement.kind = Placement::Kind::Expert;
      expert.placement.axis = "expert";
      expert.placement.index = first_ + j;
      expert.placement.count = E;
    }
    ParamOptions expert_follow = expert;
    expert_follow.follow_previous = true;
    const std::string base = fmt::format("mlp.experts.{}.", first_ + j);
    expert_gate_.push_back(
        reg.add(layer_name(layer, base + "gate_proj.weight"), {I, C}, ParamKind::Linear, layer, expert));
    expert_up_.push_back(
        reg.add(layer_name(layer, base + "up_proj.weight"), {I, C}, ParamKind::Linear, layer, expert_follow));
    expert_down_.push_back(
        reg.add(layer_name(layer, base + "down_proj.weight"), {C, I}, ParamKind::Linear, layer, expert));
  }
  // Shared experts: one SwiGLU MLP of the fused width, split by columns like a dense one.
  if (shared_inter_ > 0) {
    const int64_t S = shared_inter_, Sg = c.moe_intermediate_size * c.n_shared_experts;
    shared_gate_ = add_tp_piece(reg, layer_name(layer, "mlp.shared_experts.gate_proj.weight"), {S, C}, {Sg, C}, 0,
                                shard, layer);
    shared_up_ = add_tp_piece(reg, layer_name(layer, "mlp.shared_experts.up_proj.weight"), {S, C}, {Sg, C}, 0, shard,
                              layer, true);
    shared_down_ = add_tp_piece(reg, layer_name(layer, "mlp.shared_experts.down_proj.weight"), {C, S}, {C, Sg}, 1,
                                shard, layer);
  }
  stats_.tokens_per_expert.assign(size_t(E), 0);
}

void MoEBlock::forward(const Ctx& ctx, int mb, Tensor x, Tensor out) {
  DS_CHECK(x.ndim() == 3, "MoE forward: x {} is not (B,T,C)", x.shape().str());
  const int64_t B = x.size(0), T = x.size(1), C = x.size(2), N = B * T, E = n_experts_, k = route_.top_k;
  // The rows this rank routes and holds of out: all N, or its share with sequence parallelism.
  const Range mine = ctx.token_rows(N);
  const int64_t n = mine.size(), M = n * k, I = inter_;
  const bool split_rows = n != N;
  DS_CHECK(out.numel() == n * C, "MoE forward: out {} for rows [{}, {}) of x {}", out.shape().str(), mine.begin,
           mine.end, x.shape().str());
  DS_CHECK(M < (int64_t(1) << 31), "MoE forward: {} routed rows overflow the int32 dispatch plan", M);
  ActivationStore& acts = *ctx.acts;
  Meta& m = acts.meta<Meta>(mb, meta_key_);
  Tensor xr = x.view({N, C}), xm = xr.slice(mine.begin, mine.end), outr = out.view({n, C});

  // Router: in fp32 whatever the compute dtype, as MoEGate computes F.linear(x.float(),
  // weight.float()): the fp32 master gate (the kernel widens a 16-bit x), fp32 scores, then
  // the top-k choice and the weights.
  auto t = Clock::now();
  const DType cd = ctx.compute_dtype;  // the experts' rows
  // A replay (activation recomputation) takes the first forward's routing decisions, dispatch
  // plan and counts: it neither routes again nor counts loads or the auxiliary loss twice.
  const bool route = !ctx.replay;
  DS_CHECK(route || m.pending, "{}: a replay of micro-batch {} without its first forward", key_, mb);
  Tensor scores, ids, weights, offsets, sorted, position;
  if (!route) {
    scores = acts.get(mb, gate_scores_key_);
    weights = acts.get(mb, gate_weights_key_);
    sorted = acts.get(mb, plan_sorted_key_);
    position = acts.get(mb, plan_position_key_);
  } else {
    scores = acts.put(mb, gate_scores_key_, {n, E});
    ops::linear_forward(scores, xm, reg_.param(gate_));
    ops::moe_scores(scores, scores, scoring_);
    ids = acts.put(mb, gate_ids_key_, {n, k}, DType::I32);
    weights = acts.put(mb, gate_weights_key_, {n, k});
    ops::moe_route(ids, weights, scores, bias_ >= 0 ? reg_.param(bias_) : Tensor(), route_);

    offsets = acts.put(mb, plan_offsets_key_, {E + 1}, DType::I64);
    sorted = acts.put(mb, plan_sorted_key_, {M}, DType::I32);
    position = acts.put(mb, plan_position_key_, {M}, DType::I32);
    // With a capacity the router's plan (routed) is cut to at most `capacity` rows per expert
    // (offsets), here on the token's rank, before any row moves: the loads and the aux loss stay
    // the router's choice, as Megatron-Core computes them before capacity.
    const int64_t capacity = capacity_factor_ > 0 ? expert_capacity(M) : -1;
    Tensor routed = capacity < 0 ? offsets : ctx.scratch->get(routed_offsets_slot_, {E + 1}, DType::I64);
    ops::moe_dispatch_plan(routed, sorted, position, ids);
    if (capacity >= 0) ops::moe_capacity_plan(offsets, sorted, position, routed, weights, capacity, drop_policy_);
    // The one synchronisation MoE needs: the per-expert row counts decide the shapes of the
    // expert GEMMs, so they come to the host once per forward (as in Megatron-Core); with a
    // capacity the router's counts come along, for the loads.
    m.plan.assign(size_t(E + 1), 0);
    ops::copy(Tensor(m.plan.data(), DType::I64, Shape{E + 1}), offsets);
    // The meta device (memory model) routes nothing: it takes balanced loads, each expert
    // an equal share of the M rows (up to the capacity).
    if (ctx.device.type == DeviceType::Meta) m.plan = balanced_plan(M, E, capacity);
    std::vector<int64_t> routed_host;
    if (capacity >= 0) {
      routed_host.assign(size_t(E + 1), 0);
      ops::copy(Tensor(routed_host.data(), DType::I64, Shape{E + 1}), routed);
    }
    const std::vector<int64_t>& loads = capacity < 0 ? m.plan : routed_host;
    for (int64_t e = 0; e < E; ++e) stats_.tokens_per_expert[size_t(e)] += loads[size_t(e + 1)] - loads[size_t(e)];
    stats_.dropped_rows += M - m.plan[size_t(E)];
  }
  const int64_t kept = m.plan[size_t(E)];  // grouped rows: M, or fewer after dropping
  Tensor kept_sorted = sorted.slice(0, kept);
  const int64_t El = n_local_;
  if (!route) {
    // The counts of the first forward stand.
  } else if (ep_ == 1) {
    m.offsets = m.plan;
  } else {
    // Expert parallelism: every rank tells every other how many of its rows go to each of that
    // rank's experts (El counts per pair), then the rows follow (below).
    std::vector<int64_t> send_counts(static_cast<size_t>(E)), recv_counts(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) send_counts[size_t(e)] = m.plan[size_t(e + 1)] - m.plan[size_t(e)];
    const auto c0 = Clock::now();
    ctx.groups.ep->all_to_all(Tensor(recv_counts.data(), DType::I64, Shape{E}),
                              Tensor(send_counts.data(), DType::I64, Shape{E}));
    stats_.dispatch_seconds += seconds_since(c0);
    if (ctx.device.type == DeviceType::Meta && ctx.expert_imbalance != 1) {
      // The memory model's rank is the hot one: every source sends its experts
      // expert_imbalance x a balanced share (up to the capacity each source keeps per expert).
      const int64_t capacity = capacity_factor_ > 0 ? expert_capacity(M) : -1;
      for (int64_t e = 0; e < E; ++e) {
        int64_t rows = std::llround(double(recv_counts[size_t(e)]) * ctx.expert_imbalance);
        if (capacity >= 0) rows = std::min(rows, capacity);
        recv_counts[size_t(e)] = rows;
      }
    }
    m.recv_counts = recv_counts;
    m.send_rows.assign(size_t(ep_), 0);
    m.recv_rows.assign(size_t(ep_), 0);
    m.offsets.assign(size_t(El + 1), 0);
    for (int q = 0; q < ep_; ++q) {
      for (int64_t j = 0; j < El; ++j) {
        m.send_rows[size_t(q)] += send_counts[size_t(q * El + j)];
        m.recv_rows[size_t(q)] += recv_counts[size_t(q * El + j)];
        m.offsets[size_t(j + 1)] += recv_counts[size_t(q * El + j)];
      }
    }
    for (int64_t j = 0; j < El; ++j) m.offsets[size_t(j + 1)] += m.offsets[size_t(j)];
  }
  const int64_t* off = m.offsets.data();
  const int64_t R = off[El];  // rows this rank's experts compute
  if (route) stats_.received_rows += R;
  m.active.clear();
  for (int64_t j = 0; j < El; ++j) {
    if (off[j + 1] > off[j]) m.active.push_back(j);
  }
  std::stable_sort(m.active.begin(), m.active.end(),
                   [&](int64_t a, int64_t b) { return off[a + 1] - off[a] > off[b + 1] - off[b]; });

  if (route) m.aux_scale = 0;
  if (route && aux_alpha_ > 0) {
    const int64_t G = seq_aux_ ? B : 1;
    const double scale = aux_alpha_ * (seq_aux_ ? scales_.sequence : scales_.micro_batch);
    if (aux_pending_ == aux_values_.size()) {
      aux_values_.emplace_back("moe.aux_loss", MemCategory::Workspace, DType::F64, 1, x.device());
      aux_scales_.push_back(0);
    }
    Tensor all_scores = scores, all_ids = ids;
    if (split_rows) {
      // The balance statistics are over whole sequences (or the micro-batch): every tensor rank
      // computes them, and the same loss, from all ranks' rows (rank order is row order).
      all_scores = acts.put(mb, gate_scores_all_key_, {N, E});
      all_ids = ctx.scratch->get(ids_all_slot_, {N, k}, DType::I32);
      ctx.groups.tp->all_gather(all_scores, scores);
      ctx.groups.tp->all_gather(all_ids, ids);
    }
    ops::moe_aux_loss(aux_values_[aux_pending_].tensor(), acts.put(mb, gate_aux_coef_key_, {G, E}), all_scores,
                      all_ids, scoring_);
    aux_scales_[aux_pending_++] = scale;
    m.aux_scale = float(scale);
  }
  stats_.route_seconds += seconds_since(t);

  // Routed experts' rows in expert order; with expert parallelism on their way to the experts'
  // owners while the shared experts compute.
  Tensor grouped = acts.put(mb, experts_grouped_key_, {kept, C}, cd);
  t = Clock::now();
  ops::moe_permute(grouped, xm, kept_sorted, int(k));
  stats_.permute_seconds += seconds_since(t);
  Tensor received;  // the rows from the expert group, by source rank
  Work dispatch;
  if (ep_ > 1) {
    received = ctx.scratch->get(a2a_slot_, {R, C}, cd);
    dispatch = exchange_rows(ctx, received, m.recv_rows, grouped, m.send_rows);
  }

  // Shared experts on all rows, this rank's columns: summed over the tensor group (reduce-
  // scattered into this rank's rows with sequence parallelism).
  if (shared_inter_ > 0) {
    Tensor gu = acts.put(mb, shared_experts_gate_up_key_, {N, 2 * shared_inter_}, cd);
    Tensor h = acts.put(mb, shared_experts_h_key_, {N, shared_inter_}, cd);
    ops::linear_forward(gu, xr, reg_.compute_rows(shared_gate_, shared_up_));
    ops::swiglu_forward(h, gu);
    row_parallel_forward(ctx, sharded_, outr, h, reg_.compute(shared_down_), shared_partial_);
  }

  // Routed experts: one GEMM per expert over its contiguous rows. Without expert parallelism
  // the outputs overwrite the inputs in `grouped`, which the backward re-gathers instead of
  // keeping a second copy; with it the owner keeps the rows it received (experts.local_in) and
  // sends the outputs back into `grouped`. All in the compute dtype; moe_unpermute sums the
  // weighted outputs into the fp32 residual. They are whole on every tensor rank: their output
  // for this rank's rows is complete.
  Tensor xl = grouped, yl = grouped;
  if (ep_ > 1) {
    const auto w0 = Clock::now();
    dispatch.wait();
    stats_.dispatch_seconds += seconds_since(w0);
    xl = acts.put(mb, experts_local_in_key_, {R, C}, cd);
    yl = ctx.scratch->get(local_out_slot_, {R, C}, cd);
    t = Clock::now();
    sort_chunks(xl, received, m.recv_counts, /*to_experts=*/true);
    stats_.permute_seconds += seconds_since(t);
  }
  Tensor gate_up = acts.put(mb, experts_gate_up_key_, {R, 2 * I}, cd);
  // Selective recomputation ("moe_act"): the SwiGLU output lives in scratch; the backward forms
  // it again from gate|up.
  Tensor h = ctx.recompute_moe_act ? ctx.scratch->get(experts_h_slot_, {R, I}, cd)
                                   : acts.put(mb, experts_h_key_, {R, I}, cd);
  t = Clock::now();
  for_each_expert(m, [&](int64_t e, int64_t r0, int64_t r1) {
    ops::linear_forward(gate_up.slice(r0, r1), xl.slice(r0, r1),
                        reg_.compute_rows(expert_gate_[size_t(e)], expert_up_[size_t(e)]));
  });
  ops::swiglu_forward(h, gate_up);
  for_each_expert(m, [&](int64_t e, int64_t r0, int64_t r1) {
    ops::linear_forward(yl.slice(r0, r1), h.slice(r0, r1), reg_.compute(expert_down_[size_t(e)]));
  });
  stats_.expert_seconds += seconds_since(t);
  // Combine: the outputs back to the tokens' ranks, into `grouped` (global expert order).
  if (ep_ > 1) return_rows(ctx, m, yl, grouped);
  t = Clock::now();
  ops::moe_unpermute(outr, grouped, weights, position);
  stats_.permute_seconds += seconds_since(t);
  m.pending = true;
}

void MoEBlock::backward(const Ctx& ctx, int mb, Tensor x, Tensor dout, Tensor dx) {
  ActivationStore& acts = *ctx.acts;
  Scratch& scratch = *ctx.scratch;
  WeightGradStore& wg = *ctx.wgrad;
  const DType cd = ctx.compute_dtype;  // the experts' gradients; the router's stay fp32
  Meta& m = acts.meta<Meta>(mb, meta_key_);
  DS_CHECK(m.pending, "{}: MoE backward of micro-batch {} without a forward since its last backward", key_, mb);
  const int64_t C = x.size(2), N = x.numel() / C, E = n_experts_, k = route_.top_k, I = inter_;
  const Range mine = ctx.token_rows(N);
  const int64_t n = mine.size(), kept = m.plan.back();  // grouped rows (n*k less the dropped)
  DS_CHECK(dout.numel() == n * C && dx.numel() == n * C, "MoE backward: dout {} dx {} for rows [{}, {}) of x {}",
           dout.shape().str(), dx.shape().str(), mine.begin, mine.end, x.shape().str());
  m.pending = false;
  Tensor xr = x.view({N, C}), xm = xr.slice(mine.begin, mine.end), doutr = dout.view({n, C}), dxr = dx.view({n, C});
  Tensor scores = acts.get(mb, gate_scores_key_);
  Tensor ids = acts.get(mb, gate_ids_key_);
  Tensor weights = acts.get(mb, gate_weights_key_);
  Tensor sorted = acts.get(mb, plan_sorted_key_).slice(0, kept);
  Tensor position = acts.get(mb, plan_position_key_);
  // The expert temporaries share the dense MLP's scratch slots: the shared experts, the
  // routed experts and the dense layers use them one after another, never at once.
  // Shared experts first, from dout of all rows: their input gradient is this rank's columns'
  // partial, summed over the tensor group before the (complete) routed and router parts are
  // added, so that those are not counted once per rank.
  if (shared_inter_ > 0) {
    Tensor dh = scratch.get(dh_slot_, {N, shared_inter_}, cd);
    Tensor dgu = scratch.get(dgate_up_slot_, {N, 2 * shared_inter_}, cd);
    wg.linear(dh, reg_.grad(shared_down_),
              in_compute_dtype(ctx, sp_gather(ctx, doutr, grad_slots_.sp_dout), grad_slots_.dout16),
              acts.get(mb, shared_experts_h_key_), reg_.compute(shared_down_));
    ops::swiglu_backward(dgu, dh, acts.get(mb, shared_experts_gate_up_key_));
    Tensor dxp = column_parallel_grad(ctx, sharded_, dx, x, grad_slots_.dx);
    wg.linear(dxp.view({N, C}), reg_.grad_rows(shared_gate_, shared_up_), dgu, xr,
              reg_.compute_rows(shared_gate_, shared_up_));
    reduce_column_parallel_grad(ctx, dxp, dx, grad_slots_.dx_mine);
  } else {
    ops::fill(dxr, 0.0f);
  }

  // Routed experts, in expert order. Their output gradients, from the token rank's rows: in
  // place with one expert-parallel rank, otherwise sent to the experts' owners (as the
  // forward's dispatch) and the input gradients returned (as its combine).
  Tensor grouped = acts.get(mb, experts_grouped_key_);  // the experts' outputs
  Tensor gate_up = acts.get(mb, experts_gate_up_key_);
  const int64_t R = m.offsets.back();
  Tensor h;
  if (ctx.recompute_moe_act) {
    h = scratch.get(experts_h_slot_, {R, I}, cd);
    ops::swiglu_forward(h, gate_up);
  } else {
    h = acts.get(mb, experts_h_key_);
  }
  Tensor dgrouped = scratch.get(dgrouped_slot_, {kept, C}, cd);
  Tensor dweights = scratch.get(dweights_slot_, {n, k});
  Tensor dh = scratch.get(dh_slot_, {R, I}, cd);
  Tensor dgu = scratch.get(dgate_up_slot_, {R, 2 * I}, cd);
  auto t = Clock::now();
  ops::moe_unpermute_backward(dgrouped, dweights, doutr, grouped, weights, sorted);
  stats_.permute_seconds += seconds_since(t);
  Tensor dyl = dgrouped;
  if (ep_ > 1) {
    Tensor received = scratch.get(a2a_slot_, {R, C}, cd);
    const auto w0 = Clock::now();
    exchange_rows(ctx, received, m.recv_rows, dgrouped, m.send_rows).wait();
    stats_.dispatch_seconds += seconds_since(w0);
    dyl = scratch.get(local_dy_slot_, {R, C}, cd);
    t = Clock::now();
    sort_chunks(dyl, received, m.recv_counts, /*to_experts=*/true);
    stats_.permute_seconds += seconds_since(t);
  }
  t = Clock::now();
  for_each_expert(m, [&](int64_t e, int64_t r0, int64_t r1) {
    wg.linear(dh.slice(r0, r1), reg_.grad(expert_down_[size_t(e)]), dyl.slice(r0, r1), h.slice(r0, r1),
              reg_.compute(expert_down_[size_t(e)]));
  });
  ops::swiglu_backward(dgu, dh, gate_up);
  // The expert inputs: without expert parallelism gathered again (into dgrouped, now
  // consumed), their gradients going into grouped, whose outputs are consumed too; with it the
  // rows the owner kept, their gradients into a temporary.
  Tensor xg = dgrouped, dxg = grouped;
  if (ep_ > 1) {
    xg = acts.get(mb, experts_local_in_key_);
    dxg = scratch.get(local_dx_slot_, {R, C}, cd);
  } else {
    const auto p0 = Clock::now();
    ops::moe_permute(xg, xm, sorted, int(k));
    stats_.permute_seconds += seconds_since(p0);
  }
  for_each_expert(m, [&](int64_t e, int64_t r0, int64_t r1) {
    const int g = expert_gate_[size_t(e)], u = expert_up_[size_t(e)];
    wg.linear(dxg.slice(r0, r1), reg_.grad_rows(g, u), dgu.slice(r0, r1), xg.slice(r0, r1), reg_.compute_rows(g, u));
  });
  stats_.expert_seconds += seconds_since(t);
  if (ep_ > 1) {
    return_rows(ctx, m, dxg, grouped);
    dxg = grouped;
  }
  t = Clock::now();
  ops::moe_permute_backward(dxr, dxg, position, /*accumulate=*/true);
  stats_.permute_seconds += seconds_since(t);

  // Router, in fp32: through the weights (and the aux loss) into the scores, the logits, the
  // fp32 gate; its input gradient is rounded once as it is added to dx.
  t = Clock::now();
  Tensor dscores = scratch.get(dscores_slot_, {n, E});
  ops::moe_route_backward(dscores, dweights, ids, scores, route_);
  if (m.aux_scale != 0) {
    Tensor coef = acts.get(mb, gate_aux_coef_key_);
    if (n == N) {
      ops::moe_aux_loss_backward(dscores, coef, scores, scoring_, m.aux_scale);
    } else {
      // The coefficients belong to sequences that may straddle ranks: the aux gradient of all
      // rows, of which this rank's rows are added (0 + g then d + g: what the unsplit op adds).
      Tensor daux = scratch.get(daux_slot_, {N, E});
      ops::fill(daux, 0.0f);
      ops::moe_aux_loss_backward(daux, coef, acts.get(mb, gate_scores_all_key_), scoring_, m.aux_scale);
      ops::add(dscores, dscores, daux.slice(mine.begin, mine.end));
    }
  }
  ops::moe_scores_backward(dscores, dscores, scores, scoring_);
  wg.linear(dxr, reg_.grad(gate_), dscores, xm, reg_.param(gate_), /*accumulate_dx=*/true);
  stats_.route_seconds += seconds_since(t);
}

Work MoEBlock::exchange_rows(const Ctx& ctx, Tensor out, const std::vector<int64_t>& out_rows, Tensor in,
                             const std::vector<int64_t>& in_rows) {
  DS_CHECK(in.ndim() == 2 && out.ndim() == 2 && in.size(1) == out.size(1), "exchange_rows: rows {} and {}",
           in.shape().str(), out.shape().str());
  const int64_t C = in.size(1);
  std::vector<int64_t> out_counts(out_rows.size()), in_counts(in_rows.size());
  double sent = 0;
  for (size_t q = 0; q < in_rows.size(); ++q) {
    in_counts[q] = in_rows[q] * C;
    if (int(q) != ctx.groups.ep->rank()) sent += double(in_counts[q]);
  }
  for (size_t q = 0; q < out_rows.size(); ++q) out_counts[q] = out_rows[q] * C;
  stats_.a2a_bytes += sent * double(dtype_size(in.dtype()));
  return ctx.groups.ep->all_to_all_v_async(out, out_counts, in, in_counts);
}

void MoEBlock::return_rows(const Ctx& ctx, const Meta& m, Tensor local, Tensor grouped) {
  Tensor back = ctx.scratch->get(a2a_slot_, local.shape(), local.dtype());
  auto t = Clock::now();
  sort_chunks(back, local, m.recv_counts, /*to_experts=*/false);
  stats_.permute_seconds += seconds_since(t);
  t = Clock::now();
  exchange_rows(ctx, grouped, m.send_rows, back, m.recv_rows).wait();
  stats_.combine_seconds += seconds_since(t);
}

void MoEBlock::sort_chunks(Tensor out, Tensor in, const std::vector<int64_t>& counts, bool to_experts) const {
  // Block (s, j) starts at src[s * El + j] in source-major order and at dst[j * ep + s] in
  // expert-major order.
  const int64_t El = n_local_;
  const size_t blocks = counts.size();
  std::vector<int64_t> by_source(blocks + 1, 0), by_expert(blocks + 1, 0);
  for (size_t b = 0; b < blocks; ++b) by_source[b + 1] = by_source[b] + counts[b];
  for (int64_t j = 0, at = 0; j < El; ++j) {
    for (int s = 0; s < ep_; ++s) {
      by_expert[size_t(s * El + j)] = at;
      at += counts[size_t(s * El + j)];
    }
  }
  for (size_t b = 0; b < blocks; ++b) {
    if (counts[b] == 0) continue;
    const int64_t from = to_experts ? by_source[b] : by_expert[b], to = to_experts ? by_expert[b] : by_source[b];
    ops::copy(out.slice(to, to + counts[b]), in.slice(from, from + counts[b]));
  }
}

int64_t MoEBlock::expert_capacity(int64_t rows) const {
  // Megatron-Core's get_capacity: ceil(rows / E * capacity_factor), rows = tokens x top-k.
  return int64_t(std::ceil(double(rows) / double(n_experts_) * capacity_factor_));
}

RoutingStats* MoEBlock::routing() {
  for (size_t i = 0; i < aux_pending_; ++i) {
    stats_.aux_loss += aux_scales_[i] * ops::read_scalar<double>(aux_values_[i].tensor());
  }
  aux_pending_ = 0;
  return &stats_;
}

void MoEBlock::update_routing_bias(const std::vector<int64_t>& counts, double gamma) {
  if (bias_ < 0) return;
  DS_CHECK(int64_t(counts.size()) == n_experts_, "update_routing_bias: {} counts for {} experts", counts.size(),
           n_experts_);
  Buffer on_device("moe.tokens_per_expert", MemCategory::Workspace, DType::I64, n_experts_, reg_.device());
  ops::copy(on_device.tensor(), Tensor(const_cast<int64_t*>(counts.data()), DType::I64, Shape{n_experts_}));
  ops::moe_bias_update(reg_.param(bias_), on_device.tensor(), float(gamma));
  // The routing reads the fp32 bias; its compute copy follows the master all the same, so the
  // copy stays the rounded masters everywhere.
  if (reg_.has_compute_copy()) ops::cast(reg_.compute(bias_), reg_.param(bias_));
}

}  // namespace dstrain
