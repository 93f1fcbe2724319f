"""PyTorch reference of the DeepSeek-LLM (Llama) architecture for dstrain checks.

The module reproduces Hugging Face's LlamaForCausalLM (eager attention, no
rope scaling, no biases) and uses the Hugging Face state_dict names:

    model.embed_tokens.weight                          (V, H)
    model.layers.{i}.input_layernorm.weight            (H,)
    model.layers.{i}.self_attn.q_proj.weight           (nH*D, H)
    model.layers.{i}.self_attn.k_proj.weight           (nKV*D, H)
    model.layers.{i}.self_attn.v_proj.weight           (nKV*D, H)
    model.layers.{i}.self_attn.o_proj.weight           (H, nH*D)
    model.layers.{i}.post_attention_layernorm.weight   (H,)
    model.layers.{i}.mlp.gate_proj.weight              (I, H)
    model.layers.{i}.mlp.up_proj.weight                (I, H)
    model.layers.{i}.mlp.down_proj.weight              (H, I)
    model.norm.weight                                  (H,)
    lm_head.weight                                     (V, H)  absent when tied

With tie_word_embeddings the head multiplies by model.embed_tokens.weight and
there is no lm_head parameter at all (so state_dict() has no lm_head.weight).

Everything runs in float32 as Hugging Face does for a float32 model.  The
module can also be cast to float64 (model.double()); RMSNorm and softmax then
work in float64 instead of float32 (they upcast to at least float32, which is
exactly HF's behaviour for float32/float16/bfloat16 inputs), while cos/sin of
the rotary embedding are always computed in float32 and then cast, as in HF.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100


class LlamaConfig:
    """The subset of a Hugging Face LlamaConfig that the reference uses."""

    def __init__(self, d):
        self.hidden_size = int(d["hidden_size"])
        self.intermediate_size = int(d["intermediate_size"])
        self.num_hidden_layers = int(d["num_hidden_layers"])
        self.num_attention_heads = int(d["num_attention_heads"])
        self.num_key_value_heads = int(d.get("num_key_value_heads") or self.num_attention_heads)
        self.vocab_size = int(d["vocab_size"])
        self.max_position_embeddings = int(d.get("max_position_embeddings", 2048))
        self.rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        self.rope_theta = float(d.get("rope_theta", 10000.0))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        self.initializer_range = float(d.get("initializer_range", 0.02))
        self.head_dim = int(d.get("head_dim") or self.hidden_size // self.num_attention_heads)
        if d.get("rope_scaling"):
            raise ValueError("rope_scaling is not supported by the reference")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported by the reference")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError("only hidden_act == 'silu' is supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even")


def _compute_dtype(dtype):
    """HF upcasts to float32 for norms/softmax; keep float64 when given float64."""
    return torch.promote_types(dtype, torch.float32)


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(_compute_dtype(input_dtype))
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * x.to(input_dtype)


def rope_cos_sin(seq_len, head_dim, theta, device=None):
    """cos, sin of shape (seq_len, head_dim), float32, exactly as HF computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    t = torch.arange(seq_len, device=device).float()
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q, k, cos, sin):
    """q, k: (B, heads, T, D); cos, sin: (T, D)."""
    cos = cos.to(q.dtype)
    sin = sin.to(q.dtype)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def repeat_kv(x, n_rep):
    """(B, nKV, T, D) -> (B, nKV*n_rep, T, D); kv head j serves query heads j*n_rep .. j*n_rep+n_rep-1."""
    if n_rep == 1:
        return x
    b, nkv, t, d = x.shape
    return x[:, :, None, :, :].expand(b, nkv, n_rep, t, d).reshape(b, nkv * n_rep, t, d)


class LlamaAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, cos, sin)
        n_rep = self.num_heads // self.num_kv_heads
        k = repeat_kv(k, n_rep)
        v = repeat_kv(v, n_rep)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=_compute_dtype(q.dtype)).to(q.dtype)
        out = torch.matmul(probs, v)  # (B, nH, T, D)
        out = out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(tokens (B, T) long) -> logits (B, T, V) (float32 for a float32 model)."""

    def __init__(self, config):
        super().__init__()
        cfg = config if isinstance(config, LlamaConfig) else LlamaConfig(config)
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(
            cfg.hidden_size, cfg.vocab_size, bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(self, tokens):
        cfg = self.config
        t = tokens.shape[1]
        cos, sin = rope_cos_sin(t, cfg.head_dim, cfg.rope_theta, device=tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        logits = F.linear(x, self.head_weight())
        return logits if logits.dtype == torch.float64 else logits.float()

    # ---- weights -------------------------------------------------------
    def init_weights(self, std=None, generator=None):
        """HF-style init: normal(0, initializer_range) for linear/embedding, ones for norms."""
        std = self.config.initializer_range if std is None else std
        with torch.no_grad():
            for name, p in self.named_parameters():
                if param_kind(name) == "norm":
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=generator)

    def load_numpy_state(self, tensors, strict=True):
        """Load a dict name -> np.ndarray (e.g. from safetensors_np.load)."""
        state = {}
        for name, arr in tensors.items():
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied checkpoints sometimes still store the head copy
            state[name] = torch.from_numpy(arr.copy())
        self.load_state_dict(state, strict=strict)


def param_kind(name):
    """Kind used by the optimizer's no_decay list: "norm", "embedding", "linear"."""
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return "norm"
    if name == "model.embed_tokens.weight":
        return "embedding"
    return "linear"


def token_losses(logits, targets):
    """Per-token cross-entropy, shape (B*T,); ignore_index=-100 positions give 0. 16-bit logits
    (autocast) are widened first: the loss is fp32, as in dstrain and Hugging Face's models."""
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    v = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1),
                           reduction="none", ignore_index=IGNORE_INDEX)


def mean_loss(logits, targets):
    """Mean token loss over the non-ignored targets."""
    losses = token_losses(logits, targets)
    n = (targets.reshape(-1) != IGNORE_INDEX).sum().clamp(min=1)
    return losses.sum() / n


if __name__ == "__main__":
    # Smoke test: build a tiny model and print the state_dict layout.
    demo = LlamaForCausalLM(dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=50,
                                 max_position_embeddings=64, rms_norm_eps=1e-6,
                                 rope_theta=10000.0, tie_word_embeddings=False))
    for n, p in demo.state_dict().items():
        print(n, tuple(p.shape))
    toks = torch.randint(0, 50, (2, 8))
    print("logits", tuple(demo(toks).shape))
