#!/usr/bin/env python3
"""Memory of `dstrain train --init-from` a Hugging Face directory, per rank: measured for a small
model at several layouts beside the analytic figure, and calculated for the dense 67B.

    validation/bench_init_from.py [--binary build/app/dstrain] [--calc-only] [--json OUT]

About 30 s on 2 cores (`--calc-only`: a second). The runs read inputs/quickstart.json's fortunes
corpus (.ci/prepare-fortunes makes it), evaluation, generation and checkpoints off.

Measured. DeepSeek-LLM-architecture model inputs/models/deepseek-llm-cpu-d1024.json with a
32,768-token vocabulary (112M parameters, 449 MB in fp32; its embedding and head, 134 MB each,
are its largest tensors, as the 67B's are). It is exported once in bfloat16, as DeepSeek ships
its weights (`dstrain train --max-steps 0 --save-hf DIR`), then loaded by
`mpirun -np N dstrain train --init-from DIR --max-steps 0` (no step: the load is the run) at
  - 1 rank; tensor 2; pipeline 2 x tensor 2 (4 ranks);
  - ZeRO-3 over data 2, where each rank loads its tensor and pipeline pieces whole and ZeRO then
    keeps 1/2 of them (the pieces are the tensor x pipeline rank's, not the ZeRO shard);
  - DeepSeek-V3-tiny (MoE, exported in fp32) at expert 2: each rank loads its 16 of the 32
    routed experts of every MoE layer.
Every rank's figures come from the line load_hf_weights logs (src/io/hf_weights.cpp):
  pieces     bytes read into the rank's parameters (fp32);
  beyond     the rise of the process's anonymous memory (RssAnon, /proc/self/status) during the
             load, sampled after each tensor's read while its buffers live, less the pieces where
             the load commits them (ZeRO-3's reserved registry). Anonymous memory is the rank's
             own: THE CLAIM IS ABOUT IT. "anon peak" = pieces + beyond.
  mapped     the most safetensors pages the process had mapped at once (RssFile's rise): page
             cache, shared by every rank reading the files and reclaimable, so not the rank's
             memory, but RSS (top, ru_maxrss, a batch system's MaxRSS) counts it. Each tensor's
             pages are unmapped once read, so it stays near one tensor of the file.
The unit test HFWeightsIO.LoadingHoldsThePiecesAndOneTensorsPagesAtMost checks the same bound
with the kernel's peak (VmHWM), which no sampling can miss.

Analytic, per rank, from the tensors' global shapes (the file's header; for the 67B, the config)
and the rules the code splits by: tensor parallelism splits q/k/v/gate/up and the embedding and
head by rows, o/down by columns (model/layers.cpp add_tp_piece; key/value heads replicated when
fewer than the tensor ranks); a pipeline stage holds its layers (the split `dstrain validate`
prints, cost-balanced: model/stage.h), the first the embedding, the last the norm and head;
an expert rank its routed experts. World rank r = (pipeline * data + data_coord) * tensor +
tensor_coord, expert = data_coord % expert (comm/grid.h).
  bound      pieces + the largest single piece, in fp32: a run on a device reads each piece into
             a host copy before sending it over (on the host, pieces are read in place: 0).
  whole      the whole model in fp32, what a rank that read everything would hold.
Exit status 1 when a rank's measured pieces differ from the analytic ones, its anon peak
exceeds the bound, its mapped pages exceed its largest tensor's bytes in the file by more than
4 MiB (a page mapped can bring neighbours up to 2 MiB either side with it: the kernel's
fault-around, large folios in the page cache), or a run fails.

Calculated: the dense DeepSeek-LLM 67B (inputs/models/deepseek-llm-67b-base.json) at tensor 8 x
pipeline 8 (64 ranks per replica: eight 8-GPU nodes, tensor parallelism inside a node), 4,096
tokens a sequence, from the config's tensor shapes, per pipeline stage (every tensor rank of a
stage holds the same amount): pieces, the largest piece (a device run's host copy), the most file
pages mapped at once (the largest tensor it reads from, whole when it reads a column range of
every row), against the whole model and against reading whole tensors (its largest tensor).
"""

