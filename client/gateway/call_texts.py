"""The text the model wrote for each tool call the gateway answered with, kept by the call
id the gateway gave it, so that a later request that resends the call (an agent's next
turn) has it rendered as the model wrote it.

Why: a client sends a call back as its name and arguments (a tool_use block, an OpenAI
tool_calls entry), and the chat template serialises them its own way (its JSON spacing,
key order, escaping), which need not be the tokens the model sampled; the prompt then
parts from the daemon's cached tokens at the call, and everything after it is prefilled
again on every turn (issue 53). With the call's text, the daemon renders that call as it
was sampled (daemon/model/tool_calls.py `render_call_texts`).

A kept text is used only for a call with the same id, the same name and arguments equal
as parsed JSON: a client that edits the call gets the template's rendering of its edit.
Bounded: at most PER_CLIENT calls for each client identity (Anthropic's
`metadata.user_id`, OpenAI's `user`, the Responses API's `prompt_cache_key`; "" for
clients that send none), least recently used first out, at most CLIENTS identities, and
MAX_CHARS characters of text in all (a Write call's text holds a whole file). In memory
only: after a gateway restart the template renders the calls again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

PER_CLIENT = 512
CLIENTS = 64
MAX_CHARS = 32 << 20


@dataclass(frozen=True)
class KeptCall:
    name: str
    arguments: Any  # the parsed JSON of the call's arguments
    text: str


class CallTexts:
    """Thread-safe: the gateway's request threads and its event loop share it."""

    def __init__(self, per_client: int = PER_CLIENT, clients: int = CLIENTS, max_chars: int = MAX_CHARS) -> None:
        self._per_client = per_client
        self._clients = clients
        self._max_chars = max_chars
        self._chars = 0
        self._kept: OrderedDict[str, OrderedDict[str, KeptCall]] = OrderedDict()
        self._lock = threading.Lock()

    def keep(self, client: str, call_id: str, name: str, arguments: str, text: str | None) -> None:
        """Keep `text` (None: nothing to keep) for the call `call_id`, whose arguments are
        the JSON text `arguments`."""
        if text is None or len(text) > self._max_chars:
            return
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return
        with self._lock:
            calls = self._kept.pop(client, None) or OrderedDict()
            self._kept[client] = calls
            old = calls.pop(call_id, None)
            self._chars += len(text) - (len(old.text) if old else 0)
            calls[call_id] = KeptCall(name, parsed, text)
            while len(calls) > self._per_client:
                self._chars -= len(calls.popitem(last=False)[1].text)
            while len(self._kept) > self._clients:
                self._chars -= sum(len(c.text) for c in self._kept.popitem(last=False)[1].values())
            while self._chars > self._max_chars:  # the least recent client's oldest calls first
                oldest = next(iter(self._kept.values()))
                self._chars -= len(oldest.popitem(last=False)[1].text)
                if not oldest:
                    self._kept.popitem(last=False)

    def find(self, client: str, call_id: Any, name: str, arguments: Any) -> str | None:
        """The kept text of call `call_id` if it is still the call that was answered
        (same name, arguments equal as JSON), else None."""
        if not isinstance(call_id, str):
            return None
        with self._lock:
            calls = self._kept.get(client)
            kept = calls.get(call_id) if calls is not None else None
            if kept is None or kept.name != name or not same_json(kept.arguments, arguments):
                return None
            calls.move_to_end(call_id)
            self._kept.move_to_end(client)
            return kept.text

    def __len__(self) -> int:
        with self._lock:
            return sum(len(c) for c in self._kept.values())


def same_json(a: Any, b: Any) -> bool:
    """Whether two parsed JSON values are the same value: numbers by value (1 and 1.0,
    which a JavaScript client writes back as 1), but true is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b
