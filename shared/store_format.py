"""The on-disk expert store: its layout, and the manifest that describes it.

A store is a folder:

    manifest.json            this module's `Manifest`, as JSON
    resident*.safetensors    every non-expert weight, keyed as in the mlx-lm model
    tokenizer files          copied from the source model folder
    experts/layer_NNN.bin    one file per MoE layer
    pool_usage.json          routing heat, written by the heat keeper (a rank of an
                             expert-parallel group: pool_usage.rank<r>of<N>.json)

In a layer file, expert `e` occupies one block that starts at `e * stride` (a multiple
of `EXPERT_ALIGN`), so reading one expert is one aligned read. Inside the block the
expert's tensors (weight, scales, biases, bias of every projection, in manifest order)
lie back to back, each at an offset that is a multiple of `TENSOR_ALIGN`. The block's
first `length` bytes are covered by a CRC-32 (zlib polynomial); the rest is zero padding.

A shard store (`convert --shard i/N`, for rank i of an expert-parallel group of N,
docs/scale-out.md) holds only the experts e with e % N == i, each layer's owned experts
back to back: expert e at `(e // N) * stride`. The manifest's `shard` says [i, N], and
every expert the store lacks is listed with offset ABSENT (its length as the others',
CRC 0), so that nothing can read it by mistake.

This module imports no MLX: the client, the benchmarks and the daemon all read it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import sys
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .durable import fsync_dir, sync_file

FORMAT_NAME = "moestream-store"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
POOL_USAGE_NAME = "pool_usage.json"
# Beside it: each layer's LRU stack distances (daemon/pool/reuse.py), {layer: {distance:
# count}} in the heat file's format, the distance `num_experts` for first uses.
POOL_REUSE_NAME = "pool_reuse.json"
EXPERTS_DIR = "experts"
EXPERT_ALIGN = 16384
# A shard store's offset of an expert it does not hold.
ABSENT = -1
TENSOR_ALIGN = 64

# Bytes per element of the dtypes a store may hold, by their MLX/numpy names.
DTYPE_SIZES = {
    "uint8": 1,
    "int8": 1,
    "uint16": 2,
    "int16": 2,
    "uint32": 4,
    "int32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
}


class StoreError(Exception):
    """The store is missing, malformed, or does not match what is asked of it."""


def align_up(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


@dataclass(frozen=True)
class TensorSpec:
    """One per-expert tensor of a MoE layer, e.g. `gate_proj.scales`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # within the expert block
    nbytes: int


@dataclass(frozen=True)
class ExpertEntry:
    offset: int  # within the layer file
    length: int  # meaningful bytes; the checksum covers exactly these
    crc32: int


@dataclass(frozen=True)
class MoELayer:
    """The experts of one `SwitchGLU`/`SwitchMLP` module of the model."""

    ordinal: int  # position among the model's MoE layers, 0-based
    module_path: str  # e.g. "model.layers.3.mlp.switch_mlp"
    kind: str  # "SwitchGLU" or "SwitchMLP"
    num_experts: int
    file: str  # relative to the store folder
    stride: int  # bytes between consecutive expert blocks
    tensors: tuple[TensorSpec, ...]
    experts: tuple[ExpertEntry, ...]
    # Per projection ("gate_proj", ...): {"group_size", "bits", "mode"}, or None when
    # that projection is not quantized.
    quantization: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's tensors, padding between tensors included."""
        last = self.tensors[-1]
        return last.offset + last.nbytes


