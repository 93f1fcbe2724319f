"""PyTorch benchmark peer for dstrain: train the reference Llama or DeepSeek-V2/V3 on llm.c shards.

Usage:
    /usr/bin/python3 validation/reference/train_ref.py --config HF_CONFIG_JSON \
        --data 'GLOB_OF_LLMC_SHARDS' --seq-len T --micro-batch B --steps N \
        [--threads K] [--warmup 2] [--lr 3e-4] [--seed 0] \
        [--mtp-loss-weight 0.3] [--router-bias-update-rate 0.001]

Model: chosen by the config's model_type.  deepseek_v2 / deepseek_v3 give
deepseek_ref.DeepseekForCausalLM, anything else llama_ref.LlamaForCausalLM; both
float32, initialised with normal(0, initializer_range) for linear/embedding
weights and ones for norms (zeros for DeepSeek's e_score_correction_bias).
Optimizer: AdamW(lr, betas (0.9, 0.95), eps 1e-8, weight decay 0.1 on every
parameter for Llama; for DeepSeek none on norms and the embedding, as dstrain's
no_weight_decay ["norm", "embedding"]), gradient clipping at 1.0, constant lr,
no gradient accumulation.

Loss: Llama trains the mean token cross-entropy.  DeepSeek trains the loss dstrain
trains, deepseek_ref.loss_terms with LossScales for one micro-batch: mean CE +
the auxiliary terms of every MoE layer (aux_loss_alpha, seq_aux) + mtp-loss-weight
x mean MTP CE when num_nextn_predict_layers > 0; after the optimizer step the
noaux_tc routers' e_score_correction_bias moves by +-router-bias-update-rate
(deepseek_ref.update_router_biases), inside the timed region.  The reference's
MoE is Hugging Face's eager training path (a Python loop over the experts, each
taking its rows of the k-times repeated tokens by boolean mask), and every gate
call also records test-only routing details (top-k margins, the unbiased and the
group-free selections); it is written for exactness, not speed.

Data: llm.c shards (magic 20240520 version 1 = uint16 tokens, or magic
20240801 version 7 = uint32 tokens; 256 int32 header), in sorted file
order; each step takes the next B windows of T+1 tokens (window i of a shard =
tokens [i*T, i*T+T]), moving to the next shard when one is exhausted and
wrapping around after the last.

Each step is timed with time.perf_counter around forward + backward + clip +
optimizer step (+ DeepSeek's router bias update).  The last stdout line is one JSON object:
    {"tokens_per_s": median over steps after --warmup, "step_ms": median,
     "losses": [loss of every step], "threads": K}
Progress goes to stderr.
"""

import argparse
import glob
import json
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepseek_ref  # noqa: E402
import llama_ref  # noqa: E402

LLMC_HEADER_INTS = 256
LLMC_FORMATS = {20240520: (1, np.dtype("<u2")), 20240801: (7, np.dtype("<u4"))}


def read_llmc_shard(path):
    """Return the tokens of an llm.c shard as a (memory-mapped) numpy array."""
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
    if len(header) != LLMC_HEADER_INTS:
        raise ValueError(f"{path}: shorter than the 1024-byte llm.c header")
    magic, version, n = int(header[0]), int(header[1]), int(header[2])
    if magic not in LLMC_FORMATS:
        raise ValueError(f"{path}: bad magic {magic}")
    want_version, dtype = LLMC_FORMATS[magic]
    if version != want_version:
        raise ValueError(f"{path}: magic {magic} expects version {want_version}, got {version}")
    size = os.path.getsize(path)
    if size < LLMC_HEADER_INTS * 4 + n * dtype.itemsize:
        raise ValueError(f"{path}: header says {n} tokens but the file is only {size} bytes")
    return np.memmap(path, dtype=dtype, mode="r", offset=LLMC_HEADER_INTS * 4, shape=(n,))


