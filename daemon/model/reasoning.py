"""A thinking model's reasoning, split from its answer as the text comes.

mlx-lm finds a model's thinking markers when it loads the tokenizer
(`mlx_lm.tokenizer_utils`: `<think>` / `</think>` and the other pairs it knows, in
`think_start` / `think_end`); its server splits a chat's text on them with
`mlx_lm.generate.TextStateMachine`, starting in reasoning where the rendered prompt
leaves a thinking block open (a template that writes `<think>` itself). The daemon does
the same per request, so that each API can send the reasoning in its own shape (and
tool calls are parsed from the answer only, `daemon/model/tool_calls.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from mlx_lm.generate import TextStateMachine

REASONING = "reasoning"
ANSWER = "normal"  # mlx-lm's name for the state outside thinking and tool calls


def opens_thinking(tokenizer: Any, prompt_ids: Sequence[int]) -> bool | None:
    """Whether the answer starts inside a thinking block: the prompt's last think-start
    marker comes after its last think-end marker (or the tokenizer's response format says
    so), as mlx-lm's server decides; None for a tokenizer without thinking markers."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    initial = getattr(tokenizer, "response_initial_state", None)
    if initial is not None:
        return initial == REASONING
    start = tokenizer.rfind_think_start(prompt_ids)
    return start >= 0 and start > tokenizer.rfind_think_end(prompt_ids, start=start)


@dataclass
class ReasoningSplitter:
    """Splits the answer's text, fed as it comes, into reasoning and answer pieces, the
    markers taken out. Text that might be the start of a marker is held until it cannot
    be; whitespace right after a marker (and at the start of reasoning the prompt opened)
    is dropped, as the model writes it only to lay out its markers."""

    start: str
    end: str
    reasoning: bool  # the answer starts inside a thinking block
    fed: int = 0  # characters fed so far
    thought: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    _state: Any = None
    _eat: bool = False  # drop leading whitespace: a marker was just passed

    def __post_init__(self) -> None:
        machine = TextStateMachine({ANSWER: [(self.start, REASONING)], REASONING: [(self.end, ANSWER)]})
        self._state = machine.make_state(REASONING if self.reasoning else ANSWER)
        self._eat = self.reasoning

    def feed(self, segment: str) -> list[tuple[bool, str]]:
        """(is reasoning, text) pieces that can be sent now, in order."""
        self.fed += len(segment)
        self._state, segments = TextStateMachine.split(self._state, segment)
        return self._pieces(segments)

    def finish(self) -> list[tuple[bool, str]]:
        """At the end of the answer: text held as a possible marker's start."""
        self._state, rest, state = TextStateMachine.flush(self._state)
        return self._pieces([(state, rest)])

    @property
    def reasoning_text(self) -> str:
        return "".join(self.thought)

    @property
    def answer_text(self) -> str:
        return "".join(self.answer)

    def _pieces(self, segments: list[tuple[str, str]]) -> list[tuple[bool, str]]:
        out: list[tuple[bool, str]] = []
        for i, (state, text) in enumerate(segments):
            if i > 0:  # split() starts a new segment at each marker passed
                self._eat = True
            if self._eat:
                text = text.lstrip()
                self._eat = not text
            if not text:
                continue
            thinking = state == REASONING
            (self.thought if thinking else self.answer).append(text)
            if out and out[-1][0] == thinking:
                out[-1] = (thinking, out[-1][1] + text)
            else:
                out.append((thinking, text))
        return out


def reasoning_splitter(tokenizer: Any, opens: bool | None) -> ReasoningSplitter | None:
    """A splitter for a chat's answer (None for a model without thinking markers)."""
    if opens is None or not getattr(tokenizer, "has_thinking", False):
        return None
    return ReasoningSplitter(start=tokenizer.think_start, end=tokenizer.think_end, reasoning=opens)
