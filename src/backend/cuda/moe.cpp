// The MoE ops of the CUDA backend: the kernels of moe.cu, on arguments the ops:: wrapper has
// checked (backend/checks.cpp); only the kernels' own limits are checked here. The floating-point tensors may be any mix of F32
// and one 16-bit type, so every op but the integer-only dispatch plan serves all three slots.
// Two ops read device data for checks of that data and so synchronise with the stream: the dispatch
// plan (an expert id out of range) and the capacity plan (its offsets, which the host needs
// anyway to size the kept ranges).
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/moe_kernels.h"
#include "core/buffer.h"

namespace dstrain::cuda {
namespace {

int64_t rows(const Tensor& t) { return t.size(-1) > 0 ? t.numel() / t.size(-1) : 0; }

// Device scratch of one call, freed in stream order when it goes out of scope.
Buffer scratch(DType dt, int64_t n, const Tensor& like) {
  return Buffer("moe scratch", MemCategory::Workspace, dt, n, like.device());
}

bool normalised(const ops::MoERouteParams& p) { return p.top_k > 1 && p.norm_topk_prob; }

moe::RouteArgs route_args(const ops::MoERouteParams& p) {
  moe::RouteArgs a;
  a.method = p.method == ops::MoETopK::Greedy ? 0 : p.method == ops::MoETopK::GroupLimitedGreedy ? 1 : 2;
  a.top_k = p.top_k;
  a.n_group = p.n_group;
  a.topk_group = p.topk_group;
  a.grouped = p.method != ops::MoETopK::Greedy && p.n_group > 1;
  a.normalised = normalised(p);
  a.routed_scaling_factor = p.routed_scaling_factor;
  return a;
}

// The CUDA kernel's own limits (the op's argument checks ran in the ops:: wrapper).
void check_route(const ops::MoERouteParams& p) {
  // The CUDA kernel keeps a token's candidates in registers and local memory.
  DS_CHECK(p.top_k <= moe::kMaxTopK, "moe_route: top_k {} is more than the CUDA kernel's {}", p.top_k,
           moe::kMaxTopK);
  DS_CHECK(p.method == ops::MoETopK::Greedy || p.n_group <= moe::kMaxGroups,
           "moe_route: n_group {} is more than the CUDA kernel's {}", p.n_group, moe::kMaxGroups);
}

// ---- scores and routing ---------------------------------------------------------------------

void moe_scores(Tensor scores, Tensor logits, ops::MoEScoring scoring) {
  const int64_t E = logits.size(-1), N = rows(logits);
  moe::scores(scores.raw(), elem_of(scores, "moe_scores: scores"), logits.raw(), elem_of(logits, "moe_scores: logits"),
              N, E, scoring == ops::MoEScoring::Sigmoid);
}

void moe_scores_backward(Tensor dlogits, Tensor dscores, Tensor scores, ops::MoEScoring scoring) {
  const int64_t E = scores.size(-1), N = rows(scores);
  moe::scores_backward(dlogits.raw(), elem_of(dlogits, "moe_scores_backward: dlogits"), dscores.raw(),
                       elem_of(dscores, "moe_scores_backward: dscores"), scores.raw(),
                       elem_of(scores, "moe_scores_backward: scores"), N, E, scoring == ops::MoEScoring::Sigmoid);
}

void moe_route(Tensor ids, Tensor weights, Tensor scores, Tensor bias, const ops::MoERouteParams& p) {
  check_route(p);
  const bool noaux = p.method == ops::MoETopK::NoAuxTC;
  const int64_t E = scores.size(-1), N = rows(scores);
  const Elem eb = noaux ? elem_of(bias, "moe_route: bias") : Elem::F32;
  moe::route(static_cast<int32_t*>(ids.raw()), weights.raw(), elem_of(weights, "moe_route: weights"), scores.raw(),
             elem_of(scores, "moe_route: scores"), noaux ? bias.raw() : nullptr, eb, N, int(E), route_args(p));
}

void moe_route_backward(Tensor dscores, Tensor dweights, Tensor ids, Tensor scores, const ops::MoERouteParams& p) {
  const int64_t E = scores.size(-1), N = rows(scores);
  moe::route_backward(dscores.raw(), elem_of(dscores, "moe_route_backward: dscores"), dweights.raw(),
                      elem_of(dweights, "moe_route_backward: dweights"), static_cast<const int32_t*>(ids.raw()),
                      scores.raw(), elem_of(scores, "moe_route_backward: scores"), N, E, route_args(p));
}

// ---- load-balancing loss --------------------------------------------------------------------

void moe_aux_loss(Tensor aux_out, Tensor coef, Tensor scores, Tensor ids, ops::MoEScoring scoring) {
  const int64_t E = scores.size(-1), N = rows(scores), G = E > 0 ? coef.numel() / E : 0;
  const int64_t k = ids.numel() / N;
  const bool sigmoid = scoring == ops::MoEScoring::Sigmoid;
  const int64_t chunks = moe::aux_chunks(N / G);
  const int64_t n_affinity = sigmoid ? N : 0, n_partial = G * chunks * E;
  Buffer sums = scratch(DType::F64, n_affinity + n_partial + G, scores);
  Buffer counts = scratch(DType::I32, G * E, scores);
  double* d = static_cast<double*>(sums.data());
  moe::AuxScratch s;
  s.affinity = sigmoid ? d : nullptr;
  s.partial = d + n_affinity;
  s.part = d + n_affinity + n_partial;
  s.counts = static_cast<int32_t*>(counts.data());
  moe::aux_loss(static_cast<double*>(aux_out.raw()), coef.raw(), elem_of(coef, "moe_aux_loss: coef"), scores.raw(),
                elem_of(scores, "moe_aux_loss: scores"), static_cast<const int32_t*>(ids.raw()), N, E, G, k, sigmoid,
                s);
}

void moe_aux_loss_backward(Tensor dscores, Tensor coef, Tensor scores, ops::MoEScoring scoring, float scale) {
  const int64_t E = dscores.size(-1), N = rows(dscores), G = E > 0 ? coef.numel() / E : 0;
  moe::aux_loss_backward(dscores.raw(), elem_of(dscores, "moe_aux_loss_backward: dscores"), coef.raw(),
                         elem_of(coef, "moe_aux_loss_backward: coef"), scores.raw(),
                         elem_of(scores, "moe_aux_loss_backward: scores"), N, E, G,
                         scoring == ops::MoEScoring::Sigmoid, scale);
}

// ---- dispatch and capacity plans ------------------------------------------------------------

void moe_dispatch_plan(Tensor offsets, Tensor sorted, Tensor position, Tensor ids) {
  const int64_t E = offsets.numel() - 1, M = ids.numel();
  const auto* ip = static_cast<const int32_t*>(ids.raw());
  Buffer counts = scratch(DType::I32, moe::plan_chunks(M) * E, ids);
  Buffer bad = scratch(DType::I64, 1, ids);
  DS_CUDA_CHECK(cudaMemsetAsync(bad.data(), 0xff, sizeof(unsigned long long), stream()));
  moe::plan_count(static_cast<int32_t*>(counts.data()), static_cast<unsigned long long*>(bad.data()), ip, M, E);
  // The plan's contract: an id out of range is an error on the host, named as the CPU names it.
  unsigned long long first_bad = 0;
  DS_CUDA_CHECK(cudaMemcpyAsync(&first_bad, bad.data(), sizeof first_bad, cudaMemcpyDeviceToHost, stream()));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream()));
  if (first_bad != ~0ull) {
    DS_FAIL("moe_dispatch_plan: expert id {} outside [0, {})", int32_t(uint32_t(first_bad & 0xffffffffull)), E);
  }
  moe::plan_place(static_cast<int64_t*>(offsets.raw()), static_cast<int32_t*>(sorted.raw()),
                  static_cast<int32_t*>(position.raw()), static_cast<int32_t*>(counts.data()), ip, M, E);
}

