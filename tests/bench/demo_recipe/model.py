"""The demo model: a small qwen3_moe built from mlx-lm's own classes.

`DemoShape` fixes the sizes; `store_size_estimate` says, before any training, how many
bytes the 4-bit expert store made from it will take (expert blocks are padded to the
store's 16 KiB alignment, so expert sizes are chosen to fill their blocks).

`forward_train` computes exactly what stock `Model.__call__` computes, but evaluates
the experts densely: every expert's gate/up projection for every token in one matmul,
the hidden activations scaled by the router's top-k weights (zero for unchosen
experts), then one matmul through all down projections. Unchosen experts contribute
zero and get zero gradient, so the result and the gradients equal the sparse
computation; it needs only dense matmuls, which every MLX backend differentiates, and
it also returns the router statistics for the load-balancing loss.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_moe import Model, ModelArgs, Qwen3MoeSparseMoeBlock

from moestream.shared.store_format import EXPERT_ALIGN, TENSOR_ALIGN, align_up

# A safetensors header entry (name, dtype, shape, offsets) is well under this.
_HEADER_BYTES_PER_TENSOR = 160
# mlx-lm's qwen3_moe quant_predicate keeps routers at 8 bits, group 64.
_ROUTER_QUANT = (64, 8)
# Experts' scales and biases are bfloat16 (the model is cast before quantizing); the
# resident weights are kept in float32 after it (export.py `_float32_outside_experts`).
_SCALE_BYTES = 2
_RESIDENT_BYTES = 4
# manifest.json: the config, tensor layouts, and one [offset, length, crc32] per expert.
_MANIFEST_BASE_BYTES = 8192
_MANIFEST_BYTES_PER_EXPERT = 40


@dataclass(frozen=True)
class DemoShape:
    """Sizes of the demo model; `config()` turns them into an HF-style config.json."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    intermediate_size: int  # dense MLP of the layers in mlp_only_layers
    mlp_only_layers: tuple[int, ...]
    mtp_intermediate_size: int
    max_position_embeddings: int = 4096
    group_size: int = 32
    bits: int = 4

    def config(self, *, eos_token_id: int = 0) -> dict[str, Any]:
        """The float model's config.json (quantization is added by mlx-lm)."""
        return {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "intermediate_size": self.intermediate_size,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(self.mlp_only_layers),
            "norm_topk_prob": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": True,
            "eos_token_id": eos_token_id,
            "bos_token_id": None,
        }

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i not in self.mlp_only_layers]


# The shipped demo. Experts of 32 x 256 at 4 bits/group 32 take 15,360 bytes of a
# 16 KiB store block; 64 of them per layer, top-8 routing (256 active intermediate
# units). Layer 0 is dense, as in DeepSeek's first_k_dense, so that the five MoE layers'
# 5 MiB of experts leave room for the resident weights within the 7.5 MiB store budget.
FULL = DemoShape(
    vocab_size=4096,
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=32,
    intermediate_size=512,
    mlp_only_layers=(0,),
    mtp_intermediate_size=256,
)

# For tests on CPU: seconds, not minutes.
TINY = DemoShape(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    intermediate_size=64,
    mlp_only_layers=(),
    mtp_intermediate_size=64,
    max_position_embeddings=512,
)


def _matrix_bytes(rows: int, cols: int, group_size: int, bits: int, scale_bytes: int = _RESIDENT_BYTES) -> int:
    """Bytes of one affine-quantized [rows, cols] matrix: packed weight, scales, biases."""
    if cols % group_size:
        return rows * cols * scale_bytes  # mlx-lm leaves such layers unquantized
    return rows * cols * bits // 8 + 2 * rows * (cols // group_size) * scale_bytes


