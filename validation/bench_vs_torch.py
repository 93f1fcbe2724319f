#!/usr/bin/env python3
"""dstrain against the PyTorch a user would pick today, on this machine: tokens/s of each on the
same model, sequence length, batch, optimizer and thread count, in fp32 and in bf16, their ratio,
and dstrain's achieved model FLOP/s as a fraction of GEMM ceilings measured in the same run.

    validation/bench_vs_torch.py [--sizes 256,1024] [--precisions fp32,bf16] [--peers eager,compile,hf]
                                 [--steps 8] [--warmup 2] [--repeats 2] [--threads 2]
                                 [--peer-budget-s 120] [--baseline OLD_BUILD/app/dstrain] [--json OUT]

The peer is the current PyTorch of the validation venv (validation/peer_venv.sh; its python runs
validation/torch_peer.py) three ways by default, and the best of the ways run counts:
  eager    a Llama written as a PyTorch user writes it (SDPA attention, fp32 RMSNorm),
  compile  the same under torch.compile (compilation in untimed warm-up steps),
  hf       transformers' LlamaForCausalLM, attn_implementation="sdpa";
  autotune (only when --peers names it) the same as compile with
           mode="max-autotune-no-cudagraphs": inductor also times its own GEMM templates against
           the library's at each shape, so it compiles for longer;
each in fp32 and in bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16), fp32 masters),
with AdamW (fused on the CPU where torch has it, else foreach) and dstrain's quickstart
hyper-parameters (lr 2e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1 but on norms and the
embedding, clipping 1.0). dstrain trains inputs/quickstart.json with the model swapped, in fp32
and with train.bf16.enabled (fp32 masters and bf16 compute: the DeepSpeed key).

Models: DeepSeek-LLM-architecture configs of 4 layers, micro-batch 8, T=256: d=256
(inputs/models/deepseek-llm-tiny.json) and d=1024 (deepseek-llm-cpu-d1024.json).
Every process gets the same threads (OMP_NUM_THREADS, MKL_NUM_THREADS, torch.set_num_threads;
dstrain's OpenMP OpenBLAS gets OPENBLAS_NUM_THREADS=threads, the peer's numpy 1). Runs alternate
(dstrain, peer variant, dstrain, next variant, ...) so that a noisy machine slows all alike; each
figure is the median over the timed steps of all its runs.

Targets at d=256: bf16 >= 1.5x the best PyTorch bf16 (goal 2x), fp32 >= 1.2x the best PyTorch
fp32. Ceilings: torch.matmul in the venv on the same threads (validation/torch_gemm_ceiling.py),
fp32 and bf16, at a large square size and at the model's training GEMM shapes. On a CPU without
bf16 instructions (avx512_bf16, AMX) both sides emulate bf16 and the header says so.

With --baseline, a dstrain binary built from an earlier commit runs next to each dstrain run and
a column gives this build's tokens/s over the baseline's. Exit status 1 when a measured target is
missed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build")
DATA = os.path.join(ROOT, "data", "fortunes", "fortunes_train_*.bin")
MICRO_BATCH, SEQ_LEN = 8, 256

SIZES = {
    "256": ("d=256, 4 layers", "inputs/models/deepseek-llm-tiny.json"),
    "1024": ("d=1024, 4 layers", "inputs/models/deepseek-llm-cpu-d1024.json"),
}
PEERS = {"eager": "eager", "compile": "torch.compile", "hf": "HF sdpa", "autotune": "max-autotune"}
# (size, precision) -> minimum dstrain / best peer; the goal where there is one.
TARGETS = {("256", "bf16"): 1.5, ("256", "fp32"): 1.2}
GOALS = {("256", "bf16"): 2.0}
BF16_SET = 'train.bf16={"enabled": true}'
CPU_FLAGS = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"]


def cpu_info():
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    return model, [fl for fl in CPU_FLAGS if fl in flags]


def peer_python():
    p = subprocess.run([os.path.join(ROOT, "validation", "peer_venv.sh"), "--check"], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"bench_vs_torch: the peer venv is not usable:\n{p.stderr}")
    return p.stdout.strip()


def ensure_data():
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), BUILD], check=True, stdout=subprocess.DEVNULL)


def env_for(threads, peer):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                OPENBLAS_NUM_THREADS="1" if peer else str(threads))


def dstrain_cmd(binary, cfg, precision, steps, out):
    cmd = [binary, "train", "--config", "inputs/quickstart.json", "--max-steps", str(steps),
           "--set", f'model="{cfg}"', "--set", f"train.train_micro_batch_size_per_gpu={MICRO_BATCH}",
           "--set", "train.gradient_accumulation_steps=1", "--set", f"data.seq_len={SEQ_LEN}",
           "--set", "train.eval_interval=0", "--set", 'output.save_hf=""', "--set", f'output.dir="{out}"',
           "--set", 'generate.prompt=""', "--set", "generate.interval=0"]
    if precision == "bf16":
        cmd += ["--set", BF16_SET]
    return cmd


def probe_bf16(binary, threads):
    """None when `binary` trains with train.bf16.enabled, else the reason it does not."""
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run(dstrain_cmd(binary, SIZES["256"][1], "bf16", 1, out), cwd=ROOT, env=env_for(threads, False),
                           capture_output=True, text=True)
    if p.returncode == 0:
        return None
    lines = [l for l in (p.stderr + p.stdout).splitlines() if "error" in l.lower()] or p.stderr.splitlines()[-1:]
    return lines[0].strip() if lines else f"exit status {p.returncode}"


# (binary, config, precision) -> the losses of its first run: a bf16 run whose losses equal the
# fp32 run's bit for bit computed nothing in bf16, and its speed says nothing about bf16.
LOSSES = {}


def run_dstrain(binary, cfg, precision, steps, warmup, threads):
    """Tokens/s and model FLOP/s of the timed steps of one run."""
    with tempfile.TemporaryDirectory() as out:
        p = subprocess.run(dstrain_cmd(binary, cfg, precision, warmup + steps, out), cwd=ROOT,
                           env=env_for(threads, False), capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"dstrain {precision} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if r.get("type") == "train"][warmup:]
    LOSSES.setdefault((binary, cfg, precision), [r["loss"] for r in rows])
    return [r["tokens_per_s"] for r in rows], [r["model_flops_per_s"] for r in rows]


def run_peer(py, impl, precision, cfg, steps, warmup, threads, budget):
    cmd = [py, os.path.join(ROOT, "validation", "torch_peer.py"), "--impl", impl, "--precision", precision,
           "--config", cfg, "--data", DATA, "--seq-len", str(SEQ_LEN), "--micro-batch", str(MICRO_BATCH),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads), "--budget-s", str(budget)]
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(threads, True), capture_output=True, text=True)
    if p.returncode != 0:
        tail = p.stderr.strip().splitlines()[-3:]
        return {"error": " | ".join(tail) or f"exit status {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def ceilings(py, cfg, precisions, threads):
    cmd = [py, os.path.join(ROOT, "validation", "torch_gemm_ceiling.py"), "--threads", str(threads),
           "--dtypes", ",".join(precisions), "--config", cfg, "--tokens", str(MICRO_BATCH * SEQ_LEN)]
    p = subprocess.run(cmd, cwd=ROOT, env=env_for(threads, True), check=True, capture_output=True, text=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


SGEMM_NAME = ["sgemm"]  # the library of dstrain's fp32 GEMMs, as sgemm_ceiling names it


def sgemm_ceiling(threads):
    exe = os.path.join(BUILD, "validation", "sgemm_ceiling")
    if not os.path.exists(exe):
        return None
    p = subprocess.run([exe, "2048", "5"], env=env_for(threads, False), capture_output=True, text=True)
    if p.returncode != 0:
        return None
    lines = p.stdout.strip().splitlines()
    SGEMM_NAME[0] = lines[1] if len(lines) > 1 else "sgemm"
    return float(lines[0]) * 1e9


def med(xs):
    return statistics.median(xs) if xs else None


def fmt(x, spec=".0f", none="-"):
    return none if x is None else format(x, spec)


def print_table(a, size, peers, precisions, res, ceils, blases, out, note=""):
    """The side-by-side table of one model size; returns whether every measured target is met."""
    name = SIZES[size][0]
    ok = True
    ceil = dict(ceils[0])
    for prec in precisions:
        ceil[prec] = {k: med([c[prec][k] for c in ceils]) for k in ("square", "model")}
        ceil[prec]["square_n"] = ceils[0][prec]["square_n"]
    blas = med([b for b in blases if b])
    print(f"\n{name}, micro-batch {MICRO_BATCH}, T={SEQ_LEN}: tokens/s (medians){note}", file=out)
    head = f"{'precision':<9} {'dstrain':>8}" + "".join(f" {PEERS[p]:>13}" for p in peers) + \
        f" {'best peer':>10} {'dstrain/best':>12}  target"
    if a.baseline:
        head += "  | baseline  this/baseline"
    print(head, file=out)
    for prec in precisions:
        cur = res[prec]
        ds = med(cur["dstrain"])
        pv = {p: med(cur["peers"][p]) for p in peers}
        best_p = max((p for p in peers if pv[p]), key=lambda p: pv[p], default=None)
        best = pv[best_p] if best_p else None
        ratio = ds / best if ds and best else None
        tgt = TARGETS.get((size, prec))
        if tgt is None:
            verdict = ""
        elif ratio is None:
            verdict = f">= {tgt:.1f}x: not measured" + (" (dstrain bf16 not available in this build)"
                                                        if ds is None and prec == "bf16" else "")
        else:
            met = ratio >= tgt
            ok &= met
            goal = GOALS.get((size, prec))
            verdict = f">= {tgt:.1f}x: {'met' if met else 'MISSED'}" + (
                f" (goal {goal:.1f}x: {'met' if ratio >= goal else 'not yet'})" if goal else "")
        line = f"{prec:<9} {fmt(ds, '.0f', 'n/a'):>8}" + "".join(
            f" {fmt(pv[p], '.0f', 'failed' if isinstance(cur['info'].get(p), str) else '-'):>13}" for p in peers)
        line += f" {fmt(best):>10}" + (f" ({PEERS[best_p]})" if best_p else "") + \
            f" {fmt(ratio, '.2f') + 'x' if ratio else '-':>8}  {verdict}"
        if a.baseline:
            b = med(cur["baseline"])
            line += f"  | {fmt(b):>8}  {fmt(ds / b, '.3f') + 'x' if ds and b else '-'}"
        print(line, file=out)
        cur["median"] = {"dstrain": ds, "peers": pv, "best": best_p, "ratio": ratio, "flops": med(cur["flops"])}
    print(f"GEMM ceilings (medians of {len(ceils)} rounds; torch.matmul, torch {ceil['torch']}, {ceil['threads']} "
          f"threads, "
          f"capability {ceil['cpu_capability']}, oneDNN bf16 {ceil['mkldnn_bf16']}); "
          f"dstrain model GFLOP/s (6 x matmul params + attention) as a fraction of each:", file=out)
    for prec in precisions:
        c, fl = ceil[prec], res[prec].get("median", {}).get("flops")
        sq, mo = c["square"], c.get("model")
        frac = (f"dstrain {fl / 1e9:.1f} GFLOP/s = {fl / sq:.0%} of square, {fl / mo:.0%} of model shapes"
                if fl else "dstrain not measured")
        print(f"  {prec}: square {c['square_n']}^3 {sq / 1e9:.1f} GFLOP/s, model GEMM shapes "
              f"({MICRO_BATCH * SEQ_LEN} rows, fwd+dgrad+wgrad) {mo / 1e9:.1f} GFLOP/s; {frac}", file=out)
    if blas:
        fl = res["fp32"].get("median", {}).get("flops") if "fp32" in res else None
        print(f"  (dstrain's fp32 GEMM, {SGEMM_NAME[0]}, 2048^3: {blas / 1e9:.1f} GFLOP/s"
              + (f"; dstrain fp32 at {fl / blas:.0%} of it)" if fl else ")"), file=out)
    same = LOSSES.get((os.path.join(BUILD, "app", "dstrain"), SIZES[size][1], "bf16"))
    if same is not None and same == LOSSES.get((os.path.join(BUILD, "app", "dstrain"), SIZES[size][1], "fp32")):
        print("  WARNING: dstrain's bf16 run has the fp32 run's losses bit for bit: its layers do not compute in "
              "bf16 in this build, so its bf16 figures are fp32 speed, not bf16", file=out)
    infos = {p: res[precisions[0]]["info"].get(p) for p in peers}
    print("peer: " + "; ".join(f"{PEERS[p]}: " + (f"AdamW {i['adamw']}, attention {i['attention']}" +
                                                  (f", compile {i['compile_s']:.0f} s (untimed)"
                                                   if p in ("compile", "autotune") else "")
                                                  if isinstance(i, dict) else f"failed: {i}")
                               for p, i in infos.items()), file=out, flush=True)
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="256,1024", help="comma list of " + ", ".join(SIZES))
    ap.add_argument("--precisions", default="fp32,bf16", help="comma list of fp32, bf16")
    ap.add_argument("--peers", default="eager,compile,hf", help="comma list of " + ", ".join(PEERS))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per run (torch.compile: at least 3)")
    ap.add_argument("--repeats", type=int, default=2, help="alternating rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-budget-s", type=float, default=120,
                    help="a peer run stops timing after this many seconds (at least 3 timed steps)")
    ap.add_argument("--baseline", help="a dstrain binary from an earlier build, run in the same alternation")
    ap.add_argument("--json", help="also write every figure to this file")
    a = ap.parse_args()
    sizes = [s for s in a.sizes.split(",") if s]
    precisions = [p for p in a.precisions.split(",") if p]
    peers = [p for p in a.peers.split(",") if p]
    for what, got, known in (("--sizes", sizes, SIZES), ("--precisions", precisions, ("fp32", "bf16")),
                             ("--peers", peers, PEERS)):
        bad = [g for g in got if g not in known]
        if bad:
            ap.error(f"{what}: unknown {', '.join(bad)} (known: {', '.join(known)})")
    binary = os.path.join(BUILD, "app", "dstrain")
    if not os.path.exists(binary):
        sys.exit(f"bench_vs_torch: {binary} is missing: build it first (cmake --build build --target dstrain)")
    py = peer_python()
    ensure_data()

    model, flags = cpu_info()
    bf16_hw = [f for f in flags if f in ("avx512_bf16", "amx_bf16")]
    print(f"CPU: {model}; flags: {' '.join(flags)}; {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f} at start (other work on the machine slows every side alike)")
    print("bf16 hardware: " + (" + ".join(bf16_hw) if bf16_hw else
                               "NONE (no avx512_bf16, no AMX): dstrain and PyTorch both emulate bf16 arithmetic "
                               "(convert to fp32 and back), so bf16 figures measure emulation, not bf16 hardware"))
    bf16_reason = probe_bf16(binary, a.threads) if "bf16" in precisions else None
    if "bf16" in precisions:
        print("dstrain bf16: " + ("available (train.bf16.enabled)" if bf16_reason is None else
                                  f"not available in this build ({bf16_reason})"))
    base_bf16 = a.baseline and "bf16" in precisions and probe_bf16(a.baseline, a.threads) is None
    print(f"{a.threads} threads each; micro-batch {MICRO_BATCH}, T={SEQ_LEN}; {a.steps} timed steps after "
          f"{a.warmup} untimed (torch.compile: {max(a.warmup, 3)}) per run; {a.repeats} alternating rounds; "
          f"peers {', '.join(PEERS[p] for p in peers)}")
    sys.stdout.flush()

    results = {"cpu": model, "flags": flags, "threads": a.threads, "sizes": {}}
    ok = True
    for size in sizes:
        name, cfg = SIZES[size]
        t0 = time.time()
        ceils, blases = [], []
        res = {p: {"dstrain": [], "flops": [], "baseline": [], "peers": {k: [] for k in peers}, "info": {}}
               for p in precisions}
        for r in range(a.repeats):
            # The ceilings too are measured once a round, under the same conditions as the runs.
            ceils.append(ceilings(py, cfg, precisions, a.threads))
            blases.append(sgemm_ceiling(a.threads))
            order = peers[r % len(peers):] + peers[:r % len(peers)]
            for prec in precisions:
                cur = res[prec]
                for impl in order:
                    if prec == "fp32" or bf16_reason is None:
                        tps, fl = run_dstrain(binary, cfg, prec, a.steps, a.warmup, a.threads)
                        cur["dstrain"] += tps
                        cur["flops"] += fl
                    if a.baseline and (prec == "fp32" or base_bf16):
                        cur["baseline"] += run_dstrain(a.baseline, cfg, prec, a.steps, a.warmup, a.threads)[0]
                    out = run_peer(py, impl, prec, cfg, a.steps, a.warmup, a.threads, a.peer_budget_s)
                    if "error" in out:
                        cur["info"][impl] = out["error"]
                        print(f"  {name} {prec} {PEERS[impl]}: FAILED: {out['error']}", file=sys.stderr)
                    else:
                        cur["peers"][impl].append(out["tokens_per_s"])
                        cur["info"][impl] = {k: out[k] for k in ("torch", "adamw", "attention", "compile_s",
                                                                 "timed_steps") if k in out}
                    print(f"  [{time.time() - t0:6.0f} s] {name} {prec} round {r + 1}: dstrain "
                          f"{fmt(med(cur['dstrain']))}, {PEERS[impl]} {fmt(med(cur['peers'][impl]))} tok/s",
                          file=sys.stderr, flush=True)
            if r + 1 < a.repeats:
                print_table(a, size, peers, precisions, res, ceils, blases, sys.stderr,
                            f" after round {r + 1} of {a.repeats}")
        results["sizes"][size] = {"name": name, "ceilings": ceils, "dstrain_sgemm": blases, "runs": res}
        ok &= print_table(a, size, peers, precisions, res, ceils, blases, sys.stdout)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
