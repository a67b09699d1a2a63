"""Expert-parallel streaming (daemon/model/expert_parallel.py): two processes started by
`mlx.launch` (ring backend on loopback) decode bit for bit what one process and stock
mlx-lm decode, at 25% and at 100% of each rank's share, and each reads only its share:
with every rank running the forward, and the daemon's way (rank 0 runs it, rank 1
serves its share of each MoE layer).

Each rank gets its own copy of the store in which the other rank's experts are
overwritten with random bytes (verification off, so a stray read would go unnoticed by
the reader and change the logits instead): identical output means no rank used a byte
it does not own.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import psutil
import pytest
from arch_table import tiny_config
from daemon_cli import clean_env, ctl, wait_for
from tiny_models import make_tiny_model

from moestream.client.cli.group import launch_argv
from moestream.daemon.bench.common import parse_capacity
from moestream.daemon.bench.expert_parallel import greedy
from moestream.daemon.model.expert_parallel import CONTROL_SECONDS, NOT_HERE, ExpertShare
from moestream.daemon.model.streaming_model import load_stock_model, load_streaming_model
from moestream.daemon.store.convert import convert_model
from moestream.shared.heat_file import parse_usage, usage_name, write_usage
from moestream.shared.settings import Settings
from moestream.shared.store_format import ABSENT, POOL_USAGE_NAME, StoreError, load_manifest

RANKS = 2
CAPACITIES = ["25%", "100%"]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 9, 11, 300, 200, 100]
STEPS = 8


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("expert_parallel")
    # 32 experts, top-4: a rank's share of 16 holds 4 slots at 25%, the minimum (one
    # token may route all four of its experts to one rank).
    config = tiny_config("qwen3_moe") | {"num_experts": 32}
    src = make_tiny_model(root / "model", "qwen3_moe", quant="4bit", seed=1, config=config)
    convert_model(src, root / "store")
    return root / "store"


@pytest.fixture(scope="module")
def shards(store) -> list[Path]:
    """`convert --shard r/2` of the store's model, for each rank r."""
    paths = [store.parent / f"shard{r}" for r in range(RANKS)]
    for r, path in enumerate(paths):
        convert_model(store.parent / "model", path, shard=(r, RANKS))
    return paths


def _scrambled_copy(store: Path, dest: Path, rank: int) -> None:
    """A copy of `store` where every expert that `rank` does not own is random bytes."""
    shutil.copytree(store, dest)
    rng = np.random.default_rng(rank)
    for layer in load_manifest(store).layers:
        with open(dest / layer.file, "r+b") as f:
            for e, entry in enumerate(layer.experts):
                if e % RANKS != rank:
                    f.seek(entry.offset)
                    f.write(rng.integers(0, 256, entry.length, dtype=np.uint8).tobytes())


