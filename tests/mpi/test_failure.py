"""An error on one rank ends every rank promptly with that rank's message, both before
training (a bad configuration on the last rank only) and in the middle of it (the last rank
reads a corrupt window at step 3 while the others wait in a collective).

    tests/mpi/test_failure.py BUILD_DIR NUM_RANKS     (under the Open MPI variables of ctest)
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import unittest

BUILD, NP = None, None
DEADLINE = 60  # seconds: far beyond a clean run, far below a hang

MODEL = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 32}
T, MB = 16, 2


def write_shard(path, tokens):
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack(f"<{len(tokens)}H", *tokens))


class RankFailure(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="dstrain_fail_")
        self.last = NP - 1
        tokens = [i % 60 for i in range(4000)]
        # Step 3 (index 2) of the last rank reads window 2*G + last*MB; put an id outside the
        # vocabulary in it (G = MB * NP windows per step, one micro-step each).
        bad_window = 2 * MB * NP + self.last * MB
        tokens[bad_window * T + 5] = 63 + 1000
        self.shard = os.path.join(self.dir, "train.bin")
        write_shard(self.shard, tokens)
        self.run_cfg = {
            "model": MODEL,
            "train": {"train_micro_batch_size_per_gpu": MB, "max_steps": 6, "steps_per_print": 1,
                      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}},
            "data": {"train": self.shard, "seq_len": T, "shuffle": False},
            "output": {"dir": os.path.join(self.dir, "out")},
        }

    def tearDown(self):
        shutil.rmtree(self.dir)

    def launch(self, per_rank_configs):
        for r, cfg in enumerate(per_rank_configs):
            with open(os.path.join(self.dir, f"run_{r}.json"), "w") as f:
                json.dump(cfg, f)
        dstrain = os.path.join(BUILD, "app", "dstrain")
        cmd = ["mpirun", "-np", str(NP), "sh", "-c",
               f'exec {dstrain} train --config {self.dir}/run_$OMPI_COMM_WORLD_RANK.json']
        t0 = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=DEADLINE)
        return p, time.monotonic() - t0

    def expect_rank_error(self, p, text):
        self.assertNotEqual(p.returncode, 0, p.stdout + p.stderr)
        prefix = f"[rank {self.last}] error: " if self.last > 0 else "error: "
        lines = [l for l in p.stderr.splitlines() if l.startswith(prefix)]
        self.assertTrue(lines, f"no line starting with {prefix!r} in:\n{p.stderr}")
        self.assertIn(text, "\n".join(p.stderr.splitlines()), p.stderr)

    def test_bad_configuration_on_one_rank(self):
        bad = json.loads(json.dumps(self.run_cfg))
        bad["train"]["optimizer"]["params"]["learning_rate"] = 1e-3
        configs = [self.run_cfg] * (NP - 1) + [bad]
        p, elapsed = self.launch(configs)
        self.expect_rank_error(p, "unknown key 'train.optimizer.params.learning_rate'")
        print(f"{NP} ranks: configuration error on rank {self.last} ended the job in {elapsed:.1f} s")

    def test_error_in_the_middle_of_training(self):
        p, elapsed = self.launch([self.run_cfg] * NP)
        self.expect_rank_error(p, "outside the model's vocabulary of 64")
        self.assertIn(self.shard, p.stderr)
        self.assertIn("step      2/6", p.stdout, "steps before the corrupt window completed")
        self.assertNotIn("step      3/6", p.stdout)
        print(f"{NP} ranks: data error on rank {self.last} at step 3 ended the job in {elapsed:.1f} s")


if __name__ == "__main__":
    BUILD, NP = os.path.abspath(sys.argv[1]), int(sys.argv[2])
    del sys.argv[1:3]
    unittest.main(verbosity=2)
