"""Long prefills survive their clients, through a real daemon (and a real gateway).

The daemon serves a tiny store with every expert in its pool, so a prompt prefills in
stock's chunks of 2048 tokens: the prompts here take three (a second or more each on a
CPU: the store's model has two MoE layers and one attention head, as a chunk of the usual
tiny model takes 4-10 s there and the chunks are all this file's time), and whatever a
test sends after a chunk has ended (a cancel, a stop, a duplicate, Ctrl-C) reaches the
daemon while the next one runs, thousands of times longer than the message takes. What
each test asserts is counted by the daemon, not timed: the pieces of a prefill begun
after a stop was asked (`prefill_pieces_after_stop`), the prompt cache's prefills
started, joined, suspended and resumed.
"""

from __future__ import annotations

import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import numpy as np
import openai
import pytest
from daemon_cli import clean_env, ctl, started_daemon, wait_for
from tiny_models import tiny_config, tiny_store

from moestream.client.client import Accepted, Client, Progress, Token

CHUNK = 2048
PROMPT_TOKENS = 3 * CHUNK + 1  # three chunks, then the last token
MAX_TOKENS = 4
EXPERTS = "16"  # the tiny store's every expert: stock's chunk order
# The tiny model's own context is 512 tokens; these prompts are up to seven chunks long.
CONTEXT = {"MOESTREAM_MAX_CONTEXT": "32768"}


def _prompt(seed: int, tokens: int = PROMPT_TOKENS) -> list[int]:
    return np.random.default_rng(seed).integers(3, 500, size=tokens).tolist()


