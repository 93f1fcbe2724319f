#!/usr/bin/env python3
"""Asynchronous gradient aggregation, measured: convergence at equal tokens, bytes between
replicas, and step time over a link slowed on purpose.

    validation/bench_gradient_sync.py [--steps 768] [--replicas 2,4] [--timing-steps 40]
        [--latency-ms 2] [--gbit 0.1] [--out validation/figures/gradient_sync]
    validation/bench_gradient_sync.py --timing-only [--repeats 3]   (timings again, machine quiet)
    validation/bench_gradient_sync.py --steps 3072 --modes "sync;DiLoCo H=32" --out validation/figures/gradient_sync_3072

The fortunes corpus (.ci/prepare-fortunes, byte tokens), a 0.8M-parameter DeepSeek-LLM-style
model (hidden 128, 2 layers), global batch 16 x 128 tokens at every replica count, AdamW lr
2e-3 with 5% warm-up and cosine decay. Each replica is one rank (gradient_sync.over "data").
Modes: sync, delayed, local SGD (H 8, 32), DiLoCo (H 8, 32, 128; outer Nesterov lr 0.7,
momentum 0.5; at H = 32 also in bf16, with Douillard et al.'s published momentum 0.9, and with the
larger outer step (lr 1.0, momentum 0.7) that 4 replicas take better). --steps is a multiple of 128, so every run ends on
an outer step, where the replicas agree, and the final validation loss (64 micro-batches of the
validation split) is the model's.

Convergence runs are not slowed. Timing runs repeat each mode for --timing-steps steps (at least
two outer rounds after 8 warm-up steps) with and without train.gradient_sync.test_slow_link
(latency + ring traffic over --gbit Gbit/s on the link between replicas; the data axis under
sync), and give the mean step after the first 8: the outer steps' share included.

Bytes between replicas are the payload of every collective on that link per step (the mean
over the run): under sync the data axis's gradient all-reduce, otherwise the aggregation's
collectives plus the step's scalars. Prints a markdown table; writes OUT.json and OUT.png
(validation loss curves, matplotlib where installed).
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
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"}
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 352,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "initializer_range": 0.02, "bos_token_id": 256, "eos_token_id": 257, "hidden_act": "silu"}
# The outer Nesterov step: momentum 0.5 at lr 0.7, the best of a 384-step sweep at H = 32 over
# (lr, momentum) in {(0.7, 0.9), (0.4, 0.9), (0.7, 0.5), (1.0, 0.5)}; DiLoCo's published (0.7,
# 0.9), tuned for H = 500, is run at H = 32 beside it.
NESTEROV = {"type": "nesterov", "lr": 0.7, "momentum": 0.5}
PUBLISHED = {"type": "nesterov", "lr": 0.7, "momentum": 0.9}
# At 4 replicas the averaged deltas cancel more: a larger outer step does better there (3072
# steps at H = 32: (1.0, 0.7) +2.12% over sync, (1.0, 0.5) +2.41%, (0.7, 0.5) +3.52%, (1.2, 0.7) +3.89%).
FOUR_REPLICAS = {"type": "nesterov", "lr": 1.0, "momentum": 0.7}
MODES = [("sync", {"mode": "sync"}),
         ("delayed", {"mode": "delayed"}),
         ("local SGD H=8", {"mode": "local_sgd", "every": 8}),
         ("local SGD H=32", {"mode": "local_sgd", "every": 32}),
         ("DiLoCo H=8", {"mode": "diloco", "every": 8, "outer_optimizer": NESTEROV}),
         ("DiLoCo H=32", {"mode": "diloco", "every": 32, "outer_optimizer": NESTEROV}),
         ("DiLoCo H=32, bf16", {"mode": "diloco", "every": 32, "outer_optimizer": NESTEROV, "outer_dtype": "bf16"}),
         ("DiLoCo H=32, published outer (0.7, 0.9)", {"mode": "diloco", "every": 32, "outer_optimizer": PUBLISHED}),
         ("DiLoCo H=128", {"mode": "diloco", "every": 128, "outer_optimizer": NESTEROV}),
         ("DiLoCo H=32, outer (1.0, 0.7)", {"mode": "diloco", "every": 32, "outer_optimizer": FOUR_REPLICAS})]


def run(work, replicas, steps, gs, eval_every, slow=None):
    os.makedirs(work, exist_ok=True)
    model = os.path.join(work, "model.json")
    with open(model, "w") as f:
        json.dump(MODEL, f)
    gs = dict(gs)
    if slow:
        gs["test_slow_link"] = slow
    sets = [f'model="{model}"', "train.train_batch_size=16", f"train.train_micro_batch_size_per_gpu={16 // replicas}",
            "train.gradient_accumulation_steps=1", "data.seq_len=128", f"train.max_steps={steps}",
            "train.optimizer.params.lr=0.002",
            f"train.scheduler.params.total_num_steps={steps}",
            f"train.scheduler.params.warmup_num_steps={max(1, steps // 20)}",
            f"train.eval_interval={eval_every}", "train.eval_batches=64", "train.steps_per_print=1000000",
            f"train.gradient_sync={json.dumps(gs)}", 'output.save_hf=""', f'output.dir="{work}/out"',
            'generate.prompt=""', "generate.interval=0", "checkpoint.save_final=false",
            "checkpoint.interval_steps=0", "checkpoint.interval_minutes=0"]
    cmd = ["mpirun", "-np", str(replicas), "--bind-to", "none", os.path.join(ROOT, "build", "app", "dstrain"), "train",
           "--config", "inputs/quickstart.json", "--set", *sets]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **MPI_ENV), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"dstrain failed ({' '.join(cmd)}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    records = [json.loads(line) for line in open(os.path.join(work, "out", "metrics.jsonl"))]
    return [r for r in records if r.get("type") == "train"], [r for r in records if r.get("type") == "eval"]


def link_bytes(step, mode):
    if mode == "sync":
        return step.get("data_parallel", {}).get("comm_bytes", 0.0)
    return step.get("gradient_sync", {}).get("outer_bytes", 0.0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=768)
    ap.add_argument("--replicas", default="2,4")
    ap.add_argument("--timing-steps", type=int, default=40)
    ap.add_argument("--latency-ms", type=float, default=2.0)
    ap.add_argument("--gbit", type=float, default=0.1)
    ap.add_argument("--out", default=os.path.join(ROOT, "validation", "figures", "gradient_sync"))
    ap.add_argument("--timing-only", action="store_true",
                    help="only the slowed-link timing runs, --repeats times alternating, into OUT.json's rows")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report-only", action="store_true", help="the table and plot from OUT.json, nothing run")
    ap.add_argument("--modes", default="",
                    help="only these modes, by their names separated by ';' (e.g. \"sync;DiLoCo H=32\"); sync "
                         "must be among them")
    a = ap.parse_args()
    modes = MODES
    if a.modes:
        wanted = [m.strip() for m in a.modes.split(";")]
        unknown = [m for m in wanted if m not in dict(MODES)]
        assert not unknown and "sync" in wanted, f"--modes: unknown {unknown} or no sync; the modes: {[m for m, _ in MODES]}"
        modes = [(m, gs) for m, gs in MODES if m in wanted]
    assert a.steps % 128 == 0, "--steps must be a multiple of 128 (DiLoCo H=128 ends on an outer step)"
    slow = {"latency_ms": a.latency_ms, "gbit_per_s": a.gbit}
    results = []
    if a.report_only:
        with open(a.out + ".json") as f:
            saved = json.load(f)
        results, a.steps, slow = saved["rows"], saved["steps"], saved["slow_link"]
        a.latency_ms, a.gbit = slow["latency_ms"], slow["gbit_per_s"]
    else:
        subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), os.path.join(ROOT, "build")], check=True,
                       stdout=subprocess.DEVNULL)
    if a.timing_only:
        # The machine quiet: every mode's timing run --repeats times, alternating; the median
        # step of each run after 8, and the median over the runs (with their spread).
        with open(a.out + ".json") as f:
            saved = json.load(f)
        results = saved["rows"]
        with tempfile.TemporaryDirectory() as tmp:
            for row in results:
                row["step_s_slow_link_runs"] = []
                row["step_s_unslowed_runs"] = []
            for k in range(a.repeats):
                for i, row in enumerate(results):
                    # Two outer rounds after 8 warm-up steps at least: the mean step carries the
                    # outer step's share.
                    steps = max(a.timing_steps, 8 + 2 * int(row["config"].get("every", 1)))
                    for key, link in (("step_s_slow_link_runs", slow), ("step_s_unslowed_runs", None)):
                        timed, _ = run(os.path.join(tmp, f"t{k}_{i}_{key}"), row["replicas"], steps,
                                       row["config"], eval_every=0, slow=link)
                        row[key].append(statistics.mean(s["step_time_s"] for s in timed[8:]))
            for row in results:
                row["step_s_slow_link"] = statistics.median(row["step_s_slow_link_runs"])
                row["step_s_unslowed"] = statistics.median(row["step_s_unslowed_runs"])
        saved["slow_link"] = slow
        saved["timing_repeats"] = a.repeats
        with open(a.out + ".json", "w") as f:
            json.dump(saved, f, indent=1)
        a.steps = saved["steps"]
    with tempfile.TemporaryDirectory() as tmp:
        for replicas in [] if a.timing_only or a.report_only else [int(x) for x in a.replicas.split(",")]:
            for name, gs in modes:
                steps, evals = run(os.path.join(tmp, f"{replicas}_{len(results)}"), replicas, a.steps, gs,
                                   eval_every=128)
                timed, _ = run(os.path.join(tmp, f"{replicas}_{len(results)}_t"), replicas, a.timing_steps, gs,
                               eval_every=0, slow=slow)
                row = {"replicas": replicas, "mode": name, "config": gs,
                       "final_val_loss": evals[-1]["loss"], "val_curve": [[e["step"], e["loss"]] for e in evals],
                       "final_train_loss": statistics.mean(s["loss"] for s in steps[-32:]),
                       "bytes_per_step": statistics.mean(link_bytes(s, gs["mode"]) for s in steps),
                       "step_s_unslowed": statistics.median(s["step_time_s"] for s in steps[8:]),
                       "step_s_slow_link": statistics.median(s["step_time_s"] for s in timed[8:])}
                results.append(row)
                print(f"{replicas} replicas, {name}: val {row['final_val_loss']:.4f}, "
                      f"{row['bytes_per_step'] / 1e3:.1f} kB/step, {row['step_s_slow_link'] * 1e3:.0f} ms/step slowed",
                      file=sys.stderr)
    if not a.timing_only and not a.report_only:
        with open(a.out + ".json", "w") as f:
            json.dump({"steps": a.steps, "slow_link": slow, "rows": results}, f, indent=1)
    print(f"{a.steps} steps of 16 x 128 tokens ({a.steps * 16 * 128 / 1e6:.2f}M tokens); slowed link: "
          f"{a.latency_ms} ms + ring traffic at {a.gbit} Gbit/s\n")
    print("| replicas | mode | final val loss | vs sync | bytes between replicas per step | vs sync | "
          "step, slowed link (ms) | vs sync | step, unslowed (ms) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        base = next(b for b in results if b["replicas"] == r["replicas"] and b["mode"] == "sync")
        ratio = base["bytes_per_step"] / r["bytes_per_step"] if r["bytes_per_step"] else float("inf")
        spread = ""
        if r.get("step_s_slow_link_runs"):
            spread = f" ({min(r['step_s_slow_link_runs']) * 1e3:.0f}-{max(r['step_s_slow_link_runs']) * 1e3:.0f})"
        print(f"| {r['replicas']} | {r['mode']} | {r['final_val_loss']:.4f} | "
              f"{(r['final_val_loss'] / base['final_val_loss'] - 1) * 100:+.2f}% | {r['bytes_per_step'] / 1e3:,.1f} kB | "
              f"{ratio:.1f}x fewer | {r['step_s_slow_link'] * 1e3:.0f}{spread} | "
              f"{r['step_s_slow_link'] / base['step_s_slow_link']:.2f}x | {r['step_s_unslowed'] * 1e3:.0f} |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no plot)", file=sys.stderr)
        return 0
    reps = sorted({r["replicas"] for r in results})
    fig, axes = plt.subplots(1, len(reps), figsize=(6 * len(reps), 4), squeeze=False)
    for ax, n in zip(axes[0], reps):
        for r in results:
            if r["replicas"] != n:
                continue
            xs, ys = zip(*r["val_curve"])
            ax.plot(xs, ys, marker="o", label=r["mode"])
        ax.set_title(f"{n} replicas: validation loss")
        ax.set_xlabel("step (16 x 128 tokens)")
        ax.set_ylabel("loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out + ".png", dpi=90)
    return 0


if __name__ == "__main__":
    sys.exit(main())
