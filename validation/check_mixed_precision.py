#!/usr/bin/env python3
"""dstrain's mixed precision (fp32 masters, bf16/fp16 compute) against PyTorch and against its
own fp32 training. Prints one PASS/FAIL line per check with its figures.

    PEER_PYTHON validation/check_mixed_precision.py [--build build] [--parts autocast,quickstart,fp16]
        [--steps 400] [--threads 2] [--fp16-scale-power 32] [--keep DIR]

PEER_PYTHON: the venv of validation/peer_venv.sh (current torch and transformers).

autocast   Against PyTorch autocast (torch.autocast("cpu", dtype=torch.bfloat16), fp32 weights),
           and the same in fp16 (torch.float16 against dstrain's fp16 compute copy, no loss scale)
           on a small dense (Llama: GQA, untied) and a small DeepSeek-V3 model (MLA with q LoRA
           and YaRN, sigmoid/noaux_tc MoE with groups and a shared expert, one MTP module, the
           sequence-wise balance loss). The same fp32 weights and windows go to dstrain
           (tests/interop/dump_logits: --dtype bf16, the compute path train.bf16 trains with)
           and to the peer: transformers' LlamaForCausalLM (eager attention) for the dense
           model; validation/reference/deepseek_ref.py (DeepSeek's modelling with MTP and the
           balance loss, which transformers' DeepseekV3 lacks) for V3. The peer's MoE gate runs
           in fp32 on the bf16 norm output, as Hugging Face's MoEGate upcasts (autocast would
           otherwise run it in bf16) and as dstrain's contract says; expert outputs are rounded
           to bf16 by autocast and summed in fp32. Checked:
           - logits: max |dstrain bf16 - torch bf16| <= LOGITS_TOL x max |logit|, and dstrain
             bf16's distance to the fp32 logits at most twice autocast's (+ a small floor) and at
             least a tenth of it (it does round to bf16);
           - every parameter gradient of the training loss (CE + aux + MTP): cosine similarity
             with the peer's >= COS_MIN; the worst tensors are printed;
           - as a check of the harness, dstrain fp32 against the peer fp32 (1e-4).
quickstart inputs/quickstart.json trained in fp32 and in bf16 (train.bf16.enabled) for --steps steps
           (400: the quickstart; fewer for a quick check, the schedule shortened alike): the
           final validation loss of bf16 within 1% of fp32's.
fp16       The same run in fp16 with dynamic loss scaling (train.fp16: loss_scale 0, an initial
           scale of 2^--fp16-scale-power, default 2^32, high enough that the first steps overflow): the scale
           must back off (skipped steps or a lower scale in the metrics) and training continue.
           The fp16 run stops after the first 10% of the steps (the overflow phase) with a
           checkpoint, and continues from it in fp16 and, as the reference, in fp32 (a resume in
           another precision): the same weights, moments, learning rates and batches from there
           on. Their loss curves (means over windows of min(20, steps/5) steps) must stay within
           2% and their final validation losses within 2%. Against the fp32 run from step 0 the
           curves are printed for information only: that run also trained on the batches that
           fp16's overflow-skipped steps consumed (DeepSpeed's semantics), which moves its
           validation loss by more than fp16's rounding does (at 400 steps from 2^32: 10 skipped
           steps, 2.3%, against 0.04% between the two continuations).

Exit status: 0 all checks passed, 1 a check failed. A build without the bf16 or fp16 compute path
(its training rejects train.bf16 / train.fp16, or the model has no such path) fails the parts
that need it, saying "dstrain bf16: not available in this build": a check that cannot run is not a
check that passed. The fp32 harness check runs regardless.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "validation", "reference"))

NOT_AVAILABLE = 77
LOGITS_TOL = 3e-2       # of max |logit|: bf16 keeps 8 bits, and two implementations round differently
LOGITS_FLOOR = 2e-3     # added to twice autocast's own distance to fp32
COS_MIN = 0.999
COS_FLOOR = 0.99        # where the peer strays from fp32 itself (see check_autocast)
FP32_TOL = 1e-4         # dstrain fp32 against the peer fp32 (the harness itself)
N_WINDOWS, SEQ = 8, 64
MTP_WEIGHT = 0.3

COMMON = {"hidden_act": "silu", "vocab_size": 260, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
          "initializer_range": 0.02, "bos_token_id": 256, "eos_token_id": 257}
MODELS = {
    "dense": dict(COMMON, architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128, tie_word_embeddings=False),
    "v3": dict(COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=64,
               intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
               max_position_embeddings=128, tie_word_embeddings=False,
               q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
               rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
               n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
               first_k_dense_replace=1, moe_layer_freq=1, n_group=4, topk_group=2, topk_method="noaux_tc",
               scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.5,
               aux_loss_alpha=0.001, seq_aux=True, num_nextn_predict_layers=1),
}

results = []  # (ok, line)


def report(ok, line):
    results.append((ok, line))
    print(("PASS " if ok else "FAIL ") + line, flush=True)


def env(threads):
    return dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads))


# ---- autocast: logits and gradients against PyTorch ------------------------------------------------
def make_weights(name, d, seed):
    """Random fp32 weights of model `name` in HF layout under d (config.json, model.safetensors);
    returns the fp32 peer module holding them."""
    import torch
    from safetensors.torch import save_file
    cfg = MODELS[name]
    g = torch.Generator().manual_seed(seed)
    peer = build_peer(name)
    with torch.no_grad():
        for n, p in list(peer.named_parameters()) + list(peer.named_buffers()):
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif n.endswith("norm.weight") or "layernorm" in n:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif n == "model.embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() == 2:  # a linear map: unit-variance outputs for unit-variance inputs
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[1]))
        if name == "v3":
            route_by_token(peer, cfg, g)
    state = {n: t.detach().contiguous() for n, t in peer.state_dict().items()}
    save_file(state, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return state


def route_by_token(peer, cfg, g):
    """Routing with wide margins, so that bf16 rounding (which differs between any two
    implementations) flips no token's experts: a flipped token would move its experts' gradients
    by far more than rounding does. Each token id prefers two experts of two different groups: its
    embedding has a large component along coordinates e1 and e2, which the gates read (gate row e
    is coordinate e, plus noise); the MTP module's eh_proj passes the next token's embedding
    through, and the layers' output projections are damped so that the residual keeps it. The
    experts chosen still vary from token to token, and every weight still gets a gradient."""
    import torch
    E, per_group, d = cfg["n_routed_experts"], cfg["n_routed_experts"] // cfg["n_group"], cfg["hidden_size"]
    emb = peer.model.embed_tokens.weight
    emb[:, :E] = 0.1 * torch.randn(emb.shape[0], E, generator=g)  # the other experts' scores stay near 0.5
    for tok in range(emb.shape[0]):
        g1, g2 = torch.randperm(cfg["n_group"], generator=g)[:2].tolist()
        for grp in (g1, g2):
            e = grp * per_group + int(torch.randint(per_group, (1,), generator=g))
            emb[tok, e] += 3.0
    for n, p in peer.named_parameters():
        if n.endswith("mlp.gate.weight"):
            p.copy_(0.05 * torch.randn(p.shape, generator=g) / d ** 0.5)
            p[:, :E] += 2.0 * torch.eye(E)
        elif n.endswith("eh_proj.weight"):  # [enorm(embedding of the next token); hnorm(hidden)]
            p.copy_(0.2 * torch.randn(p.shape, generator=g) / (2 * d) ** 0.5)
            p[:, :d] += torch.eye(d)
        elif n.endswith(("o_proj.weight", "down_proj.weight")):
            p.mul_(0.1)
    for n, b in peer.named_buffers():
        if n.endswith("e_score_correction_bias"):
            b.copy_(0.01 * torch.randn(b.shape, generator=g))


def build_peer(name, d=None):
    import torch
    cfg = MODELS[name]
    if name == "dense":
        import transformers
        if d:
            return transformers.LlamaForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        conf = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        return transformers.LlamaForCausalLM._from_config(conf, attn_implementation="eager").float()
    import deepseek_ref
    return deepseek_ref.DeepseekForCausalLM(cfg)


def peer_run(name, state, windows, dtype=None):
    """(logits (N,T,V) float64 numpy, {param: grad float64 numpy}, loss, expert counts by layer);
    dtype "bf16" or "fp16": under torch.autocast in that dtype, else fp32."""
    import numpy as np
    import torch
    torch.manual_seed(0)
    model = build_peer(name)
    model.load_state_dict({k: v.clone() for k, v in state.items()}, strict=True)
    model.train()
    win = torch.from_numpy(windows.astype(np.int64))
    x, y = win[:, :-1], win[:, 1:]
    counts = {}
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.bfloat16)
    with torch.autocast("cpu", dtype=amp, enabled=dtype is not None):
        if name == "dense":
            logits = model(input_ids=x, use_cache=False).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        else:
            import deepseek_ref
            deepseek_ref.autocast_patches()
            scales = deepseek_ref.LossScales.for_global_batch(model.config, x.shape[0], 1, x.shape[1], MTP_WEIGHT)
            terms = deepseek_ref.loss_terms(model, win, scales)
            logits, loss = terms["logits"].float(), terms["total"]
            for layer, c in deepseek_ref.expert_counts(terms["records"], model.config.n_routed_experts).items():
                counts[layer] = [int(v) for v in c]
    loss.backward()
    grads = {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double().numpy(), grads, float(loss.detach()), counts


def dstrain_run(build, d, windows_file, dtype, threads):
    """(logits, grads, loss, counts) from interop_dump_logits, or None when the build lacks dtype."""
    import numpy as np
    from safetensors.numpy import load_file
    logits_out, grads_out = os.path.join(d, f"logits.{dtype}"), os.path.join(d, f"grads.{dtype}.safetensors")
    p = subprocess.run([os.path.join(build, "tests", "interop_dump_logits"), d, windows_file, str(N_WINDOWS), str(SEQ),
                        logits_out, "--dtype", dtype, "--grads", grads_out, "--mtp-weight", str(MTP_WEIGHT)],
                       capture_output=True, text=True, env=env(threads))
    if p.returncode == NOT_AVAILABLE:
        return None, p.stdout.strip()
    if p.returncode != 0:
        raise RuntimeError(f"interop_dump_logits --dtype {dtype} failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
    with open(os.path.join(d, "config.json")) as f:
        V = json.load(f)["vocab_size"]
    logits = np.fromfile(logits_out, dtype=np.float32).reshape(N_WINDOWS, SEQ, V).astype(np.float64)
    grads = {k: v.astype(np.float64) for k, v in load_file(grads_out).items()}
    loss = float(next(l for l in p.stdout.splitlines() if l.startswith("loss ")).split()[1])
    counts = {}
    for line in p.stdout.splitlines():
        if line.startswith("experts "):
            parts = line.split()
            counts[int(parts[1])] = [int(v) for v in parts[2:]]
    return (logits, grads, loss, counts), None


def config_key_missing(build, key, threads):
    """The error of a `dstrain train` whose configuration sets `key` ("bf16" or "fp16") when this
    build does not know the key, else None. (The run stops at its missing data either way.)"""
    with tempfile.TemporaryDirectory() as d:
        run = os.path.join(d, "run.json")
        with open(os.path.join(d, "model.json"), "w") as f:
            json.dump(MODELS["dense"], f)
        with open(run, "w") as f:
            json.dump({"model": os.path.join(d, "model.json"),
                       "train": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                 key: {"enabled": True}},
                       "data": {"train": os.path.join(d, "missing_*.bin"), "seq_len": 8},
                       "output": {"dir": os.path.join(d, "out")}}, f)
        p = subprocess.run([os.path.join(build, "app", "dstrain"), "train", "--config", run, "--max-steps", "1"],
                           capture_output=True, text=True, env=env(threads))
    for line in (p.stderr + p.stdout).splitlines():
        if f"train.{key}" in line and "unknown key" in line:
            return line.strip()
    return None


def cosine(a, b):
    import numpy as np
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    return float((a.ravel() @ b.ravel()) / max(na * nb, 1e-300))


def check_autocast(a, dtype="bf16"):
    import numpy as np
    windows_rng = np.random.default_rng(7)
    any_available = False
    # Until training accepts train.bf16, the model's bf16 path is work in progress: skip.
    missing = config_key_missing(a.build, dtype, a.threads)
    if missing:
        report(False, f"autocast {dtype}: dstrain {dtype}: not available in this build ({missing})")
    for name in ("dense", "v3"):
        d = tempfile.mkdtemp(prefix=f"dstrain_mp_{name}_", dir=a.keep)
        try:
            state = make_weights(name, d, seed=11 if name == "dense" else 13)
            windows = windows_rng.integers(0, MODELS[name]["vocab_size"] - 4, size=(N_WINDOWS, SEQ + 1),
                                           dtype=np.int32)
            wf = os.path.join(d, "windows.i32")
            windows.tofile(wf)
            ds32, _ = dstrain_run(a.build, d, wf, "fp32", a.threads)
            ds16, why = (None, None) if missing else dstrain_run(a.build, d, wf, dtype, a.threads)
            pt32 = peer_run(name, state, windows)
            # The harness: dstrain fp32 is the peer fp32.
            scale = np.abs(pt32[0]).max()
            e32 = np.abs(ds32[0] - pt32[0]).max() / scale
            g32 = max(np.abs(ds32[1][k] - pt32[1][k]).max() / max(np.abs(pt32[1][k]).max(), 1e-30) for k in pt32[1])
            report(e32 <= FP32_TOL and g32 <= FP32_TOL,
                   f"autocast {dtype} {name}: harness, dstrain fp32 vs torch fp32: logits {e32:.1e}, worst gradient {g32:.1e} "
                   f"(relative to max; <= {FP32_TOL:g})")
            if ds16 is None:
                report(False, f"autocast {dtype} {name}: dstrain {dtype}: not available in this build ({why})")
                continue
            any_available = True
            pt16 = peer_run(name, state, windows, dtype)
            e_peer = np.abs(ds16[0] - pt16[0]).max() / scale
            e_ds_fp32 = np.abs(ds16[0] - pt32[0]).max() / scale
            e_pt_fp32 = np.abs(pt16[0] - pt32[0]).max() / scale
            report(e_peer <= LOGITS_TOL and e_ds_fp32 <= 2 * e_pt_fp32 + LOGITS_FLOOR,
                   f"autocast {dtype} {name}: logits max|dstrain {dtype} - torch {dtype}| = {e_peer:.2e} of max|logit| {scale:.3g} "
                   f"(<= {LOGITS_TOL:g}); distance to fp32: dstrain {dtype} {e_ds_fp32:.2e}, torch autocast "
                   f"{e_pt_fp32:.2e} (dstrain <= 2x torch + {LOGITS_FLOOR:g}); loss dstrain {ds16[2]:.6f}, torch "
                   f"{pt16[2]:.6f}, fp32 {pt32[2]:.6f}")
            report(e_ds_fp32 >= 0.1 * e_pt_fp32,
                   f"autocast {dtype} {name}: dstrain --dtype {dtype} computes in {dtype}: its logits are {e_ds_fp32:.2e} from fp32 "
                   f"(autocast's: {e_pt_fp32:.2e}; at least a tenth of it, else nothing was rounded)")
            names = sorted(pt16[1])
            missing = sorted(set(names) ^ set(ds16[1]))
            cos = sorted((cosine(ds16[1][k], pt16[1][k]), k) for k in names if k in ds16[1])
            cos_ref = {k: cosine(pt16[1][k], pt32[1][k]) for k in names}
            cos_ds32 = {k: cosine(ds16[1][k], pt32[1][k]) for k in names if k in ds16[1]}
            worst = cos[0][0] if cos else float("nan")
            # A tensor agrees when its gradient's cosine with the peer's is COS_MIN or more, or,
            # where the peer itself strays further from fp32 than that allows (PyTorch's fp16
            # autocast on MLA's low-rank projections: 0.9987), when dstrain's is at least as close
            # to fp32 as the peer's and still COS_FLOOR from it.
            stray = [k for c, k in cos if c < COS_MIN and not (c >= COS_FLOOR and cos_ds32[k] >= cos_ref[k])]
            closer = [k for c, k in cos if COS_FLOOR <= c < COS_MIN and k not in stray]
            report(not missing and not stray,
                   f"autocast {dtype} {name}: gradient cosine dstrain {dtype} vs torch {dtype} >= {COS_MIN} (or >= "
                   f"{COS_FLOOR} and dstrain closer to fp32 than torch): worst {worst:.6f} over {len(cos)} tensors"
                   + (f"; {len(closer)} below {COS_MIN} where torch strays from fp32 more than dstrain" if closer else "")
                   + (f"; failing: {stray}" if stray else "")
                   + (f"; missing on one side: {missing}" if missing else ""))
            print(f"     worst tensors (cos vs torch {dtype} | dstrain {dtype} vs fp32 | torch {dtype} vs fp32):")
            for c, k in cos[:6]:
                print(f"       {c:.6f} | {cos_ds32[k]:.6f} | {cos_ref[k]:.6f}  {k}")
            if pt16[3]:
                same = all(ds16[3].get(l) == c for l, c in pt16[3].items()) if ds16[3] else None
                print(f"     expert loads by MoE layer: torch {dtype} {pt16[3]}" +
                      ("" if same is None else f"; dstrain {dtype} {'identical' if same else ds16[3]}"))
        finally:
            if not a.keep:
                shutil.rmtree(d, ignore_errors=True)
    return any_available


# ---- quickstart and fp16: training runs ------------------------------------------------------------
def train(a, precision, out, steps, stop=None, resume=None):
    """The quickstart run in `precision` with a schedule of `steps` steps, stopped after `stop`
    (default: all of them) or resumed from the checkpoint `resume`; returns its metrics records."""
    sets = [f"train.max_steps={stop or steps}", f"train.scheduler.params.total_num_steps={steps}",
            f"train.scheduler.params.warmup_num_steps={max(1, steps // 10)}",
            f"train.eval_interval={max(1, min(100, steps // 4))}", f'output.dir="{out}"', 'output.save_hf=""',
            "generate.interval=0", 'generate.prompt=""']
    if precision == "bf16":
        sets.append('train.bf16={"enabled": true}')
    elif precision == "fp16":
        sets.append('train.fp16=' + json.dumps({"enabled": True, "loss_scale": 0,
                                                 "initial_scale_power": a.fp16_scale_power,
                                                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}))
    cmd = [os.path.join(a.build, "app", "dstrain"), "train", "--config", "inputs/quickstart.json"]
    if resume:
        cmd += ["--resume", resume]
    for s in sets:
        cmd += ["--set", s]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env(a.threads))
    if p.returncode != 0:
        lines = (p.stderr + p.stdout).splitlines()
        err = [l.strip() for l in lines if "error" in l.lower()] or [l.strip() for l in lines if l.strip()][-1:]
        return None, err[0] if err else f"exit status {p.returncode}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(l) for l in f], None


def curve(records, window, by_update=True, first=1):
    """Mean training loss per `window` steps from step `first` (skipped steps left out).
    by_update: steps are counted in applied updates. A step skipped for an fp16 overflow moves
    neither the weights nor the learning-rate schedule (DeepSpeed's semantics), so fp16 step s
    after k overflow skips is compared with fp32 step s - k, the step that starts from as many
    updates at the same learning rate (but whose batch is another: the skipped steps consumed
    theirs). Otherwise steps are counted as they are: batch s is batch s in both runs."""
    losses = {}
    for r in records:
        if r.get("type") != "train" or r.get("overflow"):
            continue
        if r.get("loss") is not None and math.isfinite(r["loss"]):
            k = int(r.get("overflow_skipped_total") or 0) if by_update else 0
            losses[r["step"] - k] = r["loss"]
    last = max(losses) if losses else 0
    out = []
    for start in range(first, last + 1, window):
        vals = [losses[s] for s in range(start, start + window) if s in losses]
        out.append((start, statistics.fmean(vals) if vals else float("nan")))
    return out


def curve_gap(mine, ref, window, after, by_update=True):
    """The worst relative gap between two runs' windowed loss means, over windows after step
    `after` that both runs fill: (gap, first step of its window), or (nan, None)."""
    first = after + 1
    c = dict(curve(mine, window, by_update, first))
    devs = [(abs(c[s] - v) / v, s) for s, v in curve(ref, window, by_update, first)
            if s in c and math.isfinite(c[s]) and math.isfinite(v)]
    return max(devs) if devs else (float("nan"), None)


def run_gap(mine, ref, window, after, by_update):
    """curve_gap of two runs, their final validation losses and the relative gap between those:
    (worst window gap, its first step, mine's last eval step, mine's loss, ref's loss, loss gap)."""
    worst, at = curve_gap(mine, ref, window, after, by_update)
    step, ev = final_eval(mine)
    _, ref_ev = final_eval(ref)
    rel = abs(ev - ref_ev) / ref_ev if ev is not None and ref_ev else float("nan")
    return worst, at, step, ev, ref_ev, rel


def train_losses(records):
    return [r.get("loss") for r in records if r.get("type") == "train"]


def report_rounds(precision, recs, ref):
    """A 16-bit run whose every loss equals the fp32 run's computed nothing in 16 bits."""
    same = train_losses(recs) == train_losses(ref)
    report(not same, f"{precision} run rounds at all: its training losses "
                     + ("equal the fp32 run's bit for bit (no layer computes in 16 bits)" if same else
                        "differ from the fp32 run's"))


def final_eval(records):
    ev = [r for r in records if r.get("type") == "eval"]
    return (ev[-1]["step"], ev[-1]["loss"]) if ev else (None, None)


def scale_evidence(records):
    """What the metrics say about loss scaling: (overflow-skipped steps, loss scales by step)."""
    skipped, flagged, scales = 0, 0, []
    for r in records:
        if r.get("type") != "train":
            continue
        skipped = max(skipped, int(r.get("overflow_skipped_total") or 0))
        flagged += bool(r.get("overflow"))
        if isinstance(r.get("loss_scale"), (int, float)):
            scales.append(float(r["loss_scale"]))
    return max(skipped, flagged), scales


def check_training(a, parts):
    work = tempfile.mkdtemp(prefix="dstrain_mp_train_", dir=a.keep)
    available = False
    try:
        ref, err = train(a, "fp32", os.path.join(work, "fp32"), a.steps)
        if ref is None:
            report(False, f"fp32 quickstart run failed: {err}")
            return True
        ref_step, ref_eval = final_eval(ref)
        window = max(1, min(20, a.steps // 5))
        skip = max(1, a.steps // 10)
        if "quickstart" in parts:
            recs, err = train(a, "bf16", os.path.join(work, "bf16"), a.steps)
            if recs is None:
                report(False, f"quickstart bf16: dstrain bf16: not available in this build ({err})")
            else:
                available = True
                report_rounds("bf16", recs, ref)
                step, ev = final_eval(recs)
                rel = abs(ev - ref_eval) / ref_eval
                report(rel <= 0.01, f"quickstart bf16 vs fp32, {a.steps} steps: validation loss at step {step} "
                                    f"bf16 {ev:.4f}, fp32 {ref_eval:.4f}: {rel:.2%} apart (<= 1%)")
        if "fp16" in parts:
            available |= check_fp16(a, work, ref, window, skip)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return available


def final_step_ok(records, steps):
    """Training continued to the last step."""
    return any(r.get("type") == "train" and r.get("step") == steps for r in records)


def check_fp16(a, work, ref, window, split):
    """fp16 with dynamic loss scaling, in two legs from one checkpoint. The first `split` steps
    (the overflow phase: the scale backs off from 2^--fp16-scale-power) end in a checkpoint;
    from it the run continues in fp16, and an fp32 run resumes too (dstrain resumes a checkpoint
    in another precision). Both continuations start from the same weights, moments, schedule
    position and data position, so their losses differ by precision alone: that is the 2% check.
    The plain fp32 run (`ref`) is compared too, for information: its curve is shifted against
    fp16's by the overflow-skipped steps, which consumed their batches without an update."""
    first, err = train(a, "fp16", os.path.join(work, "fp16_start"), a.steps, stop=split)
    if first is None:
        report(False, f"fp16: dstrain fp16: not available in this build ({err})")
        return False
    ckpt = os.path.join(work, "fp16_start", "checkpoints", f"step_{split:08d}.h5")
    rest, err = train(a, "fp16", os.path.join(work, "fp16_rest"), a.steps, resume=ckpt)
    if rest is None:
        report(False, f"fp16 run resumed from {ckpt} failed: {err}")
        return True
    same, err = train(a, "fp32", os.path.join(work, "fp32_rest"), a.steps, resume=ckpt)
    if same is None:
        report(False, f"fp32 run resumed from the fp16 checkpoint {ckpt} failed: {err}")
        return True
    recs = first + rest
    report_rounds("fp16", recs, ref)
    skipped, scales = scale_evidence(recs)
    backed = skipped > 0 and len(scales) > 1 and min(scales) < scales[0]
    report(backed and final_step_ok(recs, a.steps),
           f"fp16 loss scale backs off from 2^{a.fp16_scale_power} and training continues: "
           f"{skipped} overflow-skipped steps, scale first {scales[0] if scales else '?'}, lowest "
           f"{min(scales) if scales else '?'}, last {scales[-1] if scales else '?'} "
           f"(metrics loss_scale, overflow_skipped_total); reached step {a.steps}: {final_step_ok(recs, a.steps)}")
    worst, at, step, ev, same_ev, rel = run_gap(rest, same, window, split, by_update=False)
    report(math.isfinite(worst) and worst <= 0.02 and rel <= 0.02,
           f"fp16 vs fp32 from the fp16 run's step-{split} checkpoint (same batches, updates and learning rates), "
           f"steps {split + 1}-{a.steps} in {window}-step loss means: worst {worst:.2%} at steps {at}-"
           f"{(at or 0) + window - 1} (<= 2%); validation loss at step {step}: fp16 "
           f"{ev if ev is None else round(ev, 4)}, fp32 {same_ev if same_ev is None else round(same_ev, 4)}: "
           f"{rel:.2%} apart (<= 2%)")
    worst, at, step, ev, ref_ev, rel = run_gap(recs, ref, window, split, by_update=True)
    print(f"INFO fp16 vs the fp32 run from step 0, which trained on the {skipped} batches that fp16's overflow "
          f"steps skipped: {window}-step loss means by applied update, worst {worst:.2%} at {at}; validation "
          f"loss at step {step}: fp16 {ev if ev is None else round(ev, 4)}, fp32 "
          f"{ref_ev if ref_ev is None else round(ref_ev, 4)}: {rel:.2%} apart", flush=True)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--parts", default="autocast,quickstart,fp16")
    ap.add_argument("--steps", type=int, default=400, help="steps of the quickstart and fp16 runs")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fp16-scale-power", type=int, default=32,
                    help="initial fp16 loss scale 2^P (2^32: the first backward overflows fp16)")
    ap.add_argument("--keep", help="keep the work directories under this directory")
    a = ap.parse_args()
    a.build = os.path.abspath(a.build)
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in ("autocast", "quickstart", "fp16")]
    if bad:
        ap.error(f"--parts: unknown {', '.join(bad)} (known: autocast, quickstart, fp16)")
    if a.keep:
        os.makedirs(a.keep, exist_ok=True)
    import torch
    torch.set_num_threads(a.threads)
    available = False
    if "autocast" in parts:
        for dtype in ("bf16", "fp16"):
            available |= check_autocast(a, dtype)
    if "quickstart" in parts or "fp16" in parts:
        subprocess.run([os.path.join(ROOT, ".ci", "prepare-fortunes"), a.build], check=True, stdout=subprocess.DEVNULL)
        available |= check_training(a, parts)
    failed = [l for ok, l in results if not ok]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if failed:
        return 1
    if not available:
        print("dstrain's 16-bit compute is not available in this build: nothing was compared")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
