"""The demo model's multi-token-prediction (MTP) head, in the style of DeepSeek-V3 and
Qwen3-Next: from the main model's final (normed) hidden state at position t and the
embedding of token t+1, predict token t+2.

    z = proj([hnorm(h_t); enorm(embed(x_{t+1}))])  ->  one decoder block (dense MLP)
      ->  norm  ->  the main model's shared output head

Stock mlx-lm drops `mtp.*` weights, so the head lives in its own `mtp.safetensors`
beside the model files; the file's metadata holds the model config and the head's
quantization, so `load_mtp` needs nothing else.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_moe import ModelArgs, Qwen3MoeDecoderLayer

MTP_FILE = "mtp.safetensors"
MTP_PREFIX = "mtp."


class MTPHead(nn.Module):
    """One MTP depth; returns normed hidden states for the shared output head."""

    def __init__(self, args: ModelArgs, intermediate_size: int):
        super().__init__()
        dim = args.hidden_size
        self.hnorm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.enorm = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        # Layer 0 listed in mlp_only_layers: the block gets a dense MLP, not experts.
        block_args = replace(args, intermediate_size=intermediate_size, mlp_only_layers=[0])
        self.block = Qwen3MoeDecoderLayer(block_args, layer_idx=0)
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        """hidden: [B, L, D] main-model states at positions t; next_embeddings: [B, L, D]
        embeddings of the tokens at t+1; mask as mlx-lm passes it ("causal" for L > 1)."""
        z = self.proj(mx.concatenate([self.hnorm(hidden), self.enorm(next_embeddings)], axis=-1))
        return self.norm(self.block(z, mask, cache))


def load_mtp(path: str | Path) -> tuple[MTPHead, dict[str, Any]]:
    """Read an MTP head written by `save_mtp` (tests/bench/demo_recipe/export.py); return it
    and its metadata."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"MTP head {path} does not exist (train.py writes it as {MTP_FILE})")
    weights, metadata = mx.load(str(path), return_metadata=True)
    if "moestream_mtp" not in metadata:
        raise ValueError(f"{path} is not a moestream MTP head: its metadata has no 'moestream_mtp' entry")
    meta = json.loads(metadata["moestream_mtp"])
    head = MTPHead(ModelArgs.from_dict(meta["model_config"]), int(meta["intermediate_size"]))
    quant = meta.get("quantization")
    if quant:
        quantized = {k[len(MTP_PREFIX) :].rsplit(".", 1)[0] for k in weights if k.endswith(".scales")}
        nn.quantize(head, quant["group_size"], quant["bits"], class_predicate=lambda p, _: p in quantized)
    head.load_weights([(k[len(MTP_PREFIX) :], v) for k, v in weights.items()], strict=True)
    mx.eval(head.parameters())
    return head, meta
