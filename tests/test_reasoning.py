"""The daemon's side of thinking models and of coding agents' requests, without a daemon:
the reasoning splitter on the thinking model's real token pieces, the answer's first
state from the rendered prompt, top_k in the request's sampler against stock mlx-lm's,
the prompt checker's counts and its cut of max_tokens, and the protocol's new messages."""

from __future__ import annotations

import shutil
import tempfile
import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.sample_utils import apply_top_k, apply_top_p
from thinking_model import CHAT, load_thinking_tokenizer, make_thinking_model

from moestream.daemon.model.generation import SamplingParams, render_chat, request_sampler
from moestream.daemon.model.reasoning import ReasoningSplitter, opens_thinking, reasoning_splitter
from moestream.daemon.prompt_check import PromptChecker
from moestream.shared import protocol as proto
from moestream.shared.settings import demo_store_path


@pytest.fixture(scope="module")
def tokenizer():
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mrs"))
    try:
        yield load_thinking_tokenizer(make_thinking_model(root / "model"))
    finally:
        shutil.rmtree(root)


def _pieces(tokenizer, text: str) -> list[str]:
    """`text` as the daemon's detokenizer hands it out, token by token."""
    detok = tokenizer.detokenizer
    out, seen = [], 0
    for t in tokenizer.encode(text, add_special_tokens=False):
        detok.add_token(t)
        out.append(detok.text[seen:])
        seen = len(detok.text)
    detok.finalize()
    out.append(detok.text[seen:])
    return out


def _split(splitter: ReasoningSplitter, pieces: list[str]) -> tuple[str, str, list[tuple[bool, str]]]:
    sent = [p for piece in pieces for p in splitter.feed(piece)] + splitter.finish()
    assert splitter.fed == sum(map(len, pieces))
    return splitter.reasoning_text, splitter.answer_text, sent


@pytest.mark.parametrize("by", ["tokens", "characters"])
def test_the_splitter_takes_the_markers_out_and_never_streams_them(tokenizer, by):
    cases = [
        # (the answer starts in reasoning, the model's text, reasoning, answer)
        (True, "Paris, I think.\n</think>\n\nParis is the capital.", "Paris, I think.\n", "Paris is the capital."),
        (False, "<think>\nhmm </thi\n</think>\n\n<thought> stays", "hmm </thi\n", "<thought> stays"),
        (False, "No thinking here, </think> is text.", "", "No thinking here, </think> is text."),
        (True, "cut off mid-marker </thin", "cut off mid-marker </thin", ""),
        (True, "a</think>b<think>c</think>d", "ac", "bd"),
    ]
    for opens, text, reasoning, answer in cases:
        pieces = _pieces(tokenizer, text) if by == "tokens" else list(text)
        got_reasoning, got_answer, sent = _split(reasoning_splitter(tokenizer, opens), pieces)
        assert (got_reasoning, got_answer) == (reasoning, answer), text
        # What was sent, in order, is the same text: no marker, no piece of one.
        assert "".join(t for r, t in sent if r) == reasoning and "".join(t for r, t in sent if not r) == answer


def test_the_answer_starts_in_reasoning_where_the_template_opens_it(tokenizer):
    def opens(thinking):
        text = render_chat(tokenizer, CHAT, thinking=thinking)
        return opens_thinking(tokenizer, tokenizer.encode(text, add_special_tokens=False))

    assert (opens(None), opens(True), opens(False)) == (True, True, False)
    # An earlier turn's closed block does not open the answer.
    turn = [*CHAT, {"role": "assistant", "content": "Paris.", "reasoning_content": "easy"}, CHAT[1]]
    assert "<think>\neasy\n</think>" in render_chat(tokenizer, turn, thinking=False)
    ids = tokenizer.encode(render_chat(tokenizer, turn, thinking=False), add_special_tokens=False)
    assert opens_thinking(tokenizer, ids) is False
    from mlx_lm.utils import load_tokenizer

    demo = load_tokenizer(demo_store_path())
    assert opens_thinking(demo, [1, 2, 3]) is None and reasoning_splitter(demo, None) is None


def test_top_k_is_stock_mlx_lms_after_top_p_on_the_requests_own_key():
    vocab = 64
    logprobs = mx.log(mx.softmax(mx.random.normal((1, vocab), key=mx.random.key(0)), axis=-1))
    top5 = set(mx.argsort(-logprobs[0])[:5].tolist())
    params = SamplingParams(temp=0.7, top_p=0.95, top_k=5, seed=3)
    sample = request_sampler(params)
    key = mx.random.key(3)
    for _ in range(50):
        key, sub = mx.random.split(key)
        want = mx.random.categorical(apply_top_k(apply_top_p(logprobs, 0.95), 5) * (1 / 0.7), key=sub)
        got = sample(logprobs)
        assert got.item() == want.item() and got.item() in top5
    # A k of the vocabulary or more keeps every token (stock's apply_top_k refuses it).
    every = request_sampler(SamplingParams(temp=1.0, top_k=vocab, seed=3))
    plain = request_sampler(SamplingParams(temp=1.0, seed=3))
    assert [every(logprobs).item() for _ in range(20)] == [plain(logprobs).item() for _ in range(20)]


