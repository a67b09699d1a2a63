"""Constrained decoding: a request's answer held to a grammar while it is sampled.

A `constraint` (JSON, JSON of a schema) or an enforced `tool_choice` (required, a named
function, none) becomes a llguidance grammar, compiled once per request on the prompt
check's thread (`grammar_for`, off the engine thread). The engine then decodes the request
with a `GrammarProcessor` among `generate_step`'s logits processors: before each token is
sampled it sets every token the grammar cannot take next to -inf, and it advances the
grammar by each token chosen. Constraining only masks logits, so a constrained request
makes exactly the tokens of stock mlx-lm's `generate_step` run with the same processor
(tests/test_constrain.py); a request without one has no processor and pays nothing.

llguidance (why it, not xgrammar: daemon/README.md) takes the tokenizer as an
`LLTokenizer`, built once per loaded model (`ll_tokenizer`, cached by the tokenizer). Its
bitmask is applied here with `mx.where`, not with `llguidance.mlx`'s kernel, which is
Metal-only: the same code runs on every MLX backend.
"""

from __future__ import annotations

import json
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from ...shared.protocol import Constraint

# JSON as Python's json.dumps writes it (and the chat templates write tool calls): one
# space after ',' and ':', none elsewhere, so that an answer cannot pad itself forever.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_TOKENIZERS: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def ll_tokenizer(tokenizer: Any) -> LLTokenizer:
    """llguidance's view of mlx-lm's `tokenizer` (its Hugging Face fast tokenizer): built
    on first use for a loaded model, then cached. Logits wider than its vocabulary (a
    model's padded embedding) have their extra tokens masked (`GrammarProcessor.allowed`)."""
    import llguidance.hf

    with _LOCK:
        cached = _TOKENIZERS.get(tokenizer)
        if cached is None:
            eos = sorted(tokenizer.eos_token_ids)
            cached = llguidance.hf.from_tokenizer(tokenizer._tokenizer, eos_token=eos)
            _TOKENIZERS[tokenizer] = cached
        return cached


@dataclass
class Grammar:
    """A request's compiled grammar: the matcher `GrammarProcessor` drives, and what it
    enforces (for the request's statistics)."""

    matcher: LLMatcher
    what: str

    def processor(self) -> GrammarProcessor:
        return GrammarProcessor(self.matcher)


def _json_grammar(schema: Any) -> str:
    return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)


def _lark_json(schema: Any) -> str:
    """A schema as a lark rule's body (`%json`), with JSON_OPTIONS unless it sets its own."""
    with_options = dict(schema) if isinstance(schema, dict) else {}
    with_options.setdefault("x-guidance", JSON_OPTIONS)
    return "%json " + json.dumps(with_options if isinstance(schema, dict) else schema)


def _compiled(tok: LLTokenizer, grammar: str, what: str, problem: str) -> Grammar:
    matcher = LLMatcher(tok, grammar, log_level=0)
    if matcher.is_error():
        raise ValueError(f"{problem}: {matcher.get_error()}")
    return Grammar(matcher, what)