class WindowLoader:
    """Consecutive (B, T) input/target batches from the shards, in order."""

    def __init__(self, pattern, seq_len, micro_batch, vocab_size):
        self.paths = sorted(glob.glob(pattern))
        if not self.paths:
            raise FileNotFoundError(f"no shard matches {pattern}")
        self.T, self.B, self.V = seq_len, micro_batch, vocab_size
        self.shard_idx, self.window = 0, 0
        self.tokens = self._open(0)

    def _open(self, i):
        toks = read_llmc_shard(self.paths[i])
        if len(toks) < self.B * self.T + 1:
            raise ValueError(f"{self.paths[i]}: {len(toks)} tokens, fewer than one batch "
                             f"({self.B * self.T + 1})")
        return toks

    def next(self):
        """(inputs, targets), both (B, T) long."""
        w = self.next_window()
        return w[:, :-1].contiguous(), w[:, 1:].contiguous()

    def next_window(self):
        """(B, T+1) long: B consecutive windows of T+1 tokens."""
        start = self.window * self.T
        if start + self.B * self.T + 1 > len(self.tokens):
            self.shard_idx = (self.shard_idx + 1) % len(self.paths)
            self.tokens = self._open(self.shard_idx)
            self.window, start = 0, 0
        chunk = np.asarray(self.tokens[start:start + self.B * self.T + 1]).astype(np.int64)
        self.window += self.B
        if chunk.max() >= self.V:
            raise ValueError(f"token id {chunk.max()} >= vocab_size {self.V}")
        idx = np.lib.stride_tricks.sliding_window_view(chunk, self.T + 1)[::self.T][:self.B]
        return torch.from_numpy(idx.copy())


def deepseek_param_groups(model, weight_decay):
    """AdamW groups with dstrain's no_weight_decay ["norm", "embedding"]."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if deepseek_ref.param_kind(name) in ("norm", "embedding") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True, help="Hugging Face config.json")
    ap.add_argument("--data", required=True, help="glob of llm.c shards (quote it)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--warmup", type=int, default=2, help="untimed leading steps")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0, help="weight init seed")
    ap.add_argument("--mtp-loss-weight", type=float, default=0.3, help="DeepSeek: lambda of the MTP loss")
    ap.add_argument("--router-bias-update-rate", type=float, default=0.001,
                    help="DeepSeek noaux_tc: gamma of the auxiliary-loss-free bias update")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with open(args.config) as f:
        config = json.load(f)
    deepseek = config.get("model_type") in ("deepseek_v2", "deepseek_v3")
    model = deepseek_ref.DeepseekForCausalLM(config) if deepseek else llama_ref.LlamaForCausalLM(config)
    model.init_weights()
    model.train()
    cfg = model.config
    if args.seq_len > cfg.max_position_embeddings:
        print(f"warning: seq_len {args.seq_len} > max_position_embeddings "
              f"{cfg.max_position_embeddings}", file=sys.stderr)
    params = list(model.parameters())
    n_params = sum(p.numel() for p in params)
    groups = deepseek_param_groups(model, 0.1) if deepseek else params
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    loader = WindowLoader(args.data, args.seq_len, args.micro_batch, cfg.vocab_size)
    if deepseek:
        scales = deepseek_ref.LossScales.for_global_batch(cfg, args.micro_batch, 1, args.seq_len,
                                                          args.mtp_loss_weight)
    print(f"train_ref: {n_params} params, {len(loader.paths)} shard(s), B={args.micro_batch} "
          f"T={args.seq_len} threads={args.threads}", file=sys.stderr)

    tokens_per_step = args.micro_batch * args.seq_len
    losses, times = [], []
    for step in range(args.steps):
        if deepseek:
            window = loader.next_window()
        else:
            x, y = loader.next()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        if deepseek:
            terms = deepseek_ref.loss_terms(model, window, scales)
            loss = terms["total"]
        else:
            loss = llama_ref.mean_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if deepseek and args.router_bias_update_rate > 0:
            counts = deepseek_ref.expert_counts(terms["records"], cfg.n_routed_experts)
            deepseek_ref.update_router_biases(model, counts, args.router_bias_update_rate)
        dt = time.perf_counter() - t0
        losses.append(loss.item())
        times.append(dt)
        print(f"step {step}: loss {losses[-1]:.6f}  {dt * 1e3:.1f} ms", file=sys.stderr)

    timed = times[args.warmup:]
    if not timed:
        print(f"warning: --steps {args.steps} <= --warmup {args.warmup}; timing all steps",
              file=sys.stderr)
        timed = times
    result = {
        "tokens_per_s": statistics.median(tokens_per_step / t for t in timed) if timed else 0.0,
        "step_ms": statistics.median(t * 1e3 for t in timed) if timed else 0.0,
        "losses": losses,
        "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
