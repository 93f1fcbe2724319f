#!/usr/bin/env python3
"""Speedup and efficiency of a dstrain scaling sweep (slurm/sweep-nodes.sh), from the
metrics.jsonl of its runs, with plots of measured against predicted throughput
(Debian's python3-matplotlib):

    /usr/bin/python3 validation/scaling_report.py [RUNS_DIR] [--out DIR] [--warmup N]
        [--predict DSTRAIN_BIN --cluster PROFILE.json | --predicted FILE.json]

RUNS_DIR (default runs/sweep) holds one directory per run, <mode>-<count><n|r>-<repeat>/ with
metrics.jsonl and sweep.json (what the sweep asked for). For each run, the median tokens/s
over its steps after the first N of each start (--warmup, default 3); for each count, the
median over repeats, their spread (min-max), and
  speedup     tokens/s over that of the smallest count
  efficiency  speedup / (ranks / ranks at the smallest count). Strong scaling (fixed global
              batch): speedup over the ideal one. Weak scaling (fixed batch per rank): tokens/s
              per rank relative to the smallest count, which is also its step time over ours.
Predictions, when given, come from `DSTRAIN_BIN plan --config RUN.json --ranks N --cluster
PROFILE.json --explain --json` (its printed JSON object's "tokens_per_second" and
"step_seconds"; RUN.json is the sweep's config with the run's overrides), or from --predicted
FILE.json: {"COUNT": tokens_per_second, ...}, values may be {"tokens_per_second": X,
"step_seconds": Y}, and the whole may be split by mode ({"strong": {...}, "weak": {...}}).

Writes into --out (default RUNS_DIR/report): scaling.md and scaling.json (the tables),
scaling_throughput.png (measured and predicted tokens/s against the count) and
scaling_efficiency.png.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

NAME = re.compile(r"^(?:(strong|weak)-)?(\d+)([nr])-(\d+)$")  # also the older <count>n-<repeat>
UNIT = {"n": "nodes", "r": "ranks"}


class ReportError(Exception):
    pass


def read_config_json(path):
    """A dstrain config file: JSON that may hold // and /* */ comments."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ReportError(f"cannot read the sweep's config {path}: {e}") from None
    text = re.sub(r'("(?:\\.|[^"\\])*")|//[^\n]*|/\*.*?\*/', lambda m: m.group(1) or "", text, flags=re.S)
    try:
        return json.loads(text)
    except ValueError as e:
        raise ReportError(f"{path} is not valid JSON: {e}") from None


def apply_override(cfg, assignment):
    """KEY=VALUE as `dstrain train --set` reads it: VALUE is JSON, or else a plain string."""
    key, sep, text = assignment.partition("=")
    if not sep or not key:
        raise ReportError(f"override '{assignment}' is not KEY=VALUE")
    try:
        value = json.loads(text)
    except ValueError:
        value = text
    node = cfg
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def set_args(args):
    """The KEY=VALUE values of every --set in a DSTRAIN_ARGS string."""
    out, taking = [], False
    for word in args.split():
        if word == "--set":
            taking = True
        elif word.startswith("-"):
            taking = False
        elif taking:
            out.append(word)
    return out


