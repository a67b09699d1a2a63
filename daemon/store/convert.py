"""`moestreamctl convert`: an mlx-lm model folder -> an expert store.

The model is opened with mlx-lm's own loader (`load_model(lazy=True)`), so weights are
sanitized and quantized exactly as stock mlx-lm would (kimi_vl's, which stock mlx-lm
cannot load, with its attention split as mlx-lm's deepseek_v3 splits it); nothing is
read until a tensor is evaluated. The stacked expert tensors are then written one MoE
layer at a time and dropped, and the resident weights go out in bounded files, so memory
stays near one layer whatever the model's size.

The store is built in a hidden sibling folder and renamed into place at the end: an
interrupted convert leaves no half store behind, and a later run cleans up after it.
"""

from __future__ import annotations

import glob
import os
import shutil
import zlib
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ...shared.durable import fsync_dir, sync_fd, sync_file
from ...shared.runtime_dir import pid_alive
from ...shared.settings import format_size
from ...shared.store_format import (
    ABSENT,
    EXPERTS_DIR,
    MANIFEST_NAME,
    ExpertEntry,
    Manifest,
    MoELayer,
    StoreError,
    new_store_id,
)
from .layout import SwitchLayer, find_switch_layers
from .source import check_model_dir, tokenizer_files

# progress(bytes_written, bytes_total)
ProgressFn = Callable[[int, int], None]
# disk_free(folder) -> free bytes on the file system holding folder
DiskFreeFn = Callable[[Path], int]

RESIDENT_SHARD_BYTES = 2 << 30
VISION_FILE = "vision.safetensors"
RESIDENT_METADATA = {"format": "mlx"}
DISK_MARGIN_BYTES = 64 << 20
DISK_MARGIN_FRACTION = 0.02
_PARTIAL = ".partial-"
_REPLACED = ".replaced-"


def _disk_free(folder: Path) -> int:
    return shutil.disk_usage(folder).free


def _package_version(name: str) -> str | None:
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _remove_stale_partials(out_dir: Path) -> None:
    """Remove what an interrupted convert into `out_dir` left behind (its process is gone)."""
    for kind in (_PARTIAL, _REPLACED):
        for p in out_dir.parent.glob(f".{glob.escape(out_dir.name)}{kind}*"):
            pid_text = p.name.rsplit("-", 1)[-1]
            if pid_text.isdigit() and not pid_alive(int(pid_text)):
                shutil.rmtree(p)


def _check_destination(out_dir: Path, force: bool) -> None:
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise StoreError(f"{out_dir} exists and is not a folder; choose another --out")
    if (out_dir / MANIFEST_NAME).is_file():
        if not force:
            raise StoreError(f"{out_dir} already holds an expert store; pass --force to replace it")
        return
    if any(out_dir.iterdir()):
        # --force replaces stores, never an unrelated folder that happens to be named.
        raise StoreError(
            f"{out_dir} exists, is not empty and is not an expert store; choose another --out (nothing was changed)"
        )


