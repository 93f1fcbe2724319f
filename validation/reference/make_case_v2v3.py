"""Generate one dstrain DeepSeek-V2/V3 correctness test case from the PyTorch reference.

Usage:
    /usr/bin/python3 validation/reference/make_case_v2v3.py --out DIR --seed S
        [--model v2|v3] [--q-lora] [--topk-method greedy|group_limited_greedy|noaux_tc]
        [--norm-topk-prob] [--shared N] [--first-dense K] [--mtp D] [--no-seq-aux]
        [--rope auto|yarn|none] [--routed-scaling X]

Writes, deterministically in its arguments:
    DIR/config.json           Hugging Face DeepSeek-V2/V3 config of a tiny random model
    DIR/model.safetensors     its initial F32 weights (HF names; e_score_correction_bias
                              included for noaux_tc)
    DIR/case.json             training hyper-parameters (make_case.py's, plus mtp_weight and
                              bias_update_gamma)
    DIR/data.bin              llm.c token shard (v1: magic 20240520, uint16 tokens)
    DIR/expected.safetensors  reference outputs:
        tokens  I32 (B, T)       first micro-batch inputs  (windows 0 .. B-1)
        targets I32 (B, T)       first micro-batch targets
        logits  F32 (B, T, V)    main-model logits of that micro-batch at the initial weights
        loss    F32 (1,)         total training loss of that micro-batch taken as the whole
                                 global batch: ce_loss + aux_loss + mtp_loss
        ce_loss F32 (1,)         mean token cross-entropy of the main model
        aux_loss F32 (1,)        sum over all MoE layers (main and MTP) of their aux terms
        mtp_loss F32 (1,)        mtp_weight / D * sum_k mean CE of MTP depth k
        grad.<name> F32          d loss / d parameter for every trainable parameter (one
                                 backward at the initial weights; no e_score_correction_bias)
        step_losses F32 (steps,) total training loss of each optimizer step (global batch)
        lrs         F32 (steps,) learning rate used at each step
        grad_norms  F32 (steps,) global gradient L2 norm before clipping, each step
        final.<name> F32         every parameter and e_score_correction_bias after `steps`
                                 steps (bias updates included)
      debugging aids (not needed to pass):
        mtp_logits.<k> F32 (B, T, V)   MTP depth-k logits of the first micro-batch (k = 1..D)
        expert_counts.<i> I32 (E,)     top-k selections per expert of MoE layer i on the first
                                       micro-batch (i >= num_hidden_layers: MTP modules)

Training semantics (shared with dstrain and make_case.py): window i of the shard is tokens
[i*T, i*T+T] (inputs = first T, targets = last T), consumed in order; step s, micro-step m
uses windows s*B*A + m*B + [0, B).  Per step: zero grads; each micro-step backpropagates
    sum(CE token losses) / (B*A*T)
  + per MoE layer: seq_aux: alpha * sum_b aux_b / (B*A)   (aux_b = sum_e ce[b,e] * mean_t a[b,t,e],
                                                           ce = count / (T*K/E))
                   else:    alpha * sum_e Pi[e]*fi[e] / A  (of this micro-batch)
    with affinities a = the softmax scores, or the sigmoid scores normalised per token
    (DeepSeek-V3 eqs. 18-20; deepseek_ref.aux_affinities);
  + mtp_weight / D * sum_k sum(MTP-k token losses) / (B*A*(T-k));
MTP depth k at position i reads token t_{i+k} (0 beyond the window) and predicts t_{i+k+1}
(ignored beyond the window).  Then clip_grad_norm_(trainable params, gradient_clipping);
lr from DeepSpeed WarmupCosineLR at last_batch_iteration = s; AdamW with weight_decay 0 for
the no_decay kinds ("norm": *layernorm.weight, model.norm.weight, *enorm.weight,
*hnorm.weight, *shared_head.norm.weight; "embedding": model.embed_tokens.weight); then, for
noaux_tc, each e_score_correction_bias moves by +-bias_update_gamma towards balance given
its layer's expert counts over the whole step (all micro-batches, biases of the step).

All expected values are computed in float32 on the CPU with one thread.  A float64 shadow
run of the same training must route every token identically (checked) and its discrepancy
is printed and stored in the expected file's metadata.  Data whose routing decisions are
closer than ROUTING_MARGIN (near-ties), or whose routing is trivial, are rejected and the
script draws again from a derived seed (deterministically).
"""

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref  # noqa: E402
import make_case  # noqa: E402
import safetensors_np  # noqa: E402

