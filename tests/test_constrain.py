"""Constrained decoding (daemon/model/constrain.py): grammars compiled from a request's
`constraint` or enforced `tool_choice`, and their exactness.

Constraining only masks logits, so a constrained request streamed by the daemon's own
path (`iter_generate`: prefill, pool, prompt cache) makes the tokens of stock mlx-lm's
`generate_step` run on the source folder with the same logits processor (a fresh matcher
of the same grammar) and the same sampler, on four architectures at 25% and 100% pools,
seeded sampling; and what it makes is JSON of the schema.
"""

from __future__ import annotations

import json
import math

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as stock_load
from mlx_lm.generate import generate_step
from tiny_models import make_tiny_model

from moestream.daemon.model.constrain import GrammarProcessor, grammar_for
from moestream.daemon.model.generation import (
    GenerationResult,
    SamplingParams,
    iter_generate,
    request_processors,
    request_sampler,
)
from moestream.daemon.model.streaming_model import load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared import protocol as proto
from moestream.shared.settings import Settings

ARCHS = ["qwen3_moe", "qwen3_5_moe", "mixtral", "deepseek_v3"]
# Bounded, so that every answer ends within MAX_TOKENS (an integer of one digit, a boolean).
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
CONSTRAINT = proto.Constraint("json_schema", json.dumps(SCHEMA))
MAX_TOKENS = 48
SEEDS = (0, 1, 2)


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = make_tiny_model(root / "model", request.param, quant="4bit", seed=1)
    convert_model(src, root / "store")
    model, tokenizer = stock_load(str(src))
    return root / "store", model, tokenizer


def _stock(model, tokenizer, prompt: list[int], params: SamplingParams) -> list[int]:
    """Stock `generate_step` with a fresh matcher of the same grammar (then the request's
    own processors: penalties, biases), to the end token."""
    processor = grammar_for(tokenizer, CONSTRAINT).processor()
    steps = generate_step(
        mx.array(prompt),
        model,
        max_tokens=params.max_tokens,
        sampler=request_sampler(params),
        logits_processors=[processor, *request_processors(params)],
    )
    out = []
    for token, _ in steps:
        if int(token) in tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return out


@pytest.mark.parametrize("share", [0.25, 1.0], ids=["25%", "100%"])
def test_a_constrained_request_makes_stock_generate_steps_tokens_with_the_same_processor(tiny, share):
    store, model, tokenizer = tiny
    from moestream.shared.store_format import load_manifest

    manifest = load_manifest(store)
    experts = manifest.layers[0].num_experts
    sm = load_streaming_model(store, Settings(capacity=max(2, math.ceil(share * experts)), direct_io=True))
    try:
        prompt = np.random.default_rng(5).integers(0, 200, size=12).tolist()
        for seed in SEEDS:
            params = SamplingParams(max_tokens=MAX_TOKENS, temp=1.0, seed=seed)
            result = GenerationResult()
            list(iter_generate(sm, prompt, params, result, grammar=grammar_for(sm.tokenizer, CONSTRAINT)))
            want = _stock(model, tokenizer, prompt, params)
            assert result.tokens == want, f"seed {seed}: tokens differ from stock's with the same processor"
            assert result.finish_reason == "stop", result.text
            jsonschema.validate(json.loads(result.text), SCHEMA)
            assert result.stats.constraint.kind == "json_schema"
            assert result.stats.constraint.tokens_checked >= len(result.tokens)
    finally:
        sm.close()


def test_a_constrained_request_with_a_model_cards_sampling_is_stocks_with_both_processors(tiny):
    """The grammar masks first, then the penalties and biases: as stock given both."""
    store, model, tokenizer = tiny
    sm = load_streaming_model(store, Settings(capacity=0.25, direct_io=True))
    try:
        prompt = np.random.default_rng(7).integers(0, 200, size=12).tolist()
        controls = proto.SamplingControls(presence_penalty=1.5, repetition_penalty=1.1, logit_bias=((5, 3.0),))
        params = SamplingParams(max_tokens=MAX_TOKENS, temp=0.7, top_p=0.8, top_k=20, seed=4, controls=controls)
        result = GenerationResult()
        list(iter_generate(sm, prompt, params, result, grammar=grammar_for(sm.tokenizer, CONSTRAINT)))
        assert result.tokens == _stock(model, tokenizer, prompt, params)
        jsonschema.validate(json.loads(result.text), SCHEMA)
    finally:
        sm.close()


def test_without_a_grammar_the_same_seed_writes_what_the_grammar_forbids(tiny):
    """The mask is what made the JSON: the same request unconstrained is not JSON."""
    store, model, tokenizer = tiny
    prompt = np.random.default_rng(5).integers(0, 200, size=12).tolist()
    params = SamplingParams(max_tokens=MAX_TOKENS, temp=1.0, seed=0)
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=24, sampler=request_sampler(params))]
    with pytest.raises(ValueError):
        json.loads(tokenizer.decode(tokens))


