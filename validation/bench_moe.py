#!/usr/bin/env python3
"""dstrain against the PyTorch reference on DeepSeek-V2/V3-style MoE models on this machine:
tokens/s of each on the same model, sequence length, micro-batch and thread count, their
ratio, and the share of dstrain's step time spent in MoE routing and in token permutation.

    validation/bench_moe.py [--steps 10] [--warmup 2] [--repeats 3] [--threads N]
                            [--seq-len 256] [--micro-batch 8] [--baseline OLD_BUILD/app/dstrain]
    validation/bench_moe.py --expert 1 2 4 [--ranks 4] [--steps 6] [--warmup 2] [--repeats 3]
                            [--seq-len 256] [--micro-batch 2]

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

--expert N [N ...]: expert parallelism on the V3-tiny model (32 routed experts, top-4 of 4
groups, 2 groups per token, a shared expert, MTP). Each size runs as --ranks MPI processes
(default: the largest N) with parallel.expert = N carved out of the data-parallel ranks, so
every size trains the same global batch on the same ranks and only the placement of the experts
differs; sizes alternate over --repeats. One process per rank with 1 thread, oversubscribed where
the machine has fewer cores than ranks (then every rank's time includes waiting for a core).
Per size: tokens/s, the all-to-all share of the step (rank 0's wait in dispatch and combine over
its step time), the dispatch / expert-GEMM / combine split, the busiest rank's received rows over
the mean, and rank 0's all-to-all bytes per step against the analytic count for uniform routing:

    bytes = 4 (dispatch and combine, forward and backward) x layers x micro-batches x
            micro-batch x T x top-k x (N - 1) / N (the rows whose expert is on another rank)
            x hidden_size x 4 (fp32)

The measured bytes differ from it by how far the routing of rank 0's tokens is from uniform.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_vs_torch import BUILD, DATA, ROOT, ensure_data  # noqa: E402

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OPENBLAS_NUM_THREADS": "1"}
V3_TINY = "inputs/models/deepseek-v3-tiny.json"


def dstrain_rows(cfg, mb, T, steps, warmup, threads, binary=None, ranks=1, sets=()):
    """The metrics.jsonl train rows of a quickstart run of model `cfg`, after `warmup` steps."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [binary or os.path.join(BUILD, "app", "dstrain"), "train", "--config", "inputs/quickstart.json",
               "--max-steps", str(steps), "--set", f'model="{cfg}"', f"train.train_micro_batch_size_per_gpu={mb}",
               "train.gradient_accumulation_steps=1", f"data.seq_len={T}", "train.eval_interval=0",
               'output.save_hf=""', f'output.dir="{out}"', 'generate.prompt=""', "generate.interval=0", *sets]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        if ranks > 1:
            cmd = ["mpirun", "-np", str(ranks)] + cmd
            env.update(MPI_ENV)
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, errors="replace")
        if p.returncode != 0:
            sys.exit(f"bench_moe: dstrain failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    return [r for r in rows if r["type"] == "train"][warmup:]


def run_torch(cfg, mb, T, steps, warmup, threads, *extra):
    """Median tokens/s of the PyTorch reference (validation/reference/train_ref.py) on the same run."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    cmd = ["/usr/bin/python3", os.path.join(ROOT, "validation", "reference", "train_ref.py"), "--config", cfg,
           "--data", DATA, "--seq-len", str(T), "--micro-batch", str(mb), "--steps", str(steps),
           "--warmup", str(warmup), "--threads", str(threads), *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def field(row, key):
    """A block of metrics.jsonl's row, at the top level or under "extra"."""
    return row[key] if key in row else row.get("extra", {})[key]


def bench_expert(a):
    """Expert parallelism at each size of --expert on --ranks ranks: see the module docstring."""
    ranks = a.ranks or max(a.expert)
    bad = [n for n in a.expert if ranks % n]
    if bad:
        sys.exit(f"bench_moe: --expert {bad} must divide --ranks {ranks} (expert ranks are carved out of the data ranks)")
    with open(os.path.join(ROOT, V3_TINY)) as f:
        model = json.load(f)
    C, k = model["hidden_size"], model["num_experts_per_tok"]
    layers = sum(1 for l in range(model["num_hidden_layers"] + model.get("num_nextn_predict_layers", 0))
                 if model["n_routed_experts"] and l >= model["first_k_dense_replace"])
    print(f"V3-tiny ({model['n_routed_experts']} routed experts, top-{k}, {layers} MoE layers with MTP's), "
          f"{ranks} ranks x 1 thread on {os.cpu_count()} cores, micro-batch {a.micro_batch} x T={a.seq_len} per rank, "
          f"{a.steps} steps ({a.warmup} untimed), {a.repeats} alternating repeats")
    res = {n: [] for n in a.expert}
    for _ in range(a.repeats):
        for n in a.expert:
            res[n] += dstrain_rows(V3_TINY, a.micro_batch, a.seq_len, a.steps, a.warmup, 1, ranks=ranks,
                                   sets=[f"parallel.expert={n}"])
    print(f"{'expert':>6} {'tok/s':>8} {'step ms':>8} {'a2a share':>10} {'dispatch ms':>12} {'experts ms':>11} "
          f"{'combine ms':>11} {'rows max/mean':>14} {'a2a MB/step':>12} {'analytic MB':>12} {'ratio':>6}")
    for n in a.expert:
        rows = res[n]
        med = lambda f: statistics.median(f(r) for r in rows)  # noqa: E731
        tps, step = med(lambda r: r["tokens_per_s"]), med(lambda r: r["step_time_s"])
        if n == 1:
            print(f"{n:>6} {tps:>8.0f} {step * 1e3:>8.1f} {'-':>10} {'-':>12} {'-':>11} {'-':>11} {'-':>14} "
                  f"{0:>12.2f} {0:>12.2f} {'-':>6}")
            continue
        ep = lambda r: field(r, "expert_parallel")  # noqa: E731
        share = med(lambda r: ep(r)["a2a_s"] / r["step_time_s"])
        analytic = 4 * layers * a.micro_batch * a.seq_len * k * (n - 1) / n * C * 4
        measured = med(lambda r: ep(r)["a2a_bytes"])
        print(f"{n:>6} {tps:>8.0f} {step * 1e3:>8.1f} {share:>10.1%} {med(lambda r: ep(r)['dispatch_s']) * 1e3:>12.1f} "
              f"{med(lambda r: ep(r)['expert_s']) * 1e3:>11.1f} {med(lambda r: ep(r)['combine_s']) * 1e3:>11.1f} "
              f"{med(lambda r: ep(r)['received_max_over_mean']):>14.2f} {measured / 1e6:>12.2f} "
              f"{analytic / 1e6:>12.2f} {measured / analytic:>6.2f}")
    print("a2a share / dispatch / combine: rank 0's waits in the all-to-alls (forward and backward); experts: its "
          "expert GEMMs;\nrows max/mean: the busiest rank's received rows over the mean; MB: rank 0's bytes sent per "
          "step, and the uniform-routing count.")
    return 0

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
    ap.add_argument("--micro-batch", type=int, help="per rank (default 8; with --expert 2)")
    ap.add_argument("--baseline", help="a dstrain binary from an earlier build, run in the same alternation")
    ap.add_argument("--expert", type=int, nargs="+", help="expert-parallel sizes to compare (V3-tiny, MPI ranks)")
    ap.add_argument("--ranks", type=int, help="MPI ranks of the --expert runs (default: the largest size)")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        ap.error(f"--steps {a.steps} must exceed --warmup {a.warmup}")
    if a.micro_batch is None:
        a.micro_batch = 2 if a.expert else 8
    ensure_data()
    if a.expert:
        return bench_expert(a)
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