def expert_block_bytes(shape: DemoShape) -> tuple[int, int]:
    """(meaningful bytes, stride) of one expert block in the store, as convert lays it."""
    g, b = shape.group_size, shape.bits
    h, i = shape.hidden_size, shape.moe_intermediate_size
    offset = 0
    for rows, cols in ((i, h), (i, h), (h, i)):  # gate_proj, up_proj, down_proj
        for nbytes in (rows * cols * b // 8, rows * (cols // g) * _SCALE_BYTES, rows * (cols // g) * _SCALE_BYTES):
            offset = align_up(offset, TENSOR_ALIGN) + nbytes
    return offset, align_up(offset, EXPERT_ALIGN)


def store_size_estimate(shape: DemoShape, *, tokenizer_bytes: int = 0) -> dict[str, int]:
    """Bytes of the expert store made from the 4-bit model, and of its 4-bit MTP head.

    Returns {"experts", "resident", "tokenizer", "manifest", "store", "mtp"}; "store" is
    the sum of the first four (the MTP file is counted separately).
    """
    g, b = shape.group_size, shape.bits
    h, v = shape.hidden_size, shape.vocab_size
    q_out, kv_out = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim

    def attention_and_norms(scale_bytes: int = _RESIDENT_BYTES) -> tuple[int, int]:
        mats = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out)]
        norms = (2 * shape.head_dim + 2 * h) * scale_bytes
        return sum(_matrix_bytes(r, c, g, b, scale_bytes) for r, c in mats) + norms, 10

    def dense_mlp(inter: int, scale_bytes: int = _RESIDENT_BYTES) -> tuple[int, int]:
        return sum(_matrix_bytes(r, c, g, b, scale_bytes) for r, c in ((inter, h), (inter, h), (h, inter))), 9

    resident, tensors = _matrix_bytes(v, h, g, b) + h * _RESIDENT_BYTES, 4  # embedding (tied), final norm
    for layer in range(shape.num_hidden_layers):
        nbytes, count = attention_and_norms()
        resident, tensors = resident + nbytes, tensors + count
        if layer in shape.mlp_only_layers:
            nbytes, count = dense_mlp(shape.intermediate_size)
        else:
            nbytes, count = _matrix_bytes(shape.num_experts, h, *_ROUTER_QUANT), 3
        resident, tensors = resident + nbytes, tensors + count
    resident += tensors * _HEADER_BYTES_PER_TENSOR

    _, stride = expert_block_bytes(shape)
    experts = len(shape.moe_layers) * shape.num_experts * stride
    manifest = _MANIFEST_BASE_BYTES + len(shape.moe_layers) * shape.num_experts * _MANIFEST_BYTES_PER_EXPERT

    # The MTP head stays bfloat16 (its own file, quantized after the cast).
    attn, attn_tensors = attention_and_norms(_SCALE_BYTES)
    mlp, mlp_tensors = dense_mlp(shape.mtp_intermediate_size, _SCALE_BYTES)
    mtp = _matrix_bytes(h, 2 * h, g, b, _SCALE_BYTES) + attn + mlp + 3 * h * _SCALE_BYTES
    mtp += (attn_tensors + mlp_tensors + 6) * _HEADER_BYTES_PER_TENSOR
    return {
        "experts": experts,
        "resident": resident,
        "tokenizer": tokenizer_bytes,
        "manifest": manifest,
        "store": experts + resident + tokenizer_bytes + manifest,
        "mtp": mtp,
    }


def build_model(shape: DemoShape, *, seed: int) -> tuple[Model, dict[str, Any]]:
    """A freshly initialised float32 qwen3_moe of `shape` and its config.json dict."""
    config = shape.config()
    model = Model(ModelArgs.from_dict(config))
    init_weights(model, seed=seed, num_layers=shape.num_hidden_layers)
    return model, config


