#!/usr/bin/env python3
"""Plots of a dstrain run from its metrics.jsonl (Debian's python3-matplotlib):

    /usr/bin/python3 validation/plot_metrics.py RUN_DIR/metrics.jsonl [OUT_DIR]

writes, next to the file or into OUT_DIR:
  loss.png        training loss (and evaluation loss) against steps and against tokens
  throughput.png  tokens/s and MFU against steps
  time_split.png  each step's time split: data wait, forward, backward, exposed communication,
                  optimizer, checkpoint, other (stacked)
"""

import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PHASES = ["data_wait", "forward", "backward", "exposed_comm", "optimizer", "checkpoint", "other"]


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    path = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) == 3 else os.path.dirname(os.path.abspath(path))
    os.makedirs(out, exist_ok=True)
    records = [json.loads(line) for line in open(path) if line.strip()]
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    if not train:
        print(f"{path}: no training steps")
        return 1
    steps = [r["step"] for r in train]
    tokens_at = {r["step"]: r["tokens"] for r in train}

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [r["loss"] for r in train], label="train", lw=1)
    b.plot([r["tokens"] for r in train], [r["loss"] for r in train], label="train", lw=1)
    if evals:
        a.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", label="validation")
        b.plot([tokens_at.get(e["step"], 0) for e in evals], [e["loss"] for e in evals], "o-", label="validation")
    a.set_xlabel("step")
    b.set_xlabel("tokens")
    for ax in (a, b):
        ax.set_ylabel("loss")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)

    fig, a = plt.subplots(figsize=(8, 4))
    a.plot(steps, [r["tokens_per_s"] for r in train], lw=1, color="tab:blue")
    a.set_xlabel("step")
    a.set_ylabel("tokens/s", color="tab:blue")
    b = a.twinx()
    b.plot(steps, [100 * r["mfu"] for r in train], lw=1, color="tab:orange")
    b.set_ylabel("MFU (%)", color="tab:orange")
    a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "throughput.png"), dpi=110)

    fig, a = plt.subplots(figsize=(9, 4))
    a.stackplot(steps, *[[r["time_s"][p] for r in train] for p in PHASES], labels=PHASES)
    a.set_xlabel("step")
    a.set_ylabel("seconds")
    a.legend(loc="upper right", fontsize=8)
    a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "time_split.png"), dpi=110)
    print(f"wrote loss.png, throughput.png, time_split.png to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