def _tool_call_lark(tokenizer: Any, tools: Sequence[dict[str, Any]], tool_choice: Any) -> str:
    """The rest of the answer after `forced_start` (daemon/model/tool_calls.py) as the
    model's own tool-call markup (mlx-lm's `json_tools` format, Qwen's and the demo's:
    `<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>`): one call of an
    offered function, its arguments matching the function's parameters."""
    end = json.dumps("\n" + tokenizer.tool_call_end)
    if isinstance(tool_choice, dict):
        # The prompt wrote the call up to its arguments: the arguments, then the call's end.
        fn = next(t["function"] for t in tools if t["function"]["name"] == tool_choice["name"])
        return f'start: args "}}" {end}\nargs: {_lark_json(fn.get("parameters") or {"type": "object"})}\n'
    rules = []
    for i, t in enumerate(tools):
        fn = t["function"]
        call = {
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": fn.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        rules.append(f"call{i}: {_lark_json(call)}")
    calls = " | ".join(f"call{i}" for i in range(len(tools)))
    return f'start: "\\n" ({calls}) {end}\n' + "\n".join(rules) + "\n"


def _regex_literal(text: str) -> str:
    return "".join(f"\\x{ord(c):02x}" if ord(c) < 128 else c for c in text)


def _no_tool_call_lark(tokenizer: Any) -> str:
    """Any answer that never writes the tool-call start marker: text without it, and the
    tokenizer's special tokens (a thinking model's markers) but those of a call."""
    start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
    hf = tokenizer._tokenizer
    special = sorted(
        i
        for i, t in hf.added_tokens_decoder.items()
        if t.special and i not in tokenizer.eos_token_ids and start not in t.content and t.content != end
    )
    text = f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{_regex_literal(start)}(.|\\n)*/\n"
    if not special:
        return "start: TEXT\n" + text
    ids = " | ".join(f"<[{i}]>" for i in special)
    return f"start: TEXT (special TEXT)*\nspecial: {ids}\n" + text


def _json_tools(tokenizer: Any) -> bool:
    return getattr(tokenizer.tool_parser, "__module__", "").endswith(".json_tools")


def grammar_for(
    tokenizer: Any,
    constraint: Constraint | None,
    tools: Sequence[dict[str, Any]] | None = None,
    tool_choice: Any = None,
) -> Grammar | None:
    """The request's grammar, compiled; None where nothing constrains its answer.
    Raises ValueError, naming the problem, for a schema llguidance cannot enforce, or a
    forced tool call the model's tool-call format has no grammar for here."""
    if constraint is not None:
        tok = ll_tokenizer(tokenizer)
        if constraint.kind == "json_object":
            return _compiled(tok, _json_grammar({"type": "object"}), "json_object", "json_object")
        try:
            grammar = _json_grammar(constraint.schema)
        except ValueError as e:
            raise ValueError(f"the JSON schema cannot be enforced: {e}") from None
        return _compiled(tok, grammar, "json_schema", "the JSON schema cannot be enforced")
    if not tools or tool_choice in (None, "auto") or not getattr(tokenizer, "has_tool_calling", False):
        return None
    tok = ll_tokenizer(tokenizer)
    if tool_choice == "none":
        return _compiled(tok, LLMatcher.grammar_from_lark(_no_tool_call_lark(tokenizer)), "tool_choice none", "none")
    if not _json_tools(tokenizer):
        raise ValueError(
            f"tool_choice {tool_choice!r}: the model's tool-call format ({tokenizer.tool_parser.__module__}) "
            "has no grammar here; only mlx-lm's json_tools format (<tool_call>{json}</tool_call>) is enforced"
        )
    what = f"tool_choice {tool_choice['name']}" if isinstance(tool_choice, dict) else f"tool_choice {tool_choice}"
    lark = _tool_call_lark(tokenizer, tools, tool_choice)
    return _compiled(tok, LLMatcher.grammar_from_lark(lark), what, "a tool's parameters cannot be enforced")


class GrammarError(RuntimeError):
    """The grammar took a token it did not allow, or refused every token (a bug here)."""


class GrammarProcessor:
    """A logits processor of mlx-lm's signature, `processor(tokens, logits) -> logits`:
    the tokens the grammar cannot take next set to -inf. `tokens` is what
    `generate_step` has fed so far; the first call's length marks the prompt (however
    much of it a cached prefix spared), and every later call brings the token sampled
    since, which the matcher consumes before the next mask."""

    def __init__(self, matcher: LLMatcher) -> None:
        self.matcher = matcher
        self._prompt: int | None = None
        self.consumed = 0
        # Host seconds in this processor (the matcher's steps, the mask built and applied),
        # and its calls: the grammar's own cost per token, which no drift of the machine moves.
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        # The token sampled last must be computed before the grammar can follow it: the
        # one wait a constrained step adds, which `generate_step` otherwise overlaps with
        # building the next step's graph. Not counted in `seconds`, the grammar's own time.
        mx.eval(tokens)
        tic = time.perf_counter()
        try:
            return self._masked(tokens, logits)
        finally:
            self.seconds += time.perf_counter() - tic
            self.calls += 1

    def _masked(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = int(tokens.shape[-1])
        if self._prompt is None:
            self._prompt = n
        else:
            new = tokens[self._prompt + self.consumed :].tolist()
            self.consumed += len(new)
            # Once the grammar has ended only an end token was allowed, which ends the
            # answer: `generate_step` computes one step past it, which the matcher need not see.
            if not self.matcher.is_stopped() and not self.matcher.consume_tokens(new):
                raise GrammarError(f"the grammar refused token(s) {new}: {self.matcher.get_error()}")
        return mx.where(self.allowed(logits.shape[-1]), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def allowed(self, width: int) -> mx.array:
        """The tokens the grammar takes next, as booleans `width` wide."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        if bits.size < width:
            bits = np.concatenate([bits, np.zeros(width - bits.size, dtype=np.uint8)])
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        return mx.array(bits[:width].astype(np.bool_))
