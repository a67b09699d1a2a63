"""Write a random-weight MoE model of a real model's shape in the mlx-community layout.

Used on the GPU machine for `moestreamctl bench decode` on a Qwen3-30B-A3B-shaped model
(48 layers, 128 experts, top-8, hidden 2048, expert width 768, 4-bit: about 17 GiB):

    python tests/bench/make_random_moe.py --shape qwen3-30b-a3b --out /data/q30 --mlx-memory-limit 64G

The weights are drawn lazily and evaluated one saved shard at a time, so memory stays
near one shard.

Routing. With mlx-lm's initialisation a deep random model routes almost the same experts
for every token: random attention averages over the context, so the residual stream is
nearly the same from one token to the next, and an LRU pool of 25% hits about 0.95 of the
routed experts (48 layers, hidden 2048, 64 tokens sampled at temperature 1). Real models
do not: on the real Qwen1.5-MoE trace (tests/data/traces) LRU at 25% hits 0.30.
`--embed-scale S` multiplies the token embeddings by S, so that the token itself dominates
the residual stream and routing varies from token to token: at hidden 2048, S = 16, 48, 64
and 96 give an LRU hit rate at 25% of 0.85, 0.40, 0.29 and 0.24 (measured on a narrow
version of the shape on the CPU). S = 64 is the benchmarks' realistic setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

SHAPES = {
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 768,
        "rms_norm_eps": 1e-6,
        "vocab_size": 151936,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 40960,
        "norm_topk_prob": True,
    },
    # A small shape with the same structure, to try the script on a CPU.
    "mini": {
        "model_type": "qwen3_moe",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_experts": 32,
        "num_experts_per_tok": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 128,
        "rms_norm_eps": 1e-6,
        "vocab_size": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
        "norm_topk_prob": True,
    },
}
# A shape whose expert reads and expert compute take about as long on the developer
# machine's CPU and disk (float32 experts of 144 KiB, 8 of 64 routed per layer): where
# prefetch has reads to hide behind compute, unlike the demo model (its experts are a
# few KiB) and unlike the H200 (whose decode is bound by the host). Use --dtype float32
# --bits 0: MLX's CPU build runs gather_mm on float32 only.
SHAPES["balanced-cpu"] = dict(
    SHAPES["mini"], num_hidden_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=48
)

# `moestreamctl bench agent`'s shape: tests/tiny_models.py's qwen3_moe (as narrow, as fast
# per layer on a CPU) with eight layers, so that a prefill yields after each of eight: a
# 16k-token prompt prefills for minutes at 25% on the developer machine's CPU. Make it with
# --dtype float32: its experts are narrower than a quantization group, so they stay
# unquantized, and MLX's CPU gather_mm takes float32 only.
SHAPES["agent-cpu"] = dict(
    SHAPES["mini"],
    hidden_size=64,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    max_position_embeddings=32768,
)

# Issue 55's shape: q30's depth and routing (48 MoE layers, 128 experts, top-8) at tiny
# widths, where the host's per-layer work, not compute, sets a CPU token's time. Make it
# with --dtype float32 (as agent-cpu).
SHAPES["deep-cpu"] = dict(SHAPES["agent-cpu"], num_hidden_layers=48, num_experts=128, num_experts_per_tok=8)

# Another architecture than the demo's for `moestreamctl plan`'s forecast against the
# benchmarks on a CPU: DeepSeek-V3's (latent attention, a shared expert beside 64 routed
# ones in 8 groups, a dense first layer), 4-bit, about as fast per token as the demo.
SHAPES["deepseek-v3-cpu"] = {
    "model_type": "deepseek_v3",
    "vocab_size": 4096,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "intermediate_size": 512,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 128,
    "q_lora_rank": 192,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer trained on a little text, padded to the vocab size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [Path(__file__).read_text()] * 4
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 1024),
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "model_max_length": 32768,
            }
        )
    )


def make_random_moe(
    out: Path,
    shape: str,
    *,
    bits: int = 4,
    group_size: int = 64,
    seed: int = 0,
    embed_scale: float = 1.0,
    dtype: str = "bfloat16",
    expert_width: int | None = None,
) -> Path:
    config = dict(SHAPES[shape])
    if expert_width is not None:
        config["moe_intermediate_size"] = expert_width
    out.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if embed_scale != 1.0:
        embed = model.model.embed_tokens
        embed.weight = embed.weight * embed_scale
    # Real checkpoints keep bf16 scales and norms; so does this one by default.
    model.set_dtype(getattr(mx, dtype))
    if bits:  # 0 keeps the weights unquantized
        model, config = quantize_model(model, config, group_size=group_size, bits=bits, mode="affine")
    save_model(out, model, donate_model=True)
    save_config(config, config_path=out / "config.json")
    _write_tokenizer(out, config["vocab_size"])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--bits", type=int, default=4, help="4 or 8; 0 keeps the weights unquantized")
    parser.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        default="bfloat16",
        help="of the weights (unquantized), scales and norms; float32 for unquantized models on MLX's CPU build",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expert-width", type=int, help="the shape's moe_intermediate_size, replaced")
    parser.add_argument(
        "--embed-scale",
        type=float,
        default=1.0,
        help="multiply token embeddings (64: routing about as varied as a real model's; see above)",
    )
    parser.add_argument("--mlx-memory-limit", default="64G", help="mx.set_memory_limit, e.g. 64G")
    args = parser.parse_args(argv)
    from moestream.shared.settings import parse_size

    mx.set_memory_limit(parse_size(args.mlx_memory_limit))
    tic = time.perf_counter()
    path = make_random_moe(
        Path(args.out),
        args.shape,
        bits=args.bits,
        seed=args.seed,
        embed_scale=args.embed_scale,
        dtype=args.dtype,
        expert_width=args.expert_width,
    )
    size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    print(
        f"wrote {args.shape} ({size / 2**30:.2f} GiB) to {path} in {time.perf_counter() - tic:.1f} s", file=sys.stderr
    )


if __name__ == "__main__":
    main()
