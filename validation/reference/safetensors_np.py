"""Minimal safetensors reader/writer built on numpy, json and struct only.

File format (https://github.com/huggingface/safetensors):
    u64 little-endian N = length of the JSON header in bytes
    N bytes of UTF-8 JSON: {name: {"dtype": "F32", "shape": [...],
                                   "data_offsets": [begin, end]},
                            "__metadata__": {str: str}}   (metadata optional)
    the raw little-endian tensor data; offsets are relative to the end of
    the header.

`save` pads the JSON header with spaces to a multiple of 8 bytes (as the
reference Rust implementation does) and writes tensors in sorted name order,
so the output is a deterministic function of the input.

`load` converts BF16 to float32 (uint16 << 16); every other dtype is returned
as the matching numpy dtype.

`load_dir` loads a Hugging Face checkpoint folder: model.safetensors, or
model.safetensors.index.json ({"weight_map": {name: shard_file}}) with shards.
"""

import json
import os
import struct

import numpy as np

# safetensors dtype string -> numpy dtype (little-endian)
_LOAD_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # converted to float32 after reading
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}

# numpy dtype -> safetensors dtype string accepted by save()
_SAVE_DTYPES = {
    np.dtype("float32"): "F32",
    np.dtype("int32"): "I32",
    np.dtype("int64"): "I64",
}


def bf16_to_f32(raw_u16):
    """Convert an array of raw bfloat16 bit patterns (uint16) to float32."""
    raw_u16 = np.asarray(raw_u16, dtype=np.uint16)
    return (raw_u16.astype(np.uint32) << 16).view(np.float32)


def read_header(path):
    """Return (header_dict, data_start_offset) of a safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: file too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError(f"{path}: truncated header ({len(raw)} of {n} bytes)")
    return json.loads(raw.decode("utf-8")), 8 + n


def load(path):
    """Load every tensor of a safetensors file into a dict name -> np.ndarray."""
    header, start = read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _LOAD_DTYPES:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {dt}")
        npdt = _LOAD_DTYPES[dt]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(x) for x in info["data_offsets"])
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if end - begin != count * npdt.itemsize or end > len(data) or begin < 0:
            raise ValueError(f"{path}: tensor {name}: bad data_offsets {begin}..{end} "
                             f"for shape {shape} dtype {dt}")
        arr = np.frombuffer(data, dtype=npdt, count=count, offset=begin).reshape(shape).copy()
        if dt == "BF16":
            arr = bf16_to_f32(arr)
        out[name] = arr
    return out


def load_metadata(path):
    """Return the "__metadata__" dict of a safetensors file ({} if absent)."""
    header, _ = read_header(path)
    return dict(header.get("__metadata__", {}) or {})


def save(path, tensors, metadata=None):
    """Write dict name -> np.ndarray (float32 / int32 / int64) as safetensors.

    Metadata values are converted to strings (the format requires str -> str).
    """
    names = sorted(tensors)
    header = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs = []
    offset = 0
    for name in names:
        arr = np.asarray(tensors[name])
        if arr.dtype not in _SAVE_DTYPES:
            raise ValueError(f"tensor {name}: unsupported dtype {arr.dtype} "
                             f"(save supports float32, int32, int64)")
        blob = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {
            "dtype": _SAVE_DTYPES[arr.dtype],
            "shape": [int(s) for s in arr.shape],
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * ((8 - len(raw) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def load_dir(directory):
    """Load a Hugging Face checkpoint folder (single file or index + shards)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(single):
        return load(single)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        out = {}
        for shard in sorted(set(weight_map.values())):
            tensors = load(os.path.join(directory, shard))
            for name, arr in tensors.items():
                if weight_map.get(name) == shard:
                    out[name] = arr
        missing = sorted(set(weight_map) - set(out))
        if missing:
            raise ValueError(f"{index}: tensors missing from their shards: {missing[:5]}")
        return out
    raise FileNotFoundError(f"{directory}: neither model.safetensors nor "
                            f"model.safetensors.index.json found")


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        print("usage: safetensors_np.py FILE.safetensors  (lists the tensors)")
        sys.exit(2)
    hdr, _ = read_header(sys.argv[1])
    for key, val in hdr.items():
        if key == "__metadata__":
            print("__metadata__", val)
        else:
            print(key, val["dtype"], val["shape"])
