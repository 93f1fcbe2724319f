#!/usr/bin/env python3
"""ZeRO on this machine: per-rank model-state memory, peak RSS and tokens/s of ZeRO stages 0-3 at
1, 2 and 4 data-parallel ranks, next to the analytic figures, and the share of a step that
communication leaves exposed at stages 2 and 3 on 2 ranks.

    validation/bench_zero.py [--ranks 1,2,4] [--stages 0,1,2,3] [--steps 4] [--warmup 1] [--repeats 1]
                             [--model inputs/models/deepseek-llm-tiny.json] [--micro-batch 8]
                             [--batch 32] [--seq-len 256] [--threads 1] [--offload]
                             [--bucket 500000] [--prefetch 500000] [--set KEY=VALUE ...] [--binary build/app/dstrain] [--json OUT]

Every run trains inputs/quickstart.json (its embedded fortunes data, fp32, AdamW) with the model
swapped for --model, under `mpirun -np RANKS`, train.zero_optimization.stage=STAGE, evaluation,
generation, HF export and the final checkpoint off. The global batch (--batch windows of
--seq-len tokens, default micro-batch x the largest rank count) is the same at every rank count:
the micro-batch stays --micro-batch and the gradient accumulation is batch / (micro-batch x
ranks), so tokens/s is global and the runs train the same thing. Stages 2 and 3 reduce every
micro-step, as DeepSpeed does, so their communication grows with the accumulation.

Figures, from dstrain's metrics.jsonl (the first --warmup steps of a run untimed):
  model state  parameters + gradients + optimizer_state + gathered_parameters of the step
               records' memory_bytes: rank 0's bytes held at the end of a step (current, not
               peak: the whole gradients of stages 2-3 and the weights stage 3 gathers for a
               layer are transient and are gone by then; what stays gathered at stage 3 is the
               persistent parameters, stage3_param_persistence_threshold)
  fp32 analytic dstrain's per-rank model state in fp32 training (train/trainer.cpp,
               model_state_bytes_per_rank), Psi parameters, N ranks:
               stage 0: 16 Psi; 1: (4 + 4 + 12/N) Psi; 2: (4 + 16/N) Psi; 3: 16/N Psi
               (whole fp32 weights and gradients at stages 0-1, the masters and AdamW's two
               moments, K = 12, sharded from stage 1, gradients from 2, weights at 3)
  DS mixed     the ZeRO paper's / DeepSpeed's mixed-precision analytic (fp16 weights and
               gradients, K = 12): 0: (2+2+K) Psi; 1: (2+2) Psi + K Psi/N; 2: 2 Psi + (2+K) Psi/N;
               3: (2+2+K) Psi/N. For reference only: dstrain trains fp32 here.
  meas/fp32    model state over the fp32 analytic (above 1 at stage 3 by the persistent
               parameters; with offload in a CPU-only build the host copy of the gradient shard
               is counted as well)
  peak RSS     the largest ru_maxrss over the ranks (peak_rss_bytes): the whole process since
               its start (activations, workspace, MPI, the start-up weights), so it moves far
               less than the model state on a small model
  tok/s        median over the timed steps of all repeats (global tokens per second)
  exposed      exposed_comm_time_s / step_time_s, median over the timed steps
Each category is also checked against its own analytic share (e.g. gradients 4/N Psi from stage
2 on) and a line printed for any that is off by more than 2%.

Targets (2 ranks, exposed communication as a share of a step, median): stage 2 < 5%, stage 3
< 15%. --offload adds stage 2 and 3 runs with offload_optimizer.device = cpu (and, at stage 3,
offload_param.device = cpu) and gives their tokens/s against the same stage without offload.
Exit status 1 when a measured target is missed or a run fails.

With more ranks x threads than cores the runs are oversubscribed and the header says so: tokens/s
at those rank counts measures the communication and the scheduler, not scaling.
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = "inputs/quickstart.json"  # runs start in ROOT
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader"}
K = 12  # bytes per parameter of fp32 masters and AdamW's two moments
TARGETS = {2: 0.05, 3: 0.15}  # stage -> exposed communication share of a step, at TARGET_RANKS
TARGET_RANKS = 2
STATE = ("parameters", "gradients", "optimizer_state", "gathered_parameters")
TOLERANCE = 0.02
MB = 1e6


def dstrain_fp32_bytes(stage, n, psi):
    n = max(n, 1)
    return psi * {0: 16, 1: 4 + 4 + K / n, 2: 4 + 16 / n}.get(stage, 16 / n)


def deepspeed_mixed_bytes(stage, n, psi):
    n = max(n, 1)
    return psi * {0: 2 + 2 + K, 1: 2 + 2 + K / n, 2: 2 + (2 + K) / n}.get(stage, (2 + 2 + K) / n)


def expected_categories(stage, n, psi, offload, persistent):
    """Bytes per memory category that dstrain's ZeRO design holds on a rank at the end of a step."""
    n = max(n, 1)
    whole = 4 * psi
    shard = 4 * psi / n
    if stage == 0:
        return {"parameters": whole, "gradients": whole, "optimizer_state": 2 * whole, "gathered_parameters": 0}
    params = whole + shard if stage < 3 else shard  # whole weights (stages 1-2) + the master pieces
    grads = whole if stage == 1 else shard
    if offload and stage >= 2:
        grads += shard  # the gradient shard's host copy (the same memory in a CPU-only build)
    if offload and stage == 3 and not offload["param"]:
        params += shard  # the pieces at rest on the device besides the host masters
    return {"parameters": params, "gradients": grads, "optimizer_state": 2 * shard,
            "gathered_parameters": 4 * persistent if stage == 3 else 0}


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def load_avg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def label(stage, offload):
    return f"{stage}" + ("+off" if offload else "")


