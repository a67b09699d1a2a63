"""What a chat template loses of an agent's cached history (issue 53, point 2).

The prompt cache serves a turn's prompt from the previous turn's prompt and answer as far
as the new prompt's tokens are the same. An agent sends its history back as parsed
messages (a thinking block, text, tool_use blocks with their JSON arguments), and the
template renders the answer again its own way: a template that drops earlier turns'
reasoning, writes a call differently from how the model wrote it, or rewrites what
surrounds them parts from the cached tokens there, and everything from that token on (the
rest of that answer, and the turns after it) is prefilled again on every turn.

`template_loss` measures it for one tokenizer and its template. Turn 1's prompt (a system
prompt, a tool, the user's request) is rendered as the daemon renders it, then the answer
as the model writes it: the template's own rendering of that assistant turn while it is
the newest message (where templates keep its reasoning: the form they train the model to
write), from the generation prompt on, up to its end-of-turn marker; where the template
renders no reasoning even there, the reasoning is written in front of it with mlx-lm's
thinking markers (as the model would write it after the generation prompt). Those tokens
(the prompt's, then the answer's, each encoded as the tokenizer writes it: a model's
sampled tokens are its tokenizer's own for the text it writes, mostly) are what the cache
holds. Turn 2's prompt is the history with that answer as a client sends it back (its
reasoning resent, as Anthropic's clients resend thinking blocks, or left out, as most
OpenAI chat clients do) and the tool's result, rendered by the template and encoded. The
first position where the two part, and the tokens of turn 1 from there on (the tokens
lost, prefilled again), are the figures.

Imports mlx-lm (its tokenizer wrapper) only through the tokenizer it is given.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ...shared.protocol import ChatMessage
from ..model.chat import turn_end
from ..model.generation import render_chat

SYSTEM = "You are a coding agent. Use the tools to read and change files; answer briefly."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Read",
            "description": "Reads a file from the local filesystem.",
            "parameters": {
                "type": "object",
                "properties": {"file_path": {"type": "string", "description": "The absolute path to the file to read"}},
                "required": ["file_path"],
            },
        },
    }
]
USER = "The test tests/test_parser.py::test_trailing_comma fails. Find out why."
REASONING = "The user wants the failing test fixed. I should read the parser first, then the test."
CONTENT = "Let me read the parser."
CALL = {"name": "Read", "arguments": {"file_path": "/home/user/project/src/parser.py"}}
RESULT = "def parse(text):\n    return [int(x) for x in text.strip('[]').split(',')]"


@dataclass(frozen=True)
class Loss:
    """One way of sending the answer back, measured."""

    resend: str  # "reasoning resent" | "reasoning dropped"
    prompt_tokens: int  # turn 1's prompt
    answer_tokens: int  # the answer as the model writes it
    # Where turn 2's prompt parts from turn 1's prompt and answer (a token position from
    # the start; prompt_tokens + answer_tokens where it does not part from them).
    first_difference: int
    lost_tokens: int  # of turn 1's prompt and answer, from first_difference on
    # The text there: turn 1's (the answer as written) and turn 2's, a few characters each.
    cached_text: str
    resent_text: str

    @property
    def answer_lost(self) -> int:
        """The lost tokens of the answer alone."""
        return min(self.lost_tokens, self.answer_tokens)


HISTORY = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]


def _assistant(reasoning: str | None) -> dict[str, Any]:
    msg = {"role": "assistant", "content": CONTENT, "tool_calls": [CALL]}
    return msg | ({"reasoning": reasoning} if reasoning else {})


def _chat(messages: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    return [
        ChatMessage(
            role=m["role"],
            content=m["content"],
            tool_calls=tuple(m["tool_calls"]) if m.get("tool_calls") else None,
            tool_call_id=m.get("tool_call_id"),
            reasoning=m.get("reasoning"),
        )
        for m in messages
    ]


def _end_markers(tokenizer: Any) -> list[str]:
    """Texts an answer ends with: the end tokens', and where no end token spells it, the
    template's end of a turn (the daemon stops there)."""
    ids = sorted(getattr(tokenizer, "eos_token_ids", None) or ())
    markers = [t for t in (tokenizer.decode([i]) for i in ids) if t]
    end = turn_end(tokenizer)
    return markers + ([end] if end else [])


