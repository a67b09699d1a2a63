"""Where MLX's `save_safetensors` puts each tensor of a file, known before any byte of it.

`moestreamctl pull` writes a store's resident files tensor by tensor as the shards that
hold them arrive, and `plan REPO_ID` sizes them before anything is downloaded; both need
the file `convert` would write (`mx.save_safetensors`, daemon/store/convert.py), byte for
byte. Its header is the JSON of every tensor's dtype, shape and data offsets (keys sorted,
no spaces), and the data follow in the order of MLX's own map of the tensors, which only
the names and their insertion order decide. So a file of one-element arrays of the same
names shows the order, and the header it gets is checked against the one written here for
it: where MLX writes otherwise, `SafetensorsLayoutError` says so, and the caller falls
back to writing the file with MLX itself.
"""

from __future__ import annotations

import json
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

# MLX's dtype names -> the safetensors header's.
_SAFETENSORS_DTYPES = {
    "bool": "BOOL",
    "uint8": "U8",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "int8": "I8",
    "int16": "I16",
    "int32": "I32",
    "int64": "I64",
    "float16": "F16",
    "bfloat16": "BF16",
    "float32": "F32",
    "float64": "F64",
}
# And the header's back to MLX's (the store's TensorSpec dtypes).
MLX_DTYPES = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


class SafetensorsLayoutError(Exception):
    """MLX writes this file otherwise than `file_layout` predicts it."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # MLX's name: "bfloat16", "uint32"
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileLayout:
    """A safetensors file as MLX writes it: its header and each tensor's data offset."""

    header: bytes  # the 8-byte length and the JSON
    offsets: dict[str, int]  # absolute, in the file
    size: int


def _header(tensors: list[TensorMeta], order: list[str], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    by_name = {t.name: t for t in tensors}
    body: dict[str, object] = {"__metadata__": metadata} if metadata else {}
    relative, offset = {}, 0
    for name in order:
        t = by_name[name]
        dtype = _SAFETENSORS_DTYPES[t.dtype]
        body[name] = {"data_offsets": [offset, offset + t.nbytes], "dtype": dtype, "shape": list(t.shape)}
        relative[name] = offset
        offset += t.nbytes
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    head = struct.pack("<Q", len(text)) + text
    return head, {name: len(head) + off for name, off in relative.items()}


def file_layout(tensors: list[TensorMeta], metadata: dict[str, str], *, check: bool = True) -> FileLayout:
    """The layout of `mx.save_safetensors(path, {name: array, ...}, metadata)` for arrays
    of `tensors` (in the dict's order). Raises SafetensorsLayoutError where the probe
    file MLX writes is not the one predicted for it. `check=False`: no probe, the data in
    the given order (a size that may be a few bytes off, where the check failed)."""
    unknown = sorted({t.dtype for t in tensors} - set(_SAFETENSORS_DTYPES))
    if not check:
        known = [t if t.dtype not in unknown else TensorMeta(t.name, "uint8", t.shape, t.nbytes) for t in tensors]
        head, offsets = _header(known, [t.name for t in known], metadata)
        return FileLayout(head, offsets, len(head) + sum(t.nbytes for t in tensors))
    if unknown:
        raise SafetensorsLayoutError(f"tensors of dtype {', '.join(unknown)}")
    with tempfile.TemporaryDirectory(prefix="moestream-layout-") as tmp:
        path = Path(tmp) / "probe.safetensors"
        mx.save_safetensors(
            str(path), {t.name: mx.zeros((1,), dtype=getattr(mx, t.dtype)) for t in tensors}, metadata=metadata
        )
        raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    probe = json.loads(raw[8 : 8 + length])
    order = sorted((k for k in probe if k != "__metadata__"), key=lambda k: probe[k]["data_offsets"][0])
    if sorted(order) != sorted(t.name for t in tensors):
        raise SafetensorsLayoutError("the probe file does not hold the tensors it was given")
    ones = [TensorMeta(t.name, t.dtype, (1,), mx.zeros((1,), dtype=getattr(mx, t.dtype)).nbytes) for t in tensors]
    expected, _ = _header(ones, order, metadata)
    if raw != expected + b"\0" * sum(t.nbytes for t in ones):
        raise SafetensorsLayoutError("MLX's safetensors header is not the one predicted")
    head, offsets = _header(tensors, order, metadata)
    return FileLayout(head, offsets, len(head) + sum(t.nbytes for t in tensors))
