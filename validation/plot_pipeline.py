#!/usr/bin/env python3
"""The schedule of a dstrain run, per rank, from the timelines it recorded
(metrics.timeline_steps; src/train/timeline.h): a Gantt chart, a Chrome trace, the bubble.

    /usr/bin/python3 validation/plot_pipeline.py RUN_DIR [--step S] [--png OUT.png] [--trace OUT.json]

reads RUN_DIR/timeline.rank*.jsonl (a header line, then one event a line: kind, step,
micro_batch, chunk, peer, start, end in seconds on the ranks' shared clock) and writes
  OUT.png   (default RUN_DIR/timeline.png) one row per rank, a bar per event: forwards blue,
            backwards (whole or input part) orange, weight gradients green, communication
            (send, recv, the gradient reduction) grey and hatched on a lane of its own; the
            micro-batch number in each bar ("3.1": micro-batch 3 on chunk 1)
  OUT.json  (default RUN_DIR/timeline.trace.json) a Chrome trace (ph "X" events, ts and dur
            in microseconds, pid = rank, tid = kind) that ui.perfetto.dev and chrome://tracing open
and prints, per recorded step (or step S alone), the measured bubble fraction: the ranks' idle
time between the step's first compute start and its last compute end (compute: F, B, BI, BW;
time waiting in a send, receive or reduction counts as idle), over ranks x that span; next to
it, when the headers say P pipeline ranks and m micro-batches, the schedule's figure: 1F1B's (and
GPipe's) analytic (P-1)/(m+P-1), the interleaved schedule's (P-1)/(Vm+P-1), and for DualPipeV the
bubble dstrain's simulator finds with the papers' chunk costs (header "ideal_bubble"). Standard
library and matplotlib only.
"""

import argparse
import glob
import json
import os
import re
import sys

COMPUTE = ("F", "B", "BI", "BW")
COMM = ("send", "recv", "reduce")
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "BI": "#DD8452", "BW": "#55A868"}
HATCHES = {"send": "///", "recv": "\\\\\\", "reduce": "xxx"}
FIELDS = ("kind", "step", "micro_batch", "chunk", "peer", "start", "end")


def load(run_dir):
    """{rank: (header, [event, ...])} from every timeline.rank{r}.jsonl of run_dir."""
    paths = glob.glob(os.path.join(run_dir, "timeline.rank*.jsonl"))
    if not paths:
        raise SystemExit(f"{run_dir}: no timeline.rank*.jsonl (train with metrics.timeline_steps set)")
    ranks = {}
    for path in paths:
        m = re.search(r"timeline\.rank(\d+)\.jsonl$", path)
        if not m:
            continue
        with open(path) as f:
            lines = [json.loads(line) for line in f if line.strip()]
        if not lines or lines[0].get("type") != "timeline":
            raise SystemExit(f"{path}: the first line is not a timeline header")
        header, events = lines[0], lines[1:]
        for n, e in enumerate(events, 2):
            missing = [k for k in FIELDS if k not in e]
            if missing or e["end"] < e["start"]:
                raise SystemExit(f"{path}:{n}: not an event ({', '.join(missing) or 'end before start'}): {e}")
        ranks[int(m.group(1))] = (header, events)
    return dict(sorted(ranks.items()))


