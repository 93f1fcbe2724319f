"""TensorBoard events written by dstrain, read by TensorBoard's own EventAccumulator: every
scalar equals metrics.jsonl's figure of the same step (to float32, TensorBoard's type), a MoE
run's expert-load histograms count each expert's tokens, a resumed run appends steps that
continue from its checkpoint (what the earlier attempt wrote after it is dropped: no step twice),
and a directory holding another run's events is refused with a clear error. Runs in the venv
of validation/peer_venv.sh, which has tensorboard:

    validation/peer_venv.sh --run tests/e2e/test_tensorboard.py BUILD_DIR
"""

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np
from tensorboard.backend.event_processing import event_accumulator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
import test_cli  # noqa: E402  (the corpus and the dense model of the command-line tests)
import test_deepseek_cli  # noqa: E402  (the small DeepSeek-V3 model: MLA, MoE, MTP)

BUILD = None


def accumulate(directory):
    """TensorBoard's view of a directory, every event kept (size guidance 0: no sampling)."""
    acc = event_accumulator.EventAccumulator(
        directory, size_guidance={k: 0 for k in event_accumulator.DEFAULT_SIZE_GUIDANCE})
    acc.Reload()
    return acc


def runs_of(jsonl):
    """metrics.jsonl's records, one list per run (each run starts with its environment record)."""
    runs = []
    with open(jsonl) as f:
        for line in f:
            r = json.loads(line)
            if r["type"] == "environment":
                runs.append([])
            runs[-1].append(r)
    return runs


def expected_view(jsonl):
    """What TensorBoard should show: per step, the train and eval records of the latest run that
    wrote that step. A run starting at step s replaces what earlier runs wrote from s on."""
    train, evals = {}, {}
    for records in runs_of(jsonl):
        steps = [r["step"] for r in records if r["type"] == "train"]
        if not steps:
            continue
        for d in (train, evals):
            for s in [s for s in d if s >= steps[0]]:
                del d[s]
        for r in records:
            if r["type"] == "train":
                train[r["step"]] = r
            elif r["type"] == "eval":
                evals[r["step"]] = r
    return train, evals


def jsonl_value(tag, train, evals):
    """metrics.jsonl's figure for a TensorBoard tag: (records by step, the value in one record)."""
    parts = tag.split("/")
    named = {"loss/total": "loss", "loss/ce": "ce_loss", "loss/aux": "aux_loss", "loss/mtp": "mtp_loss",
             "lr": "lr", "grad_norm": "grad_norm", "throughput/tokens_per_s": "tokens_per_s",
             "throughput/mfu": "mfu", "throughput/model_flops_per_s": "model_flops_per_s",
             "throughput/tokens": "tokens", "time/step": "step_time_s",
             "time/step_max_over_ranks": "step_time_max_s", "time/step_min_over_ranks": "step_time_min_s",
             "memory/peak_rss": "peak_rss_bytes", "skipped_steps": "skipped_total", "loss_scale": "loss_scale",
             "overflow_skipped_steps": "overflow_skipped_total"}
    if tag in named:
        return train, lambda r: r[named[tag]]
    if parts[0] == "time":
        return train, lambda r: r["time_s"][parts[1]]
    if parts[0] == "memory":
        return train, lambda r: r["memory_bytes"][parts[1]]
    if parts[0] == "moe":
        return train, lambda r: r["moe"][parts[1][len("layer_"):]][parts[2]]
    if parts[0] == "eval" and len(parts) == 2:
        return evals, lambda r: r[parts[1]]
    if parts[0] == "eval":
        return evals, lambda r: r["datasets"][parts[1]][parts[2]]
    raise AssertionError(f"TensorBoard tag {tag} has no metrics.jsonl figure")


def same_float32(a, b):
    if a is None:  # metrics.jsonl writes a NaN as null
        return math.isnan(b)
    return np.float32(a) == np.float32(b)


