"""A GPU check that cannot pass by skipping.

Without a GPU, dstrain's GPU tests skip, by name (ctest reports them as skipped). Under
DSTRAIN_REQUIRE_GPU=1, which validation/device/check.sh sets, the same tests fail: a machine whose
GPU dstrain cannot see cannot report that the GPU tests passed. check.sh's step verdict also fails
any step whose output says SKIPPED, whatever its exit status.

Usage: test_require_gpu.py BUILD_DIR
"""
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None
# The GPU tests of the unit suite (the op suite's CUDA cases and the GPU timing marks).
GPU_TESTS = "BackendOps.Cuda*:TimingOnGpu.*"


def gpu_visible():
    return shutil.which("nvidia-smi") is not None and subprocess.run(
        ["nvidia-smi", "-L"], capture_output=True).returncode == 0


class RequireGpu(unittest.TestCase):
    def unit_tests(self, **env):
        e = {k: v for k, v in os.environ.items() if k != "DSTRAIN_REQUIRE_GPU"}
        e.update(env)
        return subprocess.run([os.path.join(BUILD, "tests", "unit_tests"), f"--gtest_filter={GPU_TESTS}",
                               "--gtest_color=no"], capture_output=True, text=True, env=e, timeout=300)

    def test_gpu_tests_skip_by_name_without_a_gpu(self):
        if gpu_visible():
            self.skipTest("a GPU is visible: the GPU tests run")
        p = self.unit_tests()
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        skipped = [l for l in p.stdout.splitlines() if l.startswith("[  SKIPPED ] ") and "." in l]
        self.assertGreaterEqual(len(skipped), 2, p.stdout)
        self.assertIn("no GPU: ", p.stdout)

    def test_required_gpu_turns_every_skip_into_a_failure(self):
        if gpu_visible():
            self.skipTest("a GPU is visible: the GPU tests run")
        for value in ("1", "yes"):
            p = self.unit_tests(DSTRAIN_REQUIRE_GPU=value)
            self.assertNotEqual(p.returncode, 0, p.stdout)
            self.assertIn("DSTRAIN_REQUIRE_GPU is set, but this process cannot use a GPU", p.stdout)
            self.assertNotIn("[  SKIPPED ]", p.stdout)
            failed = [l for l in p.stdout.splitlines() if l.startswith("[  FAILED  ] ") and "." in l and "ms)" in l]
            self.assertGreaterEqual(len(failed), 2, p.stdout)
        # "0" and empty mean not required.
        for value in ("0", ""):
            self.assertEqual(self.unit_tests(DSTRAIN_REQUIRE_GPU=value).returncode, 0)

    def test_check_script_fails_a_step_that_skipped(self):
        check = os.path.join(ROOT, "validation", "device", "check.sh")
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "step.txt")

            def verdict(rc, text):
                with open(out, "w") as f:
                    f.write(text)
                p = subprocess.run(["bash", check, "verdict", str(rc), out], capture_output=True, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                return p.stdout.strip()

            self.assertEqual(verdict(0, "[  PASSED  ] 3 tests.\n"), "ok")
            self.assertEqual(verdict(0, "[  SKIPPED ] BackendOps.CudaBackendMatchesTheCpuReference (0 ms)\n"),
                             "FAILED (1 SKIPPED line(s))")
            self.assertEqual(verdict(1, "[  FAILED  ] X.Y\n"), "FAILED (exit 1)")
            self.assertEqual(verdict(124, ""), "TIMED OUT")
            self.assertEqual(verdict(137, ""), "TIMED OUT")


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
