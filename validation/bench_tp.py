#!/usr/bin/env python3
"""Tensor parallelism (TP) and sequence parallelism (SP) on this machine: tokens/s, step time, the
time and bytes of the tensor group's collectives and rank 0's activation memory of the quickstart
model at TP 1, 2 and 4, SP off and on, next to the analytic communication volume.

    validation/bench_tp.py [--tensor 1,2,4] [--sp off,on] [--steps 4] [--warmup 1] [--repeats 1]
                           [--model inputs/models/deepseek-llm-tiny.json] [--micro-batch 8] [--accum 1]
                           [--seq-len 256] [--threads 1] [--set KEY=VALUE ...] [--binary build/app/dstrain]
                           [--timeout 900] [--json OUT]

Every run trains inputs/quickstart.json (its embedded fortunes data, fp32, AdamW) with the model
swapped for --model, under `mpirun -np TP`, parallel.tensor=TP (so the data-parallel axis is 1),
parallel.sequence_parallel=SP, evaluation, generation, HF export and the final checkpoint off.
Every configuration trains the same global batch: --accum micro-batches of --micro-batch windows
of --seq-len tokens per step; TP 1 runs once (SP needs TP > 1). With SP each micro-batch's
micro-batch x seq-len token rows are split over the TP ranks, so that product must be divisible
by every TP. --repeats runs every configuration that many times, interleaved, so that machine
noise hits each of them alike.

Figures, from dstrain's metrics.jsonl (the first --warmup steps of a run untimed; medians over the
timed steps of all repeats); the TP ones come from the train records' "tensor_parallel" object
(rank 0's tensor group, absent at TP 1):
  tok/s        global tokens per second (tokens_per_s); vs TP1: over the TP 1 run's
  step ms      step_time_s
  TP comm ms   comm_s: seconds rank 0 spent in the tensor group's collectives in the step (they
               are blocking: none of it overlaps computation); share: comm_s / step_time_s
  meas MB      comm_bytes: the payload of rank 0's tensor-group collectives in the step, as
               dstrain counts it (all_reduce: the tensor's bytes; all_gather: the OUTPUT's;
               reduce_scatter: the INPUT's); MB = 1e6 B. Every rank of the group does the same.
  analytic MB  the same payload from the model's shape (below); meas/anl: their ratio
  wire MB      bytes each rank sends with ring algorithms for the analytic collectives:
               all_reduce 2(P-1)/P x bytes, all_gather (P-1)/P x output bytes, reduce_scatter
               (P-1)/P x input bytes
  textbook MB  the usual figure for Megatron TP (also the SP paper's, which keeps the same volume):
               per layer and micro-batch 4 all-reduces (2 forward, 2 backward) of B x T x C fp32
               elements, 2(P-1)/P of each on the wire; no embedding, head or loss terms
  colls        the number of collectives in the step (collectives)
  act MB       rank 0's activation store (activation_bytes; memory_bytes["activations"] at TP 1,
               where there is no tensor_parallel object); vs TP1: over the TP 1 run's

Analytic payload per step, dense model (dstrain's accounting): P = TP, C = hidden_size,
L = num_hidden_layers, h = num_attention_heads, k = num_key_value_heads, d = C / h, m = --accum
micro-batches of n = micro-batch x seq-len tokens; fp32 (4-byte) partial sums and activations.
  TP, SP off, per micro-batch:
    4L all_reduce of n C 4 B (forward: the attention and MLP outputs; backward: the input
       gradients of q|k|v and gate|up)
    the vocabulary-parallel embedding's forward all_reduce, n C 4 B
    the head's input-gradient all_reduce, n C 4 B
    the cross-entropy's all_gather of each row's (log-sum-exp, target logit): output P n 2 4 B
  TP, SP on, per micro-batch:
    10L collectives of n C 4 B (forward: 2 all_gathers of the norms' outputs, 2 reduce_scatters
       of the outputs; backward: the 2 all_gathers of the norms' outputs again, 2 all_gathers of
       the output gradients, 2 reduce_scatters of the input gradients)
    4 more of n C 4 B: the embedding's forward reduce_scatter, its backward's all_gather, the
       head's input all_gather and its input-gradient reduce_scatter
    the cross-entropy's all_gather, P n 8 B
  once per step (at the last micro-batch):
    SP on: an all_reduce of every replicated parameter's gradient (the norms: (2L + 1) C 4 B)
    when k < P (key/value heads replicated over ranks): an all_reduce of the whole k_proj and of
       the whole v_proj gradient per layer (k d C 4 B each; a rank's piece among zeros)
Small extras are not in the analytic figure (the gradient norm's 8-byte all_reduce per step), so
measured/analytic within about 1% is expected (on the quickstart model it is 1 to within 1e-5); a
line is printed, and the exit status is 1, for any configuration off by more than 2%, as for a run
that fails. The analytic figures are for a dense model (no MLA, no MoE); for other models they are
left out.

The activation store shrinks with TP (attention heads and the MLP's intermediate columns are
split) and further with SP (what is kept per token row outside the split GEMMs: the residual
stream, the norms' inputs, ...). It does not shrink by 1/P: some of it stays whole per rank.

With more ranks x threads than cores the runs are oversubscribed and the header says so. On a
2-core machine TP 2 with one thread per rank fills it and TP 4 runs 4 ranks on 2 cores: there
tokens/s measures the cost of splitting small GEMMs over ranks, the blocking collectives and the
scheduler, not the scaling a real node (a core or a GPU per rank) would show. The byte counts and
activation sizes do not depend on the machine.
"""