@dataclass(frozen=True)
class Manifest:
    model_type: str
    config: dict[str, Any]
    resident_files: tuple[str, ...]
    tokenizer_files: tuple[str, ...]
    layers: tuple[MoELayer, ...]
    source: dict[str, Any] = field(default_factory=dict)
    alignment: int = EXPERT_ALIGN
    version: int = FORMAT_VERSION
    # Names the store wherever it lies: two copies of one store have the same id. `convert`
    # writes a fresh one; a store written before ids existed gets one from its content.
    store_id: str | None = None
    # (i, N) for a shard store, which holds only the experts e % N == i; None: every expert.
    shard: tuple[int, int] | None = None
    # The vision tower and projector of a vision-language model, as mlx-vlm loads them
    # (resident, beside the language model's weights); empty: the model takes no images.
    vision_files: tuple[str, ...] = ()

    @property
    def takes_images(self) -> bool:
        return bool(self.vision_files)

    def holds(self, expert: int) -> bool:
        """Whether this store holds `expert` of every layer (a shard store only its own)."""
        return self.shard is None or expert % self.shard[1] == self.shard[0]

    @property
    def expert_bytes_total(self) -> int:
        """Bytes of every expert of every MoE layer: what host memory needs to hold them all."""
        return sum(layer.num_experts * layer.expert_bytes for layer in self.layers)

    # ---- serialisation -------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        layers = []
        for layer in self.layers:
            d = asdict(layer)
            d["tensors"] = [asdict(t) | {"shape": list(t.shape)} for t in layer.tensors]
            d["experts"] = [[e.offset, e.length, e.crc32] for e in layer.experts]
            layers.append(d)
        head: dict[str, Any] = {"format": FORMAT_NAME, "version": self.version}
        if self.store_id is not None:
            head["store_id"] = self.store_id
        if self.shard is not None:
            head["shard"] = list(self.shard)
        if self.vision_files:
            head["vision_files"] = list(self.vision_files)
        return {
            **head,
            "model_type": self.model_type,
            "alignment": self.alignment,
            "config": self.config,
            "resident_files": list(self.resident_files),
            "tokenizer_files": list(self.tokenizer_files),
            "source": self.source,
            "moe_layers": layers,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "manifest") -> "Manifest":
        try:
            if data.get("format") != FORMAT_NAME:
                raise StoreError(f"{where}: not a moestream store manifest")
            if data.get("version") != FORMAT_VERSION:
                raise StoreError(
                    f"{where}: store format version {data.get('version')} is not "
                    f"supported (this moestream reads version {FORMAT_VERSION}); "
                    "convert the model again"
                )
            layers = []
            for d in data["moe_layers"]:
                tensors = tuple(
                    TensorSpec(
                        name=t["name"],
                        dtype=t["dtype"],
                        shape=tuple(int(s) for s in t["shape"]),
                        offset=int(t["offset"]),
                        nbytes=int(t["nbytes"]),
                    )
                    for t in d["tensors"]
                )
                experts = tuple(ExpertEntry(int(o), int(n), int(c)) for o, n, c in d["experts"])
                layers.append(
                    MoELayer(
                        ordinal=int(d["ordinal"]),
                        module_path=str(d["module_path"]),
                        kind=str(d["kind"]),
                        num_experts=int(d["num_experts"]),
                        file=str(d["file"]),
                        stride=int(d["stride"]),
                        tensors=tensors,
                        experts=experts,
                        quantization=dict(d.get("quantization") or {}),
                    )
                )
            manifest = cls(
                model_type=str(data["model_type"]),
                config=dict(data["config"]),
                resident_files=tuple(data["resident_files"]),
                tokenizer_files=tuple(data["tokenizer_files"]),
                layers=tuple(layers),
                source=dict(data.get("source") or {}),
                alignment=int(data.get("alignment", EXPERT_ALIGN)),
                version=int(data["version"]),
                store_id=_store_id_of(data),
                shard=_shard_of(data),
                vision_files=tuple(str(f) for f in data.get("vision_files") or ()),
            )
        except StoreError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"{where}: malformed manifest ({type(e).__name__}: {e})") from e
        manifest.validate(where)
        return manifest

    def validate(self, where: str = "manifest") -> None:
        """Check the invariants the reader relies on; raise StoreError if one fails."""
        if self.store_id is not None and (not isinstance(self.store_id, str) or not self.store_id.strip()):
            raise StoreError(f"{where}: the store id {self.store_id!r} is not a non-empty string")
        if not self.layers:
            raise StoreError(f"{where}: the store has no MoE layers")
        if self.shard is not None and not 0 <= self.shard[0] < self.shard[1]:
            raise StoreError(f"{where}: shard {self.shard[0]}/{self.shard[1]} is not one of {self.shard[1]}")
        for layer in self.layers:
            if len(layer.experts) != layer.num_experts:
                raise StoreError(
                    f"{where}: layer {layer.module_path} lists {len(layer.experts)} "
                    f"experts, expected {layer.num_experts}"
                )
            if layer.stride % self.alignment or layer.stride < layer.expert_bytes:
                raise StoreError(f"{where}: layer {layer.module_path} has a bad stride")
            for t in layer.tensors:
                if t.dtype not in DTYPE_SIZES:
                    raise StoreError(f"{where}: tensor {t.name} has unknown dtype {t.dtype}")
                count = 1
                for s in t.shape:
                    count *= s
                if count * DTYPE_SIZES[t.dtype] != t.nbytes or t.offset % TENSOR_ALIGN:
                    raise StoreError(f"{where}: tensor {t.name} of {layer.module_path} is inconsistent")
            for e, entry in enumerate(layer.experts):
                offset = self.expert_offset(layer, e)
                if entry.offset != offset or entry.length != layer.expert_bytes:
                    raise StoreError(
                        f"{where}: expert {e} of {layer.module_path} has offset/length "
                        f"{entry.offset}/{entry.length}, expected {offset}/{layer.expert_bytes}"
                    )

    def expert_offset(self, layer: MoELayer, expert: int) -> int:
        """Where `expert` of `layer` lies in its file: ABSENT where a shard store lacks it."""
        if self.shard is None:
            return expert * layer.stride
        return expert // self.shard[1] * layer.stride if self.holds(expert) else ABSENT

    # ---- files ---------------------------------------------------------------------

    def dump(self, store_dir: str | os.PathLike) -> None:
        """Write manifest.json atomically (temporary file, fsync, rename)."""
        path = Path(store_dir) / MANIFEST_NAME
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
            sync_file(f)
        os.replace(tmp, path)
        fsync_dir(path.parent)


