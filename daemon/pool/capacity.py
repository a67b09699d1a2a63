"""Pool sizing: slots per MoE layer from `--capacity` or from `--memory-budget`."""

from __future__ import annotations

import math
from typing import Any, Sequence

from ...shared.settings import format_size
from ...shared.status import ContextLimit
from ...shared.store_format import Manifest
from .expert_pool import PoolCapacityError

# Config keys that give the experts each token routes to, by model family (a list: one
# per layer, of which the pool needs the largest).
TOP_K_KEYS = (
    "num_experts_per_tok",
    "moe_top_k",
    "top_k",
    "num_experts_per_token",
    "moe_k",
    "top_k_experts",
    "moe_topk",
    "n_activated_experts",
)
# Attributes of mlx-lm's MoE blocks (the module that holds the SwitchGLU/SwitchMLP and
# its router) that hold the same number.
BLOCK_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "n_activated_experts", "moe_topk", "k")
# The config names of a layer's expert count in mlx-lm's ModelArgs, by model family.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def top_k_of(config: dict[str, Any]) -> int:
    """Experts each token routes to, read from the model config (the largest, where the
    config gives one per layer)."""
    cfg = config.get("text_config", config)
    for key in TOP_K_KEYS:
        value = cfg.get(key, config.get(key))
        if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
            return max(value)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    raise PoolCapacityError(f"cannot find the router's top-k in the model config (looked for {', '.join(TOP_K_KEYS)})")


def top_k_of_blocks(blocks: Sequence[Any], config: dict[str, Any]) -> int:
    """Experts each token routes to, as the model's own MoE blocks hold it (the largest
    over layers, so a per-layer top-k is covered); the config where no block says."""
    found = []
    for block in blocks:
        for attr in BLOCK_TOP_K_ATTRS:
            value = getattr(block, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.append(value)
                break
    if found and len(found) == len(blocks):
        return max(found)
    return top_k_of(config)


# The config names of the layer count in mlx-lm's ModelArgs (phixtral, longcat_flash: the second).
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers")


def layer_count_key(cfg: dict[str, Any]) -> str | None:
    """The name under which this (text) config gives its number of decoder layers."""
    return next((k for k in LAYER_COUNT_KEYS if isinstance(cfg.get(k), int)), None)


def layer_count(config: dict[str, Any]) -> int:
    """The model's decoder layers, from its config (its text config where it has one)."""
    cfg = config.get("text_config", config)
    key = layer_count_key(cfg)
    if key is None:
        raise KeyError(f"no layer count in the model config (looked for {', '.join(LAYER_COUNT_KEYS)})")
    return int(cfg[key])


def kv_cache_bytes(config: dict[str, Any], tokens: int) -> int:
    """Upper estimate of the KV cache for `tokens` tokens (all layers, 2 bytes/elem)."""
    cfg = config.get("text_config", config)
    # phixtral names them num_layers, num_heads and model_dim (longcat_flash: num_layers).
    key = layer_count_key(cfg)
    layers = int(cfg[key]) if key else 0
    query_heads = int(cfg.get("num_attention_heads") or cfg.get("num_heads") or 1)
    heads = int(cfg.get("num_key_value_heads") or query_heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or cfg.get("model_dim") or 0) // query_heads))
    if cfg.get("kv_lora_rank"):  # MLA caches the latent plus the rope part
        per_token = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim", 0))
        return layers * tokens * per_token * 2 * 2
    return layers * tokens * 2 * heads * head_dim * 2


# The config names of the model's own context length (text config first).
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "max_seq_len", "n_positions")
# A request's context where the config names none.
FALLBACK_CONTEXT = 16384
# Where `max_context` is left to the model, the KV a memory budget keeps room for while it
# sizes the pool: an agent's prompt with room to answer (Claude Code's first prompt is
# 25-34k tokens). The context is then what the budget leaves after the pool, this or more.
KV_RESERVE_TOKENS = 32768


def model_context(config: dict[str, Any]) -> int | None:
    """The model's own context length from its config, None where it names none."""
    cfg = config.get("text_config", config)
    for key in CONTEXT_KEYS:
        value = cfg.get(key, config.get(key))
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def kv_reserve_tokens(config: dict[str, Any], max_context: int | None) -> int:
    """Tokens of KV a memory budget keeps room for when it sizes the pool: `max_context`
    where it is set, else the model's context up to KV_RESERVE_TOKENS."""
    if max_context is not None:
        return max_context
    return min(model_context(config) or FALLBACK_CONTEXT, KV_RESERVE_TOKENS)


