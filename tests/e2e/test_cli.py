"""End-to-end tests of the dstrain command line: prepare text, train, save Hugging Face
weights, evaluate and sample from them, and check that PyTorch reads the saved model and
gets the same loss; the same seed and config give bitwise-identical runs; bad input ends
with a clear error.

    /usr/bin/python3 tests/e2e/test_cli.py BUILD_DIR
"""

import gzip
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "validation", "reference"))
BUILD = None

MODEL = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 260, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 256, "eos_token_id": 257,
}

TEXT = """The quick brown fox jumps over the lazy dog.
%
A journey of a thousand miles begins with a single step.
%
All that glitters is not gold; all that wander are not lost.
%
To be, or not to be, that is the question.
%
"""


def run(args, check=True, **kw):
    p = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2"), **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def prepare_corpus(directory, build):
    """TEXT x 40 as llm.c shards: directory/corpus_train_*.bin, and corpus_val_*.bin (the first 12 documents)."""
    with open(os.path.join(directory, "text.txt"), "w") as f:
        f.write(TEXT * 40)
    run([os.path.join(build, "app", "dstrain-prep"), "--input", os.path.join(directory, "text.txt"),
         "--split-on-line", "%", "--val-docs", "12", "--output-prefix", os.path.join(directory, "corpus")])


