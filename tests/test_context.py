"""A request's context (daemon/pool/capacity.py `context_limit`): `max_context` defaults to
the model's own context length, at most what the memory budget (else the device's memory)
leaves for KV caches once the model and its pool are in; a prompt that fills it is
refused, a `max_tokens` past it is cut to the room left and the answer ends with finish
reason "length" (an agent asks for 32000 tokens beside a 30k-token prompt)."""

from __future__ import annotations

import anthropic
import pytest
from daemon_cli import started_daemon
from test_openai_gateway import Gateway
from tiny_models import tiny_store

from moestream.client.client import Client, RequestRejected
from moestream.daemon.pool.capacity import (
    FALLBACK_CONTEXT,
    KV_RESERVE_TOKENS,
    context_limit,
    kv_cache_bytes,
    kv_reserve_tokens,
    model_context,
)
from moestream.shared import protocol as proto
from moestream.shared.settings import Settings

GIB = 1 << 30
# A 32-layer model of 8 KV heads of 128: 128 KiB of KV per token.
CONFIG = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
}


def test_the_default_is_the_models_context_at_most_what_the_memory_left_holds():
    per_token = kv_cache_bytes(CONFIG, 1)
    assert per_token == 128 * 1024
    # Room for more than the model's context: the model's.
    c = context_limit(CONFIG, None, 64 * GIB, None, 40 * GIB)
    assert (c.tokens, c.bound, c.memory, c.kv_room_bytes) == (131072, "model", "memory_budget", 24 * GIB)
    # Room for less: what it holds (2 GiB of KV: 16384 tokens).
    c = context_limit(CONFIG, None, 42 * GIB, None, 40 * GIB)
    assert (c.tokens, c.bound, c.model_tokens) == (16384, "memory", 131072)
    # No budget: the device's memory bounds it the same way.
    c = context_limit(CONFIG, None, None, (41 * GIB, "device memory (memory_size)"), 40 * GIB)
    assert (c.tokens, c.bound, c.memory) == (8192, "memory", "device memory (memory_size)")
    # None left at all: the least context a setting may give, not 0.
    assert context_limit(CONFIG, None, 30 * GIB, None, 40 * GIB).tokens == 16
    # Set: max_context, whatever the memory (the pool was sized to leave room for it).
    c = context_limit(CONFIG, 4096, 42 * GIB, None, 40 * GIB)
    assert (c.tokens, c.bound, c.kv_room_bytes) == (4096, "max_context", 2 * GIB)
    # A config that names no context length, and no memory known.
    c = context_limit({k: v for k, v in CONFIG.items() if k != "max_position_embeddings"}, None, None, None, 0)
    assert (c.tokens, c.model_tokens, c.kv_room_bytes) == (FALLBACK_CONTEXT, None, None)


def test_the_models_context_and_the_room_a_budget_keeps_for_it():
    assert model_context({"text_config": {"max_position_embeddings": 262144}, "max_position_embeddings": 8}) == 262144
    assert model_context({"seq_length": 4096}) == 4096
    assert model_context({"hidden_size": 64}) is None
    # Sizing the pool, a budget keeps room for max_context where it is set, else the
    # model's context up to an agent's.
    assert kv_reserve_tokens(CONFIG, 2048) == 2048
    assert kv_reserve_tokens(CONFIG, None) == KV_RESERVE_TOKENS
    assert kv_reserve_tokens({"max_position_embeddings": 4096}, None) == 4096
    assert Settings.resolve({}).max_context is None


@pytest.fixture(scope="module")
def store():
    with tiny_store("msctx") as path:
        yield path


@pytest.fixture(scope="module")
def daemon(store):
    with started_daemon(store, "msctx", "--capacity", "4") as paths:
        yield paths


def test_a_daemon_cuts_max_tokens_to_the_context_and_refuses_a_prompt_that_fills_it(daemon):
    """A real daemon with default settings: its context is the tiny model's 512 tokens
    (status says so and why); a request for 100000 tokens is served and ends "length"
    where the context is full; a prompt of 512 tokens or more is refused, clearly."""
    with Client(daemon, timeout=120) as c:
        context = c.status().context.to_dict()
        assert context["tokens"] == context["model_tokens"] == 512 and context["bound"] == "model"
        assert context["kv_bytes_per_token"] > 0 and context["kv_room_bytes"] > 512 * context["kv_bytes_per_token"]
        prompt = [5, 17, 99, 3, 250, 11, 42]
        done = c.complete(prompt_ids=prompt, max_tokens=100_000, temp=0.0)
        assert done.finish_reason == "length"
        assert done.stats.prompt_tokens == len(prompt) and len(done.tokens) == 512 - len(prompt)
        for n in (512, 600):
            with pytest.raises(RequestRejected) as info:
                c.complete(prompt_ids=[5] * n, max_tokens=1)
            assert info.value.code == proto.TOO_LONG
            assert f"prompt of {n} tokens leaves no room in the daemon's context of 512 tokens" in str(info.value)
        # The longest prompt that fits makes its one token.
        done = c.complete(prompt_ids=[5] * 511, max_tokens=32000, temp=0.0)
        assert done.finish_reason == "length" and len(done.tokens) == 1


def test_a_budget_says_what_it_leaves_for_kv(store):
    """With a memory budget, `status` reports the room the budget leaves once the model
    holds its weights and pool: the budget less those (the prompt cache is off here), and
    the context is what the room holds, at most the model's."""
    budget = 64 << 20
    flags = ("--memory-budget", str(budget), "--prompt-cache-bytes", "0")
    with started_daemon(store, "msctx", *flags) as paths, Client(paths, timeout=60) as c:
        st = c.status()
        context, memory = st.context.to_dict(), st.memory.to_dict()
        assert context["memory"] == "memory_budget"
        full = st.capacity >= st.experts_per_layer  # 64 MiB holds every expert of the tiny model
        assert full
        assert context["kv_room_bytes"] == budget - memory["resident_weights_bytes"] - memory["pool_bytes"]
        fits = context["kv_room_bytes"] // context["kv_bytes_per_token"]
        assert context["tokens"] == min(512, fits)


def test_an_agents_max_tokens_past_the_context_ends_as_max_tokens_through_the_gateway(daemon):
    """Claude Code asks for max_tokens 32000 whatever its prompt: through the Anthropic API
    the answer comes, cut where the context is full, with stop_reason "max_tokens"."""
    gateway = Gateway(daemon.dir, daemon.dir / "gateway.log")
    try:
        claude = anthropic.Anthropic(base_url=gateway.url, api_key="unused-on-loopback", max_retries=0)
        # Streamed, as Claude Code asks (the SDK asks it of any max_tokens this large).
        with claude.messages.stream(
            model="moestream",
            max_tokens=32000,
            messages=[{"role": "user", "content": "Tell me everything about the weather."}],
            extra_body={"temperature": 0},  # greedy (this SDK has no argument for it)
        ) as stream:
            answer = stream.get_final_message()
        assert answer.stop_reason == "max_tokens"
        assert answer.usage.input_tokens + answer.usage.output_tokens == 512
    finally:
        gateway.stop()
