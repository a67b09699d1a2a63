"""Starting a run from trained demo weights (`train.py --init-from`), and the chat check
of a trained float model.

The shipped store keeps only 4-bit weights; its quantized matrices are dequantized
(w = scale * q + bias per group, as `mx.dequantize` computes) into a float32 model of
the recipe's shape, and its MTP head likewise. A float folder (`model-f32/` of a run)
loads as it is. Either way the tokenizer files come along: a fine-tune keeps the
vocabulary the embeddings were trained with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from demo_recipe.model import DemoShape, build_model
from moestream.daemon.model.demo_mtp import MTP_FILE, MTPHead, load_mtp

# Config keys that must agree between the weights and the recipe's shape.
_SHAPE_KEYS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "mlp_only_layers",
)  # fmt: skip


def dequantized(params: dict[str, mx.array], quantization: dict[str, Any] | None) -> dict[str, mx.array]:
    """Float32 copies of `params` (flat names), quantized matrices dequantized with their
    module's group size and bits (a per-module entry of `quantization` overrides the default)."""
    out = {}
    for name, value in params.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and module + ".weight" in params and module + ".scales" in params:
            continue
        if name.endswith(".weight") and module + ".scales" in params:
            if quantization is None:
                raise ValueError(f"{name} is quantized but no quantization settings came with it")
            q = quantization.get(module, quantization)
            value = mx.dequantize(
                value, params[module + ".scales"], params[module + ".biases"], q["group_size"], q["bits"]
            )
        out[name] = value.astype(mx.float32)
    return out


def _check_shape(config: dict[str, Any], shape: DemoShape, source: Path) -> None:
    want = shape.config()
    wrong = [k for k in _SHAPE_KEYS if config.get(k) != want[k] and not (k == "mlp_only_layers" and not config.get(k))]
    if wrong:
        detail = ", ".join(f"{k} {config.get(k)} (recipe {want[k]})" for k in wrong)
        raise ValueError(f"--init-from {source}: its weights are not of this run's shape: {detail}")


def load_init(source: str | Path, shape: DemoShape, *, seed: int) -> tuple[nn.Module, MTPHead, dict[str, Any]]:
    """(float32 language model, float32 MTP head, config.json dict) from an expert store
    or an mlx-lm model folder holding the recipe's `mtp.safetensors`."""
    source = Path(source)
    if (source / "manifest.json").is_file():
        from moestream.daemon.model.streaming_model import load_stock_model

        config = json.loads((source / "manifest.json").read_text())["config"]
        trained = load_stock_model(source)
    elif (source / "config.json").is_file():
        from mlx_lm import load

        config = json.loads((source / "config.json").read_text())
        trained, _ = load(str(source))
    else:
        raise FileNotFoundError(f"--init-from {source}: neither an expert store (manifest.json) nor a model folder")
    if not (source / MTP_FILE).is_file():
        raise FileNotFoundError(f"--init-from {source}: no {MTP_FILE} beside the weights")
    _check_shape(config, shape, source)
    lm, fresh_config = build_model(shape, seed=seed)
    lm.load_weights(list(dequantized(dict(tree_flatten(trained.parameters())), config.get("quantization")).items()))
    trained_head, meta = load_mtp(source / MTP_FILE)
    head = MTPHead(lm.args, shape.mtp_intermediate_size)
    head.load_weights(list(dequantized(dict(tree_flatten(trained_head.parameters())), meta["quantization"]).items()))
    mx.eval(lm.parameters(), head.parameters())
    return lm, head, fresh_config


_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parsed_calls(text: str) -> list[dict[str, Any]]:
    """The `<tool_call>{...}</tool_call>` calls of `text` that parse as JSON objects."""
    calls = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("arguments"), dict):
            calls.append(call)
    return calls


def chat_check(model_dir: Path, *, max_tokens: int = 48) -> dict[str, Any]:
    """chat_eval's two figures on a saved model folder with stock mlx-lm (greedy), for
    the training record; the shipped figures come from chat_eval through a daemon."""
    from mlx_lm import generate, load

    from demo_recipe.chat_eval import CITIES, QUESTIONS, WEATHER_FORMS, WEATHER_TOOL, answered_in_text

    model, tokenizer = load(str(model_dir))

    def answer(question: str) -> str:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tools=[WEATHER_TOOL], add_generation_prompt=True, tokenize=False
        )
        return generate(model, tokenizer, prompt, max_tokens=max_tokens)

    calls = 0
    for i, city in enumerate(CITIES):
        found = parsed_calls(answer(WEATHER_FORMS[i % len(WEATHER_FORMS)].format(city)))
        calls += any(c.get("name") == "get_weather" and city.lower() in str(c["arguments"].get("city", "")).lower()
                     for c in found)  # fmt: skip
    texts = []
    for q in QUESTIONS:
        text = answer(q)
        if answered_in_text(parsed_calls(text), text):
            texts.append(text)
    return {
        "weather_calls_naming_the_city": calls,
        "weather_prompts": len(CITIES),
        "stdlib_answered_in_text": len(texts),
        "stdlib_questions": len(QUESTIONS),
        "max_tokens": max_tokens,
    }