ManifestStamp = tuple[int, int, int, int, int]


def manifest_stamp(store_dir: str | os.PathLike) -> ManifestStamp:
    """(device, inode, size, mtime, ctime) of the store's manifest: what changes when the
    store at that path is replaced or its manifest edited. The ctime is there because a
    copy keeps the mtime (`cp -p`, copytree) and a freshly deleted inode number is often
    handed to the next new file, while no copy can set a new file's ctime back.
    Raises OSError when it cannot be read."""
    st = os.stat(Path(store_dir) / MANIFEST_NAME)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def vanished_store_problem(store_dir: str | os.PathLike, stamp: ManifestStamp | None) -> str | None:
    """Why the store loaded from `store_dir` (its manifest then had `stamp`) is not there
    as it was, or None. Costs a stat or two: a daemon asks it per `status`."""
    store = Path(store_dir)
    restart = "restart the daemon with `moestreamctl restart --model STORE`"
    try:
        now = manifest_stamp(store)
    except FileNotFoundError:
        if not store.is_dir():
            return f"the model folder {store} no longer exists: {restart}"
        return f"the model folder {store} no longer holds a store ({MANIFEST_NAME} is gone): {restart}"
    except OSError as e:
        return f"the model folder {store} cannot be read ({e.strerror or e}): {restart}"
    if stamp is not None and now != stamp:
        return (
            f"the store in the model folder {store} was replaced or its manifest changed since the daemon "
            "loaded it: restart the daemon (`moestreamctl restart`) to serve what is there now"
        )
    return None


