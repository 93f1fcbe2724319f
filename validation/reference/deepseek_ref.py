"""PyTorch reference of the DeepSeek-V2/V3 architecture for dstrain checks.

The module reproduces what Hugging Face's remote code modeling_deepseek.py
(DeepseekV2ForCausalLM, DeepseekV3ForCausalLM; eager attention, training path of
the MoE) computes, and adds dstrain's training semantics where Hugging Face has
none (the auxiliary loss of sigmoid routers, the auxiliary-loss-free bias update,
multi-token prediction).  State_dict names are the Hugging Face names:

    model.embed_tokens.weight                                  (V, H)
    model.layers.{i}.input_layernorm.weight                    (H,)
    model.layers.{i}.self_attn.q_proj.weight                   (nH*(dn+dr), H)   q_lora_rank null
    model.layers.{i}.self_attn.q_a_proj.weight                 (Rq, H)           q_lora_rank Rq
    model.layers.{i}.self_attn.q_a_layernorm.weight            (Rq,)
    model.layers.{i}.self_attn.q_b_proj.weight                 (nH*(dn+dr), Rq)
    model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight       (Rkv+dr, H)
    model.layers.{i}.self_attn.kv_a_layernorm.weight           (Rkv,)
    model.layers.{i}.self_attn.kv_b_proj.weight                (nH*(dn+dv), Rkv)
    model.layers.{i}.self_attn.o_proj.weight                   (H, nH*dv)
    model.layers.{i}.post_attention_layernorm.weight           (H,)
  dense layers:
    model.layers.{i}.mlp.{gate,up}_proj.weight                 (I, H)
    model.layers.{i}.mlp.down_proj.weight                      (H, I)
  MoE layers (n_routed_experts set, i >= first_k_dense_replace, i % moe_layer_freq == 0):
    model.layers.{i}.mlp.gate.weight                           (E, H)
    model.layers.{i}.mlp.gate.e_score_correction_bias          (E,)  BUFFER, noaux_tc only
    model.layers.{i}.mlp.experts.{j}.{gate,up}_proj.weight     (Im, H)
    model.layers.{i}.mlp.experts.{j}.down_proj.weight          (H, Im)
    model.layers.{i}.mlp.shared_experts.{gate,up}_proj.weight  (Im*S, H)  absent when S is 0/null
    model.layers.{i}.mlp.shared_experts.down_proj.weight       (H, Im*S)
  multi-token prediction module k = 1..D at index j = num_hidden_layers + k - 1
  (a full decoder layer as above, MoE or dense by the same rule applied to j, plus):
    model.layers.{j}.enorm.weight, model.layers.{j}.hnorm.weight          (H,)
    model.layers.{j}.eh_proj.weight                                       (H, 2H)
    model.layers.{j}.shared_head.norm.weight                              (H,)
    model.norm.weight                                                     (H,)
    lm_head.weight                                                        (V, H)  absent when tied

dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv = v_head_dim, Rkv = kv_lora_rank.

Everything runs in float32 as Hugging Face does for a float32 model.  The module
can be cast to float64 (model.double()): norms, softmax and the router then work in
float64 (they upcast to at least float32, which is HF's behaviour for float32 /
bf16 inputs); cos/sin of the rotary embedding are always computed in float32 and
cast, as in HF.

Training semantics (dstrain's; see `loss_terms`):
    loss = mean CE over the target tokens of the global batch
         + sum over MoE layers (main and MTP) of their auxiliary terms
         + mtp_weight / D * sum_k mean CE_k of MTP depth k over its valid targets.
Evaluation loss = main CE only.
"""

import math
import os
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# What HF's DeepSeek code shares with its Llama code: the RMSNorm, fp32 upcasting, the loss.
from llama_ref import IGNORE_INDEX, _compute_dtype, mean_loss, token_losses  # noqa: E402,F401
from llama_ref import LlamaRMSNorm as DeepseekRMSNorm  # noqa: E402

