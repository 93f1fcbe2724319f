"""Checkpoints from the command line: files any HDF5 tool reads (h5ls, h5dump, h5py), the
dstrain-ckpt tool (info with verified checksums, export to Hugging Face), --init-from a
checkpoint, the guard against mixing runs, and a corrupt file being reported.

    /usr/bin/python3 tests/e2e/test_checkpoint_cli.py BUILD_DIR
"""

import os
import re
import shutil
import sys
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

    def test_the_environment_is_recorded_and_shown(self):
        """Checkpoint metadata, the head of metrics.jsonl and dstrain-ckpt info carry the job's
        build and library versions, checked against what the tools of this machine report."""
        import h5py
        import json
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


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