def read_run(path, warmup):
    """One run: the median tokens/s and step time over its steps after the warm-up of each start
    (a requeued run starts again and warms up again; a repeated step keeps its last record)."""
    metrics = os.path.join(path, "metrics.jsonl")
    with open(metrics) as f:
        lines = f.read().splitlines()
    steps, env, seen, max_steps = {}, {}, 0, None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError as e:
            if i == len(lines):  # the last line of a job killed while writing it
                print(f"note: {metrics}:{i}: ignoring a truncated last line", file=sys.stderr)
                continue
            raise ReportError(f"{metrics}:{i}: not a JSON record ({e})") from None
        kind = rec.get("type")
        if kind == "environment":
            env, seen = rec.get("environment", {}), 0
        elif kind == "train":
            seen += 1
            if seen > warmup:
                try:
                    steps[rec["step"]] = (float(rec["tokens_per_s"]), float(rec["step_time_s"]))
                except (KeyError, TypeError, ValueError):
                    raise ReportError(f"{metrics}:{i}: a train record without step, tokens_per_s and step_time_s; "
                                      "was it written by dstrain?") from None
    resolved = {}
    if os.path.exists(os.path.join(path, "resolved_config.json")):
        with open(os.path.join(path, "resolved_config.json")) as f:
            resolved = json.load(f)
    train = resolved.get("train", {})
    max_steps = train.get("max_steps")
    last = max(steps) if steps else 0
    return {
        "dir": path,
        "steps": len(steps),
        "last_step": last,
        "max_steps": max_steps,
        "tokens_per_s": statistics.median(v[0] for v in steps.values()) if steps else None,
        "step_s": statistics.median(v[1] for v in steps.values()) if steps else None,
        "ranks": env.get("world_size"),
        "global_batch": train.get("train_batch_size"),
        "seq_len": resolved.get("data", {}).get("seq_len"),
        "environment": env,
    }


def collect(runs_dir, warmup):
    """Runs grouped by (mode, unit), then by count: {(mode, unit): {count: [run, ...]}}."""
    if not os.path.isdir(runs_dir):
        raise ReportError(f"{runs_dir} is not a directory; give the sweep's output (slurm/sweep-nodes.sh --out, "
                          "default runs/sweep)")
    groups, skipped = {}, []
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name)
        if not os.path.isfile(os.path.join(path, "metrics.jsonl")):
            if os.path.isdir(path) and NAME.match(name):
                skipped.append(f"{name}: no metrics.jsonl (not started, or failed before the first step)")
            continue
        sweep = {}
        if os.path.exists(os.path.join(path, "sweep.json")):
            with open(os.path.join(path, "sweep.json")) as f:
                sweep = json.load(f)
        m = NAME.match(name)
        if not sweep and not m:
            skipped.append(f"{name}: neither sweep.json nor a <mode>-<count><n|r>-<repeat> name")
            continue
        mode = sweep.get("mode") or (m.group(1) if m and m.group(1) else "strong")
        unit = sweep.get("unit") or UNIT[m.group(3)]
        count = int(sweep.get("count") or m.group(2))
        run = read_run(path, warmup)
        run.update(name=name, sweep=sweep, mode=mode, unit=unit, count=count)
        if run["steps"] == 0:
            skipped.append(f"{name}: no steps after the {warmup} warm-up step(s); run more steps or lower --warmup")
            continue
        if run["max_steps"] and run["last_step"] < run["max_steps"]:
            skipped.append(f"{name}: incomplete (last step {run['last_step']} of {run['max_steps']}): still running, "
                           f"or failed (see its Slurm log)")
            continue
        groups.setdefault((mode, unit), {}).setdefault(count, []).append(run)
    if not groups:
        raise ReportError(f"{runs_dir}: no finished runs with metrics.jsonl" +
                          ("".join(f"\n  {s}" for s in skipped) if skipped else
                           "; run slurm/sweep-nodes.sh first and wait for its jobs"))
    return groups, skipped


def one_value(runs, key, what):
    values = {r[key] for r in runs}
    if len(values) > 1:
        raise ReportError(f"the repeats of one count disagree on {what}: " +
                          ", ".join(f"{r['name']}={r[key]}" for r in runs))
    return values.pop()


