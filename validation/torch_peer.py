"""The PyTorch peer of validation/bench_vs_torch.py: trains a DeepSeek-LLM (Llama) config the
way a PyTorch user would today, and reports its tokens/s. Runs in the validation venv
(validation/peer_venv.sh: current torch and transformers from PyPI), never in a product path.

    PEER_PYTHON validation/torch_peer.py --impl eager|compile|autotune|hf --precision fp32|bf16
        --config HF_CONFIG_JSON --data 'GLOB_OF_LLMC_SHARDS' --seq-len T --micro-batch B
        --steps N [--warmup W] [--threads K] [--budget-s S] [--lr 2e-3]

Implementations (the same architecture, initialisation normal(0, initializer_range)):
- eager:   the model below, written as a PyTorch user writes it today: nn.Linear, RMSNorm in fp32
           (as Hugging Face), RoPE, F.scaled_dot_product_attention(is_causal=True), SwiGLU.
- compile: the same model and loss under torch.compile (inductor). Compilation happens in the
           first steps, which are untimed; their time is reported as compile_s.
- autotune: the same under torch.compile(mode="max-autotune-no-cudagraphs"): inductor also times
           its own GEMM templates against the library's at each shape (slower to compile).
- hf:      Hugging Face transformers' LlamaForCausalLM built from the config with
           attn_implementation="sdpa".
Precision: fp32, or bf16 autocast (torch.autocast("cpu", dtype=torch.bfloat16)) around the
forward and the loss, fp32 weights, gradients and AdamW state (PyTorch's mixed precision).

Optimizer: what dstrain's inputs/quickstart.json trains with: AdamW (lr, betas (0.9, 0.95), eps
1e-8, weight decay 0.1 except on norms and the embedding), fused on the CPU when this torch
has it, else foreach; gradient clipping at 1.0 (foreach); no accumulation. The learning rate
is constant (dstrain's warmup-cosine schedule costs nothing measurable).

Each step is timed with time.perf_counter around zero_grad + forward + loss + backward + clip
+ optimizer step. The last stdout line is one JSON object: tokens_per_s (median over the timed
steps), step_ms, timed_steps, compile_s, losses, and what ran (torch version, optimizer kind,
attention). Timed steps stop early once --budget-s seconds of them have run (at least 3).
"""

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
from train_ref import WindowLoader  # noqa: E402  (llm.c shards, in order)


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, self.nh, self.nkv = c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads") or c[
            "num_attention_heads"]
        self.hd = c.get("head_dim") or d // self.nh
        eps = c.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=False)
        self.gate_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(d, c["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(c["intermediate_size"], d, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.nh // self.nkv
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, self.nh * self.hd))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        d = c["hidden_size"]
        self.embed_tokens = nn.Embedding(c["vocab_size"], d)
        self.layers = nn.ModuleList(Block(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(d, c.get("rms_norm_eps", 1e-6))
        self.lm_head = nn.Linear(d, c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings"):
            self.lm_head.weight = self.embed_tokens.weight
        hd = self.layers[0].hd
        theta = c.get("rope_theta", 10000.0)
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(c.get("max_position_embeddings", 2048)).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, tokens):
        t = tokens.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def no_decay(name):
    return "norm" in name or "embed_tokens" in name


def make_optimizer(model, lr):
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    nodecay = [p for n, p in model.named_parameters() if no_decay(n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": nodecay, "weight_decay": 0.0}]
    kw = dict(lr=lr, betas=(0.9, 0.95), eps=1e-8)
    try:
        # Some versions accept fused=True on the CPU and fail only at the first step: probe it.
        probe = torch.zeros(4, requires_grad=True)
        probe.grad = torch.ones(4)
        torch.optim.AdamW([probe], fused=True, **kw).step()
        opt, kind = torch.optim.AdamW(groups, fused=True, **kw), "fused"
    except (RuntimeError, TypeError, ValueError):
        opt, kind = torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    return opt, kind


def init_weights(model, std):
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
            else:
                p.normal_(0.0, std)


# The implementations that run under torch.compile, and the mode of each (None: the default).
COMPILE_MODES = {"compile": None, "autotune": "max-autotune-no-cudagraphs"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", choices=["eager", "compile", "autotune", "hf"], required=True)
    ap.add_argument("--precision", choices=["fp32", "bf16"], required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed leading steps (compile: at least 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop timing after this many seconds (>= 3 steps)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    with open(a.config) as f:
        c = json.load(f)
    info = {"torch": torch.__version__, "impl": a.impl, "precision": a.precision, "threads": torch.get_num_threads()}
    if a.impl == "hf":
        import transformers
        cfg = transformers.LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "torch_dtype")})
        model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
        model = model.float()
        info["transformers"] = transformers.__version__
        info["attention"] = model.config._attn_implementation
        fwd = lambda x: model(input_ids=x, use_cache=False).logits  # noqa: E731
    else:
        model = Llama(c)
        info["attention"] = "sdpa"
        fwd = model
    init_weights(model, c.get("initializer_range", 0.02))
    model.train()
    opt, info["adamw"] = make_optimizer(model, a.lr)
    params = [p for p in model.parameters()]
    V = c["vocab_size"]

    def loss_fn(x, y):
        return F.cross_entropy(fwd(x).float().view(-1, V), y.view(-1))

    warmup = a.warmup
    if a.impl in COMPILE_MODES:
        loss_fn = torch.compile(loss_fn, mode=COMPILE_MODES[a.impl])
        warmup = max(warmup, 3)
    loader = WindowLoader(a.data, a.seq_len, a.micro_batch, V)
    amp = torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.precision == "bf16")
    tokens = a.micro_batch * a.seq_len
    losses, times = [], []
    compile_s, timed_s = 0.0, 0.0
    for step in range(warmup + a.steps):
        x, y = loader.next()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with amp:
            loss = loss_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        if step < warmup:
            compile_s += dt
        else:
            times.append(dt)
            timed_s += dt
        print(f"{a.impl} {a.precision} step {step}: loss {losses[-1]:.4f} {dt * 1e3:.0f} ms", file=sys.stderr)
        if len(times) >= 3 and timed_s > a.budget_s:
            break
    info.update(tokens_per_s=statistics.median(tokens / t for t in times), step_ms=statistics.median(times) * 1e3,
                timed_steps=len(times), compile_s=compile_s if a.impl in COMPILE_MODES else 0.0,
                warmup_s=compile_s, losses=losses)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