# The usual tiny qwen3_moe less its dense layer and three of its four attention heads.
LEAN = {"num_hidden_layers": 2, "mlp_only_layers": [], "num_attention_heads": 1, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def store():
    with tiny_store("mslp", config=tiny_config("qwen3_moe") | LEAN) as path:
        yield path


@pytest.fixture(scope="module")
def daemon(store):
    with started_daemon(store, "mslp", "--capacity", EXPERTS, env=CONTEXT) as paths:
        yield paths


@pytest.fixture(scope="module")
def alone(store):
    """`alone(prompt) -> tokens`: greedy tokens of a prompt generated in this process,
    the pool as the daemon's."""
    from moestream.daemon.model.generation import SamplingParams, generate
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    sm = load_streaming_model(store, Settings(capacity=int(EXPERTS)))
    made: dict[tuple[int, ...], list[int]] = {}

    def run(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in made:
            made[tuple(prompt)] = generate(sm, prompt, SamplingParams(max_tokens=MAX_TOKENS)).tokens
        return made[tuple(prompt)]

    yield run
    sm.close()


def _counts(paths) -> dict[str, int]:
    with Client(paths) as c:
        return {k: v for k, v in c.status().prompt_cache.items() if k.startswith(("prefill", "suspended"))}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _until_prefilled(stream, done: int = 1) -> list:
    """The stream's events up to the first progress of at least `done` prompt tokens (0:
    its prefill has begun; 1: a chunk has ended)."""
    seen = []
    for event in stream:
        seen.append(event)
        if isinstance(event, Progress) and event.done >= done:
            return seen
    raise AssertionError(f"the request ended before its prefill came to {done} tokens: {seen}")


def test_a_cancel_takes_effect_within_a_chunk_and_the_same_prompt_again_takes_the_prefill_up(daemon, alone):
    prompt = _prompt(1)
    before = _counts(daemon)
    with Client(daemon) as c:
        stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, progress=True)
        seen = _until_prefilled(stream)
        assert isinstance(seen[0], Accepted) and seen[0].prompt_tokens == PROMPT_TOKENS
        assert c.cancel(stream.id) is True  # answered once the chunk in flight has ended
        rest = list(stream)
    done = stream.done
    assert done.finish_reason == "cancelled" and done.tokens == [] and not any(isinstance(e, Token) for e in rest)
    # No chunk began after the cancel: the one in flight was the last.
    assert done.stats.prefill_pieces_after_stop == 0
    assert _delta(before, _counts(daemon)) == {
        "prefills": 1,
        "prefills_suspended": 1,
        "suspended": 1,
        "suspended_bytes": _counts(daemon)["suspended_bytes"],
    }
    with Client(daemon) as c:
        again = c.complete(prompt_ids=prompt, max_tokens=MAX_TOKENS)
    assert again.tokens == alone(prompt), "the prefill taken up made other tokens than one alone"
    assert again.stats.prompt_cache.resumed is True
    after = _delta(before, _counts(daemon))
    assert after["prefills_resumed"] == 1 and "suspended" not in after


def _running(paths, request_id: str) -> dict | None:
    with Client(paths) as c:
        return next((r.to_dict() for r in c.status().requests.running if r.id == request_id), None)


def _recent(paths, request_id: str) -> dict | None:
    with Client(paths) as c:
        return next((r.to_dict() for r in c.status().requests.recent if r.id == request_id), None)


def test_a_client_gone_during_a_prefill_stops_it_within_a_chunk(daemon):
    """A client that asked for no progress sends nothing and is sent nothing during its
    prompt's prefill; it closes its connection after the first chunk. Its connection's end
    stops the request at the end of the chunk in flight (it ran the whole prefill, twelve
    minutes' worth on a large prompt, before a first token's send found it gone), and the
    prefill is kept, suspended."""
    prompt = _prompt(11, 6 * CHUNK + 1)
    before = _counts(daemon)
    c = Client(daemon)
    stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS)
    assert isinstance(next(stream), Accepted)
    info = wait_for(
        lambda: (r := _running(daemon, stream.id)) is not None and (r["prefilled_tokens"] or 0) >= CHUNK and r,
        60,
        "the first chunk to end",
    )
    assert info["phase"] == "prefill"
    c.close()
    ended = wait_for(lambda: _recent(daemon, stream.id), 60, "the daemon to stop the request")
    assert ended["finish_reason"] == "disconnected" and ended["tokens"] == 0
    assert ended["prefill_pieces_after_stop"] == 0
    delta = _delta(before, _counts(daemon))
    assert delta["prefills"] == 1 and delta["prefills_suspended"] == 1, delta
    with Client(daemon) as c:  # the engine is free; the same prompt takes the prefill up (and leaves none kept)
        again = c.complete(prompt_ids=prompt, max_tokens=MAX_TOKENS)
    assert again.stats.prompt_cache.resumed is True and _counts(daemon)["suspended"] == before["suspended"]


def test_a_speculative_request_cancelled_during_its_prefill_stops_within_a_chunk(store, daemon):
    """A speculative request prefills in stock's chunks too, and goes back to the engine
    between two: a cancel takes effect at the end of the chunk in flight (it ran the rest
    of the prefill first)."""
    with Client(daemon) as c:
        stream = c.generate(
            prompt_ids=_prompt(12),
            max_tokens=MAX_TOKENS,
            progress=True,
            speculative="draft",
            draft_model=str(store),
        )
        _until_prefilled(stream)
        assert c.cancel(stream.id) is True
        rest = list(stream)
    assert stream.done.finish_reason == "cancelled" and stream.done.tokens == []
    assert not any(isinstance(e, Token) for e in rest)
    assert stream.done.stats.prefill_pieces_after_stop == 0


