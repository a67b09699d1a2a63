"""A tiny thinking model as an expert store, for the tests of reasoning (thinking blocks,
`reasoning_content`, Ollama's `thinking`) and of coding agents' requests.

`make_thinking_store(root)` writes a tiny 4-bit qwen3_moe (tests/tiny_models.py) whose
tokenizer has `<think>` and `</think>` as tokens of their own (so mlx-lm's tokenizer
wrapper finds its thinking markers: `has_thinking`) and a Qwen3-style chat template with
tools, a system message anywhere, earlier turns' `reasoning_content`, and the thinking
switch `enable_thinking`: on (mlx-lm's default for such a model), the template opens the
answer's `<think>` block itself, as Qwen3-Thinking's and DeepSeek-R1's do, so the answer
starts in reasoning; off, it writes an empty block, so the answer starts as the answer.

Random weights seldom write `</think>`, so one row of the output layer is made to: the
builder finds a token `t` that the model writes greedily a few tokens into its answer to
`CHAT` and gives `</think>` a scaled copy of `t`'s row (every logit of `</think>` is the
logit of `t` times THINK_END_GAIN), so that the greedy answer to `CHAT` has some
reasoning, then `</think>` (once), then an answer. The store is built the same on every
run (fixed seed).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tiny_models import EOS_TOKEN, SPECIAL_TOKENS, make_tiny_model, tiny_config, write_tokenizer

SEED = 5
THINK_START, THINK_END = "<think>", "</think>"
THINK_END_GAIN = 1.05
# The chat whose greedy answer reasons, closes its reasoning and answers (see above).
CHAT = [
    {"role": "system", "content": "You are a helpful assistant. Think first, then answer."},
    {"role": "user", "content": "What is the capital of France?"},
]
# Tokens of the greedy answer to CHAT in which `</think>` comes once, after at least 3.
THINK_WITHIN = 24
# Two MoE layers of one attention head: coding agents' prompts run to 9,500 tokens here,
# where attention is most of a CPU prefill's time (3 layers of 4 heads: 30 s, this: 9 s).
LEAN = {"num_hidden_layers": 2, "mlp_only_layers": [], "num_attention_heads": 1, "num_key_value_heads": 1}

# Qwen3's template, cut to what the tests need; the generation prompt opens <think> itself
# (Qwen3-Thinking-2507, DeepSeek-R1) unless `enable_thinking` is false.
CHAT_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content %}<think>
{{ message.reasoning_content.strip() }}
</think>

{% endif %}{{ message.content or '' }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}
{%- if loop.first and message.content %}
{% endif %}<tool_call>
{"name": {{ tool_call.name | tojson }}, "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

# Text the tokenizer learns its merges from: chat, code and tool-call JSON, as the tests send.
_TEXT = """
You are a helpful assistant. Think first, then answer. What is the capital of France?
Paris is the capital of France. The user wants to read a file, so I will call the tool.
<tool_call>
{"name": "Read", "arguments": {"file_path": "/home/user/project/main.py"}}
</tool_call>
<tool_response>
def main():
    print("hello, world")
</tool_response>
The function prints a greeting. Let me run the tests with the Bash tool: python -m pytest -x -q tests
and look at the output. The command failed with an error; the file does not exist. Edit the file,
replace the old string with the new string, and write the result. Search the code for the pattern
with Grep and Glob; list the files in the folder. Todo: fix the bug, add a test, update the README.
Numbers and dates: 1, 2, 3, 10, 42, 100, 256, 1024. {"type": "object", "properties": {"path":
{"type": "string", "description": "The absolute path"}}, "required": ["path"]}
"""


def write_thinking_tokenizer(path: Path) -> None:
    """The tokenizer of the thinking model (tiny_models' with the thinking markers)."""
    write_tokenizer(
        path, special_tokens=(*SPECIAL_TOKENS, THINK_START, THINK_END), chat_template=CHAT_TEMPLATE, text=_TEXT
    )


def _greedy(model_dir: Path, n: int) -> list[int]:
    """Stock mlx-lm's greedy answer to CHAT (thinking on), n tokens."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model, tokenizer = load(str(model_dir))
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
        out.append(int(token))
    return out


def _copy_row(model_dir: Path, src: int, dst: int, gain: float) -> None:
    """Row `dst` of the quantized output layer becomes `gain` x row `src`."""
    import mlx.core as mx

    file = model_dir / "model.safetensors"
    weights = dict(mx.load(str(file)))
    weights["lm_head.weight"][dst] = weights["lm_head.weight"][src]
    for name in ("lm_head.scales", "lm_head.biases"):
        weights[name][dst] = weights[name][src] * gain
    mx.save_safetensors(str(file), weights, metadata={"format": "mlx"})


def make_thinking_model(path: Path, lean: bool = True) -> Path:
    """The tiny thinking model in the mlx-community layout at `path` (see the module's doc);
    `lean=False`: the usual tiny qwen3_moe's 3 layers of 4 heads."""
    config = tiny_config("qwen3_moe") | (LEAN if lean else {})
    make_tiny_model(path, "qwen3_moe", quant="4bit", seed=SEED, config=config)
    write_thinking_tokenizer(path)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    end = vocab[THINK_END]
    special = {vocab[t] for t in (*SPECIAL_TOKENS, THINK_START, THINK_END) if t in vocab}
    answer = _greedy(path, THINK_WITHIN)
    pristine = path / "model.safetensors.orig"
    shutil.copyfile(path / "model.safetensors", pristine)
    # The first token from the fourth on, not written before it, whose row makes the
    # greedy answer close its reasoning once, after 3 tokens or more.
    for k in range(3, len(answer)):
        t = answer[k]
        if t in special or t in answer[:k]:
            continue
        shutil.copyfile(pristine, path / "model.safetensors")
        _copy_row(path, t, end, THINK_END_GAIN)
        closed = [i for i, x in enumerate(_greedy(path, THINK_WITHIN)) if x == end]
        if len(closed) == 1 and closed[0] >= 3:
            pristine.unlink()
            return path
    raise AssertionError(f"no token of the greedy answer {answer} makes the model close its reasoning")


def make_thinking_store(root: Path, lean: bool = True) -> Path:
    """`root/store`: the tiny thinking model converted to an expert store."""
    from moestream.daemon.store.convert import convert_model

    convert_model(make_thinking_model(root / "model", lean), root / "store")
    return root / "store"


def load_thinking_tokenizer(store: Path) -> Any:
    """mlx-lm's tokenizer wrapper of the store (what the daemon loads)."""
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(store)


__all__ = [
    "CHAT",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "THINK_END",
    "THINK_START",
    "load_thinking_tokenizer",
    "make_thinking_model",
    "make_thinking_store",
]
