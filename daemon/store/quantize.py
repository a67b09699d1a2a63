"""Quantizing a module as mlx-lm's loading does, from the weights it will load (the
streamed model's resident part, and an MTP head's)."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.utils import infer_quant_config


def quantize_like_weights(
    module: nn.Module, quantization: dict[str, Any], weights: dict[str, mx.array], fixed: dict[str, Any] | None = None
) -> None:
    """Quantize `module` the way mlx-lm's loading does: a layer is quantized where the
    weights carry its scales, with the group size and bits they imply; `fixed` maps paths
    to a given quantization (or False) first."""
    fixed = fixed or {}

    def predicate(path: str, m: nn.Module) -> bool | dict[str, Any]:
        if path in fixed:
            return fixed[path]
        if not hasattr(m, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, m, weights)

    nn.quantize(
        module,
        group_size=quantization["group_size"],
        bits=quantization["bits"],
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )
