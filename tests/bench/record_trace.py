"""Record a routing trace from an expert store, in the format of tests/data/traces/README.md.

    python tests/bench/record_trace.py --model daemon/demo/store --out tests/data/traces/demo_stdlib

Runs the model with every expert resident (mlx-lm's own MoE modules, wrapped only to copy
the router's choices), prefilling each prompt and then decoding greedily, and writes
`trace.jsonl` (one object per token: req, pos, phase, layers = top-k ids per MoE layer)
and `meta.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_tokenizer

from moestream.daemon.model.streaming_model import _module_at, load_stock_model
from moestream.daemon.pool.capacity import top_k_of
from moestream.shared.store_format import load_manifest

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    'def read_config(path):\n    """Read a configuration file."""\n',
    "for i in range(10):",
    "try:\n    import json\nexcept ImportError:",
    "def parse_args(argv=None):",
    "    def __repr__(self):",
    "# Copyright (c) Python Software Foundation\n",
    "def is_prime(n):",
    "with open(filename) as f:",
    "class HTTPError(Exception):",
]


class _Recorder(nn.Module):
    """Calls the wrapped SwitchGLU/SwitchMLP unchanged and keeps the expert ids."""

    def __init__(self, inner: nn.Module, sink: list) -> None:
        super().__init__()
        self.inner = inner
        self.sink = sink

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        self.sink.append(np.array(indices).reshape(-1, indices.shape[-1]))
        return self.inner(x, indices)


def record(store: Path, out: Path, decode_tokens: int) -> dict:
    manifest = load_manifest(store)
    model = load_stock_model(store)
    tokenizer = load_tokenizer(store)
    sinks: list[list[np.ndarray]] = []
    for layer in manifest.layers:
        parent, key, module = _module_at(model, layer.module_path)
        sink: list[np.ndarray] = []
        parent[key] = _Recorder(module, sink)
        sinks.append(sink)
    out.mkdir(parents=True, exist_ok=True)
    rows = 0
    with open(out / "trace.jsonl", "w") as f:
        for req, prompt in enumerate(PROMPTS):
            for s in sinks:
                s.clear()
            ids = tokenizer.encode(prompt)
            cache = make_prompt_cache(model)
            logits = model(mx.array(ids)[None], cache=cache)[:, -1, :]
            for _ in range(decode_tokens):
                token = mx.argmax(logits, axis=-1)
                logits = model(token[None], cache=cache)[:, -1, :]
            mx.eval(logits)
            per_layer = [np.concatenate(s) for s in sinks]  # [tokens, k] per layer
            for pos in range(per_layer[0].shape[0]):
                phase = "prefill" if pos < len(ids) else "decode"
                layers = [p[pos].tolist() for p in per_layer]
                f.write(json.dumps({"req": req, "pos": pos, "phase": phase, "layers": layers}) + "\n")
                rows += 1
    meta = {
        "model": "moestream built-in demo model (qwen3_moe trained on the Python standard library)",
        "store": str(store),
        "num_experts": manifest.layers[0].num_experts,
        "top_k": top_k_of(manifest.config),
        "layer_ids": [layer.ordinal for layer in manifest.layers],
        "module_paths": [layer.module_path for layer in manifest.layers],
        "requests": len(PROMPTS),
        "decode_tokens_per_request": decode_tokens,
        "tokens": rows,
        "source": "tests/bench/record_trace.py, greedy decoding, every expert resident, MLX CPU build",
        "caveats": "prompts are short Python snippets; the model was trained with a load-balancing loss, "
        "so routing is close to uniform over a whole corpus",
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--decode-tokens", type=int, default=64)
    args = parser.parse_args()
    meta = record(Path(args.model), Path(args.out), args.decode_tokens)
    print(f"wrote {meta['tokens']} tokens of routing to {args.out}")


if __name__ == "__main__":
    main()