def test_the_same_prompt_during_its_prefill_shares_it(daemon, alone):
    """A duplicate sent while the first is prefilling is accepted at once, waits on the
    same prefill (one prefill, two answers) and makes the tokens of one alone. (Sent as
    the first's prefill begins, it is read after the first chunk and checked during the
    second, so that the third is left to share.)"""
    prompt = _prompt(2)
    before = _counts(daemon)
    second: dict[str, object] = {}

    def duplicate() -> None:
        with Client(daemon) as c:
            stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS)
            second["accepted"] = (next(stream), time.monotonic())
            list(stream)
            second["done"] = stream.done

    with Client(daemon) as c:
        stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, progress=True)
        _until_prefilled(stream, 0)
        thread = threading.Thread(target=duplicate)
        thread.start()
        first_token = next((time.monotonic() for e in stream if isinstance(e, Token)), None)
        list(stream)
        thread.join()
    first, dup = stream.done, second["done"]
    accepted, at = second["accepted"]
    assert isinstance(accepted, Accepted) and first_token is not None and at < first_token
    assert first.tokens == dup.tokens == alone(prompt)
    assert dup.stats.prompt_cache.joined is True and first.stats.prompt_cache.joined is False
    assert _delta(before, _counts(daemon)) == {"prefills": 1, "prefill_joins": 1}


def test_ctrl_c_during_a_prefill_exits_quietly_and_cancels_within_a_chunk(store, daemon, tmp_path):
    """Ctrl-C at a terminal once the prefill shows its first chunk done. The client's own
    progress line (the daemon's progress event, as it comes) says when, not the status's
    snapshot, which may lag a tiny model's prefill by most of it; eleven more chunks to go.

    The client gets a terminal's SIGINT (its default action): a test run started in the
    background by a shell without job control (CI's, beside a build) has SIGINT ignored,
    which every child inherits; the client then ignored Ctrl-C and ran the whole prefill
    (it "outlived SIGINT by 30 s" on a loaded machine: reproduced with `sh -c 'pytest ... &'`)."""
    ids = tmp_path / "ids.txt"
    ids.write_text(",".join(map(str, _prompt(3, 12 * CHUNK + 1))))
    terminal, side = pty.openpty()  # stderr a terminal: the progress line is shown
    # A handler here is the default action after exec, whatever this process inherited.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moestream.client.cli", "generate", "--prompt-ids", f"@{ids}"]
            + ["--max-tokens", str(MAX_TOKENS), "--model", str(store), "--runtime-dir", str(daemon.dir)],
            stdout=subprocess.PIPE,
            stderr=side,
            text=True,
            env=clean_env(),
        )
    finally:
        signal.signal(signal.SIGINT, before)
    os.close(side)
    shown = b""
    try:
        deadline = time.monotonic() + 120
        while not re.search(rb"prefill ([1-9]\d{3,})/", shown):
            assert time.monotonic() < deadline and proc.poll() is None, shown
            if select.select([terminal], [], [], 1.0)[0]:
                shown += os.read(terminal, 4096)
        tic = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - tic
    finally:
        if proc.poll() is None:
            proc.kill()
        err = shown + _read_all(terminal)
        os.close(terminal)
    text = err.decode(errors="replace")
    assert proc.returncode == 130, text
    assert "Traceback" not in text and "died" not in text and "Aborted" not in text, text
    assert out == "" and took < 5, (out, took)  # a ping's round trip, not the prefill's rest

    def cancelled() -> list[dict]:
        with Client(daemon) as c:
            return [r.to_dict() for r in c.status().requests.recent if r.finish_reason == "cancelled"]

    # The daemon applies the cancel at the end of the chunk in flight (the client did not wait).
    ended = wait_for(cancelled, 60, "the daemon to cancel the request")
    assert ended[-1]["tokens"] == 0 and ended[-1]["prefill_pieces_after_stop"] == 0


def _read_all(fd: int) -> bytes:
    """What is left to read on a pty's side whose other end has closed (Linux: EIO at the end)."""
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out


def test_stop_during_a_prefill_ends_the_daemon_within_a_chunk(store):
    with started_daemon(store, "mslps", "--capacity", EXPERTS, env=CONTEXT) as paths:
        with Client(paths) as c:
            stream = c.generate(prompt_ids=_prompt(4), max_tokens=MAX_TOKENS, progress=True)
            _until_prefilled(stream)
            stopped = ctl("stop", "--runtime-dir", str(paths.dir))
            list(stream)
        assert stopped.returncode == 0, stopped.stderr
        # Counted, not timed (a loaded machine once took 34 s for the chunk in flight and the
        # exit): no prefill piece ran once the stop had arrived.
        assert stream.done.finish_reason == "shutdown" and stream.done.stats.prefill_pieces_after_stop == 0
        # started_daemon's own stop finds none running.