def generated_text(tokenizer: Any, thinking: bool | None = True) -> str:
    """The answer as the model writes it after turn 1's prompt (see the module's doc)."""
    extra: dict[str, Any] = {"tools": TOOLS} | ({} if thinking is None else {"enable_thinking": thinking})

    def render(messages: Sequence[dict[str, Any]], gen: bool) -> str:
        chat = [m.to_template() for m in _chat(messages)]
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen, **extra)

    before = render(HISTORY, False)
    gen = render(HISTORY, True)[len(before) :]  # the generation prompt
    turn = render([*HISTORY, _assistant(REASONING)], False)[len(before) :]  # the newest turn, as the template writes it
    # Past the tokens the two share (the turn's header), what the template writes is the
    # answer; what the generation prompt writes beyond them (an opened thinking block) the
    # model does not write again.
    turn_ids = tokenizer.encode(turn, add_special_tokens=False)
    shared = _parting(tokenizer.encode(gen, add_special_tokens=False), turn_ids)
    cut = len(tokenizer.decode(turn_ids[:shared])) if shared else 0
    opened, answer = gen[cut:], turn[cut:]
    if opened and answer.startswith(opened):
        answer = answer[len(opened) :]
    if REASONING not in answer and getattr(tokenizer, "has_thinking", False) and thinking is not False:
        # The template leaves the reasoning out of even the newest turn: the model writes
        # it first (after the block the generation prompt opened, or opening its own).
        start, end = tokenizer.think_start, tokenizer.think_end
        rest = answer.removeprefix(end).lstrip("\n") if answer.startswith(end) else answer
        block = f"{REASONING}\n{end}\n\n"
        answer = block + rest if opened.strip().endswith(start) else f"{start}\n{block}{rest}"
    ends = [(answer.rfind(m), m) for m in _end_markers(tokenizer) if m in answer]
    if ends:
        at, marker = max(ends)
        answer = answer[: at + len(marker)]
    return answer


def _parting(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def template_loss(tokenizer: Any, thinking: bool | None = True) -> list[Loss]:
    """The figures of one template (the tokenizer's), for the answer sent back with its
    reasoning and without."""
    prompt_text = render_chat(tokenizer, _chat(HISTORY), TOOLS, thinking=thinking)
    prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
    answer_text = generated_text(tokenizer, thinking)
    answer = tokenizer.encode(answer_text, add_special_tokens=False)
    cached, cached_text = prompt + answer, prompt_text + answer_text
    out = []
    for resend, reasoning in (("reasoning resent", REASONING), ("reasoning dropped", None)):
        result = {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}
        resent_text = render_chat(tokenizer, _chat([*HISTORY, _assistant(reasoning), result]), TOOLS, thinking=thinking)
        d = _parting(cached, tokenizer.encode(resent_text, add_special_tokens=False))
        c = len(tokenizer.decode(cached[:d])) if d else 0
        out.append(
            Loss(
                resend=resend,
                prompt_tokens=len(prompt),
                answer_tokens=len(answer),
                first_difference=d,
                lost_tokens=len(cached) - d,
                cached_text=cached_text[c : c + 24],
                resent_text=resent_text[c : c + 24],
            )
        )
    return out


def call_text_renders(tokenizer: Any) -> bool | None:
    """Whether a resent call's kept text (the gateway's, issue 53) is rendered in place of
    the template's serialisation of it (daemon/model/tool_calls.py `render_call_texts`);
    None for a tokenizer without mlx-lm's tool-call markers (no call is parsed to keep)."""
    from ..model.tool_calls import render_call_texts

    start, end = getattr(tokenizer, "tool_call_start", None), getattr(tokenizer, "tool_call_end", None)
    if not (getattr(tokenizer, "has_tool_calling", False) and start and end):
        return None
    result = {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}
    chat = [m.to_template() for m in _chat([*HISTORY, _assistant(None), result])]
    text = f"{start}\u2063written\u2063{end}"

    def render(c: list[dict[str, Any]]) -> str:
        return tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False, tools=TOOLS)

    out = render_call_texts(tokenizer, chat, {(len(HISTORY), 0): text}, render)
    return out is not None and text in out


def report(name: str, losses: list[Loss], call_text: bool | None = None) -> dict[str, Any]:
    rows = [asdict(x) | {"answer_lost": x.answer_lost} for x in losses]
    return {"template": name, "losses": rows, "call_text_renders": call_text}


def format_losses(rows: list[dict[str, Any]]) -> str:
    lines = [
        "template loss: turn 1's prompt and answer (reasoning, text, a tool call) against turn 2's prompt as the "
        "template renders the answer sent back",
        f"{'template':<24} {'resend':<18} {'prompt':>6} {'answer':>6} {'parts at':>8} {'lost':>5}  cached | resent",
    ]
    for r in rows:
        for x in r["losses"]:
            at = x["first_difference"] - x["prompt_tokens"]
            lines.append(
                f"{r['template']:<24} {x['resend']:<18} {x['prompt_tokens']:>6} {x['answer_tokens']:>6} "
                f"{'+' if at >= 0 else ''}{at:>7} {x['lost_tokens']:>5}  {x['cached_text']!r} | {x['resent_text']!r}"
            )
        renders = {True: "yes", False: "no (the template's serialisation)", None: "no tool-call parser"}
        lines.append(f"{r['template']}: a kept call's text rendered as written: {renders[r['call_text_renders']]}")
    return "\n".join(lines)


def run_template_loss(store: Any, thinking: bool | None = True) -> dict[str, Any]:
    """The figures of the store's own template (its tokenizer, as the daemon loads it)."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(store))
    return report(str(store), template_loss(tokenizer, thinking), call_text_renders(tokenizer))
