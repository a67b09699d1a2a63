"""The daemon with real processes and sockets: concurrent clients get exactly the local
output, cancel and disconnect stop a request at once, status stays fast, a second daemon
is refused, a crashed one is recovered from, and SIGTERM shuts down cleanly.

One daemon (capacity 0.25, so slots are evicted while requests interleave) serves most
tests of this module; the lifecycle test runs its own. Runtime folders live under /tmp
with short names: ipc socket paths are limited to about 107 bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from daemon_cli import clean_env, ctl, started_daemon, wait_for
from tiny_models import local_outputs, tiny_store

from moestream.client.client import Client, ClientError, DaemonDied, DaemonNotRunning, RequestRejected, Token
from moestream.shared import protocol as proto
from moestream.shared.heat_file import usage_path
from moestream.shared.runtime_dir import InstanceLock, RuntimeDirError, RuntimePaths, lock_is_held, read_pid

PROMPTS = [
    "The farmer counted his hens",
    "def route(hidden, gate, k=2):",
    "Numbers and dates: 1, 2, 3",
    "In the morning",
]
LONG_PROMPT = "There was news of rain"
N_TOKENS = 48
LONG_TOKENS = 300
CAPACITY = "0.25"


def paths_of(rt: Path) -> RuntimePaths:
    return RuntimePaths(dir=rt, log=rt / "daemon.log")


def recent(client: Client) -> dict[str, dict]:
    return {r.id: r.to_dict() for r in client.status().requests.recent}


@pytest.fixture(scope="module")
def store():
    with tiny_store("mss") as path:
        yield path


@pytest.fixture(scope="module")
def reference(store):
    """What `generate --local` computes in-process, prompt by prompt."""
    out = local_outputs(store, {**dict.fromkeys(PROMPTS, N_TOKENS), LONG_PROMPT: LONG_TOKENS})
    # The cancel and disconnect tests need a request that would run its full length.
    assert out[LONG_PROMPT].finish_reason == "length"
    return out


@pytest.fixture(scope="module")
def daemon(store):
    with started_daemon(store, "msd", "--capacity", CAPACITY) as paths:
        yield paths


def collect(stream) -> tuple[str, list]:
    streamed = "".join(e.text for e in stream if isinstance(e, Token))
    return streamed, stream.done


def test_four_concurrent_clients_get_the_local_output(daemon, reference):
    results: dict[int, tuple] = {}
    failures: list[BaseException] = []
    barrier = threading.Barrier(4)

    def run(i: int) -> None:
        try:
            with Client(daemon, timeout=30) as c:
                barrier.wait()
                stream = c.generate(PROMPTS[i], max_tokens=N_TOKENS)
                first = None
                for event in stream:
                    if first is None:
                        first = time.monotonic()
                results[i] = (stream.done, first, time.monotonic())
        except BaseException as e:  # reported below, in the test's thread
            failures.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    for i, prompt in enumerate(PROMPTS):
        done = results[i][0]
        assert done.tokens == reference[prompt].tokens, f"client {i} differs from the local run"
        assert done.text == reference[prompt].text
        assert done.finish_reason == reference[prompt].finish_reason
    # Interleaved, not one after another: every request had its first token before any ended.
    assert max(r[1] for r in results.values()) < min(r[2] for r in results.values())
    with Client(daemon) as c:
        stats = c.stats()
    assert stats.pool.evictions > 0, "capacity 0.25 should evict while serving"


@pytest.mark.slow  # 13 s: prefetch from the tier is checked for exactness in tests/test_exactness.py too
def test_prefetch_from_the_host_tier_under_concurrent_clients_changes_no_token(store, reference):
    """A daemon with a host tier and prefetch on copies predicted experts into the next
    layer's slots while requests decode together: each client still gets exactly the
    local output."""
    from moestream.daemon.bench.soak.driver import DaemonProcess

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msp"))
    # Prefetch is a bench knob (auto in a user's daemon): set in code, as benchmarks do.
    daemon = DaemonProcess.start(
        store, rt / "rt", capacity=CAPACITY, flags={"host_cache": "64M"}, knobs={"prefetch": "on"}
    )
    try:
        with Client(daemon.paths, timeout=60) as c:
            streams = [c.generate(p, max_tokens=N_TOKENS) for p in PROMPTS]
            for s in streams:
                list(s)
            pool = c.status().pool
        for prompt, s in zip(PROMPTS, streams):
            assert s.done.tokens == reference[prompt].tokens, f"{prompt!r} differs from the local run"
        assert pool.prestaged >= pool.prestaged_used > 0
        assert sum(s.done.stats.prestaged for s in streams) > 0
    finally:
        daemon.stop(15.0)
        shutil.rmtree(rt, ignore_errors=True)


def test_a_seeded_sampled_request_is_the_same_beside_another(daemon, store):
    """Sampling draws from the request's own key: a seeded request gives the text it
    gives alone (in-process), while another sampled request is interleaved with it."""
    from moestream.daemon.model.generation import SamplingParams, encode_prompt, generate
    from moestream.daemon.model.streaming_model import load_streaming_model
    from moestream.shared.settings import Settings

    mine = dict(max_tokens=N_TOKENS, temp=0.9, top_p=0.95, seed=5)
    sm = load_streaming_model(store, Settings(capacity=0.25))
    try:
        alone = generate(sm, encode_prompt(sm, PROMPTS[0], None), SamplingParams(**mine))
    finally:
        sm.close()
    results: dict[str, object] = {}
    failures: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(name: str, prompt: str, params: dict) -> None:
        try:
            with Client(daemon, timeout=30) as c:
                barrier.wait()
                stream = c.generate(prompt, **params)
                for _ in stream:
                    pass
                results[name] = stream.done
        except BaseException as e:  # reported below, in the test's thread
            failures.append(e)

    other = dict(max_tokens=N_TOKENS, temp=1.0, seed=7)
    threads = [
        threading.Thread(target=run, args=("mine", PROMPTS[0], mine)),
        threading.Thread(target=run, args=("other", PROMPTS[1], other)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    assert results["mine"].tokens == alone.tokens, "another request changed a seeded request's draws"
    assert results["mine"].text == alone.text


def test_status_has_its_fields_while_generating(daemon, reference):
    """The status read while a request decodes lists it; its round trips are printed (how
    fast it answers is the machine's: a loaded one once took 0.3 s), not asserted."""
    with Client(daemon) as gen, Client(daemon) as c:
        stream = gen.generate(LONG_PROMPT, max_tokens=LONG_TOKENS)
        next(stream)
        latencies = []

        def timed():
            tic = time.perf_counter()
            status = c.status()
            latencies.append(time.perf_counter() - tic)
            return status

        def running():
            status = timed()
            return status if any(j.id == stream.id and j.phase == "decode" for j in status.requests.running) else None

        # A snapshot published after its first token lists it decoding (the 300 tokens
        # outlast a snapshot's 0.1 s); the last of 30 polls, on a loaded machine, did not.
        status = wait_for(running, 10, "a status that lists the request decoding")
        for _ in range(30):
            timed()
        assert status.requests.active == 1
        job = status.requests.running[0]
        assert job.id == stream.id and job.phase == "decode" and job.tokens >= 1
        # No name given: the connection, as the daemon's log names it (ZeroMQ's 5-byte id, in hex).
        assert len(job.client) == 10 and int(job.client, 16) >= 0, job
        stream.close()
    print(
        f"status round trip while generating: max {max(latencies) * 1000:.1f} ms, "
        f"median {sorted(latencies)[len(latencies) // 2] * 1000:.1f} ms"
    )

    tic = time.perf_counter()
    out = ctl("status", "--json", "--runtime-dir", str(daemon.dir))
    wall = time.perf_counter() - tic
    print(f"`moestreamctl status --json` wall time: {wall * 1000:.0f} ms")
    assert out.returncode == 0, out.stderr
    st = json.loads(out.stdout)
    assert st["running"] is True and st["state"] == "ready"
    assert st["pid"] == read_pid(daemon) and st["uptime_s"] > 0
    assert Path(st["model"]).name == "store" and st["capacity"] == 4 and st["policy"] == "lru"
    assert len(st["pool"]["layers"]) == st["moe_layers"] == 2
    for layer in st["pool"]["layers"]:
        assert set(layer) >= {"layer", "resident", "capacity", "pinned", "hit_rate"}
        assert 0 < layer["resident"] <= layer["capacity"] == 4
    assert 0.0 <= st["pool"]["hit_rate"] <= 1.0
    assert st["memory"]["rss_bytes"] > 10 * 2**20
    assert st["memory"]["mlx_active_bytes"] > 0 and st["memory"]["mlx_peak_bytes"] >= st["memory"]["mlx_active_bytes"]
    assert st["clients"]["connected"] >= 1
    assert {"active", "queued", "completed", "cancelled", "failed"} <= set(st["requests"])
    assert st["heat"]["state"] in ("running", "starting", "down") and "dropped_counts" in st["heat"]
    assert st["log"] == str(daemon.log) and Path(st["log"]).is_file()

    human = ctl("status", "--runtime-dir", str(daemon.dir))
    assert human.returncode == 0 and "ready" in human.stdout and str(daemon.log) in human.stdout
    logs = ctl("logs", "-n", "3", "--runtime-dir", str(daemon.dir))
    assert logs.returncode == 0 and f"log: {daemon.log}" in logs.stderr and len(logs.stdout.splitlines()) == 3
    stats = json.loads(ctl("stats", "--json", "--runtime-dir", str(daemon.dir)).stdout)
    assert stats["pool"]["bytes_read"] > 0 and len(stats["pool"]["layers"]) == 2
    human = ctl("stats", "--runtime-dir", str(daemon.dir)).stdout.splitlines()
    assert any(line.startswith("total: hit rate ") for line in human), human
    header = next(i for i, line in enumerate(human) if line.split()[:2] == ["layer", "resident"])
    shown = [int(line.split()[0]) for line in human[header + 1 : header + 3]]
    assert shown == [layer["layer"] for layer in stats["pool"]["layers"]], human


def test_cancel_stops_within_one_token_while_another_client_continues(daemon, reference):
    with Client(daemon) as a, Client(daemon) as b:
        other = b.generate(PROMPTS[0], max_tokens=N_TOKENS)
        stream = a.generate(LONG_PROMPT, max_tokens=LONG_TOKENS)
        for n, _ in enumerate(stream, 1):
            if n == 3:
                break
        assert stream.cancel() is True
        rest = list(stream)
        assert isinstance(rest[-1], proto.Done)
        done = stream.done
        assert done.finish_reason == "cancelled"
        assert 3 <= len(done.tokens) < LONG_TOKENS
        assert done.tokens == reference[LONG_PROMPT].tokens[: len(done.tokens)]
        _, other_done = collect(other)
        assert other_done.tokens == reference[PROMPTS[0]].tokens
        seen = recent(b)
    assert seen[stream.id]["finish_reason"] == "cancelled"
    assert seen[stream.id]["tokens_after_stop"] <= 1
    ids = list(seen)
    assert ids.index(stream.id) < ids.index(other.id), "the other request should still have been running"


def test_disconnect_stops_generation_while_another_client_continues(daemon, reference):
    with Client(daemon) as b:
        other = b.generate(PROMPTS[1], max_tokens=N_TOKENS)
        a = Client(daemon)
        stream = a.generate(LONG_PROMPT, max_tokens=LONG_TOKENS)
        next(stream)
        next(stream)
        a.close()
        entry = wait_for(lambda: recent(b).get(stream.id), 10, "the disconnected request to end")
        assert entry["finish_reason"] == "disconnected"
        assert entry["tokens"] < LONG_TOKENS
        assert entry["tokens_after_stop"] <= 1
        _, other_done = collect(other)
        assert other_done.tokens == reference[PROMPTS[1]].tokens


def test_runtime_folder_and_socket_are_private(daemon):
    assert stat.S_IMODE(os.stat(daemon.dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(daemon.pid_file).st_mode) == 0o600


def test_a_second_daemon_is_refused_and_the_first_keeps_its_socket(daemon, store):
    pid = read_pid(daemon)
    out = subprocess.run(
        [sys.executable, "-m", "moestream.daemon.main", "--model", str(store), "--runtime-dir", str(daemon.dir)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=60,
    )
    assert out.returncode == 1
    assert "already running" in out.stderr and f"pid {pid}" in out.stderr
    again = ctl("start", "--model", str(store), "--runtime-dir", str(daemon.dir))
    assert again.returncode == 1 and "already running" in again.stderr
    with Client(daemon) as c:
        assert c.ping().pid == pid
        assert c.status().state == "ready"


def test_malformed_and_oversized_messages_get_errors_and_change_nothing(daemon, reference):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.endpoint)

    def ask(*frames: bytes) -> proto.Reply:
        sock.send_multipart(list(frames))
        assert sock.poll(5000), "no reply"
        return proto.decode_reply(sock.recv())

    def pack(body) -> bytes:
        return msgpack.packb(body)

    try:
        with Client(daemon) as c:
            before = c.stats().requests
        cases = [
            ((b"\xc1garbage",), proto.BAD_MESSAGE),
            ((pack([1, 2, 3]),), proto.BAD_MESSAGE),
            ((pack({"v": 99, "type": "ping", "id": "a"}),), proto.BAD_VERSION),
            ((pack({"v": 1, "type": "launch_missiles", "id": "a"}),), proto.UNKNOWN_TYPE),
            ((pack({"v": 1, "type": "generate", "id": "a", "prompt": "x", "max_tokens": "many"}),), proto.BAD_MESSAGE),
            ((b"\x00" * (2 * proto.MAX_MESSAGE_BYTES),), proto.TOO_LARGE),
            ((pack({"v": 1, "type": "ping", "id": "a"}), b"second frame"), proto.BAD_MESSAGE),
            ((pack({"v": 1, "type": "generate", "id": "g1", "prompt_ids": [10**6]}),), proto.BAD_MESSAGE),
            # A prompt over the model's context of 512 tokens (a max_tokens past it is cut instead).
            ((pack({"v": 1, "type": "generate", "id": "g2", "prompt_ids": [5] * 600}),), proto.TOO_LONG),
        ]
        for frames, code in cases:
            reply = ask(*frames)
            assert isinstance(reply, proto.Error), (frames[0][:20], reply)
            assert reply.code == code, (frames[0][:20], reply)
        reply = ask(pack({"v": 1, "type": "cancel", "id": "c", "target": "nothing-like-it"}))
        assert isinstance(reply, proto.Cancelled) and reply.found is False

        with Client(daemon) as c:
            stats = c.stats().requests
            # Refused before the engine: no request counted, none running.
            assert stats.requests - before.requests == 2  # the two the engine refused
            assert stats.failed - before.failed == 2
            assert stats.queued == 0
            result = c.complete(PROMPTS[2], max_tokens=N_TOKENS)
        assert result.tokens == reference[PROMPTS[2]].tokens
    finally:
        sock.close(linger=0)


def test_a_duplicate_request_id_is_refused(daemon):
    with Client(daemon) as c:
        first = c.generate(LONG_PROMPT, max_tokens=LONG_TOKENS, request_id="same")
        next(first)
        with pytest.raises(RequestRejected) as info:
            list(c.generate("x", max_tokens=2, request_id="same"))
        assert info.value.code == proto.DUPLICATE_ID
        first.close()
        assert first.done.finish_reason == "cancelled"


def test_an_unreadable_expert_fails_that_request_and_the_daemon_serves_on(daemon, store, reference):
    from moestream.shared.store_format import load_manifest

    layer = load_manifest(store).layers[0]
    path = store / layer.file
    original = path.read_bytes()
    try:
        with open(path, "r+b") as f:
            f.truncate(layer.experts[4].offset)  # experts 4.. of layer 0 are gone
        with Client(daemon) as c, pytest.raises(RequestRejected) as info:
            c.complete(prompt_ids=list(range(3, 90)), max_tokens=4)
    finally:
        with open(path, "r+b") as f:  # same file, same inode: the daemon's open fd sees it
            f.write(original)
    assert info.value.code == proto.ENGINE
    assert "layer 0" in info.value.message and "expert" in info.value.message
    with Client(daemon) as c:
        assert c.status().requests.failed >= 1
        result = c.complete(PROMPTS[3], max_tokens=N_TOKENS)
    assert result.tokens == reference[PROMPTS[3]].tokens


def test_an_open_runtime_folder_or_a_long_socket_path_is_refused():
    folder = Path(tempfile.mkdtemp(dir="/tmp", prefix="msp"))
    try:
        os.chmod(folder, 0o755)
        with pytest.raises(RuntimeDirError, match="chmod 700"):
            InstanceLock.acquire(paths_of(folder))
        with pytest.raises(ClientError, match="chmod 700"):
            Client(folder)
        os.chmod(folder, 0o700)
        with pytest.raises(DaemonNotRunning):
            Client(folder)
        deep = folder / ("d" * 120)
        with pytest.raises(RuntimeDirError, match="over this system's limit"):
            paths_of(deep).endpoint
    finally:
        shutil.rmtree(folder)


def test_autostart_crash_recovery_restart_and_clean_sigterm(store, reference):
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msc"))
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt))
    paths = paths_of(rt)
    proc = None
    # Its own copy of the store: a second daemon's heat keeper would wait for the lock
    # that the module daemon's keeper holds on the store's heat file.
    store = Path(shutil.copytree(store, rt / "store"))
    try:
        # `generate` without --local starts a daemon and goes through it.
        out = ctl(
            "generate",
            PROMPTS[3],
            "--model",
            str(store),
            "--capacity",
            CAPACITY,
            "--max-tokens",
            str(N_TOKENS),
            "--json",
            env=env,
        )
        assert out.returncode == 0, out.stderr
        assert "starting one" in out.stderr
        result = json.loads(out.stdout)
        assert set(result) == {"text", "tokens", "stats"}
        assert result["tokens"] == reference[PROMPTS[3]].tokens and result["text"] == reference[PROMPTS[3]].text

        # kill -9 mid-stream: the client says the daemon died; the lock goes with the
        # process, its socket and pid file stay behind.
        crashed = read_pid(paths)
        with Client(paths, timeout=2.0) as c:
            stream = c.generate(LONG_PROMPT, max_tokens=LONG_TOKENS)
            next(stream)
            os.kill(crashed, signal.SIGKILL)
            tic = time.monotonic()
            with pytest.raises(DaemonDied):
                list(stream)
            assert time.monotonic() - tic < 6.0
        wait_for(lambda: not lock_is_held(paths), 10, "the killed daemon's lock to be released")
        assert paths.socket.exists() and paths.pid_file.exists()
        # Its heat keeper saves the counts when it sees its parent gone.
        wait_for(usage_path(store).exists, 20, "the crashed daemon's heat to be saved")

        # The next daemon, in the foreground (as a service runs it), with room to pin.
        log = rt / "foreground.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "moestream.client.cli",
                    "start",
                    "--foreground",
                    "--model",
                    str(store),
                    "--capacity",
                    "0.5",
                ],
                stdout=f,
                stderr=f,
                env=env,
            )
        wait_for(lambda: _ready(paths) or proc.poll() is not None, 60, "the new daemon")
        assert proc.poll() is None, log.read_text()
        assert read_pid(paths) == proc.pid
        assert f"a daemon (pid {crashed}) did not shut down cleanly" in log.read_text()
        with Client(paths) as c:
            st = c.status()
        assert st.autopin["pinned"] > 0 and all(layer.pinned > 0 for layer in st.pool.layers)

        # SIGTERM while a client streams: it gets its `done` with reason "shutdown".
        with Client(paths) as c:
            stream = c.generate(LONG_PROMPT, max_tokens=LONG_TOKENS)
            next(stream)
            proc.send_signal(signal.SIGTERM)
            list(stream)
            assert stream.done.finish_reason == "shutdown"
            assert len(stream.done.tokens) < LONG_TOKENS
        assert proc.wait(30) == 0
        assert not paths.pid_file.exists() and not paths.socket.exists() and not lock_is_held(paths)
        assert "stopped cleanly" in log.read_text()

        # restart keeps the model and pool settings of the running daemon.
        assert ctl("start", "--model", str(store), "--capacity", CAPACITY, "--no-mapped", env=env).returncode == 0
        first = read_pid(paths)
        with Client(paths) as c:
            before = c.status().settings
        out = ctl("restart", env=env)
        assert out.returncode == 0, out.stderr
        with Client(paths) as c:
            st = c.status()
        assert st.pid != first
        assert st.capacity == 4 and Path(st.model) == store
        # Every setting as before (the log file, left to its default before, is now named).
        assert {k: v for k, v in st.settings.items() if k != "log_file"} == {
            k: v for k, v in before.items() if k != "log_file"
        }
        assert st.settings["mapped"] is False and st.settings["log_file"] == st.log
        assert ctl("stop", env=env).returncode == 0
        assert not lock_is_held(paths)
        again = ctl("stop", env=env)
        assert again.returncode == 0 and "no moestream daemon is running" in again.stderr
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if lock_is_held(paths):
            os.kill(read_pid(paths), signal.SIGKILL)
        shutil.rmtree(rt)