def tables(groups, predicted):
    out = []
    for (mode, unit), by_count in sorted(groups.items()):
        counts = sorted(by_count)
        rows = []
        for c in counts:
            runs = sorted(by_count[c], key=lambda r: r["name"])
            tps = [r["tokens_per_s"] for r in runs]
            layout = runs[0]["sweep"].get("layout", "")
            rows.append({
                "count": c,
                "ranks": one_value(runs, "ranks", "the rank count") or c,
                "global_batch": one_value(runs, "global_batch", "the global batch"),
                "seq_len": one_value(runs, "seq_len", "the sequence length"),
                "repeats": len(runs),
                "tokens_per_s": statistics.median(tps),
                "tokens_per_s_min": min(tps),
                "tokens_per_s_max": max(tps),
                "step_s": statistics.median(r["step_s"] for r in runs),
                "oversubscribed": "--overcommit" in layout,
                "runs": [{"dir": r["name"], "tokens_per_s": r["tokens_per_s"], "step_s": r["step_s"],
                          "steps": r["steps"]} for r in runs],
            })
        base = rows[0]
        for row in rows:
            ideal = row["ranks"] / base["ranks"]
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
            row["efficiency"] = row["speedup"] / ideal
            p = predicted.get((mode, row["count"])) if predicted else None
            row["predicted_tokens_per_s"] = p["tokens_per_second"] if p else None
            row["predicted_step_s"] = p.get("step_seconds") if p else None
            row["error"] = (row["tokens_per_s"] / p["tokens_per_second"] - 1) if p else None
        pb = predicted.get((mode, base["count"])) if predicted else None
        for row in rows:
            p = predicted.get((mode, row["count"])) if predicted else None
            row["predicted_efficiency"] = (p["tokens_per_second"] / pb["tokens_per_second"] /
                                           (row["ranks"] / base["ranks"])) if p and pb else None
        out.append({"mode": mode, "unit": unit, "base_count": base["count"], "rows": rows})
    return out


def markdown(result):
    def num(x, fmt):
        return "—" if x is None else format(x, fmt)

    pred = result["predictions"]
    lines = [f"# {result['title']}", ""]
    env = result["machine"]
    if env:
        lines += [f"Machine: {env.get('cpu_model', '?')} on {env.get('hosts', '?')}, {env.get('omp_threads', '?')} "
                  f"OpenMP thread(s) per rank; {(env.get('mpi') or '?').split(',')[0]}; dstrain "
                  f"{env.get('dstrain_version', '?')} ({env.get('commit', '?')}).", ""]
    lines += [f"Runs: `{result['runs_dir']}`; per run the median over its steps after {result['warmup_steps']} "
              "warm-up step(s), per count the median over repeats (spread: min-max of the repeats). "
              "Efficiency = speedup / (ranks / ranks at the smallest count).", ""]
    if pred is None:
        lines += ["**Predictions: none.** Add them with `--predict DSTRAIN_BIN --cluster PROFILE.json` "
                  "(`dstrain plan`) or `--predicted FILE.json`.", ""]
    else:
        lines += [f"Predictions: {pred['source']}. Error = measured / predicted - 1.", ""]
    for t in result["tables"]:
        what = ("strong scaling: global batch fixed" if t["mode"] == "strong"
                else "weak scaling: batch per rank fixed, global batch grows with the ranks")
        lines += [f"## {t['mode'].capitalize()} scaling over {t['unit']} ({what})", ""]
        nodes = t["unit"] == "nodes"  # a ranks column only where the count is not ranks already
        lines.append(f"| {t['unit']} |{' ranks |' if nodes else ''} global batch | runs | tokens/s (median) | "
                     "spread (min-max) | step (s) | speedup | efficiency | predicted tokens/s | predicted efficiency "
                     "| error |")
        lines.append("|---:" * (12 if nodes else 11) + "|")
        for r in t["rows"]:
            mark = " *" if r["oversubscribed"] else ""
            lines.append(
                f"| {r['count']}{mark} |{' ' + str(r['ranks']) + ' |' if nodes else ''} {r['global_batch']} | "
                f"{r['repeats']} | "
                f"{r['tokens_per_s']:.0f} | {r['tokens_per_s_min']:.0f}-{r['tokens_per_s_max']:.0f} | "
                f"{r['step_s']:.4f} | {r['speedup']:.2f} | {r['efficiency']:.2f} | "
                f"{num(r['predicted_tokens_per_s'], '.0f')} | {num(r['predicted_efficiency'], '.2f')} | "
                f"{'—' if r['error'] is None else format(100 * r['error'], '+.1f') + '%'} |")
        if any(r["oversubscribed"] for r in t["rows"]):
            lines.append("")
            lines.append("\\* more ranks than the node has cores (sweep-nodes.sh --overcommit): ranks share cores.")
        lines.append("")
    if result["skipped"]:
        lines += ["Left out:", ""] + [f"- {s}" for s in result["skipped"]] + [""]
    lines += ["Plots: `scaling_throughput.png` (tokens/s against the count: measured, ideal"
              + (", predicted" if pred else "") + "), `scaling_efficiency.png`.", ""]
    return "\n".join(lines)


