#!/usr/bin/env python3
"""Opens a dstrain checkpoint with h5py alone (no dstrain code), verifies every tensor's
crc32 with zlib and every metadata field's checksum (/metadata_checksums, sealed by the root
attribute metadata_crc32), prints what it holds, and, given a Hugging Face export of the same
checkpoint (`dstrain-ckpt export FILE --to-hf DIR`), checks that the exported safetensors
hold exactly the checkpoint's /model tensors.

    /usr/bin/python3 validation/check_checkpoint.py CHECKPOINT.h5 [HF_DIR]
"""

import json
import os
import sys
import zlib

import h5py
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference"))
import safetensors_np  # noqa: E402


def canonical(value):
    """An attribute's value as dstrain hashes it: integers in decimal, floats as %.17g, text as is."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    if isinstance(value, (np.integer, int)):
        return str(int(value))
    return "%.17g" % float(value)


def metadata_fields(f):
    fields = {f"/@{k}": canonical(v) for k, v in f.attrs.items() if k != "metadata_crc32"}

    def visit(name, obj):
        path = "/" + name
        if path == "/metadata_checksums":
            return
        if isinstance(obj, h5py.Dataset):
            if obj.dtype.kind in "SOU":
                v = obj[()]
                fields[path] = (v.decode() if isinstance(v, bytes) else v).rstrip("\0")
            else:
                kind = {"f": "float", "i": "int", "u": "uint"}[obj.dtype.kind]
                fields[path] = f"{kind}{obj.dtype.itemsize * 8} [{','.join(str(d) for d in obj.shape)}]"
        for k, v in obj.attrs.items():
            fields[f"{path}@{k}"] = canonical(v)

    f.visititems(visit)
    return fields


def check_metadata(f):
    """Mismatching metadata fields (0 for a file written before dstrain sealed its metadata)."""
    if "metadata_crc32" not in f.attrs:
        print("metadata unverified: written before dstrain sealed checkpoint metadata")
        return 0
    manifest = f["metadata_checksums"][()]
    manifest = (manifest.decode() if isinstance(manifest, bytes) else manifest).rstrip("\0")
    if zlib.crc32(manifest.encode()) != int(f.attrs["metadata_crc32"]):
        print("  /metadata_checksums does not match /@metadata_crc32")
        return 1
    want = {line[9:]: int(line[:8], 16) for line in manifest.splitlines() if line}
    have = metadata_fields(f)
    bad = 0
    for name in sorted(set(want) | set(have)):
        if name not in have or name not in want or zlib.crc32(have[name].encode()) != want[name]:
            print(f"  {name}: metadata checksum mismatch")
            bad += 1
    print(f"{len(have)} metadata fields, {bad} metadata checksum mismatch(es)")
    return bad


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        return 2
    path = sys.argv[1]
    bad = 0
    with h5py.File(path, "r") as f:
        assert f.attrs["format"] == "dstrain-checkpoint", "not a dstrain checkpoint"
        print(f"{path}: step {f.attrs['step']}, {f.attrs['consumed_samples']} samples, "
              f"written by dstrain {f.attrs['dstrain_version']} ({f.attrs['build_id']}) at {f.attrs['created']}")
        layout = json.loads(f["layout"].attrs["json"])
        config = json.loads(f["config"][()].decode() if isinstance(f["config"][()], bytes) else f["config"][()])
        print(f"layout {layout['world_size']} rank(s); model {config['model']['hidden_size']} hidden x "
              f"{config['model']['num_hidden_layers']} layers; data position {f['data'].attrs['consumed_samples']}")
        groups = ["model", "optimizer/exp_avg", "optimizer/exp_avg_sq"]
        count = 0
        for g in groups:
            if g not in f:
                continue
            for name, ds in f[g].items():
                data = ds[()]
                assert data.dtype == np.float32, f"{g}/{name} is {data.dtype}"
                crc = zlib.crc32(np.ascontiguousarray(data).astype("<f4").tobytes())
                if crc != int(ds.attrs["crc32"]):
                    print(f"  {g}/{name}: crc32 {crc:08x} != stored {int(ds.attrs['crc32']):08x}")
                    bad += 1
                count += 1
        print(f"{count} tensors, {bad} checksum mismatch(es)")
        bad += check_metadata(f)
        if len(sys.argv) == 3:
            hf = safetensors_np.load_dir(sys.argv[2])
            names = set(f["model"].keys())
            assert names == set(hf.keys()), f"names differ: {sorted(names ^ set(hf.keys()))[:5]}"
            for name in sorted(names):
                np.testing.assert_array_equal(f["model"][name][()], hf[name], err_msg=name)
            hf_config = json.load(open(os.path.join(sys.argv[2], "config.json")))
            assert hf_config["hidden_size"] == config["model"]["hidden_size"]
            print(f"the export in {sys.argv[2]} holds the same {len(names)} model tensors, bit for bit")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