MTP_WEIGHT = 0.3
BIAS_UPDATE_GAMMA = 0.01
ROUTING_MARGIN = 5e-5  # smallest allowed gap of any top-k routing decision (float32 run)
MAX_ATTEMPTS = 30


# ---------------------------------------------------------------------------
# Case generation
# ---------------------------------------------------------------------------
def make_config(rng, args):
    v3 = args.model == "v3"
    method = args.topk_method or ("noaux_tc" if v3 else "greedy")
    grouped = method != "greedy"
    if args.rope == "auto":
        yarn = bool(rng.integers(0, 2))
    else:
        yarn = args.rope == "yarn"
    rope_scaling = None
    if yarn:
        rope_scaling = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16,
                        "mscale": 0.8, "mscale_all_dim": 1.0 if v3 else 0.8,
                        "beta_fast": 32, "beta_slow": 1}
    rsf = args.routed_scaling if args.routed_scaling is not None else (2.5 if v3 else 1.0)
    return {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v3" if v3 else "deepseek_v2",
        "vocab_size": int(rng.integers(40, 101)),
        "hidden_size": int(rng.choice([32, 48])),
        "intermediate_size": 40,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 24 if args.q_lora else None,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "n_routed_experts": 8,
        "n_shared_experts": args.shared if args.shared > 0 else None,
        "num_experts_per_tok": 3 if method == "noaux_tc" else 2,
        "first_k_dense_replace": args.first_dense,
        "moe_layer_freq": 1,
        "topk_method": method,
        "n_group": 2 if grouped else 1,
        "topk_group": 1,
        "norm_topk_prob": bool(args.norm_topk_prob),
        "routed_scaling_factor": rsf,
        "scoring_func": "sigmoid" if method == "noaux_tc" else "softmax",
        "aux_loss_alpha": 0.01,
        "seq_aux": not args.no_seq_aux,
        "num_nextn_predict_layers": args.mtp,
        "max_position_embeddings": 64,
        "rms_norm_eps": float(rng.choice([1e-6, 1e-5])),
        "rope_theta": float(rng.choice([10000.0, 500000.0])),
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": "float32",
    }


def make_weights(rng, config):
    """Initial state: N(0, 0.2) for linear/embedding, 1 + N(0, 0.1) for norms,
    N(0, 0.05) for e_score_correction_bias."""
    shapes = {n: tuple(t.shape) for n, t in deepseek_ref.DeepseekForCausalLM(config).state_dict().items()}
    weights = {}
    for name, shape in shapes.items():  # module registration order: deterministic
        kind = deepseek_ref.param_kind(name)
        if kind == "norm":
            w = 1.0 + rng.normal(0.0, 0.1, size=shape)
        elif kind == "router_bias":
            w = rng.normal(0.0, 0.05, size=shape)
        else:
            w = rng.normal(0.0, 0.2, size=shape)
        weights[name] = w.astype(np.float32)
    return weights


def make_case_json(clip):
    case = make_case.make_case_json(clip)
    case["mtp_weight"] = MTP_WEIGHT
    case["bias_update_gamma"] = BIAS_UPDATE_GAMMA
    return case


def window_tokens(data, first_window, count, seq_len):
    """(count, T+1) int64 windows first_window .. first_window+count-1 (make_case's layout)."""
    rows = [data[(first_window + j) * seq_len:(first_window + j) * seq_len + seq_len + 1]
            for j in range(count)]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


# ---------------------------------------------------------------------------
# Reference computations
# ---------------------------------------------------------------------------
def build_model(config, weights, dtype):
    model = deepseek_ref.DeepseekForCausalLM(config)
    model.load_numpy_state(weights)
    return model.to(dtype)


