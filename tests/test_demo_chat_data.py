"""The demo recipe's chat corpus and fine-tune start (tests/bench/demo_recipe/chat_data.py,
finetune.py, train.py): the training text is what the daemon renders, the tool calls in it
parse with the model's own mlx-lm parser, the chat evaluation's cities and questions never
appear in it, city arguments are copied from the request, a fine-tune starts from the
shipped store's weights, and `--select` keeps the weights its rule picks."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from demo_recipe.chat_data import (
    CONCEPTS,
    EVAL_CITIES,
    EVAL_QUESTIONS,
    HOWTOS,
    TRAIN_CITIES,
    WEATHER_TOOL,
    ChatCorpus,
    held_out_names,
    invented_cities,
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


def _city_args(conv) -> list[str]:
    calls = [c for m in conv.messages for c in m.get("tool_calls", [])]
    return [v for c in calls for k, v in c["function"]["arguments"].items() if k in ("city", "location", "origin",
            "destination")]  # fmt: skip


def test_invented_cities_never_are_nor_contain_an_eval_city() -> None:
    names = invented_cities(2000)
    assert len(set(names)) == 2000 and names == invented_cities(2000)  # distinct, seeded
    low = [n.lower() for n in names]
    assert not [n for n in low for c in EVAL_CITIES if c.lower() in n]
    assert not set(low) & {c.lower() for c in TRAIN_CITIES}
    assert all(n.isalpha() and n[0].isupper() for n in names)


def test_city_arguments_are_copied_from_the_request_and_mostly_invented(corpus_draws: list) -> None:
    corpus = ChatCorpus(seed=7)
    convs = [corpus.draw() for _ in range(1500)]
    assert convs == corpus_draws
    invented, seen = set(corpus.cities.invented), []
    for conv in convs:
        for city in _city_args(conv):
            assert city in conv.messages[0]["content"], (city, conv.messages[0]["content"])
            assert not any(c.lower() in city.lower() for c in EVAL_CITIES), city
            seen.append(city)
    stats = corpus.summary()["cities"]
    assert stats["real"] + stats["invented"] == len(seen)
    assert stats["invented"] > 2 * stats["real"] > 0 and stats["multi_word"] > 0
    assert sum(c in TRAIN_CITIES for c in seen) == stats["real"]
    multi = [c for c in seen if " " in c]
    assert len(multi) == stats["multi_word"] and {len(c.split()) for c in multi} == {2, 3}
    assert all(w in invented or w[0].isupper() for c in multi for w in c.split())


def test_stdlib_questions_are_offered_the_eval_tool_and_answered_in_text(corpus_draws: list) -> None:
    qa = [c for c in corpus_draws if c.kind == "qa"]
    weather_only = [c for c in qa if c.tools == (WEATHER_TOOL,)]
    # The eval offers exactly WEATHER_TOOL with each of its stdlib questions.
    assert len(weather_only) > 0.2 * len(qa)
    assert all(c.messages[1]["content"] and "tool_calls" not in c.messages[1] for c in qa)
    calls_weather_only = [c for c in corpus_draws if c.kind != "qa" and c.tools == (WEATHER_TOOL,)]
    assert calls_weather_only and all(m["tool_calls"][0]["function"]["name"] == "get_weather"
                                      for c in calls_weather_only for m in c.messages[1:2])  # fmt: skip
    questions = {c.messages[0]["content"] for c in qa}
    assert any(task in q for task, _ in HOWTOS for q in questions)  # "How do I reverse a list?"
    assert any(f"a {concept}" in q for concept, _ in CONCEPTS for q in questions)  # "What is a lambda?"


def test_howtos_and_concepts_hold_the_eval_out() -> None:
    held = held_out_names()
    eval_tasks = {q.lower().rstrip("?") for q in EVAL_QUESTIONS}
    for task, answer in HOWTOS:
        assert f"how do i {task}" not in eval_tasks, task
        assert not [h for h in held if re.search(rf"\b{re.escape(h)}\b", answer)], (task, answer)
    for concept, answer in CONCEPTS:
        assert concept not in held, concept
        assert not [h for h in held if re.search(rf"\b{re.escape(h)}\b", answer)], (concept, answer)


def test_select_needs_a_rule_and_chat_for_the_chat_rule(tmp_path: Path) -> None:
    for argv in (["--select", "best"], ["--select", "chat"]):
        with pytest.raises(SystemExit):
            parse_args(["--out", str(tmp_path), *argv])
    assert parse_args(["--out", str(tmp_path)]).select == "mixed"
    assert parse_args(["--out", str(tmp_path), "--chat-fraction", "0.5", "--select", "chat"]).select == "chat"


@pytest.fixture(scope="module")
def diverging_data() -> tuple:
    """Training and validation tokens cycle through 16 ids; the chat validation tokens are
    the same ids in random order. As the model grows sure of each id's successor, its loss
    on the random order rises, so the chat loss's best step is not the last."""
    cycle = np.arange(16, dtype=np.int32)
    chat_val = np.random.default_rng(0).integers(0, 16, size=4_000).astype(np.int32)
    return np.tile(cycle, 1250), np.tile(cycle, 250), chat_val