void moe_capacity_plan(Tensor kept, Tensor sorted, Tensor position, Tensor offsets, Tensor weights, int64_t capacity,
                       ops::MoEDropPolicy policy) {
  const int64_t E = offsets.numel() - 1, M = sorted.numel();
  const Elem ew = elem_of(weights, "moe_capacity_plan: weights");
  // The offsets come to the host: for the checks, and for the kept ranges, min(rows, capacity)
  // per expert, whichever rows the policy keeps.
  std::vector<int64_t> off(size_t(E + 1)), kp(size_t(E + 1));
  DS_CUDA_CHECK(cudaMemcpyAsync(off.data(), offsets.raw(), size_t(E + 1) * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                stream()));
  DS_CUDA_CHECK(cudaStreamSynchronize(stream()));
  DS_CHECK(off[0] == 0 && off[size_t(E)] == M, "moe_capacity_plan: offsets cover rows [{}, {}) of a plan of {}", off[0],
           off[size_t(E)], M);
  bool over = false;
  int64_t max_rows = 0;
  kp[0] = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = off[size_t(e + 1)] - off[size_t(e)];
    DS_CHECK(n >= 0, "moe_capacity_plan: offsets decrease at expert {}", e);
    if (n > capacity) {
      over = true;
      max_rows = std::max(max_rows, n);
    }
    kp[size_t(e + 1)] = kp[size_t(e)] + std::min(n, capacity);
  }
  // From pageable memory: the call returns once the bytes are staged, so kp may go.
  DS_CUDA_CHECK(cudaMemcpyAsync(kept.raw(), kp.data(), size_t(E + 1) * sizeof(int64_t), cudaMemcpyHostToDevice,
                                stream()));
  if (!over) return;  // every row stays where it is
  const int64_t R = kp[size_t(E)];
  // The kept rows move up over rows other experts still read: the kernels read a copy.
  Buffer from = scratch(DType::I32, M, sorted);
  DS_CUDA_CHECK(cudaMemcpyAsync(from.data(), sorted.raw(), size_t(M) * sizeof(int32_t), cudaMemcpyDeviceToDevice,
                                stream()));
  const bool probs = policy == ops::MoEDropPolicy::Probs;
  Buffer keep = scratch(DType::U8, probs ? M : 0, sorted);
  moe::capacity_plan(static_cast<int32_t*>(sorted.raw()), static_cast<int32_t*>(position.raw()),
                     static_cast<const int32_t*>(from.data()), static_cast<uint8_t*>(keep.data()),
                     static_cast<const int64_t*>(kept.raw()), static_cast<const int64_t*>(offsets.raw()),
                     weights.raw(), ew, M, E, capacity, probs, max_rows);
  // The rest of sorted: -1 (all bits set).
  DS_CUDA_CHECK(cudaMemsetAsync(static_cast<int32_t*>(sorted.raw()) + R, 0xff, size_t(M - R) * sizeof(int32_t),
                                stream()));
}

