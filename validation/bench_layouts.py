#!/usr/bin/env python3
"""Composed layouts on this machine: every rank's model-state memory (weights, gradients, optimizer
state and gathered weights held at the end of a step) measured beside the analytic figure for
its local parameters and its ZeRO groups, and tokens/s, for

  - DeepSeek-V3-tiny at pipeline 2 (DualPipeV) x expert 2 x ZeRO-1 over data 2 (4 ranks: the
    V3 recipe in miniature), against the same layout at stage 0;
  - the dense quickstart model at tensor 2 x ZeRO-3 over data 2 (4 ranks), against stage 0.

    validation/bench_layouts.py [--steps 4] [--binary build/app/dstrain] [--json OUT]

Every run trains inputs/quickstart.json's data (the fortunes corpus; .ci/prepare-fortunes makes
it) in fp32 with the model and layout of the case, under `mpirun -np 4`, with evaluation,
generation, export and checkpoints off, stage3_param_persistence_threshold 0 (every trainable
parameter sharded) and one thread per rank.

Figures, per world rank, from the last step record's "ranks" block of metrics.jsonl:
  measured     model_state_bytes
  analytic     from the rank's local parameters (after the tensor, pipeline and expert splits:
               L = dense + expert elements) and its ZeRO groups (dense over the data axis, N_d
               ranks; routed experts over the ranks holding the same experts, N_e = data /
               expert), fp32:
                 stage 0: 16 L
                 stage 1: (4 + 4) L + 12 (dense / N_d + expert / N_e)
                 stage 2: 4 L + 16 (dense / N_d + expert / N_e)
                 stage 3: 16 (dense / N_d + expert / N_e)
               (the whole weights and gradients where a stage keeps them; the masters and the two
               AdamW moments, K = 12, sharded from stage 1, the gradients from 2, the weights at 3).
               The routing biases, updated by a rule on every rank, stay whole at stage 3 (a few
               hundred bytes).
  meas/analytic  above 1 by the shard's 64-byte alignment of each piece and the persistent
               routing biases.
Exit status 1 when a rank's measured figure is more than 3% off its analytic one or a run fails.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader",
               OMPI_MCA_mpi_yield_when_idle="1", OMP_NUM_THREADS="1")

CASES = [
    ("V3-tiny pipeline 2 (DualPipeV) x expert 2 x data 2", "inputs/models/deepseek-v3-tiny.json",
     {"pipeline": 2, "expert": 2, "tensor": 1}, ['parallel.schedule="dualpipev"'], [0, 1]),
    ("dense tiny tensor 2 x data 2", "inputs/models/deepseek-llm-tiny.json",
     {"pipeline": 1, "expert": 1, "tensor": 2}, ["parallel.sequence_parallel=true"], [0, 3]),
]


def analytic(stage, dense, expert, n_dense, n_expert):
    local = dense + expert
    sharded = dense / n_dense + expert / n_expert
    return {0: 16 * local, 1: 8 * local + 12 * sharded, 2: 4 * local + 16 * sharded, 3: 16 * sharded}[stage]


def run(binary, model, axes, sets, stage, steps, out):
    cmd = ["mpirun", "-np", "4", "--bind-to", "none", binary, "train", "--config",
           os.path.join(ROOT, "inputs", "quickstart.json"), "--max-steps", str(steps), "--set",
           f'model="{os.path.join(ROOT, model)}"', f'output.dir="{out}"', "output.save_hf=\"\"",
           f"parallel.pipeline={axes['pipeline']}", f"parallel.expert={axes['expert']}",
           f"parallel.tensor={axes['tensor']}", *sets, f"train.zero_optimization.stage={stage}",
           "train.zero_optimization.stage3_param_persistence_threshold=0",
           "train.train_micro_batch_size_per_gpu=2", "train.gradient_accumulation_steps=4",
           "data.seq_len=128", "train.eval_interval=0", "train.steps_per_print=1", "generate.prompt=\"\"",
           "generate.interval=0", "checkpoint.save_final=false", "checkpoint.interval_steps=0",
           "checkpoint.interval_minutes=0"]
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **MPI_ENV), capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    steps_recs = []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "ranks" in rec and "tokens_per_s" in rec:
                steps_recs.append(rec)
    return steps_recs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "app", "dstrain"))
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if not os.path.exists(os.path.join(ROOT, "data", "fortunes", "fortunes_text_document.idx")):
        sys.exit("bench_layouts: no fortunes corpus: run .ci/prepare-fortunes build first")
    failures, results = [], []
    print(f"{'case':<52} {'ZeRO':>4} {'rank':>4} {'dense':>9} {'expert':>9} {'measured MB':>12} "
          f"{'analytic MB':>12} {'meas/an':>8} {'tok/s':>8}")
    for name, model, axes, sets, stages in CASES:
        for stage in stages:
            with tempfile.TemporaryDirectory(prefix="bench_layouts.") as out:
                recs = run(a.binary, model, axes, sets, stage, a.steps, out)
            last = recs[-1]["ranks"]
            tps = statistics.median(r["tokens_per_s"] for r in recs[1:]) if len(recs) > 1 else recs[-1]["tokens_per_s"]
            data = 4 // (axes["tensor"] * axes["pipeline"])
            n_dense, n_expert = data, data // axes["expert"]
            for rank, (meas, dense, expert) in enumerate(zip(last["model_state_bytes"], last["local_dense_params"],
                                                             last["local_expert_params"])):
                an = analytic(stage, dense, expert, n_dense, n_expert)
                ratio = meas / an
                print(f"{name:<52} {stage:>4} {rank:>4} {dense:>9} {expert:>9} {meas / 1e6:>12.2f} {an / 1e6:>12.2f} "
                      f"{ratio:>8.3f} {f'{tps:.0f}' if rank == 0 else '':>8}")
                results.append(dict(case=name, stage=stage, rank=rank, dense=dense, expert=expert, measured=meas,
                                    analytic=an, tokens_per_s=tps))
                if abs(ratio - 1) > 0.03:
                    failures.append(f"{name} ZeRO-{stage} rank {rank}: measured {meas:.0f} B, analytic {an:.0f} B")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if failures:
        print("\nmodel state off its analytic figure by more than 3%:\n  " + "\n  ".join(failures))
        sys.exit(1)
    print("\nevery rank's model state is within 3% of its analytic figure")


if __name__ == "__main__":
    main()
