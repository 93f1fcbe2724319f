"""DeepSeek's released checkpoints in and out: block-scaled FP8 weights (F8_E4M3 with
`weight_scale_inv`), the MTP module's own copies of the embedding and the output head, sharded
with an index, and config.json's quantization_config.

    PEER_PYTHON tests/interop/test_fp8_checkpoints.py BUILD_DIR

PEER_PYTHON is the venv of validation/peer_venv.sh (PyTorch with torch.float8_e4m3fn,
safetensors, transformers).

The reference is DeepSeek's own code, ported line by line to PyTorch on the CPU (the originals
are Triton kernels): weight_quant and weight_dequant of DeepSeek-V3's inference/kernel.py
(https://github.com/deepseek-ai/DeepSeek-V3/blob/main/inference/kernel.py):
- weight_quant: per block of block x block elements, s = max(|x|) / 448.0 and y = (x / s) cast to
  float8_e4m3fn, in fp32; s stored as fp32 of shape (ceil(M / block), ceil(N / block)).
- weight_dequant: y = x.to(float32) * s[block of the element], stored in the default dtype
  (inference/fp8_cast_bf16.py sets bfloat16; dstrain's master weights are fp32, so fp32 here).
Which tensors are FP8 follows the release: the projection matrices of the decoder layers'
attention and MLPs (experts included); embeddings, heads, norms, router gates and the MTP module's
eh_proj are BF16.

What it checks:
- a checkpoint made here by PyTorch in the released layout (FP8 + scales, MTP copies, 3 shards
  and model.safetensors.index.json) loads with --init-from into exactly weight_dequant's values,
  on 1 rank and on 2 tensor-parallel ranks (each reading its pieces), with two block sizes: the
  default 128 (no weight_block_size in the config) and [16, 16] from quantization_config;
- FP8 in, no training, FP8 out (output.hf_layout "released", output.hf_dtype "fp8") gives the
  same tensors bit for bit, written by 1 rank or by 2 tensor-parallel ranks;
- a trained model exported in the released layout in bf16 loads in transformers, which agrees on
  the loss with `dstrain eval`; in fp8, every FP8 tensor is weight_quant of the exported weights
  except where it reads back exactly under a scale one fp32 step from weight_quant's;
- damaged checkpoints are refused naming the tensor: an FP8 weight without its scales, scales of
  the wrong block size, an MTP copy that differs from the main head.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = None
T = 16

MODEL = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
         "vocab_size": 260, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "initializer_range": 0.02,
         "bos_token_id": 256, "eos_token_id": 257, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 64, "tie_word_embeddings": False, "q_lora_rank": 24, "kv_lora_rank": 16,
         "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 8,
         "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
         "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 4, "topk_group": 2,
         "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
         "routed_scaling_factor": 2.5, "aux_loss_alpha": 0.001, "seq_aux": True, "num_nextn_predict_layers": 1}

MPI_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "self,vader",
           "OMP_NUM_THREADS": "1"}

FP8_NAME = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.([A-Za-z0-9_]+\.)*[A-Za-z0-9_]*_proj\.weight")


def run(args, mpi=0, check=True):
    if mpi:
        args = ["mpirun", "-np", str(mpi), "--bind-to", "none", *args]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    env.update(MPI_ENV if mpi else {})
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=600)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    return p


def weight_quant(x, block):
    """DeepSeek-V3 inference/kernel.py weight_quant (weight_quant_kernel), in PyTorch."""
    import torch
    x = x.float()
    m, n = x.shape
    gm, gn = -(-m // block[0]), -(-n // block[1])
    y = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(gm, gn, dtype=torch.float32)
    for i in range(gm):
        for j in range(gn):
            blk = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            sc = blk.abs().max() / 448.0
            y[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk / sc).to(torch.float8_e4m3fn)
            s[i, j] = sc
    return y, s


def inverse_scale_quant(x, block):
    """Block quantisation that keeps scale = 448 / amax and stores 1 / scale as weight_scale_inv."""
    import torch
    x = x.float()
    m, n = x.shape
    y = torch.empty(m, n, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-m // block[0]), -(-n // block[1]), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = x[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            scale = 448.0 / blk.abs().max()
            y[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = (blk * scale).to(torch.float8_e4m3fn)
            s[i, j] = 1.0 / scale
    return y, s


def block_amax(x, block):
    """max |x| of every block, shape (ceil(M / block), ceil(N / block))."""
    import torch
    m, n = x.shape
    gm, gn = -(-m // block[0]), -(-n // block[1])
    padded = torch.zeros(gm * block[0], gn * block[1])
    padded[:m, :n] = x.abs()
    return padded.reshape(gm, block[0], gn, block[1]).amax(dim=(1, 3))


def weight_dequant(y, s, block):
    """DeepSeek-V3 inference/kernel.py weight_dequant (weight_dequant_kernel), in PyTorch: fp32 out."""
    import torch
    m, n = y.shape
    full = s.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :n]
    return y.to(torch.float32) * full


def load_dir(d):
    """Every tensor of a Hugging Face directory (single file or index), by name."""
    from safetensors.torch import load_file
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for name in files:
        out.update(load_file(os.path.join(d, name)))
    return out


class ReleasedCheckpoints(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.dir = tempfile.mkdtemp(prefix="dstrain_fp8_")
        text = "".join(f"The quick brown fox {i} jumps over the lazy dog.\n%\n" for i in range(300))
        with open(os.path.join(cls.dir, "text.txt"), "w") as f:
            f.write(text)
        run([os.path.join(BUILD, "app", "dstrain-prep"), "--input", os.path.join(cls.dir, "text.txt"),
             "--split-on-line", "%", "--val-docs", "12", "--output-prefix", os.path.join(cls.dir, "corpus")])
        with open(os.path.join(cls.dir, "model.json"), "w") as f:
            json.dump(MODEL, f)
        # The names and shapes of the model's tensors in the released layout, from dstrain's
        # untrained bf16 export (the values are replaced below).
        cls.names = cls.export_dir("names", [], hf_layout="released", hf_dtype="bfloat16")

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.dir)

    @classmethod
    def config(cls, name, max_steps=0, **output):
        path = os.path.join(cls.dir, name + ".json")
        with open(path, "w") as f:
            json.dump({
                "model": os.path.join(cls.dir, "model.json"),
                "train": {"train_micro_batch_size_per_gpu": 4, "max_steps": max_steps, "steps_per_print": 10,
                          "seed": 5, "eval_interval": 0, "eval_batches": 2,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}},
                "data": {"train": os.path.join(cls.dir, "corpus_train_*.bin"),
                         "val": os.path.join(cls.dir, "corpus_val_*.bin"), "seq_len": T},
                "output": dict({"dir": os.path.join(cls.dir, name + "_out")}, **output),
            }, f)
        return path

    @classmethod
    def export_dir(cls, name, extra, mpi=0, max_steps=0, **output):
        """dstrain train --max-steps N [extra] --save-hf DIR; returns DIR."""
        hf = os.path.join(cls.dir, name)
        args = [os.path.join(BUILD, "app", "dstrain"), "train", "--config", cls.config(name, max_steps, **output),
                "--save-hf", hf, *extra]
        if mpi:
            args += ["--set", f"parallel.tensor={mpi}"]
        run(args, mpi=mpi)
        return hf

    def make_released(self, name, block, block_in_config, seed):
        """A checkpoint in DeepSeek's released layout made by PyTorch: random bf16 weights, the FP8
        ones quantised by weight_quant, the MTP copies equal to the main embedding and head, 3
        shards with an index. Returns (dir, tensors as written, reference fp32 weights)."""
        import torch
        from safetensors.torch import save_file
        g = torch.Generator().manual_seed(seed)
        self.off_rule_blocks, self.blocks = 0, 0
        base = load_dir(self.names)
        tensors, reference = {}, {}
        for k in sorted(base):
            if ".embed_tokens." in k and k != "model.embed_tokens.weight" or k.endswith("shared_head.head.weight"):
                continue  # the copies, made below
            v = torch.randn(base[k].shape, generator=g) * 0.05
            if k.endswith("norm.weight"):
                v = 1 + v
            if FP8_NAME.fullmatch(k):
                # Quantised from fp32 weights, half by weight_quant, half as a training framework
                # that keeps the quantisation scale 448 / amax and stores its inverse
                # (weight_scale_inv) does: those scales are not all amax / 448 of the values they
                # give, which a round trip must keep all the same.
                y, s = weight_quant(v, block) if len(tensors) % 2 else inverse_scale_quant(v, block)
                tensors[k], tensors[k + "_scale_inv"] = y, s
                reference[k] = weight_dequant(y, s, block)
                self.off_rule_blocks += int((block_amax(reference[k], block) / 448.0 != s).sum())
                self.blocks += s.numel()
            else:
                # The routing biases are F32 in DeepSeek-V3's release, the rest BF16.
                tensors[k] = v if k.endswith("e_score_correction_bias") else v.to(torch.bfloat16)
                reference[k] = tensors[k].float()
        mtp = f"model.layers.{MODEL['num_hidden_layers']}."
        tensors[mtp + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[mtp + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        self.assertTrue(any(t.dtype == torch.float8_e4m3fn for t in tensors.values()))

        d = os.path.join(self.dir, name)
        os.makedirs(d)
        names = sorted(tensors)
        parts = [names[i::3] for i in range(3)]  # interleaved: the index decides where each is
        weight_map = {}
        for i, part in enumerate(parts):
            file = f"model-{i + 1:05d}-of-00003.safetensors"
            save_file({k: tensors[k].contiguous() for k in part}, os.path.join(d, file), metadata={"format": "pt"})
            weight_map.update({k: file for k in part})
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
        config = dict(MODEL, torch_dtype="bfloat16",
                      quantization_config={"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8"})
        if block_in_config:
            config["quantization_config"]["weight_block_size"] = list(block)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        return d, tensors, reference

    def assert_same_tensors(self, got, want, what):
        import torch
        self.assertEqual(sorted(got), sorted(want), what)
        for k in want:
            self.assertEqual(got[k].dtype, want[k].dtype, f"{what}: {k}")
            self.assertEqual(got[k].shape, want[k].shape, f"{what}: {k}")
            a, b = got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)
            self.assertTrue(torch.equal(a, b), f"{what}: {k} differs in {(a != b).sum().item()} bytes")

    def check_in_and_out(self, name, block, block_in_config):
        import torch
        src, tensors, reference = self.make_released(name, block, block_in_config, seed=len(name))
        block_set = ["--set", f"output.hf_fp8_block={json.dumps(list(block))}"]
        # In: the fp32 masters are weight_dequant's values, bit for bit, on 1 and 2 ranks.
        for ranks in (1, 2):
            out = self.export_dir(f"{name}_f32_np{ranks}", ["--init-from", src], mpi=ranks if ranks > 1 else 0,
                                  save_hf_dtype="float32")
            got = load_dir(out)
            self.assertEqual(sorted(got), sorted(reference))  # standard layout: no copies, no scales
            for k, v in reference.items():
                self.assertTrue(torch.equal(got[k], v), f"{name}, {ranks} rank(s): {k} differs from weight_dequant "
                                f"by up to {(got[k] - v).abs().max().item():.3g}")
        # Out: FP8 in, no training, FP8 out in the released layout: the same tensors, bit for bit.
        for ranks in (1, 2):
            out = self.export_dir(f"{name}_fp8_np{ranks}", ["--init-from", src, *block_set],
                                  mpi=ranks if ranks > 1 else 0, hf_layout="released", hf_dtype="fp8")
            self.assert_same_tensors(load_dir(out), tensors, f"{name}: FP8 round trip on {ranks} rank(s)")
            with open(os.path.join(out, "config.json")) as f:
                q = json.load(f)["quantization_config"]
            self.assertEqual(q, {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                 "weight_block_size": list(block)})
        print(f"{name}: {sum(1 for t in tensors.values() if t.dtype == torch.float8_e4m3fn)} FP8 tensors in blocks "
              f"of {block}: read as weight_dequant's values and written back bit for bit, on 1 and 2 ranks "
              f"({self.off_rule_blocks} of {self.blocks} blocks with a scale other than amax / 448 of their values)",
              flush=True)
        self.assertGreater(self.off_rule_blocks, 0, "the round trip is checked on scales weight_quant would not give")

    def test_released_fp8_with_default_128_blocks(self):
        self.check_in_and_out("released_b128", (128, 128), block_in_config=False)

    def test_released_fp8_with_16_blocks_from_the_config(self):
        # Matrices of several blocks, with partial ones (24 and 64 rows, 24 and 16 columns).
        self.check_in_and_out("released_b16", (16, 16), block_in_config=True)

    def test_trained_export_loads_in_transformers_and_quantises_as_deepseek(self):
        import numpy as np
        import torch
        import transformers
        hf = self.export_dir("trained_bf16", [], max_steps=4, hf_layout="released", hf_dtype="bfloat16")
        cfg = self.config("trained_bf16", 4, hf_layout="released")
        ev = run([os.path.join(BUILD, "app", "dstrain"), "eval", "--config", cfg, "--init-from", hf]).stdout
        dstrain_loss = float(re.search(r"eval loss ([0-9.]+)", ev).group(1))
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
        self.assertEqual(info["missing_keys"] if isinstance(info["missing_keys"], list) else sorted(info["missing_keys"]), [])
        mtp = f"model.layers.{MODEL['num_hidden_layers']}."
        self.assertIn(mtp + "embed_tokens.weight", info["unexpected_keys"])  # the copies are there
        self.assertIn(mtp + "shared_head.head.weight", info["unexpected_keys"])
        # The windows `dstrain eval` scores: 2 batches of 4, sample i over val tokens [i*T, i*T+T].
        shard = os.path.join(self.dir, "corpus_val_000000.bin")
        header = np.fromfile(shard, dtype=np.int32, count=256)
        tokens = np.fromfile(shard, dtype=np.uint16, offset=1024, count=header[2]).astype(np.int64)
        windows = torch.tensor(np.stack([tokens[i * T:i * T + T + 1] for i in range(8)]))
        with torch.no_grad():
            logits = model(input_ids=windows[:, :T]).logits.double()
        hf_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1)).item()
        print(f"released bf16 layout: transformers loss {hf_loss:.6f}, dstrain eval {dstrain_loss:.6f}", flush=True)
        self.assertAlmostEqual(dstrain_loss, hf_loss, delta=1e-5 * hf_loss + 1e-6)

        # The same trained weights in fp8: weight_quant of the fp32 weights, block by block.
        f32 = load_dir(self.export_dir("trained_f32", [], max_steps=4, save_hf_dtype="float32"))
        fp8 = load_dir(self.export_dir("trained_fp8", [], max_steps=4, hf_layout="released", hf_dtype="fp8"))
        n_fp8, refined = 0, 0
        for k, v in f32.items():
            if k.endswith("e_score_correction_bias"):
                self.assertTrue(torch.equal(fp8[k], v), k)  # F32, as released
                continue
            if not FP8_NAME.fullmatch(k):
                self.assertTrue(torch.equal(fp8[k], v.to(torch.bfloat16)), k)
                continue
            n_fp8 += 1
            y, s = weight_quant(v, (128, 128))
            if not torch.equal(fp8[k + "_scale_inv"], s):
                # Allowed only where the block reads back exactly under the scale written, one
                # fp32 step from weight_quant's.
                refined += 1
                self.assertTrue(torch.equal(weight_dequant(fp8[k], fp8[k + "_scale_inv"], (128, 128)), v), k)
                continue
            self.assertTrue(torch.equal(fp8[k].view(torch.uint8), y.view(torch.uint8)), k)
        self.assertGreater(n_fp8, 20)
        self.assertEqual(refined, 0, "trained weights are not exactly representable in FP8")
        self.assertTrue(torch.equal(fp8[mtp + "shared_head.head.weight"], fp8["lm_head.weight"]))

    def test_damaged_checkpoints_are_refused_naming_the_tensor(self):
        src, _, _ = self.make_released("damaged_src", (16, 16), True, seed=3)
        key = "model.layers.1.self_attn.o_proj.weight"

        def damaged(name, change):
            d = os.path.join(self.dir, name)
            shutil.copytree(src, d)
            change(d)
            p = run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config(name), "--init-from", d],
                    check=False)
            self.assertNotEqual(p.returncode, 0)
            return p.stdout + p.stderr

        # An FP8 weight without its scales (gone from their shard and from the index).
        d = os.path.join(self.dir, "no_scale")
        shutil.copytree(src, d)
        with open(os.path.join(d, "model.safetensors.index.json")) as f:
            index = json.load(f)
        scale_file = index["weight_map"][key + "_scale_inv"]
        from safetensors.torch import save_file
        t = load_dir(d)
        save_file({k: t[k] for k, f in index["weight_map"].items() if f == scale_file and k != key + "_scale_inv"},
                  os.path.join(d, scale_file), metadata={"format": "pt"})
        index["weight_map"].pop(key + "_scale_inv")
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f)
        p = run([os.path.join(BUILD, "app", "dstrain"), "train", "--config", self.config("no_scale"), "--init-from", d],
                check=False)
        msg = p.stdout + p.stderr
        self.assertNotEqual(p.returncode, 0)
        self.assertIn(f"FP8 tensor '{key}'", msg)
        self.assertIn(f"no '{key}_scale_inv' beside it", msg)

        # Scales made for 16 x 16 blocks, read as 128 x 128 (the config says so).
        def wrong_block(d):
            with open(os.path.join(d, "config.json")) as f:
                c = json.load(f)
            c["quantization_config"]["weight_block_size"] = [128, 128]
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(c, f)
        msg = damaged("wrong_block", wrong_block)
        self.assertIn("_scale_inv'", msg)
        self.assertIn("in blocks of 128 x 128", msg)
        self.assertIn("quantization_config.weight_block_size", msg)

        # The MTP module's head copy differs from the main head.
        def other_head(d):
            import torch
            mtp_head = f"model.layers.{MODEL['num_hidden_layers']}.shared_head.head.weight"
            with open(os.path.join(d, "model.safetensors.index.json")) as f:
                index = json.load(f)
            file = index["weight_map"][mtp_head]
            t = load_dir(d)
            part = {k: t[k] for k, f in index["weight_map"].items() if f == file}
            part[mtp_head] = (part[mtp_head].float() * 1.5).to(torch.bfloat16)
            save_file(part, os.path.join(d, file), metadata={"format": "pt"})
        msg = damaged("other_head", other_head)
        self.assertIn("shared_head.head.weight", msg)
        self.assertIn("differs from it", msg)


if __name__ == "__main__":
    BUILD = os.path.abspath(sys.argv.pop(1))
    try:
        import torch  # noqa: F401
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        sys.exit(f"test_fp8_checkpoints: {sys.executable} cannot import {e.name}: run validation/peer_venv.sh "
                 f"(it makes the venv with torch, safetensors and transformers) and pass its python")
    unittest.main(verbosity=2)
