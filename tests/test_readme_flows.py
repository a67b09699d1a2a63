"""The README followed as a new user would, in a home folder of its own: the "A real model"
steps on a tiny model served by a local hub (tests/hub_server.py: no network here) under
the README's repository name, and every Python example of the APIs section run as written
against the demo model behind the gateway (only the address changed), each answering in
words, not in tool-call markup."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from daemon_cli import clean_env, ctl
from hub_server import FakeHub
from test_openai_gateway import Gateway

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(language: str, start: str, end: str) -> list[str]:
    section = README[README.index(start) : README.index(end, README.index(start))]
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


def test_the_real_model_steps_end_in_an_answer(tiny_model, tmp_path):
    """plan, pull, start, then a plain `generate` with no --model: the daemon's store answers
    (it was refused once, the built-in demo standing in for the user's choice)."""
    (block,) = _blocks("bash", "## A real model", "## Where it runs")
    lines = [line for line in block.splitlines() if line.startswith("moestreamctl ")]
    assert [shlex.split(line)[1] for line in lines] == ["plan", "pull", "start", "generate"]
    repo = shlex.split(lines[1])[2]
    home = tmp_path / "home"
    home.mkdir()
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msrm"))
    with FakeHub() as hub:
        hub.add(repo, tiny_model("qwen3_moe", shards=2))
        env = clean_env(
            HOME=str(home),
            MOESTREAM_RUNTIME_DIR=str(rt),
            HF_ENDPOINT=hub.url,
            HF_HOME=str(home / "hf"),
            XDG_DATA_HOME=str(home / "data"),
            XDG_STATE_HOME=str(home / "state"),
        )
        try:
            for line in lines:
                args = shlex.split(line)[1:]
                if args[0] == "generate":
                    args += ["--max-tokens", "4"]
                out = ctl(*args, env=env, timeout=300)
                assert out.returncode == 0, f"{line}\n{out.stderr}"
            assert out.stdout.strip(), "generate printed no text"
        finally:
            ctl("stop", env=env)
            shutil.rmtree(rt)
    assert (home / "data" / "moestream" / "stores" / repo.replace("/", "--") / "manifest.json").is_file()


@pytest.fixture(scope="module")
def gateway():
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msrg"))
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt))
    assert ctl("start", env=env).returncode == 0  # the built-in demo, as the README's examples use it
    gw = Gateway(rt, rt / "gateway.log")
    try:
        yield gw
    finally:
        gw.stop()
        ctl("stop", env=env)
        shutil.rmtree(rt)


HTTP_EXAMPLES = [
    b
    for b in _blocks("python", "**HTTP**", "## Use with")
    if "127.0.0.1:8080" in b  # the gateway's examples, not the Python client's
]


@pytest.mark.parametrize("example", HTTP_EXAMPLES, ids=lambda b: re.search(r"import (\w+)", b).group(1))
def test_every_api_example_runs_as_written_and_answers_in_words(gateway, example):
    code = example.replace("http://127.0.0.1:8080", gateway.url)
    # Anthropic's client no longer takes a temperature (its default is 1.0): greedy here,
    # as the others' examples are, so that the words checked are the same on every run.
    if "import anthropic" in code:
        assert "messages=ask)" in code
        code = code.replace("messages=ask)", 'messages=ask, extra_body={"temperature": 0})')
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() and "<tool_call>" not in out.stdout, out.stdout
