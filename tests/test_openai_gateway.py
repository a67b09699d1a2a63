"""The OpenAI-compatible gateway (`moestreamctl serve-openai`) with real processes: a
daemon on a tiny model, the gateway as its own process on a free port, the real `openai`
package as the client, and raw HTTP (httpx, sockets) for the error cases.

Greedy output through the gateway is compared with `moestreamctl generate --json` and
with the daemon's own answer to the same prompt; chat is compared with the daemon fed
the chat template's tokens rendered here. Runtime folders live under /tmp with short
names: ipc socket paths are limited to about 107 bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import anthropic
import httpx
import ollama
import openai
import pytest
from daemon_cli import clean_env, ctl, wait_for
from tiny_models import tiny_store

from moestream.client.client import Client
from moestream.client.gateway.images import IMAGE_BODY_BYTES
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.status import Status

KEY = "sk-test-0123456789"
PROMPT = "The farmer counted his hens"
PROMPTS = ["In the morning", "def route(hidden, gate, k=2):", "Numbers and dates: 1, 2, 3"]
CHAT = [
    {"role": "system", "content": "You answer questions."},
    {"role": "user", "content": "What is the capital of France?"},
]
N = 32
LONG = 400  # never reached: the requests that ask for it are cancelled
BUSY = 120  # tokens per request when three run at once


class Gateway:
    """`moestreamctl serve-openai` as a child process on a free port."""

    def __init__(self, runtime: Path, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "moestream.client.cli",
                    "serve-openai",
                    "--port",
                    "0",
                    "--runtime-dir",
                    str(runtime),
                    *args,
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=clean_env(**(env or {})),
            )
        line = wait_for(self._address, 30, "the gateway to listen")
        self.url = line
        wait_for(lambda: self._answers(), 30, "the gateway to answer")

    def _address(self) -> str | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"the gateway exited with {self.proc.returncode}:\n{self.log.read_text()}")
        for line in self.log.read_text().splitlines():
            if "OpenAI API on " in line:
                return line.split("OpenAI API on ", 1)[1].split(" ", 1)[0].removesuffix("/v1")
        return None

    def _answers(self) -> bool:
        try:
            httpx.get(self.url + "/health", timeout=5)
        except httpx.TransportError:
            return False
        return True

    def stop(self) -> None:
        self.proc.terminate()
        try:
            # uvicorn shuts down, then re-raises the signal: death by SIGTERM is its clean exit.
            assert self.proc.wait(15) in (0, -signal.SIGTERM), self.log.read_text()
            assert "Finished server process" in self.log.read_text()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def real_clients(url: str, key: str) -> tuple[openai.OpenAI, anthropic.Anthropic, ollama.Client]:
    """The real `openai`, `anthropic` and `ollama` clients of the keyed gateway at `url`."""
    return (
        openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120),
        anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120),
        ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"}, timeout=120),
    )


@contextmanager
def served_gateway(
    store: Path, prefix: str, key: str, env: dict[str, str] | None = None
) -> Iterator[tuple[RuntimePaths, Gateway]]:
    """(daemon paths, gateway): a daemon started on `store` (with `env` added to a clean
    environment) and a gateway with the API key `key` in front of it; both stopped after."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))
    gateway = Gateway(rt, rt / "gateway.log", "--api-key", key)
    try:
        out = ctl("start", "--model", str(store), "--runtime-dir", str(rt), env=clean_env(**(env or {})))
        assert out.returncode == 0, out.stdout + out.stderr
        yield RuntimePaths(dir=rt, log=rt / "daemon.log"), gateway
    finally:
        gateway.stop()
        stopped = ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def store():
    with tiny_store("mso") as path:
        yield path