def plot(result, out):
    try:
        import matplotlib
    except ImportError:
        raise ReportError("matplotlib is missing: apt-get install python3-matplotlib, and run this with "
                          "/usr/bin/python3") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = result["tables"]
    no_pred = " (no predictions)" if result["predictions"] is None else ""
    fig, axes = plt.subplots(1, len(ts), figsize=(5.5 * len(ts), 4.2), squeeze=False)
    for ax, t in zip(axes[0], ts):
        rows = t["rows"]
        x = [r["count"] for r in rows]
        y = [r["tokens_per_s"] for r in rows]
        err = [[r["tokens_per_s"] - r["tokens_per_s_min"] for r in rows],
               [r["tokens_per_s_max"] - r["tokens_per_s"] for r in rows]]
        ax.errorbar(x, y, yerr=err, fmt="o-", capsize=4, label="measured (median, min-max)")
        ax.plot(x, [rows[0]["tokens_per_s"] * r["ranks"] / rows[0]["ranks"] for r in rows], "k:", label="ideal")
        px = [r["count"] for r in rows if r["predicted_tokens_per_s"] is not None]
        if px:
            ax.plot(px, [r["predicted_tokens_per_s"] for r in rows if r["predicted_tokens_per_s"] is not None],
                    "s--", label="predicted")
        over = [r["count"] for r in rows if r["oversubscribed"]]
        if over:  # shaded from halfway (on the log axis) between the last count within the cores and the first beyond
            below = [c for c in x if c < min(over)]
            left = (below[-1] * min(over)) ** 0.5 if below else min(over) / 1.2
            ax.axvspan(left, max(x) * 1.2, color="0.9", zorder=0, label="more ranks than cores")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x)
        ax.set_xticklabels([str(c) for c in x])
        ax.set_xlabel(t["unit"])
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{t['mode']} scaling{no_pred}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling_throughput.png"), dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4.2))
    for t in ts:
        rows = t["rows"]
        x = [r["count"] for r in rows]
        line, = ax.plot(x, [r["efficiency"] for r in rows], "o-", label=f"{t['mode']} ({t['unit']}), measured")
        px = [r for r in rows if r["predicted_efficiency"] is not None]
        if px:
            ax.plot([r["count"] for r in px], [r["predicted_efficiency"] for r in px], "s--", color=line.get_color(),
                    label=f"{t['mode']} ({t['unit']}), predicted")
    ax.axhline(1.0, color="k", ls=":", lw=1)
    ax.set_xscale("log", base=2)
    counts = sorted({r["count"] for t in ts for r in t["rows"]})
    over = sorted({r["count"] for t in ts for r in t["rows"] if r["oversubscribed"]})
    if over:
        below = [c for c in counts if c < over[0]]
        left = (below[-1] * over[0]) ** 0.5 if below else over[0] / 1.2
        ax.axvspan(left, counts[-1] * 1.2, color="0.9", zorder=0, label="more ranks than cores")
    ax.set_xticks(counts)
    ax.set_xticklabels([str(c) for c in counts])
    units = {t["unit"] for t in ts}
    ax.set_xlabel(units.pop() if len(units) == 1 else "count (nodes or ranks)")
    ax.set_ylabel("efficiency")
    ax.set_ylim(0, max(1.1, max(r["efficiency"] for t in ts for r in t["rows"]) * 1.05))
    ax.set_title("scaling efficiency" + no_pred)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "scaling_efficiency.png"), dpi=110)
    plt.close(fig)


