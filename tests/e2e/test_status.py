"""`dstrain status RUN_DIR` against real runs: a live run watched in tmux (alive with its pid, the
step advancing, the loss sparkline, tokens/s, a valid checkpoint), the same run finished; --json
on both; a run killed under a Slurm job id (requeued), resumed as the requeued job, then stopped
by SIGTERM; a damaged newest checkpoint; a live writer's partial last line; the bottleneck table
computed from the records equal to the run's own summary; a 2-rank job's per-rank step times;
the errors for a missing directory. Nothing is written in RUN_DIR.

    /usr/bin/python3 tests/e2e/test_status.py BUILD_DIR
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_cli  # noqa: E402

BUILD = None
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"}
# A dense model slow enough (tens of ms a step on one thread) to be caught running.
MODEL = dict(test_cli.MODEL, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
SPARK = set("▁▂▃▄▅▆▇█")
WAIT = 120  # seconds: far beyond what these runs need, far below a hang


def wait_for(what, condition, timeout=WAIT, every=0.1):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def train_records(out):
    path = os.path.join(out, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n"):
                records.append(json.loads(line))
    return [r for r in records if r["type"] == "train"]


def checkpoints(out):
    d = os.path.join(out, "checkpoints")
    return sorted(f for f in os.listdir(d) if re.fullmatch(r"step_\d+\.h5", f)) if os.path.isdir(d) else []


def snapshot(directory):
    """Every file under `directory` with its size and modification time."""
    found = {}
    for root, _, files in os.walk(directory):
        for f in files:
            st = os.stat(os.path.join(root, f))
            found[os.path.relpath(os.path.join(root, f), directory)] = (st.st_size, st.st_mtime_ns)
    return found


class Status(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_status_")
        test_cli.prepare_corpus(cls.dir, BUILD)
        with open(os.path.join(cls.dir, "model.json"), "w") as f:
            json.dump(MODEL, f)
        cls.config = os.path.join(cls.dir, "run.json")
        with open(cls.config, "w") as f:
            json.dump({
                "model": os.path.join(cls.dir, "model.json"),
                "train": {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                          "gradient_clipping": 1.0, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
                          "steps_per_print": 1, "max_steps": 300, "seed": 7, "eval_interval": 50,
                          "eval_batches": 1},
                "data": {"train": os.path.join(cls.dir, "corpus_train_*.bin"),
                         "val": os.path.join(cls.dir, "corpus_val_*.bin"), "seq_len": 64},
                "checkpoint": {"interval_steps": 20, "keep_last": 3},
                "metrics": {"progress": "lines"},
            }, f)
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        cls.tmux = ["tmux", "-S", os.path.join(cls.dir, "tmux.sock")]  # a server of our own

    @classmethod
    def tearDownClass(cls):
        # Our own tmux server only (its own socket), never another one.
        subprocess.run([*cls.tmux, "kill-server"], capture_output=True)
        shutil.rmtree(cls.dir)

    def start(self, out, *extra, env=None, mpi=0):
        cmd = [self.dstrain, "train", "--config", self.config, "--set", f'output.dir="{out}"', *extra]
        if mpi:
            cmd = ["mpirun", "-np", str(mpi), *cmd]
        log = os.path.join(self.dir, os.path.basename(out) + f".{time.monotonic_ns()}.log")
        with open(log, "w") as f:
            p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, **MPI_ENV, **(env or {})))
        p.log = log
        self.addCleanup(self.end, p)  # a failed test leaves no run behind
        return p

    @staticmethod
    def end(p):
        if p.poll() is None:
            p.terminate()  # mpirun passes SIGTERM on to its ranks
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def finish(self, p, expected_rc):
        try:
            rc = p.wait(timeout=WAIT)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        with open(p.log) as f:
            self.assertEqual(rc, expected_rc, f.read()[-3000:])

    def status(self, out, *args, rc=0):
        p = subprocess.run([self.dstrain, "status", out, *args], capture_output=True, text=True,
                           env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=60)
        self.assertEqual(p.returncode, rc, p.stdout + p.stderr)
        return p

    def status_json(self, out):
        return json.loads(self.status(out, "--json").stdout)

    def capture(self, session):
        return subprocess.run([*self.tmux, "capture-pane", "-p", "-t", session],
                              capture_output=True, text=True, check=True).stdout

    def screen_step(self, screen):
        found = re.search(r"^step +(\d+) / (\d+) ", screen, re.M)
        self.assertTrue(found, screen)
        return int(found.group(1)), int(found.group(2))

    def test_live_run_in_tmux_then_finished(self):
        out = os.path.join(self.dir, "live")
        p = self.start(out)
        wait_for("3 steps and a checkpoint", lambda: len(train_records(out)) >= 3 and checkpoints(out))
        session = "live"
        subprocess.run([*self.tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "50",
                        f"env OMP_NUM_THREADS=1 {self.dstrain} status --watch 1 {out}"], check=True)
        first = wait_for("the first screen", lambda: (s := self.capture(session)) and "state" in s and s)
        time.sleep(2.5)
        second = self.capture(session)
        for screen in (first, second):
            self.assertIn(f"running: pid {p.pid} on ", screen)
            self.assertIn("this host; checked with kill(pid, 0)", screen)
            loss = re.search(r"^loss +(\S+)  last ([0-9.]+)  min ([0-9.]+)", screen, re.M)
            self.assertTrue(loss, screen)
            self.assertTrue(set(loss.group(1)) <= SPARK and len(loss.group(1)) >= 3, loss.group(1))
            self.assertRegex(screen, r"throughput +[0-9]+ tok/s   MFU [0-9.]+%")
            self.assertRegex(screen, r"(?m)^checkpoint +step \d+, written .* ago: valid \(.*\n +\S+/step_\d{8}\.h5$")
            self.assertIn("bottlenecks: the end-of-run summary's rows over the", screen)
            self.assertRegex(screen, r"MFU \(model FLOP/s over the peak\) +[0-9.]+%")
        (a, max_steps), (b, _) = self.screen_step(first), self.screen_step(second)
        self.assertEqual(max_steps, 300)
        self.assertGreater(b, a, "the step advances between two captures 2.5 s apart")
        self.assertLess(b, 300, "captured while running")

        live = self.status_json(out)
        self.assertEqual(live["state"], "running")
        self.assertIs(live["alive"], True)
        self.assertEqual(live["lock"]["pid"], p.pid)
        self.assertTrue(live["lock"]["this_host"])
        self.assertEqual(live["max_steps"], 300)
        self.assertGreaterEqual(live["step"], b)
        self.assertIsNotNone(live["eta_s"])
        self.assertGreater(live["tokens_per_s"], 0)
        self.assertGreater(live["mfu"], 0)
        self.assertTrue(set(live["loss"]["sparkline"]) <= SPARK)
        self.assertTrue(live["checkpoint"]["valid"])
        self.assertEqual(live["checkpoint"]["step"] % 20, 0)
        self.assertEqual(live["bottlenecks"]["source"], "records")
        self.assertIn("MFU (model FLOP/s over the peak)", [r["metric"] for r in live["bottlenecks"]["rows"]])
        self.assertEqual(len(live["ranks"]["step_time_s"]), 1)

        self.finish(p, 0)
        time.sleep(2.5)  # a redraw after the end: --watch keeps going
        final = self.capture(session)
        self.assertIn("finished at step 300, with its summary", final)
        self.assertEqual(self.screen_step(final), (300, 300))
        self.assertIn("bottlenecks: the run's end-of-run summary", final)
        subprocess.run([*self.tmux, "kill-session", "-t", session], check=True)

        before = snapshot(out)
        done = self.status_json(out)
        text = self.status(out).stdout
        self.assertEqual(snapshot(out), before, "dstrain status writes nothing in RUN_DIR")
        self.assertEqual(done["state"], "finished")
        self.assertEqual(done["step"], 300)
        self.assertIsNone(done["lock"], "the run released its lock")
        self.assertIsNone(done["eta_s"])
        self.assertEqual(done["checkpoint"]["step"], 300)
        self.assertTrue(done["checkpoint"]["valid"])
        self.assertEqual(done["eval"]["step"], 300)
        self.assertEqual(done["bottlenecks"]["source"], "summary")
        self.assertIn("finished at step 300", text)

        # The rows computed from the records are the run's own summary table.
        with open(os.path.join(out, "metrics.jsonl")) as f:
            summary = [json.loads(l) for l in f if '"summary"' in l][0]
        replay = os.path.join(self.dir, "replay")
        shutil.copytree(out, replay)
        with open(os.path.join(replay, "metrics.jsonl")) as f:
            lines = [l for l in f if '"type":"summary"' not in l.replace(" ", "")]
        with open(os.path.join(replay, "metrics.jsonl"), "w") as f:
            f.writelines(lines)
        replayed = self.status_json(replay)
        self.assertEqual(replayed["bottlenecks"]["source"], "records")
        self.assertEqual(replayed["bottlenecks"]["table"], summary["table"])
        self.assertEqual(replayed["state"], "failed", "ended without a summary, lock released")

        # A live writer's partial last line is not an error, and not a step.
        with open(os.path.join(replay, "metrics.jsonl"), "a") as f:
            f.write('{"type": "train", "step": 301, "loss": 1.')
        partial = self.status_json(replay)
        self.assertEqual(partial["step"], 300)
        self.assertEqual(partial["unreadable_lines"], 0)

        # A damaged newest checkpoint (cut short) is not valid; --resume auto's choice is named.
        damaged = os.path.join(self.dir, "damaged")
        shutil.copytree(out, damaged)
        newest = os.path.join(damaged, "checkpoints", "step_00000300.h5")
        with open(newest, "r+b") as f:
            f.truncate(os.path.getsize(newest) // 2)
        bad = self.status_json(damaged)
        self.assertFalse(bad["checkpoint"]["valid"])
        self.assertEqual(bad["checkpoint"]["step"], 300)
        self.assertTrue(bad["checkpoint"]["problem"])
        self.assertEqual(bad["checkpoint"]["newest_valid"]["step"], 280)
        text = self.status(damaged).stdout
        self.assertRegex(text, r"checkpoint +step 300, written .* ago: NOT VALID: ")
        self.assertIn("newest valid: step 280", text)
        # A file whose step is not the one its name says (copied or renamed by hand).
        renamed = os.path.join(damaged, "checkpoints", "step_00000290.h5")
        shutil.copyfile(os.path.join(damaged, "checkpoints", "step_00000280.h5"), renamed)
        os.remove(newest)
        bad = self.status_json(damaged)
        self.assertEqual(bad["checkpoint"]["step"], 290)
        self.assertFalse(bad["checkpoint"]["valid"])
        self.assertIn("step 280", bad["checkpoint"]["problem"])

        # A lock of another host: its pid cannot be checked from here; the last record's age judges.
        elsewhere = os.path.join(self.dir, "elsewhere")
        shutil.copytree(out, elsewhere)
        with open(os.path.join(elsewhere, "metrics.jsonl")) as f:
            lines = [l for l in f if '"type":"summary"' not in l.replace(" ", "")]
        with open(os.path.join(elsewhere, "metrics.jsonl"), "w") as f:
            f.writelines(lines)
        with open(os.path.join(elsewhere, "dstrain.lock"), "w") as f:
            json.dump({"host": "another-node", "pid": 12345, "started": "2026-01-01T00:00:00Z"}, f)
        s = self.status_json(elsewhere)
        self.assertEqual(s["state"], "running")
        self.assertIsNone(s["alive"])
        self.assertIn("running: pid 12345 on another-node, another host, not checked from this one",
                      s["state_detail"])
        an_hour_ago = time.time() - 3630
        os.utime(os.path.join(elsewhere, "metrics.jsonl"), (an_hour_ago, an_hour_ago))
        s = self.status_json(elsewhere)
        self.assertEqual(s["state"], "unknown")
        self.assertIn("the last record is 1 h 0 min old: it may have died", s["state_detail"])

    def test_killed_in_a_slurm_job_requeued_then_stopped_by_sigterm(self):
        out = os.path.join(self.dir, "requeue")
        slurm = {"SLURM_JOB_ID": "4242", "SLURM_RESTART_COUNT": "0"}
        first = self.start(out, "--max-steps", "2000", env=slurm)
        wait_for("a checkpoint", lambda: checkpoints(out) and len(train_records(out)) >= 25)
        first.send_signal(signal.SIGKILL)
        self.finish(first, -signal.SIGKILL)
        s = self.status_json(out)
        self.assertEqual(s["state"], "requeued")
        self.assertIs(s["alive"], False)
        self.assertEqual(s["lock"]["pid"], first.pid)
        self.assertEqual(s["slurm"], {"job_id": "4242", "restart_count": 0})
        self.assertIn("Slurm job 4242's run (pid", self.status(out).stdout)
        killed_at = s["step"]

        # The requeued job (Slurm's restart count 1) takes the lock over and resumes.
        second = self.start(out, "--max-steps", "2000", "--resume", "auto", env=dict(slurm, SLURM_RESTART_COUNT="1"))
        resumed = wait_for("the resumed run's steps", lambda: (s := self.status_json(out))["starts"] == 2 and
                           s["state"] == "running" and s["step"] is not None and s["step"] > killed_at and s)
        self.assertEqual(resumed["lock"]["pid"], second.pid)
        self.assertEqual(resumed["slurm"], {"job_id": "4242", "restart_count": 1})
        self.assertIn("Slurm job 4242, requeued 1 time(s)", resumed["state_detail"])
        self.assertIn("started 2 times in this directory", self.status(out).stdout)

        second.send_signal(signal.SIGTERM)
        self.finish(second, 75)
        s = self.status_json(out)
        self.assertEqual(s["state"], "stopped")
        self.assertLess(s["step"], 2000)
        self.assertEqual(s["checkpoint"]["step"], s["step"], "the stop saved a checkpoint at its step")
        self.assertTrue(s["checkpoint"]["valid"])
        self.assertIsNone(s["lock"])
        self.assertIn(f"stopped at step {s['step']} of 2000 by a stop signal", self.status(out).stdout)

    def test_two_ranks_show_each_ranks_step_time(self):
        out = os.path.join(self.dir, "two")
        p = self.start(out, "--max-steps", "30", mpi=2)
        self.finish(p, 0)
        s = self.status_json(out)
        self.assertEqual(s["state"], "finished")
        times = s["ranks"]["step_time_s"]
        self.assertEqual(len(times), 2)
        self.assertTrue(all(t > 0 for t in times))
        self.assertIn(s["ranks"]["slowest"], (0, 1))
        self.assertEqual(s["ranks"]["max_s"], max(times))
        text = self.status(out).stdout
        self.assertIn("over 2 rank(s)", text)
        for r in (0, 1):
            self.assertRegex(text, rf"(?m)^  rank {r} +{times[r]:.4f} s  =+")
        # Started under mpirun, only one rank prints.
        p = subprocess.run(["mpirun", "-np", "2", self.dstrain, "status", out, "--json"], capture_output=True,
                           text=True, env=dict(os.environ, **MPI_ENV), timeout=60)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(json.loads(p.stdout)["step"], 30)

    def test_expert_load_of_a_moe_run_with_expert_parallelism(self):
        import test_deepseek_cli
        config = os.path.join(self.dir, "moe.json")
        with open(os.path.join(self.dir, "moe_model.json"), "w") as f:
            json.dump(test_deepseek_cli.MODEL, f)
        with open(self.config) as f:
            c = json.load(f)
        c["model"] = os.path.join(self.dir, "moe_model.json")
        c["data"]["seq_len"] = 32
        c["train"].update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1, max_steps=6,
                          eval_interval=0)
        c["parallel"] = {"expert": 2}
        with open(config, "w") as f:
            json.dump(c, f)
        out = os.path.join(self.dir, "moe")
        p = subprocess.run(["mpirun", "-np", "2", self.dstrain, "train", "--config", config, "--set",
                            f'output.dir="{out}"'], capture_output=True, text=True, env=dict(os.environ, **MPI_ENV),
                           timeout=WAIT)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        last = train_records(out)[-1]
        load = max(v["max_over_mean_load"] for v in last["moe"].values())
        received = max(v["received_max_over_mean"] for v in last["moe"].values())
        layer = max(last["moe"], key=lambda k: last["moe"][k]["max_over_mean_load"])
        e = self.status_json(out)["experts"]
        self.assertEqual(e["max_over_mean_load"], load)
        self.assertEqual(e["max_over_mean_load_layer"], layer)
        self.assertEqual(e["received_max_over_mean"], received)
        self.assertEqual(e["expert_parallel_received_max_over_mean"], last["expert_parallel"]["received_max_over_mean"])
        self.assertGreater(received, 1.0, "two expert ranks never receive exactly alike here")
        text = self.status(out).stdout
        self.assertIn(f"experts     busiest expert {load:.2f} x the mean (layer {layer}), dead experts", text)
        self.assertIn(f"expert ranks received max {received:.2f} x the mean rows", text)
        self.assertIn("expert-parallel load (busiest rank over mean)", text, "the summary's MoE rows")

    def test_errors_name_the_path(self):
        missing = os.path.join(self.dir, "no_such_run")
        p = self.status(missing, rc=1)
        self.assertIn(f"{missing} does not exist", p.stderr)
        self.assertIn("output.dir", p.stderr)
        empty = os.path.join(self.dir, "empty")
        os.makedirs(empty)
        p = self.status(empty, rc=1)
        self.assertIn(f"{empty} holds no metrics.jsonl", p.stderr)
        self.assertEqual(os.listdir(empty), [])
        p = self.status(empty, "--watch", "0", rc=2)
        self.assertIn("--watch: expects a number of seconds >= 0.1, got '0'", p.stderr)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
