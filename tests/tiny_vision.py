"""Tiny vision-language MoE models, built from mlx-vlm's own classes.

`make_tiny_vlm(path, arch)` writes a folder that both `mlx_vlm.load(path)` and
`mlx_lm.load(path)` (the language model alone) load, or, kimi_vl's, moestream's convert
(stock mlx-lm refuses its attention's `kv_b_proj`, which convert splits as mlx-lm's
deepseek_v3 does, daemon/store/convert.py): a `config.json` of mlx-vlm's
`ModelConfig`, the weights of mlx-vlm's `Model` (float32: the CPU runs gather_mm only
in float32) in its own layout, the tiny byte-level BPE tokenizer of tests/tiny_models.py
with the model's vision tokens, a chat template that places `{"type": "image"}` parts,
and the processor's files. `png(seed)` is a small deterministic test image.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from arch_table import ARCHS, GEMMA4, MISTRAL4
from mlx.utils import tree_flatten
from tiny_models import EOS_TOKEN, HIDDEN, SPECIAL_TOKENS, VOCAB_SIZE, init_weights, tiny_config, write_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Gemma 4's image, audio and video tokens (its processor's boi/image/eoi names).
GEMMA4_TOKENS = ("<start_of_image>", "<|image|>", "<end_of_image>", "<|audio|>", "<|video|>")
# Llama 4's: an image's tiles of patch tokens, between start and end, `<|image|>` before
# its global tile (and the chat's placeholder).
LLAMA4_TOKENS = (
    "<|image_start|>",
    "<|image|>",
    "<|image_end|>",
    "<|patch|>",
    "<|tile_x_separator|>",
    "<|tile_y_separator|>",
)
# Kimi-VL's and Kimi K2.5's: an image's pad token (their processors repeat it, one per
# 2x2 merged patches) inside the media markers of the chat template.
KIMI_VL_TOKENS = ("<|media_start|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
# Mistral 3's (Pixtral's): an image's rows of patch tokens, each row but the last ended by
# a break token, the image by an end token; the chat's placeholder is the patch token.
MISTRAL3_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
# MiniMax M3's: its processor wraps an image's pad tokens in start and end tokens.
MINIMAX_M3_TOKENS = ("]<]image[>[", "]<]video[>[", "]<]start of image[>[", "]<]end of image[>[")
# Kimi K3's: as Kimi-VL's, but its media span begins with `<|media_begin|>`.
KIMI_K3_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>")
VLM_SPECIAL_TOKENS = SPECIAL_TOKENS + VISION_TOKENS


def _template(image: str) -> str:
    """A chat template reduced to its image and text parts, `image` in each image's place."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + image + ""
        "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Qwen-VL's (its processor expands the pad token) and Gemma 4's (its processor wraps
