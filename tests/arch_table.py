"""Every MoE architecture of the installed mlx-lm, as a tiny model: the table.

A model file keeps stacked experts when it uses `SwitchGLU` or `SwitchMLP` (mlx-lm's
`models/switch_layers.py`), or imports a model file that does (a wrapper such as
qwen3_5_moe, whose text model is qwen3_5's, or kimi_vl around deepseek_v3).
`stacked_expert_files()` finds them by scanning; `ARCHS` says, for each, how to build a
tiny instance from its `ModelArgs` and, where streaming it fails, why (`Arch.xfail`: the
test expects that failure, strictly, so a fix flips it). tests/test_every_architecture.py
runs the table; `python tests/arch_table.py --markdown` prints the supported families.
`VARIANTS` are more tiny configs of some of them, where a config switch changes what the
model's loop passes from layer to layer (cross-layer KV, shared KV, residual blocks).

A tiny config is `GENERIC` (tiny values under the names mlx-lm's ModelArgs use), kept
to the fields the architecture's args class has, then the entry's own fields. A wrapper
(`Arch.text_args`) gets that config as its `text_config`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from tiny_models import HIDDEN, VOCAB_SIZE, tiny_config

TOP_K = 2
EXPERTS = 8

# Tiny values under the config names mlx-lm's ModelArgs use; each architecture takes
# those its args class has.
GENERIC: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "moe_top_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "num_shared_expert": 1,
    "rms_norm_eps": 1e-6,
    "norm_eps": 1e-6,
    "layer_norm_epsilon": 1e-5,
    "layernorm_epsilon": 1e-6,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "model_max_length": 512,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "norm_topk_prob": True,
    "kv_lora_rank": 32,
    "q_lora_rank": 64,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 0,
    "routed_scaling_factor": 1.5,
    "mlp_only_layers": [],
    "decoder_sparse_step": 1,
    "moe_layer_freq": 1,
}


@dataclass(frozen=True)
class Arch:
    """How to build a tiny `model_type` (the model file's name) and what to expect."""

    family: str
    fields: dict[str, Any] = field(default_factory=dict)
    # A wrapper: "module:Class" of the args its text_config is read with; `outer` are
    # its own top-level fields.
    text_args: str | None = None
    outer: dict[str, Any] = field(default_factory=dict)
    top_k: int = TOP_K
    # Where streaming the architecture fails: the exact reason (an expected failure).
    xfail: str | None = None
    # Expected failures of one quantization only ("4bit", "f32"): quant -> reason.
    xfail_quant: dict[str, str] = field(default_factory=dict)
    # The whole config, where tests/tiny_models.py has one already.
    config: dict[str, Any] | None = None

    # The prefill order `status` reports with default settings ("layer": the layer-major
    # prefill drives the model's forward; "chunk": it falls back to stock's chunks).
    prefill: str = "layer"

    # Stock mlx-lm runs it only with Metal (its model file calls Metal kernels): elsewhere
    # there is no stock run to compare with, an expected failure saying so.
    metal_only: bool = False

    def xfail_reason(self, quant: str) -> str | None:
        if self.metal_only and not mx.metal.is_available():
            return (
                "stock mlx-lm cannot run it without Metal: its model file calls Metal kernels "
                "([metal_kernel] No Metal back-end)"
            )
        return self.xfail or self.xfail_quant.get(quant)


GEMMA4 = {
    "enable_moe_block": True,
    "top_k_experts": TOP_K,
    "num_kv_shared_layers": 0,
    "global_head_dim": 16,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": VOCAB_SIZE,
    "sliding_window": 16,
    "sliding_window_pattern": 2,
}
KIMI_LINEAR = {
    "linear_attn_config": {
        "kda_layers": [1],
        "full_attn_layers": [2],
        "num_heads": 4,
        "head_dim": 16,
        "short_conv_kernel_size": 4,
    },
    "num_experts_per_token": TOP_K,
}
MISTRAL4 = {
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "llama_4_scaling_beta": 0.1,
        "original_max_position_embeddings": 512,
    }
}

