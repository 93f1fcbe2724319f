"""DeepSeek-V3 from the command line: train a small MLA + MoE + MTP model, watch its routing
health in the progress lines and the metrics file, keep the routing biases in the HDF5
checkpoint, export Hugging Face safetensors that the PyTorch reference loads and scores
alike, and read checkpoints laid out like the released V3 ones (MTP modules with their own
copies of the embedding and the head).

    /usr/bin/python3 tests/e2e/test_deepseek_cli.py BUILD_DIR
"""

import json
import os
import re
import shutil
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "validation", "reference"))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))
from test_cli import prepare_corpus, run  # noqa: E402  (the corpus and the command runner of the dense tests)

BUILD = None

# MLA with q LoRA and YaRN, sigmoid/noaux_tc routing over 2 groups, one shared expert, a dense
# first layer, one MTP module.
MODEL = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "vocab_size": 260, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "bos_token_id": 256, "eos_token_id": 257,
    "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8,
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 2, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "aux_loss_alpha": 0.001, "seq_aux": True, "num_nextn_predict_layers": 1,
}

STEPS = 10


class DeepSeekV3CommandLine(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_e2e_v3_")
        cls.dstrain = os.path.join(BUILD, "app", "dstrain")
        prepare_corpus(cls.dir, BUILD)
        with open(os.path.join(cls.dir, "model.json"), "w") as f:
            json.dump(MODEL, f)
        cls.config = os.path.join(cls.dir, "run.json")
        with open(cls.config, "w") as f:
            json.dump({
                "model": os.path.join(cls.dir, "model.json"),
                "train": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                          "gradient_clipping": 1.0,
                          "optimizer": {"type": "AdamW", "params": {"lr": 5e-3, "betas": [0.9, 0.95],
                                                                    "weight_decay": 0.1}},
                          "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
                          "steps_per_print": 5, "max_steps": STEPS, "seed": 7, "eval_interval": 0,
                          "eval_batches": 2, "mtp_loss_weight": 0.3, "router_bias_update_rate": 0.001},
                "data": {"train": os.path.join(cls.dir, "corpus_train_*.bin"),
                         "val": os.path.join(cls.dir, "corpus_val_*.bin"), "seq_len": 32, "shuffle": True},
                "checkpoint": {"interval_steps": STEPS},
                "output": {"dir": os.path.join(cls.dir, "out")},
                "generate": {"prompt": ""},
            }, f)
        cls.hf = os.path.join(cls.dir, "hf")
        cls.out = run([cls.dstrain, "train", "--config", cls.config, "--save-hf", cls.hf]).stdout

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def eval_loss(self, init_from):
        ev = run([self.dstrain, "eval", "--config", self.config, "--init-from", init_from]).stdout
        return float(re.search(r"eval loss ([0-9.]+), accuracy ([0-9.]+)% over (\d+) tokens", ev).group(1))

    def test_progress_and_metrics_show_routing_health(self):
        # Two MoE layers: layer 1 and the MTP module (model.layers.2), 8 experts each.
        routing = re.findall(r"^routing +\d+ \| ce ([0-9.]+) \+ aux ([0-9.]+) \+ mtp ([0-9.]+) \| worst expert load "
                             r"([0-9.]+) x mean \(layer [12]\) \| dead experts (\d+) of 16 \| routing [0-9.]+% \+ "
                             r"permutation [0-9.]+% of the step", self.out, re.M)
        self.assertGreaterEqual(len(routing), 2, self.out)
        # The end-of-run summary judges the routing too.
        self.assertRegex(self.out, r"expert load \(busiest over mean, worst layer\) +[0-9.]+x +< 2x the mean")
        self.assertRegex(self.out, r"dead experts \(last step, all layers\) +\d+ +0 ")
        self.assertRegex(self.out, r"MoE routing \+ permutation +[0-9.]+% +< 10% of a step")
        with open(os.path.join(self.dir, "out", "metrics.jsonl")) as f:
            rows = [json.loads(l) for l in f]
        train = [r for r in rows if r["type"] == "train"]
        self.assertEqual([r["step"] for r in train], list(range(1, STEPS + 1)))
        tokens = 8 * 32  # global batch x seq_len
        for r in train:
            self.assertAlmostEqual(r["loss"], r["ce_loss"] + r["aux_loss"] + r["mtp_loss"], delta=1e-5 * r["loss"])
            self.assertGreater(r["mtp_loss"], 0)
            self.assertEqual(sorted(r["moe"]), ["1", "2"])
            layer = r["moe"]["1"]
            self.assertEqual(sum(layer["tokens_per_expert"]), tokens * MODEL["num_experts_per_tok"])
            self.assertEqual(layer["dead_experts"], layer["tokens_per_expert"].count(0))
            self.assertAlmostEqual(layer["max_over_mean_load"],
                                   max(layer["tokens_per_expert"]) * 8 / (tokens * 2), delta=1e-9)
            self.assertGreater(layer["aux_loss"], 0)
            self.assertGreater(r["moe_route_s"], 0)
            self.assertGreater(r["moe_permute_s"], 0)
        self.assertLess(train[-1]["ce_loss"], train[0]["ce_loss"], "the loss must fall")

    def test_export_loads_in_pytorch_and_scores_alike(self):
        import numpy as np
        import torch
        import deepseek_ref
        import safetensors_np
        with open(os.path.join(self.hf, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual(cfg["model_type"], "deepseek_v3")
        tensors = safetensors_np.load_dir(self.hf)
        L = MODEL["num_hidden_layers"]
        for name in ("model.layers.1.mlp.gate.e_score_correction_bias", "model.layers.1.mlp.experts.7.down_proj.weight",
                     "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
                     f"model.layers.{L}.eh_proj.weight", f"model.layers.{L}.enorm.weight",
                     f"model.layers.{L}.shared_head.norm.weight", f"model.layers.{L}.mlp.gate.e_score_correction_bias"):
            self.assertIn(name, tensors)
        bias = tensors["model.layers.1.mlp.gate.e_score_correction_bias"]
        self.assertGreater(np.abs(bias).max(), 0, "the routing biases moved and were saved")
        model = deepseek_ref.DeepseekForCausalLM(cfg)
        model.load_safetensors(self.hf, strict=True)

        loss = self.eval_loss(self.hf)
        shard = os.path.join(self.dir, "corpus_val_000000.bin")
        header = np.fromfile(shard, dtype=np.int32, count=256)
        tokens = np.fromfile(shard, dtype=np.uint16, offset=1024, count=header[2]).astype(np.int64)
        T, n = 32, 8  # eval_batches 2 x micro-batch 4 windows, in order
        x = torch.tensor(np.stack([tokens[i * T:i * T + T] for i in range(n)]))
        y = torch.tensor(np.stack([tokens[i * T + 1:i * T + T + 1] for i in range(n)]))
        with torch.no_grad():
            ref = deepseek_ref.mean_loss(model(x), y).item()
        self.assertAlmostEqual(loss, ref, delta=1e-5 * ref)

        # The HDF5 checkpoint holds the same model, routing biases included.
        ckpt = os.path.join(self.dir, "out", "checkpoints", f"step_{STEPS:08d}.h5")
        import h5py
        with h5py.File(ckpt, "r") as f:
            np.testing.assert_array_equal(f["model/model.layers.1.mlp.gate.e_score_correction_bias"][()], bias)
        self.assertEqual(self.eval_loss(ckpt), loss)

    def test_released_v3_layout_with_mtp_copies_of_embedding_and_head(self):
        import numpy as np
        import safetensors_np
        L = MODEL["num_hidden_layers"]
        tensors = safetensors_np.load_dir(self.hf)
        released = os.path.join(self.dir, "released")
        os.makedirs(released, exist_ok=True)
        shutil.copy(os.path.join(self.hf, "config.json"), released)
        tensors[f"model.layers.{L}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].copy()
        tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"].copy()
        safetensors_np.save(os.path.join(released, "model.safetensors"), tensors, {"format": "pt"})
        p = run([self.dstrain, "eval", "--config", self.config, "--init-from", released])
        self.assertEqual(float(re.search(r"eval loss ([0-9.]+)", p.stdout).group(1)), self.eval_loss(self.hf))

        # A module with a head of its own is not what dstrain trains: a clear error, not a silent pick.
        tensors[f"model.layers.{L}.shared_head.head.weight"] = tensors["lm_head.weight"] + np.float32(1.0)
        safetensors_np.save(os.path.join(released, "model.safetensors"), tensors, {"format": "pt"})
        p = run([self.dstrain, "eval", "--config", self.config, "--init-from", released], check=False)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(f"model.layers.{L}.shared_head.head.weight", p.stderr)
        self.assertIn("differs", p.stderr)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    unittest.main()
