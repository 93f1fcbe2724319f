"""GEMM ceilings for validation/bench_vs_torch.py, measured with torch.matmul in the validation
venv on the benchmark's thread count: what a CPU reaches on GEMMs alone, in fp32 and bf16,
against which dstrain's achieved model FLOP/s are judged.

    PEER_PYTHON validation/torch_gemm_ceiling.py --threads 2 [--square 2048] [--dtypes fp32,bf16]
        [--config HF_CONFIG_JSON --tokens B*T] [--min-time 0.2]

- square: one n x n x n product A B^T (the BLAS's best case);
- model:  the training GEMMs of the config's linear maps at `tokens` rows: for every linear
          (q, k, v, o, gate, up, down per layer; the head once) its forward X W^T, input
          gradient dY W and weight gradient dY^T X, with the operand layouts of a training step.
          The ceiling is their total FLOPs over their total time (each shape weighted by how
          often a step runs it). Attention's own products are not included.
Each figure is the best of 3 trials, each repeating the product for at least --min-time seconds
(once at least). The last stdout line is one JSON object, with the CPU capability torch
detects and whether oneDNN has bf16 kernels for this CPU.
"""

import argparse
import json
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rate(fn, flops, min_time):
    """Best FLOP/s of 3 trials of at least min_time each; one trial after the warm-up call when a
    single product takes longer than min_time (an emulated bf16 GEMM can take seconds)."""
    t0 = time.perf_counter()
    fn()
    trials = 1 if time.perf_counter() - t0 > min_time else 3
    best = 0.0
    for _ in range(trials):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time:
                break
        best = max(best, flops * n / dt)
    return best


def linear_shapes(c):
    """(in, out, count per step) of every linear map of a Llama config."""
    d, nh = c["hidden_size"], c["num_attention_heads"]
    nkv = c.get("num_key_value_heads") or nh
    hd = c.get("head_dim") or d // nh
    inter, L = c["intermediate_size"], c["num_hidden_layers"]
    shapes = {}
    for i, o in [(d, nh * hd), (d, nkv * hd), (d, nkv * hd), (nh * hd, d), (d, inter), (d, inter), (inter, d)]:
        shapes[(i, o)] = shapes.get((i, o), 0) + L
    shapes[(d, c["vocab_size"])] = shapes.get((d, c["vocab_size"]), 0) + 1
    return shapes


def model_ceiling(c, tokens, dtype, min_time):
    total_flops, total_s, detail = 0.0, 0.0, []
    for (i, o), count in linear_shapes(c).items():
        x = torch.randn(tokens, i, dtype=dtype)
        w = torch.randn(o, i, dtype=dtype)
        dy = torch.randn(tokens, o, dtype=dtype)
        flops = 2.0 * tokens * i * o
        for what, fn in (("fwd", lambda: torch.matmul(x, w.t())), ("dgrad", lambda: torch.matmul(dy, w)),
                         ("wgrad", lambda: torch.matmul(dy.t(), x))):
            r = rate(fn, flops, min_time)
            total_flops += count * flops
            total_s += count * flops / r
            detail.append({"in": i, "out": o, "rows": tokens, "kind": what, "count": count, "gflops": r / 1e9})
    return total_flops / total_s, detail


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--square", type=int, default=2048)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--config", help="a Hugging Face Llama config.json: also measure its GEMM shapes")
    ap.add_argument("--tokens", type=int, default=2048, help="rows of the model's GEMMs (micro-batch x T)")
    ap.add_argument("--min-time", type=float, default=0.2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    out = {"torch": torch.__version__, "threads": torch.get_num_threads(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    try:
        out["mkldnn_bf16"] = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        out["mkldnn_bf16"] = None
    for name in a.dtypes.split(","):
        dtype = DTYPES[name]
        n = a.square
        x, y = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        res = {"square_n": n, "square": rate(lambda: torch.matmul(x, y.t()), 2.0 * n ** 3, a.min_time)}
        if a.config:
            with open(a.config) as f:
                c = json.load(f)
            res["model"], res["model_detail"] = model_ceiling(c, a.tokens, dtype, a.min_time)
        out[name] = res
    print(json.dumps(out))


if __name__ == "__main__":
    main()
