"""Multi-token-prediction (MTP) heads read from an expert store.

A store may hold `mtp.safetensors` beside its manifest, in one of two layouts, told
apart by the file's `moestream_mtp` metadata:

- the demo model's head (`daemon/model/demo_mtp.py`): metadata holds its own model config;
- a Qwen3-Next head (`kind: "qwen3_next"`), written by `moestreamctl convert` from the
  `mtp.*` tensors of the source checkpoint, which stock mlx-lm drops: `mtp.fc`
  (2h -> h), `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, one decoder layer
  `mtp.layers.0.*` (full attention + MoE) and `mtp.norm`, in mlx layout (experts
  stacked into `switch_mlp`, norm weights shifted by +1 as mlx-lm's sanitize does for
  the main model). The store's manifest config is the head's config.

Both heads share one call: `head(hidden, next_embeddings, mask, cache)` takes the main
model's final normed hidden states at positions t and the embeddings of the tokens at
t+1, and returns normed hidden states for the main model's output head, which predict
the tokens at t+2. The Qwen3-Next MTP layer's experts stay resident: one layer's worth.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ...shared.store_format import StoreError, vanished_store_problem
from ..store.quantize import quantize_like_weights
from .demo_mtp import MTP_FILE, MTP_PREFIX, load_mtp

QWEN3_NEXT = "qwen3_next"
MTP_MODEL_TYPES = (QWEN3_NEXT,)
# Norms that mlx-lm's qwen3_next sanitize shifts by +1 when it reads a HF checkpoint.
_SHIFTED_NORMS = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_embedding.weight",
    "mtp.pre_fc_norm_hidden.weight",
)


class Qwen3NextMTP(nn.Module):
    """The Qwen3-Next MTP module, built from mlx-lm's own decoder layer."""

    def __init__(self, args: Any):
        super().__init__()
        from mlx_lm.models.qwen3_next import Qwen3NextDecoderLayer

        dim = args.hidden_size
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(dim, eps=args.rms_norm_eps)
        # The layer index only picks the layer kind: the last of a full-attention
        # interval is full attention; with no mlp_only_layers entry it is MoE.
        full_attention = args.full_attention_interval - 1
        if full_attention in args.mlp_only_layers or args.num_experts <= 0:
            raise ValueError("this Qwen3-Next config gives no MoE layer at the MTP layer's index")
        self.layers = [Qwen3NextDecoderLayer(args, layer_idx=full_attention)]
        self.norm = nn.RMSNorm(dim, eps=args.rms_norm_eps)

    def __call__(self, hidden: mx.array, next_embeddings: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        z = self.fc(
            mx.concatenate([self.pre_fc_norm_embedding(next_embeddings), self.pre_fc_norm_hidden(hidden)], axis=-1)
        )
        return self.norm(self.layers[0](z, mask=mask, cache=cache))


def load_mtp_head(store: str | Path, config: dict[str, Any]) -> nn.Module:
    """The MTP head of the store at `store` (whose manifest config is `config`), as
    described above; its layer's cache is a KVCache."""
    path = Path(store) / MTP_FILE
    if not path.is_file():
        gone = vanished_store_problem(store, None)  # the model folder itself went away
        if gone:
            raise StoreError(gone)
        raise StoreError(
            f"{store} has no MTP head ({MTP_FILE}); speculative decoding with --speculative mtp needs one "
            "(convert a Qwen3-Next checkpoint that carries mtp.* tensors, or use --speculative draft)"
        )
    _, metadata = mx.load(str(path), return_metadata=True)
    meta = json.loads(metadata.get("moestream_mtp", "null") or "null")
    if not isinstance(meta, dict):
        raise StoreError(f"{path} is not a moestream MTP head: its metadata has no 'moestream_mtp' entry")
    loaded = _load_qwen3_next(path, config) if meta.get("kind") == QWEN3_NEXT else load_mtp(path)[0]
    mx.eval(mx.random.state)  # its initial draws (streaming_model.py `_build_model`)
    return loaded


def _load_qwen3_next(path: Path, config: dict[str, Any]) -> Qwen3NextMTP:
    from mlx_lm.models.qwen3_next import ModelArgs

    if config.get("model_type") != QWEN3_NEXT:
        raise StoreError(f"{path} holds a Qwen3-Next MTP head but the store's model is {config.get('model_type')!r}")
    weights = {k[len(MTP_PREFIX) :]: v for k, v in mx.load(str(path)).items()}
    head = Qwen3NextMTP(ModelArgs.from_dict(config))
    quantization = config.get("quantization")
    if quantization:
        quantize_like_weights(head, quantization, weights)
    expected = {k for k, _ in tree_flatten(head.parameters())}
    if expected != set(weights):
        raise StoreError(
            f"{path}: the MTP weights do not match a Qwen3-Next MTP layer: missing "
            f"{sorted(expected - set(weights))[:5]}, unexpected {sorted(set(weights) - expected)[:5]}"
        )
    head.load_weights(list(weights.items()), strict=True)
    head.eval()
    mx.eval(head.parameters())
    return head


# ---- convert: keep the mtp.* tensors that stock mlx-lm drops -----------------------


def sanitize_mtp_weights(mtp: dict[str, mx.array], num_experts: int) -> dict[str, mx.array]:
    """`mtp.*` tensors as a checkpoint holds them -> mlx layout.

    A Hugging Face checkpoint has one tensor per expert and zero-centred norms: stack the
    experts into `switch_mlp` and add 1 to the norms, as mlx-lm's qwen3_next sanitize
    does for the main model. An mlx-community checkpoint is already in mlx layout."""
    prefix = "mtp.layers.0.mlp"
    if f"{prefix}.experts.0.up_proj.weight" not in mtp:
        return dict(mtp)
    out = dict(mtp)
    for n in ("up_proj", "down_proj", "gate_proj"):
        out[f"{prefix}.switch_mlp.{n}.weight"] = mx.stack(
            [out.pop(f"{prefix}.experts.{e}.{n}.weight") for e in range(num_experts)]
        )
    for k, v in out.items():
        if v.ndim == 1 and k.endswith(_SHIFTED_NORMS):
            out[k] = v + 1.0
    return out


def classes_keeping_mtp(sink: dict[str, mx.array]) -> Callable[[dict], tuple[type, type]]:
    """A `get_model_classes` for mlx-lm's `load_model` whose model moves the `mtp.*`
    tensors into `sink` before sanitizing (stock sanitize drops them, or, in mlx layout,
    the strict load refuses them)."""
    from mlx_lm.utils import _get_classes

    def get(config: dict) -> tuple[type, type]:
        model_class, args_class = _get_classes(config=config)
        if config.get("model_type") not in MTP_MODEL_TYPES:
            return model_class, args_class

        class KeepMTP(model_class):  # type: ignore[misc, valid-type]
            def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
                mtp = {k: v for k, v in weights.items() if k.startswith(MTP_PREFIX)}
                rest = {k: v for k, v in weights.items() if not k.startswith(MTP_PREFIX)}
                sink.update(sanitize_mtp_weights(mtp, self.args.num_experts) if mtp else {})
                return super().sanitize(rest)

        KeepMTP.__name__ = model_class.__name__
        return KeepMTP, args_class

    return get


def save_qwen3_next_mtp(path: str | Path, weights: dict[str, mx.array]) -> None:
    """Write sanitized `mtp.*` tensors as the store's MTP file."""
    meta = {"kind": QWEN3_NEXT}
    mx.save_safetensors(
        str(path), dict(sorted(weights.items())), metadata={"format": "mlx", "moestream_mtp": json.dumps(meta)}
    )