import argparse
import json
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_pml="ob1", OMPI_MCA_btl="self,vader",
               OMPI_MCA_mpi_yield_when_idle="1", OMP_NUM_THREADS="1")
MB = 1e6
SEQ_LEN = 128
DENSE = '{"hf_config": "inputs/models/deepseek-llm-cpu-d1024.json", "vocab_size": 32768}'
MOE = '"inputs/models/deepseek-v3-tiny.json"'
# name, model, export dtype, ranks, --set overrides of the layout
CASES = [
    ("1 rank", DENSE, "bfloat16", 1, []),
    ("tensor 2", DENSE, "bfloat16", 2, ["parallel.tensor=2"]),
    ("pipeline 2 x tensor 2", DENSE, "bfloat16", 4, ["parallel.tensor=2", "parallel.pipeline=2"]),
    ("ZeRO-3 over data 2", DENSE, "bfloat16", 2, ["train.zero_optimization.stage=3"]),
    ("V3-tiny expert 2", MOE, "float32", 2, ["parallel.expert=2"]),
]
LAYOUT_67B = dict(tensor=8, pipeline=8, seq_len=4096)
RUN_SETS = ["train.eval_interval=0", "train.steps_per_print=1", 'generate.prompt=""', "generate.interval=0",
            "checkpoint.save_final=false", "checkpoint.interval_steps=0", "checkpoint.interval_minutes=0",
            f"data.seq_len={SEQ_LEN}", "train.train_micro_batch_size_per_gpu=1", "train.gradient_accumulation_steps=1"]
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}


def sh(cmd, **kw):
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **MPI_ENV), capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def shown(cmd, work):
    """The command as a user would type it from the repository root (the run settings elided)."""
    cmd = [c for c in cmd if c not in RUN_SETS and not c.startswith("output.dir=")]
    text = " ".join(shlex.quote(c) for c in cmd).replace(ROOT + "/", "").replace(work, "$WORK")
    return "# " + text + " ... (RUN_SETS: no evaluation, generation or checkpoints)"


# --- the model's tensors -------------------------------------------------------------------