def new_store_id() -> str:
    """A fresh store id, for a store just written."""
    return uuid.uuid4().hex


def content_store_id(data: dict[str, Any]) -> str:
    """The id of a manifest (as JSON data) that has none: a hash of its canonical JSON,
    so that every copy of such a store, read by any moestream, gets the same id."""
    body = {k: v for k, v in data.items() if k != "store_id"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def _store_id_of(data: dict[str, Any]) -> str:
    given = data.get("store_id")
    if given is None:
        return content_store_id(data)
    if not isinstance(given, str):
        raise TypeError(f"store_id is a {type(given).__name__}, not a string")
    return given


def _shard_of(data: dict[str, Any]) -> tuple[int, int] | None:
    shard = data.get("shard")
    if shard is None:
        return None
    if not isinstance(shard, list) or len(shard) != 2 or not all(type(n) is int for n in shard):
        raise TypeError(f"shard is {shard!r}, not [index, count]")
    return (shard[0], shard[1])


def load_manifest(store_dir: str | os.PathLike) -> Manifest:
    """Read and validate a store's manifest, with errors that say what to do."""
    store = Path(store_dir)
    path = store / MANIFEST_NAME
    try:
        if not store.is_dir():
            raise StoreError(f"expert store {store} does not exist (make one with `moestreamctl convert`)")
        if not path.is_file():
            raise StoreError(
                f"{store} is not an expert store: {MANIFEST_NAME} is missing (make one with `moestreamctl convert`)"
            )
        data = json.loads(path.read_text())
    except OSError as e:  # is_dir and is_file raise what is not "not there": EPERM, EIO
        raise StoreError(f"{path}: cannot read the manifest ({e}){permission_advice(e)}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreError(f"{path}: cannot read the manifest ({e})") from e
    return Manifest.from_json(data, where=str(path))


def permission_advice(err: OSError, *, platform: str | None = None, executable: str | None = None) -> str:
    """What to grant, as a sentence to append to the message of `err`, when it is macOS's
    privacy protection refusing a read: EPERM ("Operation not permitted"), which a
    LaunchAgent gets in ~/Documents, ~/Desktop, ~/Downloads or on a removable volume
    without Full Disk Access; "" for any other error or system. `platform` and
    `executable` are `sys.platform` and `sys.executable` unless given."""
    platform = sys.platform if platform is None else platform
    if platform != "darwin" or err.errno != errno.EPERM:
        return ""
    python = os.path.realpath(sys.executable if executable is None else executable)
    return (
        f". macOS's privacy protection refused it: in System Settings > Privacy & Security, give {python} "
        "Full Disk Access (or access to this folder under Files and Folders), or keep the store outside "
        "~/Documents, ~/Desktop, ~/Downloads and removable volumes"
    )


def same_folder(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` are one folder, by device and inode: on a case-insensitive
    filesystem (APFS's default) ~/models/x and ~/Models/X are one folder with two
    spellings that no path comparison equates. False when either cannot be looked at."""
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def canonical_folder(path: str | os.PathLike, *, platform: str | None = None) -> Path:
    """`path` resolved, and on macOS spelled as on disk (F_GETPATH), so that the two
    spellings of one folder on a case-insensitive filesystem name one heat folder.
    Elsewhere, or where the folder cannot be opened, the resolved path."""
    resolved = Path(path).resolve()
    platform = sys.platform if platform is None else platform
    getpath = getattr(fcntl, "F_GETPATH", None)  # only macOS's Python has it
    if platform != "darwin" or getpath is None:
        return resolved
    try:
        fd = os.open(resolved, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return resolved
    try:
        raw = fcntl.fcntl(fd, getpath, bytes(1024))  # MAXPATHLEN
    except OSError:
        return resolved
    finally:
        os.close(fd)
    return Path(os.fsdecode(raw.split(b"\0", 1)[0]))
