#!/usr/bin/env python3
"""dstrain against the PyTorch reference on DeepSeek-V2/V3-style MoE models on this machine:
tokens/s of each on the same model, sequence length, micro-batch and thread count, their
ratio, and the share of dstrain's step time spent in MoE routing and in token permutation.

    validation/bench_moe.py [--steps 10] [--warmup 2] [--repeats 3] [--threads N]
                            [--seq-len 256] [--micro-batch 8] [--baseline OLD_BUILD/app/dstrain]

Needs a built tree (build/) and /usr/bin/python3 with torch. Runs alternate (dstrain,
torch, dstrain, torch, ...) so that a noisy machine affects both alike; each figure is the
median over the timed steps (after --warmup) of all repeats. Prints one row per model:

    dstrain tok/s, torch tok/s, ratio dstrain/torch, dstrain step ms,
    routing   median over steps of moe_route_s / step_time_s (gate GEMM, scores, top-k,
              dispatch plan and auxiliary loss, forward and backward, all MoE layers)
    permute   median over steps of moe_permute_s / step_time_s (permute and unpermute of
              the token rows, forward and backward)

Both sides train the same loss: mean CE + the MoE auxiliary terms + 0.3 x the MTP loss
(V3: num_nextn_predict_layers 1), with the auxiliary-loss-free router bias update (V3) after
the optimizer step, AdamW and clipping at 1.0. dstrain's step time is its whole step
(data wait and optimizer included); the reference (validation/reference/train_ref.py, model
deepseek_ref.DeepseekForCausalLM) times forward, backward, clipping, the optimizer step and
the bias update. The reference's MoE is Hugging Face's eager training path: a Python loop
over the experts, each taking its rows of the k-times repeated tokens by boolean mask and
writing them back by masked assignment; it is not token-by-token but is written for
exactness, not speed, and its gates also record test-only routing details (about 1% of an
MoE layer's time here). The ratio therefore measures dstrain against that reference, not
against an optimised PyTorch MoE (grouped GEMMs, fused permutation). No targets; exits 0.
With --baseline, a dstrain binary from an earlier commit runs in the same alternation and
its tokens/s is compared with this build's.
"""

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch import dstrain_rows, ensure_data, run_torch  # noqa: E402

CONFIGS = [
    # name, HF config
    ("V2-tiny (16 experts, softmax)", "inputs/models/deepseek-v2-tiny.json"),
    ("V3-tiny (32 experts, noaux, MTP)", "inputs/models/deepseek-v3-tiny.json"),
]


def run_dstrain(cfg, mb, T, steps, warmup, threads, binary=None):
    """Per timed step: tokens/s, step seconds, routing share, permutation share."""
    rows = dstrain_rows(cfg, mb, T, steps, warmup, threads, binary)
    missing = [k for k in ("moe_route_s", "moe_permute_s", "step_time_s") if k not in rows[0]]
    if missing:
        sys.exit(f"bench_moe: metrics.jsonl train rows lack {missing}; rebuild dstrain (cmake --build build)")
    return ([r["tokens_per_s"] for r in rows], [r["step_time_s"] for r in rows],
            [r["moe_route_s"] / r["step_time_s"] for r in rows],
            [r["moe_permute_s"] / r["step_time_s"] for r in rows])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--baseline", help="a dstrain binary from an earlier build, run in the same alternation")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    ensure_data()
    print(f"threads {a.threads}, T={a.seq_len}, micro-batch {a.micro_batch}, {a.steps} steps ({a.warmup} untimed), "
          f"{a.repeats} alternating repeats, load average {os.getloadavg()[0]:.2f} at start")
    results = []
    for name, cfg in CONFIGS:
        ds_tps, ds_step, route, permute, pt_tps, base_tps = [], [], [], [], [], []
        for _ in range(a.repeats):
            t, s, r, p = run_dstrain(cfg, a.micro_batch, a.seq_len, a.steps, a.warmup, a.threads)
            ds_tps += t
            ds_step += s
            route += r
            permute += p
            if a.baseline:
                base_tps += run_dstrain(cfg, a.micro_batch, a.seq_len, a.steps, a.warmup, a.threads, a.baseline)[0]
            pt_tps.append(run_torch(cfg, a.micro_batch, a.seq_len, a.steps, a.warmup, a.threads,
                                    "--mtp-loss-weight", "0.3"))
        results.append((name, statistics.median(ds_tps), statistics.median(pt_tps), statistics.median(ds_step),
                        statistics.median(route), statistics.median(permute),
                        statistics.median(base_tps) if base_tps else None))
    print(f"{'model':<33} {'dstrain tok/s':>13} {'torch tok/s':>12} {'ratio':>7} {'dstrain step ms':>16} "
          f"{'routing':>8} {'permute':>8}")
    for name, ds, pt, step, route, permute, _ in results:
        print(f"{name:<33} {ds:>13.0f} {pt:>12.0f} {ds / pt:>6.2f}x {step * 1e3:>16.1f} {route:>8.1%} "
              f"{permute:>8.1%}")
    print("routing / permute: median share of dstrain's step time (forward + backward, all MoE layers).")
    print("torch: deepseek_ref's MoE is Hugging Face's eager training path (a Python loop over experts with\n"
          "boolean-mask gather/scatter), written for exactness, not speed; see this script's docstring.")
    if a.baseline:
        print(f"against the baseline {a.baseline}:")
        for name, ds, pt, _, _, _, base in results:
            print(f"  {name:<33} this build {ds:>8.0f} tok/s, baseline {base:>8.0f} tok/s: {ds / base:.3f}x "
                  f"(torch ratio {ds / pt:.2f}x now, {base / pt:.2f}x before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
