"""Keep-alives of a streamed answer while its prompt is prefilled.

A coding agent's prompt of 25-35k tokens may prefill for minutes on a partial pool, and
its client gives up after a few minutes without a byte. The gateway sends the status
line once the daemon has accepted the prompt (its `accepted` event), then, until the
first token, one `KeepAlive` every `KEEP_ALIVE_SECONDS` in each API's own form: an SSE
comment on the OpenAI routes (which also says how far the prefill is: OpenAI's chunks
have no place for that), Anthropic's `ping` event, and nothing on Ollama's NDJSON (it has
no comment line, and Ollama's own server sends nothing while it evaluates a prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

# Under half of the 10 s bound a client may meet, so one late turn of the event loop
# never makes a gap of 10 s.
KEEP_ALIVE_SECONDS = 5.0


@dataclass(frozen=True)
class KeepAlive:
    """No byte for `KEEP_ALIVE_SECONDS` before the first token: send a keep-alive. The
    prefill's progress (prompt tokens in the cache, of how many), where known."""

    prefilled: int | None = None
    prompt_tokens: int | None = None

    def sse_comment(self) -> str:
        """An SSE comment line, which every SSE client skips."""
        if self.prefilled is None or not self.prompt_tokens:
            return ": keep-alive\n\n"
        return f": keep-alive, prefill {self.prefilled}/{self.prompt_tokens} tokens\n\n"