ARCHS: dict[str, Arch] = {
    "Klear": Arch("Klear"),
    "afmoe": Arch("AFMoE", {"layer_types": ["sliding_attention", "full_attention"], "num_dense_layers": 0}),
    "bailing_hybrid": Arch("Bailing (Ling)", {"layer_group_size": 2, "group_norm_size": 1}),
    "bailing_moe": Arch("Bailing (Ling)"),
    "bailing_moe_linear": Arch("Bailing (Ling)", {"layer_group_size": 2, "group_norm_size": 1}),
    "bailing_moe_v3": Arch("Bailing (Ling)", {"layer_group_size": 2}),
    "deepseek": Arch("DeepSeek"),
    "deepseek_v2": Arch(
        "DeepSeek",
        {
            "rope_scaling": {
                "type": "yarn",
                "factor": 2.0,
                "original_max_position_embeddings": 256,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            }
        },
    ),
    "deepseek_v3": Arch("DeepSeek", top_k=4, config=tiny_config("deepseek_v3")),
    "deepseek_v32": Arch("DeepSeek", {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8}),
    "deepseek_v41": Arch(
        "DeepSeek", {"index_head_dim": 16, "index_n_heads": 2, "index_topk": 8, "o_lora_rank": 32, "o_groups": 2}
    ),
    "dots1": Arch("dots.llm1"),
    "ernie4_5_moe": Arch("ERNIE 4.5", config=tiny_config("ernie4_5_moe")),
    "exaone_moe": Arch(
        "EXAONE",
        {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"], "is_moe_layer": [True, True]},
    ),
    "gemma4_text": Arch("Gemma 4", GEMMA4),
    "gemma4": Arch("Gemma 4", GEMMA4, text_args="gemma4_text:ModelArgs", outer={"vocab_size": VOCAB_SIZE}),
    "glm4_moe": Arch("GLM", {"use_qk_norm": True, "partial_rotary_factor": 0.5, "rope_scaling": None}),
    "glm4_moe_lite": Arch("GLM"),
    "glm_moe_dsa": Arch(
        "GLM",
        {
            "index_head_dim": 16,
            "index_n_heads": 2,
            "index_topk": 8,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    ),
    "gpt_oss": Arch("gpt-oss"),
    "granitemoe": Arch(
        "Granite",
        {"logits_scaling": 2.0, "attention_multiplier": 0.25, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
    ),
    "granitemoehybrid": Arch(
        "Granite",
        {
            "logits_scaling": 2.0,
            "attention_multiplier": 0.25,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "layer_types": ["mamba", "attention"],
            "num_local_experts": EXPERTS,
            "num_experts_per_tok": TOP_K,
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_proj_bias": False,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
        },
    ),
    "hunyuan": Arch(
        "Hunyuan",
        {
            "use_mixed_mlp_moe": True,
            "use_qk_norm": True,
            "use_cla": False,
            "cla_share_factor": 1,
            "rope_scaling": {"alpha": 1.0, "type": "dynamic", "factor": 1.0},
        },
    ),
    "jamba": Arch(
        "Jamba",
        {
            "attn_layer_offset": 1,
            "attn_layer_period": 2,
            "expert_layer_offset": 0,
            "expert_layer_period": 1,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
        },
    ),
    "kimi_linear": Arch(
        "Kimi",
        KIMI_LINEAR,
    ),
    "kimi_k25": Arch("Kimi", text_args="deepseek_v3:ModelArgs"),
    "kimi_vl": Arch("Kimi", text_args="kimi_vl:TextArgs", outer={"model_type": "kimi_vl"}),
    "kimi_k3": Arch("Kimi", KIMI_LINEAR, text_args="kimi_k3:TextArgs"),
    "laguna": Arch("Laguna"),
    "lfm2_moe": Arch(
        "LFM2",
        {
            "use_expert_bias": True,
            "num_dense_layers": 0,
            "conv_bias": False,
            "conv_L_cache": 3,
            "layer_types": ["conv", "full_attention"],
        },
    ),
    "llama4": Arch(
        "Llama 4",
        {
            "attention_chunk_size": 16,
            "interleave_moe_layer_step": 1,
            "intermediate_size_mlp": 64,
            "use_qk_norm": True,
            "rope_scaling": None,
            "num_experts_per_tok": 1,  # mlx-lm's Llama 4 routes one expert per token
            "num_hidden_layers": 4,  # its mask is taken from layer 3
        },
        text_args="llama4:TextArgs",
        top_k=1,
    ),
    "longcat_flash": Arch(
        "LongCat",
        {
            "attention_method": "MLA",
            "zero_expert_type": "identity",
            "ffn_hidden_size": 64,
            "expert_ffn_hidden_size": 32,
            "zero_expert_num": 2,
            "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True,
        },
    ),
    "longcat_flash_ngram": Arch(
        "LongCat",
        {
            "zero_expert_type": "identity",
            "ffn_hidden_size": 64,
            "expert_ffn_hidden_size": 32,
            "zero_expert_num": 2,
            "mla_scale_q_lora": True,
            "mla_scale_kv_lora": True,
        },
    ),
    "mellum": Arch(
        "Mellum",
        {
            "sliding_window": 16,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_parameters": {
                "sliding_attention": {"rope_theta": 10000.0},
                "full_attention": {"rope_theta": 50000.0},
            },
        },
    ),
    "mimo_v2_flash": Arch(
        "MiMo",
        {
            "hybrid_layer_pattern": [1, 0],
            "moe_layer_freq": [1, 1],
            "add_swa_attention_sink_bias": True,
            "add_full_attention_sink_bias": False,
            "sliding_window_size": 16,
            "swa_rope_theta": 10000.0,
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 2,
            "swa_head_dim": 16,
            "swa_v_head_dim": 16,
            "v_head_dim": 16,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "partial_rotary_factor": 0.5,
        },
    ),
    "minimax": Arch("MiniMax", {"rotary_dim": 8}),
    "minimax_m3_vl": Arch("MiniMax", {"moe_layer_freq": [1, 1]}, text_args="minimax_m3_vl:TextArgs"),
    "mistral4": Arch("Mistral", MISTRAL4),
    "mistral3": Arch("Mistral", MISTRAL4 | {"model_type": "mistral4"}, text_args="mistral4:ModelArgs"),
    "mixtral": Arch("Mixtral", config=tiny_config("mixtral")),
    "muse_spark": Arch(
        "Muse Spark",
        {
            "post_norm_eps": 1e-6,
            "rope_parameters": {"rope_theta": 10000.0},
            "layer_rope_theta": [10000.0, 0],
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "final_logit_softcapping": 30.0,
            "output_multiplier": 1.0,
            "moe_hidden_size": 32,
            "num_shared_experts": 0,
        },
        text_args="muse_spark:TextArgs",
        # A tiny vision tower (its defaults make 2 B random weights: minutes to build).
        outer={
            "vision_config": {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1},
            "out_hidden_size": HIDDEN,
        },
        metal_only=True,
    ),
    "nemotron_h": Arch("Nemotron-H", config=tiny_config("nemotron_h")),
    "olmoe": Arch("OLMoE"),
    "phimoe": Arch("Phi", {"router_jitter_noise": 0.0}),
    "phixtral": Arch("Phi", {"num_vocab": VOCAB_SIZE, "model_dim": HIDDEN, "num_heads": 4, "rotary_dim": 8}),
    "qwen2_moe": Arch("Qwen"),
    "qwen3_moe": Arch("Qwen", top_k=4, config=tiny_config("qwen3_moe")),
    "qwen3_next": Arch("Qwen", config=tiny_config("qwen3_next")),
    "qwen3_5": Arch("Qwen", config=tiny_config("qwen3_5_moe") | {"model_type": "qwen3_5"}),
    "qwen3_5_moe": Arch("Qwen", config=tiny_config("qwen3_5_moe")),
    "prism_hadamard_qwen35": Arch(
        "Qwen",
        {"model_type": "qwen3_5_text"},
        text_args="qwen3_5:TextModelArgs",
        xfail="not built: a Hadamard pack (schema 2 tensors, 2-bit affine weights in groups of 128) is beyond "
        "the tiny builder, so mlx-lm refuses the tiny model (ValueError: Unsupported Hadamard pack)",
    ),
    "qwen3_vl_moe": Arch("Qwen", {"model_type": "qwen3_moe"}, text_args="qwen3_moe:ModelArgs"),
    "solar_open": Arch("Solar", {"partial_rotary_factor": 0.5}),
    "step3p5": Arch("Step", {"num_attention_groups": 2, "share_expert_dim": 32, "moe_layers_enum": "0,1"}),
}


# name -> (model_type, fields over its tiny config; a wrapper's go into its text_config).
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    # Each second layer reuses the KV its first layer returns (`shared_kv_states`).
    "hunyuan+cla": ("hunyuan", {"use_cla": True, "cla_share_factor": 2}),
    # Attention residuals: the layers pass their blocks along.
    "kimi_k3+attn_res": ("kimi_k3", {"attn_res_block_size": 1}),
    "gemma4+tied": ("gemma4", {"tie_word_embeddings": True}),
    "gemma4_text+tied": ("gemma4_text", {"tie_word_embeddings": True}),
    # The last two layers take the KV the first two return, and keep no cache.
    "gemma4_text+kv_shared": (
        "gemma4_text",
        {"num_hidden_layers": 4, "num_kv_shared_layers": 2, "tie_word_embeddings": True},
    ),
}

# Models whose decoder blocks pass along an object each of them changes (kimi_k3's
# attention residuals): their decode forwards are not replayed from a block that missed
# (daemon/model/optimistic.py `_plain`), so they stay on the per-layer path.
NOT_REPLAYED = {"kimi_k3+attn_res"}


def arch_of(name: str) -> Arch:
    """The table's entry of a model_type or a variant's."""
    return ARCHS[VARIANTS[name][0] if name in VARIANTS else name]


def models_dir() -> Path:
    import mlx_lm.models

    return Path(mlx_lm.models.__path__[0])


def stacked_expert_files(folder: Path | None = None) -> list[str]:
    """The model files (by name, without .py) of mlx-lm that keep stacked experts: those
    that use SwitchGLU or SwitchMLP, and those that import one that does."""
    folder = folder or models_dir()
    sources = {p.stem: p.read_text() for p in folder.glob("*.py") if p.stem not in ("__init__", "switch_layers")}
    found = {name for name, text in sources.items() if re.search(r"\bSwitch(GLU|MLP)\b", text)}

    def imports(text: str) -> set[str]:
        names = set(re.findall(r"^from \.(\w+) import", text, re.M))
        for group in re.findall(r"^from \. import ([\w, ]+)", text, re.M):
            names |= {n.strip() for n in group.split(",")}
        return names

    while True:
        more = {name for name, text in sources.items() if name not in found and imports(text) & found}
        if not more:
            return sorted(found)
        found |= more


def _args_fields(spec: str) -> set[str]:
    module, cls = spec.split(":")
    return {f.name for f in dataclasses.fields(getattr(importlib.import_module(f"mlx_lm.models.{module}"), cls))}


def tiny_arch_config(model_type: str) -> dict[str, Any]:
    """The config.json (before quantization) of a tiny `model_type` model (or variant)."""
    if model_type in VARIANTS:
        base, fields = VARIANTS[model_type]
        config = tiny_arch_config(base)
        inner = config["text_config"] if ARCHS[base].text_args is not None else config
        inner |= copy.deepcopy(fields)
        return config
    arch = ARCHS[model_type]
    if arch.config is not None:
        return copy.deepcopy(arch.config)
    spec = arch.text_args or f"{model_type}:ModelArgs"
    names = _args_fields(spec)
    text = {"model_type": model_type} | {k: copy.deepcopy(v) for k, v in GENERIC.items() if k in names}
    text |= copy.deepcopy(arch.fields)
    if arch.text_args is None:
        return text
    return {"model_type": model_type, "tie_word_embeddings": False} | copy.deepcopy(arch.outer) | {"text_config": text}


def supported() -> list[str]:
    """The model_types the table streams exactly (no expected failure at any quantization)."""
    # A Metal-only architecture is not listed: this repository's runs (a CPU, CUDA) cannot
    # compare it with stock.
    return sorted(
        name for name, arch in ARCHS.items() if arch.xfail is None and not arch.xfail_quant and not arch.metal_only
    )


def markdown() -> str:
    """One line per family: its supported model_types (and those that are not, why)."""
    families: dict[str, list[str]] = {}
    for name in sorted(ARCHS, key=str.lower):
        families.setdefault(ARCHS[name].family, []).append(name)
    lines = []
    for family in sorted(families, key=str.lower):
        ok = [f"`{n}`" for n in families[family] if n in supported()]
        not_yet = [f"`{n}`" for n in families[family] if n not in supported()]
        parts = [", ".join(ok)] if ok else []
        metal = [f"`{n}`" for n in families[family] if ARCHS[n].metal_only]
        not_yet = [n for n in not_yet if n not in metal]
        if not_yet:
            parts.append(f"not yet: {', '.join(not_yet)}")
        if metal:
            parts.append(f"converts, exactness unchecked (stock runs it only with Metal): {', '.join(metal)}")
        line = f"- **{family}**: " + "; ".join(parts)
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    if argv == ["--markdown"]:
        print(markdown())
    elif argv == ["--list"]:
        print("\n".join(supported()))
    else:
        raise SystemExit("usage: python tests/arch_table.py --markdown | --list")


if __name__ == "__main__":
    main(sys.argv[1:])