@pytest.mark.parametrize("rule", ["chat", "last"])
def test_select_keeps_the_weights_its_rule_picks(rule: str, diverging_data: tuple, tmp_path: Path) -> None:
    from demo_recipe.evaluate import evaluate
    from demo_recipe.model import build_model
    from demo_recipe.train import Trainee, TrainSettings, train_loop

    from moestream.daemon.model.demo_mtp import MTPHead

    train, val, chat_val = diverging_data
    settings = TrainSettings.tiny_preset(
        str(tmp_path), steps=8, eval_every=2, warmup_steps=2, learning_rate=3e-2, select=rule, log_every=100,
        batch_size=4, seq_len=32, eval_tokens=256,
    )  # fmt: skip
    mx.random.seed(0)  # the MTP head's initial weights: the same run under each rule
    lm, _ = build_model(TINY, seed=0)
    trainee = Trainee(lm, MTPHead(lm.args, TINY.mtp_intermediate_size))
    result = train_loop(trainee, train, val, settings, chat_val)
    curve = result.curve
    assert [v["step"] for v in curve.chat_val] == [v["step"] for v in curve.val] == [2, 4, 6, 8]
    chat_losses = [v["loss"] for v in curve.chat_val]
    assert chat_losses[-1] > min(chat_losses)  # the data makes the rules disagree
    ranked = {"chat": curve.chat_val, "mixed": curve.val}.get(rule)
    want = min(ranked, key=lambda v: v["loss"])["step"] if ranked else 8
    assert result.selection.rule == rule and result.selection.step == want
    # The trainee holds that step's weights: its chat loss now is the one recorded then.
    now = evaluate(lm, trainee.mtp, chat_val, seq_len=settings.seq_len, batch_size=settings.batch_size,
                   max_tokens=settings.eval_tokens)  # fmt: skip
    recorded = next(v["loss"] for v in curve.chat_val if v["step"] == want)
    assert now.loss == pytest.approx(recorded, abs=1e-4)
    if rule == "chat":
        assert want < 8 and result.selection.loss == pytest.approx(min(chat_losses))


def test_the_mix_keeps_every_conversation_and_the_chat_share(tmp_path: Path) -> None:
    from demo_recipe.data import reuse_tokenizer
    from demo_recipe.train import TrainSettings, _mix_chat

    tok_dir = tmp_path / "tok"
    tokenizer = reuse_tokenizer(DEMO, tok_dir)
    settings = TrainSettings.tiny_preset(str(tmp_path), chat_fraction=0.6, chat_examples=200)
    code, code_val = np.arange(1, 5001, dtype=np.int32), np.arange(1, 801, dtype=np.int32)
    train, val, chat_val, info = _mix_chat(tokenizer, tok_dir, code, code_val, settings)
    # 200 conversations are more than 0.6 of a stream with 5000 code tokens: the code is tiled.
    assert info["distinct_tokens"] > 5000 * 1.5 and info["code_train_tokens_tiled"] > 5000
    assert info["train_tokens"] >= info["distinct_tokens"]
    assert info["train_tokens"] / len(train) == pytest.approx(0.6, abs=1e-3)
    assert np.array_equal(train[: len(code)], code) and np.array_equal(train[len(code) : 2 * len(code)], code)
    assert len(chat_val) == info["val_distinct_tokens"] and info["val_tokens"] / len(val) == pytest.approx(0.6, 1e-3)
    assert info["qa"] + info["call"] + info["result"] == 200 and info["pools"]["invented_cities"] == 2000
