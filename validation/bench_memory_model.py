#!/usr/bin/env python3
"""The memory model against measurement: `dstrain train --dry-run` beside real runs.

For each case of the matrix (dense and V3 models x recomputation none/selective/full x the
pipeline schedules 1f1b/interleaved/dualpipev x ZeRO stages 0-3), on 4 ranks (pipeline 2 x
data 2; the V3 model with expert parallelism 2 too), it runs

  dstrain train --dry-run --ranks 4 ...    the memory model's peak per rank
  mpirun -n 4 dstrain train ...            a short run that reports, per rank, the peak of the
                                           allocator's accounting and the peak RSS

and prints predicted / measured per case (the rank with the largest measured peak), for the
allocator's peak and for RSS (the model's peak, plus the collectives in flight for which the
communication library holds temporaries, plus what the dry-run process holds itself: code,
libraries, MPI). With expert parallelism the model is told the load imbalance the run met
(metrics.expert_imbalance = the largest moe.<layer>.received_max_over_mean of the run's steps):
the model's rank is the hot one, in every MoE layer.

  python3 validation/bench_memory_model.py [--build build] [--quick] [--markdown] [--models dense,v3]

--quick runs a 12-case cover of the matrix (every value of every axis at least once).
"""
import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    # (config, extra overrides)
    "dense": ("inputs/quickstart.json", ["model=\"inputs/models/deepseek-llm-cpu-d1024.json\""]),
    "v3": ("inputs/quickstart.json", ["model=\"inputs/models/deepseek-v3-tiny.json\"", "parallel.expert=2",
                                      "train.mtp_loss_weight=0.3"]),
}
RECOMPUTE = {
    "none": ["train.activation_checkpointing.granularity=\"none\""],
    "selective": ["train.activation_checkpointing.granularity=\"selective\"",
                  "train.activation_checkpointing.selective=[\"layernorm\",\"moe_act\"]"],
    "full": ["train.activation_checkpointing.granularity=\"full\""],
}
SCHEDULES = {
    "1f1b": ["parallel.schedule=\"1f1b\""],
    "interleaved": ["parallel.schedule=\"interleaved\"", "parallel.virtual_stages=2"],
    "dualpipev": ["parallel.schedule=\"dualpipev\""],
}


def env():
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
             OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader", OMP_NUM_THREADS="1")
    return e


def sets(model, recompute, schedule, zero, out):
    config, extra = MODELS[model]
    s = extra + RECOMPUTE[recompute] + SCHEDULES[schedule] + [
        "parallel.pipeline=2", f"train.zero_optimization.stage={zero}", "train.train_micro_batch_size_per_gpu=4",
        "train.gradient_accumulation_steps=4", "data.seq_len=256", "train.eval_interval=0",
        "checkpoint.interval_steps=0", "checkpoint.interval_minutes=0", "output.save_hf=\"\"",
        "generate.prompt=\"\"", "train.steps_per_print=1", f"output.dir=\"{out}\""]
    args = ["--config", config]
    for x in s:
        args += ["--set", x]
    return args


