"""The demo recipe's chat corpus and fine-tune start (tests/bench/demo_recipe/chat_data.py,
finetune.py): the training text is what the daemon renders, the tool calls in it parse with
the model's own mlx-lm parser, the chat evaluation's cities and questions never appear in
it, and a fine-tune starts from the shipped store's weights."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import mlx.core as mx
import pytest
from demo_recipe.chat_data import (
    EVAL_CITIES,
    EVAL_QUESTIONS,
    ChatCorpus,
    held_out_names,
    load_template_tokenizer,
    render,
)
from demo_recipe.finetune import load_init, parsed_calls
from demo_recipe.model import FULL, TINY
from demo_recipe.train import parse_args
from mlx_lm.utils import load_tokenizer

from moestream.daemon.model.generation import render_chat
from moestream.daemon.model.tool_calls import ToolCallSplitter
from moestream.shared.settings import demo_store_path

DEMO = str(demo_store_path())


@pytest.fixture(scope="module")
def corpus_draws() -> list:
    corpus = ChatCorpus(seed=7)
    return [corpus.draw() for _ in range(1500)]


def test_training_text_is_what_the_daemon_renders_and_its_calls_parse(corpus_draws: list) -> None:
    hf = load_template_tokenizer(DEMO)
    wrapper = load_tokenizer(Path(DEMO))
    seen = set()
    for conv in corpus_draws:
        if conv.kind in seen:
            continue
        seen.add(conv.kind)
        text = render(hf, conv)
        prompt = render_chat(wrapper, list(conv.messages[:1]), list(conv.tools) or None)
        assert text.startswith(prompt), f"{conv.kind}: the training text does not start with the daemon's prompt"
        answer = text[len(prompt) :]
        splitter = ToolCallSplitter(wrapper.tool_call_start, wrapper.tool_call_end, wrapper.tool_parser, conv.tools)
        splitter.feed(answer.split("<|im_end|>")[0])
        splitter.finish()
        wanted = conv.messages[1].get("tool_calls", [])
        got = [(c["name"], json.loads(c["arguments"])) for c in splitter.calls]
        assert got == [(c["function"]["name"], c["function"]["arguments"]) for c in wanted], answer
        assert parsed_calls(answer) == [{"name": n, "arguments": a} for n, a in got]
        if not wanted:
            assert splitter.content.strip(), f"{conv.kind}: an empty text answer"
    assert seen == {"qa", "call", "result"}


def test_the_chat_evaluation_is_held_out_of_the_corpus(corpus_draws: list) -> None:
    words = re.compile(r"\b(" + "|".join(EVAL_CITIES) + r")\b")
    for conv in corpus_draws:
        for m in conv.messages:
            assert m["content"] not in EVAL_QUESTIONS
            found = words.search(json.dumps(m))
            assert found is None, f"the eval's city {found.group(0) if found else ''} is in {m}"
    facts = dict(ChatCorpus(seed=0).facts)
    held = held_out_names()
    assert {"os.path.join", "zip", "collections.Counter"} <= held
    assert not [n for n in facts if any(n == h or n.endswith("." + h) for h in held)]
    assert "os.path.split" in facts and "itertools.accumulate" in facts  # their neighbours stay


def test_the_corpus_varies_tools_phrasings_and_offers(corpus_draws: list) -> None:
    called = {m["tool_calls"][0]["function"]["name"] for c in corpus_draws for m in c.messages if m.get("tool_calls")}
    questions = {c.messages[0]["content"] for c in corpus_draws}
    qa = [c for c in corpus_draws if c.kind == "qa"]
    assert len(called) >= 10 and len(questions) > 0.9 * len(corpus_draws)
    assert any(c.tools for c in qa) and any(not c.tools for c in qa)
    assert any(len(c.tools) > 1 for c in corpus_draws if c.kind == "call")
    assert ChatCorpus(seed=7).draw() == corpus_draws[0]  # one seed, one corpus


def test_init_from_the_shipped_store_holds_its_weights() -> None:
    from tokenizers import Tokenizer

    from moestream.daemon.model.streaming_model import load_stock_model

    lm, head, config = load_init(DEMO, FULL, seed=0)
    assert all(v.dtype == mx.float32 for v in (lm.model.embed_tokens.weight, head.proj.weight))
    stock = load_stock_model(DEMO)
    ids = Tokenizer.from_file(str(Path(DEMO) / "tokenizer.json")).encode(inspect.getsource(json.dumps)).ids[:32]
    x = mx.array([ids])
    agree = (lm(x).argmax(-1) == stock(x).argmax(-1)).astype(mx.float32).mean().item()
    # Float arithmetic on the dequantized weights against bf16 4-bit kernels: the same
    # model up to rounding (a wrong group size or a missing tensor falls far below this).
    assert agree >= 0.85, agree


def test_init_from_refuses_weights_of_another_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not of this run's shape: vocab_size 4096"):
        load_init(DEMO, TINY, seed=0)
    with pytest.raises(FileNotFoundError, match="neither an expert store"):
        load_init(tmp_path, FULL, seed=0)


def test_chat_fraction_must_leave_code(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--out", str(tmp_path), "--chat-fraction", "1"])
    settings = parse_args(["--out", str(tmp_path), "--init-from", DEMO, "--chat-fraction", "0.5"])
    assert settings.chat_fraction == 0.5 and settings.init_from == DEMO


def test_an_answer_in_text_has_words_and_no_call_even_a_broken_one() -> None:
    from demo_recipe.chat_eval import answered_in_text

    assert answered_in_text([], "os.path.split: Split a pathname.<|im_end|>\n")
    assert not answered_in_text([], "<|im_end|>\n")  # an empty turn
    assert not answered_in_text([], '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B')
    assert not answered_in_text([{"name": "get_weather", "arguments": "{}"}], "Sure.")
