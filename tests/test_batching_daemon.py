"""Continuous batching through the real daemon (`--max-batch`): eight clients at once,
greedy, sampled with seeds, and cancelled, each get exactly what they get alone."""

from __future__ import annotations

import threading
import time

import pytest
from daemon_cli import started_daemon, wait_for
from tiny_models import tiny_store

from moestream.client.client import Client, Token
from moestream.daemon.model.generation import SamplingParams, encode_prompt, generate
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.shared import protocol as proto
from moestream.shared.settings import Settings

TOKENS = 24
# The cancelled requests' max_tokens: neither ends by itself within them (checked alone), so
# a cancel sent after a few tokens lands first on however loaded a machine (with 24, a slow
# client's cancel once came after the last token).
CANCELLED_TOKENS = 400
# (prompt, temperature, seed, cancel after this many token events or None)
REQUESTS = [
    ("def route(hidden, gate, k=2):", 0.0, None, None),
    ("import numpy as np", 0.0, None, None),
    ("class Pool:", 0.8, 11, None),
    ("for i in range(10):", 1.0, 12, None),
    ("def f(x):", 0.0, None, 3),
    ("# a comment", 0.7, 13, None),
    ("while True:", 0.0, None, None),
    ("return x", 1.0, 15, 2),
]

# What `status` says while a request waits in the queue for its turn.
WAIT_WHYS = ("the batch is full", "its prompt is being checked", "the KV caches would pass the memory budget")


def _run_watching(paths, work: list[threading.Thread], read) -> list:
    """Run the `work` threads to their end while another client polls `status`; what
    `read(status)` gave at each poll."""
    seen: list = []
    stop = threading.Event()

    def watch() -> None:
        with Client(paths, timeout=60) as c:
            while not stop.is_set():
                seen.append(read(c.status()))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in work:
        t.start()
    for t in work:
        t.join(120)
    stop.set()
    watcher.join(30)
    return seen


def _greedy_clients(paths, prompts: list[str], results: dict) -> list[threading.Thread]:
    """A client thread per prompt, each sending it greedy once all are ready; each
    request's outcome goes into `results` by prompt."""
    barrier = threading.Barrier(len(prompts))

    def run(prompt: str) -> None:
        with Client(paths, timeout=60) as c:
            barrier.wait()
            stream = c.generate(prompt, max_tokens=TOKENS)
            list(stream)
            results[prompt] = stream.done

    return [threading.Thread(target=run, args=(p,)) for p in prompts]


@pytest.fixture(scope="module")
def store():
    with tiny_store("msbatch") as path:
        yield path


@pytest.fixture(scope="module")
def alone(store):
    """Each request decoded on its own, in process, with the daemon's settings."""
    sm = load_streaming_model(store, Settings(capacity=0.5))
    try:
        out = {}
        for prompt, temp, seed, cancel in REQUESTS:
            ids = encode_prompt(sm, prompt, None)
            tokens = TOKENS if cancel is None else CANCELLED_TOKENS
            out[prompt] = generate(sm, ids, SamplingParams(max_tokens=tokens, temp=temp, seed=seed))
        return out
    finally:
        sm.close()