# the image token in boi/eoi and repeats it).
VLM_CHAT_TEMPLATE = _template("<|vision_start|><|image_pad|><|vision_end|>")
GEMMA4_CHAT_TEMPLATE = LLAMA4_CHAT_TEMPLATE = _template("<|image|>")
KIMI_VL_CHAT_TEMPLATE = _template("<|media_start|>image<|media_content|><|media_pad|><|media_end|>")
MISTRAL3_CHAT_TEMPLATE = _template("[IMG]")
MINIMAX_M3_CHAT_TEMPLATE = _template("]<]image[>[")
KIMI_K3_CHAT_TEMPLATE = _template("<|media_begin|>image<|media_content|><|media_pad|><|media_end|>")
# Vision MoE architectures of mlx-vlm with a tiny config here. A MiniMax M3 checkpoint
# whose shared expert is as wide as a routed one (as in mlx-vlm's defaults: 3072 both)
# converts to a text-only store: mlx-vlm then packs the shared expert into the expert
# bank as expert N, its gate and up projections fused (MiniMaxPackedSwitchGLU), so the
# weights it needs lie inside the module the store streams in mlx-lm's layout (N
# experts, gate_proj and up_proj apart, the shared expert resident), and its weighted
# sum adds the shared expert's output among the routed ones', where mlx-lm adds it
# after. Running mlx-vlm's arithmetic would take a streamed module that serves the
# shared expert as expert N with fused weights; there is none. The tiny
# minimax_m3_vl's shared expert is wider, which mlx-vlm keeps apart, as mlx-lm does.
#
# Left out: deepseek_v41. mlx-vlm's DeepSeek V4.1 language model is an implementation of
# its own, not mlx-lm's: (1) it keeps the checkpoint's names (attn, ffn, hc_attn_fn,
# head; its experts at language_model.layers.N.ffn.switch_mlp), where mlx-lm renames them
# (self_attn, mlp, attn_hc.fn, lm_head; model.layers.N.mlp.experts.switch_mlp), so it
# shares no weight with the streamed model and has no module at the store's expert
# paths; (2) its experts compute otherwise: DeepseekV41SwitchGLU is called with the
# routing weights, scales each expert's activation by its weight and rounds it to FP8
# (fake_quant_fp8_ue8m0) before the down projection, after rounding the layer's input
# to FP8, where mlx-lm's SwitchGLU(x, indices) rounds nothing and its caller weights
# the outputs; a StreamingMoE serves mlx-lm's two-argument call; (3) it keeps every
# layer's state in one DeepseekV41Cache where mlx-lm keeps a LayerCache a layer, which
# the prompt cache could not hand over; (4) its gate routes image tokens with a bias of
# their own (bias_vl), which mlx-lm drops. Real V4.1 checkpoints have engram layers,
# which mlx-lm refuses (its ModelArgs raises: no n-gram hash tables), so they do not
# convert at all; one without converts to a text-only store (convert's vision_weights,
# tests/test_vision.py's check on `make_tiny_deepseek_v41`).
VLM_ARCHS = (
    "qwen3_vl_moe",
    "qwen3_5_moe",
    "gemma4",
    "llama4",
    "kimi_vl",
    "mistral3",
    "kimi_k25",
    "minimax_m3_vl",
    "kimi_k3",
)


# The language models' common tiny sizes (each arch adds its own fields).
TEXT = {
    "num_hidden_layers": 2,
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 512,
}

# tests/tiny_models.py's deepseek_v3 (MLA attention, sigmoid routing with a shared
# expert), 2 layers, every one MoE: the language model of kimi_vl, kimi_k25 and mistral3.
DEEPSEEK_V3_TEXT = tiny_config("deepseek_v3") | {
    "num_hidden_layers": 2,
    "n_routed_experts": 8,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 0,
    "tie_word_embeddings": False,
}


def _special_tokens(arch: str) -> tuple[str, ...]:
    own = {
        "gemma4": GEMMA4_TOKENS,
        "llama4": LLAMA4_TOKENS,
        "kimi_vl": KIMI_VL_TOKENS,
        "mistral3": MISTRAL3_TOKENS,
        "kimi_k25": KIMI_VL_TOKENS,
        "minimax_m3_vl": MINIMAX_M3_TOKENS,
        "kimi_k3": KIMI_K3_TOKENS,
    }
    return SPECIAL_TOKENS + own.get(arch, VISION_TOKENS)


def _ids(arch: str) -> dict[str, int]:
    return {t: i for i, t in enumerate(_special_tokens(arch))}


