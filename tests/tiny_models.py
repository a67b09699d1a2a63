"""Tiny models in the mlx-community layout, built from mlx-lm's own classes.

`make_tiny_model(path, arch)` writes a folder that `mlx_lm.load(path)` loads: a
`config.json` (with "quantization" when quantized), safetensors written by mlx-lm's
`save_model` (optionally re-split into shards with a `model.safetensors.index.json`),
and a small byte-level BPE tokenizer trained on the fixed text below. Weights are drawn
deterministically from `seed`, so two builds with the same arguments are bit-identical.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

VOCAB_SIZE = 512
GROUP_SIZE = 32
HIDDEN = 64

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Architectures with routed experts in SwitchGLU/SwitchMLP modules.
MOE_ARCHS = ("qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3", "qwen3_next")
# "qwen3": no MoE layers at all. "dbrx": experts kept as one module per expert.
OTHER_ARCHS = ("qwen3", "dbrx")
# MoE families whose config or layout differs from the common ones: top-k under another
# name (ernie4_5_moe: moe_k), and a latent MoE whose experts compute on a projection of
# the hidden state (nemotron_h with moe_latent_size).
MORE_MOE_ARCHS = ("ernie4_5_moe", "nemotron_h")
# "f32" keeps float32 weights: the CPU build of MLX runs gather_mm only in float32, so
# unquantized models that must run a forward pass on CPU need it.
QUANTS = ("4bit", "8bit", "bf16", "f32")

# Router weights get a larger scale than other matrices so that top-k choices differ
# clearly between tokens instead of all tokens landing on near-tied experts.
ROUTER_SCALE = 3.0

_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_LINEAR_ATTN = {
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}


def tiny_config(arch: str) -> dict[str, Any]:
    """The HF-style config.json of a tiny model of `arch` (before quantization)."""
    common = {"model_type": arch, "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN, "rms_norm_eps": 1e-6}
    if arch == "qwen3_moe":
        return (
            common
            | _ATTN
            | {
                "num_hidden_layers": 3,
                "intermediate_size": 128,
                "num_experts": 16,
                "num_experts_per_tok": 4,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [1],  # one dense layer between two MoE layers
                "moe_intermediate_size": 32,
                "rope_theta": 10000.0,
                "tie_word_embeddings": False,
                "max_position_embeddings": 512,
                "norm_topk_prob": True,
            }
        )
    if arch == "qwen3_next":
        return (
            common
            | _ATTN
            | _LINEAR_ATTN
            | {
                "num_hidden_layers": 4,
                "intermediate_size": 128,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "decoder_sparse_step": 1,
                "shared_expert_intermediate_size": 64,
                "mlp_only_layers": [],
                "moe_intermediate_size": 32,
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "max_position_embeddings": 512,
                "norm_topk_prob": True,
                "full_attention_interval": 2,
            }
        )
    if arch == "qwen3_5_moe":
        text = (
            common
            | _ATTN
            | _LINEAR_ATTN
            | {
                "model_type": "qwen3_5_moe_text",
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "num_experts": 8,
                "num_experts_per_tok": 2,
                "shared_expert_intermediate_size": 64,
                "moe_intermediate_size": 32,
                "max_position_embeddings": 512,
                "full_attention_interval": 2,
                "tie_word_embeddings": False,
                "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            }
        )
        return {"model_type": arch, "text_config": text, "tie_word_embeddings": False}
    if arch == "mixtral":
        return common | {
            "num_hidden_layers": 2,
            "intermediate_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rope_theta": 10000.0,
        }
    if arch == "deepseek_v3":
        return common | {
            "num_hidden_layers": 3,
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "n_shared_experts": 1,
            "n_routed_experts": 16,
            "routed_scaling_factor": 2.5,
            "kv_lora_rank": 32,
            "q_lora_rank": 64,
            "qk_rope_head_dim": 16,
            "v_head_dim": 32,
            "qk_nope_head_dim": 32,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "norm_topk_prob": True,
            "n_group": 4,
            "topk_group": 2,
            "num_experts_per_tok": 4,
            "moe_layer_freq": 1,
            "first_k_dense_replace": 1,
            "max_position_embeddings": 512,
            "rope_theta": 10000.0,
        }
    if arch == "qwen3":
        return (
            common
            | _ATTN
            | {
                "num_hidden_layers": 2,
                "intermediate_size": 128,
                "max_position_embeddings": 512,
                "rope_theta": 10000.0,
                "tie_word_embeddings": True,
            }
        )
    if arch == "dbrx":
        return {
            "model_type": arch,
            "vocab_size": VOCAB_SIZE,
            "d_model": HIDDEN,
            "n_layers": 2,
            "n_heads": 4,
            "ffn_config": {"ffn_hidden_size": 32, "moe_num_experts": 4, "moe_top_k": 2},
            "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0},
        }
    if arch == "ernie4_5_moe":
        return {
            **common,
            "intermediate_size": 64,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 2,
            "rope_theta": 10000.0,
            "use_bias": False,
            "tie_word_embeddings": False,
            "moe_num_experts": 8,
            "moe_intermediate_size": 32,
            "moe_k": 2,
        }
    if arch == "nemotron_h":
        return {
            "model_type": arch,
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN,
            "intermediate_size": 64,
            "max_position_embeddings": 512,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 1,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "hybrid_override_pattern": ["M", "E", "*", "E"],
            "num_hidden_layers": 4,
            "head_dim": 16,
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "moe_latent_size": 32,
            "n_group": 1,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False,
        }
    raise ValueError(f"unknown tiny architecture {arch!r}; choose from {MOE_ARCHS + OTHER_ARCHS + MORE_MOE_ARCHS}")


def _init_value(name: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    noise = mx.random.normal(shape, key=key)
    if len(shape) == 1:
        if "norm" in name.rsplit(".", 2)[-2]:
            return 1.0 + 0.05 * noise  # near-one norm scales that still differ per channel
        return 0.02 * noise  # biases, A_log, dt_bias, correction biases
    fan_in = math.prod(shape[1:]) if "conv1d" in name else shape[-1]
    scale = 1.0 / math.sqrt(fan_in)
    if name.endswith(".gate.weight") or name.endswith(".router.layer.weight"):
        scale *= ROUTER_SCALE
    return scale * noise


def init_weights(model: nn.Module, seed: int) -> None:
    """Overwrite every floating parameter deterministically from `seed`."""
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    keys = mx.random.split(mx.random.key(seed), len(params))
    new = []
    for i, (name, value) in enumerate(params):
        if mx.issubdtype(value.dtype, mx.floating):
            value = _init_value(name, tuple(value.shape), keys[i]).astype(value.dtype)
        new.append((name, value))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def build_tiny_model(
    arch: str, *, seed: int = 0, config: dict[str, Any] | None = None
) -> tuple[nn.Module, dict[str, Any]]:
    """An initialised float32 model of `arch` and its config (`config`, or
    `tiny_config(arch)`), using mlx-lm's classes."""
    from mlx_lm.utils import _get_classes

    config = copy.deepcopy(config) if config is not None else tiny_config(arch)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(copy.deepcopy(config)))
    init_weights(model, seed)
    return model, config


