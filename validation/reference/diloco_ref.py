"""DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", arXiv 2311.08105, Algorithm 1) in PyTorch, on a make_case.py case: the reference that
dstrain's train.gradient_sync "diloco" is checked against.

Usage:
    /usr/bin/python3 validation/reference/diloco_ref.py --case DIR --replicas K --every H \
        --outer-steps T [--outer-lr 0.7] [--momentum 0.9] [--sgd] [--micro-batch B] [--grad-accum A] \
        --out FILE.safetensors

Algorithm 1, as the paper states it:
    for outer step t = 1..T:
        for each worker i (in parallel):
            theta_i <- theta^(t-1)
            for inner step h = 1..H:
                x ~ D_i;  L <- f(x, theta_i);  theta_i <- InnerOpt(theta_i, grad L)
        Delta^(t) <- (1/k) sum_i (theta^(t-1) - theta_i)
        theta^(t) <- OuterOpt(theta^(t-1), Delta^(t))
InnerOpt is AdamW with the case's hyper-parameters, its state kept by each worker across outer
steps (the paper's workers keep their inner optimizer); OuterOpt is torch.optim.SGD with
Nesterov momentum (the paper's choice), or plain SGD with --sgd.

Data: worker i is data-parallel rank i of k; at inner step s (counting over all outer steps)
micro-step m it reads windows s*G + m*(k*B) + i*B + [0, B) of the case's shard, G = k*B*A (the
global batch keeps its windows whatever the number of ranks; each rank its rows of each
micro-step). Each worker's loss is the mean over its own tokens; its gradients are clipped at
the case's gradient_clipping; the learning rate is the case's schedule at step s.
"""

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_ref  # noqa: E402
import make_case  # noqa: E402
import safetensors_np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True)
    ap.add_argument("--replicas", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--outer-steps", type=int, required=True)
    ap.add_argument("--outer-lr", type=float, default=0.7)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--sgd", action="store_true", help="outer SGD without momentum")
    ap.add_argument("--micro-batch", type=int, help="B per worker (default: the case's)")
    ap.add_argument("--grad-accum", type=int, help="A (default: the case's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with open(os.path.join(args.case, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(args.case, "case.json")) as f:
        case = json.load(f)
    weights = safetensors_np.load(os.path.join(args.case, "model.safetensors"))
    # The case's llm.c shard: a 256-int32 header (magic 20240520, version 1, token count), then uint16 tokens.
    path = os.path.join(args.case, "data.bin")
    header = np.fromfile(path, dtype="<i4", count=256)
    assert header[0] == make_case.LLMC_MAGIC_V1 and header[1] == 1, f"{path}: not an llm.c v1 shard"
    data = np.fromfile(path, dtype="<u2", offset=1024, count=int(header[2])).astype(np.int64)
    k, H, T = args.replicas, args.every, args.outer_steps
    B = args.micro_batch or case["micro_batch"]
    A = args.grad_accum or case["grad_accum"]
    S = case["seq_len"]
    G = k * B * A

    outer = make_case.build_model(config, weights, torch.float32)
    outer_params = [p for _, p in outer.named_parameters()]
    if args.sgd:
        outer_opt = torch.optim.SGD(outer_params, lr=args.outer_lr)
    else:
        outer_opt = torch.optim.SGD(outer_params, lr=args.outer_lr, momentum=args.momentum, nesterov=True)

    no_decay = set(case["no_decay"])
    workers, inner_opts = [], []
    for _ in range(k):
        model = make_case.build_model(config, weights, torch.float32)
        named = list(model.named_parameters())
        decay = [p for n, p in named if llama_ref.param_kind(n) not in no_decay]
        nodecay = [p for n, p in named if llama_ref.param_kind(n) in no_decay]
        groups = [g for g in ({"params": decay, "weight_decay": case["weight_decay"]},
                              {"params": nodecay, "weight_decay": 0.0}) if g["params"]]
        workers.append(model)
        inner_opts.append(torch.optim.AdamW(groups, lr=case["lr"], betas=tuple(case["betas"]), eps=case["eps"],
                                            weight_decay=case["weight_decay"]))
    losses = []
    for t in range(T):
        deltas = [torch.zeros_like(p) for p in outer_params]
        for i, (model, opt) in enumerate(zip(workers, inner_opts)):
            params = [p for _, p in model.named_parameters()]
            with torch.no_grad():
                for p, o in zip(params, outer_params):
                    p.copy_(o)
            for h in range(H):
                s = t * H + h
                opt.zero_grad(set_to_none=True)
                total = 0.0
                for m in range(A):
                    x, y = make_case.window_batch(data, s * G + m * (k * B) + i * B, B, S)
                    loss = llama_ref.token_losses(model(x), y).sum() / (B * A * S)
                    loss.backward()
                    total += loss.item()
                torch.nn.utils.clip_grad_norm_(params, case["gradient_clipping"])
                lr = make_case.lr_at(s, case)
                for g in opt.param_groups:
                    g["lr"] = lr
                opt.step()
                losses.append(total)
            with torch.no_grad():
                for d, p, o in zip(deltas, params, outer_params):
                    d.add_(o - p)
        outer_opt.zero_grad(set_to_none=False)
        for d, o in zip(deltas, outer_params):
            o.grad = d / k
        outer_opt.step()
    out = {n: p.detach().numpy().astype(np.float32) for n, p in outer.named_parameters()}
    safetensors_np.save(args.out, out)
    print(json.dumps({"inner_losses": losses}))


if __name__ == "__main__":
    main()