def test_eight_mixed_clients_in_one_batch_get_their_alone_outputs(store, alone):
    with started_daemon(store, "msbt", "--capacity", "0.5", "--max-batch", "4") as paths:
        results: dict[int, object] = {}
        failures: list[BaseException] = []
        barrier = threading.Barrier(len(REQUESTS))

        def run(i: int) -> None:
            prompt, temp, seed, cancel_after = REQUESTS[i]
            try:
                with Client(paths, timeout=60) as c:
                    barrier.wait()
                    tokens = TOKENS if cancel_after is None else CANCELLED_TOKENS
                    stream = c.generate(prompt, max_tokens=tokens, temp=temp, seed=seed)
                    seen = 0
                    for _ in stream:
                        seen += 1
                        if cancel_after is not None and seen == cancel_after:
                            stream.cancel()
                    results[i] = stream.done
            except BaseException as e:  # reported below, in the test's thread
                failures.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(REQUESTS))]
        # What `status` says while the eight run: the batch never over its bound, and the
        # requests that cannot join wait in the queue, saying why.
        seen = _run_watching(
            paths,
            threads,
            lambda st: (st.batch["size"], st.batch["max_batch"], st.requests.why_queued),
        )
        assert not failures, failures
        assert all(size <= bound for size, bound, _ in seen), seen
        # Those that could not join waited, counted once each (a wait can be shorter than
        # a poll), and what a poll saw of a wait says why.
        with Client(paths) as c:
            assert c.status().requests.waited_for_batch >= 1
        assert all(why is None or why.startswith(WAIT_WHYS) for _, _, why in seen), seen
        for i, (prompt, _, _, cancel_after) in enumerate(REQUESTS):
            done, want = results[i], alone[prompt]
            if cancel_after is None:
                assert done.tokens == want.tokens and done.text == want.text, f"request {i} differs from alone"
                assert done.finish_reason == want.finish_reason
                assert done.stats.batch["requested"] == 4 and 1 < done.stats.batch["max_batch"] <= 4
            else:
                # Cancelled: what it got is the start of what it gets alone, and it stopped early.
                assert want.finish_reason == "length" and len(want.tokens) == CANCELLED_TOKENS
                assert done.finish_reason == "cancelled"
                assert done.tokens == want.tokens[: len(done.tokens)] and len(done.tokens) < len(want.tokens)
        with Client(paths) as c:
            deadline = time.monotonic() + 10
            while (batch := c.status().batch)["size"] and time.monotonic() < deadline:
                time.sleep(0.05)
        # Everyone left the batch (the cancelled ones too), and it ran more than one at a time.
        assert batch["size"] == 0 and batch["max_size"] > 1 and batch["joined"] == batch["left"] == len(REQUESTS)


def _recent(client: Client) -> dict[str, dict]:
    """The daemon's recently ended requests, by id."""
    return {r.id: r.to_dict() for r in client.status().requests.recent}


def test_a_client_that_vanishes_leaves_the_batch_within_a_step(store, alone):
    """A client whose socket closes mid-decode, sending no cancel, leaves the batch: the
    daemon makes at most one more token for it once it has seen the peer go, the batch
    shrinks to the request beside it, and that one gets what it gets alone."""
    prompt = REQUESTS[0][0]
    long_tokens = 300
    with started_daemon(store, "msbgone", "--capacity", "0.5", "--max-batch", "4") as paths:
        with Client(paths, timeout=60) as c:
            gone = Client(paths, timeout=60)
            vanishing = gone.generate("There was news of rain", max_tokens=long_tokens)
            next(e for e in vanishing if isinstance(e, Token))  # it decodes (`accepted` comes before)
            other = c.generate(prompt, max_tokens=TOKENS)
            next(e for e in other if isinstance(e, Token))  # it has joined: both decode in one batch now
            gone.close()
            entry = wait_for(lambda: _recent(c).get(vanishing.id), 10, "the vanished request to end")
            list(other)
            done = other.done
            batch = wait_for(lambda: (b := c.status().batch)["size"] == 0 and b, 10, "the batch to empty")
    assert entry["finish_reason"] == "disconnected" and entry["tokens"] < long_tokens, entry
    assert entry["tokens_after_stop"] <= 1, entry
    assert done.tokens == alone[prompt].tokens and done.finish_reason == alone[prompt].finish_reason
    assert done.stats.batch["max_batch"] == 2, done.stats.batch
    assert batch["joined"] == batch["left"] == 2 and batch["max_size"] == 2, batch