def first_microbatch(config, weights, data, case):
    T, B = case["seq_len"], case["micro_batch"]
    model = build_model(config, weights, torch.float32)
    cfg = model.config
    window = window_tokens(data, 0, B, T)
    scales = deepseek_ref.LossScales.for_global_batch(cfg, B, 1, T, case["mtp_weight"])
    terms = deepseek_ref.loss_terms(model, window, scales)
    terms["total"].backward()
    out = {
        "tokens": window[:, :-1].numpy().astype(np.int32),
        "targets": window[:, 1:].numpy().astype(np.int32),
        "logits": terms["logits"].detach().numpy().astype(np.float32),
        "loss": np.array([terms["total"].item()], dtype=np.float32),
        "ce_loss": np.array([terms["ce"].item()], dtype=np.float32),
        "aux_loss": np.array([terms["aux"].item()], dtype=np.float32),
        "mtp_loss": np.array([terms["mtp"].item()], dtype=np.float32),
    }
    for k, lg in enumerate(terms["mtp_logits"], start=1):
        out[f"mtp_logits.{k}"] = lg.detach().numpy().astype(np.float32)
    counts = deepseek_ref.expert_counts(terms["records"], cfg.n_routed_experts)
    for layer, c in counts.items():
        out[f"expert_counts.{layer}"] = c.astype(np.int32)
    for name, p in model.named_parameters():  # an expert no token chose has a zero gradient
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        out["grad." + name] = g.numpy().astype(np.float32)
    return out, terms["records"]


