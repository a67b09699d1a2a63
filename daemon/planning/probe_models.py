"""The models the plan's probes time: a real model's config cut to a few layers and at most
PROBE_MAX_EXPERTS experts, built by mlx-lm with random weights in the store's dtype
(the plan's compute probe, the pool probes, and the GPU probes under tests/bench)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from ...shared.store_format import Manifest
from ..pool.capacity import EXPERT_COUNT_KEYS, layer_count_key, top_k_of


def config_with_layers(config: dict[str, Any], n: int) -> dict[str, Any]:
    """The config of the same model with only its first `n` layers: per-layer lists
    (layer types, sparse steps) cut to `n` too."""
    out = copy.deepcopy(config)
    for cfg in (out, out.get("text_config")):
        key = layer_count_key(cfg) if isinstance(cfg, dict) else None
        if key is None:
            continue
        total = int(cfg[key])
        cfg[key] = n
        for key, value in list(cfg.items()):
            if isinstance(value, list) and len(value) == total and key != "mlp_only_layers":
                cfg[key] = value[:n]
    return out


# At most this many experts per layer in the probe's models: a decode token computes its
# top-k whatever the count, while the count sets the memory (a 512-expert layer of
# Qwen3.5-397B is about 3.6 GB at 4 bits, too much to make several of before loading on a 48 GB
# machine). A multiple of the router's groups where it has them (DeepSeek's n_group).
PROBE_MAX_EXPERTS = 64


def probe_config(config: dict[str, Any], layers: int) -> dict[str, Any]:
    """The config of a probe model: the first `layers` layers, at most PROBE_MAX_EXPERTS
    experts per layer (never fewer than twice the top-k)."""
    out = config_with_layers(config, layers)
    wanted = max(PROBE_MAX_EXPERTS, 2 * top_k_of(config))
    for cfg in (out, out.get("text_config")):
        if not isinstance(cfg, dict):
            continue
        groups = int(cfg.get("n_group") or 1)
        fewer = -(-wanted // groups) * groups
        for key in EXPERT_COUNT_KEYS:
            count = cfg.get(key)
            if isinstance(count, int) and not isinstance(count, bool) and count > PROBE_MAX_EXPERTS:
                cfg[key] = min(count, fewer)
    return out


def resident_dtype(store: Path, manifest: Manifest) -> str:
    """The floating-point dtype that most of the resident weights are stored in, from the
    safetensors headers alone (the compute of bfloat16 and float32 differ by 2x or more on
    a CPU)."""
    sizes: dict[str, int] = {}
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    for name in manifest.resident_files:
        with open(store / name, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for key, info in header.items():
            if key != "__metadata__" and info["dtype"] in names:
                begin, end = info["data_offsets"]
                sizes[names[info["dtype"]]] = sizes.get(names[info["dtype"]], 0) + end - begin
    return dominant_dtype(sizes)


def dominant_dtype(sizes: dict[str, int]) -> str:
    """Of resident weights' bytes by dtype ("bfloat16": n), the floating-point dtype that
    holds the most (float32 where none does)."""
    floats = {k: v for k, v in sizes.items() if k in ("bfloat16", "float16", "float32")}
    return max(floats, key=floats.__getitem__) if floats else "float32"


def random_model(config: dict[str, Any], dtype: str, embed_scale: float = 1.0) -> Any:
    """mlx-lm's model of `config` with its own random initialisation, quantized as the
    config says. `embed_scale` multiplies the token embeddings first (as
    tests/bench/make_random_moe.py does), so that routing varies from token to token as a
    trained model's does; at 1 nearly every token routes to the same experts."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if embed_scale != 1.0:
        embed = model.model.embed_tokens
        embed.update({"weight": embed.weight * embed_scale})
    model.set_dtype(getattr(mx, dtype))
    q = config.get("quantization")
    if q:
        fixed = {k: v for k, v in q.items() if isinstance(v, (dict, bool))}

        def predicate(path: str, m: Any) -> Any:
            if path in fixed:
                return fixed[path]
            weight = getattr(m, "weight", None)
            return hasattr(m, "to_quantized") and weight is not None and weight.shape[-1] % q["group_size"] == 0

        nn.quantize(
            model, group_size=q["group_size"], bits=q["bits"], mode=q.get("mode", "affine"), class_predicate=predicate
        )
    mx.eval(model.parameters())
    return model
