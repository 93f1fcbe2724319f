"""DeepSeek-V3's recipe from the command line: the shipped miniature
(inputs/deepseek-v3-recipe-mini.json: pipeline 2 with DualPipeV x expert 2 x ZeRO-1 data
parallelism, MTP and the routing-bias update, on 4 ranks) trains, checkpoints, and resumes on
another layout (expert 2 x ZeRO-2 on 2 ranks) with the same losses; and the full-size layout
(inputs/deepseek-v3-671b-2048gpu.json: V3 671B, pipeline 16 x expert 64 x ZeRO-1 over 2,048
GPUs) passes `dstrain validate` without running, while rank counts and axes that cannot work are
errors naming the sizes that would.

    /usr/bin/python3 tests/e2e/test_recipes.py BUILD_DIR
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from test_cli import prepare_corpus  # noqa: E402  (the corpus of the dense tests, as llm.c shards)

BUILD = None
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader",
               OMPI_MCA_mpi_yield_when_idle="1", OMP_NUM_THREADS="1")
MINI = os.path.join(ROOT, "inputs", "deepseek-v3-recipe-mini.json")
FULL = os.path.join(ROOT, "inputs", "deepseek-v3-671b-2048gpu.json")
STEPS = 12


def run(args, check=True):
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, **MPI_ENV), timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def step_losses(metrics_jsonl):
    """step -> loss, from a run's metrics.jsonl (the step lines)."""
    out = {}
    with open(metrics_jsonl) as f:
        for line in f:
            rec = json.loads(line)
            if "step" in rec and "loss" in rec:
                out[rec["step"]] = rec
    return out


