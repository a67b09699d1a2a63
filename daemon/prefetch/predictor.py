"""The predictor: which experts will the next MoE layer want?

While layer L runs, layer L+1's router is applied to layer L's input hidden state: the
residual stream changes little from one layer to the next, so L+1's router scores on it
rank the experts L+1 will route to nearly as L+1 itself will. The scores come out of the
same graph evaluation as layer L's own expert ids, so predicting costs one small matmul
on the device and no extra host sync.

The loader (daemon/model/streaming_model.py) builds them before the streaming layers:
`routers_of` each layer's router, `make_prefetcher` the prefetcher where some pool is
partial, and `next_layers` what each layer predicts for.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...shared.store_format import Manifest, MoELayer
from ..pool.admission import Admitter
from ..pool.expert_reader import ExpertReader
from ..pool.host_tier import expert_stride
from .prefetcher import Prefetcher

if TYPE_CHECKING:
    from ..pool.expert_pool import ExpertPool

LOG = logging.getLogger("moestream.prefetch")


class NextRouter:
    """Router scores of one MoE layer, computable on another layer's hidden state.

    Knows the gates of mlx-lm's MoE blocks: a plain or quantized Linear (Qwen3-MoE,
    Qwen3-Next / Qwen3.5-MoE, Mixtral, ...) and DeepSeek-V3's `MoEGate` (sigmoid scores
    plus the correction bias; its group limit is left out, which can only widen the
    ranking a little)."""

    def __init__(self, gate: Any, num_experts: int) -> None:
        self.num_experts = num_experts
        if isinstance(gate, nn.Module) and hasattr(gate, "e_score_correction_bias") and "weight" in gate:
            self._kind = "sigmoid_bias"
        elif isinstance(gate, (nn.Linear, nn.QuantizedLinear)):
            self._kind = "linear"
        else:
            raise TypeError(f"no predictor for a router of type {type(gate).__name__}")
        # Held in a plain object (never an attribute of an nn.Module), so the gate's
        # weights are not counted twice in the model's parameters.
        self._gate = gate

    def scores(self, x: mx.array) -> mx.array:
        g = self._gate
        if self._kind == "linear":
            return g(x)
        return mx.sigmoid((x @ g.weight.T).astype(mx.float32)) + g.e_score_correction_bias

    def ranked(self, x: mx.array, k: int, *, ordered: bool) -> mx.array:
        """[..., k] expert ids with the highest scores: best first when `ordered`, else
        in no particular order (argpartition, cheaper)."""
        s = self.scores(x)
        k = min(k, self.num_experts)
        if ordered:
            return mx.argsort(-s, axis=-1)[..., :k]
        if k == self.num_experts:
            return mx.broadcast_to(mx.arange(k), s.shape)
        return mx.argpartition(-s, kth=k - 1, axis=-1)[..., :k]


@dataclass(eq=False)
class Prediction:
    """What layer L named for layer L+1 in this forward."""

    # [tokens, n] expert ids per token (best first when diagnostics are on).
    ranked: np.ndarray
    # The unique experts prefetch was asked for (the top k of each token).
    named: np.ndarray
    # perf_counter() when the prefetch was submitted (diagnostics only), else 0.
    submitted_at: float = 0.0
    submitted: bool = False


@dataclass(eq=False)
class NextLayer:
    """Layer L+1 as seen from layer L: its pool and its router; with a prefetch depth
    above 1, also the layers after it whose experts layer L reads ahead (`ahead`: L+2,
    ...), those of them with a router the predictor knows."""

    pool: "ExpertPool"
    router: NextRouter
    ahead: list["NextLayer"] = field(default_factory=list)


def _input_dims(module: Any) -> int | None:
    """The input width of a (quantized) linear or switch-linear layer, or None."""
    if module is None:
        return None
    dims = getattr(module, "input_dims", None)
    if isinstance(dims, int):
        return dims
    if "scales" in module and "group_size" in dir(module):
        return int(module["scales"].shape[-1]) * int(module.group_size)
    if "weight" in module:
        return int(module["weight"].shape[-1])
    return None


def _experts_input_dims(switch: Any) -> int | None:
    """The width of the input a SwitchGLU/SwitchMLP computes on (its first projection's)."""
    for name in ("gate_proj", "up_proj", "fc1"):
        if isinstance(switch, nn.Module) and name in switch:
            return _input_dims(switch[name])
    return None


def routers_of(layers: Sequence[MoELayer], blocks: Sequence[Any]) -> list[NextRouter | None]:
    """Each MoE layer's router as a NextRouter (None where its gate is of a kind the
    predictor does not know, or takes another input than the experts: a latent MoE's
    experts compute on a projection of the hidden state, which the router of the next
    layer cannot score). `blocks[i]` is the MoE block that holds `layers[i]`."""
    routers: list[NextRouter | None] = []
    for block, layer in zip(blocks, layers):
        gate = getattr(block, "gate", None) if block is not None else None
        switch = block.get(layer.module_path.rsplit(".", 1)[-1]) if isinstance(block, nn.Module) else None
        gate_in, experts_in = _input_dims(gate) if isinstance(gate, nn.Module) else None, _experts_input_dims(switch)
        if gate_in is not None and experts_in is not None and gate_in != experts_in:
            LOG.info(
                "no prediction for layer %s: its router takes %d features, its experts %d (a latent MoE)",
                layer.module_path,
                gate_in,
                experts_in,
            )
            routers.append(None)
            continue
        try:
            routers.append(NextRouter(gate, layer.num_experts) if gate is not None else None)
        except TypeError:
            routers.append(None)
    return routers


def make_prefetcher(
    layers: Sequence[MoELayer],
    routers: Sequence[NextRouter | None],
    resident: Sequence[bool],
    *,
    reader: ExpertReader,
    manifest: Manifest,
    admitter: Admitter,
    top_k: int,
    prefetch: str,
    predict: bool = True,
    depth: int = 1,
    buffer_bytes: int = 0,
) -> Prefetcher | None:
    """The prefetcher of a model's streaming layers (in forward order), or None where
    nothing is predicted: every pool fully resident (`resident[i]`: layer i's will be),
    fewer than two MoE layers, no router the predictor knows after the first, or
    `predict` False. `depth` (Settings.prefetch_depth): how many layers ahead each layer
    reads; `buffer_bytes` (Settings.prefetch_buffer): the prefetch buffer's size, 0 for
    the default."""
    if not predict or all(resident) or len(layers) < 2 or all(r is None for r in routers[1:]):
        return None
    copier = getattr(admitter, "copier", None)
    tier = getattr(admitter, "tier", None) if getattr(admitter, "caching", False) else None
    largest = max(layer.num_experts for layer in layers)
    # Room for a few layers' predictions of a batch (more when reading further ahead);
    # with prefetch off the buffer only has to exist (predictions still feed the
    # diagnostics).
    stride = expert_stride(manifest)
    if buffer_bytes and buffer_bytes < top_k * stride:
        raise ValueError(
            f"prefetch_buffer of {buffer_bytes} bytes holds fewer experts than one token routes "
            f"({top_k} of {stride} bytes): give at least {top_k * stride}, or 0 for the default"
        )
    if prefetch == "off":
        slots = top_k
    elif buffer_bytes:
        slots = buffer_bytes // stride
    else:
        slots = min(16 * depth * top_k, 4 * depth * largest)
    return Prefetcher(reader, manifest, copier, slots=slots, top_k=top_k, mode=prefetch, tier=tier, depth=depth)


def next_layers(
    pools: Sequence["ExpertPool"], routers: Sequence[NextRouter | None], depth: int = 1
) -> list[NextLayer | None]:
    """What each layer predicts for: layer i+1 with its router, and the layers after it
    up to `depth` ahead that have a router the predictor knows; None for the last layer
    and where layer i+1's router is unknown."""
    out: list[NextLayer | None] = []
    for i in range(len(pools)):
        router = routers[i + 1] if i + 1 < len(pools) else None
        if router is None:
            out.append(None)
            continue
        ahead = [
            NextLayer(p, r)
            for p, r in zip(pools[i + 2 : i + 1 + depth], routers[i + 2 : i + 1 + depth])
            if r is not None
        ]
        out.append(NextLayer(pools[i + 1], router, ahead))
    return out
