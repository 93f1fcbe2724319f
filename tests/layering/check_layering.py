#!/usr/bin/env python3
"""dstrain's layering: every #include "..." under src/ and app/ may only point down the order below.

Each file belongs to its top folder (src/<folder>/..., or app). The check fails on
  (a) a cycle between folders, and
  (b) an include from a folder to one later in ORDER (one that runs back up).
It prints the folder graph either way. Standard library only.

Usage: check_layering.py [REPO_ROOT]     (default: the repository holding this script)
       check_layering.py --self-test     (the checker against small trees with known faults)
"""
import os
import re
import sys
import tempfile

# Lowest first. A folder may include itself and folders before it, never one after it.
ORDER = [
    ("core", "tensors, dtypes, devices, buffers, errors, logging, JSON, Philox: needs nothing of dstrain"),
    ("comm", "communicators over MPI, the watchdog and the process grid: tensors and errors from core only"),
    ("backend", "the op table and its CPU kernels: tensors from core; no communication, no parameters"),
    ("state", "the parameter registry, its groups and flat buffers: core (backend may serve casts later)"),
    ("model", "layers, Ctx, ShardSpec: ops from backend, collectives from comm, parameters from state"),
    ("distributed", "gradient reducers, parameter-group communicators, hook chains: the model's hooks, state's groups"),
    ("optim", "AdamW, ZeRO's sharded optimizer and learning-rate schedules: state's flat buffers, backend ops, distributed's hooks"),
    ("io", "checkpoints, safetensors, Hugging Face weights: reads and writes state's registry"),
    ("data", "datasets, tokenizers, the pipeline: core, and comm for ranks that share reads"),
    ("train", "the trainer, its configuration and checkpointing: drives everything below"),
    ("plan", "the performance model, hardware profiles, calibration and the layout planner: prices train's traced steps"),
    ("app", "the command-line programs: thin mains over train, data, io, plan"),
]

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')
SOURCE_SUFFIXES = (".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".h.in")


def folder_of(rel):
    """'src/model/ctx.h' -> 'model'; 'app/cli.h' -> 'app'."""
    parts = rel.split("/")
    return parts[1] if parts[0] == "src" else parts[0]


def scan(root):
    """Returns (edges, external, files): edges[(a, b)] = ['file:line', ...] for a != b."""
    edges, external, files = {}, [], set()
    for top in ("src", "app"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames.sort()
            for name in sorted(filenames):
                if not name.endswith(SOURCE_SUFFIXES):
                    continue
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, root).replace(os.sep, "/")
                if rel.count("/") < (2 if top == "src" else 1):
                    continue  # src/CMakeLists.txt and the like sit in no folder
                src_folder = folder_of(rel)
                files.add(src_folder)
                with open(path, encoding="utf-8", errors="replace") as f:
                    for lineno, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = target_folder(root, dirpath, m.group(1))
                        where = f"{rel}:{lineno}: #include \"{m.group(1)}\""
                        if target is None:
                            external.append(where)
                        elif target != src_folder:
                            edges.setdefault((src_folder, target), []).append(where)
    return edges, external, files


def target_folder(root, dirpath, inc):
    """The folder an include resolves to: next to the including file, then from src/ (the
    include root), then by its first component (generated headers such as core/version.h)."""
    known = {name for name, _ in ORDER}
    for base in (dirpath, os.path.join(root, "src")):
        cand = os.path.normpath(os.path.join(base, inc))
        if os.path.isfile(cand):
            rel = os.path.relpath(cand, root).replace(os.sep, "/")
            if rel.startswith(("src/", "app/")):
                return folder_of(rel)
    first = inc.split("/")[0]
    return first if "/" in inc and first in known else None


def cycles(nodes, edges):
    """Strongly connected components of more than one folder (Tarjan)."""
    succ = {n: sorted(b for (a, b) in edges if a == n) for n in nodes}
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in succ.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in sorted(nodes):
        if n not in index:
            visit(n)
    return out


def check(root, out=sys.stdout):
    """Prints the folder graph and every fault; returns the number of faults."""
    rank = {name: i for i, (name, _) in enumerate(ORDER)}
    edges, external, folders = scan(root)
    nodes = folders | {b for (_, b) in edges}
    faults = 0
    print("dstrain folder graph (folder -> folders it includes, number of includes):", file=out)
    for name in sorted(nodes, key=lambda n: (rank.get(n, len(ORDER)), n)):
        deps = sorted((b for (a, b) in edges if a == name), key=lambda n: (rank.get(n, len(ORDER)), n))
        shown = ", ".join(f"{b} ({len(edges[(name, b)])})" for b in deps) or "-"
        print(f"  {name:12s} -> {shown}", file=out)
    print("allowed order, lowest first:", file=out)
    for name, why in ORDER:
        print(f"  {name:12s} {why}{'' if name in nodes else '  [no such folder today]'}", file=out)
    for name in sorted(nodes - set(rank)):
        faults += 1
        print(f"FAIL: folder '{name}' is not in the layering order; add it to ORDER in "
              f"{os.path.relpath(__file__, root) if __file__.startswith(root) else __file__} with the reason for its place",
              file=out)
    for comp in cycles(nodes, edges):
        faults += 1
        print(f"FAIL: include cycle between folders {' <-> '.join(comp)}:", file=out)
        for a in comp:
            for b in comp:
                for where in edges.get((a, b), [])[:3]:
                    print(f"    {a} -> {b}: {where}", file=out)
    for (a, b), sites in sorted(edges.items()):
        if a in rank and b in rank and rank[b] > rank[a]:
            faults += 1
            print(f"FAIL: {a} includes {b}, which comes after it in the order ({b} may use {a}, not the reverse); "
                  f"move the shared piece down or invert the dependency:", file=out)
            for where in sites:
                print(f"    {where}", file=out)
    if external:
        print(f"{len(external)} include(s) outside src/ and app/ not checked, e.g. {external[0]}", file=out)
    print("layering: " + (f"{faults} fault(s)" if faults else "OK"), file=out)
    return faults


def self_test():
    """The checker must find what it is for: a clean tree passes, an upward include and a cycle fail."""
    import io

    def tree(files):
        d = tempfile.mkdtemp(prefix="layering_")
        for rel, text in files.items():
            os.makedirs(os.path.dirname(os.path.join(d, rel)), exist_ok=True)
            with open(os.path.join(d, rel), "w") as f:
                f.write(text)
        return d

    clean = {
        "src/core/tensor.h": "#pragma once\n#include <vector>\n",
        "src/core/version.h.in": "#define V 1\n",
        "src/comm/comm.h": '#include "core/tensor.h"\n#include "core/version.h"\n',
        "src/backend/cpu/k.cpp": '#include "cpu_ops.h"\n#include "core/tensor.h"\n',
        "src/backend/cpu/cpu_ops.h": '#include "backend/ops.h"\n',
        "src/backend/ops.h": '#include "core/tensor.h"\n',
        "app/main.cpp": '#include "cli.h"\n#include "comm/comm.h"\n#include "third_party.h"\n',
        "app/cli.h": "",
    }
    failures = []

    def expect(name, files, want_faults, *needles):
        buf = io.StringIO()
        n = check(tree(files), buf)
        text = buf.getvalue()
        if n != want_faults:
            failures.append(f"{name}: {n} fault(s), expected {want_faults}\n{text}")
        for needle in needles:
            if needle not in text:
                failures.append(f"{name}: output lacks {needle!r}\n{text}")

    expect("clean", clean, 0, "comm         -> core (2)", "app          -> comm (1)", "layering: OK",
           "backend      -> core (2)", "1 include(s) outside")
    upward = dict(clean)
    upward["src/comm/comm.h"] += '#include "backend/ops.h"\n'
    expect("upward", upward, 1, "FAIL: comm includes backend", 'src/comm/comm.h:3: #include "backend/ops.h"')
    cycle = dict(clean)
    cycle["src/core/tensor.h"] += '#include "comm/comm.h"\n'
    expect("cycle", cycle, 2, "FAIL: include cycle between folders comm <-> core", "FAIL: core includes comm")
    stray = dict(clean)
    stray["src/plugins/p.h"] = '#include "core/tensor.h"\n'
    expect("unknown folder", stray, 1, "FAIL: folder 'plugins' is not in the layering order")
    for f in failures:
        print("SELF-TEST FAIL:", f)
    print("self-test: " + ("OK" if not failures else f"{len(failures)} failure(s)"))
    return 1 if failures else 0


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    root = os.path.abspath(argv[1] if len(argv) > 1 else os.path.join(os.path.dirname(__file__), "..", ".."))
    if not os.path.isdir(os.path.join(root, "src")):
        print(f"{root} has no src/ folder: pass the dstrain repository root")
        return 2
    return 1 if check(root) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