def _ready(paths: RuntimePaths) -> bool:
    if not lock_is_held(paths) or not paths.socket.exists():
        return False
    try:
        with Client(paths, timeout=0.5) as c:
            return c.ping().state == "ready"
    except ClientError:
        return False


@pytest.mark.slow  # 18 s of daemon restarts; autopin from the heat is tested in tests/test_autopin.py
def test_bench_warmstart_restarts_real_daemons_and_puts_the_heat_back(store):
    """`bench warmstart` with a host tier: the pinned daemon filled its pools and its
    tier from the heat before it was ready, both daemons produced the same tokens, and
    the store's own heat file is left as it was."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msw"))
    own = Path(shutil.copytree(store, rt / "store"))
    usage_path(own).write_text('{"0": {"1": 5}}')
    try:
        # Half the experts: room to pin some beyond the top-k slots that stay unpinned.
        out = ctl(
            "bench",
            "warmstart",
            "--model",
            str(own),
            "--capacity",
            "0.5",
            "--tokens",
            "8",
            "--rounds",
            "1",
            "--host-cache",
            "64M",
            "--json",
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        r = json.loads(out.stdout)  # progress goes to stderr, so stdout is the JSON alone
        assert r["same_tokens_every_run"] and r["host_cache"] == "64M"
        progress = out.stderr.splitlines()
        for stage in (
            "heat (routes the prompt once): starting",
            "round 1/1 cold: starting a daemon (autopin 0)",
            "round 1/1 cold: ready in",
            "round 1/1 pinned: starting a daemon (autopin 0.5)",
            "round 1/1 pinned: ready in",
        ):
            assert any(stage in line for line in progress), (stage, out.stderr)
        cold, pinned = r["cold"]["autopin"], r["pinned"]["autopin"]
        assert cold["pinned"] == cold["preloaded"] == cold["tier_warmed_bytes"] == 0
        assert pinned["pinned"] > 0 and pinned["preloaded"] > 0 and pinned["tier_warmed_bytes"] > 0, r
        assert r["pinned_over_cold"] == r["pinned"]["seconds_to_tokens"] / r["cold"]["seconds_to_tokens"]
        assert usage_path(own).read_text() == '{"0": {"1": 5}}'
        bad = ctl("bench", "warmstart", "--model", str(own), "--host-cache", "lots")
        assert bad.returncode != 0 and "--host-cache" in bad.stderr
    finally:
        shutil.rmtree(rt, ignore_errors=True)


def test_heat_file_holds_exactly_the_routed_counts(store):
    """After requests through a daemon, pool_usage.json sums to what they routed."""
    from moestream.shared.heat_file import read_usage
    from moestream.shared.store_format import load_manifest

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msh"))
    own = Path(shutil.copytree(store, rt / "store"))
    # The module daemons' heat, if they wrote any: the heat file, and the pending files of
    # a keeper that waited for its lock (in the copy their owners are gone, so the new
    # keeper would add them).
    for p in own.glob(usage_path(own).name + "*"):
        p.unlink()
    try:
        out = ctl("start", "--model", str(own), "--capacity", CAPACITY, "--runtime-dir", str(rt))
        assert out.returncode == 0, out.stderr
        routed = 0
        with Client(paths_of(rt)) as c:
            for prompt in PROMPTS[:3]:  # one at a time: each request's stats are its own
                routed += c.complete(prompt, max_tokens=16).stats.routed_experts
            # Interleaved requests are attributed per request too.
            streams = [c.generate(p, max_tokens=12) for p in PROMPTS]
            for s in streams:
                list(s)
            routed += sum(s.done.stats.routed_experts for s in streams)
        assert routed > 0
        stopped = ctl("stop", "--runtime-dir", str(rt))
        assert stopped.returncode == 0, stopped.stderr
        usage = read_usage(usage_path(own))
        assert usage.problem is None
        assert usage.total == routed
        layers = load_manifest(own).layers
        per_layer = [sum(usage.counts.get(layer.ordinal, {}).values()) for layer in layers]
        assert len(set(per_layer)) == 1, "every MoE layer sees the same tokens"
        # Beside it the pools' LRU stack distances, which `plan` reads, of a sample of the
        # steps (the first among them): first uses of experts the layer routed, and no
        # step counting an expert twice.
        from moestream.daemon.planning.plan import heat_reuse
        from moestream.shared.settings import Settings
        from moestream.shared.store_format import POOL_REUSE_NAME

        reuse = read_usage(own / POOL_REUSE_NAME, {layer.ordinal: layer.num_experts + 1 for layer in layers})
        assert reuse.problem is None
        for layer in layers:
            histogram, routed_here = reuse.counts[layer.ordinal], usage.counts[layer.ordinal]
            assert 0 < histogram[layer.num_experts] <= len(routed_here)
            assert sum(histogram.values()) <= sum(routed_here.values())
        table, source = heat_reuse(own, Settings(model=str(own)), load_manifest(own))
        assert table == reuse.counts and str(own / POOL_REUSE_NAME) in source
    finally:
        ctl("stop", "--runtime-dir", str(rt))
        shutil.rmtree(rt, ignore_errors=True)


def test_generate_knows_the_daemons_store_by_its_id_not_its_path(store):
    """The demo installed twice is one store: a daemon on one copy of it serves `generate`
    given another copy; a store with another id is refused, both stores named."""
    from moestream.shared.settings import demo_store_path
    from moestream.shared.store_format import load_manifest

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msi"))
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt))
    first = Path(shutil.copytree(demo_store_path(), rt / "a" / "store"))
    second = Path(shutil.copytree(demo_store_path(), rt / "b" / "store"))
    demo_id, other_id = load_manifest(demo_store_path()).store_id, load_manifest(store).store_id
    try:
        out = ctl("start", "--model", str(first), "--capacity", "0.25", env=env)
        assert out.returncode == 0, out.stderr
        st = json.loads(ctl("status", "--json", env=env).stdout)
        assert st["model"] == str(first) and st["store_id"] == demo_id
        assert f"(store id {demo_id})" in ctl("status", env=env).stdout

        out = ctl("generate", "def f(", "--model", str(second), "--max-tokens", "4", "--json", env=env)
        assert out.returncode == 0, out.stderr
        assert 0 < len(json.loads(out.stdout)["tokens"]) <= 4

        out = ctl("generate", "def f(", "--model", str(store), "--max-tokens", "4", env=env)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert (
            f"the daemon serves the store {first} (id {demo_id}), not {store} (id {other_id}): "
            "stop it (`moestreamctl stop`) or use --local"
        ) in out.stderr
    finally:
        ctl("stop", env=env)
        shutil.rmtree(rt)


def test_a_plain_generate_asks_the_store_the_daemon_serves(store):
    """The README's "A real model" steps: `start --model X`, then `generate` with no
    --model is served by X; the built-in demo is only the default, not a choice that
    would refuse the running daemon."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msp"))
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt))
    try:
        out = ctl("start", "--model", str(store), "--capacity", "0.5", env=env)
        assert out.returncode == 0, out.stderr
        out = ctl("generate", "hello", "--max-tokens", "3", "--json", env=env)
        assert out.returncode == 0, out.stderr
        assert 0 < len(json.loads(out.stdout)["tokens"]) <= 3
        served = json.loads(ctl("status", "--json", env=env).stdout)
        assert served["model"] == str(store) and served["requests"]["requests"] == 1
    finally:
        ctl("stop", env=env)
        shutil.rmtree(rt)