def init_weights(module: nn.Module, *, seed: int, num_layers: int) -> None:
    """GPT-2 style initialisation, deterministic in `seed`: matrices N(0, 0.02), the
    projections that write into the residual stream scaled by 1/sqrt(2 * num_layers),
    norm scales 1. Parameters are visited in name order, each with its own key."""
    params = sorted(tree_flatten(module.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    residual_scale = 1.0 / math.sqrt(2 * num_layers)
    new = []
    for i, (name, value) in enumerate(params):
        if value.ndim == 1:
            new.append((name, mx.ones_like(value)))
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std *= residual_scale
        new.append((name, (std * mx.random.normal(value.shape, key=keys[i])).astype(value.dtype)))
    module.update(tree_unflatten(new))
    mx.eval(module.parameters())


class TrainOutput(NamedTuple):
    logits: mx.array  # [B, L, vocab]
    hidden: mx.array  # [B, L, hidden], after the final norm (what the MTP head reads)
    aux_loss: mx.array  # scalar: mean over MoE layers of the load-balancing loss
    load: mx.array  # [moe_layers, experts]: fraction of routed slots per expert


def moe_dense(block: Qwen3MoeSparseMoeBlock, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """Stock `Qwen3MoeSparseMoeBlock(x)` with dense expert evaluation.

    Returns (y, aux, load): y as the stock block computes it; aux the Switch
    Transformer load-balancing loss E * sum_e f_e * P_e (1.0 when perfectly balanced),
    with f_e the fraction of top-k slots given to expert e and P_e its mean router
    probability; load is f.
    """
    num_experts, k = block.num_experts, block.top_k
    probs = mx.softmax(block.gate(x), axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(probs, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(probs, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    chosen = inds[..., None] == mx.arange(num_experts)  # [..., k, E]
    weights = (chosen * scores[..., None]).sum(axis=-2)  # [..., E], zero where unchosen

    mlp = block.switch_mlp
    w_gate, w_up, w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    e, inter, hidden = w_gate.shape
    g = x @ w_gate.reshape(e * inter, hidden).T
    u = x @ w_up.reshape(e * inter, hidden).T
    a = mlp.activation(u, g).reshape(*x.shape[:-1], e, inter) * weights[..., None].astype(x.dtype)
    y = a.reshape(*x.shape[:-1], e * inter) @ w_down.transpose(0, 2, 1).reshape(e * inter, hidden)

    load = mx.stop_gradient(chosen.astype(mx.float32).sum(axis=-2).reshape(-1, num_experts).mean(axis=0) / k)
    importance = probs.astype(mx.float32).reshape(-1, num_experts).mean(axis=0)
    aux = num_experts * mx.sum(load * importance)
    return y, aux, load


def forward_train(model: Model, inputs: mx.array) -> TrainOutput:
    """The stock qwen3_moe forward pass (no cache), with dense experts and router stats."""
    inner = model.model
    h = inner.embed_tokens(inputs)
    mask = create_attention_mask(h, None)
    aux, loads = [], []
    for layer in inner.layers:
        h = h + layer.self_attn(layer.input_layernorm(h), mask, None)
        x = layer.post_attention_layernorm(h)
        if isinstance(layer.mlp, Qwen3MoeSparseMoeBlock):
            y, layer_aux, layer_load = moe_dense(layer.mlp, x)
            aux.append(layer_aux)
            loads.append(layer_load)
        else:
            y = layer.mlp(x)
        h = h + y
    hidden = inner.norm(h)
    logits = inner.embed_tokens.as_linear(hidden) if model.args.tie_word_embeddings else model.lm_head(hidden)
    if not aux:
        raise ValueError("the model has no MoE layer; the demo needs routed experts")
    return TrainOutput(logits, hidden, mx.mean(mx.stack(aux)), mx.stack(loads))


def output_head(model: Model, hidden: mx.array) -> mx.array:
    """The model's (shared) output head applied to normed hidden states."""
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)
    return model.lm_head(hidden)


# The shipped store lives in the repository: store files, then store plus MTP head (the
# 8 MB tests/test_demo_model.py holds the shipped one to).
STORE_BUDGET_BYTES = int(7.5 * 2**20)
STORE_WITH_MTP_BUDGET_BYTES = 8 * 10**6


def over_budget(store: int, mtp: int) -> str | None:
    """Why a store of `store` bytes with an MTP head of `mtp` bytes is too big, or None."""
    if store <= STORE_BUDGET_BYTES and store + mtp <= STORE_WITH_MTP_BUDGET_BYTES:
        return None
    return (
        f"a {store / 2**20:.2f} MiB store (+{mtp / 2**20:.2f} MiB MTP head) is over the budget of "
        f"{STORE_BUDGET_BYTES / 2**20:.1f} MiB (+MTP: {STORE_WITH_MTP_BUDGET_BYTES / 2**20:.1f} MiB); "
        "shrink the shape in tests/bench/demo_recipe/model.py"
    )
