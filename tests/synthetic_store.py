"""Synthetic expert stores: valid layout, random bytes, no MLX.

`make_synthetic_store` writes a store that `shared/store_format` accepts (manifest,
per-layer expert files with each expert at `e * stride`, padded, zlib CRC-32s), with
random tensor bytes, so that the read engine and its benchmark can be exercised on
stores of any size in seconds. The bytes are not a model: do not run one on them.

`tensor_bytes` and `expert_block` read the bytes back with plain Python file reads,
for comparisons that do not trust the engine.

Also usable as a script, for benchmarks:
    python tests/synthetic_store.py OUT_DIR --layers 48 --experts 16 --preset qwen3-30b-a3b-4bit
"""

from __future__ import annotations

import argparse
import os
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

from moestream.shared.store_format import (
    DTYPE_SIZES,
    EXPERT_ALIGN,
    EXPERTS_DIR,
    TENSOR_ALIGN,
    ExpertEntry,
    Manifest,
    MoELayer,
    TensorSpec,
    align_up,
    load_manifest,
)

TensorDef = tuple[str, str, tuple[int, ...]]

# A small 4-bit SwitchGLU (hidden 128, intermediate 64, group size 64): ~13 KiB/expert.
SMALL_TENSORS: tuple[TensorDef, ...] = (
    ("gate_proj.weight", "uint32", (64, 16)),
    ("gate_proj.scales", "float16", (64, 2)),
    ("gate_proj.biases", "float16", (64, 2)),
    ("up_proj.weight", "uint32", (64, 16)),
    ("up_proj.scales", "float16", (64, 2)),
    ("up_proj.biases", "float16", (64, 2)),
    ("down_proj.weight", "uint32", (128, 8)),
    ("down_proj.scales", "float16", (128, 1)),
    ("down_proj.biases", "float16", (128, 1)),
)

# The expert of Qwen3-30B-A3B at 4 bits (hidden 2048, moe intermediate 768, group
# size 64, bf16 scales/biases): 2,654,208 bytes, a multiple of EXPERT_ALIGN.
QWEN3_30B_A3B_4BIT_TENSORS: tuple[TensorDef, ...] = (
    ("gate_proj.weight", "uint32", (768, 256)),
    ("gate_proj.scales", "bfloat16", (768, 32)),
    ("gate_proj.biases", "bfloat16", (768, 32)),
    ("up_proj.weight", "uint32", (768, 256)),
    ("up_proj.scales", "bfloat16", (768, 32)),
    ("up_proj.biases", "bfloat16", (768, 32)),
    ("down_proj.weight", "uint32", (2048, 96)),
    ("down_proj.scales", "bfloat16", (2048, 12)),
    ("down_proj.biases", "bfloat16", (2048, 12)),
)

PRESETS = {"small": SMALL_TENSORS, "qwen3-30b-a3b-4bit": QWEN3_30B_A3B_4BIT_TENSORS}


def _tensor_specs(tensors: Sequence[TensorDef]) -> tuple[TensorSpec, ...]:
    specs = []
    offset = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPE_SIZES:
            raise ValueError(f"tensor {name}: unknown dtype {dtype!r} (one of {sorted(DTYPE_SIZES)})")
        count = 1
        for s in shape:
            count *= int(s)
        nbytes = count * DTYPE_SIZES[dtype]
        offset = align_up(offset, TENSOR_ALIGN)
        specs.append(
            TensorSpec(name=name, dtype=dtype, shape=tuple(int(s) for s in shape), offset=offset, nbytes=nbytes)
        )
        offset += nbytes
    return tuple(specs)