@pytest.fixture(scope="module")
def served(store):
    """(daemon paths, gateway, health answers seen while the daemon started)."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msg"))
    paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
    gateway = Gateway(rt, rt / "gateway.log", "--api-key", KEY)
    seen: list[tuple[int, dict]] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            r = httpx.get(gateway.url + "/health", timeout=5)
            seen.append((r.status_code, r.json()))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    try:
        watcher.start()
        out = ctl("start", "--model", str(store), "--capacity", "0.25", "--runtime-dir", str(rt))
        assert out.returncode == 0, out.stdout + out.stderr
        watching.set()
        watcher.join()
        yield paths, gateway, seen
    finally:
        watching.set()
        gateway.stop()
        stopped = ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
        assert stopped.returncode == 0, stopped.stderr


@pytest.fixture(scope="module")
def api(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[1].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model_name(api) -> str:
    return api.models.list().data[0].id


def generate_json(store: Path, paths: RuntimePaths, prompt: str, *args: str) -> dict:
    out = ctl(
        "generate", prompt, "--model", str(store), "--json", *args, env=clean_env(MOESTREAM_RUNTIME_DIR=str(paths.dir))
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def chat_answer(text: str, tokens: list[int], tokenizer) -> tuple[str, int]:
    """(text, tokens) of a chat's answer, from a plain request's text and tokens for its
    rendered prompt: a chat ends at the template's end of turn (`turn_end`) where the text has it."""
    from moestream.daemon.model.chat import turn_end

    marker, tokens = turn_end(tokenizer), list(tokens)
    if marker is None or marker not in text:
        return text, len(tokens)
    made = next(k for k in range(1, len(tokens) + 1) if marker in tokenizer.decode(tokens[:k]))
    return text[: text.index(marker)], made


def recent(paths: RuntimePaths) -> dict[str, dict]:
    with Client(paths) as c:
        return {r.id: r.to_dict() for r in c.status().requests.recent}