def union_length(intervals, lo, hi):
    """Length of the union of [a, b) clipped to [lo, hi): overlapping events count once."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def bubble(ranks, step):
    """(measured bubble fraction, span in seconds) of `step` over every rank, or None."""
    compute = {r: [(e["start"], e["end"]) for e in ev if e["step"] == step and e["kind"] in COMPUTE]
               for r, (_, ev) in ranks.items()}
    spans = [iv for ivs in compute.values() for iv in ivs]
    if not spans:
        return None
    lo, hi = min(a for a, _ in spans), max(b for _, b in spans)
    if hi <= lo:
        return None
    busy = sum(union_length(ivs, lo, hi) for ivs in compute.values())
    return 1.0 - busy / (len(ranks) * (hi - lo)), hi - lo


def analytic(ranks):
    """(bubble, P, m) from the headers, or None when they do not say or disagree. 1F1B (and GPipe):
    (P-1)/(m+P-1), PipeDream-Flush's and Megatron's figure; interleaved with V chunks per rank:
    (P-1)/(V*m+P-1) (Narayanan et al. 2021, section 2.2.2). DualPipeV: the header's ideal_bubble, the
    schedule simulated by dstrain with backward = 2 x forward and its input and weight halves equal
    (DeepSeek's DualPipe table gives its bubble in chunk times, (PP/2-1)(F&B+B-3W), not as a fraction)."""
    shapes = {(h.get("stages"), h.get("micro_batches"), h.get("schedule"), h.get("chunks", 1))
              for h, _ in ranks.values()}
    if len(shapes) != 1:
        return None
    P, m, schedule, V = shapes.pop()
    if not isinstance(P, int) or not isinstance(m, int) or P < 1 or m < 1:
        return None
    if schedule == "dualpipev":
        # No closed form in dstrain's terms: the schedule simulated with the papers' chunk costs.
        ideal = {h.get("ideal_bubble") for h, _ in ranks.values()}
        if len(ideal) != 1 or not isinstance(next(iter(ideal)), (int, float)):
            return None
        return float(ideal.pop()), P, m
    if schedule == "interleaved":
        return (P - 1) / (V * m + P - 1), P, m
    return (P - 1) / (m + P - 1), P, m


def label(e):
    if e["micro_batch"] < 0:
        return ""
    return f"{e['micro_batch']}" + (f".{e['chunk']}" if e["chunk"] else "")


def chrome_trace(ranks, steps):
    tids = {k: i for i, k in enumerate(COMPUTE + COMM)}
    trace = []
    for r, (h, events) in ranks.items():
        trace.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                      "args": {"name": f"rank {r} (stage {h.get('stage', 0)} of {h.get('stages', 1)})"}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for e in events:
            if e["step"] not in steps:
                continue
            tid = tids.setdefault(e["kind"], len(tids))
            name = e["kind"] + label(e) if e["micro_batch"] >= 0 else e["kind"]
            trace.append({"ph": "X", "name": name, "cat": e["kind"], "pid": r, "tid": tid,
                          "ts": e["start"] * 1e6, "dur": (e["end"] - e["start"]) * 1e6,
                          "args": {k: e[k] for k in ("step", "micro_batch", "chunk", "peer")}})
        for kind, tid in tids.items():
            trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": kind}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def gantt(ranks, steps, out, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    shown = [e for _, ev in ranks.values() for e in ev if e["step"] in steps]
    t0 = min(e["start"] for e in shown)
    span = max(e["end"] for e in shown) - t0
    fig, ax = plt.subplots(figsize=(14, 1.2 + 0.8 * len(ranks)))
    for row, (r, (_, events)) in enumerate(ranks.items()):
        for e in events:
            if e["step"] not in steps:
                continue
            x, w = (e["start"] - t0) * 1e3, (e["end"] - e["start"]) * 1e3
            if e["kind"] in COMM:  # a lane below the compute one: it may overlap it
                y, h = row + 0.12, 0.3
                ax.broken_barh([(x, w)], (y, h), facecolors="#BBBBBB", edgecolors="#555555",
                               hatch=HATCHES[e["kind"]], linewidth=0.5)
            else:
                y, h = row - 0.42, 0.5
                ax.broken_barh([(x, w)], (y, h), facecolors=COLOURS.get(e["kind"], "#8172B3"),
                               edgecolors="black", linewidth=0.5)
            text = label(e)
            if text and w >= span * 1e3 * 0.006:
                ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=7,
                        color="black" if e["kind"] in COMM else "white", clip_on=True)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}\nstage {h.get('stage', 0)}" for r, (h, _) in ranks.items()])
    ax.set_ylim(len(ranks) - 0.5, -0.6)
    ax.set_xlim(0, span * 1e3)
    ax.set_xlabel("ms since the first event shown")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    legend = [mpatches.Patch(facecolor=COLOURS["F"], label="forward"),
              mpatches.Patch(facecolor=COLOURS["B"], label="backward (B, BI)"),
              mpatches.Patch(facecolor=COLOURS["BW"], label="weight gradients (BW)")]
    legend += [mpatches.Patch(facecolor="#BBBBBB", hatch=HATCHES[k], label=k) for k in COMM]
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.2 / len(ranks)), ncol=6,
              fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, help="only this step (default: every recorded step)")
    p.add_argument("--png", help="the Gantt chart (default RUN_DIR/timeline.png)")
    p.add_argument("--trace", help="the Chrome trace (default RUN_DIR/timeline.trace.json)")
    a = p.parse_args()
    ranks = load(a.run_dir)
    recorded = sorted({e["step"] for _, ev in ranks.values() for e in ev})
    if not recorded:
        print(f"{a.run_dir}: the timelines hold no events (did the run reach the steps asked for?)")
        return 1
    if a.step is not None and a.step not in recorded:
        print(f"{a.run_dir}: step {a.step} was not recorded; recorded: {', '.join(map(str, recorded))}")
        return 1
    steps = [a.step] if a.step is not None else recorded

    headers = [h for h, _ in ranks.values()]
    want = analytic(ranks)
    schedule = headers[0].get("schedule", "?")
    print(f"{a.run_dir}: {len(ranks)} rank(s), schedule {schedule}, "
          + (f"P = {want[1]} stage(s), m = {want[2]} micro-batch(es)" if want else "stages/micro-batches unknown"))
    formula = {"interleaved": "(P-1)/(Vm+P-1)", "dualpipev": "(simulated)"}.get(schedule, "(P-1)/(m+P-1)")
    print(f"{'step':>6} {'span ms':>10} {'bubble':>8} {'analytic ' + formula:>24}")
    measured = []
    for s in steps:
        b = bubble(ranks, s)
        if b is None:
            print(f"{s:>6} {'-':>10} {'-':>8}")
            continue
        measured.append(b[0])
        print(f"{s:>6} {b[1] * 1e3:>10.2f} {b[0]:>8.3f} {(f'{want[0]:.3f}' if want else 'n/a'):>24}")
    if len(measured) > 1:
        print(f"{'mean':>6} {'':>10} {sum(measured) / len(measured):>8.3f} {(f'{want[0]:.3f}' if want else 'n/a'):>24}")

    trace_path = a.trace or os.path.join(a.run_dir, "timeline.trace.json")
    with open(trace_path, "w") as f:
        json.dump(chrome_trace(ranks, set(steps)), f)
    png = a.png or os.path.join(a.run_dir, "timeline.png")
    what = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
    title = f"{os.path.abspath(a.run_dir)}: {what}, schedule {schedule}" + (
        f", P={want[1]}, m={want[2]}; bubble {sum(measured) / max(len(measured), 1):.3f} "
        f"(analytic {want[0]:.3f})" if want else "")
    gantt(ranks, set(steps), png, title)
    print(f"wrote {png} and {trace_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
