"""Generate one dstrain correctness test case from the PyTorch reference.

Usage:
    /usr/bin/python3 validation/reference/make_case.py --out DIR --seed S [--gqa] [--tied]

Writes, deterministically in (S, --gqa, --tied):
    DIR/config.json           Hugging Face Llama config of a tiny random model
    DIR/model.safetensors     its initial F32 weights (HF names, no lm_head when tied)
    DIR/case.json             training hyper-parameters
    DIR/data.bin              llm.c token shard (v1: magic 20240520, uint16 tokens)
    DIR/expected.safetensors  reference outputs:
        tokens  I32 (B, T)      first micro-batch inputs  (windows 0 and 1)
        targets I32 (B, T)      first micro-batch targets
        logits  F32 (B, T, V)   logits of that micro-batch at the initial weights
        loss    F32 (1,)        mean token loss of that micro-batch
        grad.<name>  F32        d loss / d parameter (one backward, initial weights)
        step_losses F32 (steps,) global-batch mean token loss of each optimizer step
        lrs         F32 (steps,) learning rate used at each step
        grad_norms  F32 (steps,) global gradient L2 norm before clipping, each step
        final.<name> F32        parameters after `steps` AdamW steps
        bf16.step_losses, bf16.grad_norms, bf16.final.<name>
                                the same training under torch.autocast("cpu", bfloat16) with
                                fp32 weights and optimizer (PyTorch's mixed precision: what
                                dstrain's train.bf16 is compared with, by the update each
                                tensor receives)

Training semantics (shared with dstrain): window i of the shard is tokens
[i*T, i*T+T] (inputs = first T, targets = last T), consumed in order; step s,
micro-step m uses windows s*B*A + m*B + [0, B).  Per step: zero grads; each
micro-step backpropagates sum(token losses) / (B*A*T); then
clip_grad_norm_(params, gradient_clipping); set lr (DeepSpeed WarmupCosineLR at
last_batch_iteration = s); AdamW step with weight_decay 0 for the no_decay kinds
("norm": *layernorm.weight and model.norm.weight, "embedding":
model.embed_tokens.weight) and the configured weight_decay otherwise.

All expected values are computed in float32 on the CPU with one thread.  A float64
shadow run of the same training is compared against them and the discrepancy is
printed (and stored in the expected file's metadata) as a conditioning check.
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402
import safetensors_np  # noqa: E402

LLMC_MAGIC_V1 = 20240520
LLMC_HEADER_INTS = 256

# Deterministic fall-back list for gradient_clipping (first that fits wins).
CLIP_CANDIDATES = [0.5, 0.3, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.7, 1.0]
CLIP_MARGIN = 0.02  # no pre-clip norm may lie within 2% of the threshold


# ---------------------------------------------------------------------------
# Learning-rate schedule
# ---------------------------------------------------------------------------
def warmup_cosine_lr(step, base_lr, params):
    """DeepSpeed WarmupCosineLR at last_batch_iteration = step."""
    total = int(params["total_num_steps"])
    warm = max(2, int(params.get("warmup_num_steps", 0)))
    wmin = float(params.get("warmup_min_ratio", 0.0))
    cmin = float(params.get("cos_min_ratio", 0.0001))
    wtype = params.get("warmup_type", "log")
    if step < warm:
        if wtype == "linear":
            r = step / warm
        elif wtype == "log":
            r = math.log(step + 1) / math.log(warm)
        else:
            raise ValueError(f"unknown warmup_type {wtype}")
        ratio = wmin + r * (1.0 - wmin)
    else:
        real_last = step - warm + 1
        real_total = total - warm
        ratio = max(0.0, cmin + (1.0 - cmin) * (1 + math.cos(math.pi * real_last / real_total)) / 2)
    return base_lr * ratio


def lr_at(step, case):
    sch = case["scheduler"]
    if sch["type"] != "WarmupCosineLR":
        raise ValueError(f"unsupported scheduler {sch['type']}")
    return warmup_cosine_lr(step, case["lr"], sch["params"])


# ---------------------------------------------------------------------------
# Case generation
# ---------------------------------------------------------------------------
def make_config(rng, gqa, tied):
    heads = 4
    head_dim = int(rng.choice([4, 8]))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(rng.integers(40, 101)),
        "hidden_size": heads * head_dim,
        "intermediate_size": int(rng.integers(16, 49)),
        "num_hidden_layers": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": 2 if gqa else 4,
        "max_position_embeddings": 64,
        "rms_norm_eps": float(rng.choice([1e-6, 1e-5])),
        "rope_theta": float(rng.choice([10000.0, 500000.0])),
        "tie_word_embeddings": bool(tied),
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }


def make_weights(rng, config):
    """Initial weights: N(0, 0.2) for linear/embedding, 1 + N(0, 0.1) for norms."""
    shapes = {n: tuple(p.shape) for n, p in llama_ref.LlamaForCausalLM(config).state_dict().items()}
    weights = {}
    for name, shape in shapes.items():  # module registration order: deterministic
        if llama_ref.param_kind(name) == "norm":
            w = 1.0 + rng.normal(0.0, 0.1, size=shape)
        else:
            w = rng.normal(0.0, 0.2, size=shape)
        weights[name] = w.astype(np.float32)
    return weights


def make_case_json(clip):
    return {
        "seq_len": 16,
        "micro_batch": 2,
        "grad_accum": 2,
        "steps": 3,
        "lr": 1e-2,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "gradient_clipping": clip,
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": 10,
                "warmup_num_steps": 2,
                "warmup_min_ratio": 0.1,
                "cos_min_ratio": 0.1,
                "warmup_type": "linear",
            },
        },
        "no_decay": ["norm", "embedding"],
    }


def window_batch(data, first_window, count, seq_len):
    """Inputs/targets (count, T) int64 of windows first_window .. first_window+count-1."""
    rows = [data[(first_window + j) * seq_len:(first_window + j) * seq_len + seq_len + 1]
            for j in range(count)]
    arr = np.stack(rows).astype(np.int64)
    return torch.from_numpy(arr[:, :-1].copy()), torch.from_numpy(arr[:, 1:].copy())


def write_llmc_shard(path, tokens):
    header = np.zeros(LLMC_HEADER_INTS, dtype="<i4")
    header[0] = LLMC_MAGIC_V1
    header[1] = 1
    header[2] = len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype="<u2").tobytes())


# ---------------------------------------------------------------------------
# Reference computations
# ---------------------------------------------------------------------------
def build_model(config, weights, dtype):
    model = llama_ref.LlamaForCausalLM(config)
    model.load_numpy_state(weights)
    return model.to(dtype)


def first_microbatch(config, weights, data, case):
    T, B = case["seq_len"], case["micro_batch"]
    model = build_model(config, weights, torch.float32)
    x, y = window_batch(data, 0, B, T)
    logits = model(x)
    loss = llama_ref.token_losses(logits, y).sum() / (B * T)
    loss.backward()
    out = {
        "tokens": x.numpy().astype(np.int32),
        "targets": y.numpy().astype(np.int32),
        "logits": logits.detach().numpy().astype(np.float32),
        "loss": np.array([loss.item()], dtype=np.float32),
    }
    for name, p in model.named_parameters():
        out["grad." + name] = p.grad.numpy().astype(np.float32)
    return out


def autocast_bf16(enabled):
    """torch.autocast on the CPU in bfloat16: fp32 weights, their products in bf16."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)


