"""The CPU batch script (slurm/dstrain-cpu.sbatch) against a real Slurm (slurmctld + slurmd on
this machine, started by .ci/local-slurm): (a) a normal run; (b) SIGUSR1 -> checkpoint ->
requeue -> resume -> completion; (c) a killed rank -> restart from the checkpoint ->
completion; (d) a hung rank -> the watchdog ends the job within its deadline. In (a)-(c) the
final weights and optimizer state are bitwise identical (every tensor's crc32).

    /usr/bin/python3 tests/slurm/test_batch.py BUILD_DIR
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None
STEPS = 1500
DEADLINE = 10  # seconds: resilience.collective_timeout_s of the hang test


def sh(*args, check=True):
    return subprocess.run(args, capture_output=True, text=True, check=check).stdout


def job_field(jid, field):
    m = re.search(rf"\b{field}=(\S+)", sh("scontrol", "show", "job", str(jid), check=False))
    return m.group(1) if m else None


class BatchScript(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if subprocess.run(["sinfo", "-h"], capture_output=True).returncode != 0:
            raise RuntimeError("no Slurm controller answers; start one with: .ci/local-slurm start")
        subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), BUILD], check=True, stdout=subprocess.DEVNULL)
        cls.dir = tempfile.mkdtemp(prefix="dstrain_slurm_")
        cls.reference = None

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def config(self, name, **resilience):
        cfg = {
            "model": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 2, "vocab_size": 260, "max_position_embeddings": 64,
                      "bos_token_id": 256, "eos_token_id": 257},
            "train": {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "max_steps": STEPS,
                      "steps_per_print": 50, "seed": 5, "gradient_clipping": 1.0,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.1}}},
            "data": {"format": "megatron", "train": os.path.join(ROOT, "data/fortunes/fortunes_text_document"),
                     "seq_len": 64},
            "output": {"dir": os.path.join(self.dir, name)},
            "checkpoint": {"interval_steps": 100, "keep_last": 2},
            "resilience": {"collective_timeout_s": 60, **resilience},
        }
        path = os.path.join(self.dir, name + ".json")
        with open(path, "w") as f:
            json.dump(cfg, f)
        return path

    def submit(self, name, config, **env):
        log = os.path.join(self.dir, name + ".log")
        jid = subprocess.run(
            ["sbatch", "--parsable", f"--output={log}", f"--job-name={name}",
             os.path.join(ROOT, "slurm", "dstrain-cpu.sbatch")],
            capture_output=True, text=True, check=True, cwd=ROOT,
            env=dict(os.environ, DSTRAIN_CONFIG=config, DSTRAIN_BIN=os.path.join(BUILD, "app", "dstrain"),
                     **env)).stdout.strip()
        return jid, log

    def wait(self, jid, log, timeout=240, on_log=None):
        """Polls until the job ends; a requeued job is started at once (Slurm would wait ~2 min)."""
        t0 = time.monotonic()
        pending_since = None
        while time.monotonic() - t0 < timeout:
            state = job_field(jid, "JobState")
            if on_log and os.path.exists(log):
                on_log(open(log).read())
            if state == "PENDING" and job_field(jid, "Reason") == "BeginTime":
                pending_since = pending_since or time.monotonic()
                if time.monotonic() - pending_since > 3:  # let the node finish the old job step
                    sh("scontrol", "update", f"jobid={jid}", "StartTime=now", check=False)
            else:
                pending_since = None
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                return state, open(log).read()
            time.sleep(0.2)
        sh("scancel", str(jid), check=False)
        self.fail(f"job {jid} did not end within {timeout} s:\n" + (open(log).read() if os.path.exists(log) else ""))

    def final_crcs(self, name):
        path = os.path.join(self.dir, name, "checkpoints", f"step_{STEPS:08d}.h5")
        out = sh(os.path.join(BUILD, "app", "dstrain-ckpt"), "info", path)
        crcs = dict(re.findall(r"^(\S+\s+\S+)\s+\(.*?\)\s+\d+\s+([0-9a-f]{8})\s+ok$", out, re.M))
        self.assertGreater(len(crcs), 20, out)
        return crcs

    def reference_crcs(self):
        if BatchScript.reference is None:
            self.test_a_normal_run()
        return BatchScript.reference

    def test_a_normal_run(self):
        if BatchScript.reference is not None:
            return
        jid, log = self.submit("normal", self.config("normal"))
        state, text = self.wait(jid, log)
        self.assertEqual(state, "COMPLETED", text)
        self.assertIn(f"=== training complete (completed {STEPS})", text)
        self.assertIn("2 ranks on 1 node", text)
        self.assertIn(f"step   {STEPS}/{STEPS}", text)
        BatchScript.reference = self.final_crcs("normal")

    def test_b_sigusr1_checkpoints_requeues_and_resumes(self):
        ref = self.reference_crcs()
        jid, log = self.submit("signal", self.config("signal"))
        sent = []

        def signal_once(text):
            if not sent and "step    300/" in text:
                sh("scancel", "--signal=USR1", "--batch", jid)
                sent.append(True)

        state, text = self.wait(jid, log, on_log=signal_once)
        self.assertEqual(state, "COMPLETED", text)
        self.assertTrue(sent, "the signal was never sent")
        self.assertIn("stop requested (signal 10)", text)
        self.assertIn("requeueing job", text)
        self.assertRegex(text, r"resumed from \S+step_\d{8}\.h5 at step \d+")
        self.assertEqual(job_field(jid, "Restarts"), "1")
        self.assertEqual(self.final_crcs("signal"), ref)

    def test_c_killed_rank_restarts_from_the_checkpoint(self):
        ref = self.reference_crcs()
        cfg = self.config("kill", fault={"rank": 1, "kill_at_step": 250})
        jid, log = self.submit("kill", cfg)
        state, text = self.wait(jid, log)
        self.assertEqual(state, "COMPLETED", text)
        self.assertIn("fault injection: rank 1 kills itself at step 250", text)
        self.assertIn("restarting from the newest valid checkpoint (1 of 3)", text)
        self.assertRegex(text, r"resumed from \S+step_00000200\.h5 at step 200")
        self.assertEqual(self.final_crcs("kill"), ref)

    def test_d_hung_rank_is_ended_by_the_watchdog(self):
        cfg = self.config("hang", collective_timeout_s=DEADLINE, fault={"rank": 1, "hang_at_step": 120})
        jid, log = self.submit("hang", cfg, DSTRAIN_MAX_RESTARTS="0")
        hung = []

        def note_hang(text):
            if not hung and "hangs at step 120" in text:
                hung.append(time.monotonic())

        state, text = self.wait(jid, log, on_log=note_hang)
        ended = time.monotonic()
        self.assertEqual(state, "FAILED", text)
        self.assertTrue(hung, text)
        self.assertRegex(text, r"watchdog: \S+ #\d+ on communicator '\w+' has run for [0-9.]+ s, past its deadline")
        self.assertIn("giving up", text)
        elapsed = ended - hung[0]
        print(f"hang noticed, job ended {elapsed:.1f} s later (deadline {DEADLINE} s)")
        self.assertLess(elapsed, DEADLINE + 20)

    def test_e_scripts_refuse_to_run_outside_slurm(self):
        for script in ("dstrain-cpu.sbatch", "dstrain-gpu.sbatch"):
            env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
            p = subprocess.run([os.path.join(ROOT, "slurm", script)], capture_output=True, text=True, env=env)
            self.assertEqual(p.returncode, 2, script)
            self.assertIn("not running under Slurm", p.stderr)
            self.assertIn("sbatch", p.stderr)

    def test_f_sweep_submits_a_job_array_per_node_count(self):
        cfg = self.config("sweep")
        with open(cfg) as f:
            c = json.load(f)
        c["train"]["max_steps"] = 20
        with open(cfg, "w") as f:
            json.dump(c, f)
        out = subprocess.run([os.path.join(ROOT, "slurm", "sweep-nodes.sh"), cfg, "1", "2",
                              os.path.join(ROOT, "slurm", "dstrain-cpu.sbatch")], cwd=self.dir, capture_output=True,
                             text=True, check=True, env=dict(os.environ, DSTRAIN_BIN=os.path.join(BUILD, "app",
                                                                                                   "dstrain"))).stdout
        array = re.search(r"job array (\d+)", out).group(1)
        for task in ("0", "1"):
            state, text = self.wait(f"{array}_{task}", os.path.join(self.dir, "runs", "sweep",
                                                                     f"slurm-1n-{array}_{task}.out"))
            self.assertEqual(state, "COMPLETED", text)
            metrics = os.path.join(self.dir, "runs", "sweep", f"1n-{task}", "metrics.jsonl")
            self.assertEqual(sum(1 for l in open(metrics) if '"train"' in l), 20)

    def test_g_gpu_script_runs_the_same_loop(self):
        # No GPUs here: the GPU layout is overridden on the command line, as users do for tests.
        cfg = self.config("gpu")
        with open(cfg) as f:
            c = json.load(f)
        c["train"]["max_steps"] = 30
        with open(cfg, "w") as f:
            json.dump(c, f)
        log = os.path.join(self.dir, "gpu.log")
        jid = subprocess.run(["sbatch", "--parsable", f"--output={log}", "--nodes=1", "--ntasks-per-node=2",
                              "--cpus-per-task=1", "--gpus-per-node=0", os.path.join(ROOT, "slurm", "dstrain-gpu.sbatch")],
                             capture_output=True, text=True, check=True, cwd=ROOT,
                             env=dict(os.environ, DSTRAIN_CONFIG=cfg,
                                      DSTRAIN_BIN=os.path.join(BUILD, "app", "dstrain"))).stdout.strip()
        state, text = self.wait(jid, log)
        self.assertEqual(state, "COMPLETED", text)
        self.assertIn("=== dstrain-gpu job", text)
        self.assertIn("=== training complete (completed 30)", text)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
