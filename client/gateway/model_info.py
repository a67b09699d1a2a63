"""The daemon's model as the APIs name and describe it, from its status: shared by the
OpenAI routes (openai.py) and Ollama's (ollama.py), below both."""

from __future__ import annotations

from pathlib import Path

from ...shared.status import Status

MODEL_ALIAS = "moestream"
DEMO_MODEL_ID = "moestream-demo"


def model_id(st: Status, demo_store_id: str | None) -> str:
    """The model's id in the API, from the daemon's status: the store folder's name, or
    "moestream-demo" for the built-in demo model wherever its store lies (its id says so)."""
    store = st.model
    if not store:
        return MODEL_ALIAS
    if demo_store_id is not None and st.store_id == demo_store_id:
        return DEMO_MODEL_ID
    return Path(store).name


def capabilities(st: Status) -> list[str]:
    """What the daemon's model takes, in Ollama's words (completion, tools, thinking, vision)."""
    caps = st.capabilities or {}
    return ["completion", *(name for name in ("tools", "thinking", "vision") if caps.get(name))]


def context_length(st: Status) -> int | None:
    """Tokens per request, prompt and answer (None before the model's first load)."""
    return st.context.tokens if st.context is not None else None
