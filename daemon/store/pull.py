"""`moestreamctl pull`: a Hugging Face repository -> an expert store, converted as it downloads.

`convert` of the downloaded folder writes each MoE layer's experts into a file of fixed
blocks and the resident weights into safetensors files whose layout only their names,
dtypes and shapes decide. All of that is known before a byte of weights arrives: mlx-lm
loads a *skeleton* of the repository (its config, and each weight file as its header
over a sparse hole) exactly as `convert` loads the real folder (`open_model`), and every
model parameter that is, object for object, a tensor mlx-lm read from a file (sanitize
kept it as it is, as it keeps an mlx-community model's) has a fixed place in the store:
`StoreLayout.places`. So each weight file, once downloaded and checked, has its tensors
copied to their places (an expert tensor's slice of expert e to block e of its layer's
file) and is removed; a layer whose tensors are all in gets its checksums; after the last
file the tokenizer files and the manifest finish the store. The disk holds the store and
one weight file at most. The result is `convert`'s byte for byte but the manifest's id
and source (tests/test_pull.py).

A model whose parameters sanitize computes from several tensors (a Hugging Face layout of
one module per expert, stacked by mlx-lm), or with an MTP head, or where MLX would write a
resident file otherwise than `safetensors_layout` predicts, is downloaded whole and
converted at the end, as `convert` would (`StoreLayout.direct` says why); the disk then
needs the model and the store at once, and the pull says so before it starts.

The pull works in the store's own folder: `.pull/` holds the downloads (`source/`, each
file as `NAME.incomplete` until complete and checked), the weight files' headers and a
state file naming the commit, the weight files already placed and the layers' checksums.
Started again after a stop, it continues from there: placed files are neither fetched nor
copied again, a partial download continues from its length. The manifest is written last,
so a folder with one is a complete store.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import zlib
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from ...shared.durable import fsync_dir, sync_fd
from ...shared.file_lock import lock_exclusive
from ...shared.settings import format_size
from ...shared.store_format import (
    EXPERTS_DIR,
    MANIFEST_NAME,
    ExpertEntry,
    Manifest,
    MoELayer,
    StoreError,
    load_manifest,
    new_store_id,
)
from .convert import (
    RESIDENT_METADATA,
    RESIDENT_SHARD_BYTES,
    _disk_free,
    convert_model,
    layer_file_name,
    moe_layer,
    open_model,
    package_versions,
    required_free_bytes,
    resident_file_name,
    resident_groups,
)
from .hub import (
    INCOMPLETE,
    Progress,
    RepoListing,
    WeightHeader,
    default_store_dir,
    fetch_file,
    list_repo,
    weight_headers,
)
from .layout import dtype_name, find_switch_layers
from .safetensors_layout import FileLayout, SafetensorsLayoutError, TensorMeta, file_layout
from .source import MAX_HEADER_BYTES, tokenizer_files

PULL_DIR = ".pull"
SOURCE_DIR = "source"
STATE_NAME = "state.json"
LOCK_NAME = "lock"
HEADERS_NAME = "headers.json"
_COPY_CHUNK = 64 << 20


# ---- the store's layout, from the repository's config and headers ---------------------------


@dataclass(frozen=True)
class Place:
    """Where one downloaded tensor's bytes go in the store: `count` slices of `nbytes`
    (a stacked expert tensor's, one per expert, `stride` apart from `offset`), or the
    whole tensor at `offset` (count 1)."""

    file: str  # relative to the store
    offset: int
    count: int
    nbytes: int
    stride: int


@dataclass
class StoreLayout:
    """The store `convert` would write from the repository, known from its config and
    weight headers alone."""

    model_type: str
    config: dict[str, Any]
    layers: tuple[MoELayer, ...]  # checksums 0: they need the bytes
    resident: tuple[tuple[str, FileLayout], ...]  # (file name, its layout)
    resident_dtype_bytes: dict[str, int]  # bytes of resident weights by dtype ("bfloat16")
    mtp_bytes: int  # an MTP head's tensors (their data; a store holds them in mtp.safetensors)
    places: dict[str, list[Place]]  # by the downloaded tensor's name
    layer_files: dict[int, frozenset[str]]  # by layer ordinal: the weight files its experts come from
    # None: every tensor is placed as its file arrives; else why the model is converted whole at the end.
    direct: str | None

    @property
    def expert_file_bytes(self) -> int:
        return sum(layer.num_experts * layer.stride for layer in self.layers)

    @property
    def resident_bytes(self) -> int:
        return sum(f.size for _, f in self.resident)

    def store_bytes(self, tokenizer_bytes: int) -> int:
        """The store's files but its manifest (a few KB to a few MB of JSON)."""
        return self.expert_file_bytes + self.resident_bytes + self.mtp_bytes + tokenizer_bytes


def _placeholder(path: Path, header: WeightHeader) -> None:
    """A weight file of `header` whose data is a hole: mlx-lm loads it lazily, and no byte
    of it is read (nor takes disk space)."""
    body: dict[str, Any] = {"__metadata__": header.metadata} if header.metadata else {}
    for name, t in header.tensors.items():
        body[name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": list(t.data_offsets)}
    text = json.dumps(body).encode()
    end = max((t.data_offsets[1] for t in header.tensors.values()), default=0)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + end)


def describe_repo(small_dir: Path, headers: dict[str, WeightHeader]) -> StoreLayout:
    """The layout of the store of the model whose small files (config, tokenizer) are in
    `small_dir` and whose weight files have `headers`, as `convert` lays it out."""
    seen: dict[str, mx.array] = {}
    with tempfile.TemporaryDirectory(prefix="moestream-skeleton-") as tmp:
        skeleton = Path(tmp)
        for f in small_dir.iterdir():
            if f.is_file() and not f.name.endswith(INCOMPLETE):
                os.symlink(f.resolve(), skeleton / f.name)
        for name, header in headers.items():
            _placeholder(skeleton / name, header)
        parts = open_model(skeleton, sanitize_input=seen.update)
    where = {name: file for file, h in headers.items() for name in h.tensors}
    source = {id(a): name for name, a in seen.items()}
    places: dict[str, list[Place]] = {}
    why_not: list[str] = []

    def place(param: str, a: mx.array, p: Place) -> str | None:
        name = source.get(id(a))
        if name is None:
            why_not.append(f"{param} is computed by the model's sanitize")
            return None
        places.setdefault(name, []).append(p)
        return where[name]

    layers, layer_files = [], {}
    for ordinal, layer in enumerate(parts.layers):
        entries = [ExpertEntry(e * layer.stride, layer.expert_bytes, 0) for e in range(layer.num_experts)]
        layers.append(moe_layer(ordinal, layer, entries))
        files = set()
        for param, a, spec in zip(layer.parameter_names(), layer.arrays, layer.specs):
            p = Place(layer_file_name(ordinal), spec.offset, layer.num_experts, spec.nbytes, layer.stride)
            files.add(place(param, a, p))
        layer_files[ordinal] = frozenset(files - {None})
    resident = []
    dtype_bytes: dict[str, int] = {}
    items = parts.resident
    for i, group in enumerate(resident_groups([a.nbytes for _, a in items], RESIDENT_SHARD_BYTES)):
        metas = [TensorMeta(n, dtype_name(a.dtype), tuple(a.shape), a.nbytes) for n, a in (items[j] for j in group)]
        try:
            layout = file_layout(metas, RESIDENT_METADATA)
        except SafetensorsLayoutError as e:
            why_not.append(f"the resident weights' files cannot be laid out before they are written ({e})")
            layout = file_layout(metas, RESIDENT_METADATA, check=False)
        name = resident_file_name(i)
        resident.append((name, layout))
        for j, m in zip(group, metas):
            dtype_bytes[m.dtype] = dtype_bytes.get(m.dtype, 0) + m.nbytes
            place(m.name, items[j][1], Place(name, layout.offsets[m.name], 1, m.nbytes, 0))
    if parts.mtp:
        why_not.append("its MTP head's tensors are converted with the whole model")
    return StoreLayout(
        model_type=parts.model_type,
        config=parts.config,
        layers=tuple(layers),
        resident=tuple(resident),
        resident_dtype_bytes=dtype_bytes,
        mtp_bytes=sum(a.nbytes for a in parts.mtp.values()),
        places=places,
        layer_files=layer_files,
        direct=why_not[0] if why_not else None,
    )


def check_config(small_dir: Path, repo_id: str) -> None:
    """Refuse, from config.json alone, a repository that is no MoE model mlx-lm can load:
    mlx-lm builds the model of the config (random, lazy weights: nothing is read) and the
    store's own check finds its experts (daemon/store/layout.py `find_switch_layers`)."""
    from mlx_lm.utils import _get_classes, load_config

    try:
        config = load_config(small_dir)
        if config.get("model_file") is not None:
            raise ValueError(f"it needs its own code ({config['model_file']}) to build its architecture")
        model_class, args_class = _get_classes(config)
        model = model_class(args_class.from_dict(config))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreError(
            f"{repo_id}: mlx-lm cannot load this model ({type(e).__name__}: {e}); nothing was downloaded but its config"
        ) from None
    try:
        find_switch_layers(model, str(config.get("model_type", "model")))
    except StoreError as e:
        raise StoreError(f"{repo_id}: {e}; nothing was downloaded but its config") from None


# ---- the pull ------------------------------------------------------------------------------


@dataclass
class PullState:
    """What `.pull/state.json` keeps between runs."""

    repo_id: str
    commit: str
    placed: list[str] = field(default_factory=list)  # weight files whose tensors are in the store
    crcs: dict[str, list[int]] = field(default_factory=dict)  # by layer ordinal

    def save(self, work: Path) -> None:
        tmp = work / (STATE_NAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump(asdict(self), f)
            f.flush()
            sync_fd(f.fileno())
        os.replace(tmp, work / STATE_NAME)

    @classmethod
    def load(cls, work: Path) -> PullState | None:
        try:
            data = json.loads((work / STATE_NAME).read_text())
            return cls(str(data["repo_id"]), str(data["commit"]), list(data["placed"]), dict(data["crcs"]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{work / STATE_NAME} cannot be read ({e}); remove {work.parent} to pull again") from None


@dataclass(frozen=True)
class PullEvent:
    """A step of a pull, for a caller that watches it (a test samples the disk here)."""

    kind: str  # "bytes", "downloaded", "placed" (before the weight file is removed), "removed", "done"
    file: str
    done: int  # bytes downloaded (or found downloaded) of `total`
    total: int


def folder_bytes(folder: Path) -> int:
    """Disk space the files under `folder` take (allocated blocks: a hole takes none)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(where the data begins, the header's tensors) of a downloaded weight file."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        if length > MAX_HEADER_BYTES:
            raise StoreError(f"{path} is not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return 8 + length, header


def _copy(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int) -> None:
    while nbytes > 0:
        chunk = os.pread(src, min(nbytes, _COPY_CHUNK), src_offset)
        if not chunk:
            raise StoreError("a weight file ended before its header said it would")
        os.pwrite(dst, chunk, dst_offset)
        src_offset, dst_offset, nbytes = src_offset + len(chunk), dst_offset + len(chunk), nbytes - len(chunk)


def _place(path: Path, expected: WeightHeader, layout: StoreLayout, out: Path) -> None:
    """Copy each tensor of the weight file `path` to its places in the store at `out`."""
    start, header = _read_header(path)
    for name, t in expected.tensors.items():
        got = header.get(name)
        if got is None or got["dtype"] != t.dtype or tuple(got["shape"]) != t.shape:
            raise StoreError(f"{path.name}: tensor {name} is not the one its header on the hub showed; pull again")
    files: dict[str, int] = {}
    src = os.open(path, os.O_RDONLY)
    try:
        for name, t in header.items():
            begin = start + int(t["data_offsets"][0])
            for p in layout.places.get(name, []):
                if p.file not in files:
                    files[p.file] = os.open(out / p.file, os.O_WRONLY)
                for e in range(p.count):
                    _copy(src, begin + e * p.nbytes, files[p.file], p.offset + e * p.stride, p.nbytes)
        for fd in files.values():
            sync_fd(fd)
    finally:
        os.close(src)
        for fd in files.values():
            os.close(fd)


def _layer_crcs(out: Path, layer: MoELayer) -> list[int]:
    fd = os.open(out / layer.file, os.O_RDONLY)
    try:
        return [zlib.crc32(os.pread(fd, e.length, e.offset)) for e in layer.experts]
    finally:
        os.close(fd)


def _lay_out_files(out: Path, layout: StoreLayout) -> None:
    """The store's weight files at their sizes (holes until filled), each resident file
    with its header; files a stopped pull made are kept as they are."""
    (out / EXPERTS_DIR).mkdir(parents=True, exist_ok=True)
    layer_files = [(layer.file, b"", layer.num_experts * layer.stride) for layer in layout.layers]
    for name, header, size in layer_files + [(name, f.header, f.size) for name, f in layout.resident]:
        if not (out / name).exists():
            with open(out / name, "wb") as f:
                f.write(header)
                f.truncate(size)


def _headers(work: Path, listing: RepoListing, endpoint: str | None) -> dict[str, WeightHeader]:
    """The weight files' headers: read from the hub once, then kept in `.pull/`."""
    path = work / HEADERS_NAME
    try:
        return {k: WeightHeader.from_json(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    headers = weight_headers(listing, endpoint)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: h.to_json() for k, h in headers.items()}))
    os.replace(tmp, path)
    return headers


def _check_out(out: Path, repo_id: str, state: PullState | None) -> Manifest | None:
    """The finished store of `repo_id` at `out` (a pull that has nothing left to do), or
    None where the pull goes on; StoreError for a folder that is something else."""
    if (out / MANIFEST_NAME).is_file():
        manifest = load_manifest(out)
        if manifest.source.get("repo_id") == repo_id:
            shutil.rmtree(out / PULL_DIR, ignore_errors=True)  # a pull stopped after its manifest
            return manifest
        raise StoreError(f"{out} already holds an expert store (not of {repo_id}); choose another --out")
    if state is not None and state.repo_id != repo_id:
        raise StoreError(f"{out} holds an unfinished pull of {state.repo_id}; choose another --out, or remove it")
    if state is None and out.exists() and (not out.is_dir() or any(p.name != PULL_DIR for p in out.iterdir())):
        raise StoreError(
            f"{out} exists, is not empty and is no pull in progress; choose another --out (nothing was changed)"
        )
    return None


def pull_model(
    repo_id: str,
    out_dir: str | os.PathLike | None = None,
    *,
    revision: str | None = None,
    keep_source: bool = False,
    endpoint: str | None = None,
    on_event: Callable[[PullEvent], None] | None = None,
    progress: Progress | None = None,
    disk_free: Callable[[Path], int] = _disk_free,
) -> Manifest:
    """Download `repo_id` (at `revision`) and convert it into an expert store at `out_dir`
    (default: `default_store_dir`) as its weight files arrive (see the module docstring);
    returns its manifest. `keep_source`: keep the downloaded model folder beside the store
    (`STORE.source`). StoreError for a repository that is not an MoE model mlx-lm can load
    (said from its config, before anything else is downloaded), a download that fails or
    does not match the hub's hash twice, too little free disk, or an `out_dir` that holds
    something else."""
    out = Path(out_dir or default_store_dir(repo_id, revision)).expanduser().absolute()
    work = out / PULL_DIR
    done_store = _check_out(out, repo_id, PullState.load(work) if work.is_dir() else None)
    if done_store is not None:
        return done_store
    work.mkdir(parents=True, exist_ok=True)
    lock = os.open(work / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not lock_exclusive(lock, 0):
            raise StoreError(f"another pull into {out} is running: wait for it (or stop it) and pull again")
        state = PullState.load(work)
        done_store = _check_out(out, repo_id, state)  # what another pull left, now that it is done
        if done_store is not None:
            return done_store
        return _pull(repo_id, out, state, revision, keep_source, endpoint, on_event, progress, disk_free)
    finally:
        os.close(lock)


def _pull(
    repo_id: str,
    out: Path,
    state: PullState | None,
    revision: str | None,
    keep_source: bool,
    endpoint: str | None,
    on_event: Callable[[PullEvent], None] | None,
    progress: Progress | None,
    disk_free: Callable[[Path], int],
) -> Manifest:
    """`pull_model`'s work, in `out` that no other pull writes."""
    work = out / PULL_DIR
    listing = list_repo(repo_id, revision or (state.commit if state else None), endpoint)
    if state is not None and listing.commit != state.commit:
        raise StoreError(
            f"{out} holds an unfinished pull of {repo_id} at commit {state.commit}, not {listing.commit} "
            f"({revision}); pass --revision {state.commit} to finish it, or remove {out} to start again"
        )
    source = work / SOURCE_DIR
    source.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = PullState(repo_id, listing.commit)
        state.save(work)

    def present(f: Any) -> int:
        if f.name in state.placed or (source / f.name).exists():
            return f.size
        part = source / (f.name + INCOMPLETE)
        return part.stat().st_size if part.exists() else 0

    total = sum(f.size for f in listing.files)
    bar = progress or Progress(total)
    bar.start(total, sum(present(f) for f in listing.files))

    def event(kind: str, name: str) -> None:
        if on_event is not None:
            on_event(PullEvent(kind, name, bar.done, total))

    def on_bytes(n: int) -> None:
        bar.add(n)
        event("bytes", "")

    def fetch(f: Any) -> Path:
        path = source / f.name
        if not path.exists():
            bar.note = f.name
            fetch_file(listing, f, source, on_bytes, bar.say, endpoint)
            event("downloaded", f.name)
        return path

    for f in listing.small:
        fetch(f)
        if f.name == "config.json":
            check_config(source, repo_id)
    headers = _headers(work, listing, endpoint)
    layout = describe_repo(source, headers)
    tokenizer = tokenizer_files(source)
    store_bytes = layout.store_bytes(sum(p.stat().st_size for p in tokenizer))
    left = [f for f in listing.weights if f.name not in state.placed]
    if layout.direct is None:
        need = max(store_bytes - folder_bytes(out), 0) + max((f.size for f in left), default=0)
    else:
        need = store_bytes + sum(f.size - present(f) for f in left)
        bar.say(f"{repo_id}: converted once downloaded whole ({layout.direct}): the disk holds the model and the store")
    free = disk_free(out)
    if free < required_free_bytes(need):
        raise StoreError(
            f"not enough free disk space in {out}: the pull needs about {format_size(need)} more (plus a margin), "
            f"only {format_size(free)} are free; free some space or choose another --out"
        )
    source_note = {"repo_id": repo_id, "revision": listing.commit, **package_versions()}
    if layout.direct is None:
        _lay_out_files(out, layout)
        for f in left:
            path = fetch(f)
            bar.note = f"placing {f.name}"
            _place(path, headers[f.name], layout, out)
            placed = set(state.placed) | {f.name}
            for layer in layout.layers:
                key = str(layer.ordinal)
                if key not in state.crcs and layout.layer_files[layer.ordinal] <= placed:
                    state.crcs[key] = _layer_crcs(out, layer)
            state.placed.append(f.name)
            state.save(work)
            event("placed", f.name)
            if not keep_source:
                path.unlink()
                event("removed", f.name)
        manifest = _finish(out, layout, state, tokenizer, source_note, keep_source)
        install: Callable[[], None] = lambda: manifest.dump(out)  # noqa: E731
    else:
        for f in left:
            fetch(f)
        manifest = _convert_whole(out, work, source, source_note, keep_source)
        install = lambda: os.replace(work / "store" / MANIFEST_NAME, out / MANIFEST_NAME)  # noqa: E731
    bar.note = ""
    bar.finish()
    if keep_source:
        os.replace(source, _source_dir(out))
    install()  # last: a folder with a manifest is a complete store
    fsync_dir(out)
    shutil.rmtree(work)
    event("done", "")
    return manifest


def _source_dir(out: Path) -> Path:
    return out.parent / f"{out.name}.source"


def _finish(
    out: Path,
    layout: StoreLayout,
    state: PullState,
    tokenizer: list[Path],
    source_note: dict[str, Any],
    keep_source: bool,
) -> Manifest:
    """The tokenizer files, and the manifest (checked, not yet written)."""
    for src in tokenizer:
        # Moved out of the downloads (unless they are kept): no second copy on the disk.
        (shutil.copy2 if keep_source else os.replace)(src, out / src.name)
    layers = tuple(
        replace(layer, experts=tuple(replace(e, crc32=c) for e, c in zip(layer.experts, state.crcs[str(i)])))
        for i, layer in enumerate(layout.layers)
    )
    manifest = Manifest(
        model_type=layout.model_type,
        config=layout.config,
        resident_files=tuple(name for name, _ in layout.resident),
        tokenizer_files=tuple(p.name for p in tokenizer),
        layers=layers,
        source=source_note,
        store_id=new_store_id(),
    )
    manifest.validate(str(out / MANIFEST_NAME))
    for f in [*out.iterdir(), *(out / EXPERTS_DIR).iterdir()]:
        if f.is_file():
            with open(f, "rb") as fh:
                sync_fd(fh.fileno())
    fsync_dir(out / EXPERTS_DIR)
    return manifest


def _convert_whole(out: Path, work: Path, source: Path, source_note: dict[str, Any], keep_source: bool) -> Manifest:
    """`convert` of the downloaded folder into `work`, its files then moved into `out`
    but the manifest (the caller's last step); the downloads go unless kept."""
    store = work / "store"
    if store.exists():
        shutil.rmtree(store)  # a stopped conversion's
    manifest = convert_model(source, store, source=source_note)
    if not keep_source:
        for f in source.iterdir():
            f.unlink()
    for f in store.iterdir():
        if f.name != MANIFEST_NAME:
            os.replace(f, out / f.name)
    return manifest