def train(config, weights, data, case, dtype=torch.float32, bf16=False):
    """Run `steps` optimizer steps; returns step_losses, lrs, grad_norms, final state,
    the routing of every gate call (for comparing runs) and the smallest routing margin.
    bf16: the forward under torch.autocast("cpu", bfloat16) with the gate in fp32
    (deepseek_ref.autocast_patches), fp32 weights, losses and optimizer."""
    if bf16:
        deepseek_ref.autocast_patches()
    T, B, A = case["seq_len"], case["micro_batch"], case["grad_accum"]
    model = build_model(config, weights, dtype)
    cfg = model.config
    scales = deepseek_ref.LossScales.for_global_batch(cfg, B, A, T, case["mtp_weight"])
    no_decay = set(case["no_decay"])
    named = list(model.named_parameters())
    decay = [p for n, p in named if deepseek_ref.param_kind(n) not in no_decay]
    nodecay = [p for n, p in named if deepseek_ref.param_kind(n) in no_decay]
    groups = [g for g in ({"params": decay, "weight_decay": case["weight_decay"]},
                          {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, lr=case["lr"], betas=tuple(case["betas"]), eps=case["eps"],
                            weight_decay=case["weight_decay"])
    params = [p for _, p in named]
    step_losses, lrs, norms, routing, step_counts = [], [], [], [], []
    margin = float("inf")
    for s in range(case["steps"]):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        records = []
        for m in range(A):
            window = window_tokens(data, s * B * A + m * B, B, T)
            with make_case.autocast_bf16(bf16):
                terms = deepseek_ref.loss_terms(model, window, scales)
            terms["total"].backward()
            total += terms["total"].item()
            records += terms["records"]
        for p in params:  # experts no token chose: zero gradient, AdamW still steps them
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(params, case["gradient_clipping"])
        lr = make_case.lr_at(s, case)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.step()
        counts = deepseek_ref.expert_counts(records, cfg.n_routed_experts)
        deepseek_ref.update_router_biases(model, counts, case["bias_update_gamma"])
        step_losses.append(total)
        lrs.append(lr)
        norms.append(float(norm))
        step_counts.append(counts)
        for rec in records:
            routing.append((rec.layer, rec.idx.sort(dim=-1).values.numpy()))
            margin = min(margin, rec.margin)
    final = {n: t.detach().to(torch.float64).numpy() for n, t in model.state_dict().items()}
    return {"step_losses": step_losses, "lrs": lrs, "grad_norms": norms, "final": final,
            "routing": routing, "margin": margin, "counts": step_counts}


def routing_problems(cfg, records):
    """Reasons why the first micro-batch's routing is too trivial to test anything."""
    problems = []
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    biased_changed = group_changed = False
    for rec in records:
        idx = rec.idx.reshape(-1, k)
        used = len(np.unique(idx.numpy()))
        if used < max(2, e // 2):
            problems.append(f"layer {rec.layer} uses only {used} of {e} experts")
        sets = {tuple(sorted(r)) for r in idx.tolist()}
        if len(sets) < 3:
            problems.append(f"layer {rec.layer} routes all tokens to {len(sets)} expert sets")
        a = rec.idx.sort(dim=-1).values
        if not torch.equal(a, rec.unbiased_idx.sort(dim=-1).values):
            biased_changed = True
        if not torch.equal(rec.unbiased_idx.sort(dim=-1).values, rec.greedy_idx.sort(dim=-1).values):
            group_changed = True
    if cfg.topk_method == "noaux_tc" and not biased_changed:
        problems.append("e_score_correction_bias changes no selection on the first micro-batch")
    if cfg.topk_method != "greedy" and cfg.topk_group < cfg.n_group and not group_changed:
        problems.append("group limiting changes no selection on the first micro-batch")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--model", choices=["v2", "v3"], default="v2",
                    help="model_type deepseek_v2 / deepseek_v3 (v3: routed_scaling_factor 2.5)")
    ap.add_argument("--q-lora", action="store_true", help="q_lora_rank = 24 (else null)")
    ap.add_argument("--topk-method", choices=["greedy", "group_limited_greedy", "noaux_tc"],
                    default=None, help="default: greedy for v2, noaux_tc for v3")
    ap.add_argument("--norm-topk-prob", action="store_true")
    ap.add_argument("--shared", type=int, default=1, choices=[0, 1, 2], help="n_shared_experts")
    ap.add_argument("--first-dense", type=int, default=1, choices=[0, 1, 2], help="first_k_dense_replace")
    ap.add_argument("--mtp", type=int, default=0, choices=[0, 1, 2], help="num_nextn_predict_layers")
    ap.add_argument("--no-seq-aux", action="store_true", help="seq_aux = false (batch-wise aux loss)")
    ap.add_argument("--rope", choices=["auto", "yarn", "none"], default="auto",
                    help="rope_scaling: yarn, null, or drawn from the seed (auto)")
    ap.add_argument("--routed-scaling", type=float, default=None,
                    help="routed_scaling_factor (default 2.5 for v3, 1.0 for v2)")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)  # nothing should draw from it; belt and braces

    rejected = []
    for attempt in range(MAX_ATTEMPTS):
        rng = np.random.default_rng(args.seed if attempt == 0 else [args.seed, attempt])
        config = make_config(rng, args)
        weights = make_weights(rng, config)
        case = make_case_json(make_case.CLIP_CANDIDATES[0])
        T, B, A, S = case["seq_len"], case["micro_batch"], case["grad_accum"], case["steps"]
        n_tokens = S * B * A * T + 1 + 5 * T
        data = rng.integers(0, config["vocab_size"], size=n_tokens).astype(np.uint16)
        cfg = deepseek_ref.DeepseekConfig(config)

        # Pick gradient_clipping deterministically so clipping triggers in >= 1 step.
        result = None
        for clip in make_case.CLIP_CANDIDATES:
            case["gradient_clipping"] = clip
            result = train(config, weights, data, case)
            print(f"attempt {attempt}: gradient_clipping {clip}: pre-clip norms "
                  + " ".join(f"{n:.6f}" for n in result["grad_norms"]))
            if make_case.clip_ok(result["grad_norms"], clip):
                break
        else:
            rejected.append(f"attempt {attempt}: no gradient_clipping candidate makes clipping trigger")
            continue

        first, records = first_microbatch(config, weights, data, case)
        problems = routing_problems(cfg, records)
        margin = min([result["margin"]] + [r.margin for r in records])
        if margin < ROUTING_MARGIN:
            problems.append(f"routing near-tie: smallest decision margin {margin:.3g} < {ROUTING_MARGIN}")

        # Conditioning check: float64 shadow run of the identical training.
        r64 = train(config, weights, data, case, dtype=torch.float64)
        same_routing = (len(r64["routing"]) == len(result["routing"]) and all(
            la == lb and np.array_equal(a, b) for (la, a), (lb, b) in zip(result["routing"], r64["routing"])))
        if not same_routing:
            problems.append("the float64 shadow run routes some token differently")
        if problems:
            rejected.append(f"attempt {attempt}: " + "; ".join(problems))
            print(rejected[-1])
            continue
        break
    else:
        raise AssertionError("no acceptable case within %d attempts:\n  %s" % (MAX_ATTEMPTS, "\n  ".join(rejected)))

    assert any(n > case["gradient_clipping"] for n in result["grad_norms"]), "clipping never triggers"
    final_diff = max(float(np.max(np.abs(result["final"][n] - r64["final"][n]))) for n in result["final"])
    rbf16 = train(config, weights, data, case, bf16=True)
    loss_diff = max(abs(a - b) for a, b in zip(result["step_losses"], r64["step_losses"]))
    norm_rel = max(abs(a - b) / b for a, b in zip(result["grad_norms"], r64["grad_norms"]))
    bias_names = [n for n in result["final"] if deepseek_ref.param_kind(n) == "router_bias"]
    bias_moved = {n: float(np.max(np.abs(result["final"][n] - weights[n]))) for n in bias_names}
    if bias_names:
        assert all(v > 0 for v in bias_moved.values()), f"a routing bias never moved: {bias_moved}"

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    with open(os.path.join(args.out, "case.json"), "w") as f:
        json.dump(case, f, indent=2)
        f.write("\n")
    safetensors_np.save(os.path.join(args.out, "model.safetensors"), weights,
                        metadata={"format": "pt"})
    make_case.write_llmc_shard(os.path.join(args.out, "data.bin"), data)

    expected = dict(first)
    expected["step_losses"] = np.array(result["step_losses"], dtype=np.float32)
    expected["lrs"] = np.array(result["lrs"], dtype=np.float32)
    expected["grad_norms"] = np.array(result["grad_norms"], dtype=np.float32)
    for name, arr in result["final"].items():
        expected["final." + name] = arr.astype(np.float32)
    # The same training under PyTorch's bf16 autocast (make_case.py says what it holds).
    expected["bf16.step_losses"] = np.array(rbf16["step_losses"], dtype=np.float32)
    expected["bf16.grad_norms"] = np.array(rbf16["grad_norms"], dtype=np.float32)
    for name, arr in rbf16["final"].items():
        expected["bf16.final." + name] = arr.astype(np.float32)
    meta = {
        "generator": "validation/reference/make_case_v2v3.py",
        "seed": args.seed,
        "attempt": attempt,
        "args": " ".join(f"{k}={v}" for k, v in sorted(vars(args).items()) if k != "out"),
        "torch": torch.__version__,
        "routing_min_margin": f"{margin:.3e}",
        "fp64_final_max_abs_diff": f"{final_diff:.3e}",
        "fp64_step_loss_max_abs_diff": f"{loss_diff:.3e}",
        "fp64_grad_norm_max_rel_diff": f"{norm_rel:.3e}",
    }
    safetensors_np.save(os.path.join(args.out, "expected.safetensors"), expected, metadata=meta)

    print(f"case {args.out}: seed {args.seed} (attempt {attempt}) model {args.model} "
          f"topk_method {cfg.topk_method} q_lora {cfg.q_lora_rank or None} shared {cfg.n_shared_experts} "
          f"first_dense {cfg.first_k_dense_replace} mtp {cfg.num_nextn_predict_layers} "
          f"seq_aux {cfg.seq_aux} norm_topk_prob {cfg.norm_topk_prob}")
    print("config: V={vocab_size} H={hidden_size} L={num_hidden_layers} heads={num_attention_heads} "
          "experts={n_routed_experts} top{num_experts_per_tok} groups {n_group}/{topk_group} "
          "scoring={scoring_func} rsf={routed_scaling_factor} eps={rms_norm_eps} theta={rope_theta} "
          "rope_scaling={rope_scaling}".format(**config))
    moe = [i for i in range(cfg.num_hidden_layers + cfg.num_nextn_predict_layers) if cfg.is_moe_layer(i)]
    print(f"MoE layers: {moe}; tokens in data.bin: {n_tokens}; "
          f"gradient_clipping: {case['gradient_clipping']}")
    print(f"first micro-batch: loss {first['loss'][0]:.6f} = ce {first['ce_loss'][0]:.6f} "
          f"+ aux {first['aux_loss'][0]:.6f} + mtp {first['mtp_loss'][0]:.6f}  "
          f"(ln V = {math.log(config['vocab_size']):.4f})")
    for name in sorted(k for k in first if k.startswith("expert_counts.")):
        print(f"  {name}: {first[name].tolist()}")
    print("step_losses: " + " ".join(f"{v:.6f}" for v in result["step_losses"]))
    print("grad_norms:  " + " ".join(f"{v:.6f}" for v in result["grad_norms"]))
    print("lrs:         " + " ".join(f"{v:.6g}" for v in result["lrs"]))
    for n in bias_names:
        print(f"  {n}: max |moved| {bias_moved[n]:.3g}")
    print(f"routing: smallest decision margin {margin:.3e}; float64 shadow routes identically")
    print(f"fp64 shadow: final max|diff| {final_diff:.2e}, step loss max|diff| {loss_diff:.2e}, "
          f"grad norm max rel diff {norm_rel:.2e}")
    if final_diff > 1e-4:
        print("WARNING: final weights are sensitive to rounding (float32 vs float64 differ by "
              f"{final_diff:.2e}); compare final.* with a tolerance above that.")


if __name__ == "__main__":
    main()
