#!/usr/bin/env python3
"""Data-parallel communication overhead and overlap, at 1 and 2 ranks on this machine.

    validation/bench_dp.py [--steps 14] [--warmup 4] [--repeats 3] [--bucket 1000000]

For each configuration the tiny DeepSeek-LLM model (inputs/quickstart.json) trains
--steps steps, --repeats times; every figure is the median over the timed steps of all
repeats, from dstrain's metrics.jsonl:
  step      wall time of an optimizer step
  compute   step minus the time the training thread waited for communication (per rank)
  comm      time the data-parallel communicator spent all-reducing gradients
  exposed   time the training thread waited for communication (not hidden by the backward)
  overlap   1 - exposed / comm: the share of the all-reduce hidden behind the backward
With 2 vCPUs the point is communication overhead and overlap, not compute scaling: two
ranks run one OpenMP thread each, so the one-rank rows are given with 1 and 2 threads.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader"}


def run(ranks, threads, overlap, steps, bucket):
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), **MPI_ENV)
        cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", os.path.join(ROOT, "build", "app", "dstrain"),
               "train", "--config", "inputs/quickstart.json", "--max-steps", str(steps), "--set",
               "train.train_batch_size=16", "train.train_micro_batch_size_per_gpu=8",
               f"train.gradient_accumulation_steps={2 // ranks}", "train.eval_interval=0",
               'output.save_hf=""', f'output.dir="{out}"', 'generate.prompt=""', "generate.interval=0",
               f"train.zero_optimization.reduce_bucket_size={bucket}",
               f"train.zero_optimization.overlap_comm={'true' if overlap else 'false'}"]
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        return [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l]


def main():
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), os.path.join(ROOT, "build")], check=True,
                   stdout=subprocess.DEVNULL)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket", type=int, default=1_000_000, help="reduce_bucket_size (elements)")
    a = ap.parse_args()
    configs = [("1 rank x 1 thread", 1, 1, True), ("1 rank x 2 threads", 1, 2, True),
               ("2 ranks x 1 thread, overlap", 2, 1, True), ("2 ranks x 1 thread, blocking", 2, 1, False)]
    rows = {c[0]: [] for c in configs}
    for _ in range(a.repeats):  # interleaved, so machine noise hits every configuration
        for name, ranks, threads, overlap in configs:
            rows[name] += run(ranks, threads, overlap, a.steps, a.bucket)[a.warmup:]
    print(f"global batch 16 x 256 tokens, tiny model (3.2M parameters, {3213568 * 4 / 1e6:.1f} MB of fp32 "
          f"gradients), reduce_bucket_size {a.bucket}; medians of {a.repeats} x {a.steps - a.warmup} steps")
    print(f"{'configuration':<30} {'step ms':>8} {'compute ms (per rank)':>24} {'comm ms':>8} {'exposed ms':>10} "
          f"{'overlap':>8} {'tok/s':>7}")
    med = lambda xs: statistics.median(xs)
    for name, ranks, _, _ in configs:
        rs = rows[name]
        step = med([r["step_time_s"] for r in rs]) * 1e3
        per_rank = [med([r["rank_compute_time_s"][k] for r in rs]) * 1e3 for k in range(ranks)]
        comm = med([r["comm_time_s"] for r in rs]) * 1e3
        exposed = med([r["exposed_comm_time_s"] for r in rs]) * 1e3
        # exposed also holds the step's two scalar all-reduces, so blocking mode can dip below 0.
        overlaps = [max(0.0, 1 - r["exposed_comm_time_s"] / r["comm_time_s"]) for r in rs if r["comm_time_s"] > 0]
        overlap = f"{med(overlaps):.0%}" if overlaps else "-"
        tps = med([r["tokens_per_s"] for r in rs])
        print(f"{name:<30} {step:>8.0f} {' / '.join(f'{c:.0f}' for c in per_rank):>24} {comm:>8.1f} "
              f"{exposed:>10.1f} {overlap:>8} {tps:>7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