def make_synthetic_store(
    path: str | os.PathLike,
    *,
    layers: int = 2,
    experts: int = 8,
    tensors: Sequence[TensorDef] = SMALL_TENSORS,
    seed: int = 0,
) -> Manifest:
    """Write a store of `layers` MoE layers with `experts` random experts each at `path`
    (created; must not hold a store already) and return its manifest."""
    if layers < 1 or experts < 1 or not tensors:
        raise ValueError("a synthetic store needs at least one layer, one expert and one tensor")
    store = Path(path)
    (store / EXPERTS_DIR).mkdir(parents=True, exist_ok=True)
    specs = _tensor_specs(tensors)
    expert_bytes = specs[-1].offset + specs[-1].nbytes
    stride = align_up(expert_bytes, EXPERT_ALIGN)
    rng = np.random.default_rng(seed)
    projections = [t.name.rsplit(".", 1)[0] for t in specs]
    quantized = {p for p, t in zip(projections, specs) if t.name.endswith(".scales")}
    quantization = {
        p: ({"group_size": 64, "bits": 4, "mode": "affine"} if p in quantized else None) for p in projections
    }
    moe_layers = []
    for ordinal in range(layers):
        rel = f"{EXPERTS_DIR}/layer_{ordinal:03d}.bin"
        entries = []
        with open(store / rel, "wb") as f:
            for e in range(experts):
                block = bytearray(stride)
                for t in specs:
                    block[t.offset : t.offset + t.nbytes] = rng.bytes(t.nbytes)
                payload = memoryview(block)[:expert_bytes]
                entries.append(ExpertEntry(offset=e * stride, length=expert_bytes, crc32=zlib.crc32(payload)))
                f.write(block)
        moe_layers.append(
            MoELayer(
                ordinal=ordinal,
                module_path=f"model.layers.{ordinal}.mlp.switch_mlp",
                kind="SwitchGLU",
                num_experts=experts,
                file=rel,
                stride=stride,
                tensors=specs,
                experts=tuple(entries),
                quantization=quantization,
            )
        )
    manifest = Manifest(
        model_type="synthetic",
        config={"model_type": "synthetic", "num_experts": experts, "num_hidden_layers": layers},
        resident_files=(),
        tokenizer_files=(),
        layers=tuple(moe_layers),
        source={"synthetic": True, "seed": seed},
    )
    manifest.validate(str(store))
    manifest.dump(store)
    return manifest


def _layer(store: str | os.PathLike, layer: int) -> tuple[Path, MoELayer]:
    folder = Path(store)
    return folder, load_manifest(folder).layers[layer]


def expert_block(store: str | os.PathLike, layer: int, expert: int) -> bytes:
    """The `length` meaningful bytes of one expert block, read with plain file reads."""
    folder, moe = _layer(store, layer)
    entry = moe.experts[expert]
    with open(folder / moe.file, "rb") as f:
        f.seek(entry.offset)
        data = f.read(entry.length)
    if len(data) != entry.length:
        raise ValueError(f"{folder / moe.file}: expert {expert} is cut short ({len(data)} of {entry.length} bytes)")
    return data


def tensor_spec(layer: MoELayer, name: str) -> TensorSpec:
    """The spec of the per-expert tensor `name` (`gate_proj.scales`) of `layer`."""
    return next(t for t in layer.tensors if t.name == name)


def tensor_bytes(store: str | os.PathLike, layer: int, expert: int, tensor_name: str) -> bytes:
    """The original bytes of one tensor of one expert (`layer` is the MoE ordinal)."""
    folder, moe = _layer(store, layer)
    spec = tensor_spec(moe, tensor_name)
    entry = moe.experts[expert]
    with open(folder / moe.file, "rb") as f:
        f.seek(entry.offset + spec.offset)
        data = f.read(spec.nbytes)
    if len(data) != spec.nbytes:
        raise ValueError(f"{folder / moe.file}: tensor {tensor_name} of expert {expert} is cut short")
    return data


def _main() -> None:
    p = argparse.ArgumentParser(description="Write a synthetic expert store (random bytes).")
    p.add_argument("out")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    m = make_synthetic_store(a.out, layers=a.layers, experts=a.experts, tensors=PRESETS[a.preset], seed=a.seed)
    total = sum(layer.stride * layer.num_experts for layer in m.layers)
    print(
        f"{a.out}: {len(m.layers)} layers x {a.experts} experts of {m.layers[0].expert_bytes} bytes, "
        f"{total / 2**30:.2f} GiB"
    )


if __name__ == "__main__":
    _main()