MTP_PAD_TOKEN = 0  # input id of MTP positions beyond the window (their target is ignored)


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------
class DeepseekConfig:
    """The subset of a Hugging Face DeepseekV2Config / DeepseekV3Config the reference uses.

    Defaults and null handling follow dstrain's ModelConfig::from_hf_json.
    """

    def __init__(self, d):
        self.model_type = d.get("model_type", "deepseek_v2")
        if self.model_type not in ("deepseek_v2", "deepseek_v3"):
            raise ValueError(f"model_type {self.model_type!r}: expected deepseek_v2 or deepseek_v3")
        v3 = self.model_type == "deepseek_v3"
        self.hidden_size = int(d["hidden_size"])
        self.intermediate_size = int(d["intermediate_size"])
        self.num_hidden_layers = int(d["num_hidden_layers"])
        self.num_attention_heads = int(d["num_attention_heads"])
        nkv = d.get("num_key_value_heads")
        if nkv is not None and int(nkv) != self.num_attention_heads:
            raise ValueError("MLA: num_key_value_heads must equal num_attention_heads")
        self.vocab_size = int(d["vocab_size"])
        self.max_position_embeddings = int(d.get("max_position_embeddings", 2048))
        self.rms_norm_eps = float(d.get("rms_norm_eps", 1e-6))
        self.rope_theta = float(d.get("rope_theta", 10000.0))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        self.initializer_range = float(d.get("initializer_range", 0.02))
        # MLA
        self.q_lora_rank = int(d["q_lora_rank"]) if d.get("q_lora_rank") is not None else 0
        self.kv_lora_rank = int(d["kv_lora_rank"])
        self.qk_nope_head_dim = int(d["qk_nope_head_dim"])
        self.qk_rope_head_dim = int(d["qk_rope_head_dim"])
        self.v_head_dim = int(d["v_head_dim"])
        self.qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        rs = d.get("rope_scaling")
        self.rope_scaling = None
        if rs:
            typ = rs.get("type", rs.get("rope_type"))
            if typ != "yarn":
                raise ValueError(f"rope_scaling type {typ!r}: only yarn is supported")
            self.rope_scaling = {
                "factor": float(rs["factor"]),
                "original_max_position_embeddings": int(rs["original_max_position_embeddings"]),
                "beta_fast": float(rs.get("beta_fast", 32)),
                "beta_slow": float(rs.get("beta_slow", 1)),
                "mscale": float(rs.get("mscale", 1)),
                "mscale_all_dim": float(rs.get("mscale_all_dim", 0)),
            }
        # DeepSeekMoE
        self.n_routed_experts = int(d["n_routed_experts"]) if d.get("n_routed_experts") is not None else 0
        self.n_shared_experts = int(d["n_shared_experts"]) if d.get("n_shared_experts") is not None else 0
        self.num_experts_per_tok = int(d.get("num_experts_per_tok") or 0)
        self.moe_intermediate_size = int(d.get("moe_intermediate_size") or 0)
        self.first_k_dense_replace = int(d.get("first_k_dense_replace", 0))
        self.moe_layer_freq = int(d.get("moe_layer_freq", 1))
        self.routed_scaling_factor = float(d.get("routed_scaling_factor", 1.0))
        self.scoring_func = d.get("scoring_func", "sigmoid" if v3 else "softmax")
        self.topk_method = d.get("topk_method", "noaux_tc" if v3 else "greedy")
        if self.topk_method == "gready":
            self.topk_method = "greedy"
        self.n_group = int(d["n_group"]) if d.get("n_group") is not None else 1
        self.topk_group = int(d["topk_group"]) if d.get("topk_group") is not None else 1
        self.norm_topk_prob = bool(d.get("norm_topk_prob", False))
        self.aux_loss_alpha = float(d.get("aux_loss_alpha", 0.0))
        self.seq_aux = bool(d.get("seq_aux", True))
        self.num_nextn_predict_layers = int(d.get("num_nextn_predict_layers", 0) or 0)
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"scoring_func {self.scoring_func!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"topk_method {self.topk_method!r}")
        if self.n_routed_experts:
            if self.n_routed_experts % self.n_group:
                raise ValueError("n_group must divide n_routed_experts")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError("topk_group must lie in [1, n_group]")
            if self.topk_method == "noaux_tc" and self.n_routed_experts // self.n_group < 2:
                raise ValueError("noaux_tc needs >= 2 experts per group")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias are not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError("only hidden_act == 'silu' is supported")
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even")

    # V3 weight semantics (always multiply by routed_scaling_factor) iff noaux_tc.
    @property
    def v3_routing(self):
        return self.topk_method == "noaux_tc"

    def is_moe_layer(self, i):
        return (self.n_routed_experts > 0 and i >= self.first_k_dense_replace
                and i % self.moe_layer_freq == 0)

    def softmax_scale(self):
        s = self.qk_head_dim ** (-0.5)
        rs = self.rope_scaling
        if rs is not None and rs["mscale_all_dim"]:
            m = yarn_get_mscale(rs["factor"], rs["mscale_all_dim"])
            s = s * m * m
        return s