def load_predicted(path, groups):
    """--predicted FILE.json: {(mode, count): {"tokens_per_second": X, "step_seconds": Y or None}}."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ReportError(f"--predicted {path}: {e}") from None
    if not isinstance(data, dict):
        raise ReportError(f"--predicted {path}: expected an object {{\"COUNT\": tokens_per_second, ...}}")
    by_mode = data if set(data) & {"strong", "weak"} else {mode: data for mode, _ in groups}
    out = {}
    for mode, table in by_mode.items():
        if not isinstance(table, dict):
            raise ReportError(f"--predicted {path}: \"{mode}\" must map counts to tokens/s")
        for count, v in table.items():
            if not str(count).isdigit():
                raise ReportError(f"--predicted {path}: key \"{count}\" is not a count (use \"1\", \"2\", ...)")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = {"tokens_per_second": v}
            if not isinstance(v, dict) or not isinstance(v.get("tokens_per_second"), (int, float)) or \
                    v["tokens_per_second"] <= 0:
                raise ReportError(f"--predicted {path}: count {count}: expected a positive number or an object with "
                                  f"\"tokens_per_second\", got {json.dumps(v)}")
            out[(mode, int(count))] = {"tokens_per_second": float(v["tokens_per_second"]),
                                       "step_seconds": v.get("step_seconds")}
    return out


def run_planner(bin_path, profile, groups):
    """Predictions from `dstrain plan` for the config of one run of every (mode, count)."""
    if not os.access(bin_path, os.X_OK):
        raise ReportError(f"--predict {bin_path} is not an executable; give dstrain's path (build/app/dstrain)")
    if not os.path.isfile(profile):
        raise ReportError(f"--cluster {profile} does not exist; give the cluster profile (JSON) to predict for")
    out = {}
    with tempfile.TemporaryDirectory(prefix="scaling_report_") as tmp:
        for (mode, _unit), by_count in sorted(groups.items()):
            for count, runs in sorted(by_count.items()):
                run = runs[0]
                sweep = run["sweep"]
                if not sweep.get("config"):
                    raise ReportError(f"{run['dir']} has no sweep.json, so its config cannot be rebuilt for "
                                      "`dstrain plan`; give predictions with --predicted FILE.json")
                cfg = read_config_json(sweep["config"])
                for o in set_args(sweep.get("dstrain_args", "")) + sweep.get("overrides", []):
                    apply_override(cfg, o)
                run_json = os.path.join(tmp, f"{mode}-{count}.json")
                with open(run_json, "w") as f:
                    json.dump(cfg, f, indent=1)
                cmd = [os.path.abspath(bin_path), "plan", "--config", run_json, "--ranks", str(run["ranks"] or count),
                       "--cluster", os.path.abspath(profile), "--explain", "--json"]
                p = subprocess.run(cmd, capture_output=True, text=True, cwd=sweep.get("submit_dir") or None)
                if p.returncode != 0:
                    raise ReportError(f"{' '.join(cmd)} failed (exit {p.returncode}) for {mode} count {count}:\n"
                                      f"{p.stderr.strip()[-2000:]}\nCheck the profile and the binary (a dstrain with "
                                      "the plan subcommand), or give predictions with --predicted FILE.json")
                out[(mode, count)] = parse_plan(p.stdout, cmd)
    return out


def parse_plan(stdout, cmd):
    """The JSON object `dstrain plan --json` prints (text around it, such as --explain's, is allowed)."""
    dec = json.JSONDecoder()
    for i in [m.start() for m in re.finditer(r"^\{", stdout, re.M)]:
        try:
            obj, _ = dec.raw_decode(stdout, i)
        except ValueError:
            continue
        if isinstance(obj, dict) and "tokens_per_second" in obj:
            tps = obj["tokens_per_second"]
            if not isinstance(tps, (int, float)) or tps <= 0:
                raise ReportError(f"{' '.join(cmd)}: tokens_per_second is {json.dumps(tps)}, not a positive number")
            return {"tokens_per_second": float(tps), "step_seconds": obj.get("step_seconds")}
    raise ReportError(f"{' '.join(cmd)} printed no JSON object with \"tokens_per_second\"; its output began:\n"
                      f"{stdout[:1000]}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs_dir", nargs="?", default="runs/sweep", help="the sweep's output (default runs/sweep)")
    ap.add_argument("--out", help="where the report goes (default RUNS_DIR/report)")
    ap.add_argument("--warmup", type=int, default=3, help="steps left out at each start of a run (default 3)")
    ap.add_argument("--title", default="dstrain scaling", help="the report's heading")
    ap.add_argument("--predict", metavar="DSTRAIN_BIN", help="predict with DSTRAIN_BIN plan (needs --cluster)")
    ap.add_argument("--cluster", metavar="PROFILE.json", help="the cluster profile for --predict")
    ap.add_argument("--predicted", metavar="FILE.json", help="predictions: {\"COUNT\": tokens_per_second, ...}")
    ap.add_argument("--no-plots", action="store_true", help="tables only (no matplotlib needed)")
    a = ap.parse_args(argv)
    if a.warmup < 0:
        ap.error(f"--warmup {a.warmup}: give the number of steps to leave out (0 or more)")
    if a.predict and a.predicted:
        ap.error("--predict and --predicted both give predictions; choose one")
    if bool(a.predict) != bool(a.cluster):
        ap.error("--predict DSTRAIN_BIN and --cluster PROFILE.json go together")
    out = a.out or os.path.join(a.runs_dir, "report")
    try:
        groups, skipped = collect(a.runs_dir, a.warmup)
        if a.predicted:
            predicted, source = load_predicted(a.predicted, groups), f"`{a.predicted}`"
        elif a.predict:
            predicted = run_planner(a.predict, a.cluster, groups)
            source = f"`{os.path.basename(a.predict)} plan --cluster {a.cluster}`"
        else:
            predicted, source = None, None
        first = next(iter(next(iter(groups.values())).values()))[0]
        builds = sorted({str(r["environment"].get("commit")) for g in groups.values() for runs in g.values()
                         for r in runs})
        result = {
            "title": a.title,
            "runs_dir": a.runs_dir,
            "warmup_steps": a.warmup,
            "predictions": {"source": source} if predicted is not None else None,
            "machine": {k: first["environment"].get(k) for k in
                        ("cpu_model", "hosts", "omp_threads", "mpi", "dstrain_version", "blas")},
            "tables": tables(groups, predicted),
            "skipped": skipped,
        }
        result["machine"]["commit"] = ", ".join(builds)  # more than one: runs of different builds
        os.makedirs(out, exist_ok=True)
        text = markdown(result)
        with open(os.path.join(out, "scaling.md"), "w") as f:
            f.write(text)
        with open(os.path.join(out, "scaling.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        if not a.no_plots:
            plot(result, out)
    except ReportError as e:
        print(f"scaling_report.py: {e}", file=sys.stderr)
        return 1
    print(text)
    for s in skipped:
        print(f"note: left out {s}", file=sys.stderr)
    print(f"wrote scaling.md, scaling.json{'' if a.no_plots else ', scaling_throughput.png, scaling_efficiency.png'}"
          f" to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
