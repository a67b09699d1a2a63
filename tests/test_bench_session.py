"""`moestreamctl bench session` (issue 53): the recorded Claude Code session, how the
bench reads an Anthropic stream and sends the answer back, its report; end to end on the
tiny thinking model through real daemons and gateways."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from moestream.daemon.bench.session import (
    DEFAULT_SESSION,
    Answer,
    BenchSessionSettings,
    Step,
    Turn,
    _next_user,
    format_report,
    load_session,
    summarize,
)


def test_the_recorded_session_is_shaped_as_claude_code_sends_it():
    session = load_session(DEFAULT_SESSION)
    body = session.body
    assert body["stream"] is True and body["max_tokens"] == 32000
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 31999}
    assert isinstance(body["metadata"]["user_id"], str) and "messages" not in body
    assert all(b["type"] == "text" and b["cache_control"] == {"type": "ephemeral"} for b in body["system"])
    assert all({"name", "description", "input_schema"} <= t.keys() for t in body["tools"])
    assert session.headers["anthropic-version"] == "2023-06-01" and session.headers["x-app"] == "cli"
    assert len(session.main.steps) >= 6 and len(session.subagents) == 2
    assert all(len(s.steps) >= 3 for s in session.subagents)


def test_a_broken_session_file_is_refused_with_what_is_wrong(tmp_path):
    bad = tmp_path / "s.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load_session(bad)
    raw = json.loads(DEFAULT_SESSION.read_text())
    raw["main"]["steps"][1] = {"tool_result": 3}
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"main.steps\[1\]"):
        load_session(bad)
    with pytest.raises(ValueError, match="cannot read"):
        load_session(tmp_path / "missing.json")


def _events(*events: dict) -> list[bytes]:
    return [b"data: " + json.dumps(e).encode() for e in events]


def test_an_answer_is_read_from_its_events_and_sent_back_as_claude_code_does():
    answer = Answer()
    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    call = {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}
    use = {"input_tokens": 5, "cache_read_input_tokens": 95, "output_tokens": 7}

    def delta(index: int, **d: str) -> dict:
        return {"type": "content_block_delta", "index": index, "delta": d}

    lines = _events(
        {"type": "message_start", "message": {"id": "msg_1"}},
        {"type": "ping"},
        {"type": "content_block_start", "index": 0, "content_block": thinking},
        delta(0, type="thinking_delta", thinking="Read it."),
        delta(0, type="signature_delta", signature="c2ln"),
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_start", "index": 2, "content_block": call},
        delta(2, type="input_json_delta", partial_json='{"file_path": '),
        delta(2, type="input_json_delta", partial_json='"/a.py"}'),
        {"type": "message_delta", "delta": {"stop_reason": "tool_use"}, "usage": use},
    )
    for i, line in enumerate([b"event: message_start", b": keep-alive", *lines]):
        answer.line(line, 0.1 * i)
    assert answer.id == "msg_1" and answer.keep_alives == 1 and answer.stop_reason == "tool_use"
    assert answer.first_token_s == pytest.approx(0.5)  # the first thinking delta, not the signature
    content = answer.content()
    assert content == [
        {"type": "thinking", "thinking": "Read it.", "signature": "c2ln"},
        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/a.py"}},
    ]
    # Each call gets the recorded result; the last block carries cache_control.
    user = _next_user(answer, Step("x = 1", "Go on.", is_error=True))
    assert user == {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "toolu_1",
                "content": "x = 1",
                "is_error": True,
                "cache_control": {"type": "ephemeral"},
            }
        ],
    }
    assert _next_user(Answer(), Step("x", "Go on."))["content"] == [
        {"type": "text", "text": "Go on.", "cache_control": {"type": "ephemeral"}}
    ]
    with pytest.raises(RuntimeError, match="overloaded"):
        answer.line(b'data: {"type": "error", "error": {"type": "overloaded_error"}}', 1.0)


def _turn(branch: str, turn: int, prompt: int, cached: int, prefill: float, text: str = "a") -> Turn:
    content = [{"type": "text", "text": text}]
    return Turn(branch, turn, prompt, cached, prefill + 0.1, prefill, 4, "max_tokens", 0, content)


def test_the_report_puts_the_runs_side_by_side_and_says_which_checks_hold():
    settings = BenchSessionSettings(store=Path("/s"), turns=2, subagents=1)
    off = {
        "turns": [_turn("main", 1, 100, 0, 10.0), _turn("main", 2, 120, 0, 12.0), _turn("subagent 1", 1, 90, 0, 9.0)],
        "cut": {"cut_s": 4.0, "mid_prefill": True, "prefilled_tokens": 40, "prefill_total": 100, "counts": {}},
        "system_tokens": 80,
        "tools": 8,
        "wall_s": 40.0,
        "prompt_cache": {},
    }
    on = off | {
        "turns": [
            _turn("main", 1, 100, 0, 6.0),
            _turn("main", 2, 120, 100, 2.0, text="b"),
            _turn("subagent 1", 1, 90, 80, 1.0),
        ],
        "cut": off["cut"] | {"cut_s": 3.0},
    }
    r = summarize(settings, off, on)
    assert [(t["branch"], t["turn"]) for t in r["turns"]] == [("main", 1), ("main", 2), ("subagent 1", 1)]
    assert r["turns"][1]["reuse"] == pytest.approx(100 / 120) and r["turns"][1]["cached_tokens_off"] == 0
    # Of main turn 1's 100 prompt and 4 answer tokens, turn 2 reused 100: 4 lost.
    assert [t["lost_tokens"] for t in r["turns"]] == [None, 4, None]
    assert [t["same_answer"] for t in r["turns"]] == [True, False, True] and not r["same_answers"]
    assert r["total_prefill_off_s"] == pytest.approx(10 + 12 + 9 + 4) and r["total_prefill_on_s"] == pytest.approx(12)
    assert r["total_prefill_ratio"] == pytest.approx(12 / 35)
    assert r["prefilled_tokens_off"] == 310 and r["prefilled_tokens_on"] == 130
    # A subagent of one turn has no turn 2: nothing checked for it; the main agent's 0.83 fails.
    assert r["reuse_from_turn_2"] == {"main": [pytest.approx(100 / 120)]}
    assert r["checks"] == {"reuse_at_least_0.9_from_turn_2": {"main": False}, "total_prefill_ratio_at_most_0.2": False}
    text = format_report(r)
    assert "FAILED" in text and "cut (cache on): at 3.00 s, 40 of 100" in text


@pytest.mark.slow  # two daemons and gateways, a session of 5 requests each on the tiny thinking model: ~40 s
def test_the_bench_replays_the_session_through_real_daemons_and_gateways():
    from thinking_model import make_thinking_store

    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="mbs"))
    try:
        # Three layers: a cut lands mid-prefill with layers still to go, so the prefill is
        # suspended (with the lean model's two it often finished first).
        store = make_thinking_store(root, lean=False)
        # The recorded session with two short tools, to keep the tiny model's prompts short.
        raw = json.loads(DEFAULT_SESSION.read_text())
        tools = [t for t in raw["body"]["tools"] if t["name"] in ("Read", "Write")]
        raw["body"]["tools"] = [t | {"description": t["description"][:40]} for t in tools]
        session = root / "session.json"
        session.write_text(json.dumps(raw))
        out = subprocess.run(
            [sys.executable, "-m", "moestream.client.cli", "bench", "session", "--model", str(store)]
            + ["--session", str(session), "--turns", "2", "--subagents", "1", "--system-tokens", "900"]
            + ["--max-tokens", "6", "--context", "4096", "--json"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        shutil.rmtree(root)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["tools"] == 2 and r["system_tokens"] <= 900
    assert [(t["branch"], t["turn"]) for t in r["turns"]] == [("main", 1), ("main", 2), ("subagent 1", 1)]
    first, second, sub = r["turns"]
    assert first["cached_tokens_off"] == second["cached_tokens_off"] == sub["cached_tokens_off"] == 0
    # On: the main agent's second turn from its first turn's prompt and answer, the subagent
    # from the shared system prompt and tools.
    assert second["cached_tokens"] >= first["prompt_tokens"] and second["reuse"] >= 0.9
    assert sub["cached_tokens"] >= r["system_tokens"]
    assert r["same_answers"] and all(t["prefill_off_s"] > 0 and t["ttft_on_s"] > 0 for t in r["turns"])
    cut = r["cut"]["on"]
    assert cut["mid_prefill"] and 0 < cut["prefilled_tokens"] < cut["prefill_total"]
    assert cut["counts"]["prefills_suspended"] == 1 and cut["counts"]["prefills_resumed"] == 1
    assert r["total_prefill_on_s"] < r["total_prefill_off_s"] and "checks:" in format_report(r)