CHECKPOINT = 4096  # daemon/model/shared_prefill.py CHECKPOINT_TOKENS


@pytest.mark.slow  # a prompt of seven chunks, prefilled in part, then again after a restart
def test_a_prefill_stopped_with_the_daemon_starts_again_from_its_last_checkpoint(store, alone, tmp_path):
    """A long prefill leaves a checkpoint in the prompt cache every 4096 tokens, written
    to its folder: the daemon stopped in the middle of it and started again, the same
    prompt starts from the last checkpoint the stopped prefill reached, and makes the
    tokens of one prefill in one go."""
    prompt = np.random.default_rng(9).integers(3, 500, size=7 * CHUNK + 1).tolist()
    flags = ("--capacity", EXPERTS, "--prompt-cache-dir", str(tmp_path / "prompt-cache"))
    with started_daemon(store, "mslpk", *flags, env=CONTEXT) as paths:
        with Client(paths) as c:
            stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS, progress=True)
            seen = _until_prefilled(stream, 2 * CHECKPOINT)  # two checkpoints made
            stopped = ctl("stop", "--runtime-dir", str(paths.dir))
            seen += list(stream)
        assert stopped.returncode == 0, stopped.stderr
        assert stream.done.stats.prefill_pieces_after_stop == 0
    reached = max(e.done for e in seen if isinstance(e, Progress))
    # Where the stop came before the prefill's end (three chunks after the second checkpoint
    # were left), the last checkpoint it passed; else the whole prompt, kept by its request.
    want = reached // CHECKPOINT * CHECKPOINT if reached < len(prompt) - 1 else len(prompt) - 1
    assert want >= 2 * CHECKPOINT
    with started_daemon(store, "mslpk", *flags, env=CONTEXT) as paths:
        with Client(paths) as c:
            stream = c.generate(prompt_ids=prompt, max_tokens=MAX_TOKENS)
            list(stream)
    assert stream.done.stats.cached_tokens == want, (reached, stream.done.stats.cached_tokens)
    assert stream.done.stats.prompt_cache.from_disk is True
    assert stream.done.tokens == alone(prompt)


# ---- through the gateway --------------------------------------------------------------------

KEEP_ALIVE = 0.2


@pytest.fixture(scope="module")
def gateway(daemon):
    """The gateway app in this process (uvicorn on a free port) with keep-alives every
    KEEP_ALIVE seconds, so that a prefill of seconds sends several."""
    import uvicorn

    from moestream.client.gateway.app import GatewayConfig, create_app

    config = uvicorn.Config(
        create_app(GatewayConfig(paths=daemon, keep_alive_seconds=KEEP_ALIVE)),
        host="127.0.0.1",
        port=0,
        log_level="warning",
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run)
    thread.start()
    wait_for(lambda: server.started, 30, "the gateway to listen")
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


def _long_text(seed: int, words: int = 600) -> str:
    """Words of 3 to 4 tokens each in the tiny tokenizer: 600 make about one chunk, 1750 three."""
    vocabulary = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "night", "paper"]
    rng = np.random.default_rng(seed)
    return " ".join(vocabulary[i] for i in rng.integers(0, len(vocabulary), size=words))


def _timeline(url: str, path: str, body: dict) -> tuple[float, list[tuple[float, str]]]:
    """(when the status line came, [(when, line)] of the body's lines), from the request's start."""
    tic = time.monotonic()
    with httpx.Client(timeout=120) as http, http.stream("POST", url + path, json=body) as r:
        status = time.monotonic() - tic
        assert r.status_code == 200, r.read()
        return status, [(time.monotonic() - tic, line) for line in r.iter_lines() if line]


