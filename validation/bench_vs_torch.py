#!/usr/bin/env python3
"""dstrain against the PyTorch reference on this machine: tokens/s of each on the same
model, sequence length, batch and thread count, their ratio, and dstrain's achieved model
GFLOP/s against the sgemm ceiling measured here.

    validation/bench_vs_torch.py [--steps 12] [--warmup 2] [--repeats 3] [--threads N]
                                 [--baseline OLD_BUILD/app/dstrain]

Needs a built tree (build/) and /usr/bin/python3 with torch. Runs alternate (dstrain,
torch, dstrain, torch, ...) so that a noisy machine affects both alike; each figure is the
median over the timed steps of all repeats. Targets: dstrain >= 1.0x PyTorch on the
4-layer d=256 T=256 model, and >= 70% of the sgemm ceiling on the GEMM-dominated d=1024
model. With --baseline, a dstrain binary built from an earlier commit runs in the same
alternation (dstrain, baseline, torch, ...) and a column gives this build's tokens/s as a
ratio of the baseline's: how a change moved speed, measured in one run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build")
DATA = os.path.join(ROOT, "data", "fortunes", "fortunes_train_*.bin")

CONFIGS = [
    # name, HF config, micro-batch, seq_len, target
    ("d256 x 4 layers (T=256)", "inputs/models/deepseek-llm-tiny.json", 8, 256, ("torch_ratio", 1.0)),
    ("d1024 x 4 layers (T=256)", "inputs/models/deepseek-llm-cpu-d1024.json", 8, 256, ("ceiling", 0.70)),
]


def ensure_data():
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), BUILD], check=True, stdout=subprocess.DEVNULL)


def dstrain_rows(cfg, mb, T, steps, warmup, threads, binary=None):
    """The metrics.jsonl train rows of a quickstart run of model `cfg`, after `warmup` steps."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        cmd = [binary or os.path.join(BUILD, "app", "dstrain"), "train", "--config", "inputs/quickstart.json",
               "--max-steps", str(steps), "--set", f'model="{cfg}"', f"train.train_micro_batch_size_per_gpu={mb}",
               "train.gradient_accumulation_steps=1", f"data.seq_len={T}", "train.eval_interval=0",
               'output.save_hf=""', f'output.dir="{out}"', 'generate.prompt=""', "generate.interval=0"]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f]
    return [r for r in rows if r["type"] == "train"][warmup:]


def run_dstrain(cfg, mb, T, steps, warmup, threads, binary=None):
    rows = dstrain_rows(cfg, mb, T, steps, warmup, threads, binary)
    return [r["tokens_per_s"] for r in rows], [r["model_flops_per_s"] for r in rows]


def run_torch(cfg, mb, T, steps, warmup, threads, *extra):
    """Median tokens/s of the PyTorch peer (validation/reference/train_ref.py) on the same run."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS="1")
    cmd = ["/usr/bin/python3", os.path.join(ROOT, "validation", "reference", "train_ref.py"), "--config", cfg,
           "--data", DATA, "--seq-len", str(T), "--micro-batch", str(mb), "--steps", str(steps),
           "--warmup", str(warmup), "--threads", str(threads), *extra]
    out = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def sgemm_ceiling(threads):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([os.path.join(BUILD, "validation", "sgemm_ceiling"), "2048", "7"], env=env, check=True,
                         capture_output=True, text=True).stdout
    return float(out.strip()) * 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--baseline", help="a dstrain binary from an earlier build, run in the same alternation")
    a = ap.parse_args()
    ensure_data()
    print(f"threads {a.threads}, {a.steps} steps ({a.warmup} untimed), {a.repeats} alternating repeats")
    ceilings = []
    results = []
    for name, cfg, mb, T, target in CONFIGS:
        ds_tps, ds_flops, pt_tps, base_tps = [], [], [], []
        for _ in range(a.repeats):
            ceilings.append(sgemm_ceiling(a.threads))
            t, f = run_dstrain(cfg, mb, T, a.steps, a.warmup, a.threads)
            ds_tps += t
            ds_flops += f
            if a.baseline:
                base_tps += run_dstrain(cfg, mb, T, a.steps, a.warmup, a.threads, a.baseline)[0]
            pt_tps.append(run_torch(cfg, mb, T, a.steps, a.warmup, a.threads))
        results.append((name, target, statistics.median(ds_tps), statistics.median(pt_tps),
                        statistics.median(ds_flops), statistics.median(base_tps) if base_tps else None))
    ceiling = statistics.median(ceilings)
    print(f"sgemm ceiling (2048^3, OpenBLAS, {a.threads} threads): {ceiling / 1e9:.0f} GFLOP/s (median of "
          f"{len(ceilings)})")
    print(f"{'model':<26} {'dstrain tok/s':>13} {'torch tok/s':>12} {'ratio':>7} {'dstrain GFLOP/s':>16} "
          f"{'of ceiling':>11}  target")
    ok = True
    for name, (kind, goal), ds, pt, fl, base in results:
        ratio, frac = ds / pt, fl / ceiling
        met = (ratio if kind == "torch_ratio" else frac) >= goal
        ok &= met
        goal_text = f">= {goal:.1f}x torch" if kind == "torch_ratio" else f">= {goal:.0%} of ceiling"
        print(f"{name:<26} {ds:>13.0f} {pt:>12.0f} {ratio:>6.2f}x {fl / 1e9:>16.1f} {frac:>10.0%}  "
              f"{goal_text}: {'met' if met else 'MISSED'}")
    if a.baseline:
        print(f"against the baseline {a.baseline}:")
        for name, _, ds, pt, _, base in results:
            print(f"  {name:<26} this build {ds:>8.0f} tok/s, baseline {base:>8.0f} tok/s: {ds / base:.3f}x "
                  f"(torch ratio {ds / pt:.2f}x now, {base / pt:.2f}x before)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