def test_requests_whose_kv_caches_would_pass_the_memory_budget_wait_in_the_queue(store, alone):
    """Under --memory-budget the KV caches of the active requests count (each request's
    upper estimate: prompt + max_tokens): a budget that leaves room beside the full pool
    for any two of three requests' caches but not all three starts two at once; the third
    waits in the queue, `status` saying why, until one of the two ends, then gets what it
    gets alone. The two hold their slots (long, their end tokens banned) until the test
    has seen the third wait, so no timing decides whether it waited."""
    from moestream.daemon.pool.capacity import kv_cache_bytes
    from moestream.shared.store_format import load_manifest

    config = load_manifest(store).config
    prompts = [p for p, temp, _, cancel in REQUESTS if temp == 0.0 and cancel is None][:3]
    sm = load_streaming_model(store, Settings(capacity=1.0))
    fixed = sm.resident_bytes + sm.pool_bytes
    lengths = [len(encode_prompt(sm, p, None)) for p in prompts]
    no_end = proto.SamplingControls(logit_bias=tuple((t, -100.0) for t in sorted(sm.tokenizer.eos_token_ids)))
    sm.close()
    hold = 400
    caches = [kv_cache_bytes(config, n + m) for n, m in zip(lengths, (hold, hold, TOKENS))]
    context = max(lengths) + hold
    # The pool is sized first, leaving one max_context cache (less than any two here);
    # no prompt cache, whose bound the budget would keep too.
    budget = fixed + sum(caches) - min(caches) // 2
    args = ("--memory-budget", str(budget), "--max-batch", "4")
    env = {"MOESTREAM_MAX_CONTEXT": str(context), "MOESTREAM_PROMPT_CACHE_BYTES": "0"}
    with started_daemon(store, "msbkv", *args, env=env) as paths:
        with Client(paths, timeout=60) as c, Client(paths, timeout=60) as a, Client(paths, timeout=60) as b:
            assert c.status().pool.layers[0].capacity == load_manifest(store).layers[0].num_experts
            holding = [x.generate(p, max_tokens=hold, sampling=no_end) for x, p in zip((a, b), prompts)]
            for stream in holding:
                next(e for e in stream if isinstance(e, Token))  # both decode
            third = c.generate(prompts[2], max_tokens=TOKENS)
            status = wait_for(lambda: (st := c.status()).requests.queued == 1 and st, 30, "the third request to wait")
            for stream in holding:
                stream.cancel()
                list(stream)
            list(third)
            counters = c.status().requests
    assert status.requests.why_queued.startswith(WAIT_WHYS[2]), status.requests
    assert third.done.tokens == alone[prompts[2]].tokens
    # Counted once, for memory, and never for the batch (room for four).
    assert (counters.waited_for_memory, counters.waited_for_batch) == (1, 0), counters


def test_by_default_requests_batch_or_take_turns_as_the_steps_measure_and_get_their_alone_outputs(store, alone):
    """The default max_batch (0): the daemon chooses per request whether it joins the
    batch (its steps timed faster a token than lone ones) or decodes alone in turns.
    Which one a request got depends on this machine's timings; what it makes does not."""
    prompts = [p for p, temp, _, cancel in REQUESTS if temp == 0.0 and cancel is None]
    with started_daemon(store, "msbauto", "--capacity", "0.5") as paths:
        results: dict[str, object] = {}
        _run_watching(paths, _greedy_clients(paths, prompts, results), lambda st: None)
        with Client(paths) as c:
            status = c.status()
    for prompt in prompts:
        assert results[prompt].tokens == alone[prompt].tokens, f"{prompt!r} differs from alone"
    batch = status.batch
    assert batch["auto"] is True and batch["requested"] == 8
    # Each request either joined the batch or decoded in turns, never both or neither.
    assert batch["joined"] + status.requests.decoded_in_turns == len(prompts), (batch, status.requests)
    # Steps of the batch were timed (whether lone ones were depends on this machine's load:
    # requests that arrive together may never step alone; StepCosts' own test holds that).
    assert batch["joined"] == 0 or batch["step_seconds"], batch
