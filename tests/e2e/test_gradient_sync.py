"""DiLoCo in dstrain (train.gradient_sync "diloco") against an independent PyTorch reference of
Algorithm 1 (validation/reference/diloco_ref.py): 2 replicas, H = 2 inner AdamW steps, 3 outer
Nesterov steps; the outer parameters, exported as Hugging Face weights after the last outer
step, within 1e-5 (max |dstrain - reference| / max |reference| per tensor). Run as 2 ranks (a
replica each) and as 4 (each replica split over 2 tensor ranks). Micro-batch 1 without
accumulation: the case's shard holds the 12 windows of 6 steps of 2 replicas. Seed 7 gives a
vocabulary and FFN width that 2 tensor ranks split.

Usage: python3 tests/e2e/test_gradient_sync.py BUILD_DIR
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "validation", "reference"))
import safetensors_np  # noqa: E402

BUILD = None
TORCH_PYTHON = "/usr/bin/python3"
MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMPI_MCA_mpi_yield_when_idle": "1", "OMP_NUM_THREADS": "1"}
H, OUTER = 2, 3


class DiLoCoAgainstReference(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="dstrain_diloco_")
        cls.case = os.path.join(cls.tmp.name, "case")
        subprocess.run([TORCH_PYTHON, os.path.join(ROOT, "validation", "reference", "make_case.py"), "--out", cls.case,
                        "--seed", "7"], check=True, capture_output=True)
        cls.ref = os.path.join(cls.tmp.name, "reference.safetensors")
        subprocess.run([TORCH_PYTHON, os.path.join(ROOT, "validation", "reference", "diloco_ref.py"), "--case", cls.case,
                        "--replicas", "2", "--every", str(H), "--outer-steps", str(OUTER), "--micro-batch", "1",
                        "--grad-accum", "1", "--out", cls.ref],
                       check=True, capture_output=True)

    def run_dstrain(self, ranks, gradient_sync, tensor=1):
        with open(os.path.join(self.case, "case.json")) as f:
            case = json.load(f)
        work = tempfile.mkdtemp(dir=self.tmp.name)
        run = {
            "model": os.path.join(self.case, "config.json"),
            "parallel": {"tensor": tensor},
            "train": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                      "gradient_clipping": case["gradient_clipping"],
                      "optimizer": {"type": "AdamW", "params": {"lr": case["lr"], "betas": case["betas"],
                                                                "eps": case["eps"],
                                                                "weight_decay": case["weight_decay"]}},
                      "scheduler": case["scheduler"], "no_weight_decay": case["no_decay"], "max_steps": H * OUTER,
                      "gradient_sync": gradient_sync},
            "data": {"train": os.path.join(self.case, "data.bin"), "seq_len": case["seq_len"], "shuffle": False},
            "output": {"dir": os.path.join(work, "out"), "save_hf": os.path.join(work, "hf")},
            "checkpoint": {"save_final": False},
        }
        path = os.path.join(work, "run.json")
        with open(path, "w") as f:
            json.dump(run, f)
        p = subprocess.run(["mpirun", "-np", str(ranks), os.path.join(BUILD, "app", "dstrain"), "train", "--config", path,
                            "--init-from", os.path.join(self.case, "model.safetensors")],
                           capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=600)
        self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
        return safetensors_np.load_dir(os.path.join(work, "hf"))

    def check(self, got):
        want = safetensors_np.load(self.ref)
        initial = safetensors_np.load(os.path.join(self.case, "model.safetensors"))
        worst, moved = 0.0, 0.0
        for name, w in want.items():
            g = got[name].astype(np.float64)
            err = np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30)
            worst = max(worst, err)
            moved = max(moved, np.max(np.abs(w - initial[name])) / max(np.max(np.abs(w)), 1e-30))
            self.assertLessEqual(err, 1e-5, name)
        # The comparison means something: training moved the weights far beyond the tolerance.
        self.assertGreater(moved, 1e-2)
        print(f"worst outer-parameter error {worst:.2e} (largest move {moved:.2e})", file=sys.stderr)

    def test_two_replicas_of_one_rank(self):
        self.check(self.run_dstrain(2, {"mode": "diloco", "every": H,
                                        "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}}))

    def test_two_replicas_of_two_tensor_ranks(self):
        self.check(self.run_dstrain(4, {"mode": "diloco", "every": H,
                                        "outer_optimizer": {"type": "nesterov", "lr": 0.7, "momentum": 0.9}}, tensor=2))


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main()
