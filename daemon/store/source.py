"""Checks on an mlx-lm model folder before anything is loaded from it.

MLX reads safetensors lazily and trusts their headers, so a missing or truncated shard
would surface late, as a crash deep inside a load. These checks read only the headers
and name the file that is wrong. No MLX here.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ...shared.store_format import StoreError

INDEX_NAME = "model.safetensors.index.json"
# Larger headers than this are not plausible for a weight file; it is corrupt.
MAX_HEADER_BYTES = 100 << 20

# Files a tokenizer may need, as mlx-lm's load_tokenizer fetches them; weights, the
# weight index and the model config are not tokenizer files.
_TOKENIZER_PATTERNS = ("*.json", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt", "*.jsonl", "*.jinja")
_NOT_TOKENIZER = {"config.json", INDEX_NAME}


def safetensors_data_end(path: Path) -> int:
    """The size in bytes `path` must have according to its own header."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StoreError(f"{path} is truncated ({size} bytes, not even a safetensors header); download it again")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES:
            raise StoreError(f"{path} is not a safetensors file (header length {header_len})")
        if 8 + header_len > size:
            raise StoreError(
                f"{path} is truncated: {size} bytes, its header alone needs {8 + header_len}; download it again"
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise StoreError(f"{path} has a malformed safetensors header ({e}); download it again") from e
    return 8 + header_len + max(ends, default=0)


def check_weight_files(model_dir: Path) -> list[Path]:
    """The weight files mlx-lm will load from `model_dir`, each checked to be present
    and complete. Raises StoreError naming the first file that is missing or short."""
    index_path = model_dir / INDEX_NAME
    files = sorted(model_dir.glob("model*.safetensors"))
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
            named = sorted({str(v) for v in weight_map.values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"{index_path}: cannot read the weight index ({e})") from e
        missing = [n for n in named if not (model_dir / n).is_file()]
        if missing:
            raise StoreError(
                f"{model_dir}: the weight index names {len(missing)} file(s) that are missing: "
                f"{', '.join(missing)}; finish the download (or download the model again)"
            )
        files = sorted(set(files) | {model_dir / n for n in named})
    if not files:
        raise StoreError(f"{model_dir}: no model*.safetensors weight files; is this an mlx-lm model folder?")
    for path in files:
        expected = safetensors_data_end(path)
        size = path.stat().st_size
        if size < expected:
            raise StoreError(f"{path} is truncated: {size} bytes, its header says {expected}; download it again")
    return files


def check_model_dir(model_dir: Path) -> list[Path]:
    """Check that `model_dir` looks like an mlx-lm model folder; return its weight files."""
    if not model_dir.is_dir():
        raise StoreError(f"model folder {model_dir} does not exist")
    if not (model_dir / "config.json").is_file():
        raise StoreError(f"{model_dir} is not an mlx-lm model folder: config.json is missing")
    return check_weight_files(model_dir)


def tokenizer_files(model_dir: Path) -> list[Path]:
    """The tokenizer (and generation config) files of `model_dir`, to copy into a store."""
    found: set[Path] = set()
    for pattern in _TOKENIZER_PATTERNS:
        found.update(p for p in model_dir.glob(pattern) if p.is_file() and p.name not in _NOT_TOKENIZER)
    return sorted(found)