def predict(build, args):
    p = subprocess.run([f"{build}/app/dstrain", "train", "--dry-run", "--ranks", "4"] + args, cwd=ROOT, env=env(),
                       capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise RuntimeError(p.stdout + p.stderr)
    peaks, library = {}, {}
    base = 0.0
    for line in p.stdout.splitlines():
        m = re.match(r"\s+(\d+)(?:-(\d+))?\s+([\d.]+(?:\s+[\d.]+){10})\s", line)
        if m:
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            vals = [float(v) for v in m.group(3).split()]
            for r in range(lo, hi + 1):
                peaks[r] = vals[8] * 1e6  # the columns: 8 categories, peak, held, library
                library[r] = vals[10] * 1e6
        m = re.search(r"holds ([\d.]+) MB resident", line)
        if m:
            base = float(m.group(1)) * 1e6
    if len(peaks) != 4:
        raise RuntimeError("could not read the dry-run's table:\n" + p.stdout + p.stderr)
    return peaks, library, base


def measure(build, args, out):
    shutil.rmtree(out, ignore_errors=True)
    p = subprocess.run(["mpirun", "-n", "4", f"{build}/app/dstrain", "train", "--max-steps", "2"] + args, cwd=ROOT,
                       env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(p.stdout[-3000:] + p.stderr[-3000:])
    last, imbalance = None, 1.0
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "train":
                last = r
                # The most-loaded layer's figure: the model gives every MoE layer the imbalance.
                for layer in r.get("moe", {}).values():
                    imbalance = max(imbalance, layer.get("received_max_over_mean", 1.0))
    return last["ranks"]["memory_peak_bytes"], last["ranks"]["peak_rss_bytes"], imbalance


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    a = ap.parse_args()
    models = [m for m in a.models.split(",") if m]
    if any(m not in MODELS for m in models):
        ap.error(f"--models: expected a subset of {', '.join(MODELS)}")
    cases = list(itertools.product(models, RECOMPUTE, SCHEDULES, range(4)))
    if a.quick:
        # Every recompute x schedule pair once per model, ZeRO stages cycling.
        cases = [(m, r, s, (i + j + (m == "v3")) % 4) for m in MODELS for i, r in enumerate(RECOMPUTE)
                 for j, s in enumerate(SCHEDULES) if m in models][:12]
    tmp = tempfile.mkdtemp(prefix="dstrain-memmodel-")
    rows, worst_alloc, worst_rss = [], 0.0, 0.0
    print(f"{'model':6} {'recompute':9} {'schedule':11} zero {'imbal':>5} | {'alloc pred':>10} {'alloc meas':>10} {'ratio':>6} | "
          f"{'RSS pred':>9} {'RSS meas':>9} {'ratio':>6}   (MB, the rank with the largest measured peak)")
    for model, rec, sched, zero in cases:
        out = os.path.join(tmp, "run")
        args = sets(model, rec, sched, zero, out)
        # The run first: the model is told the expert load imbalance the run met.
        alloc, rss, imbalance = measure(a.build, args, out)
        pred, library, base = predict(a.build, args + ["--set", f"metrics.expert_imbalance={imbalance:.4f}"])
        r = max(range(4), key=lambda k: alloc[k])
        ra = pred[r] / alloc[r]
        pred_rss = pred[r] + library[r] + base
        rr = pred_rss / rss[r]
        worst_alloc = max(worst_alloc, abs(ra - 1))
        worst_rss = max(worst_rss, abs(rr - 1))
        rows.append((model, rec, sched, zero, imbalance, pred[r], alloc[r], ra, pred_rss, rss[r], rr))
        print(f"{model:6} {rec:9} {sched:11} {zero:4} {imbalance:5.3f} | {pred[r]/1e6:10.1f} {alloc[r]/1e6:10.1f} "
              f"{ra:6.3f} | {pred_rss/1e6:9.1f} {rss[r]/1e6:9.1f} {rr:6.3f}", flush=True)
    print(f"{len(rows)} cases: largest deviation {worst_alloc*100:.1f}% (allocator), {worst_rss*100:.1f}% (RSS)")
    if a.markdown:
        print("\n| model | recompute | schedule | ZeRO | expert imbalance | predicted MB | allocator MB | ratio | "
              "predicted + process MB | RSS MB | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for m, rec, s, z, imb, p, al, ra, pr, rs, rr in rows:
            print(f"| {m} | {rec} | {s} | {z} | {imb:.3f} | {p/1e6:.1f} | {al/1e6:.1f} | {ra:.3f} | {pr/1e6:.1f} | "
                  f"{rs/1e6:.1f} | {rr:.3f} |")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if worst_alloc <= 0.10 and worst_rss <= 0.10 else 1


if __name__ == "__main__":
    sys.exit(main())
