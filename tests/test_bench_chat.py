"""`moestreamctl bench chat` end to end: real daemons with the prompt cache off and on,
one conversation, JSON out."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from tiny_models import tiny_store


@pytest.mark.slow  # two daemons, one after the other: about 15 s
def test_a_conversation_with_the_prompt_cache_off_and_on():
    with tiny_store("bench-chat") as store:
        out = subprocess.run(
            [sys.executable, "-m", "moestream.client.cli", "bench", "chat", "--model", str(store)]
            + ["--turns", "3", "--history-tokens", "48", "--turn-tokens", "8", "--max-tokens", "3", "--json"],
            capture_output=True,
            text=True,
            timeout=600,
        )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert [t["prompt_tokens"] for t in turns] == [48, 48 + 3 + 8, 48 + 2 * (3 + 8)]
    assert turns[0]["cached_tokens"] == 0
    for prev, t in zip(turns, turns[1:]):
        assert 0 < t["cached_tokens"] < t["prompt_tokens"]
        if prev["same_tokens"]:  # then all of the previous prompt and its answer
            assert t["cached_tokens"] == prev["prompt_tokens"] + 3
        assert t["ttft_off_s"] > 0 and t["ttft_on_s"] > 0 and t["ttft_ratio"] is not None
        # The daemon's account of each turn's prompt comes along (its order, its bytes).
        assert t["prefill_on"]["mode"] in ("layer-major", "chunked") and "read_bytes" in t["prefill_off"]
    assert report["tokens_reused"] == sum(t["cached_tokens"] for t in turns)
    # And the warm-up: its short request, and its two-turn conversation (whose second turn hits).
    assert report["prompt_cache"]["hits"] == 2 + 1 and report["prompt_cache"]["lookups"] == 4 + 2
