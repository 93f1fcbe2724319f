#!/usr/bin/env python3
"""Checkpoint I/O against the disk it lands on: write and read throughput of dstrain's
parallel HDF5 checkpoints beside the raw sequential write and read bandwidth of the same
directory for the same byte count, and the stall an asynchronous save puts on a training
step beside a synchronous one.

    validation/bench_ckpt.py [--model inputs/models/deepseek-llm-cpu-d1024.json] [--repeats 3] [--dir DIR]

Writes include an fsync, as dstrain's do. Reads follow writes, so both the checkpoint and the
raw file are read from the page cache when the machine has the memory for it. The comparison
is like for like, but it measures the read path rather than the disk.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def raw_bandwidth(directory, nbytes):
    path = os.path.join(directory, "raw.bin")
    block = os.urandom(1 << 22)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        left = nbytes
        while left > 0:
            left -= f.write(block[:min(left, len(block))])
        f.flush()
        os.fsync(f.fileno())
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass
    r = time.perf_counter() - t0
    os.remove(path)
    return nbytes / w / 1e6, nbytes / r / 1e6


def train(directory, model, async_save, steps, interval, resume=False):
    out = os.path.join(directory, "run")
    cmd = [os.path.join(ROOT, "build", "app", "dstrain"), "train", "--config", "inputs/quickstart.json",
           "--max-steps", str(steps), "--set", f'model="{model}"', f'output.dir="{out}"', 'output.save_hf=""',
           "train.eval_interval=0", 'generate.prompt=""', "generate.interval=0", "train.steps_per_print=1",
           f"checkpoint.interval_steps={interval}", f"checkpoint.async={'true' if async_save else 'false'}",
           "checkpoint.keep_last=1", "checkpoint.save_final=false"]
    if resume:
        cmd += ["--resume", "auto"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
    metrics = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return p.stdout, metrics


def main():
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), os.path.join(ROOT, "build")], check=True,
                   stdout=subprocess.DEVNULL)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="inputs/models/deepseek-llm-cpu-d1024.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory in /tmp)")
    a = ap.parse_args()
    writes, reads, raw_w, raw_r, stalls = [], [], [], [], {True: [], False: []}
    steps_s = []
    nbytes = None
    for _ in range(a.repeats):
        for async_save in (False, True):
            with tempfile.TemporaryDirectory(dir=a.dir) as d:
                log, metrics = train(d, a.model, async_save, steps=8, interval=3)
                written = [(float(s), float(mb)) for s, mb in
                           re.findall(r"checkpoint \S+ written in ([0-9.]+) s \(([0-9.]+) MB", log)]
                nbytes = written[0][1] * 1e6
                if not async_save:
                    writes += [mb / s for s, mb in written]
                    log2, _ = train(d, a.model, async_save, steps=7, interval=100, resume=True)
                    m = re.search(r"read and verified ([0-9.]+) MB in ([0-9.]+) s", log2)
                    reads.append(float(m.group(1)) / float(m.group(2)))
                    w, r = raw_bandwidth(d, int(nbytes))
                    raw_w.append(w)
                    raw_r.append(r)
                stalls[async_save] += [m["stall_s"] for m in metrics if m["type"] == "checkpoint"]
                steps_s += [m["step_time_s"] for m in metrics if m["type"] == "train"][2:]
    med = statistics.median
    step = med(steps_s)
    print(f"model {a.model}: checkpoint of {nbytes / 1e6:.0f} MB (weights + AdamW moments, fp32); medians of "
          f"{a.repeats} repeats")
    print(f"{'':<10} {'checkpoint MB/s':>16} {'raw disk MB/s':>14} {'ratio':>7}")
    print(f"{'write':<10} {med(writes):>16.0f} {med(raw_w):>14.0f} {med(writes) / med(raw_w):>7.2f}")
    print(f"{'read':<10} {med(reads):>16.0f} {med(raw_r):>14.0f} {med(reads) / med(raw_r):>7.2f}")
    print(f"step time {step * 1e3:.0f} ms; stall of a save: synchronous {med(stalls[False]) * 1e3:.0f} ms "
          f"({med(stalls[False]) / step:.0%} of a step), asynchronous {med(stalls[True]) * 1e3:.1f} ms "
          f"({med(stalls[True]) / step:.1%} of a step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
