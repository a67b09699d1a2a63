"""Structured output and enforced tool choice through the gateway, with real parts: the
demo model in a real daemon, the gateway as its own process, and the real `openai`,
`anthropic` and `ollama` packages as clients.

The demo model has learnt neither JSON nor tool calls (tests/test_gateway_apis.py): what
it writes here is JSON of the schema, calls of offered tools with arguments of their
schemas, and no tool-call markup under tool_choice none, only because the daemon's grammar
masks every other token (daemon/model/constrain.py). Each check runs 20 seeds, sampled at
temperature 1 (8 in the default run: a constrained request decodes alone, so the seeds take
turns; `-m slow` runs the 20); the schemas are bounded (short strings, small integers) so
that every answer ends within its max_tokens.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from test_openai_gateway import real_clients, served_gateway

from moestream.client.client import Client
from moestream.shared import protocol as proto
from moestream.shared.settings import demo_store_path

KEY = "sk-structured-0123456789"
# The seeds each check samples: 8 in the default run, the 20 under `-m slow`.
SEEDS = [pytest.param(range(8), id="8-seeds"), pytest.param(range(20), id="20-seeds", marks=pytest.mark.slow)]
MAX_TOKENS = 96
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "sunny": {"type": "boolean"},
    },
    "required": ["city", "days", "sunny"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris this week? Answer in JSON."}]


def _tool(name: str, properties: dict) -> dict:
    params = {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": f"{name} of a city", "parameters": params}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string", "maxLength": 12}}),
    _tool("get_time", {"city": {"type": "string", "maxLength": 12}, "utc": {"type": "boolean"}}),
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def served():
    with served_gateway(demo_store_path(), "mss", KEY) as both:
        yield both


@pytest.fixture(scope="module")
def clients(served):
    return real_clients(served[1].url, KEY)


def _valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


def _json_answer(api: str, clients, seed: int) -> str:
    """A json_schema request's answer through `api`, sampled at temperature 1 (`seed`
    where the API takes one: the others draw from the daemon's seedless sampler)."""
    oa, an, ol = clients
    if api == "openai":
        fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
        r = oa.chat.completions.create(
            model="demo", messages=ASK, response_format=fmt, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS
        )
        assert r.choices[0].finish_reason == "stop", (seed, r.choices[0].message.content)
        return r.choices[0].message.content
    if api == "anthropic":
        m = an.messages.create(
            model="demo",
            max_tokens=MAX_TOKENS,
            messages=ASK,
            output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
            extra_body={"temperature": 1.0},
        )
        assert m.stop_reason == "end_turn"
        return m.content[0].text
    if api == "ollama":
        options = {"temperature": 1.0, "num_predict": MAX_TOKENS, "seed": seed}
        o = ol.chat(model="demo", messages=ASK, format=SCHEMA, options=options)
        assert o.done_reason == "stop"
        return o.message.content
    resp = oa.responses.create(
        model="demo",
        input=ASK[0]["content"],
        temperature=1.0,
        max_output_tokens=MAX_TOKENS,
        text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA, "strict": True}},
    )
    assert resp.status == "completed"
    return resp.output_text


@pytest.mark.parametrize("seeds", SEEDS)
def test_json_schema_answers_validate_for_every_seed(clients, seeds):
    for seed in seeds:
        _valid(_json_answer("openai", clients, seed))
    for api in ("anthropic", "ollama", "responses"):
        for seed in range(3):
            _valid(_json_answer(api, clients, seed))


@pytest.mark.slow
@pytest.mark.parametrize("api", ["anthropic", "ollama", "responses"])
def test_json_schema_answers_validate_in_20_of_20_through_every_api(clients, api):
    for seed in range(20):
        _valid(_json_answer(api, clients, seed))


def test_json_object_and_ollamas_json_give_json_objects(clients):
    oa, _, ol = clients
    r = oa.chat.completions.create(
        model="demo", messages=ASK, response_format={"type": "json_object"}, temperature=0, max_tokens=256
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut at max_tokens: still a JSON object's beginning
        assert r.choices[0].message.content.startswith("{")
    o = ol.generate(model="demo", prompt="Weather as JSON:", format="json", options={"num_predict": 256})
    assert o.response.startswith("{")


@pytest.mark.parametrize("seeds", SEEDS)
def test_tool_choice_required_calls_an_offered_tool_with_valid_arguments(clients, seeds):
    oa, an, _ = clients
    for seed in seeds:
        r = oa.chat.completions.create(
            model="demo",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            temperature=1.0,
            seed=seed,
            max_tokens=MAX_TOKENS,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice.message)
        assert choice.message.tool_calls, seed
        for call in choice.message.tool_calls:
            assert call.function.name in PARAMS
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    named = oa.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=3,
        max_tokens=MAX_TOKENS,
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_time"])
    anthropic_tools = [
        {"name": t["function"]["name"], "description": "x", "input_schema": t["function"]["parameters"]} for t in TOOLS
    ]
    m = an.messages.create(
        model="demo",
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=anthropic_tools,
        tool_choice={"type": "any"},
        extra_body={"temperature": 1.0},
    )
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and all(u.name in PARAMS for u in uses)
    for u in uses:
        jsonschema.validate(u.input, PARAMS[u.name])


@pytest.mark.parametrize("seeds", SEEDS)
def test_tool_choice_none_never_writes_tool_call_markup(clients, seeds):
    oa, _, _ = clients
    # A prompt that ends inside the markup's start: unconstrained, the demo goes on writing it.
    ask = [{"role": "user", "content": "Call get_weather for Paris. Reply with <tool_call>"}]
    for seed in seeds:
        r = oa.chat.completions.create(
            model="demo", messages=ask, tools=TOOLS, tool_choice="none", temperature=1.0, seed=seed, max_tokens=48
        )
        message = r.choices[0].message
        assert not message.tool_calls
        assert "<tool_call>" not in (message.content or ""), (seed, message.content)


def test_malformed_or_unenforceable_formats_are_400s_naming_the_problem(served, clients):
    oa = clients[0]
    with pytest.raises(openai.BadRequestError, match="needs 'json_schema.schema'"):
        oa.chat.completions.create(
            model="demo", messages=ASK, response_format={"type": "json_schema", "json_schema": {"name": "x"}}
        )
    with pytest.raises(openai.BadRequestError, match="cannot be enforced.*objekt"):
        oa.chat.completions.create(
            model="demo",
            messages=ASK,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}},
        )
    r = httpx.post(
        served[1].url + "/api/chat",
        json={"model": "demo", "messages": ASK, "format": ["json"], "stream": False},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_a_constrained_request_runs_without_speculation_and_says_so(served):
    """Speculation's drafts are verified against unmasked logits: a constrained request
    asking for it decodes without it, to the same tokens as without asking."""
    paths = served[0]
    constraint = proto.Constraint("json_schema", json.dumps(SCHEMA))
    with Client(paths, timeout=120) as c:
        runs = []
        for speculative in (None, "mtp"):
            stream = c.generate(
                messages=ASK, constraint=constraint, max_tokens=MAX_TOKENS, temp=1.0, seed=4, speculative=speculative
            )
            list(stream)
            runs.append(stream.done)
    plain, spec = runs
    assert spec.tokens == plain.tokens
    assert spec.stats.constraint.speculative == "off" and spec.stats.speculative is None
    _valid(spec.text)