# ---- grammars and their errors (no model) --------------------------------------------------


@pytest.fixture(scope="module")
def demo_tokenizer():
    from mlx_lm.utils import load_tokenizer

    from moestream.shared.settings import demo_store_path

    return load_tokenizer(demo_store_path())


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def _takes(grammar, tokenizer, text: str) -> bool:
    """Whether the grammar takes all of `text` and may end there."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    m = grammar.matcher.deep_copy()
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def test_tool_choice_grammars_take_the_models_markup_of_offered_tools_only(demo_tokenizer):
    tok = demo_tokenizer
    required = grammar_for(tok, None, [WEATHER, TIME], "required")
    call = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert _takes(required, tok, call)
    assert _takes(required, tok, '\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not _takes(required, tok, call.replace("get_weather", "get_wether"))  # not offered
    assert not _takes(required, tok, call.replace('"city"', '"town"'))  # arguments off the schema
    assert not _takes(required, tok, "Sure, here it is")
    named = grammar_for(tok, None, [WEATHER, TIME], {"name": "get_weather"})
    assert _takes(named, tok, '{"city": "Oslo"}}\n</tool_call>')
    assert not _takes(named, tok, "{}}\n</tool_call>")  # city is required
    none = grammar_for(tok, None, [WEATHER], "none")
    assert _takes(none, tok, "It is sunny <tool or not, tool_call.")
    assert not _takes(none, tok, "I will call <tool_call>")
    assert grammar_for(tok, None, [WEATHER], "auto") is None
    assert grammar_for(tok, None, None, None) is None


def test_a_schema_llguidance_refuses_is_a_clear_error(demo_tokenizer):
    with pytest.raises(ValueError, match="the JSON schema cannot be enforced: .*objekt"):
        grammar_for(demo_tokenizer, proto.Constraint("json_schema", '{"type": "objekt"}'))
    with pytest.raises(ValueError, match="look-around"):
        grammar_for(demo_tokenizer, proto.Constraint("json_schema", '{"type": "string", "pattern": "(?<=a)b"}'))
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    with pytest.raises(ValueError, match="parameters cannot be enforced"):
        grammar_for(demo_tokenizer, None, [bad_tool], "required")


def test_the_processor_masks_what_the_grammar_forbids_and_follows_the_tokens_fed(demo_tokenizer):
    tok = demo_tokenizer
    g = grammar_for(tok, proto.Constraint("json_object"))
    p = GrammarProcessor(g.matcher)
    logits = mx.zeros((1, 4100))  # wider than the vocabulary: the extra ids are never allowed
    masked = p(mx.array([5, 6, 7]), logits)
    allowed = np.flatnonzero(np.isfinite(np.array(masked[0])))
    assert allowed.size > 0 and all(tok.decode([int(t)]).lstrip().startswith("{") for t in allowed)
    assert allowed.max() < 4096
    brace = int(allowed[0])
    masked = p(mx.array([5, 6, 7, brace]), logits)  # the token sampled since: consumed
    assert p.consumed == 1
    assert not np.isfinite(np.array(masked[0]))[brace] or tok.decode([brace]).strip() != "{"


def _request(**extra) -> dict:
    return {"v": 1, "type": "generate", "id": "r", "prompt": "hi", **extra}


def test_the_protocol_carries_a_constraint_and_refuses_a_malformed_one():
    import msgpack

    def decode(body):
        return proto.decode_request(msgpack.packb(body))

    msg = proto.Generate(id="r", prompt="hi", constraint=CONSTRAINT)
    assert proto.decode_request(proto.encode(msg)).constraint == CONSTRAINT
    assert decode(_request(constraint={"kind": "json_object"})).constraint == proto.Constraint("json_object")
    assert "constraint" not in msgpack.unpackb(proto.encode(proto.Generate(id="r", prompt="hi")))
    for bad, words in [
        ({"kind": "json_schema"}, "needs 'schema'"),
        ({"kind": "json_schema", "schema": "{not json"}, "not JSON"),
        ({"kind": "json_schema", "schema": "[1]"}, "must be a JSON schema"),
        ({"kind": "json_object", "schema": "{}"}, "takes no schema"),
        ({"kind": "regex"}, "kind one of"),
        ("json", "must be null or a map"),
    ]:
        with pytest.raises(proto.ProtocolError, match=words):
            decode(_request(constraint=bad))
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "tool_choice": "required"}
    body = {"v": 1, "type": "generate", "id": "r", **chat, "constraint": {"kind": "json_object"}}
    with pytest.raises(proto.ProtocolError, match="exclude each other"):
        decode(body)