def tiny_vlm_config(arch: str) -> dict[str, Any]:
    """The config.json of a tiny `arch` vision-language MoE model."""
    ids = _ids(arch)
    if arch == "qwen3_vl_moe":
        text = TEXT | {
            "model_type": "qwen3_vl_moe_text",
            "intermediate_size": 128,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "norm_topk_prob": True,
            # Sections of head_dim / 2 (time, height, width), interleaved as Qwen3-VL's.
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
            "tie_word_embeddings": False,
        }
        vision = {
            "model_type": "qwen3_vl_moe",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": HIDDEN,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
            "in_channels": 3,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "eos_token_id": ids[EOS_TOKEN],
            "tie_word_embeddings": False,
        }
    if arch == "qwen3_5_moe":
        text = TEXT | {
            "model_type": "qwen3_5_moe_text",
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "shared_expert_intermediate_size": 64,
            "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6,
            "full_attention_interval": 2,
            "tie_word_embeddings": False,
            # A rotary part of 8 of head_dim 16, its 4 frequencies in (time, height, width) sections.
            "rope_parameters": {
                "type": "default",
                "mrope_section": [2, 1, 1],
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_interleaved": True,
            },
        }
        vision = {
            "model_type": "qwen3_5_moe",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": HIDDEN,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "in_channels": 3,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"],
            "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"],
            "eos_token_id": ids[EOS_TOKEN],
            "tie_word_embeddings": False,
        }
    if arch == "gemma4":
        # mlx-lm's gemma4_text MoE (tests/arch_table.py's), its experts beside a dense MLP.
        text = (
            TEXT
            | GEMMA4
            | {
                "model_type": "gemma4_text",
                "intermediate_size": 128,
                "num_experts": 8,
                "moe_intermediate_size": 32,
                "tie_word_embeddings": True,
            }
        )
        vision = {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 16,
            "position_embedding_size": 64,
            "pooling_kernel_size": 2,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "vocab_size": VOCAB_SIZE,
            "hidden_size": HIDDEN,
            "image_token_id": ids["<|image|>"],
            "boi_token_id": ids["<start_of_image>"],
            "eoi_token_id": ids["<end_of_image>"],
            "audio_token_id": ids["<|audio|>"],
            "video_token_id": ids["<|video|>"],
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": True,
        }
    if arch == "llama4":
        # mlx-lm's Llama 4 (tests/arch_table.py's: one expert a token beside a shared
        # one, chunked attention), and a vision tower of 56-pixel tiles of 14-pixel
        # patches (the processor's patch size), pixel-shuffled 2x2: 4 tokens a tile.
        text = (
            TEXT
            | ARCHS["llama4"].fields
            | {
                "model_type": "llama4_text",
                "intermediate_size": 32,
                "num_local_experts": 8,
                "no_rope_layers": [1, 1, 1, 0],
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "attention_bias": False,
            }
        )
        vision = {
            "model_type": "llama4_vision_model",
            "hidden_size": 32,
            "image_size": 56,
            "initializer_range": 0.02,
            "intermediate_size": 128,  # the pixel-shuffled width: hidden_size / 0.5**2
            "norm_eps": 1e-5,
            "num_attention_heads": 2,
            "num_channels": 3,
            "num_hidden_layers": 2,
            "patch_size": 14,
            "pixel_shuffle_ratio": 0.5,
            "projector_dropout": 0.0,
            "projector_input_dim": HIDDEN,
            "projector_output_dim": HIDDEN,
            "rope_theta": 10000.0,
            "vision_feature_layer": -1,
            "vision_feature_select_strategy": "default",
            "vision_output_dim": HIDDEN,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "image_token_index": ids["<|patch|>"],
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": False,
        }
    if arch == "kimi_vl":
        # mlx-lm's kimi_vl, a deepseek_v3 language model (tests/tiny_models.py's: MLA
        # attention, sigmoid routing with a shared expert), every layer MoE here, and
        # MoonViT: 14-pixel patches merged 2x2, so the 48x64 test image (cropped to
        # 28x56) is 2 image tokens.
        text = DEEPSEEK_V3_TEXT
        vision = {
            "model_type": "moonvit",
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "patch_size": 14,
            "init_pos_emb_height": 8,
            "init_pos_emb_width": 8,
            "merge_kernel_size": [2, 2],
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "vocab_size": VOCAB_SIZE,
            "media_placeholder_token_id": ids["<|media_pad|>"],
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": False,
        }
    if arch == "mistral3":
        # mlx-lm's mistral3 around mistral4 (tests/arch_table.py's: a deepseek_v3-like
        # MoE with MLA attention and Llama 4's attention scaling), every layer MoE, and
        # Pixtral's vision tower: 14-pixel patches merged 2x2, so the 48x64 test image
        # (resized into 56 pixels and padded to 28-pixel tiles: 56x56) is 2x2 image tokens.
        text = DEEPSEEK_V3_TEXT | MISTRAL4 | {"model_type": "mistral4", "routed_scaling_factor": 1.0}
        vision = {
            "model_type": "pixtral",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "rope_theta": 10000.0,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "image_token_index": ids["[IMG]"],
            "spatial_merge_size": 2,
            "vision_feature_layer": -1,
            "multimodal_projector_bias": False,
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": False,
        }
    if arch == "kimi_k25":
        # Kimi-VL's config: mlx-lm's kimi_k25 is a deepseek_v3 language model too (but
        # mlx-vlm's runs its attention absorbed, as mlx-lm's does), and K2.5's MoonViT
        # takes the same fields; its processor pads the 48x64 test image to 56x84 (4x6
        # patches), 6 image tokens.
        return tiny_vlm_config("kimi_vl") | {"model_type": arch}
    if arch == "minimax_m3_vl":
        # mlx-lm's minimax_m3_vl (tests/arch_table.py's: every layer MoE, dense attention),
        # its shared expert wider than a routed one (mlx-vlm keeps it apart then, as mlx-lm
        # does; see VLM_ARCHS's comment), and a CLIP-like tower with 3-D RoPE: 14-pixel
        # patches merged 2x2, so the 48x64 test image (resized to 56x56) is 4 image tokens.
        compression = {"spatial_merge_size": 2, "temporal_patch_size": 2}
        text = TEXT | {
            "model_type": "minimax_m3",
            "intermediate_size": 32,
            "shared_intermediate_size": 64,
            "dense_intermediate_size": 128,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "n_shared_experts": 1,
            "moe_layer_freq": [1, 1],
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "tie_word_embeddings": False,
        }
        vision = {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": HIDDEN,
            "img_token_compression_config": compression,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "image_token_index": ids["]<]image[>["],
            "video_token_index": ids["]<]video[>["],
            "vision_start_token_id": ids["]<]start of image[>["],
            "vision_end_token_id": ids["]<]end of image[>["],
            "projector_hidden_size": HIDDEN,
            "img_token_compression_config": compression,
            "vocab_size": VOCAB_SIZE,
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": False,
        }
    if arch == "kimi_k3":
        # mlx-lm's kimi_k3 (tests/arch_table.py's: a KDA linear-attention layer, then an
        # MLA one, every layer MoE with a shared expert), and K3's MoonViT: 14-pixel
        # patches merged 2x2 (time-pooled), so the 48x64 test image, which its processor
        # pads to 56x84 (4x6 patches), is 6 image tokens.
        text = (
            TEXT
            | ARCHS["kimi_k3"].fields
            | {
                "model_type": "kimi_linear",
                "intermediate_size": 64,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "num_shared_experts": 1,
                "kv_lora_rank": 32,
                "q_lora_rank": 64,
                "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32,
                "v_head_dim": 32,
                "routed_scaling_factor": 1.5,
                "rms_norm_eps": 1e-6,
                "tie_word_embeddings": False,
            }
        )
        vision = {
            "model_type": "moonvit3d",
            "patch_size": 14,
            "init_pos_emb_height": 8,
            "init_pos_emb_width": 8,
            "init_pos_emb_time": 4,
            "vt_num_attention_heads": 2,
            "vt_num_hidden_layers": 2,
            "vt_hidden_size": 32,
            "vt_intermediate_size": 64,
            "qkv_hidden_size": 32,
            "merge_kernel_size": [2, 2],
            "mm_hidden_size": 32,
            "text_hidden_size": HIDDEN,
        }
        return {
            "model_type": arch,
            "text_config": text,
            "vision_config": vision,
            "vocab_size": VOCAB_SIZE,
            "media_placeholder_token_id": ids["<|media_pad|>"],
            "eos_token_id": [ids[EOS_TOKEN]],
            "tie_word_embeddings": False,
        }
    raise ValueError(f"no tiny config for {arch!r} (known: {VLM_ARCHS})")