def test_the_checker_counts_fits_max_tokens_and_says_where_the_answer_starts(tokenizer):
    checker = PromptChecker(SimpleNamespace(tokenizer=tokenizer), 100, lambda job: None)
    try:
        n = len(tokenizer.encode(render_chat(tokenizer, CHAT), add_special_tokens=False))
        count = checker.count_reply(proto.CountTokens(id="c", messages=tuple(proto.ChatMessage(**m) for m in CHAT)))
        assert count == proto.TokenCount("c", n)
        chat = tuple(proto.ChatMessage(**m) for m in CHAT)
        fitted = checker.check(proto.Generate(id="g", messages=chat, max_tokens=32000))
        assert fitted.ids is not None and fitted.max_tokens == 100 - n and fitted.opens_thinking is True
        off = checker.check(proto.Generate(id="g", messages=chat, max_tokens=4, thinking=False))
        assert off.max_tokens == 4 and off.opens_thinking is False and len(off.ids) > n
        assert checker.check(proto.Generate(id="g", prompt="<think>", max_tokens=4)).opens_thinking is None
        # No socket to answer on: a count goes another way.
        assert checker.count(SimpleNamespace(peer=b"p", msg=None)) is False
    finally:
        assert checker.close() == []
    long = PromptChecker(SimpleNamespace(tokenizer=tokenizer), n, lambda job: None)
    try:
        assert (
            long.check(
                proto.Generate(
                    id="g",
                    messages=chat,
                    max_tokens=8,
                )
            ).code
            == proto.TOO_LONG
        )
    finally:
        long.close()


def test_the_checker_takes_clients_in_turn_whatever_their_connections(tokenizer):
    """A gateway's requests come over a connection each but name their client: one client's
    many requests are checked in turn with another's, not all before it."""
    done: list[str] = []
    first_held, release, all_done = threading.Event(), threading.Event(), threading.Event()

    def on_done(job) -> None:
        done.append(job.msg.id)
        if len(done) == 7:
            all_done.set()
        if job.msg.id == "a0":
            first_held.set()
            release.wait(10)

    def job(i: int, client: str) -> SimpleNamespace:
        msg = proto.Generate(id=f"{client}{i}", prompt="def f():", max_tokens=4)
        return SimpleNamespace(peer=f"{client}{i}".encode(), client=f"key {client}", msg=msg, stop_reason=None)

    checker = PromptChecker(SimpleNamespace(tokenizer=tokenizer), 100, on_done)
    try:
        checker.submit(job(0, "a"))
        assert first_held.wait(10)
        for i in range(1, 6):
            checker.submit(job(i, "a"))
        checker.submit(job(0, "b"))
        release.set()
        assert all_done.wait(10), done
    finally:
        checker.close()
    assert done == ["a0", "b0", "a1", "a2", "a3", "a4", "a5"]


def test_the_protocols_count_tokens_reasoning_and_top_k():
    msg = proto.CountTokens(
        id="c",
        messages=(proto.ChatMessage("assistant", "Paris.", reasoning="easy"), proto.ChatMessage("user", "Spain?")),
        tools=({"type": "function", "function": {"name": "f", "parameters": {}}},),
        thinking=False,
    )
    assert proto.decode_request(proto.encode(msg)) == msg
    assert msg.messages[0].to_template() == {"role": "assistant", "content": "Paris.", "reasoning_content": "easy"}
    assert proto.decode_reply(proto.encode(proto.TokenCount("c", 7))) == proto.TokenCount("c", 7)
    gen = proto.Generate(id="g", prompt="x", top_k=3, thinking=True)
    assert proto.decode_request(proto.encode(gen)) == gen
    for bad, why in (
        ({"prompt": "x", "prompt_ids": [1]}, "exactly one"),
        ({"prompt": "x", "tools": []}, "go with 'messages'"),
        ({"messages": [{"role": "assistant", "content": "", "reasoning": 5}]}, "reasoning must be a string"),
        ({"prompt": "x", "max_tokens": 4}, "unknown field"),
    ):
        data = proto.encode(proto.Ping(id="c"))
        import msgpack

        body = msgpack.unpackb(data) | {"type": "count_tokens"} | bad
        with pytest.raises(proto.ProtocolError, match=why):
            proto.decode_request(msgpack.packb(body))
