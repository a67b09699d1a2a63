"""The prompt cache in a real daemon, through the OpenAI gateway and the real `openai`
client: a chat's later turns report cached tokens, `status` shows the cache, and with
`prompt_cache_dir` a daemon restarted between turns still reuses the history.

The tiny qwen3_moe store has a chat template (tests/tiny_models.py), so the turns go
through /v1/chat/completions and the daemon's rendering of the template.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import openai
import pytest
from daemon_cli import ctl
from test_openai_gateway import KEY, Gateway
from tiny_models import tiny_store

from moestream.client.client import Client
from moestream.shared.runtime_dir import RuntimePaths

TURNS = ["What is the capital of France?", "And of Spain?", "Which one is larger?", "Say it again."]


@pytest.fixture(scope="module")
def store():
    with tiny_store("mspc") as path:
        yield path


def _start(store: Path, rt: Path, folder: Path) -> None:
    flags = ("--capacity", "0.25", "--runtime-dir", str(rt), "--prompt-cache-dir", str(folder))
    out = ctl("start", "--model", str(store), *flags)
    assert out.returncode == 0, out.stdout + out.stderr


def _turn(api: openai.OpenAI, model: str, messages: list[dict]) -> tuple[str, int, int]:
    r = api.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    details = r.usage.prompt_tokens_details
    assert details is not None, "usage has no prompt_tokens_details"
    return r.choices[0].message.content, r.usage.prompt_tokens, details.cached_tokens


@pytest.mark.slow  # two daemon starts and a gateway: about 20 s
def test_chat_turns_reuse_the_history_across_a_restart(store):
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mspc"))
    paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
    folder = rt / "prompt-cache"
    gateway = None
    try:
        _start(store, rt, folder)
        gateway = Gateway(rt, rt / "gateway.log", "--api-key", KEY)
        api = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        model = api.models.list().data[0].id
        messages = [{"role": "system", "content": "You answer questions."}]
        seen = []
        for question in TURNS[:3]:
            messages.append({"role": "user", "content": question})
            answer, prompt_tokens, cached = _turn(api, model, messages)
            messages.append({"role": "assistant", "content": answer})
            seen.append((prompt_tokens, cached))
        assert seen[0][1] == 0, "the first turn has nothing to reuse"
        for i in (1, 2):
            # At least the previous turn's prompt (but the token the answer may merge with).
            assert seen[i][1] >= seen[i - 1][0] - 1 and seen[i][1] < seen[i][0], seen
        with Client(paths) as c:
            pc = c.status().prompt_cache
        assert pc["entries"] >= 1 and 0 < pc["bytes"] <= pc["max_bytes"]
        assert pc["hits"] == 2 and pc["lookups"] == 3 and pc["hit_rate"] == pytest.approx(2 / 3)
        text = ctl("status", "--runtime-dir", str(rt))
        assert text.returncode == 0, text.stderr
        assert "prompts' KV caches in" in text.stdout and "hit rate 66.7%" in text.stdout, text.stdout
        # A turn's kept sequence ends with what the model sampled, which the next prompt may
        # render otherwise at its very end (the turn's end): a short tail of its own, a leaf.
        assert 1 <= pc["branches"] <= pc["entries"] and f"in {pc['branches']} branches" in text.stdout
        # The daemon stops (writing what it has not written yet) and starts again.
        stopped = ctl("stop", "--runtime-dir", str(rt))
        assert stopped.returncode == 0, stopped.stderr
        assert list(folder.glob("*.safetensors")), "no cache was written to the folder"
        _start(store, rt, folder)
        messages.append({"role": "user", "content": TURNS[3]})
        _, prompt_tokens, cached = _turn(api, model, messages)
        assert cached >= seen[2][0] - 1 and cached < prompt_tokens, (cached, prompt_tokens, seen)
        with Client(paths) as c:
            pc = c.status().prompt_cache
        assert pc["disk_loaded"] == 1 and pc["hits"] == 1 and pc["disk_skipped"] == 0
        written = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        assert 0 < pc["disk_written_today"] <= written and pc["disk_write_budget"] == 16 * 2**30
        status = json.loads(ctl("status", "--runtime-dir", str(rt), "--json").stdout)
        assert status["prompt_cache"]["disk_dir"] == str(folder)
    finally:
        if gateway is not None:
            gateway.stop()
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)


def _cached(api: openai.OpenAI, model: str, text: str, **extra) -> int:
    r = api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=1, temperature=0, **extra
    )
    return r.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("shared", [False, True])
def test_one_client_cannot_learn_anothers_prompt_from_cached_tokens(store, shared):
    """Through the keyless loopback gateway, a client that probes with a guess of another's
    prompt learns nothing from `cached_tokens` (0), unless the gateway shares it (--share-prompt-cache);
    requests that name the same user share their history."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mspc"))
    gateway = None
    try:
        out = ctl("start", "--model", str(store), "--runtime-dir", str(rt))
        assert out.returncode == 0, out.stdout + out.stderr
        gateway = Gateway(rt, rt / "gateway.log", *(["--share-prompt-cache"] if shared else []))
        api = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
        model = api.models.list().data[0].id
        secret = "The secret code is 4821. " * 6
        assert _cached(api, model, secret + "Remember it.", user="alice") == 0
        # Alice's next request reuses her own prompt.
        assert _cached(api, model, secret + "Say it.", user="alice") > 20
        guesses = [_cached(api, model, secret + "Is it?", **extra) for extra in ({"user": "mallory"}, {})]
        if shared:
            assert all(g > 20 for g in guesses), guesses
        else:
            assert guesses == [0, 0], "a probe learned another client's prompt from cached_tokens"
    finally:
        if gateway is not None:
            gateway.stop()
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