def test_restart_after_a_reinstall_moved_the_demo_and_refuses_a_gone_store_keeping_the_daemon(store):
    """The README's quick start then its test command: `pip install -e` replaces the demo
    store a running daemon was started on; `restart` starts on the demo's new copy (the
    same store id). A store that is gone otherwise is refused before anything stops."""
    from moestream.shared.settings import demo_store_path

    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msr"))
    env = clean_env(MOESTREAM_RUNTIME_DIR=str(rt))
    old_demo = Path(shutil.copytree(demo_store_path(), rt / "site" / "store"))
    other = Path(shutil.copytree(store, rt / "other" / "store"))
    try:
        assert ctl("start", "--model", str(old_demo), "--capacity", "0.5", env=env).returncode == 0
        shutil.rmtree(old_demo)
        out = ctl("restart", env=env)
        assert out.returncode == 0, out.stderr
        st = json.loads(ctl("status", "--json", env=env).stdout)
        assert st["model"] == str(demo_store_path()) and st["settings"]["capacity"] == 0.5

        assert ctl("restart", "--model", str(other), env=env).returncode == 0
        pid = json.loads(ctl("status", "--json", env=env).stdout)["pid"]
        shutil.rmtree(other)
        out = ctl("restart", env=env)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert f"the daemon's store {other} is gone" in out.stderr and "the daemon keeps running" in out.stderr
        assert json.loads(ctl("status", "--json", env=env).stdout)["pid"] == pid
    finally:
        ctl("stop", env=env)
        shutil.rmtree(rt)