def _to_bytes_view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated array with the same bytes (bfloat16 included)."""
    unsigned = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[a.itemsize]
    return np.ascontiguousarray(np.asarray(a.view(unsigned)))


def _write_layer(
    layer: SwitchLayer, path: Path, advance: Callable[[int], None], shard: tuple[int, int] | None = None
) -> list[ExpertEntry]:
    """Write every expert block of `layer` to `path` (of a `shard` (i, N), only the experts
    e % N == i, back to back); return offsets, lengths, CRCs (ABSENT, CRC 0 for the others)."""
    mx.eval(*layer.arrays)
    views = [_to_bytes_view(a) for a in layer.arrays]
    length = layer.expert_bytes
    # Tensors land at the same offsets in every block, so one buffer serves all experts
    # and its padding stays zero.
    block = bytearray(layer.stride)
    entries = []
    with open(path, "wb") as f:
        for e in range(layer.num_experts):
            if shard is not None and e % shard[1] != shard[0]:
                entries.append(ExpertEntry(offset=ABSENT, length=length, crc32=0))
                continue
            for spec, view in zip(layer.specs, views):
                block[spec.offset : spec.offset + spec.nbytes] = memoryview(view[e]).cast("B")
            offset = e * layer.stride if shard is None else e // shard[1] * layer.stride
            entries.append(ExpertEntry(offset=offset, length=length, crc32=zlib.crc32(memoryview(block)[:length])))
            f.write(block)
            advance(layer.stride)
        sync_file(f)
    layer.arrays.clear()  # the only references left: free this layer before the next
    return entries


def _write_resident(
    items: list[tuple[str, mx.array]], folder: Path, shard_bytes: int, advance: Callable[[int], None]
) -> list[str]:
    """Save resident weights into files of at most `shard_bytes` (one tensor may exceed it)."""
    shards = [[items[i] for i in group] for group in resident_groups([a.nbytes for _, a in items], shard_bytes)]
    items.clear()
    names = []
    for i in range(len(shards)):
        shard = dict(shards[i])
        shards[i] = []
        name = resident_file_name(i)
        mx.save_safetensors(str(folder / name), shard, metadata=RESIDENT_METADATA)
        advance(sum(a.nbytes for a in shard.values()))
        del shard
        names.append(name)
    return names


def layer_file_bytes(layer: SwitchLayer, shard: tuple[int, int] | None = None) -> int:
    """Bytes of the layer's file: every expert's block, or those of a `shard` (i, N)."""
    if shard is None:
        return layer.file_bytes
    return len(range(shard[0], layer.num_experts, shard[1])) * layer.stride


def estimate_store_bytes(
    layers: list[SwitchLayer], resident_bytes: int, extra_files: list[Path], shard: tuple[int, int] | None = None
) -> int:
    """Bytes the store will take: expert files, resident weights, copied files."""
    experts = sum(layer_file_bytes(layer, shard) for layer in layers)
    return experts + resident_bytes + sum(p.stat().st_size for p in extra_files)


def required_free_bytes(estimate: int) -> int:
    """Free space to insist on: the estimate plus a margin for headers and the FS."""
    return estimate + int(estimate * DISK_MARGIN_FRACTION) + DISK_MARGIN_BYTES


# sanitize_input(weights): shown the tensors mlx-lm read, before the model's sanitize.
SanitizeInputFn = Callable[[dict[str, mx.array]], None]


def _load(model_dir: Path, mtp_sink: dict[str, mx.array], sanitize_input: SanitizeInputFn | None = None):
    from mlx_lm.utils import load_model

    from ..model.mtp_head import classes_keeping_mtp

    get = _splitting_kimi_vl_attention(classes_keeping_mtp(mtp_sink))
    if sanitize_input is not None:
        get = _showing_sanitize_input(get, sanitize_input)
    try:
        return load_model(model_dir, lazy=True, get_model_classes=get)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as e:
        raise StoreError(f"{model_dir}: mlx-lm cannot load this model ({type(e).__name__}: {e})") from e


def _showing_sanitize_input(get: Callable, sanitize_input: SanitizeInputFn) -> Callable:
    """`get` (a `get_model_classes`) whose model shows `sanitize_input` the weights as
    read, then sanitizes them as its own class does (or keeps them, where it has no sanitize)."""

    def classes(config: dict) -> tuple[type, type]:
        model_class, args_class = get(config)

        class Shown(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                sanitize_input(weights)
                own = getattr(super(), "sanitize", None)
                return own(weights) if own is not None else weights

        Shown.__name__ = model_class.__name__
        return Shown, args_class

    return classes


def _splitting_kimi_vl_attention(get: Callable) -> Callable:
    """`get` (a `get_model_classes`) whose kimi_vl model, after its own sanitize, splits
    each attention's `kv_b_proj` into the `embed_q` and `unembed_out` its layers hold, by
    mlx-lm's deepseek_v3 sanitize. kimi_vl's language model is mlx-lm's DeepseekV3Model,
    but its sanitize only stacks the experts: stock mlx-lm refuses a Kimi-VL checkpoint,
    whose attention keeps `kv_b_proj` (mlx-lm 0.32, its main branch as of August 2026)."""

    def classes(config: dict) -> tuple[type, type]:
        model_class, args_class = get(config)
        if config.get("model_type") != "kimi_vl":
            return model_class, args_class

        class SplitAttention(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                from types import SimpleNamespace

                from mlx_lm.models import deepseek_v3

                weights = super().sanitize(weights)
                prefix = "language_model."
                attention = [k for k in weights if k.startswith(prefix) and ".self_attn.kv_b_proj." in k]
                if attention:
                    text = SimpleNamespace(args=self.args.text_config)
                    split = deepseek_v3.Model.sanitize(text, {k[len(prefix) :]: weights.pop(k) for k in attention})
                    weights.update((prefix + k, v) for k, v in split.items())
                return weights

        SplitAttention.__name__ = model_class.__name__
        return SplitAttention, args_class

    return classes


def vision_weights(
    model_dir: Path, config: dict[str, Any], resident: list[tuple[str, mx.array]], layers: list[SwitchLayer]
) -> list[tuple[str, mx.array]]:
    """The weights a vision-language model (its config has a `vision_config`) needs beside
    mlx-lm's `resident` ones and its experts, as stock mlx-vlm loads them (sanitized,
    quantized where the folder is), lazily: the vision tower and projector, and those of
    mlx-vlm's language model that mlx-lm holds in other weights (the MLA attention of
    kimi_vl and of mistral3's Mistral 4 keeps `kv_b_proj`, which the mlx-lm model holds
    split in two, `embed_q` and `unembed_out`). The vision side runs on
    these and shares the rest of the language model with the streamed one.

    Empty, and the store takes no images, for a text-only model, one mlx-vlm does not
    know, or one the vision side cannot share the streamed model with: a weight both
    name but hold in another shape or dtype, or one mlx-vlm needs inside a module the
    expert store holds (its experts in a layout other than mlx-lm's), or one whose
    experts are not where the store's are: at load, mlx-vlm's modules at the store's
    module paths are wrapped on the pools, so its model must name every expert tensor
    the store streams as mlx-lm does. deepseek_v41's is a model of its own (mlx-vlm
    keeps the checkpoint's names, its experts at `ffn.switch_mlp` where mlx-lm's are at
    `mlp.experts.switch_mlp`): without this check its whole language model went into the
    vision file, and the store then failed to load."""
    if not config.get("vision_config"):
        return []
    from mlx_vlm.utils import load_model as load_vlm

    try:
        model = load_vlm(model_dir, lazy=True)
    except (ValueError, KeyError, TypeError, ImportError, FileNotFoundError):
        return []
    flat = tree_flatten(model.parameters())
    experts = {n for layer in layers for n in layer.parameter_names()}
    if not experts <= {n for n, _ in flat}:
        return []
    streamed = tuple(f"{layer.module_path}." for layer in layers)
    shared = dict(resident)
    own = []
    for n, a in flat:
        if not n.startswith("language_model."):
            own.append((n, a))
        elif n in shared:
            if shared[n].shape != a.shape or shared[n].dtype != a.dtype:
                return []
        elif n not in experts:
            if n.startswith(streamed):
                return []
            own.append((n, a))
    return own


@dataclass
class ModelParts:
    """A model opened lazily for conversion: its stacked experts and resident weights."""

    model_type: str
    config: dict[str, Any]
    layers: list[SwitchLayer]
    resident: list[tuple[str, mx.array]]
    mtp: dict[str, mx.array]  # mtp.* tensors, which stock mlx-lm drops


def open_model(model_dir: Path, sanitize_input: SanitizeInputFn | None = None) -> ModelParts:
    """The MoE layers and resident weights of the mlx-lm model in `model_dir`, as mlx-lm
    loads it (nothing read yet); the model's own references dropped, so that each tensor
    is freed once written. StoreError for a model mlx-lm cannot load or without experts."""
    mtp: dict[str, mx.array] = {}
    model, config = _load(model_dir, mtp, sanitize_input)
    model_type = str(config.get("model_type", "model"))
    layers = find_switch_layers(model, model_type)
    expert_names = {n for layer in layers for n in layer.parameter_names()}
    flat = tree_flatten(model.parameters())
    resident = [(n, a) for n, a in flat if n not in expert_names]
    if len(flat) - len(resident) != len(expert_names):
        raise StoreError(f"{model_dir}: expert tensors are not all model parameters; this layout is not supported")
    del flat
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    return ModelParts(model_type, config, layers, resident, mtp)


def moe_layer(ordinal: int, layer: SwitchLayer, entries: list[ExpertEntry]) -> MoELayer:
    """The manifest's record of `layer`, the `ordinal`-th, whose experts lie at `entries`."""
    return MoELayer(
        ordinal=ordinal,
        module_path=layer.module_path,
        kind=layer.kind,
        num_experts=layer.num_experts,
        file=layer_file_name(ordinal),
        stride=layer.stride,
        tensors=layer.specs,
        experts=tuple(entries),
        quantization=layer.quantization,
    )