# ---------------------------------------------------------------------------
# Rotary embedding (DeepseekV2RotaryEmbedding / DeepseekV2YarnRotaryEmbedding)
# ---------------------------------------------------------------------------
def yarn_find_correction_dim(num_rotations, dim, base=10000, max_position_embeddings=2048):
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def yarn_find_correction_range(low_rot, high_rot, dim, base=10000, max_position_embeddings=2048):
    low = math.floor(yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
    high = math.ceil(yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
    return max(low, 0), min(high, dim - 1)


def yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_linear_ramp_mask(lo, hi, dim):
    if lo == hi:
        hi += 0.001  # prevent singularity
    linear = (torch.arange(dim, dtype=torch.float32) - lo) / (hi - lo)
    return torch.clamp(linear, 0, 1)


def rope_inv_freq(cfg):
    """inv_freq (dim/2,) float32 of the rotary embedding, and the cos/sin factor _mscale."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    rs = cfg.rope_scaling
    if rs is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), 1.0
    factor = rs["factor"]
    freq_extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freq_inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = yarn_find_correction_range(rs["beta_fast"], rs["beta_slow"], dim, base,
                                           rs["original_max_position_embeddings"])
    inv_freq_mask = 1.0 - yarn_linear_ramp_mask(low, high, dim // 2).to(dtype=torch.float32)
    inv_freq = freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask
    mscale = float(yarn_get_mscale(factor, rs["mscale"]) / yarn_get_mscale(factor, rs["mscale_all_dim"]))
    return inv_freq, mscale


def rope_cos_sin(cfg, seq_len, device=None):
    """cos, sin of shape (seq_len, qk_rope_head_dim), float32, exactly as HF computes them."""
    inv_freq, mscale = rope_inv_freq(cfg)
    inv_freq = inv_freq.to(device)
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    if cfg.rope_scaling is None:
        return emb.cos(), emb.sin()
    return emb.cos() * mscale, emb.sin() * mscale


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def deinterleave(x):
    """(..., d) -> (..., d): even indices first, then odd (DeepSeek's view/transpose/reshape)."""
    d = x.shape[-1]
    return x.reshape(*x.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(*x.shape[:-1], d)


def apply_rotary(x, cos, sin):
    """x (B, heads, T, d); cos, sin (T, d).  DeepSeek's apply_rotary_pos_emb for one tensor."""
    x = deinterleave(x)
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------
class DeepseekMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekAttention(nn.Module):
    """Multi-head latent attention (DeepseekV2Attention, eager)."""

    def __init__(self, cfg):
        super().__init__()
        h, nh = cfg.hidden_size, cfg.num_attention_heads
        self.cfg = cfg
        self.num_heads = nh
        if cfg.q_lora_rank:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = DeepseekRMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_proj = nn.Linear(h, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = DeepseekRMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(nh * cfg.v_head_dim, h, bias=False)
        self.softmax_scale = cfg.softmax_scale()

    def forward(self, x, cos, sin):
        cfg = self.cfg
        b, t, _ = x.shape
        nh, dn, dr, dv = self.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        if cfg.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, nh, dn + dr).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
        compressed = self.kv_a_proj_with_mqa(x)
        c, k_pe = torch.split(compressed, [cfg.kv_lora_rank, dr], dim=-1)
        k_pe = k_pe.view(b, t, 1, dr).transpose(1, 2)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, t, nh, dn + dv).transpose(1, 2)
        k_nope, v = torch.split(kv, [dn, dv], dim=-1)
        q_pe = apply_rotary(q_pe, cos, sin)
        k_pe = apply_rotary(k_pe, cos, sin)
        query = torch.cat((q_nope, q_pe), dim=-1)
        key = torch.cat((k_nope, k_pe.expand(b, nh, t, dr)), dim=-1)
        scores = torch.matmul(query, key.transpose(2, 3)) * self.softmax_scale
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = F.softmax(scores, dim=-1, dtype=_compute_dtype(query.dtype)).to(query.dtype)
        out = torch.matmul(probs, v)  # (B, nH, T, dv)
        out = out.transpose(1, 2).reshape(b, t, nh * dv)
        return self.o_proj(out)


class RoutingRecord:
    """What one MoE gate call saw: for the auxiliary loss, the bias update and test checks.

    scores (B, T, E) with grad (the router's softmax/sigmoid scores, unbiased);
    idx (B, T, K) long, the selected experts; margin: the smallest gap, over the tokens,
    between the last selected and the first rejected candidate of every top-k decision
    (groups and experts; -1 when a masked-out expert was selected); unbiased_idx (B, T, K)
    the selection the same method makes without e_score_correction_bias (noaux_tc), and
    greedy_idx (B, T, K) plain top-k of the scores (the selection without group limits).
    """

    def __init__(self, layer, scores, idx, margin, unbiased_idx, greedy_idx):
        self.layer = layer
        self.scores = scores
        self.idx = idx
        self.margin = margin
        self.unbiased_idx = unbiased_idx
        self.greedy_idx = greedy_idx


def _topk_margin(values, k):
    """min over rows of (k-th largest - (k+1)-th largest); inf when k == number of columns."""
    if k >= values.shape[-1]:
        return float("inf")
    s = values.sort(dim=-1, descending=True).values
    return float((s[:, k - 1] - s[:, k]).min())


class MoEGate(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.top_k = cfg.num_experts_per_tok
        self.n_routed_experts = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def scores(self, x):
        """x (N, H) -> scores (N, E) in float32 (float64 for a float64 model)."""
        cdt = _compute_dtype(x.dtype)
        logits = F.linear(x.to(cdt), self.weight.to(cdt), None)
        if self.cfg.scoring_func == "softmax":
            return logits.softmax(dim=-1, dtype=cdt)
        return logits.sigmoid()

    def select(self, scores, use_bias=True, with_margin=False):
        """Expert indices (N, K) chosen by the configured topk_method (no gradient)."""
        cfg, k = self.cfg, self.top_k
        n = scores.shape[0]
        choice = scores
        if cfg.topk_method == "noaux_tc" and use_bias:
            choice = scores + self.e_score_correction_bias.to(scores.dtype).unsqueeze(0)
        if cfg.topk_method == "greedy":
            idx = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            return (idx, _topk_margin(choice, k)) if with_margin else idx
        grouped = choice.view(n, cfg.n_group, -1)
        if cfg.topk_method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:  # noaux_tc
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        score_mask = score_mask.reshape(n, -1)
        tmp = choice.masked_fill(~score_mask.bool(), 0.0)
        idx = torch.topk(tmp, k=k, dim=-1, sorted=False)[1]
        if not with_margin:
            return idx
        margin = min(_topk_margin(group_scores, cfg.topk_group), _topk_margin(tmp, k))
        if not bool(score_mask.gather(1, idx).bool().all()):
            margin = -1.0  # an expert of a dropped group won (masked 0.0 beat kept scores)
        return idx, margin

    def forward(self, x):
        """x (N, H) -> (idx (N, K), weights (N, K), scores (N, E), margin)."""
        cfg = self.cfg
        scores = self.scores(x)
        with torch.no_grad():
            idx, margin = self.select(scores.detach(), with_margin=True)
        w = scores.gather(1, idx)
        if cfg.v3_routing:
            if self.top_k > 1 and cfg.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            w = w * cfg.routed_scaling_factor
        else:
            if self.top_k > 1 and cfg.norm_topk_prob:
                w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
            else:
                w = w * cfg.routed_scaling_factor
        return idx, w, scores, margin


def autocast_enabled():
    """Whether CPU autocast is on (PyTorch 2's spelling, or 1.x's)."""
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:
        return torch.is_autocast_cpu_enabled()


def autocast_patches():
    """These modules under torch.autocast("cpu", bfloat16) as Hugging Face's DeepSeek modelling
    means them: the MoE gate in fp32 (MoEGate upcasts; autocast would undo that) on the
    bf16-rounded norm output, as dstrain's gate reads it; and each MLP's bf16 output widened
    (exactly) to fp32 before the MoE scatters it into its fp32 buffer (the eager MoE path's
    index_put refuses mixed dtypes). Applied once; without autocast nothing changes."""
    if getattr(MoEGate.scores, "patched", False):
        return
    gate_scores, mlp_forward = MoEGate.scores, DeepseekMLP.forward

    def scores(self, x):
        if autocast_enabled():
            with torch.autocast("cpu", enabled=False):
                return gate_scores(self, x.to(torch.bfloat16).float())
        return gate_scores(self, x)

    def forward(self, x):
        y = mlp_forward(self, x)
        return y.float() if autocast_enabled() else y
    scores.patched = True
    MoEGate.scores = scores
    DeepseekMLP.forward = forward


class DeepseekMoE(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.experts = nn.ModuleList([DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                      for _ in range(cfg.n_routed_experts)])
        self.gate = MoEGate(cfg)
        if cfg.n_shared_experts:
            self.shared_experts = DeepseekMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        else:
            self.shared_experts = None

    def forward(self, x, log=None):
        b, t, h = x.shape
        k = self.cfg.num_experts_per_tok
        flat = x.reshape(-1, h)
        idx, w, scores, margin = self.gate(flat)
        if log is not None:
            with torch.no_grad():
                sd = scores.detach()
                unbiased = self.gate.select(sd, use_bias=False)
                greedy = torch.topk(sd, k=k, dim=-1, sorted=False)[1]
            log.append(RoutingRecord(self.layer_idx, scores.view(b, t, -1), idx.view(b, t, k), margin,
                                     unbiased.view(b, t, k), greedy.view(b, t, k)))
        # HF training path: one row per (token, slot), each expert on its rows, weighted sum.
        xr = flat.repeat_interleave(k, dim=0)
        fidx = idx.reshape(-1)
        y = torch.zeros_like(xr)
        for e, expert in enumerate(self.experts):
            sel = fidx == e
            if bool(sel.any()):
                y[sel] = expert(xr[sel])
        y = (y.view(b * t, k, h) * w.unsqueeze(-1).to(y.dtype)).sum(dim=1)
        y = y.to(x.dtype).view(b, t, h)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = DeepseekAttention(cfg)
        self.is_moe = cfg.is_moe_layer(layer_idx)
        self.mlp = DeepseekMoE(cfg, layer_idx) if self.is_moe else DeepseekMLP(cfg.hidden_size,
                                                                              cfg.intermediate_size)
        self.input_layernorm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, log=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        x = x + (self.mlp(h, log) if self.is_moe else self.mlp(h))
        return x


class SharedHead(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.norm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTPLayer(DeepseekDecoderLayer):
    """Multi-token prediction module: norms, projection, a decoder layer, the head norm."""

    def __init__(self, cfg, layer_idx):
        super().__init__(cfg, layer_idx)
        self.enorm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def mtp_forward(self, emb, h_prev, cos, sin, log=None):
        """emb (B,T,H) embeddings of the shifted tokens, h_prev (B,T,H) -> h^k (B,T,H)."""
        x = self.eh_proj(torch.cat((self.enorm(emb), self.hnorm(h_prev)), dim=-1))
        return self.forward(x, cos, sin, log)


class DeepseekModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [DeepseekDecoderLayer(cfg, i) for i in range(n)]
            + [DeepseekMTPLayer(cfg, n + k) for k in range(cfg.num_nextn_predict_layers)])
        self.norm = DeepseekRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    """forward(tokens (B, T) long) -> logits (B, T, V); forward_train adds MTP and routing."""

    def __init__(self, config):
        super().__init__()
        cfg = config if isinstance(config, DeepseekConfig) else DeepseekConfig(config)
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size,
                                                                      bias=False)

    def head_weight(self):
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def _logits(self, x):
        logits = F.linear(x, self.head_weight())
        return logits if logits.dtype == torch.float64 else logits.float()

    def main_layers(self):
        return self.model.layers[:self.config.num_hidden_layers]

    def mtp_layers(self):
        return self.model.layers[self.config.num_hidden_layers:]

    def forward(self, tokens):
        """Main model logits (the evaluation path; no MTP, no routing log)."""
        return self.forward_train(tokens)[0]

    def forward_train(self, tokens, mtp_tokens=(), log=None):
        """tokens (B, T); mtp_tokens: list of D (B, T) inputs of the MTP modules (see
        mtp_batch).  Returns (logits (B,T,V), [MTP logits (B,T,V) per depth]); MoE gates
        append a RoutingRecord to `log` when it is a list (main layers first, then MTP)."""
        t = tokens.shape[1]
        cos, sin = rope_cos_sin(self.config, t, device=tokens.device)
        x = self.model.embed_tokens(tokens)
        for layer in self.main_layers():
            x = layer(x, cos, sin, log)
        # MTP module 1 reads this output after model.norm, as vLLM's and Megatron-Core's
        # DeepSeek MTP do; module k > 1 reads module k-1's output before its shared_head.norm.
        h = self.model.norm(x)
        logits = self._logits(h)
        mtp_logits = []
        mtp = self.mtp_layers()
        if len(mtp_tokens) > len(mtp):
            raise ValueError(f"{len(mtp_tokens)} MTP inputs for {len(mtp)} MTP modules")
        for layer, toks in zip(mtp, mtp_tokens):
            h = layer.mtp_forward(self.model.embed_tokens(toks), h, cos, sin, log)
            mtp_logits.append(self._logits(layer.shared_head.norm(h)))
        return logits, mtp_logits

    # ---- weights -------------------------------------------------------
    def init_weights(self, std=None, generator=None):
        """HF-style init: normal(0, initializer_range) for linear/embedding, ones for norms,
        zeros for e_score_correction_bias."""
        std = self.config.initializer_range if std is None else std
        with torch.no_grad():
            for name, p in self.named_parameters():
                if param_kind(name) == "norm":
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, std, generator=generator)
            for name, buf in self.named_buffers():
                if param_kind(name) == "router_bias":
                    buf.zero_()

    def load_numpy_state(self, tensors, strict=True):
        """Load a dict name -> np.ndarray (e.g. from safetensors_np.load), biases included."""
        state = {}
        for name, arr in tensors.items():
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            state[name] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
        self.load_state_dict(state, strict=strict)

    def numpy_state(self):
        """dict name -> float32 np.ndarray of every parameter and e_score_correction_bias."""
        return {n: t.detach().to(torch.float32).cpu().numpy().copy() for n, t in self.state_dict().items()}

    def load_safetensors(self, path, strict=True):
        """Load a model.safetensors file or a Hugging Face checkpoint folder (index + shards)."""
        import os
        import safetensors_np
        tensors = safetensors_np.load_dir(path) if os.path.isdir(path) else safetensors_np.load(path)
        self.load_numpy_state(tensors, strict=strict)

    def save_safetensors(self, path):
        """Write every parameter and e_score_correction_bias as F32 safetensors (HF names)."""
        import safetensors_np
        safetensors_np.save(path, self.numpy_state(), metadata={"format": "pt"})

    def router_biases(self):
        """dict name -> e_score_correction_bias buffer of every noaux_tc gate."""
        return {n: b for n, b in self.named_buffers() if param_kind(n) == "router_bias"}


def param_kind(name):
    """Kind used by the optimizer's no_decay list: "norm", "embedding", "linear", or
    "router_bias" for the (non-trainable) e_score_correction_bias buffers."""
    if (name.endswith(("layernorm.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight"))
            or name == "model.norm.weight"):
        return "norm"
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name.endswith("e_score_correction_bias"):
        return "router_bias"
    return "linear"


# ---------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------
def mtp_batch(window, depth):
    """window (B, T+1) tokens t_0..t_T -> MTP-`depth` inputs and targets, both (B, T).

    Input at position i: t_{i+depth} (MTP_PAD_TOKEN when i+depth > T);
    target at i: t_{i+depth+1} (IGNORE_INDEX when i+depth+1 > T).
    """
    b, w = window.shape
    t = w - 1
    inputs = torch.full((b, t), MTP_PAD_TOKEN, dtype=window.dtype)
    targets = torch.full((b, t), IGNORE_INDEX, dtype=window.dtype)
    n_in = max(0, min(t, t + 1 - depth))
    inputs[:, :n_in] = window[:, depth:depth + n_in]
    n_tg = max(0, min(t, t - depth))
    targets[:, :n_tg] = window[:, depth + 1:depth + 1 + n_tg]
    return inputs, targets


def mtp_valid_targets(seq_len, depth):
    """Valid MTP-`depth` targets per sequence of seq_len inputs: positions i <= T-depth-1."""
    return max(0, seq_len - depth)


class LossScales:
    """How each term of a micro-batch's loss is scaled so that the micro-batches of a step
    sum to the step's loss (dstrain's LossScales):
        token       1 / (target tokens of the global batch)
        sequence    1 / (sequences of the global batch)            (seq_aux terms)
        micro_batch 1 / (micro-batches of the global batch)        (batch-wise aux terms)
        mtp         [mtp_weight / D / (valid MTP-k targets of the global batch), k = 1..D]
    """

    def __init__(self, token, sequence, micro_batch, mtp=()):
        self.token = token
        self.sequence = sequence
        self.micro_batch = micro_batch
        self.mtp = list(mtp)

    @classmethod
    def for_global_batch(cls, cfg, micro_batch, grad_accum, seq_len, mtp_weight):
        n_seq = micro_batch * grad_accum
        d = cfg.num_nextn_predict_layers
        mtp = [mtp_weight / d / (n_seq * mtp_valid_targets(seq_len, k)) for k in range(1, d + 1)]
        return cls(1.0 / (n_seq * seq_len), 1.0 / n_seq, 1.0 / grad_accum, mtp)


def aux_affinities(cfg, scores):
    """The per-token affinities the balance loss averages into P_i.

    Softmax scores already sum to 1 over the experts and are used as they are (Hugging Face's
    DeepSeek-V2 MoEGate).  Sigmoid scores are normalised per token first, as in the
    sequence-wise balance loss of the DeepSeek-V3 technical report (arXiv 2412.19437),
    eqs. 18-20:  s'_{i,t} = s_{i,t} / sum_j s_{j,t},  P_i = (1/T) sum_t s'_{i,t},
    L_Bal = alpha sum_i f_i P_i; Megatron-Core normalises alike for sigmoid scores in
    compute_routing_scores_for_aux_loss (megatron/core/transformer/moe): scores /
    (scores.sum(dim=-1, keepdim=True) + 1e-20).  The gradient flows through the sum.
    """
    if cfg.scoring_func == "sigmoid":
        return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    return scores


def aux_loss_term(cfg, rec, scales):
    """The auxiliary term one MoE layer adds to a micro-batch's loss (already scaled)."""
    scores, idx = aux_affinities(cfg, rec.scores), rec.idx
    b, t, e = scores.shape
    k = idx.shape[-1]
    alpha = cfg.aux_loss_alpha
    if cfg.seq_aux:
        counts = torch.zeros(b, e, dtype=scores.dtype)
        counts.scatter_add_(1, idx.reshape(b, -1), torch.ones(b, t * k, dtype=scores.dtype))
        ce = counts / (t * k / e)
        aux_b = (ce * scores.mean(dim=1)).sum(dim=1)  # (B,)
        return alpha * aux_b.sum() * scales.sequence
    fi = F.one_hot(idx.reshape(-1), num_classes=e).to(scores.dtype).mean(0) * e
    pi = scores.reshape(-1, e).mean(0)
    return alpha * (pi * fi).sum() * scales.micro_batch


def loss_terms(model, window, scales, log=None):
    """Training loss of one micro-batch.  window (B, T+1) long.

    Returns a dict of tensors: total = ce + aux + mtp (the quantity to backpropagate),
    ce (sum of token losses * scales.token), aux (sum of all MoE layers' terms), mtp
    (sum over depths of token losses * scales.mtp[k-1]), and logits, mtp_logits, records.
    """
    cfg = model.config
    tokens, targets = window[:, :-1], window[:, 1:]
    d = cfg.num_nextn_predict_layers
    mtp_in, mtp_tg = [], []
    for k in range(1, d + 1):
        i, tg = mtp_batch(window, k)
        mtp_in.append(i)
        mtp_tg.append(tg)
    records = [] if log is None else log
    start = len(records)
    logits, mtp_logits = model.forward_train(tokens, mtp_in, records)
    ce = token_losses(logits, targets).sum() * scales.token
    zero = ce.new_zeros(())
    aux = zero
    if cfg.aux_loss_alpha > 0:
        for rec in records[start:]:
            aux = aux + aux_loss_term(cfg, rec, scales)
    mtp = zero
    for k in range(d):
        mtp = mtp + token_losses(mtp_logits[k], mtp_tg[k]).sum() * scales.mtp[k]
    return {"total": ce + aux + mtp, "ce": ce, "aux": aux, "mtp": mtp, "logits": logits,
            "mtp_logits": mtp_logits, "records": records[start:]}


def expert_counts(records, n_experts):
    """dict layer index -> int64 np.ndarray (E,) of top-k selections in `records`."""
    out = {}
    for rec in records:
        c = np.bincount(rec.idx.reshape(-1).numpy(), minlength=n_experts).astype(np.int64)
        out[rec.layer] = out.get(rec.layer, 0) + c
    return out


def update_router_biases(model, counts, gamma):
    """Auxiliary-loss-free balancing: per noaux_tc layer, bias[e] += gamma if its selections
    over the global batch are below the mean, -= gamma above, unchanged when equal."""
    with torch.no_grad():
        for layer in model.model.layers:
            if not layer.is_moe or layer.mlp.gate.e_score_correction_bias is None:
                continue
            c = counts.get(layer.layer_idx)
            if c is None:
                continue
            c = torch.from_numpy(np.asarray(c, dtype=np.float64))
            mean = c.sum() / c.numel()
            step = torch.sign(mean - c) * gamma
            bias = layer.mlp.gate.e_score_correction_bias
            bias.add_(step.to(bias.dtype))


if __name__ == "__main__":
    # Smoke test: build a tiny V3-style model and print the state_dict layout.
    demo = DeepseekForCausalLM(dict(
        model_type="deepseek_v3", hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, vocab_size=50, q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4,
        qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=8, first_k_dense_replace=1, n_group=2,
        topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
        routed_scaling_factor=2.5, num_nextn_predict_layers=1, aux_loss_alpha=0.01,
        rope_scaling={"type": "yarn", "factor": 2, "original_max_position_embeddings": 8,
                      "mscale": 1.0, "mscale_all_dim": 1.0}))
    demo.init_weights()
    for n, p in demo.state_dict().items():
        print(n, tuple(p.shape), param_kind(n))
    win = torch.randint(0, 50, (2, 9))
    sc = LossScales.for_global_batch(demo.config, 2, 1, 8, 0.3)
    terms = loss_terms(demo, win, sc)
    print("logits", tuple(terms["logits"].shape),
          " ".join(f"{k}={float(terms[k]):.5f}" for k in ("total", "ce", "aux", "mtp")))
