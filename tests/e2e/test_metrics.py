"""Observability during a real run: the Prometheus endpoint is scraped over loopback while
dstrain trains and must parse as Prometheus text format with the expected metrics; every
record of metrics.jsonl follows its schema; the summary table and the plots come out.

    /usr/bin/python3 tests/e2e/test_metrics.py BUILD_DIR
"""

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import unittest
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_cli  # noqa: E402

BUILD = None
NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
SAMPLE = re.compile(rf'^({NAME})(\{{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*"(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*")*)?\}})? (\S+)$')


def parse_prometheus(text):
    """Parses the text exposition format strictly; returns {name: [(labels, value)]} and types."""
    samples, types, helps = {}, {}, {}
    for n, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            assert re.fullmatch(NAME, name), f"line {n}: bad HELP name {name!r}"
            helps[name] = doc
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), f"line {n}: type {kind!r}"
            assert name not in types, f"line {n}: {name} typed twice"
            types[name] = kind
        elif line.startswith("#"):
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"line {n} is not a sample: {line!r}"
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            assert name in types, f"line {n}: {name} has no TYPE before its samples"
            v = float(value)  # also accepts NaN, +Inf
            samples.setdefault(name, []).append((labels, v))
    for name, kind in types.items():
        if kind == "counter":
            assert name.endswith("_total") or name == "dstrain_step", f"counter {name} should end in _total"
    return samples, types, helps


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Observability(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        test_cli.BUILD = BUILD
        test_cli.CommandLine.setUpClass.__func__(cls)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_endpoint_jsonl_summary_and_plots(self):
        port = free_port()
        out = os.path.join(self.dir, "observed")
        cmd = [os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--max-steps", "400",
               "--set", f'output.dir="{out}"', f"metrics.prometheus_port={port}",
               "metrics.progress=lines", "train.eval_interval=200", "checkpoint.interval_steps=150"]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        scrapes = []
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and len(scrapes) < 2:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    self.assertEqual(r.status, 200)
                    self.assertTrue(r.headers["Content-Type"].startswith("text/plain; version=0.0.4"))
                    text = r.read().decode()
                samples, types, helps = parse_prometheus(text)
                if "dstrain_step" in samples and samples["dstrain_step"][0][1] >= 5 + 50 * len(scrapes):
                    scrapes.append((samples, types, helps))
            except (ConnectionError, OSError):
                pass
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=300)
        self.assertEqual(proc.returncode, 0, stderr)
        self.assertEqual(len(scrapes), 2, "the endpoint was never scraped during training")
        # Loopback by default, and the log says so.
        self.assertIn(f"Prometheus endpoint on http://127.0.0.1:{port}/metrics (this host only;", stdout + stderr)
        (first, types, helps), (second, _, _) = scrapes
        self.assertGreater(second["dstrain_step"][0][1], first["dstrain_step"][0][1])
        for name in ("dstrain_loss", "dstrain_learning_rate", "dstrain_grad_norm", "dstrain_tokens_per_second",
                     "dstrain_model_flops_per_second", "dstrain_mfu_ratio", "dstrain_step_duration_seconds",
                     "dstrain_memory_bytes", "dstrain_peak_rss_bytes", "dstrain_tokens_total",
                     "dstrain_skipped_steps_total", "dstrain_rank_step_duration_seconds", "dstrain_mfu_above_peak"):
            self.assertIn(name, second, name)
            self.assertIn(name, helps)
        self.assertEqual(types["dstrain_tokens_total"], "counter")
        phases = {labels for labels, _ in second["dstrain_step_duration_seconds"]}
        self.assertEqual(phases, {f'{{phase="{p}"}}' for p in ("total", "data_wait", "forward", "backward",
                                                                "exposed_comm", "optimizer", "checkpoint", "other")})
        memory = {labels: v for labels, v in second["dstrain_memory_bytes"]}
        self.assertGreater(memory['{category="parameters"}'], 0)
        self.assertGreater(memory['{category="activations"}'], 0)
        self.assertTrue(0 < second["dstrain_mfu_ratio"][0][1] < 1)

        # metrics.jsonl: every record has its schema.
        records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        kinds = [r["type"] for r in records]
        # The head: the job's build and libraries, and where the peak came from.
        self.assertEqual(kinds[0], "environment")
        for key in ("dstrain_version", "commit", "compiler", "mpi", "hdf5", "blas", "gemm", "omp_threads", "cpu_model",
                    "cpu_features", "blas_kernels", "world_size", "hosts"):
            self.assertIn(key, records[0]["environment"])
        self.assertRegex(records[0]["peak_source"], r"^measured: best of \d+ trials of sgemm \d+x\d+x\d+ on 1 threads \((dstrain's thread split over )?(oneDNN|OpenBLAS) [\d.]+( and OpenBLAS [\d.]+)? sgemm\)$")
        self.assertEqual(kinds.count("train"), 400)
        self.assertEqual(kinds.count("eval"), 2)
        self.assertEqual(kinds.count("checkpoint"), 2)
        self.assertEqual(kinds[-1], "summary")
        schema = {"step": int, "loss": float, "lr": float, "grad_norm": float, "tokens_per_s": float,
                  "model_flops_per_s": float, "mfu": float, "tokens": int, "elapsed_s": float, "step_time_s": float,
                  "time_s": dict, "memory_bytes": dict, "peak_rss_bytes": float, "rank_step_time_s": list,
                  "step_time_max_s": float, "step_time_min_s": float, "step_time_mean_s": float, "slowest_rank": int,
                  "skipped": bool, "skipped_total": int, "data_wait_s": float, "exposed_comm_time_s": float,
                  "mfu_above_peak": bool, "peak_flops": float}
        for r in (r for r in records if r["type"] == "train"):
            for key, kind in schema.items():
                self.assertIn(key, r)
                self.assertIsInstance(r[key], (int, float) if kind is float else kind, key)
            parts = sum(r["time_s"].values())
            self.assertAlmostEqual(parts, r["step_time_s"], delta=1e-6 + 1e-9 * r["step_time_s"])
            self.assertTrue(all(v >= 0 for v in r["time_s"].values()))
            self.assertTrue(math.isfinite(r["loss"]))
            # No step runs above the peak: a reading over 100% is flagged as a wrong peak.
            self.assertEqual(r["mfu_above_peak"], r["mfu"] > 1, r)
        steps = [r["step"] for r in records if r["type"] == "train"]
        self.assertEqual(steps, list(range(1, 401)))
        for r in (r for r in records if r["type"] == "checkpoint"):
            self.assertIsInstance(r["stall_s"], float)
        # The summary table and the progress lines.
        self.assertIn("run summary", stdout)
        for row in ("MFU", "data wait", "exposed communication", "peak memory / budget", "load imbalance"):
            self.assertIn(row, stdout)
        mfu_row = re.search(r"^MFU .* ([0-9.]+)% .*$", records[-1]["table"], re.M)
        above = sum(r["mfu_above_peak"] for r in records if r["type"] == "train")
        self.assertEqual("above 100%" in mfu_row.group(0), above > 0, mfu_row.group(0))
        if above:
            self.assertFalse(mfu_row.group(0).endswith(" ok"), mfu_row.group(0))
        self.assertRegex(records[-1]["table"], r"peak: [0-9.]+ GFLOP/s per rank, (re-)?measured")
        self.assertRegex(stdout, r"step +400/400 \| loss [0-9.]+ .* \| MFU [0-9.]+% \| elapsed .* \| eta 00:00:00")
        # Plots from the JSONL.
        plots = os.path.join(self.dir, "plots")
        subprocess.run(["/usr/bin/python3", os.path.join(ROOT, "validation", "plot_metrics.py"),
                        os.path.join(out, "metrics.jsonl"), plots], check=True, capture_output=True)
        for name in ("loss.png", "throughput.png", "time_split.png"):
            with open(os.path.join(plots, name), "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n", name)

    def test_a_peak_below_what_steps_reach_is_a_warning_never_ok(self):
        out = os.path.join(self.dir, "low_peak")
        p = subprocess.run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--max-steps", "6",
                            "--set", f'output.dir="{out}"', "metrics.peak_tflops=1e-6", "metrics.progress=lines"],
                           capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("peak 0.0 GFLOP/s per rank (from config metrics.peak_tflops)", p.stdout)
        self.assertRegex(p.stdout, r"MFU [0-9.]+% \(above 100%: peak too low\)")
        self.assertIn("is too low and MFU means nothing until it is right; correct metrics.peak_tflops", p.stderr)
        self.assertRegex(p.stdout, r"MFU \(model FLOP/s over the peak\) .* CHECK: 6 step\(s\) above 100%, the peak is "
                                   r"too low\n")
        records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
        self.assertTrue(all(r["mfu_above_peak"] for r in records if r["type"] == "train"))
        self.assertIn("warning", [r["type"] for r in records])
        self.assertNotIn("peak", [r["type"] for r in records], "a configured peak is not measured again")
        # A peak that is not a positive number is an error naming the key.
        bad = subprocess.run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--set",
                              f'output.dir="{out}_bad"', 'metrics.peak_tflops="fast"'], capture_output=True, text=True)
        self.assertNotEqual(bad.returncode, 0)
        self.assertIn("'metrics.peak_tflops' must be a number", bad.stderr)

    def test_a_port_in_use_is_a_clear_error(self):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = s.getsockname()[1]
            p = subprocess.run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--set",
                                f'output.dir="{os.path.join(self.dir, "busy")}"', f"metrics.prometheus_port={port}"],
                               capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(f"cannot listen on 127.0.0.1:{port}", p.stderr)
        # The key of older configurations names its new name.
        p = subprocess.run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--set",
                            f'output.dir="{os.path.join(self.dir, "renamed")}"', 'metrics.prometheus_host="0.0.0.0"'],
                           capture_output=True, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("'metrics.prometheus_host' was renamed metrics.prometheus_bind", p.stderr)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