class TensorBoardEvents(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_tb_")
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        test_cli.prepare_corpus(cls.dir, BUILD)
        for name, model in (("dense", test_cli.MODEL), ("v3", test_deepseek_cli.MODEL)):
            with open(os.path.join(cls.dir, f"{name}.json"), "w") as f:
                json.dump(model, f)
            with open(os.path.join(cls.dir, f"{name}_run.json"), "w") as f:
                json.dump({
                    "model": os.path.join(cls.dir, f"{name}.json"),
                    "train": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                              "gradient_clipping": 1.0,
                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
                              "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3}},
                              "steps_per_print": 3, "max_steps": 6, "seed": 5, "eval_interval": 4,
                              "eval_batches": 1},
                    "data": {"train": os.path.join(cls.dir, "corpus_train_*.bin"),
                             "val": os.path.join(cls.dir, "corpus_val_*.bin"), "seq_len": 32, "shuffle": True},
                    "checkpoint": {"interval_steps": 4, "save_final": False},
                    "metrics": {"progress": "lines"},
                }, f)
        # The dense model trains in fp16: its loss scale is a scalar too.
        with open(os.path.join(cls.dir, "dense_run.json")) as f:
            dense = json.load(f)
        dense["train"]["fp16"] = {"enabled": True, "initial_scale_power": 12}
        with open(os.path.join(cls.dir, "dense_run.json"), "w") as f:
            json.dump(dense, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def train(self, name, out, tb, *extra, check=True):
        p = subprocess.run([self.dstrain, "train", "--config", os.path.join(self.dir, f"{name}_run.json"),
                            "--set", f'output.dir="{out}"', f'metrics.tensorboard_dir="{tb}"', *extra],
                           capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"))
        if check:
            self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        return p

    def assert_scalars_equal_jsonl(self, acc, jsonl):
        train, evals = expected_view(jsonl)
        tags = acc.Tags()["scalars"]
        for tag in tags:
            records, value = jsonl_value(tag, train, evals)
            events = acc.Scalars(tag)
            steps = [e.step for e in events]
            self.assertEqual(len(steps), len(set(steps)), f"{tag}: a step twice: {steps}")
            # Every record that has the figure has the tag at its step, and no other step has it.
            self.assertEqual(steps, sorted(s for s, r in records.items() if _has(value, r)), tag)
            for e in events:
                self.assertTrue(same_float32(value(records[e.step]), e.value),
                                f"{tag} at step {e.step}: TensorBoard {e.value}, metrics.jsonl "
                                f"{value(records[e.step])}")
        return train, evals, tags

    def test_dense_run_resumed_appends_and_matches_metrics_jsonl(self):
        out, tb = os.path.join(self.dir, "dense_out"), os.path.join(self.dir, "dense_tb")
        first = self.train("dense", out, tb)
        self.assertIn("metrics: TensorBoard events in", first.stdout)
        # The run ends at step 6 with a checkpoint at 4: the resumed run trains 5 to 10 again.
        self.train("dense", out, tb, "--resume", "auto", "--max-steps", "10")
        files = sorted(f for f in os.listdir(tb) if f.startswith("events.out.tfevents."))
        self.assertEqual(len(files), 2, files)
        with open(os.path.join(tb, "dstrain_run.json")) as f:
            self.assertEqual(json.load(f)["output_dir"], os.path.realpath(out))
        acc = accumulate(tb)
        train, evals, tags = self.assert_scalars_equal_jsonl(acc, os.path.join(out, "metrics.jsonl"))
        self.assertEqual(sorted(train), list(range(1, 11)))
        self.assertEqual(sorted(evals), [4, 8, 10], "the first run's evaluation at step 6 is dropped with its step")
        self.assertEqual([e.step for e in acc.Scalars("loss/total")], list(range(1, 11)))
        for tag in ("loss/total", "lr", "grad_norm", "throughput/tokens_per_s", "throughput/mfu", "time/step",
                    "time/data_wait", "time/forward", "time/backward", "time/exposed_comm", "time/optimizer",
                    "time/checkpoint", "time/other", "memory/parameters", "memory/gradients",
                    "memory/optimizer_state", "memory/activations", "memory/peak_rss", "skipped_steps", "loss_scale",
                    "overflow_skipped_steps", "eval/loss", "eval/accuracy"):
            self.assertIn(tag, tags)
        self.assertNotIn("loss/aux", tags, "a dense model has no MoE losses")
        self.assertEqual(acc.Tags()["histograms"], [])

        # Another run's directory is refused on start, naming the key, the directory and the other run.
        other = self.train("dense", os.path.join(self.dir, "other_out"), tb, check=False)
        self.assertNotEqual(other.returncode, 0)
        self.assertIn(f"metrics.tensorboard_dir '{tb}' holds the TensorBoard events of another run (output.dir "
                      f"'{os.path.realpath(out)}'", other.stderr)
        self.assertIn("Give this run a directory of its own", other.stderr)
        self.assertEqual(len([f for f in os.listdir(tb) if "tfevents" in f]), 2, "the refused run wrote nothing")
        # So is a directory with events of no dstrain run.
        foreign = os.path.join(self.dir, "foreign_tb")
        os.makedirs(foreign)
        open(os.path.join(foreign, "events.out.tfevents.1700000000.elsewhere.7.v2"), "wb").close()
        p = self.train("dense", os.path.join(self.dir, "foreign_out"), foreign, check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(f"metrics.tensorboard_dir '{foreign}' holds 1 TensorBoard events file(s) of no dstrain run",
                      p.stderr)

    def test_moe_run_has_expert_load_histograms(self):
        out, tb = os.path.join(self.dir, "v3_out"), os.path.join(self.dir, "v3_tb")
        self.train("v3", out, tb)
        acc = accumulate(tb)
        train, evals, tags = self.assert_scalars_equal_jsonl(acc, os.path.join(out, "metrics.jsonl"))
        self.assertEqual(sorted(train), list(range(1, 7)))
        for tag in ("loss/total", "loss/ce", "loss/aux", "loss/mtp", "moe/layer_1/max_over_mean_load",
                    "moe/layer_1/dead_experts", "eval/loss"):
            self.assertIn(tag, tags)
        self.assertNotIn("loss_scale", tags, "no loss scale without fp16")
        layers = sorted(train[1]["moe"])
        self.assertEqual(sorted(acc.Tags()["histograms"]), [f"moe/layer_{l}/expert_tokens" for l in layers])
        for layer in layers:
            events = acc.Histograms(f"moe/layer_{layer}/expert_tokens")
            self.assertEqual([e.step for e in events], list(range(1, 7)))
            for e in events:
                tokens = train[e.step]["moe"][layer]["tokens_per_expert"]
                h = e.histogram_value
                self.assertEqual(list(h.bucket), [float(t) for t in tokens], f"layer {layer} step {e.step}")
                self.assertEqual(list(h.bucket_limit), [i + 0.5 for i in range(len(tokens))])
                self.assertEqual(h.num, sum(tokens))
                self.assertEqual(h.sum, sum(i * t for i, t in enumerate(tokens)))
                self.assertEqual((h.min, h.max), (-0.5, len(tokens) - 0.5))


def _has(value, record):
    """Whether a record has the figure (null, a NaN, counts: TensorBoard shows it as NaN)."""
    try:
        value(record)
        return True
    except (KeyError, TypeError):
        return False


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