def test_a_streamed_answer_gets_its_status_line_at_once_then_keep_alives_until_its_first_token(gateway, daemon):
    chat = {"model": "moestream", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    chat["messages"] = [{"role": "user", "content": _long_text(5)}]
    _, lines = _timeline(gateway, "/v1/chat/completions", chat)
    first = next(i for i, (_, line) in enumerate(lines) if '"content":"' in line and '"content":""' not in line)
    comments = [line for _, line in lines[:first] if line.startswith(": keep-alive")]
    # Several, saying how far the prefill had come; none after the first token.
    assert len(comments) >= 2 and any(" prefill " in line for line in comments), lines[:first]
    assert not any(line.startswith(":") for _, line in lines[first:])
    # No two lines before the first token further apart than a few keep-alive periods.
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1 : first + 1])]
    assert max(gaps) < 10 * KEEP_ALIVE + 2, gaps

    message = {"model": "moestream", "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
    message["messages"] = [{"role": "user", "content": _long_text(6)}]
    _, lines = _timeline(gateway, "/v1/messages", message)
    events = [line.removeprefix("event: ") for _, line in lines if line.startswith("event: ")]
    start = events.index("content_block_start")
    assert events[0] == "message_start" and events[1:start].count("ping") >= 2 and "ping" not in events[start:]

    # Codex CLI's Responses API: SSE comments between the response's first events and its first delta.
    # Greedy, as the requests above: sampled, an answer may end at its first token with no
    # text at all (a loaded CI run drew that once).
    response = {"model": "gpt-5-codex", "max_output_tokens": MAX_TOKENS, "stream": True, "temperature": 0}
    response["input"] = _long_text(7)
    _, lines = _timeline(gateway, "/v1/responses", response)
    first = next(i for i, (_, line) in enumerate(lines) if "response.output_text.delta" in line)
    assert lines[0][1] == "event: response.created", lines[:3]
    assert sum(line.startswith(": keep-alive") for _, line in lines[:first]) >= 2, lines[:first]
    assert not any(line.startswith(":") for _, line in lines[first:])


def test_real_clients_read_the_keep_alives_and_a_cut_request_sent_again_takes_its_prefill_up(gateway, daemon):
    """The openai and anthropic packages stream through the keep-alives; a client that
    leaves during the prefill is cancelled in the daemon, which keeps the prefill, and
    the same request sent again takes it up and answers as the uncut one would."""
    api = openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": _long_text(7)}]
    streamed = api.chat.completions.create(
        model="moestream", messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    claude = anthropic.Anthropic(base_url=gateway, api_key="unused", max_retries=0, timeout=120)
    events = claude.messages.create(
        model="moestream",
        max_tokens=MAX_TOKENS,
        stream=True,
        messages=[{"role": "user", "content": _long_text(8)}],
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_delta" in kinds

    before = _counts(daemon)
    body = {"model": "moestream", "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    cut = body | {"messages": [{"role": "user", "content": _long_text(9, words=1750)}]}
    with httpx.Client(timeout=120) as http, http.stream("POST", gateway + "/v1/chat/completions", json=cut) as r:
        for line in r.iter_lines():
            if line.startswith(": keep-alive, prefill ") and not line.startswith(": keep-alive, prefill 0/"):
                break  # a chunk is in: leave
    wait_for(lambda: _counts(daemon)["suspended"] == 1, 60, "the daemon to keep the cut prefill")
    again = api.chat.completions.create(
        model="moestream", messages=cut["messages"], max_tokens=MAX_TOKENS, temperature=0
    )
    assert _delta(before, _counts(daemon))["prefills_resumed"] == 1
    # The same request once more, from the prompt cache (which serves exactly): the same answer.
    once_more = api.chat.completions.create(
        model="moestream", messages=cut["messages"], max_tokens=MAX_TOKENS, temperature=0
    )
    assert again.choices[0].message.content == once_more.choices[0].message.content
    assert text is not None