def sse_events(response: httpx.Response):
    """The JSON objects of a server-sent event stream, then the string "[DONE]"."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


# ---- without a daemon -------------------------------------------------------------------


def test_the_gateway_imports_no_mlx():
    code = (
        "import sys, moestream.client.gateway.app, moestream.client.gateway.anthropic, "
        "moestream.client.gateway.ollama, moestream.client.cli.serve_openai; "
        "print(sorted(m for m in sys.modules if m.startswith('mlx')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_listening_beyond_loopback_needs_a_key(tmp_path):
    from moestream.client.cli.serve_openai import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert (
        not is_loopback("0.0.0.0")
        and not is_loopback("::")
        and not is_loopback("192.168.1.4")
        and not is_loopback("example.org")
    )
    for host in ("0.0.0.0", "::", "my-host.example"):
        out = ctl("serve-openai", "--host", host, "--port", "0")
        assert out.returncode == 2, out.stderr
        assert "--api-key-file" in out.stderr and "loopback" in out.stderr
    empty = tmp_path / "key"
    empty.write_text("\n")
    out = ctl("serve-openai", "--api-key-file", str(empty))
    assert out.returncode == 2 and "is empty" in out.stderr
    # A FIFO would block the read for good, /dev/zero fill memory: both refused at once.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        out = ctl("serve-openai", "--api-key-file", str(path), timeout=20)
        assert out.returncode == 2 and "not a regular file" in out.stderr, out.stderr
    # A key others could guess guards nothing beyond loopback.
    short = tmp_path / "short"
    short.write_text("k\n")
    out = ctl("serve-openai", "--host", "0.0.0.0", "--port", "0", "--api-key-file", str(short))
    assert out.returncode == 2 and "at least 16 characters (this one has 1" in out.stderr, out.stderr
    home = str(tmp_path / "home")
    args = ("--openai", "--platform", "linux", "--dry-run", "--host", "0.0.0.0", "--api-key-file", str(short))
    result = ctl("service", "install", *args, env=clean_env(HOME=home))
    assert result.returncode == 2 and "at least 16 characters" in result.stderr, result.stderr


def test_a_copy_of_the_demo_store_anywhere_is_named_the_demo(tmp_path):
    """By its store id: after a reinstall the daemon may serve the demo from another path."""
    from moestream.client.gateway.app import GatewayConfig
    from moestream.client.gateway.model_info import DEMO_MODEL_ID, model_id
    from moestream.shared.settings import demo_store_path
    from moestream.shared.store_format import load_manifest

    demo = load_manifest(demo_store_path()).store_id
    assert GatewayConfig(paths=RuntimePaths(dir=tmp_path, log=tmp_path / "log")).demo_store_id == demo
    old_install = "/old/site-packages/moestream/daemon/demo/store"
    assert model_id(Status(state="ready", model=old_install, store_id=demo), demo) == DEMO_MODEL_ID
    assert model_id(Status(state="ready", model="/home/me/stores/qwen", store_id="0" * 32), demo) == "qwen"


def test_health_is_503_without_a_daemon_and_completions_say_why(tmp_path):
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msn"))
    gateway = Gateway(rt, tmp_path / "gateway.log")
    try:
        r = httpx.get(gateway.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable", "daemon": "not running"}
        r = httpx.post(gateway.url + "/v1/completions", json={"model": "x", "prompt": "hi"})
        assert r.status_code == 503
        assert (
            r.json()["error"]["code"] == "daemon_not_running" and "moestreamctl start" in r.json()["error"]["message"]
        )
    finally:
        gateway.stop()
        shutil.rmtree(rt)


def test_chat_messages_travel_in_the_generate_request():
    import msgpack

    from moestream.shared import protocol as proto

    msg = proto.Generate(
        id="a", messages=(proto.ChatMessage("system", "Be brief."), proto.ChatMessage("user", "hé")), max_tokens=3
    )
    assert proto.decode_request(proto.encode(msg)) == msg
    body = msgpack.unpackb(proto.encode(msg))
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hé"}]
    # Left out when not used, so a daemon that predates `messages` reads the request.
    assert "messages" not in msgpack.unpackb(proto.encode(proto.Generate(id="b", prompt="x")))

    def code_of(**fields) -> str:
        data = msgpack.packb({"v": proto.PROTOCOL_VERSION, "type": "generate", "id": "r", **fields})
        with pytest.raises(proto.ProtocolError) as info:
            proto.decode_request(data)
        return info.value.code

    user = {"role": "user", "content": "hi"}
    assert code_of(prompt="x", messages=[user]) == proto.BAD_MESSAGE
    assert code_of(prompt_ids=[1], messages=[user]) == proto.BAD_MESSAGE
    assert code_of(messages=[]) == proto.BAD_MESSAGE
    assert code_of(messages=[{"role": "user"}]) == proto.BAD_MESSAGE
    assert code_of(messages=[{**user, "colour": "blue"}]) == proto.BAD_MESSAGE
    assert code_of(messages=[{**user, "name": 5}]) == proto.BAD_MESSAGE
    assert code_of(messages=[{"role": "", "content": "x"}]) == proto.BAD_MESSAGE
    assert code_of(messages=[{"role": "user", "content": 5}]) == proto.BAD_MESSAGE
    assert code_of(messages=[user] * (proto.MAX_MESSAGES + 1)) == proto.BAD_MESSAGE
    assert code_of(messages=[{"role": "user", "content": "x" * (proto.MAX_PROMPT_CHARS + 1)}]) == proto.TOO_LARGE


def test_a_tokenizer_without_a_chat_template_is_refused_clearly(tmp_path):
    from mlx_lm.utils import load_tokenizer

    from moestream.daemon.model.generation import render_chat
    from moestream.shared.settings import demo_store_path

    shutil.copy(demo_store_path() / "tokenizer.json", tmp_path)
    config = json.loads((demo_store_path() / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template.*/v1/completions"):
        render_chat(tokenizer, CHAT)


# ---- through the daemon ---------------------------------------------------------------


def test_health_tells_the_truth_while_the_daemon_starts(served):
    paths, gateway, seen = served
    assert seen and seen[0] == (503, {"status": "unavailable", "daemon": "not running"})
    for status, body in seen:
        assert (status == 200) == (body.get("daemon") == "ready"), (status, body)
    r = httpx.get(gateway.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["model"] == "store"
    states = [body["daemon"] for _, body in seen]
    print(f"health answers while the daemon started: {sorted(set(states))}")


def test_models_lists_the_daemons_model(api, served):
    models = api.models.list().data
    assert [m.id for m in models] == ["store"] and models[0].owned_by == "moestream"
    assert api.models.retrieve("store").id == "store"
    # Any name is the daemon's model; the listing says its context (the model's own 512) and what it takes.
    assert api.models.retrieve("gpt-4").id == "gpt-4"
    assert models[0].context_length == 512 and models[0].capabilities == ["completion"]


def test_greedy_completions_equal_generate_json(api, served, store, model_name):
    paths = served[0]
    ref = generate_json(store, paths, PROMPT, "--max-tokens", str(N))
    out = api.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text == ref["text"]
    assert out.choices[0].finish_reason == ("length" if ref["stats"]["finish_reason"] == "length" else "stop")
    assert out.usage.completion_tokens == len(ref["tokens"])
    assert out.usage.prompt_tokens == ref["stats"]["prompt_tokens"] > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(
        api.completions.create(
            model="moestream",
            prompt=PROMPT,
            max_tokens=N,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [out.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref["tokens"])


def test_chat_goes_through_the_models_chat_template(api, served, store, model_name):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(store)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = tokenizer.encode(text, add_special_tokens=False)
    with Client(served[0]) as c:
        ref = c.complete(prompt_ids=ids, max_tokens=N)
    assert ref.stats.prompt_tokens == len(ids)
    answer, made = chat_answer(ref.text, ref.tokens, tokenizer)

    out = api.chat.completions.create(model=model_name, messages=CHAT, max_tokens=N, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == answer
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == made

    stream = api.chat.completions.create(model=model_name, messages=CHAT, max_tokens=N, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    assert all(c.id == chunks[0].id for c in chunks)


def test_sampling_parameters_seed_and_stop_reach_the_daemon(api, served, model_name):
    with Client(served[0]) as c:
        sampled = c.complete(PROMPT, max_tokens=N, temp=0.9, top_p=0.8, seed=7)
        greedy = c.complete(PROMPTS[0], max_tokens=N)
    out = api.completions.create(model=model_name, prompt=PROMPT, max_tokens=N, temperature=0.9, top_p=0.8, seed=7)
    assert out.choices[0].text == sampled.text

    # A stop string from the middle of the greedy answer: the text ends just before it.
    text = greedy.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    expected = text[: text.index(stop)]
    out = api.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=stop)
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(
        api.completions.create(
            model=model_name, prompt=PROMPTS[0], max_tokens=N, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors_and_the_gateway_serves_on(served, model_name):
    url = served[1].url
    auth = {"Authorization": f"Bearer {KEY}"}
    chat = url + "/v1/chat/completions"
    ok_body = {"model": model_name, "messages": CHAT, "max_tokens": 4, "temperature": 0}
    long_body = {**ok_body, "messages": [{"role": "user", "content": "word " * 2000}]}
    cases = [
        ("bad JSON", chat, b'{"model": "store", "messages": [', auth, 400, "invalid_json", None),
        ("not an object", chat, b"[1, 2]", auth, 400, None, None),
        ("missing messages", chat, {"model": model_name}, auth, 400, None, "messages"),
        ("empty messages", chat, {**ok_body, "messages": []}, auth, 400, None, "messages"),
        ("bad role", chat, {**ok_body, "messages": [{"content": "hi"}]}, auth, 400, None, "messages[0].role"),
        (
            "image part",
            chat,
            {**ok_body, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            auth,
            400,
            None,
            "messages[0].content[0].image_url.url",
        ),
        ("temperature", chat, {**ok_body, "temperature": 7}, auth, 400, None, "temperature"),
        ("max_tokens", chat, {**ok_body, "max_tokens": 0}, auth, 400, None, "max_tokens"),
        ("n=9", chat, {**ok_body, "n": 9}, auth, 400, None, "n"),
        ("logit_bias", chat, {**ok_body, "logit_bias": {"x": 1}}, auth, 400, None, "logit_bias"),
        ("presence_penalty", chat, {**ok_body, "presence_penalty": 3}, auth, 400, None, "presence_penalty"),
        ("top_logprobs", chat, {**ok_body, "top_logprobs": 2}, auth, 400, None, "top_logprobs"),
        # A prompt over the model's context of 512 tokens (a max_tokens past it is cut instead).
        ("over the context", chat, long_body, auth, 400, "context_length_exceeded", None),
        # Streaming waits for the daemon's first event, so its refusal keeps its status.
        (
            "over the context, streaming",
            chat,
            {**long_body, "stream": True},
            auth,
            400,
            "context_length_exceeded",
            None,
        ),
        (
            "oversized body",
            chat,
            # Past the limit of a route that takes images (client/gateway/images.py).
            {**ok_body, "messages": [{"role": "user", "content": "x" * (IMAGE_BODY_BYTES + 1)}]},
            auth,
            413,
            "request_too_large",
            None,
        ),
        ("wrong key", chat, ok_body, {"Authorization": "Bearer sk-wrong"}, 401, "invalid_api_key", None),
        ("no key", chat, ok_body, {}, 401, "invalid_api_key", None),
        (
            "prompt list",
            url + "/v1/completions",
            {"model": model_name, "prompt": ["a", "b"]},
            auth,
            400,
            None,
            "prompt",
        ),
    ]
    with httpx.Client(timeout=30) as http:
        for what, target, body, headers, status, code, param in cases:
            if isinstance(body, bytes):
                r = http.post(target, content=body, headers={**headers, "Content-Type": "application/json"})
            else:
                r = http.post(target, json=body, headers=headers)
            assert r.status_code == status, (what, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, what
            assert isinstance(error["message"], str) and error["message"], what
            assert error["type"] == "invalid_request_error", (what, error)
            if code is not None:
                assert error["code"] == code, (what, error)
            if param is not None:
                assert error["param"] == param, (what, error)
            assert KEY not in r.text and "sk-wrong" not in r.text
            # The gateway serves on after every one of them.
            assert http.get(url + "/health").status_code == 200, what
        r = http.get(url + "/v1/nothing-here", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        r = http.post(chat, json=ok_body, headers=auth)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        # Any model name is the daemon's model (coding agents ask for their own), named back.
        r = http.post(chat, json={**ok_body, "model": "gpt-4o"}, headers=auth)
        assert r.status_code == 200 and r.json()["model"] == "gpt-4o"
    assert KEY not in served[1].log.read_text()


def test_two_gateway_clients_and_generate_at_once_get_their_exact_outputs(api, served, store, model_name):
    paths = served[0]
    with Client(paths) as c:
        refs = [c.complete(p, max_tokens=BUSY) for p in PROMPTS]
    assert all(len(r.tokens) > 40 for r in refs), [len(r.tokens) for r in refs]

    def at_once() -> int:
        """The three requests started together; each answer checked; how many the
        daemon listed as running at once (status, polled while they ran)."""
        results: dict[str, object] = {}
        failures: list[BaseException] = []
        barrier = threading.Barrier(3)

        def gateway_stream() -> None:
            barrier.wait()
            chunks = api.completions.create(
                model=model_name, prompt=PROMPTS[0], max_tokens=BUSY, temperature=0, stream=True
            )
            results["stream"] = "".join(c.choices[0].text for c in chunks)

        def gateway_whole() -> None:
            barrier.wait()
            results["whole"] = (
                api.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=BUSY, temperature=0)
                .choices[0]
                .text
            )

        def cli() -> None:
            barrier.wait()
            results["cli"] = generate_json(store, paths, PROMPTS[2], "--max-tokens", str(BUSY))

        def run(f) -> None:
            try:
                f()
            except BaseException as e:  # reported in the test's thread
                failures.append(e)

        threads = [threading.Thread(target=run, args=(f,)) for f in (gateway_stream, gateway_whole, cli)]
        peak = 0
        with Client(paths) as c:
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                peak = max(peak, len(c.status().requests.running))
                time.sleep(0.01)
        assert not failures, failures
        assert results["stream"] == refs[0].text
        assert results["whole"] == refs[1].text
        assert results["cli"]["tokens"] == refs[2].tokens and results["cli"]["text"] == refs[2].text
        return peak

    # Each round's answers must be exact; that they ran at once is up to the machine's
    # scheduling (a loaded CI machine once started the CLI's process after the gateway's
    # requests had ended), so up to three rounds are run until one is seen to overlap.
    peaks = []
    while len(peaks) < 3 and max(peaks, default=0) < 2:
        peaks.append(at_once())
    print(f"requests running at once in the daemon, by round: {peaks}")
    assert max(peaks) >= 2, "the requests should have overlapped in the daemon"


def test_a_client_that_disconnects_cancels_its_request_within_a_token(served, model_name):
    paths, gateway, _ = served
    body = {"model": model_name, "prompt": PROMPTS[0], "max_tokens": LONG, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", gateway.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
        ) as r:
            assert r.status_code == 200
            events = sse_events(r)
            first = next(events)
            next(events)
            next(events)
        # Leaving the block closes the connection mid-stream.
    entry = wait_for(lambda: recent(paths).get(first["id"]), 10, "the daemon to end the streaming request")
    assert entry["finish_reason"] == "cancelled"
    assert entry["tokens_after_stop"] <= 1
    assert 3 <= entry["tokens"] < LONG

    # A non-streaming request whose client leaves while it runs.
    raw = json.dumps({**body, "stream": False}).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    try:
        sock.sendall(
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n".encode()
            + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )

        def running() -> str | None:
            with Client(paths) as c:
                ids = [r.id for r in c.status().requests.running if r.id.startswith("cmpl-") and r.tokens >= 2]
            return ids[0] if ids else None

        rid = wait_for(running, 10, "the non-streaming request to run")
    finally:
        sock.close()
    entry = wait_for(lambda: recent(paths).get(rid), 10, "the daemon to end the non-streaming request")
    assert entry["finish_reason"] == "cancelled" and entry["tokens_after_stop"] <= 1 and entry["tokens"] < LONG
    assert httpx.get(gateway.url + "/health").status_code == 200


# ---- as a service -----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_service_install_openai_writes_a_second_service_that_serves(tmp_path):
    import plistlib

    from click.testing import CliRunner
    from test_service import parse_unit

    from moestream.client.cli import main
    from moestream.shared import service_files as sf

    home = tmp_path / "home"
    key = tmp_path / "key"
    key.write_text(KEY + "\n")
    key.chmod(0o600)
    runtime = Path(tempfile.mkdtemp(dir="/tmp", prefix="mss"))
    env = {k: None for k in os.environ if k.startswith("MOESTREAM_")} | {
        "XDG_CONFIG_HOME": None,
        "HOME": str(home),
        "MOESTREAM_RUNTIME_DIR": str(runtime),
        # No systemd user instance can be reached from here, so nothing real is touched.
        "XDG_RUNTIME_DIR": str(tmp_path / "none"),
        "DBUS_SESSION_BUS_ADDRESS": f"unix:path={tmp_path}/none",
    }

    def service(*args: str):
        return CliRunner().invoke(main, ["service", *args], env=env, catch_exceptions=False)

    port = _free_port()
    python = os.path.abspath(sys.executable)
    expected = [
        python,
        "-m",
        "moestream.client.cli",
        "serve-openai",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--api-key-file",
        str(key),
    ]
    for platform in sf.PLATFORMS:
        result = service(
            "install", "--openai", "--platform", platform, "--no-load", "--port", str(port), "--api-key-file", str(key)
        )
        assert result.exit_code == 0, result.output
        path = sf.service_file_path(platform, home, sf.OPENAI)
        assert f"wrote {path}" in result.output and KEY not in path.read_text()
        if platform == "darwin":
            doc = plistlib.loads(path.read_bytes())
            assert path.name == "dev.moestream.openai.plist" and doc["Label"] == "dev.moestream.openai"
            assert doc["ProgramArguments"] == expected
            assert Path(doc["StandardErrorPath"]).name == "openai.err.log"
            assert doc["EnvironmentVariables"]["MOESTREAM_RUNTIME_DIR"] == str(runtime)
        else:
            unit, argv, environment = parse_unit(path.read_text())
            assert path.name == "moestream-openai.service"
            assert argv == expected and environment["MOESTREAM_RUNTIME_DIR"] == str(runtime)
            assert unit["Unit"]["Wants"] == unit["Unit"]["After"] == "moestream.service"
            assert unit["Install"]["WantedBy"] == "default.target" and unit["Service"]["Restart"] == "on-failure"
            verify = shutil.which("systemd-analyze")
            if verify is not None:
                done = subprocess.run([verify, "verify", str(path)], capture_output=True, text=True, timeout=30)
                assert done.returncode == 0 and "moestream-openai.service" not in done.stderr, done.stderr
            assert "service uninstall --openai" in path.read_text()
        assert not sf.service_file_path(platform, home).exists(), "the daemon's own service file is another file"

    # What the unit runs, run as the service manager would: it serves, with the key.
    proc = subprocess.Popen(
        argv,
        env=clean_env(**environment, HOME=str(home)),
        cwd="/",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def health() -> httpx.Response | None:
            try:
                return httpx.get(url + "/health")
            except httpx.TransportError:
                assert proc.poll() is None, "the gateway service exited"
                return None

        assert wait_for(health, 30, "the gateway service").status_code == 503  # no daemon in that runtime folder
        assert httpx.get(url + "/v1/models").status_code == 401
        assert (
            httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["error"]["code"]
            == "daemon_not_running"
        )
    finally:
        proc.terminate()
        proc.wait(15)
        shutil.rmtree(runtime)

    refused = [
        (["--host", "0.0.0.0"], "--api-key-file"),
        (["--model", str(tmp_path)], "the daemon's settings"),
    ]
    for args, message in refused:
        result = service("install", "--openai", "--platform", "linux", "--dry-run", *args)
        assert result.exit_code == 2 and message in result.output, result.output
    result = service("install", "--platform", "linux", "--dry-run", "--port", "9000")
    assert result.exit_code == 2 and "only with --openai" in result.output
    result = service("status", "--openai", "--platform", "linux", "--dry-run")
    assert result.exit_code == 0 and "moestream-openai.service" in result.output
    result = service("uninstall", "--openai", "--platform", "linux", "--no-unload")
    assert result.exit_code == 0 and not sf.service_file_path("linux", home, sf.OPENAI).exists()
    assert sf.service_file_path("darwin", home, sf.OPENAI).exists()


def test_a_daemon_whose_model_folder_is_gone_says_so_in_status_and_health(store):
    """The daemon serves on from the files it holds open, but `status` (text and JSON)
    and the gateway's /health say that its model folder went away, or was replaced."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msv"))
    own = Path(shutil.copytree(store, rt / "model" / "store", ignore=shutil.ignore_patterns("pool_usage.json*")))
    paths = RuntimePaths(dir=rt, log=rt / "daemon.log")
    gateway = None

    def problem() -> str | None:
        with Client(paths) as c:
            return c.status().store_problem

    try:
        out = ctl("start", "--model", str(own), "--capacity", "0.25", "--runtime-dir", str(rt))
        assert out.returncode == 0, out.stdout + out.stderr
        gateway = Gateway(rt, rt / "gateway.log")
        assert httpx.get(gateway.url + "/health").status_code == 200
        assert problem() is None

        restart = "restart the daemon with `moestreamctl restart --model STORE`"
        (own / "manifest.json").unlink()
        assert problem() == f"the model folder {own} no longer holds a store (manifest.json is gone): {restart}"
        shutil.rmtree(own)
        gone = f"the model folder {own} no longer exists: {restart}"
        out = ctl("status", "--json", "--runtime-dir", str(rt))
        st = json.loads(out.stdout)
        assert out.returncode == 0 and st["state"] == "ready" and st["store_problem"] == gone
        text = ctl("status", "--runtime-dir", str(rt))
        assert text.returncode == 0 and ": ready (pid" in text.stdout and f"\n  warning    {gone}\n" in text.stdout
        r = httpx.get(gateway.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "unavailable", "daemon": "ready", "reason": gone}
        with Client(paths) as c:
            assert c.complete(PROMPT, max_tokens=8).tokens  # what it loaded, it still serves

        shutil.copytree(store, own, ignore=shutil.ignore_patterns("pool_usage.json*"))
        assert problem() == (
            f"the store in the model folder {own} was replaced or its manifest changed since the daemon loaded it: "
            "restart the daemon (`moestreamctl restart`) to serve what is there now"
        )
    finally:
        if gateway is not None:
            gateway.stop()
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt)
