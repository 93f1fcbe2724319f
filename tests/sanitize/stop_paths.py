#!/usr/bin/env python3
"""dstrain's stop and shutdown paths under a sanitizer, under mpirun, many times over.

    stop_paths.py --dstrain SANITIZED_DSTRAIN --sanitizer address|thread [--rounds N] [--seed S]
                  [--data PREFIX | --prepare BUILD_DIR]

Each scenario trains a tiny model on 2 ranks with asynchronous checkpoints every few steps (so
that a write is often in flight when the run stops) and ends it one way:
  - SIGUSR1 or SIGTERM at a random moment of training, sent to every rank as Slurm and kill
    send it: the run must save a checkpoint and exit with status 75, and a resume from that
    checkpoint must finish (status 0);
  - an error on every rank (a NaN step with resilience.max_skipped_steps 1), unwinding through
    the trainer's destructors with a checkpoint in flight: status 1 with the error;
  - an error on one rank (an injected allocation failure with oom_fallback off, under a
    pipeline): the ranks agree before the step that it does not fit, and every rank stops with
    the error.
at ZeRO stages 0-3 (stage 3 with offload too) and under pipeline parallelism (1F1B, DualPipeV).
A scenario fails on any sanitizer report (AddressSanitizer, ThreadSanitizer), a crash, another
exit status or a missing message. This is how a SIGUSR1 that corrupted the heap (a handler
interrupting oneDNN's sgemm) would be caught, and any race or use-after-free between the
checkpoint writer, the data reader, the communicators and shutdown.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
FORTUNES = os.path.join(ROOT, "data", "fortunes", "fortunes_text_document")

# What a sanitizer prints when it finds something (ASan and TSan reports, and their summaries).
REPORT = re.compile(r"ERROR: AddressSanitizer|WARNING: ThreadSanitizer|ERROR: ThreadSanitizer|"
                    r"SUMMARY: (Address|Thread)Sanitizer|runtime error:")
# A rank that died rather than exited: a crash the sanitizer did not explain.
CRASH = re.compile(r"Signal: (Segmentation fault|Aborted|Bus error)|exited on signal|"
                   r"corrupted size|free\(\): invalid|double free|munmap_chunk")

MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
    "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1",
    # Open MPI's components stay loaded to the end, so that ThreadSanitizer can tell their
    # frames (tsan.supp) until the process exits.
    "OMPI_MCA_mca_base_component_disable_dlclose": "1",
}

# name -> (config overrides, ranks)
LAYOUTS = {
    "zero0": ({}, 2),
    "zero1": ({"train": {"zero_optimization": {"stage": 1}}}, 2),
    "zero2": ({"train": {"zero_optimization": {"stage": 2}}}, 2),
    "zero3": ({"train": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}}, 2),
    "zero3_offload": ({"train": {"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}}, 2),
    "pp_1f1b": ({"parallel": {"pipeline": 2, "schedule": "1f1b"},
                 "train": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}}, 2),
    "pp_dualpipev": ({"parallel": {"pipeline": 2, "schedule": "dualpipev"}, "model": {"num_hidden_layers": 4},
                      "train": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}}, 2),
}


def merge(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config(data, out_dir, extra):
    cfg = {
        "model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "vocab_size": 260, "max_position_embeddings": 64,
                  "bos_token_id": 256, "eos_token_id": 257},
        "train": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "max_steps": 1000000,
                  "steps_per_print": 10, "seed": 3, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
        "data": {"format": "megatron", "train": data, "seq_len": 32},
        "output": {"dir": out_dir},
        "checkpoint": {"interval_steps": 3, "keep_last": 2, "async": True},
        "metrics": {"progress": "lines", "peak_tflops": 1},
        "resilience": {"collective_timeout_s": 120},
    }
    return merge(cfg, extra)


class Run:
    """One mpirun of the sanitized dstrain, its output collected as it comes."""

    def __init__(self, args, ranks, cfg_path, extra_args=(), env=None):
        self.text = ""
        self.lock = threading.Lock()
        cmd = ["mpirun", "-np", str(ranks), args.dstrain, "train", "--config", cfg_path, *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", env={**os.environ, **MPI_ENV, **(env or {})},
                                     start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self.lock:
                self.text += line

    def output(self):
        with self.lock:
            return self.text

    def wait_for(self, pattern, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if re.search(pattern, self.output()):
                return True
            if self.proc.poll() is not None:
                return bool(re.search(pattern, self.output()))
            time.sleep(0.05)
        return False

    def ranks(self):
        """The rank processes: the children of mpirun."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def finish(self, timeout):
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            rc = "timeout"
        self.reader.join(timeout=10)
        return rc, self.output()


def check(name, rc, text, want_rc, want_text, failures):
    problems = []
    if REPORT.search(text):
        problems.append("a sanitizer report")
    if CRASH.search(text):
        problems.append("a crash")
    if rc != want_rc:
        problems.append(f"exit status {rc}, expected {want_rc}")
    for w in want_text:
        if not re.search(w, text):
            problems.append(f"no output matching {w!r}")
    if problems:
        failures.append(name)
        print(f"FAIL {name}: {', '.join(problems)}\n---- output ----\n{text[-30000:]}\n----------------", flush=True)
    else:
        print(f"ok   {name}", flush=True)


