"""End-to-end tests of `dstrain calibrate` and `dstrain plan`: a profile measured on this machine
under mpirun, one layout priced with it, every layout of a model ranked on a shipped GPU
profile, each rank role checked, and bad command lines and profiles refused with clear errors.

    /usr/bin/python3 tests/e2e/test_plan.py BUILD_DIR
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMP_NUM_THREADS": "1"}
MODEL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02}
H100 = os.path.join(ROOT, "inputs", "clusters", "dgx-h100.json")


def run(args, mpi=0, check=True):
    cmd = (["mpirun", "-np", str(mpi)] if mpi else []) + [os.path.join(BUILD, "app", "dstrain")] + args
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


class Plan(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_plan_")
        cls.model = os.path.join(cls.dir, "config.json")
        with open(cls.model, "w") as f:
            json.dump(MODEL, f)
        cls.run_config = os.path.join(cls.dir, "run.json")
        with open(cls.run_config, "w") as f:
            json.dump({"model": cls.model,
                       "train": {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
                       "data": {"train": "unused.bin", "seq_len": 32}}, f)
        cls.profile = os.path.join(cls.dir, "profile.json")
        run(["calibrate", "--config", cls.run_config, "--out", cls.profile, "--precisions", "fp32",
             "--seconds-per-op", "0.01", "--max-collective-bytes", "65536"], mpi=2)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def test_calibration_measures_the_models_ops_and_the_jobs_collectives(self):
        with open(self.profile) as f:
            p = json.load(f)
        self.assertTrue(p["calibrated"])
        self.assertEqual(p["device"]["type"], "cpu")
        self.assertGreater(p["device"]["peak_flops"]["f32"], 1e8)
        # Every GEMM shape of the model's step at tensor 1 and 2 was run.
        gemms = [k for k in p["ops"] if k.startswith("linear_")]
        self.assertTrue(any("(64, 128)" in k for k in gemms), gemms)  # the head at tensor 1
        self.assertTrue(any("(64, 64)" in k for k in gemms), gemms)  # a tensor-parallel half
        self.assertGreater(len(p["op_fits"]), 0)
        for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"):
            fit = p["collectives"][kind]["2"]
            self.assertGreaterEqual(fit["alpha"], 0)
            self.assertGreater(fit["alpha"] + fit["beta"] * 65536, 0, kind)
        self.assertEqual(sorted(p["contention"]["gemm"]), ["1", "2"])

    def test_a_layout_is_priced_with_the_calibrated_profile(self):
        out = run(["plan", "--config", self.run_config, "--ranks", "2", "--cluster", self.profile, "--json"]).stdout
        j = json.loads(out)
        self.assertEqual(j["layout"]["data"], 2)
        self.assertGreater(j["step_seconds"], 0)
        self.assertAlmostEqual(j["tokens_per_second"], 2 * 2 * 2 * 32 / j["step_seconds"], delta=1e-6 * j["tokens_per_second"])
        self.assertGreater(j["stages"][0]["comm_seconds"]["data"], 0)
        text = run(["plan", "--config", self.run_config, "--ranks", "2", "--cluster", self.profile, "--explain",
                    "--set", "parallel.pipeline=2"]).stdout
        self.assertIn("pipeline: bubble", text)
        self.assertIn("largest ops:", text)
        self.assertRegex(text, r"memory: peak [\d.]+ GB .*: fits")

    def test_every_layout_of_a_model_is_ranked_and_the_refused_say_why(self):
        p = run(["plan", "--model", self.model, "--ranks", "8", "--cluster", H100, "--global-batch", "32",
                 "--seq", "64", "--json"])
        rows = json.loads(p.stdout)
        feasible = [r for r in rows if r["feasible"]]
        refused = [r for r in rows if not r["feasible"]]
        self.assertGreater(len(feasible), 10)
        self.assertGreater(len(refused), 0)
        speeds = [r["tokens_per_second"] for r in feasible]
        self.assertEqual(speeds, sorted(speeds, reverse=True))
        self.assertTrue(all(r["reason"] for r in refused))
        layouts = {(r["layout"]["tensor"], r["layout"]["pipeline"]) for r in feasible}
        self.assertIn((2, 2), layouts)
        table = run(["plan", "--model", self.model, "--ranks", "8", "--cluster", H100, "--global-batch", "32",
                     "--seq", "64", "--top", "3", "--explain"]).stdout
        self.assertRegex(table, r"\n1 +d\d+ t\d+ p\d+")
        self.assertIn("the fastest layout:", table)

    def test_check_runs_the_trainers_checks_and_memory_per_rank_role(self):
        out = run(["plan", "--check", self.run_config, "--ranks", "4", "--cluster", H100, "--set", "parallel.pipeline=2"]).stdout
        self.assertIn("a valid layout for 4 ranks", out)
        self.assertIn("memory per rank role", out)
        self.assertRegex(out, r"\n +0-1 .*\n +2-3 ")  # one line per pipeline stage's ranks
        bad = run(["plan", "--check", self.run_config, "--ranks", "3", "--set", "parallel.pipeline=2"], check=False)
        self.assertEqual(bad.returncode, 1)
        self.assertIn("not a valid layout for 3 ranks", bad.stderr)

    def test_bad_command_lines_and_profiles_are_refused_clearly(self):
        p = run(["plan", "--config", self.run_config, "--model", self.model, "--ranks", "2", "--cluster", H100], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("exactly one of --config", p.stderr)
        p = run(["plan", "--config", self.run_config, "--ranks", "2"], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--cluster", p.stderr)
        p = run(["plan", "--model", self.model, "--ranks", "2", "--cluster", H100], check=False)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--global-batch", p.stderr)
        with open(H100) as f:
            prof = json.load(f)
        del prof["links"]["inter_node"]
        bad = os.path.join(self.dir, "bad.json")
        with open(bad, "w") as f:
            json.dump(prof, f)
        p = run(["plan", "--config", self.run_config, "--ranks", "2", "--cluster", bad], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(bad, p.stderr)
        self.assertIn("inter_node", p.stderr)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
