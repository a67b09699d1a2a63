"""Write the q30 repository's small files and weight headers (tests/data/hub/qwen3-30b-a3b-4bit).

There is no internet where this project is developed, so the files are not fetched from
the hub but made as mlx-lm makes such a repository (`mlx_lm.convert --q-bits 4` of
Qwen3-30B-A3B, as mlx-community/Qwen3-30B-A3B-4bit was made): the model of Qwen3-30B-A3B's
config (tests/bench/make_random_moe.py's qwen3-30b-a3b shape, with the rest of the hub
config's fields), quantized by mlx-lm's `quantize_model` (4 bits, groups of 64, the router
at 8 bits as mlx-lm's qwen3_moe asks), split as `save_model` splits it (files of at most
5 GiB, its index), and each file's safetensors header as `mx.save_safetensors` writes it
(daemon/store/safetensors_layout.py). Nothing is evaluated: the weights stay lazy, so this
runs in seconds and writes about 200 KB.

    python tests/data/hub/make_q30_repo.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "qwen3-30b-a3b-4bit"
ROOT = HERE.parents[2]

# Fields of the hub's config.json beside the shape's (Qwen/Qwen3-30B-A3B's, as published).
HUB_FIELDS = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_window_layers": 48,
    "output_router_logits": False,
    "rope_scaling": None,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
}


def main() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "bench"))
    import mlx.core as mx
    from make_random_moe import SHAPES
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_moe
    from mlx_lm.utils import make_shards, quantize_model

    from moestream.daemon.store.layout import dtype_name
    from moestream.daemon.store.safetensors_layout import TensorMeta, file_layout

    config = {**HUB_FIELDS, **SHAPES["qwen3-30b-a3b"]}
    model = qwen3_moe.Model(qwen3_moe.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    model, config = quantize_model(model, config, group_size=64, bits=4, mode="affine")
    weights = dict(tree_flatten(model.parameters()))
    shards = make_shards(weights)
    OUT.mkdir(parents=True, exist_ok=True)
    headers, weight_map = {}, {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        metas = [TensorMeta(k, dtype_name(v.dtype), tuple(v.shape), v.nbytes) for k, v in shard.items()]
        layout = file_layout(metas, {"format": "mlx"})
        headers[name] = {"size": layout.size, "header": layout.header[8:].decode()}
        weight_map.update({k: name for k in shard})
    index = {
        "metadata": {"total_size": sum(v.nbytes for v in weights.values())},
        "weight_map": {k: weight_map[k] for k in sorted(weight_map)},
    }
    (OUT / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4) + "\n")
    (OUT / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
    (OUT / "headers.json").write_text(json.dumps(headers, indent=1) + "\n")
    print(f"{OUT}: {len(shards)} weight files, {index['metadata']['total_size'] / 2**30:.2f} GiB of weights")


if __name__ == "__main__":
    main()