def scenario_signal(args, work, layout, sig, rnd, failures):
    extra, ranks = LAYOUTS[layout]
    name = f"{layout}/{signal.Signals(sig).name}/round{rnd}"
    out = os.path.join(work, name.replace("/", "_"))
    cfg_path = out + ".json"
    with open(cfg_path, "w") as f:
        json.dump(config(args.data, out, extra), f)
    run = Run(args, ranks, cfg_path)
    if not run.wait_for(r"step\s+\d+/", args.timeout):
        rc, text = run.finish(5)
        check(name, rc, text, 75, ["stop requested"], failures)
        return
    time.sleep(random.uniform(0.05, args.max_delay))
    for pid in run.ranks():
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    rc, text = run.finish(args.timeout)
    check(name, rc, text, 75, [rf"stop requested \(signal {int(sig)}\)", r"checkpoint \S+step_\d+\.h5 written"],
          failures)
    if rc != 75:
        return
    # The checkpoint the stop wrote: a short resume from it ends normally.
    step = int(re.search(rf"stop requested \(signal {int(sig)}\) at step (\d+)", text).group(1))
    resumed = Run(args, ranks, cfg_path, ["--resume", "auto", "--max-steps", str(step + 4)])
    rc, text = resumed.finish(args.timeout)
    check(name + "/resume", rc, text, 0, [rf"resumed from \S+step_0*{step}\.h5 at step {step}"], failures)


def scenario_error(args, work, layout, one_rank, rnd, failures):
    extra, ranks = LAYOUTS[layout]
    name = f"{layout}/{'error_on_one_rank' if one_rank else 'error_on_every_rank'}/round{rnd}"
    out = os.path.join(work, name.replace("/", "_"))
    at = random.randint(4, 9)
    if one_rank:
        fault = {"resilience": {"oom_fallback": False, "fault": {"rank": ranks - 1, "oom_at_step": at}}}
        want = [r"error: .*(out of memory|allocat)"]
    else:
        fault = {"resilience": {"max_skipped_steps": 1, "fault": {"rank": 0, "nan_at_step": at}}}
        want = [r"error: .*skipped"]
    cfg_path = out + ".json"
    with open(cfg_path, "w") as f:
        json.dump(config(args.data, out, merge(extra, fault)), f)
    rc, text = Run(args, ranks, cfg_path).finish(args.timeout)
    check(name, rc, text, 1, want, failures)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dstrain", required=True, help="dstrain built with -DDSTRAIN_SANITIZE=...")
    p.add_argument("--sanitizer", required=True, choices=["address", "thread"])
    p.add_argument("--data", default=FORTUNES, help="a Megatron dataset prefix (default: the quickstart's)")
    p.add_argument("--prepare", metavar="BUILD_DIR",
                   help="make the quickstart's dataset first with .ci/prepare-fortunes and that build's dstrain-prep")
    p.add_argument("--rounds", type=int, default=1, help="times each scenario runs")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated subset of " + ",".join(LAYOUTS))
    p.add_argument("--max-delay", type=float, default=1.5, help="latest signal, seconds after the first step")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--seed", type=int, default=None, help="for the signal times and fault steps (default: random)")
    args = p.parse_args()
    if not os.access(args.dstrain, os.X_OK):
        sys.exit(f"stop_paths: {args.dstrain} is not an executable; build it with -DDSTRAIN_SANITIZE={args.sanitizer}")
    if args.prepare:
        subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), args.prepare], check=True,
                       stdout=subprocess.DEVNULL)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    random.seed(seed)
    print(f"stop_paths: {args.sanitizer} sanitizer, {args.dstrain}, seed {seed}, {args.rounds} round(s)", flush=True)
    if args.sanitizer == "address":
        # Leaks are not checked: MPI's libraries hold memory to exit by design, and their
        # components are unloaded before the report, which then cannot name them.
        os.environ["ASAN_OPTIONS"] = "detect_leaks=0:halt_on_error=1:detect_stack_use_after_return=0"
    else:
        os.environ["TSAN_OPTIONS"] = f"suppressions={os.path.join(HERE, 'tsan.supp')}:halt_on_error=0:history_size=7"
    work = tempfile.mkdtemp(prefix=f"dstrain_stop_{args.sanitizer}_")
    failures = []
    started = time.monotonic()
    try:
        for rnd in range(1, args.rounds + 1):
            for i, layout in enumerate(args.layouts.split(",")):
                # USR1 and TERM alternate over the layouts and rounds.
                sig = signal.SIGUSR1 if (i + rnd) % 2 else signal.SIGTERM
                scenario_signal(args, work, layout, sig, rnd, failures)
            scenario_error(args, work, "zero0", one_rank=False, rnd=rnd, failures=failures)
            scenario_error(args, work, "zero3", one_rank=False, rnd=rnd, failures=failures)
            scenario_error(args, work, "pp_1f1b", one_rank=True, rnd=rnd, failures=failures)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"stop_paths: {len(failures)} failure(s) in {time.monotonic() - started:.0f} s (seed {seed})"
          + (": " + ", ".join(failures) if failures else ""), flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