def _free_port() -> int:
    """A port that is free, and whose next RANKS - 1 are: the ring backend listens on one per
    rank (another job's listener on the second one would leave the group never ready).
    Taken below the kernel's ephemeral range: every outgoing connection of the other tests
    (and port-0 listeners) takes a port from that range, and on a busy machine one took a
    rank's port in the seconds before the rank bound it (mlx.launch then exits 0 with no
    rank's report)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:
        low = 49152  # macOS's (and IANA's) ephemeral range starts there
    rng = random.Random()
    while True:
        port = rng.randrange(max(1024, low - 12000), low - RANKS)
        try:
            for p in range(port, port + RANKS):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def test_share_maps_global_ids_to_its_rows():
    share = ExpertShare(None, rank=1, size=3)
    assert share.owned(8) == [1, 4, 7]
    ids = np.array([[0, 1, 4], [7, 2, 3]])
    assert share.local_ids(ids).tolist() == [[NOT_HERE, 0, 1], [2, NOT_HERE, NOT_HERE]]
    # Heat: the share's per-row counts as global ids, and a rank's file back to its rows
    # (another rank's expert, one past the layer, or an unknown layer left out, and counted).
    assert share.global_counts(np.array([5, 0, 7])).tolist() == [0, 5, 0, 0, 0, 0, 0, 7, 0]
    assert share.local_counts({0: {1: 5, 7: 7, 2: 1, 10: 3}, 9: {1: 1}}, {0: 3}) == ({0: {0: 5, 2: 7}}, 3)


def test_two_ranks_decode_what_one_process_decodes(store, tmp_path):
    for r in range(RANKS):
        _scrambled_copy(store, tmp_path / f"store{r}", r)
    out = tmp_path / "out"
    command = [
        str(Path(sys.executable).with_name("mlx.launch")),  # as MLX users launch
        "--backend",
        "ring",
        "-n",
        str(RANKS),
        "--starting-port",
        str(_free_port()),
        "--",
        sys.executable,
        "-m",
        "moestream.daemon.bench.expert_parallel",
        str(tmp_path / "store{rank}"),
        *[a for c in CAPACITIES for a in ("--capacity", c)],
        "--prompt",
        ",".join(map(str, PROMPT)),
        "--steps",
        str(STEPS),
        "--out",
        str(out),
        "--led",
        "--prefetch",
        "on",
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    # mlx.launch exits 0 when a rank fails (it only logs a warning): the reports tell.
    reports = [out / f"rank{r}.json" for r in range(RANKS)]
    assert run.returncode == 0 and all(r.is_file() for r in reports), run.stdout[-3000:] + run.stderr[-3000:]
    ranks = [json.loads(r.read_text()) for r in reports]

    stock = load_stock_model(store)
    want_tokens, want_digests, _ = greedy(stock, PROMPT, STEPS)
    del stock
    full = load_manifest(store)
    for i, capacity in enumerate(CAPACITIES):
        alone = load_streaming_model(store, Settings(capacity=parse_capacity(capacity)))
        try:
            tokens, digests, _ = greedy(alone.model, PROMPT, STEPS)
            alone_bytes = alone.pool_stats().bytes_read
        finally:
            alone.close()
        assert (tokens, digests) == (want_tokens, want_digests), f"one process at {capacity} differs from stock"
        for r, runs in enumerate(ranks):
            got = runs[i]
            assert got["size"] == RANKS and got["rank"] == r
            assert got["tokens"] == want_tokens, f"rank {r} at {capacity}: tokens differ"
            assert got["logits_sha256"] == want_digests, f"rank {r} at {capacity}: logits differ"
            assert got["experts_per_layer"] == [layer.num_experts // RANKS for layer in full.layers]
            assert got["group"]["collectives"] > 0 and got["group"]["collective_bytes"] > 0
            assert got["bytes_read"] > 0
        if capacity == "100%":
            # Each rank loaded exactly its half of every layer, the one process all of it.
            assert [runs[i]["bytes_read"] for runs in ranks] == [alone_bytes // RANKS] * RANKS
            assert all(runs[i]["hit_rate"] is None for runs in ranks)  # resident: no lookups
        else:
            assert all(0 < runs[i]["hit_rate"] < 1 for runs in ranks)
            # Each rank read ahead its own share of the next layer's predicted experts (how
            # many of them the tiny random model then routes is left to chance).
            assert all(runs[i]["prefetch"]["submitted"] > 0 for runs in ranks)

        # The daemon's way: rank 0 decodes, rank 1 follows its MoE layers.
        led = ranks[0][len(CAPACITIES) + i]
        assert led["mode"] == "leader" and led["asked_capacity"] == capacity
        assert (led["tokens"], led["logits_sha256"]) == (want_tokens, want_digests), f"led at {capacity} differs"
        assert [runs[len(CAPACITIES) + i]["exit"] for runs in ranks[1:]] == [0] * (RANKS - 1)
        share_experts = sum(layer.num_experts for layer in full.layers) // RANKS
        assert [r["experts"] for r in led["ranks"]] == [share_experts] * RANKS
        assert all(r["bytes_read"] > 0 and r["collectives"] > 0 for r in led["ranks"])
        if capacity == "100%":
            assert [r["bytes_read"] for r in led["ranks"]] == [alone_bytes // RANKS] * RANKS


@contextmanager
def _daemon_group(store: Path) -> Iterator[tuple[Path, subprocess.Popen]]:
    """The daemon of `store` at 25%, one process per rank under `mlx.launch` (ring on
    loopback), ready; its runtime folder and the launcher. Killed afterwards if still up."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mst-ep-"))
    command = [
        str(Path(sys.executable).with_name("mlx.launch")),
        *("--backend", "ring", "-n", str(RANKS), "--starting-port", str(_free_port()), "--"),
        *(sys.executable, "-m", "moestream.daemon.main", "--distributed", "ring", "--model", str(store)),
        *("--capacity", "25%", "--runtime-dir", str(rt)),
    ]
    group = subprocess.Popen(command, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:

        def ready() -> bool:
            st = ctl("status", "--runtime-dir", str(rt), "--json")
            return st.returncode == 0 and json.loads(st.stdout)["state"] == "ready"

        wait_for(ready, 180, "the expert-parallel daemon")
        yield rt, group
    finally:
        if group.poll() is None:
            group.kill()
            group.wait()
        shutil.rmtree(rt, ignore_errors=True)


def _rank_pid(rank: int, rt: Path) -> int:
    """The pid of the daemon process of `rank` in the group serving `rt`."""
    for proc in psutil.process_iter(["cmdline", "environ"]):
        cmd = proc.info["cmdline"] or []
        env = proc.info["environ"] or {}
        if "moestream.daemon.main" in cmd and str(rt) in cmd and env.get("MLX_RANK") == str(rank):
            return proc.pid
    raise AssertionError(f"no process of rank {rank}")


@pytest.mark.slow
def test_daemon_under_mlx_launch_serves_what_one_process_serves(store):
    """`mlx.launch` of the daemon with `--distributed ring`: one socket (rank 0's), clients
    unchanged, greedy tokens equal to a single process's, `status` showing each rank's
    share, pool, hit rate and bytes; `stop` ends both ranks cleanly."""
    prompt = ("generate", "the quick brown fox", "--model", str(store), "--max-tokens", "8", "--temp", "0", "--json")
    alone = ctl(*prompt, "--local")
    assert alone.returncode == 0, alone.stderr
    with _daemon_group(store) as (rt, group):
        served = ctl(*prompt, "--runtime-dir", str(rt))
        assert served.returncode == 0, served.stderr
        assert json.loads(served.stdout)["tokens"] == json.loads(alone.stdout)["tokens"]
        status = json.loads(ctl("status", "--runtime-dir", str(rt), "--json").stdout)
        ranks = status["expert_parallel"]["ranks"]
        share = sum(layer.num_experts for layer in load_manifest(store).layers) // RANKS
        assert [r["rank"] for r in ranks] == list(range(RANKS))
        assert all(r["experts"] == share and r["bytes_read"] > 0 and 0 < r["hit_rate"] < 1 for r in ranks)
        assert "rank 1:" in ctl("status", "--runtime-dir", str(rt)).stdout
        assert ctl("stop", "--runtime-dir", str(rt)).returncode == 0
        out, _ = group.communicate(timeout=60)
        assert group.returncode == 0, out[-3000:]
        assert "stopped by rank 0" in out


@pytest.mark.slow
def test_a_follower_that_dies_ends_rank_0_instead_of_blocking_it(store):
    """kill -9 of rank 1: rank 0 takes the group for broken at its next command to it
    (the status it gathers) and exits with the reason in its log, within the control
    timeout, instead of waiting for rank 1 for good."""
    with _daemon_group(store) as (rt, group):
        os.kill(_rank_pid(1, rt), signal.SIGKILL)
        group.communicate(timeout=CONTROL_SECONDS + 60)
        log = (rt / "daemon.log").read_text()
        assert "the expert-parallel group is broken" in log
        assert "pid file and socket removed" in log


def _group_pids(rt: Path) -> dict[str, list[int]]:
    """Every process of the group serving `rt`: mlx.launch, each rank's daemon and the
    heat keeper of each."""
    mine = [p for p in psutil.process_iter(["cmdline"]) if str(rt) in (p.info["cmdline"] or [])]
    launcher = [p for p in mine if any(a.endswith("mlx.launch") for a in p.info["cmdline"])]
    ranks = [p for p in mine if p not in launcher and "moestream.daemon.main" in p.info["cmdline"]]
    keepers = [c for p in ranks for c in p.children() if "moestream.daemon.heat_keeper" in c.cmdline()]
    return {"launcher": [p.pid for p in launcher], "ranks": [p.pid for p in ranks], "keepers": [p.pid for p in keepers]}


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_start_distributed_refuses_launch_options_it_cannot_use(store, tmp_path):
    """A group needs mlx.launch's options, and the backend and the command are moestream's:
    each bad start is refused with the reason before any process starts."""
    import click

    settings = Settings(distributed="ring")
    for launch, says in [
        (None, "needs --distributed-launch"),
        ("-n 2 --backend mpi", "--backend is moestream's"),
        ("-n 2 -- python", "-- is moestream's"),
        ("--hosts 'a,b", "No closing quotation"),
    ]:
        with pytest.raises(click.UsageError, match=says):
            launch_argv(settings.replace(distributed_launch=launch), ["python"])
    argv = launch_argv(settings.replace(distributed_launch="--hosts a,b -p 9000"), ["python", "-m", "x"])
    assert argv[1:] == ["--hosts", "a,b", "-p", "9000", "--backend", "ring", "--", "python", "-m", "x"]
    # Through the command: no process, no log, no group.
    rt = tmp_path / "rt"
    base = ("start", "--model", str(store), "--runtime-dir", str(rt), "--distributed", "ring")
    for extra, says in [((), "needs --distributed-launch"), (("--distributed-launch", "-n 2", "--foreground"), "drop")]:
        run = ctl(*base, *extra, timeout=60)
        assert run.returncode == 2 and says in run.stderr, (extra, run.stderr)
    service = ctl("service", "install", "--dry-run", *base[1:], "--distributed-launch", "-n 2", timeout=60)
    assert service.returncode == 2 and "not installed as a service" in service.stderr, service.stderr
    assert not (rt / "group.pid").exists() and not (rt / "daemon.log").exists()


def _start_group(store: Path, rt: Path, heat: Path) -> tuple[tuple[str, ...], dict[str, str]]:
    """`moestreamctl start --distributed ring` of `store` at 50% (8 slots of a rank's 16
    experts, of which autopin may pin 4: top-k stay free), two ranks on this machine; the
    flags for its clients, and their environment."""
    flags = ("--model", str(store), "--runtime-dir", str(rt))
    env = clean_env(MOESTREAM_HEAT_DIR=str(heat), MOESTREAM_HEAT_FLUSH_SECONDS="0.5")
    group = ("--capacity", "50%", "--distributed", "ring", "--distributed-launch", f"-n {RANKS} -p {_free_port()}")
    started = ctl("start", *flags, *group, env=env, timeout=180)
    assert started.returncode == 0, started.stderr
    assert f"log {rt / 'daemon.log'}" in started.stderr and "mlx.launch" in started.stderr
    return flags, env


def _stop_group(rt: Path) -> None:
    """`moestreamctl stop`, after which no process of the group is left."""
    pids = _group_pids(rt)
    assert [len(pids[k]) for k in ("launcher", "ranks", "keepers")] == [1, RANKS, RANKS], pids
    stopped = ctl("stop", "--runtime-dir", str(rt))
    assert stopped.returncode == 0, stopped.stderr
    assert [p for k in pids for p in pids[k] if _alive(p)] == []


def _kill_group(rt: Path) -> None:
    for pids in _group_pids(rt).values():
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(rt, ignore_errors=True)


def _rank_heat(heat: Path, layers: dict[int, int]) -> list[dict[int, dict[int, int]]]:
    """Each rank's heat file, checked to hold that rank's experts only."""
    assert not (heat / POOL_USAGE_NAME).exists()
    out = []
    for r in range(RANKS):
        counts = parse_usage((heat / usage_name(r, RANKS)).read_bytes())
        assert set(counts) == set(layers)
        assert all(e % RANKS == r and e < layers[lay] for lay, experts in counts.items() for e in experts), counts
        out.append(counts)
    return out


def _total(counts: dict[int, dict[int, int]]) -> int:
    return sum(sum(experts.values()) for experts in counts.values())


def test_start_distributed_detaches_keeps_heat_per_rank_and_stop_ends_every_rank(store, tmp_path):
    """`moestreamctl start --distributed` returns once rank 0 serves (the group runs on
    under mlx.launch, detached); each rank pins its hottest experts from its own heat file
    (status shows each rank's pins and heat); served requests add to each rank's file,
    which holds only that rank's experts; `stop` leaves no process of the group (launcher,
    ranks, heat keepers)."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mst-eph-"))
    heat = tmp_path / "heat"
    heat.mkdir()
    layers = {layer.ordinal: layer.num_experts for layer in load_manifest(store).layers}
    seeded = [{lay: {e: 100 + e for e in range(r, n, RANKS)} for lay, n in layers.items()} for r in range(RANKS)]
    for r, counts in enumerate(seeded):
        write_usage(heat / usage_name(r, RANKS), counts)
    try:
        flags, env = _start_group(store, rt, heat)
        st = json.loads(ctl("status", "--runtime-dir", str(rt), "--json").stdout)
        ranks = st["expert_parallel"]["ranks"]
        assert [r["heat_file"] for r in ranks] == [usage_name(r, RANKS) for r in range(RANKS)]
        for r, row in enumerate(ranks):
            assert row["heat_state"] == "running" and row["heat_loaded"] == _total(seeded[r]), row
            # 4 of 8 slots in each of the 2 layers (top-k stay unpinned).
            assert row["heat_pinned"] == row["pinned"] == 4 * len(layers) and row["capacity"] == 8, row
            assert row["resident"] >= row["pinned"], row
        assert "rank 1:" in (text := ctl("status", "--runtime-dir", str(rt)).stdout) and "8 pinned" in text, text
        # The two ranks share this runtime folder: each keeper has sockets of its own.
        sockets = sorted(p.name for p in rt.glob("heat*.sock"))
        assert sockets == sorted(f"{k}-rank{r}of{RANKS}.sock" for r in range(RANKS) for k in ("heat", "heat-ack"))
        served = ctl("generate", "the quick brown fox", *flags, "--max-tokens", "6", "--temp", "0", env=env)
        assert served.returncode == 0, served.stderr
        _stop_group(rt)
        assert list(rt.glob("heat*.sock")) == []
        after = _rank_heat(heat, layers)
        assert all(_total(after[r]) > _total(seeded[r]) for r in range(RANKS)), after
    finally:
        _kill_group(rt)


@pytest.mark.slow
def test_a_group_that_served_pins_each_ranks_hottest_at_its_next_start(store, tmp_path):
    """From no heat: requests served by a group leave each rank's file (its experts only),
    and the group's next start pins from them, per rank."""
    rt = Path(tempfile.mkdtemp(dir="/tmp", prefix="mst-eph-"))
    heat = tmp_path / "heat"
    layers = {layer.ordinal: layer.num_experts for layer in load_manifest(store).layers}
    try:
        flags, env = _start_group(store, rt, heat)
        for prompt in ("the quick brown fox", "a b c d e f g"):
            served = ctl("generate", prompt, *flags, "--max-tokens", "6", "--temp", "0", env=env)
            assert served.returncode == 0, served.stderr
        _stop_group(rt)
        saved = _rank_heat(heat, layers)
        assert all(_total(counts) > 0 for counts in saved)
        _start_group(store, rt, heat)
        ranks = json.loads(ctl("status", "--runtime-dir", str(rt), "--json").stdout)["expert_parallel"]["ranks"]
        for r, row in enumerate(ranks):
            assert row["heat_loaded"] == _total(saved[r]) and row["heat_pinned"] == row["pinned"] > 0, row
        _stop_group(rt)
    finally:
        _kill_group(rt)


def test_a_shard_store_holds_its_ranks_experts_and_serves_only_that_rank(store, shards):
    """`convert --shard r/N`: each layer file holds rank r's experts back to back, byte for
    byte those of the whole store, the manifest says the shard and lists the rest ABSENT;
    the shard loads as rank r of N (and reads exactly its half), and is refused alone, as
    another rank, and as stock's model."""
    full = load_manifest(store)
    for r, path in enumerate(shards):
        manifest = load_manifest(path)
        assert manifest.shard == (r, RANKS)
        for whole, layer in zip(full.layers, manifest.layers):
            data, want = (path / layer.file).read_bytes(), (store / whole.file).read_bytes()
            mine = range(r, layer.num_experts, RANKS)
            assert len(data) == len(mine) * layer.stride
            for j, e in enumerate(mine):
                assert layer.experts[e].offset == j * layer.stride and layer.experts[e].crc32 == whole.experts[e].crc32
                block = data[j * layer.stride : (j + 1) * layer.stride]
                assert block == want[e * whole.stride : (e + 1) * whole.stride]
            assert all(layer.experts[e].offset == ABSENT for e in range(layer.num_experts) if e % RANKS != r)
    settings = Settings(capacity=1.0, verify_checksums=True)
    alone = load_streaming_model(store, settings)
    whole_bytes = alone.pool_stats().bytes_read
    alone.close()
    rank1 = load_streaming_model(shards[1], settings, share=ExpertShare(None, rank=1, size=RANKS))
    try:
        assert rank1.pool_stats().bytes_read == whole_bytes // RANKS  # every owned expert, checksums verified
    finally:
        rank1.close()
    with pytest.raises(StoreError, match="shard 1/2 .* one process needs a whole store"):
        load_streaming_model(shards[1], settings)
    with pytest.raises(StoreError, match="shard 1/2 of its model, but this is rank 0 of 2"):
        load_streaming_model(shards[1], settings, share=ExpertShare(None, rank=0, size=RANKS))
    with pytest.raises(StoreError, match="one process needs a whole store"):
        load_stock_model(shards[0])


@pytest.mark.slow
def test_two_ranks_from_shard_stores_decode_what_stock_decodes(store, shards, tmp_path):
    """Each rank from its own `convert --shard` store (rank r's at shard{r}), both ways
    (every rank running the forward, and the daemon's): stock mlx-lm's tokens and logits."""
    command = [
        str(Path(sys.executable).with_name("mlx.launch")),
        *("--backend", "ring", "-n", str(RANKS), "--starting-port", str(_free_port()), "--"),
        *(sys.executable, "-m", "moestream.daemon.bench.expert_parallel", str(store.parent / "shard{rank}")),
        *("--capacity", "25%", "--prompt", ",".join(map(str, PROMPT)), "--steps", str(STEPS)),
        *("--out", str(tmp_path / "out"), "--led"),
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    want = greedy(load_stock_model(store), PROMPT, STEPS)[:2]
    rank0 = json.loads((tmp_path / "out" / "rank0.json").read_text())
    assert [(got["tokens"], got["logits_sha256"]) for got in rank0] == [want, want]
