"""Writing out a trained demo model: float and 4-bit mlx-lm folders (the MTP head in its
own file), the expert store, and sample text from the saved 4-bit model."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_map_with_path

from demo_recipe.data import tokenizer_file_names
from demo_recipe.model import DemoShape
from moestream.daemon.model.demo_mtp import MTP_FILE, MTP_PREFIX, MTPHead

SAMPLE_PROMPT = "def fibonacci(n):"


def save_mtp(
    path: str | Path,
    head: MTPHead,
    *,
    model_config: dict[str, Any],
    intermediate_size: int,
    quantization: dict[str, int] | None,
) -> None:
    """Write `head` to `path` with what `load_mtp` needs in the metadata."""
    config = {k: v for k, v in model_config.items() if k not in ("quantization", "quantization_config")}
    meta = {"model_config": config, "intermediate_size": intermediate_size, "quantization": quantization}
    weights = {MTP_PREFIX + k: v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx", "moestream_mtp": json.dumps(meta)})


def quantize_mtp(head: MTPHead, *, group_size: int, bits: int) -> dict[str, int]:
    """Quantize the head's linear layers in place (those whose input splits into
    groups); return the quantization to record."""
    nn.quantize(
        head,
        group_size,
        bits,
        class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % group_size == 0,
    )
    return {"group_size": group_size, "bits": bits}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in tokenizer_file_names():
        shutil.copy2(src / name, dst / name)


def _cast(module: nn.Module, dtype: mx.Dtype) -> None:
    module.update(
        tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a, module.parameters())
    )


def save_float(
    lm: nn.Module, head: MTPHead, config: dict[str, Any], shape: DemoShape, tokenizer_dir: Path, folder: Path
) -> None:
    """An mlx-lm model folder with the weights as they are (float32 after training)."""
    from mlx_lm.utils import save_config, save_model

    save_model(folder, lm)
    save_config(dict(config), folder / "config.json")
    _copy_tokenizer(tokenizer_dir, folder)
    save_mtp(
        folder / MTP_FILE, head, model_config=config, intermediate_size=shape.mtp_intermediate_size, quantization=None
    )


def _float32_outside_experts(lm: nn.Module) -> None:
    """The resident weights (embedding, attention, dense MLP, norms, routers, and the
    scales of their quantized matrices) back to float32 after quantizing: their values
    stay bfloat16's, so the model is the same, but it then computes in float32, which
    MLX's CPU build runs about 7x faster than bfloat16 (a 572-token prefill: 14 s against
    2.3 s). The experts keep bfloat16 scales: float32 would double their store stride."""
    lm.update(
        tree_map_with_path(
            lambda path, a: a.astype(mx.float32) if a.dtype == mx.bfloat16 and "switch_mlp" not in path else a,
            lm.parameters(),
        )
    )


def save_quantized(
    lm: nn.Module, head: MTPHead, config: dict[str, Any], shape: DemoShape, tokenizer_dir: Path, folder: Path
) -> None:
    """Cast to bfloat16 and quantize (as mlx-community ships models), the resident
    weights then kept in float32 (`_float32_outside_experts`), and save.

    Changes `lm` and `head` in place: call it after everything that needs the float model.
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    _cast(lm, mx.bfloat16)
    _cast(head, mx.bfloat16)
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits per weight
        lm, qconfig = quantize_model(lm, dict(config), shape.group_size, shape.bits, mode="affine")
    _float32_outside_experts(lm)
    quant = quantize_mtp(head, group_size=shape.group_size, bits=shape.bits)
    save_model(folder, lm)
    save_config(qconfig, folder / "config.json")
    _copy_tokenizer(tokenizer_dir, folder)
    save_mtp(
        folder / MTP_FILE, head, model_config=config, intermediate_size=shape.mtp_intermediate_size, quantization=quant
    )


def folder_bytes(folder: Path) -> int:
    """Bytes of every file under `folder`."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def make_store(model_dir: Path, store_dir: Path) -> dict[str, int]:
    """`moestreamctl convert` of `model_dir` into `store_dir`, with the MTP head copied
    beside it; returns {"store", "mtp", "total"} in bytes."""
    from moestream.daemon.store.convert import convert_model

    convert_model(model_dir, store_dir, force=True)
    shutil.copy2(model_dir / MTP_FILE, store_dir / MTP_FILE)
    total = folder_bytes(store_dir)
    mtp = (store_dir / MTP_FILE).stat().st_size
    return {"store": total - mtp, "mtp": mtp, "total": total}


def sample_text(model_dir: Path, *, seed: int, max_tokens: int, prompt: str = SAMPLE_PROMPT) -> dict[str, str]:
    """Greedy and sampled (temperature 0.7, top-p 0.95) continuations of `prompt` by
    the model saved in `model_dir`, loaded with stock mlx-lm."""
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(model_dir))
    greedy = generate(model, tokenizer, prompt, max_tokens=max_tokens)
    mx.random.seed(seed)
    sampled = generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp=0.7, top_p=0.95))
    return {"prompt": prompt, "greedy": greedy, "sampled_t0.7": sampled}