def context_limit(
    config: dict[str, Any],
    max_context: int | None,
    memory_budget: int | None,
    device: tuple[int, str] | None,
    held: int,
) -> ContextLimit:
    """A request's context: `max_context` where set; else the model's own context
    length (FALLBACK_CONTEXT where the config names none), at most the tokens whose KV
    fits in the memory budget, or where there is none in the device's memory (`device`:
    its bytes and what they are, `device_memory`; None: unknown, no bound), less `held`
    (what the model holds there: `memory_held`); never under 16 tokens."""
    memory, source = (memory_budget, "memory_budget") if memory_budget is not None else device or (None, "")
    per_token = kv_cache_bytes(config, 1)
    own = model_context(config)
    room = None if memory is None else max(memory - held, 0)
    if max_context is not None:
        return ContextLimit(max_context, own, per_token, room, source, "max_context")
    tokens, bound = own or FALLBACK_CONTEXT, "model"
    if room is not None and per_token and room // per_token < tokens:
        tokens, bound = max(room // per_token, 16), "memory"
    return ContextLimit(tokens, own, per_token, room, source, bound)


def memory_held(manifest: Manifest, resident_bytes: int, pool_bytes: int, slots: int, prompt_cache_bytes: int) -> int:
    """What a loaded model holds of its memory beside the requests' KV caches: resident
    weights, the pool, a long prompt's transient stack (a partial pool) and the prompt
    cache's bound."""
    partial = any(slots < layer.num_experts for layer in manifest.layers)
    reserve = overflow_reserve_bytes(manifest, slots) if partial else 0
    return resident_bytes + pool_bytes + reserve + prompt_cache_bytes


def device_memory() -> tuple[int, str]:
    """The memory a loaded model and its KV caches share where no budget is given: what
    MLX reports of the device (Metal's recommended working set, a GPU's memory), else
    the host's RAM (the CPU build); and which it is."""
    import mlx.core as mx
    import psutil

    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        value = info.get(key)
        if isinstance(value, int) and value > 0:
            return value, f"device memory ({key})"
    return psutil.virtual_memory().total, "host memory"


def plan_capacity(
    manifest: Manifest,
    *,
    capacity: float | int | None,
    memory_budget: int | None,
    resident_bytes: int,
    max_tokens: int = 4096,
    top_k: int | None = None,
    prompt_cache_bytes: int = 0,
) -> int:
    """Slots per layer (the same for every layer, clamped to its expert count); `top_k`
    as the model's blocks give it (default: from the config). A memory budget holds the
    prompt cache's `prompt_cache_bytes` too (daemon/model/prompt_cache.py)."""
    k = top_k if top_k is not None else top_k_of(manifest.config)
    most = max(layer.num_experts for layer in manifest.layers)
    if capacity is not None and memory_budget is not None:
        raise PoolCapacityError("give either --capacity or --memory-budget, not both")
    if capacity is None and memory_budget is None:
        return most
    if capacity is not None:
        slots = math.ceil(capacity * most) if isinstance(capacity, float) else int(capacity)
        if slots < k:
            raise PoolCapacityError(
                f"--capacity {capacity} gives {slots} slots per layer, below the minimum "
                f"{k} (top-k: the experts one token routes to)"
            )
        return min(slots, most)
    per_slot = sum(layer.expert_bytes for layer in manifest.layers)
    kv = kv_cache_bytes(manifest.config, max_tokens)
    spare = memory_budget - resident_bytes - kv - prompt_cache_bytes
    if spare >= most * per_slot:
        return most
    # A partial pool of c slots serves a prefill whose experts do not fit from a
    # transient stack of up to all E experts of one layer plus scratch for the up to
    # E - c it lacks (an overflow forward), or from one stack of all E (a layer-major
    # prefill, daemon/model/prefill.py): keep room for c * per_slot + (2E - c) * expert.
    expert = max(layer.expert_bytes for layer in manifest.layers)
    slots = (spare - 2 * most * expert) // (per_slot - expert) if per_slot > expert else 0
    if slots < k:
        need = resident_bytes + kv + prompt_cache_bytes + k * per_slot + overflow_reserve_bytes(manifest, k)
        raise PoolCapacityError(
            f"--memory-budget {format_size(memory_budget)} is below the minimum "
            f"{format_size(need)}: resident weights {format_size(resident_bytes)} + "
            f"KV cache for {max_tokens} tokens {format_size(kv)} + "
            f"prompt cache {format_size(prompt_cache_bytes)} (--prompt-cache-bytes) + top-{k} experts "
            f"per layer {format_size(k * per_slot)} + room for a long prompt's experts "
            f"{format_size(overflow_reserve_bytes(manifest, k))}"
        )
    return min(int(slots), most)


def overflow_reserve_bytes(manifest: Manifest, slots: int) -> int:
    """Transient memory of a prefill whose experts do not fit in a pool of `slots` slots:
    at most every expert of one layer, stacked, plus scratch for those it lacks."""
    most = max(layer.num_experts for layer in manifest.layers)
    return (2 * most - slots) * max(layer.expert_bytes for layer in manifest.layers)
