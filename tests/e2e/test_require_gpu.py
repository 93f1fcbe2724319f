"""A GPU check that cannot pass by skipping.

Without a GPU, dstrain's GPU tests skip, by name (ctest reports them as skipped). Under
DSTRAIN_REQUIRE_GPU=1, which validation/device/check.sh sets, the same tests fail: a machine whose
GPU dstrain cannot see cannot report that the GPU tests passed. check.sh's step verdict also fails
any step whose output says SKIPPED, whatever its exit status. check.sh run itself runs here over a
bundle of stand-in programs (DSTRAIN_DEVICE_BUNDLE): each step's verdict, its figures in the
summary, and the time budget.

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


# Stand-ins for the bundle's programs: what each prints and how it exits decides the verdicts.
FAKE_PROGRAMS = {
    "unit_tests": """#!/bin/bash
echo "[ backend ops ] cuda  linear_forward  f32  3 cases  max err 1e-7  ok"
echo "[ backend ops ] cuda: 50 of 50 ops match the CPU reference in every slot"
echo "[       OK ] BackendOps.CudaBackendMatchesTheCpuReference (5 ms)"
""",
    # A GPU test that skipped, exit status 0.
    "reference_tests": """#!/bin/bash
echo "[  SKIPPED ] Cases/TorchReference.OnTheGpu/mha_untied_1 (0 ms)"
""",
    "deepseek_reference_tests": """#!/bin/bash
echo "[  FAILED  ] Cases/DeepSeekReference.OnTheGpu/v3_noaux_plain (3 ms)"
exit 1
""",
    "dstrain": """#!/bin/bash
if [[ $1 == train ]]; then
  for a in "$@"; do [[ $a == output.dir=* ]] && dir=${a#output.dir=}; done
  dir=${dir//\\"/}; mkdir -p "$dir"
  for s in 1 2 3 4 5 6 7 8; do
    echo '{"type": "train", "step": '$s', "tokens_per_s": 1000, "mfu": 0.41, "step_time_s": 0.5, "loss": 3.2,
           "peak_flops": 9.89e14, "time_s": {"forward": 0.1, "backward": 0.2}}' | tr -d '\\n' >> "$dir/metrics.jsonl"
    echo >> "$dir/metrics.jsonl"
  done
elif [[ $1 == calibrate ]]; then
  sleep 15
fi
""",
    "nccl_bandwidth": """#!/bin/bash
echo "check: every operation ok"
""",
}


class CheckScript(unittest.TestCase):
    """check.sh run over a bundle of stand-in programs: its verdicts, figures and budget."""

    def run_check(self, budget):
        check = os.path.join(ROOT, "validation", "device", "check.sh")
        with tempfile.TemporaryDirectory() as d:
            stage = os.path.join(d, "stage")
            os.makedirs(os.path.join(stage, "bin"))
            for name, text in FAKE_PROGRAMS.items():
                path = os.path.join(stage, "bin", name)
                with open(path, "w") as f:
                    f.write(text)
                os.chmod(path, 0o755)
            bundle = os.path.join(d, "bundle")
            os.makedirs(bundle)
            subprocess.run(f"tar -C {stage} -cf - . | xz -0 > {bundle}/bundle.tar.xz", shell=True, check=True)
            out = os.path.join(d, "out")
            env = dict(os.environ, DSTRAIN_DEVICE_BUNDLE=bundle, OUT=out, CHECK_BUDGET_S=str(budget),
                       TMPDIR=d, PATH="/usr/bin:/bin")
            p = subprocess.run(["bash", check, "run"], capture_output=True, text=True, env=env, timeout=120)
            with open(os.path.join(out, "summary.txt")) as f:
                summary = f.read()
        return p, summary

    def test_each_step_gets_its_verdict_and_figures(self):
        p, summary = self.run_check(budget=60)
        self.assertEqual(p.returncode, 1, summary)
        line = {l.split()[0]: l for l in summary.splitlines() if l and not l.startswith(" ")}
        self.assertRegex(line["op_suite"], r"^op_suite +ok ")
        self.assertRegex(line["reference_dense"], r"FAILED \(1 SKIPPED line\(s\)\)")
        self.assertRegex(line["reference_deepseek"], r"FAILED \(exit 1\)")
        for ok in ("bench_1b", "bench_v3", "nccl_check", "nccl_bandwidth", "calibrate"):
            self.assertRegex(line[ok], rf"^{ok} +ok ", summary)
        self.assertIn("    [ backend ops ] cuda: 50 of 50 ops match", summary)
        self.assertIn("    0 passed, 1 failed, 0 skipped", summary)
        self.assertIn("    bench_1b: 3 steps, 1000 tokens/s, MFU 41.0% (peak 989 TFLOP/s), step 500 ms", summary)
        self.assertIn("    bench_v3: 5 steps, 1000 tokens/s", summary)
        self.assertIn("    bench_v3 time split (s): forward 0.1000, backward 0.2000", summary)
        self.assertIn("some steps FAILED", summary)
        self.assertEqual(len(line), 10, summary)  # the GPU, 8 steps, the verdict on the whole

    def test_steps_past_the_budget_are_reported_not_run(self):
        p, summary = self.run_check(budget=12)
        self.assertEqual(p.returncode, 1, summary)
        # calibrate (15 s) is cut at what is left of the 12 s.
        self.assertRegex(summary, r"calibrate +TIMED OUT")
        p, summary = self.run_check(budget=5)
        self.assertRegex(summary, r"op_suite +NOT RUN \(budget spent\)")
        self.assertRegex(summary, r"bench_1b +NOT RUN \(budget spent\)")


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