def run_dstrain(a, stage, ranks, offload):
    """One run: its timed step records and what its log says about the model."""
    accum = a.batch // (a.micro_batch * ranks)
    steps = a.warmup + a.steps
    with tempfile.TemporaryDirectory(prefix="bench_zero.") as out:
        sets = [f'model="{a.model}"', f"train.train_batch_size={a.batch}",
                f"train.train_micro_batch_size_per_gpu={a.micro_batch}", f"train.gradient_accumulation_steps={accum}",
                f"data.seq_len={a.seq_len}", f"train.zero_optimization.stage={stage}", "train.eval_interval=0",
                "checkpoint.save_final=false", 'output.save_hf=""', f'output.dir="{out}"', 'generate.prompt=""',
                "generate.interval=0", f"train.zero_optimization.reduce_bucket_size={a.bucket}",
                f"train.zero_optimization.stage3_prefetch_bucket_size={a.prefetch}"]
        sets += a.set
        if offload:
            sets.append('train.zero_optimization.offload_optimizer={"device": "cpu"}')
            if offload["param"]:
                sets.append('train.zero_optimization.offload_param={"device": "cpu"}')
        cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", a.binary, "train", "--config", QUICKSTART,
               "--max-steps", str(steps), "--set", *sets]
        env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), OPENBLAS_NUM_THREADS=str(a.threads), **MPI_ENV)
        t0 = time.time()
        # Its own process group, so that a run past --timeout goes with every rank mpirun started.
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            log, _ = p.communicate(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                    p.communicate(timeout=10)
                    break
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            return {"error": f"timed out after {a.timeout} s", "cmd": cmd, "wall_s": time.time() - t0, "accum": accum}
        path = os.path.join(out, "metrics.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [r for r in map(json.loads, f) if r.get("type") == "train"]
    res = {"cmd": cmd, "wall_s": time.time() - t0, "accum": accum}
    if p.returncode != 0 or len(rows) < steps:
        lines = [l for l in log.splitlines() if "error" in l.lower()] or log.strip().splitlines()[-3:]
        res["error"] = f"exit status {p.returncode}, {len(rows)} of {steps} steps: " + " | ".join(lines[:3])
        return res
    m = re.search(r"model: (\d+) parameters", log)
    res["params"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) elements persistent", log)
    res["persistent"] = int(m.group(1)) if m else 0
    m = re.search(r"ZeRO stage .*", log)
    res["zero"] = m.group(0).strip() if m else None
    res["rows"] = rows[a.warmup:]
    res["memory_changes"] = len({json.dumps(r["memory_bytes"], sort_keys=True) for r in res["rows"]}) > 1
    return res


def summarize(runs, stage, ranks, offload):
    """The figures of one (stage, ranks, offload) configuration over its repeats."""
    good = [r for r in runs if "error" not in r]
    s = {"stage": stage, "ranks": ranks, "offload": bool(offload), "errors": [r["error"] for r in runs if "error" in r],
         "accum": runs[0]["accum"] if runs else None}
    if not good:
        return s
    rows = [row for r in good for row in r["rows"]]
    last = good[-1]["rows"][-1]
    mem = last["memory_bytes"]
    psi = good[-1]["params"]
    s.update({
        "params": psi, "persistent": good[-1]["persistent"], "zero": good[-1]["zero"],
        "memory_bytes": mem, "memory_changes_between_steps": any(r["memory_changes"] for r in good),
        "model_state_bytes": sum(mem.get(c, 0) for c in STATE),
        "peak_rss_bytes": max(r["rows"][-1]["peak_rss_bytes"] for r in good),
        "tokens_per_s": med([row["tokens_per_s"] for row in rows]),
        "step_time_s": med([row["step_time_s"] for row in rows]),
        "comm_time_s": med([row["comm_time_s"] for row in rows]),
        "exposed_comm_time_s": med([row["exposed_comm_time_s"] for row in rows]),
        "exposed_share": med([row["exposed_comm_time_s"] / row["step_time_s"] for row in rows if row["step_time_s"] > 0]),
        "timed_steps": len(rows),
        # ZeRO's peaks within a step (metrics' "zero" block): whole weights gathered (stage 3) and
        # whole gradients not yet reduced (stages 2, 3).
        "gathered_peak_bytes": max((row.get("zero", {}).get("gathered_peak_bytes", 0) for row in rows), default=0),
        "transient_grad_peak_bytes": max((row.get("zero", {}).get("transient_grad_peak_bytes", 0) for row in rows),
                                         default=0),
        "step_tokens_per_s": [row["tokens_per_s"] for row in rows],
        "step_exposed_shares": [row["exposed_comm_time_s"] / row["step_time_s"] for row in rows if row["step_time_s"] > 0],
    })
    if psi:
        s["fp32_analytic_bytes"] = dstrain_fp32_bytes(stage, ranks, psi)
        s["ds_mixed_analytic_bytes"] = deepspeed_mixed_bytes(stage, ranks, psi)
        s["ratio"] = s["model_state_bytes"] / s["fp32_analytic_bytes"]
        exp = expected_categories(stage, ranks, psi, offload, s["persistent"])
        s["expected_categories"] = exp
        off = []
        for c, want in exp.items():
            got = mem.get(c, 0)
            if abs(got - want) > TOLERANCE * max(want, 4 * psi / ranks):
                off.append(f"{c} {got / MB:.2f} MB, expected {want / MB:.2f} MB ({got / (want or 1):.2f}x)")
        s["category_mismatches"] = off
    return s


def main():
    with open(os.path.join(ROOT, QUICKSTART)) as f:
        default_model = json.load(f)["model"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved")
    ap.add_argument("--model", default=default_model, help="model config (default: the quickstart's)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--batch", type=int, default=None, help="global batch in windows (default micro-batch x max ranks)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--offload", action="store_true", help="add stage 2 and 3 runs with the optimizer (and stage 3 "
                    "parameters) offloaded to the CPU")
    ap.add_argument("--bucket", type=int, default=500_000,
                    help="train.zero_optimization.reduce_bucket_size of every run, in elements (DeepSpeed's default "
                    "of 5e8 is one bucket for a small model: nothing would overlap the backward)")
    ap.add_argument("--prefetch", type=int, default=500_000,
                    help="train.zero_optimization.stage3_prefetch_bucket_size, in elements (DeepSpeed's default of "
                    "5e7 prefetches the whole of a small model)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more dstrain --set override for every run (e.g. "
                    "train.zero_optimization.reduce_bucket_size=500000); repeatable")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "app", "dstrain"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    ranks = [int(x) for x in a.ranks.split(",") if x]
    stages = [int(x) for x in a.stages.split(",") if x]
    if any(s not in (0, 1, 2, 3) for s in stages):
        sys.exit("bench_zero: stages are 0 to 3")
    if a.batch is None:
        a.batch = a.micro_batch * max(ranks)
    for n in ranks:
        if a.batch % (a.micro_batch * n):
            sys.exit(f"bench_zero: the global batch {a.batch} is not a multiple of micro-batch {a.micro_batch} x {n} ranks")
    if not os.path.exists(a.binary):
        sys.exit(f"bench_zero: no dstrain at {a.binary}: build it first")
    a.model = os.path.relpath(os.path.abspath(a.model), ROOT) if os.path.exists(a.model) else a.model
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), os.path.join(ROOT, "build")],
                   check=True, stdout=subprocess.DEVNULL)

    configs = [(s, n, None) for n in ranks for s in stages]
    if a.offload:
        configs += [(s, n, {"param": s == 3}) for n in ranks for s in stages if s >= 2]
    cores = os.cpu_count() or 1
    load0 = load_avg()
    runs = {(s, n, bool(o)): [] for s, n, o in configs}
    for rep in range(a.repeats):  # interleaved, so machine noise hits every configuration
        for s, n, o in configs:
            r = run_dstrain(a, s, n, o)
            runs[(s, n, bool(o))].append(r)
            status = r.get("error") or f"{med([x['tokens_per_s'] for x in r['rows']]):.0f} tok/s"
            print(f"  [{rep + 1}/{a.repeats}] stage {label(s, o)}, {n} rank(s), accum {r['accum']}: {status} "
                  f"({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
    load1 = load_avg()
    summ = {(s, n, bool(o)): summarize(runs[(s, n, bool(o))], s, n, o) for s, n, o in configs}

    psi = next((x["params"] for x in summ.values() if x.get("params")), None)
    over = [n for n in ranks if n * a.threads > cores]
    print(f"\nZeRO on {a.model} ({psi / 1e6:.2f}M parameters, fp32, AdamW)" if psi else f"\nZeRO on {a.model}")
    print(f"global batch {a.batch} x {a.seq_len} tokens (micro-batch {a.micro_batch}, accumulation batch / "
          f"(micro-batch x ranks)), {a.threads} thread(s) per rank; medians of {a.repeats} x {a.steps} timed steps "
          f"after {a.warmup} warm-up step(s); reduce_bucket_size {a.bucket}, "
          f"stage3_prefetch_bucket_size {a.prefetch}" +
          (f"; --set {' '.join(a.set)}" if a.set else ""))
    if over:
        print(f"note: {cores} cores: {', '.join(map(str, over))} rank(s) x {a.threads} thread(s) OVERSUBSCRIBE the "
              f"machine; tokens/s there is not a scaling figure")
    if load0 is not None and max(load0, load1 or 0) > 0.5 * cores:
        print(f"note: load average {load0:.1f} before and {load1:.1f} after the runs on {cores} cores: other work "
              f"was running, timings are noisy")
    print("model state = parameters + gradients + optimizer_state + gathered_parameters (rank 0, end of a step, "
          "MB = 1e6 B);\npk gather / pk grads = the step's peak of whole weights gathered (stage 3) and of whole "
          "gradients not yet reduced (stages 2, 3), MB;\nfp32 analytic = dstrain's fp32 model; DS mixed = DeepSpeed's mixed-precision analytic "
          "(reference, K=12)\n")
    head = (f"{'stage':>5} {'ranks':>5} {'accum':>5} {'params':>7} {'grads':>7} {'optim':>7} {'gathered':>8} "
            f"{'state MB':>8} {'fp32 analytic':>13} {'meas/fp32':>9} {'DS mixed':>8} {'peak RSS MB':>11} "
            f"{'tok/s':>7} {'exposed':>7} {'pk gather':>9} {'pk grads':>10}")
    print(head)
    print("-" * len(head))
    failed = False
    for s, n, o in configs:
        x = summ[(s, n, bool(o))]
        if x["errors"] and "tokens_per_s" not in x:
            failed = True
            print(f"{label(s, o):>5} {n:>5} {x['accum']:>5}  FAILED: {x['errors'][0]}")
            continue
        mem = x["memory_bytes"]
        print(f"{label(s, o):>5} {n:>5} {x['accum']:>5} " + " ".join(
            f"{mem.get(c, 0) / MB:>{w}.2f}" for c, w in zip(STATE, (7, 7, 7, 8))) +
            f" {x['model_state_bytes'] / MB:>8.2f} {fmt(x.get('fp32_analytic_bytes', 0) / MB, '.2f'):>13} "
            f"{fmt(x.get('ratio'), '.3f'):>9} {fmt(x.get('ds_mixed_analytic_bytes', 0) / MB, '.2f'):>8} "
            f"{x['peak_rss_bytes'] / MB:>11.1f} {x['tokens_per_s']:>7.0f} "
            f"{(fmt(100 * x['exposed_share'], '.1f') + '%') if n > 1 else '-':>7} "
            f"{(x['gathered_peak_bytes'] / MB if s == 3 else 0):>9.2f} {(x['transient_grad_peak_bytes'] / MB if s >= 2 else 0):>10.2f}")
        if x["errors"]:
            failed = True
            print(f"      {len(x['errors'])} of {a.repeats} repeats failed: {x['errors'][0]}")
    notes = []
    for s, n, o in configs:
        x = summ[(s, n, bool(o))]
        for m in x.get("category_mismatches", []):
            notes.append(f"stage {label(s, o)}, {n} rank(s): {m}")
        if x.get("memory_changes_between_steps"):
            notes.append(f"stage {label(s, o)}, {n} rank(s): memory_bytes differ between the timed steps")
    checked = sum("category_mismatches" in x for x in summ.values())
    if notes:
        print("\nmemory categories off their analytic share (> 2%):")
        for line in notes:
            print(f"  {line}")
    elif not checked:
        print("\nno run measured: memory categories not checked")
    else:
        print("\nevery memory category matches its analytic share within 2% (parameters, gradients, optimizer "
              "state, and at stage 3 the persistent parameters gathered)")

    print(f"\nexposed communication at {TARGET_RANKS} ranks (median share of a step):")
    targets = {}
    for s, limit in TARGETS.items():
        x = summ.get((s, TARGET_RANKS, False))
        if not x or "exposed_share" not in x:
            print(f"  stage {s}: < {100 * limit:.0f}%: not measured")
            continue
        ok = x["exposed_share"] < limit
        failed |= not ok
        targets[s] = {"exposed_share": x["exposed_share"], "target": limit, "met": ok}
        print(f"  stage {s}: {100 * x['exposed_share']:.1f}% (exposed {1e3 * x['exposed_comm_time_s']:.0f} ms of "
              f"{1e3 * x['step_time_s']:.0f} ms, comm {1e3 * x['comm_time_s']:.0f} ms; steps "
              f"{100 * min(x['step_exposed_shares']):.1f}-{100 * max(x['step_exposed_shares']):.1f}%)  "
              f"target < {100 * limit:.0f}%: {'PASS' if ok else 'MISS'}")

    if a.offload:
        print("\noffload (offload_optimizer cpu; stage 3 also offload_param cpu): tokens/s against the same stage "
              "without")
        for s, n, o in configs:
            if not o:
                continue
            x, base = summ[(s, n, True)], summ.get((s, n, False))
            if "tokens_per_s" not in x or not base or "tokens_per_s" not in base:
                print(f"  stage {s}, {n} rank(s): not measured")
                continue
            cost = x["tokens_per_s"] / base["tokens_per_s"] - 1
            x["tokens_per_s_vs_no_offload"] = cost
            print(f"  stage {s}, {n} rank(s): {x['tokens_per_s']:.0f} vs {base['tokens_per_s']:.0f} tok/s "
                  f"({100 * cost:+.1f}%)")

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cores": cores, "load_avg": [load0, load1], "params": psi,
                       "configs": [summ[(s, n, bool(o))] for s, n, o in configs], "targets": targets,
                       "runs": {f"{s}/{n}/{int(o)}": [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                                for (s, n, o), rs in runs.items()}}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
