"""Tool calls: the prompt's forced start for `tool_choice`, and the model's tool-call text
split from its answer and parsed with the model's own mlx-lm tool parser.

mlx-lm picks a model's parser when it loads the tokenizer (`tokenizer_config.json`'s
`tool_parser_type`, else inferred from the chat template: `mlx_lm.tokenizer_utils`); the
wrapper carries it with the call's start and end markers. The parsers import MLX, which
the clients never do, so the daemon parses and sends parsed calls in the protocol.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

log = logging.getLogger("moestream.tools")


def forced_start(tokenizer: Any, tool_choice: Any) -> str:
    """Text appended to the rendered prompt so that the answer is a tool call: the call's
    start marker for "required", and for a named function, with mlx-lm's `json_tools`
    format, the call's JSON up to its arguments. "" for auto / none / no choice."""
    if tool_choice in (None, "auto", "none") or not getattr(tokenizer, "has_tool_calling", False):
        return ""
    start = tokenizer.tool_call_start
    if isinstance(tool_choice, dict) and getattr(tokenizer.tool_parser, "__module__", "").endswith(".json_tools"):
        return f'{start}\n{{"name": {json.dumps(tool_choice["name"])}, "arguments": '
    return start


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        json.loads(value)  # a parser may hand back the arguments' text: it must be JSON
        return value
    return json.dumps(value, ensure_ascii=False)


def _common_prefix_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a start of `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class ToolCallSplitter:
    """Splits the answer's text, fed as it comes, into plain text and parsed tool calls.

    Text that might begin a call's start marker is held back until it cannot; a call's
    text is held until its end marker (or the end of the answer), then parsed. A call
    that does not parse is given back as the text it was, so nothing the model wrote is
    lost. `forced` is the part of a call the prompt already wrote (`forced_start`)."""

    start: str
    end: str
    parse: Callable[[str, Any], Any]
    tools: Sequence[dict[str, Any]] | None = None
    forced: str = ""
    fed: int = 0  # characters fed so far
    text: list[str] = field(default_factory=list)  # the plain text, in pieces
    calls: list[dict[str, str]] = field(default_factory=list)
    _held: str = ""
    _call: str | None = None  # the current call's text after its start marker; None outside one

    def __post_init__(self) -> None:
        if self.forced:
            self._call = self.forced[len(self.start) :] if self.forced.startswith(self.start) else self.forced

    def feed(self, segment: str) -> tuple[str, list[dict[str, str]]]:
        """Plain text that can be sent now and the calls completed by `segment`."""
        self.fed += len(segment)
        buf = self._held + segment
        self._held = ""
        out: list[str] = []
        new: list[dict[str, str]] = []
        while buf:
            if self._call is not None:
                body = self._call + buf
                at = body.find(self.end)
                if at < 0:
                    self._call, buf = body, ""
                    break
                self._close(body[:at], out, new, closed=True)
                buf = body[at + len(self.end) :]
                continue
            at = buf.find(self.start)
            if at >= 0:
                out.append(buf[:at])
                self._call, buf = "", buf[at + len(self.start) :]
                continue
            keep = _common_prefix_tail(buf, self.start)
            out.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep :]
            break
        plain = "".join(out)
        self.text.append(plain)
        return plain, new

    def finish(self) -> tuple[str, list[dict[str, str]]]:
        """At the end of the answer: held text, and a call the answer left open (parsed
        if it parses: a model may stop right after the call's JSON)."""
        out = [self._held]
        self._held = ""
        new: list[dict[str, str]] = []
        if self._call is not None:
            self._close(self._call, out, new, closed=False)
        plain = "".join(out)
        self.text.append(plain)
        return plain, new

    @property
    def content(self) -> str:
        return "".join(self.text)

    def _close(self, body: str, out: list[str], new: list[dict[str, str]], *, closed: bool) -> None:
        self._call = None
        calls = self._parse(body)
        if calls is None:
            out.append(self.start + body + (self.end if closed else ""))
            return
        if closed and len(calls) == 1:
            # The call as the model wrote it: a later turn that resends it is rendered
            # with this text rather than the template's serialisation (`render_call_texts`).
            calls[0]["text"] = self.start + body + self.end
        self.calls.extend(calls)
        new.extend(calls)

    def _parse(self, body: str) -> list[dict[str, str]] | None:
        try:
            parsed = self.parse(body, list(self.tools) if self.tools else None)
            items = parsed if isinstance(parsed, list) else [parsed]
            calls = []
            for item in items:
                name = item.get("name") if isinstance(item, dict) else None
                if not isinstance(name, str) or not name:
                    raise ValueError(f"a tool call without a name: {item!r}")
                calls.append({"name": name, "arguments": _arguments(item.get("arguments", {}))})
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # JSONDecodeError is a ValueError
            log.info("a tool call that does not parse is kept as text: %s: %s", type(e).__name__, e)
            return None
        return calls


def splitter_for(tokenizer: Any, tools: Sequence[dict[str, Any]] | None, tool_choice: Any) -> ToolCallSplitter | None:
    """A splitter for a request with tools (None: no tools, tool_choice none, or a model
    whose tokenizer has no tool parser: then its text is plain text)."""
    if not tools or tool_choice == "none" or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return ToolCallSplitter(
        start=tokenizer.tool_call_start,
        end=tokenizer.tool_call_end,
        parse=tokenizer.tool_parser,
        tools=tools,
        forced=forced_start(tokenizer, tool_choice),
    )


def render_call_texts(
    tokenizer: Any,
    chat: list[dict[str, Any]],
    texts: dict[tuple[int, int], str],
    render: Callable[[list[dict[str, Any]]], str],
) -> str | None:
    """The chat rendered by `render` with each tool call that has a text in `texts`
    ((message index, call index) -> the call's text as the model wrote it) written as
    that text in place of the template's serialisation of it: a resent turn then has
    the tokens the model sampled (its JSON's spacing and key order), and the prompt cache
    serves every token up to the tool's result.

    The template renders the chat with each such call's name replaced by a marker name;
    the span from the start marker before it (`tool_call_start`) to the end marker after
    it is the call, replaced by its text. None where that cannot be done exactly, and the
    caller renders the template's way: a tokenizer without both markers, a text that is
    not one whole call between them, a template that writes the name more than once (a
    tool result's header, say) or not between the markers."""
    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if not (start and end) or not all(t.startswith(start) and t.endswith(end) for t in texts.values()):
        return None
    nonce = uuid.uuid4().hex[:12]
    marked = [dict(m) for m in chat]
    names: dict[str, str] = {}
    for (i, j), text in texts.items():
        calls = [dict(c) for c in marked[i]["tool_calls"]]
        name = f"moestream_call_{nonce}_{i}_{j}"
        calls[j] = calls[j] | {"function": calls[j]["function"] | {"name": name}}
        marked[i]["tool_calls"] = calls
        names[name] = text
    rendered = render(marked)
    spans = []
    for name, text in names.items():
        at = rendered.find(name)
        if at < 0 or rendered.find(name, at + 1) >= 0:
            return None
        a, b = rendered.rfind(start, 0, at), rendered.find(end, at)
        if a < 0 or b < 0 or rendered.find(end, a, at) >= 0:
            return None
        spans.append((a, b + len(end), text))
    spans.sort()
    if any(prev[1] > nxt[0] for prev, nxt in zip(spans, spans[1:])):
        return None
    out, pos = [], 0
    for a, b, text in spans:
        out += [rendered[pos:a], text]
        pos = b
    return "".join(out) + rendered[pos:]