class CommandLine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_")
        prepare_corpus(cls.dir, BUILD)
        with open(os.path.join(cls.dir, "model.json"), "w") as f:
            json.dump(MODEL, f)
        cls.config = os.path.join(cls.dir, "run.json")
        with open(cls.config, "w") as f:
            json.dump({
                "model": os.path.join(cls.dir, "model.json"),
                "train": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                          "gradient_clipping": 1.0,
                          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95],
                                                                    "weight_decay": 0.1}},
                          "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 3,
                                                                            "total_num_steps": 30,
                                                                            "warmup_type": "linear"}},
                          "steps_per_print": 5, "max_steps": 12, "seed": 99, "eval_interval": 6,
                          "eval_batches": 2},
                "data": {"train": os.path.join(cls.dir, "corpus_train_*.bin"),
                         "val": os.path.join(cls.dir, "corpus_val_*.bin"), "seq_len": 32, "shuffle": True},
                "output": {"dir": os.path.join(cls.dir, "out")},
                "generate": {"prompt": "The ", "max_new_tokens": 20, "temperature": 0.0},
            }, f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def train(self, name, *extra):
        hf = os.path.join(self.dir, name)
        p = run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config, "--save-hf", hf,
                 "--set", f'output.dir="{os.path.join(self.dir, name + "_out")}"', *extra])
        return hf, p.stdout

    def test_train_save_eval_generate_and_torch_reads_the_export(self):
        hf, out = self.train("hf_a")
        losses = [float(x) for x in re.findall(r"^step +\d+/12 \| loss ([0-9.]+)", out, re.M)]
        self.assertGreaterEqual(len(losses), 3)
        self.assertLess(losses[-1], losses[0], "the loss must fall")
        self.assertIn('"train_batch_size": 8', out, "rank 0 prints the resolved configuration")
        self.assertNotIn("expert load", out, "no MoE rows in a dense model's summary")
        for f in ("config.json", "model.safetensors"):
            self.assertTrue(os.path.exists(os.path.join(hf, f)), f)
        metrics = [json.loads(l) for l in open(os.path.join(self.dir, "hf_a_out", "metrics.jsonl"))]
        self.assertEqual([m["step"] for m in metrics if m["type"] == "train"], list(range(1, 13)))
        self.assertEqual(len([m for m in metrics if m["type"] == "eval"]), 2)

        ev = run([os.path.join(BUILD, "app", "dstrain"), "eval", "--config", self.config, "--init-from", hf]).stdout
        found = re.search(r"eval loss ([0-9.]+), accuracy ([0-9.]+)% over (\d+) tokens", ev)
        loss, accuracy = float(found.group(1)), float(found.group(2))
        # The same windows through the PyTorch reference, from the exported files.
        import numpy as np
        import torch
        import llama_ref
        import safetensors_np
        cfg = json.load(open(os.path.join(hf, "config.json")))
        model = llama_ref.LlamaForCausalLM(llama_ref.LlamaConfig(cfg))
        model.load_numpy_state(safetensors_np.load_dir(hf))
        shard = os.path.join(self.dir, "corpus_val_000000.bin")
        header = np.fromfile(shard, dtype=np.int32, count=256)
        tokens = np.fromfile(shard, dtype=np.uint16, offset=1024, count=header[2]).astype(np.int64)
        T, n = 32, 8  # eval_batches 2 x micro-batch 4 windows, in order
        x = torch.tensor(np.stack([tokens[i * T:i * T + T] for i in range(n)]))
        y = torch.tensor(np.stack([tokens[i * T + 1:i * T + T + 1] for i in range(n)]))
        with torch.no_grad():
            logits = model(x)
            ref = llama_ref.mean_loss(logits, y).item()
            ref_accuracy = 100 * (logits.argmax(dim=-1) == y).double().mean().item()
        self.assertAlmostEqual(loss, ref, delta=1e-5 * ref)
        # Token accuracy: the targets the model ranks first (printed with two decimals).
        self.assertAlmostEqual(accuracy, ref_accuracy, delta=0.006)
        self.assertGreater(ref_accuracy, 0, "a model that ranks no target first tests nothing")

        gen = run([os.path.join(BUILD, "app", "dstrain"), "generate", "--config", self.config, "--init-from", hf,
                   "--prompt", "The ", "--max-new-tokens", "16"]).stdout
        text = gen.split("tensors from " + hf + "\n", 1)[1]
        self.assertTrue(text.startswith("The "), gen)
        self.assertGreater(len(text), len("The "), "something was generated")

    def test_mixed_precision_runs_and_the_export_dtype(self):
        def header(hf):
            with open(os.path.join(hf, "model.safetensors"), "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                return json.loads(f.read(n))

        # bf16: the log says so, and --save-hf writes bfloat16 tensors by default.
        hf, out = self.train("hf_bf16", "--set", 'train.bf16={"enabled": true}', "--max-steps", "6")
        self.assertIn("precision: bf16 compute, fp32 master weights", out)
        self.assertEqual(json.load(open(os.path.join(hf, "config.json")))["torch_dtype"], "bfloat16")
        dtypes = {v["dtype"] for k, v in header(hf).items() if k != "__metadata__"}
        self.assertEqual(dtypes, {"BF16"})
        # fp16 with output.save_hf_dtype: the scale is in metrics.jsonl; the export in float16.
        hf, out = self.train("hf_fp16", "--set", 'train.fp16={"enabled": true, "initial_scale_power": 8}',
                             "--set", "output.save_hf_dtype=float16", "--max-steps", "6")
        self.assertIn("dynamic loss scale from 256", out)
        self.assertEqual(json.load(open(os.path.join(hf, "config.json")))["torch_dtype"], "float16")
        self.assertEqual({v["dtype"] for k, v in header(hf).items() if k != "__metadata__"}, {"F16"})
        metrics = [json.loads(l) for l in open(os.path.join(self.dir, "hf_fp16_out", "metrics.jsonl"))]
        train = [m for m in metrics if m["type"] == "train"]
        self.assertEqual(len(train), 6)
        for m in train:
            self.assertIn("loss_scale", m)
            self.assertIn("overflow_skipped_total", m)
        self.assertTrue(all(m["loss"] is not None for m in train if not m["overflow"]))
        # bf16 runs (as fp32 ones) report no loss scale.
        bf16 = [json.loads(l) for l in open(os.path.join(self.dir, "hf_bf16_out", "metrics.jsonl"))]
        self.assertFalse(any("loss_scale" in m for m in bf16))

    def test_same_seed_same_config_is_bitwise_identical(self):
        hf1, out1 = self.train("hf_r1")
        hf2, out2 = self.train("hf_r2")
        strip = lambda s: re.sub(r"\| [0-9]+ tok/s \|.*$", "", s, flags=re.M)
        steps = lambda s: [l for l in strip(s).splitlines() if l.startswith(("step", "eval"))]
        self.assertEqual(steps(out1), steps(out2))
        with open(os.path.join(hf1, "model.safetensors"), "rb") as a, open(os.path.join(hf2, "model.safetensors"),
                                                                            "rb") as b:
            self.assertEqual(a.read(), b.read())
        hf3, out3 = self.train("hf_r3", "train.seed=100")
        with open(os.path.join(hf1, "model.safetensors"), "rb") as a, open(os.path.join(hf3, "model.safetensors"),
                                                                            "rb") as b:
            self.assertNotEqual(a.read(), b.read(), "another seed gives another run")

    def test_bad_input_is_a_clear_error(self):
        dstrain = os.path.join(BUILD, "app", "dstrain")
        p = run([dstrain, "train", "--config", self.config, "--set", "train.optimizer.params.lrr=1"], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("unknown key 'train.optimizer.params.lrr'", p.stderr)
        self.assertIn("did you mean 'train.optimizer.params.lr'", p.stderr)
        p = run([dstrain, "train", "--config", self.config, "--set", 'data.train="/nonexistent/x_*.bin"'],
                check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("/nonexistent/x_*.bin", p.stderr)
        p = run([dstrain, "eval", "--config", self.config, "--init-from", self.dir], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("model.safetensors", p.stderr)
        p = run([dstrain, "train", "--config", os.path.join(self.dir, "missing.json")], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("missing.json", p.stderr)
        # A model whose weights, gradients and AdamW state cannot fit this machine is refused
        # before anything is allocated, with what it needs and what there is.
        p = run([dstrain, "train", "--config", self.config, "--set",
                 f'model="{os.path.join(ROOT, "inputs", "models", "deepseek-v3.json")}"'], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertRegex(p.stderr, r"the model has 68\d\.\d\dB parameters, whose weights, gradients and AdamW "
                                   r"state need 1\d{4}\.\d GB per rank at ZeRO stage 0 .* more than the")


class BadCommandLine(unittest.TestCase):
    """Every bad command line of the three programs ends with status 2 and one message naming the
    option, the value and what it accepts; inputs that are not text are refused before any work."""

    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_cli_")
        cls.config = os.path.join(cls.dir, "run.json")
        with open(cls.config, "w") as f:
            f.write("{}")
        cls.text = os.path.join(cls.dir, "text.txt")
        with open(cls.text, "w") as f:
            f.write(TEXT)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def assert_usage_error(self, program, args, *expected):
        p = run([os.path.join(BUILD, "app", program), *args], check=False)
        self.assertEqual(p.returncode, 2, f"{program} {args}: {p.stderr}")
        self.assertTrue(p.stderr.startswith(f"{program}: error: "), p.stderr)
        for e in expected:
            self.assertIn(e, p.stderr, f"{program} {args}")
        return p

    def test_dstrain(self):
        c = ["--config", self.config]
        gen = ["generate", *c, "--init-from", self.dir, "--prompt", "The "]
        cases = [
            (["train", *c, "--max-steps", "-1"], "--max-steps: expects an integer >= 0, got '-1'"),
            (["train", *c, "--max-steps", "2.5"], "--max-steps: expects an integer >= 0, got '2.5'"),
            (["train", *c, "--set", "novalue"], "--set: expects KEY=VALUE", "got 'novalue'"),
            (["train", *c, "--bogus"], "--bogus"),
            (["train"], "--config is required"),
            (["train", "--config", os.path.join(self.dir, "missing.json")], "--config", "missing.json"),
            (["eval", *c, "--init-from", self.dir, "--batches", "0"], "--batches: expects an integer >= 1, got '0'"),
            ([*gen, "--temperature", "nan"], "--temperature: expects a finite number >= 0, got 'nan'"),
            ([*gen, "--temperature", "inf"], "--temperature: expects a finite number >= 0, got 'inf'"),
            ([*gen, "--temperature", "-0.5"], "--temperature: expects a finite number >= 0, got '-0.5'"),
            ([*gen, "--top-k", "-3"], "--top-k: expects an integer >= 0, got '-3'"),
            ([*gen, "--max-new-tokens", "0"], "--max-new-tokens: expects an integer >= 1, got '0'"),
            ([*gen, "--max-new-tokens", "-5"], "--max-new-tokens: expects an integer >= 1, got '-5'"),
            (["bogus"], "unknown command 'bogus'; the commands are train, eval, generate, validate, plan, calibrate and status"),
            ([], "no command given"),
        ]
        for args, *expected in cases:
            with self.subTest(args=args):
                p = self.assert_usage_error("dstrain", args, *expected)
                self.assertNotIn("not in range 0.000000", p.stderr)

    def test_dstrain_ckpt(self):
        self.assert_usage_error("dstrain-ckpt", [], "no command given; the commands are info and export")
        self.assert_usage_error("dstrain-ckpt", ["bogus"], "unknown command 'bogus'")
        self.assert_usage_error("dstrain-ckpt", ["info", os.path.join(self.dir, "missing.h5")], "missing.h5")
        self.assert_usage_error("dstrain-ckpt", ["export", self.config], "--to-hf is required")

    def test_dstrain_prep_options(self):
        out = ["--input", self.text, "--output-prefix", os.path.join(self.dir, "o")]
        cases = [
            (["--threads", "0"], "--threads: expects an integer >= 1, got '0'"),
            (["--val-docs", "-1"], "--val-docs: expects an integer >= 0, got '-1'"),
            (["--shard-tokens", "0"], "--shard-tokens: expects an integer from 1 to 2147483647, got '0'"),
            (["--format", "arrow"], "--format: expects one of llmc, megatron, got 'arrow'"),
            (["--version", "3"], "--version: expects one of 1, 7, got '3'"),
            (["--dtype", "int8"], "--dtype: expects one of auto, uint16, int32, got 'int8'"),
            (["--format", "megatron", "--version", "1"], "--version applies to --format llmc"),
        ]
        for extra, expected in cases:
            with self.subTest(args=extra):
                self.assert_usage_error("dstrain-prep", out + extra, expected)
        self.assert_usage_error("dstrain-prep", ["--input", self.text], "--output-prefix is required")
        self.assertEqual(os.listdir(self.dir), ["run.json", "text.txt"], "nothing written")

    def test_dstrain_prep_refuses_inputs_that_are_not_text(self):
        gz = os.path.join(self.dir, "text.txt.gz")
        with gzip.open(gz, "wb") as f:
            f.write(TEXT.encode())
        shard = os.path.join(self.dir, "shard.bin")
        with open(shard, "wb") as f:
            f.write(b"\x20\x05\x35\x01" + b"\x00" * 100)
        noise = os.path.join(self.dir, "noise.dat")
        with open(noise, "wb") as f:
            rng = random.Random(1)
            f.write(bytes(rng.randrange(1, 256) for _ in range(4096)))
        prefix = os.path.join(self.dir, "refused")
        # Listed after a good input: refused before that one is tokenised.
        for path, expected in [(gz, f"input {gz} is gzip-compressed"), (gz, "decompress it first"),
                               (shard, f"input {shard} holds a NUL byte at offset 4"),
                               (noise, f"input {noise} is not UTF-8 text"), (noise, "the first at offset")]:
            with self.subTest(path=path):
                self.assert_usage_error("dstrain-prep", ["--input", self.text, path, "--output-prefix", prefix],
                                        expected)
        self.assertFalse([f for f in os.listdir(self.dir) if f.startswith("refused")], "nothing written")
        # A stray Latin-1 byte in UTF-8 text is tolerated.
        stray = os.path.join(self.dir, "stray.txt")
        with open(stray, "wb") as f:
            f.write(TEXT.encode() + b"caf\xe9\n" + "naïve\n".encode())
        run([os.path.join(BUILD, "app", "dstrain-prep"), "--input", stray, "--output-prefix", prefix])
        self.assertTrue(os.path.exists(prefix + "_train_000000.bin"))


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
