#!/usr/bin/env python3
"""The performance model against measurement on this machine: `dstrain plan` beside real runs.

For each model (dense d=1024 and DeepSeek-V3-tiny), `dstrain calibrate` first measures this
machine under `mpirun -n 4` (the model's op shapes, alone and 2 and 4 ranks at once, and the
collectives of groups of 2 and 4) into a profile. Then for every case (layouts of data, tensor,
pipeline, expert, ZeRO and recomputation at 1, 2 and 4 ranks) it runs

  dstrain plan --config ... --ranks N --cluster PROFILE --json    the predicted step time
  mpirun -n N dstrain train --max-steps S ...                     the measured one: the median
                                                                  step time of steps 2..S of
                                                                  metrics.jsonl

repeated (the cases alternate within each repeat, so drift of this shared machine falls on every
case alike) and reports the median over repeats with its spread, the error of the prediction,
the median and worst absolute error, and strong- (global batch fixed) and weak- (batch per rank
fixed) scaling efficiency of data parallelism at 1, 2 and 4 ranks, measured and predicted.

  python3 validation/bench_plan.py [--build build] [--repeats 3] [--steps 4] [--quick]
                                   [--markdown FILE] [--json FILE]

Every run trains inputs/quickstart.json's data (.ci/prepare-fortunes makes it), fp32, one thread
per rank, micro-batch 2 x 128 tokens; evaluation, generation, export and checkpoints off.
The expert layouts are predicted at metrics.expert_imbalance 1 (balanced loads): what a user
states before a run; the runs' own imbalance is printed beside them.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {
    "dense": ['model="inputs/models/deepseek-llm-cpu-d1024.json"'],
    "v3": ['model="inputs/models/deepseek-v3-tiny.json"', "train.mtp_loss_weight=0.3"],
}
COMMON = ["train.train_micro_batch_size_per_gpu=2", "data.seq_len=128", "train.eval_interval=0",
          "checkpoint.interval_steps=0", "checkpoint.interval_minutes=0", 'output.save_hf=""', 'generate.prompt=""',
          "train.steps_per_print=1", "checkpoint.save_final=false"]

# (name, model, ranks, overrides). "accum" is gradient accumulation steps; global batch =
# 2 x accum x data ranks.
CASES = [
    ("1 rank", "dense", 1, ["train.gradient_accumulation_steps=4"]),
    ("data 2", "dense", 2, ["train.gradient_accumulation_steps=2"]),
    ("data 4, ZeRO 1", "dense", 4, ["train.gradient_accumulation_steps=1", "train.zero_optimization.stage=1"]),
    ("data 2, ZeRO 3", "dense", 2, ["train.gradient_accumulation_steps=2", "train.zero_optimization.stage=3"]),
    ("tensor 2 (sequence parallel)", "dense", 2,
     ["train.gradient_accumulation_steps=4", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("tensor 2 x data 2", "dense", 4,
     ["train.gradient_accumulation_steps=2", "parallel.tensor=2", "parallel.sequence_parallel=true"]),
    ("pipeline 2, 1F1B", "dense", 2, ["train.gradient_accumulation_steps=4", "parallel.pipeline=2",
                                      'parallel.schedule="1f1b"']),
    ("pipeline 4, 1F1B", "dense", 4, ["train.gradient_accumulation_steps=4", "parallel.pipeline=4",
                                      'parallel.schedule="1f1b"']),
    ("pipeline 2 x data 2, interleaved", "dense", 4,
     ["train.gradient_accumulation_steps=2", "parallel.pipeline=2", 'parallel.schedule="interleaved"',
      "parallel.virtual_stages=2"]),
    ("1 rank, full recompute", "dense", 1,
     ["train.gradient_accumulation_steps=4", 'train.activation_checkpointing.granularity="full"']),
    ("1 rank", "v3", 1, ["train.gradient_accumulation_steps=4"]),
    ("expert 2 x data 2", "v3", 2, ["train.gradient_accumulation_steps=2", "parallel.expert=2"]),
    ("expert 2 x data 4, ZeRO 1", "v3", 4,
     ["train.gradient_accumulation_steps=1", "parallel.expert=2", "train.zero_optimization.stage=1"]),
    ("pipeline 2 DualPipeV x data 2, expert 2", "v3", 4,
     ["train.gradient_accumulation_steps=4", "parallel.pipeline=2", 'parallel.schedule="dualpipev"',
      "parallel.expert=2"]),
    ("tensor 2 x expert 2 x data 2", "v3", 4,
     ["train.gradient_accumulation_steps=2", "parallel.tensor=2", "parallel.expert=2"]),
    # Weak scaling of data parallelism: 4 micro-batches per rank at every size.
    ("data 2 (weak)", "dense", 2, ["train.gradient_accumulation_steps=4"]),
    ("data 4 (weak)", "dense", 4, ["train.gradient_accumulation_steps=4"]),
]
QUICK = {"1 rank", "data 2", "tensor 2 (sequence parallel)", "pipeline 2, 1F1B", "expert 2 x data 2"}


def env():
    e = dict(os.environ)
    e.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1",
             OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader", OMP_NUM_THREADS="1",
             # 4 ranks on this machine's 2 cores: a rank that waits yields its core.
             OMPI_MCA_mpi_yield_when_idle="1")
    return e


def args_of(sets):
    out = ["--config", "inputs/quickstart.json"]
    for s in sets:
        out += ["--set", s]
    return out


def run(cmd):
    p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(" ".join(cmd) + "\n" + p.stdout[-3000:] + p.stderr[-3000:])
    return p.stdout


def calibrate(build, model, out):
    run(["mpirun", "-n", "4", f"{build}/app/dstrain", "calibrate"] + args_of(MODELS[model] + COMMON) +
        ["--out", out, "--precisions", "fp32", "--seconds-per-op", "0.2"])


def predict(build, case, profile):
    name, model, ranks, sets = case
    out = run([f"{build}/app/dstrain", "plan"] + args_of(MODELS[model] + COMMON + sets) +
              ["--ranks", str(ranks), "--cluster", profile, "--json"])
    return json.loads(out)


def measure(build, case, steps, outdir):
    name, model, ranks, sets = case
    shutil.rmtree(outdir, ignore_errors=True)
    run(["mpirun", "-n", str(ranks), f"{build}/app/dstrain", "train", "--max-steps", str(steps)] +
        args_of(MODELS[model] + COMMON + sets + [f'output.dir="{outdir}"']))
    times, imbalance = [], 1.0
    with open(os.path.join(outdir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") != "train":
                continue
            if r["step"] >= 2:
                times.append(r["step_time_s"])
            for layer in r.get("moe", {}).values():
                imbalance = max(imbalance, layer.get("received_max_over_mean", 1.0))
    if not times:
        raise RuntimeError(f"{name}: no step records after the first in {outdir}")
    return statistics.median(times), imbalance


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="5 cases, for a smoke test")
    ap.add_argument("--markdown")
    ap.add_argument("--json")
    ap.add_argument("--profiles", help="directory for the calibrated profiles (default: a temporary one)")
    a = ap.parse_args()
    cases = [c for c in CASES if not a.quick or (c[0] in QUICK)]
    work = tempfile.mkdtemp(prefix="dstrain_bench_plan_")
    pdir = a.profiles or work
    os.makedirs(pdir, exist_ok=True)
    profiles = {}
    for model in sorted({c[1] for c in cases}):
        profiles[model] = os.path.join(pdir, f"calibrated-{model}.json")
        print(f"calibrating this machine for {model} ...", file=sys.stderr, flush=True)
        calibrate(a.build, model, profiles[model])
    predicted = {}
    for c in cases:
        predicted[(c[0], c[1])] = predict(a.build, c, profiles[c[1]])
    measured = {(c[0], c[1]): [] for c in cases}
    imbalance = {}
    for rep in range(a.repeats):
        for c in cases:
            print(f"repeat {rep + 1}/{a.repeats}: {c[1]} {c[0]} ...", file=sys.stderr, flush=True)
            t, imb = measure(a.build, c, a.steps, os.path.join(work, "run"))
            measured[(c[0], c[1])].append(t)
            imbalance[(c[0], c[1])] = imb
    rows = []
    for c in cases:
        key = (c[0], c[1])
        m = statistics.median(measured[key])
        p = predicted[key]["step_seconds"]
        rows.append(dict(case=c[0], model=c[1], ranks=c[2], predicted_s=p, measured_s=m, runs=measured[key],
                         error=(p - m) / m, imbalance=imbalance[key],
                         global_batch=predicted[key]["global_batch"], seq_len=predicted[key]["seq_len"],
                         bubble=predicted[key]["bubble_fraction"]))
    errors = [abs(r["error"]) for r in rows]

    def eff(ranks_case, base_case, weak):
        def find(name):
            return next((r for r in rows if r["case"] == name and r["model"] == "dense"), None)
        b, x = find(base_case), find(ranks_case)
        if not b or not x:
            return None
        # tokens/s per rank relative to one rank's.
        out = {}
        for k in ("measured_s", "predicted_s"):
            tb = b["global_batch"] / b[k]
            tx = x["global_batch"] / x[k]
            out[k] = tx / (tb * x["ranks"])
        return out

    scaling = []
    for label, case, weak in (("strong, 2 ranks", "data 2", False), ("strong, 4 ranks", "data 4, ZeRO 1", False),
                              ("weak, 2 ranks", "data 2 (weak)", True), ("weak, 4 ranks", "data 4 (weak)", True)):
        e = eff(case, "1 rank", weak)
        if e:
            scaling.append(dict(kind=label, measured=e["measured_s"], predicted=e["predicted_s"]))

    lines = ["| model | case | ranks | global batch | predicted s | measured s (median; runs) | error | "
             "imbalance met |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        runs = ", ".join(f"{t:.3f}" for t in r["runs"])
        lines.append(f"| {r['model']} | {r['case']} | {r['ranks']} | {r['global_batch']} x {r['seq_len']} | "
                     f"{r['predicted_s']:.3f} | {r['measured_s']:.3f} ({runs}) | {100 * r['error']:+.1f}% | "
                     f"{r['imbalance']:.2f} |")
    lines.append("")
    lines.append(f"{len(rows)} cases: median |error| {100 * statistics.median(errors):.1f}%, worst "
                 f"{100 * max(errors):.1f}%, within 15%: {sum(e <= 0.15 for e in errors)}, within 30%: "
                 f"{sum(e <= 0.30 for e in errors)}")
    if scaling:
        lines += ["", "| data-parallel scaling (dense) | measured efficiency | predicted |", "|---|---|---|"]
        for s in scaling:
            lines.append(f"| {s['kind']} | {100 * s['measured']:.1f}% | {100 * s['predicted']:.1f}% |")
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write("# The performance model against this machine\n\n`python3 validation/bench_plan.py "
                    f"--repeats {a.repeats} --steps {a.steps}`: step seconds, the median of steps 2..{a.steps} of "
                    "each run, the median of the runs.\n\n" + text + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=rows, scaling=scaling), f, indent=1)
    return 0 if max(errors) <= 0.30 and statistics.median(errors) <= 0.15 else 1


if __name__ == "__main__":
    sys.exit(main())