def train(config, weights, data, case, dtype=torch.float32, bf16=False):
    """Run `steps` optimizer steps; returns step_losses, lrs, grad_norms, final params. bf16: the
    forward under autocast (the loss in fp32 from the logits widened), fp32 everything else."""
    T, B, A = case["seq_len"], case["micro_batch"], case["grad_accum"]
    model = build_model(config, weights, dtype)
    no_decay = set(case["no_decay"])
    named = list(model.named_parameters())
    decay = [p for n, p in named if llama_ref.param_kind(n) not in no_decay]
    nodecay = [p for n, p in named if llama_ref.param_kind(n) in no_decay]
    groups = [g for g in ({"params": decay, "weight_decay": case["weight_decay"]},
                          {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=case["lr"], betas=tuple(case["betas"]), eps=case["eps"],
                            weight_decay=case["weight_decay"])
    params = [p for _, p in named]
    step_losses, lrs, norms = [], [], []
    for s in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for m in range(A):
            x, y = window_batch(data, s * B * A + m * B, B, T)
            with autocast_bf16(bf16):
                logits = model(x).float()
            loss = llama_ref.token_losses(logits, y).sum() / (B * A * T)
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(params, case["gradient_clipping"])
        lr = lr_at(s, case)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        step_losses.append(total)
        lrs.append(lr)
        norms.append(float(norm))
    final = {n: p.detach().to(torch.float64).numpy() for n, p in named}
    return {"step_losses": step_losses, "lrs": lrs, "grad_norms": norms, "final": final}


def clip_ok(norms, clip):
    exceeds = any(n > clip * (1 + CLIP_MARGIN) for n in norms)
    borderline = any(abs(n - clip) <= CLIP_MARGIN * clip for n in norms)
    return exceeds and not borderline


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--gqa", action="store_true", help="num_key_value_heads = 2 (else 4)")
    ap.add_argument("--tied", action="store_true", help="tie_word_embeddings = true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # nothing should draw from it; belt and braces
    rng = np.random.default_rng(args.seed)

    config = make_config(rng, args.gqa, args.tied)
    weights = make_weights(rng, config)
    case = make_case_json(CLIP_CANDIDATES[0])
    T, B, A, S = case["seq_len"], case["micro_batch"], case["grad_accum"], case["steps"]
    n_tokens = S * B * A * T + 1 + 5 * T
    data = rng.integers(0, config["vocab_size"], size=n_tokens).astype(np.uint16)

    # Pick gradient_clipping deterministically so clipping triggers in >= 1 step.
    result = None
    for clip in CLIP_CANDIDATES:
        case["gradient_clipping"] = clip
        result = train(config, weights, data, case)
        print(f"gradient_clipping {clip}: pre-clip norms "
              + " ".join(f"{n:.6f}" for n in result["grad_norms"]))
        if clip_ok(result["grad_norms"], clip):
            break
    else:
        raise AssertionError("no gradient_clipping candidate makes clipping trigger")
    assert any(n > case["gradient_clipping"] for n in result["grad_norms"]), "clipping never triggers"

    first = first_microbatch(config, weights, data, case)

    # Conditioning check: float64 shadow run of the identical training.
    r64 = train(config, weights, data, case, dtype=torch.float64)
    final_diff = max(float(np.max(np.abs(result["final"][n] - r64["final"][n]))) for n in result["final"])
    rbf16 = train(config, weights, data, case, bf16=True)
    loss_diff = max(abs(a - b) for a, b in zip(result["step_losses"], r64["step_losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(result["grad_norms"], r64["grad_norms"]))

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
        f.write("\n")
    safetensors_np.save(os.path.join(args.out, "model.safetensors"), weights,
                        metadata={"format": "pt"})
    write_llmc_shard(os.path.join(args.out, "data.bin"), data)

    expected = dict(first)
    expected["step_losses"] = np.array(result["step_losses"], dtype=np.float32)
    expected["lrs"] = np.array(result["lrs"], dtype=np.float32)
    expected["grad_norms"] = np.array(result["grad_norms"], dtype=np.float32)
    for name, arr in result["final"].items():
        expected["final." + name] = arr.astype(np.float32)
    expected["bf16.step_losses"] = np.array(rbf16["step_losses"], dtype=np.float32)
    expected["bf16.grad_norms"] = np.array(rbf16["grad_norms"], dtype=np.float32)
    for name, arr in rbf16["final"].items():
        expected["bf16.final." + name] = arr.astype(np.float32)
    meta = {
        "generator": "validation/reference/make_case.py",
        "seed": args.seed,
        "gqa": int(args.gqa),
        "tied": int(args.tied),
        "torch": torch.__version__,
        "fp64_final_max_abs_diff": f"{final_diff:.3e}",
        "fp64_step_loss_max_abs_diff": f"{loss_diff:.3e}",
        "fp64_grad_norm_max_rel_diff": f"{norm_rel:.3e}",
    }
    safetensors_np.save(os.path.join(args.out, "expected.safetensors"), expected, metadata=meta)

    print(f"case {args.out}: seed {args.seed} gqa {args.gqa} tied {args.tied}")
    print("config: V={vocab_size} H={hidden_size} I={intermediate_size} L={num_hidden_layers} "
          "heads={num_attention_heads} kv={num_key_value_heads} eps={rms_norm_eps} "
          "theta={rope_theta}".format(**config))
    print(f"tokens in data.bin: {n_tokens}; gradient_clipping: {case['gradient_clipping']}")
    print(f"first micro-batch loss: {first['loss'][0]:.6f}  (ln V = {math.log(config['vocab_size']):.4f})")
    print("step_losses: " + " ".join(f"{v:.6f}" for v in result["step_losses"]))
    print("grad_norms:  " + " ".join(f"{v:.6f}" for v in result["grad_norms"]))
    print("lrs:         " + " ".join(f"{v:.6g}" for v in result["lrs"]))
    print("bf16 autocast step_losses: " + " ".join(f"{v:.6f}" for v in rbf16["step_losses"]))
    print("bf16 autocast grad_norms:  " + " ".join(f"{v:.6f}" for v in rbf16["grad_norms"]))
    print(f"fp64 shadow: final max|diff| {final_diff:.2e}, step loss max|diff| {loss_diff:.2e}, "
          f"grad norm max rel diff {norm_rel:.2e}")
    if final_diff > 1e-4:
        print("WARNING: final weights are sensitive to rounding (float32 vs float64 differ by "
              f"{final_diff:.2e}); compare final.* with a tolerance above that.")


if __name__ == "__main__":
    main()
