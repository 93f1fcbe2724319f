"""Hugging Face transformers' own modelling code runs dstrain's exports: a dense (Llama), a
DeepSeek-V2 and a DeepSeek-V3 model are trained a few steps from the command line and saved
with --save-hf; transformers loads each directory as written (config.json and safetensors, no
conversion), in fp32 with eager attention, and must give dstrain's logits and loss on the
evaluation windows.

    PEER_PYTHON tests/interop/test_hf_interop.py BUILD_DIR

PEER_PYTHON is the venv that validation/peer_venv.sh makes (torch, transformers).

Where transformers' classes differ from DeepSeek's reference modeling_deepseek.py, the models
here stay inside what both compute:
- DeepseekV2's router ignores norm_topk_prob (it always scales by routed_scaling_factor), so the
  V2 model has norm_topk_prob false, as the released V2 checkpoints do.
- Both classes ignore moe_layer_freq (every layer from first_k_dense_replace on is MoE): 1 here.
- DeepseekV3 builds no MTP module: the MTP weights (model.layers.{num_hidden_layers}.*) are
  reported as unexpected and skipped, and only the main cross-entropy is compared (transformers
  has neither the MTP loss nor the auxiliary balance loss).
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None

T = 32          # seq_len
WINDOWS = 8     # eval_batches 2 x micro-batch 4, read in order
STEPS = 4
LOGITS_RTOL = 1e-4  # of the largest |logit|
LOSS_RTOL = 1e-5

COMMON = {"hidden_act": "silu", "vocab_size": 260, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "initializer_range": 0.02, "bos_token_id": 256, "eos_token_id": 257}

MODELS = {
    # GQA, untied head.
    "dense": dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=32,
                  intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=64, tie_word_embeddings=False),
    # MLA without q LoRA, YaRN with mscale (the softmax scale and the rotary amplitude both
    # change), softmax/greedy routing scaled by routed_scaling_factor, two shared experts, a
    # dense first layer.
    "v2": dict(COMMON, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=32,
               intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=128, tie_word_embeddings=False,
               q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
               n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, moe_intermediate_size=16,
               first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="greedy",
               scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.5,
               aux_loss_alpha=0.001, seq_aux=True),
    # MLA with q LoRA and YaRN, sigmoid/noaux_tc routing over 4 groups (2 kept) with trained
    # correction biases, one shared expert, a dense first layer, one MTP module.
    "v3": dict(COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=32,
               intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=64, tie_word_embeddings=False,
               q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
               rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=16,
               first_k_dense_replace=1, moe_layer_freq=1, n_group=4, topk_group=2, topk_method="noaux_tc",
               scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
               aux_loss_alpha=0.001, seq_aux=True, num_nextn_predict_layers=1),
}
# The same with 4 layers: DualPipeV over 2 ranks runs 4 stages of at least one layer each.
MODELS["v3_4layers"] = dict(MODELS["v3"], num_hidden_layers=4)

TEXT = """The quick brown fox jumps over the lazy dog.
%
A journey of a thousand miles begins with a single step.
%
All that glitters is not gold; not all those who wander are lost.
%
To be, or not to be, that is the question.
%
"""


MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMP_NUM_THREADS": "1"}


def run(args, extra_env=None, **kw):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.update(extra_env or {})
    p = subprocess.run(args, capture_output=True, text=True, env=env, **kw)
    if p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


class HuggingFaceRunsTheExports(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import numpy as np
        cls.dir = tempfile.mkdtemp(prefix="dstrain_interop_")
        with open(os.path.join(cls.dir, "text.txt"), "w") as f:
            f.write(TEXT * 40)
        run([os.path.join(BUILD, "app", "dstrain-prep"), "--input", os.path.join(cls.dir, "text.txt"),
             "--split-on-line", "%", "--val-docs", "12", "--output-prefix", os.path.join(cls.dir, "corpus")])
        # The windows `dstrain eval` scores: sample i covers val tokens [i*T, i*T+T].
        shard = os.path.join(cls.dir, "corpus_val_000000.bin")
        header = np.fromfile(shard, dtype=np.int32, count=256)
        tokens = np.fromfile(shard, dtype=np.uint16, offset=1024, count=header[2]).astype(np.int32)
        cls.windows = np.stack([tokens[i * T:i * T + T + 1] for i in range(WINDOWS)])
        cls.windows_file = os.path.join(cls.dir, "windows.i32")
        cls.windows.tofile(cls.windows_file)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    def export(self, name, tensor=1, pipeline=1, expert=1, recipe=False):
        """Trains `name` for STEPS steps (over `tensor` tensor-parallel ranks with sequence
        parallelism when above 1, over `pipeline` 1F1B pipeline stages, or with its routed experts
        split over `expert` data-parallel ranks, or with `recipe` on DeepSeek-V3's layout on 4 ranks:
        DualPipeV over 2 stages x expert 2 x ZeRO-1, exported as the sharded layout) and saves it;
        returns the directory and dstrain's eval loss."""
        d = os.path.join(self.dir, name + (f"_tp{tensor}" if tensor > 1 else "") + (f"_pp{pipeline}" if pipeline > 1 else "")
                         + (f"_ep{expert}" if expert > 1 else "") + ("_recipe" if recipe else ""))
        os.makedirs(d)
        with open(os.path.join(d, "model.json"), "w") as f:
            json.dump(MODELS[name], f)
        config = os.path.join(d, "run.json")
        with open(config, "w") as f:
            json.dump({
                "model": os.path.join(d, "model.json"),
                "train": {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95],
                                                                    "weight_decay": 0.1}},
                          "steps_per_print": STEPS, "max_steps": STEPS, "seed": 5, "eval_interval": 0,
                          "eval_batches": WINDOWS // 4, "router_bias_update_rate": 0.01},
                "data": {"train": os.path.join(self.dir, "corpus_train_*.bin"),
                         "val": os.path.join(self.dir, "corpus_val_*.bin"), "seq_len": T, "shuffle": True},
                "output": {"dir": os.path.join(d, "out")},
                "generate": {"prompt": ""},
            }, f)
        hf = os.path.join(d, "hf")
        train = [os.path.join(BUILD, "app", "dstrain"), "train", "--config", config, "--save-hf", hf]
        if tensor > 1:
            train = ["mpirun", "-np", str(tensor), "--bind-to", "none", *train, "--set", f"parallel.tensor={tensor}",
                     "parallel.sequence_parallel=true"]
        if pipeline > 1:
            train = ["mpirun", "-np", str(pipeline), "--bind-to", "none", *train, "--set",
                     f"parallel.pipeline={pipeline}", 'parallel.schedule="1f1b"']
        if expert > 1:
            train = ["mpirun", "-np", str(expert), "--bind-to", "none", *train, "--set", f"parallel.expert={expert}"]
        if recipe:
            # Small files: the export is the sharded layout (model-0000k-of-0000n plus the index),
            # each tensor written by the rank that holds it.
            train = ["mpirun", "-np", "4", "--bind-to", "none", *train, "--set", "parallel.pipeline=2",
                     'parallel.schedule="dualpipev"', "parallel.expert=2", "train.zero_optimization.stage=1",
                     "train.gradient_accumulation_steps=4", "output.save_hf_shard_bytes=100000"]
        run(train, extra_env=MPI_ENV if tensor > 1 or pipeline > 1 or expert > 1 or recipe else {})
        if recipe:
            with open(os.path.join(hf, "model.safetensors.index.json")) as f:
                files = set(json.load(f)["weight_map"].values())
            self.assertGreater(len(files), 3)
            self.assertFalse(os.path.exists(os.path.join(hf, "model.safetensors")))
        ev = run([os.path.join(BUILD, "app", "dstrain"), "eval", "--config", config, "--init-from", hf]).stdout
        m = re.search(r"eval loss ([0-9.]+), accuracy ([0-9.]+)% over (\d+) tokens", ev)
        self.assertIsNotNone(m, ev)
        self.assertEqual(int(m.group(3)), WINDOWS * T)
        return hf, float(m.group(1)), float(m.group(2))

    def dstrain_logits(self, hf, vocab):
        import numpy as np
        out = os.path.join(hf, "..", "logits.f32")
        p = run([os.path.join(BUILD, "tests", "interop_dump_logits"), hf, self.windows_file, str(WINDOWS), str(T), out])
        ce = float(re.search(r"^ce ([-0-9.e+]+)$", p.stdout, re.M).group(1))
        return np.fromfile(out, dtype=np.float32).reshape(WINDOWS, T, vocab), ce

    def check(self, name, tensor=1, pipeline=1, expert=1, recipe=False):
        import numpy as np
        import torch
        import transformers
        start = time.time()
        hf, eval_loss, eval_accuracy = self.export(name, tensor, pipeline, expert, recipe)
        cfg = MODELS[name]

        # config.json loads as written, as the class it names.
        hf_config = transformers.AutoConfig.from_pretrained(hf)
        self.assertEqual(hf_config.model_type, cfg["model_type"])
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        self.assertEqual(type(model).__name__, cfg["architectures"][0])
        self.assertEqual(sorted(info["missing_keys"]), [], "every weight transformers needs is in the export")
        self.assertEqual(list(info["mismatched_keys"]), [])
        mtp = f"model.layers.{cfg['num_hidden_layers']}."
        unexpected = sorted(info["unexpected_keys"])
        self.assertTrue(all(k.startswith(mtp) for k in unexpected), unexpected)
        if cfg.get("num_nextn_predict_layers"):
            self.assertIn(mtp + "eh_proj.weight", unexpected)  # the MTP module, which transformers does not build
        else:
            self.assertEqual(unexpected, [])
        model.eval()

        if cfg["model_type"] == "deepseek_v3":
            # The trained routing biases decide which experts run: they must be the ones loaded.
            from safetensors.numpy import load_file
            key = "model.layers.1.mlp.gate.e_score_correction_bias"
            shard = "model.safetensors"
            index = os.path.join(hf, "model.safetensors.index.json")
            if os.path.exists(index):  # the sharded layout: the index names the file
                with open(index) as f:
                    shard = json.load(f)["weight_map"][key]
            bias = load_file(os.path.join(hf, shard))[key]
            self.assertGreater(np.abs(bias).max(), 0, "the routing biases moved in training")
            np.testing.assert_array_equal(model.model.layers[1].mlp.gate.e_score_correction_bias.numpy(), bias)

        x = torch.tensor(self.windows[:, :T], dtype=torch.long)
        y = torch.tensor(self.windows[:, 1:], dtype=torch.long)
        with torch.no_grad():
            out = model(input_ids=x)
        theirs = out.logits.double()
        hf_loss = torch.nn.functional.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), y.reshape(-1)).item()
        hf_accuracy = 100 * (theirs.argmax(dim=-1) == y).double().mean().item()
        ours, ce = self.dstrain_logits(hf, cfg["vocab_size"])
        ours = torch.from_numpy(ours).double()
        abs_diff = (ours - theirs).abs().max().item()
        scale = theirs.abs().max().item()
        rel_diff = abs_diff / scale
        print(f"{name}{' (recipe layout)' if recipe else ''}{f' (tensor {tensor})' if tensor > 1 else ''}{f' (pipeline {pipeline})' if pipeline > 1 else ''}{f' (expert {expert})' if expert > 1 else ''}: logits max |diff| {abs_diff:.3g} ({rel_diff:.3g} of max |logit| {scale:.3g}); loss: "
              f"transformers {hf_loss:.7f}, dstrain eval {eval_loss:.6f} ({abs(eval_loss - hf_loss) / hf_loss:.2g} "
              f"rel), dstrain forward {ce:.7f} ({abs(ce - hf_loss) / hf_loss:.2g} rel); accuracy: transformers {hf_accuracy:.3f}%, "
              f"dstrain eval {eval_accuracy:.2f}%; {time.time() - start:.1f} s",
              flush=True)
        self.assertLess(rel_diff, LOGITS_RTOL, f"{name}: logits differ from transformers'")
        self.assertAlmostEqual(ce, hf_loss, delta=LOSS_RTOL * hf_loss)
        # The CLI prints 6 decimals.
        self.assertAlmostEqual(eval_loss, hf_loss, delta=LOSS_RTOL * hf_loss + 1e-6)
        # Token accuracy: the targets transformers' logits rank first (the CLI prints 2 decimals).
        self.assertAlmostEqual(eval_accuracy, hf_accuracy, delta=0.006,
                               msg=f"{name}: accuracy {eval_accuracy}% against transformers' {hf_accuracy:.4f}%")
        # A trained model, not a uniform one: the comparison has something to see.
        self.assertLess(hf_loss, 0.9 * np.log(cfg["vocab_size"]))

    def test_dense_llama(self):
        self.check("dense")

    def test_deepseek_v2(self):
        self.check("v2")

    def test_deepseek_v3(self):
        self.check("v3")

    def test_deepseek_v3_trained_tensor_parallel(self):
        # Trained over 2 tensor-parallel ranks with sequence parallelism: the export (gathered
        # from the pieces) is a model transformers runs as it runs the others.
        self.check("v3", tensor=2)

    def test_deepseek_v3_trained_pipeline_parallel(self):
        # Trained over 2 pipeline stages (1F1B; the last stage's MTP reads its copy of the
        # embedding): the export, assembled from the stages, is a model transformers runs too.
        self.check("v3", pipeline=2)

    def test_deepseek_v3_trained_on_its_recipe_layout(self):
        # Trained as DeepSeek-V3 was (pipeline with DualPipeV x expert x ZeRO-1), on 4 ranks, and
        # exported as the sharded layout without assembling the model in one process: transformers
        # loads the shards through the index and runs the model as it runs the others.
        self.check("v3_4layers", recipe=True)

    def test_deepseek_v3_trained_expert_parallel(self):
        # Trained with its routed experts split over 2 ranks (all-to-all dispatch and combine):
        # the export, assembled from the experts' owners, is a model transformers runs too.
        self.check("v3", expert=2)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        sys.exit(f"test_hf_interop: {sys.executable} cannot import {e.name}: run validation/peer_venv.sh "
                 f"(it makes the venv with torch and transformers) and pass its python")
    unittest.main(verbosity=2)
