"""One request as `status` lists it (requests.running, requests.waiting): what `moestreamctl
status` and the dashboard's table of requests show. The daemon's engine makes these; a
client reads them back with `RequestInfo.from_dict`. Imports no MLX."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

Phase = Literal["queued", "prefill", "decode", "paused"]
PHASES: tuple[Phase, ...] = ("queued", "prefill", "decode", "paused")


@dataclass(frozen=True)
class RequestInfo:
    id: str
    # Who sent it: the name a client gave (generate's `client`), else its connection as
    # the daemon's log names it.
    client: str
    # queued: waiting for its prompt's check or a turn; prefill: its prompt is being
    # processed (no token yet); decode: it has made its first token; paused: its client
    # reads none of its replies (not stepped until it does, cancelled after a while).
    phase: Phase
    # The prompt's tokens (None until its prompt is checked), and while it is prefilled,
    # how many of them are done of how many it prefills (a cached prefix is not prefilled).
    prompt_tokens: int | None
    prefilled_tokens: int | None
    prefill_total: int | None
    tokens: int  # made so far
    max_tokens: int
    seconds: float  # since the daemon received it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RequestInfo":
        """From `status` (a daemon that predates a field leaves it None, or unknown)."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = dict.fromkeys(known)
        values.update({k: v for k, v in d.items() if k in known})
        values["client"] = values["client"] or "unknown"
        values["tokens"] = int(values["tokens"] or 0)
        values["max_tokens"] = int(values["max_tokens"] or 0)
        values["seconds"] = float(values["seconds"] or 0.0)
        if values["phase"] not in PHASES:
            values["phase"] = "decode" if values["tokens"] else "prefill"
        return cls(**values)