def _cast_bf16(model: nn.Module) -> None:
    # What `mlx_lm.convert --dtype bfloat16` does, honouring the model's cast_predicate.
    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(
        tree_unflatten(
            [
                (k, v.astype(mx.bfloat16) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v)
                for k, v in tree_flatten(model.parameters())
            ]
        )
    )


def _reshard(path: Path, shards: int) -> None:
    """Split the single file written by save_model into `shards` files plus an index,
    named and indexed as save_model names them when it shards by size."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weights = mx.load(str(path / "model.safetensors"))
    names = sorted(weights)
    per = math.ceil(len(names) / shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: weights[k] for k in names[i * per : (i + 1) * per]}
        mx.save_safetensors(str(path / file), part, metadata={"format": "mlx"})
        weight_map.update({k: file for k in part})
    (path / "model.safetensors").unlink()
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=4))


def make_tiny_model(
    path: str | Path,
    arch: str,
    *,
    quant: str = "4bit",
    seed: int = 0,
    shards: int = 1,
    group_size: int = GROUP_SIZE,
    mtp: bool = False,
    config: dict[str, Any] | None = None,
) -> Path:
    """Write a tiny `arch` model in the mlx-community layout to `path`; return `path`.

    quant: "4bit" or "8bit" (affine, `group_size`, via mlx-lm's `quantize_model`),
    "bf16" (as mlx-community ships unquantized models) or "f32". shards > 1 splits
    the weights into that many files with an index. mtp=True (qwen3_next only) adds
    random `mtp.*` tensors of a Qwen3-Next MTP head, in mlx layout and quantized alike.
    config: the config.json to build from instead of `tiny_config(arch)` (tests/arch_table.py).
    """
    from mlx_lm.utils import quantize_model, save_config, save_model

    if quant not in QUANTS:
        raise ValueError(f"quant must be one of {QUANTS}, not {quant!r}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    path = Path(path)
    model, config = build_tiny_model(arch, seed=seed, config=config)
    if quant != "f32":
        _cast_bf16(model)
    if quant in ("4bit", "8bit"):
        with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints bits/weight
            model, config = quantize_model(model, config, group_size, int(quant[0]), mode="affine")
    config["eos_token_id"] = SPECIAL_TOKENS.index(EOS_TOKEN)
    save_model(path, model)
    if mtp:
        _add_mtp(path, config, quant, seed=seed, group_size=group_size)
    save_config(config, path / "config.json")
    if shards > 1:
        _reshard(path, shards)
    write_tokenizer(path)
    return path


def _add_mtp(path: Path, config: dict[str, Any], quant: str, *, seed: int, group_size: int) -> None:
    """Append random Qwen3-Next `mtp.*` tensors to the saved model.safetensors."""
    from mlx_lm.models.qwen3_next import ModelArgs

    from moestream.daemon.model.mtp_head import Qwen3NextMTP

    if config["model_type"] != "qwen3_next":
        raise ValueError("mtp=True needs arch qwen3_next")
    head = Qwen3NextMTP(ModelArgs.from_dict(copy.deepcopy(config)))
    init_weights(head, seed + 1)
    if quant != "f32":
        _cast_bf16(head)
    if quant in ("4bit", "8bit"):

        def predicate(p: str, m: nn.Module) -> bool | dict[str, Any]:
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % group_size:
                return False
            if p.endswith("mlp.gate") or p.endswith("shared_expert_gate"):
                return {"group_size": 64, "bits": 8}  # as mlx-lm's qwen3_next quant_predicate
            return True

        nn.quantize(head, group_size, int(quant[0]), class_predicate=predicate)
    file = path / "model.safetensors"
    weights = dict(mx.load(str(file)))
    added = {"mtp." + k: v for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(file), weights | added, metadata={"format": "mlx"})
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        index["weight_map"] = dict(sorted((index["weight_map"] | dict.fromkeys(added, file.name)).items()))
        index_path.write_text(json.dumps(index, indent=4))


# ---- tokenizer -------------------------------------------------------------------

_TEXT = '''
The expert store keeps every expert of a layer in one file, so that one expert is one
read. A small pool of slots holds the experts that the router picked most recently, and
the rest wait on disk until a token needs them. When the pool is full, the policy picks a
victim: the least recently used expert, or the least frequently used one, or the one
whose heat has decayed the most since it was last touched.

Once upon a time a quick brown fox jumped over the lazy dog. The dog did not mind; it
was asleep in the sun, dreaming of bones and long walks by the river. The fox ran on,
through the field and over the hill, until the evening light turned the grass to gold.
In the morning the farmer counted his hens and found them all safe. He laughed, made a
pot of tea, and sat by the window to read the newspaper. There was news of rain, of a
market in the town, and of a new bridge over the river that would open in the spring.

Numbers and dates: 1, 2, 3, 10, 42, 100, 256, 1024, 2048. On 12 March 2024 at 09:30 the
meeting began; it ended at 11:15 with three decisions and one open question.

def route(hidden, gate, k=2):
    """Return the indices of the top-k experts for each token."""
    scores = gate(hidden)
    order = scores.argsort(axis=-1)
    return order[..., -k:]


class Pool:
    def __init__(self, capacity):
        self.capacity = capacity
        self.slots = {}
        self.hits = 0
        self.misses = 0

    def lookup(self, expert):
        if expert in self.slots:
            self.hits += 1
            return self.slots[expert]
        self.misses += 1
        return None

    def admit(self, expert, slot):
        self.slots[expert] = slot


for layer in range(4):
    for expert in range(8):
        print(f"layer {layer} expert {expert}: {layer * 8 + expert}")

import json
with open("config.json") as f:
    config = json.load(f)
print(config["hidden_size"], config.get("num_experts", 0))

Questions and answers. What is the capital of France? Paris. How many legs does a
spider have? Eight. Which planet is closest to the sun? Mercury. What colour is the sky
on a clear day? Blue. Who wrote the book? Nobody knows; the name on the cover is false.
'''


def write_tokenizer(
    path: str | Path,
    *,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    chat_template: str = CHAT_TEMPLATE,
    text: str = _TEXT,
) -> None:
    """Train a byte-level BPE of at most VOCAB_SIZE tokens on fixed text (`text`) with
    `special_tokens` as its first ids; save it in the Hugging Face layout (tokenizer.json,
    tokenizer_config.json with `chat_template`, special_tokens_map.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] * 4, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    special = {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            special
            | {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "add_prefix_space": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 512,
                "chat_template": chat_template,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


@contextlib.contextmanager
def tiny_store(
    prefix: str, arch: str = "qwen3_moe", *, seed: int = 11, config: dict[str, Any] | None = None
) -> Iterator[Path]:
    """A tiny `arch` model (built from `config`, default `tiny_config(arch)`) converted to
    an expert store in a short /tmp folder (daemon sockets live near it), removed afterwards."""
    import shutil
    import tempfile

    from moestream.daemon.store.convert import convert_model

    root = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    try:
        src = make_tiny_model(root / "model", arch, quant="4bit", seed=seed, config=config)
        convert_model(src, root / "store")
        yield root / "store"
    finally:
        shutil.rmtree(root)


def main(argv: list[str] | None = None) -> None:
    """Build one tiny model from the command line (used by the README's quick start)."""
    import argparse

    parser = argparse.ArgumentParser(description="Write a tiny random MoE model in the mlx-community layout.")
    parser.add_argument("--arch", default="qwen3_moe", choices=MOE_ARCHS + OTHER_ARCHS)
    parser.add_argument("--quant", default="4bit", choices=QUANTS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="Folder to write the model into.")
    args = parser.parse_args(argv)
    path = make_tiny_model(args.out, args.arch, quant=args.quant, seed=args.seed)
    print(f"wrote a tiny {args.arch} model ({args.quant}) to {path}")


if __name__ == "__main__":
    main()


def local_outputs(store: Path, prompts: dict[str, int], capacity: float = 0.25) -> dict[str, Any]:
    """What `generate --local` computes in-process (greedy), for each prompt with its
    number of tokens: the reference the daemon tests compare with."""
    from moestream.daemon.model.generation import SamplingParams, encode_prompt, generate
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    sm = load_streaming_model(store, Settings(capacity=capacity))
    try:
        return {p: generate(sm, encode_prompt(sm, p, None), SamplingParams(max_tokens=n)) for p, n in prompts.items()}
    finally:
        sm.close()
