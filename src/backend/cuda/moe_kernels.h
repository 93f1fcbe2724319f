// Launch functions of the MoE kernels (moe.cu) over raw device pointers, for the op wrappers of
// moe.cpp, which check the arguments first. A plain header: nvcc compiles moe.cu with it.
// Floating-point tensors come with their Elem (any mix of F32, BF16, F16; arithmetic in fp32,
// one rounding per 16-bit store); ids, sorted and position are int32, offsets int64.
// Everything runs on cuda::stream().
#pragma once

#include <cstdint>

#include "core/cuda/runtime.h"

namespace dstrain::cuda::moe {

// Limits of the routing kernel (one thread per token, its candidates in registers and local
// memory): DeepSeek-V3 routes top-8 of 256 experts in 8 groups.
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = 64;

// Tokens per chunk of the aux loss's affinity sums and ids per chunk of the dispatch plan: the
// fixed partition that makes the sums' order, and the plan's scratch, a function of the shapes.
constexpr int64_t kAuxChunk = 64;
constexpr int64_t kPlanChunk = 256;

// ops::MoETopK as an int: 0 greedy, 1 group-limited greedy, 2 noaux_tc.
struct RouteArgs {
  int method = 0;
  int top_k = 1;
  int n_group = 1, topk_group = 1;
  bool grouped = false;     // group-limited selection (method != greedy and n_group > 1)
  bool normalised = false;  // top_k > 1 and norm_topk_prob
  float routed_scaling_factor = 1.0f;
};

// scores (N,E) = softmax or sigmoid of logits (N,E) per row; scores may alias logits.
void scores(void* scores, Elem es, const void* logits, Elem el, int64_t N, int64_t E, bool sigmoid);
// dlogits (N,E) from dscores and scores (N,E); dlogits may alias dscores.
void scores_backward(void* dlogits, Elem edl, const void* dscores, Elem eds, const void* scores, Elem es, int64_t N,
                     int64_t E, bool sigmoid);
// ids (N,k) int32 and weights (N,k) from scores (N,E) and, for noaux_tc, bias (E).
void route(int32_t* ids, void* weights, Elem ew, const void* scores, Elem es, const void* bias, Elem eb, int64_t N,
           int E, const RouteArgs& a);
// dscores (N,E), overwritten, from dweights (N,k), ids (N,k) and scores (N,E).
void route_backward(void* dscores, Elem eds, const void* dweights, Elem edw, const int32_t* ids, const void* scores,
                    Elem es, int64_t N, int64_t E, const RouteArgs& a);

// Scratch of aux_loss, in doubles and int32s: the caller allocates (zero-filled).
struct AuxScratch {
  double* affinity = nullptr;  // (N): only for sigmoid scores
  double* partial = nullptr;   // (G, aux_chunks(N/G), E)
  int32_t* counts = nullptr;   // (G, E), zero on entry
  double* part = nullptr;      // (G)
};
inline int64_t aux_chunks(int64_t Tg) { return (Tg + kAuxChunk - 1) / kAuxChunk; }
// aux (1) F64 and coef (G,E) from scores (N,E) and ids (N,k), over G groups of N/G tokens.
void aux_loss(double* aux, void* coef, Elem ec, const void* scores, Elem es, const int32_t* ids, int64_t N, int64_t E,
              int64_t G, int64_t k, bool sigmoid, const AuxScratch& s);
// dscores (N,E) += scale * d aux / d scores from coef (G,E) and scores (N,E).
void aux_loss_backward(void* dscores, Elem ed, const void* coef, Elem ec, const void* scores, Elem es, int64_t N,
                       int64_t E, int64_t G, bool sigmoid, float scale);

inline int64_t plan_chunks(int64_t M) { return (M + kPlanChunk - 1) / kPlanChunk; }
// The dispatch plan's first pass: per-chunk expert counts into counts (plan_chunks(M), E),
// zero on entry, and the first out-of-range id into *bad as (index << 32 | uint32 id); *bad
// must be all ones on entry and stays so when every id is in [0, E).
void plan_count(int32_t* counts, unsigned long long* bad, const int32_t* ids, int64_t M, int64_t E);
// The second and third passes (every id in range): offsets (E+1), sorted (M), position (M).
// counts is the first pass's and is used up (it becomes the chunks' cursors).
void plan_place(int64_t* offsets, int32_t* sorted, int32_t* position, int32_t* counts, const int32_t* ids, int64_t M,
                int64_t E);

// The capacity plan's device part, once the host has checked offsets and written kept (E+1):
// from_sorted (M) is a copy of the plan's sorted, which is rewritten in place with position;
// keep (M) is byte scratch for the Probs policy (prob_rank says whether to rank: some expert
// is over capacity, under Probs), and max_rows the most rows of an expert over capacity.
void capacity_plan(int32_t* sorted, int32_t* position, const int32_t* from_sorted, uint8_t* keep,
                   const int64_t* kept, const int64_t* offsets, const void* weights, Elem ew, int64_t M, int64_t E,
                   int64_t capacity, bool prob_rank, int64_t max_rows);

// xg (R,C) row p = x (N,C) row sorted[p] / top_k.
void permute(void* xg, Elem eg, const void* x, Elem ex, const int32_t* sorted, int64_t R, int64_t N, int64_t C,
             int top_k);
// dx (N,C) (+= when accumulate) sum over slots of dxg (R,C) rows position[n*k + slot] (>= 0).
void permute_backward(void* dx, Elem edx, const void* dxg, Elem eg, const int32_t* position, int64_t N, int64_t k,
                      int64_t R, int64_t C, bool accumulate);
// out (N,C) += sum over slots of weights[n*k + slot] * yg (R,C) row position[n*k + slot] (>= 0).
void unpermute(void* out, Elem eo, const void* yg, Elem ey, const void* weights, Elem ew, const int32_t* position,
               int64_t N, int64_t k, int64_t R, int64_t C);
// dyg (R,C) and dweights (N*k) from dout (N,C), yg (R,C), weights (N*k), sorted (R); dweights
// is zeroed first when R < N*k.
void unpermute_backward(void* dyg, Elem edy, void* dweights, Elem edw, const void* dout, Elem edo, const void* yg,
                        Elem ey, const void* weights, Elem ew, const int32_t* sorted, int64_t N, int64_t k, int64_t R,
                        int64_t C);

// bias (E) += or -= gamma by tokens_per_expert (E) against its mean.
void bias_update(void* bias, Elem eb, const int64_t* tokens_per_expert, int64_t E, float gamma);

}  // namespace dstrain::cuda::moe