def layer_file_name(ordinal: int) -> str:
    return f"{EXPERTS_DIR}/layer_{ordinal:03d}.bin"


def resident_groups(sizes: list[int], shard_bytes: int) -> list[list[int]]:
    """The resident tensors (by their `sizes`, in order) of each resident file: files of at
    most `shard_bytes`, one tensor may exceed it."""
    groups: list[list[int]] = []
    size = 0
    for i, n in enumerate(sizes):
        if not groups or (size + n > shard_bytes and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def resident_file_name(i: int) -> str:
    return f"resident-{i + 1:05d}.safetensors"


def package_versions() -> dict[str, str | None]:
    return {"mlx_lm": _package_version("mlx-lm"), "mlx": _package_version("mlx")}


def convert_model(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    force: bool = False,
    progress: ProgressFn | None = None,
    disk_free: DiskFreeFn = _disk_free,
    resident_shard_bytes: int = RESIDENT_SHARD_BYTES,
    shard: tuple[int, int] | None = None,
    source: dict[str, Any] | None = None,
) -> Manifest:
    """Convert the mlx-lm model in `model_dir` into an expert store at `out_dir`.

    Refuses (StoreError) a model with no MoE layers or an unknown expert layout, missing
    or truncated weight files, an existing store unless `force`, and a destination
    without enough free space (as reported by `disk_free`). `progress` is called with
    (bytes written, bytes total) as the store is written. A Qwen3-Next checkpoint's
    `mtp.*` tensors, which stock mlx-lm drops, go to the store's `mtp.safetensors`
    (daemon/model/mtp_head.py).

    `shard` (i, N): a shard store for rank i of an expert-parallel group of N, holding only
    the experts e % N == i of every layer (shared/store_format.py); the rest as a whole store.
    `source`: the manifest's note of where the model came from (default: `model_dir`).
    """
    if shard is not None and not (shard[1] >= 2 and 0 <= shard[0] < shard[1]):
        raise StoreError(f"--shard {shard[0]}/{shard[1]}: give i/N with N at least 2 and i in 0..N-1")
    model_dir = Path(model_dir).expanduser().resolve()
    out_dir = Path(out_dir).expanduser().absolute()
    check_model_dir(model_dir)
    _check_destination(out_dir, force)
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        why = f"{e.filename} is not a folder" if isinstance(e, FileExistsError) else f"{e.filename}: {e.strerror or e}"
        raise StoreError(f"cannot make the store {out_dir}: {why}; choose another --out") from e
    _remove_stale_partials(out_dir)

    parts = open_model(model_dir)
    model_type, config, layers, resident, mtp = parts.model_type, parts.config, parts.layers, parts.resident, parts.mtp
    del parts
    if shard is not None and any(layer.num_experts < shard[1] for layer in layers):
        raise StoreError(f"{model_dir}: a layer has fewer experts than the {shard[1]} shards of --shard")

    copied = tokenizer_files(model_dir)
    vision = vision_weights(model_dir, config, resident, layers) if shard is None else []
    resident_bytes = sum(a.nbytes for _, a in resident) + sum(a.nbytes for _, a in vision)
    estimate = estimate_store_bytes(layers, resident_bytes + sum(a.nbytes for a in mtp.values()), copied, shard)
    free = disk_free(out_dir.parent)
    if free < required_free_bytes(estimate):
        raise StoreError(
            f"not enough free disk space in {out_dir.parent}: the store needs about "
            f"{format_size(estimate)} (plus a margin), only {format_size(free)} are free; "
            "free some space or choose another --out"
        )

    total = sum(layer_file_bytes(layer, shard) for layer in layers) + resident_bytes
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, total)

    tmp = out_dir.parent / f".{out_dir.name}{_PARTIAL}{os.getpid()}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise StoreError(f"cannot write the store {out_dir}: {e.strerror or e}") from e
    try:
        (tmp / EXPERTS_DIR).mkdir()
        moe_layers = []
        for ordinal, layer in enumerate(layers):
            entries = _write_layer(layer, tmp / layer_file_name(ordinal), advance, shard)
            moe_layers.append(moe_layer(ordinal, layer, entries))
        resident_files = _write_resident(resident, tmp, resident_shard_bytes, advance)
        if vision:
            mx.save_safetensors(str(tmp / VISION_FILE), dict(vision), metadata=RESIDENT_METADATA)
            advance(sum(a.nbytes for _, a in vision))
            # The model's processor (Hugging Face's AutoProcessor) finds its classes by
            # the config's model_type, which it reads from config.json beside its files.
            shutil.copy2(model_dir / "config.json", tmp / "config.json")
            copied.append(model_dir / "config.json")
        for src in copied:
            shutil.copy2(src, tmp / src.name)
        if mtp:
            from ..model.mtp_head import MTP_FILE, save_qwen3_next_mtp

            save_qwen3_next_mtp(tmp / MTP_FILE, mtp)
            mtp.clear()
        manifest = Manifest(
            model_type=model_type,
            config=config,
            resident_files=tuple(resident_files),
            tokenizer_files=tuple(p.name for p in copied),
            layers=tuple(moe_layers),
            source=source if source is not None else {"model_dir": str(model_dir), **package_versions()},
            store_id=new_store_id(),
            shard=shard,
            vision_files=(VISION_FILE,) if vision else (),
        )
        manifest.validate(str(tmp / MANIFEST_NAME))
        for f in [*tmp.iterdir(), *(tmp / EXPERTS_DIR).iterdir()]:
            if f.is_file() and f.suffix != ".bin":  # layer files were synced as written
                with open(f, "rb") as fh:
                    sync_fd(fh.fileno())
        fsync_dir(tmp / EXPERTS_DIR)
        manifest.dump(tmp)  # last, so a folder with a manifest is a complete store
        _install(tmp, out_dir)
    except BaseException as exc:
        note = None
        try:
            shutil.rmtree(tmp)
        except OSError as cleanup:
            note = f"could not remove the partial store {tmp}: {cleanup}; delete it by hand"
        if isinstance(exc, OSError):
            # A full or read-only disk, say: one line that names the store, not its partial folder.
            where = str(exc.filename).replace(str(tmp), str(out_dir)) if exc.filename else str(out_dir)
            error = StoreError(
                f"cannot write the store {out_dir}: {where}: {exc.strerror or exc}" + (f"; {note}" if note else "")
            )
            raise error from exc
        if note:
            exc.add_note(note)
        raise
    return manifest


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the finished store into place, replacing an old one only once it is complete."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}{_REPLACED}{os.getpid()}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    if old is not None:
        shutil.rmtree(old)
