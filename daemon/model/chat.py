"""What a model's chat template says about a chat beyond the prompt it renders: where an
answer ends when no end token spells it (`turn_end`)."""

from __future__ import annotations

from typing import Any

from jinja2 import TemplateError

_SENTINEL = "\u2063moestream-answer\u2063"


def turn_end(tokenizer: Any) -> str | None:
    """The text the chat template puts after an assistant's answer (ChatML's
    `<|im_end|>`), where the tokenizer has no end token of that text: a model whose
    vocabulary spells it in pieces (the demo's) would otherwise write past its turn, and
    the marker would reach the client. None where an end token covers it, or the template
    puts nothing there."""
    if not getattr(tokenizer, "has_chat_template", False):
        return None
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(chat, tokenize=False)
    except (TemplateError, ValueError, TypeError, KeyError):
        return None
    at = text.find(_SENTINEL)
    if at < 0:
        return None
    marker = text[at + len(_SENTINEL) :].split("\n", 1)[0].strip()
    if not marker:
        return None
    ids = tokenizer.encode(marker, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in tokenizer.eos_token_ids:
        return None
    return marker
