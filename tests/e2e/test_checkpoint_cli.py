"""Checkpoints from the command line: files any HDF5 tool reads (h5ls, h5dump, h5py), the
dstrain-ckpt tool (info with verified checksums, export to Hugging Face), --init-from a
checkpoint, the guard against mixing runs, a corrupt file or altered metadata being reported,
and a full disk (or file size limit) ending every rank of 1 and 2 with a message, never a hang.

    /usr/bin/python3 tests/e2e/test_checkpoint_cli.py BUILD_DIR
"""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_cli  # noqa: E402  (shares the tiny model and corpus)
from test_cli import run  # noqa: E402

BUILD = None


class CheckpointCommandLine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        test_cli.BUILD = BUILD
        test_cli.CommandLine.setUpClass.__func__(cls)  # corpus, model and run config in cls.dir
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        cls.ckpt_tool = os.path.join(BUILD, "app", "dstrain-ckpt")
        cls.out = os.path.join(cls.dir, "ckpt_run")
        run([cls.dstrain, "train", "--config", cls.config, "--set", f'output.dir="{cls.out}"',
             "checkpoint.interval_steps=4", "checkpoint.keep_last=2"])
        cls.ckdir = os.path.join(cls.out, "checkpoints")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_rotation_and_latest(self):
        files = sorted(os.listdir(self.ckdir))
        self.assertEqual(files, ["latest", "step_00000008.h5", "step_00000012.h5"])
        self.assertEqual(open(os.path.join(self.ckdir, "latest")).read().strip(), "step_00000012.h5")

    def test_any_hdf5_tool_reads_it(self):
        path = os.path.join(self.ckdir, "step_00000012.h5")
        ls = run(["h5ls", "-r", path]).stdout
        self.assertIn("/model/model.layers.1.self_attn.q_proj.weight Dataset {32, 32}", ls)
        self.assertIn("/optimizer/exp_avg_sq/lm_head.weight Dataset {260, 32}", ls)
        run(["h5dump", "-H", path])
        hf = os.path.join(self.dir, "export")
        out = run([self.ckpt_tool, "export", path, "--to-hf", hf]).stdout
        self.assertIn("step 12", out)
        check = run(["/usr/bin/python3", os.path.join(ROOT, "validation", "check_checkpoint.py"), path, hf]).stdout
        self.assertIn("0 checksum mismatch(es)", check)
        self.assertIn("bit for bit", check)
        # --init-from accepts the checkpoint itself: same weights, same loss as the export.
        loss = lambda src: float(re.search(r"eval loss ([0-9.]+)", run(
            [self.dstrain, "eval", "--config", self.config, "--init-from", src]).stdout).group(1))
        self.assertEqual(loss(path), loss(hf))

    def test_info_verifies_and_a_corrupt_file_is_reported(self):
        path = os.path.join(self.ckdir, "step_00000008.h5")
        info = run([self.ckpt_tool, "info", path]).stdout
        self.assertIn("step          8 (optimizer step 8)", info)
        self.assertIn("0 checksum mismatch(es)", info)
        bad = os.path.join(self.dir, "corrupt.h5")
        shutil.copy(path, bad)
        import h5py
        with h5py.File(bad, "r") as f:
            offset = f["model"]["model.norm.weight"].id.get_offset()
        with open(bad, "r+b") as f:
            f.seek(offset + 8)
            b = f.read(1)
            f.seek(offset + 8)
            f.write(bytes([b[0] ^ 0xFF]))
        p = run([self.ckpt_tool, "info", bad], check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("MISMATCH", p.stdout)
        self.assertIn("corrupt", p.stderr)
        self.assertIn("checksums verified: ok", info)
        # An edited data position: the field is named, by dstrain-ckpt and by the h5py check.
        edited = os.path.join(self.dir, "edited.h5")
        shutil.copy(path, edited)
        with h5py.File(edited, "r+") as f:
            f["data"].attrs["consumed_samples"] = 16
        p = run([self.ckpt_tool, "info", edited], check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn(f"{edited}: /data@consumed_samples fails its checksum", p.stderr)
        p = run(["/usr/bin/python3", os.path.join(ROOT, "validation", "check_checkpoint.py"), edited], check=False)
        self.assertEqual(p.returncode, 1)
        self.assertIn("/data@consumed_samples", p.stdout)

    def test_the_environment_is_recorded_and_shown(self):
        """Checkpoint metadata, the head of metrics.jsonl and dstrain-ckpt info carry the job's
        build and library versions, checked against what the tools of this machine report."""
        import h5py
        import subprocess
        path = os.path.join(self.ckdir, "step_00000012.h5")
        with h5py.File(path, "r") as f:
            env = json.loads(f["environment"].attrs["json"])
            self.assertEqual(env["dstrain_version"], f.attrs["dstrain_version"])
            self.assertEqual(env["commit"], f.attrs["build_id"])
            self.assertEqual(f["environment"].attrs["hdf5"], env["hdf5"])  # readable at a glance
        mpirun = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout
        mpi_release = re.search(r"(\d+\.\d+\.\d+)", mpirun).group(1)
        self.assertIn(mpi_release, env["mpi"])
        self.assertEqual(env["hdf5"], h5py.version.hdf5_version)
        self.assertRegex(env["blas"], r"^OpenBLAS \d+\.\d+")
        self.assertRegex(env["gemm"], r"^oneDNN \d+\.\d+\.\d+, DSTRAIN_CPU_SGEMM ")
        self.assertRegex(env["compiler"], r"^(GCC|Clang) ")
        self.assertEqual(env["world_size"], 1)
        self.assertGreater(env["omp_threads"], 0)
        self.assertTrue(env["cpu_model"])
        self.assertNotIn("ranks run", env["warnings"], "one rank differs from none")
        head = json.loads(open(os.path.join(self.out, "metrics.jsonl")).readline())
        self.assertEqual(head["type"], "environment")
        self.assertEqual(head["environment"], env)
        self.assertIn("measured: best of", head["peak_source"])
        info = run([self.ckpt_tool, "info", "--no-verify", path]).stdout
        self.assertIn(f"environment   dstrain {env['dstrain_version']} ({env['commit']}), {env['compiler']}", info)
        self.assertIn(f"MPI: {env['mpi']}", info)
        self.assertIn(f"HDF5 {env['hdf5']}, BLAS: {env['blas']}", info)
        self.assertIn(f"CPU: {env['cpu_model']}", info)
        if env["warnings"]:  # e.g. OpenBLAS's SSE kernels on an AVX2 CPU it does not recognise
            self.assertIn("warnings: " + env["warnings"].splitlines()[0], info)

    def test_a_new_run_does_not_mix_with_existing_checkpoints(self):
        p = run([self.dstrain, "train", "--config", self.config, "--set", f'output.dir="{self.out}"'], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("already holds checkpoints", p.stderr)
        self.assertIn("--resume auto", p.stderr)
        # Resuming a finished run trains nothing more and keeps its files.
        p = run([self.dstrain, "train", "--config", self.config, "--resume", "auto", "--set",
                 f'output.dir="{self.out}"'])
        self.assertIn("resumed from", p.stdout)
        self.assertIn("at step 12", p.stdout)
        self.assertNotIn("step     13", p.stdout)


MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMP_NUM_THREADS": "1"}
HANG = 90  # seconds: far beyond these runs (a few seconds, or the 10 s watchdog), far below a hang


class FullDisk(unittest.TestCase):
    """A checkpoint that does not fit: refused up front (free space or `ulimit -f` below its
    size), or failing in the middle of the write (the check off). Every rank ends with
    "<cause> on <dir>: checkpoint step N not written; step M is the newest valid one", and the
    older checkpoints stay valid."""

    @classmethod
    def setUpClass(cls):
        test_cli.BUILD = BUILD
        test_cli.CommandLine.setUpClass.__func__(cls)
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        cls.ckpt_tool = os.path.join(BUILD, "app", "dstrain-ckpt")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def launch(self, np, ckdir, *sets, limit_kb=None, resume=False):
        """mpirun -np NP dstrain train, each rank under `ulimit -f` when limit_kb is given."""
        args = [self.dstrain, "train", "--config", self.config, "--set", f'output.dir="{ckdir}_out"',
                f'checkpoint.dir="{ckdir}"', "checkpoint.interval_steps=2", "checkpoint.keep_last=5",
                "resilience.collective_timeout_s=10", *sets] + (["--resume", "auto"] if resume else [])
        env = dict(os.environ, **MPI_ENV)
        if limit_kb is None:
            cmd = ["mpirun", "-np", str(np), *args]
        else:
            # The shared-memory transport's segments outgrow the limit: TCP over loopback. SIGXFSZ
            # ignored as a batch script would, so that the write fails instead of the process.
            env["OMPI_MCA_btl"] = "self,tcp"
            quoted = " ".join("'" + a.replace("'", "'\\''") + "'" for a in args)
            cmd = ["mpirun", "-np", str(np), "sh", "-c", f"trap '' XFSZ; ulimit -f {limit_kb}; exec {quoted}"]
        env.setdefault("OMPI_MCA_btl", "self,vader")
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=HANG)
        except subprocess.TimeoutExpired:
            self.fail(f"{np} rank(s): the job hung (no end within {HANG} s)")
        return p, time.monotonic() - t0

    def expect_not_written(self, p, np, cause, ckdir, step, newest):
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        want = f"{cause} on {ckdir}: checkpoint step {step} not written; step {newest} is the newest valid one"
        for r in range(np):
            prefix = f"[rank {r}] error: " if r else "error: "
            self.assertTrue(any(l.startswith(prefix + want) for l in p.stderr.splitlines()),
                            f"rank {r} of {np} does not say {want!r}:\n{p.stderr}")
        names = sorted(os.listdir(ckdir))
        self.assertNotIn(f"step_{step:08d}.h5", names)
        if "watchdog" not in p.stderr:
            self.assertFalse([n for n in names if n.endswith(".tmp")], f"a partial file is left: {names}")
        with open(os.path.join(ckdir, "latest")) as f:
            self.assertEqual(f.read().strip(), f"step_{newest:08d}.h5")
        info = run([self.ckpt_tool, "info", os.path.join(ckdir, f"step_{newest:08d}.h5")]).stdout
        self.assertIn("0 checksum mismatch(es)", info)

    def test_file_size_limit(self):
        """No mount needed: `ulimit -f` below a checkpoint's size, from the second run on."""
        for np in (1, 2):
            for check in ("true", "false"):
                with self.subTest(ranks=np, check_free_space=check):
                    ckdir = tempfile.mkdtemp(prefix="limit_", dir=self.dir)
                    p, _ = self.launch(np, ckdir, "train.max_steps=4")
                    self.assertEqual(p.returncode, 0, p.stderr)
                    p, secs = self.launch(np, ckdir, "train.max_steps=8", f"checkpoint.check_free_space={check}",
                                          limit_kb=200, resume=True)
                    cause = ("the file size limit (ulimit -f) is too small" if check == "true"
                             else "the file size limit (ulimit -f) was reached")
                    self.expect_not_written(p, np, cause, ckdir, 6, 4)
                    print(f"{np} rank(s), check {check}: ended in {secs:.1f} s")

    def test_full_tmpfs(self):
        """A real full file system where mounting is allowed (root outside a container)."""
        mnt = tempfile.mkdtemp(prefix="tmpfs_", dir=self.dir)
        # One checkpoint (~0.5 MB) fits in 1 MB; the check wants ~0.6 MB free for the second.
        m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True, text=True)
        # A test that cannot run fails: a skip would read as passed.
        self.assertEqual(m.returncode, 0, f"cannot mount a 1 MB tmpfs at {mnt} ({m.stderr.strip()}): this test "
                                          "needs root (the CI machine and .ci/test run as root)")
        try:
            for np in (1, 2):
                for check in ("true", "false"):
                    with self.subTest(ranks=np, check_free_space=check):
                        for n in os.listdir(mnt):
                            os.remove(os.path.join(mnt, n))
                        p, secs = self.launch(np, mnt, "train.max_steps=8", f"checkpoint.check_free_space={check}")
                        # Checked, the second save is refused; unchecked, reserving its space fails.
                        self.expect_not_written(p, np, "no space left", mnt, 4, 2)
                        self.assertNotIn("watchdog", p.stderr, "the ranks agreed on the failure")
                        print(f"{np} rank(s), tmpfs, check {check}: ended in {secs:.1f} s")
        finally:
            subprocess.run(["umount", mnt])


class RunStartCommandLine(unittest.TestCase):
    """What a train command checks before it trains: resuming a run whose checkpoints are gone,
    max_steps below the resumed step, a checkpoint of another model, ranks given different
    weights or checkpoint files, a second run in the same directory, an unwritable --save-hf."""

    MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader",
                   OMPI_MCA_mpi_yield_when_idle="1", OMP_NUM_THREADS="1")

    @classmethod
    def setUpClass(cls):
        test_cli.BUILD = BUILD
        test_cli.CommandLine.setUpClass.__func__(cls)
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        cls.run_dir = os.path.join(cls.dir, "run8")
        run([cls.dstrain, "train", "--config", cls.config, "--max-steps", "8", "--set",
             f'output.dir="{cls.run_dir}"', "checkpoint.interval_steps=4"])

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def copy_of_run(self, name):
        out = os.path.join(self.dir, name)
        shutil.copytree(self.run_dir, out)
        return out

    def train(self, out, *extra, check=False):
        # errors="replace": the tiny model's sample at the end is arbitrary bytes.
        return run([self.dstrain, "train", "--config", self.config, "--set", f'output.dir="{out}"', *extra],
                   check=check, errors="replace")

    def test_resume_auto_with_every_checkpoint_gone_is_an_error(self):
        out = self.copy_of_run("gone")
        ck = os.path.join(out, "checkpoints")
        for f in os.listdir(ck):
            if f.endswith(".h5"):
                os.remove(os.path.join(ck, f))
        p = self.train(out, "--resume", "auto")
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("latest says this run completed checkpoint step_00000008.h5", p.stderr)
        self.assertIn(f"remove {ck}/latest to start a new run", p.stderr)
        self.assertNotIn("starting a new run", p.stdout)

    def test_max_steps_below_the_resumed_step_is_an_error(self):
        out = self.copy_of_run("below")
        p = self.train(out, "--resume", "auto", "--max-steps", "3")
        self.assertEqual(p.returncode, 1, p.stdout)
        self.assertIn("resumed at step 8 but train.max_steps (--max-steps) is 3", p.stderr)
        self.assertNotIn("training 3 steps", p.stdout)

    def test_a_checkpoint_of_another_model_says_so(self):
        with open(os.path.join(self.dir, "model.json")) as f:
            model = json.load(f)
        model["hidden_size"] = 64
        wider = os.path.join(self.dir, "model_wider.json")
        with open(wider, "w") as f:
            json.dump(model, f)
        for spec in ("auto", os.path.join(self.run_dir, "checkpoints", "step_00000008.h5")):
            p = self.train(self.run_dir, "--resume", spec, "--set", f'model="{wider}"')
            self.assertEqual(p.returncode, 1, p.stdout)
            self.assertIn("step_00000008.h5' was written for a different model: hidden_size 32 in the checkpoint vs "
                          "64 in the config", p.stderr)
            self.assertNotIn("corrupt", p.stderr + p.stdout)
            self.assertNotIn("invalid", p.stderr + p.stdout)

    def test_ranks_given_different_weights_or_checkpoints_are_told_so(self):
        ck = os.path.join(self.run_dir, "checkpoints")
        a, b = os.path.join(ck, "step_00000004.h5"), os.path.join(ck, "step_00000008.h5")
        env = dict(os.environ, **self.MPI_ENV)

        def mpmd(out, option, first, second):
            common = ["train", "--config", self.config, "--max-steps", "9", "--set", f'output.dir="{out}"']
            return subprocess.run(["mpirun", "-np", "1", self.dstrain, *common, option, first, ":",
                                   "-np", "1", self.dstrain, *common, option, second],
                                  capture_output=True, text=True, env=env, timeout=120)

        hf_a, hf_b = os.path.join(self.dir, "hf_4"), os.path.join(self.dir, "hf_8")
        for src, dst in ((a, hf_a), (b, hf_b)):
            run([os.path.join(BUILD, "app", "dstrain-ckpt"), "export", src, "--to-hf", dst])
        p = mpmd(os.path.join(self.dir, "spliced"), "--init-from", hf_a, hf_b)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("ranks start from different weights (first differing tensor", p.stderr)
        self.assertIn(f"--init-from {hf_a}", p.stderr)
        self.assertIn(f"--init-from {hf_b}", p.stderr)
        self.assertNotIn("step      1", p.stdout)
        p = mpmd(os.path.join(self.dir, "spliced_h5"), "--init-from", a, b)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("ranks were given different checkpoint files", p.stderr)
        self.assertIn(f"--init-from {a}", p.stderr)
        self.assertNotIn("corrupt", p.stderr)
        out = self.copy_of_run("two_files")
        p = mpmd(out, "--resume", a, b)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("ranks were given different checkpoint files", p.stderr)
        self.assertIn(f"--resume {a}", p.stderr)
        self.assertIn(f"--resume {b}", p.stderr)
        self.assertNotIn("corrupt", p.stderr)

    def test_one_run_per_directory(self):
        out = os.path.join(self.dir, "locked")
        lock = os.path.join(out, "dstrain.lock")
        first = subprocess.Popen([self.dstrain, "train", "--config", self.config, "--max-steps", "100000", "--set",
                                  f'output.dir="{out}"', "checkpoint.save_final=false"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.time() + 60
            while not os.path.exists(lock) and time.time() < deadline and first.poll() is None:
                time.sleep(0.05)
            self.assertTrue(os.path.exists(lock), "the first run takes the lock")
            p = self.train(out, "--max-steps", "2")
            self.assertEqual(p.returncode, 1, p.stdout)
            self.assertIn(f"is in use by another dstrain run (host {socket.gethostname()}, pid {first.pid}",
                          p.stderr)
            self.assertIn(lock, p.stderr)
        finally:
            first.kill()  # as a crash would: the lock stays behind
            first.wait()
        self.assertTrue(os.path.exists(lock))
        p = self.train(out, "--max-steps", "2", "--resume", "auto")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn(f"left by dstrain pid {first.pid} on {socket.gethostname()}, which is no longer running",
                      p.stdout + p.stderr)
        self.assertFalse(os.path.exists(lock), "released at exit")
        # Released after an error too.
        p = self.train(out, "--max-steps", "1", "--resume", "auto")
        self.assertEqual(p.returncode, 1)
        self.assertFalse(os.path.exists(lock), "released after an error")

    def test_an_unwritable_save_hf_is_an_error_before_training(self):
        not_a_dir = os.path.join(self.dir, "a_file")
        with open(not_a_dir, "w") as f:
            f.write("x\n")
        for option in (["--save-hf", f"{not_a_dir}/hf"], ["--set", f'output.save_hf="{not_a_dir}/hf"']):
            p = self.train(os.path.join(self.dir, "save_hf_run"), *option)
            self.assertEqual(p.returncode, 1, p.stdout)
            self.assertIn(f"output.save_hf (--save-hf) '{not_a_dir}/hf' cannot be created", p.stderr)
            self.assertNotIn("step      1", p.stdout)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
