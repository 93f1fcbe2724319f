"""The schedule timeline end to end: two ranks train with metrics.timeline_steps, each writes
timeline.rank{r}.jsonl with the recorded steps' forwards, backwards and reductions on a shared
clock, and validation/plot_pipeline.py turns them into a bubble report, a Chrome trace and a
Gantt chart.

    /usr/bin/python3 tests/e2e/test_timeline.py BUILD_DIR
"""

import json
import os
import re
import shutil
import subprocess
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_cli  # noqa: E402

BUILD = None
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMP_NUM_THREADS": "1"}


class Timeline(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        test_cli.BUILD = BUILD
        test_cli.CommandLine.setUpClass.__func__(cls)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_two_ranks_record_steps_and_the_script_reports_and_draws_them(self):
        out = os.path.join(self.dir, "timeline")
        # gradient_accumulation_steps 2 (the shared config): F0 B0 F1 B1 then the reduction.
        cmd = ["mpirun", "-np", "2", os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config,
               "--max-steps", "4", "--set", f'output.dir="{out}"', "metrics.timeline_steps=[2,4]",
               "train.eval_interval=0", "metrics.progress=lines"]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        for rank in range(2):
            with open(os.path.join(out, f"timeline.rank{rank}.jsonl")) as f:
                lines = [json.loads(line) for line in f]
            head, events = lines[0], lines[1:]
            self.assertEqual((head["type"], head["rank"], head["world"]), ("timeline", rank, 2))
            self.assertEqual((head["stages"], head["micro_batches"]), (1, 2))
            for step in (2, 4):
                got = [(e["kind"], e["micro_batch"]) for e in events if e["step"] == step]
                self.assertEqual(got, [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("reduce", -1)], f"rank {rank}")
            self.assertEqual({e["step"] for e in events}, {2, 4}, "steps 1 and 3 were not asked for")
            starts = [e["start"] for e in events]
            self.assertEqual(starts, sorted(starts))
            self.assertTrue(all(e["end"] >= e["start"] for e in events))

        png, trace = os.path.join(out, "t.png"), os.path.join(out, "t.json")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "plot_pipeline.py"), out, "--png", png,
                            "--trace", trace], capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rows = re.findall(r"^ +(\d+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", p.stdout, re.M)
        self.assertEqual([int(r[0]) for r in rows], [2, 4], p.stdout)
        for _, span_ms, measured, analytic in rows:
            self.assertGreater(float(span_ms), 0)
            self.assertTrue(0 <= float(measured) < 1, p.stdout)
            self.assertEqual(float(analytic), 0.0, "one stage: no pipeline bubble")
        with open(trace) as f:
            events = [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]
        self.assertEqual(len(events), 2 * 2 * 5)
        self.assertEqual({e["pid"] for e in events}, {0, 1})
        self.assertTrue(all(e["dur"] >= 0 and e["ts"] >= 0 for e in events))
        with open(png, "rb") as f:
            self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_pipeline_stages_record_sends_and_receives_and_the_analytic_bubble(self):
        out = os.path.join(self.dir, "pipeline")
        # Two pipeline stages, 1F1B over the shared config's 2 micro-batches: rank 0 runs F0 F1 B0 B1
        # (one warm-up forward), rank 1 F0 B0 F1 B1, with the activations and gradients between them.
        cmd = ["mpirun", "-np", "2", os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config,
               "--max-steps", "2", "--set", f'output.dir="{out}"', "metrics.timeline_steps=[2]",
               "parallel.pipeline=2", 'parallel.schedule="1f1b"', "train.eval_interval=0", "metrics.progress=lines"]
        # (The sample printed at the end may cut a UTF-8 sequence.)
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=dict(os.environ, **MPI_ENV),
                           timeout=300)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("pipeline: 2 stages over 2 ranks, schedule 1f1b", p.stdout + p.stderr)
        want = {0: [("F", 0), ("F", 1), ("B", 0), ("B", 1)], 1: [("F", 0), ("B", 0), ("F", 1), ("B", 1)]}
        for rank in range(2):
            with open(os.path.join(out, f"timeline.rank{rank}.jsonl")) as f:
                lines = [json.loads(line) for line in f]
            head, events = lines[0], lines[1:]
            self.assertEqual((head["stage"], head["stages"], head["schedule"]), (rank, 2, "1f1b"))
            compute = [(e["kind"], e["micro_batch"]) for e in events if e["kind"] in ("F", "B")]
            self.assertEqual(compute, want[rank], f"rank {rank}")
            # Stage 0 sends activations and receives gradients; stage 1 the other way round.
            sends = [e for e in events if e["kind"] == "send"]
            recvs = [e for e in events if e["kind"] == "recv"]
            self.assertEqual(len(sends), 2, f"rank {rank}: {events}")
            self.assertEqual(len(recvs), 2, f"rank {rank}: {events}")
            self.assertTrue(all(e["peer"] == 1 - rank for e in sends + recvs))
        p = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "plot_pipeline.py"), out],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        rows = re.findall(r"^ +(\d+) +([0-9.]+) +([0-9.]+) +([0-9.]+)$", p.stdout, re.M)
        self.assertEqual(len(rows), 1, p.stdout)
        self.assertAlmostEqual(float(rows[0][3]), 1 / 3, places=3)  # (P-1)/(m+P-1), P = m = 2

    def test_a_hung_pipeline_stage_ends_every_rank_through_the_watchdog(self):
        # Stage 1 stops at step 2; stage 0, mid-schedule, waits for its gradient: the watchdog ends
        # the job within the deadline instead of letting it hang.
        deadline = 5
        cmd = ["mpirun", "-np", "2", os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config,
               "--max-steps", "3", "--set", f'output.dir="{os.path.join(self.dir, "hang")}"',
               "parallel.pipeline=2", "train.eval_interval=0", "metrics.progress=lines",
               f"resilience.collective_timeout_s={deadline}", 'resilience.fault={"rank": 1, "hang_at_step": 2}']
        import time
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=dict(os.environ, **MPI_ENV),
                           timeout=300)
        elapsed = time.monotonic() - t0
        text = p.stdout + p.stderr
        self.assertNotEqual(p.returncode, 0, text)
        self.assertIn("fault injection: rank 1 hangs at step 2", text)
        self.assertRegex(text, r"watchdog: .*on communicator 'pipeline'.*past its deadline")
        self.assertLess(elapsed, deadline + 60, text)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
