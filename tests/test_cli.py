"""The command line as a new user meets it: prompts from files and standard input, the
progress of a long prompt, messages that say what is wrong, and flags that are checked
or said to be changed rather than silently dropped.

One daemon (a tiny store, its own runtime folder) serves the tests that need one.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import zmq
from click.testing import CliRunner
from daemon_cli import clean_env, ctl, started_daemon
from tiny_models import tiny_store

from moestream.client.cli import main as cli
from moestream.client.cli.daemon import _format_status
from moestream.client.cli.generate import PrefillProgress
from moestream.client.client import Accepted, Client, Progress, Token
from moestream.daemon.engine_loop import EngineLoop
from moestream.daemon.policies import POLICIES
from moestream.daemon.server import Server
from moestream.shared.runtime_dir import RuntimePaths
from moestream.shared.settings import POLICY_NAMES, Settings, SettingsError
from moestream.shared.status import RequestInfo, RequestsStatus

PROMPT = "The farmer counted his hens"
# One prefill chunk whose routed experts outnumber the half pool's slots, so that it goes
# layer by layer and reports progress after each layer; ids within the tiny vocabulary,
# none of them a special token.
LONG_IDS = [5 + (i * 7) % 90 for i in range(600)]


@pytest.fixture(scope="module")
def store():
    with tiny_store("mscli") as path:
        yield path


@pytest.fixture(scope="module")
def daemon(store):
    # Its long prompt (600 tokens) is over the tiny model's own context of 512: room for it.
    with started_daemon(store, "mscl", "--capacity", "0.5", env={"MOESTREAM_MAX_CONTEXT": "16384"}) as paths:
        yield paths


def invoke(args: list[str], *, input: str | None = None, env: dict[str, str] | None = None):
    return CliRunner().invoke(cli, args, input=input, env=env or {}, catch_exceptions=False)


def tokens_of(result) -> list[int]:
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["tokens"]


# ---- prompts from files and standard input ------------------------------------------


def test_a_prompt_from_standard_input_or_a_file_is_the_same_prompt(store, tmp_path):
    base = ["generate", "--local", "--model", str(store), "--max-tokens", "6", "--json"]
    inline = tokens_of(invoke([*base, PROMPT]))
    assert tokens_of(invoke([*base, "-"], input=PROMPT)) == inline
    (tmp_path / "prompt.txt").write_text(PROMPT)
    assert tokens_of(invoke([*base, "--prompt-file", str(tmp_path / "prompt.txt")])) == inline
    assert tokens_of(invoke([*base, "--prompt-file", "-"], input=PROMPT)) == inline

    ids = "11,12,13,14"
    by_ids = tokens_of(invoke([*base, "--prompt-ids", ids]))
    (tmp_path / "ids.txt").write_text("11 12\n13, 14\n")
    assert tokens_of(invoke([*base, "--prompt-ids", "@" + str(tmp_path / "ids.txt")])) == by_ids
    assert tokens_of(invoke([*base, "--prompt-ids", "-"], input="11,12,13,14")) == by_ids


def test_prompt_options_that_clash_or_cannot_be_read_are_refused(store, tmp_path):
    base = ["generate", "--local", "--model", str(store)]
    both = invoke([*base, "text", "--prompt-ids", "1,2"])
    assert both.exit_code == 2 and "give one prompt: PROMPT and --prompt-ids were both given" in both.output
    assert "chat" not in both.output
    none = invoke(base)
    assert none.exit_code == 2 and "give a PROMPT (`-` reads it from standard input)" in none.output
    missing = invoke([*base, "--prompt-ids", "@" + str(tmp_path / "nope.txt")])
    assert missing.exit_code == 2 and "cannot read" in missing.output and "nope.txt" in missing.output
    bad = invoke([*base, "--prompt-ids", "1,x"])
    assert bad.exit_code == 2 and "expected token ids" in bad.output


def test_a_prompt_too_long_for_the_command_line_goes_through_standard_input(daemon, store):
    """Tens of thousands of tokens fail as an argument (`Argument list too long`); on
    standard input they reach the daemon, which measures them against its context."""
    text = "word " * 40_000
    out = ctl(
        "generate", "-", "--model", str(store), "--runtime-dir", str(daemon.dir), "--max-tokens", "1", input_text=text
    )
    assert out.returncode == 1
    assert "tokens leaves no room in the daemon's context of 16384 tokens" in out.stderr


# ---- the progress of a long prompt ----------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prefill_progress_is_drawn_on_a_terminal_and_cleared_for_the_text():
    term = _Terminal()
    shown = PrefillProgress(term)
    shown.update(0, 3000)
    shown.update(2048, 3000)
    shown.clear()
    out = term.getvalue()
    assert "prefill 0/3000 tokens (0%)" in out and "prefill 2048/3000 tokens (68%)" in out
    assert out.endswith("\r\033[K")
    piped = io.StringIO()
    quiet = PrefillProgress(piped)
    quiet.update(2048, 3000)
    quiet.clear()
    assert piped.getvalue() == "" and quiet.on is False


def test_a_long_prompt_reports_its_prefill_to_the_client_and_in_status(daemon):
    seen: list[int | None] = []
    shown: set[tuple[str, str, int | None]] = set()
    stop = threading.Event()

    def watch() -> None:
        with Client(daemon) as c:
            while not stop.is_set():
                for job in c.status().requests.running:
                    if job.prompt_tokens == len(LONG_IDS):
                        seen.append(job.prefilled_tokens)
                        shown.add((job.phase, job.client, job.prefill_total))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with Client(daemon) as c:
            events = list(c.generate(prompt_ids=LONG_IDS, max_tokens=3, progress=True, client="a long prompt"))
            quiet = list(c.generate(prompt_ids=LONG_IDS[:100], max_tokens=3))
    finally:
        stop.set()
        watcher.join()
    progress = [(e.done, e.total) for e in events if isinstance(e, Progress)]
    n = len(LONG_IDS)
    with Client(daemon) as c:
        st = c.status()
    # A partial pool and a chunk it cannot hold: the prompt but its last token goes layer
    # by layer (daemon/model/prefill.py), with progress after each decoder layer in proportion,
    # then the last token through mlx-lm's generate_step, then the first token.
    assert st.pool.prefill.order.startswith("layer") and st.pool.prefill.stacked_layers > 0
    dones = [d for d, _ in progress]
    assert all(total == n for _, total in progress)
    assert dones[0] == 0 and dones[-2:] == [n - 1, n] and dones == sorted(set(dones))
    assert len(dones) > 4  # more than the chunks' own steps: one per layer
    first_token = next(i for i, e in enumerate(events) if isinstance(e, Token))
    assert isinstance(events[0], Accepted) and events[0].prompt_tokens == n
    assert all(isinstance(e, Progress) for e in events[1:first_token])
    assert not any(isinstance(e, Progress) for e in quiet)  # only a request that asks gets them
    assert 0 in seen and any(0 < d < n for d in seen if d is not None), seen
    # `status` lists it in its prefill, with the prefill's length and who sent it.
    assert ("prefill", "a long prompt", n) in shown, shown
    assert set(seen) <= set(dones) | {None}


def test_status_while_loading_and_its_request_counts_read_plainly(tmp_path):
    paths = RuntimePaths(dir=tmp_path, log=tmp_path / "daemon.log")
    settings = Settings(model="/some/store")
    log = logging.getLogger("test")
    ctx = zmq.Context()
    try:
        engine = EngineLoop(settings, ctx, "inproc://unused", log)  # not started: still loading
        st = Server(settings, paths, log, handle_signals=False).status(engine)
    finally:
        ctx.term()
    text = _format_status(st)
    assert "loading" in text and "pool       not loaded yet" in text
    assert "None" not in text and "0/0 slots" not in text

    requests = RequestsStatus(
        requests=3,
        completed=0,
        cancelled=1,
        disconnected=2,
        failed=0,
        active=0,
        running=[RequestInfo("abc", "moestreamctl generate", "prefill", 3000, 2048, 3000, 0, 8, 41.0)],
        waiting=[RequestInfo("def", "0a1b", "queued", None, None, None, 0, 8, 0.0)],
    )
    st = dataclasses.replace(st, requests=requests)
    text = _format_status(st)
    assert "3 received: 0 completed, 1 cancelled, 2 disconnected, 0 failed" in text
    assert "abc (moestreamctl generate): prefill 2048/3000 prompt tokens (68%), 41 s" in text
    assert "def (0a1b): queued, a prompt of ? tokens, 0 s" in text
    # What the loaded model takes.
    st = dataclasses.replace(st, capabilities={"chat": True, "tools": True, "thinking": False, "vision": True})
    assert "takes      text, tools; images" in _format_status(st)
    st = dataclasses.replace(st, capabilities={"chat": True, "tools": True, "thinking": False, "vision": False})
    assert "takes      text, tools; no images" in _format_status(st)


def test_status_and_stats_of_a_serving_daemon_name_every_request(daemon, store):
    with Client(daemon) as c:
        c.complete(PROMPT, max_tokens=2)
    st = ctl("status", "--runtime-dir", str(daemon.dir))
    assert st.returncode == 0, st.stderr
    assert " completed, " in st.stdout and " disconnected, " in st.stdout
    stats = ctl("stats", "--runtime-dir", str(daemon.dir))
    assert stats.returncode == 0, stats.stderr
    line = next(line for line in stats.stdout.splitlines() if line.startswith("requests:"))
    assert "{" not in line and " completed" in line and "tokens made" in line
    engine = next(line for line in stats.stdout.splitlines() if line.startswith("read engine:"))
    # Seconds as a person reads them, not 0.028954564000000002.
    assert all(len(word) <= 8 for word in re.findall(r"\d[\d.e+-]*", engine)), engine


# ---- messages that say what is wrong --------------------------------------------------


def test_a_tiny_memory_budget_is_said_in_units_that_show_it(store):
    out = invoke(["generate", "--local", "--model", str(store), "--memory-budget", "1M", "x"])
    assert out.exit_code == 1
    assert "--memory-budget 1.0 MiB is below the minimum" in out.output
    assert "0.00 GiB" not in out.output


def test_every_commands_store_option_takes_demo_for_the_built_in_model(tmp_path, monkeypatch):
    """The README's settings say `--model demo` is the built-in demo model: so it is for
    every command that takes a store (the benchmarks', heatmap's and plan's too), unless a
    folder of that name is here."""
    from moestream.client.cli.values import SettingType, StorePath
    from moestream.shared.settings import demo_store_path

    commands, todo = [], [cli]
    while todo:
        c = todo.pop()
        commands.append(c)
        todo.extend(getattr(c, "commands", {}).values())
    stores = [(c.name, p) for c in commands for p in c.params if {"--model", "--store"} & set(p.opts)]
    assert len(stores) >= 13, stores
    for name, p in stores:
        if isinstance(p.type, SettingType):  # start's, generate's: Settings.resolve reads it
            assert p.type.d.name == "model", name
            assert Settings.resolve({"model": "demo"}).model == str(demo_store_path())
        else:
            assert isinstance(p.type, StorePath), name
            assert p.type.convert("demo", p, None) == str(demo_store_path()), name
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()  # a folder of that name is the one meant
    assert StorePath().convert("demo", None, None) == "demo"
    assert invoke(["heatmap", "--model", "demo", "--out", str(tmp_path / "heat.png")]).exit_code != 0
    (tmp_path / "demo").rmdir()
    out = invoke(["heatmap", "--model", "demo", "--out", str(tmp_path / "heat.png")])
    assert out.exit_code == 0 and (tmp_path / "heat.png").stat().st_size > 0, out.output


def test_a_missing_model_is_refused_before_a_daemon_is_started(tmp_path):
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mscn"))
    try:
        out = ctl("generate", "--model", str(tmp_path / "nope"), "--runtime-dir", str(rt), "x")
    finally:
        shutil.rmtree(rt)
    assert out.returncode == 2
    assert "starting one" not in out.stderr
    assert f"expert store {tmp_path / 'nope'} does not exist" in out.stderr
    assert out.stderr.count("moestreamctl convert") == 1


def test_a_typo_in_the_config_file_is_named_and_status_and_stop_still_work(store, tmp_path):
    config = tmp_path / "moestream" / "config.toml"
    config.parent.mkdir()
    config.write_text("capacity = 0.5\nio_threds = 4\n")
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mscc"))
    env = clean_env(XDG_CONFIG_HOME=str(tmp_path))
    try:
        start = ctl("start", "--model", str(store), "--runtime-dir", str(rt), env=env)
        assert start.returncode == 2
        assert f"config file {config}, line 2: unknown setting 'io_threds' (did you mean 'io_threads'?)" in start.stderr
        status = ctl("status", "--runtime-dir", str(rt), env=env)
        assert status.returncode == 1 and "not running" in status.stdout
        assert f"warning: config file {config}, line 2: unknown setting 'io_threds'" in status.stderr
        stop = ctl("stop", "--runtime-dir", str(rt), env=env)
        assert stop.returncode == 0 and "no moestream daemon is running" in stop.stderr
    finally:
        shutil.rmtree(rt)


def test_bad_values_name_the_variable_or_the_line_they_came_from(tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("\n\nio_threads = 9999\n")
    with pytest.raises(SettingsError, match=rf"config file {config}, line 3: io_threads: must be between 1 and 256"):
        Settings.resolve({}, {}, config)
    with pytest.raises(
        SettingsError, match="environment variable MOESTREAM_MAX_BATCH: max_batch: expected a whole number"
    ):
        Settings.resolve({}, {"MOESTREAM_MAX_BATCH": "sometimes"}, tmp_path / "none.toml")
    problems: list[str] = []
    settings = Settings.resolve({"max_active": 2}, {"MOESTREAM_MAX_BATCH": "sometimes"}, config, problems=problems)
    assert settings.max_active == 2 and settings.io_threads == Settings().io_threads
    assert settings.max_batch == Settings().max_batch
    assert len(problems) == 2 and all(p.endswith("; ignored") for p in problems)


# ---- flags that are checked, or said to be changed ------------------------------------


def test_the_policy_names_checked_by_the_settings_are_the_policies():
    assert POLICY_NAMES == tuple(POLICIES)


def test_the_eviction_policy_is_a_benchmarks_choice_not_the_daemons():
    """lru is the daemon's; the others are measured by `bench policy` and `bench decode`."""
    out = CliRunner().invoke(cli, ["bench", "decode", "--policy", "bogus"])
    assert out.exit_code == 2 and "unknown eviction policy 'bogus'; valid names: lru, lfu" in out.output
    out = CliRunner().invoke(cli, ["generate", "--policy", "lfu", "x"])
    assert out.exit_code == 2 and "No such option '--policy'" in out.output


def test_pool_settings_a_running_daemon_keeps_are_said_to_be_ignored(daemon, store):
    base = ["generate", "--model", str(store), "--runtime-dir", str(daemon.dir), "--max-tokens", "1"]
    changed = ctl(*base, "--capacity", "0.25", "--io-threads", "4", "--host-cache", "1M", PROMPT)
    assert changed.returncode == 0, changed.stderr
    assert "note: --capacity, --host-cache ignored: the running daemon keeps its pool settings" in changed.stderr
    same = ctl(*base, "--capacity", "50%", PROMPT)  # the daemon's own, spelled another way
    assert same.returncode == 0 and "ignored" not in same.stderr, same.stderr


def test_a_capacity_above_the_experts_is_said_to_hold_them_all(store):
    out = CliRunner().invoke(
        cli,
        ["generate", "--local", "--model", str(store), "--capacity", "1000", "--max-tokens", "2", "--json", "x"],
        catch_exceptions=False,
    )
    assert out.exit_code == 0, out.output
    assert "note: --capacity 1000 is more than the 16 experts of a layer: the pool holds all 16 (100%)" in out.output
    assert json.loads(out.output.splitlines()[-1])["stats"]["capacity"] == 16


def test_diagnostics_without_json_print_a_summary(daemon, store):
    out = ctl(
        "generate",
        "--model",
        str(store),
        "--runtime-dir",
        str(daemon.dir),
        "--max-tokens",
        "3",
        "--diagnostics",
        PROMPT,
    )
    assert out.returncode == 0, out.stderr
    assert "diagnostics: recall top_k" in out.stderr and "ms per call:" in out.stderr
    plain = ctl("generate", "--model", str(store), "--runtime-dir", str(daemon.dir), "--max-tokens", "3", PROMPT)
    assert plain.returncode == 0 and "diagnostics" not in plain.stderr
