#!/usr/bin/env python3
"""Data pipeline throughput against what training consumes.

    validation/bench_data.py [--repeats 3] [--hf]

  prep      dstrain-prep on ~50 MB of text (the fortunes corpus repeated), Megatron output,
            2 threads: MB/s of text. With --hf also a DeepSeek-style byte-level BPE
            tokenizer.json, trained by validation/compare_tokenizers.py (needs PyPI's tokenizers).
  reader    validation/data_reader_bench: samples of the quickstart data read as the trainer
            reads them (blended, shuffled, ids checked), one thread: tokens/s.
  training  the quickstart model's tokens/s and the share of each step spent waiting for data,
            with read-ahead (data.prefetch 2) and without (prefetch 0).
Medians over --repeats runs.
"""

import argparse
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build")


def prep_throughput(text_file, tokenizer, out_dir):
    p = subprocess.run([os.path.join(BUILD, "app", "dstrain-prep"), "--input", text_file, "--split-on-line", "%",
                        "--format", "megatron", "--tokenizer", tokenizer, "--threads", "2", "--output-prefix",
                        os.path.join(out_dir, "bench")], capture_output=True, text=True, check=True)
    return float(re.search(r"\(([0-9.]+) MB/s\)", p.stdout).group(1))


def train(prefetch, steps=14, warmup=4):
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", "inputs/quickstart.json",
                        "--max-steps", str(steps), "--set", f'output.dir="{out}"', 'output.save_hf=""',
                        "train.eval_interval=0", 'generate.prompt=""', f"data.prefetch={prefetch}",
                        "checkpoint.save_final=false"], cwd=ROOT, check=True, capture_output=True,
                       env=dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count())))
        rows = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"train"' in l][warmup:]
    return [r["tokens_per_s"] for r in rows], [r["data_wait_s"] / r["step_time_s"] for r in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hf", action="store_true", help="also measure prep with a trained tokenizer.json")
    a = ap.parse_args()
    subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), BUILD], check=True, stdout=subprocess.DEVNULL)
    med = statistics.median
    with tempfile.TemporaryDirectory() as tmp:
        corpus = sorted(p for p in glob.glob("/usr/share/games/fortunes/*") if "." not in os.path.basename(p))
        text = b"".join(open(p, "rb").read().rstrip(b"\n") + b"\n%\n" for p in corpus)
        big = os.path.join(tmp, "corpus.txt")
        with open(big, "wb") as f:
            for _ in range(max(1, 50_000_000 // len(text))):
                f.write(text)
        mb = os.path.getsize(big) / 1e6
        tokenizers = [("byte", "byte")]
        if a.hf:
            keep = os.path.join(tmp, "tok")
            subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "validation", "compare_tokenizers.py"), "--keep",
                            keep], check=True, capture_output=True)
            found = sorted(glob.glob(os.path.join(keep, "**", "*.json"), recursive=True))
            deepseek = [f for f in found if "deepseek" in f.lower()] or found
            tokenizers.append(("DeepSeek-style BPE", deepseek[0]))
        print(f"prep: {mb:.0f} MB of text, Megatron output, 2 threads")
        for name, spec in tokenizers:
            rates = [prep_throughput(big, spec, tmp) for _ in range(a.repeats)]
            print(f"  {name:<22} {med(rates):8.1f} MB/s of text")
    reads = []
    for _ in range(a.repeats):
        out = subprocess.run([os.path.join(BUILD, "validation", "data_reader_bench"), "inputs/quickstart.json",
                              "50000"], cwd=ROOT, check=True, capture_output=True, text=True).stdout
        reads.append(json.loads(out.strip().splitlines()[-1])["tokens_per_s"])
    print(f"reader: {med(reads):,.0f} tokens/s (one thread, quickstart data: Megatron, shuffled, ids checked)")
    for prefetch in (2, 0):
        tps, waits = [], []
        for _ in range(a.repeats):
            t, w = train(prefetch)
            tps += t
            waits += w
        print(f"training (quickstart model, 2 threads), data.prefetch={prefetch}: {med(tps):,.0f} tokens/s consumed, "
              f"data wait {med(waits):.2%} of a step (max {max(waits):.2%}); the reader is {med(reads) / med(tps):,.0f}x "
              f"faster than consumption")
    return 0


if __name__ == "__main__":
    sys.exit(main())