// ---- permutations ---------------------------------------------------------------------------

void moe_permute(Tensor xg, Tensor x, Tensor sorted, int top_k) {
  const int64_t C = x.size(-1), M = sorted.numel(), N = rows(x);
  moe::permute(xg.raw(), elem_of(xg, "moe_permute: xg"), x.raw(), elem_of(x, "moe_permute: x"),
               static_cast<const int32_t*>(sorted.raw()), M, N, C, top_k);
}

void moe_permute_backward(Tensor dx, Tensor dxg, Tensor position, bool accumulate) {
  const int64_t C = dx.size(-1), N = rows(dx), M = position.numel(), k = N > 0 ? M / N : 0;
  moe::permute_backward(dx.raw(), elem_of(dx, "moe_permute_backward: dx"), dxg.raw(),
                        elem_of(dxg, "moe_permute_backward: dxg"), static_cast<const int32_t*>(position.raw()), N, k,
                        dxg.numel() / C, C, accumulate);
}

void moe_unpermute(Tensor out, Tensor yg, Tensor weights, Tensor position) {
  const int64_t C = out.size(-1), N = rows(out), M = position.numel(), k = N > 0 ? M / N : 0;
  moe::unpermute(out.raw(), elem_of(out, "moe_unpermute: out"), yg.raw(), elem_of(yg, "moe_unpermute: yg"),
                 weights.raw(), elem_of(weights, "moe_unpermute: weights"),
                 static_cast<const int32_t*>(position.raw()), N, k, yg.numel() / C, C);
}

void moe_unpermute_backward(Tensor dyg, Tensor dweights, Tensor dout, Tensor yg, Tensor weights, Tensor sorted) {
  const int64_t C = dout.size(-1), N = rows(dout), M = weights.numel(), k = N > 0 ? M / N : 0, R = sorted.numel();
  moe::unpermute_backward(dyg.raw(), elem_of(dyg, "moe_unpermute_backward: dyg"), dweights.raw(),
                          elem_of(dweights, "moe_unpermute_backward: dweights"), dout.raw(),
                          elem_of(dout, "moe_unpermute_backward: dout"), yg.raw(),
                          elem_of(yg, "moe_unpermute_backward: yg"), weights.raw(),
                          elem_of(weights, "moe_unpermute_backward: weights"),
                          static_cast<const int32_t*>(sorted.raw()), N, k, R, C);
}

void moe_bias_update(Tensor bias, Tensor tokens_per_expert, float gamma) {
  const int64_t E = bias.numel();
  moe::bias_update(bias.raw(), elem_of(bias, "moe_bias_update: bias"),
                   static_cast<const int64_t*>(tokens_per_expert.raw()), E, gamma);
}

}  // namespace

void fill_moe(ops::OpTable& t) {
  for (KernelDType k : {KernelDType::F32, KernelDType::BF16, KernelDType::F16}) {
    const size_t s = size_t(k);
    t.moe_scores[s] = &moe_scores;
    t.moe_scores_backward[s] = &moe_scores_backward;
    t.moe_route[s] = &moe_route;
    t.moe_route_backward[s] = &moe_route_backward;
    t.moe_aux_loss[s] = &moe_aux_loss;
    t.moe_aux_loss_backward[s] = &moe_aux_loss_backward;
    t.moe_capacity_plan[s] = &moe_capacity_plan;
    t.moe_permute[s] = &moe_permute;
    t.moe_permute_backward[s] = &moe_permute_backward;
    t.moe_unpermute[s] = &moe_unpermute;
    t.moe_unpermute_backward[s] = &moe_unpermute_backward;
    t.moe_bias_update[s] = &moe_bias_update;
  }
  // Integer tensors only: the F32 slot.
  t.moe_dispatch_plan[size_t(KernelDType::F32)] = &moe_dispatch_plan;
}

}  // namespace dstrain::cuda