def header_tensors(hf_dir):
    """{name: (shape, dtype)} from the safetensors files of an exported directory."""
    files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    out = {}
    for f in files:
        with open(os.path.join(hf_dir, f), "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, e in header.items():
            if name != "__metadata__":
                out[name] = (tuple(e["shape"]), e["dtype"])
    return out


def llama_tensors(cfg, dtype="BF16"):
    """{name: (shape, dtype)} of a dense DeepSeek-LLM (LLaMA) checkpoint, from its config.json."""
    C, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    H, Hkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    D = C // H
    t = {"model.embed_tokens.weight": (V, C), "model.norm.weight": (C,)}
    if not cfg.get("tie_word_embeddings", False):
        t["lm_head.weight"] = (V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        t.update({p + "self_attn.q_proj.weight": (H * D, C), p + "self_attn.k_proj.weight": (Hkv * D, C),
                  p + "self_attn.v_proj.weight": (Hkv * D, C), p + "self_attn.o_proj.weight": (C, H * D),
                  p + "mlp.gate_proj.weight": (I, C), p + "mlp.up_proj.weight": (I, C),
                  p + "mlp.down_proj.weight": (C, I), p + "input_layernorm.weight": (C,),
                  p + "post_attention_layernorm.weight": (C,)})
    return {n: (s, dtype) for n, s in t.items()}


def resolve_model(spec):
    """The Hugging Face config a --set model=... value names (a path, or hf_config + overrides)."""
    m = json.loads(spec)
    if isinstance(m, str):
        return json.load(open(os.path.join(ROOT, m)))
    cfg = json.load(open(os.path.join(ROOT, m.pop("hf_config"))))
    cfg.update(m)
    return cfg


# --- the split rules -----------------------------------------------------------------------

ROW_SPLIT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight")
COL_SPLIT = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def tp_split(name, cfg, tp):
    """(dim, pieces) of a tensor under tensor parallelism of size tp; None when whole (dense models)."""
    if tp == 1:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (0, tp)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        return (0, min(tp, cfg["num_key_value_heads"]))  # fewer heads than ranks: replicated
    if name.endswith(ROW_SPLIT):
        return (0, tp)
    if name.endswith(COL_SPLIT):
        return (1, tp)
    return None


def stage_split(binary, model, ranks, sets, seq_len):
    """[(first_layer, end_layer)] per pipeline stage, as `dstrain validate` prints the trainer's split."""
    out = sh([binary, "validate", "--config", os.path.join(ROOT, "inputs", "quickstart.json"), "--ranks", str(ranks),
              "--set", f"model={model}", f"data.seq_len={seq_len}", "train.train_micro_batch_size_per_gpu=1",
              "train.gradient_accumulation_steps=8", *sets])
    m = re.search(r"pipeline: \d+ stages.*?; (stage 0:.*)", out)
    if not m:
        return None
    stages = []
    for part in re.findall(r"stage \d+: ([^,]*\S)", m.group(1)):
        lay = re.search(r"layers? (\d+)(?:-(\d+))?", part)
        stages.append((int(lay.group(1)), int(lay.group(2) or lay.group(1)) + 1))
    return stages


def rank_pieces(tensors, cfg, tp, pp_stages, stage, ep=1, ep_rank=0):
    """{name: (local elements, file bytes whose pages a read maps)} of the tensors one rank loads."""
    last = len(pp_stages) - 1 if pp_stages else 0
    out = {}
    for name, (shape, dtype) in tensors.items():
        if "rotary_emb.inv_freq" in name:
            continue
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m and pp_stages:
            lo, hi = pp_stages[stage]
            # The MTP modules (layers past num_hidden_layers) sit on the last stage.
            if not (lo <= int(m.group(1)) < hi or (stage == last and int(m.group(1)) >= cfg["num_hidden_layers"])):
                continue
        if name == "model.embed_tokens.weight" and stage != 0:
            continue
        if name in ("model.norm.weight", "lm_head.weight") and stage != last:
            continue
        e = re.search(r"\.mlp\.experts\.(\d+)\.", name)
        if e and ep > 1 and int(e.group(1)) // (cfg["n_routed_experts"] // ep) != ep_rank:
            continue
        numel = math.prod(shape)
        file_bytes = numel * DTYPE_BYTES[dtype]
        split = tp_split(name, cfg, tp)
        if split:
            numel //= split[1]
            if split[0] == 0:  # whole rows: only the piece's pages
                file_bytes //= split[1]
        out[name] = (numel, file_bytes)
    return out


def analytic(tensors, cfg, tp, pp_stages, stage, ep=1, ep_rank=0):
    """A rank's pieces (bytes, fp32), its largest piece and the most file bytes one tensor's read maps."""
    p = rank_pieces(tensors, cfg, tp, pp_stages, stage, ep, ep_rank)
    return dict(pieces=4 * sum(n for n, _ in p.values()), largest_piece=4 * max(n for n, _ in p.values()),
                largest_mapped=max(b for _, b in p.values()))


# --- measurement ---------------------------------------------------------------------------

LOG_ROW = re.compile(r"^\s*rank (\d+): ([\d.]+) \+ (-?[\d.]+) \[([\d.]+)\]; ([\d.]+)$")


def load_memory(log):
    """{rank: (pieces, beyond, counted, mapped)} in MB from load_hf_weights' line."""
    lines = log.splitlines()
    start = next(i for i, l in enumerate(lines) if l.startswith("--init-from memory per rank"))
    rows = {}
    for line in lines[start + 1:]:
        m = LOG_ROW.match(line)
        if not m:
            break
        rows[int(m.group(1))] = tuple(float(x) for x in m.groups()[1:])
    return rows


def measure(binary, work):
    exports = {}
    results, failures = [], []
    print(f"{'layout':<24} {'rank':>4} {'pieces MB':>10} {'+largest':>9} {'bound MB':>9} | {'pieces MB':>10} "
          f"{'+beyond':>8} {'anon peak':>10} {'mapped':>7} | {'whole MB':>9}")
    print(f"{'':<24} {'':>4} {'analytic':>30} | {'measured (anonymous memory; mapped file pages)':>38} |")
    for name, model, dtype, ranks, sets in CASES:
        key = (model, dtype)
        if key not in exports:
            hf = os.path.join(work, f"hf{len(exports)}")
            cmd = [binary, "train", "--config", os.path.join(ROOT, "inputs", "quickstart.json"), "--max-steps", "0",
                   "--save-hf", hf, "--set", f"model={model}", f'output.dir="{work}/export{len(exports)}"',
                   f'output.save_hf_dtype="{dtype}"', *RUN_SETS]
            print(shown(cmd, work))
            sh(cmd, timeout=600)
            exports[key] = hf
        hf = exports[key]
        cfg = resolve_model(model)
        tensors = header_tensors(hf)
        if not cfg.get("n_routed_experts"):  # the 67B's tensor list, checked against a real export
            assert llama_tensors(cfg, tensors["model.norm.weight"][1]) == tensors, \
                "llama_tensors() does not list the exported tensors"
        axes = dict(tensor=1, pipeline=1, expert=1)
        for s in sets:
            k, _, v = s.partition("=")
            if k.startswith("parallel."):
                axes[k.split(".")[1]] = int(v)
        data = ranks // (axes["tensor"] * axes["pipeline"])
        stages = stage_split(binary, model, ranks, sets, SEQ_LEN) if axes["pipeline"] > 1 else None
        cmd = ["mpirun", "-np", str(ranks), "--bind-to", "none", binary, "train", "--config",
               os.path.join(ROOT, "inputs", "quickstart.json"), "--max-steps", "0", "--init-from", hf, "--set",
               f"model={model}", f'output.dir="{work}/run"', 'output.save_hf=""', *RUN_SETS, *sets]
        print(shown(cmd, work))
        rows = load_memory(sh(cmd, timeout=600))
        whole = 4 * sum(math.prod(s) for s, _ in tensors.values())
        for r in range(ranks):
            rest = r // axes["tensor"]
            data_coord, stage = rest % data, rest // data
            an = analytic(tensors, cfg, axes["tensor"], stages, stage, axes["expert"], data_coord % axes["expert"])
            pieces, beyond, counted, mapped = rows[r]
            bound = (an["pieces"] + an["largest_piece"]) / MB
            peak = pieces + beyond
            print(f"{name if r == 0 else '':<24} {r:>4} {an['pieces'] / MB:>10.1f} {an['largest_piece'] / MB:>9.1f} "
                  f"{bound:>9.1f} | {pieces:>10.1f} {beyond:>+8.1f} {peak:>10.1f} {mapped:>7.1f} | "
                  f"{f'{whole / MB:.1f}' if r == 0 else '':>9}")
            results.append(dict(layout=name, rank=r, analytic_pieces=an["pieces"], largest_piece=an["largest_piece"],
                                bound=bound * MB, measured_pieces=pieces * MB, anon_beyond=beyond * MB,
                                anon_peak=peak * MB, counted_transient=counted * MB, mapped=mapped * MB,
                                whole=whole))
            if abs(pieces * MB - an["pieces"]) > 0.06 * MB + 1e-3 * an["pieces"]:
                failures.append(f"{name} rank {r}: pieces {pieces:.1f} MB measured, {an['pieces'] / MB:.1f} analytic")
            if peak > bound + 0.1:
                failures.append(f"{name} rank {r}: anonymous memory peak {peak:.1f} MB above the bound {bound:.1f}")
            if mapped > an["largest_mapped"] / MB + 4.2:
                failures.append(f"{name} rank {r}: {mapped:.1f} MB of file pages mapped, more than its largest "
                                f"tensor's {an['largest_mapped'] / MB:.1f} MB")
    return results, failures


# --- the 67B, by calculation ---------------------------------------------------------------

def calc_67b(binary):
    cfg = json.load(open(os.path.join(ROOT, "inputs", "models", "deepseek-llm-67b-base.json")))
    tensors = llama_tensors(cfg, "BF16")
    tp, pp, seq = LAYOUT_67B["tensor"], LAYOUT_67B["pipeline"], LAYOUT_67B["seq_len"]
    stages = stage_split(binary, '"inputs/models/deepseek-llm-67b-base.json"', tp * pp,
                         [f"parallel.tensor={tp}", f"parallel.pipeline={pp}"], seq)
    whole = 4 * sum(math.prod(s) for s, _ in tensors.values())
    largest = max(tensors, key=lambda n: math.prod(tensors[n][0]))
    print(f"\nDeepSeek-LLM 67B ({sum(math.prod(s) for s, _ in tensors.values()) / 1e9:.2f}B parameters, "
          f"{cfg['num_hidden_layers']} layers) at tensor {tp} x pipeline {pp}, {seq} tokens: "
          f"per rank, GB (every tensor rank of a stage the same)")
    print(f"{'stage':<24} {'layers':>7} {'pieces':>7} {'+largest piece':>15} {'= peak':>7} {'mapped pages':>13} "
          f"{'whole tensors':>14} {'whole model':>12}")
    out = []
    for s, (lo, hi) in enumerate(stages):
        an = analytic(tensors, cfg, tp, stages, s)
        # Reading whole tensors to cut pieces from would add the largest one the stage holds a piece of.
        held = rank_pieces(tensors, cfg, tp, stages, s)
        whole_read = 4 * max(math.prod(tensors[n][0]) for n in held)
        extra = "embedding" if s == 0 else ("norm + head" if s == len(stages) - 1 else "")
        print(f"{s:<3} {extra:<20} {hi - lo:>7} {an['pieces'] / 1e9:>7.2f} {an['largest_piece'] / 1e9:>15.2f} "
              f"{(an['pieces'] + an['largest_piece']) / 1e9:>7.2f} {an['largest_mapped'] / 1e9:>13.2f} "
              f"{(an['pieces'] + whole_read) / 1e9:>14.2f} {whole / 1e9:>12.1f}")
        out.append(dict(stage=s, layers=hi - lo, **an, whole_read=whole_read, whole=whole))
    print(f"  pieces: the rank's parameters (fp32); largest piece: a device run's host copy of one piece (on the "
          f"host, 0: pieces are read in place);\n  mapped pages: the most bf16 file pages a rank has mapped at once "
          f"(page cache); whole tensors: pieces + the largest whole tensor\n  in fp32 ({largest}, "
          f"{4 * math.prod(tensors[largest][0]) / 1e9:.2f} GB), what cutting pieces out of whole tensors would hold; "
          f"whole model: fp32 ({whole / 2e9:.1f} GB in bf16)")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "app", "dstrain"))
    ap.add_argument("--calc-only", action="store_true", help="the 67B calculation only (no runs)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    results, failures = {}, []
    if not a.calc_only:
        if not os.path.exists(os.path.join(ROOT, "data", "fortunes", "fortunes_text_document.idx")):
            sys.exit("bench_init_from: no fortunes corpus: run .ci/prepare-fortunes build first")
        with tempfile.TemporaryDirectory(prefix="bench_init_from.") as work:
            results["measured"], failures = measure(a.binary, work)
    results["67b"] = calc_67b(a.binary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    if failures:
        print("\n" + "\n".join(failures))
        sys.exit(1)
    if not a.calc_only:
        print("\nevery rank's anonymous memory stayed within its pieces + its largest piece, and its mapped file pages "
              "within its largest tensor")


if __name__ == "__main__":
    main()