class DeepSeekV3Recipe(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_recipe_")
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        prepare_corpus(cls.dir, BUILD)
        # The shipped recipe as it is, on the test corpus, checkpointing halfway.
        cls.data = ['data.format="llmc"', "data.split=[]",
                    f'data.train="{os.path.join(cls.dir, "corpus_train_*.bin")}"',
                    f'data.val="{os.path.join(cls.dir, "corpus_val_*.bin")}"', "train.eval_interval=0",
                    f"checkpoint.interval_steps={STEPS // 2}", "checkpoint.keep_last=2"]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def train(self, np, out, *sets, resume=False):
        args = ["mpirun", "-np", str(np), self.dstrain, "train", "--config", MINI, "--max-steps", str(STEPS),
                "--set", f'output.dir="{out}"', *self.data, *sets]
        if resume:
            args += ["--resume", "auto"]
        return run(args)

    def test_trains_on_four_ranks_and_resumes_on_another_layout(self):
        out4 = os.path.join(self.dir, "out4")
        p = self.train(4, out4)
        log = p.stdout + p.stderr
        # The layout the recipe asks for, as the run reports it.
        self.assertIn("pipeline: 4 stages over 2 ranks, schedule dualpipev", log)
        self.assertIn("expert parallelism: 32 routed experts per MoE layer over 2 ranks, 16 per rank", log)
        self.assertIn("ZeRO stage 1 (dense over data (2 ranks), expert over expert_data (1 rank))", log)
        full = step_losses(os.path.join(out4, "metrics.jsonl"))
        self.assertEqual(sorted(full), list(range(1, STEPS + 1)))
        # It trains: the loss falls, the MTP loss is part of it, the routing biases move.
        self.assertLess(full[STEPS]["loss"], 0.8 * full[1]["loss"])
        self.assertGreater(full[STEPS]["mtp_loss"], 0)
        ckpts = sorted(os.listdir(os.path.join(out4, "checkpoints")))
        self.assertIn(f"step_{STEPS // 2:08d}.h5", ckpts)

        # Resumed from the halfway checkpoint on 2 ranks with expert 2 x ZeRO-2 and no pipeline:
        # the file holds global tensors, so the steps after it are the 4-rank run's.
        out2 = os.path.join(self.dir, "out2")
        os.makedirs(os.path.join(out2, "checkpoints"))
        shutil.copy(os.path.join(out4, "checkpoints", f"step_{STEPS // 2:08d}.h5"), os.path.join(out2, "checkpoints"))
        p = self.train(2, out2, "parallel.pipeline=1", "train.zero_optimization.stage=2", resume=True)
        self.assertIn(f"at step {STEPS // 2}", p.stdout + p.stderr)
        resumed = step_losses(os.path.join(out2, "metrics.jsonl"))
        self.assertEqual(sorted(resumed), list(range(STEPS // 2 + 1, STEPS + 1)))
        for s in resumed:
            self.assertAlmostEqual(resumed[s]["loss"], full[s]["loss"], delta=1e-4 * full[s]["loss"], msg=f"step {s}")

    def test_full_recomputation_trains_the_recipe_bitwise(self):
        # Whole layers, or the norms and the experts' SwiGLU, recomputed under pipeline (DualPipeV)
        # x expert x ZeRO-1 with MTP and the bias update: every step's losses and gradient norm
        # are the same bits, with fewer activation bytes held.
        steps = STEPS
        runs = {}
        for name, sets in (("none", []), ("full", ['train.activation_checkpointing={"granularity": "full"}']),
                           ("selective", ['train.activation_checkpointing={"granularity": "selective", '
                                          '"selective": ["layernorm", "moe_act"]}'])):
            out = os.path.join(self.dir, "recompute_" + name)
            p = self.train(4, out, "checkpoint.save_final=false", *sets)
            if name == "full":
                self.assertIn("activation recomputation: full, in groups of 1 layer(s)", p.stdout + p.stderr)
            runs[name] = step_losses(os.path.join(out, "metrics.jsonl"))
        held = {n: max(r["memory_bytes"]["activations"] for r in runs[n].values()) for n in runs}
        for name in ("full", "selective"):
            self.assertEqual(sorted(runs[name]), list(range(1, steps + 1)))
            for s in range(1, steps + 1):
                for key in ("loss", "mtp_loss", "grad_norm"):
                    self.assertEqual(runs[name][s][key], runs["none"][s][key], f"{name}: step {s} {key}")
            self.assertLess(held[name], held["none"], name)

    def test_full_size_layout_validates_without_running(self):
        p = run([self.dstrain, "validate", "--config", FULL, "--ranks", "2048"])
        self.assertIn("a valid layout for 2048 ranks", p.stdout)
        self.assertIn("2048 ranks = data 128 x tensor 1 x pipeline 16, expert 64 within data (2 expert groups)", p.stdout)
        self.assertIn("expert: 256 routed experts per MoE layer over 64 ranks, 4 per rank", p.stdout)
        self.assertIn("pipeline: 32 stages over 16 ranks, schedule dualpipev", p.stdout)
        self.assertIn("= 128 data-parallel ranks x 120 micro-batches of 1", p.stdout)
        self.assertIn("ZeRO stage 1", p.stdout)
        # About 1.1B dense and 0.65B expert parameters per rank in bf16 with fp32 masters, AdamW
        # sharded: (4 + 2 + 4 + 2) bytes each plus 12 over the ZeRO groups.
        self.assertIn("model state per rank (weights, gradients, AdamW; layers spread evenly over the stages): 24.9 GB "
                      "at ZeRO stage 1, bf16", p.stdout)
        # What cannot work is an error naming the sizes that would.
        bad = {
            ("--ranks", "2000"): "or a rank count that is a multiple of 1024",
            ("--ranks", "2048", "--set", "parallel.pipeline=13"): "rank counts that work with this layout: 832, 1664",
            ("--ranks", "2048", "--set", "parallel.expert=48"): "choose an expert size that divides 128",
            ("--ranks", "2048", "--set", "parallel.expert=128", "parallel.pipeline=8", "parallel.tensor=3"):
                "tensor 3 x pipeline 8 = 24 does not divide the 2048 ranks",
            ("--ranks", "4096", "--set", "parallel.pipeline=64"):
                "makes 128 stages (2 per rank) for a model of 61 decoder layers (num_hidden_layers): each stage "
                "needs at least one layer; pipeline sizes that work with this schedule: 2 to 30",
            ("--ranks", "2048", "--set", "train.train_batch_size=15000"): "train_batch_size",
        }
        for args, want in bad.items():
            p = run([self.dstrain, "validate", "--config", FULL, *args], check=False)
            self.assertEqual(p.returncode, 1, f"{args}: {p.stdout}{p.stderr}")
            self.assertIn(want, p.stderr, f"{args}")
            self.assertNotIn("MPI_ABORT", p.stdout + p.stderr)


if __name__ == "__main__":
    BUILD = sys.argv.pop(1)
    unittest.main()
