#!/usr/bin/env python3
"""Pipeline schedules on a real run: each schedule trains the quickstart model, made 8 layers deep,
over P pipeline ranks with m micro-batches per step and records a timeline of steps 3-5
(metrics.timeline_steps); validation/plot_pipeline.py measures each step's bubble (the median is
printed next to the schedule's own figure: 1F1B (P-1)/(m+P-1), interleaved (P-1)/(Vm+P-1),
DualPipeV the schedule simulated with the papers' chunk costs) and draws step 4.

    /usr/bin/python3 validation/bench_pp.py [--build build] [--pipeline 4] [--micro-batches 8]
                                            [--schedules 1f1b,interleaved,dualpipev] [--out DIR]
                                            [--figures DIR]

Writes DIR/<schedule>/ (the run, its timelines, timeline.png and timeline.trace.json) and, with
--figures, a copy of each Gantt chart as FIGURES/pipeline_<schedule>.png (the README's pictures).
Every rank is one process on this machine's cores (waiting ranks yield the core:
OMPI_MCA_mpi_yield_when_idle). With at most one rank per core the measured bubble is the
schedule's plus communication and stage imbalance; with more ranks than cores they share them, a
chunk's bar then includes time its rank was descheduled and idle time includes other ranks'
compute, so the picture shows the schedule's order and overlap but its bubble is not the
dedicated-core figure.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--pipeline", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--schedules", default="1f1b,interleaved,dualpipev")
    p.add_argument("--out", default=None, help="where the runs go (default: a temporary directory)")
    p.add_argument("--figures", default=None, help="copy each Gantt chart here as pipeline_<schedule>.png")
    a = p.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="dstrain_bench_pp_")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(ROOT, "inputs", "models", "deepseek-llm-tiny.json")) as f:
        model = json.load(f)
    model["num_hidden_layers"] = 8  # interleaved (V = 2) and DualPipeV need 2P stages
    model_path = os.path.join(out, "model.json")
    with open(model_path, "w") as f:
        json.dump(model, f, indent=2)
    P, m = a.pipeline, a.micro_batches
    print(f"pipeline {P} ranks, {m} micro-batches of {a.micro_batch} x {a.seq_len} tokens; the quickstart model "
          f"with {model['num_hidden_layers']} layers; one process per rank on {os.cpu_count()} cores")
    print("medians of steps 3-5 (after 2 warm-up steps); expected: the schedule's analytic or simulated bubble")
    print(f"{'schedule':<12} {'step ms':>9} {'bubble':>8} {'expected':>9}  figure (step 4)")
    rows = []
    for schedule in a.schedules.split(","):
        run = os.path.join(out, schedule)
        shutil.rmtree(run, ignore_errors=True)
        sets = [f'model="{model_path}"', f'output.dir="{run}"', 'output.save_hf=""',
                f"train.train_micro_batch_size_per_gpu={a.micro_batch}", f"train.gradient_accumulation_steps={m}",
                f"data.seq_len={a.seq_len}", "train.eval_interval=0", "generate.interval=0",
                f"parallel.pipeline={P}", f'parallel.schedule="{schedule}"', "metrics.timeline_steps=[3,4,5]",
                "metrics.progress=lines"]
        if schedule == "interleaved":
            sets.append("parallel.virtual_stages=2")
        cmd = ["mpirun", "-np", str(P), os.path.join(a.build, "app", "dstrain"), "train", "--config",
               os.path.join(ROOT, "inputs", "quickstart.json"), "--max-steps", "5", "--set", *sets]
        r = subprocess.run(cmd, capture_output=True, text=True, errors="replace", cwd=ROOT,
                           env=dict(os.environ, **MPI_ENV), timeout=1200)
        if r.returncode != 0:
            print(f"{schedule}: the run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
            return 1
        # The figures of steps 3-5 (after two warm-up steps); the picture of step 4.
        plot = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "plot_pipeline.py"), run],
                              capture_output=True, text=True, timeout=300)
        picture = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "plot_pipeline.py"), run,
                                  "--step", "4"], capture_output=True, text=True, timeout=300)
        if plot.returncode != 0 or picture.returncode != 0:
            print(f"{schedule}: plot_pipeline.py failed:\n{plot.stdout}\n{plot.stderr}\n{picture.stderr}")
            return 1
        found = re.findall(r"^ +(\d+) +([0-9.]+) +([0-9.]+) +([0-9.]+|n/a)$", plot.stdout, re.M)
        if len(found) != 3:
            print(f"{schedule}: expected the rows of steps 3-5 in\n{plot.stdout}")
            return 1
        spans = sorted(float(r[1]) for r in found)
        bubbles = sorted(float(r[2]) for r in found)
        span, bubble, expected = spans[1], bubbles[1], found[0][3]  # medians of the 3 steps
        figure = os.path.join(run, "timeline.png")
        if a.figures:
            os.makedirs(a.figures, exist_ok=True)
            figure = os.path.join(a.figures, f"pipeline_{schedule}.png")
            shutil.copyfile(os.path.join(run, "timeline.png"), figure)
        rows.append((schedule, span, bubble, expected))
        print(f"{schedule:<12} {span:>9.1f} {bubble:>8.3f} {expected:>9}  {os.path.relpath(figure, ROOT)}")
    print(f"runs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
