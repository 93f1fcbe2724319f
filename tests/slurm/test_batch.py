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
import statistics
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None
STEPS = 1500
DEADLINE = 10  # seconds: resilience.collective_timeout_s of the hang test
SWEEP_STEPS = 20  # steps of each run of the scaling sweeps
WARMUP = 3  # steps scaling_report.py leaves out at the start of each run


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

    def sweep(self, *args, check=True):
        p = subprocess.run([os.path.join(ROOT, "slurm", "sweep-nodes.sh"), *args], cwd=self.dir,
                           capture_output=True, text=True,
                           env=dict(os.environ, DSTRAIN_BIN=os.path.join(BUILD, "app", "dstrain")))
        if check:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def wait_sweep(self, out, stdout, repeats):
        """Waits for every run a sweep submitted; returns {run directory name: its Slurm log}."""
        logs = {}
        arrays = re.findall(r"job array (\d+) \((\d+) runs\) -> \S+/([\w-]+)-\*", stdout)
        self.assertTrue(arrays, stdout)
        for array, runs, name in arrays:
            self.assertEqual(int(runs), repeats, stdout)
            for task in range(repeats):
                log = os.path.join(out, f"slurm-{name}-{array}_{task}.out")
                state, text = self.wait(f"{array}_{task}", log)
                self.assertEqual(state, "COMPLETED", text)
                self.assertIn(f"=== training complete (completed {SWEEP_STEPS})", text)
                logs[f"{name}-{task}"] = text
        return logs

    def test_f_sweep_scaling_study(self):
        """Strong and weak sweeps over 1, 2 and 4 ranks of the one local node (ranks beyond its cores
        overcommitted), then validation/scaling_report.py over their metrics."""
        cfg = self.config("sweep")
        with open(cfg) as f:
            c = json.load(f)
        c["train"]["max_steps"] = SWEEP_STEPS  # global batch 8 = micro-batch 2 x accumulation x data-parallel ranks
        with open(cfg, "w") as f:
            json.dump(c, f)
        script = os.path.join(ROOT, "slurm", "dstrain-cpu.sbatch")
        out = os.path.join(self.dir, "runs", "scaling")
        cores = int(sh("sinfo", "-h", "-o", "%c").split()[0])

        # Bad arguments are refused before anything is submitted, with what to do.
        p = self.sweep("--mode", "fast", cfg, "1 2", check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--mode is 'fast'; it must be strong or weak", p.stderr)
        no_batch = os.path.join(self.dir, "sweep-no-batch.json")
        with open(no_batch, "w") as f:
            json.dump({**c, "train": {k: v for k, v in c["train"].items() if k != "train_batch_size"}}, f)
        p = self.sweep("--mode", "weak", no_batch, "1 2", "1", script, check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("sets no train.train_batch_size", p.stderr)
        self.assertIn("--global-batch", p.stderr)

        # The positional interface as before (default: strong over nodes, runs/sweep), then the study.
        compat = self.sweep(cfg, "1", "1", script).stdout
        strong = self.sweep("--unit", "ranks", "--overcommit", "--out", out, cfg, "1 2 4", "2", script).stdout
        weak = self.sweep("--mode", "weak", "--unit", "ranks", "--overcommit", "--out", out, cfg, "1 2 4", "1",
                          script).stdout
        p = self.sweep("--unit", "ranks", "--overcommit", "--out", out, cfg, "1", "1", script, check=False)
        self.assertEqual(p.returncode, 2)  # a second sweep never resumes the first one's runs
        self.assertIn("strong-1r-0 exists from an earlier sweep", p.stderr)

        compat_logs = self.wait_sweep(os.path.join(self.dir, "runs", "sweep"), compat, 1)
        self.assertIn("2 ranks on 1 node", compat_logs["strong-1n-0"])  # the script's 2 tasks per node
        logs = {**self.wait_sweep(out, strong, 2), **self.wait_sweep(out, weak, 1)}
        self.assertEqual(len(logs), 9)
        for mode, repeats in (("strong", 2), ("weak", 1)):
            for n in (1, 2, 4):
                batch = 8 * n if mode == "weak" else 8
                for r in range(repeats):
                    run = os.path.join(out, f"{mode}-{n}r-{r}")
                    log = logs[f"{mode}-{n}r-{r}"]
                    self.assertIn(f"global batch {batch} windows", log)
                    self.assertIn(f"{n} ranks on 1 node" if n > 1 else "x 1 data-parallel ranks", log)
                    with open(os.path.join(run, "sweep.json")) as f:
                        meta = json.load(f)
                    self.assertEqual((meta["mode"], meta["count"], meta["global_batch"]), (mode, n, batch))
                    self.assertEqual("--overcommit" in meta["layout"], n > cores, meta["layout"])

        # A stand-in for `dstrain plan` (not built yet): it records what it was asked, and predicts
        # 1000 tokens/s per rank.
        fake = os.path.join(self.dir, "fake-plan")
        asked = os.path.join(self.dir, "fake-plan.log")
        with open(fake, "w") as f:
            f.write(f"""#!/usr/bin/python3
import json, os, sys
a = sys.argv[1:]
cfg = json.load(open(a[a.index("--config") + 1]))
ranks = int(a[a.index("--ranks") + 1])
with open({asked!r}, "a") as log:
    log.write(json.dumps({{"args": a, "cwd": os.getcwd(), "batch": cfg["train"]["train_batch_size"],
                          "output": cfg["output"]["dir"]}}) + "\\n")
print("explanation: 1000 tokens/s per rank")
print(json.dumps({{"tokens_per_second": 1000.0 * ranks, "step_seconds": 0.5}}, indent=1))
""")
        os.chmod(fake, 0o755)
        profile = os.path.join(self.dir, "profile.json")
        with open(profile, "w") as f:
            json.dump({"name": "local"}, f)
        report = os.path.join(self.dir, "report")
        p = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "scaling_report.py"), out, "--out", report,
                            "--warmup", str(WARMUP)], capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("Predictions: none", p.stdout)
        p = subprocess.run([sys.executable, os.path.join(ROOT, "validation", "scaling_report.py"), out, "--out", report,
                            "--warmup", str(WARMUP), "--predict", fake, "--cluster", profile],
                           capture_output=True, text=True)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        print(p.stdout)
        with open(os.path.join(report, "scaling.json")) as f:
            result = json.load(f)
        with open(asked) as f:
            calls = [json.loads(line) for line in f]

        def run_median(name):  # tokens/s of one run, recomputed from its metrics.jsonl
            with open(os.path.join(out, name, "metrics.jsonl")) as f:
                train = [json.loads(l) for l in f if '"type":"train"' in l]
            self.assertEqual([r["step"] for r in train], list(range(1, SWEEP_STEPS + 1)))
            return statistics.median(r["tokens_per_s"] for r in train[WARMUP:])

        tables = {(t["mode"], t["unit"]): t for t in result["tables"]}
        self.assertEqual(sorted(tables), [("strong", "ranks"), ("weak", "ranks")])
        for (mode, _), t in tables.items():
            rows = t["rows"]
            repeats = 2 if mode == "strong" else 1
            self.assertEqual([r["count"] for r in rows], [1, 2, 4])
            self.assertEqual([r["ranks"] for r in rows], [1, 2, 4])
            self.assertEqual([r["repeats"] for r in rows], [repeats] * 3)
            self.assertEqual([r["global_batch"] for r in rows], [8, 16, 32] if mode == "weak" else [8, 8, 8])
            self.assertEqual([r["oversubscribed"] for r in rows], [n > cores for n in (1, 2, 4)])
            measured = {n: statistics.median(run_median(f"{mode}-{n}r-{r}") for r in range(repeats)) for n in (1, 2, 4)}
            for row in rows:
                n = row["count"]
                self.assertAlmostEqual(row["tokens_per_s"], measured[n], delta=1e-6 * measured[n])
                self.assertAlmostEqual(row["efficiency"], measured[n] / measured[1] / n, places=9)
                self.assertEqual(row["predicted_tokens_per_s"], 1000.0 * n)
                self.assertAlmostEqual(row["error"], measured[n] / (1000.0 * n) - 1, places=9)
                self.assertAlmostEqual(row["predicted_efficiency"], 1.0, places=9)
        # dstrain plan saw each count's rank count and the run's own config: its scaled batch, its output dir.
        self.assertEqual(sorted((c["args"][c["args"].index("--ranks") + 1], c["batch"]) for c in calls),
                         sorted([("1", 8), ("2", 8), ("4", 8), ("1", 8), ("2", 16), ("4", 32)]))
        for c in calls:
            self.assertEqual(c["args"][0], "plan")
            self.assertIn("--explain", c["args"])
            self.assertEqual(os.path.realpath(c["cwd"]), os.path.realpath(self.dir))
            self.assertRegex(c["output"], r"/runs/scaling/(strong|weak)-\dr-0$")
        with open(os.path.join(report, "scaling.md")) as f:
            md = f.read()
        self.assertIn("## Weak scaling over ranks", md)
        self.assertIn(f"| 2 | 16 | 1 | {tables[('weak', 'ranks')]['rows'][1]['tokens_per_s']:.0f} |", md)
        for png in ("scaling_throughput.png", "scaling_efficiency.png"):
            with open(os.path.join(report, png), "rb") as f:
                data = f.read()
            self.assertTrue(data.startswith(b"\x89PNG\r\n\x1a\n"), png)
            self.assertGreater(len(data), 10000, png)

    def test_f2_gpu_script_needs_the_cuda_build(self):
        # Outside sbatch (SLURM_JOB_ID set by hand): the checks before anything is launched.
        with tempfile.TemporaryDirectory() as d:
            env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DSTRAIN_"))}
            env.update(SLURM_JOB_ID="1", SLURM_SUBMIT_DIR=d, DSTRAIN_CONFIG=os.path.join(ROOT, "inputs", "quickstart.json"))
            script = os.path.join(ROOT, "slurm", "dstrain-gpu.sbatch")
            p = subprocess.run([script], capture_output=True, text=True, env=env, cwd=d)
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("build-cuda/app/dstrain, dstrain's CUDA build, is missing in " + d, p.stderr)
            self.assertIn("-DDSTRAIN_CUDA=ON", p.stderr)
            p = subprocess.run([script], capture_output=True, text=True, cwd=d,
                               env=dict(env, DSTRAIN_BIN=os.path.join(BUILD, "app", "dstrain"), DSTRAIN_DEVICE="gpu"))
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            self.assertIn("DSTRAIN_DEVICE=gpu; use cuda or cpu", p.stderr)

    def test_g_gpu_script_runs_the_same_loop(self):
        # No GPUs here: the GPU layout is overridden on the command line, as users do for tests,
        # and the run is told to compute on the host (DSTRAIN_DEVICE=cpu) with the CPU build.
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
                             env=dict(os.environ, DSTRAIN_CONFIG=cfg, DSTRAIN_DEVICE="cpu",
                                      DSTRAIN_BIN=os.path.join(BUILD, "app", "dstrain"))).stdout.strip()
        state, text = self.wait(jid, log)
        self.assertEqual(state, "COMPLETED", text)
        self.assertIn("=== dstrain-gpu job", text)
        self.assertIn('device "cpu", srun --cpu-bind=cores', text)
        self.assertIn("no GPUs allocated on this node", text)
        # Every rank's binding, before training: its own cores.
        ranks = re.findall(r"rank (\d) \(\S+, node-local (\d)\): cores ([0-9,-]+), GPUs all of the node", text)
        self.assertEqual(sorted(r[0] for r in ranks), ["0", "1"], text)
        self.assertIn("=== training complete (completed 30)", text)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