import argparse
import json
import os
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
FP32 = 4
TOLERANCE = 0.02
MB = 1e6
GRAD_NORM_BYTES = 8  # the gradient norm's all_reduce of one double per step: not in the analytic


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def load_avg():
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def label(tp, sp):
    return f"TP {tp}" + (" SP" if sp else "")


def tp_record(row):
    """The train record's tensor_parallel object (top level; under "extra" in some versions), or None."""
    x = row.get("tensor_parallel")
    if x is None:
        x = (row.get("extra") or {}).get("tensor_parallel")
    return x


def model_shape(path):
    with open(os.path.join(ROOT, path)) as f:
        c = json.load(f)
    C, heads = c["hidden_size"], c["num_attention_heads"]
    shape = {"C": C, "L": c["num_hidden_layers"], "heads": heads, "kv_heads": c.get("num_key_value_heads", heads),
             "head_dim": C // heads, "V": c["vocab_size"], "intermediate": c.get("intermediate_size")}
    # The analytic figures are for a dense model with multi-head / grouped-query attention.
    moe = any(c.get(k) for k in ("n_routed_experts", "num_experts", "num_local_experts"))
    mla = any(c.get(k) for k in ("kv_lora_rank", "q_lora_rank"))
    shape["dense"] = not (moe or mla)
    return shape


def analytic(shape, P, sp, n, m):
    """Payload bytes per step of the tensor group's collectives, by kind: dstrain's accounting
    (all_reduce: the tensor; all_gather: the output; reduce_scatter: the input)."""
    C, L = shape["C"], shape["L"]
    act = n * C * FP32  # one (n, C) fp32 tensor
    ce = P * n * 2 * FP32  # the cross-entropy's gathered (log-sum-exp, target logit) pairs
    kv = 2 * L * shape["kv_heads"] * shape["head_dim"] * C * FP32 if shape["kv_heads"] < P else 0
    if P == 1:
        return {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0}
    if not sp:
        return {"all_reduce": m * (4 * L + 2) * act + kv, "all_gather": m * ce, "reduce_scatter": 0}
    # Per layer 6 all_gathers (2 forward, 4 backward) and 4 reduce_scatters; embedding and head: 2 of each.
    norms = (2 * L + 1) * C * FP32
    return {"all_reduce": norms + kv, "all_gather": m * ((6 * L + 2) * act + ce),
            "reduce_scatter": m * (4 * L + 2) * act}


def wire(kinds, P):
    """Bytes a rank sends for these collectives with ring algorithms."""
    if P == 1:
        return 0
    f = (P - 1) / P
    return 2 * f * kinds["all_reduce"] + f * (kinds["all_gather"] + kinds["reduce_scatter"])


def textbook_wire(shape, P, n, m):
    """Megatron's figure: per layer and micro-batch 4 all-reduces of B x T x C fp32 elements."""
    if P == 1:
        return 0
    return m * shape["L"] * 4 * n * shape["C"] * FP32 * 2 * (P - 1) / P


def run_dstrain(a, tp, sp):
    """One run: its timed step records, or an error."""
    steps = a.warmup + a.steps
    with tempfile.TemporaryDirectory(prefix="bench_tp.") as out:
        sets = [f'model="{a.model}"', f"train.train_batch_size={a.micro_batch * a.accum}",
                f"train.train_micro_batch_size_per_gpu={a.micro_batch}", f"train.gradient_accumulation_steps={a.accum}",
                f"data.seq_len={a.seq_len}", f"parallel.tensor={tp}",
                f"parallel.sequence_parallel={'true' if sp else 'false'}", "train.eval_interval=0",
                "checkpoint.save_final=false", 'output.save_hf=""', f'output.dir="{out}"', 'generate.prompt=""',
                "generate.interval=0"]
        sets += a.set
        cmd = ["mpirun", "-np", str(tp), "--bind-to", "none", a.binary, "train", "--config", QUICKSTART,
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
            return {"error": f"timed out after {a.timeout} s", "cmd": cmd, "wall_s": time.time() - t0}
        path = os.path.join(out, "metrics.jsonl")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = [r for r in map(json.loads, f) if r.get("type") == "train"]
    res = {"cmd": cmd, "wall_s": time.time() - t0}
    if p.returncode != 0 or len(rows) < steps:
        lines = [l for l in log.splitlines() if "error" in l.lower()] or log.strip().splitlines()[-3:]
        res["error"] = f"exit status {p.returncode}, {len(rows)} of {steps} steps: " + " | ".join(lines[:3])
        return res
    if tp > 1 and any(tp_record(r) is None for r in rows):
        res["error"] = "the train records carry no tensor_parallel object: is parallel.tensor implemented?"
        return res
    if tp > 1 and any(tp_record(r).get("size") != tp or bool(tp_record(r).get("sequence_parallel")) != sp
                      for r in rows):
        x = tp_record(rows[-1])
        res["error"] = (f"asked for tensor {tp}, sequence_parallel {sp}; the records say size {x.get('size')}, "
                        f"sequence_parallel {x.get('sequence_parallel')}")
        return res
    res["rows"] = rows[a.warmup:]
    return res


def summarize(runs, tp, sp, shape, a):
    """The figures of one (TP, SP) configuration over its repeats."""
    good = [r for r in runs if "error" not in r]
    s = {"tensor": tp, "sequence_parallel": sp, "errors": [r["error"] for r in runs if "error" in r]}
    n = a.micro_batch * a.seq_len
    if shape["dense"]:
        kinds = analytic(shape, tp, sp, n, a.accum)
        s["analytic_bytes_by_kind"] = kinds
        s["analytic_bytes"] = sum(kinds.values())
        s["analytic_wire_bytes"] = wire(kinds, tp)
    s["textbook_wire_bytes"] = textbook_wire(shape, tp, n, a.accum)
    if not good:
        return s
    rows = [row for r in good for row in r["rows"]]
    tpx = [tp_record(row) or {} for row in rows]
    act = [x["activation_bytes"] if "activation_bytes" in x else row["memory_bytes"].get("activations")
           for x, row in zip(tpx, rows)]
    s.update({
        "tokens_per_s": med([row["tokens_per_s"] for row in rows]),
        "step_time_s": med([row["step_time_s"] for row in rows]),
        "timed_steps": len(rows),
        "activation_bytes": med(act),
        "memory_activations_bytes": med([row["memory_bytes"].get("activations") for row in rows]),
        "peak_rss_bytes": max(r["rows"][-1]["peak_rss_bytes"] for r in good),
        "step_tokens_per_s": [row["tokens_per_s"] for row in rows],
    })
    if tp > 1:
        comm_bytes = [x["comm_bytes"] for x in tpx]
        s.update({
            "comm_s": med([x["comm_s"] for x in tpx]),
            "comm_share": med([x["comm_s"] / row["step_time_s"] for x, row in zip(tpx, rows) if row["step_time_s"] > 0]),
            "comm_bytes": med(comm_bytes),
            "comm_bytes_range": [min(comm_bytes), max(comm_bytes)],
            "collectives": med([x.get("collectives") for x in tpx]),
            "grad_sync_s": med([x.get("grad_sync_s") for x in tpx]),
        })
    else:
        s.update({"comm_s": 0.0, "comm_share": 0.0, "comm_bytes": 0, "comm_bytes_range": [0, 0], "collectives": 0})
    if "analytic_bytes" in s:
        want = s["analytic_bytes"]
        s["bytes_minus_analytic"] = s["comm_bytes"] - want
        s["ratio"] = s["comm_bytes"] / want if want else None
        lo, hi = s["comm_bytes_range"]
        s["bytes_off"] = (abs(hi - want) > TOLERANCE * want or abs(lo - want) > TOLERANCE * want) if want else hi > 0
    return s


def main():
    with open(os.path.join(ROOT, QUICKSTART)) as f:
        default_model = json.load(f)["model"]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tensor", default="1,2,4", help="TP sizes (ranks = TP, data-parallel 1)")
    ap.add_argument("--sp", default="off,on", help="sequence parallelism: off, on or off,on (TP 1 runs once, off)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each run")
    ap.add_argument("--repeats", type=int, default=1, help="runs per configuration, interleaved")
    ap.add_argument("--model", default=default_model, help="model config (default: the quickstart's)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per step (the global batch is "
                    "micro-batch x accum windows at every TP)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS per rank")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="one more dstrain --set override for every run; repeatable")
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "app", "dstrain"))
    ap.add_argument("--timeout", type=int, default=900, help="seconds per run")
    ap.add_argument("--json", help="write every figure here")
    a = ap.parse_args()
    tensors = [int(x) for x in a.tensor.split(",") if x]
    sps = [x.strip().lower() for x in a.sp.split(",") if x.strip()]
    if any(x not in ("off", "on") for x in sps) or not sps:
        sys.exit("bench_tp: --sp is off, on or off,on")
    if any(t < 1 for t in tensors):
        sys.exit("bench_tp: TP sizes are positive")
    if "on" in sps:
        for t in tensors:
            if t > 1 and (a.micro_batch * a.seq_len) % t:
                sys.exit(f"bench_tp: sequence parallelism splits micro-batch {a.micro_batch} x seq-len {a.seq_len} "
                         f"token rows over {t} ranks, which does not divide them")
    if not os.path.exists(a.binary):
        sys.exit(f"bench_tp: no dstrain at {a.binary}: build it first")
    a.binary = os.path.abspath(a.binary)
    a.model = os.path.relpath(os.path.abspath(a.model), ROOT) if os.path.exists(a.model) else a.model
    shape = model_shape(a.model)
    build_dir = os.path.dirname(os.path.dirname(a.binary))
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), build_dir], check=True, stdout=subprocess.DEVNULL)

    configs = []
    for t in tensors:
        for sp in (["off"] if t == 1 else sps):
            if (t, sp == "on") not in configs:
                configs.append((t, sp == "on"))
    cores = os.cpu_count() or 1
    load0 = load_avg()
    runs = {c: [] for c in configs}
    for rep in range(a.repeats):  # interleaved, so machine noise hits every configuration
        for t, sp in configs:
            r = run_dstrain(a, t, sp)
            runs[(t, sp)].append(r)
            status = r.get("error") or f"{med([x['tokens_per_s'] for x in r['rows']]):.0f} tok/s"
            print(f"  [{rep + 1}/{a.repeats}] {label(t, sp)}, {t} rank(s): {status} ({r['wall_s']:.0f} s)",
                  file=sys.stderr, flush=True)
    load1 = load_avg()
    summ = {c: summarize(runs[c], c[0], c[1], shape, a) for c in configs}
    base = summ.get((1, False))
    base_tok = base.get("tokens_per_s") if base else None
    base_act = base.get("activation_bytes") if base else None

    over = [t for t in tensors if t * a.threads > cores]
    n = a.micro_batch * a.seq_len
    print(f"\nTensor and sequence parallelism on {a.model} (C {shape['C']}, L {shape['L']}, {shape['heads']} heads, "
          f"{shape['kv_heads']} key/value heads, head_dim {shape['head_dim']}, V {shape['V']}; fp32, AdamW)")
    print(f"global batch {a.micro_batch * a.accum} x {a.seq_len} tokens at every TP ({a.accum} micro-batch(es) of "
          f"{a.micro_batch} x {a.seq_len} = {n} tokens), ranks = TP, data-parallel 1, {a.threads} thread(s) per rank; "
          f"medians of {a.repeats} x {a.steps} timed steps after {a.warmup} warm-up step(s)" +
          (f"; --set {' '.join(a.set)}" if a.set else ""))
    if over:
        print(f"note: {cores} cores: TP {', '.join(map(str, over))} x {a.threads} thread(s) per rank OVERSUBSCRIBE the "
              f"machine; tokens/s there measures the cost of splitting small GEMMs, the blocking collectives and the "
              f"scheduler, not the scaling a real node would show")
    full = [t for t in tensors if t > 1 and t * a.threads == cores]
    if full:
        print(f"note: {cores} cores: TP {', '.join(map(str, full))} x {a.threads} thread(s) per rank fills the machine "
              f"(nothing left for MPI's progress or the OS); tokens/s there is not a scaling figure either")
    if load0 is not None and max(load0, load1 or 0) > 0.5 * cores:
        print(f"note: load average {load0:.1f} before and {load1:.1f} after the runs on {cores} cores: other work "
              f"was running, timings are noisy")
    print("comm = rank 0's tensor-group collectives per step (blocking); meas/analytic MB = their payload per step "
          "per rank (all_reduce: tensor, all_gather: output,\nreduce_scatter: input bytes; MB = 1e6 B); wire = bytes "
          "sent per rank with ring algorithms; textbook = 4 all-reduces of B x T x C fp32 per layer, 2(P-1)/P on the "
          "wire;\nact = rank 0's activation store\n")
    head = (f"{'TP':>3} {'SP':>3} {'tok/s':>7} {'vs TP1':>6} {'step ms':>8} {'TP comm ms':>10} {'share':>6} "
            f"{'colls':>5} {'meas MB':>9} {'analytic MB':>11} {'meas/anl':>8} {'wire MB':>8} {'textbook MB':>11} "
            f"{'act MB':>7} {'vs TP1':>6}")
    print(head)
    print("-" * len(head))
    failed = False
    for t, sp in configs:
        x = summ[(t, sp)]
        if "tokens_per_s" not in x:
            failed = True
            print(f"{t:>3} {'on' if sp else 'off':>3}  FAILED: {x['errors'][0]}")
            continue
        vs_tok = x["tokens_per_s"] / base_tok if base_tok else None
        vs_act = x["activation_bytes"] / base_act if base_act and x["activation_bytes"] is not None else None
        anl = x.get("analytic_bytes")
        print(f"{t:>3} {'on' if sp else 'off':>3} {x['tokens_per_s']:>7.0f} {fmt(vs_tok, '.2f'):>6} "
              f"{1e3 * x['step_time_s']:>8.1f} {1e3 * x['comm_s']:>10.1f} {100 * x['comm_share']:>5.1f}% "
              f"{fmt(x['collectives']):>5} {x['comm_bytes'] / MB:>9.3f} "
              f"{fmt(anl / MB if anl is not None else None, '.3f'):>11} {fmt(x.get('ratio'), '.4f'):>8} "
              f"{fmt(x['analytic_wire_bytes'] / MB if 'analytic_wire_bytes' in x else None, '.3f'):>8} "
              f"{x['textbook_wire_bytes'] / MB:>11.3f} "
              f"{fmt(x['activation_bytes'] / MB if x['activation_bytes'] is not None else None, '.2f'):>7} "
              f"{fmt(vs_act, '.2f'):>6}")
        if x["errors"]:
            failed = True
            print(f"        {len(x['errors'])} of {a.repeats} repeats failed: {x['errors'][0]}")

    print()
    if not shape["dense"]:
        print(f"{a.model} is not a dense model (MLA or MoE): no analytic communication figures")
    else:
        off, checked = [], 0
        for t, sp in configs:
            x = summ[(t, sp)]
            if "ratio" not in x and "bytes_off" not in x:
                continue
            checked += 1
            if x.get("bytes_off"):
                lo, hi = x["comm_bytes_range"]
                off.append(f"{label(t, sp)}: measured {x['comm_bytes']:.0f} B per step (steps {lo:.0f}-{hi:.0f}), "
                           f"analytic {x['analytic_bytes']:.0f} B ({fmt(x.get('ratio'), '.4f')}x, "
                           f"{x['bytes_minus_analytic']:+.0f} B)")
        if off:
            failed = True
            print("measured communication off the analytic payload by more than 2%:")
            for line in off:
                print(f"  {line}")
        elif checked:
            print("measured communication payload matches the analytic one within 2% in every configuration "
                  "(within about 1% expected)")
        else:
            print("no run measured: communication not checked")
        for t, sp in configs:
            x = summ[(t, sp)]
            if t > 1 and "bytes_minus_analytic" in x:
                d = x["bytes_minus_analytic"]
                extra = " (the gradient norm's all_reduce)" if d == GRAD_NORM_BYTES else ""
                kinds = ", ".join(f"{k} {v / MB:.3f} MB" for k, v in x["analytic_bytes_by_kind"].items() if v)
                print(f"  {label(t, sp)}: measured - analytic = {d:+.0f} B{extra}; analytic {kinds}")

    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "cores": cores, "load_avg": [load0, load1], "model_shape": shape,
                       "configs": [summ[c] for c in configs],
                       "runs": {f"{t}/{int(sp)}": [{k: v for k, v in r.items() if k != "rows"} for r in rs]
                                for (t, sp), rs in runs.items()}}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