def test_a_bad_store_gets_one_clean_line_naming_the_path_given(store):
    """`bench soak` works on a temporary copy of the store: a folder that is no store, a
    corrupt manifest or a config edited out of step with the layer files is reported in
    one line that names the folder given, not the copy; other commands say it as cleanly."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="msb"))
    try:
        nostore = rt / "photos"
        nostore.mkdir()
        (nostore / "cat.jpg").write_bytes(b"\xff\xd8")
        corrupt = Path(shutil.copytree(store, rt / "corrupt"))
        (corrupt / "manifest.json").write_text('{"format": "moestream-store", "vers')
        edited = Path(shutil.copytree(store, rt / "edited"))
        data = json.loads((edited / "manifest.json").read_text())
        data["config"]["num_experts"] = 8
        (edited / "manifest.json").write_text(json.dumps(data))
        layer = data["moe_layers"][0]
        expected = {
            nostore: f"Error: {nostore} is not an expert store: manifest.json is missing "
            "(make one with `moestreamctl convert`)\n",
            corrupt: f"Error: {corrupt}/manifest.json: cannot read the manifest (Unterminated string",
            edited: (
                f"Error: {edited}: layer {layer['module_path']} holds 16 experts in {layer['file']}, but the "
                "manifest's config gives num_experts = 8: the config does not match the store's layer files"
            ),
        }
        soak = ("bench", "soak", "--kills", "0", "--fuzz", "0", "--clients", "1", "--requests", "1", "--model")
        for path, message in expected.items():
            out = ctl(*soak, str(path))
            assert out.returncode == 1, out.stdout + out.stderr
            assert message in out.stderr, out.stderr
            assert "Traceback" not in out.stderr and "mssoak" not in out.stderr
        for command in (("start", "--runtime-dir", str(rt / "rt")), ("bench", "warmstart")):
            out = ctl(*command, "--model", str(corrupt))
            assert out.returncode != 0 and "Traceback" not in out.stderr
            assert f"{corrupt}/manifest.json: cannot read the manifest" in out.stderr, (command, out.stderr)
    finally:
        shutil.rmtree(rt)