def make_tiny_vlm(path: str | Path, arch: str = "qwen3_vl_moe", *, seed: int = 0) -> Path:
    """Write a tiny `arch` vision-language MoE model (float32) to `path`; return `path`."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = tiny_vlm_config(arch)
    module, _ = get_model_and_args(config)
    # As mlx-vlm's `load` builds it: the text and vision parts as their own config classes.
    model_config = module.ModelConfig.from_dict(json.loads(json.dumps(config)))
    model = module.Model(update_module_configs(model_config, module, config, ["text", "vision"]))
    init_weights(model, seed)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    if arch == "gemma4":
        _write_gemma4_processor(path)
    elif arch == "llama4":
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=LLAMA4_CHAT_TEMPLATE)
        # Tiles of 56 pixels, at most 4 of them besides the global one.
        (path / "preprocessor_config.json").write_text(
            json.dumps({"processor_class": "Llama4Processor", "size": {"height": 56, "width": 56}, "max_patches": 4})
        )
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "Llama4Processor"}))
    elif arch == "kimi_vl":
        # Its processor reads the patch and merge sizes from config.json's vision_config.
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=KIMI_VL_CHAT_TEMPLATE)
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "KimiVLProcessor"}))
    elif arch == "kimi_k25":
        # Its processor takes the patch and merge sizes from preprocessor_config.json's
        # media_proc_cfg (the image processor's defaults are K2.5's: 14 and 2x2).
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=KIMI_VL_CHAT_TEMPLATE)
        (path / "preprocessor_config.json").write_text(
            json.dumps({"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": [2, 2]}})
        )
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "KimiK25Processor"}))
    elif arch == "kimi_k3":
        # Its processor takes the patch and merge sizes from preprocessor_config.json's
        # media_proc_cfg, as K2.5's does.
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=KIMI_K3_CHAT_TEMPLATE)
        (path / "preprocessor_config.json").write_text(
            json.dumps({"media_proc_cfg": {"patch_size": 14, "merge_kernel_size": [2, 2]}})
        )
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "KimiK3Processor"}))
    elif arch == "minimax_m3_vl":
        # Its processor reads the patch and merge sizes from config.json; images are
        # resized to multiples of 28 pixels between these bounds.
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=MINIMAX_M3_CHAT_TEMPLATE)
        (path / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 28 * 28, "max_pixels": 56 * 56}))
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "MiniMaxM3VLProcessor"}))
    elif arch == "mistral3":
        # Its processor reads the patch size from config.json's vision_config and the
        # merge size from its spatial_merge_size; images fit in 56 pixels.
        write_tokenizer(path, special_tokens=_special_tokens(arch), chat_template=MISTRAL3_CHAT_TEMPLATE)
        (path / "preprocessor_config.json").write_text(
            json.dumps({"image_processor_type": "PixtralImageProcessor", "size": {"longest_edge": 56}})
        )
        (path / "processor_config.json").write_text(json.dumps({"processor_class": "Mistral3Processor"}))
    else:
        _write_qwen_vl_processor(path, config["vision_config"])
    return path


def make_tiny_deepseek_v41(path: str | Path, *, seed: int = 0) -> Path:
    """Write a tiny deepseek_v41 vision-language model (float32, no engram layers, which
    mlx-lm refuses) to `path` in the checkpoint's own names, which both mlx-lm's and
    mlx-vlm's sanitize read (each expert apart, the shared expert's w1/w2/w3, wo_a in
    two dimensions); return `path`. No processor: it is converted, not run."""
    import re

    from mlx_vlm.utils import get_model_and_args

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    text = (
        TEXT
        | ARCHS["deepseek_v41"].fields
        | {
            "model_type": "deepseek_v41",
            "num_key_value_heads": 1,
            "head_dim": 32,
            "qk_rope_head_dim": 16,
            "q_lora_rank": 64,
            "moe_intermediate_size": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-6,
            "sliding_window": 16,
            "compress_ratios": [0, 4],
            "kv_source_layer_ids": [1],
            "index_source_layer_ids": [1],
            "candidate_source_layer_id": 1,
            "candidate_topk_blocks": 4,
            "candidate_block_size": 4,
            "engram_layer_ids": [],
            "hc_mult": 2,
        }
    )
    vision = {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2, "intermediate_size": 64}
    config = {
        "model_type": "deepseek_v41",
        "text_config": text,
        "vision_config": vision | {"patch_size": 14, "downsample_ratio": 2},
        "image_token_id": _ids("deepseek_v41")["<|image_pad|>"],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": HIDDEN,
        "eos_token_id": _ids("deepseek_v41")[EOS_TOKEN],
        "tie_word_embeddings": False,
    }
    module, _ = get_model_and_args(config)
    model = module.Model(module.ModelConfig.from_dict(json.loads(json.dumps(config))))
    for part in ("language_model", "vision", "aligner"):  # not the image_start marks (no dot)
        init_weights(model[part], seed)
    weights = {}
    shared = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for name, value in tree_flatten(model.parameters()):
        name = name.removeprefix("language_model.").replace("embed_tokens.", "embed.")
        routed = re.fullmatch(r"(layers\.\d+\.ffn)\.switch_mlp\.(\w+)\.weight", name)
        if routed:
            for e in range(value.shape[0]):
                weights[f"{routed[1]}.experts.{e}.{shared[routed[2]]}.weight"] = value[e]
            continue
        for mlx_name, own in shared.items():
            name = name.replace(f"shared_experts.{mlx_name}.", f"shared_experts.{own}.")
        weights[name] = value.reshape(-1, value.shape[-1]) if ".wo_a." in name else value
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(path, special_tokens=_special_tokens("deepseek_v41"), chat_template=VLM_CHAT_TEMPLATE)
    return path


def _write_qwen_vl_processor(path: Path, vision: dict[str, Any]) -> None:
    write_tokenizer(path, special_tokens=VLM_SPECIAL_TOKENS, chat_template=VLM_CHAT_TEMPLATE)
    (path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen3VLImageProcessor",
                "processor_class": "Qwen3VLProcessor",
                "patch_size": vision["patch_size"],
                "temporal_patch_size": vision["temporal_patch_size"],
                "merge_size": vision["spatial_merge_size"],
                # Small images: a few image tokens each.
                "min_pixels": 32 * 32,
                "max_pixels": 64 * 64 * 4,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
            }
        )
    )
    (path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))


def _write_gemma4_processor(path: Path) -> None:
    """mlx-vlm's Gemma 4 processor's files: the tokenizer names its image tokens, and
    an image becomes at most 16 soft tokens (2x2 patches of 16 pixels pooled into one)."""
    write_tokenizer(path, special_tokens=_special_tokens("gemma4"), chat_template=GEMMA4_CHAT_TEMPLATE)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["extra_special_tokens"] = {
        "image_token": "<|image|>",
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (path / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "Gemma4Processor",
                "image_processor": {"patch_size": 16, "max_soft_tokens": 16, "pooling_kernel_size": 2},
            }
        )
    )


def image_array(seed: int = 0, size: tuple[int, int] = (48, 64)) -> np.ndarray:
    """A deterministic RGB image (height, width, 3) with structure a vision tower can see."""
    h, w = size
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([(x * 4 + seed * 40) % 256, (y * 5) % 256, ((x + y) * 3) % 256], axis=-1)
    return ((base + rng.integers(0, 32, size=(h, w, 3))) % 256).astype(np.uint8)


def png(seed: int = 0, size: tuple[int, int] = (48, 64)) -> bytes:
    """`image_array(seed, size)` as a PNG file's bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image_array(seed, size)).save(buf, "PNG")
    return buf.getvalue()
